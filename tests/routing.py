"""Inputs shared by the tests and the benchmark's checks: every rank can rebuild every rank's inputs."""

from __future__ import annotations

import torch
import torch.distributed as dist

ROUTINGS = ("random", "one_expert", "imbalanced", "empty_rank", "all_dropped")


def make_topk_idx(gen: torch.Generator, num_tokens: int, num_experts: int, num_topk: int, num_ranks: int,
                  routing: str) -> torch.Tensor:
    """Top-k expert ids [T, K] int64 for a named routing pattern; -1 marks unused slots."""
    if num_tokens == 0:
        return torch.empty((0, num_topk), dtype=torch.int64)
    scores = torch.rand((num_tokens, num_experts), generator=gen)
    experts_per_rank = num_experts // num_ranks
    if routing == "imbalanced":  # rank 0's experts win almost always
        scores[:, :experts_per_rank] += 0.9
    if routing == "empty_rank":  # nobody routes to the last rank
        scores[:, num_experts - experts_per_rank:] = -1
    idx = scores.topk(num_topk, dim=1).indices
    if routing == "one_expert":
        idx[:, 0] = 0
        idx[:, 1:] = -1
    elif routing == "all_dropped":
        idx[:] = -1
    else:  # drop ~10% of the slots
        drop = torch.rand((num_tokens, num_topk), generator=gen) < 0.1
        idx = torch.where(drop, torch.full_like(idx, -1), idx)
    return idx.to(torch.int64)


def make_inputs(seed: int, rank: int, num_tokens: int, hidden: int, num_experts: int, num_topk: int,
                num_ranks: int, routing: str):
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = (torch.randn((num_tokens, hidden), generator=gen) * 2).to(torch.bfloat16)
    topk_idx = make_topk_idx(gen, num_tokens, num_experts, num_topk, num_ranks, routing)
    weights = torch.rand((num_tokens, num_topk), generator=gen).to(torch.float32)
    return x, topk_idx, weights


def device() -> torch.device:
    """The device of the group's tensors: the rank's GPU under NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
