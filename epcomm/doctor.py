"""``epcomm doctor``: check a machine before a job starts, and say how to fix what is wrong.

Most hangs and slow runs of expert-parallel jobs come from the setup rather than the code: a GPU the
kernels are not built for, GPUs without peer access, no compiler for the first-use build, an NVSHMEM of
another major version, no RDMA NIC for a multi-node job, NVLink multicast left on, a buffer larger than
the GPU. Each check gives findings (name, status, what was found, the fix). Nothing here starts a process
group or builds the kernels (unless ``--build``), and every subprocess has a timeout, so the doctor ends
even where the driver or the compiler hangs. ``epcomm doctor --help`` lists the shape's options.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections import namedtuple
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
STATUSES = (OK, WARN, FAIL, SKIP)
# Every check, by the first part of its findings' names (a check may give several: multicast/NCCL_NVLS_ENABLE).
CHECKS = ("gpus", "backend", "peer_access", "nvlink", "nvcc", "kernel_cache", "nvshmem", "rdma", "multicast",
          "process_group", "shape", "buffers")

# The NVSHMEM the kernels are built and tested against: the cuda extra's range in pyproject.toml.
NVSHMEM_RANGE = ((3, 4, 5), (4, 0, 0))
NVSHMEM_DISTRIBUTIONS = ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12")
LL_MAX_BYTES = 32 << 30  # the low-latency kernels' per-rank buffer limit (README, Limits)
MAX_TOPK = 32  # experts per token the kernels take
SUBPROCESS_TIMEOUT_S = 30.0

# Why NVLink multicast must be off, said once for the three variables.
MULTICAST_WHY = ("a process that creates NVLink multicast objects on an NVSwitch host can take the host's GPUs out of "
                 "service for every job on it, and epcomm needs none (peer stores and NVSHMEM puts)")
# name -> (the library, the value that turns multicast off, whether the variable is a yes/no switch)
MULTICAST_VARS = {
    "NCCL_NVLS_ENABLE": ("NCCL", "0", False),
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": ("PyTorch symmetric memory", "1", True),
    "NVSHMEM_DISABLE_NVLS": ("NVSHMEM", "1", True),
}
_YES = {"1", "true", "t", "yes", "y", "on"}


@dataclass
class Finding:
    name: str
    status: str
    found: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


@dataclass
class Shape:
    """The deployment a job will run: the sizes its Buffers need and what the mode choice sees."""

    hidden: int = 7168
    tokens: int = 4096
    ll_tokens: int = 128
    topk: int = 8
    experts: int = 256
    ranks: int = 8
    nodes: int = 1

    @property
    def ranks_per_node(self) -> int:
        return max(1, self.ranks // self.nodes)


def run_command(command: list[str], timeout: float = SUBPROCESS_TIMEOUT_S) -> tuple[int | None, str]:
    """(exit status, stdout + stderr); status None when the program is absent, did not start or ran past
    ``timeout`` (the text then says which). A program past its time is killed with everything it started
    (nvcc's compilers), and one that does not die is left behind rather than waited for."""
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)
    except OSError as error:
        return None, f"{command[0]} not found" if isinstance(error, FileNotFoundError) else f"{command[0]}: {error}"
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        return None, f"{' '.join(command)} did not finish within {timeout:.0f} s"
    return process.returncode, output.strip()


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"


Gpu = namedtuple("Gpu", "index name capability total_bytes")  # capability: (major, minor)


def visible_gpus() -> list[Gpu]:
    """The GPUs this process sees (CUDA_VISIBLE_DEVICES applies); none without CUDA."""
    if not torch.cuda.is_available():
        return []
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return [Gpu(i, p.name, (p.major, p.minor), p.total_memory) for i, p in enumerate(props)]


def no_gpu_reason() -> str:
    if torch.version.cuda is None:
        return f"no CUDA GPU visible: this PyTorch ({torch.__version__}) is built without CUDA"
    return (f"no CUDA GPU visible (PyTorch {torch.__version__} for CUDA {torch.version.cuda}; "
            f"torch.cuda.is_available() is False; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")


def _kernels_wanted(gpus: list[Gpu]) -> bool:  # the kernels would run here: a missing compiler then fails
    return any(g.capability == (9, 0) for g in gpus)


def _locate(finder_name: str) -> tuple[Path | str | None, str]:
    """(build.find_nvcc() or build.find_nvshmem(), or None and the reason it gave)."""
    from .backends.cuda import build

    try:
        return getattr(build, finder_name)(), ""
    except RuntimeError as error:
        return None, str(error).removeprefix("epcomm: ")


