"""The CUDA low-latency kernels against the reference backend, on GPUs (skipped without them).

Dispatch must be bitwise equal (data, FP8 scales in every mode, src_info, layout, counts, and the
receive statistics); combine sums in the reference's order (fp32, top-k slot order), so it must
be bitwise equal too, except by partial sums on several ranks (EPCOMM_LL_COMBINE_PARTIALS: 1, or
auto from 64 tokens a rank): within the bf16 rounding of each partial. The shared-messages tests
force the per-expert combine (0), so every case checks it bitwise too. Outputs start as garbage
(the allocator is poisoned), so nothing passes by luck.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import (
    BACKEND,
    busy_side_stream,
    capture_graph,
    cluster,
    env_var,
    fresh_cluster,
    nvshmem_found,
    poison_allocator,
)
from routing import combined_matches, make_inputs, partials_bound

from epcomm import Buffer
from epcomm.backends.cuda.low_latency import partials_fit
from epcomm.bench.checks import poison_, same_bits
from epcomm.tuning import partials_asked

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(BACKEND != "nccl", reason="CUDA kernels: run with EPCOMM_TEST_BACKEND=nccl on GPUs")]

# One rank too: every kernel then runs end to end (sending to itself) on a one-GPU machine.
RANKS = [1, 2, 4, 8]


def _buffer(backend: str, n: int, hidden: int, num_experts: int, **kwargs) -> Buffer:
    size = Buffer.get_low_latency_rdma_size_hint(n, hidden, dist.get_world_size(), num_experts)
    return Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, backend=backend, **kwargs)


def _valid_rows(recv_x, recv_count):
    """Each expert's rows [0, recv_count[e]) (the rest is unspecified), as one list of tensors."""
    parts = recv_x if isinstance(recv_x, tuple) else (recv_x,)
    return [t[e, :int(recv_count[e])].contiguous() for t in parts for e in range(t.shape[0])]


def _expert_stand_in(recv_x, use_fp8: bool) -> torch.Tensor:
    """The experts' outputs the tests combine: every received row times (local expert + 1) / 4, from
    its own data, in bf16. In place: at 8 ranks sharing one GPU, three fp32 copies of the rows would
    not fit."""
    data = recv_x[0].float() if use_fp8 else recv_x.float()
    scale = (torch.arange(data.shape[0], device=data.device, dtype=torch.float32) + 1).view(-1, 1, 1) / 4
    return data.nan_to_num_().mul_(scale).to(torch.bfloat16)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and same_bits(a, b)


def _partials_expected(buf, n: int, num_experts: int, hidden: int, num_topk: int) -> bool:
    """Whether this Buffer's combines of this shape without a hook go by partial sums: where the
    Buffer may (IPC transport, the send kernel fits), they fit, and EPCOMM_LL_COMBINE_PARTIALS asks
    for them (1; or auto, the default, from 64 tokens a rank: partials_asked, pinned by the CPU tests)."""
    ll = buf.low_latency_ops
    return (ll.combine_partials and partials_fit(dist.get_world_size(), num_experts, hidden, num_topk) and
            partials_asked(ll.combine_partials_mode, n))


def rank_ll_vs_reference(tokens_per_rank, n, hidden, num_experts, num_topk, routing, seed, use_fp8, round_scale,
                         use_ue8m0, use_hook, shrink_last, partials=False, hook_stream=False, num_sms=None,
                         beside_compute=False):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    tag = (f"rank={rank} R={num_ranks} T={tokens_per_rank} N={n} H={hidden} E={num_experts} K={num_topk} {routing} "
           f"fp8={use_fp8} round={round_scale} ue8m0={use_ue8m0} hook={use_hook} shrink={shrink_last} "
           f"beside_compute={beside_compute}")
    dev = torch.device("cuda", torch.cuda.current_device())
    num_tokens = tokens_per_rank[rank % len(tokens_per_rank)]
    x, topk_idx, weights = (t.to(dev) for t in make_inputs(seed, rank, num_tokens, hidden, num_experts, num_topk,
                                                           num_ranks, routing))
    e_local = num_experts // num_ranks
    # By partial sums on several ranks: within bf16 rounding of the partials (bitwise on one rank).
    bound = None
    outs = {}
    # The hooks on a stream of their own (hook_stream): the receive waits for the send there.
    side = torch.cuda.Stream(dev) if hook_stream else torch.cuda.current_stream(dev)
    busy = []  # GEMM streams kept busy beside the CUDA backend's calls, and their tensors
    for backend in ("reference", "cuda"):
        buf = _buffer(backend, n, hidden, num_experts, enable_shrink=shrink_last)
        if backend == "cuda" and partials:  # the mode is available (else the test would prove nothing)
            assert buf.low_latency_ops.combine_partials and partials_fit(num_ranks, num_experts, hidden, num_topk), tag
        if backend == "cuda":  # forced (partials: asserted available above), or by the auto rule
            by_partials = not use_hook and _partials_expected(buf, n, num_experts, hidden, num_topk)
        if backend == "cuda" and num_sms is not None:  # the dispatch's kernels on fewer blocks than SMs
            for call in buf.low_latency_ops._dispatch_calls:  # the shape records copy these at the first call
                call.context.num_sms = num_sms
        if shrink_last:
            buf.low_latency_update_mask_buffer(num_ranks - 1, True)
        recv_stats = torch.zeros(e_local, dtype=torch.int32, device=dev)
        wait_stats = torch.zeros(num_ranks, dtype=torch.int64, device=dev)
        poison_allocator(dev)
        if beside_compute and backend == "cuda":
            busy.append(busy_side_stream(dev))
        recv_x, recv_count, handle, _, hook = buf.low_latency_dispatch(
            x, topk_idx, n, num_experts, cumulative_local_expert_recv_stats=recv_stats,
            dispatch_wait_recv_cost_stats=wait_stats, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
            return_recv_hook=use_hook)
        if use_hook:
            with torch.cuda.stream(side):
                hook()
        torch.cuda.synchronize()
        y = _expert_stand_in(recv_x, use_fp8)
        poison_allocator(dev)
        if busy:
            busy.append(busy_side_stream(dev))
        combined, _, hook = buf.low_latency_combine(y, topk_idx, weights, handle, return_recv_hook=use_hook)
        if use_hook:
            with torch.cuda.stream(side):
                hook()
        torch.cuda.synchronize()
        if backend == "cuda":  # by partial sums exactly when asked for (or by auto) and without a hook
            assert buf.low_latency_ops.last_combine_partials == by_partials, tag
            if by_partials and num_ranks > 1:
                bound = partials_bound(x, topk_idx, weights, lambda e: (e % e_local).float().add(1) / 4)
        outs[backend] = dict(rows=_valid_rows(recv_x, recv_count), recv_count=recv_count.clone(),
                             layout_range=handle.layout_range.clone(), src_info=handle.src_info.clone(),
                             recv_stats=recv_stats, wait_stats=wait_stats, combined=combined.clone(),
                             scale_strides=recv_x[1].stride() if use_fp8 else None)
        buf.destroy()
    ref, got = outs["reference"], outs["cuda"]
    if shrink_last:
        # A masked rank is treated as failed: the kernels neither send to it nor wait for it, and it
        # sends nothing. (The reference still moves the masked rank's own tokens, as its collectives
        # need every process alive.) What both define alike: the live ranks' combined outputs.
        if rank == num_ranks - 1:
            assert int(got["recv_count"].sum()) == 0, tag
        else:
            assert combined_matches(got["combined"], ref["combined"], bound), \
                f"{tag}: combined differs from the reference"
        return 0
    for key in ("recv_count", "layout_range", "src_info", "recv_stats"):
        assert _bits_equal(got[key], ref[key]), f"{tag}: {key} differs from the reference backend"
    assert combined_matches(got["combined"], ref["combined"], bound), f"{tag}: combined differs from the reference"
    if bound is not None and hidden >= 4096 and num_tokens >= 64:  # partials were added: some rounding shows
        assert not _bits_equal(got["combined"], ref["combined"]), f"{tag}: bitwise equal; were partials summed?"
    assert len(got["rows"]) == len(ref["rows"]), tag
    for i, (a, b) in enumerate(zip(got["rows"], ref["rows"])):
        assert _bits_equal(a, b), f"{tag}: received rows of part {i} differ from the reference backend"
    assert got["scale_strides"] == ref["scale_strides"], tag
    assert bool((got["wait_stats"] >= 0).all()), tag
    return int(ref["recv_count"].sum())


