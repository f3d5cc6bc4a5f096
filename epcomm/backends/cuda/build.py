"""Compile the kernels on first use and cache them, so ``pip install`` compiles nothing.

The device sources never include torch: they build alone with nvcc into a shared library with a
C ABI, loaded through ctypes. The cache key covers the sources and the nvcc version.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from ... import _env

PACKAGE_DIR = Path(__file__).resolve().parents[2]
# Two libraries: the IPC one (every peer mapped into this process) and the NVSHMEM one, which builds the
# low-latency launchers again with EPCOMM_NVSHMEM so that peers outside the NVLink domain get puts.
KERNEL_SOURCES = [PACKAGE_DIR / "csrc" / name for name in ("intranode.cu", "low_latency.cu")]
HEADERS = sorted([*(PACKAGE_DIR / "include").rglob("*.cuh"), *(PACKAGE_DIR / "csrc").rglob("*.cuh")])
ARCH_FLAGS = ["-gencode=arch=compute_90,code=sm_90"]
NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo", "-Xcompiler", "-fPIC", *ARCH_FLAGS]

_library: ctypes.CDLL | None = None


SYSTEM_CUDA_HOME = "/usr/local/cuda"


def nvcc_package_homes() -> list[Path]:
    """Where the ``nvidia-cuda-nvcc`` wheels put a toolkit-shaped tree (bin/nvcc beside include/ and lib/,
    which its dependencies fill): ``nvidia/cu13`` for CUDA 13, ``nvidia/cuda_nvcc`` for CUDA 12. ``nvidia``
    is a namespace package, so every site directory holding a part of it is looked in."""
    try:
        import nvidia  # type: ignore[import-not-found]
    except ImportError:
        return []
    return [Path(root) / sub for root in nvidia.__path__ for sub in ("cu13", "cuda_nvcc")]


def find_nvcc() -> str:
    """nvcc: $CUDA_HOME, $CUDA_PATH, then the environment's own ``nvidia-cuda-nvcc`` package (what
    ``pip install "epcomm[cuda]"`` brings, so a pip-only machine needs no toolkit), /usr/local/cuda, PATH."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), *nvcc_package_homes(), SYSTEM_CUDA_HOME]
    for home in homes:
        if home and (Path(home) / "bin" / "nvcc").exists():
            if Path(home) in nvcc_package_homes():
                check_package_toolkit(Path(home))
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    raise RuntimeError("epcomm: nvcc was not found (looked in $CUDA_HOME, $CUDA_PATH, the nvidia-cuda-nvcc package, "
                       "/usr/local/cuda and PATH). The CUDA backend compiles its kernels on first use: "
                       'pip install "epcomm[cuda]" (nvcc and NVSHMEM as packages), or install the CUDA toolkit and '
                       "set CUDA_HOME, or use Buffer(..., backend='reference')")


def check_package_toolkit(home: Path) -> None:
    """A CUDA 13 toolkit that pip assembled from packages builds only when nvcc and the runtime's headers
    (the version PyTorch pins) are of one release, since nvcc's headers refuse others, and CCCL's headers
    are there: say which package to install rather than let the build fail on a header."""
    from importlib import metadata

    try:
        nvcc_version = metadata.version("nvidia-cuda-nvcc")
    except metadata.PackageNotFoundError:
        return  # another layout (CUDA 12's nvidia/cuda_nvcc): its headers live in other packages
    try:
        runtime_version: str | None = metadata.version("nvidia-cuda-runtime")
    except metadata.PackageNotFoundError:
        runtime_version = None
    release = ".".join((runtime_version or nvcc_version).split(".")[:2])
    if runtime_version is not None and nvcc_version.split(".")[:2] != runtime_version.split(".")[:2]:
        raise RuntimeError(f"epcomm: nvidia-cuda-nvcc {nvcc_version} cannot build against the CUDA headers of "
                           f"nvidia-cuda-runtime {runtime_version} (PyTorch's): pip install "
                           f'"nvidia-cuda-nvcc=={release}.*" "nvidia-nvvm=={release}.*" "nvidia-cuda-crt=={release}.*"')
    if not (home / "include" / "nv" / "target").exists():
        raise RuntimeError(f"epcomm: the CUDA headers beside {home / 'bin' / 'nvcc'} lack CCCL's (nv/target): "
                           f'pip install "nvidia-cuda-cccl=={release}.*"')


