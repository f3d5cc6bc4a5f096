"""The one interface ``Buffer`` runs each mode through: ``NormalOps`` and ``LowLatencyOps``.

``Buffer`` checks the API's arguments, handles streams and events, and hands the data movement to
one implementation per mode, picked once when it is built (``epcomm.backends.make_ops``): the CUDA
kernels (backends/cuda) or the portable torch.distributed path (backends/reference). The
implementations take arguments the API has already checked.

``on_kernels`` tells the three things that differ for the caller, never which backend runs:
  * input values (top-k ids, counts) are checked on the device, not read on the host (a host read
    would sync and cannot be captured in a CUDA graph);
  * a rank that refuses its arguments needs no handshake: the peers' bounded waits name it;
  * the implementation holds memory its peers write into, freed collectively (``lifecycle``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..handle import DispatchHandle, LowLatencyHandle
from .reference.backend import Op

Finish = Callable[[], None]


@dataclasses.dataclass(frozen=True)
class CombineOverlap:
    """low_latency_combine's single-batch overlap, checked (ArgumentChecks._check_ll_overlap): the rows of
    local expert e in block b (rows [b * block_m, (b + 1) * block_m) of its receive layout) are sent once
    the expert GEMM has raised ``signals[e * signals_per_expert + b]`` to at least ``threshold``."""

    signals: torch.Tensor  # comp_signal (int32) or src_signals (uint32 or int32), contiguous
    signals_per_expert: int  # ceil(N * R / block_m) with comp_signal; 1 with src_signals
    block_m: int  # rows a word covers: N * R with src_signals (the whole expert)
    threshold: int  # in [1, 2**31) with comp_signal, [1, 2**32) with src_signals
    packed_recv_count: torch.Tensor | None  # [E_local] int32, the rows the GEMM computes; None: every row
    num_sms: int  # the send kernel's blocks (0: one per (local expert, source))


class NormalOps(Protocol):
    """Normal mode: get_dispatch_layout, dispatch (fresh or cached), combine."""

    on_kernels: bool
    frees_after_meeting: bool  # (on_kernels) destroy meets every rank before close(), not after a barrier
    # A handle's state holds none of the Buffer's memory: a later Buffer of the same group and kind takes
    # it (DeepEP's handles are plain tensors; Megatron-LM's get_buffer replaces a Buffer mid-step).
    handles_outlive_buffer: bool

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, ranks_per_domain: int) -> tuple:
        """(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [domains] int32 or None,
        num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)."""
        ...

    def dispatch(self, x: torch.Tensor, scales: torch.Tensor | None, handle: DispatchHandle | None,
                 num_tokens_per_rank: torch.Tensor | None, is_token_in_rank: torch.Tensor | None,
                 num_tokens_per_expert: torch.Tensor | None, topk_idx: torch.Tensor | None,
                 topk_weights: torch.Tensor | None, expert_alignment: int, num_worst_tokens: int, num_experts: int,
                 buffer_uid: str, num_sms: int) -> tuple:
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle), as
        Buffer.dispatch returns them without the event; a cached dispatch gives its handle back, which
        Buffer replaces with None (DeepEP's result). A fresh handle's count_matrix is set where the
        counts are known (handle[0] needs it)."""
        ...

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None,
                biases: tuple[torch.Tensor, ...], num_sms: int) -> tuple:
        """(combined_x [T, H] bf16, combined_topk_weights [T, K] f32 or None)."""
        ...

    def barrier(self, op: str) -> None:
        """(on_kernels) Meet every rank, raising what the kernels reported."""
        ...

    def local_memory(self, rdma: bool) -> torch.Tensor | None:
        """This rank's uint8 memory the peers write into: the ``num_nvl_bytes`` one, or with ``rdma``
        the ``num_rdma_bytes`` one; None where this implementation holds none (get_local_buffer_tensor)."""
        ...

    def check_errors(self, op: str) -> None:
        """(on_kernels) Raise what the kernels reported since the last check."""
        ...

    def close(self) -> None:
        """(on_kernels) Free the memory the peers write into; every rank is done with it."""
        ...


class LowLatencyOps(Protocol):
    """Low-latency mode: a dispatch and a combine per call, each with an optional receive hook."""

    on_kernels: bool
    transport: str  # how the calls reach the peers: "ipc", "nvshmem" or "reference"

    def remote_ranks(self) -> list[int]:
        """The ranks reached by NVSHMEM puts (the others by direct stores)."""
        ...

    def check_dispatch_args(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_tokens: int,
                            num_experts: int) -> None:
        """What the implementation needs beyond the API's checks (ValueError)."""
        ...

    def check_combine_args(self, x: torch.Tensor, handle: LowLatencyHandle, out: torch.Tensor | None) -> None:
        ...

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_tokens: int, num_experts: int,
                 cumulative_stats: torch.Tensor | None, wait_stats: torch.Tensor | None, use_fp8: bool,
                 round_scale: bool, use_ue8m0: bool, slot: int, mask: torch.Tensor | None, buffer_uid: str,
                 hook: bool) -> tuple[Any, torch.Tensor, LowLatencyHandle, Finish]:
        """Send, and receive unless ``hook``; returns (recv_x, recv_count, handle, finish): finish
        completes the receive (the hook's work) and updates both statistics; call it once."""
        ...

    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                handle: LowLatencyHandle, out: torch.Tensor | None, slot: int, mask: torch.Tensor | None,
                wait_stats: torch.Tensor | None, hook: bool,
                overlap: CombineOverlap | None = None) -> tuple[torch.Tensor, Finish]:
        """(combined_x [T, H] bf16, finish), as dispatch. With ``overlap`` the rows of ``x`` are read
        only once the expert GEMM has raised their signals (a bounded wait: RuntimeError)."""
        ...

    def local_memory(self, rdma: bool) -> torch.Tensor | None:
        """As NormalOps.local_memory."""
        ...

    def clean(self, meet: Callable[[str], None]) -> bool:
        """clean_low_latency_buffer's reset; whether it restarted the calls from the first (then every
        rank met through ``meet``)."""
        ...

    def close(self) -> None:
        ...


__all__ = ["CombineOverlap", "Finish", "LowLatencyOps", "NormalOps", "Op"]
