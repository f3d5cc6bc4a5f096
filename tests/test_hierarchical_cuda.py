"""The hierarchical strategy on the CUDA kernels (NVSHMEM between domains, CUDA IPC inside) against
the reference backend's hierarchical strategy, on GPUs (skipped without them): every dispatch output
bit for bit, combine bit for bit too (the same fp32 additions in the same order), the rows that
crossed the slow tier counted, and a dispatch + combine captured in a CUDA graph and replayed."""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from conftest import BACKEND, capture_graph, env_var, fresh_cluster, gpu_backend, nvshmem_found, peer_timeout
from test_dropin import rank_fp8_scales_of_any_grouping
from test_hierarchical import CASES, _flat, _inputs
from test_reliability_cuda import (
    _check_survivor,
    _context_is_usable,
    _die,
    _survivor_outcome,
    check_flight_record,
    flight_record,
)

import epcomm
from epcomm import Buffer
from epcomm.backends.cuda.hierarchical import nvl_bytes_needed, rdma_bytes_needed
from epcomm.bench.checks import same_bits
from epcomm.utils.launch import LocalCluster, RankFailure

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(BACKEND != "nccl", reason="CUDA kernels: run with EPCOMM_TEST_BACKEND=nccl on GPUs"),
    pytest.mark.skipif(not nvshmem_found(), reason="NVSHMEM not installed (pip install nvidia-nvshmem-cu13)"),
]

NVL = 64 << 20
HIDDEN, NUM_TOPK = 256, 4


