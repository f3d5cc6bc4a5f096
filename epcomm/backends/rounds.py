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
from typing import Any

import torch

from ..handle import DispatchHandle


def round_order(counts: list[list[int]], num_ranks: int, device: torch.device) -> list[torch.Tensor]:
    """For each round, the rows of the assembled outputs (source rank, then token) it received;
    ``counts[j][s]``: rows round j received from source s."""
    begin = [[0] * num_ranks for _ in counts]  # where round j's rows of source s start, assembled
    at = 0
    for s in range(num_ranks):
        for j, round_counts in enumerate(counts):
            begin[j][s] = at
            at += round_counts[s]
    return [torch.cat([torch.arange(begin[j][s], begin[j][s] + counts[j][s], dtype=torch.int64, device=device)
                       for s in range(num_ranks)]) for j in range(len(counts))]


def assemble(per_round: list, order: list[torch.Tensor], device: torch.device):
    """Put each round's rows at their assembled positions: a tensor per round, an FP8 (data, scales)
    tuple per round, or None. Rows are moved as bytes (index_copy_ has no FP8 kernel); the result is
    row-major, as a single call returns it."""
    if per_round[0] is None:
        return None
    if isinstance(per_round[0], tuple):
        return (assemble([p[0] for p in per_round], order, device),
                assemble([p[1] for p in per_round], order, device))
    first = per_round[0]
    total = sum(int(o.numel()) for o in order)
    out = torch.empty((total, *first.shape[1:]), dtype=first.dtype, device=device)
    width = math.prod(first.shape[1:])
    if total and width:
        as_bytes = out.view(total, width).view(torch.uint8)
        for part, rows in zip(per_round, order):
            if rows.numel():
                as_bytes.index_copy_(0, rows, part.contiguous().view(part.shape[0], width).view(torch.uint8))
    return out


def _token_range(j: int, step: int, num_tokens: int) -> tuple[int, int]:
    """Round j's source tokens: [j * step, (j + 1) * step), clipped to the rank's tokens."""
    return min(j * step, num_tokens), min((j + 1) * step, num_tokens)


def _rows(t: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    return t[lo:hi] if t is not None else None


# The loops below drive a CUDA backend (cuda/intranode.py, cuda/hierarchical.py): its ``dispatch(x,
# scales, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
# expert_alignment, num_worst_tokens, num_experts, buffer_uid, num_sms)`` and ``combine(x, handle,
# topk_weights, biases, num_sms)`` run one round each; ``after_round`` is called after each.

def dispatch_in_rounds(backend: Any, x: torch.Tensor, scales: torch.Tensor | None, is_token_in_rank: torch.Tensor,
                       topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None, num_experts: int,
                       step: int, num_rounds: int, matrix, buffer_uid: str, num_sms: int,
                       backend_state: dict | None = None, after_round: Callable[[], None] | None = None):
    """A fresh dispatch run in rounds of ``step`` source tokens (``num_rounds``: the same on every
    rank); ``matrix`` is the whole call's [R, R] count matrix. Returns (recv_x, recv_topk_idx,
    recv_topk_weights, handle) as one call returns them; the handle's backend state holds the rounds'
    handles (what cached_dispatch_in_rounds and combine_in_rounds take), plus ``backend_state``.
    The rounds' expert counts are zeros: the caller has the whole call's totals."""
    num_tokens, rank, device = x.shape[0], backend.rank, backend.device
    no_expert_counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    parts, handles = [], []
    for j in range(num_rounds):
        lo, hi = _token_range(j, step, num_tokens)
        in_rank = is_token_in_rank[lo:hi]
        out = backend.dispatch(x[lo:hi], _rows(scales, lo, hi), None, in_rank.sum(0, dtype=torch.int32), in_rank,
                               no_expert_counts, _rows(topk_idx, lo, hi), _rows(topk_weights, lo, hi), 1, 0,
                               num_experts, buffer_uid, num_sms)
        parts.append(out[:3])
        handles.append(out[4])
        if after_round is not None:
            after_round()
    order = round_order([h.recv_counts for h in handles], len(matrix), device)
    recv_x = assemble([p[0] for p in parts], order, device)
    recv_topk_idx, recv_topk_weights = (assemble([p[i] for p in parts], order, device) for i in (1, 2))
    handle = DispatchHandle(
        buffer_uid=buffer_uid, num_tokens=num_tokens, hidden=x.shape[1], num_recv_tokens=int(matrix[:, rank].sum()),
        num_worst_tokens=0, is_token_in_rank=is_token_in_rank, send_counts=[int(v) for v in matrix[rank]],
        recv_counts=[int(v) for v in matrix[:, rank]], count_matrix=matrix,
        backend_state={"rounds": handles, "round_step": step, "round_rows": order, **(backend_state or {})})
    return recv_x, recv_topk_idx, recv_topk_weights, handle


def cached_dispatch_in_rounds(backend: Any, x: torch.Tensor, scales: torch.Tensor | None, handle: DispatchHandle,
                              num_sms: int, after_round: Callable[[], None] | None = None):
    """A cached dispatch with the handle of a dispatch run in rounds: the rows of every round come
    back assembled as one call returns them."""
    state = handle.backend_state
    step, parts = state["round_step"], []
    for j, sub in enumerate(state["rounds"]):
        lo, hi = _token_range(j, step, x.shape[0])
        parts.append(backend.dispatch(x[lo:hi], _rows(scales, lo, hi), sub, None, None, None, None, None, 1, 0, 0,
                                      handle.buffer_uid, num_sms)[0])
        if after_round is not None:
            after_round()
    return assemble(parts, state["round_rows"], backend.device)


def combine_in_rounds(backend: Any, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None,
                      biases: tuple, num_sms: int, after_round: Callable[[], None] | None = None):
    """A combine with the handle of a dispatch run in rounds: round j's combine takes the rows round j
    received (``x`` is in the assembled order: ``round_rows[j]`` picks them) and returns the sums of
    the tokens of its range. Each token belongs to one round, so the sums are one call's."""
    state, num_tokens, device = handle.backend_state, handle.num_tokens, backend.device
    step = state["round_step"]
    out = torch.empty((num_tokens, x.shape[1]), dtype=torch.bfloat16, device=device)
    num_topk = topk_weights.shape[1] if topk_weights is not None else 0
    out_w = torch.empty((num_tokens, num_topk), dtype=torch.float32, device=device) if num_topk else None
    for j, (sub, rows) in enumerate(zip(state["rounds"], state["round_rows"])):
        lo, hi = _token_range(j, step, num_tokens)
        part, part_w = backend.combine(x.index_select(0, rows), sub,
                                       topk_weights.index_select(0, rows) if num_topk else None,
                                       tuple(b[lo:hi] for b in biases), num_sms)
        out[lo:hi] = part
        if out_w is not None:
            out_w[lo:hi] = part_w
        if after_round is not None:
            after_round()
    return out, out_w
