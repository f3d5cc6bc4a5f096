"""Argument checks shared by every backend. Each error names the argument, its value and what was expected."""

from __future__ import annotations

from collections.abc import Sequence

import torch

topk_idx_t = torch.int64


def check_tensor(name: str, t: object, *, dtype: torch.dtype | Sequence[torch.dtype] | None = None,
                 dim: int | None = None, shape: Sequence[int | None] | None = None,
                 device: torch.device | None = None, contiguous: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(w is not None and s != w for s, w in zip(t.shape, shape)):
            want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if device is not None and not same_device(t.device, device):
        hint = (" (a gloo group on a machine with CUDA puts the Buffer on the GPU, as DeepEP; for CPU tensors "
                "build it with device='cpu' or EPCOMM_DEVICE=cpu)" if device.type == "cuda" and t.device.type == "cpu"
                else "")
        raise ValueError(f"{name} must be on {device} (the Buffer's device), got {t.device}{hint}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")
    return t


def same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        ia = a.index if a.index is not None else torch.cuda.current_device()
        ib = b.index if b.index is not None else torch.cuda.current_device()
        return ia == ib
    return True


def check_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_topk_idx(name: str, topk_idx: object, num_experts: int, device: torch.device,
                   num_tokens: int | None = None, values: bool = True) -> torch.Tensor:
    """topk_idx must be int64 [T, K] with every value in [-1, num_experts) (checked when ``values``:
    it reads the tensor on the host)."""
    t = check_tensor(name, topk_idx, dtype=topk_idx_t, dim=2, device=device, contiguous=True)
    if num_tokens is not None and t.shape[0] != num_tokens:
        raise ValueError(f"{name} must have {num_tokens} rows (one per token of x), got {t.shape[0]}")
    if values and t.numel():
        check_topk_bounds(name, int(t.min()), int(t.max()), num_experts)
    return t


def check_topk_bounds(name: str, lo: int, hi: int, num_experts: int) -> None:
    """The range check of top-k ids, from their minimum and maximum read on the host."""
    if lo < -1 or hi >= num_experts:
        raise ValueError(f"{name} values must lie in [-1, {num_experts}) (num_experts={num_experts}), "
                         f"got min {lo} and max {hi}")


def split_x(name: str, x: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Accept a bf16 tensor or an (e4m3, scales) tuple; return (data, scales or None)."""
    if isinstance(x, tuple | list):
        if len(x) != 2:
            raise ValueError(f"{name} as a tuple must be (x_e4m3, scales), got {len(x)} items")
        data, scales = x
        check_tensor(f"{name}[0]", data, dtype=torch.float8_e4m3fn, dim=2)
        check_tensor(f"{name}[1]", scales, dtype=(torch.float32, torch.int32), dim=2)
        return data, scales
    check_tensor(name, x, dtype=torch.bfloat16, dim=2)
    return x, None  # type: ignore[return-value]
