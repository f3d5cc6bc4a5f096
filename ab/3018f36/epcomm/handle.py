"""Handles: what a dispatch leaves behind for its combine and for cached dispatches.

Callers treat them as opaque. Each records the Buffer that made it, so a handle cannot be used
with another Buffer by mistake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class DispatchHandle:
    buffer_uid: str
    num_tokens: int  # tokens on this rank before dispatch
    hidden: int
    num_recv_tokens: int  # valid received rows
    num_worst_tokens: int  # 0, or the fixed row count of the outputs
    is_token_in_rank: torch.Tensor  # [T, R] bool
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank, in rank order
    backend_state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_recv_rows(self) -> int:
        """Rows of the receive-side tensors (num_worst_tokens when set)."""
        return self.num_worst_tokens or self.num_recv_tokens


@dataclass(eq=False)
class LowLatencyHandle:
    buffer_uid: str
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_tokens: int
    num_topk: int
    src_info: torch.Tensor  # [E_local, N*R] int32: source token index of each received row
    layout_range: torch.Tensor  # [E_local, R] int64: (begin << 32) | count of each source's block
    backend_state: dict[str, Any] = field(default_factory=dict)
