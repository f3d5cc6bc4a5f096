"""The CUDA intranode kernels against the reference backend, on GPUs (skipped without them).

Copies must be bitwise equal. The combine sums in the same order as the reference (fp32, ascending
rank, then the biases), so it must be bitwise equal too. Outputs are allocated from memory that
was filled with garbage first, so a row the kernels forget to write cannot pass by luck.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import BACKEND, busy_side_stream, capture_graph, cluster, peer_timeout, poison_allocator
from routing import make_inputs

import epcomm
from epcomm import Buffer, lifecycle
from epcomm.bench.checks import poison_, same_bits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(BACKEND != "nccl", reason="CUDA kernels: run with EPCOMM_TEST_BACKEND=nccl on GPUs")]

NVL_BYTES = 512 << 20
# One rank too: every kernel then runs end to end (sending to itself) on a one-GPU machine.
RANKS = [1, 2, 4, 8]


def _same(a, b) -> bool:
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is None and b is None
    if not isinstance(a, torch.Tensor):
        return a == b
    return a.shape == b.shape and same_bits(a, b)


def _inputs(seed, rank, num_ranks, tokens_per_rank, hidden, num_experts, num_topk, routing, fp8, col_major, dev):
    num_tokens = tokens_per_rank[rank % len(tokens_per_rank)]
    x, topk_idx, topk_weights = (t.to(dev) for t in make_inputs(seed, rank, num_tokens, hidden, num_experts,
                                                                 num_topk, num_ranks, routing))
    if fp8:
        data, scales = epcomm.per_token_cast_to_fp8(x)
        return x, (data, scales.t().contiguous().t() if col_major else scales), topk_idx, topk_weights
    return x, x, topk_idx, topk_weights


def rank_cuda_vs_reference(tokens_per_rank, hidden, num_experts, num_topk, routing, seed, fp8, col_major,
                           num_worst_tokens, use_bias, num_sms, nvl_bytes=NVL_BYTES, beside_compute=False):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    tag = (f"rank={rank} R={num_ranks} T={tokens_per_rank} H={hidden} E={num_experts} K={num_topk} {routing} "
           f"fp8={fp8} col_major={col_major} worst={num_worst_tokens} bias={use_bias} sms={num_sms} "
           f"beside_compute={beside_compute}")
    dev = torch.device("cuda", torch.cuda.current_device())
    x, x_in, topk_idx, topk_weights = _inputs(seed, rank, num_ranks, tokens_per_rank, hidden, num_experts, num_topk,
                                              routing, fp8, col_major, dev)
    config = epcomm.Config(num_sms=num_sms)
    if nvl_bytes == "hint":  # DeepEP's sizing: a buffer this call does not fit in (it runs in rounds)
        nvl_bytes = config.get_nvl_buffer_size_hint(hidden * 2, num_ranks)
    outs = {}
    busy = []  # GEMM streams kept busy beside the CUDA backend's calls, and their tensors
    for backend in ("reference", "cuda"):
        buf = Buffer(dist.group.WORLD, nvl_bytes, backend=backend)
        poison_allocator(dev)
        if beside_compute and backend == "cuda":
            busy.append(busy_side_stream(dev))
        layout = buf.get_dispatch_layout(topk_idx, num_experts)[:4]
        per_rank, _, per_expert, in_rank = layout
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=num_worst_tokens, config=config)
        poison_allocator(dev)
        cached_x, *_ = buf.dispatch(x_in, handle=handle, config=config)
        rows = (recv_x[0] if fp8 else recv_x).shape[0]
        gen = torch.Generator().manual_seed(seed + 1000 + rank)
        y = torch.randn((rows, hidden), generator=gen).to(torch.bfloat16).to(dev)
        biases = tuple(torch.randn((x.shape[0], hidden), generator=gen).to(torch.bfloat16).to(dev)
                       for _ in range(2)) if use_bias else None
        poison_allocator(dev)
        if busy:
            busy.append(busy_side_stream(dev))
        combined, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w, bias=biases, config=config)
        torch.cuda.synchronize()
        if backend == "cuda" and nvl_bytes != NVL_BYTES:
            assert "rounds" in handle.backend_state, f"{tag}: expected the call to run in rounds"
        # What the host knows of the call (not known with num_worst_tokens: no sync on that path).
        host = None if num_worst_tokens else (handle.num_recv_tokens, handle.send_counts, handle.recv_counts)
        outs[backend] = dict(handle=host, layout=layout, recv_x=recv_x, recv_idx=recv_idx, recv_w=recv_w, counts=counts,
                             cached=cached_x, combined=combined, combined_w=combined_w)
        buf.destroy()
    ref, got = outs["reference"], outs["cuda"]
    for key in ref:
        assert _same(got[key], ref[key]), f"{tag}: {key} differs from the reference backend"
    if fp8:  # row-major whatever the input's layout (DeepEP's)
        assert got["recv_x"][1].is_contiguous() and ref["recv_x"][1].is_contiguous(), tag
    return (ref["recv_x"][0] if fp8 else ref["recv_x"]).shape[0]


CASES = [
    # (tokens per rank (cycled over ranks), hidden, experts, topk, routing)
    ([256, 200], 7168, 256, 8, "random"),
    ([64, 0], 2048, 16, 4, "random"),
    ([96, 96], 4096, 32, 8, "imbalanced"),
    ([80, 80], 1024, 32, 4, "empty_rank"),
    ([50, 31], 512, 8, 2, "one_expert"),
    ([40, 40], 256, 16, 4, "all_dropped"),
    ([1, 1], 256, 8, 4, "random"),
    ([0, 0], 256, 8, 4, "random"),
    ([24, 17], 10240, 16, 4, "random"),  # 80 FP8 scales a token: more than a warp holds (kMetaScales)
    ([2500, 1100], 256, 16, 4, "random"),  # the count exchange's scan spread over 3 and 2 blocks
]


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{sum(c[0])}-H{c[1]}-{c[4]}")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cuda_matches_reference(ranks, case, fp8):
    tokens, hidden, experts, topk, routing = case
    experts = max(experts, ranks)
    cluster(ranks).run(rank_cuda_vs_reference, tokens, hidden, experts, topk, routing, seed=CASES.index(case),
                       fp8=fp8, col_major=fp8 and CASES.index(case) % 2 == 0, num_worst_tokens=0, use_bias=True,
                       num_sms=24)


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("num_sms", [2, 8, 32])
def test_cuda_num_worst_tokens_and_sm_counts(ranks, num_sms):
    cluster(ranks).run(rank_cuda_vs_reference, [128, 77], 2048, 16, 4, "random", seed=7, fp8=num_sms == 8,
                       col_major=False, num_worst_tokens=ranks * 128, use_bias=num_sms != 2, num_sms=num_sms)


@pytest.mark.parametrize("ranks", [2])
def test_cuda_count_exchange_within_the_sm_budget(ranks):
    """2500 tokens would take 3 notify blocks (a block per 1024 tokens); at 2 SMs the count
    exchange's cooperative launch keeps to 2, each scanning a longer range."""
    cluster(ranks).run(rank_cuda_vs_reference, [2500, 1100], 256, 16, 4, "random", seed=11, fp8=False,
                       col_major=False, num_worst_tokens=0, use_bias=False, num_sms=2)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("num_worst", [False, True], ids=["synced", "worst"])
