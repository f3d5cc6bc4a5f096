import contextlib
import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from epcomm.utils.launch import SHARED_GPU_BACKEND, LocalCluster  # noqa: E402

# gloo (CPU processes) by default; EPCOMM_TEST_BACKEND=nccl runs the same tests on GPUs.
BACKEND = os.environ.get("EPCOMM_TEST_BACKEND", "gloo")
# With EPCOMM_TEST_SHARE_GPUS=1, a rank count above the GPU count runs anyway, the ranks sharing the
# GPUs (launch.SHARED_GPU_BACKEND): a one-GPU machine then checks the kernels' multi-rank protocol and
# results at 2, 4 and 8 ranks (not the cross-GPU memory ordering, nor any timing).
SHARE_GPUS = os.environ.get("EPCOMM_TEST_SHARE_GPUS", "0") == "1"

_clusters: dict[tuple[int, str], LocalCluster] = {}

# Ranks raise quickly in tests if a peer never arrives, instead of after 100 s. A Buffer built without
# backend= is the reference backend's, as the suite's oracle tests mean (on GPUs, 'auto' would pick the
# kernels); the kernel tests and the tests of 'auto' name their backend.
TEST_ENV = {"EPCOMM_TIMEOUT_S": os.environ.get("EPCOMM_TEST_TIMEOUT_S", "30"), "EPCOMM_BACKEND": "reference",
            "OMP_NUM_THREADS": "1",
            "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def cluster(num_ranks: int, backend: str | None = None) -> LocalCluster:
    """A shared cluster of ``num_ranks`` processes (on ``backend``, default the suite's), restarted
    after a failure."""
    backend = backend or BACKEND
    if backend == "nccl":
        backend = gpu_backend(num_ranks)
    c = _clusters.get((num_ranks, backend))
    if c is None or c.broken:
        c = LocalCluster(num_ranks, backend=backend, env=TEST_ENV)
        _clusters[(num_ranks, backend)] = c
    return c


def gpu_backend(num_ranks: int) -> str:
    """The group backend for ``num_ranks`` ranks on this machine's GPUs: NCCL with a GPU per rank, the
    shared-GPU backend when EPCOMM_TEST_SHARE_GPUS=1 and there are fewer; else the test is skipped."""
    gpus = torch.cuda.device_count()
    if num_ranks <= gpus:
        return "nccl"
    if SHARE_GPUS and gpus > 0:
        return SHARED_GPU_BACKEND
    pytest.skip(f"needs {num_ranks} GPUs, {gpus} present (EPCOMM_TEST_SHARE_GPUS=1 shares them)")


def fresh_cluster(num_ranks: int, env: dict[str, str] | None = None) -> LocalCluster:
    """A new cluster of ``num_ranks`` GPU ranks (for what a process does once: NVSHMEM's initialization),
    the caller closing it."""
    return LocalCluster(num_ranks, backend=gpu_backend(num_ranks), env={**TEST_ENV, **(env or {})})


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


def busy_side_stream(dev: torch.device, matmuls: int = 4, size: int = 8192) -> tuple[torch.cuda.Stream, list]:
    """GEMMs queued on a stream of their own (~1.5 ms each on an H100), filling the SMs while the calls
    that follow run, as overlapped expert compute does. The kernels' cooperative launches wait for SMs
    to free up and their bounded waits must not fire: same results, no timeout. Returns the stream and
    what must live until it is done (the caller synchronizes)."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    a = torch.randn((size, size), device=dev).to(torch.bfloat16)
    out = torch.empty_like(a)
    with torch.cuda.stream(side):
        for _ in range(matmuls):
            torch.mm(a, a, out=out)
    return side, [a, out]


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


class EpcommLog(logging.Handler):
    """The messages of the epcomm logger, every level, while installed (a context manager)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> "EpcommLog":
        logger = logging.getLogger("epcomm")
        self.saved_level = logger.level
        logger.setLevel(logging.DEBUG)  # setLevel, not the attribute: it clears the logger's level cache
        logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger("epcomm")
        logger.removeHandler(self)
        logger.setLevel(self.saved_level)
