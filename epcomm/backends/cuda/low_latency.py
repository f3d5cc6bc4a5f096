"""Low-latency mode with the CUDA kernels (include/epcomm/impls/ll_*.cuh).

Two transports (EPCOMM_LL_TRANSPORT): CUDA IPC inside one host (every peer's buffer mapped, direct
stores), or the NVSHMEM symmetric heap, where peers mapped over NVLink still get direct stores
and the others (other nodes; or those EPCOMM_LL_REMOTE_RANKS lists, so one host tests the path)
get NVSHMEM puts and signals. The kernels are the same; only the library differs.

Each call is one kernel (ll::dispatch, ll::combine), launched by the call with both phases, or,
with a receive hook, its send phase by the call and its receive phase by the hook: between the two
no SM is held. Both read the call counter from the GPU and take their data positions from device
tensors, so a decode step captured in a CUDA graph replays with new inputs; there is no host sync anywhere.

Outputs follow the API's layout exactly as the reference backend builds it: expert e's rows hold
the blocks of sources 0..R-1 in rank order, each in ascending (token, top-k slot) order, so the
receive side is bitwise equal to the reference (FP8 casts included), and combine sums in fp32 in
top-k slot order, as the reference does. A combine by partial sums (EPCOMM_LL_COMBINE_PARTIALS: 1,
or auto from 64 tokens a rank; IPC only, no hook) has the expert side return one bf16 partial sum
per (token, rank) instead (ll::combine_partials): the same at one rank, within bf16 rounding on
more.

Errors found by the kernels are written to pinned host memory, one record per slot, and raised
without a host sync in the common case:
* invalid inputs (topk_idx values outside [-1, E), or more pairs for one expert than N; a combine
  whose topk_idx differs from its dispatch's): the sender marks every signal of the call, so every
  rank records them. A call checks the record of the call before it that used its slot, after
  waiting for that call's receive to finish (long done in a decode loop), so every rank raises the
  same ValueError at the same call and none is left waiting for a peer that raised alone;
* a peer that did not send within EPCOMM_TIMEOUT_S: RuntimeError as soon as any call sees it (the
  peers are in trouble anyway). With ``enable_shrink=True`` such a source is masked instead.
"""

from __future__ import annotations

import ctypes
import functools
import socket
import types
from collections.abc import Callable

import torch
import torch.distributed as dist

from ... import _env
from ...flight_recorder import hook, low_latency_counters
from ...handle import LowLatencyHandle
from ...tuning import partials_asked, receive_together
from ..base import CombineOverlap
from ..rows import low_latency_scales_layout, round_up, shape_digest
from .build import load_library, load_nvshmem_library
from .capi import addr, check, check_aligned, load_records, raw_stream
from .errors import LOW_LATENCY, ErrorTable, RecordLayout
from .ipc import SharedBuffer

_INFO_INTS = 16
_MAX_BUFFER_BYTES = 32 << 30  # plan_message (low_latency.cuh): message offsets in 16-byte units, int32
# One error record per slot: the code, the failed call's op, its phase, a word per rank (zeroed whole
# once read).
_ERROR_TABLE = ErrorTable(LOW_LATENCY, RecordLayout.protocol(clear="record"))


