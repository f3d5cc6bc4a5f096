"""The lifecycle of a Buffer: the construction every rank agrees on, the backend vote, and the
freeing of its shared memory (destroy, or the Buffer after it was collected).

Every rank of a group builds its Buffer in the same exchange: each learns whether a peer refused
its arguments, each rank's host and GPU, and that all asked for the same Buffer (else they would
run different protocols). The kernel memory peers write into is freed only once every rank has
finished with it: destroy meets the peers (bounded by the timeout); a Buffer collected without
destroy keeps it until the next Buffer on its group proves every rank collected it too.
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
from typing import Any

import torch
import torch.distributed as dist

from . import _env, backend_choice, flight_recorder
from ._checks import check_int
from .backends import make_ops
from .backends.cuda.availability import LOW_LATENCY, NORMAL, gpu_id, mode_blockers, modes_used, stable_id
from .backends.reference import ReferenceBackend
from .backends.reference.ops import ReferenceLowLatencyOps, ReferenceNormalOps
from .utils.launch import group_device

_log = logging.getLogger("epcomm")
_buffer_counters: dict[tuple[int, ...], itertools.count] = {}
_MODES = (NORMAL, LOW_LATENCY)
_KERNEL_BUILD_S = 900.0  # how long the backend vote waits for a rank that builds the kernels
# What every rank of a Buffer must choose alike (exchanged when it is built).
_SHARED_CHOICES = ("backend", "device", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "strategy",
                   "EPCOMM_RANKS_PER_DOMAIN", "EPCOMM_LINKS")
# Sequence numbers the construction's exchanges announce in the store (calls count from 1): a peer
# that has not reached an exchange is named by its timeout.
_SEQ_AGREEMENT, _SEQ_VOTE = -2, -1
_BACKENDS = ("auto", "cuda", "reference")
_STRATEGIES = ("alltoall", "allgather", "hierarchical")  # [ext] normal-mode algorithm of the reference backend
_UNSET = len(_STRATEGIES)  # strategy=None in the exchange: the kernels' default, or the planner's on 'auto'
# Errors of argument checking: the refusing rank tells its peers before raising.
REFUSALS = (ValueError, TypeError, RuntimeError, NotImplementedError)


def next_uid(group: dist.ProcessGroup) -> str:
    """A Buffer's name in the group's store (its exchanges' keys), equal on every rank of its group: the
    group's ranks and how many Buffers this process built on them before. One count per process would
    differ between ranks that also build Buffers on other groups, and would give two groups' Buffers
    the same keys in the shared store."""
    ranks = _group_ranks(group)
    counter = _buffer_counters.setdefault(ranks, itertools.count())
    return f"{zlib.crc32(repr(ranks).encode()):08x}-{next(counter)}"


def _group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def buffer_device(group: dist.ProcessGroup, device: torch.device | str | None) -> torch.device:
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




def build(buf: Any, group: dist.ProcessGroup | None, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool,
          num_qps_per_rank: int, allow_nvlink_for_low_latency_mode: bool, allow_mnnvl: bool, use_fabric: bool,
          explicitly_destroy: bool, enable_shrink: bool, comm: Any, backend: str | None, strategy: str | None,
          device: torch.device | str | None) -> None:
    """Buffer.__init__'s collective part: check the arguments, agree with every rank (raising on all
    of them if one refused or they differ), vote on the backends and build each mode's ops."""
    if not dist.is_initialized():
        raise RuntimeError("epcomm.Buffer needs torch.distributed initialized (dist.init_process_group)")
    buf.group = group if group is not None else dist.group.WORLD
    buf.rank = dist.get_rank(buf.group)
    buf.group_size = dist.get_world_size(buf.group)
    error: Exception | None = None
    gpu = 0
    try:
        buf.device = buffer_device(buf.group, device)
        gpu = gpu_id(buf.device)
    except Exception as e:  # refused below, with the peers told; the exchange needs a device the group holds
        error = e if isinstance(e, REFUSALS) else ValueError(f"device {device!r}: {e}")
        buf.device = group_device(buf.group, honour_env=False)
    buf.uid = next_uid(buf.group)
    buf._group_ranks = _group_ranks(buf.group)
    buf._backend = ReferenceBackend(buf.group, buf.device, buf.uid, _env.timeout_s())
    backend_from_env = backend is None
    backend = backend if backend is not None else _env.env_str("EPCOMM_BACKEND")
    links = _env.env_str("EPCOMM_LINKS")  # what the planner prices (backend_choice.planned_strategy)
    ll_nvshmem = False
    try:
        if error is not None:
            raise error
        buf.num_nvl_bytes = check_int("num_nvl_bytes", num_nvl_bytes, minimum=0)
        buf.num_rdma_bytes = check_int("num_rdma_bytes", num_rdma_bytes, minimum=0)
        buf.num_qps_per_rank = check_int("num_qps_per_rank", num_qps_per_rank, minimum=1)
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if backend == "cuda" and buf.device.type != "cuda":
            raise ValueError("backend='cuda' needs the Buffer on a GPU: a process group that holds CUDA "
                             "tensors (NCCL or gloo) on a machine with CUDA, or device='cuda' / "
                             f"EPCOMM_DEVICE=cuda (group backend {dist.get_backend(buf.group)}, device "
                             f"{buf.device})")
        if strategy is not None and strategy not in _STRATEGIES:
            raise ValueError(f"strategy must be one of {_STRATEGIES} or None, got {strategy!r}")
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
        ranks_per_domain_env = _ranks_per_domain_from_env(buf)
        if backend == "auto" and strategy is None:  # the planner prices these links (an error names the choices)
            backend_choice.links_topology(links)
        if backend != "reference" and low_latency_mode:  # the environment's low-latency transport
            ll_nvshmem = _env.ll_transport() == "nvshmem" or bool(_env.ll_remote_ranks(buf.group_size))
    except REFUSALS as e:
        error = e
    # Every rank learns whether a peer refused its arguments, each rank's host and GPU, and that all
    # asked for the same Buffer, within the timeout.
    shared_choices = [] if error else [
        _BACKENDS.index(backend), int(buf.device.type == "cuda"), buf.num_nvl_bytes, buf.num_rdma_bytes,
        int(bool(low_latency_mode)), _UNSET if strategy is None else _STRATEGIES.index(strategy), ranks_per_domain_env,
        zlib.crc32(links.encode())]
    buf.ranks_per_domain, hosts, gpus = _agree_on_construction(
        buf, error, ranks_per_domain_env if error is None else 0, gpu, shared_choices, _collected_on(buf._group_ranks))
    buf._backend.ranks_per_domain = buf.ranks_per_domain
    buf.low_latency_mode = bool(low_latency_mode)
    buf.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
    buf.allow_mnnvl = allow_mnnvl
    buf.use_fabric = use_fabric
    buf.explicitly_destroy = explicitly_destroy
    buf.enable_shrink = enable_shrink
    buf._mask = torch.zeros(buf.group_size, dtype=torch.int32, device=buf.device)  # the failed-rank mask
    buf._backend.mask = buf._mask if enable_shrink else None  # normal mode masks on a failure (shrink.py)
    buf.comm = comm
    domains = backend_choice.detect_domains(hosts, buf.ranks_per_domain, bool(ranks_per_domain_env))
    # [ext] The backend of each mode: 'auto' runs a mode on the kernels where every rank can; the strategy
    # and each mode's reason follow (backend_choice.py), equal on every rank.
    buf.strategy = strategy or backend_choice.kernel_strategy(domains, buf.num_rdma_bytes, buf.low_latency_mode)
    on_kernels, buf.backend_reasons = _choose_backends(buf, backend, backend_from_env, hosts, gpus,
                                                        ll_nvshmem)
    buf.backends = {mode: "cuda" if on_kernels[mode] else "reference" for mode in _MODES}
    buf.backend_name = "cuda" if "cuda" in buf.backends.values() else "reference"
    buf.strategy, buf.backend_reasons[NORMAL] = _normal_strategy(backend, strategy, buf.strategy, on_kernels[NORMAL],
                                                                 domains, buf.backend_reasons[NORMAL], enable_shrink,
                                                                 links)
    backend_choice.log_choice(buf.rank, buf.group_size, buf.device.type, buf.backends, buf.backend_reasons)
    buf._normal_ops, buf._ll_ops = make_ops(buf.group, buf.device, buf._backend, buf.strategy, on_kernels[NORMAL],
                                            on_kernels[LOW_LATENCY], buf.num_nvl_bytes, buf.num_rdma_bytes,
                                            buf.ranks_per_domain, _env.timeout_s())
    # The normal-mode handles a later Buffer of the same group, device and kind takes (DeepEP's do).
    buf.handle_scope = ""
    if buf._normal_ops.handles_outlive_buffer:
        ranks = dist.get_process_group_ranks(buf.group)
        buf.handle_scope = f"{ranks}|{buf.device}|{buf.backends[NORMAL]}|{buf.strategy}|{buf.ranks_per_domain}"
    buf._flight = flight_recorder.attach(buf)


