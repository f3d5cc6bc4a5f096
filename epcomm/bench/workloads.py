"""What is measured: the configurations of a run and their inputs.

Inputs are a pure function of (seed, rank, shape), so every rank can rebuild every other rank's
inputs and check its own outputs against a single-process reference without any extra
communication. This is a bench-local copy of the builder in tests/routing.py (the package must not
import from tests/), restricted to the benchmark's routing: scores ~ U(0, 1), top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NORMAL, LOW_LATENCY = "normal", "low_latency"
MODES = (NORMAL, LOW_LATENCY)
# What a case runs: the Buffer, the plain all_to_all_single baseline, the allgather baseline
# (all_gather_into_tensor for dispatch, reduce_scatter_tensor for combine), Megatron-LM's
# alltoall dispatcher sequence (bench/megatron.py; normal mode), or a plain copy of x on the device
# (normal mode, one rank: what no communication costs, the yardstick of the portable path there).
EPCOMM, A2A, AG, MEGATRON, COPY = "epcomm", "a2a", "allgather", "megatron", "copy"
DEEP_EP = "deep_ep"  # DeepEP's own Buffer (normal mode), run beside epcomm where it is importable
BASELINES = (A2A, AG, MEGATRON, COPY)
ALLTOALL, ALLGATHER, HIERARCHICAL = "alltoall", "allgather", "hierarchical"
STRATEGIES = (ALLTOALL, ALLGATHER, HIERARCHICAL)  # Buffer(strategy=...) of the normal-mode epcomm cases


@dataclass(frozen=True)
class Case:
    """One measured configuration; sent to every rank, so it stays a plain picklable value."""

    mode: str  # NORMAL or LOW_LATENCY
    kind: str  # EPCOMM, a baseline (A2A, AG) or the peer DEEP_EP
    num_tokens: int  # per rank (low-latency: also num_max_dispatch_tokens_per_rank)
    hidden: int
    num_topk: int
    num_experts: int
    num_sms: int | None  # Buffer.set_num_sms value; None for the baseline (NCCL picks its own)
    dtype: str  # dispatch dtype: "bf16" or "fp8" (the baseline is always bf16)
    warmup: int
    iters: int
    seed: int
    backend: str  # Buffer(backend=...)
    strategy: str = ALLTOALL  # Buffer(strategy=...); the baseline's data movement for A2A/AG
    diagnose: bool = False  # also measure the low-latency wait-cost statistics
    straggler: int | None = None  # rank that sleeps before every call (--straggler)
    straggler_delay_us: float = 0.0
    ranks_per_domain: int = 0  # EPCOMM_RANKS_PER_DOMAIN of the ranks; 0: one domain per host
    num_groups: int | None = None  # node-limited routing: experts of at most this many domains per token

    @property
    def baseline(self) -> bool:
        return self.kind in BASELINES

    def describe(self) -> str:
        if self.kind == A2A:
            who = "a2a-baseline"
        elif self.kind == AG:
            who = "allgather-baseline"
        elif self.kind == MEGATRON:
            who = "megatron-a2a-baseline"
        elif self.kind == COPY:
            who = "copy-baseline"
        elif self.kind == DEEP_EP:
            who = f"deep_ep {self.dtype}"
        else:
            who = f"epcomm {self.dtype}" + (f" {self.strategy}" if self.strategy != ALLTOALL else "")
        sms = "" if self.num_sms is None else f" sms={self.num_sms}"
        return (f"{self.mode} {who} T={self.num_tokens} H={self.hidden} K={self.num_topk} "
                f"E={self.num_experts}{sms}")


@dataclass
class RankInputs:
    x: torch.Tensor  # [T, H] bf16, random normal (never all zeros, so a dropped row shows)
    topk_idx: torch.Tensor  # [T, K] int64
    topk_weights: torch.Tensor  # [T, K] f32 in (0, 1)


ROUTINGS = ("random", "one_expert", "imbalanced", "empty_rank", "all_dropped")


def make_pattern_topk_idx(gen: torch.Generator, num_tokens: int, num_experts: int, num_topk: int, num_ranks: int,
                          routing: str) -> torch.Tensor:
    """Top-k expert ids [T, K] int64 for a named routing pattern (the tests' and the pressure test's);
    -1 marks unused slots. "random" drops about 10% of the slots."""
    if num_tokens == 0:
        return torch.empty((0, num_topk), dtype=torch.int64, device="cpu")
    scores = torch.rand((num_tokens, num_experts), generator=gen, dtype=torch.float32, device="cpu")
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
        drop = torch.rand((num_tokens, num_topk), generator=gen, dtype=torch.float32, device="cpu") < 0.1
        idx = torch.where(drop, torch.full_like(idx, -1), idx)
    return idx.to(torch.int64)


def make_topk_idx(gen: torch.Generator, num_tokens: int, num_experts: int, num_topk: int,
                  num_domains: int = 1, num_groups: int | None = None) -> torch.Tensor:
    """The benchmark's random routing: per token, the top-k of U(0, 1) scores over all experts.

    Node-limited (DeepSeek-V3's group-limited gating) with ``num_groups``: the experts are split
    into ``num_domains`` groups, one per scale-up domain; each token keeps the ``num_groups`` groups
    whose two best scores sum highest, and picks its top-k among their experts only.
    """
    scores = torch.rand((num_tokens, num_experts), generator=gen, dtype=torch.float32, device="cpu")
    if num_groups is not None and num_groups < num_domains and num_tokens:
        grouped = scores.view(num_tokens, num_domains, num_experts // num_domains)
        best = grouped.topk(min(2, grouped.shape[2]), dim=2).values.sum(2)
        keep = torch.zeros((num_tokens, num_domains), dtype=torch.bool, device="cpu")
        keep.scatter_(1, best.topk(num_groups, dim=1).indices, True)
        scores = torch.where(keep.unsqueeze(2), grouped, torch.full_like(grouped, -1.0)).view(num_tokens, -1)
    return scores.topk(num_topk, dim=1).indices.to(torch.int64)


def make_rank_inputs(seed: int, rank: int, num_tokens: int, hidden: int, num_experts: int,
                     num_topk: int, num_domains: int = 1, num_groups: int | None = None) -> RankInputs:
    """Inputs of ``rank``, identical on whichever process builds them (CPU generator, fixed order)."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 1000 + rank)
    x = torch.randn((num_tokens, hidden), generator=gen, dtype=torch.float32, device="cpu").to(torch.bfloat16)
    topk_idx = make_topk_idx(gen, num_tokens, num_experts, num_topk, num_domains, num_groups)
    weights = torch.rand((num_tokens, num_topk), generator=gen, dtype=torch.float32, device="cpu")
    return RankInputs(x, topk_idx, weights)


_cache: dict[tuple, list[RankInputs]] = {}


def all_rank_inputs(case: Case, num_ranks: int, device: torch.device) -> list[RankInputs]:
    """Every rank's inputs on ``device``; the last set is cached because consecutive cases share it."""
    num_domains = num_ranks // case.ranks_per_domain if case.ranks_per_domain else 1
    key = (case.seed, case.mode, num_ranks, case.num_tokens, case.hidden, case.num_experts, case.num_topk,
           num_domains, case.num_groups, str(device))
    if key not in _cache:
        _cache.clear()
        # Low-latency inputs come from another seed stream than normal-mode ones of the same shape.
        seed = case.seed + (7919 if case.mode == LOW_LATENCY else 0)
        built = []
        for r in range(num_ranks):
            inp = make_rank_inputs(seed, r, case.num_tokens, case.hidden, case.num_experts, case.num_topk,
                                   num_domains, case.num_groups)
            built.append(RankInputs(inp.x.to(device), inp.topk_idx.to(device), inp.topk_weights.to(device)))
        _cache[key] = built
    return _cache[key]


def plan_cases(modes: list[str], tokens: list[int], ll_tokens: list[int], hiddens: list[int], num_topk: int,
               num_experts: int, ll_experts: int, num_sms: list[int], dtypes: list[str], warmup: int,
               iters: int, seed: int, backend: str, strategies: list[str] | tuple[str, ...] = (ALLTOALL,),
               diagnose: bool = False, straggler: int | None = None, straggler_delay_us: float = 0.0,
               with_deep_ep: bool = False, ranks_per_domain: int = 0, num_groups: int | None = None,
               num_ranks: int = 0) -> list[Case]:
    """Cases in run order: for each shape, the baselines first (normal mode: also Megatron-LM's sequence,
    and on ``num_ranks`` 1 a device copy of x), then epcomm per SM count, dtype and strategy.

    Low-latency dispatch is FP8, as the benchmark's method has it, whatever ``dtypes`` says; strategies
    apply to normal mode only (the allgather baseline runs when ``allgather`` is among them).
    """
    for strategy in strategies:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategies must be drawn from {STRATEGIES}, got {strategy!r}")
    cases = []
    for mode in modes:
        counts, experts = (tokens, num_experts) if mode == NORMAL else (ll_tokens, ll_experts)
        mode_dtypes = dtypes if mode == NORMAL else ["fp8"]
        mode_strategies = list(strategies) if mode == NORMAL else [ALLTOALL]
        for hidden in hiddens:
            for t in counts:
                common = dict(mode=mode, num_tokens=t, hidden=hidden, num_topk=num_topk, num_experts=experts,
                              warmup=warmup, iters=iters, seed=seed, backend=backend, diagnose=diagnose,
                              straggler=straggler, straggler_delay_us=straggler_delay_us,
                              ranks_per_domain=ranks_per_domain, num_groups=num_groups)
                cases.append(Case(kind=A2A, num_sms=None, dtype="bf16", **common))
                if mode == NORMAL:
                    cases.append(Case(kind=MEGATRON, num_sms=None, dtype="bf16", **common))
                if mode == NORMAL and num_ranks == 1:
                    cases.append(Case(kind=COPY, num_sms=None, dtype="bf16", **common))
                if ALLGATHER in mode_strategies:
                    cases.append(Case(kind=AG, num_sms=None, dtype="bf16", strategy=ALLGATHER, **common))
                for sms in num_sms:
                    for dtype in mode_dtypes:
                        for strategy in mode_strategies:
                            cases.append(Case(kind=EPCOMM, num_sms=sms, dtype=dtype, strategy=strategy, **common))
                        if with_deep_ep and mode == NORMAL:
                            cases.append(Case(kind=DEEP_EP, num_sms=sms, dtype=dtype, **common))
    return cases
