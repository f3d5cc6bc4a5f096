"""The NVSHMEM transport's foundation on GPUs (skipped without them, or without NVSHMEM): unique-id
bootstrap over the torch.distributed group, the symmetric heap, and a device put with a signal
around a ring of ranks, checked word by word."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import BACKEND, fresh_cluster, nvshmem_found

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(BACKEND != "nccl", reason="NVSHMEM: run with EPCOMM_TEST_BACKEND=nccl on GPUs")]


def rank_probe_ring(num_words: int, rounds: int) -> dict:
    from epcomm.backends.cuda.nvshmem import NvshmemTeam

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    team = NvshmemTeam(dist.group.WORLD, dev)
    # No try/finally: close() is collective, and a rank that failed must not enter it alone.
    dst, src, signal = team.alloc_words(num_words), team.alloc_words(num_words), team.alloc_words(1)
    previous = (rank - 1) % num_ranks
    for r in range(1, rounds + 1):
        src.fill_((rank + 1) * 1000 + r)
        torch.cuda.synchronize(dev)
        dist.barrier()  # every rank's source is ready before any put (the kernel puts at once)
        assert team.probe_ring(dst, src, signal, r, timeout_s=10), f"rank {rank} round {r}: no signal"
        torch.cuda.synchronize(dev)
        want = torch.full_like(dst, (previous + 1) * 1000 + r)
        assert torch.equal(dst, want), f"rank {rank} round {r}: {dst[:4].tolist()} != {want[:4].tolist()}"
        dist.barrier()  # nobody overwrites a destination before its owner has read it
    p2p = [team.is_p2p(dst, peer) for peer in range(num_ranks)]
    team.close()
    return {"p2p": p2p}


@pytest.mark.skipif(not nvshmem_found(), reason="NVSHMEM not installed (pip install nvidia-nvshmem-cu13)")
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_nvshmem_put_with_signal_around_a_ring(ranks):
    # Fresh processes: NVSHMEM is initialized once per process.
    with fresh_cluster(ranks) as cluster:
        reports = cluster.run(rank_probe_ring, 1 << 12, 3, timeout_s=180)
    assert all(all(r["p2p"]) for r in reports), reports  # one host: every peer is reachable over NVLink
