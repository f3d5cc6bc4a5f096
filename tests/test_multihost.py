"""Across hosts: the hierarchical strategy against the flat one with one domain per host (found by
hostname, no EPCOMM_RANKS_PER_DOMAIN), and the CUDA hierarchical kernels against the reference
backend where there are GPUs (NVSHMEM over RDMA between the hosts). Skipped unless started by
torchrun on several hosts:

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK --master-addr $HEAD \\
        -m pytest -q tests/test_multihost.py
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


def _several_hosts() -> bool:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world > int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


pytestmark = pytest.mark.skipif(not _several_hosts(), reason="run under torchrun on several hosts (see docstring)")


def test_hierarchical_equals_flat_across_hosts():
    from test_hierarchical import CASES, rank_hierarchical_vs_flat

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if gpu else "gloo")
    try:
        rank_hierarchical_vs_flat(int(os.environ["LOCAL_WORLD_SIZE"]), CASES)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_hierarchical_cuda_across_hosts():
    """The CUDA kernels (NVSHMEM between hosts over RDMA, CUDA IPC inside) against the reference
    backend's hierarchical strategy, one domain per host; and again with a CUDA graph."""
    if not torch.cuda.is_available():
        pytest.skip("the CUDA kernels need GPUs")
    from test_hierarchical_cuda import rank_cuda_vs_reference, rank_graph_replay

    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(1 << 30))
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    try:
        rank_cuda_vs_reference(int(os.environ["LOCAL_WORLD_SIZE"]), "auto")
        rank_graph_replay(int(os.environ["LOCAL_WORLD_SIZE"]), "auto")
    finally:
        dist.destroy_process_group()