@functools.lru_cache(maxsize=256)
def message_bytes(hidden: int, use_fp8: bool, use_ue8m0: bool) -> tuple[int, int, int]:
    """(data bytes, scale columns, message bytes) of one dispatched token's message to a rank."""
    data = hidden if use_fp8 else hidden * 2
    cols = (hidden // 512 if use_ue8m0 else hidden // 128) if use_fp8 else 0
    return data, cols, round_up(data + cols * 4, 16)


def message_layout(num_max_tokens: int, hidden: int, num_ranks: int, num_experts: int, use_fp8: bool,
                   use_ue8m0: bool) -> tuple[int, int]:
    """(message bytes, alignment) of a dispatch's messages [R][N] in the slot's dispatch area: 128-byte
    lines (each 512-byte unit of FP8 data fills whole lines over NVLink) where the area has room for
    them, the index [E_local][R][N] of int32 and the base's rounding; else as message_bytes, 16."""
    _, _, msg = message_bytes(hidden, use_fp8, use_ue8m0)
    wide = round_up(msg, 128)
    area = num_experts * num_max_tokens * (hidden * 2 + 16)
    if num_ranks * num_max_tokens * wide + 4 * num_experts * num_max_tokens + 112 <= area:
        return wide, 128
    return msg, 16


def arrival_message_bytes(hidden: int, num_topk: int, use_fp8: bool, use_ue8m0: bool) -> int:
    """Bytes of a dispatch message by arrival (low_latency.cuh, "dispatch by arrival"): a 128-byte
    header (K <= 16 tagged words), the FP8 data and the fp32 scales, in 128-byte lines; 0 for the
    formats that have none (BF16, UE8M0 scales: their words may be any bits, so no poison exists)."""
    if not use_fp8 or use_ue8m0 or num_topk > 16:
        return 0
    data, cols, _ = message_bytes(hidden, use_fp8, use_ue8m0)
    return round_up(128 + data + round_up(cols * 4, 16), 128)


def area_tag(hidden: int, num_experts: int, num_max_tokens: int) -> int:
    """The shape tag of a slot's layout (where its dispatch area lies): a dispatch's arrival key and a
    combine's check of it (ArrivalKeyUpdate in low_latency.cuh)."""
    return shape_digest(3, hidden, num_experts, num_max_tokens, bits=31)


def slot_bytes_needed(num_max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Bytes of one of the two slots: signals, acks, the dispatch area (sized as the size hint's
    messages, one per (expert, row) of 2H + 16 bytes: the kernels' messages [R][N] and index
    [E_local][R][N] take part of it), the combine area."""
    dispatch = num_experts * num_max_tokens * (hidden * 2 + 16)
    combine = num_experts * num_max_tokens * hidden * 2
    return num_experts * 16 + round_up(num_ranks * 8, 16) + dispatch + combine



def request_bytes(num_topk: int) -> int:
    """A combine-by-partials request record (ll::combine_partials): a header (the pair count and
    the call counter, 8 bytes unused), then per pair 16 bytes (the local expert * N + row and the
    weight, each beside the call counter)."""
    return 16 + 16 * num_topk


def partials_fit(num_ranks: int, num_experts: int, hidden: int, num_topk: int) -> bool:
    """Whether a combine by partial sums fits a slot's combine area ([E][N] rows) and signals ([E]):
    partial rows [R][N] and request records [R][N], and 2R signals."""
    return (num_experts >= 2 * num_ranks and
            num_ranks * (2 * hidden + request_bytes(num_topk)) <= num_experts * 2 * hidden)


def bind_calls(lib: ctypes.CDLL) -> types.SimpleNamespace:
    """The call records (LLCallContext, LLDispatchCall, LLCombineCall: built from the declarations in
    csrc/low_latency.cu, which the IPC and the NVSHMEM library both hold), with the entry points that
    take them declared, with the phase and the stream."""
    records = load_records(lib, "LLCallContext LLDispatchCall LLCombineCall", "epcomm_ll_struct")
    for function, record in ((lib.epcomm_ll_dispatch, records.LLDispatchCall),
                             (lib.epcomm_ll_combine, records.LLCombineCall)):
        function.argtypes = [ctypes.POINTER(record), ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        function.restype = ctypes.c_int
    lib.epcomm_ll_event_create.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.epcomm_ll_stream_wait_event.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    for function in (lib.epcomm_ll_event_synchronize, lib.epcomm_ll_event_destroy):
        function.argtypes = [ctypes.c_void_p]
    for function in (lib.epcomm_ll_event_create, lib.epcomm_ll_event_synchronize, lib.epcomm_ll_stream_wait_event,
                     lib.epcomm_ll_event_destroy):
        function.restype = ctypes.c_int
    for function in (lib.epcomm_ll_combine_partials_fit, lib.epcomm_ll_dispatch_fused_fit):
        function.argtypes = [ctypes.c_int]
        function.restype = ctypes.c_int
    return records


def _choose_transport(group: dist.ProcessGroup, num_ranks: int) -> str:
    """EPCOMM_LL_TRANSPORT, with auto resolved: CUDA IPC when every rank is on this host and none is
    to be treated as remote, else NVSHMEM. Every rank reaches the same answer."""
    choice = _env.ll_transport()
    remote = _env.ll_remote_ranks(num_ranks)
    if choice == "ipc" and remote:
        raise ValueError("EPCOMM_LL_REMOTE_RANKS needs the NVSHMEM transport, but EPCOMM_LL_TRANSPORT=ipc")
    if choice != "auto":
        return choice
    if remote:
        return "nvshmem"
    hosts: list = [None] * num_ranks
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return "ipc" if len(set(hosts)) == 1 else "nvshmem"


class CudaLowLatency:
    """Low-latency mode on the CUDA kernels (the LowLatencyOps of backends/base.py)."""

    on_kernels = True
    recorder = None  # the Buffer's FlightRecorder (flight_recorder.attach)

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_rdma_bytes: int, timeout_s: float) -> None:
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        if self.num_ranks > 8:
            raise RuntimeError(f"the CUDA low-latency kernels support up to 8 ranks, the group has {self.num_ranks}")
        self.device = device
        self.timeout_ns = int(timeout_s * 1e9)
        self.transport = _choose_transport(group, self.num_ranks)
        self.block_receive = _env.ll_block_receive()  # auto, 0 or 1; the receive side only: ranks may differ
        self.lib = load_nvshmem_library() if self.transport == "nvshmem" else load_library()
        self.record_types = bind_calls(self.lib)
        self.header = self.lib.epcomm_ll_header_bytes()
        if num_rdma_bytes <= self.header + 64:
            raise ValueError(f"num_rdma_bytes={num_rdma_bytes} is too small for the low-latency kernels; use "
                             "Buffer.get_low_latency_rdma_size_hint")
        if num_rdma_bytes > _MAX_BUFFER_BYTES:  # the dispatch's send plan holds offsets in 16-byte units, int32
            raise ValueError(f"num_rdma_bytes={num_rdma_bytes}: the CUDA low-latency kernels address at most "
                             f"{_MAX_BUFFER_BYTES} bytes (32 GiB) a rank")
        if self.transport == "nvshmem":
            from .nvshmem import SymmetricBuffer

            remote = _env.ll_remote_ranks(self.num_ranks) - {self.rank}
            self.shared = SymmetricBuffer(group, device, num_rdma_bytes, remote, "num_rdma_bytes")
        else:
            self.shared = SharedBuffer(self.lib, group, device, num_rdma_bytes, "num_rdma_bytes")
        self.slot_bytes = (num_rdma_bytes - self.header) // 2 // 16 * 16
        # One error record per slot; the event marks the end of the receive of the slot's last call.
        self.info = torch.zeros((2, _INFO_INTS), dtype=torch.int32, device="cpu", pin_memory=True)
        self.info_np = self.info.numpy()
        self._flight = hook(self, "low_latency", low_latency_counters)
        # Per slot: whether the receive of its last call was recorded in _received_events (the host
        # waits on it before reading the slot's error record), and the event the hook's receive waits
        # on (the send). Reused: a slot's next call starts only after these were consumed. CUDA
        # events of the library's (cudaEvent_t), which records them after the launches (_launch).
        self._received: list[bool] = [False, False]
        with torch.cuda.device(device):
            self._received_events = [self._new_event() for _ in range(2)]
            self._sent_events = [self._new_event() for _ in range(2)]
        # What the calls of one shape share (_DispatchShape, _CombineShape), by shape.
        self._dispatch_shapes: dict[tuple, _DispatchShape] = {}
        self._combine_shapes: dict[tuple, _CombineShape] = {}
        self._captured = False  # a call was captured in a CUDA graph: its replays record errors too
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.max_experts = self.lib.epcomm_ll_max_experts()
        self.combine_partials_mode = _env.ll_combine_partials()  # auto, 0 or 1
        self.combine_partials, self.arrival = self._switches_agreed(group)
        self.last_combine_partials = False  # whether the last combine was by partial sums (tests)

        # Per slot, the running send's counters, 0 between calls: a dispatch's pairs written per
        # expert, a combine by partial sums' first three words. Allocated once, at the largest size,
        # so a CUDA graph never holds a pointer to a freed or pool-owned tensor.
        self._sent_pairs = torch.zeros((2, self.max_experts), dtype=torch.int32, device=device)
        # Phase timelines of the next calls (trace()); None in normal use.
        self.traces: dict[str, torch.Tensor] | None = None
        # Per slot, a record of each kind with the fields every call in the slot shares; a call
        # copies its slot's and sets the rest (_launch says why a copy, not the record itself).
        types_ = self.record_types
        contexts = [types_.LLCallContext(peer_bufs=ctypes.addressof(self.shared.ptrs), info=self.info[s].data_ptr(),
                                         timeout_ns=self.timeout_ns, slot_bytes=self.slot_bytes, rank=self.rank,
                                         num_ranks=self.num_ranks, slot=s, num_sms=self.num_sms) for s in range(2)]
        # The blocks of a dispatch by arrival that send (0: the kernel's choice; send_plan). Each
        # rank plans its own sends, so ranks need not agree.
        senders = _env.ll_dispatch_senders()
        self._dispatch_calls = [types_.LLDispatchCall(context=c, sent_pairs=addr(self._sent_pairs[s]),
                                                      send_blocks=senders) for s, c in enumerate(contexts)]
        self._combine_calls = [types_.LLCombineCall(context=c, counters=addr(self._sent_pairs[s]))
                               for s, c in enumerate(contexts)]
        dist.barrier(group=group)

    def _switches_agreed(self, group: dist.ProcessGroup) -> tuple[bool, bool]:
        """(Whether combines may go by partial sums, whether dispatches may go by arrival), checked in
        one collective (every rank builds its Buffer): ranks whose switches disagree are named here,
        not left to wait for each other in the kernels or to report each other's calls as of another
        shape. Partial sums (EPCOMM_LL_COMBINE_PARTIALS not 0; which ones: combine_by_partials) where
        every rank can: its kernels storing into each peer's slot (every peer mapped: the IPC
        transport) and its send kernel fitting one block per SM (a cooperative launch). By arrival:
        EPCOMM_LL_ARRIVAL (the kernels decide per call: dispatch_mode)."""
        partials = ("0", "1", "auto").index(self.combine_partials_mode)
        able = partials != 0 and self.transport == "ipc" and self.lib.epcomm_ll_combine_partials_fit(self.num_sms) == 1
        arrival = int(_env.ll_arrival())
        flags = torch.tensor([partials, -partials, arrival, -arrival, int(able)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
        for i, name in ((0, "EPCOMM_LL_COMBINE_PARTIALS"), (2, "EPCOMM_LL_ARRIVAL")):
            if int(flags[i]) != -int(flags[i + 1]):
                raise ValueError(f"{name} differs across ranks; every rank must set the same value")
        return bool(flags[4].item()), bool(arrival)

    def combine_by_partials(self, num_experts: int, hidden: int, num_max_tokens: int, num_topk: int,
                            hook: bool) -> bool:
        """Whether a combine of this shape goes by partial sums: allowed (combine_partials), without a
        hook (its send kernel waits for every peer's requests, which a hook's send must not: no SM
        held while data is in flight), where its rows and records fit (partials_fit), and asked for
        (1) or, with auto, from tuning.PARTIALS_AUTO_MIN_TOKENS tokens a rank. The same on every rank."""
        return (self.combine_partials and not hook and partials_fit(self.num_ranks, num_experts, hidden, num_topk) and
                partials_asked(self.combine_partials_mode, num_max_tokens))

    def trace(self, on: bool = True) -> dict[str, torch.Tensor] | None:
        """Have the following calls record their phase timeline (tools/profile/ll_profile.py): per op
        ("dispatch", "combine"), an int64 tensor [2 kernels (send, receive), blocks, points] of global
        timer values (ns) that each block stores as it passes the points of include/epcomm/layout/low_latency.cuh
        (TracePoint); 0 where a block did not pass. The last point (kTraceSm) is no time: the block's
        SM + 1, stamped by the dispatch's send role only. Each call overwrites its op's tensor. For
        diagnosis only: not to be used inside a captured graph that outlives the tensors."""
        if not on:
            self.traces = None
            return None
        blocks, points = ctypes.c_int(), ctypes.c_int()
        self.lib.epcomm_ll_trace_shape(ctypes.byref(blocks), ctypes.byref(points))
        self.traces = {op: torch.zeros((2, blocks.value, points.value), dtype=torch.int64, device=self.device)
                       for op in ("dispatch", "combine")}
        return self.traces

    def _trace(self, op: str) -> torch.Tensor | None:
        return self.traces[op] if self.traces is not None else None

    def _new_event(self) -> int:
        event = ctypes.c_void_p()
        check(self.lib.epcomm_ll_event_create(ctypes.byref(event)), "low-latency buffer setup (cudaEventCreate)")
        return event.value

    def close(self) -> None:
        for event in self._received_events + self._sent_events:
            self.lib.epcomm_ll_event_destroy(event)  # released once pending work is done
        self._received_events = self._sent_events = []
        self.shared.close()

    def remote_ranks(self) -> list[int]:
        return list(getattr(self.shared, "remote_ranks", []))

    def local_memory(self, rdma: bool) -> torch.Tensor | None:
        return self.shared.tensor if rdma else None

    def clean(self, meet: Callable[[str], None]) -> bool:
        """clean_low_latency_buffer, collective: every rank's kernels are done (first meeting), the
        whole buffer is zeroed (signals, acknowledgements, call counters) with the error records and
        pair counters, and nobody sends again before every rank has zeroed (second meeting). Every
        rank then starts again from call 1: ranks whose calls diverged (a peer masked after a
        timeout that comes back) are in step again."""
        torch.cuda.synchronize(self.device)
        meet("zero")
        self.shared.tensor.zero_()
        self._sent_pairs.zero_()
        self.info_np[:] = 0
        self._received = [False, False]
        self._captured = False
        torch.cuda.synchronize(self.device)
        meet("zeroed")
        return True

    def check_errors(self, op: str, slot: int, capturing: bool) -> None:
        """Raise what the kernels reported before a call in ``slot`` launches anything: the record of
        the slot's previous call once its receive has finished (the same verdict on every rank), and
        a timeout seen in the other slot's record."""
        if capturing:
            return  # no host wait inside a capture; the next eager call checks
        if self._received[slot]:
            check(self.lib.epcomm_ll_event_synchronize(self._received_events[slot]), op)
            self._received[slot] = False
            self._raise(op, slot)
        elif self._captured:  # replays of captured calls may have recorded errors: look at both slots
            torch.cuda.synchronize(self.device)
            self._captured = False
            self._raise(op, slot)
            self._raise(op, 1 - slot)
        if int(self.info_np[1 - slot][0]) in _ERROR_TABLE.fatal:
            self._raise(op, 1 - slot)

    def _raise(self, op: str, slot: int) -> None:
        _ERROR_TABLE.check(self.info_np[slot], op, self.rank, self.num_ranks, flight=self._flight)

    def check_dispatch_args(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_tokens: int,
                            num_experts: int) -> None:
        """What the kernels need beyond the API's checks; called before the call takes a slot."""
        self.check_capacity(num_max_tokens, x.shape[1], num_experts)
        if topk_idx.shape[1] > 32:
            raise ValueError(f"topk_idx: the CUDA low-latency kernels support up to 32 experts per token, got "
                             f"{topk_idx.shape[1]}")
        check_aligned("x", x)

    def check_combine_args(self, x: torch.Tensor, handle: LowLatencyHandle, out: torch.Tensor | None) -> None:
        if not handle.backend_state.get("received"):
            raise ValueError("low_latency_combine: the dispatch of this handle has not been received yet; call its "
                             "receive hook first")
        self.check_capacity(handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        check_aligned("x", x)
        if out is not None:
            check_aligned("out", out)

    def check_capacity(self, num_max_tokens: int, hidden: int, num_experts: int) -> None:
        if num_experts > self.max_experts:
            raise ValueError(f"num_experts={num_experts}: the CUDA low-latency kernels support up to "
                             f"{self.max_experts} experts")
        need = slot_bytes_needed(num_max_tokens, hidden, self.num_ranks, num_experts)
        if need > self.slot_bytes:
            raise ValueError(f"num_rdma_bytes={self.shared.num_bytes} gives two slots of {self.slot_bytes} bytes; "
                             f"N={num_max_tokens}, hidden={hidden}, num_experts={num_experts} need {need} per slot "
                             "(Buffer.get_low_latency_rdma_size_hint gives enough)")

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_tokens: int, num_experts: int,
                 cumulative_stats: torch.Tensor | None, wait_stats: torch.Tensor | None, use_fp8: bool,
                 round_scale: bool, use_ue8m0: bool, slot: int, mask: torch.Tensor | None, buffer_uid: str,
                 hook: bool) -> tuple[object, torch.Tensor, LowLatencyHandle, Callable[[], None]]:
        """Launch the send kernel; returns (recv_x, recv_count, handle, finish), finish launching the
        receive. Without ``hook``, one kernel sends and receives, and finish does nothing.
        Host time counts here (an eager decode step waits on it): what depends on the shape only
        comes from _DispatchShape, the FP8 scales and the small int tensors are views of one
        allocation, and the kernel copies topk_idx for the handle (no clone)."""
        capturing = _capturing()
        self.check_errors("low_latency_dispatch", slot, capturing)
        num_tokens, hidden = x.shape
        num_topk = topk_idx.shape[1]
        key = (hidden, num_topk, num_experts, num_max_tokens, use_fp8, round_scale, use_ue8m0)
        shape = self._dispatch_shapes.get(key)
        if shape is None:
            shape = self._dispatch_shapes[key] = _DispatchShape(self, *key)
        dev = self.device
        data = torch.empty(shape.data_shape, dtype=shape.data_dtype, device=dev)
        topk_copy_at, slot_map_at, small_words = shape.pairs_layout(num_tokens * num_topk)
        small = torch.empty(small_words, dtype=torch.int64, device=dev)
        small32 = small.view(torch.int32)
        layout_range = small.as_strided(shape.layout_range_shape, shape.layout_range_strides, 0)
        src_info = small32.as_strided(shape.src_info_shape, shape.src_info_strides, shape.src_info_at)
        recv_count = small32.as_strided((shape.e_local,), (1,), shape.recv_count_at)
        scales = None
        if use_fp8:
            words = small32 if use_ue8m0 else small32.view(torch.float32)
            scales = words.as_strided(shape.scales_shape, shape.scales_strides, shape.scales_at)
        base = small.data_ptr()  # the handle keeps offsets in small, not addresses
        trace = self._trace("dispatch")

        call = self.record_types.LLDispatchCall.from_buffer_copy(shape.records[slot])  # its own: _launch says why
        call.num_tokens = num_tokens
        call.block_receive = receive_together(self.block_receive, num_tokens, num_topk, num_experts)
        call.arrival = int(shape.arrival and not hook and mask is None)
        call.x, call.topk_idx, call.mask = x.data_ptr(), topk_idx.data_ptr(), addr(mask)
        call.wait_stats, call.trace, call.cumulative_stats = addr(wait_stats), addr(trace), addr(cumulative_stats)
        call.slot_map, call.topk_copy = base + slot_map_at, base + topk_copy_at
        call.recv_data, call.recv_scales = data.data_ptr(), addr(scales)
        call.src_info, call.recv_count = base + 4 * shape.src_info_at, base + 4 * shape.recv_count_at
        call.layout_range = base
        call.held = (x, topk_idx, mask, wait_stats, trace, cumulative_stats, data, scales, small)
        call.written = (data, small)  # what the receive writes (_launch)

        state: dict = {"small": small, "topk_copy_at": topk_copy_at, "slot_map_at": slot_map_at, "received": False}
        handle = LowLatencyHandle(
            buffer_uid=buffer_uid, num_max_dispatch_tokens_per_rank=num_max_tokens, hidden=hidden,
            num_experts=num_experts, num_tokens=num_tokens, num_topk=num_topk, src_info=src_info,
            layout_range=layout_range, backend_state=state)
        recv_x = (data, scales) if use_fp8 else data
        entry = self.lib.epcomm_ll_dispatch
        if not hook:
            self._launch(entry, call, 0, slot, capturing, "low_latency_dispatch")
            state["received"] = True  # layout_range is filled once the receive has run
            return recv_x, recv_count, handle, _nothing
        send_stream = self._launch(entry, call, 1, slot, capturing, "low_latency_dispatch")

        def receive() -> None:  # the record keeps the inputs alive until then
            self._launch(entry, call, 2, slot, _capturing(), "low_latency_dispatch", send_stream)
            state["received"] = True

        return recv_x, recv_count, handle, receive

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: LowLatencyHandle,
                out: torch.Tensor | None, slot: int, mask: torch.Tensor | None, wait_stats: torch.Tensor | None,
                hook: bool, overlap: CombineOverlap | None = None) -> tuple[torch.Tensor, Callable[[], None]]:
        """With ``overlap`` (single-batch overlap): a send kernel on at most ``overlap.num_sms`` blocks
        that sends each (local expert, source) unit's rows once the GEMM has raised the words of their
        blocks (combine_send_overlap), then the usual receive; never by partial sums."""
        capturing = _capturing()
        self.check_errors("low_latency_combine", slot, capturing)
        num_tokens, hidden = handle.num_tokens, handle.hidden
        key = (hidden, handle.num_experts, handle.num_max_dispatch_tokens_per_rank, handle.num_topk, hook,
               overlap is not None)
        shape = self._combine_shapes.get(key)
        if shape is None:
            shape = self._combine_shapes[key] = _CombineShape(self, *key)
        # The kernels index [T, K] densely: the handle's own copy of the ids (the one the dispatch
        # used) and contiguous weights. The caller's ids are compared with it on the GPU (a host
        # comparison would sync).
        caller_topk_idx = topk_idx.contiguous()
        topk_weights = topk_weights.contiguous()
        combined = out if out is not None else torch.empty((num_tokens, hidden), dtype=torch.bfloat16,
                                                           device=self.device)
        state = handle.backend_state
        small = state["small"].data_ptr()
        trace = self._trace("combine")
        self.last_combine_partials = shape.partials

        call = self.record_types.LLCombineCall.from_buffer_copy(shape.records[slot])  # its own: _launch says why
        call.num_tokens = num_tokens
        call.x, call.topk_idx, call.mask = x.data_ptr(), small + state["topk_copy_at"], addr(mask)
        call.wait_stats = addr(wait_stats)
        call.trace, call.layout_range = addr(trace), handle.layout_range.data_ptr()
        call.slot_map = small + state["slot_map_at"]
        call.caller_topk_idx, call.topk_weights = caller_topk_idx.data_ptr(), topk_weights.data_ptr()
        call.out = combined.data_ptr()
        call.held = (x, mask, wait_stats, trace, state["small"], handle.layout_range, caller_topk_idx, topk_weights,
                     combined, overlap)
        call.written = (combined,)
        if overlap is not None:
            call.computed, call.packed_recv_count = overlap.signals.data_ptr(), addr(overlap.packed_recv_count)
            call.block_m, call.signals_per_expert = overlap.block_m, overlap.signals_per_expert
            call.threshold, call.send_blocks = overlap.threshold, overlap.num_sms
        entry = self.lib.epcomm_ll_combine
        if not hook:
            self._launch(entry, call, 0, slot, capturing, "low_latency_combine")
            return combined, _nothing
        send_stream = self._launch(entry, call, 1, slot, capturing, "low_latency_combine")
        return combined, lambda: self._launch(entry, call, 2, slot, _capturing(), "low_latency_combine", send_stream)

    def _launch(self, entry: Callable[..., int], call: ctypes.Structure, phase: int, slot: int, capturing: bool,
                op: str, send_stream: int | None = None) -> int:
        """Launch a call's send (phase 1, with a hook), its receive (phase 2: the hook's work) or both
        (phase 0) on the current stream, and return the stream. ``call`` is the call's own record: a
        copy of the slot's, filled once by the call and never shared, since the hook runs later, maybe
        after other calls filled theirs; it holds the tensors its addresses point at (``held``), so
        the hook keeps them alive until it launches. The library copies it into the kernels'
        arguments (a captured graph keeps its own copy) and records, after the kernels, the slot's
        send event (phase 1: a receive on another stream waits on it) or its receive event (the
        slot's next call waits on it before it reads the error record; none inside a capture)."""
        stream = raw_stream(self.device)
        if phase == 1:
            check(entry(call, 1, stream, self._sent_events[slot]), op)
            return stream
        if phase == 2 and stream != send_stream:
            check(self.lib.epcomm_ll_stream_wait_event(stream, self._sent_events[slot]), op)
            # The outputs were allocated on the send stream and are written on this one: the
            # allocator must not reuse them before this stream is done with them.
            receiving = torch.cuda.current_stream(self.device)
            for t in call.written:
                t.record_stream(receiving)
        check(entry(call, phase, stream, None if capturing else self._received_events[slot]), op)
        self._received[slot] = not capturing  # a captured receive: its replays are checked by the next eager call
        self._captured |= capturing
        return stream


