"""What ``Buffer(backend="auto")`` decides besides the kernels' vote (lifecycle.py): the group's scale-up
domains, the normal-mode strategy of a Buffer that did not pass ``strategy=``, each mode's reason, and
the one log line that says them.

Everything here is a function of values every rank shares once the construction's exchange is done
(each rank's host, the group size, EPCOMM_RANKS_PER_DOMAIN, the Buffer's agreed arguments, the vote),
so every rank reaches the same choice without another exchange.

The portable path's strategy is the planner's (epcomm.planner) fastest for the group's domains. The
Buffer cannot measure its links at construction nor know the layer it will serve, so the planner
prices the links EPCOMM_LINKS names: a preset or a topology file, by default ``h800-cx7``
(NVLink-class links inside a host, a 400 Gb/s NIC per GPU between hosts, whose ratio is what ranks the
strategies), and its default workload (the benchmark's shape: 4096 tokens of 7168 channels, top-8 of
256 experts, rounded up to a multiple of the ranks).
Domains that split one host (EPCOMM_RANKS_PER_DOMAIN) share that host's links, as the planner's
``split`` presets do: their tiers' times add up; links of one tier only (a single-domain preset) join
the domains too.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

from .backends.cuda.availability import LOW_LATENCY, NORMAL

_log = logging.getLogger("epcomm")
_MODES = (NORMAL, LOW_LATENCY)
_PLANNED_EXPERTS = 256  # the planner's default workload; rounded up to a multiple of the group size
# The planner's names for the portable path's strategies (Buffer's strategy= values).
_FROM_PLANNER = {"flat": "alltoall", "allgather": "allgather", "hierarchical": "hierarchical"}


@dataclasses.dataclass(frozen=True)
class Domains:
    """The group's scale-up domains: ``ranks_per_domain`` consecutive ranks each."""

    num_ranks: int
    ranks_per_domain: int
    num_hosts: int
    from_env: bool  # EPCOMM_RANKS_PER_DOMAIN, else the hosts
    shared_links: bool  # some host holds ranks of several domains: its links carry both tiers
    spans_hosts: bool  # some domain holds ranks of several hosts

    @property
    def num_domains(self) -> int:
        return self.num_ranks // self.ranks_per_domain

    def describe(self) -> str:
        text = (f"{self.num_domains} domain{'s' if self.num_domains > 1 else ''} of {self.ranks_per_domain} "
                f"rank{'s' if self.ranks_per_domain > 1 else ''} on {self.num_hosts} host"
                f"{'s' if self.num_hosts > 1 else ''}")
        if self.from_env:
            text += " (EPCOMM_RANKS_PER_DOMAIN)"
        if self.num_domains > 1 and self.shared_links:
            text += ", sharing the host's links"
        return text


def default_ranks_per_domain(hosts: Sequence[int]) -> int:
    """One domain per host when every host holds as many ranks, else one domain of the whole group. The
    same on every rank (a count of this rank's host alone would differ between uneven hosts)."""
    counts = {hosts.count(host) for host in hosts}
    return counts.pop() if len(counts) == 1 else len(hosts)


