"""How the Python side calls the kernel library's C ABI (ctypes): tensor and stream pointers,
return codes, and the alignment every kernel relies on. One place for both CUDA backends."""

from __future__ import annotations

import ctypes

import torch


def ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    """A tensor's device address (NULL for None or an empty tensor)."""
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)


def stream_ptr(device: torch.device) -> ctypes.c_void_p:
    """The current CUDA stream of ``device``, where the kernels are launched."""
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def check(code: int, what: str) -> None:
    """Raise on a nonzero return code of a library call (a cudaError_t, or -1)."""
    if code != 0:
        raise RuntimeError(f"epcomm {what}: CUDA call failed with error {code}")


def check_aligned(name: str, t: torch.Tensor) -> None:
    """The kernels move 16-byte words: a tensor must start on a 16-byte boundary."""
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address (the kernels move 16-byte words; a view "
                         "with an odd storage offset is not aligned); pass a fresh or .clone()d tensor")