def libraries_built() -> dict[str, bool | None]:
    """Whether each library is in the cache for these sources, this nvcc (and NVSHMEM); None where it
    cannot be built here at all."""
    from .backends.cuda.build import kernel_library_path, nvshmem_library_path

    built: dict[str, bool | None] = {"kernels": None, "nvshmem": None}
    for name, path, needs in (("kernels", kernel_library_path, ()), ("nvshmem", nvshmem_library_path, ("nvshmem",))):
        if _locate("find_nvcc")[0] is None or (needs and _locate("find_nvshmem")[0] is None):
            continue
        with contextlib.suppress(RuntimeError, OSError, subprocess.SubprocessError):  # nvcc does not run
            built[name] = path().exists()
    return built


# ------------------------------------------------------------------------------------- the checks
def check_gpus(gpus: list[Gpu], shape: Shape) -> list[Finding]:
    if not gpus:
        return [Finding("gpus", SKIP, no_gpu_reason() + "; every mode runs on the portable path",
                        "none for the portable path (gloo, CPU tensors); for the kernels, run on H100/H200 "
                        "(compute capability 9.0) with a CUDA build of PyTorch")]
    listed = "; ".join(f"cuda:{g.index} {g.name} (capability {g.capability[0]}.{g.capability[1]}, "
                       f"{_gib(g.total_bytes)})" for g in gpus)
    other = [g.index for g in gpus if g.capability != (9, 0)]
    if not other:
        findings = [Finding("gpus", OK, f"{len(gpus)} visible: {listed}")]
    elif len(other) == len(gpus):
        findings = [Finding("gpus", WARN, f"{listed}: the kernels are built for compute capability 9.0 only, so "
                                          "every mode runs on the portable path",
                            "run on H100/H200 GPUs for the kernels; the portable path works as is")]
    else:
        findings = [Finding("gpus", WARN, f"{listed}: GPU(s) {other} are not capability 9.0; a Buffer any of whose "
                                          "ranks sits on one runs the portable path on every rank",
                            "set CUDA_VISIBLE_DEVICES to the capability 9.0 GPUs")]
    if shape.ranks_per_node > len(gpus):
        findings.append(Finding("gpus/ranks", WARN, f"{shape.ranks_per_node} ranks per node but {len(gpus)} GPU(s) "
                                                    "visible: ranks would share GPUs",
                                "one rank per GPU: --ranks (and --nodes) as the job runs, or expose more GPUs"))
    return findings


# The fix for each reason availability.mode_blockers gives, by a word of it.
_BLOCKER_FIXES = (
    ("compute capability", "run on H100/H200 (compute capability 9.0); the portable path works as is"),
    ("nvcc", 'pip install "epcomm[cuda]" (nvcc as a package), or install the CUDA toolkit and set CUDA_HOME'),
    ("NVSHMEM", 'pip install "epcomm[cuda]" (nvidia-nvshmem-cu13), or set NVSHMEM_HOME'),
    ("peer access", "see peer_access: every pair of a host's GPUs must reach each other"),
    ("ranks", "at most 8 ranks per node on the kernels; across hosts strategy='hierarchical' with num_rdma_bytes"),
)


def _blocker_fix(reason: str) -> str:
    return next((fix for word, fix in _BLOCKER_FIXES if word in reason), "see docs/ERRORS.md, Construction errors")


def _doctor_library_blocker(built: dict[str, bool] | None) -> Callable[[bool], str | None]:
    """mode_blockers' library check without building: the compiler (and NVSHMEM) must be there; where
    ``--build`` ran, its outcome."""

    def blocker(nvshmem: bool) -> str | None:
        nvcc, why = _locate("find_nvcc")
        if nvcc is None:
            return f"the kernel library cannot be built ({why.split('. ')[0]})"
        if nvshmem:
            home, why = _locate("find_nvshmem")
            if home is None:
                return f"the NVSHMEM kernel library cannot be built ({why.split(' (')[0]})"
        if built is not None and not built.get("nvshmem" if nvshmem else "kernels", False):
            return f"the {'NVSHMEM ' if nvshmem else ''}kernel library did not build (see kernel_cache)"
        return None

    return blocker


