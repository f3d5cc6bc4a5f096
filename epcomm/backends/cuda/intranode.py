"""Normal mode inside one NVLink domain with the CUDA kernels (csrc/kernels/intranode.cu).

Each rank's communication buffer is shared with the other ranks through CUDA IPC (PyTorch's own
handle export), so senders write token rows straight into the receivers' buffers. One call:
  1. notify: every rank writes its per-rank and per-expert counts into each peer, then all meet at a
     system-scope barrier (bounded; a rank that never arrives is named in the error);
  2. the CPU reads the counts to size the outputs (the one host sync, as in DeepEP);
  3. push: each token row goes to the block of its source rank in each destination, at its slot;
  4. barrier, then each rank compacts the blocks (in source-rank order) into its outputs.
Combine runs the same steps backwards and sums in fp32 in ascending rank order.

Work in progress (see README "Status"): single round of fixed capacity (num_nvl_bytes must hold
R * T rows), no FP8-specific path (rows are packed bytes), and no overlap of the stages yet.
"""

from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

from ...handle import DispatchHandle
from ..rows import check_worst_tokens, pack_token_rows, unpack_token_rows
from .build import load_library

_ROW_ALIGN = 16
# Mirrors kRowsOffset in csrc/kernels/intranode.cu (checked against the library when it loads).
ROWS_OFFSET = 128 + 8 * 256 * 4


def buffer_bytes_needed(num_tokens: int, hidden: int, element_size: int, num_ranks: int, num_topk: int = 0,
                        num_scales: int = 0) -> int:
    """num_nvl_bytes the v0 kernels need: one block of ``num_tokens`` rows per source rank."""
    row = hidden * element_size + num_scales * 4 + num_topk * 12
    row = (row + _ROW_ALIGN - 1) // _ROW_ALIGN * _ROW_ALIGN
    combine_row = (hidden * 2 + num_topk * 4 + _ROW_ALIGN - 1) // _ROW_ALIGN * _ROW_ALIGN
    return ROWS_OFFSET + num_ranks * max(num_tokens, 1) * max(row, combine_row)


