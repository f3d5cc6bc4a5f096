"""Whether the CUDA kernels can run a Buffer's modes here: what ``Buffer(backend="auto")`` decides by.

A mode (normal, low latency) runs on the kernels only if every rank can run it, so each rank checks
what it sees (``mode_blockers``) and the Buffer's ranks vote (buffer.py); a mode any rank cannot run
stays on the reference backend on every rank, and the reasons are logged. What a rank checks:
  - its tensors are on a GPU of compute capability 9.0 (the kernels are built for sm_90: H100, H200);
  - the kernel library builds (nvcc, on first use) and loads; NVSHMEM's too where the mode needs it
    (peers on other hosts, the hierarchical strategy);
  - the group fits the kernels (at most 8 ranks inside a node, one host for CUDA IPC);
  - every peer on its host whose GPU this process can see is reachable by peer access (CUDA IPC maps
    the peers' buffers). Peers whose GPU is not visible here (CUDA_VISIBLE_DEVICES set per process)
    cannot be checked and are taken as reachable, as on the NVSwitch machines the kernels target.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

MAX_RANKS = 8  # the intranode and low-latency kernels (kMaxRanks in include/epcomm/common/ptx.cuh)
NORMAL, LOW_LATENCY = "normal", "low_latency"


def stable_id(name: str) -> int:
    """A number for ``name`` equal in every process (Python's hash() is salted per process), small
    enough for an int64 tensor: how ranks exchange host names and GPU UUIDs."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "little")


def gpu_id(device: torch.device) -> int:
    """A number naming the GPU itself (from its UUID), equal across processes whatever the device
    index each sees it under; 0 for the CPU."""
    if device.type != "cuda":
        return 0
    return stable_id(str(torch.cuda.get_device_properties(device).uuid))


def _gpu_blocker(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "the Buffer's tensors are on the CPU"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"the kernels are built for compute capability 9.0 (H100/H200); this GPU is {capability}"
    return None


def _library_blocker(nvshmem: bool) -> str | None:
    from .build import load_library, load_nvshmem_library

    try:
        load_library()
        if nvshmem:
            load_nvshmem_library()
    except Exception as error:  # no nvcc, a failed build, a library that does not load: the reference runs
        return f"the {'NVSHMEM ' if nvshmem else ''}kernel library is not available ({error})"
    return None


def _unreachable_peers(rank: int, device: torch.device, hosts: list[int], gpus: list[int]) -> list[int]:
    """Ranks on this host whose GPU this process sees and cannot reach by peer access."""
    visible = {gpu_id(torch.device("cuda", i)): i for i in range(torch.cuda.device_count())}
    unreachable = []
    for peer, (host, gpu) in enumerate(zip(hosts, gpus)):
        if peer == rank or host != hosts[rank] or gpu == gpus[rank]:  # a GPU shared with a peer maps itself
            continue
        index = visible.get(gpu)
        if index is not None and not torch.cuda.can_device_access_peer(device, index):
            unreachable.append(peer)
    return unreachable


def modes_used(num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool) -> list[str]:
    """The modes a Buffer of these sizes can call: normal mode needs num_nvl_bytes, low latency
    low_latency_mode and num_rdma_bytes."""
    return [mode for mode, used in ((NORMAL, num_nvl_bytes > 0), (LOW_LATENCY, low_latency_mode and num_rdma_bytes > 0))
            if used]


def mode_blockers(rank: int, device: torch.device, hosts: list[int], gpus: list[int], *, num_nvl_bytes: int,
                  num_rdma_bytes: int, low_latency_mode: bool, strategy: str, ll_nvshmem: bool,
                  library_blocker: Callable[[bool], str | None] | None = None) -> dict[str, str]:
    """Per mode this Buffer uses (modes_used), why this rank cannot run it on the kernels (absent: it can).

    ``hosts`` and ``gpus`` name every rank's host and GPU (gathered by the Buffer); ``ll_nvshmem``: the
    environment sends low-latency peers of this host through NVSHMEM (EPCOMM_LL_TRANSPORT=nvshmem or
    EPCOMM_LL_REMOTE_RANKS), which then needs NVSHMEM's library on one host too. ``library_blocker(nvshmem)``
    replaces the build-and-load check (``epcomm doctor`` asks without building).
    """
    check_library = library_blocker or _library_blocker
    modes = modes_used(num_nvl_bytes, num_rdma_bytes, low_latency_mode)
    if not modes:
        return {}
    blocker = _gpu_blocker(device)
    if blocker:
        return dict.fromkeys(modes, blocker)
    num_ranks, one_host = len(hosts), len(set(hosts)) == 1
    unreachable = _unreachable_peers(rank, device, hosts, gpus)
    blockers: dict[str, str] = {}
    if NORMAL in modes:
        if strategy == "allgather":
            blockers[NORMAL] = "strategy='allgather' is implemented by the reference backend only"
        elif strategy == "hierarchical":
            if low_latency_mode:
                blockers[NORMAL] = ("strategy='hierarchical' on the kernels needs its own Buffer (low_latency_mode "
                                    "claims num_rdma_bytes too)")
            elif num_rdma_bytes <= 0:
                blockers[NORMAL] = "strategy='hierarchical' on the kernels needs num_rdma_bytes (the NVSHMEM tier)"
            else:
                blocker = check_library(nvshmem=True)
                if blocker:
                    blockers[NORMAL] = blocker
        elif num_ranks > MAX_RANKS or not one_host:
            blockers[NORMAL] = (f"the intranode kernels run up to {MAX_RANKS} ranks of one host (this group: "
                                f"{num_ranks} ranks on {len(set(hosts))} host(s)); strategy='hierarchical' with "
                                "num_rdma_bytes runs the kernels across hosts")
        elif unreachable:
            blockers[NORMAL] = f"no peer access from this GPU to the GPU(s) of rank(s) {unreachable}"
        else:
            blocker = check_library(nvshmem=False)
            if blocker:
                blockers[NORMAL] = blocker
    if LOW_LATENCY in modes:
        nvshmem = ll_nvshmem or not one_host
        if num_ranks > MAX_RANKS:
            blockers[LOW_LATENCY] = f"the low-latency kernels run up to {MAX_RANKS} ranks, this group has {num_ranks}"
        elif unreachable and not nvshmem:
            blockers[LOW_LATENCY] = f"no peer access from this GPU to the GPU(s) of rank(s) {unreachable}"
        else:
            blocker = check_library(nvshmem)
            if blocker:
                blockers[LOW_LATENCY] = blocker
    return blockers