def test_cuda_calls_beside_busy_compute(ranks, num_worst):
    """Dispatch (fresh and cached) and combine while GEMMs on another stream hold the SMs: the count
    exchange's and the kernels' launches wait for SMs, nothing times out, results as without."""
    cluster(ranks).run(rank_cuda_vs_reference, [1500, 700], 4096, 32, 8, "random", seed=13, fp8=num_worst,
                       col_major=False, num_worst_tokens=ranks * 1500 if num_worst else 0, use_bias=True,
                       num_sms=24, beside_compute=True)


def rank_graph_replay(num_tokens, hidden, num_experts, num_topk, num_worst_tokens):
    """Capture layout + dispatch + combine (num_worst_tokens: no CPU sync) once, replay with new data."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(dist.group.WORLD, NVL_BYTES, backend="cuda")
    ref = Buffer(dist.group.WORLD, NVL_BYTES, backend="reference")
    x_static = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=dev)
    idx_static = torch.empty((num_tokens, num_topk), dtype=torch.int64, device=dev)
    w_static = torch.empty((num_tokens, num_topk), dtype=torch.float32, device=dev)

    def step(b, x, idx, w):
        per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(idx, num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = b.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w, num_worst_tokens=num_worst_tokens)
        expert_out = (recv_x.float() * 1.5).to(torch.bfloat16)  # stands in for the experts
        combined, combined_w, _ = b.combine(expert_out, handle, topk_weights=recv_w)
        return recv_x, recv_idx, recv_w, combined, combined_w

    def load(seed):
        x, idx, w = make_inputs(seed, rank, num_tokens, hidden, num_experts, num_topk, num_ranks, "random")
        x_static.copy_(x)
        idx_static.copy_(idx)
        w_static.copy_(w)

    load(100)
    graph, outputs = capture_graph(step, buf, x_static, idx_static, w_static)
    for seed in (200, 300, 400):
        load(seed)
        _poison_outputs(outputs)
        graph.replay()
        torch.cuda.synchronize()
        want = step(ref, x_static.clone(), idx_static.clone(), w_static.clone())
        for name, got, exp in zip(("recv_x", "recv_idx", "recv_w", "combined", "combined_w"), outputs, want):
            assert _same(got, exp), f"rank {rank} replay seed {seed}: {name} differs from the reference backend"
    buf.destroy()
    ref.destroy()


def _poison_outputs(outputs) -> None:
    for t in outputs:
        poison_(t)


@pytest.mark.parametrize("ranks", RANKS)
def test_cuda_graph_replay_with_new_inputs(ranks):
    cluster(ranks).run(rank_graph_replay, 96, 1024, 32, 4, num_worst_tokens=96 * ranks)


def rank_refusal(hidden, num_experts):
    """A rank passing out-of-range top-k ids makes every rank raise ValueError naming it; the Buffer
    stays usable. The bad id is in the third of the count exchange's blocks (1024 tokens each)."""
    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(dist.group.WORLD, NVL_BYTES, backend="cuda")
    x, topk_idx, w = (t.to(dev) for t in make_inputs(5, rank, 2100, hidden, num_experts, 4, dist.get_world_size(),
                                                     "random"))
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
    bad = topk_idx.clone()
    if rank == 1:
        bad[2050, 2] = num_experts + 5
    with pytest.raises(ValueError, match="rank 1: topk_idx values outside"):
        buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                     topk_idx=bad, topk_weights=w)
    recv_x, *_ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                              num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=w)
    assert recv_x.shape[0] > 0
    buf.destroy()


