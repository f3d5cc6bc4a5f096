"""``Buffer``: the public API (DeepEP V1's ``deep_ep.Buffer``), shared by every backend.

This layer checks every argument and handles streams and events; the implementation it picked for
each mode when it was built (backends/base.py) moves the data. A refused argument is announced to
the peers before raising, so every rank raises instead of waiting for a call that never comes.

Notation of the docstrings: R ranks in the group, T tokens on this rank, H hidden size, K top-k,
E experts, E_local = E / R, N = num_max_dispatch_tokens_per_rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import lifecycle
from ._arguments import ArgumentChecks
from ._checks import check_int, check_tensor, check_topk_idx, same_device
from .backends import sm90_kernels_buildable
from .backends.base import LowLatencyOps, NormalOps, Op
from .config import Config, default_combine_config, default_dispatch_config, low_latency_size_hint
from .event import EventOverlap
from .handle import DispatchHandle, LowLatencyHandle
from .lifecycle import REFUSALS as _REFUSALS
from .utils.streams import current_stream
from .utils.tensors import result_tensors

if TYPE_CHECKING:
    from .backends.reference import ReferenceBackend


class Buffer(ArgumentChecks):
    """Communication buffer for MoE dispatch and combine over a ``torch.distributed`` group.

    Every method is collective over ``group``: all ranks call it, in the same order.

    Arguments:
        group: the ``torch.distributed`` process group (default: the world).
        num_nvl_bytes: bytes reserved for normal mode (``Config.get_nvl_buffer_size_hint``).
        num_rdma_bytes: bytes reserved for low-latency mode (``get_low_latency_rdma_size_hint``), and for
            the inter-domain buffer of ``strategy='hierarchical'`` on the CUDA backend.
        low_latency_mode: whether the low-latency calls are used.
        num_qps_per_rank: accepted for DeepEP compatibility (>= 1); no queue pairs are used.
        allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric, comm: accepted for DeepEP compatibility.
        explicitly_destroy: the caller frees the Buffer with ``destroy()``.
        enable_shrink: failed-rank masking (``low_latency_update_mask_buffer``); a normal-mode call also masks a
            peer that fails in it and completes over the live ranks (docs/ERRORS.md).
        backend: **[ext]** ``'auto'`` (default, or ``EPCOMM_BACKEND``): each mode on the CUDA kernels where every
            rank can run it, else on the reference backend; ``'cuda'``; ``'reference'``. See ``backend_reasons``.
        strategy: **[ext]** normal mode's ``'alltoall'``, ``'allgather'`` (reference only) or ``'hierarchical'``;
            None: the kernels' default, on the reference backend under 'auto' the planner's fastest, else all-to-all.
        device: **[ext]** the device of the Buffer's tensors (default: the group's, or ``EPCOMM_DEVICE``).
    """

    num_sms: int = 20

    def __init__(self, group: dist.ProcessGroup | None = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Any = None, *, backend: str | None = None, strategy: str | None = None,
                 device: torch.device | str | None = None) -> None:
        # Collective: sets group, rank, group_size, device, uid, handle_scope, the sizes and flags, ranks_per_domain,
        # strategy, backends, backend_reasons, the ops of each mode (_normal_ops, _ll_ops), or raises on every rank.
        self._normal_ops: NormalOps
        self._ll_ops: LowLatencyOps
        lifecycle.build(self, group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                        allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric, explicitly_destroy, enable_shrink,
                        comm, backend, strategy, device)
        self._comm_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self._comm_stream is not None:  # _run's events: the compute stream's work, then the call's
            self._compute_ready, self._comm_done = torch.cuda.Event(), torch.cuda.Event()
        self._local_scratch: dict[bool, torch.Tensor] = {}  # get_local_buffer_tensor's, where a mode has none
        self._destroyed = False
        self._nvl_bytes_ok: set[tuple[int, Config]] = set()  # (hidden, config) pairs that fit (checked once)
        # Low-latency double buffering: each call takes the next of two slots.
        self._ll_counter = 0
        self._ll_cleanings = 0
        # The end of the last eager async low-latency call: the next call on the caller's stream waits for it.
        self._ll_async_done: torch.cuda.Event | None = None
        self._ll_pending: dict[int, str] = {}
        # Argument shapes a low-latency call of this Buffer passed the checks with (_ll_checked_now).
        self._ll_checked: set[tuple] = set()

    # ------------------------------------------------------------------ static API
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SMs the normal-mode calls use when no ``config`` is given (default 20).

        Arguments:
            new_num_sms: an even int >= 2 (two SMs per channel).
        """
        check_int("new_num_sms", new_num_sms, minimum=2)
        if new_num_sms % 2:
            raise ValueError(f"new_num_sms must be even (two SMs per channel), got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The ``Config`` a dispatch without one uses.

        Arguments:
            num_ranks: R, the group size (>= 1).

        Returns:
            a ``Config`` with ``num_sms`` as ``set_num_sms`` set it.
        """
        return default_dispatch_config(check_int("num_ranks", num_ranks, minimum=1), Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The ``Config`` a combine without one uses (arguments and result as ``get_dispatch_config``)."""
        return default_combine_config(check_int("num_ranks", num_ranks, minimum=1), Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """The ``num_rdma_bytes`` a low-latency Buffer needs.

        Arguments:
            num_max_dispatch_tokens_per_rank: N, the most tokens a rank passes to one call.
            hidden: H.
            num_ranks: R.
            num_experts: E.

        Returns:
            the bytes of two slots (double buffering) of low-latency messages, an int.
        """
        return low_latency_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether the SM90 kernels can run here: a Hopper GPU is visible and nvcc is there to build them on
        first use (they are compiled on first use, not at install)."""
        return sm90_kernels_buildable()

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream, to pass as ``previous_event``.

        Returns:
            an ``EventOverlap`` (of no event without CUDA).
        """
        if not torch.cuda.is_available():
            return EventOverlap(None)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return EventOverlap(event)

    # ------------------------------------------------------------------ buffers
    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | tuple[int, ...] | None = None,
                                offset: int = 0, use_rdma_buffer: bool = False) -> torch.Tensor:
        """A view of this rank's communication memory, as DeepEP's: the ``num_nvl_bytes`` buffer of the
        normal-mode kernels, or with ``use_rdma_buffer`` the ``num_rdma_bytes`` one (the low-latency
        kernels', else the hierarchical kernels' inter-domain buffer). No copy: writes reach the
        kernels' flags and counters, so ``view.zero_()`` on every rank while no call is in flight resets
        the buffer (vLLM's reset; clean_low_latency_buffer is the collective way). A mode on the
        reference backend communicates through torch.distributed and keeps no such memory: its view
        is of a zeroed allocation of this Buffer's own (made at the first call), which no call reads.
        The view is valid until ``destroy()``.

        Arguments:
            dtype: the dtype of the view.
            size: the shape of the view (its bytes must fit from ``offset``), or None for a 1-D view of all.
            offset: the first byte of the view, in [0, the buffer's bytes], a multiple of dtype's size.
            use_rdma_buffer: view the ``num_rdma_bytes`` memory instead of the ``num_nvl_bytes`` one.

        Returns:
            a tensor of ``dtype`` on the Buffer's device.
        """
        self._check_alive()
        total = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        check_int("offset", offset, minimum=0, maximum=total)
        element = dtype.itemsize
        if offset % element:
            raise ValueError(f"offset ({offset}) must be a multiple of {dtype}'s size ({element} bytes)")
        raw = self._local_memory(use_rdma_buffer)
        usable = (total - offset) // element
        view = raw[offset:offset + usable * element].view(dtype)
        if size is None:
            return view
        numel = 1
        for s in size:
            numel *= s
        if numel > usable:
            raise ValueError(f"size {tuple(size)} needs {numel * element} bytes from offset {offset}, but the "
                             f"{'RDMA' if use_rdma_buffer else 'NVL'} buffer has {total} bytes")
        return view[:numel].view(size)

    def _local_memory(self, rdma: bool) -> torch.Tensor:
        """The uint8 memory get_local_buffer_tensor views (see there)."""
        for mode in (self._ll_ops, self._normal_ops) if rdma else (self._normal_ops,):
            if (memory := mode.local_memory(rdma)) is not None:
                return memory
        if rdma not in self._local_scratch:
            total = self.num_rdma_bytes if rdma else self.num_nvl_bytes
            self._local_scratch[rdma] = torch.zeros(total, dtype=torch.uint8, device=self.device)
        return self._local_scratch[rdma]

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        """The communication stream the calls with ``async_finish`` run on (None on the CPU)."""
        return self._comm_stream

    def low_latency_transport(self) -> tuple[str, list[int]]:
        """**[ext]** How low-latency calls reach the peers: ("ipc", []) or ("nvshmem", ranks reached by
        NVSHMEM puts); ("reference", []) on the reference backend (EPCOMM_LL_TRANSPORT,
        EPCOMM_LL_REMOTE_RANKS)."""
        return self._ll_ops.transport, self._ll_ops.remote_ranks()

    def destroy(self) -> None:
        """Free the buffers; the Buffer cannot be used afterwards. Collective on the CUDA backend: the
        shared memory is freed once every rank is done with it (lifecycle.destroy)."""
        lifecycle.destroy(self)

    def __del__(self) -> None:
        lifecycle.collected(self)

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this epcomm Buffer was destroyed")

    @property
    def num_domains(self) -> int:
        return self.group_size // self.ranks_per_domain

    # ------------------------------------------------------------------ test hooks
    # Documented accessors for tests and profilers (not DeepEP API): what a Buffer picked, by the
    # interface of backends/base.py. Their attributes beyond that interface are the implementation's.
    @property
    def normal_ops(self) -> NormalOps:
        """The implementation normal-mode calls run on (CudaIntranode, CudaHierarchical, ReferenceNormalOps)."""
        return self._normal_ops

    @property
    def low_latency_ops(self) -> LowLatencyOps:
        """The implementation low-latency calls run on (CudaLowLatency or ReferenceLowLatencyOps)."""
        return self._ll_ops

    @property
    def agreement(self) -> ReferenceBackend:
        """The ranks' agreement: the store transport of every exchange, the handshakes, zero-copy buffers."""
        return self._backend

    # ------------------------------------------------------------------ helpers
    def _refuse(self, op: Op, error: Exception) -> None:
        """Tell the peers this rank refused its arguments (so they raise too), then raise."""
        ops = self._normal_ops if op in (Op.DISPATCH, Op.COMBINE) else self._ll_ops
        try:
            if not ops.on_kernels and not self._capturing():  # kernels, graphs: no handshake (bounded waits)
                try:
                    self._backend.handshake(op, {}, refused=True)
                except RuntimeError:
                    pass  # a peer timeout while refusing: the argument error is still the one to report
            raise error
        finally:
            del error  # else error -> its traceback -> this frame -> error: a cycle holding the Buffer

    def _run(self, fn: Callable[[], Any], previous_event: EventOverlap | None, async_finish: bool,
             allocate_on_comm_stream: bool, keep_alive: tuple) -> tuple[Any, EventOverlap]:
        """Run ``fn`` on the communication stream with DeepEP's event semantics.

        Host time counts here: a normal dispatch launches its receive after the host has read the
        counts, so the GPU waits on the host's work around it. The events a call waits on at once
        are the Buffer's own (reused: a wait takes the event's state when it is issued), and the
        stream switch is two set_stream calls where the Buffer's device is the current one."""
        comm = self._comm_stream
        if comm is None:
            return fn(), EventOverlap(None)
        compute = current_stream(self.device)
        if previous_event is not None and previous_event.event is not None:
            comm.wait_event(previous_event.event)
        else:
            self._compute_ready.record(compute)
            comm.wait_event(self._compute_ready)
        if torch.cuda.current_device() == self.device.index:
            torch.cuda.set_stream(comm)
            try:
                result = fn()
            finally:
                torch.cuda.set_stream(compute)
        else:
            with torch.cuda.stream(comm):
                result = fn()
        event = torch.cuda.Event() if async_finish else self._comm_done
        event.record(comm)
        outputs = result_tensors(result)
        if not allocate_on_comm_stream:
            for t in outputs:
                t.record_stream(compute)
        if async_finish:
            return result, EventOverlap(event, extra_tensors=(keep_alive, tuple(outputs)))
        compute.wait_event(event)
        return result, EventOverlap(None)

    def _run_low_latency(self, fn: Callable[[], Any], async_finish: bool,
                         keep_alive: tuple) -> tuple[Any, EventOverlap]:
        """A low-latency call: on the caller's stream, unless ``async_finish`` asks for the communication
        stream and an event (the calls are latency-bound: a stream switch, events and record_stream
        per call would cost more host time than the kernels take).

        A Buffer's calls must run in order on the GPU (each call's first kernel acknowledges the
        call before it, and the call counter lives on the GPU): an async call's stream waits for
        the caller's, and the first call on the caller's stream after one waits for its event,
        whether or not the caller did (a wait on an event already waited for costs nothing on the
        GPU). Eager calls only: inside a CUDA graph capture the comm stream must be joined back
        anyway (the capture fails otherwise), and an event recorded outside a capture cannot be
        waited on inside one."""
        if async_finish:
            result, event = self._run(fn, None, True, False, keep_alive)
            self._ll_async_done = None if self._capturing() else event.event
            return result, event
        if self._ll_async_done is not None:  # (the common case pays one attribute test)
            self._join_async_ll()
        return fn(), EventOverlap(None)

    def _join_async_ll(self) -> None:
        """The caller's stream waits for the last async low-latency call (_run_low_latency)."""
        if not self._capturing():
            current_stream(self.device).wait_event(self._ll_async_done)
        self._ll_async_done = None

    def _default_config(self, dispatch: bool) -> Config:
        """The config a call without one uses (made once per SM count: calls are host-latency bound;
        never handed out, so nobody can change it)."""
        key = (dispatch, Buffer.num_sms, self.group_size)
        config = _DEFAULT_CONFIGS.get(key)
        if config is None:
            config = _DEFAULT_CONFIGS[key] = (
                self.get_dispatch_config if dispatch else self.get_combine_config)(self.group_size)
        return config

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: EventOverlap | None = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """Count the tokens ``topk_idx`` sends to each rank, domain and expert (local; no communication).

        Arguments:
            topk_idx: ``[T, K]`` ``topk_idx_t`` (int64), each token's experts; -1 entries are skipped.
            num_experts: E, a multiple of R.
            previous_event: an ``EventOverlap`` the work waits for instead of the current stream.
            async_finish: return at once; the returned event tracks completion.
            allocate_on_comm_stream: allocate the outputs on the communication stream (needs both above).

        Returns:
            num_tokens_per_rank: ``[R]`` int32, the tokens sent to each rank (a token counts once per rank).
            num_tokens_per_rdma_rank: ``[R / ranks_per_domain]`` int32 per domain, or None with one domain.
            num_tokens_per_expert: ``[E]`` int32, the tokens sent to each expert.
            is_token_in_rank: ``[T, R]`` bool, whether a token goes to a rank.
            event: an ``EventOverlap``.
        """
        self._check_alive()
        check_int("num_experts", num_experts, minimum=1)
        if num_experts % self.group_size:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the group size "
                             f"({self.group_size})")
        # Reading the values makes the host wait for the GPU's queued work (every layer of an eager
        # model), and a CUDA graph capture cannot do it: the CUDA kernels do not (their layout kernel
        # skips out-of-range ids; dispatch refuses them on the device, on every rank).
        check_topk_idx("topk_idx", topk_idx, num_experts, self.device,
                       values=not self._normal_ops.on_kernels and not self._capturing())
        self._check_async_args(previous_event, async_finish, allocate_on_comm_stream)
        result, event = self._run(
            lambda: self._normal_ops.get_dispatch_layout(topk_idx, num_experts, self.ranks_per_domain),
            previous_event, async_finish, allocate_on_comm_stream, (topk_idx,))
        return (*result, event)

    def dispatch(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], handle: DispatchHandle | None = None,
                 num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None, num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token to every rank holding one of its experts (once per rank).

        Arguments:
            x: ``[T, H]`` bf16, or an FP8 pair ``(e4m3 [T, H], scales [T, S] f32 or int32)`` whose scales may be
                column-major; H * element size a multiple of 16 bytes.
            handle: a ``DispatchHandle`` of an earlier dispatch: a cached dispatch of the same routing
                (then the layout and top-k arguments are None).
            num_tokens_per_rank: ``[R]`` int32 from ``get_dispatch_layout``.
            num_tokens_per_rdma_rank: ``[R / ranks_per_domain]`` int32 from ``get_dispatch_layout``, or None.
            is_token_in_rank: ``[T, R]`` bool from ``get_dispatch_layout``.
            num_tokens_per_expert: ``[E]`` int32 from ``get_dispatch_layout``.
            topk_idx: ``[T, K]`` int64 expert ids (-1: none), or None to send no ids.
            topk_weights: ``[T, K]`` f32 weights sent with the ids, or None.
            expert_alignment: each count of ``num_recv_tokens_per_expert_list`` rounded up to a multiple of it.
            num_worst_tokens: 0, or the fixed row count of the outputs: no host sync (CUDA-graph capturable).
            config: a ``Config`` (its ``num_sms``), or None for ``get_dispatch_config(R)``.
            previous_event, async_finish, allocate_on_comm_stream: as in ``get_dispatch_layout``.

        Returns:
            recv_x: the received rows, in the form of ``x``: ``[num_recv, H]`` (and the scales ``[num_recv, S]``),
                ordered by source rank, then source token.
            recv_topk_idx: ``[num_recv, K]`` int64 local expert ids (-1 for other ranks' experts), or None.
            recv_topk_weights: ``[num_recv, K]`` f32 (0 where the id is -1), or None.
            num_recv_tokens_per_expert_list: E_local ints (empty with ``num_worst_tokens``).
            handle: the ``DispatchHandle`` for ``combine`` and cached dispatches; indexable as DeepEP's tuple
                (``handle[0]``: the rank prefix matrix, ``[R, R]`` int32).
            event: an ``EventOverlap``.
            A cached dispatch returns ``(recv_x, None, None, None, None, event)``, as DeepEP does.
        """
        self._check_alive()
        try:
            self._check_async_args(previous_event, async_finish, allocate_on_comm_stream)
            args = self._check_dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                        num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                        num_worst_tokens, config)
        except _REFUSALS as error:
            self._refuse(Op.DISPATCH, error)
        data, scales, num_experts = args
        self._flight.note("dispatch", data.shape, data.dtype, topk_idx is not None and topk_idx.shape, handle is None)

        def run():
            return self._normal_ops.dispatch(data, scales, handle, num_tokens_per_rank, is_token_in_rank,
                                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                             num_worst_tokens, num_experts, self.uid,
                                             (config or self._default_config(True)).num_sms)

        keep = (x, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert)
        result, event = self._run(run, previous_event, async_finish, allocate_on_comm_stream, keep)
        if handle is not None:  # DeepEP hands no handle back from a cached dispatch
            return result[0], None, None, None, None, event
        new_handle = result[4]
        new_handle.rank, new_handle.num_domains, new_handle.scope = self.rank, self.num_domains, self.handle_scope
        return (*result, event)

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None = None,
                bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Return each received row to its source rank and sum a token's rows there in fp32 (rank order).

        Arguments:
            x: ``[num_recv, H]`` bf16, the rows in the order ``dispatch`` returned them.
            handle: the ``DispatchHandle`` of that dispatch.
            topk_weights: ``[num_recv, K]`` f32 summed like the rows, or None.
            bias: a bf16 ``[T, H]`` tensor or a tuple of at most two, added to the sums, or None.
            config: a ``Config`` (its ``num_sms``), or None for ``get_combine_config(R)``.
            previous_event, async_finish, allocate_on_comm_stream: as in ``get_dispatch_layout``.

        Returns:
            combined_x: ``[T, H]`` bf16, each token's sum (zeros plus bias for a token sent nowhere).
            combined_topk_weights: ``[T, K]`` f32 sums of ``topk_weights``, or None.
            event: an ``EventOverlap``.
        """
        self._check_alive()
        try:
            self._check_async_args(previous_event, async_finish, allocate_on_comm_stream)
            biases = self._check_combine(x, handle, topk_weights, bias, config)
        except _REFUSALS as error:
            self._refuse(Op.COMBINE, error)
        self._flight.note("combine", x.shape, x.dtype, handle.num_recv_tokens)
        result, event = self._run(
            lambda: self._normal_ops.combine(x, handle, topk_weights, biases,
                                             (config or self._default_config(False)).num_sms),
            previous_event, async_finish, allocate_on_comm_stream, (x, topk_weights, biases))
        return (*result, event)

    # ------------------------------------------------------------------ low-latency mode
    def _check_ll_slot_free(self, op: str) -> None:
        slot = self._ll_counter % 2
        if slot in self._ll_pending:
            raise RuntimeError(f"epcomm {op}: low-latency slot {slot} still holds the receive of "
                               f"{self._ll_pending[slot]} whose hook() was not called; at most two "
                               "low-latency results may be pending at once")

    def _take_ll_slot(self, op: str, *values: Any) -> int:
        slot, self._ll_counter = self._ll_counter % 2, self._ll_counter + 1
        self._flight.note(op, slot, *values)  # the call, for the flight recorder (values: its FIELDS)
        return slot

    def _make_hook(self, slot: int, what: str, finish: Callable[[], None]) -> Callable[[], None]:
        self._ll_pending[slot] = what
        called = False

        def hook() -> None:
            nonlocal called
            if called:
                raise RuntimeError(f"the receive hook of {what} was already called")
            called = True
            try:
                finish()
            finally:
                self._ll_pending.pop(slot, None)

        return hook

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Send each (token, expert) pair to the expert's rank, packed per expert for grouped GEMMs.

        Arguments:
            x: ``[T, H]`` bf16, T <= N; H a multiple of 128 with ``use_fp8`` (512 with ``use_ue8m0``).
            topk_idx: ``[T, K]`` int64 expert ids; -1 entries are skipped.
            num_max_dispatch_tokens_per_rank: N, the most tokens any rank passes (the same on every rank).
            num_experts: E, a multiple of R.
            cumulative_local_expert_recv_stats: ``[E_local]`` int32 incremented by the receive counts, or None.
            dispatch_wait_recv_cost_stats: ``[R]`` int64 accumulating the wait for each source (ns), or None.
            use_fp8: cast to e4m3 with one f32 scale per 128 channels; else send bf16.
            round_scale: round the scales up to powers of two.
            use_ue8m0: pack the scales as UE8M0 bytes, four per int32 (needs ``round_scale``).
            async_finish: run on the communication stream; the returned event tracks completion.
            return_recv_hook: only send; ``hook()`` receives (no SM is held in between). Not with async_finish.

        Returns:
            recv_x: ``[E_local, N * R, H]`` bf16, or with ``use_fp8`` a pair ``(e4m3 [E_local, N * R, H], scales)``:
                f32 ``[E_local, N * R, H / 128]`` (int32 ``[E_local, N * R, H / 512]`` with UE8M0), column-major
                in the last two dimensions. Expert e's first ``recv_count[e]`` rows are valid.
            recv_count: ``[E_local]`` int32, the rows each local expert received.
            handle: the ``LowLatencyHandle`` for ``low_latency_combine``.
            event: an ``EventOverlap``.
            hook: a callable that completes the receive with ``return_recv_hook``, else None.
        """
        self._check_alive()
        try:
            self._check_ll_slot_free("low_latency_dispatch")
            self._check_ll_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                    cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                    round_scale, use_ue8m0, async_finish, return_recv_hook)
        except _REFUSALS as error:
            self._refuse(Op.LL_DISPATCH, error)
        slot = self._take_ll_slot("low_latency_dispatch", x.shape, topk_idx.shape, num_max_dispatch_tokens_per_rank,
                                  num_experts, use_fp8, return_recv_hook)

        def run():
            # Without a hook the receive is launched already (on the communication stream too, with
            # async_finish, so the event covers it); finish then only updates what is left to update.
            return self._ll_ops.dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, slot,
                self._mask if self.enable_shrink else None, self.uid, return_recv_hook)

        if async_finish:
            (recv_x, recv_count, handle, finish), event = self._run_low_latency(run, True, (x, topk_idx))
        else:  # the decode path: no closures on the way
            if self._ll_async_done is not None:
                self._join_async_ll()
            (recv_x, recv_count, handle, finish), event = run(), EventOverlap(None)
        if return_recv_hook:
            return recv_x, recv_count, handle, event, self._make_hook(slot, "low_latency_dispatch", finish)
        finish()
        return recv_x, recv_count, handle, event, None

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None, combine_wait_recv_cost_stats: torch.Tensor | None = None,
                            overlap: bool = False, packed_recv_count: torch.Tensor | None = None,
                            comp_signal: torch.Tensor | None = None, block_m: int = 64, threshold: int = 0,
                            num_sms: int = 0, src_signals: torch.Tensor | None = None,
                            src_signal_expect_value: int = 0):
        """Return the expert outputs to their tokens and sum each token's, weighted, in fp32 (slot order).

        Arguments:
            x: ``[E_local, N * R, H]`` bf16 expert outputs, rows as ``low_latency_dispatch`` received them.
            topk_idx: ``[T, K]`` int64, the ids passed to that dispatch.
            topk_weights: ``[T, K]`` f32 weights of the non-negative entries.
            handle: the ``LowLatencyHandle`` of that dispatch.
            use_logfmt: LogFMT-compressed combine: not implemented (NotImplementedError).
            zero_copy: read ``get_next_low_latency_combine_buffer(handle)``, written by the caller (x: the shape).
            async_finish, return_recv_hook: as in ``low_latency_dispatch``.
            out: ``[T, H]`` bf16 to write the result into, or None to allocate it.
            combine_wait_recv_cost_stats: ``[R]`` int64 accumulating the wait for each rank (ns), or None.
            overlap: single-batch overlap (DeepEP forks'): the combine runs beside the expert GEMM writing ``x``
                and sends each block of rows once the GEMM raised its signal (docs/API.md). Off: the keywords
                below are unused, and a signal tensor is refused.
            packed_recv_count: ``[E_local]`` int32, the dispatch's ``recv_count``; needed with ``comp_signal``.
            comp_signal: int32, the word of local expert e's rows ``[b * block_m, (b + 1) * block_m)`` at
                ``e * ceil(N * R / block_m) + b``.
            block_m: the rows a ``comp_signal`` word covers (>= 1).
            threshold: the value (>= 1) a ``comp_signal`` word reaches once its rows are computed.
            num_sms: with overlap, the most blocks (SMs) the waiting send kernel takes; 0: one per unit.
            src_signals: ``[E_local]`` uint32 or int32, a word per local expert (instead of ``comp_signal``).
            src_signal_expect_value: the value (>= 1) a ``src_signals`` word reaches once its expert is computed.

        Returns:
            combined_x: ``[T, H]`` bf16, each token's weighted sum (valid after ``hook()`` with a hook).
            event: an ``EventOverlap``.
            hook: a callable that completes the receive with ``return_recv_hook``, else None.
        """
        self._check_alive()
        try:
            self._check_ll_slot_free("low_latency_combine")
            self._check_ll_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                   return_recv_hook, out, combine_wait_recv_cost_stats)
            overlapped = self._check_ll_overlap(handle, overlap, packed_recv_count, comp_signal, block_m, threshold,
                                                num_sms, src_signals, src_signal_expect_value)
        except _REFUSALS as error:
            self._refuse(Op.LL_COMBINE, error)
        x = self._backend.ll_combine_buffers[self._ll_counter % 2] if zero_copy else x  # DeepEP reads that buffer
        slot = self._take_ll_slot("low_latency_combine", x.shape, topk_idx.shape, zero_copy, return_recv_hook)

        def run():  # without a hook the receive is launched already (the event covers it)
            return self._ll_ops.combine(x, topk_idx, topk_weights, handle, out, slot,
                                        self._mask if self.enable_shrink else None, combine_wait_recv_cost_stats,
                                        return_recv_hook, overlapped)

        if async_finish:
            # Kept until the event is waited on: the handle's small tensors the kernels read too.
            keep = (x, topk_idx, topk_weights, handle.backend_state.get("small"), overlapped)
            (combined, finish), event = self._run_low_latency(run, True, keep)
        else:  # the decode path: no closures on the way
            if self._ll_async_done is not None:
                self._join_async_ll()
            (combined, finish), event = run(), EventOverlap(None)
        if return_recv_hook:
            return combined, event, self._make_hook(slot, "low_latency_combine", finish)
        finish()
        return combined, event, None

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The buffer the next ``low_latency_combine`` reads with ``zero_copy=True``.

        Arguments:
            handle: the ``LowLatencyHandle`` of the dispatch to combine.

        Returns:
            ``[E_local, N * R, H]`` bf16, for the caller to write the expert outputs into.
        """
        self._check_alive()
        self._check_handle(handle, LowLatencyHandle)
        slot = self._ll_counter % 2
        e_local = handle.num_experts // self.group_size
        shape = (e_local, handle.num_max_dispatch_tokens_per_rank * self.group_size, handle.hidden)
        buf = self._backend.ll_combine_buffers.get(slot)
        if buf is None or tuple(buf.shape) != shape:
            buf = torch.empty(shape, dtype=torch.bfloat16, device=self.device)
            self._backend.ll_combine_buffers[slot] = buf
        return buf

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Reset the low-latency buffers. Normal-mode calls never touch them (each mode has its own
        memory), so low-latency calls may follow normal ones without it, as in DeepEP inside a node.
        Collective on the CUDA backend (every rank calls it): it also brings ranks whose low-latency
        calls diverged back in step, e.g. a masked rank that comes back (then clean the mask too).

        Arguments:
            num_max_dispatch_tokens_per_rank, hidden, num_experts: N, H and E of the calls to come (each >= 1).
        """
        self._check_alive()
        if not self.low_latency_mode:
            raise RuntimeError("clean_low_latency_buffer needs Buffer(..., low_latency_mode=True)")
        for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                            ("hidden", hidden), ("num_experts", num_experts)):
            check_int(name, value, minimum=1)
        if self._ll_pending:
            raise RuntimeError("clean_low_latency_buffer: a low-latency receive is pending; call its hook() first")
        self._backend.ll_combine_buffers.clear()
        # Collective where the kernels run: every rank's buffer is zeroed, calls restart from 1.
        self._ll_cleanings += 1
        if self._ll_ops.clean(lambda step: lifecycle.meet_all(self, f"clean-{self._ll_cleanings}-{step}",
                                                              "clean_low_latency_buffer")):
            self._ll_counter = 0

    # ------------------------------------------------------------------ failed-rank masking
    def _check_shrink(self) -> None:
        if not self.enable_shrink:
            raise RuntimeError("failed-rank masking needs Buffer(..., enable_shrink=True)")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mark a rank as failed or alive; low-latency and normal-mode calls skip masked ranks.

        Arguments:
            rank_to_mask: the rank, in [0, R).
            mask: True to mask it (failed), False to unmask it.
        """
        self._check_shrink()
        check_int("rank_to_mask", rank_to_mask, minimum=0, maximum=self.group_size - 1)
        self._mask[rank_to_mask] = int(bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write the mask into ``mask_status``.

        Arguments:
            mask_status: ``[R]`` int32, set to 1 for each masked rank and 0 for the others.
        """
        self._check_shrink()
        check_tensor("mask_status", mask_status, dtype=torch.int32, shape=(self.group_size,))
        mask_status.copy_(self._mask)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (the calls wait for every rank again)."""
        self._check_shrink()
        self._mask.zero_()


_DEFAULT_CONFIGS: dict[tuple, Config] = {}


__all__ = ["Buffer", "same_device"]
