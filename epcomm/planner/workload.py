"""What one MoE layer asks of the communication: tokens per rank, row sizes, top-k, experts.

Row sizes follow the benchmark's method (docs/PERFORMANCE.md), which follows DeepEP's tests: a BF16
row is ``2 H`` bytes; an FP8 row is ``H`` bytes of e4m3 plus one float32 scale per 128 channels,
``H + ceil(H/128) * 4``.
Combine is always BF16 (the API has no FP8 combine). The top-k ids and weights that travel with
a dispatched row (12 bytes per k) are left out, as the benchmark metric leaves them out.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .expectations import check_routing
from .topology import Topology

DTYPES = ("bf16", "fp8")


def bytes_per_token(dtype: str, hidden: int) -> int:
    """Bytes one row of ``hidden`` channels occupies on the wire in ``dtype`` (bf16 or fp8)."""
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"hidden must be an integer >= 1, got {hidden!r}")
    if dtype == "bf16":
        return 2 * hidden
    if dtype == "fp8":
        return hidden + math.ceil(hidden / 128) * 4
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def _int_at_least(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class Workload:
    """One dispatch + combine per rank. Defaults are the benchmark's normal-mode DeepSeek-V3 shape.

    ``num_groups`` (G) turns on node-limited routing: each token uses experts of at most G domains
    (see :mod:`epcomm.planner.expectations` for the exact sampling model).
    ``ranks_per_token`` / ``domains_per_token`` override the model with measured means (distinct
    destination ranks/domains per token, the own one included), for routings that are not
    uniformly random.
    """

    num_tokens: int = 4096
    hidden: int = 7168
    num_topk: int = 8
    num_experts: int = 256
    dispatch_dtype: str = "fp8"
    combine_dtype: str = "bf16"
    num_groups: int | None = None
    ranks_per_token: float | None = None
    domains_per_token: float | None = None

    def __post_init__(self) -> None:
        _int_at_least("num_tokens", self.num_tokens, 1)
        _int_at_least("hidden", self.hidden, 1)
        _int_at_least("num_topk", self.num_topk, 1)
        _int_at_least("num_experts", self.num_experts, 1)
        if self.num_topk > self.num_experts:
            raise ValueError(f"num_topk must be <= num_experts={self.num_experts}, got {self.num_topk}")
        if self.dispatch_dtype not in DTYPES:
            raise ValueError(f"dispatch_dtype must be one of {DTYPES}, got {self.dispatch_dtype!r}")
        if self.combine_dtype != "bf16":
            raise ValueError(f"combine_dtype must be 'bf16' (combine is BF16 only), got {self.combine_dtype!r}")
        if self.num_groups is not None:
            _int_at_least("num_groups", self.num_groups, 1)
        for name in ("ranks_per_token", "domains_per_token"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise ValueError(f"{name} must be a finite number >= 0 or None, got {value!r}")

    @property
    def dispatch_bytes_per_token(self) -> int:
        return bytes_per_token(self.dispatch_dtype, self.hidden)

    @property
    def combine_bytes_per_token(self) -> int:
        return bytes_per_token(self.combine_dtype, self.hidden)

    def check(self, topology: Topology) -> None:
        """Raise ValueError naming the argument if this workload does not fit ``topology``."""
        check_routing(self.num_experts, self.num_topk, topology.num_ranks, topology.num_domains, self.num_groups)

    def describe(self) -> str:
        text = (f"{self.num_tokens} tokens/rank, hidden {self.hidden}, {self.dispatch_dtype} dispatch / "
                f"{self.combine_dtype} combine, top-{self.num_topk} of {self.num_experts} experts")
        if self.num_groups is not None:
            text += f", tokens use at most {self.num_groups} domains"
        return text

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["dispatch_bytes_per_token"] = self.dispatch_bytes_per_token
        out["combine_bytes_per_token"] = self.combine_bytes_per_token
        return out
