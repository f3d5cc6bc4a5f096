"""Backends implementing the Buffer API: ``reference`` (portable torch.distributed) and ``cuda`` (kernels).

``make_ops`` is the one place that picks an implementation per mode; Buffer reaches every backend
through the interface of ``base.py`` only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import LowLatencyOps, NormalOps
from .reference.backend import ReferenceBackend
from .reference.ops import ReferenceLowLatencyOps, ReferenceNormalOps


def make_ops(group: dist.ProcessGroup, device: torch.device, reference: ReferenceBackend, strategy: str,
             normal_on_kernels: bool, low_latency_on_kernels: bool, num_nvl_bytes: int, num_rdma_bytes: int,
             ranks_per_domain: int, timeout_s: float) -> tuple[NormalOps, LowLatencyOps]:
    """The implementation of each mode: the CUDA kernels where the ranks voted for them (and built
    here, collectively), else the reference backend on ``reference``, the Buffer's agreement state."""
    normal: NormalOps = ReferenceNormalOps(reference, strategy)
    if normal_on_kernels:
        if strategy == "hierarchical":
            from .cuda.hierarchical import CudaHierarchical

            normal = CudaHierarchical(group, device, num_nvl_bytes, num_rdma_bytes, ranks_per_domain, timeout_s)
        else:
            from .cuda.intranode import CudaIntranode

            normal = CudaIntranode(group, device, num_nvl_bytes, timeout_s)
        if reference.mask is not None:  # enable_shrink: a failed rank's calls go on without it (shrink.py)
            from .shrink import ShrinkingKernels

            normal = ShrinkingKernels(normal, ReferenceNormalOps(reference, "alltoall"))
    low_latency: LowLatencyOps = ReferenceLowLatencyOps(reference)
    if low_latency_on_kernels:
        from .cuda.low_latency import CudaLowLatency

        low_latency = CudaLowLatency(group, device, num_rdma_bytes, timeout_s)
    return normal, low_latency


def sm90_kernels_buildable() -> bool:
    """Whether a Hopper GPU is visible and nvcc is there to build the kernels on first use."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    from .cuda.build import find_nvcc

    try:
        find_nvcc()
    except RuntimeError:
        return False
    return True


__all__ = ["LowLatencyOps", "NormalOps", "make_ops", "sm90_kernels_buildable"]
