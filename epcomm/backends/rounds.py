"""Calls larger than a backend's buffers, run in rounds over ranges of source tokens.

Every rank splits its tokens into the same ranges (round j: tokens [j*B, (j+1)*B)) and runs one
call per range. A receiver gets, in round j, the rows of every source's tokens in range j, in
source-rank order; a single call would have returned all of source 0's rows, then source 1's, and
so on. ``round_order`` says where each round's rows go in that single-call order and ``assemble``
puts them there, so the outputs are the same bits as one call. (Each token belongs to one round,
so a round's combine sums a token's rows exactly as one call would.)
"""

from __future__ import annotations

import math

import torch


def round_order(counts: list[list[int]], num_ranks: int, device: torch.device) -> list[torch.Tensor]:
    """For each round, the rows of the assembled outputs (source rank, then token) it received;
    ``counts[j][s]``: rows round j received from source s."""
    begin = [[0] * num_ranks for _ in counts]  # where round j's rows of source s start, assembled
    at = 0
    for s in range(num_ranks):
        for j, round_counts in enumerate(counts):
            begin[j][s] = at
            at += round_counts[s]
    return [torch.cat([torch.arange(begin[j][s], begin[j][s] + counts[j][s], device=device)
                       for s in range(num_ranks)]) for j in range(len(counts))]


def assemble(per_round: list, order: list[torch.Tensor], device: torch.device, col_major: bool = False):
    """Put each round's rows at their assembled positions: a tensor per round, an FP8 (data, scales)
    tuple per round, or None. Rows are moved as bytes (index_copy_ has no FP8 kernel);
    ``col_major`` scales come out column-major, as a single call returns them."""
    if per_round[0] is None:
        return None
    if isinstance(per_round[0], tuple):
        return (assemble([p[0] for p in per_round], order, device),
                assemble([p[1] for p in per_round], order, device, col_major))
    first = per_round[0]
    total = sum(int(o.numel()) for o in order)
    out = torch.empty((total, *first.shape[1:]), dtype=first.dtype, device=device)
    width = math.prod(first.shape[1:])
    if total and width:
        as_bytes = out.view(total, width).view(torch.uint8)
        for part, rows in zip(per_round, order):
            if rows.numel():
                as_bytes.index_copy_(0, rows, part.contiguous().view(part.shape[0], width).view(torch.uint8))
    return out.t().contiguous().t() if col_major else out
