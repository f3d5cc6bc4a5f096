"""Normal mode by allgather (``Buffer(..., strategy="allgather")``): the planner's "allgather + permute".

Dispatch: every rank's token rows (packed as every backend packs them, ``epcomm/backends/rows.py``,
followed by the rank's ``is_token_in_rank`` row) are padded to the largest token count T_max (known
from the handshake) and all-gathered into ``[R * T_max]`` rows; each rank then keeps the rows whose
``is_token_in_rank`` column for it is set. Row ``src * T_max + t`` holds token ``t`` of rank ``src``,
so keeping the selected rows in ascending order yields exactly the all-to-all strategy's order (by
source rank, then source token index): dispatch outputs are identical, bit for bit. A cached
dispatch gathers data and scales only and reuses the selection kept in the handle.

Combine: each rank writes its rows (and ``topk_weights``) back to their positions in a zeroed
``[R * T_max, H + K]`` **fp32** buffer and reduce-scatters it (sum), which returns to every rank the
sums for its own tokens; biases are added and the result is rounded to bf16 once, as the API
prescribes. fp32 rather than bf16 partial sums because a bf16 reduce-scatter would round after
every addition (and ``combined_topk_weights`` are fp32 anyway); it moves twice the bytes a bf16
reduce-scatter would, which is why the benchmark's planner comparison uses the NCCL collectives,
not this backend's calls.

Agreement with the all-to-all strategy's combine: on NCCL ``reduce_scatter_tensor`` sums in its
own order, so sums of three or more rows may differ in the last fp32 bit, and the bf16 output (and
the fp32 weights) by one unit in the last place where that bit decides the rounding; with two
contributions per token (two ranks) the sum is the same. On gloo the reduce-scatter is an
all-to-all of the partial rows plus a local sum in ascending source-rank order
(``Transport.reduce_scatter``), the all-to-all strategy's order, so the results are identical.

Cost: every row reaches every rank whether needed or not (R T rows gathered per rank), and the
combine buffer is ``R * T_max * (H + K) * 4`` bytes per rank.

Every rank of a group must use the same strategy: the handshake carries it, and every rank raises,
naming each rank's strategy, when they differ.
"""

from __future__ import annotations

import time

import torch

from ...handle import DispatchHandle
from ..rows import check_worst_tokens, pack_token_rows, unpack_token_rows
from .backend import F, ReferenceBackend, to_bytes
from .normal import (
    combine_handshake,
    dispatch_prologue,
    dispatch_result,
    exchange_expert_counts,
    received_expert_list,
    strategy_state,
)

STRATEGY = "allgather"


