"""The reference backend behind the interface of backends/base.py: thin adapters over the functions
of normal.py (or a strategy's module) and low_latency.py, sharing the Buffer's ReferenceBackend."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from ...handle import LowLatencyHandle
from . import allgather, hierarchical, low_latency, normal, shrink
from .backend import ReferenceBackend, in_graph

# The module of each normal-mode strategy (the same functions, the same results).
_STRATEGIES: dict[str, ModuleType] = {"alltoall": normal, "allgather": allgather, "hierarchical": hierarchical}


class ReferenceNormalOps:
    """Normal mode on torch.distributed collectives, by ``strategy``."""

    on_kernels = False
    frees_after_meeting = False
    handles_outlive_buffer = True

    def __init__(self, backend: ReferenceBackend, strategy: str) -> None:
        self.backend = backend
        self.strategy = _STRATEGIES.get(strategy, normal)

    @property
    def traffic(self) -> dict[str, int]:
        """Rows and bytes each tier moved in the latest call (the strategies that count them)."""
        return self.backend.traffic

    def get_dispatch_layout(self, topk_idx, num_experts, ranks_per_domain):
        return normal.dispatch_layout(topk_idx, num_experts, self.backend.num_ranks, ranks_per_domain)

    def dispatch(self, x, scales, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                 topk_weights, expert_alignment, num_worst_tokens, num_experts, buffer_uid, num_sms):
        def call(masked):
            per_rank, in_rank, per_expert = num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert
            if masked and handle is None:
                per_rank, in_rank, per_expert = shrink.mask_routing(self.backend, masked, num_experts, per_rank,
                                                                    in_rank, per_expert)
            return self.strategy.dispatch(self.backend, x, scales, handle, per_rank, in_rank, per_expert, topk_idx,
                                          topk_weights, expert_alignment, num_worst_tokens, num_experts, buffer_uid)

        return self._run("dispatch", call)

    def combine(self, x, handle, topk_weights, biases, num_sms):
        return self._run("combine", lambda masked: self.strategy.combine(self.backend, x, handle, topk_weights,
                                                                         biases))

    def _run(self, op: str, call):
        """``call(masked ranks)``, through enable_shrink's failed-rank masking where the Buffer has it."""
        if in_graph(self.backend.device):
            if self.strategy is not normal or self.backend.mask is not None:
                raise RuntimeError(f"epcomm {op}: inside a CUDA graph the portable path runs strategy='alltoall' "
                                   "without enable_shrink (its masking agrees on the host)")
            return call([])
        if self.backend.mask is None:
            return call([])
        if self.strategy is not normal:
            raise RuntimeError(f"epcomm {op}: enable_shrink masks failed ranks in normal mode with "
                               "strategy='alltoall' only on the portable path; create the Buffer with it, or "
                               "without enable_shrink")
        return shrink.run_masked(self.backend, op, call)

    def barrier(self, op: str) -> None:
        pass

    def check_errors(self, op: str) -> None:
        pass

    def local_memory(self, rdma: bool) -> torch.Tensor | None:
        return None  # rows travel through torch.distributed: no memory of this rank's is written by peers

    def close(self) -> None:
        pass


class ReferenceLowLatencyOps:
    """Low-latency mode on torch.distributed collectives; the hook completes the all-to-all."""

    on_kernels = False
    transport = "reference"

    def __init__(self, backend: ReferenceBackend) -> None:
        self.backend = backend

    def remote_ranks(self) -> list[int]:
        return []

    def check_dispatch_args(self, x, topk_idx, num_max_tokens, num_experts) -> None:
        pass

    def check_combine_args(self, x, handle, out) -> None:
        if "send_pos" not in handle.backend_state:  # the dispatch's receive derives what the combine sends
            raise ValueError("low_latency_combine: the dispatch of this handle has not been received yet; call its "
                             "receive hook first")

    def dispatch(self, x, topk_idx, num_max_tokens, num_experts, cumulative_stats, wait_stats, use_fp8, round_scale,
                 use_ue8m0, slot, mask, buffer_uid, hook):
        if self.backend.transport.live is not None and mask is not None and not bool(mask.any()):
            self.backend.transport.use(list(range(self.backend.num_ranks)))  # cleaned: the whole group again
        if self.backend.transport.live is not None:
            raise RuntimeError("epcomm low_latency_dispatch: normal mode masked a failed rank on this Buffer; "
                               "the portable low-latency calls run on the whole group only (clean the mask first)")
        masked = None
        if mask is not None and in_graph(mask.device):  # a graph reads the mask on the device
            masked = mask != 0
        elif mask is not None:  # the ranks masked now, or None when none is
            masked = mask.cpu() != 0
            masked = masked if bool(masked.any()) else None
        recv_x, recv_count, handle, finish, wait_ns = low_latency.dispatch(
            self.backend, x, topk_idx, num_max_tokens, num_experts, use_fp8, round_scale, use_ue8m0, masked,
            buffer_uid, defer_receive=hook)
        handle.backend_state["topk_idx"] = topk_idx.clone()  # a combine's topk_idx is compared with it

        def complete() -> None:
            finish()
            if cumulative_stats is not None:
                cumulative_stats.add_(recv_count)
            if wait_stats is not None and not in_graph(wait_stats.device):  # a graph has no arrivals
                wait_stats.add_(wait_ns.to(wait_stats.device))

        return recv_x, recv_count, handle, complete

    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: LowLatencyHandle,
                out: torch.Tensor | None, slot: int, mask: torch.Tensor | None, wait_stats: torch.Tensor | None,
                hook: bool, overlap=None):
        if overlap is not None and in_graph(x.device):
            raise RuntimeError("epcomm low_latency_combine: overlap=True on the portable path polls the signals "
                               "from the host, which a CUDA graph cannot; capture without overlap")
        if overlap is not None:  # x is read once the expert GEMM has computed it
            low_latency.wait_computed(overlap, handle, self.backend.transport.timeout_s)
        combined, finish, wait_ns = low_latency.combine(self.backend, x, topk_idx, topk_weights, handle, out,
                                                        defer_receive=hook)

        def complete() -> None:
            finish()
            if wait_stats is not None and not in_graph(wait_stats.device):
                wait_stats.add_(wait_ns.to(wait_stats.device))

        return combined, complete

    def local_memory(self, rdma: bool) -> torch.Tensor | None:
        return None

    def clean(self, meet: Callable[[str], None]) -> bool:
        return False  # nothing on the device to reset; the calls keep their numbers

    def close(self) -> None:
        pass