LL_CASES = [
    # (tokens per rank (cycled), N, hidden, experts per rank, topk, routing)
    ([128, 77], 128, 7168, 36, 8, "random"),
    ([16, 0, 3, 16], 16, 512, 4, 4, "random"),
    ([6], 6, 512, 2, 2, "imbalanced"),
    ([5], 8, 1024, 4, 3, "empty_rank"),
    ([4], 4, 1024, 2, 2, "one_expert"),
    ([0], 4, 512, 2, 2, "random"),
    ([1], 1, 512, 2, 2, "random"),
    ([1, 9], 16, 7168, 36, 8, "random"),  # fewer tokens than SMs: a token's units split among 14 blocks
]


MODES = ("fp8", "bf16", "fp8-round", "fp8-ue8m0")  # dispatch formats


def mode_fits(mode: str, hidden: int) -> bool:
    return mode != "fp8-ue8m0" or hidden % 512 == 0  # UE8M0 packs 4 scales per int32


def mode_flags(mode: str) -> dict:
    """rank_ll_vs_reference's format arguments for a mode of MODES."""
    return dict(use_fp8=mode != "bf16", round_scale=mode in ("fp8-round", "fp8-ue8m0"), use_ue8m0=mode == "fp8-ue8m0")


def rank_ll_case(case, mode: str, hook: bool, seed: int, partials: bool = False) -> None:
    """rank_ll_vs_reference for a case of LL_CASES in one format (nothing where the format does not fit)."""
    tokens, n, hidden, per_rank, topk, routing = case
    if mode_fits(mode, hidden):
        rank_ll_vs_reference(tokens, n, hidden, per_rank * dist.get_world_size(), topk, routing, seed=seed,
                             use_hook=hook, shrink_last=False, partials=partials, **mode_flags(mode))


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("case", LL_CASES, ids=lambda c: f"T{c[0][0]}-H{c[2]}-{c[5]}")
@pytest.mark.parametrize("mode", MODES)
def test_ll_cuda_matches_reference(ranks, case, mode):
    tokens, n, hidden, per_rank, topk, routing = case
    if not mode_fits(mode, hidden):
        pytest.skip("UE8M0 packs 4 scales per int32: hidden must be a multiple of 512")
    cluster(ranks).run(rank_ll_vs_reference, tokens, n, hidden, per_rank * ranks, topk, routing,
                       seed=LL_CASES.index(case) + 7, use_hook=False, shrink_last=False, **mode_flags(mode))


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("hook", [False, True], ids=["fused", "hook"])
def test_ll_cuda_calls_beside_busy_compute(ranks, hook):
    """Dispatch and combine while GEMMs on another stream hold the SMs (the overlap of a decode step's
    two micro-batches): the kernels' cooperative launches wait for SMs, nothing times out."""
    cluster(ranks).run(rank_ll_vs_reference, [128, 77], 128, 7168, 36 * ranks, 8, "random", seed=37, use_fp8=True,
                       round_scale=False, use_ue8m0=False, use_hook=hook, shrink_last=False, beside_compute=True)


@pytest.mark.parametrize("ranks", RANKS)
def test_ll_cuda_hook(ranks):
    cluster(ranks).run(rank_ll_vs_reference, [64], 64, 2048, 4 * ranks, 4, "random", seed=31, use_fp8=True,
                       round_scale=False, use_ue8m0=False, use_hook=True, shrink_last=False)


@pytest.mark.parametrize("ranks", [1, 2])
def test_ll_cuda_hook_on_another_stream(ranks):
    cluster(ranks).run(rank_ll_vs_reference, [64], 64, 2048, 4 * ranks, 4, "random", seed=37, use_fp8=True,
                       round_scale=False, use_ue8m0=False, use_hook=True, shrink_last=False, hook_stream=True)


def rank_ll_combine_per_expert():
    """The combine per (token, expert) forced (EPCOMM_LL_COMBINE_PARTIALS=0; auto sums partials
    from 64 tokens): every case in every format, one with a hook, and the graph, every case's
    combine bitwise the reference's. The dispatches' tokens pick several experts of one rank
    (their one message there then fills several rows)."""
    with env_var("EPCOMM_LL_COMBINE_PARTIALS", 0):
        for i, case in enumerate(LL_CASES):
            for mode in MODES:
                rank_ll_case(case, mode, hook=i == 1, seed=70 + i)
        rank_ll_graph(32, 1024, 8 * dist.get_world_size(), 4)


