"""Normal mode on torch.distributed: layout, dispatch and combine as a variable-size all-to-all.

Every token row is packed into bytes (data | scales | top-k ids | top-k weights) so one
all-to-all moves all of it. Rows travel in ascending token order per destination, so received
rows are ordered by source rank, then source token index, exactly as the kernels order them.
"""

from __future__ import annotations

import torch

from ...handle import DispatchHandle
from ..rows import check_worst_tokens, pack_token_rows, scale_kind, unpack_token_rows
from .backend import F, Op, ReferenceBackend, check_strategy, from_bytes, mark_strategy, to_bytes


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_domain: int):
    """Counts per rank, per domain and per expert, and which ranks each token goes to (-1 ignored)."""
    num_tokens = topk_idx.shape[0]
    experts_per_rank = num_experts // num_ranks
    valid = topk_idx >= 0
    safe = topk_idx.clamp(min=0)
    num_tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64, device=topk_idx.device)
    num_tokens_per_expert.scatter_add_(0, safe[valid], torch.ones_like(safe[valid]))
    dest_rank = torch.where(valid, safe // experts_per_rank, torch.full_like(safe, num_ranks))
    in_rank = torch.zeros((num_tokens, num_ranks + 1), dtype=torch.bool, device=topk_idx.device)
    in_rank.scatter_(1, dest_rank, True)
    is_token_in_rank = in_rank[:, :num_ranks].contiguous()
    num_tokens_per_rank = is_token_in_rank.sum(0).to(torch.int32)
    num_tokens_per_domain = None
    num_domains = num_ranks // ranks_per_domain
    if num_domains > 1:
        in_domain = is_token_in_rank.view(num_tokens, num_domains, ranks_per_domain).any(-1)
        num_tokens_per_domain = in_domain.sum(0).to(torch.int32)
    return num_tokens_per_rank, num_tokens_per_domain, num_tokens_per_expert.to(torch.int32), is_token_in_rank


def exchange_expert_counts(be: ReferenceBackend, num_tokens_per_expert: torch.Tensor, num_experts: int,
                           expert_alignment: int, num_worst_tokens: int) -> list[int] | None:
    """Each rank tells each destination how many of its entries target each of that rank's experts;
    returns this rank's received counts per local expert, rounded up to ``expert_alignment`` (None
    with ``num_worst_tokens``: the API returns no list then, but the exchange still happens)."""
    num_ranks = be.num_ranks
    experts_per_rank = num_experts // num_ranks
    per_expert = num_tokens_per_expert.to(torch.int32).view(num_ranks, experts_per_rank)
    recv_per_expert = be.exchange_rows(to_bytes(per_expert.to(be.device)), [1] * num_ranks, [1] * num_ranks,
                                       Op.DISPATCH, everyone_empty=False)
    totals = from_bytes(recv_per_expert, torch.int32, experts_per_rank).sum(0).tolist()
    if num_worst_tokens:
        return None
    a = expert_alignment
    return [(c + a - 1) // a * a for c in totals]


def dispatch_handshake(be: ReferenceBackend, strategy: str, x: torch.Tensor, scales: torch.Tensor | None,
                       topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None, cached: bool,
                       num_experts: int, send_counts: list[int]) -> torch.Tensor:
    """The dispatch handshake of every normal-mode strategy; returns the headers [R, 16 + R]."""
    headers = be.handshake(Op.DISPATCH, mark_strategy({
        F.HIDDEN: x.shape[1], F.NUM_EXPERTS: num_experts, F.X_KIND: scale_kind(scales),
        F.SCALE_COLS: scales.shape[1] if scales is not None else 0,
        F.NUM_TOPK: topk_idx.shape[1] if topk_idx is not None else -1,
        F.HAS_WEIGHTS: int(topk_weights is not None), F.CACHED: int(cached), F.NUM_TOKENS: x.shape[0],
    }, strategy), counts=send_counts)
    check_strategy(headers, strategy, "dispatch")  # a peer of another strategy would wait for other rows
    return headers


def combine_handshake(be: ReferenceBackend, strategy: str, hidden: int, handle: DispatchHandle,
                      topk_weights: torch.Tensor | None, num_biases: int) -> torch.Tensor:
    """The combine handshake of every normal-mode strategy; returns the count matrix [src, dst]."""
    headers = be.handshake(Op.COMBINE, mark_strategy({
        F.HIDDEN: hidden, F.HAS_WEIGHTS: int(topk_weights is not None),
        F.NUM_TOPK: topk_weights.shape[1] if topk_weights is not None else -1, F.FLAGS: num_biases,
        F.NUM_TOKENS: handle.num_tokens,
    }, strategy), counts=handle.recv_counts)
    check_strategy(headers, strategy, "combine")
    count_matrix = headers[:, 16:]
    if count_matrix[:, be.rank].tolist() != handle.send_counts:
        raise RuntimeError("epcomm combine: peers return a different number of rows than this rank dispatched; "
                           "every rank must combine with the handle of the same dispatch")
    return count_matrix


def combine_rows(x: torch.Tensor, topk_weights: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    """The rows a combine returns, as bytes: bf16 data, then the fp32 top-k weights if any."""
    parts = [to_bytes(x[:num_rows])]
    if topk_weights is not None:
        parts.append(to_bytes(topk_weights[:num_rows]))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def strategy_state(handle: DispatchHandle, strategy: str) -> dict:
    """The handle's backend state, which must come from a dispatch of ``strategy``."""
    if handle.backend_state.get("strategy", "alltoall") != strategy:
        raise ValueError("handle was made by a dispatch of another strategy; pass this Buffer's handle")
    return handle.backend_state


def check_cached_counts(handle: DispatchHandle, recv_counts: list[int]) -> None:
    if recv_counts != handle.recv_counts:
        raise RuntimeError(f"epcomm dispatch: cached handle expects {handle.recv_counts} rows per source rank "
                           f"but peers now send {recv_counts}; use the handle of the matching dispatch")


def dispatch_result(outputs: tuple, expert_list: list[int] | None, buffer_uid: str, x: torch.Tensor,
                    num_recv_tokens: int, num_worst_tokens: int, is_token_in_rank: torch.Tensor,
                    send_counts: list[int], recv_counts: list[int], count_matrix: torch.Tensor,
                    state: dict | None = None):
    """What a fresh dispatch returns: its outputs, the per-expert counts and a new handle
    (``count_matrix``: the handshake's [src, dst] rows, which handle[0] sums)."""
    handle = DispatchHandle(buffer_uid=buffer_uid, num_tokens=x.shape[0], hidden=x.shape[1],
                            num_recv_tokens=num_recv_tokens, num_worst_tokens=num_worst_tokens,
                            is_token_in_rank=is_token_in_rank, send_counts=send_counts, recv_counts=recv_counts,
                            backend_state=state or {}, count_matrix=count_matrix)
    return (*outputs, expert_list if expert_list is not None else [], handle)


def dispatch_prologue(be: ReferenceBackend, strategy: str, x: torch.Tensor, scales: torch.Tensor | None,
                      handle: DispatchHandle | None, num_tokens_per_rank: torch.Tensor | None,
                      is_token_in_rank: torch.Tensor | None, topk_idx: torch.Tensor | None,
                      topk_weights: torch.Tensor | None, num_worst_tokens: int, num_experts: int):
    """The start of every strategy's dispatch: routing from the handle when cached, the handshake,
    the counts. Returns (headers, count_matrix [src, dst], recv_counts, is_token_in_rank, send_counts,
    num_worst_tokens)."""
    cached = handle is not None
    if cached:
        strategy_state(handle, strategy)
        is_token_in_rank, send_counts = handle.is_token_in_rank, list(handle.send_counts)
        num_worst_tokens = handle.num_worst_tokens
    else:
        send_counts = num_tokens_per_rank.tolist()
    headers = dispatch_handshake(be, strategy, x, scales, topk_idx, topk_weights, cached, num_experts, send_counts)
    count_matrix = headers[:, 16:]
    recv_counts = count_matrix[:, be.rank].tolist()
    if cached:
        check_cached_counts(handle, recv_counts)
    return headers, count_matrix, recv_counts, is_token_in_rank, send_counts, num_worst_tokens


def dispatch(be: ReferenceBackend, x: torch.Tensor, scales: torch.Tensor | None, handle: DispatchHandle | None,
             num_tokens_per_rank: torch.Tensor | None, is_token_in_rank: torch.Tensor | None,
             num_tokens_per_expert: torch.Tensor | None, topk_idx: torch.Tensor | None,
             topk_weights: torch.Tensor | None, expert_alignment: int, num_worst_tokens: int, num_experts: int,
             buffer_uid: str):
    rank, num_ranks = be.rank, be.num_ranks
    num_tokens = x.shape[0]
    cached = handle is not None
    headers, count_matrix, recv_counts, is_token_in_rank, send_counts, num_worst_tokens = dispatch_prologue(
        be, "alltoall", x, scales, handle, num_tokens_per_rank, is_token_in_rank, topk_idx, topk_weights,
        num_worst_tokens, num_experts)
    everyone_empty = int(count_matrix.sum()) == 0

    num_recv_tokens_per_expert_list = None if cached else \
        exchange_expert_counts(be, num_tokens_per_expert, num_experts, expert_alignment, num_worst_tokens)

    packed = pack_token_rows(x, scales, topk_idx, topk_weights)
    token_order = [torch.nonzero(is_token_in_rank[:, r]).flatten() for r in range(num_ranks)]
    send = packed.index_select(0, torch.cat(token_order)) if num_tokens else packed
    recv = be.exchange_rows(send, send_counts, recv_counts, Op.DISPATCH, everyone_empty)
    num_recv_tokens = sum(recv_counts)
    check_worst_tokens(rank, num_recv_tokens, num_worst_tokens)
    recv_x_out, recv_topk_idx, recv_topk_weights = unpack_token_rows(
        recv, num_recv_tokens, num_worst_tokens or num_recv_tokens, x, scales, topk_idx, topk_weights, rank,
        num_experts, num_ranks)

    if cached:
        return recv_x_out, None, None, None, handle
    return dispatch_result((recv_x_out, recv_topk_idx, recv_topk_weights), num_recv_tokens_per_expert_list,
                           buffer_uid, x, num_recv_tokens, num_worst_tokens, is_token_in_rank, send_counts,
                           recv_counts, count_matrix)


def combine(be: ReferenceBackend, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None,
            biases: tuple[torch.Tensor, ...]):
    num_ranks = be.num_ranks
    hidden = x.shape[1]
    count_matrix = combine_handshake(be, "alltoall", hidden, handle, topk_weights, len(biases))
    everyone_empty = int(count_matrix.sum()) == 0
    num_recv = handle.num_recv_tokens
    send = combine_rows(x, topk_weights, num_recv)
    recv = be.exchange_rows(send, handle.recv_counts, handle.send_counts, Op.COMBINE, everyone_empty)

    num_tokens = handle.num_tokens
    acc = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
    k = topk_weights.shape[1] if topk_weights is not None else 0
    acc_w = torch.zeros((num_tokens, k), dtype=torch.float32, device=x.device) if k else None
    begin = 0
    for r in range(num_ranks):  # ascending source rank: a fixed fp32 summation order
        count = handle.send_counts[r]
        if count == 0:
            continue
        rows = recv[begin:begin + count]
        idx = torch.nonzero(handle.is_token_in_rank[:, r]).flatten()
        acc.index_add_(0, idx, from_bytes(rows[:, :hidden * 2], torch.bfloat16, hidden).float())
        if acc_w is not None:
            acc_w.index_add_(0, idx, from_bytes(rows[:, hidden * 2:], torch.float32, k))
        begin += count
    for bias in biases:
        acc += bias.float()
    return acc.to(torch.bfloat16), acc_w

