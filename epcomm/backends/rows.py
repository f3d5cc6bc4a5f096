"""Token rows as bytes: how every backend packs a token (data | scales | top-k ids | top-k weights)
into one row before it moves, and unpacks the received rows into the API's tensors; and the packed
receive scales of low-latency dispatch, which every backend lays out alike; and the digest of a
call's row shape that the ranks of the CUDA backends compare."""

from __future__ import annotations

import functools
import struct
import zlib

import torch

from .reference.backend import from_bytes, to_bytes


def pack_token_rows(x: torch.Tensor, scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
                    topk_weights: torch.Tensor | None, align: int = 1) -> torch.Tensor:
    """[T, row_bytes] uint8; zero padding at the end of each row up to a multiple of ``align`` bytes."""
    parts = [to_bytes(t) for t in (x, scales, topk_idx, topk_weights) if t is not None]
    row_bytes = sum(p.shape[1] for p in parts)
    pad = -row_bytes % align
    if pad:
        parts.append(torch.zeros((x.shape[0], pad), dtype=torch.uint8, device=x.device))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def scale_kind(scales: torch.Tensor | None) -> int:
    """What a dispatch's rows carry beside x, for the ranks' shape agreement: 0 no scales (BF16), 1 fp32
    scales, 2 int32 scales (UE8M0 packed). Both scale kinds travel as 4-byte words, so a rank reading
    the other kind would misread every scale: the kind is part of the shape every rank must agree on."""
    if scales is None:
        return 0
    return 1 if scales.dtype == torch.float32 else 2


@functools.lru_cache(maxsize=1024)
def shape_digest(*values: int | torch.dtype, bits: int = 31) -> int:
    """``bits`` bits of a digest of a call's shape (ints; dtypes by name) that every rank computes
    alike, unlike hash() of a tuple across processes. The CUDA backends' ranks compare them to tell
    calls of other shapes apart: the intranode notify's shape key, the hierarchical counts rows'
    digest and signals' tag, the low-latency signals' 8-bit tag."""
    words = [zlib.crc32(str(v).encode()) if isinstance(v, torch.dtype) else int(v) for v in values]
    return zlib.crc32(struct.pack(f"<{len(words)}q", *words)) & ((1 << bits) - 1)


def check_worst_tokens(rank: int, num_recv_tokens: int, num_worst_tokens: int) -> None:
    if num_worst_tokens and num_recv_tokens > num_worst_tokens:
        raise RuntimeError(f"epcomm dispatch: rank {rank} received {num_recv_tokens} tokens but "
                           f"num_worst_tokens={num_worst_tokens}; pass at least num_tokens * num_ranks")


def unpack_token_rows(recv: torch.Tensor, num_recv: int, num_rows: int, x: torch.Tensor,
                      scales: torch.Tensor | None, topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None,
                      rank: int, num_experts: int, num_ranks: int):
    """Split received rows into (recv_x or (data, scales), recv_topk_idx, recv_topk_weights).

    ``x``, ``scales``, ``topk_idx`` and ``topk_weights`` are the sender-side tensors of this rank (for
    dtypes, widths and the scale layout). Rows past ``num_recv`` (num_worst_tokens) get x = 0,
    top-k ids = -1 and weights = 0. Top-k ids become local expert ids; other ranks' entries -1.
    """
    col = 0

    def take(nbytes: int, dtype: torch.dtype, cols: int, fill: float | int) -> torch.Tensor:
        nonlocal col
        if num_rows > num_recv:
            out = torch.full((num_rows, cols), fill, dtype=dtype, device=recv.device)
        else:
            out = torch.empty((num_rows, cols), dtype=dtype, device=recv.device)
        if num_recv:
            out[:num_recv] = from_bytes(recv[:num_recv, col:col + nbytes], dtype, cols)
        col += nbytes
        return out

    hidden = x.shape[1]
    recv_x = take(hidden * x.element_size(), x.dtype, hidden, 0)
    recv_scales = None
    if scales is not None:
        scale_cols = scales.shape[1]
        # Row-major [num_recv, S] whatever the input's layout, as DeepEP returns them.
        recv_scales = take(scale_cols * 4, scales.dtype, scale_cols, 0)
    recv_topk_idx = recv_topk_weights = None
    if topk_idx is not None:
        k = topk_idx.shape[1]
        global_idx = take(k * 8, torch.int64, k, -1)
        lo = rank * (num_experts // num_ranks)
        hi = lo + num_experts // num_ranks
        mine = (global_idx >= lo) & (global_idx < hi)
        recv_topk_idx = torch.where(mine, global_idx - lo, torch.full_like(global_idx, -1))
        if topk_weights is not None:
            weights = take(k * 4, torch.float32, k, 0)
            recv_topk_weights = torch.where(mine, weights, torch.zeros_like(weights))
    recv_x_out = (recv_x, recv_scales) if scales is not None else recv_x
    return recv_x_out, recv_topk_idx, recv_topk_weights


def low_latency_scales_layout(num_local_experts: int, rows: int, hidden: int,
                              use_ue8m0: bool) -> tuple[tuple[int, int, int], tuple[int, int, int], torch.dtype]:
    """(shape, strides, dtype) of a low-latency dispatch's FP8 scales: [E_local, N*R, H/128] fp32, or
    [.., H/512] packed UE8M0 int32, column-major in the last two dims (what DeepEP returns). Every
    backend lays them out by this."""
    cols = hidden // 128 // (4 if use_ue8m0 else 1)
    return (num_local_experts, rows, cols), (cols * rows, 1, rows), torch.int32 if use_ue8m0 else torch.float32


def round_up(n: int, align: int) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return (n + align - 1) // align * align