def check_backends(gpus: list[Gpu], shape: Shape, sizes: dict[str, int],
                   built: dict[str, bool] | None) -> list[Finding]:
    """Which backend each mode picks under backend='auto', by availability.mode_blockers seen by each rank of
    this node, ``shape.ranks`` ranks laid out over the visible GPUs one host per node: as the Buffer's vote,
    one rank's reason keeps the mode on the portable path."""
    from . import _env
    from .backends.cuda.availability import LOW_LATENCY, NORMAL, gpu_id, mode_blockers, stable_id

    chosen = _env.env_str("EPCOMM_BACKEND")
    modes = [("normal", NORMAL, "flat"), ("low_latency", LOW_LATENCY, "flat")]
    if shape.nodes > 1:
        modes.append(("hierarchical", NORMAL, "hierarchical"))
    if not gpus:
        return [Finding(f"backend/{label}", SKIP, f"{no_gpu_reason()}: runs on the portable path (torch.distributed)",
                        "none for the portable path; the kernels need an H100/H200")
                for label, _, _ in modes]
    host = socket.gethostname()
    hosts = [stable_id(f"{host}/{r // shape.ranks_per_node}") for r in range(shape.ranks)]
    local = [r % len(gpus) for r in range(shape.ranks_per_node)]  # the visible GPU each rank of a node takes
    gpu_ids = [gpu_id(torch.device("cuda", local[r % shape.ranks_per_node])) for r in range(shape.ranks)]
    ll_nvshmem = _env.ll_transport() == "nvshmem" or bool(_env.ll_remote_ranks(shape.ranks))
    findings = []
    for label, mode, strategy in modes:
        hier = strategy == "hierarchical"
        reasons = (mode_blockers(
            rank, torch.device("cuda", index), hosts, gpu_ids, num_nvl_bytes=sizes["num_nvl_bytes"],
            num_rdma_bytes=sizes["hierarchical_rdma_bytes"] if hier else sizes["low_latency_rdma_bytes"],
            low_latency_mode=mode == LOW_LATENCY, strategy=strategy, ll_nvshmem=ll_nvshmem,
            library_blocker=_doctor_library_blocker(built)).get(mode) for rank, index in enumerate(local))
        reason = next((f"rank {rank} (cuda:{local[rank]}): {r}" for rank, r in enumerate(reasons) if r), None)
        name = f"backend/{label}"
        if chosen == "reference":
            finding = Finding(name, WARN, "EPCOMM_BACKEND=reference: the portable path, kernels or not",
                              "unset EPCOMM_BACKEND (auto) to use the kernels where every rank can")
        elif reason is None:
            finding = Finding(name, OK, f"the CUDA kernels (strategy={strategy!r}, {shape.ranks} ranks)")
        elif chosen == "cuda":
            finding = Finding(name, FAIL, f"EPCOMM_BACKEND=cuda but {reason}: Buffer() raises RuntimeError",
                              _blocker_fix(reason) + "; or unset EPCOMM_BACKEND (auto)")
        else:
            finding = Finding(name, WARN, f"the portable path: {reason}", _blocker_fix(reason))
        findings.append(finding)
    return findings


def check_peer_access(gpus: list[Gpu]) -> list[Finding]:
    if len(gpus) < 2:
        return [Finding("peer_access", SKIP, "one GPU visible: no peer to reach (ranks sharing a GPU need none); with "
                                             "CUDA_VISIBLE_DEVICES set per rank, run the doctor without it"
                        if gpus else no_gpu_reason())]
    missing = [(a.index, b.index) for a in gpus for b in gpus
               if a.index != b.index and not torch.cuda.can_device_access_peer(a.index, b.index)]
    pairs = len(gpus) * (len(gpus) - 1)
    if not missing:
        return [Finding("peer_access", OK, f"all {pairs} ordered pairs of the {len(gpus)} GPUs have peer access")]
    listed = ", ".join(f"{a}->{b}" for a, b in missing[:16]) + (" ..." if len(missing) > 16 else "")
    return [Finding("peer_access", FAIL, f"{len(missing)} of {pairs} pairs lack peer access: {listed}; normal mode "
                                         "and IPC low latency map every peer's buffer, so they run the portable path",
                    "check `nvidia-smi topo -m`; in a VM or container expose all GPUs with P2P enabled (IOMMU/ACS "
                    "settings); or use the low-latency NVSHMEM transport (EPCOMM_LL_TRANSPORT=nvshmem)")]