class CudaIntranode:
    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_nvl_bytes: int, timeout_s: float) -> None:
        self.lib = load_library()
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        if self.num_ranks > 8:
            raise RuntimeError(f"the CUDA intranode kernels support up to 8 ranks, the group has {self.num_ranks}")
        self.device = device
        self.timeout_ns = int(timeout_s * 1e9)
        self.rows_offset = self.lib.epcomm_rows_offset()
        if self.rows_offset != ROWS_OFFSET:
            raise RuntimeError(f"epcomm: kernel library rows offset {self.rows_offset} != ROWS_OFFSET {ROWS_OFFSET}")
        self.max_experts_per_rank = self.lib.epcomm_max_experts_per_rank()
        if num_nvl_bytes <= self.rows_offset:
            raise ValueError(f"num_nvl_bytes={num_nvl_bytes} leaves no room for token rows (the metadata takes "
                             f"{self.rows_offset} bytes)")
        self.num_bytes = num_nvl_bytes
        # Zeroed once: the barrier counters start at 0 and only grow.
        self.buffer = torch.zeros(num_nvl_bytes, dtype=torch.uint8, device=device)
        # CUDA IPC: export this rank's buffer, map every peer's onto this rank's GPU.
        handle = ctypes.create_string_buffer(64)
        offset = ctypes.c_int64(0)
        self._check(self.lib.epcomm_ipc_export(device.index, ctypes.c_void_p(self.buffer.data_ptr()), handle,
                                               ctypes.byref(offset)), "Buffer() IPC export")
        exported: list = [None] * self.num_ranks
        dist.all_gather_object(exported, (handle.raw, offset.value), group=group)
        self._peer_bases: list[ctypes.c_void_p] = []
        ptrs = []
        for r, (raw, off) in enumerate(exported):
            if r == self.rank:
                ptrs.append(self.buffer.data_ptr())
                continue
            base, ptr = ctypes.c_void_p(), ctypes.c_void_p()
            self._check(self.lib.epcomm_ipc_open(device.index, ctypes.create_string_buffer(raw, 64),
                                                 ctypes.c_int64(off), ctypes.byref(base), ctypes.byref(ptr)),
                        f"Buffer() IPC open of rank {r}")
            self._peer_bases.append(base)
            ptrs.append(ptr.value)
        self.ptrs = (ctypes.c_uint64 * self.num_ranks)(*ptrs)
        self.seq = 0
        # Host memory the barrier flags timeouts into (pinned, so the GPU writes it directly).
        self.timed_out = torch.zeros(self.num_ranks, dtype=torch.int32, pin_memory=True)
        dist.barrier(group=group)

    def close(self) -> None:
        """Unmap the peers' buffers (after a barrier, so no peer still writes into ours)."""
        if not self._peer_bases:
            return
        torch.cuda.synchronize(self.device)
        for base in self._peer_bases:
            self.lib.epcomm_ipc_close(base)
        self._peer_bases = []

    # ------------------------------------------------------------------ primitives
    def _stream(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"epcomm {what}: CUDA launch failed with error {code}")

    def barrier(self, op: str, send_counts: torch.Tensor | None = None, expert_counts: torch.Tensor | None = None,
                experts_per_rank: int = 0) -> None:
        self.seq += 1
        code = self.lib.epcomm_notify(
            self.ptrs, self.rank, self.num_ranks,
            ctypes.c_void_p(send_counts.data_ptr() if send_counts is not None else 0),
            ctypes.c_void_p(expert_counts.data_ptr() if expert_counts is not None else 0),
            experts_per_rank, ctypes.c_int64(self.seq), ctypes.c_uint64(self.timeout_ns),
            ctypes.c_void_p(self.timed_out.data_ptr()), self._stream())
        self._check(code, op)

    def raise_if_timed_out(self, op: str) -> None:
        """Call after a host sync that covers the barrier."""
        missing = torch.nonzero(self.timed_out).flatten().tolist()
        if missing:
            self.timed_out.zero_()
            raise RuntimeError(f"epcomm {op}: rank {self.rank} timed out waiting for rank(s) {missing} at the "
                               "NVLink barrier (EPCOMM_TIMEOUT_S). Destroy the Buffer and the process group.")

    def capacity(self, row_bytes: int) -> int:
        return (self.num_bytes - self.rows_offset) // (self.num_ranks * row_bytes)

    def bytes_needed(self, num_tokens: int, row_bytes: int) -> int:
        return self.rows_offset + self.num_ranks * num_tokens * row_bytes

    def push(self, rows: torch.Tensor, in_rank: torch.Tensor, slot: torch.Tensor, capacity: int, num_sms: int,
             op: str) -> None:
        code = self.lib.epcomm_push_rows(
            self.ptrs, self.rank, self.num_ranks, ctypes.c_void_p(rows.data_ptr()), rows.shape[0], rows.shape[1],
            ctypes.c_void_p(in_rank.data_ptr()), ctypes.c_void_p(slot.data_ptr()), ctypes.c_int64(capacity),
            num_sms, self._stream())
        self._check(code, op)

    # ------------------------------------------------------------------ dispatch / combine
    def dispatch(self, x, scales, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                 topk_weights, expert_alignment, num_worst_tokens, num_experts, buffer_uid, num_sms):
        rank, num_ranks = self.rank, self.num_ranks
        num_tokens = x.shape[0]
        cached = handle is not None
        packed = pack_token_rows(x, scales, topk_idx, topk_weights, align=_ROW_ALIGN)
        row_bytes = packed.shape[1]
        self._check_capacity(num_tokens, row_bytes, "dispatch")
        if cached:
            is_token_in_rank = handle.is_token_in_rank
            send_counts_dev = handle.backend_state["send_counts_dev"]
            num_worst_tokens = handle.num_worst_tokens
            experts_per_rank, expert_counts = 0, None
        else:
            send_counts_dev = num_tokens_per_rank.to(torch.int32).contiguous()
            experts_per_rank = num_experts // num_ranks
            if experts_per_rank > self.max_experts_per_rank:
                raise ValueError(f"the CUDA kernels support up to {self.max_experts_per_rank} experts per rank, "
                                 f"got {experts_per_rank}")
            expert_counts = num_tokens_per_expert.to(torch.int32).contiguous()
        in_rank = is_token_in_rank.contiguous()
        as_int = in_rank.to(torch.int32)
        slot = (torch.cumsum(as_int, 0, dtype=torch.int32) - as_int).contiguous()

        self.barrier("dispatch", send_counts_dev, expert_counts, experts_per_rank)
        meta = self.buffer[:self.rows_offset]
        counts_host = meta[64:64 + 4 * num_ranks].view(torch.int32).cpu()  # host sync: sizes the outputs
        self.raise_if_timed_out("dispatch")
        recv_counts = counts_host.tolist()
        expert_list: list[int] = []
        if not cached and num_worst_tokens == 0:
            per_src = meta[128:128 + 4 * num_ranks * self.max_experts_per_rank].view(torch.int32)
            totals = per_src.view(num_ranks, self.max_experts_per_rank)[:, :experts_per_rank].sum(0).tolist()
            a = expert_alignment
            expert_list = [(c + a - 1) // a * a for c in totals]
        if cached and recv_counts != handle.recv_counts:
            raise RuntimeError(f"epcomm dispatch: cached handle expects {handle.recv_counts} rows per source rank "
                               f"but peers now send {recv_counts}")
        num_recv = sum(recv_counts)
        check_worst_tokens(rank, num_recv, num_worst_tokens)
        capacity = self.capacity(row_bytes)
        self.push(packed, in_rank, slot, capacity, num_sms, "dispatch")
        self.barrier("dispatch")
        recv = torch.empty((num_recv, row_bytes), dtype=torch.uint8, device=self.device)
        begin = torch.tensor([0] + list(torch.tensor(recv_counts).cumsum(0)[:-1].tolist()), dtype=torch.int32,
                             device=self.device)
        code = self.lib.epcomm_gather_rows(
            ctypes.c_uint64(self.buffer.data_ptr()), num_ranks, ctypes.c_void_p(begin.data_ptr()), None, row_bytes,
            ctypes.c_int64(capacity), ctypes.c_void_p(recv.data_ptr()), num_recv, num_sms, self._stream())
        self._check(code, "dispatch")
        recv_x, recv_topk_idx, recv_topk_weights = unpack_token_rows(
            recv, num_recv, num_worst_tokens or num_recv, x, scales, topk_idx, topk_weights, rank, num_experts,
            num_ranks)
        if cached:
            return recv_x, None, None, None, handle
        new_handle = DispatchHandle(
            buffer_uid=buffer_uid, num_tokens=num_tokens, hidden=x.shape[1], num_recv_tokens=num_recv,
            num_worst_tokens=num_worst_tokens, is_token_in_rank=is_token_in_rank, send_counts=send_counts_dev.tolist(),
            recv_counts=recv_counts,
            backend_state={"send_counts_dev": send_counts_dev, "slot": slot, "in_rank": in_rank,
                           "recv_src": torch.repeat_interleave(torch.arange(num_ranks, device=self.device),
                                                               torch.tensor(recv_counts, device=self.device)),
                           "recv_begin": begin})
        return recv_x, recv_topk_idx, recv_topk_weights, expert_list, new_handle

    def combine(self, x, handle: DispatchHandle, topk_weights, biases, num_sms):
        st = handle.backend_state
        num_recv = handle.num_recv_tokens
        hidden = x.shape[1]
        num_topk = topk_weights.shape[1] if topk_weights is not None else 0
        packed = pack_token_rows(x[:num_recv], None, None,
                                 topk_weights[:num_recv] if topk_weights is not None else None, align=_ROW_ALIGN)
        row_bytes = packed.shape[1]
        self._check_capacity(max(handle.num_tokens, max(handle.recv_counts, default=0)), row_bytes, "combine")
        capacity = self.capacity(row_bytes)
        # Each received row returns to its source rank, at the slot it came from.
        src = st["recv_src"]
        back_in_rank = torch.nn.functional.one_hot(src, self.num_ranks).to(torch.bool).contiguous()
        back_slot = (torch.arange(num_recv, device=self.device, dtype=torch.int32)
                     - st["recv_begin"][src]).unsqueeze(1).expand(num_recv, self.num_ranks).contiguous()
        self.barrier("combine")
        self.push(packed, back_in_rank, back_slot, capacity, num_sms, "combine")
        self.barrier("combine")
        out = torch.empty((handle.num_tokens, hidden), dtype=torch.bfloat16, device=self.device)
        out_w = torch.empty((handle.num_tokens, num_topk), dtype=torch.float32, device=self.device) \
            if num_topk else None
        bias0 = biases[0] if len(biases) > 0 else None
        bias1 = biases[1] if len(biases) > 1 else None
        code = self.lib.epcomm_reduce_rows(
            ctypes.c_uint64(self.buffer.data_ptr()), self.num_ranks, handle.num_tokens, hidden, num_topk, row_bytes,
            ctypes.c_int64(capacity), ctypes.c_void_p(st["in_rank"].data_ptr()), ctypes.c_void_p(st["slot"].data_ptr()),
            ctypes.c_void_p(bias0.data_ptr() if bias0 is not None else 0),
            ctypes.c_void_p(bias1.data_ptr() if bias1 is not None else 0), ctypes.c_void_p(out.data_ptr()),
            ctypes.c_void_p(out_w.data_ptr() if out_w is not None else 0), num_sms, self._stream())
        self._check(code, "combine")
        return out, out_w

    def _check_capacity(self, num_rows: int, row_bytes: int, op: str) -> None:
        if num_rows > self.capacity(row_bytes):
            raise ValueError(f"epcomm {op}: num_nvl_bytes={self.num_bytes} holds {self.capacity(row_bytes)} rows of "
                             f"{row_bytes} bytes per source rank, {num_rows} needed: the CUDA backend needs "
                             f"num_nvl_bytes >= {self.bytes_needed(num_rows, row_bytes)}")

