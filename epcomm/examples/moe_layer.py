"""A small expert-parallel MoE layer: router -> dispatch -> per-expert MLP -> combine.

Each rank holds ``num_experts / R`` experts. The expert weights (top-k probabilities) are applied
on the expert's rank before combine, because combine is an unweighted sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import autograd as ep
from ..buffer import Buffer


class ExpertMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, num_experts: int, generator: torch.Generator | None = None) -> None:
        super().__init__()
        # Made where the generator draws (the CPU without one), in fp32, whatever torch's defaults are;
        # .to() moves the layer.
        dev = generator.device if generator is not None else torch.device("cpu")
        self.w_in = nn.Parameter(torch.randn((num_experts, hidden, ffn), generator=generator, dtype=torch.float32,
                                             device=dev) / hidden ** 0.5)
        self.w_out = nn.Parameter(torch.randn((num_experts, ffn, hidden), generator=generator, dtype=torch.float32,
                                              device=dev) / ffn ** 0.5)

    def forward(self, e: int, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(h @ self.w_in[e]) @ self.w_out[e]


class ExpertParallelMoE(nn.Module):
    """MoE layer whose experts are spread over the ranks of ``buffer.group``."""

    def __init__(self, buffer: Buffer, hidden: int, ffn: int, num_experts: int, num_topk: int,
                 router: nn.Linear, experts: ExpertMLP) -> None:
        super().__init__()
        num_ranks = dist.get_world_size(buffer.group)
        if num_experts % num_ranks:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the group size ({num_ranks})")
        self.buffer, self.num_experts, self.num_topk = buffer, num_experts, num_topk
        self.router = router
        self.experts = experts  # the local experts only: [E / R, ...]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x), dim=-1)
        topk_w, topk_idx = probs.topk(self.num_topk, dim=-1)
        recv_x, recv_idx, recv_w, handle, _ = ep.dispatch(self.buffer, x.to(torch.bfloat16), topk_idx,
                                                          topk_w.float().contiguous(), self.num_experts)
        h = recv_x.float()
        out = torch.zeros_like(h)
        for e in range(self.experts.w_in.shape[0]):
            hit = recv_idx == e  # [rows, K]
            rows = torch.nonzero(hit.any(1)).flatten()
            if rows.numel():
                weight = (recv_w[rows] * hit[rows]).sum(1, keepdim=True)
                out = out.index_add(0, rows, weight * self.experts(e, h[rows]))
        return ep.combine(self.buffer, out.to(torch.bfloat16), handle).float()


def dense_moe(x: torch.Tensor, router: nn.Linear, experts: ExpertMLP, num_topk: int) -> torch.Tensor:
    """The same layer computed in one process over all experts: the oracle for ``ExpertParallelMoE``."""
    probs = torch.softmax(router(x), dim=-1)
    topk_w, topk_idx = probs.topk(num_topk, dim=-1)
    h = x.to(torch.bfloat16).float()
    out = torch.zeros_like(h)
    for k in range(num_topk):
        for e in torch.unique(topk_idx[:, k]).tolist():
            rows = torch.nonzero(topk_idx[:, k] == e).flatten()
            out = out.index_add(0, rows, topk_w[rows, k:k + 1] * experts(e, h[rows]))
    return out
