import contextlib
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


def nvshmem_found() -> bool:
    """Whether NVSHMEM (the nvidia-nvshmem-cu13 package, or NVSHMEM_HOME) is installed."""
    try:
        from epcomm.backends.cuda.build import find_nvshmem

        find_nvshmem()
        return True
    except RuntimeError:
        return False


def poison_allocator(dev: torch.device) -> None:
    """Fill (then free) a large block, so the next allocations start out as garbage, not zeros: an output
    row a kernel forgets to write cannot pass by luck."""
    junk = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    junk.fill_(0x7F)
    del junk


@contextlib.contextmanager
def env_var(name: str, value: object):
    """An environment variable set inside the block (Buffers read theirs when they are constructed)."""
    previous = os.environ.get(name)
    os.environ[name] = str(value)
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


def peer_timeout(seconds: float | str):
    """EPCOMM_TIMEOUT_S for the Buffers built inside."""
    return env_var("EPCOMM_TIMEOUT_S", seconds)


def capture_graph(step, *args):
    """Run ``step(*args)`` once on a side stream (loads the kernels, fills the caches), then capture it in a
    CUDA graph; returns (graph, the captured call's outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step(*args)
    return graph, outputs
