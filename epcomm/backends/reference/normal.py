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

Inside a CUDA graph capture (a ``num_worst_tokens`` dispatch, its cached dispatches and combines)
nothing may wait on the host, so the exchanges have fixed sizes and no handshake (the eager calls
before the capture agreed, and every rank dispatched the same number of tokens T): each rank sends
each peer a block of T rows (its tokens for that peer first, in order; a flag word marks them) and
places what arrives by the flags, source by source, into the num_worst_tokens rows; the combine
returns the blocks the same way. The rows, their order and the sums are the eager path's. A
receive past num_worst_tokens cannot raise inside a graph: it is kept out of the outputs and the
next eager call raises.
"""

from __future__ import annotations

import time

import torch

from ...handle import DispatchHandle
from ...utils.tensors import dense, nonzero_counted, row_words
from ..rows import check_worst_tokens, scale_kind
from .backend import F, Op, ReferenceBackend, check_strategy, counts, in_graph, mark_strategy, to_bytes


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_domain: int):
    """Counts per rank, per domain and per expert, and which ranks each token goes to (-1 ignored)."""
    num_tokens = topk_idx.shape[0]
    experts_per_rank = num_experts // num_ranks
    valid = (topk_idx >= 0) & (topk_idx < num_experts)  # past the experts: only a graph skips the host check
    safe = topk_idx.clamp(min=0)
    num_tokens_per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_idx.device)  # +1: ids -1
    num_tokens_per_expert.scatter_add_(0, torch.where(valid, safe, num_experts).flatten(),
                                       torch.ones_like(safe).flatten())
    num_tokens_per_expert = num_tokens_per_expert[:num_experts]
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


def received_expert_list(recv_topk_idx: torch.Tensor, num_recv: int, experts_per_rank: int, expert_alignment: int,
                         num_worst_tokens: int) -> list[int] | None:
    """The per-expert list counted from the received top-k ids (local ids; -1 for other ranks'), as the
    oracle states it: no exchange of the caller's counts. One host read (the ids of other ranks count
    in a spare bin)."""
    local = recv_topk_idx[:num_recv].flatten()
    per_expert = counts(torch.where(local >= 0, local, experts_per_rank), experts_per_rank + 1)
    return expert_list(per_expert[:experts_per_rank].unsqueeze(0), expert_alignment, num_worst_tokens)


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


def combine_headers(be: ReferenceBackend, strategy: str, hidden: int, handle: DispatchHandle,
                    topk_weights: torch.Tensor | None, num_biases: int, counts: list[int] | None) -> torch.Tensor:
    """The combine handshake of every normal-mode strategy, with ``counts`` (the rows each rank gets
    back) or none (the fixed-size path); returns the headers."""
    headers = be.handshake(Op.COMBINE, mark_strategy({
        F.HIDDEN: hidden, F.HAS_WEIGHTS: int(topk_weights is not None),
        F.NUM_TOPK: topk_weights.shape[1] if topk_weights is not None else -1, F.FLAGS: num_biases,
        F.NUM_TOKENS: handle.num_tokens,
    }, strategy), counts=counts)
    check_strategy(headers, strategy, "combine")
    return headers


def combine_handshake(be: ReferenceBackend, strategy: str, hidden: int, handle: DispatchHandle,
                      topk_weights: torch.Tensor | None, num_biases: int) -> torch.Tensor:
    """The combine handshake with the handle's counts; returns the count matrix [src, dst]."""
    headers = combine_headers(be, strategy, hidden, handle, topk_weights, num_biases, handle.recv_counts)
    count_matrix = be.count_matrix(headers)
    live = be.transport.expected()  # masked ranks return nothing
    returned = count_matrix[:, be.rank].tolist()
    if any(returned[r] != handle.send_counts[r] for r in live):
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
    be.dispatch_tokens = headers[:, F.NUM_TOKENS].tolist()  # what a graph's dispatch may assume (_dispatch_fixed)
    count_matrix = be.count_matrix(headers)
    recv_counts = count_matrix[:, be.rank].tolist()
    if cached:
        check_cached_counts(handle, recv_counts, be.transport.expected())
    return headers, count_matrix, recv_counts, is_token_in_rank, send_counts, num_worst_tokens


def send_order(is_token_in_rank: torch.Tensor, num_sent: int | None = None) -> torch.Tensor:
    """The tokens this rank sends, grouped by destination rank (ascending), ascending within each
    group: one device op. ``num_sent`` (the counts' sum, known on the host) spares a GPU the host read
    of the size that ``nonzero`` makes."""
    pairs = is_token_in_rank.t()
    return (torch.nonzero(pairs) if num_sent is None else nonzero_counted(pairs, num_sent))[:, 1]