def parse_topology(text: str) -> dict[tuple[int, int], str]:
    """GPU-to-GPU link kinds of ``nvidia-smi topo -m``: {(i, j): "NV18" / "SYS" / "PIX" / ...}. The first
    row naming a GPU is the header (its leading GPU columns); the later ones are the matrix's rows."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # a terminal gets the header underlined
    rows = [line.split() for line in text.splitlines()]
    rows = [cols for cols in rows if cols and re.fullmatch(r"GPU\d+", cols[0])]
    if not rows:
        return {}
    columns = []
    for cell in rows[0]:
        if not re.fullmatch(r"GPU\d+", cell):
            break
        columns.append(int(cell[3:]))
    links = {}
    for cols in rows[1:]:
        row = int(cols[0][3:])
        for col, kind in zip(columns, cols[1:]):
            if col != row:
                links[(row, col)] = kind
    return links


def check_topology(gpus: list[Gpu]) -> list[Finding]:
    if not gpus:
        return [Finding("nvlink", SKIP, no_gpu_reason())]
    status, text = run_command(["nvidia-smi", "topo", "-m"])
    if status is None and "not found" in text:
        return [Finding("nvlink", SKIP, "nvidia-smi not found: the link kinds are unknown (peer_access still holds)",
                        "install the driver's utilities (nvidia-utils) to see the topology")]
    if status != 0:
        return [Finding("nvlink", WARN, f"nvidia-smi topo -m failed: {text[-300:]}",
                        "check the driver (nvidia-smi alone should list the GPUs)")]
    links = parse_topology(text)
    if not links:
        return [Finding("nvlink", SKIP, "nvidia-smi topo -m shows one GPU: no links between GPUs", "")]
    slow = sorted((a, b, kind) for (a, b), kind in links.items() if a < b and not kind.startswith("NV"))
    kinds = sorted({kind for kind in links.values() if kind.startswith("NV")})
    if not slow:
        return [Finding("nvlink", OK, f"every pair of the {len({a for a, _ in links})} GPUs (all of the host's, "
                                      f"whatever CUDA_VISIBLE_DEVICES) is on NVLink ({', '.join(kinds)})")]
    listed = ", ".join(f"GPU{a}-GPU{b} {kind}" for a, b, kind in slow[:12]) + (" ..." if len(slow) > 12 else "")
    return [Finding("nvlink", WARN, f"{len(slow)} GPU pair(s) without NVLink: {listed}; their traffic crosses PCIe "
                                    "or the host, at a fraction of NVLink's rate",
                    "put a job's ranks on GPUs that share NVLink/NVSwitch (CUDA_VISIBLE_DEVICES); the planner "
                    "(epcomm plan) prices a slower link with --intra-gbps")]


def _driver_cuda() -> tuple[int, int] | None:
    """The CUDA version the driver supports, from nvidia-smi's banner."""
    status, text = run_command(["nvidia-smi"])
    match = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", text) if status == 0 else None
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_compiler(gpus: list[Gpu]) -> list[Finding]:
    nvcc, why = _locate("find_nvcc")
    wanted = _kernels_wanted(gpus)
    if nvcc is None:
        return [Finding("nvcc", FAIL if wanted else WARN,
                        why.split(". ")[0] + (": the kernels cannot be built, every mode runs on the portable path"
                                              if wanted else "; only the CUDA kernels need it"),
                        'pip install "epcomm[cuda]" (nvcc as a package), or install the CUDA toolkit and set '
                        "CUDA_HOME")]
    status, text = run_command([nvcc, "--version"])
    match = re.search(r"release (\d+)\.(\d+)", text)
    if status != 0 or not match:
        return [Finding("nvcc", FAIL if wanted else WARN, f"{nvcc} does not run: {text[-300:]}",
                        "reinstall the toolkit or the nvidia-cuda-nvcc package; or set CUDA_HOME to a working one")]
    found, driver = f"{nvcc} (CUDA {match.group(1)}.{match.group(2)})", _driver_cuda() if gpus else None
    if driver and int(match.group(1)) > driver[0]:
        return [Finding("nvcc", FAIL, f"{found}, but the driver supports CUDA {driver[0]}.{driver[1]}: a library "
                                      "built by this nvcc does not load (insufficient driver)",
                        f"upgrade the driver, or set CUDA_HOME to an nvcc of CUDA {driver[0]}.x")]
    if driver:
        found += f"; the driver supports CUDA {driver[0]}.{driver[1]}"
    return [Finding("nvcc", OK, found)]


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _writable(path: Path) -> bool:
    """Whether ``path`` can be created or written: the nearest existing ancestor decides."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return os.access(probe, os.W_OK | os.X_OK)


def build_kernels(timeout: float) -> tuple[dict[str, bool], str]:
    """Build both libraries into the cache in a child process, so that the timeout holds: which of them
    are in the cache afterwards, and the child's output."""
    _, text = run_command([sys.executable, "-m", "epcomm.backends.cuda.build"], timeout=timeout)
    return {name: bool(b) for name, b in libraries_built().items()}, text


