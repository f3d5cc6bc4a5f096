"""Low-latency mode on torch.distributed: fixed-size token slots, per-expert receive layout, weighted combine.

Dispatch moves each token once per destination rank, in fixed slots: the send buffer is
``[R, N, row]`` (N = num_max_dispatch_tokens_per_rank), slot ``(r, t)`` holding token t's data (FP8
and scales, or BF16) and its top-k ids, ids set to -1 where the expert is not on rank r (or r is
masked) and in the slots past the rank's tokens. So one ``all_to_all_single`` of a size every rank
knows moves everything: no counts exchange, no host wait for sizes. The receiver places its
(source, token, slot) entries by (local expert, source, token, slot) on the device, which is the
receive layout: per expert, one block per source rank in rank order (an entry's row in its expert
is a running count: the entries arrive in that order already).

Combine returns each (token, slot) entry's row to its source, in (token, slot) order per source,
as one variable-size all-to-all whose sizes the dispatch derived (each side knows them from its
own entries); the source places the rows by (token, slot) and sums ``acc + w_k * row_k`` in fp32,
slot 0 first. With ``return_recv_hook`` the all-to-all is issued by the call and the hook
completes it.

Inside a CUDA graph capture nothing may wait on the host, so there the calls take no handshake (the
ranks agreed in the eager calls before the capture) and every size is fixed: the receive layout is
placed from all R * N * K (slot, top-k) entries, invalid ones into a spare row, and the combine
returns each source a block of N * K rows, entry (token, slot) at its rank among the source's entries
to this rank; the source reads slot k's row of every token (a zero row where it has none) and adds
w_k * row_k, slot by slot, the same sum bit for bit. A handle of either kind serves a combine of
either kind.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ...fp8 import pack_ue8m0, quantize_groups
from ...handle import LowLatencyHandle
from ...utils.tensors import dense, nonzero_counted, row_words
from ..rows import low_latency_scales_layout, round_up
from .backend import F, Op, ReferenceBackend, counts, in_graph, to_bytes

FLAG_FP8, FLAG_ROUND_SCALE, FLAG_UE8M0 = 1, 2, 4


def _destinations(topk_idx: torch.Tensor, experts_per_rank: int, num_ranks: int,
                  masked: torch.Tensor | None) -> torch.Tensor:
    """Each (token, slot) entry's destination rank, flat ``t * K + k``; R where it goes nowhere (id -1,
    an id past the experts, which only a graph lets through unchecked, or a masked rank)."""
    flat = topk_idx.flatten()
    dest = torch.where((flat >= 0) & (flat < experts_per_rank * num_ranks), flat // experts_per_rank, num_ranks)
    if masked is not None:
        dest = torch.where(masked.to(flat.device)[dest.clamp(max=num_ranks - 1)] & (dest < num_ranks), num_ranks,
                           dest)
    return dest


def running_count(keys: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each element of ``keys`` (values below ``size``), how many earlier elements have its value:
    the scan of a one-hot table, which a GPU runs far faster than the stable sort it replaces. Returns
    it and the scan itself ([size, n] int32: column j counts each value among elements 0..j)."""
    seen = torch.zeros((size, keys.numel()), dtype=torch.int32, device=keys.device)
    seen.scatter_(0, keys.view(1, -1), 1)
    seen = seen.cumsum(1, dtype=torch.int32)
    return seen.gather(0, keys.view(1, -1)).view(-1).to(torch.int64) - 1, seen


