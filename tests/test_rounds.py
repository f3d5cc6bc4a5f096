"""Round assembly (epcomm/backends/rounds.py), which the CUDA backend uses for calls larger than its
buffer: rows received round by round must land exactly where one call would have put them."""

from __future__ import annotations

import pytest
import torch

from epcomm.backends.rounds import assemble, cached_dispatch_in_rounds, combine_in_rounds, round_order


def _received(tokens: list[torch.Tensor], rows: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """What a receiver gets from one call over source tokens [lo, hi): each source's selected
    tokens in that range, ascending, sources in rank order (the receive layout of a single call)."""
    return torch.cat([rows[s][(t >= lo) & (t < hi)] for s, t in enumerate(tokens)])


@pytest.mark.parametrize("num_ranks, num_tokens, step", [(2, 10, 3), (4, 17, 5), (3, 6, 6), (4, 9, 1), (2, 0, 4)])
def test_rounds_assemble_to_one_calls_order(num_ranks, num_tokens, step):
    gen = torch.Generator().manual_seed(num_ranks * 100 + num_tokens)
    # Per source: the (ascending) indices of its tokens this receiver gets, and their rows.
    tokens = [torch.nonzero(torch.rand(num_tokens, generator=gen) < 0.6).flatten() for _ in range(num_ranks)]
    x = [torch.randn((len(t), 8), generator=gen).to(torch.bfloat16) for t in tokens]
    fp8 = [(torch.randn((len(t), 16), generator=gen).to(torch.float8_e4m3fn), torch.rand((len(t), 2), generator=gen))
           for t in tokens]
    ids = [torch.randint(-1, 9, (len(t), 3), generator=gen) for t in tokens]
    rounds = max(1, -(-num_tokens // step))
    ranges = [(j * step, (j + 1) * step) for j in range(rounds)]
    counts = [[int(((t >= lo) & (t < hi)).sum()) for t in tokens] for lo, hi in ranges]
    order = round_order(counts, num_ranks, torch.device("cpu"))
    assert sorted(torch.cat(order).tolist()) == list(range(sum(len(t) for t in tokens)))  # each row once

    got = assemble([_received(tokens, x, lo, hi) for lo, hi in ranges], order, torch.device("cpu"))
    assert torch.equal(got.view(torch.int16), torch.cat(x).view(torch.int16))
    got_ids = assemble([_received(tokens, ids, lo, hi) for lo, hi in ranges], order, torch.device("cpu"))
    assert torch.equal(got_ids, torch.cat(ids))
    per_round = [(_received(tokens, [d for d, _ in fp8], lo, hi), _received(tokens, [s for _, s in fp8], lo, hi))
                 for lo, hi in ranges]
    data, scales = assemble(per_round, order, torch.device("cpu"), col_major=True)
    assert torch.equal(data.view(torch.uint8), torch.cat([d for d, _ in fp8]).view(torch.uint8))
    assert torch.equal(scales, torch.cat([s for _, s in fp8]))
    if scales.shape[0] > 1:
        assert scales.stride(0) == 1, "column-major scales come back column-major"
    assert assemble([None] * rounds, order, torch.device("cpu")) is None


def test_round_loops_slice_and_place_like_one_call():
    """cached_dispatch_in_rounds / combine_in_rounds (both CUDA backends' round loops): round j gets
    source tokens [j*step, (j+1)*step) and the received rows of round j (in the assembled order),
    and its results land where one call's would."""
    num_ranks, num_tokens, step, hidden = 3, 11, 4, 8
    gen = torch.Generator().manual_seed(5)
    tokens = [torch.nonzero(torch.rand(num_tokens, generator=gen) < 0.7).flatten() for _ in range(num_ranks)]
    rows = [torch.randn((len(t), hidden), generator=gen).to(torch.bfloat16) for t in tokens]
    ranges = [(lo, min(lo + step, num_tokens)) for lo in range(0, num_tokens, step)]
    counts = [[int(((t >= lo) & (t < hi)).sum()) for t in tokens] for lo, hi in ranges]
    order = round_order(counts, num_ranks, torch.device("cpu"))
    subs = [{"received": _received(tokens, rows, lo, hi), "range": (lo, hi)} for lo, hi in ranges]
    state = {"rounds": subs, "round_step": step, "round_rows": order}
    x = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16)
    seen = []

    def dispatch_round(x_range, scales_range, sub):
        lo, hi = sub["range"]
        assert torch.equal(x_range, x[lo:hi]) and scales_range is None
        return sub["received"]

    got = cached_dispatch_in_rounds(dispatch_round, x, None, state, torch.device("cpu"), lambda: seen.append(1))
    assert torch.equal(got.view(torch.int16), torch.cat(rows).view(torch.int16)) and len(seen) == len(ranges)

    assembled = torch.cat(rows)  # the expert outputs, in one call's order
    weights = torch.rand((len(assembled), 2), generator=gen)
    bias = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16)

    def combine_round(x_rows, sub, w_rows, biases):
        lo, hi = sub["range"]
        assert torch.equal(x_rows.view(torch.int16), sub["received"].view(torch.int16))  # round j's own rows
        assert w_rows.shape == (len(x_rows), 2) and torch.equal(biases[0], bias[lo:hi])
        return biases[0] + 1, torch.full((hi - lo, 2), float(lo))

    out, out_w = combine_in_rounds(combine_round, assembled, num_tokens, state, weights, (bias,), torch.device("cpu"))
    assert torch.equal(out, bias + 1)
    assert torch.equal(out_w[:, 0], torch.tensor([float(lo) for lo, hi in ranges for _ in range(hi - lo)]))