def _buffers(ranks_per_domain: int, num_tokens: int, transport: str):
    num_ranks = dist.get_world_size()
    rdma = rdma_bytes_needed(num_tokens, HIDDEN, 2, num_ranks, ranks_per_domain, NUM_TOPK, HIDDEN // 128)
    with env_var("EPCOMM_RANKS_PER_DOMAIN", ranks_per_domain), env_var("EPCOMM_HIER_TRANSPORT", transport):
        ref = Buffer(dist.group.WORLD, NVL, backend="reference", strategy="hierarchical")
        cuda = Buffer(dist.group.WORLD, NVL, rdma, backend="cuda", strategy="hierarchical")
    others = set(range(num_ranks // ranks_per_domain)) - {dist.get_rank() // ranks_per_domain}
    # "put": every other domain's mate through NVSHMEM puts (the path to other hosts); "auto": direct
    # stores to the mates NVLink maps (all of them on one host), puts to the others.
    one_host = "LOCAL_WORLD_SIZE" not in os.environ or os.environ["LOCAL_WORLD_SIZE"] == str(num_ranks)
    want = others if transport == "put" else (set() if one_host else set(cuda.normal_ops.put_domains))
    assert set(cuda.normal_ops.put_domains) == want and want <= others, cuda.normal_ops.put_domains
    return ref, cuda


def _round_trip(buf: Buffer, x, idx, w, num_experts: int, fp8: bool, col_major: bool, worst: int, bias):
    per_rank, per_domain, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    x_in = epcomm.per_token_cast_to_fp8(x) if fp8 else x
    if fp8 and col_major:
        x_in = (x_in[0], x_in[1].t().contiguous().t())
    recv_x, recv_idx, recv_w, expert_list, handle, _ = buf.dispatch(
        x_in, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_domain, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, num_worst_tokens=worst)
    cached = buf.dispatch(x_in, handle=handle)[0]
    rows = handle.num_recv_tokens
    data = recv_x[0].float() if fp8 else recv_x.float()
    y = (data * 0.75).to(torch.bfloat16)
    combined, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w, bias=bias)
    # Again, after a combine (whose rows reuse the slow tier's areas) and a cached dispatch.
    buf.dispatch(x_in, handle=handle)
    again = buf.combine(y, handle, topk_weights=recv_w, bias=bias)
    assert same_bits(combined, again[0]) and same_bits(combined_w, again[1]), "a second combine differs"
    return (recv_x, recv_idx, recv_w, expert_list, cached, combined, combined_w), rows, per_domain


def _assert_matches(want, got, per_domain, cuda: Buffer, ranks_per_domain: int, tag: str) -> None:
    """_round_trip's outputs on the CUDA backend equal the reference's bit for bit (layouts too), and
    the dispatch crossed the slow tier once per (token, other domain) it reaches."""
    for name, a, b in zip(("recv_x", "recv_topk_idx", "recv_topk_weights", "cached recv_x"),
                          want[:3] + want[4:5], got[:3] + got[4:5]):
        for pa, pb in zip(_flat(a), _flat(b)):  # num_worst_tokens padding rows included
            assert pa.stride() == pb.stride() or pa.shape[0] <= 1, f"{tag}: {name} layout differs"
            assert same_bits(pa, pb), f"{tag}: {name} differs from the reference backend"
    assert want[3] == got[3], f"{tag}: num_recv_tokens_per_expert_list differs ({want[3]} vs {got[3]})"
    assert same_bits(want[5], got[5]), f"{tag}: combine differs from the reference backend"
    assert same_bits(want[6], got[6]), f"{tag}: combined weights differ"
    own = dist.get_rank() // ranks_per_domain
    expected = sum(c for d, c in enumerate(per_domain.tolist()) if d != own) if per_domain is not None else 0
    traffic = cuda.normal_ops.traffic("dispatch")
    assert traffic["dispatch_inter_domain_rows"] == expected, (tag, traffic, expected)


def rank_cuda_vs_reference(ranks_per_domain: int, transport: str):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    num_experts = 4 * num_ranks
    ref, cuda = _buffers(ranks_per_domain, 64, transport)
    cases = [*CASES, ([48, 21], "random", True, 0, True, 6)]  # col-major scales (below)
    for i, (tokens, routing, fp8, worst, with_bias, seed) in enumerate(cases):
        col_major = i == len(cases) - 1
        num_tokens = tokens[rank % len(tokens)]
        x, idx, w = _inputs(seed, num_tokens, HIDDEN, num_experts, NUM_TOPK, routing, ranks_per_domain)
        bias = (torch.randn((num_tokens, HIDDEN), generator=torch.Generator().manual_seed(seed + rank))
                .to(torch.bfloat16).to(x.device)) if with_bias else None
        want, rows, per_domain = _round_trip(ref, x, idx, w, num_experts, fp8, col_major, worst * num_tokens, bias)
        got, _, _ = _round_trip(cuda, x, idx, w, num_experts, fp8, col_major, worst * num_tokens, bias)
        tag = f"rank {rank} {ranks_per_domain}/{num_ranks} T={num_tokens} {routing} fp8={fp8} worst={worst}"
        _assert_matches(want, got, per_domain, cuda, ranks_per_domain, tag)
    ref.destroy()
    cuda.destroy()


def rank_rounds_vs_reference(ranks_per_domain: int):
    """Calls that do not fit the buffers run in rounds, with the reference's results bit for bit:
    a rank with more tokens than a staging region holds (num_rdma_bytes sized for 16 tokens), and
    ranks receiving more rows than their receive area holds (the smallest num_nvl_bytes allowed); FP8
    and BF16, cached dispatch, combine with weights and a bias, per-tier rows summed over rounds."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    num_experts = 4 * num_ranks
    scales = HIDDEN // 128
    small_rdma = rdma_bytes_needed(16, HIDDEN, 2, num_ranks, ranks_per_domain, NUM_TOPK, scales)
    # The smallest num_nvl_bytes a Buffer accepts (its configs' hints), and the rows it holds: ranks
    # with that many tokens each receive more (top-4 of 4 experts per rank: 1.9x their tokens at 2
    # ranks, 3.3x at 8).
    small_nvl = max(Buffer.get_dispatch_config(num_ranks).get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks),
                    Buffer.get_combine_config(num_ranks).get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks))
    lo, hi = 1, small_nvl
    while lo < hi:  # the most rows nvl_bytes_needed says small_nvl holds
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if nvl_bytes_needed(mid, HIDDEN, 2, NUM_TOPK, scales) <= small_nvl else (lo, mid - 1)
    many = lo
    cases = [  # (nvl bytes, rdma bytes, tokens per rank (cycled), fp8, seed); odd seeds: column-major scales
        (NVL, small_rdma, [70, 5], False, 21),  # rank 0 (and others) overflow the staging regions
        (NVL, small_rdma, [3, 50], True, 22),
        (small_nvl, rdma_bytes_needed(many, HIDDEN, 2, num_ranks, ranks_per_domain, NUM_TOPK, scales), [many], True,
         23),  # every rank receives more rows than its receive area holds
        (small_nvl, rdma_bytes_needed(1024, HIDDEN, 2, num_ranks, ranks_per_domain, NUM_TOPK, scales),
         [many, many // 2, 0, 12], False, 24),  # both (two ranks' tokens already fill a receive area)
    ]
    for nvl, rdma, tokens, fp8, seed in cases:
        with env_var("EPCOMM_RANKS_PER_DOMAIN", ranks_per_domain):
            ref = Buffer(dist.group.WORLD, NVL, backend="reference", strategy="hierarchical")
            cuda = Buffer(dist.group.WORLD, nvl, rdma, backend="cuda", strategy="hierarchical")
        num_tokens = tokens[rank % len(tokens)]
        x, idx, w = _inputs(seed, num_tokens, HIDDEN, num_experts, NUM_TOPK, "random", ranks_per_domain)
        bias = (torch.randn((num_tokens, HIDDEN), generator=torch.Generator().manual_seed(seed + rank))
                .to(torch.bfloat16).to(x.device))
        col_major = fp8 and seed % 2 == 1
        want, rows, per_domain = _round_trip(ref, x, idx, w, num_experts, fp8, col_major, 0, bias)
        got, _, _ = _round_trip(cuda, x, idx, w, num_experts, fp8, col_major, 0, bias)
        tag = f"rank {rank} {ranks_per_domain}/{num_ranks} T={num_tokens} fp8={fp8} seed={seed}"
        # The call did not fit: its (cached) dispatches ran in rounds, each a call of its own.
        assert len(cuda.normal_ops.traffic_state.get("dispatch_rounds", ())) >= 2, f"{tag}: not run in rounds"
        _assert_matches(want, got, per_domain, cuda, ranks_per_domain, tag)
        ref.destroy()
        cuda.destroy()


@pytest.mark.parametrize("ranks, ranks_per_domain", [(2, 1), (4, 2), (8, 2)], ids=["2x1", "2x2", "4x2"])
def test_hierarchical_cuda_calls_larger_than_the_buffers_run_in_rounds(ranks, ranks_per_domain):
    _needs_gpus(ranks)
    with _fresh(ranks) as c:
        c.run(rank_rounds_vs_reference, ranks_per_domain, timeout_s=300)


def rank_graph_replay(ranks_per_domain: int, transport: str):
    """num_worst_tokens: dispatch + combine captured once, replayed with new routing and data."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    num_experts, num_tokens = 4 * num_ranks, 32
    ref, cuda = _buffers(ranks_per_domain, num_tokens, transport)
    worst = num_tokens * num_ranks
    x, idx, w = _inputs(11, num_tokens, HIDDEN, num_experts, NUM_TOPK, "random", ranks_per_domain)
    static = {"x": x.clone(), "idx": idx.clone(), "w": w.clone()}

    def step():
        per_rank, per_domain, per_expert, in_rank, _ = cuda.get_dispatch_layout(static["idx"], num_experts)
        recv_x, _, recv_w, _, handle, _ = cuda.dispatch(
            static["x"], num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_domain, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=static["idx"], topk_weights=static["w"],
            num_worst_tokens=worst)
        y = (recv_x.float() * 0.5).to(torch.bfloat16)
        return recv_x, cuda.combine(y, handle, topk_weights=recv_w)[0]

    graph, outputs = capture_graph(step)
    for seed in (12, 13, 14):
        x, idx, w = _inputs(seed, num_tokens, HIDDEN, num_experts, NUM_TOPK, "random", ranks_per_domain)
        static["x"].copy_(x)
        static["idx"].copy_(idx)
        static["w"].copy_(w)
        graph.replay()
        torch.cuda.synchronize()
        per_rank, per_domain, per_expert, in_rank, _ = ref.get_dispatch_layout(idx, num_experts)
        recv_x, _, recv_w, _, handle, _ = ref.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_domain, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        rows = handle.num_recv_tokens
        combined = ref.combine((recv_x.float() * 0.5).to(torch.bfloat16), handle, topk_weights=recv_w)[0]
        assert same_bits(outputs[0][:rows], recv_x), f"rank {rank} seed {seed}: replayed dispatch differs"
        assert same_bits(outputs[1], combined), f"rank {rank} seed {seed}: replayed combine differs"
    ref.destroy()
    cuda.destroy()


def _fresh(ranks: int) -> LocalCluster:
    """NVSHMEM is initialized once per process, with a heap fixed then: a fresh cluster per test."""
    return fresh_cluster(ranks, {"NVSHMEM_SYMMETRIC_SIZE": str(1 << 30)})


def _needs_gpus(ranks: int) -> None:
    gpu_backend(ranks)  # skips the test where the ranks cannot run


@pytest.mark.parametrize("ranks, ranks_per_domain, transport", [
    (2, 1, "auto"), (2, 1, "put"), (2, 2, "auto"), (4, 2, "auto"), (4, 2, "put"), (4, 1, "auto"), (8, 4, "auto"),
    (8, 4, "put"), (8, 2, "auto")], ids=["2x1", "2x1-put", "1x2", "2x2", "2x2-put", "4x1", "2x4", "2x4-put", "4x2"])
def test_hierarchical_cuda_matches_reference(ranks, ranks_per_domain, transport):
    _needs_gpus(ranks)
    with _fresh(ranks) as c:
        c.run(rank_cuda_vs_reference, ranks_per_domain, transport, timeout_s=400)
        c.run(rank_graph_replay, ranks_per_domain, transport, timeout_s=200)


def test_hierarchical_cuda_fp8_scales_of_any_grouping():
    _needs_gpus(2)
    with _fresh(2) as c:
        c.run(rank_fp8_scales_of_any_grouping, "cuda-hierarchical", timeout_s=300)


def rank_dead_peer(timeout_s: float, path: str, when: str, ranks_per_domain: int = 1):
    """Rank 1 is SIGKILLed before a dispatch or before a combine; rank 0's call gives up within the
    timeout and raises RuntimeError naming rank 1 (no host collective waits for the dead rank), and
    its flight record (next to ``path``) says where. ``ranks_per_domain`` 1: rank 1 is in another
    domain; 2: in rank 0's."""
    rank = dist.get_rank()
    with peer_timeout(timeout_s):
        ref, cuda = _buffers(ranks_per_domain, 32, "auto")
    ref.destroy()
    x, idx, w = _inputs(21, 32, HIDDEN, 8, NUM_TOPK, "random", ranks_per_domain)

    def dispatch():
        per_rank, per_domain, per_expert, in_rank, _ = cuda.get_dispatch_layout(idx, 8)
        return cuda.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_domain,
                             is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
                             topk_weights=w)

    recv_x, _, recv_w, _, handle, _ = dispatch()
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
        _die("SIGKILL")
    outcome = {"error": None}
    start = time.monotonic()
    try:
        with env_var("EPCOMM_FLIGHT_RECORDER_DIR", os.path.dirname(path)):
            if when == "before combine":
                cuda.combine(recv_x, handle, topk_weights=recv_w)
            dispatch()  # a combine's error surfaces at the next dispatch, which syncs
            dispatch()
    except RuntimeError as error:
        outcome["error"] = str(error)
    outcome["raised_after_s"] = time.monotonic() - start
    outcome["record"] = flight_record(outcome["error"])
    outcome["context_usable"] = _context_is_usable()
    outcome["idle_after_s"] = time.monotonic() - start
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the buffer is kept (a peer might still write): it says so
        try:
            cuda.destroy()
        except RuntimeError:
            pass
    with open(path, "w") as f:
        json.dump(outcome, f)


# Where rank 0 gives up on the dead rank 1: a dispatch in the counts exchange; a combine, with rank 1
# in another domain, waiting to send it partial sums (its mate's receive area), with rank 1 in its
# domain, waiting for its expert outputs to sum.
HIERARCHICAL_PHASES = {("before dispatch", 1): ("dispatch", "notify"), ("before dispatch", 2): ("dispatch", "notify"),
                       ("before combine", 1): ("combine", "send"), ("before combine", 2): ("combine", "reduce")}


@pytest.mark.parametrize("ranks_per_domain", [1, 2], ids=["across-domains", "inside-domain"])
@pytest.mark.parametrize("when", ["before dispatch", "before combine"])
def test_hierarchical_dead_peer_is_named_within_the_timeout(when, ranks_per_domain):
    _needs_gpus(2)
    timeout_s = 2.0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.json")
        with pytest.raises(RankFailure) as failure:
            with _fresh(2) as c:
                c.run(rank_dead_peer, timeout_s, path, when, ranks_per_domain, timeout_s=60)
        outcome = _survivor_outcome(failure.value, path)
    _check_survivor(outcome, timeout_s)
    operation, phase = HIERARCHICAL_PHASES[(when, ranks_per_domain)]
    record = check_flight_record(outcome, "hierarchical", operation, (phase,))
    # What the survivor's buffers show of the dead rank: the counts, or its entry into the call, of
    # the dispatch before it died, never of the call the survivor gave up.
    counters = record["counters"]
    seen = counters["counts_delivered_call"][1] if when == "before dispatch" else \
        counters["mate_entered_call" if ranks_per_domain == 1 else "domain_entered_call"]["1"]
    assert 0 < seen < counters["this_rank_call"], counters


def rank_mismatched_shapes(what: str, ranks_per_domain: int = 1):
    """Ranks that dispatch rows of different widths, or FP8 scales of another dtype (fp32 and int32
    words of one size): every rank raises, none hangs. A cached dispatch or a combine of different
    shapes: the next synchronizing call raises on every rank, well within the timeout (a rank that
    gave the call up and went on to its next call is named, not waited for). With two ranks a domain
    (2x2), rank 3 saw nothing wrong itself: its mate (1) and domain peer (2) gave the call up after
    rank 0's shape and tell it so (a done word, a leave flag) instead of sending nothing."""
    rank = dist.get_rank()
    timeout_s = 20
    with peer_timeout(timeout_s):
        ref, cuda = _buffers(ranks_per_domain, 32, "auto")
    ref.destroy()
    x, idx, w = _inputs(22, 16, HIDDEN * (1 + rank) if what == "hidden" else HIDDEN, 8, NUM_TOPK, "random", 1)
    x8 = epcomm.per_token_cast_to_fp8(x)
    per_rank, per_domain, per_expert, in_rank, _ = cuda.get_dispatch_layout(idx, 8)

    def dispatch(x_in):
        return cuda.dispatch(x_in, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_domain,
                             is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)

    if what in ("hidden", "scale dtype"):
        with pytest.raises(RuntimeError, match="another operation or shape"):
            dispatch(x if what == "hidden" else (x8[0], x8[1].view(torch.int32) if rank == 0 else x8[1]))
        return
    (recv_data, _), _, recv_w, _, handle, _ = dispatch(x8)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="another operation or shape|gave this call up|earlier call"):
        if what == "cached scales":
            cuda.dispatch((x8[0], x8[1][:, :1].contiguous()) if rank == 0 else x8, handle=handle)
        else:
            cuda.combine(recv_data.float().to(torch.bfloat16), handle, topk_weights=recv_w if rank == 0 else None)
        torch.cuda.synchronize()
        dispatch(x8)  # the next call that reads its counts on the host raises
    elapsed = time.monotonic() - start
    assert elapsed < timeout_s / 2, f"rank {rank}: the error took {elapsed:.1f} s (a wait ran to its timeout)"


