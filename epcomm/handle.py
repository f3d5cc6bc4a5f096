"""Handles: what a dispatch leaves behind for its combine and for cached dispatches.

Each records the Buffer that made it, so a handle cannot be used with another Buffer by mistake.
Callers of DeepEP index its handles, which are tuples there: ``handle[0]`` after a normal dispatch
(the rank prefix matrix), ``handle[0][i]`` and ``handle[1][i]`` after a low-latency one. The handles
here answer the same indices with the same shapes and dtypes; an entry that only DeepEP's kernels
need (its channel tables, its send heads) raises NotImplementedError naming the index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# DeepEP's normal-mode handle tuples, entry by entry: inside one scale-up domain, and across several
# (its internode path). Entries named here and answered by DispatchHandle._entry are kept.
INTRANODE_ENTRIES = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                     "is_token_in_rank", "send_head")
INTERNODE_ENTRIES = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                     "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
                     "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")
LOW_LATENCY_ENTRIES = ("src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts")
_KEPT = {"rank_prefix_matrix", "is_token_in_rank", "recv_gbl_rank_prefix_sum"}


def _position(key: object, length: int, what: str) -> int:
    """A tuple's rule for an index: an int in [-length, length), negatives from the end."""
    if isinstance(key, bool) or not isinstance(key, int):
        raise TypeError(f"{what} indices must be integers, not {type(key).__name__}")
    i = key + length if key < 0 else key
    if not 0 <= i < length:
        raise IndexError(f"{what} index {key} out of range ({length} entries, as DeepEP's)")
    return i


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
    # Rows each source rank sends each destination, [R, R]: a host array or tensor, or an int32 device
    # tensor where the counts never reach the host; None where unknown. Read by handle[0] only.
    count_matrix: Any = None
    # Set by Buffer for DeepEP's tuple layout: this rank, and the scale-up domains of the group
    # (DeepEP's internode tuple with more than one).
    rank: int = 0
    num_domains: int = 1
    # Set by Buffer: the Buffers that take this handle besides its own (Buffer.handle_scope; "" for none).
    scope: str = ""
    _rank_prefix: torch.Tensor | None = field(default=None, init=False, repr=False)

    @property
    def num_recv_rows(self) -> int:
        """Rows of the receive-side tensors (num_worst_tokens when set)."""
        return self.num_worst_tokens or self.num_recv_tokens

    @property
    def rank_prefix_matrix(self) -> torch.Tensor:
        """``[R, R]`` int32 on the Buffer's device: entry [s][d] is the rows ranks 0..s send rank d
        (DeepEP's ``handle[0]``), so rank d's rows from source s are ``[m[s-1][d], m[s][d])`` of its
        output. Made at the first read."""
        if self._rank_prefix is None:
            if self.count_matrix is None:
                raise NotImplementedError("handle[0] (rank_prefix_matrix): the counts of this dispatch were not kept "
                                          "(a num_worst_tokens dispatch captured in a CUDA graph, or on the "
                                          "hierarchical kernels)")
            counts = torch.as_tensor(self.count_matrix, dtype=torch.int64, device=self.is_token_in_rank.device)
            self._rank_prefix = counts.cumsum(0, dtype=torch.int32)
        return self._rank_prefix

    @property
    def deep_ep_entries(self) -> tuple[str, ...]:
        return INTERNODE_ENTRIES if self.num_domains > 1 else INTRANODE_ENTRIES

    def _entry(self, name: str) -> Any:
        if name == "rank_prefix_matrix":
            return self.rank_prefix_matrix
        if name == "is_token_in_rank":
            return self.is_token_in_rank
        # recv_gbl_rank_prefix_sum: [R] int32, the rows received from sources 0..s (inclusive).
        return self.rank_prefix_matrix[:, self.rank].contiguous()

    def __len__(self) -> int:
        return len(self.deep_ep_entries)

    def __getitem__(self, key: object) -> Any:
        entries = self.deep_ep_entries
        name = entries[_position(key, len(entries), "handle")]
        if name not in _KEPT:
            kept = ", ".join(f"handle[{i}] ({n})" for i, n in enumerate(entries) if n in _KEPT)
            raise NotImplementedError(f"handle[{key}] ({name}) has no counterpart in epcomm: it is bookkeeping of "
                                      f"DeepEP's kernels, which epcomm's do not keep; this handle answers {kept}")
        return self._entry(name)

    def __iter__(self):
        # Unpacking reaches the entries DeepEP's kernels need: the error names the first one.
        return (self[i] for i in range(len(self)))


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

    def __len__(self) -> int:
        return len(LOW_LATENCY_ENTRIES)

    def __getitem__(self, key: object) -> Any:
        """DeepEP's tuple: (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts);
        ``handle[0][i]`` and ``handle[1][i]`` are local expert i's rows (valid after the receive)."""
        return getattr(self, LOW_LATENCY_ENTRIES[_position(key, len(LOW_LATENCY_ENTRIES), "handle")])

    def __iter__(self):
        return (self[i] for i in range(len(self)))
