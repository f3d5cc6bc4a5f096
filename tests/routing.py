"""Inputs shared by the tests and the benchmark's checks: every rank can rebuild every rank's inputs."""

from __future__ import annotations

import torch

# The routing patterns live in the package: the pressure test draws them too.
from epcomm.bench.checks import same_bits
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


def combined_matches(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor | None) -> bool:
    """Bitwise, or (a combine by partial sums on several ranks) within ``bound`` (partials_bound)."""
    if bound is None:
        return got.shape == ref.shape and same_bits(got, ref)
    if got.shape != ref.shape or not bool(torch.isfinite(got).all()):
        return False
    error = (got.float() - ref.float()).abs()
    return bool((error <= 2**-7 * (bound + ref.float().abs()) + 1e-30).all())


def partials_bound(x, topk_idx, weights, expert_scale) -> torch.Tensor:
    """What the partials of a combine by partial sums (EPCOMM_LL_COMBINE_PARTIALS) can add up to,
    per channel: sum over the token's pairs of |w| * |expert output|, the output being the
    dispatched row times expert_scale(local expert) (x, or its FP8 round trip: under twice |x|, FP8
    subnormals included) rounded to bf16. Each rank's partial is rounded to bf16 once (2^-8 of
    itself), the output once more (2^-8 of itself): the error stays within 2^-8 (bound + 2 |ref|),
    and combined_matches allows 2^-7 (bound + |ref|)."""
    valid = (topk_idx >= 0).float()
    coef = (weights.abs() * expert_scale(topk_idx.clamp(min=0)) * valid).sum(dim=1, keepdim=True)
    return coef * x.float().abs() * 2
