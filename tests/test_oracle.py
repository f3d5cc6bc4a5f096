"""The portable path (reference backend on gloo ranks) against the single-process oracle, bit for bit.

Every rank rebuilds every rank's inputs, runs the call through a Buffer, and compares its own outputs
with the oracle's for it: dispatch is a copy and the oracle sums in the order the path does, so
every output must be equal bitwise (the rows past a call's valid ones only where the API defines them).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from conftest import cluster, env_var
from routing import device, make_inputs

from epcomm import Buffer, Config, oracle
from epcomm.backends.reference import low_latency as reference_ll
from epcomm.backends.reference import normal as reference_normal
from epcomm.backends.reference import ops as reference_ops
from epcomm.bench.checks import same_bits
from epcomm.fp8 import per_token_cast_back, per_token_cast_to_fp8


def _host(t):
    return tuple(_host(u) for u in t) if isinstance(t, tuple) else t.cpu() if t is not None else None


def _equal(got, want) -> bool:
    """Bitwise equality of tensors or (data, scales) pairs (whatever their strides)."""
    if isinstance(want, tuple):
        return isinstance(got, tuple) and len(got) == len(want) and all(_equal(g, w) for g, w in zip(got, want))
    return same_bits(got.contiguous(), want.contiguous())


def _rows(x, n: int):
    return tuple(t[:n] for t in x) if isinstance(x, tuple) else x[:n]


# What rank d (normal mode) or expert g % 3 (low latency) multiplies its rows by before a combine: large
# terms of opposite signs beside small ones, so that only the oracle's summation order gives its bits.
SCALES = (2.0 ** 20, -(2.0 ** 20), 1.0, 3.0)


def rank_normal(cases: list[tuple], fixed: tuple[bool, bool] = (False, False)) -> int:
    """Each case: (tokens per rank, hidden, experts, top-k, routing, seed, fp8, alignment, num_worst_tokens, bias).
    ``fixed``: whether the dispatch, and the cached dispatch and combine, take a graph's fixed sizes
    (graph_sizes; a handle of a fixed-size dispatch keeps them in eager calls)."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = device()
    buf = Buffer(dist.group.WORLD, Config().get_nvl_buffer_size_hint(1024 * 2, num_ranks), backend="reference")
    checked = 0
    for tokens, hidden, experts, topk, routing, seed, fp8, align, worst, bias in cases:
        tag = (f"rank={rank} R={num_ranks} T={tokens} H={hidden} E={experts} K={topk} routing={routing} "
               f"seed={seed} fp8={fp8} align={align} worst={worst} bias={bias}")
        inputs = [make_inputs(seed, r, tokens[r], hidden, experts, topk, num_ranks, routing) for r in range(num_ranks)]
        xs = [per_token_cast_to_fp8(x) if fp8 else x for x, _, _ in inputs]
        idxs, ws = [i for _, i, _ in inputs], [w for _, _, w in inputs]
        x, idx, w = xs[rank], idxs[rank], ws[rank]
        on_dev = (lambda t: tuple(u.to(dev) for u in t)) if fp8 else (lambda t: t.to(dev))

        layout = buf.get_dispatch_layout(idx.to(dev), experts)
        want_layout = oracle.dispatch_layout(idx, experts, num_ranks)
        for name, got, want in zip(("per_rank", "per_domain", "per_expert", "in_rank"), layout, want_layout):
            assert (got is None and want is None) or _equal(got.cpu(), want), f"{tag}: layout {name}"

        if fixed[0]:  # the eager dispatch before a capture: the ranks agree on the shapes
            buf.dispatch(on_dev(x), num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                         num_tokens_per_expert=layout[2], topk_idx=idx.to(dev), topk_weights=w.to(dev),
                         num_worst_tokens=worst)
        with graph_sizes(fixed[0]):
            recv_x, recv_idx, recv_w, expert_list, handle, _ = buf.dispatch(
                on_dev(x), num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                num_tokens_per_expert=layout[2], topk_idx=idx.to(dev), topk_weights=w.to(dev),
                expert_alignment=align, num_worst_tokens=worst)
        everyone = oracle.dispatch(xs, idxs, experts, topk_weights=ws, expert_alignment=align, num_worst_tokens=worst)
        want = everyone[rank]
        assert _equal(_host(recv_x), want.x), f"{tag}: recv_x"
        assert _equal(recv_idx.cpu(), want.topk_idx), f"{tag}: recv_topk_idx"
        assert _equal(recv_w.cpu(), want.topk_weights), f"{tag}: recv_topk_weights"
        assert expert_list == want.expert_counts, f"{tag}: expert list {expert_list} != {want.expert_counts}"
        in_ranks = [oracle.dispatch_layout(i, experts, num_ranks)[3] for i in idxs]
        assert bool(handle.backend_state.get("fixed")) == fixed[0], f"{tag}: fixed sizes {fixed}"
        prefix = oracle.count_matrix(in_ranks).cumsum(0).to(torch.int32)
        if not fixed[0]:  # a fixed-size handle has no count matrix on the host
            assert _equal(handle[0].cpu(), prefix), f"{tag}: handle[0] (rank prefix matrix)"

        # Cached dispatch of new rows along the same routing.
        xs2 = [per_token_cast_to_fp8(x * 3) if fp8 else x * 3 for x, _, _ in inputs]
        with graph_sizes(fixed[1]):
            cached_x = buf.dispatch(on_dev(xs2[rank]), handle=handle)[0]
        want_cached = oracle.dispatch_to(rank, xs2, None, experts, num_worst_tokens=worst, in_ranks=in_ranks)
        assert _equal(_host(cached_x), want_cached.x), f"{tag}: cached recv_x"

        # Combine: rank d returns its received rows (dequantized) times SCALES[d]; rows past them are
        # NaN, which the combine must not read. The scales cancel, so another order of the fp32 sum, or
        # the biases added earlier, or a rounding to bf16 before the end would give other bits.
        ys, ws_back = [], []
        for d, got in enumerate(everyone):
            rows = per_token_cast_back(*got.x) if fp8 else got.x
            y = (rows.float() * SCALES[d]).to(torch.bfloat16)
            y[got.num_recv:] = float("nan")
            ys.append(y)
            ws_back.append(got.topk_weights)
        biases = None
        if bias:
            gen = torch.Generator().manual_seed(seed + 7)
            biases = [tuple(torch.randn((n, hidden), generator=gen).to(torch.bfloat16) for _ in range(2))
                      for n in tokens]
        with graph_sizes(fixed[1]):
            combined, combined_w, _ = buf.combine(ys[rank].to(dev), handle, topk_weights=ws_back[rank].to(dev),
                                                  bias=tuple(b.to(dev) for b in biases[rank]) if bias else None)
        want_x, want_w = oracle.combine(ys, in_ranks, ws_back, biases)[rank]
        assert _equal(combined.cpu(), want_x), f"{tag}: combined_x"
        assert _equal(combined_w.cpu(), want_w), f"{tag}: combined_topk_weights"
        checked += want.num_recv
    return checked