def _source_entries(dest: torch.Tensor, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (token, slot) entries, as flat indices ``t * K + k`` ordered by (destination rank,
    token, slot), those that go nowhere last, and the count per destination (on the device: the
    receive reads it on the host with its own counts, ``_place``)."""
    return torch.sort(dest, stable=True).indices, counts(dest, num_ranks + 1)[:num_ranks]


def dispatch(be: ReferenceBackend, x: torch.Tensor, topk_idx: torch.Tensor, num_max_tokens: int, num_experts: int,
             use_fp8: bool, round_scale: bool, use_ue8m0: bool, masked: torch.Tensor | None, buffer_uid: str,
             defer_receive: bool):
    """Returns (recv_x, recv_count, handle, finish, wait_ns) where finish() completes the receive and
    fills recv_x, recv_count and the handle's src_info and layout_range."""
    rank, num_ranks = be.rank, be.num_ranks
    num_tokens, hidden = x.shape
    num_topk = topk_idx.shape[1]
    experts_per_rank = num_experts // num_ranks
    n = num_max_tokens
    flags = (FLAG_FP8 * use_fp8) | (FLAG_ROUND_SCALE * round_scale) | (FLAG_UE8M0 * use_ue8m0)
    dev = x.device
    graph = in_graph(dev)
    if graph:
        wait_ns = torch.zeros(num_ranks, dtype=torch.int64)
    else:
        headers = be.handshake(Op.LL_DISPATCH, {
            F.HIDDEN: hidden, F.NUM_EXPERTS: num_experts, F.NUM_TOPK: num_topk, F.MAX_TOKENS: num_max_tokens,
            F.FLAGS: flags, F.NUM_TOKENS: num_tokens,
        })
        wait_ns = be.arrival_wait_ns(headers)
    dest = _destinations(topk_idx, experts_per_rank, num_ranks, masked)

    # Slot (r, t): token t's payload and its top-k ids as rank r sees them (-1: not for r).
    if use_fp8:
        data, scales = quantize_groups(x, round_scale=round_scale)
        if use_ue8m0:
            scales = pack_ue8m0(scales)
        payload = [to_bytes(data), to_bytes(scales)]
    else:
        payload = [to_bytes(x)]
    # A slot: ids | data | scales, each part starting on an 8-byte word (the receiver gathers words).
    id_bytes = round_up(4 * num_topk, 8)
    row_bytes = round_up(id_bytes + sum(p.shape[1] for p in payload), 8)
    send = torch.empty((num_ranks, n, row_bytes), dtype=torch.uint8, device=dev)
    col = id_bytes
    for part in payload:
        send[:, :num_tokens, col:col + part.shape[1]] = part
        col += part.shape[1]
    ranks = torch.arange(num_ranks, device=dev).view(-1, 1, 1)
    if num_tokens:
        ids = torch.where(dest.view(1, num_tokens, num_topk) == ranks, topk_idx.to(torch.int32), -1)
        send[:, :num_tokens, :4 * num_topk] = dense(ids).view(torch.uint8).view(num_ranks, num_tokens, -1)
    send[:, num_tokens:, :4 * num_topk] = 255  # all bytes set: id -1
    recv = torch.empty_like(send)
    slots = [n] * num_ranks
    pending = be.transport.start_all_to_all(send.view(num_ranks * n, -1), slots, slots,
                                            out=recv.view(num_ranks * n, -1))
    seq = be.seq

    # Outputs, one expert more than the API's: entries of no local expert are written to the extra
    # one, so the placement needs no count on the host.
    rows = n * num_ranks
    data_dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
    data_buf = torch.empty((experts_per_rank + 1, rows, hidden), dtype=data_dtype, device=dev)
    scales_buf = None
    if use_fp8:
        shape, strides, dtype = low_latency_scales_layout(experts_per_rank + 1, rows, hidden, use_ue8m0)
        scales_buf = torch.empty_strided(shape, strides, dtype=dtype, device=dev)
    src_info_buf = torch.full((experts_per_rank + 1, rows), -1, dtype=torch.int32, device=dev)
    recv_count = torch.empty(experts_per_rank, dtype=torch.int32, device=dev)  # finish() writes them whole
    layout_range = torch.empty((experts_per_rank, num_ranks), dtype=torch.int64, device=dev)
    state: dict = {"dest": dest, "masked": masked}
    if not graph:
        state["entries"], state["per_dest"] = _source_entries(dest, num_ranks)  # _place reads them
    arrived_ns = torch.zeros(num_ranks, dtype=torch.int64, device="cpu")

    def finish() -> None:
        start = time.monotonic_ns()
        pending.wait("low_latency_dispatch", seq, time.monotonic() + be.transport.timeout_s)
        arrived_ns.add_(wait_ns + (time.monotonic_ns() - start if defer_receive and not graph else 0))
        _place(recv, rank, n, num_ranks, num_topk, id_bytes, data_buf, scales_buf, src_info_buf, recv_count,
               layout_range, state, fixed=graph)

    recv_x = data_buf[:experts_per_rank]
    if use_fp8:
        recv_x = (recv_x, scales_buf[:experts_per_rank])
    handle = LowLatencyHandle(
        buffer_uid=buffer_uid, num_max_dispatch_tokens_per_rank=num_max_tokens, hidden=hidden,
        num_experts=num_experts, num_tokens=num_tokens, num_topk=num_topk, src_info=src_info_buf[:experts_per_rank],
        layout_range=layout_range, backend_state=state)
    return recv_x, recv_count, handle, finish, arrived_ns


def _place(recv: torch.Tensor, rank: int, n: int, num_ranks: int, num_topk: int, id_bytes: int,
           data_buf: torch.Tensor, scales_buf: torch.Tensor | None, src_info_buf: torch.Tensor,
           recv_count: torch.Tensor, layout_range: torch.Tensor, state: dict, fixed: bool) -> None:
    """Place the received slots in the receive layout and derive what the combine sends back. Eager:
    the valid entries only (their count read on the host, which sizes the combine); ``fixed`` (a graph):
    every entry, the invalid ones into the spare expert's first row, and nothing read on the host.

    The entries, (source, token, slot) ascending, are already in the layout's order within an expert,
    so an entry's row in its expert is the count of earlier entries of that expert (running_count)."""
    experts_per_rank = data_buf.shape[0] - 1
    hidden = data_buf.shape[2]
    rows = n * num_ranks
    dev = recv.device
    got = recv[:, :, :4 * num_topk].view(torch.int32).to(torch.int64).view(-1)
    lo = rank * experts_per_rank
    expert = torch.where((got >= lo) & (got < lo + experts_per_rank), got - lo, experts_per_rank)
    pos, seen = running_count(expert, experts_per_rank + 1)
    # Each expert's entries up to the end of each source's block, read off the scan: the blocks and
    # where they begin (layout_range), the count per expert in the last column.
    ends = seen.view(experts_per_rank + 1, num_ranks, -1)[:experts_per_rank, :, -1].to(torch.int64)
    begin = torch.nn.functional.pad(ends[:, :-1], (1, 0))
    blocks = ends - begin
    recv_count.copy_(ends[:, -1])
    layout_range.copy_((begin << 32) | blocks)
    entry = torch.arange(expert.numel(), device=dev)
    valid = expert < experts_per_rank
    if fixed:
        exp, pos = expert, torch.where(valid, pos, 0)
    else:
        # One host read for the combine's sizes: the entries this rank returns to each source and
        # those each destination returns to it.
        sizes = torch.cat([blocks.sum(0), state.pop("per_dest")]).tolist()
        per_source = state["send_rows"] = sizes[:num_ranks]
        state["rows_per_dest"] = sizes[num_ranks:]
        state["entries"] = state["entries"][:sum(state["rows_per_dest"])]
        entry = nonzero_counted(valid, sum(per_source)).view(-1)
        exp, pos = expert[entry], pos[entry]
        valid = valid[entry]
    slot = entry // num_topk  # source * N + token
    target = exp * rows + pos
    taken = recv.view(rows, -1).view(torch.int64).index_select(0, slot)
    data_words = hidden * data_buf.element_size() // 8
    first = id_bytes // 8
    data_buf.view(-1, hidden).view(torch.int64).index_copy_(0, target, taken[:, first:first + data_words])
    if scales_buf is not None:
        begin = id_bytes + data_words * 8
        scale_bytes = dense(taken.view(torch.uint8)[:, begin:begin + scales_buf.shape[2] * 4])
        scales_buf[exp, pos] = scale_bytes.view(scales_buf.dtype)
    src_info_buf.view(-1).index_copy_(0, target, (slot % n).to(torch.int32))
    # The combine returns the entries in (source, token, slot) order, the order here: the rows of x to
    # send, and each row's place in the fixed-size exchange (a block of N * K rows per source; invalid:
    # a spare row).
    state["combine_rows"] = torch.where(valid, target, 0)
    block = n * num_topk
    source = entry // block
    if fixed:  # every source's entries, in order: the valid ones before each
        before = torch.cumsum(valid.view(num_ranks, -1), 1).view(-1) - 1
    else:
        starts = torch.tensor([0] + per_source[:-1], device=dev).cumsum(0)
        before = torch.arange(valid.numel(), device=dev) - starts[source]
    state["send_pos"] = torch.where(valid, source * block + before, num_ranks * block)


def combine(be: ReferenceBackend, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            handle: LowLatencyHandle, out: torch.Tensor | None, defer_receive: bool
            ) -> tuple[torch.Tensor, Callable[[], None], torch.Tensor]:
    """Returns (combined_x, finish, wait_ns); combined_x is valid once finish() ran. The exchange has the
    sizes the dispatch counted on the host, or (in a graph, or for a handle a graph's dispatch made) a
    fixed block of N * K rows per source."""
    st = handle.backend_state
    hidden = x.shape[2]
    num_ranks = be.num_ranks
    num_tokens, num_topk = handle.num_tokens, handle.num_topk
    graph = in_graph(x.device)
    fixed = graph or "send_rows" not in st
    if graph:
        wait_ns, everyone_empty = torch.zeros(num_ranks, dtype=torch.int64), False
    else:
        headers = be.handshake(Op.LL_COMBINE, {
            F.HIDDEN: hidden, F.NUM_EXPERTS: handle.num_experts, F.NUM_TOPK: num_topk,
            F.MAX_TOKENS: handle.num_max_dispatch_tokens_per_rank, F.NUM_TOKENS: num_tokens,
        }, counts=None if fixed else st["send_rows"])
        wait_ns = be.arrival_wait_ns(headers)
        everyone_empty = not fixed and int(be.count_matrix(headers).sum()) == 0
    x_words = row_words(dense(x).view(-1, hidden))
    if fixed:
        block = handle.num_max_dispatch_tokens_per_rank * num_topk
        # The row of x at each place of the send blocks (the extra last place takes the invalid
        # entries; places no entry takes send row 0, which no one reads): one gather straight from x.
        row_at = torch.zeros(num_ranks * block + 1, dtype=torch.int64, device=x.device)
        row_at.index_copy_(0, st["send_pos"], st["combine_rows"])
        send = x_words.index_select(0, row_at[:-1])
        recv = x.new_empty((num_ranks * block + 1, hidden))
        recv[-1].zero_()  # read for every slot a token has no row in
        sizes = [block] * num_ranks
        pending = be.transport.start_all_to_all(send, sizes, sizes, out=row_words(recv[:-1]))
    else:
        rows = x_words.index_select(0, st["combine_rows"])
        recv_rows = st["rows_per_dest"]
        recv = x.new_empty((sum(recv_rows), hidden))
        pending = None if everyone_empty else be.transport.start_all_to_all(rows, st["send_rows"], recv_rows,
                                                                            out=row_words(recv))
    seq = be.seq
    combined = out if out is not None else torch.empty((num_tokens, hidden), dtype=torch.bfloat16,
                                                       device=x.device)
    arrived_ns = wait_ns.clone()

    def finish() -> None:
        start = time.monotonic_ns()
        if pending is not None:
            pending.wait("low_latency_combine", seq, time.monotonic() + be.transport.timeout_s)
        if defer_receive and not graph:
            arrived_ns.add_(time.monotonic_ns() - start)
        acc = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
        words = row_words(recv)
        if fixed:
            # Slot k's row of every token (the zero row where it has none, weight 0): acc + w_k * row_k
            # for a row, acc + 0 (acc unchanged: a sum from +0 is never -0) for none. Every slot's rows
            # come in one gather (a receive's worth); bf16 * fp32 is the fp32 product, one op.
            places = _fixed_places(st, num_ranks, block).view(num_tokens, num_topk)
            weights = torch.where(st["dest"].view(num_tokens, num_topk) < num_ranks, topk_weights.float(), 0.0)
            rows = words.index_select(0, places.t().flatten()).view(torch.bfloat16).view(num_topk, num_tokens, hidden)
            for k in range(num_topk):
                acc.add_(rows[k] * weights[:, k:k + 1])
            combined.copy_(acc)
            return
        # Rows arrive per destination rank by (token, slot). Summed slot by slot (the oracle's fp32
        # order: slot 0 first), one slot's rows gathered at a time (the temporaries stay a slot's
        # share of the receive): a token holds a slot once, so one index_add_ per slot adds
        # w_k * row_k exactly as acc + w_k * row_k, and absent slots add nothing.
        by_slot, tokens, slot_counts = _slot_order(st, num_topk)
        weights = topk_weights.reshape(-1).index_select(0, st["entries"].index_select(0, by_slot)).float()
        begin = 0
        for count in slot_counts:
            end = begin + count
            if count:
                rows = words.index_select(0, by_slot[begin:end]).view(torch.bfloat16)
                acc.index_add_(0, tokens[begin:end], rows * weights[begin:end, None])
            begin = end
        combined.copy_(acc)

    return combined, finish, arrived_ns


def _fixed_places(state: dict, num_ranks: int, block: int) -> torch.Tensor:
    """Where each of this rank's (token, slot) entries comes back in a fixed-size combine's receive:
    block d holds its entries to rank d in (token, slot) order; entries that went nowhere read the
    zero row after the blocks. Made by every combine, on the device (a graph's replay rewrites the
    dispatch's ``dest``, so nothing derived from it may be kept)."""
    dest = state["dest"]
    return torch.where(dest < num_ranks, dest * block + running_count(dest, num_ranks + 1)[0], num_ranks * block)


def _slot_order(state: dict, num_topk: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The combine's received rows grouped by top-k slot (positions into the receive buffer, ascending
    within a slot), each row's token, and the rows per slot: made once per handle."""
    if "by_slot" not in state:
        entries = state["entries"]  # flat t * K + k, in receive order
        slot = entries % num_topk
        by_slot = torch.sort(slot, stable=True).indices
        state["by_slot"] = by_slot
        state["slot_tokens"] = entries.index_select(0, by_slot) // num_topk
        state["slot_counts"] = counts(slot, num_topk).tolist()
    return state["by_slot"], state["slot_tokens"], state["slot_counts"]


def wait_computed(overlap, handle: LowLatencyHandle, timeout_s: float) -> None:
    """Single-batch overlap (backends/base.py, CombineOverlap): return once the expert GEMM has raised
    the signal word of every block that holds rows of a local expert to the threshold, polling from the
    host (this path syncs anyway); RuntimeError after ``timeout_s``. The counts are the handle's (the
    argument checks compared packed_recv_count with them)."""
    counts = (handle.layout_range.cpu() & 0xffffffff).sum(1)  # rows per local expert
    blocks = (counts + overlap.block_m - 1) // overlap.block_m
    words = torch.cat([e * overlap.signals_per_expert + torch.arange(int(n)) for e, n in enumerate(blocks.tolist())]
                      + [torch.zeros(0, dtype=torch.int64)])
    signals = overlap.signals.view(-1).view(torch.int32)
    deadline = time.monotonic() + timeout_s
    while True:
        values = signals[words.to(signals.device)].cpu().to(torch.int64) & 0xffffffff  # compared unsigned
        if bool((values >= overlap.threshold).all()):
            return
        if time.monotonic() > deadline:
            late = words[values < overlap.threshold].tolist()[:8]
            raise RuntimeError(f"epcomm low_latency_combine: the expert GEMM did not raise signal words {late} to "
                               f"{overlap.threshold} within {timeout_s} s (overlap=True; EPCOMM_TIMEOUT_S)")
        time.sleep(0.0002)