def _meta_words(scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
                topk_weights: torch.Tensor | None) -> torch.Tensor | None:
    """[T, S + K + K] int32: a token's scales, top-k ids and weights as 4-byte words (they travel beside
    the rows of x), or None when there is nothing but x."""
    parts = []
    if scales is not None:
        parts.append(scales.view(torch.int32) if scales.dtype == torch.float32 else scales)
    if topk_idx is not None:
        parts.append(topk_idx.to(torch.int32))
        if topk_weights is not None:
            parts.append(topk_weights.view(torch.int32))
    return torch.cat(parts, dim=1) if parts else None


def send_rows(be: ReferenceBackend, words: torch.Tensor, meta: torch.Tensor | None, order: torch.Tensor,
              send_counts: list[int], recv_counts: list[int], out: torch.Tensor, op: str, deadline: float):
    """Move the rows of ``words`` (x as words) in ``order`` to their ranks, received into ``out``, and
    ``meta``'s rows beside them. Returns (received meta or None, finish): ``finish()`` completes the
    rows, which may still be in flight when the meta is in.

    A group of one rank gathers straight into ``out``. Otherwise the meta goes first, in an exchange of
    its own, so that it is in while the rows still travel (the host reads the per-expert counts from
    it)."""
    if be.num_ranks == 1 and be.transport.live is None:
        torch.index_select(words, 0, order, out=out)
        return (None if meta is None else meta.index_select(0, order)), lambda: None
    pending_meta = None
    if meta is not None:
        pending_meta = be.transport.start_all_to_all(meta.index_select(0, order), send_counts, recv_counts)
    send = be.scratch("send", (order.numel(), words.shape[1]), words.dtype)
    torch.index_select(words, 0, order, out=send)
    pending = be.transport.start_all_to_all(send, send_counts, recv_counts, out=out)
    recv_meta = None if pending_meta is None else pending_meta.wait(op, be.seq, deadline)
    return recv_meta, lambda: pending.wait(op, be.seq, deadline)


