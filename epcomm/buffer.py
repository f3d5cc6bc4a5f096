"""``Buffer``: the public API (DeepEP V1's ``deep_ep.Buffer``), shared by every backend.

This layer checks every argument and handles streams and events; the backend moves the data.
A refused argument is announced to the peers before raising, so every rank raises instead of
waiting for a call that never comes.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import socket
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import _env
from ._checks import check_int, check_tensor, check_topk_idx, same_device, split_x, topk_idx_t
from .backends.cuda.availability import LOW_LATENCY, NORMAL, gpu_id, mode_blockers, modes_used, stable_id
from .backends.cuda.capi import current_stream
from .backends.reference import ReferenceBackend
from .backends.reference import allgather as ref_allgather
from .backends.reference import hierarchical as ref_hierarchical
from .backends.reference import low_latency as ref_ll
from .backends.reference import normal as ref_normal
from .backends.reference.backend import Op
from .config import Config, default_combine_config, default_dispatch_config, low_latency_size_hint
from .event import EventOverlap
from .handle import DispatchHandle, LowLatencyHandle
from .utils.launch import group_device

_log = logging.getLogger("epcomm")
_buffer_counters: dict[tuple[int, ...], itertools.count] = {}
_MODES = (NORMAL, LOW_LATENCY)
_KERNEL_BUILD_S = 900.0  # how long the backend vote waits for a rank that builds the kernels
# What every rank of a Buffer must choose alike (exchanged when it is built).
_SHARED_CHOICES = ("backend", "device", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "strategy")
# Sequence numbers the construction's exchanges announce in the store (calls count from 1): a peer
# that has not reached an exchange is named by its timeout.
_SEQ_AGREEMENT, _SEQ_VOTE = -2, -1
_BACKENDS = ("auto", "cuda", "reference")
_STRATEGIES = ("alltoall", "allgather", "hierarchical")  # [ext] normal-mode algorithm of the reference backend
# Errors of argument checking: the refusing rank tells its peers before raising.
_REFUSALS = (ValueError, TypeError, RuntimeError, NotImplementedError)


def _next_uid(group: dist.ProcessGroup) -> str:
    """A Buffer's name in the group's store (its exchanges' keys), equal on every rank of its group: the
    group's ranks and how many Buffers this process built on them before. One count per process would
    differ between ranks that also build Buffers on other groups, and would give two groups' Buffers
    the same keys in the shared store."""
    ranks = _group_ranks(group)
    counter = _buffer_counters.setdefault(ranks, itertools.count())
    return f"{zlib.crc32(repr(ranks).encode()):08x}-{next(counter)}"


def _group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _buffer_device(group: dist.ProcessGroup, device: torch.device | str | None) -> torch.device:
    """The device of a Buffer's tensors: ``device`` if given (a bare 'cuda' is the current GPU), else
    group_device's rule."""
    if device is None:
        return group_device(group)
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be the CPU or a CUDA device, got {device}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device}: CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"device={device}: this process sees {torch.cuda.device_count()} GPU(s)")
    elif str(dist.get_backend(group)) == "nccl":
        raise ValueError("device=cpu: the group's backend (nccl) holds CUDA tensors only")
    return device