@pytest.mark.parametrize("ranks", RANKS)
def test_ll_cuda_combine_per_expert_matches_reference(ranks):
    cluster(ranks).run(rank_ll_combine_per_expert, timeout_s=400)


def rank_ll_block_receive(mode):
    """EPCOMM_LL_BLOCK_RECEIVE forced either way (auto picks per call, so each path would see only
    some cases): 1, the fused dispatch's blocks receive their units together (their warps share the
    copies); 0, a group of warps per unit. Every case in every format; on 1 and 3 blocks (a block's
    units in several batches of 8, and fewer blocks than ranks); a masked rank; the graph."""
    num_ranks = dist.get_world_size()
    with env_var("EPCOMM_LL_BLOCK_RECEIVE", mode):
        probe = _buffer("cuda", 8, 512, 2 * num_ranks)
        assert probe.low_latency_ops.block_receive == mode  # the switch took (else the test would prove nothing)
        probe.destroy()
        for i, case in enumerate(LL_CASES):
            for mode in MODES:
                rank_ll_case(case, mode, hook=False, seed=150 + i)
        tokens, n, hidden, per_rank, topk, routing = LL_CASES[0]
        for sms in (1, 3):
            rank_ll_vs_reference(tokens, n, hidden, per_rank * num_ranks, topk, routing, seed=160 + sms, use_fp8=True,
                                 round_scale=False, use_ue8m0=False, use_hook=False, shrink_last=False, num_sms=sms)
        if num_ranks > 2:
            rank_ll_vs_reference([8], 8, 512, 4 * num_ranks, 3, "random", seed=165, use_fp8=True, round_scale=False,
                                 use_ue8m0=False, use_hook=False, shrink_last=True)
        rank_ll_graph(32, 1024, 8 * dist.get_world_size(), 4)


@pytest.mark.parametrize("mode", ["0", "1"])
@pytest.mark.parametrize("ranks", RANKS)
def test_ll_cuda_block_receive_matches_reference(ranks, mode):
    cluster(ranks).run(rank_ll_block_receive, mode, timeout_s=400)


def rank_ll_token_messages_nvshmem():
    """Over NVSHMEM with rank 1 remote: a token's message and its pairs' index entries are put to it
    from staging, and stored straight into the mapped ranks."""
    with env_var("EPCOMM_LL_TRANSPORT", "nvshmem"), env_var("EPCOMM_LL_REMOTE_RANKS", "1"):
        for case, mode, hook in NVSHMEM_CASES:
            rank_ll_case(case, mode, hook, seed=90)


@pytest.mark.skipif(not nvshmem_found(), reason="NVSHMEM not installed (pip install nvidia-nvshmem-cu13)")
@pytest.mark.parametrize("ranks", [r for r in RANKS if r > 2])  # rank 1 remote, others mapped
def test_ll_cuda_token_messages_over_nvshmem_match_reference(ranks):
    with fresh_cluster(ranks) as fresh:  # NVSHMEM: initialized once per process
        fresh.run(rank_ll_token_messages_nvshmem, timeout_s=400)


def rank_ll_combine_partials():
    """EPCOMM_LL_COMBINE_PARTIALS=1: the expert side returns one partial sum per (token, rank); every
    case in three formats (BF16, FP8, FP8 with UE8M0 scales), one with a hook (which keeps the
    per-expert path), a masked rank, and the graph."""
    with env_var("EPCOMM_LL_COMBINE_PARTIALS", 1):
        for i, case in enumerate(LL_CASES):
            for mode in ("fp8", "bf16", "fp8-ue8m0"):
                rank_ll_case(case, mode, hook=i == 1, seed=110 + i, partials=True)
        num_ranks = dist.get_world_size()
        if num_ranks > 2:
            rank_ll_vs_reference([8], 8, 512, 4 * num_ranks, 3, "random", seed=41, use_fp8=False, round_scale=False,
                                 use_ue8m0=False, use_hook=False, shrink_last=True, partials=True)
        rank_ll_graph(32, 1024, 8 * num_ranks, 4, partials=True)


@pytest.mark.parametrize("ranks", RANKS)
def test_ll_cuda_combine_partials_match_reference(ranks):
    cluster(ranks).run(rank_ll_combine_partials, timeout_s=400)


@pytest.mark.parametrize("ranks", [r for r in RANKS if r > 2])
def test_ll_cuda_masked_rank(ranks):
    cluster(ranks).run(rank_ll_vs_reference, [8], 8, 512, 4 * ranks, 3, "random", seed=41, use_fp8=False,
                       round_scale=False, use_ue8m0=False, use_hook=False, shrink_last=True)