def runtime_link_flags(nvcc: str) -> list[str]:
    """Where the CUDA runtime's static libraries are when nvcc does not look there itself: the packages
    put them in lib/, where a toolkit's nvcc.profile names lib64/."""
    top = Path(nvcc).resolve().parent.parent
    if (top / "lib" / "libcudart_static.a").exists() and not (top / "lib64").exists():
        return [f"-L{top / 'lib'}"]
    return []


# Where toolkits keep the stub libcuda.so that -lcuda links against (the real one comes with the driver).
_DRIVER_STUB_DIRS = ("lib64/stubs", "lib/stubs", "targets/x86_64-linux/lib/stubs", "targets/sbsa-linux/lib/stubs")


def driver_link_flags(nvcc: str) -> list[str]:
    """How the kernel library links the driver API: against a toolkit's stub where nvcc has one; else by
    the driver's own soname, since the nvcc packages ship no stub and a driver install (a container's
    above all) may hold only libcuda.so.1. The library is only linked where it will run, beside a driver."""
    top = Path(nvcc).resolve().parent.parent
    if any((top / stubs / "libcuda.so").exists() for stubs in _DRIVER_STUB_DIRS):
        return ["-lcuda"]
    # The linker does not search LD_LIBRARY_PATH, where some images put the driver's libraries.
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)
            if d and (Path(d) / "libcuda.so.1").exists()]
    return [*(f"-L{d}" for d in dirs), "-l:libcuda.so.1"]


def compile_command(nvcc: str, output: Path) -> list[str]:
    return [nvcc, *NVCC_FLAGS, "-shared", "-o", str(output), *map(str, KERNEL_SOURCES), *runtime_link_flags(nvcc),
            *driver_link_flags(nvcc)]


def cache_dir() -> Path:
    """The kernel cache (EPCOMM_CACHE_DIR): one directory per key, each holding its built libraries."""
    return Path(os.path.expanduser(_env.env_str("EPCOMM_CACHE_DIR")))


def _cache_target(name: str, sources: list[Path], extra_key: str,
                  commands: Callable[[str, Path, Path], list[list[str]]]) -> tuple[str, Path]:
    """(nvcc, where the build of ``name`` lands in the cache): the key hashes the sources, the nvcc
    version and the build commands."""
    nvcc = find_nvcc()
    # Bounded: the doctor asks for these paths and must not hang on a broken compiler.
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    digest = hashlib.sha256(version.encode())
    for path in [*sources, *HEADERS]:
        digest.update(str(path.relative_to(PACKAGE_DIR)).encode())
        digest.update(path.read_bytes())
    digest.update(extra_key.encode())
    for command in commands(nvcc, Path("/work"), Path("/work") / name):  # how it is built is part of the key
        digest.update(" ".join(command).encode())
    return nvcc, cache_dir() / digest.hexdigest()[:16] / name


def _cached_build(name: str, sources: list[Path], extra_key: str,
                  commands: Callable[[str, Path, Path], list[list[str]]]) -> Path:
    """Build ``name`` (a shared library) into the cache unless a build of the same sources, flags
    and nvcc is there; ``commands(nvcc, workdir, output)`` gives the commands to run in order."""
    nvcc, target = _cache_target(name, sources, extra_key, commands)
    cache = target.parent
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # ranks may compile at once: rename atomically
            out = Path(tmp) / name
            for command in commands(nvcc, Path(tmp), out):
                result = subprocess.run(command, capture_output=True, text=True)
                if result.returncode != 0:
                    raise RuntimeError(f"epcomm: building {name} failed:\n{' '.join(command)}\n"
                                       f"{result.stderr[-4000:]}")
            os.replace(out, target)
    return target


def _kernel_commands(nvcc: str, _workdir: Path, out: Path) -> list[list[str]]:
    return [compile_command(nvcc, out)]


def kernel_library_path() -> Path:
    """Where the kernel library is (or will be, once built) cached for these sources and this nvcc."""
    return _cache_target("libepcomm_kernels.so", KERNEL_SOURCES, "", _kernel_commands)[1]


def load_library() -> ctypes.CDLL:
    """The kernel library, compiled into the cache on the first call of the process."""
    global _library
    if _library is None:
        _library = ctypes.CDLL(str(_cached_build("libepcomm_kernels.so", KERNEL_SOURCES, "", _kernel_commands)))
    return _library