@pytest.mark.parametrize("what", ["hidden", "scale dtype", "cached scales", "combine weights"])
def test_hierarchical_mismatched_shapes_raise_on_every_rank(what):
    _needs_gpus(2)
    with _fresh(2) as c:
        c.run(rank_mismatched_shapes, what, timeout_s=120)


@pytest.mark.parametrize("what", ["cached scales", "combine weights"])
def test_hierarchical_2x2_given_up_calls_are_told_to_mates(what):
    _needs_gpus(4)
    with _fresh(4) as c:
        c.run(rank_mismatched_shapes, what, 2, timeout_s=120)


def rank_refused_inputs(fault: str):
    """A rank whose counts or top-k ids are invalid: every rank raises, naming it; nothing hangs."""
    rank = dist.get_rank()
    ref, cuda = _buffers(1, 32, "auto")
    ref.destroy()
    x, idx, w = _inputs(23, 16, HIDDEN, 8, NUM_TOPK, "random", 1)
    per_rank, per_domain, per_expert, in_rank, _ = cuda.get_dispatch_layout(idx, 8)
    if rank == 1 and fault == "counts":
        per_rank = per_rank + 1
    if rank == 1 and fault == "ids":
        idx = idx.clone()
        idx[0, 0] = 8  # past num_experts
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] refused the inputs"):
        cuda.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_domain, is_token_in_rank=in_rank,
                      num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)


