"""Normal mode inside one NVLink domain with the CUDA kernels (include/epcomm/impls/intranode_*.cuh).

Each rank's communication buffer is shared with the other ranks through CUDA IPC, so senders store
token rows straight into the receivers' buffers. A dispatch is two kernels on the stream:
  1. notify: counts exchanged, inputs validated, bounded barrier, layout derived on the device;
  2. the CPU reads the receive counts to size the outputs (the one host sync, as in DeepEP), which
     ``num_worst_tokens`` removes (outputs of a fixed size; CUDA-graph capturable);
  3. dispatch: half of the SMs send (one warp per token, x read once for all its destinations),
     half receive (one warp per row, copied out of the buffer as soon as its flag lands).
Combine is a barrier and one kernel: rows return to their sources, which sum them in fp32 in
ascending rank order (the reference backend's order, so results are bitwise equal).

A call whose rows do not fit the buffer runs in rounds over ranges of source tokens (same results);
``buffer_bytes_needed`` gives the size for one pass. A ``num_worst_tokens`` call must fit in one
pass (else ValueError on every rank before any row moves). Errors found by the kernels (a peer that
did not arrive within EPCOMM_TIMEOUT_S, ranks calling different operations or passing rows of
different shapes (``dispatch_shape_key``), refused inputs) are raised by the call that synchronizes with
them: a dispatch without ``num_worst_tokens`` synchronizes at its counts, so it reports its own and
earlier calls' errors; ``CudaIntranode.check_errors`` (``Buffer.destroy`` calls it) reports the rest.
"""

from __future__ import annotations

import ctypes
import types

import torch
import torch.distributed as dist

from ... import _env
from ...flight_recorder import hook, intranode_counters
from ...handle import DispatchHandle
from ...tuning import ROW_ALIGN, dispatch_work, own_rows_by_receivers, send_blocks
from ..rounds import cached_dispatch_in_rounds, combine_in_rounds, dispatch_in_rounds
from ..rows import round_up, scale_kind, shape_digest
from .build import load_library
from .capi import (
    addr,
    check,
    check_aligned,
    current_stream,
    library_constants,
    load_records,
    ptr,
    stream_ptr,
)
from .errors import INTRANODE, ErrorTable, RecordLayout
from .ipc import SharedBuffer

ROWS_OFFSET = 67584  # mirrors kRowsOffset in include/epcomm/layout/intranode.cuh (checked when the library loads)
ROW_TRAILER_BYTES = 16
LAYOUT_INTS = 48
def dispatch_shape_key(x: torch.Tensor, scales: torch.Tensor | None, num_topk: int, has_weights: bool,
                       num_worst_tokens: int) -> int:
    """The shape key of a dispatch (header word 3, compared by every rank's notify kernel)."""
    return shape_digest(1, x.shape[1], x.dtype, scale_kind(scales), scales.shape[1] if scales is not None else 0,
                        num_topk, int(has_weights), num_worst_tokens)


def dispatch_row_bytes(hidden: int, element_size: int, num_topk: int = 0, num_scales: int = 0) -> int:
    """Bytes of one dispatch row slot: x, top-k ids and weights, scales and the 16-byte flag trailer (the slot's
    last bytes), rounded up to ROW_ALIGN."""
    return round_up(hidden * element_size + num_topk * 12 + num_scales * 4 + ROW_TRAILER_BYTES, ROW_ALIGN)


def combine_row_bytes(hidden: int, num_topk: int = 0) -> int:
    return round_up(hidden * 2 + num_topk * 4 + ROW_TRAILER_BYTES, ROW_ALIGN)


def buffer_bytes_needed(num_tokens: int, hidden: int, element_size: int, num_ranks: int, num_topk: int = 0,
                        num_scales: int = 0) -> int:
    """num_nvl_bytes the kernels need when every rank sends ``num_tokens`` tokens to every rank.

    The worst case: a rank receives at most ``num_ranks * num_tokens`` rows in dispatch and gets
    back at most as many in combine. Random routing needs less (a dispatch checks the exact need).
    """
    rows = num_ranks * max(num_tokens, 1)
    row = max(dispatch_row_bytes(hidden, element_size, num_topk, num_scales), combine_row_bytes(hidden, num_topk))
    return ROWS_OFFSET + rows * row