# ---------------------------------------------------------------------------------------- NVSHMEM
NVSHMEM_SOURCES = [PACKAGE_DIR / "csrc" / name
                   for name in ("hierarchical.cu", "low_latency.cu", "nvshmem_bootstrap.cu")]
_nvshmem_library: ctypes.CDLL | None = None


def find_nvshmem() -> Path:
    """The NVSHMEM install: $NVSHMEM_HOME, or the ``nvidia-nvshmem-cu13`` package (which PyTorch's
    CUDA 13 builds depend on), with include/ and lib/ (libnvshmem_device.a, libnvshmem_host.so.3)."""
    home = os.environ.get("NVSHMEM_HOME")
    candidates = [Path(home)] if home else []
    try:
        import nvidia.nvshmem as package  # type: ignore[import-not-found]

        candidates += [Path(p) for p in package.__path__]
    except ImportError:
        pass
    for c in candidates:
        if (c / "include" / "nvshmem.h").exists() and (c / "lib" / "libnvshmem_device.a").exists():
            return c
    raise RuntimeError("epcomm: NVSHMEM was not found (set NVSHMEM_HOME, or pip install nvidia-nvshmem-cu13, "
                       'which pip install "epcomm[cuda]" brings); it carries the transport to peers outside '
                       "the NVLink domain")


def nvshmem_build_commands(nvcc: str, nvshmem: Path, workdir: Path, output: Path) -> list[list[str]]:
    """Relocatable device code, a device link against libnvshmem_device.a, then the shared library
    (NVSHMEM's device API needs all three steps)."""
    objects = [workdir / (src.stem + ".o") for src in NVSHMEM_SOURCES]
    flags = [*NVCC_FLAGS, "-rdc=true", f"-I{nvshmem / 'include'}", "-DEPCOMM_NVSHMEM"]
    commands = [[nvcc, *flags, "-c", str(src), "-o", str(obj)] for src, obj in zip(NVSHMEM_SOURCES, objects)]
    dlink = workdir / "dlink.o"
    runtime = runtime_link_flags(nvcc)
    commands.append([nvcc, *ARCH_FLAGS, "-Xcompiler", "-fPIC", "-dlink", *runtime, *map(str, objects),
                     str(nvshmem / "lib" / "libnvshmem_device.a"), "-o", str(dlink)])
    commands.append([nvcc, *ARCH_FLAGS, "-shared", *runtime, "-o", str(output), *map(str, objects), str(dlink),
                     str(nvshmem / "lib" / "libnvshmem_device.a"),  # its host-side stubs of the device code
                     f"-L{nvshmem / 'lib'}", "-l:libnvshmem_host.so.3", f"-Xlinker=-rpath={nvshmem / 'lib'}"])
    return commands


def nvshmem_library_path() -> Path:
    """Where the NVSHMEM library is (or will be) cached for these sources, nvcc and NVSHMEM install."""
    nvshmem = find_nvshmem()
    return _cache_target("libepcomm_nvshmem.so", NVSHMEM_SOURCES, str(nvshmem),
                         lambda nvcc, tmp, out: nvshmem_build_commands(nvcc, nvshmem, tmp, out))[1]


def load_nvshmem_library() -> ctypes.CDLL:
    """The NVSHMEM library (hierarchical mode, the low-latency kernels with puts, the bootstrap), built on
    first use like the kernels."""
    global _nvshmem_library
    if _nvshmem_library is None:
        nvshmem = find_nvshmem()
        path = _cached_build("libepcomm_nvshmem.so", NVSHMEM_SOURCES, str(nvshmem),
                             lambda nvcc, tmp, out: nvshmem_build_commands(nvcc, nvshmem, tmp, out))
        lib = ctypes.CDLL(str(path))
        lib.epcomm_nvshmem_malloc.restype = ctypes.c_void_p
        lib.epcomm_nvshmem_malloc.argtypes = [ctypes.c_int64]
        lib.epcomm_nvshmem_peer_ptr.restype = ctypes.c_void_p
        lib.epcomm_nvshmem_peer_ptr.argtypes = [ctypes.c_void_p, ctypes.c_int]
        _nvshmem_library = lib
    return _nvshmem_library


if __name__ == "__main__":  # python -m epcomm.backends.cuda.build: both libraries built (or found cached)
    load_library()
    load_nvshmem_library()
    print("epcomm: kernels built")