@pytest.mark.parametrize("fault", ["counts", "ids"])
def test_hierarchical_refused_inputs_raise_on_every_rank(fault):
    _needs_gpus(2)
    with _fresh(2) as c:
        c.run(rank_refused_inputs, fault, timeout_s=120)


def rank_lifecycle(num_buffers: int):
    """Create and destroy a hierarchical Buffer many times (its NVSHMEM memory goes back to the heap,
    its IPC mappings are closed): GPU memory and mappings must not grow; a destroy with a combine in
    flight waits for it."""
    from test_reliability_cuda import _mapped_regions

    x, idx, w = _inputs(24, 16, HIDDEN, 8, NUM_TOPK, "random", 1)

    def round_trip(buf: Buffer, async_finish: bool = False):
        per_rank, per_domain, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 8)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_domain, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        previous = buf.capture() if async_finish else None
        return buf.combine(recv_x, handle, topk_weights=recv_w, previous_event=previous, async_finish=async_finish)

    ref, cuda = _buffers(1, 32, "auto")
    want = round_trip(ref)[0]
    ref.destroy()
    round_trip(cuda)  # warm-up: compile, load, first mappings
    cuda.destroy()
    torch.cuda.synchronize()
    allocated, regions = torch.cuda.memory_allocated(), _mapped_regions()
    free_before, _ = torch.cuda.mem_get_info()
    for i in range(num_buffers):
        ref, cuda = _buffers(1, 32, "auto")
        ref.destroy()
        if i % 10 == 0:
            round_trip(cuda)
        cuda.destroy()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    grown = {"allocated": torch.cuda.memory_allocated() - allocated, "regions": _mapped_regions() - regions,
             "free_lost": free_before - torch.cuda.mem_get_info()[0]}
    assert grown["allocated"] <= 0, grown
    assert grown["regions"] <= 8, grown
    assert grown["free_lost"] < 2 * NVL, grown
    ref, cuda = _buffers(1, 32, "auto")
    ref.destroy()
    combined, _, event = round_trip(cuda, async_finish=True)
    cuda.destroy()  # waits for the combine in flight
    event.current_stream_wait()
    assert same_bits(combined, want), "a combine finished by destroy differs"


def test_hierarchical_create_and_destroy_buffers():
    _needs_gpus(2)
    with _fresh(2) as c:
        c.run(rank_lifecycle, 50, timeout_s=300)