def _ranks_per_domain_from_env(buf: Any) -> int:
    """EPCOMM_RANKS_PER_DOMAIN, or 0 for the default (one domain per host)."""
    raw = _env.env_str("EPCOMM_RANKS_PER_DOMAIN")
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0 or buf.group_size % value:
        raise ValueError(f"EPCOMM_RANKS_PER_DOMAIN={raw} must be a positive divisor of the group size "
                         f"{buf.group_size}")
    return value


def _agree_on_construction(buf: Any, error: Exception | None, ranks_per_domain: int, gpu: int,
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
    mine = torch.tensor(row, dtype=torch.int64, device=buf.device)
    deadline = time.monotonic() + buf._backend.transport.timeout_s
    buf._backend.transport.announce(_SEQ_AGREEMENT)
    rows = torch.stack(buf._backend.transport.all_gather(mine, "Buffer()", _SEQ_AGREEMENT, deadline)).cpu()
    if error is not None:
        raise error
    refused = [r for r, flag in enumerate(rows[:, 0].tolist()) if flag]
    if refused:
        raise ValueError(f"epcomm Buffer(): rank(s) {refused} refused their arguments (see the error on those "
                         "ranks)")
    for i, name in enumerate(_SHARED_CHOICES):
        values = rows[:, 4 + i].tolist()
        if len(set(values)) > 1:
            shown = [_BACKENDS[v] if name == "backend" else (*_STRATEGIES, "unset")[v] if name == "strategy" else
                     ("cuda" if v else "cpu") if name == "device" else
                     (v or "unset") if name == "EPCOMM_RANKS_PER_DOMAIN" else
                     f"crc32 {v:08x}" if name == "EPCOMM_LINKS" else v for v in values]
            raise ValueError(f"epcomm Buffer(): ranks chose different {name} values (every rank must build the "
                             "same Buffer): " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown)))
    if collected_key and rows[:, 3].tolist() == [collected_key] * buf.group_size:
        _free_collected(collected)  # every rank holds the same ones, and their kernels have ended everywhere
    hosts, gpus = rows[:, 1].tolist(), rows[:, 2].tolist()
    return (ranks_per_domain or backend_choice.default_ranks_per_domain(hosts)), hosts, gpus


