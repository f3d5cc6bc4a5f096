"""Exact expectations of how many ranks and domains one token reaches under random top-k routing.

Routing models (both sample each token independently of the others):

* **uniform**: the token's K experts are a uniformly random K-subset of the E experts (top-k of
  i.i.d. scores, i.e. without replacement).
* **node-limited** (``num_groups=G``, DeepSeek-V3 style group-limited gating): first a uniformly
  random G-subset of the D domains is chosen, then the K experts are a uniformly random K-subset of
  the ``G * E / D`` experts living in those domains. A chosen domain may therefore receive no expert
  (probability ``C((G-1)E/D, K) / C(GE/D, K)``); so the expected number of domains reached is
  *below* G. DeepSeek-V3's real gating ranks groups by the sum of their two best expert scores,
  which makes a chosen group almost always receive an expert; with ``G = D`` both models reduce to
  the uniform one.

Experts are laid out contiguously: rank r holds experts ``[r*E/R, (r+1)*E/R)`` and domain d holds
ranks ``[d*R/D, (d+1)*R/D)``, so a rank owns ``E/R`` experts and a domain ``E/D``.

Why exact rather than ``1 - (1 - f)^K`` (sampling with replacement, as the design study in
seed 004 writes it): the approximation undercounts reach probabilities, by ~1% at E=256, K=8 and by
much more for small E, and the planner's byte counts are linear in them. The approximation is kept
as :func:`prob_reach_with_replacement` so the seed's figures can be compared.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Any


def prob_miss(num_experts: int, num_topk: int, num_avoided: int) -> float:
    """P(a uniform K-subset of E experts contains none of ``num_avoided`` given experts).

    Equals ``C(E - m, K) / C(E, K)``, evaluated as a product of K ratios so that it stays exact in
    floating point for any E (no huge binomials, no cancellation).
    """
    if not 0 <= num_avoided <= num_experts:
        raise ValueError(f"num_avoided must be in [0, num_experts={num_experts}], got {num_avoided}")
    if num_topk > num_experts - num_avoided:
        return 0.0
    result = 1.0
    for i in range(num_topk):
        result *= (num_experts - num_avoided - i) / (num_experts - i)
    return result


def prob_reach_with_replacement(fraction: float, num_topk: int) -> float:
    """``1 - (1 - f)^K``: the with-replacement approximation of P(token reaches a unit holding
    fraction ``f`` of the experts). Kept only to compare with hand estimates such as seed 004's."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    return 1.0 - (1.0 - fraction) ** num_topk


def prob_reach_all_of(num_experts: int, num_topk: int, experts_per_unit: int, num_units: int) -> float:
    """P(a uniform K-subset reaches *every one* of ``num_units`` given disjoint units of
    ``experts_per_unit`` experts each), by inclusion-exclusion in exact integer arithmetic:
    ``sum_j (-1)^j C(n, j) C(E - j u, K) / C(E, K)``.

    With ``num_units = R`` and ``experts_per_unit = E / R`` this is P(token reaches all R ranks),
    the only case in which an allgather moves no useless row.
    """
    _check_common(num_experts, num_topk)
    if experts_per_unit < 1 or num_units < 0 or experts_per_unit * num_units > num_experts:
        raise ValueError(f"need experts_per_unit >= 1 and experts_per_unit * num_units <= num_experts={num_experts}, "
                         f"got experts_per_unit={experts_per_unit}, num_units={num_units}")
    total = sum((-1) ** j * math.comb(num_units, j) * math.comb(num_experts - j * experts_per_unit, num_topk)
                for j in range(num_units + 1))
    return total / math.comb(num_experts, num_topk)


def _check_common(num_experts: int, num_topk: int) -> None:
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if not 1 <= num_topk <= num_experts:
        raise ValueError(f"num_topk must be in [1, num_experts={num_experts}], got {num_topk}")