def bind_calls(lib: ctypes.CDLL) -> types.SimpleNamespace:
    """The call records (CallContext, NotifyCall, DispatchCall, CombineCall: built from the library's
    declarations in csrc/intranode.cu), with the entry points that take them declared (so a record of
    the wrong kind is refused)."""
    records = load_records(lib, "CallContext NotifyCall DispatchCall CombineCall")
    for function, record in ((lib.epcomm_notify, records.NotifyCall), (lib.epcomm_dispatch, records.DispatchCall),
                             (lib.epcomm_combine, records.CombineCall)):
        function.argtypes = [ctypes.POINTER(record), ctypes.c_void_p]
        function.restype = ctypes.c_int
    return records


def dispatch_layout(lib: ctypes.CDLL, device: torch.device, topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                    ranks_per_domain: int):
    """get_dispatch_layout on the device: tokens per rank, per domain (None with one domain), per
    expert, and is_token_in_rank [T, R] (impls/dispatch_layout.cuh)."""
    num_tokens, num_topk = topk_idx.shape
    if num_experts + num_ranks + num_ranks // ranks_per_domain > 12 * 1024:
        raise ValueError(f"num_experts={num_experts}: the CUDA layout kernel counts up to 12K experts")
    num_domains = num_ranks // ranks_per_domain
    per_rank = torch.zeros(num_ranks, dtype=torch.int32, device=device)
    per_domain = torch.zeros(num_domains, dtype=torch.int32, device=device) if num_domains > 1 else None
    per_expert = torch.zeros(num_experts, dtype=torch.int32, device=device)
    in_rank = torch.empty((num_tokens, num_ranks), dtype=torch.bool, device=device)
    code = lib.epcomm_get_dispatch_layout(
        ptr(topk_idx), num_tokens, num_topk, num_experts, num_ranks, ranks_per_domain, ptr(per_rank),
        ptr(per_domain), ptr(per_expert), ptr(in_rank), stream_ptr(device))
    check(code, "get_dispatch_layout")
    return per_rank, per_domain, per_expert, in_rank


