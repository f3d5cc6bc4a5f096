"""FP8 (e4m3) casts with one scale per 128 channels, bit-for-bit what the kernels compute.

The rule, shared by every backend: per token and per group of 128 channels,
``amax = max(max|x|, 1e-4)``, ``scale = amax * fp32(1/448)`` and ``q = e4m3(x * (448 / amax))``,
all in fp32 with round-to-nearest-even (the division correctly rounded). The scale is a product
rather than a quotient because PyTorch's CUDA kernels turn division by a scalar into a product with
its reciprocal: written this way the rule gives the same bits on every device. With ``round_scale``
the scale is rounded up to a power of two and the multiplier is its exact inverse. UE8M0 packing
keeps only the exponent byte of such a power-of-two scale, four groups per int32 (group g in byte
g % 4, little-endian).
"""

from __future__ import annotations

import math

import torch

from .utils.tensors import dense

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
GROUP = 128


def _grouped(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    num_groups = math.ceil(hidden / GROUP)
    xf = x.float()
    pad = num_groups * GROUP - hidden
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    return xf.view(num_tokens, num_groups, GROUP), hidden


def round_scale_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= each (positive, normal) fp32 scale, by exponent arithmetic."""
    bits = scale.view(torch.int32)
    mantissa = bits & 0x7FFFFF
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + (mantissa != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def quantize_groups(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (e4m3 [T, H], fp32 scales [T, ceil(H/128)]) following the module rule."""
    xg, hidden = _grouped(x)
    amax = xg.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    scale = amax * torch.full_like(amax, 1.0 / FP8_MAX)  # made on the device: no host copy (graph capture)
    if round_scale:
        scale = round_scale_up_pow2(scale)
        inv = torch.ones_like(scale) / scale  # exact: scale is a power of two
    else:
        inv = torch.full_like(amax, FP8_MAX) / amax  # tensor / tensor: a true division on every device
    q = (xg * inv.unsqueeze(-1)).to(torch.float8_e4m3fn)
    q = q.reshape(x.shape[0], xg.shape[1] * GROUP)[:, :hidden].contiguous()
    return q, scale


def pack_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Pack power-of-two fp32 scales [.., G] (G % 4 == 0) into int32 [.., G / 4] exponent bytes."""
    if scale.shape[-1] % 4:
        raise ValueError(f"UE8M0 packing needs a multiple of 4 scale groups, got {scale.shape[-1]}")
    exp_bytes = ((scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return exp_bytes.view(torch.int32)  # little-endian: group g lands in byte g % 4


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_ue8m0``: int32 [.., G/4] -> fp32 powers of two [.., G]."""
    exp_bytes = dense(packed).view(torch.uint8).to(torch.int32)
    return (exp_bytes << 23).view(torch.float32)


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast bf16/fp32 ``x`` [T, H] to (e4m3 [T, H], fp32 scales [T, ceil(H/128)])."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating tensor, got dtype {x.dtype}")
    return quantize_groups(x)


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantize (e4m3 [T, H], scales [T, ceil(H/128)] fp32, or UE8M0-packed int32) to bf16."""
    for name, t in (("x_fp8", x_fp8), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if x_fp8.dtype != torch.float8_e4m3fn:
        raise TypeError(f"x_fp8 must be float8_e4m3fn, got {x_fp8.dtype}")
    if scales.dtype not in (torch.float32, torch.int32):
        raise TypeError(f"scales must be float32 or UE8M0-packed int32, got {scales.dtype}")
    xg, hidden = _grouped(x_fp8.float())
    # Exactly this module's grouping: dispatch carries scales of any count (DeepEP's rule), and
    # another grouping read as this one would give wrong values, not an error.
    want = xg.shape[1] if scales.dtype == torch.float32 else -(-xg.shape[1] // 4)
    if scales.shape != (x_fp8.shape[0], want):
        kind = "fp32 scale per 128 channels" if scales.dtype == torch.float32 else "UE8M0 int32 per 512 channels"
        raise ValueError(f"scales shape {tuple(scales.shape)} is not one {kind} of x_fp8 {tuple(x_fp8.shape)}: "
                         f"expected {(x_fp8.shape[0], want)}")
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales)
    out = xg * scales[:, : xg.shape[1]].unsqueeze(-1)
    return out.reshape(x_fp8.shape[0], xg.shape[1] * GROUP)[:, :hidden].to(torch.bfloat16)