def rank_ll_graph(n, hidden, num_experts, num_topk, partials=False, pattern="plain"):
    """A decode step (dispatch -> experts -> combine) captured once and replayed with new inputs.
    ``pattern``: how the step waits for its calls, as the serving engines capture them: plain (on the
    stream), async (``async_finish=True`` and ``event.current_stream_wait()``: SGLang) or hook
    (``return_recv_hook=True``, the hook called inside the capture: vLLM)."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    buf, ref = _buffer("cuda", n, hidden, num_experts), _buffer("reference", n, hidden, num_experts)
    x_static = torch.empty((n, hidden), dtype=torch.bfloat16, device=dev)
    idx_static = torch.empty((n, num_topk), dtype=torch.int64, device=dev)
    w_static = torch.empty((n, num_topk), dtype=torch.float32, device=dev)

    bound = None

    def finish(event, hook):
        if pattern == "async":
            event.current_stream_wait()
        elif pattern == "hook":
            hook()

    def step(b, x, idx, w):
        flags = dict(async_finish=pattern == "async", return_recv_hook=pattern == "hook")
        recv_x, recv_count, handle, event, hook = b.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False,
                                                                         **flags)
        finish(event, hook)
        y = (recv_x.float() * 0.5).to(torch.bfloat16)
        combined, event, hook = b.low_latency_combine(y, idx, w, handle, **flags)
        finish(event, hook)
        return recv_count, combined

    def load(seed):
        x, idx, w = make_inputs(seed, rank, n, hidden, num_experts, num_topk, num_ranks, "random")
        x_static.copy_(x)
        idx_static.copy_(idx)
        w_static.copy_(w)
        nonlocal bound
        if partials and num_ranks > 1:
            bound = partials_bound(x_static, idx_static, w_static,
                                    lambda e: torch.full_like(e, 0.5, dtype=torch.float32))

    load(1)
    graph, outputs = capture_graph(step, buf, x_static, idx_static, w_static)
    for seed in (2, 3, 4):
        load(seed)
        for t in outputs:
            poison_(t)
        graph.replay()
        torch.cuda.synchronize()
        want = step(ref, x_static.clone(), idx_static.clone(), w_static.clone())
        assert _bits_equal(outputs[0], want[0]), f"rank {rank} replay {seed}: recv_count differs from the reference"
        assert combined_matches(outputs[1], want[1], bound), \
            f"rank {rank} replay {seed}: combined differs from the reference backend"
    assert buf.low_latency_ops.last_combine_partials == partials, f"rank {rank}: combine by partial sums not taken"
    buf.destroy()
    ref.destroy()


@pytest.mark.parametrize("ranks", RANKS)
def test_ll_cuda_graph_replay(ranks):
    cluster(ranks).run(rank_ll_graph, 32, 1024, 8 * ranks, 4)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("pattern", ["async", "hook"])
def test_ll_cuda_graph_replay_as_serving_engines_capture(ranks, pattern):
    cluster(ranks).run(rank_ll_graph, 32, 1024, 8 * ranks, 4, pattern=pattern)


def rank_ll_graph_of_one_dispatch(n, hidden, num_experts, num_topk):
    """A graph of one dispatch without a hook, replayed back to back with new inputs: every replay
    takes the slot of the replay before it, so it waits for acknowledgements its peers pay at the
    start of this very call (pay_owed_acks), not at the end of the one before. Each replay's rows
    and scales are bitwise the reference's; an eager dispatch and combine after the replays too."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    buf, ref = _buffer("cuda", n, hidden, num_experts), _buffer("reference", n, hidden, num_experts)
    x_static = torch.empty((n, hidden), dtype=torch.bfloat16, device=dev)
    idx_static = torch.empty((n, num_topk), dtype=torch.int64, device=dev)

    def dispatch(b, x, idx):
        recv_x, recv_count, handle, _, _ = b.low_latency_dispatch(x, idx, n, num_experts, use_fp8=True)
        return recv_x, recv_count, handle

    def load(seed):
        x, idx, _ = make_inputs(seed, rank, n, hidden, num_experts, num_topk, num_ranks, "random")
        x_static.copy_(x)
        idx_static.copy_(idx)

    load(1)
    graph, (recv_x, recv_count, _) = capture_graph(dispatch, buf, x_static, idx_static)
    for seed in (2, 3, 4):
        load(seed)
        for t in (*recv_x, recv_count):
            poison_(t)
        graph.replay()
        torch.cuda.synchronize()
        want_x, want_count, _ = dispatch(ref, x_static.clone(), idx_static.clone())
        assert _bits_equal(recv_count, want_count), f"rank {rank} replay {seed}: recv_count differs"
        for i, (a, b) in enumerate(zip(_valid_rows(recv_x, recv_count), _valid_rows(want_x, want_count))):
            assert _bits_equal(a, b), f"rank {rank} replay {seed}: received rows of part {i} differ"
    x, idx, w = (t.to(dev) for t in make_inputs(5, rank, n, hidden, num_experts, num_topk, num_ranks, "random"))
    results = []
    for b in (buf, ref):  # BF16 this time: the expert stand-in's output is then known (the bound)
        got_x, got_count, handle, _, _ = b.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
        combined, _, _ = b.low_latency_combine((got_x.float() * 0.5).to(torch.bfloat16), idx, w, handle)
        torch.cuda.synchronize()
        results.append((got_count.clone(), combined.clone()))
    bound = None
    if num_ranks > 1 and buf.low_latency_ops.last_combine_partials:
        bound = partials_bound(x, idx, w, lambda e: torch.full_like(e, 0.5, dtype=torch.float32))
    assert _bits_equal(results[0][0], results[1][0]), f"rank {rank}: eager recv_count after the replays differs"
    assert combined_matches(results[0][1], results[1][1], bound), \
        f"rank {rank}: eager combine after the replays differs"
    buf.destroy()
    ref.destroy()


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_ll_cuda_graph_of_one_dispatch_replayed(ranks):
    cluster(ranks).run(rank_ll_graph_of_one_dispatch, 128, 2048, 8 * ranks, 8)


def rank_ll_graph_of_one_combine(n, hidden, num_experts, num_topk):
    """The combine's twin of rank_ll_graph_of_one_dispatch: one eager dispatch, then a graph of one
    combine of its handle replayed back to back with new expert outputs, every replay in the slot of
    the one before (its acknowledgements paid by the peers' payers of this very call); each replay's
    output is the reference's (n under the partial sums' 64 tokens: bitwise)."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    buf, ref = _buffer("cuda", n, hidden, num_experts), _buffer("reference", n, hidden, num_experts)
    x, idx, w = (t.to(dev) for t in make_inputs(9, rank, n, hidden, num_experts, num_topk, num_ranks, "random"))
    got_x, got_count, got_handle, _, _ = buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
    _, want_count, want_handle, _, _ = ref.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
    torch.cuda.synchronize()
    assert _bits_equal(got_count, want_count), f"rank {rank}: recv_count differs"
    y_static = torch.empty_like(got_x)
    generator = torch.Generator(device=dev)

    def combine(b, y, handle):
        return b.low_latency_combine(y, idx, w, handle)[0]

    y_static.normal_(generator=generator.manual_seed(100 + rank))
    graph, combined = capture_graph(combine, buf, y_static, got_handle)
    for seed in (2, 3, 4):
        y_static.normal_(generator=generator.manual_seed(seed * 10 + rank))
        poison_(combined)
        graph.replay()
        torch.cuda.synchronize()
        want = combine(ref, y_static.clone(), want_handle)
        torch.cuda.synchronize()
        assert _bits_equal(combined, want), f"rank {rank} replay {seed}: combined differs from the reference"
    buf.destroy()
    ref.destroy()


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_ll_cuda_graph_of_one_combine_replayed(ranks):
    cluster(ranks).run(rank_ll_graph_of_one_combine, 32, 2048, 8 * ranks, 8)


def rank_ll_call_after_async_call(n, hidden, num_experts, num_topk):
    """A dispatch with async_finish=True (on the Buffer's communication stream, held back there by
    a ~1 ms sleep kernel queued first) and a combine on the caller's stream right after it, the
    dispatch's event never waited on: the Buffer makes the caller's stream wait for it
    (_run_low_latency), so the combine runs after the dispatch (its handle, its slot, the
    acknowledgement the combine's first kernel pays); the output is the reference's, bitwise."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    x, idx, w = (t.to(dev) for t in make_inputs(11, rank, n, hidden, num_experts, num_topk, num_ranks, "random"))
    results = []
    for backend in ("cuda", "reference"):
        buf = _buffer(backend, n, hidden, num_experts)
        y = None
        for _round in range(2):  # the second after a dispatch and combine of the same shape
            if backend == "cuda":
                buf.get_comm_stream().wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(buf.get_comm_stream()):
                    torch.cuda._sleep(2_000_000)
            recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False,
                                                                        async_finish=True)
            if y is None:  # made from the shape alone, on the caller's stream
                y = torch.empty(recv_x.shape, dtype=torch.bfloat16, device=dev).normal_(
                    generator=torch.Generator(device=dev).manual_seed(5 + rank))
            combined, _, _ = buf.low_latency_combine(y, idx, w, handle)
            torch.cuda.synchronize()
            results.append((recv_count.clone(), combined.clone()))
        buf.destroy()
    for step in range(2):
        (got_count, got), (want_count, want) = results[step], results[2 + step]
        assert _bits_equal(got_count, want_count), f"rank {rank} round {step}: recv_count differs"
        assert _bits_equal(got, want), f"rank {rank} round {step}: combined differs from the reference"


