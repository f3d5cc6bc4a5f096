"""Inputs shared by the tests and the benchmark's checks: every rank can rebuild every rank's inputs."""

from __future__ import annotations

import torch

# The routing patterns live in the package: the pressure test draws them too.
from epcomm.bench.workloads import make_pattern_topk_idx as make_topk_idx
from epcomm.utils.launch import group_device


def make_inputs(seed: int, rank: int, num_tokens: int, hidden: int, num_experts: int, num_topk: int,
                num_ranks: int, routing: str):
    gen = torch.Generator(device="cpu").manual_seed(seed * 1000 + rank)
    x = (torch.randn((num_tokens, hidden), generator=gen, dtype=torch.float32, device="cpu") * 2).to(torch.bfloat16)
    topk_idx = make_topk_idx(gen, num_tokens, num_experts, num_topk, num_ranks, routing)
    weights = torch.rand((num_tokens, num_topk), generator=gen, dtype=torch.float32, device="cpu")
    return x, topk_idx, weights


def device() -> torch.device:
    """The device of the group's tensors: the rank's GPU under NCCL (or gloo shared GPUs), else the CPU."""
    return group_device()