def _choose_backends(buf: Any, backend: str, from_env: bool, hosts: list[int], gpus: list[int],
                     ll_nvshmem: bool) -> tuple[dict[str, bool], dict[str, str]]:
    """Per mode, whether it runs on the kernels, and why (or why not). 'auto': where every rank can run
    it (availability.py), else on the reference backend, on every rank alike; 'cuda': the same check,
    and a mode some rank cannot run raises on every rank. Every rank learns every rank's reasons, so
    the reasons are equal on every rank too."""
    used = modes_used(buf.num_nvl_bytes, buf.num_rdma_bytes, buf.low_latency_mode)
    reasons = {mode: backend_choice.unused_reason(mode) for mode in _MODES}
    if backend == "reference":
        asked = "EPCOMM_BACKEND=reference" if from_env else "backend='reference'"
        return dict.fromkeys(_MODES, False), {mode: f"{asked} was asked for" for mode in _MODES}
    if not used:
        return dict.fromkeys(_MODES, False), reasons
    try:  # builds the kernel libraries on first use
        blockers = mode_blockers(buf.rank, buf.device, hosts, gpus, num_nvl_bytes=buf.num_nvl_bytes,
                                 num_rdma_bytes=buf.num_rdma_bytes, low_latency_mode=buf.low_latency_mode,
                                 strategy=buf.strategy, ll_nvshmem=ll_nvshmem)
    except Exception as e:  # every rank still votes: a failed check keeps the modes off the kernels
        blockers = dict.fromkeys(used, f"checking the kernels failed ({type(e).__name__}: {e})")
    transport = buf._backend.transport
    if any(gpus):  # a peer may still be building the kernels (minutes, once per machine): wait in the store,
        # which a dead peer cannot hang and which no collective watchdog times
        build_s = max(transport.timeout_s, _KERNEL_BUILD_S)
        late = transport.meet("kernels-checked", time.monotonic() + build_s)
        if late:
            raise RuntimeError(f"epcomm Buffer(): rank(s) {late} did not finish checking (building) the CUDA "
                               f"kernels within {build_s:g} s")
    able_per_mode = torch.tensor([mode not in blockers for mode in _MODES], dtype=torch.int64,
                                 device=buf.device)
    transport.announce(_SEQ_VOTE)
    votes = torch.stack(transport.all_gather(able_per_mode, "Buffer() backend vote", _SEQ_VOTE,
                                             time.monotonic() + transport.timeout_s)).cpu()
    on_kernels = {mode: mode in used and bool(votes[:, i].all()) for i, mode in enumerate(_MODES)}
    for mode in _MODES:
        if on_kernels[mode]:
            reasons[mode] = "every rank can run the CUDA kernels"
    kept_off = [mode for mode in used if not on_kernels[mode]]
    if kept_off:  # every rank takes this branch alike (the votes are shared)
        gathered: list[Any] = [None] * buf.group_size
        dist.all_gather_object(gathered, {mode: blockers.get(mode) for mode in kept_off}, group=buf.group)
        for mode in kept_off:
            reasons[mode] = backend_choice.blocked_reason([per_rank[mode] for per_rank in gathered])
            if backend == "cuda":
                raise RuntimeError(f"epcomm Buffer(backend='cuda'): {mode.replace('_', '-')} mode: "
                                   f"{reasons[mode]}")
    return on_kernels, reasons