@pytest.mark.parametrize("ranks", [1, 2])
def test_ll_cuda_call_after_async_call_is_ordered(ranks):
    cluster(ranks).run(rank_ll_call_after_async_call, 32, 2048, 8 * ranks, 8)


def rank_ll_trace(use_hook, partials):
    """The phase timeline (CudaLowLatency.trace, read by tools/profile/ll_profile.py): every block of every
    kernel stamps its points in order, and the receive kernels' stamps follow the sends'. The send
    role of a combine by partial sums passes kTraceArrived (its first peer's requests) before
    kTraceSignalled (its partials)."""
    with env_var("EPCOMM_LL_COMBINE_PARTIALS", int(partials)):
        _ll_trace(use_hook, partials)


def _ll_trace(use_hook, partials):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    n, hidden, num_experts = 32, 1024, 4 * num_ranks
    x, idx, w = (t.to(dev) for t in make_inputs(5, rank, n, hidden, num_experts, 4, num_ranks, "random"))
    buf = _buffer("cuda", n, hidden, num_experts)
    # the mode taken (else the partial sums' order below would go untested)
    assert buf.low_latency_ops.combine_by_partials(num_experts, hidden, n, 4, use_hook) == partials
    # Both phases of a dispatch fit one launch on the device (a kernel whose shared memory outgrew it
    # would send every call through two launches, correct but slower, and nothing else would say so).
    ll = buf.low_latency_ops
    fused = ll.lib.epcomm_ll_dispatch_fused_fit(ll.num_sms) == 1
    assert fused, "ll::dispatch does not fit one block per SM: every dispatch would take two launches"

    traces = buf.low_latency_ops.trace()
    recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=True,
                                                          return_recv_hook=use_hook)
    if use_hook:
        hook()
    _, _, hook = buf.low_latency_combine(torch.ones_like(recv_x[0], dtype=torch.bfloat16), idx, w, handle,
                                         return_recv_hook=use_hook)
    if use_hook:
        hook()
    torch.cuda.synchronize()
    sm_point = 14  # TracePoint kTraceSm, the last point: no time, the block's SM + 1
    for op, t in traces.items():
        t = t.cpu()
        assert t.shape[-1] == sm_point + 1, f"trace points {t.shape[-1]}: kTraceSm is no longer the last"
        sends, recvs = t[..., :sm_point]  # the times
        if op == "dispatch":  # its send role stamps every block's SM; nothing else does
            sms = t[0, :, sm_point][sends[:, 0] > 0]
            assert bool(((sms >= 1) & (sms <= 1024)).all()), f"rank {rank}: SM stamps {sms.tolist()}"
        no_sm = t[1:, :, sm_point] if op == "dispatch" else t[:, :, sm_point]
        assert bool((no_sm == 0).all()), f"rank {rank} {op}: an SM stamp where none belongs"
        for name, plane in (("send", sends), ("receive", recvs)):
            used = plane[(plane > 0).any(dim=1)]
            # A dispatch without a hook is one cooperative kernel (plane 0 only). With a GPU of its
            # own (no MPS, no green context, no rank beside it) a rank's launch must not fall back
            # to the two kernels; ranks sharing a GPU may (too few SMs free at once).
            if name == "receive" and op == "dispatch" and not use_hook:
                alone = num_ranks <= torch.cuda.device_count()
                assert used.shape[0] == 0 or not alone, f"rank {rank}: a dispatch without a hook ran as two kernels"
                continue
            assert used.shape[0] > 0, f"rank {rank} {op} {name}: no block stamped"
            # TracePoint's indices in the order thread 0 passes them (10-13 inside a dispatch send's phases)
            order = [0, 1, 10, 11, 2, 12, 13, 3, 4, 5, 6, 7, 8, 9]
            if partials and op == "combine" and name == "send":
                order = [0, 1, 10, 11, 2, 12, 13, 3, 4, 5, 7, 6, 8, 9]
            for block in used:
                block = block[list(order)]
                passed = block[block > 0]
                assert bool((passed[1:] >= passed[:-1]).all()), f"rank {rank} {op} {name}: stamps out of order {block}"
        if (recvs > 0).any():
            first_recv, first_send = recvs[recvs > 0].min(), sends[sends > 0].min()
            assert int(first_recv) >= int(first_send), f"rank {rank} {op}: receive stamped before the send"
    buf.low_latency_ops.trace(False)
    buf.destroy()


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("use_hook, partials", [(False, False), (True, False), (False, True)])
def test_ll_cuda_phase_timeline(ranks, use_hook, partials):
    cluster(ranks).run(rank_ll_trace, use_hook, partials)


# The NVSHMEM transport: the Buffer in the symmetric heap, with every peer (all), one peer (1) or
# none of them (NVLink peers mapped, as same-node peers are in a multi-node job) reached by NVSHMEM
# puts and signals instead of direct stores.
NVSHMEM_REMOTE = {"all": lambda r, R: set(range(R)) - {r}, "1": lambda r, R: {1} - {r}, "": lambda r, R: set()}
NVSHMEM_CASES = [(LL_CASES[0], "fp8", False), (LL_CASES[1], "bf16", True), (LL_CASES[2], "fp8-ue8m0", False),
                 (LL_CASES[3], "fp8-round", True), (LL_CASES[5], "bf16", False), (LL_CASES[6], "fp8", False)]