class _DispatchShape:
    """What every dispatch of one shape (hidden, K, E, N, format) shares, worked out once: the output
    tensors' shapes, the byte layout of the call's small tensors in one int64 allocation ([E_local,
    R] layout_range, [E_local, N*R] src_info, [E_local] recv_count, the FP8 scales, then per
    (token, slot) the topk_idx copy (int64) and the slot map (int32); each part 16-byte aligned),
    and per slot a call record with every field but the call's own (its tensors, its token count)
    filled. The handle keeps the allocation until it is dropped, the scales' bytes with it
    (E_local * N*R * H/128 * 4: 8.3 MB at EP8, N 128, 288 experts): one allocation instead of two
    is host time saved at every call."""

    def __init__(self, backend: CudaLowLatency, hidden: int, num_topk: int, num_experts: int, num_max_tokens: int,
                 use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> None:
        num_ranks = backend.num_ranks
        self.e_local = e_local = num_experts // num_ranks
        rows = num_max_tokens * num_ranks
        data_bytes, cols, _ = message_bytes(hidden, use_fp8, use_ue8m0)
        msg, align = message_layout(num_max_tokens, hidden, backend.num_ranks, num_experts, use_fp8, use_ue8m0)
        self.data_shape = (e_local, rows, hidden)
        self.data_dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
        # FP8 scales, laid out as the reference backend lays them out (used with FP8 only; their
        # region below has cols = 0 words a row without FP8).
        self.scales_shape, self.scales_strides, _ = low_latency_scales_layout(e_local, rows, hidden, use_ue8m0)
        self.layout_range_shape, self.layout_range_strides = (e_local, num_ranks), (num_ranks, 1)
        self.src_info_shape, self.src_info_strides = (e_local, rows), (rows, 1)
        # Byte offsets in the small allocation (layout_range first, at 0), each part 16-byte aligned.
        src_info_offset = round_up(8 * e_local * num_ranks, 16)
        recv_count_offset = src_info_offset + round_up(4 * e_local * rows, 16)
        scales_offset = recv_count_offset + round_up(4 * e_local, 16)
        self.pairs_at = scales_offset + round_up(4 * e_local * rows * cols, 16)
        # the same, in 4-byte elements (as_strided offsets of the int32 and fp32 views)
        self.src_info_at, self.recv_count_at = src_info_offset // 4, recv_count_offset // 4
        self.scales_at = scales_offset // 4
        # By arrival where the format has poison and every peer is mapped (IPC); the kernel decides
        # the rest per call (dispatch_mode).
        amsg = arrival_message_bytes(hidden, num_topk, use_fp8, use_ue8m0) if num_max_tokens < 1 << 16 else 0
        arrival_key = area_tag(hidden, num_experts, num_max_tokens) << 32 | amsg if amsg else 0
        self.arrival = bool(amsg) and backend.transport == "ipc" and backend.arrival
        self.records = []
        for record in backend._dispatch_calls:
            call = backend.record_types.LLDispatchCall.from_buffer_copy(record)
            call.hidden, call.num_topk, call.num_experts = hidden, num_topk, num_experts
            call.num_max_tokens = num_max_tokens
            call.shape_tag = shape_digest(1, hidden, num_experts, num_max_tokens, int(use_fp8), int(use_ue8m0),
                                          bits=8)  # the signals carry 8 bits
            call.use_fp8, call.round_scale, call.use_ue8m0 = use_fp8, round_scale, use_ue8m0
            call.data_bytes, call.msg_bytes, call.num_scale_cols = data_bytes, msg, cols
            call.message_align = align
            call.arrival_msg_bytes, call.arrival_key = amsg, arrival_key
            if use_fp8:
                call.scale_stride_e, call.scale_stride_row, call.scale_stride_col = self.scales_strides
            self.records.append(call)

    def pairs_layout(self, pairs: int) -> tuple[int, int, int]:
        """For a call of ``pairs`` (token, slot) pairs: the byte offsets in the small allocation of
        the topk_idx copy and of the slot map, and the allocation's int64 words."""
        slot_map_at = self.pairs_at + round_up(8 * pairs, 16)
        return self.pairs_at, slot_map_at, (slot_map_at + round_up(4 * pairs, 16)) // 8


class _CombineShape:
    """What every combine of one shape (hidden, E, N, K, with a hook or not, with overlap or not) shares:
    whether it goes by partial sums (never with overlap: its rows go unit by unit as the GEMM computes
    them), and per slot a call record with every field but the call's own tensors filled."""

    def __init__(self, backend: CudaLowLatency, hidden: int, num_experts: int, num_max_tokens: int, num_topk: int,
                 hook: bool, overlap: bool) -> None:
        # Tagged with K, which sizes its records.
        self.partials = partials = not overlap and backend.combine_by_partials(num_experts, hidden, num_max_tokens,
                                                                               num_topk, hook)
        self.records = []
        for record in backend._combine_calls:
            call = backend.record_types.LLCombineCall.from_buffer_copy(record)
            call.hidden, call.num_topk, call.num_experts = hidden, num_topk, num_experts
            call.num_max_tokens = num_max_tokens
            call.shape_tag = shape_digest(2, hidden, num_experts, num_max_tokens, int(partials),
                                          num_topk if partials else 0, bits=8)
            call.partials, call.request_bytes = int(partials), request_bytes(num_topk)
            call.area_tag = area_tag(hidden, num_experts, num_max_tokens)
            self.records.append(call)


def _capturing() -> bool:
    return torch._C._cuda_isCurrentStreamCapturing()


def _nothing() -> None:
    pass