def _normal_strategy(backend: str, asked: str | None, kernels: str, on_kernels: bool,
                     domains: backend_choice.Domains, reason: str, shrink: bool, links: str) -> tuple[str, str]:
    """Normal mode's strategy and the reason that names it: the caller's; else the kernels' default
    on the kernels; else with enable_shrink the all-to-all (the strategy that masks failed ranks on
    the reference backend); else on 'auto' the planner's fastest for the domains on ``links``
    (EPCOMM_LINKS); else the all-to-all."""
    if asked is not None:
        return asked, f"{reason}; strategy {asked}: given"
    if on_kernels:
        return kernels, f"{reason}; strategy {kernels}: the kernels' default for {domains.describe()}"
    if shrink:
        return "alltoall", f"{reason}; strategy alltoall: the one that masks failed ranks (enable_shrink)"
    if backend == "auto":
        planned, why = backend_choice.planned_strategy(domains, links)
        return planned, f"{reason}; strategy {planned}: {why}"
    return "alltoall", f"{reason}; strategy alltoall: the default (the planner chooses on backend='auto')"


def meet(buf: Any, tag: str) -> list[int]:
    """Every rank meets here (through the store, bounded by this Buffer's timeout: EPCOMM_TIMEOUT_S
    when it was built); returns the ranks that did not arrive. Without a store, the group's barrier
    (unbounded)."""
    transport = buf._backend.transport
    missing = transport.meet(tag, time.monotonic() + transport.timeout_s)
    if missing is None:
        dist.barrier(group=buf.group)
        return []
    return missing


def meet_all(buf: Any, tag: str, op: str) -> None:
    """``meet``, or RuntimeError naming the ranks that did not arrive."""
    missing = meet(buf, tag)
    if missing:
        raise RuntimeError(f"epcomm {op}: rank(s) {missing} did not arrive within EPCOMM_TIMEOUT_S")


def _let_go_normal(buf: Any) -> Any:
    """Take the normal-mode kernels from the Buffer (it holds none after this); return them."""
    ops, buf._normal_ops = buf._normal_ops, ReferenceNormalOps(buf._backend, buf.strategy)
    return ops


def _let_go_low_latency(buf: Any) -> Any:
    ops, buf._ll_ops = buf._ll_ops, ReferenceLowLatencyOps(buf._backend)
    return ops