def rank_ll_nvshmem():
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    seen = {}
    for remote, expected in NVSHMEM_REMOTE.items():
        with env_var("EPCOMM_LL_TRANSPORT", "nvshmem"), env_var("EPCOMM_LL_REMOTE_RANKS", remote):
            probe = _buffer("cuda", 8, 512, 2 * num_ranks)
            seen[remote] = probe.low_latency_transport()
            probe.destroy()
            assert seen[remote] == ("nvshmem", sorted(expected(rank, num_ranks))), (remote, seen[remote])
            for case, mode, hook in NVSHMEM_CASES:
                rank_ll_case(case, mode, hook, seed=len(seen) + 50)
            rank_ll_graph(32, 1024, 8 * num_ranks, 4)
    return seen


@pytest.mark.skipif(not nvshmem_found(), reason="NVSHMEM not installed (pip install nvidia-nvshmem-cu13)")
@pytest.mark.parametrize("ranks", [r for r in RANKS if r > 1])  # remote peers need a second rank
def test_ll_cuda_nvshmem_transport_matches_reference(ranks):
    """Bitwise equal to the reference through NVSHMEM puts (all peers, one peer) and through the
    symmetric heap's NVLink mappings; CUDA-graph replays too."""
    with fresh_cluster(ranks) as fresh:  # NVSHMEM: initialized once per process
        fresh.run(rank_ll_nvshmem, timeout_s=400)


def rank_two_micro_batches():
    from epcomm.examples.ll_overlap import run_two_micro_batches

    return run_two_micro_batches(backend="cuda", check=True)


def test_ll_cuda_two_micro_batch_overlap_example():
    cluster(2).run(rank_two_micro_batches)


def rank_combine_before_hook():
    """A combine whose dispatch has not been received (hook not called) is refused, not run on garbage."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    n, hidden, num_experts = 8, 512, 4 * num_ranks
    buf = _buffer("cuda", n, hidden, num_experts)
    x, idx, w = (t.to(dev) for t in make_inputs(51, rank, n, hidden, num_experts, 2, num_ranks, "random"))
    recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False,
                                                          return_recv_hook=True)
    with pytest.raises(ValueError, match="call its receive hook first"):
        buf.low_latency_combine(recv_x, idx, w, handle)
    hook()
    out, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
    torch.cuda.synchronize()
    ref = (w * (idx >= 0)).sum(1, keepdim=True).double() * x.double()  # identity experts
    assert torch.allclose(out.double(), ref, rtol=2 ** -7, atol=1e-5), f"rank {rank}"
    buf.destroy()


def test_ll_cuda_combine_before_hook_is_refused():
    cluster(2).run(rank_combine_before_hook)


def rank_checks_after_a_call_of_the_same_shape():
    """A call whose argument shapes passed the checks before skips what is fixed per shape (host
    time, Buffer._ll_checked), never what can differ between calls of one shape: the same shapes
    with a non-contiguous or misaligned tensor, a float size, or a combine before its dispatch's
    receive are still refused, and the Buffer goes on working."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    n, hidden, num_experts = 16, 512, 4 * num_ranks
    buf = _buffer("cuda", n, hidden, num_experts)
    x, idx, w = (t.to(dev) for t in make_inputs(67, rank, n, hidden, num_experts, 2, num_ranks, "random"))

    def step(x_in=x, ids=idx, num_max=n, experts=num_experts):
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x_in, ids, num_max, experts, use_fp8=False)
        return buf.low_latency_combine(recv_x, idx, w, handle)[0]

    want = step().clone()
    step()  # both slots have seen these shapes
    strided_x = x.t().contiguous().t()  # same shape, transposed strides
    shifted_x = torch.empty(n * hidden + 1, dtype=torch.bfloat16, device=dev)[1:].view(n, hidden)
    shifted_x.copy_(x)  # contiguous, 2 bytes past a 16-byte boundary
    strided_idx = idx.t().contiguous().t() if idx.shape[1] > 1 else idx[:, :1].expand(n, 1)
    for what, args, error, message in (
            ("non-contiguous x", {"x_in": strided_x}, ValueError, "x must be contiguous"),
            ("misaligned x", {"x_in": shifted_x}, ValueError, "16-byte aligned"),
            ("non-contiguous topk_idx", {"ids": strided_idx}, ValueError, "contiguous"),
            ("float N", {"num_max": float(n)}, TypeError, "must be an int"),
            ("float num_experts", {"experts": float(num_experts)}, TypeError, "must be an int")):
        try:
            step(**args)
        except error as e:
            assert message in str(e), f"rank {rank}, {what}: {e}"
        else:
            raise AssertionError(f"rank {rank}: {what} was accepted after a call of the same shapes")
    recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False,
                                                          return_recv_hook=True)
    with pytest.raises(ValueError, match="has not been received yet"):
        buf.low_latency_combine(recv_x, idx, w, handle)
    hook()
    buf.low_latency_combine(recv_x, idx, w, handle)
    torch.cuda.synchronize()
    assert _bits_equal(step(), want), f"rank {rank}: the Buffer no longer works after the refusals"
    torch.cuda.synchronize()
    buf.destroy()


def test_ll_cuda_checks_after_a_call_of_the_same_shape():
    cluster(1).run(rank_checks_after_a_call_of_the_same_shape)


