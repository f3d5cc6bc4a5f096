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
from pathlib import Path

from ... import _env

PACKAGE_DIR = Path(__file__).resolve().parents[2]
KERNEL_SOURCES = sorted((PACKAGE_DIR / "csrc" / "kernels").glob("*.cu"))
HEADERS = sorted((PACKAGE_DIR / "include").rglob("*.cuh"))
ARCH_FLAGS = ["-gencode=arch=compute_90,code=sm_90"]
NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo", "-Xcompiler", "-fPIC", *ARCH_FLAGS]

_library: ctypes.CDLL | None = None


def find_nvcc() -> str:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for home in candidates:
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    raise RuntimeError("epcomm: nvcc was not found (looked in $CUDA_HOME, $CUDA_PATH, /usr/local/cuda and PATH). "
                       "The CUDA backend compiles its kernels on first use: install the CUDA toolkit or set "
                       "CUDA_HOME, or use Buffer(..., backend='reference')")


def compile_command(nvcc: str, output: Path) -> list[str]:
    return [nvcc, *NVCC_FLAGS, "-shared", "-o", str(output), *map(str, KERNEL_SOURCES), "-lcuda"]


def load_library() -> ctypes.CDLL:
    """The kernel library, compiled into the cache on the first call of the process."""
    global _library
    if _library is not None:
        return _library
    nvcc = find_nvcc()
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256(version.encode())
    for path in [*KERNEL_SOURCES, *HEADERS]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(NVCC_FLAGS).encode())
    cache = Path(os.path.expanduser(_env.env_str("EPCOMM_CACHE_DIR"))) / digest.hexdigest()[:16]
    target = cache / "libepcomm_kernels.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # ranks may compile at once: rename atomically
            out = Path(tmp) / target.name
            result = subprocess.run(compile_command(nvcc, out), capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"epcomm: compiling the CUDA kernels failed:\n{result.stderr[-4000:]}")
            os.replace(out, target)
    _library = ctypes.CDLL(str(target))
    return _library