def check_kernel_cache(gpus: list[Gpu], build: tuple[dict[str, bool], str] | None) -> list[Finding]:
    from .backends.cuda.build import cache_dir

    wanted, cache = _kernels_wanted(gpus), cache_dir()
    writable = _writable(cache)
    entries = {p.parent for p in cache.glob("*/*.so")}  # a killed build leaves only a temporary directory
    built = libraries_built()
    have = ", ".join(f"{name} {'built' if b else 'not built yet'}" for name, b in built.items() if b is not None)
    found = (f"{cache} ({'writable' if writable else 'NOT writable'}; {len(entries)} build(s) cached"
             + (f"; for these sources and nvcc: {have}" if have else "") + ")")
    if not writable and not built["kernels"]:  # a read-only cache that holds the build is fine
        findings = [Finding("kernel_cache", FAIL if wanted else WARN,
                            found + ": the first Buffer on the kernels cannot store its build",
                            "set EPCOMM_CACHE_DIR to a writable directory (shared by the ranks of a node)")]
    elif wanted and built["kernels"] is False:
        findings = [Finding("kernel_cache", WARN, found + ": the first Buffer on the kernels compiles them while "
                                                  "every rank waits",
                            "build them before the job: epcomm doctor --build")]
    else:
        findings = [Finding("kernel_cache", OK, found)]
    if build is not None:
        result, text = build
        if all(result.values()):
            tail = text.strip().splitlines()[-1] if text.strip() else ""
            findings.append(Finding("kernel_cache/build", OK, "both libraries built (or found cached): " + tail))
        else:  # without the kernel library every mode stays on the portable path; without NVSHMEM's, some
            failed = [name for name, ok in result.items() if not ok]
            findings.append(Finding("kernel_cache/build", FAIL if wanted and not result["kernels"] else WARN,
                                    f"{', '.join(failed)} did not build: {text[-600:]}",
                                    "raise --build-timeout" if "did not finish" in text else
                                    "see the compiler's output above; docs/ERRORS.md, Construction errors"))
    return findings