NORMAL = {
    # ranks: [(tokens per rank, hidden, experts, top-k, routing, seed, fp8, alignment, num_worst_tokens, bias)]
    2: [([40, 23], 256, 8, 4, "random", 1, False, 1, 0, False),
        ([40, 23], 256, 8, 4, "random", 2, True, 4, 0, True),
        ([16, 16], 128, 4, 2, "all_dropped", 3, True, 1, 0, False),
        ([1, 0], 128, 4, 4, "random", 4, False, 1, 8, True)],
    3: [([20, 0, 9], 128, 6, 2, "one_expert", 5, False, 2, 0, True),
        ([12, 12, 12], 384, 12, 3, "random", 6, True, 1, 36, False)],
    4: [([32, 0, 17, 1], 128, 16, 4, "random", 7, True, 1, 0, False),
        ([24, 24, 24, 24], 256, 16, 4, "empty_rank", 8, False, 8, 0, True),
        ([30, 5, 0, 12], 128, 16, 4, "imbalanced", 9, True, 1, 120, True),
        ([0, 0, 0, 0], 128, 16, 4, "random", 10, False, 1, 0, False)],
}


@pytest.mark.parametrize("ranks", sorted(NORMAL))
def test_normal_mode_equals_the_oracle(ranks):
    cluster(ranks).run(rank_normal, NORMAL[ranks])


