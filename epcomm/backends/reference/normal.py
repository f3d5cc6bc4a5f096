"""Normal mode on torch.distributed: layout, dispatch and combine as a variable-size all-to-all.

A call is one handshake (a small header every rank sends every rank: shapes and per-rank counts,
which size the exchanges) and then the rows, in flight together: x moves as it is (as 8-byte
words: gloo has no FP8, and row gathers run fastest on them), gathered by one ``index_select``
into destination order and received straight into the output, and the 4-byte words of scales,
top-k ids and weights move beside it in a second all-to-all; the per-expert counts are counted
from the received top-k ids. Rows travel in ascending token order per destination, so received
rows are ordered by source rank, then source token index, exactly as the kernels order them. The
combine sends x's rows back unchanged (they are already grouped by source) and sums each source's
block with one ``index_add_`` in fp32.
"""

from __future__ import annotations

import time

import torch

from ...handle import DispatchHandle
from ...utils.tensors import dense, row_words
from ..rows import check_worst_tokens, scale_kind
from .backend import F, Op, ReferenceBackend, check_strategy, mark_strategy, to_bytes


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


def start_expert_counts(be: ReferenceBackend, num_tokens_per_expert: torch.Tensor, num_experts: int):
    """Issue the exchange that tells each destination how many of this rank's entries target each of
    its experts ([R, E_local] int32 rows, one per rank): in flight beside the rows of a dispatch."""
    per_expert = num_tokens_per_expert.to(device=be.device, dtype=torch.int32).view(be.num_ranks, -1)
    ones = [1] * be.num_ranks
    return be.transport.start_all_to_all(per_expert, ones, ones)


