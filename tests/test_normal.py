"""Normal-mode dispatch and combine on 2-4 gloo ranks, checked against the oracle (epcomm/oracle.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import cluster
from routing import device, make_inputs

import epcomm
from epcomm import Buffer, Config, oracle


def _buffer(hidden_bytes: int) -> Buffer:
    r = dist.get_world_size()
    return Buffer(dist.group.WORLD, Config().get_nvl_buffer_size_hint(hidden_bytes, r), backend="reference")


def rank_dispatch_combine(tokens_per_rank, hidden, num_experts, num_topk, routing, seed, fp8, col_major_scales,
                          alignment, num_worst_tokens, use_bias):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    tag = (f"rank={rank} R={num_ranks} T={tokens_per_rank} H={hidden} E={num_experts} K={num_topk} "
           f"routing={routing} fp8={fp8} col_major={col_major_scales} worst={num_worst_tokens}")
    all_inputs = [make_inputs(seed, r, tokens_per_rank[r], hidden, num_experts, num_topk, num_ranks, routing)
                  for r in range(num_ranks)]
    x, topk_idx, topk_weights = all_inputs[rank]
    dev = device()
    buf = _buffer(hidden * 2)

    # Layout.
    layout = buf.get_dispatch_layout(topk_idx.to(dev), num_experts)
    per_rank, per_domain, per_expert, in_rank = (t.cpu() if t is not None else None for t in layout[:4])
    want_per_rank, _, want_per_expert, want_in_rank = oracle.dispatch_layout(topk_idx, num_experts, num_ranks)
    assert torch.equal(in_rank, want_in_rank), tag
    assert torch.equal(per_rank, want_per_rank), tag
    assert torch.equal(per_expert, want_per_expert), tag
    assert per_domain is None, tag

    # Dispatch.
    if fp8:
        data, scales = epcomm.per_token_cast_to_fp8(x)
        if col_major_scales:
            scales = scales.t().contiguous().t()
        x_in = (data.to(dev), scales.to(dev) if not col_major_scales else scales.t().to(dev).t())
    else:
        x_in = x.to(dev)
    recv_x, recv_idx, recv_w, expert_list, handle, _ = buf.dispatch(
        x_in, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
        topk_idx=topk_idx.to(dev), topk_weights=topk_weights.to(dev), expert_alignment=alignment,
        num_worst_tokens=num_worst_tokens)
    recv_x = (recv_x[0].cpu(), recv_x[1].cpu() if recv_x[1].stride(1) == 1 else recv_x[1].t().cpu().t()) \
        if fp8 else recv_x.cpu()
    recv_idx, recv_w = recv_idx.cpu(), recv_w.cpu()
    # The oracle's dispatch of every rank (the rows this rank receives, and what its peers return to it).
    everyone = oracle.dispatch([i[0] for i in all_inputs], [i[1] for i in all_inputs], num_experts,
                               topk_weights=[i[2] for i in all_inputs], expert_alignment=alignment)
    want_x, want_idx, want_w = everyone[rank].x, everyone[rank].topk_idx, everyone[rank].topk_weights
    n = want_x.shape[0]
    if fp8:
        want_data, want_scales = epcomm.per_token_cast_to_fp8(want_x)
        assert torch.equal(recv_x[0][:n].view(torch.uint8), want_data.view(torch.uint8)), tag
        assert torch.equal(recv_x[1][:n], want_scales), tag
        assert recv_x[1].is_contiguous(), f"{tag}: scales come back row-major, got strides {recv_x[1].stride()}"
        rows = recv_x[0].shape[0]
    else:
        assert torch.equal(recv_x[:n].view(torch.int16), want_x.view(torch.int16)), tag
        rows = recv_x.shape[0]
    assert rows == (num_worst_tokens or n), tag
    assert torch.equal(recv_idx[:n], want_idx), tag
    assert torch.equal(recv_w[:n], want_w), tag
    if num_worst_tokens:
        assert expert_list == [], tag
        assert bool((recv_idx[n:] == -1).all()), tag
    else:
        assert expert_list == everyone[rank].expert_counts, tag

    # Cached dispatch reproduces the rows.
    cached_x, *rest = buf.dispatch(x_in, handle=handle)
    assert rest[:3] == [None, None, None], tag
    got = (cached_x[0] if fp8 else cached_x).cpu()
    first = recv_x[0] if fp8 else recv_x
    assert torch.equal(got[:n].view(torch.uint8), first[:n].view(torch.uint8)), tag

    # Combine: each destination scales its rows by (rank + 1); the source sums them.
    y = torch.zeros((rows, hidden), dtype=torch.bfloat16)
    y_valid = _returned_rows(want_x, rank)
    y[:n] = y_valid
    w_back = torch.zeros((rows, num_topk), dtype=torch.float32)
    w_back[:n] = want_w
    biases = None
    if use_bias:
        gen = torch.Generator().manual_seed(seed + 7 + rank)
        biases = tuple(torch.randn((x.shape[0], hidden), generator=gen).to(torch.bfloat16) for _ in range(2))
    combined, combined_w, _ = buf.combine(y.to(dev), handle, topk_weights=w_back.to(dev),
                                          bias=tuple(b.to(dev) for b in biases) if biases else None)
    combined, combined_w = combined.cpu(), combined_w.cpu()
    # Every destination d returned its received rows times (d + 1): the oracle's exact (float64) combine.
    in_ranks = [oracle.dispatch_layout(i[1], num_experts, num_ranks)[3] for i in all_inputs]
    ys = [_returned_rows(d.x, r) for r, d in enumerate(everyone)]
    all_biases = [biases if r == rank else () for r in range(num_ranks)] if biases is not None else None
    # The oracle's fp32 sums, bit for bit (-0 rows included: a sum from +0 gives +0).
    want, want_w = oracle.combine(ys, in_ranks, [d.topk_weights for d in everyone], all_biases)[rank]
    assert torch.equal(combined.view(torch.int16), want.view(torch.int16)), f"{tag}: combine not bitwise"
    assert torch.equal(combined_w.view(torch.int32), want_w.view(torch.int32)), f"{tag}: weights not bitwise"
    ref, ref_w = oracle.combine(ys, in_ranks, [d.topk_weights for d in everyone], all_biases, exact=True)[rank]
    assert combined.dtype == torch.bfloat16 and combined.shape == (x.shape[0], hidden), tag
    # bf16 output: within one bf16 rounding of the float64 sum (past the columns that cancel on purpose).
    err = (combined.double() - ref)[:, _ORDERED_COLUMNS.stop:].abs()
    bound = ref[:, _ORDERED_COLUMNS.stop:].abs() * 2 ** -8 + 1e-6
    assert bool((err <= bound).all()), f"{tag}: max err {err.max()}"
    assert torch.allclose(combined_w.double(), ref_w, rtol=1e-6, atol=1e-6), tag
    return n


# Columns whose returned values make the fp32 sum depend on its order: a token's rows from ranks 0, 1, 2
# sum to 0 in column 5 in ascending rank order (2^25 + 1.5 rounds to 2^25) and to 1.5 in descending order.
_ORDERED_COLUMNS = slice(5, 7)
_ORDERED_VALUES = ((1.5, 2.0 ** 25, -2.0 ** 25, 1.0), (2.0 ** 25, -2.0 ** 25, 1.5, 3.0))


def _returned_rows(x: torch.Tensor, rank: int) -> torch.Tensor:
    """What rank ``rank`` returns for its received rows ``x``: x * (rank + 1), a few values -0, and
    values whose sum depends on its order in ``_ORDERED_COLUMNS``."""
    y = (x.float() * (rank + 1)).to(torch.bfloat16)
    y[::3, :5] = -0.0
    for column, values in zip(range(_ORDERED_COLUMNS.start, _ORDERED_COLUMNS.stop), _ORDERED_VALUES, strict=True):
        y[:, column] = values[rank % 4]
    return y


CASES = [
    # (ranks, tokens per rank, hidden, experts, topk, routing)
    (1, [40], 128, 8, 4, "random"),
    (1, [24], 128, 8, 2, "all_dropped"),
    (2, [64, 48], 256, 8, 4, "random"),
    (4, [32, 0, 17, 1], 128, 16, 4, "random"),
    (4, [40, 40, 40, 40], 128, 16, 2, "imbalanced"),
    (4, [24, 24, 24, 24], 256, 16, 4, "empty_rank"),
    (3, [20, 20, 20], 128, 6, 2, "one_expert"),
    (2, [16, 16], 128, 4, 2, "all_dropped"),
    (4, [0, 0, 0, 0], 128, 16, 4, "random"),
    (2, [1, 1], 128, 4, 4, "random"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"R{c[0]}-T{sum(c[1])}-{c[5]}")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_dispatch_combine(case, fp8):
    ranks, tokens, hidden, experts, topk, routing = case
    seed = CASES.index(case) + 100 * fp8
    cluster(ranks).run(rank_dispatch_combine, tokens, hidden, experts, topk, routing, seed=seed, fp8=fp8,
                       col_major_scales=False, alignment=1, num_worst_tokens=0, use_bias=False)


@pytest.mark.parametrize("ranks", [2, 4])
def test_fp8_column_major_scales_alignment_bias(ranks):
    cluster(ranks).run(rank_dispatch_combine, [33] * ranks, 384, 4 * ranks, 3, "random", seed=11, fp8=True,
                       col_major_scales=True, alignment=8, num_worst_tokens=0, use_bias=True)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_num_worst_tokens(fp8):
    tokens = [30, 5, 0, 12]
    cluster(4).run(rank_dispatch_combine, tokens, 128, 16, 4, "random", seed=5, fp8=fp8, col_major_scales=False,
                   alignment=1, num_worst_tokens=30 * 4, use_bias=True)


def rank_repeated_calls():
    """Many calls leave the store and the Buffer's memory where a few left them: the handshake's keys are
    deleted as the calls pass, the kept temporaries are reused."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    x, topk_idx, topk_weights = (t.to(device()) for t in make_inputs(3, rank, 24, 128, 4 * num_ranks, 3, num_ranks,
                                                                      "random"))
    buf = _buffer(128 * 2)
    store = dist.distributed_c10d._get_default_store()

    def step():
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, 4 * num_ranks)
        out = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                           topk_idx=topk_idx, topk_weights=topk_weights)
        buf.combine(out[0], out[4], out[2])

    for _ in range(3):
        step()
    dist.barrier()
    keys = store.num_keys()
    scratch = sum(t.numel() for t in buf._backend._scratch.values())
    for _ in range(20):
        step()
    dist.barrier()
    assert store.num_keys() <= keys + num_ranks, (keys, store.num_keys())  # a peer may be a call ahead
    assert sum(t.numel() for t in buf._backend._scratch.values()) == scratch


def test_repeated_calls_keep_store_and_memory_flat():
    cluster(3).run(rank_repeated_calls)