class CudaIntranode:
    """Normal mode inside one NVLink domain on the CUDA kernels (the NormalOps of backends/base.py)."""

    on_kernels = True
    frees_after_meeting = False  # destroy: a barrier (no peer writes into the buffer any more), then close()
    handles_outlive_buffer = True  # row places are counted from the rows area's fixed start
    recorder = None  # the Buffer's FlightRecorder (flight_recorder.attach)

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_nvl_bytes: int, timeout_s: float) -> None:
        self.lib = load_library()
        self.record_types = bind_calls(self.lib)
        self.group = group
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.device = device
        self.timeout_ns = int(timeout_s * 1e9)
        self.c = library_constants(self.lib, "epcomm_constant", (
            "rows_offset row_trailer_bytes max_ranks max_experts_per_rank info_ints layout_ints info_error "
            "info_error_op info_error_phase info_error_ranks info_num_recv info_recv_counts info_matrix info_max_recv "
            "info_max_send info_refusal info_experts op_dispatch op_cached_dispatch op_combine op_barrier"))
        if (self.c["rows_offset"], self.c["row_trailer_bytes"], self.c["layout_ints"]) != \
                (ROWS_OFFSET, ROW_TRAILER_BYTES, LAYOUT_INTS):
            raise RuntimeError(f"epcomm: kernel library constants {self.c} disagree with intranode.py")
        self.errors = ErrorTable(INTRANODE, RecordLayout(code=self.c["info_error"], op=self.c["info_error_op"],
                                                         phase=self.c["info_error_phase"],
                                                         ranks=self.c["info_error_ranks"], clear="ranks"))
        self._flight = hook(self, "intranode", intranode_counters)
        if self.num_ranks > self.c["max_ranks"]:
            raise RuntimeError(f"the CUDA intranode kernels support up to {self.c['max_ranks']} ranks, the group "
                               f"has {self.num_ranks}")
        if num_nvl_bytes <= ROWS_OFFSET:
            raise ValueError(f"num_nvl_bytes={num_nvl_bytes} leaves no room for token rows (the metadata takes "
                             f"{ROWS_OFFSET} bytes); see epcomm.backends.cuda.intranode.buffer_bytes_needed")
        self.num_bytes = num_nvl_bytes
        self.shared = SharedBuffer(self.lib, group, device, num_nvl_bytes, "num_nvl_bytes")
        self.buffer, self.ptrs = self.shared.tensor, self.shared.ptrs
        # Host words the kernels write (pinned and mapped): counts for the CPU, and errors.
        self.info = torch.zeros(self.c["info_ints"], dtype=torch.int32, device="cpu", pin_memory=True)
        self.info_np = self.info.numpy()
        # A dispatch that waits for its counts on the host starts its sends on this stream first.
        self.overlap = _env.env_str("EPCOMM_DISPATCH_OVERLAP") != "0"
        self.send_stream = torch.cuda.Stream(device)
        # Marks the count exchange of a dispatch on its stream; the host waits on it right away, so
        # one event serves every call (a new one per call costs host time the GPU may wait on).
        self._counted = torch.cuda.Event()
        self._sent = torch.cuda.Event()  # the send half's end, for the caller's stream to wait on
        # Percent of a call's SMs that send, per op, as set (None: auto, see send_share).
        self.send_pct = {op: _env.send_sms_pct(f"EPCOMM_{op.upper()}_SEND_SMS_PCT") for op in ("dispatch", "combine")}
        self._send_blocks_memo: dict[tuple[int, str], int] = {}
        # One record per entry point, reused: a call sets only the fields that vary between calls.
        context = self.record_types.CallContext(peer_bufs=ctypes.addressof(self.ptrs), info=self.info.data_ptr(),
                              timeout_ns=self.timeout_ns, rank=self.rank, num_ranks=self.num_ranks)
        self._notify_call = self.record_types.NotifyCall(context=context, op=self.c["op_dispatch"])
        self._dispatch_call = self.record_types.DispatchCall(context=context)
        self._combine_call = self.record_types.CombineCall(context=context)
        self._barrier_calls = {op: self.record_types.NotifyCall(context=context, op=op, expert_alignment=1)
                               for op in (self.c["op_cached_dispatch"], self.c["op_combine"], self.c["op_barrier"])}
        dist.barrier(group=group)

    def close(self) -> None:
        """Unmap the peers' buffers (after a barrier, so no peer still writes into ours)."""
        self.shared.close()

    def local_memory(self, rdma: bool) -> torch.Tensor | None:
        return None if rdma else self.buffer

    def reset(self) -> None:
        """Zero this rank's buffer and error words: the calls restart from the first (with every peer
        doing the same between two meetings, where no kernel runs: failed-rank masking's restore)."""
        self.buffer.zero_()
        self.info.zero_()
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ helpers
    def _send_blocks(self, num_sms: int, work: str) -> int:
        """SMs given to sending (the rest receive or reduce): send_blocks, with the share
        EPCOMM_{DISPATCH,COMBINE}_SEND_SMS_PCT sets. Memoised: it sits between a dispatch's count
        read and its receive launch, where every host microsecond is the GPU's too (3.5 us a call on
        the H100 host)."""
        key = (num_sms, work)
        blocks = self._send_blocks_memo.get(key)
        if blocks is None:
            pct = self.send_pct["combine" if work == "combine" else "dispatch"]
            blocks = self._send_blocks_memo[key] = send_blocks(work, self.num_ranks, num_sms, pct)
        return blocks

    def cap_rows(self, row_bytes: int) -> int:
        return (self.num_bytes - ROWS_OFFSET) // row_bytes

    def check_errors(self, op: str) -> None:
        """Raise what the kernels reported since the last check (call after a sync that covers them).

        Refused inputs raise ValueError (every rank gets the same list of refusing ranks); timeouts,
        mismatched calls and capacity overruns raise RuntimeError.
        """
        self.errors.check(self.info_np, op, self.rank, self.num_ranks, self.c["info_refusal"], self._flight)

    def _sync_and_check(self, op: str) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        event.synchronize()
        self.check_errors(op)

    def _notify_barrier(self, op_code: int, op: str) -> None:
        """The notify kernel without a count exchange: advance the call counter and meet every peer."""
        check(self.lib.epcomm_notify(self._barrier_calls[op_code], stream_ptr(self.device)), op)

    def barrier(self, op: str) -> None:
        self._notify_barrier(self.c["op_barrier"], op)
        self._sync_and_check(op)

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, ranks_per_domain: int):
        return dispatch_layout(self.lib, self.device, topk_idx, num_experts, self.num_ranks, ranks_per_domain)

    # ------------------------------------------------------------------ dispatch / combine
    def dispatch(self, x, scales, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                 topk_weights, expert_alignment, num_worst_tokens, num_experts, buffer_uid, num_sms):
        rank, num_ranks, c = self.rank, self.num_ranks, self.c
        num_tokens, hidden = x.shape
        cached = handle is not None
        num_topk = topk_idx.shape[1] if topk_idx is not None else 0
        if num_topk > 32:
            raise ValueError(f"topk_idx: the CUDA kernels support up to 32 experts per token, got {num_topk}")
        check_aligned("x", x)
        num_scales = scales.shape[1] if scales is not None else 0
        row_bytes = dispatch_row_bytes(hidden, x.element_size(), num_topk, num_scales)
        cap_rows = self.cap_rows(row_bytes)
        split = False  # send half launched before the host reads the counts, receive half after
        sending = False  # a send half runs on send_stream (split, more than one rank)
        if cached and "rounds" in handle.backend_state:
            return cached_dispatch_in_rounds(self, x, scales, handle, num_sms), None, None, None, handle
        if cached:
            st = handle.backend_state
            in_rank, slot, own_tokens, layout = st["in_rank"], st["slot"], st["own_tokens"], st["layout"]
            num_worst_tokens = handle.num_worst_tokens
            experts_per_rank = st["experts_per_rank"]
            self._barrier_calls[c["op_cached_dispatch"]].shape_key = dispatch_shape_key(
                x, scales, num_topk, topk_weights is not None, num_worst_tokens)
            self._notify_barrier(c["op_cached_dispatch"], "dispatch")
            num_recv = handle.num_recv_tokens
            if not num_worst_tokens and st["max_recv"] > cap_rows:
                self._raise_capacity("dispatch", st["max_recv"], row_bytes, cap_rows)
            self._set_dispatch_inputs(x, scales, topk_idx, topk_weights, num_topk, experts_per_rank, in_rank, slot,
                                      own_tokens, layout, row_bytes, cap_rows, num_sms)
        else:
            experts_per_rank = num_experts // num_ranks
            if experts_per_rank > c["max_experts_per_rank"]:
                raise ValueError(f"the CUDA kernels support up to {c['max_experts_per_rank']} experts per rank, got "
                                 f"{experts_per_rank}")
            if num_worst_tokens > cap_rows:
                self._raise_capacity("dispatch", num_worst_tokens, row_bytes, cap_rows)
            stream = current_stream(self.device)
            in_rank = is_token_in_rank.contiguous()
            # The kernels' tables of this routing in one allocation (each torch.empty costs the
            # host ~4 us): slot [T, R], own_tokens [T], layout [LAYOUT_INTS] int32, by address.
            tables = torch.empty(num_tokens * (num_ranks + 1) + LAYOUT_INTS, dtype=torch.int32, device=self.device)
            slot = tables.data_ptr()
            own_tokens = slot + 4 * num_tokens * num_ranks
            layout = own_tokens + 4 * num_tokens
            # Held until the launch: a temporary copy freed earlier could be reused by the next one.
            send_counts, expert_counts = num_tokens_per_rank.contiguous(), num_tokens_per_expert.contiguous()
            call = self._notify_call
            call.num_tokens, call.num_topk, call.experts_per_rank = num_tokens, num_topk, experts_per_rank
            call.expert_alignment, call.num_worst_tokens, call.row_bytes = expert_alignment, num_worst_tokens, row_bytes
            call.num_sms = num_sms
            call.shape_key = dispatch_shape_key(x, scales, num_topk, topk_weights is not None, num_worst_tokens)
            call.in_rank, call.send_counts, call.expert_counts = addr(in_rank), addr(send_counts), addr(expert_counts)
            call.topk_idx, call.slot = addr(topk_idx), slot
            call.own_tokens, call.layout = own_tokens, layout
            check(self.lib.epcomm_notify(call, stream.cuda_stream), "dispatch")
            # Everything of the kernels' record but the outputs is set now: after the host read of
            # the counts only the outputs are (the GPU waits for that part of the host's work).
            self._set_dispatch_inputs(x, scales, topk_idx, topk_weights, num_topk, experts_per_rank, in_rank, slot,
                                      own_tokens, layout, row_bytes, cap_rows, num_sms)
            num_recv = -1  # unknown on the host with num_worst_tokens (no sync)
            if not num_worst_tokens:
                counted = self._counted
                counted.record(stream)
                split = self.overlap
                # One rank alone has nothing to send (its receivers copy its rows from x); a send
                # half would still walk every token on its one SM and end after the receivers.
                sending = split and num_ranks > 1
                if sending:
                    self.send_stream.wait_event(counted)
                    self._launch_dispatch(1, c["op_dispatch"], num_sms, stream=self.send_stream.cuda_stream)
                try:
                    counted.synchronize()
                    self.check_errors("dispatch")
                    info = self.info_np
                    num_recv = int(info[c["info_num_recv"]])
                    max_recv, max_send = int(info[c["info_max_recv"]]), int(info[c["info_max_send"]])
                except BaseException:
                    if sending:  # the send half may still read the inputs
                        self._join_send_half(stream)
                    raise
                # One pass only if its combine fits too (a rank may send more rows than any receives, and
                # a BF16 combine row outgrows an FP8 dispatch row). Every rank sees the same matrix, so
                # all go to rounds alike.
                need = max(max_recv, max_send)
                if need > self.cap_rows(max(row_bytes, combine_row_bytes(hidden, num_topk))):
                    if sending:  # its send half moved rows nobody will read: let it finish first
                        self._join_send_half(stream)
                    expert_list = self.info_np[c["info_experts"]:c["info_experts"] + experts_per_rank].tolist()
                    return self._dispatch_in_rounds(
                        x, scales, is_token_in_rank, topk_idx, topk_weights, num_experts, self._count_matrix(),
                        expert_list, buffer_uid, num_sms)
        num_out = num_worst_tokens or num_recv
        recv_x = torch.empty((num_out, hidden), dtype=x.dtype, device=self.device)
        recv_scales = None
        if scales is not None:
            # Row-major whatever the input's layout (DeepEP's), the kernel reads the input by its strides.
            recv_scales = torch.empty((num_out, num_scales), dtype=scales.dtype, device=self.device)
        recv_topk_idx = recv_topk_weights = None
        if topk_idx is not None:
            recv_topk_idx = torch.empty((num_out, num_topk), dtype=torch.int64, device=self.device)
            if topk_weights is not None:
                recv_topk_weights = torch.empty((num_out, num_topk), dtype=torch.float32, device=self.device)
        self._launch_dispatch(2 if split else 0, c["op_cached_dispatch"] if cached else c["op_dispatch"], num_sms,
                              recv_x, recv_scales, recv_topk_idx, recv_topk_weights, num_out)
        if sending:
            self._join_send_half(stream)
        recv_x_out = (recv_x, recv_scales) if scales is not None else recv_x
        if cached:
            return recv_x_out, None, None, None, handle
        if num_worst_tokens:
            recv_counts, send_counts, expert_list, max_recv, max_send = [], [], [], -1, -1
            matrix = self._count_matrix_on_device()
        else:  # read after the launch: the GPU is not kept waiting for these lists
            matrix = self._count_matrix()
            recv_counts = [int(v) for v in matrix[:, rank]]
            send_counts = [int(v) for v in matrix[rank]]
            expert_list = self.info_np[c["info_experts"]:c["info_experts"] + experts_per_rank].tolist()
        new_handle = DispatchHandle(
            buffer_uid=buffer_uid, num_tokens=num_tokens, hidden=hidden, num_recv_tokens=num_recv,
            num_worst_tokens=num_worst_tokens, is_token_in_rank=is_token_in_rank, send_counts=send_counts,
            recv_counts=recv_counts, count_matrix=matrix,
            backend_state={"in_rank": in_rank, "tables": tables, "slot": slot, "own_tokens": own_tokens,
                           "layout": layout, "experts_per_rank": experts_per_rank, "max_recv": max_recv,
                           "max_send": max_send})
        return recv_x_out, recv_topk_idx, recv_topk_weights, expert_list, new_handle

    def _join_send_half(self, stream: torch.cuda.Stream) -> None:
        """`stream` waits for the send half's kernel on send_stream. One event, reused (a wait takes
        the event's state when it is issued): Stream.wait_stream makes a new event each call."""
        self._sent.record(self.send_stream)
        stream.wait_event(self._sent)

    def _count_matrix(self):
        """[R, R] rows rank s sends to rank d, as the last count exchange left them (a copy)."""
        c, r = self.c, self.num_ranks
        return self.info_np[c["info_matrix"]:c["info_matrix"] + r * r].reshape(r, r).copy()

    def _count_matrix_on_device(self) -> torch.Tensor | None:
        """The count matrix of a num_worst_tokens dispatch, which the host never reads: copied on the stream
        out of the pinned words its notify kernel wrote, before a later call rewrites them (handle[0]
        sums it). None inside a graph capture, whose replays would not keep one per replay."""
        if torch.cuda.is_current_stream_capturing():
            return None
        words = self.info[self.c["info_matrix"]:self.c["info_matrix"] + self.num_ranks * self.num_ranks]
        return words.view(self.num_ranks, self.num_ranks).to(self.device, non_blocking=True)

    def _set_dispatch_inputs(self, x, scales, topk_idx, topk_weights, num_topk, experts_per_rank, in_rank, slot,
                             own_tokens, layout, row_bytes, cap_rows, num_sms) -> None:
        """The fields of the dispatch kernels' record that do not depend on the outputs (slot,
        own_tokens and layout: device addresses in the routing's tables)."""
        call = self._dispatch_call
        call.num_sms = num_sms
        call.num_tokens, call.x_bytes, call.x = x.shape[0], x.shape[1] * x.element_size(), addr(x)
        call.scales, call.num_scales = addr(scales), scales.shape[1] if scales is not None else 0
        call.scale_stride_t, call.scale_stride_c = scales.stride() if scales is not None else (0, 0)
        call.topk_idx, call.topk_weights, call.num_topk = addr(topk_idx), addr(topk_weights), num_topk
        call.has_topk, call.has_weights = topk_idx is not None, topk_weights is not None
        call.experts_per_rank, call.row_stride, call.cap_rows = experts_per_rank, row_bytes, cap_rows
        call.in_rank, call.slot = addr(in_rank), slot
        call.own_tokens, call.layout = own_tokens, layout

    def _launch_dispatch(self, mode, op_code, num_sms, recv_x=None, recv_scales=None, recv_topk_idx=None,
                         recv_topk_weights=None, num_out=0, stream: int | None = None) -> None:
        """mode 0: the fused kernel; 1: its send half; 2: its receive half (see intranode.cu), on the
        inputs of the last _set_dispatch_inputs, on `stream` (a cudaStream_t; default: the current one)."""
        call = self._dispatch_call
        call.mode, call.op = mode, op_code
        call.local_by_receiver = own_rows_by_receivers(mode, self.num_ranks)
        work = dispatch_work(mode, self.num_ranks, bool(call.num_scales))
        call.num_send_blocks = self._send_blocks(num_sms, work)
        call.recv_x, call.recv_scales, call.num_out_rows = addr(recv_x), addr(recv_scales), num_out
        call.recv_scale_stride_t, call.recv_scale_stride_c = recv_scales.stride() if recv_scales is not None else (0, 0)
        call.recv_topk_idx, call.recv_topk_weights = addr(recv_topk_idx), addr(recv_topk_weights)
        check(self.lib.epcomm_dispatch(call, stream_ptr(self.device) if stream is None else ctypes.c_void_p(stream)),
              "dispatch")

    def combine(self, x, handle: DispatchHandle, topk_weights, biases, num_sms):
        st = handle.backend_state
        if "rounds" in st:
            return combine_in_rounds(self, x, handle, topk_weights, biases, num_sms)
        num_tokens, hidden = handle.num_tokens, x.shape[1]
        num_topk = topk_weights.shape[1] if topk_weights is not None else 0
        if num_topk > 32:
            raise ValueError(f"topk_weights: the CUDA kernels support up to 32 columns, got {num_topk}")
        check_aligned("x", x)
        for i, b in enumerate(biases):
            check_aligned(f"bias[{i}]", b)
        row_bytes = combine_row_bytes(hidden, num_topk)
        cap_rows = self.cap_rows(row_bytes)
        if st["max_send"] > cap_rows:
            self._raise_capacity("combine", st["max_send"], row_bytes, cap_rows)
        self._barrier_calls[self.c["op_combine"]].shape_key = shape_digest(3, hidden, num_topk)
        self._notify_barrier(self.c["op_combine"], "combine")
        out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=self.device)
        out_w = torch.empty((num_tokens, num_topk), dtype=torch.float32, device=self.device) if num_topk else None
        bias0 = biases[0] if len(biases) > 0 else None
        bias1 = biases[1] if len(biases) > 1 else None
        call = self._combine_call
        call.num_sms, call.num_send_blocks = num_sms, self._send_blocks(num_sms, "combine")
        call.num_tokens, call.hidden, call.num_topk = num_tokens, hidden, num_topk
        call.row_stride, call.cap_rows = row_bytes, cap_rows
        call.x, call.weights, call.out, call.out_weights = addr(x), addr(topk_weights), addr(out), addr(out_w)
        call.in_rank, call.slot, call.layout = addr(st["in_rank"]), st["slot"], st["layout"]
        call.bias0, call.bias1 = addr(bias0), addr(bias1)
        check(self.lib.epcomm_combine(call, stream_ptr(self.device)), "combine")
        return out, out_w

    # ------------------------------------------------------------------ calls larger than the buffer
    # A dispatch whose rows do not fit runs as rounds over ranges of B source tokens (the same ranges
    # on every rank): a round's rows fit by construction (each rank receives at most R * B rows, and
    # sends at most R * B back in combine). Every token belongs to one round, so each round's combine
    # sums a token's rows exactly as a single call would: the results are the same bits. The cost is
    # one extra copy of the outputs (assembling them in source-rank order) and of combine's input.
    def _round_tokens(self, hidden: int, element_size: int, num_topk: int, num_scales: int) -> int:
        row = max(dispatch_row_bytes(hidden, element_size, num_topk, num_scales), combine_row_bytes(hidden, num_topk))
        tokens = self.cap_rows(row) // self.num_ranks
        if tokens < 1:
            raise ValueError(f"num_nvl_bytes={self.num_bytes} cannot hold one row of {row} bytes per rank; the CUDA "
                             f"backend needs at least {ROWS_OFFSET + self.num_ranks * row}")
        return tokens

    def _num_rounds(self, num_tokens: int, round_tokens: int) -> int:
        """Rounds every rank runs: enough for the rank with the most tokens (one small all-reduce)."""
        most = torch.tensor([num_tokens], dtype=torch.int64, device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        return max(1, -(-int(most.item()) // round_tokens))

    def _dispatch_in_rounds(self, x, scales, is_token_in_rank, topk_idx, topk_weights, num_experts, matrix,
                            expert_list, buffer_uid, num_sms):
        num_topk = topk_idx.shape[1] if topk_idx is not None else 0
        num_scales = scales.shape[1] if scales is not None else 0
        step = self._round_tokens(x.shape[1], x.element_size(), num_topk, num_scales)
        recv_x, recv_topk_idx, recv_topk_weights, handle = dispatch_in_rounds(
            self, x, scales, is_token_in_rank, topk_idx, topk_weights, num_experts, step,
            self._num_rounds(x.shape[0], step), matrix, buffer_uid, num_sms)
        return recv_x, recv_topk_idx, recv_topk_weights, expert_list, handle

    # ------------------------------------------------------------------ errors raised on every rank alike
    def _raise_capacity(self, op: str, rows: int, row_bytes: int, cap_rows: int) -> None:
        need = ROWS_OFFSET + rows * row_bytes
        raise ValueError(f"epcomm {op}: num_nvl_bytes={self.num_bytes} holds {cap_rows} rows of {row_bytes} bytes, "
                         f"this call needs {rows} on some rank: the CUDA backend needs num_nvl_bytes >= {need} "
                         "(epcomm.backends.cuda.intranode.buffer_bytes_needed gives the worst case)")