def destroy(buf: Any) -> None:
    """Buffer.destroy: free the kernels' shared memory once no peer can write into it any more."""
    if buf._destroyed:
        return
    if buf._ll_pending:
        raise RuntimeError(f"epcomm destroy: low-latency receive(s) {sorted(buf._ll_pending.values())} are "
                           "still pending; call their hook() first")
    if buf._comm_stream is not None:
        buf._comm_stream.synchronize()
    if buf._ll_ops.on_kernels:
        ll_ops = _let_go_low_latency(buf)
        torch.cuda.synchronize(buf.device)  # this rank's kernels are done, hooks' receives included
        _free_when_peers_done(buf, ll_ops, "low-latency")
    if buf._normal_ops.on_kernels and buf._normal_ops.frees_after_meeting:
        ops = _let_go_normal(buf)  # hierarchical: NVSHMEM frees are collective, so meet first
        torch.cuda.synchronize(buf.device)
        _free_when_peers_done(buf, ops, "normal-mode")
        buf._local_scratch.clear()
        buf._backend.ll_combine_buffers.clear()
        buf._backend.drop_scratch()
        buf._destroyed = True  # before raising what the kernels reported: the Buffer is gone either way
        ops.check_errors("destroy")
    if buf._normal_ops.on_kernels:
        ops = _let_go_normal(buf)
        try:
            ops.barrier("destroy")  # no peer may still write into a buffer being unmapped
        except RuntimeError:
            _LEAKED.append(ops)  # a peer that did not arrive may still write into it: never free it
            raise
        ops.close()
    buf._local_scratch.clear()
    buf._backend.ll_combine_buffers.clear()
    buf._backend.drop_scratch()
    buf._destroyed = True


def drop_normal_kernels(buf: Any) -> None:
    """Test hook: unmap the normal-mode kernels' buffer at once, without meeting the peers (a test
    whose ranks' call counters disagree on purpose; a user destroys the Buffer and the group)."""
    _let_go_normal(buf).close()


def collected(buf: Any) -> None:
    """Buffer.__del__: a Buffer whose CUDA buffers were never destroyed keeps them when it is collected,
    and the next Buffer built on its group frees them if every rank has collected it (_free_collected).
    DeepEP frees a Buffer built with explicitly_destroy=False at once (its C++ destructor meets the
    peers); epcomm does not meet here: a collection may run on any rank at any time (the garbage
    collector, another thread, inside a graph capture or another Buffer's call), where a meeting
    can stall or break the calls in flight. Megatron drops its Buffer for a larger one without
    destroy(): the old one's memory is freed by the Buffer built after that."""
    if getattr(buf, "_destroyed", True) or sys.is_finalizing():
        return  # destroyed, never fully built, or the process is ending (its exit frees the memory)
    held = [ops for ops in (buf._normal_ops, buf._ll_ops) if ops.on_kernels]
    if held:
        # Peers may still map and write these buffers: not handed back to PyTorch before they agree.
        _COLLECTED.append(_Collected(buf._group_ranks, buf.uid, buf.device, held))
        _log.warning("epcomm Buffer (rank %d) collected without destroy(): its CUDA buffers are kept until the "
                     "next Buffer() on its group, which frees them once every rank has collected it; call "
                     "destroy() on every rank to free them at once", buf.rank)


def _free_when_peers_done(buf: Any, backend: Any, what: str) -> None:
    """Free a CUDA backend's shared buffer once every rank has finished with it (each synchronized
    its device before arriving). A rank that does not arrive within the timeout may be dead, or
    alive and still writing into this buffer: then it is kept, never freed, and a warning says so."""
    missing = meet(buf, f"destroy-{what}")
    if missing:
        _LEAKED.append(backend)
        warnings.warn(f"epcomm destroy: rank(s) {missing} did not reach destroy within EPCOMM_TIMEOUT_S; the "
                      f"{what} buffer ({backend.shared.num_bytes} bytes) is kept, not freed, since a peer "
                      "still running could write into it", RuntimeWarning, stacklevel=4)
        return
    backend.close()


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



def collected_uids() -> list[str]:
    """Test hook: the uids of the Buffers collected without destroy() whose CUDA memory is still kept."""
    return [c.uid for c in _COLLECTED]
