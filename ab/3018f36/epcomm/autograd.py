"""Dispatch and combine as autograd functions, for training.

Dispatch and combine are adjoint: the backward of a dispatch is a combine of the gradient (each
token's gradient is the sum of the gradients of its copies), and the backward of a combine is a
cached dispatch of the gradient (each copy receives its token's gradient).
"""

from __future__ import annotations

from typing import Any

import torch

from .buffer import Buffer
from .config import Config
from .handle import DispatchHandle


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                num_experts: int, config: Config | None):
        per_rank, per_domain, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, expert_counts, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_domain, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights, config=config)
        ctx.buffer, ctx.handle, ctx.config = buffer, handle, config
        ctx.save_for_backward(recv_idx)
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_w, handle, expert_counts

    @staticmethod
    def backward(ctx: Any, grad_recv_x: torch.Tensor | None, _grad_idx: Any, grad_recv_w: torch.Tensor | None,
                 *_unused: Any):
        (recv_idx,) = ctx.saved_tensors
        handle: DispatchHandle = ctx.handle
        rows = handle.num_recv_rows
        if grad_recv_x is None:
            grad_recv_x = torch.zeros((rows, handle.hidden), dtype=torch.bfloat16, device=recv_idx.device)
        if grad_recv_w is None:
            grad_recv_w = torch.zeros(recv_idx.shape, dtype=torch.float32, device=recv_idx.device)
        # A weight reaches the owner of its expert only; the other copies were zeroed in forward.
        grad_recv_w = torch.where(recv_idx >= 0, grad_recv_w.float(), 0.0).contiguous()
        grad_x, grad_w, _ = ctx.buffer.combine(grad_recv_x.to(torch.bfloat16).contiguous(), handle,
                                               topk_weights=grad_recv_w, config=ctx.config)
        return None, grad_x, None, grad_w, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, buffer: Buffer, x: torch.Tensor, handle: DispatchHandle, config: Config | None):
        combined, _, _ = buffer.combine(x, handle, config=config)
        ctx.buffer, ctx.handle, ctx.config = buffer, handle, config
        return combined

    @staticmethod
    def backward(ctx: Any, grad_combined: torch.Tensor):
        grad_x, *_ = ctx.buffer.dispatch(grad_combined.to(torch.bfloat16).contiguous(), handle=ctx.handle,
                                         config=ctx.config)
        return None, grad_x, None, None


def dispatch(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             num_experts: int, config: Config | None = None):
    """Differentiable normal-mode dispatch of bf16 ``x`` [T, H].

    Returns ``(recv_x, recv_topk_idx, recv_topk_weights, handle, num_recv_tokens_per_expert_list)``;
    gradients flow to ``x`` and ``topk_weights``.
    """
    return _Dispatch.apply(buffer, x, topk_idx, topk_weights, num_experts, config)


def combine(buffer: Buffer, x: torch.Tensor, handle: DispatchHandle, config: Config | None = None) -> torch.Tensor:
    """Differentiable normal-mode combine of bf16 rows ``x``; returns ``combined_x`` [T, H] bf16."""
    return _Combine.apply(buffer, x, handle, config)
