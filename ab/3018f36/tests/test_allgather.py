"""The allgather strategy (``Buffer(strategy="allgather")``) against the all-to-all strategy, on 2-4 ranks.

Dispatch is a copy, so every output must equal the all-to-all strategy's bit for bit (rows, FP8
bytes and scale layout, top-k ids and weights, expert counts, cached dispatch). Combine must agree
exactly on gloo (same summation order) and within one bf16 unit in the last place on NCCL, whose
reduce-scatter sums in its own order.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import BACKEND, cluster
from routing import device, make_inputs

import epcomm
from epcomm import Buffer, Config
from epcomm.backends.reference.backend import check_strategy, mark_strategy
from epcomm.bench.checks import same_bits


def _bf16_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 units in the last place (0.0 and -0.0 are the same point)."""
    def key(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return int((key(a) - key(b)).abs().max()) if a.numel() else 0


def _same(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is b
    layout = [s for s, n in zip(a.stride(), a.shape) if n > 1] == [s for s, n in zip(b.stride(), b.shape) if n > 1]
    return layout and same_bits(a, b)


def rank_compare(tokens_per_rank, hidden, num_experts, num_topk, routing, seed, fp8, col_major, with_topk,
                 num_worst_tokens, use_bias):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    tag = (f"rank={rank} R={num_ranks} T={tokens_per_rank} H={hidden} E={num_experts} K={num_topk} "
           f"routing={routing} fp8={fp8} col_major={col_major} topk={with_topk} worst={num_worst_tokens} "
           f"bias={use_bias} backend={dist.get_backend()}")
    dev = device()
    x, topk_idx, topk_weights = (t.to(dev) for t in make_inputs(
        seed, rank, tokens_per_rank[rank], hidden, num_experts, num_topk, num_ranks, routing))
    nvl_bytes = Config().get_nvl_buffer_size_hint(hidden * 2, num_ranks)
    a2a = Buffer(dist.group.WORLD, nvl_bytes, backend="reference")
    ag = Buffer(dist.group.WORLD, nvl_bytes, backend="reference", strategy="allgather")
    assert (a2a.strategy, ag.strategy) == ("alltoall", "allgather"), tag
    per_rank, _, per_expert, in_rank, _ = a2a.get_dispatch_layout(topk_idx, num_experts)
    if fp8:
        data, scales = epcomm.per_token_cast_to_fp8(x)
        x_in = (data, scales.t().contiguous().t() if col_major else scales)
    else:
        x_in = x
    kwargs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_idx if with_topk else None, topk_weights=topk_weights if with_topk else None,
                  expert_alignment=4, num_worst_tokens=num_worst_tokens)
    want = a2a.dispatch(x_in, **kwargs)
    got = ag.dispatch(x_in, **kwargs)
    for i, name in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights")):
        assert _same(got[i], want[i]), f"{tag}: {name} differs from the all-to-all strategy"
    assert got[3] == want[3], f"{tag}: expert list {got[3]} != {want[3]}"
    h_got, h_want = got[4], want[4]
    for field in ("num_tokens", "num_recv_tokens", "num_worst_tokens", "send_counts", "recv_counts"):
        assert getattr(h_got, field) == getattr(h_want, field), f"{tag}: handle.{field}"

    # Cached dispatch of other data with the same routing.
    x2 = (x.float() * -3).to(torch.bfloat16)
    x2_in = epcomm.per_token_cast_to_fp8(x2) if fp8 else x2
    cached_want = a2a.dispatch(x2_in, handle=h_want)
    cached_got = ag.dispatch(x2_in, handle=h_got)
    assert cached_got[1:4] == (None, None, None), tag
    assert _same(cached_got[0], cached_want[0]), f"{tag}: cached recv_x differs"

    # Combine: each destination scales its rows by (rank + 1), returns its weights, adds biases at the source.
    recv = want[0][0] if fp8 else want[0]
    y = recv.float() if not fp8 else epcomm.per_token_cast_back(want[0][0], want[0][1]).float()
    y = (y * (rank + 1)).to(torch.bfloat16).contiguous()
    weights_back = want[2] if with_topk else None
    biases = None
    if use_bias:
        gen = torch.Generator().manual_seed(seed + 7 + rank)
        biases = tuple(torch.randn((x.shape[0], hidden), generator=gen).to(torch.bfloat16).to(dev) for _ in range(2))
    c_want, w_want, _ = a2a.combine(y, h_want, topk_weights=weights_back, bias=biases)
    c_got, w_got, _ = ag.combine(y, h_got, topk_weights=weights_back, bias=biases)
    assert c_got.shape == c_want.shape and c_got.dtype == torch.bfloat16 and c_got.is_contiguous(), tag
    if BACKEND == "nccl" and num_ranks > 2:
        assert _bf16_ulp_distance(c_got.cpu(), c_want.cpu()) <= 1, f"{tag}: combined_x differs by more than 1 ulp"
        if with_topk:
            torch.testing.assert_close(w_got, w_want, rtol=2e-7 * num_ranks, atol=0, msg=tag)
    else:  # gloo sums in the all-to-all strategy's order; two summands commute exactly
        assert _same(c_got, c_want), f"{tag}: combined_x differs (max ulp {_bf16_ulp_distance(c_got, c_want)})"
        assert _same(w_got, w_want), f"{tag}: combined_topk_weights differ"
    for buf in (a2a, ag):
        buf.destroy()
    return int(h_got.num_recv_tokens)


CASES = [
    # (ranks, tokens per rank, hidden, experts, topk, routing)
    (2, [64, 48], 256, 8, 4, "random"),
    (4, [32, 0, 17, 1], 128, 16, 4, "random"),
    (3, [20, 20, 20], 128, 6, 2, "one_expert"),
    (4, [24, 24, 24, 24], 256, 16, 4, "empty_rank"),
    (4, [40, 3, 40, 40], 128, 16, 2, "imbalanced"),
    (2, [16, 16], 128, 4, 2, "all_dropped"),
    (4, [0, 0, 0, 0], 128, 16, 4, "random"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"R{c[0]}-T{sum(c[1])}-{c[5]}")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_allgather_matches_alltoall(case, fp8):
    ranks, tokens, hidden, experts, topk, routing = case
    seed = CASES.index(case) + 50 * fp8
    received = cluster(ranks).run(rank_compare, tokens, hidden, experts, topk, routing, seed=seed, fp8=fp8,
                                  col_major=False, with_topk=True, num_worst_tokens=0, use_bias=False)
    if sum(tokens) and routing != "all_dropped":
        assert sum(received) > 0, "a case that moves no row cannot tell the strategies apart"


@pytest.mark.parametrize("ranks", [2, 4])
def test_allgather_fp8_column_major_worst_tokens_bias(ranks):
    tokens = [33, 7, 0, 21][:ranks]
    cluster(ranks).run(rank_compare, tokens, 384, 4 * ranks, 3, "random", seed=13, fp8=True, col_major=True,
                       with_topk=True, num_worst_tokens=max(tokens) * ranks, use_bias=True)


def test_allgather_without_topk():
    cluster(2).run(rank_compare, [30, 19], 256, 8, 4, "random", seed=17, fp8=False, col_major=False,
                   with_topk=False, num_worst_tokens=0, use_bias=True)


def rank_bad_strategy():
    try:
        Buffer(dist.group.WORLD, 0, backend="reference", strategy="ring" if dist.get_rank() == 0 else "allgather")
    except ValueError as error:
        return str(error)
    return "no error"


def test_bad_strategy_raises_on_every_rank():
    errors = cluster(2).run(rank_bad_strategy)
    assert "strategy must be one of" in errors[0] and "'ring'" in errors[0], errors
    assert "rank(s) [0] refused" in errors[1], errors


def test_strategy_mismatch_names_the_ranks():
    fields = mark_strategy({}, "allgather")
    headers = torch.zeros((3, 16 + 3), dtype=torch.int64)
    for field, code in fields.items():
        headers[:, field] = code
    check_strategy(headers, "allgather", "dispatch")  # all agree: no error
    headers[1, list(fields)[0]] = 0
    with pytest.raises(RuntimeError, match=r"rank 0: allgather, rank 1: alltoall, rank 2: allgather"):
        check_strategy(headers, "allgather", "dispatch")
    with pytest.raises(RuntimeError, match=r"rank 0: allgather, rank 1: alltoall"):
        check_strategy(headers, "alltoall", "dispatch")  # and the rank using the other strategy raises too