def check_routing(num_experts: int, num_topk: int, num_ranks: int, num_domains: int,
                  num_groups: int | None) -> None:
    """Raise ValueError naming the argument when the routing model is not defined for these sizes."""
    _check_common(num_experts, num_topk)
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if num_domains < 1 or num_ranks % num_domains:
        raise ValueError(f"num_domains must be >= 1 and divide num_ranks={num_ranks}, got {num_domains}")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts must be a multiple of the number of ranks {num_ranks} "
                         f"(experts are spread evenly), got {num_experts}")
    if num_groups is not None:
        if not 1 <= num_groups <= num_domains:
            raise ValueError(f"num_groups (domains a token may use) must be in [1, num_domains={num_domains}], "
                             f"got {num_groups}")
        pool = num_groups * (num_experts // num_domains)
        if num_topk > pool:
            raise ValueError(f"num_topk={num_topk} exceeds the {pool} experts in num_groups={num_groups} domains "
                             f"of {num_experts // num_domains} experts each")


def _prob_miss_sets(num_experts: int, num_topk: int, num_domains: int, num_groups: int | None,
                    avoided_per_domain: tuple[int, ...]) -> float:
    """P(the token avoids a set of experts that has ``avoided_per_domain[i]`` experts in the i-th
    of ``len(avoided_per_domain)`` distinct domains), under either routing model.

    Node-limited: condition on which of the touched domains are among the G chosen ones (the
    untouched domains only change the pool size, which is always ``G * E / D``); each specific
    subset A of the m touched domains is exactly the chosen part with probability
    ``C(D - m, G - |A|) / C(D, G)``, and then the K experts must avoid the ``sum_A`` experts.
    """
    if num_groups is None or num_groups == num_domains:
        return prob_miss(num_experts, num_topk, sum(avoided_per_domain))
    pool = num_groups * (num_experts // num_domains)
    touched = len(avoided_per_domain)
    denominator = math.comb(num_domains, num_groups)
    total = 0.0
    for size in range(min(touched, num_groups) + 1):
        weight = math.comb(num_domains - touched, num_groups - size) / denominator
        if weight == 0.0:
            continue
        for chosen in itertools.combinations(avoided_per_domain, size):
            total += weight * prob_miss(pool, num_topk, sum(chosen))
    return total


@dataclass(frozen=True)
class Expectations:
    """Per-token reach statistics for one routing model, topology shape and expert count.

    ``p_rank``/``p_domain`` are the probabilities that a token reaches a *given* rank/domain; by
    symmetry they are the same for every rank and domain, the local ones included. Everything the
    cost model needs is a linear function of these two numbers.
    """

    num_experts: int
    num_topk: int
    num_ranks: int
    num_domains: int
    num_groups: int | None
    routing: str
    p_rank: float
    p_domain: float
    ranks_per_token: float
    domains_per_token: float
    ranks_per_token_var: float | None
    domains_per_token_var: float | None
    source: str = "exact"

    @property
    def gpus_per_domain(self) -> int:
        return self.num_ranks // self.num_domains

    @property
    def remote_ranks_per_token(self) -> float:
        """Copies of a token that leave its rank: ``(R - 1) p_rank`` (the local copy moves no link)."""
        return (self.num_ranks - 1) * self.p_rank

    @property
    def same_domain_remote_ranks_per_token(self) -> float:
        return (self.gpus_per_domain - 1) * self.p_rank

    @property
    def other_domain_ranks_per_token(self) -> float:
        return (self.num_ranks - self.gpus_per_domain) * self.p_rank

    @property
    def other_domains_per_token(self) -> float:
        return (self.num_domains - 1) * self.p_domain

    @property
    def ranks_per_reached_domain(self) -> float:
        """E[ranks reached in a domain | the domain is reached] = ``g p_rank / p_domain``."""
        return self.gpus_per_domain * self.p_rank / self.p_domain if self.p_domain > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("remote_ranks_per_token", "same_domain_remote_ranks_per_token", "other_domain_ranks_per_token",
                     "other_domains_per_token", "ranks_per_reached_domain"):
            out[name] = getattr(self, name)
        return out


def routing_label(num_domains: int, num_groups: int | None) -> str:
    if num_groups is None or num_groups == num_domains:
        return "uniform"
    return f"node-limited (G={num_groups} of D={num_domains})"


def expectations(num_experts: int, num_topk: int, num_ranks: int, num_domains: int = 1,
                 num_groups: int | None = None) -> Expectations:
    """Exact reach probabilities, means and variances for the routing model described in the
    module docstring (``num_groups=None`` means uniform routing)."""
    check_routing(num_experts, num_topk, num_ranks, num_domains, num_groups)
    gpus = num_ranks // num_domains
    e_rank = num_experts // num_ranks
    e_domain = num_experts // num_domains

    def miss(*avoided: int) -> float:
        return _prob_miss_sets(num_experts, num_topk, num_domains, num_groups, avoided)

    p_rank = 1.0 - miss(e_rank)
    p_domain = 1.0 - miss(e_domain)

    # Var(N) = sum_i P(i) + sum_{i != j} P(i and j) - (sum_i P(i))^2, with
    # P(i and j) = 1 - P(miss i) - P(miss j) + P(miss i and j).
    both_same = 1.0 - 2.0 * miss(e_rank) + miss(2 * e_rank) if gpus > 1 else 0.0
    both_diff = 1.0 - 2.0 * miss(e_rank) + miss(e_rank, e_rank) if num_domains > 1 else 0.0
    mean_ranks = num_ranks * p_rank
    var_ranks = mean_ranks + num_ranks * ((gpus - 1) * both_same + (num_ranks - gpus) * both_diff) - mean_ranks ** 2
    both_domains = 1.0 - 2.0 * miss(e_domain) + miss(e_domain, e_domain) if num_domains > 1 else 0.0
    mean_domains = num_domains * p_domain
    var_domains = mean_domains + num_domains * (num_domains - 1) * both_domains - mean_domains ** 2
    return Expectations(
        num_experts=num_experts, num_topk=num_topk, num_ranks=num_ranks, num_domains=num_domains,
        num_groups=num_groups, routing=routing_label(num_domains, num_groups),
        p_rank=p_rank, p_domain=p_domain, ranks_per_token=mean_ranks, domains_per_token=mean_domains,
        ranks_per_token_var=max(var_ranks, 0.0), domains_per_token_var=max(var_domains, 0.0))


def with_measured(base: Expectations, ranks_per_token: float | None = None,
                  domains_per_token: float | None = None) -> Expectations:
    """Replace the model's means by measured ones (e.g. the mean of ``is_token_in_rank.sum(1)``
    from ``get_dispatch_layout`` on real routing), keeping the symmetry assumption that every rank
    and domain is equally likely. Variances become unknown (None)."""
    if ranks_per_token is None and domains_per_token is None:
        return base
    p_rank, p_domain = base.p_rank, base.p_domain
    if ranks_per_token is not None:
        limit = min(base.num_topk, base.num_ranks)
        if not 0.0 <= ranks_per_token <= limit:
            raise ValueError(f"ranks_per_token must be in [0, min(num_topk, num_ranks)={limit}], got {ranks_per_token}")
        p_rank = ranks_per_token / base.num_ranks
    if domains_per_token is not None:
        limit = min(base.num_topk, base.num_domains)
        if not 0.0 <= domains_per_token <= limit:
            raise ValueError(f"domains_per_token must be in [0, min(num_topk, num_domains)={limit}], "
                             f"got {domains_per_token}")
        p_domain = domains_per_token / base.num_domains
    return Expectations(
        num_experts=base.num_experts, num_topk=base.num_topk, num_ranks=base.num_ranks,
        num_domains=base.num_domains, num_groups=base.num_groups, routing=base.routing + ", measured means",
        p_rank=p_rank, p_domain=p_domain, ranks_per_token=base.num_ranks * p_rank,
        domains_per_token=base.num_domains * p_domain, ranks_per_token_var=None, domains_per_token_var=None,
        source="measured")