# What a CUDA graph captures: num_worst_tokens, every rank the same number of tokens.
NORMAL_GRAPH = {
    2: [([12, 12], 256, 8, 4, "random", 11, False, 1, 24, True),
        ([16, 16], 128, 8, 4, "random", 12, True, 1, 32, False),
        ([16, 16], 128, 4, 2, "all_dropped", 13, False, 1, 32, False)],
    3: [([9, 9, 9], 384, 12, 3, "random", 14, True, 1, 27, True)],
    4: [([8, 8, 8, 8], 256, 16, 4, "imbalanced", 15, False, 1, 32, False),
        ([0, 0, 0, 0], 128, 16, 4, "random", 16, False, 1, 4, False)],
}


@pytest.mark.parametrize("fixed", [(True, True), (True, False)], ids=["graph", "graph-dispatch"])
@pytest.mark.parametrize("ranks", sorted(NORMAL_GRAPH))
def test_normal_graph_sizes_equal_the_oracle(ranks, fixed):
    """The fixed-size calls a CUDA graph captures (and eager calls on their handles) against the oracle."""
    cluster(ranks).run(rank_normal, NORMAL_GRAPH[ranks], fixed)


def rank_layout_in_domains(ranks_per_domain: int) -> bool:
    """get_dispatch_layout with several scale-up domains: the tokens per domain too."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    with env_var("EPCOMM_RANKS_PER_DOMAIN", ranks_per_domain):
        buf = Buffer(dist.group.WORLD, 32 << 20, backend="reference")
    for tokens, routing in ((37, "random"), (0, "random"), (20, "empty_rank")):
        tag = f"rank={rank} R={num_ranks} ranks_per_domain={ranks_per_domain} T={tokens} routing={routing}"
        idx = make_inputs(61, rank, tokens, 128, 4 * num_ranks, 3, num_ranks, routing)[1]
        got = buf.get_dispatch_layout(idx.to(device()), 4 * num_ranks)
        want = oracle.dispatch_layout(idx, 4 * num_ranks, num_ranks, ranks_per_domain)
        for name, g, w in zip(("per_rank", "per_domain", "per_expert", "in_rank"), got, want):
            assert w is not None and _equal(g.cpu(), w), f"{tag}: layout {name}"
    buf.destroy()
    return True


@pytest.mark.parametrize("ranks_per_domain", [1, 2])
def test_layout_in_domains_equals_the_oracle(ranks_per_domain):
    cluster(4).run(rank_layout_in_domains, ranks_per_domain)


@contextlib.contextmanager
def graph_sizes(on: bool):
    """The reference calls as a CUDA graph capture makes them (no handshake, fixed sizes, nothing read on
    the host), forced on CPU ranks when ``on``."""
    modules = (reference_ll, reference_normal, reference_ops)
    saved = [m.in_graph for m in modules]
    for m in modules if on else ():
        m.in_graph = lambda device: True
    try:
        yield
    finally:
        for m, f in zip(modules, saved, strict=True):
            m.in_graph = f


def rank_low_latency(cases: list[tuple], fixed: tuple[bool, bool] = (False, False)) -> int:
    """Each case: (tokens per rank, N, hidden, experts, top-k, routing, seed, mode, masked rank or None).
    ``fixed``: whether the dispatch and the combine take the graph's fixed sizes (graph_sizes)."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = device()
    checked = 0
    for tokens, n, hidden, experts, topk, routing, seed, mode, masked_rank in cases:
        tag = (f"rank={rank} R={num_ranks} T={tokens} N={n} H={hidden} E={experts} K={topk} routing={routing} "
               f"seed={seed} mode={mode} masked={masked_rank}")
        use_fp8, round_scale, use_ue8m0 = mode != "bf16", mode in ("fp8-round", "fp8-ue8m0"), mode == "fp8-ue8m0"
        masked = {masked_rank} if masked_rank is not None else None
        inputs = [make_inputs(seed, r, tokens[r], hidden, experts, topk, num_ranks, routing) for r in range(num_ranks)]
        xs, idxs, ws = ([t[i] for t in inputs] for i in range(3))
        buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(n, hidden, num_ranks, experts),
                     low_latency_mode=True, backend="reference", enable_shrink=masked is not None)
        if masked is not None:
            buf.low_latency_update_mask_buffer(masked_rank, True)
        with graph_sizes(fixed[0]):
            recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(
                xs[rank].to(dev), idxs[rank].to(dev), n, experts, use_fp8=use_fp8, round_scale=round_scale,
                use_ue8m0=use_ue8m0)
        everyone = oracle.low_latency_dispatch(xs, idxs, experts, n, use_fp8=use_fp8, round_scale=round_scale,
                                               use_ue8m0=use_ue8m0, masked=masked)
        want = everyone[rank]
        assert _equal(recv_count.cpu(), want.count), f"{tag}: recv_count {recv_count.tolist()}"
        assert _equal(handle.layout_range.cpu(), want.layout_range), f"{tag}: layout_range"
        assert _equal(handle.src_info.cpu(), want.src_info), f"{tag}: src_info"
        got_x = _host(recv_x)
        for e, c in enumerate(want.count.tolist()):  # rows past the count are unspecified
            assert _equal(_rows(tuple(t[e] for t in got_x) if use_fp8 else got_x[e], c),
                          _rows(tuple(t[e] for t in want.x) if use_fp8 else want.x[e], c)), f"{tag}: expert {e} rows"

        # Combine twice: with the routing's weights, expert g returning its rows times (g + 1) / 2; then
        # with unit weights, expert g its rows times SCALES[g % 3], which cancel, so that a sum in another
        # slot order would give other bits. Rows past the count are NaN: the combine must not read them.
        e_local = experts // num_ranks
        for step, weights, scale in (("", ws, lambda g: (g + 1) / 2),
                                     (" of cancelling experts", [torch.ones_like(w) for w in ws],
                                      lambda g: SCALES[g % 3])):
            ys = []
            for d, got in enumerate(everyone):
                y = torch.full((e_local, n * num_ranks, hidden), float("nan"), dtype=torch.bfloat16)
                for e, c in enumerate(got.count.tolist()):
                    rows = per_token_cast_back(got.x[0][e, :c], got.x[1][e, :c]) if use_fp8 else got.x[e, :c]
                    y[e, :c] = (rows.float() * scale(d * e_local + e)).to(torch.bfloat16)
                ys.append(y)
            with graph_sizes(fixed[1]):
                combined, _, _ = buf.low_latency_combine(ys[rank].to(dev), idxs[rank].to(dev),
                                                         weights[rank].to(dev), handle)
            want_combined = oracle.low_latency_combine(ys, [g.src_info for g in everyone],
                                                       [g.layout_range for g in everyone], idxs, weights, experts,
                                                       masked=masked)[rank]
            assert _equal(combined.cpu(), want_combined), f"{tag}: combined_x{step}"
        checked += int(want.count.sum())
    return checked