def dispatch(be: ReferenceBackend, x: torch.Tensor, scales: torch.Tensor | None, handle: DispatchHandle | None,
             num_tokens_per_rank: torch.Tensor | None, is_token_in_rank: torch.Tensor | None,
             num_tokens_per_expert: torch.Tensor | None, topk_idx: torch.Tensor | None,
             topk_weights: torch.Tensor | None, expert_alignment: int, num_worst_tokens: int, num_experts: int,
             buffer_uid: str):
    """One handshake (shapes and counts), then in flight together: the rows of x straight into the
    output and the 4-byte words of scales, top-k ids and weights."""
    if in_graph(x.device) or (handle is not None and handle.backend_state.get("fixed")):
        return _dispatch_fixed(be, x, scales, handle, is_token_in_rank, topk_idx, topk_weights, num_worst_tokens,
                               num_experts, buffer_uid)
    rank = be.rank
    cached = handle is not None
    headers, count_matrix, recv_counts, is_token_in_rank, send_counts, num_worst_tokens = dispatch_prologue(
        be, "alltoall", x, scales, handle, num_tokens_per_rank, is_token_in_rank, topk_idx, topk_weights,
        num_worst_tokens, num_experts)
    everyone_empty = int(count_matrix.sum()) == 0
    num_recv = sum(recv_counts)
    num_rows = num_worst_tokens or num_recv
    order = handle.backend_state["order"] if cached else send_order(is_token_in_rank, sum(send_counts))

    x = dense(x)
    # Room for every row even past num_worst_tokens: the rank that overflows raises after the
    # exchange, so its peers, whose counts fit, never wait for it.
    recv_x = x.new_empty((max(num_rows, num_recv), x.shape[1]))
    if num_rows > num_recv:
        recv_x[num_recv:].view(torch.uint8).zero_()
    meta = _meta_words(scales, None if cached else topk_idx, None if cached else topk_weights)
    # The per-expert counts are the received top-k ids' (as the oracle states them); only a dispatch
    # without top-k ids exchanges the caller's num_tokens_per_expert.
    counts_exchange = None if cached or topk_idx is not None else \
        start_expert_counts(be, num_tokens_per_expert, num_experts)
    deadline = time.monotonic() + be.transport.timeout_s
    recv_meta, finish = None, lambda: None
    if not everyone_empty:
        recv_meta, finish = send_rows(be, row_words(x), meta, order, send_counts, recv_counts,
                                      row_words(recv_x[:num_recv]), "dispatch", deadline)
    try:  # the rows may still be in flight: complete them even where this rank raises
        check_worst_tokens(rank, num_recv, num_worst_tokens)
        experts = None if counts_exchange is None else \
            expert_list(counts_exchange.wait("dispatch", be.seq, deadline), expert_alignment, num_worst_tokens)
        if meta is not None and recv_meta is None:
            recv_meta = meta.new_empty((0, meta.shape[1]))
        recv_x_out, recv_topk_idx, recv_topk_weights = _split_meta(
            recv_x, recv_meta, num_recv, num_rows, scales, None if cached else topk_idx,
            None if cached else topk_weights, rank, num_experts, be.num_ranks)
        if recv_topk_idx is not None and not num_worst_tokens and not cached:
            experts = received_expert_list(recv_topk_idx, num_recv, num_experts // be.num_ranks, expert_alignment,
                                           num_worst_tokens)
    finally:
        finish()
    if cached:
        return recv_x_out, None, None, None, handle
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
    if in_graph(x.device) or handle.backend_state.get("fixed"):
        return _combine_fixed(be, x, handle, topk_weights, biases)
    hidden = x.shape[1]
    count_matrix = combine_handshake(be, "alltoall", hidden, handle, topk_weights, len(biases))
    everyone_empty = int(count_matrix.sum()) == 0
    num_recv, num_tokens = handle.num_recv_tokens, handle.num_tokens
    order = strategy_state(handle, "alltoall")["order"]
    k = topk_weights.shape[1] if topk_weights is not None else 0
    deadline = time.monotonic() + be.transport.timeout_s
    if be.num_ranks == 1 and be.transport.live is None and not biases:
        return _combine_local(x[:num_recv], topk_weights[:num_recv] if k else None, order, num_tokens)
    recv, recv_w = (None, None) if everyone_empty else return_rows(be, x[:num_recv], topk_weights, handle, deadline)
    acc = be.scratch("sum", (num_tokens, hidden), torch.float32).zero_()
    acc_w = torch.zeros((num_tokens, k), dtype=torch.float32, device=x.device) if k else None
    if recv is not None:
        live = be.transport.expected()  # a masked rank's rows are absent from the sums
        if x.device.type == "cpu" and len(live) == be.num_ranks:
            # The host adds an index_add_'s rows in their order, so one call over every block sums each
            # token in ascending source rank, as the blocks come.
            acc.index_add_(0, order, be.scratch("block", recv.shape, torch.float32).copy_(recv))
            if acc_w is not None:
                acc_w.index_add_(0, order, recv_w)
        else:
            begin = 0
            block = be.scratch("block", (max(handle.send_counts), hidden), torch.float32)
            for src, count in enumerate(handle.send_counts):  # ascending source rank: the oracle's fp32 order
                if count and src in live:
                    rows = order[begin:begin + count]
                    acc.index_add_(0, rows, block[:count].copy_(recv[begin:begin + count]))
                    if acc_w is not None:
                        acc_w.index_add_(0, rows, recv_w[begin:begin + count])
                begin += count
    for bias in biases:
        acc += bias.float()
    return acc.to(torch.bfloat16), acc_w