def nvshmem_version(home: Path) -> str | None:
    """The NVSHMEM version: the pip distribution's, else the install's header."""
    for dist in NVSHMEM_DISTRIBUTIONS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    for header in (home / "include" / "non_abi" / "nvshmem_version.h", home / "include" / "nvshmem_version.h"):
        if header.exists():
            text = header.read_text(errors="replace")
            parts = [re.search(rf"NVSHMEM_VENDOR_{p}_VERSION\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
            if all(parts):
                return ".".join(m.group(1) for m in parts)
    return None


def check_nvshmem(shape: Shape, sizes: dict[str, int]) -> list[Finding]:
    (home, why), multi = _locate("find_nvshmem"), shape.nodes > 1
    if home is None:
        return [Finding("nvshmem", FAIL if multi else WARN,
                        why.split(" (")[0] + ": " + ("a job across nodes needs it (hierarchical and inter-node "
                                                     "low latency)" if multi else "one host's normal and IPC "
                                                     "low-latency modes do not need it; hierarchical does"),
                        'pip install "epcomm[cuda]" (nvidia-nvshmem-cu13), or set NVSHMEM_HOME')]
    version = nvshmem_version(home)
    found = f"{home} (version {version or 'unknown'})"
    if not (home / "lib" / "libnvshmem_host.so.3").exists():
        return [Finding("nvshmem", FAIL if multi else WARN, found + ": lib/libnvshmem_host.so.3 is missing",
                        "reinstall NVSHMEM 3 (pip install nvidia-nvshmem-cu13)")]
    low, high = NVSHMEM_RANGE
    if version and not low <= tuple(int(p) for p in re.findall(r"\d+", version)[:3]) < high:
        return [Finding("nvshmem", WARN, found + f": the kernels are tested with >={'.'.join(map(str, low))},<"
                                                 f"{high[0]}",
                        'pip install "nvidia-nvshmem-cu13>=3.4.5,<4"')]
    heap = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
    need = max(sizes["low_latency_rdma_bytes"], sizes["hierarchical_rdma_bytes"])
    if heap is not None and (_parse_size(heap) or need) < need:
        return [Finding("nvshmem", WARN, found + f"; NVSHMEM_SYMMETRIC_SIZE={heap} is below the {_gib(need)} "
                                                 "this shape's NVSHMEM buffer needs",
                        "unset NVSHMEM_SYMMETRIC_SIZE (epcomm sizes the heap) or raise it")]
    return [Finding("nvshmem", OK, found)]


def _parse_size(text: str) -> int | None:
    """NVSHMEM's size syntax: a number with an optional k, m, g or t (powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)b?\s*", text.lower())
    if not match:
        return None
    return int(float(match.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[match.group(2)])


def check_rdma(gpus: list[Gpu], shape: Shape, root: Path = Path("/sys/class/infiniband")) -> list[Finding]:
    multi, devices = shape.nodes > 1, sorted(root.iterdir()) if root.is_dir() else []
    if not devices:
        if multi:
            return [Finding("rdma", FAIL, f"no RDMA NIC ({root} is empty or absent): a job across {shape.nodes} "
                                          "nodes has no fast path between them",
                            "install the NIC driver (rdma-core / MLNX_OFED) and expose the NICs to the container "
                            "(/dev/infiniband, /sys/class/infiniband)")]
        return [Finding("rdma", SKIP, f"no RDMA NIC ({root} absent); one node (--nodes 1) needs none", "")]
    ports = []
    for device in devices:
        for port in sorted((device / "ports").glob("*")):
            state = _read(port / "state").split(":")[-1].strip()
            ports.append((device.name, port.name, state, _read(port / "link_layer"), _read(port / "rate")))
    active = [p for p in ports if p[2] == "ACTIVE"]
    listed = "; ".join(f"{d}/{p} {state} {layer} {rate}".strip() for d, p, state, layer, rate in ports)
    if not active:
        return [Finding("rdma", FAIL if multi else WARN, f"{len(devices)} NIC(s), no port ACTIVE: {listed}",
                        "check the cables and the subnet manager (ibstat); RoCE ports need an IP address")]
    if gpus and not Path("/sys/module/nvidia_peermem").exists():
        return [Finding("rdma", WARN if multi else OK,
                        f"{len(active)} active port(s): {listed}; nvidia_peermem is not loaded",
                        "NVSHMEM's InfiniBand transports need GPUDirect RDMA: modprobe nvidia_peermem (or a "
                        "kernel and driver with dma-buf support)" if multi else "")]
    return [Finding("rdma", OK, f"{len(active)} active port(s): {listed}")]


def check_multicast(environ: dict[str, str] | None = None) -> list[Finding]:
    environ = os.environ if environ is None else environ
    findings = []
    for name, (library, off, switch) in MULTICAST_VARS.items():
        value = environ.get(name)
        fix = f"export {name}={off}: {MULTICAST_WHY}"
        if value is None:
            findings.append(Finding(f"multicast/{name}", WARN, f"unset: {library} uses NVLink multicast where the "
                                                               "fabric offers it", fix))
        elif (value.strip().lower() in _YES) if switch else value.strip() == off:
            findings.append(Finding(f"multicast/{name}", OK, f"{name}={value}: {library} leaves multicast off"))
        else:
            findings.append(Finding(f"multicast/{name}", FAIL, f"{name}={value} lets {library} use NVLink "
                                                               "multicast", fix))
    return findings


def check_process_group(gpus: list[Gpu]) -> list[Finding]:
    import torch.distributed as dist

    if not dist.is_available():
        return [Finding("process_group", FAIL, f"torch.distributed is not available in PyTorch {torch.__version__}",
                        "install a PyTorch build with distributed support (the pip wheels have it)")]
    nccl, gloo = dist.is_nccl_available(), dist.is_gloo_available()
    found = f"nccl {'available' if nccl else 'absent'}, gloo {'available' if gloo else 'absent'}"
    if nccl and gpus:
        with contextlib.suppress(RuntimeError, AttributeError, TypeError):
            found += " (NCCL " + ".".join(map(str, torch.cuda.nccl.version())) + ")"
    if gpus and not nccl:
        return [Finding("process_group", WARN, found + ": GPU jobs then run on gloo, which is slow",
                        "install a CUDA build of PyTorch (it brings NCCL)")]
    if not gpus and not gloo:
        return [Finding("process_group", FAIL, found + ": the portable path on CPU needs gloo",
                        "install a PyTorch build with gloo (the pip wheels have it)")]
    return [Finding("process_group", OK, found)]


def buffer_sizes(shape: Shape) -> dict[str, int] | None:
    """The bytes a Buffer for ``shape`` reserves per rank, by the size hints DeepEP's callers use; None for
    a shape no Buffer takes (check_shape says why)."""
    from .buffer import Buffer

    if shape.experts % shape.ranks or shape.ranks % shape.nodes:
        return None

    hidden_bytes = shape.hidden * 2  # DeepEP's callers: hidden * max(element_size, 2)
    configs = (Buffer.get_dispatch_config(shape.ranks), Buffer.get_combine_config(shape.ranks))
    nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, shape.ranks) for c in configs)
    hier = (max(c.get_rdma_buffer_size_hint(hidden_bytes, shape.ranks, shape.ranks_per_node) for c in configs)
            if shape.nodes > 1 else 0)
    ll = Buffer.get_low_latency_rdma_size_hint(shape.ll_tokens, shape.hidden, shape.ranks, shape.experts)
    return {"num_nvl_bytes": nvl, "low_latency_rdma_bytes": ll, "hierarchical_rdma_bytes": hier}


def check_shape(shape: Shape) -> list[Finding]:
    """The shape's own rules (docs/ERRORS.md, Argument errors; README, Limits)."""
    problems, notes = [], []
    if shape.experts % shape.ranks:
        problems.append(f"{shape.experts} experts do not divide over {shape.ranks} ranks")
    if shape.ranks % shape.nodes:
        problems.append(f"{shape.ranks} ranks do not divide over {shape.nodes} nodes")
    if not 1 <= shape.topk <= min(MAX_TOPK, shape.experts):
        problems.append(f"top-{shape.topk} is outside 1..{min(MAX_TOPK, shape.experts)}")
    if (shape.hidden * 2) % 16:
        problems.append(f"hidden {shape.hidden} * 2 bytes is not a multiple of 16")
    if shape.hidden % 128:
        notes.append(f"FP8 dispatch needs hidden a multiple of 128 (got {shape.hidden})")
    if shape.ranks_per_node > 8:
        notes.append(f"{shape.ranks_per_node} ranks per node: the kernels take at most 8 per node")
    found = (f"hidden {shape.hidden}, {shape.tokens} tokens (low latency {shape.ll_tokens}), top-{shape.topk} of "
             f"{shape.experts} experts, {shape.ranks} ranks on {shape.nodes} node(s)")
    if problems:
        return [Finding("shape", FAIL, f"{found}: {'; '.join(problems + notes)}",
                        "Buffer refuses it (ValueError): change the shape (--experts/--ranks/--topk/--hidden)")]
    if notes:
        return [Finding("shape", WARN, f"{found}: {'; '.join(notes)}", "pad hidden to 128, or use BF16 dispatch; "
                                                                       "for more ranks use strategy='hierarchical'")]
    return [Finding("shape", OK, found)]


def check_buffers(gpus: list[Gpu], shape: Shape, sizes: dict[str, int] | None) -> list[Finding]:
    if sizes is None:
        return [Finding(f"buffers/{name}", SKIP, "the shape is not one a Buffer takes (see shape)", "")
                for name in ("normal", "low_latency", "received", "memory")]
    findings = []
    nvl, ll, hier = sizes["num_nvl_bytes"], sizes["low_latency_rdma_bytes"], sizes["hierarchical_rdma_bytes"]
    findings.append(Finding("buffers/normal", OK, f"num_nvl_bytes={nvl} ({_gib(nvl)}): "
                                                  "Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(H * 2, R)"))
    ll_found = (f"num_rdma_bytes={ll} ({_gib(ll)}) for low_latency_mode, num_max_dispatch_tokens_per_rank="
                f"{shape.ll_tokens}: Buffer.get_low_latency_rdma_size_hint(N, H, R, E)")
    if ll > LL_MAX_BYTES:
        findings.append(Finding("buffers/low_latency", FAIL, ll_found + f": above the kernels' {_gib(LL_MAX_BYTES)}",
                                "lower num_max_dispatch_tokens_per_rank (--ll-tokens) or spread experts over more "
                                "ranks"))
    else:
        findings.append(Finding("buffers/low_latency", OK, ll_found))
    if shape.nodes > 1:
        findings.append(Finding("buffers/hierarchical", OK, f"num_rdma_bytes={hier} ({_gib(hier)}) for "
                                                            f"strategy='hierarchical' across {shape.nodes} nodes"))
    findings += _planner_rows(shape)
    if not gpus:
        return [*findings, Finding("buffers/memory", SKIP, "no GPU to hold them", "")]
    total = min(g.total_bytes for g in gpus)
    both = nvl + max(ll, hier)
    use = f"normal + {'hierarchical' if hier > ll else 'low-latency'} buffers: {_gib(both)} of {_gib(total)}"
    if both > total:
        return [*findings, Finding("buffers/memory", FAIL, use + ": more than the GPU holds",
                                   "lower num_max_dispatch_tokens_per_rank, or build the low-latency Buffer only "
                                   "where it is used")]
    if both > total // 4:
        return [*findings, Finding("buffers/memory", WARN, use + ": over a quarter of the GPU",
                                   "check that the model's weights and activations still fit")]
    return [*findings, Finding("buffers/memory", OK, use)]


def _planner_rows(shape: Shape) -> list[Finding]:
    """What a dispatch of ``shape.tokens`` tokens per rank receives (recv_x and its kin), by the planner's
    buffer model, which needs no bandwidths: the size ``num_worst_tokens`` must cover."""
    from .planner.cost_model import estimate
    from .planner.topology import Tier, Topology
    from .planner.workload import Workload

    strategy = "hierarchical" if shape.nodes > 1 else "flat"
    tier = Tier(1.0, 0.0)  # the buffer estimate does not depend on the links
    try:
        topology = Topology(num_domains=shape.nodes, gpus_per_domain=shape.ranks_per_node, intra=tier,
                            inter=tier if shape.nodes > 1 else None)
        workload = Workload(num_tokens=shape.tokens, hidden=shape.hidden, num_topk=shape.topk,
                            num_experts=shape.experts, dispatch_dtype="bf16")
        result = estimate(strategy, topology, workload)
    except (ValueError, TypeError) as error:
        return [Finding("buffers/received", SKIP, f"the planner cannot model this shape: {error}", "")]
    return [Finding("buffers/received", OK,
                    f"a dispatch of {shape.tokens} tokens per rank moves about {_gib(result.buffer_bytes)} "
                    f"(at most {_gib(result.buffer_bytes_worst)}) per rank in and out, by the planner "
                    f"({strategy}, uniform routing; epcomm plan prices it); num_worst_tokens must cover the "
                    "received rows")]


# ------------------------------------------------------------------------------------------ driver
def diagnose(shape: Shape, *, build: bool = False, build_timeout: float = 900.0) -> list[Finding]:
    """Every finding for this machine and ``shape``, in the order they are printed."""
    gpus = visible_gpus()
    sizes = buffer_sizes(shape)
    # An invalid shape still gets the machine's checks: any positive sizes pick the same modes.
    usable = sizes or {"num_nvl_bytes": 1, "low_latency_rdma_bytes": 1, "hierarchical_rdma_bytes": 1}
    built = build_kernels(build_timeout) if build else None
    return [*check_gpus(gpus, shape), *check_backends(gpus, shape, usable, built[0] if built else None),
            *check_peer_access(gpus), *check_topology(gpus), *check_compiler(gpus), *check_kernel_cache(gpus, built),
            *check_nvshmem(shape, usable), *check_rdma(gpus, shape), *check_multicast(),
            *check_process_group(gpus), *check_shape(shape), *check_buffers(gpus, shape, sizes)]


def format_findings(findings: list[Finding]) -> str:
    lines = []
    for f in findings:
        lines.append(f"[{f.status.upper():4s}] {f.name}: {f.found}")
        if f.fix and f.status != OK:
            lines.append(f"       fix: {f.fix}")
    counts = {s: sum(f.status == s for f in findings) for s in STATUSES}
    lines.append(f"epcomm doctor: {len(findings)} findings: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epcomm doctor", allow_abbrev=False,
        description="Check this machine for an epcomm job: GPUs and the backend each mode picks, peer access and "
                    "NVLink, nvcc and the kernel cache, NVSHMEM, RDMA NICs, the NVLink-multicast variables, the "
                    "process-group backends, and the buffers a model shape needs. Exits 1 if a check fails.")
    parser.add_argument("--hidden", type=int, default=7168, help="hidden size (default 7168)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank in normal mode (default 4096)")
    parser.add_argument("--ll-tokens", type=int, default=128, help="num_max_dispatch_tokens_per_rank (default 128)")
    parser.add_argument("--topk", type=int, default=8, help="experts per token (default 8)")
    parser.add_argument("--experts", type=int, default=256, help="number of experts (default 256)")
    parser.add_argument("--ranks", type=int, help="ranks of the job (default: the visible GPUs, or 8 without any)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (hosts) the ranks span (default 1)")
    parser.add_argument("--build", action="store_true", help="build the kernels into the cache now")
    parser.add_argument("--build-timeout", type=float, default=900.0, help="seconds --build may take (default 900)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``epcomm doctor``: 0 when no check fails, 1 when one does, 2 on a bad argument."""
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    bad = [name for name in ("hidden", "tokens", "ll_tokens", "topk", "experts", "ranks", "nodes")
           if getattr(args, name) is not None and getattr(args, name) <= 0]
    if bad:
        print(f"epcomm doctor: error: --{bad[0].replace('_', '-')} must be positive", file=sys.stderr)
        return 2
    ranks = args.ranks or (torch.cuda.device_count() * args.nodes if torch.cuda.is_available() else 8)
    shape = Shape(hidden=args.hidden, tokens=args.tokens, ll_tokens=args.ll_tokens, topk=args.topk,
                  experts=args.experts, ranks=ranks, nodes=args.nodes)
    findings = diagnose(shape, build=args.build, build_timeout=args.build_timeout)
    failed = any(f.status == FAIL for f in findings)
    if args.json:
        from . import __version__

        print(json.dumps({"epcomm": __version__, "torch": torch.__version__, "shape": asdict(shape),
                          "findings": [asdict(f) for f in findings],
                          "summary": {s: sum(f.status == s for f in findings) for s in STATUSES},
                          "ok": not failed}, indent=2))
    else:
        print(format_findings(findings))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