class Buffer:
    """Communication buffer for MoE dispatch and combine over a ``torch.distributed`` group.

    ``num_nvl_bytes`` / ``num_rdma_bytes`` are the bytes reserved for normal mode (see
    ``Config.get_nvl_buffer_size_hint``) and low-latency mode (``get_low_latency_rdma_size_hint``).
    Every method is collective over ``group``: all ranks call it, in the same order.
    """

    num_sms: int = 20

    def __init__(self, group: dist.ProcessGroup | None = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Any = None, *, backend: str | None = None, strategy: str = "alltoall",
                 device: torch.device | str | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("epcomm.Buffer needs torch.distributed initialized (dist.init_process_group)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        error: Exception | None = None
        gpu = 0
        try:
            self.device = _buffer_device(self.group, device)
            gpu = gpu_id(self.device)
        except Exception as e:  # refused below, with the peers told; the exchange needs a device the group holds
            error = e if isinstance(e, _REFUSALS) else ValueError(f"device {device!r}: {e}")
            self.device = group_device(self.group, honour_env=False)
        self.uid = _next_uid(self.group)
        self._group_ranks = _group_ranks(self.group)
        self._backend = ReferenceBackend(self.group, self.device, self.uid, _env.timeout_s())
        backend = backend if backend is not None else _env.env_str("EPCOMM_BACKEND")
        ll_nvshmem = False
        try:
            if error is not None:
                raise error
            self.num_nvl_bytes = check_int("num_nvl_bytes", num_nvl_bytes, minimum=0)
            self.num_rdma_bytes = check_int("num_rdma_bytes", num_rdma_bytes, minimum=0)
            self.num_qps_per_rank = check_int("num_qps_per_rank", num_qps_per_rank, minimum=1)
            if backend not in _BACKENDS:
                raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
            if backend == "cuda" and self.device.type != "cuda":
                raise ValueError("backend='cuda' needs the Buffer on a GPU: a process group that holds CUDA "
                                 "tensors (NCCL or gloo) on a machine with CUDA, or device='cuda' / "
                                 f"EPCOMM_DEVICE=cuda (group backend {dist.get_backend(self.group)}, device "
                                 f"{self.device})")
            if strategy not in _STRATEGIES:
                raise ValueError(f"strategy must be one of {_STRATEGIES}, got {strategy!r}")
            if strategy == "allgather" and backend == "cuda":
                raise ValueError(f"strategy={strategy!r} is implemented by the reference backend only; use "
                                 "backend='reference'")
            if strategy == "hierarchical" and backend == "cuda" and low_latency_mode:
                raise ValueError("strategy='hierarchical' on the CUDA backend is a normal-mode Buffer: its NVSHMEM "
                                 "buffer is num_rdma_bytes, which low_latency_mode=True also claims; use two Buffers")
            if strategy == "hierarchical" and backend == "cuda" and num_nvl_bytes and not num_rdma_bytes:
                raise ValueError("strategy='hierarchical' on the CUDA backend needs num_rdma_bytes for the "
                                 "inter-domain (NVSHMEM) buffer: see epcomm.backends.cuda.hierarchical."
                                 "rdma_bytes_needed")
            ranks_per_domain_env = self._ranks_per_domain_from_env()
            if backend != "reference" and low_latency_mode:  # the environment's low-latency transport
                ll_nvshmem = _env.ll_transport() == "nvshmem" or bool(_env.ll_remote_ranks(self.group_size))
        except _REFUSALS as e:
            error = e
        # Every rank learns whether a peer refused its arguments, each rank's host and GPU, and that all
        # asked for the same Buffer, within the timeout.
        shared_choices = [] if error else [
            _BACKENDS.index(backend), int(self.device.type == "cuda"), self.num_nvl_bytes, self.num_rdma_bytes,
            int(bool(low_latency_mode)), _STRATEGIES.index(strategy)]
        self.ranks_per_domain, hosts, gpus = self._agree_on_construction(
            error, ranks_per_domain_env if error is None else 0, gpu, shared_choices, _collected_on(self._group_ranks))
        self._backend.ranks_per_domain = self.ranks_per_domain
        self.low_latency_mode = bool(low_latency_mode)
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl = allow_mnnvl
        self.use_fabric = use_fabric
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.comm = comm
        self.strategy = strategy
        self._normal = {"allgather": ref_allgather, "hierarchical": ref_hierarchical}.get(strategy, ref_normal)
        # [ext] The backend of each mode: 'auto' runs a mode on the kernels where every rank can.
        on_kernels = self._choose_backends(backend, hosts, gpus, ll_nvshmem)
        self.backends = {mode: "cuda" if on_kernels[mode] else "reference" for mode in _MODES}
        self.backend_name = "cuda" if "cuda" in self.backends.values() else "reference"
        self._cuda = self._cuda_ll = None
        if on_kernels[NORMAL]:
            if strategy == "hierarchical":
                from .backends.cuda.hierarchical import CudaHierarchical

                self._cuda = CudaHierarchical(self.group, self.device, self.num_nvl_bytes, self.num_rdma_bytes,
                                              self.ranks_per_domain, _env.timeout_s())
            else:
                from .backends.cuda.intranode import CudaIntranode

                self._cuda = CudaIntranode(self.group, self.device, self.num_nvl_bytes, _env.timeout_s())
        if on_kernels[LOW_LATENCY]:
            from .backends.cuda.low_latency import CudaLowLatency

            self._cuda_ll = CudaLowLatency(self.group, self.device, self.num_rdma_bytes, _env.timeout_s())
        self._comm_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self._comm_stream is not None:  # _run's events: the compute stream's work, then the call's
            self._compute_ready, self._comm_done = torch.cuda.Event(), torch.cuda.Event()
        self._local_nvl: torch.Tensor | None = None
        self._local_rdma: torch.Tensor | None = None
        self._destroyed = False
        self._nvl_bytes_ok: set[tuple[int, Config]] = set()  # (hidden, config) pairs that fit (checked once)
        # Low-latency double buffering: each call takes the next of two slots.
        self._ll_counter = 0
        self._ll_cleanings = 0
        # The end of the last eager low-latency call run on the communication stream (async_finish):
        # the next call on the caller's stream waits for it (_run_low_latency).
        self._ll_async_done: torch.cuda.Event | None = None
        self._ll_pending: dict[int, str] = {}
        self._ll_needs_clean = False
        # Argument shapes a low-latency call of this Buffer passed the checks with (_ll_checked_now).
        self._ll_checked: set[tuple] = set()
        self._mask = torch.zeros(self.group_size, dtype=torch.int32, device=self.device)

    # ------------------------------------------------------------------ static API
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        check_int("new_num_sms", new_num_sms, minimum=2)
        if new_num_sms % 2:
            raise ValueError(f"new_num_sms must be even (two SMs per channel), got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return default_dispatch_config(check_int("num_ranks", num_ranks, minimum=1), Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return default_combine_config(check_int("num_ranks", num_ranks, minimum=1), Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        return low_latency_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether the SM90 kernels can run here: a Hopper GPU is visible and nvcc is there to build them on
        first use (they are compiled on first use, not at install)."""
        if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
            return False
        from .backends.cuda.build import find_nvcc

        try:
            find_nvcc()
        except RuntimeError:
            return False
        return True

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream, to pass as ``previous_event``."""
        if not torch.cuda.is_available():
            return EventOverlap(None)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return EventOverlap(event)

    # ------------------------------------------------------------------ buffers
    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | tuple[int, ...] | None = None,
                                offset: int = 0, use_rdma_buffer: bool = False) -> torch.Tensor:
        """A tensor of the buffer's byte size as ``dtype`` (optionally reshaped to ``size``), for scratch
        use: a zeroed allocation of this Buffer's own (made at the first call, kept until destroy), not
        the memory the kernels communicate through, whose flags and counters a caller's writes would
        corrupt. Zeroing it therefore resets nothing (clean_low_latency_buffer does)."""
        self._check_alive()
        total = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        check_int("offset", offset, minimum=0, maximum=total)
        attr = "_local_rdma" if use_rdma_buffer else "_local_nvl"
        if getattr(self, attr) is None:
            setattr(self, attr, torch.zeros(total, dtype=torch.uint8, device=self.device))
        raw: torch.Tensor = getattr(self, attr)
        element = torch.empty((), dtype=dtype).element_size()
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

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        return self._comm_stream

    def low_latency_transport(self) -> tuple[str, list[int]]:
        """**[ext]** How low-latency calls reach the peers: ("ipc", []) or ("nvshmem", ranks reached by
        NVSHMEM puts); ("reference", []) on the reference backend (EPCOMM_LL_TRANSPORT,
        EPCOMM_LL_REMOTE_RANKS)."""
        if self._cuda_ll is None:
            return "reference", []
        return self._cuda_ll.transport, list(getattr(self._cuda_ll.shared, "remote_ranks", []))

    def destroy(self) -> None:
        """Free the buffers; the Buffer cannot be used afterwards."""
        if self._destroyed:
            return
        if self._ll_pending:
            raise RuntimeError(f"epcomm destroy: low-latency receive(s) {sorted(self._ll_pending.values())} are "
                               "still pending; call their hook() first")
        if self._comm_stream is not None:
            self._comm_stream.synchronize()
        if self._cuda_ll is not None:
            cuda_ll, self._cuda_ll = self._cuda_ll, None
            torch.cuda.synchronize(self.device)  # this rank's kernels are done, hooks' receives included
            self._free_when_peers_done(cuda_ll, "low-latency")
        if self._cuda is not None and getattr(self._cuda, "frees_after_meeting", False):
            cuda, self._cuda = self._cuda, None  # hierarchical: NVSHMEM frees are collective, so meet first
            torch.cuda.synchronize(self.device)
            self._free_when_peers_done(cuda, "normal-mode")
            self._local_nvl = self._local_rdma = None
            self._backend.ll_combine_buffers.clear()
            self._destroyed = True  # before raising what the kernels reported: the Buffer is gone either way
            cuda.check_errors("destroy")
        if self._cuda is not None:
            cuda, self._cuda = self._cuda, None
            try:
                cuda.barrier("destroy")  # no peer may still write into a buffer being unmapped
            except RuntimeError:
                _LEAKED.append(cuda)  # a peer that did not arrive may still write into it: never free it
                raise
            cuda.close()
        self._local_nvl = self._local_rdma = None
        self._backend.ll_combine_buffers.clear()
        self._destroyed = True

    def __del__(self) -> None:
        """A Buffer whose CUDA buffers were never destroyed keeps them when it is collected, and the next
        Buffer built on its group frees them if every rank has collected it (_free_collected). DeepEP
        frees a Buffer built with explicitly_destroy=False at once (its C++ destructor meets the peers);
        epcomm does not meet here: a collection may run on any rank at any time (the garbage
        collector, another thread, inside a graph capture or another Buffer's call), where a meeting
        can stall or break the calls in flight. Megatron drops its Buffer for a larger one without
        destroy(): the old one's memory is freed by the Buffer built after that."""
        if getattr(self, "_destroyed", True) or sys.is_finalizing():
            return  # destroyed, never fully built, or the process is ending (its exit frees the memory)
        held = [b for b in (getattr(self, "_cuda", None), getattr(self, "_cuda_ll", None)) if b is not None]
        if held:
            # Peers may still map and write these buffers: not handed back to PyTorch before they agree.
            _COLLECTED.append(_Collected(self._group_ranks, self.uid, self.device, held))
            _log.warning("epcomm Buffer (rank %d) collected without destroy(): its CUDA buffers are kept until the "
                         "next Buffer() on its group, which frees them once every rank has collected it; call "
                         "destroy() on every rank to free them at once", self.rank)

    def _free_when_peers_done(self, backend: Any, what: str) -> None:
        """Free a CUDA backend's shared buffer once every rank has finished with it (each synchronized
        its device before arriving). A rank that does not arrive within the timeout may be dead, or
        alive and still writing into this buffer: then it is kept, never freed, and a warning says so."""
        missing = self._meet(f"destroy-{what}")
        if missing:
            _LEAKED.append(backend)
            warnings.warn(f"epcomm destroy: rank(s) {missing} did not reach destroy within EPCOMM_TIMEOUT_S; the "
                          f"{what} buffer ({backend.shared.num_bytes} bytes) is kept, not freed, since a peer "
                          "still running could write into it", RuntimeWarning, stacklevel=3)
            return
        backend.close()

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this epcomm Buffer was destroyed")

    def _ranks_per_domain_from_env(self) -> int:
        """EPCOMM_RANKS_PER_DOMAIN, or 0 for the default (one domain per host)."""
        raw = _env.env_str("EPCOMM_RANKS_PER_DOMAIN")
        if not raw:
            return 0
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value <= 0 or self.group_size % value:
            raise ValueError(f"EPCOMM_RANKS_PER_DOMAIN={raw} must be a positive divisor of the group size "
                             f"{self.group_size}")
        return value

    def _agree_on_construction(self, error: Exception | None, ranks_per_domain: int, gpu: int,
                               shared_choices: list[int],
                               collected: list[_Collected]) -> tuple[int, list[int], list[int]]:
        """Exchange (refused?, host, GPU, the collected Buffers of the group this rank holds, the choices
        every rank must share) with every rank; raise on all ranks if any refused or they chose
        differently (else they would run different protocols); free the collected Buffers if every rank
        holds the same ones; return ranks per domain, and each rank's host and GPU (availability.gpu_id)."""
        if collected:  # every kernel that used them has ended on this rank before it joins the exchange
            for device in {c.device for c in collected}:
                torch.cuda.synchronize(device)
        # 56 bits of a hash of the names (never 0): ranks that free must hold the very same Buffers.
        collected_key = stable_id(" ".join(sorted(c.uid for c in collected))) | 1 if collected else 0
        row = [1 if error else 0, stable_id(socket.gethostname()), gpu, collected_key,
               *(shared_choices or [0] * len(_SHARED_CHOICES))]
        mine = torch.tensor(row, dtype=torch.int64, device=self.device)
        deadline = time.monotonic() + self._backend.transport.timeout_s
        self._backend.transport.announce(_SEQ_AGREEMENT)
        rows = torch.stack(self._backend.transport.all_gather(mine, "Buffer()", _SEQ_AGREEMENT, deadline)).cpu()
        if error is not None:
            raise error
        refused = [r for r, flag in enumerate(rows[:, 0].tolist()) if flag]
        if refused:
            raise ValueError(f"epcomm Buffer(): rank(s) {refused} refused their arguments (see the error on those "
                             "ranks)")
        for i, name in enumerate(_SHARED_CHOICES):
            values = rows[:, 4 + i].tolist()
            if len(set(values)) > 1:
                shown = [_BACKENDS[v] if name == "backend" else _STRATEGIES[v] if name == "strategy" else
                         ("cuda" if v else "cpu") if name == "device" else v for v in values]
                raise ValueError(f"epcomm Buffer(): ranks chose different {name} values (every rank must build the "
                                 "same Buffer): " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown)))
        if collected_key and rows[:, 3].tolist() == [collected_key] * self.group_size:
            _free_collected(collected)  # every rank holds the same ones, and their kernels have ended everywhere
        hosts, gpus = rows[:, 1].tolist(), rows[:, 2].tolist()
        if not ranks_per_domain:
            per_host = hosts.count(hosts[self.rank])
            ranks_per_domain = per_host if self.group_size % per_host == 0 else self.group_size
        return ranks_per_domain, hosts, gpus

    def _choose_backends(self, backend: str, hosts: list[int], gpus: list[int], ll_nvshmem: bool) -> dict[str, bool]:
        """Per mode, whether it runs on the kernels. 'auto': where every rank can run it
        (availability.py), else on the reference backend, on every rank alike; 'cuda': the same check,
        and a mode some rank cannot run raises on every rank. Rank 0 logs each rank's reasons when a
        GPU Buffer keeps a mode off the kernels."""
        used = modes_used(self.num_nvl_bytes, self.num_rdma_bytes, self.low_latency_mode)
        if backend == "reference" or not used:
            return dict.fromkeys(_MODES, False)
        try:  # builds the kernel libraries on first use
            blockers = mode_blockers(self.rank, self.device, hosts, gpus, num_nvl_bytes=self.num_nvl_bytes,
                                     num_rdma_bytes=self.num_rdma_bytes, low_latency_mode=self.low_latency_mode,
                                     strategy=self.strategy, ll_nvshmem=ll_nvshmem)
        except Exception as e:  # every rank still votes: a failed check keeps the modes off the kernels
            blockers = dict.fromkeys(used, f"checking the kernels failed ({type(e).__name__}: {e})")
        transport = self._backend.transport
        any_gpu = any(gpus)
        if any_gpu:  # a peer may still be building the kernels (minutes, once per machine): wait in the store,
            # which a dead peer cannot hang and which no collective watchdog times
            build_s = max(transport.timeout_s, _KERNEL_BUILD_S)
            late = transport.meet("kernels-checked", time.monotonic() + build_s)
            if late:
                raise RuntimeError(f"epcomm Buffer(): rank(s) {late} did not finish checking (building) the CUDA "
                                   f"kernels within {build_s:g} s")
        able_per_mode = torch.tensor([mode not in blockers for mode in _MODES], dtype=torch.int64,
                                     device=self.device)
        transport.announce(_SEQ_VOTE)
        votes = torch.stack(transport.all_gather(able_per_mode, "Buffer() backend vote", _SEQ_VOTE,
                                                 time.monotonic() + transport.timeout_s)).cpu()
        on_kernels = {mode: mode in used and bool(votes[:, i].all()) for i, mode in enumerate(_MODES)}
        kept_off = [mode for mode in used if not on_kernels[mode]]
        if kept_off and any_gpu:  # every rank takes this branch alike (the votes and GPUs are shared)
            reasons: list[Any] = [None] * self.group_size
            dist.all_gather_object(reasons, {mode: blockers.get(mode) for mode in kept_off}, group=self.group)
            for mode in kept_off:
                why = "; ".join(f"rank {r}: {reason[mode]}" for r, reason in enumerate(reasons) if reason[mode])
                if backend == "cuda":
                    raise RuntimeError(f"epcomm Buffer(backend='cuda'): the CUDA kernels cannot run "
                                       f"{mode.replace('_', '-')} mode here: {why}")
                if self.rank == 0:
                    _log.warning("epcomm Buffer: %s mode runs on the reference backend, not the CUDA kernels: %s",
                                 mode.replace("_", "-"), why)
        if self.rank == 0 and any(on_kernels.values()):
            _log.info("epcomm Buffer: the CUDA kernels run %s", ", ".join(
                f"{mode.replace('_', '-')} mode" for mode in _MODES if on_kernels[mode]))
        return on_kernels

    @property
    def num_domains(self) -> int:
        return self.group_size // self.ranks_per_domain

    # ------------------------------------------------------------------ helpers
    def _refuse(self, op: Op, error: Exception) -> None:
        """Tell the peers this rank refused its arguments (so they raise too), then raise."""
        on_kernels = (self._cuda is not None and op in (Op.DISPATCH, Op.COMBINE)) or \
            (self._cuda_ll is not None and op in (Op.LL_DISPATCH, Op.LL_COMBINE))
        try:
            if not on_kernels:  # on the kernel path no handshake: the peers' bounded waits name this rank
                try:
                    self._backend.handshake(op, {}, refused=True)
                except RuntimeError:
                    pass  # a peer timeout while refusing: the argument error is still the one to report
            raise error
        finally:
            del error  # else error -> its traceback -> this frame -> error: a cycle holding the Buffer

    @staticmethod
    def _check_async_args(previous_event: object, async_finish: object, allocate_on_comm_stream: object) -> None:
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise TypeError(f"previous_event must be an EventOverlap, got {type(previous_event).__name__}")
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError("allocate_on_comm_stream=True requires previous_event and async_finish=True "
                             "(DeepEP's rule)")

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
        outputs = _tensors(result)
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

    def _capturing(self) -> bool:
        """Inside a CUDA graph capture: checks that read values on the host are skipped (they would sync)."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _check_handle(self, handle: object, kind: type) -> None:
        if not isinstance(handle, kind):
            raise TypeError(f"handle must be the {kind.__name__} returned by this Buffer, got {type(handle).__name__}")
        if handle.buffer_uid != self.uid:  # type: ignore[attr-defined]
            raise ValueError("handle was created by another Buffer; pass the handle of this Buffer's dispatch")

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: EventOverlap | None = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """Per-rank, per-domain and per-expert token counts of ``topk_idx`` (local; no communication).

        Returns ``(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [domains] int32 or None,
        num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event)``.
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
                       values=self._cuda is None and not self._capturing())
        self._check_async_args(previous_event, async_finish, allocate_on_comm_stream)

        def run():
            if self._cuda is not None:
                return self._cuda.get_dispatch_layout(topk_idx, num_experts, self.ranks_per_domain)
            return ref_normal.dispatch_layout(topk_idx, num_experts, self.group_size, self.ranks_per_domain)

        result, event = self._run(run, previous_event, async_finish, allocate_on_comm_stream, (topk_idx,))
        return (*result, event)

    def dispatch(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], handle: DispatchHandle | None = None,
                 num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None, num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token to every rank holding one of its experts.

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event)``; with ``handle=`` (cached dispatch) only ``recv_x`` and the handle are returned set.
        """
        self._check_alive()
        try:
            self._check_async_args(previous_event, async_finish, allocate_on_comm_stream)
            args = self._check_dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                        num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                        num_worst_tokens, config)
        except _REFUSALS as error:
            self._refuse(Op.DISPATCH, error)
        self._note_normal_use()
        data, scales, num_experts = args

        def run():
            if self._cuda is not None:
                return self._cuda.dispatch(data, scales, handle, num_tokens_per_rank, is_token_in_rank,
                                           num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                           num_worst_tokens, num_experts, self.uid,
                                           (config or self._default_config(True)).num_sms)
            return self._normal.dispatch(self._backend, data, scales, handle, num_tokens_per_rank, is_token_in_rank,
                                         num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                         num_worst_tokens, num_experts, self.uid)

        keep = (x, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert)
        result, event = self._run(run, previous_event, async_finish, allocate_on_comm_stream, keep)
        return (*result, event)

    def _check_dispatch(self, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                        num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config):
        data, scales = split_x("x", x)
        num_tokens, hidden = data.shape
        check_tensor("x", data, device=self.device, contiguous=True)
        if hidden * data.element_size() % 16:
            raise ValueError(f"x: hidden ({hidden}) * element size ({data.element_size()}) must be a multiple "
                             "of 16 bytes")
        if scales is not None:
            check_tensor("x[1] (scales)", scales, device=self.device)
            if scales.shape[0] != num_tokens:
                raise ValueError(f"x[1] (scales) must have {num_tokens} rows, got {scales.shape[0]}")
            # Any grouping travels (DeepEP's rule): the scales are 4-byte words copied beside their
            # token, and what they mean is the caller's. Every rank must pass the same count and dtype.
            if scales.shape[1] < 1:
                raise ValueError("x[1] (scales) must have at least one column")
            if not (scales.stride(1) == 1 or scales.stride(0) == 1):
                raise ValueError(f"x[1] (scales) must be row- or column-major, got strides {scales.stride()}")
        check_int("expert_alignment", expert_alignment, minimum=1)
        check_int("num_worst_tokens", num_worst_tokens, minimum=0)
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be an epcomm.Config, got {type(config).__name__}")
        r = self.group_size
        if handle is not None:
            self._check_handle(handle, DispatchHandle)
            for name, value in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank",
                                is_token_in_rank), ("num_tokens_per_expert", num_tokens_per_expert),
                                ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
                if value is not None:
                    raise ValueError(f"{name} must be None for a cached dispatch (handle= given)")
            if num_tokens != handle.num_tokens:
                raise ValueError(f"x has {num_tokens} tokens but the handle was made for {handle.num_tokens}")
            num_experts = 0
        else:
            for name, value in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank",
                                is_token_in_rank), ("num_tokens_per_expert", num_tokens_per_expert)):
                if value is None:
                    raise ValueError(f"{name} is required when no handle is given (from get_dispatch_layout)")
            check_tensor("num_tokens_per_rank", num_tokens_per_rank, dtype=torch.int32, shape=(r,),
                         device=self.device)
            check_tensor("is_token_in_rank", is_token_in_rank, dtype=torch.bool, shape=(num_tokens, r),
                         device=self.device)
            check_tensor("num_tokens_per_expert", num_tokens_per_expert, dtype=torch.int32, dim=1,
                         device=self.device)
            num_experts = num_tokens_per_expert.shape[0]
            if num_experts == 0 or num_experts % r:
                raise ValueError(f"num_tokens_per_expert has {num_experts} entries; expected a positive "
                                 f"multiple of the group size {r}")
            if num_tokens_per_rdma_rank is not None:
                check_tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, dtype=torch.int32,
                             shape=(self.num_domains,), device=self.device)
            # Checks of values need the data on the host; the CUDA kernels make them on the device
            # (no host sync, CUDA-graph capturable) and every rank raises the same ValueError.
            on_host = self._cuda is None
            if on_host and not torch.equal(is_token_in_rank.sum(0).to(torch.int32), num_tokens_per_rank):
                raise ValueError("num_tokens_per_rank does not match is_token_in_rank.sum(0); pass both from "
                                 "get_dispatch_layout")
            if topk_idx is not None:
                check_topk_idx("topk_idx", topk_idx, num_experts, self.device, num_tokens, values=on_host)
            if topk_weights is not None:
                if topk_idx is None:
                    raise ValueError("topk_weights given without topk_idx")
                check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=tuple(topk_idx.shape),
                             device=self.device, contiguous=True)
        self._check_nvl_bytes(hidden, config or self._default_config(True))
        return data, scales, num_experts

    def _check_nvl_bytes(self, hidden: int, config: Config) -> None:
        """num_nvl_bytes must be at least what a DeepEP caller reserves for this hidden size: the hint for
        H bytes a token (SGLang sizes an FP8 Buffer so, for its BF16 combine too). DeepEP's own rule,
        H * max(element size, 2), gives twice that. A call whose rows do not fit runs in rounds on the
        CUDA backend (same results), so the hint bounds no call's correctness, only its passes."""
        key = (hidden, config)  # Config is frozen: equal configs need equal bytes
        if key in self._nvl_bytes_ok:
            return
        need = config.get_nvl_buffer_size_hint(hidden, self.group_size)
        if self.num_nvl_bytes < need:
            raise ValueError(f"num_nvl_bytes={self.num_nvl_bytes} is too small for hidden {hidden}: reserve "
                             f"Config.get_nvl_buffer_size_hint(hidden * max(element size, 2), {self.group_size}) = "
                             f"{config.get_nvl_buffer_size_hint(hidden * 2, self.group_size)} (at least "
                             f"get_nvl_buffer_size_hint({hidden}, {self.group_size}) = {need})")
        self._nvl_bytes_ok.add(key)

    def _note_normal_use(self) -> None:
        if self.low_latency_mode:
            self._ll_needs_clean = True

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None = None,
                bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Return each token's rows to its source rank and sum them there in fp32.

        Returns ``(combined_x [T, H] bf16, combined_topk_weights [T, K] f32 or None, event)``.
        """
        self._check_alive()
        try:
            self._check_async_args(previous_event, async_finish, allocate_on_comm_stream)
            biases = self._check_combine(x, handle, topk_weights, bias, config)
        except _REFUSALS as error:
            self._refuse(Op.COMBINE, error)
        self._note_normal_use()

        def run():
            if self._cuda is not None:
                return self._cuda.combine(x, handle, topk_weights, biases,
                                          (config or self._default_config(False)).num_sms)
            return self._normal.combine(self._backend, x, handle, topk_weights, biases)

        result, event = self._run(run, previous_event, async_finish, allocate_on_comm_stream,
                                  (x, topk_weights, biases))
        return (*result, event)

    def _check_combine(self, x, handle, topk_weights, bias, config) -> tuple[torch.Tensor, ...]:
        self._check_handle(handle, DispatchHandle)
        rows = handle.num_recv_rows
        check_tensor("x", x, dtype=torch.bfloat16, dim=2, device=self.device, contiguous=True)
        if x.shape[0] != rows:
            raise ValueError(f"x must have {rows} rows (the rows dispatch returned), got {x.shape[0]}")
        if x.shape[1] * 2 % 16:
            raise ValueError(f"x: hidden ({x.shape[1]}) * 2 bytes must be a multiple of 16")
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, dtype=torch.float32, dim=2, device=self.device,
                         contiguous=True)
            if topk_weights.shape[0] != rows:
                raise ValueError(f"topk_weights must have {rows} rows, got {topk_weights.shape[0]}")
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be an epcomm.Config, got {type(config).__name__}")
        self._check_nvl_bytes(x.shape[1], config or self._default_config(False))
        biases: tuple = () if bias is None else (bias,) if isinstance(bias, torch.Tensor) else tuple(bias)
        if len(biases) > 2:
            raise ValueError(f"bias must be a tensor or a tuple of at most two, got {len(biases)}")
        for i, b in enumerate(biases):
            check_tensor(f"bias[{i}]", b, dtype=torch.bfloat16, shape=(handle.num_tokens, x.shape[1]),
                         device=self.device, contiguous=True)
        return biases

    # ------------------------------------------------------------------ low-latency mode
    def _check_ll_buffer(self, num_max_tokens: int, hidden: int, num_experts: int) -> None:
        if not self.low_latency_mode:
            raise RuntimeError("low-latency calls need Buffer(..., low_latency_mode=True)")
        need = low_latency_size_hint(num_max_tokens, hidden, self.group_size, num_experts)
        if self.num_rdma_bytes < need:
            raise ValueError(f"num_rdma_bytes={self.num_rdma_bytes} is too small: "
                             f"Buffer.get_low_latency_rdma_size_hint({num_max_tokens}, {hidden}, "
                             f"{self.group_size}, {num_experts}) = {need}")
        if self._ll_needs_clean:
            raise RuntimeError("this Buffer was used in normal mode since its last low-latency call; call "
                               "clean_low_latency_buffer(N, hidden, num_experts) first")

    def _check_ll_slot_free(self, op: str) -> None:
        slot = self._ll_counter % 2
        if slot in self._ll_pending:
            raise RuntimeError(f"epcomm {op}: low-latency slot {slot} still holds the receive of "
                               f"{self._ll_pending[slot]} whose hook() was not called; at most two "
                               "low-latency results may be pending at once")

    def _take_ll_slot(self) -> int:
        slot = self._ll_counter % 2
        self._ll_counter += 1
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

    def _masked_ranks(self) -> torch.Tensor | None:
        if not self.enable_shrink:
            return None
        masked = self._mask.cpu() != 0
        return masked if bool(masked.any()) else None

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Send each (token, expert) pair to the expert's rank, packed per expert for grouped GEMMs.

        Returns ``(recv_x, recv_count [E_local] int32, handle, event, hook)``.
        """
        self._check_alive()
        try:
            self._check_ll_slot_free("low_latency_dispatch")
            self._check_ll_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                    cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                    round_scale, use_ue8m0, async_finish, return_recv_hook)
        except _REFUSALS as error:
            self._refuse(Op.LL_DISPATCH, error)
        slot = self._take_ll_slot()

        def run_cuda():
            recv_x, recv_count, handle, finish = self._cuda_ll.dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, slot,
                self._mask if self.enable_shrink else None, self.uid, return_recv_hook)
            # Without a hook the receive is launched already (on the communication stream too, with
            # async_finish, so the event covers it); the receive kernel updates both statistics itself.
            return recv_x, recv_count, handle, finish

        if self._cuda_ll is not None and not async_finish:  # the decode path: no closures on the way
            if self._ll_async_done is not None:
                self._join_async_ll()
            recv_x, recv_count, handle, finish = run_cuda()
            hook = self._make_hook(slot, "low_latency_dispatch", finish) if return_recv_hook else None
            return recv_x, recv_count, handle, EventOverlap(None), hook

        def run():
            if self._cuda_ll is not None:
                return run_cuda()
            recv_x, recv_count, handle, finish, wait_ns = ref_ll.dispatch(
                self._backend, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
                use_ue8m0, self._masked_ranks(), self.uid, defer_receive=return_recv_hook)
            handle.backend_state["topk_idx"] = topk_idx.clone()

            def complete():
                finish()
                if cumulative_local_expert_recv_stats is not None:
                    cumulative_local_expert_recv_stats.add_(recv_count)
                if dispatch_wait_recv_cost_stats is not None:
                    dispatch_wait_recv_cost_stats.add_(wait_ns.to(dispatch_wait_recv_cost_stats.device))

            return recv_x, recv_count, handle, complete

        (recv_x, recv_count, handle, complete), event = self._run_low_latency(run, async_finish, (x, topk_idx))
        if return_recv_hook:
            return recv_x, recv_count, handle, event, self._make_hook(slot, "low_latency_dispatch", complete)
        complete()
        return recv_x, recv_count, handle, event, None

    def _ll_checked_now(self, key: tuple | None) -> None:
        """Remember the argument shapes of a low-latency call that passed the checks (None: not
        keyable): a later call with the same ones has only what can differ between calls of one
        shape checked again (an eager decode step waits on the host time of its calls). At most
        4096 shapes."""
        if key is not None:
            if len(self._ll_checked) >= 4096:
                self._ll_checked.clear()
            self._ll_checked.add(key)

    def _check_ll_dispatch(self, x, topk_idx, num_max_tokens, num_experts, recv_stats, wait_stats, use_fp8,
                           round_scale, use_ue8m0, async_finish, return_recv_hook) -> None:
        key = None
        if self._cuda_ll is not None:  # the reference backend reads topk_idx's values: no shortcut
            key = _tensor_keys(x, topk_idx, recv_stats, wait_stats)
            if type(num_max_tokens) is not int or type(num_experts) is not int:
                key = None  # 128.0 == 128 as a key, but only an int passes the checks
            if key is not None:
                key += ("dispatch", num_max_tokens, num_experts, use_fp8, round_scale, use_ue8m0, async_finish,
                        return_recv_hook)
                if (key in self._ll_checked and x.is_contiguous() and topk_idx.is_contiguous()
                        and x.data_ptr() % 16 == 0 and not self._ll_needs_clean):
                    return
        self._check_ll_dispatch_fully(x, topk_idx, num_max_tokens, num_experts, recv_stats, wait_stats, use_fp8,
                                      round_scale, use_ue8m0, async_finish, return_recv_hook)
        self._ll_checked_now(key)

    def _check_ll_dispatch_fully(self, x, topk_idx, num_max_tokens, num_experts, recv_stats, wait_stats, use_fp8,
                                 round_scale, use_ue8m0, async_finish, return_recv_hook) -> None:
        check_tensor("x", x, dtype=torch.bfloat16, dim=2, device=self.device, contiguous=True)
        num_tokens, hidden = x.shape
        check_int("num_max_dispatch_tokens_per_rank", num_max_tokens, minimum=1)
        check_int("num_experts", num_experts, minimum=1)
        if num_experts % self.group_size:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the group size "
                             f"({self.group_size})")
        if num_tokens > num_max_tokens:
            raise ValueError(f"x has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank="
                             f"{num_max_tokens}")
        # The CUDA kernels check the values themselves (reading them here would sync the host; a bad id
        # is then reported by the next call); the reference backend checks them here.
        check_topk_idx("topk_idx", topk_idx, num_experts, self.device, num_tokens,
                       values=self._cuda_ll is None and not self._capturing())
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0=True requires round_scale=True (UE8M0 holds powers of two only)")
        if use_fp8 and hidden % 128:
            raise ValueError(f"x: hidden ({hidden}) must be a multiple of 128 for FP8 (one scale per 128)")
        if use_ue8m0 and hidden % 512:
            raise ValueError(f"x: hidden ({hidden}) must be a multiple of 512 with use_ue8m0 (4 scales per int)")
        if hidden * 2 % 16:
            raise ValueError(f"x: hidden ({hidden}) * 2 bytes must be a multiple of 16")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook are mutually exclusive")
        e_local = num_experts // self.group_size
        if recv_stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", recv_stats, dtype=torch.int32, shape=(e_local,),
                         device=self.device)
        if wait_stats is not None:
            check_tensor("dispatch_wait_recv_cost_stats", wait_stats, dtype=torch.int64,
                         shape=(self.group_size,), device=self.device)
        self._check_ll_buffer(num_max_tokens, hidden, num_experts)
        if self._cuda_ll is not None:
            self._cuda_ll.check_dispatch_args(x, topk_idx, num_max_tokens, num_experts)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None):
        """Return expert outputs to their tokens and sum them weighted by ``topk_weights`` (fp32).

        Returns ``(combined_x [T, H] bf16, event, hook)``.
        """
        self._check_alive()
        try:
            self._check_ll_slot_free("low_latency_combine")
            self._check_ll_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                   return_recv_hook, out, combine_wait_recv_cost_stats)
        except _REFUSALS as error:
            self._refuse(Op.LL_COMBINE, error)
        slot = self._take_ll_slot()
        if self._cuda_ll is not None and not async_finish:  # the decode path: no closures on the way
            if self._ll_async_done is not None:
                self._join_async_ll()
            combined, finish = self._cuda_ll.combine(x, topk_idx, topk_weights, handle, out, slot,
                                                     self._mask if self.enable_shrink else None,
                                                     combine_wait_recv_cost_stats, return_recv_hook)
            hook = self._make_hook(slot, "low_latency_combine", finish) if return_recv_hook else None
            return combined, EventOverlap(None), hook

        def run():
            if self._cuda_ll is not None:  # without a hook the receive is launched already (the event covers it)
                return self._cuda_ll.combine(x, topk_idx, topk_weights, handle, out, slot,
                                             self._mask if self.enable_shrink else None,
                                             combine_wait_recv_cost_stats, return_recv_hook)
            combined, finish, wait_ns = ref_ll.combine(self._backend, x, topk_idx, topk_weights, handle, out,
                                                       defer_receive=return_recv_hook)

            def complete():
                finish()
                if combine_wait_recv_cost_stats is not None:
                    combine_wait_recv_cost_stats.add_(wait_ns.to(combine_wait_recv_cost_stats.device))

            return combined, complete

        # Kept until the event is waited on: the handle's small tensors the kernels read too.
        keep = (x, topk_idx, topk_weights, handle.backend_state.get("small"))
        (combined, complete), event = self._run_low_latency(run, async_finish, keep)
        if return_recv_hook:
            return combined, event, self._make_hook(slot, "low_latency_combine", complete)
        complete()
        return combined, event, None

    def _check_ll_combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                          return_recv_hook, out, wait_stats) -> None:
        key = None
        if self._cuda_ll is not None and not zero_copy and type(handle) is LowLatencyHandle:
            key = _tensor_keys(x, topk_idx, topk_weights, out, wait_stats)
            if key is not None:
                key += ("combine", handle.buffer_uid, handle.num_max_dispatch_tokens_per_rank, handle.hidden,
                        handle.num_experts, handle.num_tokens, handle.num_topk, use_logfmt, async_finish,
                        return_recv_hook)
                if (key in self._ll_checked and x.is_contiguous() and x.data_ptr() % 16 == 0
                        and (out is None or (out.is_contiguous() and out.data_ptr() % 16 == 0))
                        and handle.backend_state.get("received") and not self._ll_needs_clean):
                    return
        self._check_ll_combine_fully(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                     return_recv_hook, out, wait_stats)
        self._ll_checked_now(key)

    def _check_ll_combine_fully(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                return_recv_hook, out, wait_stats) -> None:
        if use_logfmt:
            raise NotImplementedError("use_logfmt=True (LogFMT-compressed combine) is not implemented; "
                                      "use the default BF16 combine")
        self._check_handle(handle, LowLatencyHandle)
        e_local = handle.num_experts // self.group_size
        rows = handle.num_max_dispatch_tokens_per_rank * self.group_size
        check_tensor("x", x, dtype=torch.bfloat16, shape=(e_local, rows, handle.hidden), device=self.device,
                     contiguous=True)
        check_tensor("topk_idx", topk_idx, dtype=topk_idx_t, shape=(handle.num_tokens, handle.num_topk),
                     device=self.device)
        if (self._cuda_ll is None and not self._capturing()
                and not torch.equal(topk_idx, handle.backend_state["topk_idx"])):  # CUDA: compared on the GPU
            raise ValueError("topk_idx differs from the one passed to the low_latency_dispatch of this handle")
        check_tensor("topk_weights", topk_weights, dtype=torch.float32,
                     shape=(handle.num_tokens, handle.num_topk), device=self.device)
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook are mutually exclusive")
        if zero_copy:
            expected = self._backend.ll_combine_buffers.get(self._ll_counter % 2)
            if expected is None or x.data_ptr() != expected.data_ptr():
                raise ValueError("zero_copy=True needs x to be get_next_low_latency_combine_buffer(handle)")
        if out is not None:
            check_tensor("out", out, dtype=torch.bfloat16, shape=(handle.num_tokens, handle.hidden),
                         device=self.device, contiguous=True)
        if wait_stats is not None:
            check_tensor("combine_wait_recv_cost_stats", wait_stats, dtype=torch.int64, shape=(self.group_size,),
                         device=self.device)
        self._check_ll_buffer(handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        if self._cuda_ll is not None:
            self._cuda_ll.check_combine_args(x, handle, out)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The [E_local, N*R, H] bf16 buffer the next low_latency_combine reads when ``zero_copy=True``."""
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
        """Reset the low-latency buffers (required after normal-mode use of a low-latency Buffer).
        Collective on the CUDA backend (every rank calls it): it also brings ranks whose low-latency
        calls diverged back in step, e.g. a masked rank that comes back (then clean the mask too)."""
        self._check_alive()
        if not self.low_latency_mode:
            raise RuntimeError("clean_low_latency_buffer needs Buffer(..., low_latency_mode=True)")
        for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                            ("hidden", hidden), ("num_experts", num_experts)):
            check_int(name, value, minimum=1)
        if self._ll_pending:
            raise RuntimeError("clean_low_latency_buffer: a low-latency receive is pending; call its hook() first")
        self._backend.ll_combine_buffers.clear()
        if self._cuda_ll is not None:  # collective: every rank's buffer is zeroed, calls restart from 1
            self._ll_cleanings += 1
            self._cuda_ll.reset(lambda step: self._meet_all(f"clean-{self._ll_cleanings}-{step}",
                                                            "clean_low_latency_buffer"))
            self._ll_counter = 0
        self._ll_needs_clean = False

    def _meet(self, tag: str) -> list[int]:
        """Every rank meets here (through the store, bounded by this Buffer's timeout: EPCOMM_TIMEOUT_S
        when it was built); returns the ranks that did not arrive. Without a store, the group's barrier
        (unbounded)."""
        transport = self._backend.transport
        missing = transport.meet(tag, time.monotonic() + transport.timeout_s)
        if missing is None:
            dist.barrier(group=self.group)
            return []
        return missing

    def _meet_all(self, tag: str, op: str) -> None:
        """``_meet``, or RuntimeError naming the ranks that did not arrive."""
        missing = self._meet(tag)
        if missing:
            raise RuntimeError(f"epcomm {op}: rank(s) {missing} did not arrive within EPCOMM_TIMEOUT_S")

    # ------------------------------------------------------------------ failed-rank masking
    def _check_shrink(self) -> None:
        if not self.enable_shrink:
            raise RuntimeError("failed-rank masking needs Buffer(..., enable_shrink=True)")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mark ``rank_to_mask`` as failed (mask=True) or alive; masked ranks are skipped."""
        self._check_shrink()
        check_int("rank_to_mask", rank_to_mask, minimum=0, maximum=self.group_size - 1)
        self._mask[rank_to_mask] = int(bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write the mask (1 = masked) into ``mask_status`` (int32 [R])."""
        self._check_shrink()
        check_tensor("mask_status", mask_status, dtype=torch.int32, shape=(self.group_size,))
        mask_status.copy_(self._mask)

    def low_latency_clean_mask_buffer(self) -> None:
        self._check_shrink()
        self._mask.zero_()


# Shared buffers that destroy could not prove unused by every peer: kept alive for the process.
_LEAKED: list[Any] = []


@dataclasses.dataclass
class _Collected:
    """The CUDA backends of a Buffer collected without destroy(), kept until every rank of its group has
    collected it too (checked when the next Buffer on the group is built)."""
    ranks: tuple[int, ...]  # its group
    uid: str
    device: torch.device
    backends: list[Any]


_COLLECTED: list[_Collected] = []


def _collected_on(ranks: tuple[int, ...]) -> list[_Collected]:
    return [c for c in list(_COLLECTED) if c.ranks == ranks]


def _free_collected(collected: list[_Collected]) -> None:
    """Free collected Buffers' CUDA backends, on every rank of their group in the same order (NVSHMEM
    frees are collective). The caller has proved that every rank holds the same ones and that their
    kernels have ended on every rank."""
    for c in sorted(collected, key=lambda c: c.uid):
        if c not in _COLLECTED:  # freed meanwhile (another thread's Buffer on the same group)
            continue
        _COLLECTED.remove(c)
        for backend in c.backends:
            try:
                backend.close()
            except Exception as error:  # kept, as a destroy that could not meet its peers keeps its buffer
                _LEAKED.append(backend)
                _log.warning("epcomm: freeing collected Buffer %s failed (%s); its buffer is kept", c.uid, error)


_DEFAULT_CONFIGS: dict[tuple, Config] = {}


def _tensor_keys(*tensors: torch.Tensor | None) -> tuple | None:
    """(shape, dtype, device) of each tensor (None stays None), or None where one is not exactly a
    torch.Tensor (a subclass may override what the checks look at)."""
    key: tuple = ()
    for t in tensors:
        if t is None:
            key += (None,)
        elif type(t) is torch.Tensor:
            key += (t.shape, t.dtype, t.device)
        else:
            return None
    return key


def _tensors(obj: Any, out: list | None = None) -> list[torch.Tensor]:
    """The tensors in a call's result: the tensors among its items, and in (data, scales) pairs. A list
    is walked only if it starts with a tensor (num_recv_tokens_per_expert_list is E_local ints). A
    list filled in place, not a generator: this runs in every call's host path."""
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, tuple) or (isinstance(obj, list) and obj and isinstance(obj[0], torch.Tensor)):
        for item in obj:
            _tensors(item, out)
    return out


__all__ = ["Buffer", "same_device"]