def return_rows(be: ReferenceBackend, x: torch.Tensor, topk_weights: torch.Tensor | None, handle: DispatchHandle,
                deadline: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The combine's exchange: x's rows (already grouped by source rank) back to their sources, the
    weights beside them. Returns the rows (bf16, in this rank's send order) and the weights or None."""
    recv = be.scratch("back", (sum(handle.send_counts), x.shape[1]), x.dtype)
    pending = [be.transport.start_all_to_all(row_words(dense(x)), handle.recv_counts, handle.send_counts,
                                             out=row_words(recv))]
    if topk_weights is not None:
        pending.append(be.transport.start_all_to_all(dense(topk_weights[:x.shape[0]]), handle.recv_counts,
                                                      handle.send_counts))
    received = [p.wait("combine", be.seq, deadline) for p in pending]
    return recv, received[1] if topk_weights is not None else None


def _combine_local(x: torch.Tensor, topk_weights: torch.Tensor | None, order: torch.Tensor, num_tokens: int):
    """A group of one rank: each row goes back to its token, no exchange, no fp32 sum (a token has one
    row); ``add_(0.0)`` turns -0 into +0, as the sum from +0 does."""
    fresh = x.new_empty if order.numel() == num_tokens else x.new_zeros  # every token has its row, or some none
    out = fresh((num_tokens, x.shape[1]))
    row_words(out).index_copy_(0, order, row_words(dense(x)))
    out.add_(0.0)
    out_w = None
    if topk_weights is not None:
        out_w = torch.zeros((num_tokens, topk_weights.shape[1]), dtype=torch.float32, device=x.device)
        out_w.index_copy_(0, order, topk_weights.float()).add_(0.0)
    return out, out_w


def _check_equal_tokens(be: ReferenceBackend, op: str, headers: torch.Tensor | None, num_tokens: int) -> None:
    """The fixed-size exchanges' condition: every rank has ``num_tokens`` tokens. Eager: the handshake's
    ``headers`` say; in a graph (no handshake) the eager dispatch before the capture did."""
    tokens = headers[:, F.NUM_TOKENS].tolist() if headers is not None else be.dispatch_tokens
    if not tokens or set(tokens) != {num_tokens}:
        raise RuntimeError(f"epcomm {op}: in a CUDA graph the portable path needs every rank to dispatch the same "
                           f"number of tokens, as in an eager dispatch before the capture (ranks' tokens: "
                           f"{tokens or 'no eager dispatch yet'}, this rank now {num_tokens})")


def _dispatch_fixed(be: ReferenceBackend, x: torch.Tensor, scales: torch.Tensor | None,
                    handle: DispatchHandle | None, is_token_in_rank: torch.Tensor | None,
                    topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None, num_worst_tokens: int,
                    num_experts: int, buffer_uid: str):
    """The dispatch as a CUDA graph captures it (module docstring): a block of T rows per peer, a flag
    word marking the rows sent, nothing read on the host."""
    rank, num_ranks = be.rank, be.num_ranks
    num_tokens, hidden = x.shape
    cached = handle is not None
    graph = in_graph(x.device)
    if cached:
        is_token_in_rank, num_rows = handle.is_token_in_rank, handle.num_recv_rows
    elif not num_worst_tokens:
        raise RuntimeError("epcomm dispatch: inside a CUDA graph a dispatch needs num_worst_tokens (its outputs' fixed "
                           "row count: nothing may wait on the host for the received count)")
    else:
        num_rows = num_worst_tokens
    headers = None if graph else dispatch_handshake(be, "alltoall", x, scales, topk_idx, topk_weights, cached,
                                                    num_experts, None)
    _check_equal_tokens(be, "dispatch", headers, num_tokens)
    dev = x.device
    block = num_tokens
    # Pair (t, d), row-major: token t's place in its block for rank d (its rank among d's tokens).
    place = torch.cumsum(is_token_in_rank.to(torch.int64), 0) - 1
    send_pos = torch.where(is_token_in_rank, torch.arange(num_ranks, device=dev) * block + place,
                           num_ranks * block).flatten()
    # The token at each place of the send blocks (T: none; the extra last place takes the pairs not
    # sent), so each block row is gathered straight from x.
    token_of = torch.arange(num_tokens, device=dev).repeat_interleave(num_ranks)
    token_at = torch.full((num_ranks * block + 1,), num_tokens, dtype=torch.int64, device=dev)
    token_at.index_copy_(0, send_pos, token_of)
    token_at = token_at[:-1]
    sent_here = (token_at < num_tokens).unsqueeze(1)
    source_token = token_at.clamp(max=max(num_tokens - 1, 0))  # a row no one reads where none is sent
    words = row_words(dense(x))
    send_x = words.index_select(0, source_token)
    meta = _meta_words(scales, None if cached else topk_idx, None if cached else topk_weights)
    flags = torch.ones((num_tokens, 1), dtype=torch.int32, device=dev)
    meta = flags if meta is None else torch.cat([flags, meta], dim=1)
    send_meta = torch.where(sent_here, meta.index_select(0, source_token), 0)  # flag 0: not sent
    recv_x = words.new_empty((num_ranks * block, words.shape[1]))
    sizes = [block] * num_ranks
    pending = [be.transport.start_all_to_all(send_x, sizes, sizes, out=recv_x),
               be.transport.start_all_to_all(send_meta, sizes, sizes)]
    deadline = time.monotonic() + be.transport.timeout_s
    for p in pending:
        p.wait("dispatch", be.seq, deadline)
    recv_meta = pending[1].recv
    # A block's first rows are its source's, in order: output row = rows of the sources before + place.
    sent = (recv_meta[:, 0] == 1).view(num_ranks, block)
    per_source = sent.sum(1)
    out_pos = (torch.cumsum(per_source, 0) - per_source).unsqueeze(1) + torch.arange(block, device=dev)
    fits = sent & (out_pos < num_rows)
    be.note_graph_overflow(sent & ~fits)
    overflow = None if graph else be.take_graph_overflow()  # eager: this rank raises now, as check_worst_tokens
    if overflow is not None:
        raise overflow
    out_pos = torch.where(fits, out_pos, num_rows).flatten()
    out_x = x.new_zeros((num_rows + 1, hidden))  # rows past the received ones are zero, as eager
    row_words(out_x).index_copy_(0, out_pos, recv_x)
    out_meta = torch.zeros((num_rows + 1, meta.shape[1] - 1), dtype=torch.int32, device=dev)
    if not cached and topk_idx is not None:  # ids past the received rows are -1
        first_id = scales.shape[1] if scales is not None else 0
        out_meta[:, first_id:first_id + topk_idx.shape[1]] = -1
    out_meta.index_copy_(0, out_pos, recv_meta[:, 1:])
    recv_x_out, recv_topk_idx, recv_topk_weights = _split_meta(
        out_x[:num_rows], out_meta[:num_rows], num_rows, num_rows, scales, None if cached else topk_idx,
        None if cached else topk_weights, rank, num_experts, num_ranks)
    if cached:
        return recv_x_out, None, None, None, handle
    # What the combine needs: each output row's place in the blocks (num_rows * ... : none), and the
    # token at each place of this rank's send blocks.
    out_src = torch.full((num_rows + 1,), num_ranks * block, dtype=torch.int64, device=dev)
    out_src.index_copy_(0, out_pos, torch.arange(num_ranks * block, device=dev))
    state = {"fixed": True, "out_src": out_src[:num_rows], "token_at": token_at}
    # No counts reach the host: the handle's are empty, its rows num_worst_tokens, its count matrix unknown.
    return dispatch_result((recv_x_out, recv_topk_idx, recv_topk_weights), None, buffer_uid, x, num_rows, num_rows,
                           is_token_in_rank, [], [], None, state)


def _combine_fixed(be: ReferenceBackend, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None,
                   biases: tuple[torch.Tensor, ...]):
    """The combine of a graph's dispatch (or inside a graph): each row goes back to its place in its
    source's block; the source sums the blocks in ascending rank order, rows past a block's count
    into a spare row."""
    st = strategy_state(handle, "alltoall")
    if not st.get("fixed"):
        raise RuntimeError("epcomm combine: inside a CUDA graph the portable combine needs the handle of a dispatch "
                           "captured with num_worst_tokens (or a cached dispatch of one)")
    num_ranks, num_tokens, hidden = be.num_ranks, handle.num_tokens, x.shape[1]
    if not in_graph(x.device):
        headers = combine_headers(be, "alltoall", hidden, handle, topk_weights, len(biases), None)
        _check_equal_tokens(be, "combine", headers, num_tokens)
    block = num_tokens
    num_rows = handle.num_recv_rows
    words = row_words(dense(x[:num_rows]))
    send = words.new_zeros((num_ranks * block + 1, words.shape[1]))  # rows a receiver dropped add +0
    send.index_copy_(0, st["out_src"], words)
    recv = words.new_empty((num_ranks * block, words.shape[1]))
    sizes = [block] * num_ranks
    pending = [be.transport.start_all_to_all(send[:-1], sizes, sizes, out=recv)]
    k = topk_weights.shape[1] if topk_weights is not None else 0
    if k:
        send_w = torch.zeros((num_ranks * block + 1, k), dtype=torch.float32, device=x.device)
        send_w.index_copy_(0, st["out_src"], topk_weights[:num_rows].float())
        pending.append(be.transport.start_all_to_all(send_w[:-1], sizes, sizes))
    deadline = time.monotonic() + be.transport.timeout_s
    for p in pending:
        p.wait("combine", be.seq, deadline)
    rows = recv.view(torch.bfloat16)
    acc = torch.zeros((num_tokens + 1, hidden), dtype=torch.float32, device=x.device)
    acc_w = torch.zeros((num_tokens + 1, k), dtype=torch.float32, device=x.device) if k else None
    for src in range(num_ranks):  # ascending source rank: the eager path's fp32 order
        tokens = st["token_at"][src * block:(src + 1) * block]
        acc.index_add_(0, tokens, rows[src * block:(src + 1) * block].float())
        if acc_w is not None:
            acc_w.index_add_(0, tokens, pending[1].recv[src * block:(src + 1) * block])
    acc = acc[:num_tokens]
    for bias in biases:
        acc += bias.float()
    return acc.to(torch.bfloat16), acc_w[:num_tokens] if acc_w is not None else None
