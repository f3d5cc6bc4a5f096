"""Low-latency mode on torch.distributed: per-expert packed receive layout, FP8 cast, weighted combine.

A sender orders its (token, top-k slot) entries by (destination rank, local expert, token), so
each destination receives, from each source, one contiguous block per expert. The block of
source j for expert e starts after the blocks of sources 0..j-1 for e, which is the layout the
handle records. With ``return_recv_hook`` the data all-to-all is issued asynchronously and the
hook completes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ...fp8 import GROUP, pack_ue8m0, quantize_groups
from ...handle import LowLatencyHandle
from ..rows import low_latency_recv_tensors
from .backend import F, Op, ReferenceBackend, from_bytes, to_bytes

FLAG_FP8, FLAG_ROUND_SCALE, FLAG_UE8M0 = 1, 2, 4


def _send_plan(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, masked: torch.Tensor | None):
    """Entries (t * K + k) sorted by (dest rank, local expert, token, slot), and counts [R, E_local]."""
    num_tokens, num_topk = topk_idx.shape
    experts_per_rank = num_experts // num_ranks
    flat = topk_idx.flatten()
    valid = flat >= 0
    if masked is not None:
        valid &= ~masked.to(flat.device)[(flat.clamp(min=0) // experts_per_rank)]
    entries = torch.nonzero(valid).flatten()
    experts = flat[entries]
    tokens = entries // num_topk
    # experts ascending equals (dest, local expert) ascending; ties broken by token then slot.
    key = (experts * max(num_tokens, 1) + tokens) * num_topk + entries % num_topk
    order = torch.argsort(key)
    entries = entries[order]
    counts = torch.bincount(flat[entries], minlength=num_experts).view(num_ranks, experts_per_rank)
    return entries, counts.to(torch.int32)


def dispatch(be: ReferenceBackend, x: torch.Tensor, topk_idx: torch.Tensor, num_max_tokens: int, num_experts: int,
             use_fp8: bool, round_scale: bool, use_ue8m0: bool, masked: torch.Tensor | None, buffer_uid: str,
             defer_receive: bool):
    """Returns (recv_x, recv_count, handle, finish) where finish() completes the receive."""
    rank, num_ranks = be.rank, be.num_ranks
    num_tokens, hidden = x.shape
    num_topk = topk_idx.shape[1]
    experts_per_rank = num_experts // num_ranks
    flags = (FLAG_FP8 * use_fp8) | (FLAG_ROUND_SCALE * round_scale) | (FLAG_UE8M0 * use_ue8m0)
    entries, counts = _send_plan(topk_idx, num_experts, num_ranks, masked)
    rows_per_dest = counts.sum(1).tolist()
    headers = be.handshake(Op.LL_DISPATCH, {
        F.HIDDEN: hidden, F.NUM_EXPERTS: num_experts, F.NUM_TOPK: num_topk, F.MAX_TOKENS: num_max_tokens,
        F.FLAGS: flags, F.NUM_TOKENS: num_tokens,
    }, counts=rows_per_dest)
    count_matrix = be.count_matrix(headers)
    wait_ns = be.arrival_wait_ns(headers)
    everyone_empty = int(count_matrix.sum()) == 0
    recv_rows = count_matrix[:, rank].tolist()
    recv_counts = from_bytes(be.exchange_rows(to_bytes(counts.to(be.device)), [1] * num_ranks, [1] * num_ranks,
                                              Op.LL_DISPATCH, everyone_empty=False),
                             torch.int32, experts_per_rank).cpu()  # [src, local expert]

    # Payload per entry: data | scales | source token index.
    if use_fp8:
        data, scales = quantize_groups(x, round_scale=round_scale)
        if use_ue8m0:
            scales = pack_ue8m0(scales)
        payload = [to_bytes(data), to_bytes(scales)]
    else:
        payload = [to_bytes(x)]
    token_idx = torch.arange(num_tokens, dtype=torch.int32, device=x.device).unsqueeze(1)
    payload.append(to_bytes(token_idx))
    packed = torch.cat(payload, dim=1)
    send = packed.index_select(0, entries // num_topk)

    # Receive layout: expert e holds sources in rank order.
    begins = torch.cumsum(recv_counts, 0) - recv_counts  # [src, e]
    recv_count = recv_counts.sum(0).to(torch.int32)
    layout_range = ((begins.to(torch.int64) << 32) | recv_counts.to(torch.int64)).t().contiguous()  # [e, src]
    rows_total = num_max_tokens * num_ranks
    num_scale_cols = hidden // GROUP // (4 if use_ue8m0 else 1)
    dev = x.device
    recv_x, recv_data, recv_scales = low_latency_recv_tensors(experts_per_rank, rows_total, hidden, use_fp8,
                                                              use_ue8m0, dev)
    src_info = torch.full((experts_per_rank, rows_total), -1, dtype=torch.int32, device=dev)

    pending = None if everyone_empty else be.transport.start_all_to_all(send, rows_per_dest, recv_rows)
    seq = be.seq
    arrived_ns = torch.zeros(num_ranks, dtype=torch.int64, device="cpu")

    def finish() -> None:
        start = time.monotonic_ns()
        recv = send.new_empty((0, send.shape[1])) if pending is None else \
            pending.wait("low_latency_dispatch", seq, time.monotonic() + be.transport.timeout_s)
        arrived_ns.add_(wait_ns + (time.monotonic_ns() - start if defer_receive else 0))
        data_bytes = hidden if use_fp8 else hidden * 2
        scale_bytes = num_scale_cols * 4 if use_fp8 else 0
        if recv.shape[0] == 0:
            return
        # Received rows come per source, then per expert, then by token: place each in its block.
        counts = recv_counts.flatten().to(torch.int64)  # [src * E_local + e]
        block_begin = torch.repeat_interleave(begins.flatten().to(torch.int64), counts)
        block_first_row = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        local_experts = torch.arange(experts_per_rank, dtype=torch.int64, device="cpu")
        expert = torch.repeat_interleave(local_experts.repeat(num_ranks), counts)
        slot = block_begin + torch.arange(recv.shape[0], dtype=torch.int64, device="cpu") - block_first_row
        expert, slot = expert.to(dev), slot.to(dev)
        recv_data[expert, slot] = from_bytes(recv[:, :data_bytes], recv_data.dtype, hidden)
        if recv_scales is not None:
            recv_scales[expert, slot] = from_bytes(recv[:, data_bytes:data_bytes + scale_bytes], recv_scales.dtype,
                                                   num_scale_cols)
        src_info[expert, slot] = from_bytes(recv[:, data_bytes + scale_bytes:], torch.int32, 1)[:, 0]

    handle = LowLatencyHandle(
        buffer_uid=buffer_uid, num_max_dispatch_tokens_per_rank=num_max_tokens, hidden=hidden,
        num_experts=num_experts, num_tokens=num_tokens, num_topk=num_topk, src_info=src_info,
        layout_range=layout_range.to(dev),
        backend_state={"entries": entries, "rows_per_dest": rows_per_dest, "recv_counts": recv_counts,
                       "begins": begins, "masked": masked})
    return recv_x, recv_count.to(dev), handle, finish, arrived_ns


def combine(be: ReferenceBackend, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            handle: LowLatencyHandle, out: torch.Tensor | None, defer_receive: bool
            ) -> tuple[torch.Tensor, Callable[[], None], torch.Tensor]:
    """Returns (combined_x, finish, wait_ns); combined_x is valid once finish() ran."""
    num_ranks = be.num_ranks
    st = handle.backend_state
    recv_counts, begins = st["recv_counts"], st["begins"]
    experts_per_rank = handle.num_experts // num_ranks
    hidden = x.shape[2]
    send_rows = recv_counts.sum(1).tolist()  # back to each source
    headers = be.handshake(Op.LL_COMBINE, {
        F.HIDDEN: hidden, F.NUM_EXPERTS: handle.num_experts, F.NUM_TOPK: handle.num_topk,
        F.MAX_TOKENS: handle.num_max_dispatch_tokens_per_rank, F.NUM_TOKENS: handle.num_tokens,
    }, counts=send_rows)
    count_matrix = be.count_matrix(headers)
    wait_ns = be.arrival_wait_ns(headers)
    everyone_empty = int(count_matrix.sum()) == 0
    blocks = []
    for src in range(num_ranks):
        for e in range(experts_per_rank):
            c = int(recv_counts[src, e])
            if c:
                b = int(begins[src, e])
                blocks.append(x[e, b:b + c])
    send = torch.cat(blocks) if blocks else x.new_empty((0, hidden))
    send = to_bytes(send) if send.shape[0] else send.view(torch.uint8).reshape(0, hidden * 2)
    recv_rows = st["rows_per_dest"]
    pending = None if everyone_empty else be.transport.start_all_to_all(send, send_rows, recv_rows)
    seq = be.seq
    num_tokens, num_topk = handle.num_tokens, handle.num_topk
    combined = out if out is not None else torch.empty((num_tokens, hidden), dtype=torch.bfloat16,
                                                       device=x.device)
    arrived_ns = wait_ns.clone()

    def finish() -> None:
        start = time.monotonic_ns()
        recv = send.new_empty((0, hidden * 2)) if pending is None else \
            pending.wait("low_latency_combine", seq, time.monotonic() + be.transport.timeout_s)
        if defer_receive:
            arrived_ns.add_(time.monotonic_ns() - start)
        # Rows arrive in the order this rank sent its entries; scatter them back to (token, slot).
        rows = torch.zeros((num_tokens * num_topk, hidden), dtype=torch.float32, device=x.device)
        if recv.shape[0]:
            rows[st["entries"]] = from_bytes(recv, torch.bfloat16, hidden).float()
        rows = rows.view(num_tokens, num_topk, hidden)
        present = torch.zeros(num_tokens * num_topk, dtype=torch.bool, device=x.device)
        present[st["entries"]] = True
        present = present.view(num_tokens, num_topk)
        acc = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
        for k in range(num_topk):  # fixed fp32 order: slot 0 first
            term = topk_weights[:, k:k + 1] * rows[:, k]
            acc = torch.where(present[:, k:k + 1], acc + term, acc)
        combined.copy_(acc.to(torch.bfloat16))

    return combined, finish, arrived_ns