def _pack(x: torch.Tensor, scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
          topk_weights: torch.Tensor | None, in_rank: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    """[num_rows, row_bytes] uint8: the shared token row, then the is_token_in_rank row; zero padding rows."""
    packed = pack_token_rows(x, scales, topk_idx, topk_weights)
    if in_rank is not None:
        packed = torch.cat([packed, to_bytes(in_rank)], dim=1)
    if packed.shape[0] < num_rows:
        pad = torch.zeros((num_rows - packed.shape[0], packed.shape[1]), dtype=torch.uint8, device=packed.device)
        packed = torch.cat([packed, pad])
    return packed.contiguous()


def dispatch(be: ReferenceBackend, x: torch.Tensor, scales: torch.Tensor | None, handle: DispatchHandle | None,
             num_tokens_per_rank: torch.Tensor | None, is_token_in_rank: torch.Tensor | None,
             num_tokens_per_expert: torch.Tensor | None, topk_idx: torch.Tensor | None,
             topk_weights: torch.Tensor | None, expert_alignment: int, num_worst_tokens: int, num_experts: int,
             buffer_uid: str):
    """Same arguments and results as ``normal.dispatch`` (the all-to-all strategy)."""
    rank, num_ranks = be.rank, be.num_ranks
    cached = handle is not None
    headers, count_matrix, recv_counts, is_token_in_rank, send_counts, num_worst_tokens = dispatch_prologue(
        be, STRATEGY, x, scales, handle, num_tokens_per_rank, is_token_in_rank, topk_idx, topk_weights,
        num_worst_tokens, num_experts)
    tokens_per_rank = headers[:, F.NUM_TOKENS].tolist()
    if cached and tokens_per_rank != handle.backend_state["tokens_per_rank"]:
        raise RuntimeError(f"epcomm dispatch: cached handle was made with {handle.backend_state['tokens_per_rank']} "
                           f"tokens per rank but the ranks now have {tokens_per_rank}")
    t_max = max(tokens_per_rank)
    nobody_receives = int(count_matrix.sum()) == 0

    # Per-expert counts: from the received top-k ids, else (no ids) the caller's, exchanged.
    num_recv_tokens_per_expert_list = None if cached or topk_idx is not None else \
        exchange_expert_counts(be, num_tokens_per_expert, num_experts, expert_alignment, num_worst_tokens)

    num_recv_tokens = sum(recv_counts)
    check_worst_tokens(rank, num_recv_tokens, num_worst_tokens)
    if nobody_receives:  # consistent on every rank: nothing moves
        recv = torch.empty((0, 1), dtype=torch.uint8, device=x.device)
        recv_pos = torch.empty(0, dtype=torch.int64, device=x.device)
    else:
        in_rank_bytes = None if cached else is_token_in_rank
        packed = _pack(x, scales, None if cached else topk_idx, None if cached else topk_weights, in_rank_bytes,
                       t_max)
        gathered = torch.empty((num_ranks * t_max, packed.shape[1]), dtype=torch.uint8, device=x.device)
        be.transport.all_gather_into(gathered, packed, "dispatch", be.seq, time.monotonic() + be.transport.timeout_s)
        if cached:
            recv_pos = handle.backend_state["recv_pos"]
        else:
            # The last R bytes of a row are the source's is_token_in_rank row; column `rank` is ours.
            mine = gathered[:, packed.shape[1] - num_ranks + rank] != 0
            recv_pos = torch.nonzero(mine).flatten()  # ascending: by source rank, then token index
            if recv_pos.numel() != num_recv_tokens:
                raise RuntimeError(f"epcomm dispatch: rank {rank} selected {recv_pos.numel()} rows but the ranks' "
                                   f"num_tokens_per_rank promise {num_recv_tokens}")
        recv = gathered.index_select(0, recv_pos)
    recv_x_out, recv_topk_idx, recv_topk_weights = unpack_token_rows(
        recv, num_recv_tokens, num_worst_tokens or num_recv_tokens, x, scales, None if cached else topk_idx,
        None if cached else topk_weights, rank, num_experts, num_ranks)

    if cached:
        return recv_x_out, None, None, None, handle
    if recv_topk_idx is not None and not num_worst_tokens:
        num_recv_tokens_per_expert_list = received_expert_list(recv_topk_idx, num_recv_tokens, num_experts // num_ranks,
                                                               expert_alignment, num_worst_tokens)
    return dispatch_result((recv_x_out, recv_topk_idx, recv_topk_weights), num_recv_tokens_per_expert_list,
                           buffer_uid, x, num_recv_tokens, num_worst_tokens, is_token_in_rank, send_counts,
                           recv_counts, count_matrix, {"strategy": STRATEGY, "recv_pos": recv_pos,
                                         "tokens_per_rank": tokens_per_rank, "t_max": t_max})


def combine(be: ReferenceBackend, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None,
            biases: tuple[torch.Tensor, ...]):
    """Same arguments and results as ``normal.combine``; see the module docstring for the summation order."""
    state = strategy_state(handle, STRATEGY)
    hidden = x.shape[1]
    count_matrix = combine_handshake(be, STRATEGY, hidden, handle, topk_weights, len(biases))
    num_tokens, t_max, num_recv = handle.num_tokens, state["t_max"], handle.num_recv_tokens
    k = topk_weights.shape[1] if topk_weights is not None else 0
    if int(count_matrix.sum()) == 0:  # consistent on every rank: nothing moves
        reduced = torch.zeros((num_tokens, hidden + k), dtype=torch.float32, device=x.device)
    else:
        partial = torch.zeros((be.num_ranks * t_max, hidden + k), dtype=torch.float32, device=x.device)
        pos = state["recv_pos"]
        partial[pos, :hidden] = x[:num_recv].float()
        if k:
            partial[pos, hidden:] = topk_weights[:num_recv]
        reduced = be.transport.reduce_scatter(partial, "combine", be.seq, time.monotonic() + be.transport.timeout_s)
    acc = reduced[:num_tokens, :hidden]
    for bias in biases:
        acc = acc + bias.float()
    # Fresh dense outputs (a slice of one row or none would keep the buffer's strides).
    combined = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=x.device).copy_(acc)
    acc_w = None
    if k:
        acc_w = torch.empty((num_tokens, k), dtype=torch.float32, device=x.device).copy_(reduced[:num_tokens, hidden:])
    return combined, acc_w
