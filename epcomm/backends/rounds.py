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
from collections.abc import Callable

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


def _token_range(j: int, step: int, num_tokens: int) -> tuple[int, int]:
    """Round j's source tokens: [j * step, (j + 1) * step), clipped to the rank's tokens."""
    return min(j * step, num_tokens), min((j + 1) * step, num_tokens)


def cached_dispatch_in_rounds(dispatch_round: Callable, x: torch.Tensor, scales: torch.Tensor | None, state: dict,
                              device: torch.device, after_round: Callable[[], None] | None = None):
    """A cached dispatch with the handle of a dispatch run in rounds (``state``: its backend state):
    ``dispatch_round(x_range, scales_range, sub_handle)`` returns round j's received rows; the rows
    of every round come back assembled as one call returns them."""
    step, parts = state["round_step"], []
    for j, sub in enumerate(state["rounds"]):
        lo, hi = _token_range(j, step, x.shape[0])
        parts.append(dispatch_round(x[lo:hi], scales[lo:hi] if scales is not None else None, sub))
        if after_round is not None:
            after_round()
    col_major = scales is not None and scales.stride(0) == 1 and scales.shape[1] > 1  # as a single call's rule
    return assemble(parts, state["round_rows"], device, col_major)


def combine_in_rounds(combine_round: Callable, x: torch.Tensor, num_tokens: int, state: dict,
                      topk_weights: torch.Tensor | None, biases: tuple, device: torch.device,
                      after_round: Callable[[], None] | None = None):
    """A combine with the handle of a dispatch run in rounds: round j's combine takes the rows round j
    received (``x`` is in the assembled order: ``state["round_rows"][j]`` picks them) and returns the
    sums of the tokens of its range; ``combine_round(x_rows, sub_handle, weights_rows, biases_range)``
    returns (out, out_weights). Each token belongs to one round, so the sums are one call's."""
    step = state["round_step"]
    out = torch.empty((num_tokens, x.shape[1]), dtype=torch.bfloat16, device=device)
    num_topk = topk_weights.shape[1] if topk_weights is not None else 0
    out_w = torch.empty((num_tokens, num_topk), dtype=torch.float32, device=device) if num_topk else None
    for j, (sub, rows) in enumerate(zip(state["rounds"], state["round_rows"])):
        lo, hi = _token_range(j, step, num_tokens)
        part, part_w = combine_round(x.index_select(0, rows), sub,
                                     topk_weights.index_select(0, rows) if num_topk else None,
                                     tuple(b[lo:hi] for b in biases))
        out[lo:hi] = part
        if out_w is not None:
            out_w[lo:hi] = part_w
        if after_round is not None:
            after_round()
    return out, out_w
