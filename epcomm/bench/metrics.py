"""Byte counts and the slowest-rank rule of the benchmark, kept apart so they can be tested by hand.

The counts are DeepEP's own (tests/test_intranode.py and tests/test_low_latency.py), so numbers
printed here compare directly with the peers table. They count *logical* bytes: the rows a rank
receives including the ones it sends to itself, not the bytes that cross a link.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SCALE_GROUP = 128  # channels sharing one FP8 scale
SCALE_BYTES = 4  # one fp32 scale
LL_META_BYTES = 16  # per-message metadata DeepEP counts in low-latency FP8 dispatch
DTYPES = ("bf16", "fp8")


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def row_bytes(hidden: int, dtype: str) -> int:
    """Bytes of one dispatched token row: BF16 data, or FP8 data plus one fp32 scale per 128 channels."""
    _check_dtype(dtype)
    if dtype == "bf16":
        return hidden * 2
    return hidden + math.ceil(hidden / SCALE_GROUP) * SCALE_BYTES


def normal_dispatch_bytes(num_recv_rows: int, hidden: int, dtype: str) -> int:
    """Bytes of ``recv_x`` on one rank: received rows (own rows included) times the row size."""
    return num_recv_rows * row_bytes(hidden, dtype)


def normal_combine_bytes(num_recv_rows: int, hidden: int) -> int:
    """Combine moves the same rows back, always in BF16."""
    return num_recv_rows * hidden * 2


def ll_dispatch_bytes(num_selections: int, hidden: int, dtype: str = "fp8") -> int:
    """Low-latency dispatch: one message per (token, selected expert) sent by this rank.

    ``num_selections`` is the number of non-negative entries of this rank's ``topk_idx``. An FP8
    message counts data, scales and 16 bytes of metadata; a BF16 one counts the data only (as DeepEP).
    """
    if dtype == "fp8":
        return num_selections * (row_bytes(hidden, "fp8") + LL_META_BYTES)
    return num_selections * row_bytes(hidden, dtype)


def ll_combine_bytes(num_selections: int, hidden: int) -> int:
    """Low-latency combine returns one BF16 row per (token, selected expert)."""
    return num_selections * hidden * 2


def gbps(num_bytes: int, seconds: float) -> float:
    """GB/s with GB = 1e9 bytes, as DeepEP prints it."""
    return num_bytes / 1e9 / seconds if seconds > 0 else 0.0


def slowest_rank(per_rank_s: Sequence[float], per_rank_bytes: Sequence[int]) -> tuple[float, float, int]:
    """(time in us, GB/s, rank) of the bottleneck rank: the largest per-rank median time.

    The bandwidth is that rank's own byte count over its own time, so a rank that is slow because
    it received more rows is reported with the rows it actually received.
    """
    if not per_rank_s or len(per_rank_s) != len(per_rank_bytes):
        raise ValueError(f"need one time and one byte count per rank, got {len(per_rank_s)} and "
                         f"{len(per_rank_bytes)}")
    rank = max(range(len(per_rank_s)), key=lambda r: per_rank_s[r])
    return per_rank_s[rank] * 1e6, gbps(per_rank_bytes[rank], per_rank_s[rank]), rank