def detect_domains(hosts: Sequence[int], ranks_per_domain: int, from_env: bool) -> Domains:
    """The domains of a group whose rank r runs on ``hosts[r]``, of ``ranks_per_domain`` ranks each."""
    domain_hosts: dict[int, set[int]] = {}
    host_domains: dict[int, set[int]] = {}
    for rank, host in enumerate(hosts):
        domain_hosts.setdefault(rank // ranks_per_domain, set()).add(host)
        host_domains.setdefault(host, set()).add(rank // ranks_per_domain)
    return Domains(num_ranks=len(hosts), ranks_per_domain=ranks_per_domain, num_hosts=len(host_domains),
                   from_env=from_env, shared_links=any(len(d) > 1 for d in host_domains.values()),
                   spans_hosts=any(len(h) > 1 for h in domain_hosts.values()))


def kernel_strategy(domains: Domains, num_rdma_bytes: int, low_latency_mode: bool) -> str:
    """The strategy the kernels are asked for when the caller passed none: across hosts, where each
    domain lies in one host and the Buffer reserves the inter-domain buffer, the hierarchical kernels
    (DeepEP's internode choice); else the intranode all-to-all."""
    across = domains.num_hosts > 1 and domains.num_domains > 1 and not domains.spans_hosts
    return "hierarchical" if across and num_rdma_bytes > 0 and not low_latency_mode else "alltoall"


@functools.lru_cache(maxsize=16)
def links_topology(links: str):
    """The planner Topology whose tiers EPCOMM_LINKS names (a preset, or a .toml / .json file); ValueError
    naming the choices otherwise."""
    from .planner import load_topology, preset, preset_names

    if links in preset_names():
        return preset(links)
    if links.endswith((".toml", ".json", ".yaml", ".yml")):
        return load_topology(links)
    raise ValueError(f"EPCOMM_LINKS={links!r} is neither a planner preset ({', '.join(preset_names())}) nor a "
                     "topology file (.toml or .json)")


@functools.lru_cache(maxsize=64)
def planned_strategy(domains: Domains, links: str = "h800-cx7") -> tuple[str, str]:
    """(strategy, why): the planner's fastest normal-mode strategy for these domains, on the links
    ``links`` names (EPCOMM_LINKS) and the workload the module docstring names. A planner that fails
    keeps the all-to-all, and says so."""
    try:
        from .planner import Workload, plan

        base = links_topology(links)
        num_ranks, num_domains = domains.num_ranks, domains.num_domains
        if num_domains == 1:
            topology = dataclasses.replace(base, name="portable", num_domains=1, gpus_per_domain=num_ranks,
                                           inter=None, shared_links=False)
        else:
            topology = dataclasses.replace(
                base, name="portable", num_domains=num_domains, gpus_per_domain=domains.ranks_per_domain,
                inter=base.intra if domains.shared_links or base.inter is None else base.inter,
                shared_links=domains.shared_links)
        experts = num_ranks * -(-_PLANNED_EXPERTS // num_ranks)
        report = plan(topology, Workload(num_experts=experts))
    except Exception as error:  # the Buffer still works: the all-to-all is the default
        return "alltoall", f"the default (the planner failed: {type(error).__name__}: {error})"
    ranked = sorted(report.strategies, key=lambda s: s.total_us)
    priced = ", ".join(f"{_FROM_PLANNER[s.name]} {s.total_us:.0f} us" for s in ranked if not s.reference_only)
    return (_FROM_PLANNER[report.recommendation],
            f"the planner's fastest for {domains.describe()} ({priced}: predicted dispatch + combine on "
            f"{links}-like links)")


def blocked_reason(per_rank: Sequence[str | None]) -> str:
    """Why the kernels cannot run a mode, from each rank's reason (None: that rank could), ranks with
    the same reason named together."""
    ranks_by_reason: dict[str, list[int]] = {}
    for rank, reason in enumerate(per_rank):
        if reason:
            ranks_by_reason.setdefault(reason, []).append(rank)
    parts = [("every rank" if len(ranks) == len(per_rank) else f"rank{'s' if len(ranks) > 1 else ''} "
              + ", ".join(map(str, ranks))) + f": {reason}" for reason, ranks in ranks_by_reason.items()]
    return "the CUDA kernels cannot run it (" + "; ".join(parts) + ")"


def unused_reason(mode: str) -> str:
    sizes = "num_nvl_bytes=0" if mode == NORMAL else "low_latency_mode=False or num_rdma_bytes=0"
    return f"not used by this Buffer ({sizes})"


def log_choice(rank: int, num_ranks: int, device: str, backends: dict[str, str], reasons: dict[str, str]) -> None:
    """The Buffer's one log line (rank 0, INFO): each mode's backend and why."""
    if rank != 0:
        return
    parts = [f"{mode.replace('_', '-')} mode on {backends[mode]}: {reasons[mode]}" for mode in _MODES]
    _log.info("epcomm Buffer (%d rank%s, %s): %s", num_ranks, "s" if num_ranks > 1 else "", device, "; ".join(parts))
