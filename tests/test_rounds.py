"""Round assembly (epcomm/backends/rounds.py), which the CUDA backend uses for calls larger than its
buffer: rows received round by round must land exactly where one call would have put them."""

from __future__ import annotations

import pytest
import torch

from epcomm.backends.rounds import (
    assemble,
    cached_dispatch_in_rounds,
    combine_in_rounds,
    dispatch_in_rounds,
    round_order,
)
from epcomm.handle import DispatchHandle


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
    data, scales = assemble(per_round, order, torch.device("cpu"))
    assert torch.equal(data.view(torch.uint8), torch.cat([d for d, _ in fp8]).view(torch.uint8))
    assert torch.equal(scales, torch.cat([s for _, s in fp8]))
    assert scales.is_contiguous(), "scales come back row-major, as one call returns them"
    assert assemble([None] * rounds, order, torch.device("cpu")) is None


class _RoundsBackend:
    """A stand-in for a CUDA backend whose rank receives, from each source, the rows of ``tokens[s]``
    (ascending source token indices): it checks that each round's call gets its range of the inputs
    and answers what that range's one call would."""

    rank, device = 1, torch.device("cpu")

    def __init__(self, tokens, rows, ids, x, in_rank, topk_idx, bias, step):
        self.tokens, self.rows, self.ids, self.x, self.in_rank, self.topk_idx = tokens, rows, ids, x, in_rank, topk_idx
        self.bias, self.step = bias, step

    def dispatch(self, x, scales, handle, per_rank, in_rank, per_expert, topk_idx, weights, alignment, worst,
                 num_experts, buffer_uid, num_sms):
        lo = handle.backend_state["lo"] if handle is not None else self._lo(x)
        hi = lo + x.shape[0]
        assert torch.equal(x, self.x[lo:hi]) and scales is None and weights is None
        if handle is None:  # a fresh round: its routing is its range's
            assert torch.equal(in_rank, self.in_rank[lo:hi]) and torch.equal(topk_idx, self.topk_idx[lo:hi])
            assert torch.equal(per_rank, in_rank.sum(0, dtype=torch.int32)) and not per_expert.any()
        sub = DispatchHandle(buffer_uid=buffer_uid, num_tokens=hi - lo, hidden=x.shape[1], num_recv_tokens=0,
                             num_worst_tokens=0, is_token_in_rank=self.in_rank[lo:hi], send_counts=[],
                             recv_counts=[int(((t >= lo) & (t < hi)).sum()) for t in self.tokens],
                             backend_state={"lo": lo})
        ids = _received(self.tokens, self.ids, lo, hi) if handle is None else None
        return _received(self.tokens, self.rows, lo, hi), ids, None, None, sub

    def combine(self, x_rows, sub, weights_rows, biases, num_sms):
        lo = sub.backend_state["lo"]
        hi = lo + sub.num_tokens
        assert torch.equal(x_rows.view(torch.int16), _received(self.tokens, self.rows, lo, hi).view(torch.int16))
        assert weights_rows.shape == (len(x_rows), 2) and torch.equal(biases[0], self.bias[lo:hi])
        return biases[0] + 1, torch.full((hi - lo, 2), float(lo))

    def _lo(self, x):
        return next(lo for lo in range(0, self.x.shape[0] + 1, self.step) if torch.equal(x, self.x[lo:lo + x.shape[0]]))


def test_round_loops_run_each_range_and_assemble_one_calls_outputs():
    """dispatch_in_rounds / cached_dispatch_in_rounds / combine_in_rounds (both CUDA backends' round
    loops): round j gets source tokens [j*step, (j+1)*step) (and, in combine, the rows round j
    received), and the results land where one call would put them."""
    num_ranks, num_tokens, step, hidden = 3, 11, 4, 8
    gen = torch.Generator().manual_seed(5)
    tokens = [torch.nonzero(torch.rand(num_tokens, generator=gen) < 0.7).flatten() for _ in range(num_ranks)]
    rows = [torch.randn((len(t), hidden), generator=gen).to(torch.bfloat16) for t in tokens]
    ids = [torch.randint(-1, 5, (len(t), 2), generator=gen) for t in tokens]
    x = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16)
    in_rank = torch.rand((num_tokens, num_ranks), generator=gen) < 0.5
    topk_idx = torch.randint(0, 6, (num_tokens, 2), generator=gen)
    bias = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16)
    matrix = torch.randint(0, 9, (num_ranks, num_ranks), generator=gen).numpy()
    backend = _RoundsBackend(tokens, rows, ids, x, in_rank, topk_idx, bias, step)
    num_rounds, seen = -(-num_tokens // step), []

    recv_x, recv_ids, recv_w, handle = dispatch_in_rounds(
        backend, x, None, in_rank, topk_idx, None, 6, step, num_rounds, matrix, "b", 8, {"extra": 7},
        lambda: seen.append("dispatch"))
    assert torch.equal(recv_x.view(torch.int16), torch.cat(rows).view(torch.int16))
    assert torch.equal(recv_ids, torch.cat(ids)) and recv_w is None
    assert handle.recv_counts == matrix[:, 1].tolist() and handle.send_counts == matrix[1].tolist()
    assert handle.num_recv_tokens == int(matrix[:, 1].sum()) and handle.num_tokens == num_tokens
    assert len(handle.backend_state["rounds"]) == num_rounds and handle.backend_state["extra"] == 7

    cached = cached_dispatch_in_rounds(backend, x, None, handle, 8, lambda: seen.append("cached"))
    assert torch.equal(cached.view(torch.int16), torch.cat(rows).view(torch.int16))

    weights = torch.rand((len(recv_x), 2), generator=gen)
    out, out_w = combine_in_rounds(backend, recv_x, handle, weights, (bias,), 8, lambda: seen.append("combine"))
    assert torch.equal(out, bias + 1)
    assert torch.equal(out_w[:, 0], torch.tensor([float(lo - lo % step) for lo in range(num_tokens)]))
    assert seen == ["dispatch"] * num_rounds + ["cached"] * num_rounds + ["combine"] * num_rounds