LOW_LATENCY = {
    # ranks: [(tokens per rank, N, hidden, experts, top-k, routing, seed, mode, masked rank)]
    2: [([8, 5], 8, 512, 8, 4, "random", 50, "fp8", None),
        ([8, 5], 8, 256, 8, 4, "random", 51, "bf16", None),
        ([0, 0], 4, 512, 4, 2, "random", 52, "fp8-ue8m0", None),
        ([1, 1], 1, 512, 4, 4, "random", 53, "fp8-round", None)],
    3: [([4, 0, 4], 4, 1024, 6, 2, "one_expert", 54, "fp8", None),
        ([5, 5, 5], 8, 512, 12, 3, "random", 55, "bf16", 1)],
    4: [([16, 0, 3, 16], 16, 512, 16, 4, "random", 56, "fp8-ue8m0", None),
        ([5, 5, 5, 5], 8, 512, 16, 3, "empty_rank", 57, "fp8", None),
        ([6, 6, 6, 6], 6, 256, 8, 2, "imbalanced", 58, "bf16", None),
        ([8, 8, 8, 8], 8, 512, 16, 3, "random", 59, "fp8", 3)],
}


@pytest.mark.parametrize("ranks", sorted(LOW_LATENCY))
def test_low_latency_mode_equals_the_oracle(ranks):
    cluster(ranks).run(rank_low_latency, LOW_LATENCY[ranks])


@pytest.mark.parametrize("fixed", [(True, True), (True, False), (False, True)],
                         ids=["graph", "graph-dispatch", "graph-combine"])
@pytest.mark.parametrize("ranks", sorted(LOW_LATENCY))
def test_low_latency_graph_sizes_equal_the_oracle(ranks, fixed):
    """The fixed-size calls a CUDA graph captures, and handles of one kind used by calls of the other."""
    cluster(ranks).run(rank_low_latency, LOW_LATENCY[ranks], fixed)