def expert_list(recv_per_expert: torch.Tensor, expert_alignment: int, num_worst_tokens: int) -> list[int] | None:
    """This rank's received entries per local expert, rounded up to ``expert_alignment`` (None with
    ``num_worst_tokens``: the API returns no list then, but the exchange still happens)."""
    if num_worst_tokens:
        return None
    a = expert_alignment
    return [(c + a - 1) // a * a for c in recv_per_expert.sum(0).tolist()]


def exchange_expert_counts(be: ReferenceBackend, num_tokens_per_expert: torch.Tensor, num_experts: int,
                           expert_alignment: int, num_worst_tokens: int) -> list[int] | None:
    """``start_expert_counts`` and ``expert_list`` in one blocking call."""
    recv = start_expert_counts(be, num_tokens_per_expert, num_experts).wait(
        "dispatch", be.seq, time.monotonic() + be.transport.timeout_s)
    return expert_list(recv, expert_alignment, num_worst_tokens)


def dispatch_handshake(be: ReferenceBackend, strategy: str, x: torch.Tensor, scales: torch.Tensor | None,
                       topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None, cached: bool,
                       num_experts: int, send_counts: list[int]) -> torch.Tensor:
    """The dispatch handshake of every normal-mode strategy; returns the headers (``be.count_matrix``
    reads the counts)."""
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
    count_matrix = be.count_matrix(headers)
    live = be.transport.expected()  # masked ranks return nothing
    if count_matrix[live, be.rank].tolist() != [handle.send_counts[r] for r in live]:
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


def check_cached_counts(handle: DispatchHandle, recv_counts: list[int], live: list[int]) -> None:
    """A masked rank sends nothing: the rows the handle expects of it stay (as zeros)."""
    for r in range(len(recv_counts)):
        if r not in live:
            recv_counts[r] = handle.recv_counts[r]
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
    """The start of every strategy's dispatch: routing from the handle when cached, the handshake
    and the counts. Returns (headers, count_matrix [src, dst], recv_counts,
    is_token_in_rank, send_counts, num_worst_tokens)."""
    cached = handle is not None
    if cached:
        strategy_state(handle, strategy)
        is_token_in_rank, send_counts = handle.is_token_in_rank, list(handle.send_counts)
        num_worst_tokens = handle.num_worst_tokens
    else:
        send_counts = num_tokens_per_rank.tolist()
    headers = dispatch_handshake(be, strategy, x, scales, topk_idx, topk_weights, cached, num_experts, send_counts)
    count_matrix = be.count_matrix(headers)
    recv_counts = count_matrix[:, be.rank].tolist()
    if cached:
        check_cached_counts(handle, recv_counts, be.transport.expected())
    return headers, count_matrix, recv_counts, is_token_in_rank, send_counts, num_worst_tokens


def send_order(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """The tokens this rank sends, grouped by destination rank (ascending), ascending within each
    group: one device op, no host sync."""
    return torch.nonzero(is_token_in_rank.t())[:, 1]


def _meta_words(scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
                topk_weights: torch.Tensor | None) -> torch.Tensor | None:
    """[T, S + K + K] int32: a token's scales, top-k ids and weights as 4-byte words (one small
    all-to-all moves them beside the rows of x), or None when there is nothing but x."""
    parts = []
    if scales is not None:
        parts.append(scales.view(torch.int32) if scales.dtype == torch.float32 else scales)
    if topk_idx is not None:
        parts.append(topk_idx.to(torch.int32))
        if topk_weights is not None:
            parts.append(topk_weights.view(torch.int32))
    return torch.cat(parts, dim=1) if parts else None


def dispatch(be: ReferenceBackend, x: torch.Tensor, scales: torch.Tensor | None, handle: DispatchHandle | None,
             num_tokens_per_rank: torch.Tensor | None, is_token_in_rank: torch.Tensor | None,
             num_tokens_per_expert: torch.Tensor | None, topk_idx: torch.Tensor | None,
             topk_weights: torch.Tensor | None, expert_alignment: int, num_worst_tokens: int, num_experts: int,
             buffer_uid: str):
    """One handshake (shapes and counts), then in flight together: the rows of x straight into the
    output and the 4-byte words of scales, top-k ids and weights."""
    rank = be.rank
    cached = handle is not None
    headers, count_matrix, recv_counts, is_token_in_rank, send_counts, num_worst_tokens = dispatch_prologue(
        be, "alltoall", x, scales, handle, num_tokens_per_rank, is_token_in_rank, topk_idx, topk_weights,
        num_worst_tokens, num_experts)
    everyone_empty = int(count_matrix.sum()) == 0
    num_recv = sum(recv_counts)
    num_rows = num_worst_tokens or num_recv
    order = handle.backend_state["order"] if cached else send_order(is_token_in_rank)

    x = dense(x)
    # Room for every row even past num_worst_tokens: the rank that overflows raises after the
    # exchange, so its peers, whose counts fit, never wait for it.
    recv_x = x.new_empty((max(num_rows, num_recv), x.shape[1]))
    if num_rows > num_recv:
        recv_x[num_recv:].view(torch.uint8).zero_()
    meta = _meta_words(scales, None if cached else topk_idx, None if cached else topk_weights)
    recv_meta = None
    pending = []
    # The per-expert counts are the received top-k ids' (as the oracle states them); only a dispatch
    # without top-k ids exchanges the caller's num_tokens_per_expert.
    counts_exchange = None if cached or topk_idx is not None else \
        start_expert_counts(be, num_tokens_per_expert, num_experts)
    if not everyone_empty:
        send_x = row_words(x).index_select(0, order)
        pending.append(be.transport.start_all_to_all(send_x, send_counts, recv_counts,
                                                     out=row_words(recv_x[:num_recv])))
        if meta is not None:
            pending.append(be.transport.start_all_to_all(meta.index_select(0, order), send_counts, recv_counts))
    deadline = time.monotonic() + be.transport.timeout_s
    for p in pending:
        p.wait("dispatch", be.seq, deadline)
    check_worst_tokens(rank, num_recv, num_worst_tokens)
    experts = None if counts_exchange is None else \
        expert_list(counts_exchange.wait("dispatch", be.seq, deadline), expert_alignment, num_worst_tokens)
    if meta is not None:
        recv_meta = pending[1].recv if len(pending) > 1 else meta.new_empty((0, meta.shape[1]))
    recv_x_out, recv_topk_idx, recv_topk_weights = _split_meta(
        recv_x, recv_meta, num_recv, num_rows, scales, None if cached else topk_idx,
        None if cached else topk_weights, rank, num_experts, be.num_ranks)

    if cached:
        return recv_x_out, None, None, None, handle
    if recv_topk_idx is not None and not num_worst_tokens:
        local = recv_topk_idx[:num_recv]
        per_expert = torch.bincount(local[local >= 0], minlength=num_experts // be.num_ranks)
        experts = expert_list(per_expert.unsqueeze(0), expert_alignment, num_worst_tokens)
    return dispatch_result((recv_x_out, recv_topk_idx, recv_topk_weights), experts, buffer_uid, x, num_recv,
                           num_worst_tokens, is_token_in_rank, send_counts, recv_counts, count_matrix,
                           {"order": order})


def _split_meta(recv_x: torch.Tensor, recv_meta: torch.Tensor | None, num_recv: int, num_rows: int,
                scales: torch.Tensor | None, topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None,
                rank: int, num_experts: int, num_ranks: int):
    """(recv_x or (data, scales), recv_topk_idx, recv_topk_weights) from the received words; rows past
    ``num_recv`` (num_worst_tokens): scales 0, ids -1, weights 0. Top-k ids become local ids."""
    col = 0

    def take(cols: int, dtype: torch.dtype, fill: float | int) -> torch.Tensor:
        nonlocal col
        out = torch.empty((num_rows, cols), dtype=dtype, device=recv_x.device)
        if num_rows > num_recv:
            out[num_recv:] = fill
        if num_recv and cols:
            words = recv_meta[:num_recv, col:col + cols]
            out[:num_recv] = words.view(dtype) if dtype.itemsize == 4 else words
        col += cols
        return out

    recv_x_out = recv_x
    if scales is not None:
        recv_x_out = (recv_x, take(scales.shape[1], scales.dtype, 0))  # row-major, as DeepEP returns them
    recv_topk_idx = recv_topk_weights = None
    if topk_idx is not None:
        k = topk_idx.shape[1]
        global_idx = take(k, torch.int64, -1)
        lo = rank * (num_experts // num_ranks)
        mine = (global_idx >= lo) & (global_idx < lo + num_experts // num_ranks)
        recv_topk_idx = torch.where(mine, global_idx - lo, -1)
        if topk_weights is not None:
            recv_topk_weights = torch.where(mine, take(k, torch.float32, 0), 0.0)
    return recv_x_out, recv_topk_idx, recv_topk_weights


def combine(be: ReferenceBackend, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None,
            biases: tuple[torch.Tensor, ...]):
    """The rows go back as they are (no packing): x's first rows are already grouped by source rank,
    the order the peers expect; the weights travel beside them. Each source block is summed in fp32
    with one index_add_ (a block holds a token once, so the sum order is ascending source rank on
    every device)."""
    hidden = x.shape[1]
    count_matrix = combine_handshake(be, "alltoall", hidden, handle, topk_weights, len(biases))
    everyone_empty = int(count_matrix.sum()) == 0
    num_recv, num_tokens = handle.num_recv_tokens, handle.num_tokens
    order = strategy_state(handle, "alltoall")["order"]
    num_back = order.numel()
    recv = x.new_empty((num_back, hidden))
    k = topk_weights.shape[1] if topk_weights is not None else 0
    recv_w = None
    pending = []
    if not everyone_empty:
        pending.append(be.transport.start_all_to_all(row_words(dense(x[:num_recv])), handle.recv_counts,
                                                     handle.send_counts, out=row_words(recv)))
        if k:
            pending.append(be.transport.start_all_to_all(dense(topk_weights[:num_recv]), handle.recv_counts,
                                                         handle.send_counts))
    deadline = time.monotonic() + be.transport.timeout_s
    for p in pending:
        p.wait("combine", be.seq, deadline)
    acc = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
    acc_w = torch.zeros((num_tokens, k), dtype=torch.float32, device=x.device) if k else None
    if k and len(pending) > 1:
        recv_w = pending[1].recv
    if not everyone_empty:
        begin = 0
        live = be.transport.expected()  # a masked rank's rows are absent from the sums
        for src, count in enumerate(handle.send_counts):  # ascending source rank: the oracle's fp32 order
            if count and src in live:
                rows = order[begin:begin + count]
                acc.index_add_(0, rows, recv[begin:begin + count].float())
                if acc_w is not None:
                    acc_w.index_add_(0, rows, recv_w[begin:begin + count])
            begin += count
    for bias in biases:
        acc += bias.float()
    return acc.to(torch.bfloat16), acc_w
