"""Tensor helpers shared by the backends, the benchmark and the tests."""

from __future__ import annotations

import re

import torch

# nonzero_static runs on CUDA from PyTorch 2.6.
_NONZERO_STATIC_CUDA = tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 6)


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with row-major strides, copied only when needed. Unlike ``contiguous()``, a size-1
    dimension must have its row-major stride too (PyTorch calls a tensor contiguous whatever the
    stride of a size-1 dim, e.g. a one-row block of column-major scales), so the result can always
    be viewed as another dtype."""
    expected, step = [], 1
    for size in reversed(t.shape):
        expected.append(step)
        step *= size
    if list(t.stride()) == expected[::-1]:
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as a flat uint8 tensor."""
    return dense(t).view(-1).view(torch.uint8)


def row_words(t: torch.Tensor) -> torch.Tensor:
    """A dense 2-D tensor's rows as the widest integer words their byte width allows (a view): row
    gathers and scatters (index_select, index_copy_) run several times faster on 8-byte words than
    on bytes or 2-byte floats."""
    row_bytes = t.shape[1] * t.element_size()
    for dtype in (torch.int64, torch.int32, torch.int16):
        if row_bytes % dtype.itemsize == 0 and t.element_size() <= dtype.itemsize:
            if not t.numel():  # nothing to alias; empty tensors may carry strides that forbid the view
                return torch.empty((t.shape[0], row_bytes // dtype.itemsize), dtype=dtype, device=t.device)
            return t.view(dtype)
    return t.view(torch.uint8)


def result_tensors(obj: object, out: list | None = None) -> list[torch.Tensor]:
    """The tensors in a call's result: the tensors among its items, and in (data, scales) pairs. A list
    is walked only if it starts with a tensor (num_recv_tokens_per_expert_list is E_local ints). A
    list filled in place, not a generator: this runs in every call's host path."""
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, tuple) or (isinstance(obj, list) and obj and isinstance(obj[0], torch.Tensor)):
        for item in obj:
            result_tensors(item, out)
    return out


def nonzero_counted(t: torch.Tensor, count: int) -> torch.Tensor:
    """``torch.nonzero(t)`` where the host knows the count of nonzeros: on a GPU then no host read of
    the size (``nonzero_static``)."""
    if count and t.is_cuda and _NONZERO_STATIC_CUDA:
        return torch.nonzero_static(t, size=count)
    return torch.nonzero(t)