def test_oracle_on_hand_made_routing():
    """The oracle's definitions on a routing small enough to write out: two ranks, two experts each."""
    x = [torch.arange(6, dtype=torch.bfloat16).view(3, 2), -torch.arange(1, 5, dtype=torch.bfloat16).view(2, 2)]
    idx = [torch.tensor([[3, 0], [-1, 1], [2, -1]]), torch.tensor([[0, 1], [2, 3]])]
    w = [torch.tensor([[0.5, 0.25], [0.0, 1.0], [2.0, 0.0]]), torch.tensor([[1.0, 2.0], [3.0, 4.0]])]
    per_rank, per_domain, per_expert, in_rank = oracle.dispatch_layout(idx[0], 4, 2)
    assert per_rank.tolist() == [2, 2] and per_domain is None and per_expert.tolist() == [1, 1, 1, 1]
    assert in_rank.tolist() == [[True, True], [True, False], [False, True]]
    got = oracle.dispatch(x, idx, 4, topk_weights=w, expert_alignment=4)
    # Rank 1 receives rank 0's tokens 0 and 2, then rank 1's token 1, with local ids.
    assert got[1].x.tolist() == [[0, 1], [4, 5], [-3, -4]]
    assert got[1].topk_idx.tolist() == [[1, -1], [0, -1], [0, 1]]
    assert got[1].topk_weights.tolist() == [[0.5, 0.0], [2.0, 0.0], [3.0, 4.0]]
    assert got[1].expert_counts == [4, 4] and got[1].recv_counts == [2, 1]
    assert oracle.count_matrix([in_rank, oracle.dispatch_layout(idx[1], 4, 2)[3]]).tolist() == [[2, 2], [1, 1]]
    in_ranks = [oracle.dispatch_layout(i, 4, 2)[3] for i in idx]
    back = oracle.combine([d.x for d in got], in_ranks)
    assert back[0][0].tolist() == [[0, 2], [2, 3], [4, 5]]  # token 0 came back from both ranks
    ll = oracle.low_latency_dispatch(x, idx, 4, 4, use_fp8=False)
    assert ll[0].count.tolist() == [2, 2] and ll[0].layout_range[0].tolist() == [1, (1 << 32) | 1]
    assert ll[0].src_info[0, :2].tolist() == [0, 0]
    ys = [d.x for d in ll]  # identity experts: the combine is sum_k w_k x
    out = oracle.low_latency_combine(ys, [d.src_info for d in ll], [d.layout_range for d in ll], idx, w, 4)
    assert out[0].tolist() == [[0, 0.75], [2, 3], [8, 10]]


def rank_graph_refusals() -> bool:
    """What a captured portable dispatch cannot do raises on every rank: no num_worst_tokens, ranks with
    different token counts; rows past num_worst_tokens, dropped in the graph, raise at the next eager call."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = device()
    buf = Buffer(dist.group.WORLD, Config().get_nvl_buffer_size_hint(256 * 2, num_ranks), backend="reference")

    def call(tokens: int, worst: int, graph: bool):
        x, idx, w = (t.to(dev) for t in make_inputs(20, rank, tokens, 128, 8, 4, num_ranks, "random"))
        layout = buf.get_dispatch_layout(idx, 8)
        with graph_sizes(graph):
            return buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w, num_worst_tokens=worst)

    with pytest.raises(RuntimeError, match="inside a CUDA graph a dispatch needs num_worst_tokens"):
        call(8, 0, True)
    call(8 + rank, 64, False)  # eager: the ranks' token counts differ
    with pytest.raises(RuntimeError, match=r"needs every rank to dispatch the same number of tokens"):
        call(8, 64, True)
    call(8, 64, False)
    call(8, 1, True)  # every rank receives more than one row: dropped, flagged on the device
    with pytest.raises((RuntimeError, ValueError), match=r"received more rows than num_worst_tokens|refused"):
        call(8, 64, False)
    recv_x = call(8, 64, False)[0]  # raised once: the Buffer goes on
    assert recv_x.shape[0] == 64
    return True


def test_graph_sizes_refuse_what_a_graph_cannot_do():
    assert all(cluster(2).run(rank_graph_refusals))