def test_cuda_refused_input_raises_on_every_rank():
    cluster(2).run(rank_refusal, 512, 16)


def rank_shape_mismatches():
    """Rank 0's rows differ from rank 1's in what the row bytes alone do not show (FP8 scale count 1 vs
    2 and fp32 vs int32 scales round to the same 16-byte slot; weights or none): a fresh dispatch is
    refused on every rank (ValueError); a cached dispatch or a combine moves nothing, and every rank's
    next synchronizing call raises RuntimeError. The Buffer works on, equal to the reference backend."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    hidden, experts, topk = 256, 4 * num_ranks, 4  # an FP8 row: 256 + 12 * 4 + 4 * S bytes, 320 for S = 1, 2
    x, idx, w = (t.to(dev) for t in make_inputs(31, rank, 64, hidden, experts, topk, num_ranks, "random"))
    data, scales = epcomm.per_token_cast_to_fp8(x)
    buf = Buffer(dist.group.WORLD, NVL_BYTES, backend="cuda")
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)

    def fresh(x_in, weights=w):
        return buf.dispatch(x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=weights)

    first = rank == 0
    refused = {"scale count": ((data, scales[:, :1].contiguous()) if first else (data, scales), w),
               "scale dtype": ((data, scales.view(torch.int32)) if first else (data, scales), w),
               "weights": (x, None if first else w)}
    for x_in, weights in refused.values():
        with pytest.raises(ValueError, match=r"rank \d: ranks disagree on the row shape"):
            fresh(x_in, weights)
    late = r"passed rows of another shape to this call than this rank"
    (recv_data, _), _, recv_w, _, handle, _ = fresh((data, scales))
    buf.dispatch((data, scales[:, :1].contiguous()) if first else (data, scales), handle=handle)
    with pytest.raises(RuntimeError, match=f"cached dispatch .*{late}"):
        fresh((data, scales))
    recv_x, _, recv_w, _, handle, _ = fresh(x)
    buf.combine(recv_x, handle, topk_weights=recv_w if first else None)
    with pytest.raises(RuntimeError, match=f"combine .*{late}"):
        fresh(x)
    # Nothing was left half done: a round trip equals the reference backend's.
    ref = Buffer(dist.group.WORLD, NVL_BYTES, backend="reference")
    outs = []
    for b in (buf, ref):
        per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(idx, experts)
        (recv_data, recv_scales), recv_idx, recv_w, _, handle, _ = b.dispatch(
            (data, scales), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w)
        combined = b.combine(recv_data.float().to(torch.bfloat16), handle, topk_weights=recv_w)
        outs.append((recv_data, recv_scales, recv_idx, recv_w, *combined[:2]))
    assert _same(outs[0], outs[1]), f"rank {rank}: a round trip after the mismatches differs from the reference"
    buf.destroy()
    ref.destroy()


@pytest.mark.parametrize("ranks", [2, 3])
def test_cuda_shape_mismatches_are_told_apart(ranks):
    cluster(ranks).run(rank_shape_mismatches)


def rank_timeout(timeout_s):
    """Rank 1 never calls dispatch: rank 0 raises within the timeout, naming rank 1."""
    import time

    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    with peer_timeout(timeout_s):
        buf = Buffer(dist.group.WORLD, NVL_BYTES, backend="cuda")
    x, topk_idx, w = (t.to(dev) for t in make_inputs(6, rank, 16, 256, 8, 2, dist.get_world_size(), "random"))
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, 8)
    elapsed = None
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"timed out waiting for rank\(s\) \[1\]"):
            buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                         topk_idx=topk_idx, topk_weights=w)
        elapsed = time.monotonic() - start
        assert elapsed < 2 * timeout_s + 5, elapsed
    torch.cuda.synchronize()
    dist.barrier()
    # The call counters now disagree: unmap without the epcomm barrier (what a user does is destroy
    # the Buffer and the process group; here the group is shared with the next tests).
    lifecycle.drop_normal_kernels(buf)
    buf.destroy()
    return elapsed


def test_cuda_timeout_names_the_missing_rank():
    cluster(2).run(rank_timeout, 3)


def rank_cuda_fuzz(max_examples: int):
    """Random valid and invalid dispatch arguments on the CUDA backend (one rank): every call is refused
    with ValueError/TypeError, or its outputs equal the reference backend's bit for bit. Refusals that
    depend on values (top-k ids out of range, counts that do not match) are found by the kernels: a call
    that reads its counts raises at once, a num_worst_tokens call reports it at the next sync."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    dev = torch.device("cuda", torch.cuda.current_device())
    cuda = Buffer(dist.group.WORLD, 256 << 20, backend="cuda")
    ref = Buffer(dist.group.WORLD, 256 << 20, backend="reference")
    seen = {"valid": 0, "refused": 0, "reported": 0}

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data):
        t = data.draw(st.integers(0, 40))
        hidden = data.draw(st.sampled_from([128, 256, 1024]))
        num_experts = data.draw(st.sampled_from([1, 2, 8, 64]))
        k = data.draw(st.integers(1, min(8, max(1, num_experts))))
        fp8, col_major = data.draw(st.booleans()), data.draw(st.booleans())
        worst = data.draw(st.sampled_from([0, 0, t + 5]))
        fault = data.draw(st.sampled_from([None, None, None, "id too large", "id below -1", "counts",
                                           "x dtype", "topk int32", "x non-contiguous"]))
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16)))
        x = (torch.randn((t, hidden), generator=gen) * 3).to(torch.bfloat16).to(dev)
        idx = torch.randint(-1, num_experts, (t, k), generator=gen).to(dev)
        w = torch.rand((t, k), generator=gen).to(dev)
        per_rank, _, per_expert, in_rank, _ = ref.get_dispatch_layout(idx, num_experts)
        # Faults that need tokens are not applied without them: the call is then valid.
        applied = fault is not None and (t > 1 or fault in ("counts", "x dtype", "topk int32") or
                                         (t == 1 and fault != "x non-contiguous"))
        fault = fault if applied else None
        if fault == "id too large":
            idx[t // 2, 0] = num_experts
        if fault == "id below -1":
            idx[t // 2, k - 1] = -3
        if fault == "counts":
            per_rank = per_rank + 1
        x_in = x
        if fp8:
            q, s = epcomm.per_token_cast_to_fp8(x)
            x_in = (q, s.t().contiguous().t() if col_major else s)
        if fault == "x dtype":
            x_in = x.half()
        if fault == "x non-contiguous":
            x_in = torch.cat([x, x], 1)[:, ::2]
        kwargs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                      topk_idx=idx.int() if fault == "topk int32" else idx, topk_weights=w, num_worst_tokens=worst)
        value_fault = fault in ("id too large", "id below -1", "counts")
        try:
            got = cuda.dispatch(x_in, **kwargs)
        except (ValueError, TypeError) as error:
            assert fault is not None, f"valid arguments refused: {error}"
            seen["refused"] += 1
            return
        if value_fault:  # found by the kernels: a num_worst_tokens call reports it at the next sync
            assert worst, f"{fault}: the counts were read on the host, yet nothing was raised"
            torch.cuda.synchronize()
            with pytest.raises(ValueError, match="refused its inputs"):
                cuda.normal_ops.check_errors("fuzz")
            seen["reported"] += 1
            return
        assert fault is None, f"{fault} was not refused"
        want = ref.dispatch(x_in, **kwargs)
        for name, a, b in zip(("recv_x", "recv_topk_idx", "recv_topk_weights", "expert_list"), got[:4], want[:4]):
            assert _same(a, b), f"T={t} H={hidden} E={num_experts} K={k} fp8={fp8} worst={worst}: {name} differs"
        y = (got[0][0] if fp8 else got[0]).float().nan_to_num().clamp(-100, 100).to(torch.bfloat16)
        combined = cuda.combine(y, got[4], topk_weights=got[2])[:2]
        expected = ref.combine(y, want[4], topk_weights=want[2])[:2]
        assert _same(combined, expected), f"T={t} H={hidden} E={num_experts} K={k}: combine differs"
        seen["valid"] += 1

    check()
    cuda.destroy()
    ref.destroy()
    return seen


def test_cuda_bad_input_fuzz():
    (seen,) = cluster(1).run(rank_cuda_fuzz, 60, timeout_s=600)
    assert seen["valid"] and seen["refused"], seen


ROUND_CASES = [([4000, 3000], "random"), ([4000, 0], "random"), ([4000, 0], "one_expert")]


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("case", ROUND_CASES, ids=lambda c: f"T{c[0][0]}-{c[0][1]}-{c[1]}")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cuda_call_larger_than_the_buffer_runs_in_rounds(ranks, case, fp8):
    """A buffer sized by Config.get_nvl_buffer_size_hint that cannot hold the call: dispatch, cached
    dispatch and combine run in rounds, with the same bits as one call (ranks without tokens and
    ranks receiving nothing included)."""
    tokens, routing = case
    cluster(ranks).run(rank_cuda_vs_reference, tokens, 256, 4 * ranks, 4, routing, seed=13, fp8=fp8,
                       col_major=fp8, num_worst_tokens=0, use_bias=True, num_sms=8, nvl_bytes="hint")
