import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from epcomm.utils.launch import LocalCluster  # noqa: E402

# gloo (CPU processes) by default; EPCOMM_TEST_BACKEND=nccl runs the same tests on GPUs.
BACKEND = os.environ.get("EPCOMM_TEST_BACKEND", "gloo")

_clusters: dict[tuple[int, str], LocalCluster] = {}

# Ranks raise quickly in tests if a peer never arrives, instead of after 100 s.
TEST_ENV = {"EPCOMM_TIMEOUT_S": os.environ.get("EPCOMM_TEST_TIMEOUT_S", "30"), "OMP_NUM_THREADS": "1",
            "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def cluster(num_ranks: int, backend: str | None = None) -> LocalCluster:
    """A shared cluster of ``num_ranks`` processes (on ``backend``, default the suite's), restarted
    after a failure."""
    backend = backend or BACKEND
    if backend == "nccl" and num_ranks > torch.cuda.device_count():
        pytest.skip(f"needs {num_ranks} GPUs, {torch.cuda.device_count()} present")
    c = _clusters.get((num_ranks, backend))
    if c is None or c.broken:
        c = LocalCluster(num_ranks, backend=backend, env=TEST_ENV)
        _clusters[(num_ranks, backend)] = c
    return c


@pytest.fixture(scope="session", autouse=True)
def _close_clusters():
    yield
    for c in _clusters.values():
        c.close()