def rank_invalid_inputs_raise_everywhere():
    """The kernels check topk_idx on the GPU (a host check would sync): a rank's invalid ids, or a
    combine given other ids than its dispatch, make every rank raise ValueError at the same later
    call (the next call of the slot), naming the rank; the entries were dropped, nothing else
    happened, and the Buffer goes on working."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    n, hidden, num_experts = 16, 512, 4 * num_ranks
    buf = _buffer("cuda", n, hidden, num_experts)
    x, idx, w = (t.to(dev) for t in make_inputs(61, rank, n, hidden, num_experts, 2, num_ranks, "random"))

    def step(ids, combine_ids=None):
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, ids, n, num_experts, use_fp8=False)
        out, _, _ = buf.low_latency_combine(recv_x, ids if combine_ids is None else combine_ids, w, handle)
        return out

    want = step(idx).clone()  # identity experts: a reference for the valid calls
    for bad, culprit in (("id past num_experts", num_experts), ("id below -1", -2), ("combine ids", None)):
        dispatch_ids, combine_ids = idx.clone(), None
        if culprit is None:
            combine_ids = idx.clone()
            if rank == 1:
                combine_ids[0, 0] = (combine_ids[0, 0] + 1) % num_experts
        elif rank == 1:
            dispatch_ids[3, 1] = culprit
        step(dispatch_ids, combine_ids)
        what = "differs from the one of its dispatch" if culprit is None else "invalid topk_idx"
        # The next call of the faulty call's slot raises: this step's dispatch for a faulty dispatch,
        # its combine for a faulty combine.
        with pytest.raises(ValueError, match=rf"rank\(s\) \[1\] .*{what}"):
            step(idx)
        step(idx)  # the refused call launched nothing, on every rank: the ranks stay in step
        torch.cuda.synchronize()
        assert _bits_equal(step(idx), want), f"rank {rank} after {bad}: the Buffer no longer works"
    torch.cuda.synchronize()
    buf.destroy()


@pytest.mark.parametrize("ranks", [2, 4])
def test_ll_cuda_invalid_inputs_raise_on_every_rank(ranks):
    cluster(ranks).run(rank_invalid_inputs_raise_everywhere)


def _ll_outputs(buf, x, topk_idx, weights, n, num_experts, flags, combine: bool) -> dict:
    """One dispatch (and, with ``combine``, a combine of its rows times (local expert + 1) / 4) of
    ``buf``, its outputs copied."""
    poison_allocator(x.device)
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, n, num_experts, **flags)
    out = dict(rows=_valid_rows(recv_x, recv_count), recv_count=recv_count.clone(),
               layout_range=handle.layout_range.clone(), src_info=handle.src_info.clone())
    if combine:
        y = _expert_stand_in(recv_x, flags["use_fp8"])
        out["combined"] = buf.low_latency_combine(y, topk_idx, weights, handle)[0].clone()
    torch.cuda.synchronize()
    return out


def _arrival_key_of_slot(buf, slot: int) -> int:
    """The slot's arrival key in the CUDA buffer's header (low_latency.cuh kArrivalKeyOffset)."""
    return int(buf.low_latency_ops.shared.tensor[48:64].view(torch.int64)[slot])


def rank_ll_arrival(senders: str = "auto"):
    """Dispatch by arrival (EPCOMM_LL_ARRIVAL=1, the default; low_latency.cuh): a buffer's first FP8
    dispatch of a shape in a slot goes the counted way and poisons the slot's arrival area, the next
    ones there go by arrival; a call of another format or shape between (which may write over the
    area) makes the next one poison it again. The slot's key, read before each dispatch, must be what
    that rule says (so the test knows which calls went by arrival: most of them); every output of the
    sequence bitwise the reference's, fresh inputs each call, with T < N and T = 0 on some ranks;
    dispatches without a combine between so that both slots see each path. ``senders``:
    EPCOMM_LL_DISPATCH_SENDERS (few senders give each several tokens by stride, send_plan)."""
    from epcomm.backends.cuda.low_latency import area_tag, arrival_message_bytes

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    hidden, num_experts, num_topk = 7168, 36 * num_ranks, 8
    e_local = num_experts // num_ranks
    with env_var("EPCOMM_LL_DISPATCH_SENDERS", senders):
        cuda, ref = (_buffer(b, 128, hidden, num_experts) for b in ("cuda", "reference"))
    fp8, bf16 = mode_flags("fp8"), mode_flags("bf16")
    # (N, tokens of this rank, format, with a combine)
    steps = ([(128, 128, fp8, True)] * 3 + [(128, 77, fp8, False)] * 2 + [(128, 128, bf16, True)] +
             [(128, (128, 0, 77)[rank % 3], fp8, True)] * 3 + [(16, (16, 3, 0)[rank % 3], fp8, True)] * 3 +
             [(128, 128, mode_flags("fp8-round"), False)] * 3 + [(128, 128, mode_flags("fp8-ue8m0"), True)] +
             [(128, 100, fp8, True)] * 3)
    keys = [0, 0]  # the rule's model of the header's keys
    went_by_arrival = 0
    for i, (n, tokens, flags, combine) in enumerate(steps):
        tag = f"rank={rank} R={num_ranks} step={i} N={n} T={tokens} {flags} combine={combine}"
        amsg = arrival_message_bytes(hidden, num_topk, flags["use_fp8"], flags["use_ue8m0"])
        key = area_tag(hidden, num_experts, n) << 32 | amsg if amsg else 0
        slot = cuda._ll_counter % 2
        assert _arrival_key_of_slot(cuda, slot) == keys[slot], tag
        went_by_arrival += bool(amsg) and keys[slot] == key
        keys[slot] = key
        if combine:  # the combine's slot keeps a key of its own area
            other = 1 - slot
            if keys[other] >> 32 != area_tag(hidden, num_experts, n):
                keys[other] = 0
        x, topk_idx, weights = (t.to(dev) for t in make_inputs(300 + i, rank, tokens, hidden, num_experts, num_topk,
                                                               num_ranks, "random"))
        got = _ll_outputs(cuda, x, topk_idx, weights, n, num_experts, flags, combine)
        want = _ll_outputs(ref, x, topk_idx, weights, n, num_experts, flags, combine)
        for name in ("recv_count", "layout_range", "src_info"):
            assert _bits_equal(got[name], want[name]), f"{tag}: {name} differs from the reference backend"
        if combine:  # by partial sums (auto from 64 tokens): within their bf16 rounding on several ranks
            bound = (partials_bound(x, topk_idx, weights, lambda e: (e % e_local).float().add(1) / 4)
                     if cuda.low_latency_ops.last_combine_partials and num_ranks > 1 else None)
            assert combined_matches(got["combined"], want["combined"], bound), f"{tag}: combined differs"
        assert len(got["rows"]) == len(want["rows"]), tag
        for j, (a, b) in enumerate(zip(got["rows"], want["rows"])):
            assert _bits_equal(a, b), f"{tag}: received rows of part {j} differ from the reference backend"
    assert went_by_arrival >= 8, went_by_arrival
    cuda.destroy()
    ref.destroy()


@pytest.mark.parametrize("ranks", RANKS)
def test_ll_cuda_dispatch_by_arrival(ranks):
    cluster(ranks).run(rank_ll_arrival, timeout_s=300)


# 5: 26 tokens a sender by stride at T = 128 (16 at 77, 4 at N = 16); 40: 4, 2 and 1 (split parts).
@pytest.mark.parametrize("senders", ["5", "40"])
@pytest.mark.parametrize("ranks", [1, 4])
def test_ll_cuda_dispatch_by_arrival_few_senders(ranks, senders):
    cluster(ranks).run(rank_ll_arrival, senders, timeout_s=300)


def rank_ll_cuda_fuzz(max_examples: int):
    """Random valid and invalid low-latency arguments on the CUDA backend (one rank): each call is
    refused at once (ValueError/TypeError: what the host can see), or reported by the next call of
    its slot (values, found on the GPU), or its outputs equal the reference backend's bit for bit;
    never an illegal memory access (the session would die)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    dev = torch.device("cuda", torch.cuda.current_device())
    n_max, h_max, e_max = 24, 1024, 64
    size = Buffer.get_low_latency_rdma_size_hint(n_max, h_max, 1, e_max)
    cuda = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, backend="cuda")
    ref = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, backend="reference")
    seen = {"valid": 0, "refused": 0, "reported": 0}

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data):
        n = data.draw(st.integers(1, n_max))
        t = data.draw(st.integers(0, n))
        hidden = data.draw(st.sampled_from([128, 512, 640, 1024]))
        num_experts = data.draw(st.sampled_from([1, 3, 16, 64]))
        k = data.draw(st.integers(1, 8))
        mode = data.draw(st.sampled_from(["bf16", "fp8", "fp8-round", "fp8-ue8m0"]))
        fault = data.draw(st.sampled_from([None, None, None, "id too large", "id below -1", "expert twice",
                                           "combine ids", "too many tokens", "x dtype", "topk int32",
                                           "x non-contiguous", "ue8m0 without round", "weights dtype",
                                           "combine x shape"]))
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16)))
        x = (torch.randn((t, hidden), generator=gen) * 3).to(torch.bfloat16).to(dev)
        # Distinct experts per token (a token naming one twice is a fault of its own), ~1/8 dropped.
        chosen = torch.rand((t, num_experts), generator=gen).argsort(1)[:, :min(k, num_experts)]
        idx = torch.full((t, k), -1, dtype=torch.int64)
        idx[:, :chosen.shape[1]] = chosen
        idx[torch.rand((t, k), generator=gen) < 0.125] = -1
        idx = idx.to(dev)
        w = torch.rand((t, k), generator=gen).to(dev)
        fp8 = mode != "bf16"
        kwargs = dict(use_fp8=fp8, round_scale=mode in ("fp8-round", "fp8-ue8m0"), use_ue8m0=mode == "fp8-ue8m0")
        if fp8 and hidden % (512 if kwargs["use_ue8m0"] else 128):
            fault = "hidden for this mode"  # refused: not a valid shape for the chosen mode
        needs_tokens = ("id too large", "id below -1", "expert twice", "combine ids", "x non-contiguous",
                        "weights dtype")
        if fault in needs_tokens and t == 0 or fault == "expert twice" and (k < 2 or t < n):
            fault = None
        x_in, idx_in, w_in, n_in = x, idx, w, n
        if fault == "id too large":
            idx[t // 2, 0] = num_experts
        if fault == "id below -1":
            idx[t // 2, k - 1] = -3
        if fault == "expert twice":  # with T = N, an expert named twice by every token needs 2N rows
            idx[:, 0] = 0
            idx[:, 1] = 0
        if fault == "too many tokens":
            n_in = max(t - 1, 1) if t > 1 else 0
        if fault == "x dtype":
            x_in = x.half()
        if fault == "topk int32":
            idx_in = idx.int()
        if fault == "x non-contiguous":
            x_in = torch.cat([x, x], 1)[:, ::2]
        if fault == "ue8m0 without round":
            kwargs["round_scale"] = False
            kwargs["use_ue8m0"] = True
        if fault == "weights dtype":
            w_in = w.double()
        if fault == "too many tokens" and n_in == 0:
            fault = None
            n_in = n
        value_fault = fault in ("id too large", "id below -1", "expert twice", "combine ids")
        try:
            got_x, got_count, handle, _, _ = cuda.low_latency_dispatch(x_in, idx_in, n_in, num_experts, **kwargs)
            y = (got_x[0].float() if fp8 else got_x.float()).nan_to_num().clamp(-100, 100).to(torch.bfloat16)
            if fault == "combine x shape":
                y = y[:, :, : hidden // 2].contiguous()
            combine_ids = idx.clone() if fault == "combine ids" else idx_in
            if fault == "combine ids":
                combine_ids[0, 0] = (combine_ids[0, 0] + 2) % max(num_experts, 1)
                if torch.equal(combine_ids, idx):
                    combine_ids[0, 0] = -1 if int(idx[0, 0]) != -1 else 0
            got = cuda.low_latency_combine(y, combine_ids, w_in, handle)[0]
        except (ValueError, TypeError) as error:
            assert fault is not None and not value_fault, f"{fault}: valid arguments refused: {error}"
            seen["refused"] += 1
            return
        if value_fault:  # found on the GPU: the next call of the faulty call's slot raises it
            with pytest.raises(ValueError, match="invalid topk_idx|differs from the one of its dispatch"):
                for _ in range(2):  # valid calls (no expert at all), so they leave no error of their own
                    cuda.low_latency_dispatch(x, torch.full_like(idx, -1), n, num_experts, use_fp8=False)
            torch.cuda.synchronize()
            seen["reported"] += 1
            return
        assert fault is None, f"{fault} was not refused"
        want_x, want_count, want_handle, _, _ = ref.low_latency_dispatch(x_in, idx_in, n_in, num_experts, **kwargs)
        want = ref.low_latency_combine(y, idx_in, w_in, want_handle)[0]
        tag = f"T={t} N={n} H={hidden} E={num_experts} K={k} {mode}"
        assert same_bits(got_count, want_count), f"{tag}: recv_count differs"
        parts = zip(got_x, want_x) if fp8 else [(got_x, want_x)]
        for a, b in parts:
            for e in range(a.shape[0]):
                c = int(want_count[e])
                assert same_bits(a[e, :c], b[e, :c]), f"{tag}: expert {e} rows differ"
        assert same_bits(got, want), f"{tag}: combine differs"
        seen["valid"] += 1

    check()
    torch.cuda.synchronize()
    cuda.destroy()
    ref.destroy()
    return seen


def test_ll_cuda_bad_input_fuzz():
    (seen,) = cluster(1).run(rank_ll_cuda_fuzz, 80, timeout_s=600)
    assert seen["valid"] and seen["refused"] and seen["reported"], seen
