"""The peer baseline ``megatron-a2a``: the sequence Megatron-LM's alltoall token dispatcher runs.

Megatron-LM's ``MoEAlltoAllTokenDispatcher`` (megatron/core/transformer/moe/token_dispatcher.py,
with ``permute``/``unpermute`` of moe_utils.py, unfused, dropless) moves one row per (token,
selected expert), not one per (token, destination rank) as a DeepEP-style dispatch does:

* dispatch: count the tokens of each expert; permute this rank's rows by expert (a stable sort of
  the (token, slot) pairs, so an expert's rows keep token order); exchange the counts (Megatron
  gathers the whole [ranks, experts] matrix and keeps its own experts' columns, the all-to-all
  here moves only those); wait on the host for them (the variable splits); one variable
  ``all_to_all_single`` of the rows and one of their routing weights; then regroup the received
  chunks from [source rank][local expert] to [local expert][source rank].
* combine: undo the regrouping, the reverse ``all_to_all_single``, then sum each token's expert
  outputs back into its row (a scatter-add in the rows' dtype, as Megatron's unfused unpermute).

The same calls on any device and process group; the code is this project's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .checks import BF16_REL_TOL, Expected, same_bits
from .workloads import RankInputs


@dataclass
class Dispatched:
    x: torch.Tensor  # [rows, H]: the rows of local expert 0 (from rank 0, rank 1, ...), then expert 1, ...
    probs: torch.Tensor  # [rows] f32, each row's routing weight
    tokens_per_expert: list[int]  # rows per local expert
    # What combine needs: the source token of each sent row, the regrouping, the splits.
    sent_tokens: torch.Tensor
    regroup: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
             group: dist.ProcessGroup | None = None) -> Dispatched:
    num_ranks = dist.get_world_size(group)
    num_tokens, num_topk = topk_idx.shape
    local = num_experts // num_ranks
    flat = topk_idx.reshape(-1)
    # Unused slots (-1) sort after every expert and are never sent.
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_experts))
    per_expert = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    order = torch.sort(key, stable=True).indices
    recv_per_expert = torch.empty_like(per_expert)  # [source rank, local expert]
    dist.all_to_all_single(recv_per_expert, per_expert, group=group)
    counts = torch.cat([per_expert, recv_per_expert]).tolist()  # the host waits here, as Megatron's does
    send_splits = [sum(counts[r * local:(r + 1) * local]) for r in range(num_ranks)]
    recv_matrix = counts[num_experts:]
    recv_splits = [sum(recv_matrix[r * local:(r + 1) * local]) for r in range(num_ranks)]
    num_send, num_recv = sum(send_splits), sum(recv_splits)
    pairs = order[:num_send]
    sent_tokens = torch.div(pairs, num_topk, rounding_mode="floor")
    send = x.index_select(0, sent_tokens)
    send_probs = topk_weights.reshape(-1).index_select(0, pairs)
    recv = torch.empty((num_recv, x.shape[1]), dtype=x.dtype, device=x.device)
    recv_probs = torch.empty((num_recv,), dtype=send_probs.dtype, device=x.device)
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    dist.all_to_all_single(recv_probs, send_probs, recv_splits, send_splits, group=group)
    # Chunk c = source * local + expert; sorting by (expert, source) puts each expert's rows together.
    chunk = torch.repeat_interleave(torch.arange(num_ranks * local, device=x.device), recv_per_expert,
                                    output_size=num_recv)
    regroup = torch.sort((chunk % local) * num_ranks + torch.div(chunk, local, rounding_mode="floor"),
                         stable=True).indices
    tokens_per_expert = [sum(recv_matrix[r * local + e] for r in range(num_ranks)) for e in range(local)]
    return Dispatched(recv.index_select(0, regroup), recv_probs.index_select(0, regroup), tokens_per_expert,
                      sent_tokens, regroup, send_splits, recv_splits)


def combine(y: torch.Tensor, handle: Dispatched, num_tokens: int, group: dist.ProcessGroup | None = None
            ) -> torch.Tensor:
    """Sum each token's expert outputs ``y`` (in the dispatch's order) back into its row."""
    chunked = torch.empty_like(y)
    chunked.index_copy_(0, handle.regroup, y)
    back = torch.empty((handle.sent_tokens.numel(), y.shape[1]), dtype=y.dtype, device=y.device)
    dist.all_to_all_single(back, chunked, handle.send_splits, handle.recv_splits, group=group)
    out = torch.zeros((num_tokens, y.shape[1]), dtype=y.dtype, device=y.device)
    return out.index_add_(0, handle.sent_tokens, back)


def expected(want: Expected) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The oracle's dispatch in Megatron's layout: per local expert the rows that selected it (by
    source rank, then token, as the oracle orders them), their weights, and the count per expert."""
    rows, probs, counts = [], [], []
    for e in range(len(want.expert_counts)):
        hit = want.topk_idx == e
        chosen = hit.any(1)
        rows.append(want.x[chosen])
        probs.append(want.topk_weights[hit])  # one hit per chosen row, in row order
        counts.append(int(chosen.sum()))
    return torch.cat(rows), torch.cat(probs), counts


def check_dispatch(tag: str, got: Dispatched, want: Expected) -> list[str]:
    rows, probs, counts = expected(want)
    failures = []
    if got.tokens_per_expert != counts:
        failures.append(f"{tag}: tokens per local expert {got.tokens_per_expert} != {counts}")
    if not same_bits(got.x, rows.to(got.x.device)):
        failures.append(f"{tag}: the rows by expert differ from the reference (shape {tuple(got.x.shape)}, want "
                        f"{tuple(rows.shape)})")
    if not torch.equal(got.probs, probs.to(got.probs.device)):
        failures.append(f"{tag}: the rows' routing weights differ from the reference")
    return failures


def check_combine(tag: str, combined: torch.Tensor, mine: RankInputs) -> list[str]:
    """Every selected expert returns the token's row, so the sum is (selections) x its row. The
    scatter-add rounds to BF16 after each addition: the j-th partial sum (j x the row) may be off by
    one rounding of its size, so n selections allow (2 + ... + n) roundings of the row."""
    if combined.shape != mine.x.shape:
        return [f"{tag}: combined shape {tuple(combined.shape)}, want {tuple(mine.x.shape)}"]
    n = (mine.topk_idx >= 0).sum(1, keepdim=True).double()
    x = mine.x.double()
    roundings = (n * (n + 1) / 2 - 1).clamp(min=0)
    err = (combined.double() - x * n).abs()
    ok = bool((err <= roundings * x.abs() * BF16_REL_TOL + 1e-6).all())
    return [] if ok else [f"{tag}: combined rows are not (selections) x the row within the scatter-add's BF16 "
                          f"roundings (max abs error {float(err.max()) if err.numel() else 0.0:.3g})"]
