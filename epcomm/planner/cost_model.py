"""Bytes per tier, predicted time, SM count and buffer memory for three dispatch/combine strategies.

Symbols: T tokens per rank, R ranks in D domains of g = R/D GPUs, b bytes per row (dispatch dtype,
or 2H for combine), p_r / p_d = P(a token reaches a given rank / domain) from
:mod:`epcomm.planner.expectations`. Every rank is assumed alike (same T, same routing law), so in
expectation each rank *receives* on each tier exactly what it *sends*; the byte counts below are
per rank and per direction, and a full-duplex link carries both directions at once.

Strategies (rows per rank per tier; the local copy of a token moves over no link):

``allgather`` -- allgather of all tokens, local permute; combine = local unpermute + reduce-scatter.
    Bandwidth-optimal two-level allgather: every token crosses into each other domain once
    (inter: ``T (D-1)``) and is spread inside it (intra: ``T (R-D)``). Each row reaches every rank
    whether or not it is needed. The local permute reads and writes the useful rows
    (``2 R T p_r b`` bytes of HBM traffic); the unpermute writes the dense ``[R T, H]`` partial-sum
    buffer the reduce-scatter needs and reads the useful rows (``(R T + R T p_r) 2H``). The HBM
    step runs after the collective (no overlap) and is priced only when ``hbm_gbps`` is set.
    Latency: one step per ring hop, ``(g-1) lat_intra + (D-1) lat_inter``.

``flat`` -- one all-to-all (NCCL ``all_to_all_single`` or DeepEP's intranode kernels): a token is
    sent once to every rank it reaches, over whichever tier separates the two ranks.
    intra ``T (g-1) p_r``, inter ``T (R-g) p_r``. Latency: one hop of the slowest tier used.

``per_expert`` -- the low-latency (decode) layout of DeepEP and of epcomm's combine under 64 tokens: a
    message per (token, expert) pair, so a token reaching several experts of one rank crosses the
    link once per expert: intra ``T K (g-1)/R``, inter ``T K (R-g)/R`` messages of ``b + 16`` bytes
    in dispatch (data, scales and 16 bytes of metadata), ``2H`` in combine. ``flat`` counts what a
    message per (token, rank) moves (epcomm's dispatch, and its combine by partial sums,
    ``EPCOMM_LL_COMBINE_PARTIALS``: auto from 64 tokens a rank).
    Latency: one hop. Its logical
    bytes follow the benchmark's low-latency count (per pair: ``T K (b + 16)``, ``T K 2H``). Buffer:
    ``Config``'s ``low_latency_size_hint`` (a receive area for every expert's worst case, two slots).
    Estimated only when asked for (``strategies=``), not among the defaults.

``hierarchical`` -- DeepEP internode style: a token crosses the inter tier once per other domain
    it reaches, to the GPU with the same local index there, which forwards it over the intra tier
    to the ranks that need it; tokens for the own domain go directly over the intra tier.
    inter ``T (D-1) p_d``, intra ``T D (g-1) p_r`` (own domain ``T (g-1) p_r`` plus forwarding
    ``T (D-1) p_d * (g-1) p_r / p_d``). Latency: two hops, ``lat_inter + lat_intra``.

Time of a phase = link time + latency + HBM time, where the link time is ``max`` over tiers of
``bytes / bandwidth`` when the tiers are separate hardware (NVLink and NIC move data at the same
time, and forwarding is pipelined in chunks), and the *sum* when they share ports
(``shared_links``: virtual nodes on one NVSwitch). A third limit is the SMs' copy rate: moving all
link bytes with at most ``max_comm_sms`` SMs of ``sm_copy_gbps`` each. These are ideal
(speed-of-light) times: no notify/barrier phase, no kernel launch, no chunking overhead, and
the top-k ids and weights are not counted. Measured kernels land below them (DeepEP V1 on the
8xH200 machine reaches 324 of the ideal ~450 GB/s).

Slowest rank (the benchmark reports it, docs/PERFORMANCE.md, Method): the rows a rank receives on a tier are a sum of
independent Bernoulli trials, ``Binomial(n, p)``; the expected maximum over R ranks is about
``mean (1 + z_R sqrt((1-p)/(n p)))`` with ``z_R`` the expected maximum of R standard normals
(Blom's approximation). Matters at decode sizes (T=128 at EP4-8: +2-3%), ~0.5% at T=4096. On
shared links the per-tier maxima are added, which slightly overstates the slowest rank.

Logical bandwidth follows the benchmark's method for every strategy: the bytes of ``recv_x`` on a rank
(useful rows, ``R T p_r``, local rows included) divided by the time, so numbers compare with the
measured tables whichever strategy produced them.

Suggested SMs: enough SMs to move every link byte of the phase within its link-bound time,
``ceil(link bytes / link time / sm_copy_gbps)``, rounded up to even (DeepEP requires an even
count), at least 2, at most ``max_comm_sms``. For one tier this is ``bandwidth / sm_copy_gbps``:
394 / 20 -> 20 SMs on H200 NVLink, DeepEP's default. For the allgather it is the number of NCCL
channels to allow.

Buffer memory per rank (bytes; the larger of dispatch and combine, since one buffer serves both):
``allgather``: ``R T b`` (the gathered rows, then the reduce-scatter input), expected = worst.
``flat``: send staging (rows packed by destination) + receive, ``(R T p_r + R T p_r) b``;
worst case ``(T min(K, R, G g) + R T) b`` (every token of every rank comes here), which is what a
buffer sized without a CPU sync (``num_worst_tokens``) must hold.
``hierarchical``: ``flat`` plus inter-tier staging on both sides, ``+ 2 T (D-1) p_d b``;
worst ``+ (T min(K, D-1) + T (D-1)) b``. DeepEP's kernels instead stream through fixed-size chunked
ring buffers (Config's chunk sizes) and need far less; these are the unchunked figures.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from statistics import NormalDist
from typing import Any

from ..config import low_latency_size_hint
from .expectations import Expectations, expectations, with_measured
from .topology import Topology
from .workload import Workload

STRATEGIES = ("allgather", "flat", "hierarchical")  # the defaults: normal mode
LOW_LATENCY_STRATEGIES = ("per_expert",)
ALL_STRATEGIES = STRATEGIES + LOW_LATENCY_STRATEGIES
STRATEGY_LABELS = {
    "allgather": "allgather + permute",
    "flat": "flat all-to-all",
    "hierarchical": "hierarchical forwarding",
    "per_expert": "per-expert messages (low latency)",
}
_LL_METADATA_BYTES = 16  # a low-latency dispatch message's token index and alignment
SHARED = "intra+inter (shared links)"


def expected_max_normal(num: int) -> float:
    """Expected maximum of ``num`` i.i.d. standard normals (Blom: ``Phi^-1((n - 0.375)/(n + 0.25))``)."""
    if num <= 1:
        return 0.0
    return NormalDist().inv_cdf((num - 0.375) / (num + 0.25))


def slowest_rank_factor(trials: float, prob: float, num_ranks: int) -> float:
    """``E[max over ranks of Binomial(trials, prob)] / mean``, normal approximation, >= 1."""
    if trials <= 0 or prob <= 0 or prob >= 1:
        return 1.0
    return 1.0 + expected_max_normal(num_ranks) * math.sqrt((1.0 - prob) / (trials * prob))


def suggest_sms(link_bytes: float, link_time_s: float, topology: Topology) -> tuple[int, bool]:
    """(SM count, capped?) by the heuristic in the module docstring; 0 when nothing crosses a link."""
    if link_bytes <= 0 or link_time_s <= 0:
        return 0, False
    needed = math.ceil(link_bytes / link_time_s / (topology.sm_copy_gbps * 1e9) - 1e-9)
    needed = max(2, needed + needed % 2)
    cap = topology.max_comm_sms - topology.max_comm_sms % 2 or topology.max_comm_sms
    return min(needed, cap), needed > cap


@dataclass(frozen=True)
class PhaseEstimate:
    """One phase (dispatch or combine) of one strategy, per rank."""

    phase: str
    bytes_per_token: int
    link_bytes: dict[str, float]
    hbm_bytes: float
    logical_bytes: float
    component_us: dict[str, float]
    slowest_rank_factors: dict[str, float]
    latency_us: float
    time_us: float
    bottleneck: str
    logical_gbps: float
    num_sms: int
    sms_capped: bool

    @property
    def intra_bytes(self) -> float:
        return self.link_bytes.get("intra", 0.0)

    @property
    def inter_bytes(self) -> float:
        return self.link_bytes.get("inter", 0.0)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["send_bytes"] = dict(self.link_bytes)
        out["recv_bytes"] = dict(self.link_bytes)  # equal by symmetry, see the module docstring
        return out


@dataclass(frozen=True)
class StrategyEstimate:
    """Both phases of one strategy, its buffer needs and suggested SM count."""

    name: str
    label: str
    routing: str
    dispatch: PhaseEstimate
    combine: PhaseEstimate
    buffer_bytes: float
    buffer_bytes_worst: float
    reference_only: bool = False

    @property
    def total_us(self) -> float:
        return self.dispatch.time_us + self.combine.time_us

    @property
    def num_sms(self) -> int:
        return max(self.dispatch.num_sms, self.combine.num_sms)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "label": self.label, "routing": self.routing,
            "reference_only": self.reference_only, "total_us": self.total_us, "num_sms": self.num_sms,
            "buffer_bytes": self.buffer_bytes, "buffer_bytes_worst": self.buffer_bytes_worst,
            "dispatch": self.dispatch.to_dict(), "combine": self.combine.to_dict(),
        }


@dataclass(frozen=True)
class PlanReport:
    """Everything :func:`plan` predicts, with ``to_dict()`` for JSON and ``format_table()`` for people."""

    topology: Topology
    workload: Workload
    expectations: Expectations
    strategies: list[StrategyEstimate]
    recommendation: str
    notes: list[str] = field(default_factory=list)

    def strategy(self, name: str, reference_only: bool = False) -> StrategyEstimate:
        for estimate in self.strategies:
            if estimate.name == name and estimate.reference_only == reference_only:
                return estimate
        raise KeyError(f"no estimate for strategy {name!r} (reference_only={reference_only}) in this report")

    @property
    def recommended(self) -> StrategyEstimate:
        return self.strategy(self.recommendation)

    def to_dict(self) -> dict[str, Any]:
        return {
            "topology": self.topology.to_dict(), "workload": self.workload.to_dict(),
            "expectations": self.expectations.to_dict(),
            "strategies": [s.to_dict() for s in self.strategies],
            "recommendation": self.recommendation, "notes": list(self.notes),
            "units": {"bytes": "bytes per rank per direction", "time": "microseconds", "bandwidth": "GB/s, 1e9 bytes"},
        }

    def format_table(self) -> str:
        """A fixed-width table: one line per strategy, then the recommendation and the notes."""
        e = self.expectations
        lines = [
            f"topology: {self.topology.describe()}",
            f"workload: {self.workload.describe()}",
            (f"routing:  {e.routing}; a token reaches {e.ranks_per_token:.2f} ranks ({e.remote_ranks_per_token:.2f} "
             f"remote) and {e.domains_per_token:.2f} of {e.num_domains} domains; P(given rank) = {e.p_rank:.4f}"),
            "",
        ]
        header = ("strategy", "dispatch us", "combine us", "total us", "disp GB/s", "comb GB/s",
                  "intra MB", "inter MB", "bottleneck", "SMs", "buffer MB")
        rows = []
        for s in self.strategies:
            d, c = s.dispatch, s.combine
            name = s.label + (" *" if s.name == self.recommendation and not s.reference_only else "")
            if s.reference_only:
                name += " [uniform routing]"
            rows.append((name, f"{d.time_us:.1f}", f"{c.time_us:.1f}", f"{s.total_us:.1f}",
                         f"{d.logical_gbps:.0f}", f"{c.logical_gbps:.0f}", f"{d.intra_bytes / 1e6:.1f}",
                         f"{d.inter_bytes / 1e6:.1f}", d.bottleneck, f"{s.num_sms}{'!' if d.sms_capped else ''}",
                         f"{s.buffer_bytes / 1e6:.0f}"))
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            cells = [str(v).ljust(widths[i]) if i in (0, 8) else str(v).rjust(widths[i]) for i, v in enumerate(row)]
            lines.append("  ".join(cells).rstrip())
        best = self.recommended
        lines += [
            "",
            (f"recommendation: {best.label} ({best.total_us:.1f} us dispatch + combine, {best.num_sms} SMs, "
             f"{best.buffer_bytes / 1e6:.0f} MB buffer; worst case {best.buffer_bytes_worst / 1e6:.0f} MB)"),
            ("columns: GB/s = recv_x bytes incl. local rows / time (the benchmark's); intra/inter MB = dispatch bytes "
             "each rank sends (= receives) per tier, MB = 1e6 bytes; times are ideal, slowest rank"),
        ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass(frozen=True)
class _Traffic:
    """Rows per rank per tier, with the (trials, probability) of each count for the slowest-rank factor."""

    rows: dict[str, float]
    trials: dict[str, tuple[float, float]]
    hbm_rows: float
    hbm_trials: tuple[float, float]
    latency_us: float


def _traffic(name: str, topology: Topology, workload: Workload, e: Expectations, phase: str) -> _Traffic:
    t = float(workload.num_tokens)
    num_ranks, num_domains, gpus = topology.num_ranks, topology.num_domains, topology.gpus_per_domain
    p_r, p_d = e.p_rank, e.p_domain
    lat_intra = topology.intra.latency_us if gpus > 1 else 0.0
    lat_inter = topology.inter.latency_us if num_domains > 1 and topology.inter is not None else 0.0
    useful = num_ranks * t * p_r
    if name == "allgather":
        hbm_rows = 2.0 * useful if phase == "dispatch" else num_ranks * t + useful
        return _Traffic(rows={"intra": t * (num_ranks - num_domains), "inter": t * (num_domains - 1)},
                        trials={}, hbm_rows=hbm_rows, hbm_trials=(num_ranks * t, p_r),
                        latency_us=(gpus - 1) * lat_intra + (num_domains - 1) * lat_inter)
    if name in ("flat", "per_expert"):
        # One direct send per message: flat's per (token, rank it reaches), per_expert's per (token,
        # expert), whose expert lies on a given rank with probability 1/R.
        per_peer, p = (t, p_r) if name == "flat" else (t * workload.num_topk, 1.0 / num_ranks)
        peers = {"intra": gpus - 1, "inter": num_ranks - gpus}
        rows = {tier: n * per_peer * p for tier, n in peers.items()}
        trials = {tier: (n * per_peer, p) for tier, n in peers.items()}
        latency = max((lat for tier, lat in (("intra", lat_intra), ("inter", lat_inter)) if rows[tier] > 0),
                      default=0.0)
        return _Traffic(rows=rows, trials=trials, hbm_rows=0.0, hbm_trials=(0.0, 0.0), latency_us=latency)
    if name == "hierarchical":
        rows = {"intra": t * num_domains * (gpus - 1) * p_r, "inter": t * (num_domains - 1) * p_d}
        trials = {"intra": (num_domains * (gpus - 1) * t, p_r), "inter": ((num_domains - 1) * t, p_d)}
        return _Traffic(rows=rows, trials=trials, hbm_rows=0.0, hbm_trials=(0.0, 0.0),
                        latency_us=lat_intra + lat_inter)
    raise ValueError(f"strategy must be one of {ALL_STRATEGIES}, got {name!r}")


def _phase(name: str, phase: str, topology: Topology, workload: Workload, e: Expectations,
           slowest_rank: bool) -> PhaseEstimate:
    row_bytes = workload.dispatch_bytes_per_token if phase == "dispatch" else workload.combine_bytes_per_token
    if name == "per_expert" and phase == "dispatch":
        row_bytes += _LL_METADATA_BYTES
    traffic = _traffic(name, topology, workload, e, phase)
    num_ranks = topology.num_ranks
    tiers = {"intra": topology.intra, "inter": topology.inter}
    link_bytes = {tier: rows * row_bytes for tier, rows in traffic.rows.items()}
    factors: dict[str, float] = {}
    tier_s: dict[str, float] = {}
    for tier, nbytes in link_bytes.items():
        use_factor = slowest_rank and tier in traffic.trials
        factors[tier] = slowest_rank_factor(*traffic.trials[tier], num_ranks) if use_factor else 1.0
        tier_s[tier] = nbytes * factors[tier] / tiers[tier].bytes_per_s if nbytes > 0 else 0.0
    link_s = sum(tier_s.values()) if topology.shared_links else max(tier_s.values())
    total_link_bytes = sum(link_bytes.values())
    num_sms, capped = suggest_sms(total_link_bytes, link_s, topology)
    sm_s = total_link_bytes / (num_sms * topology.sm_copy_gbps * 1e9) if capped else 0.0

    hbm_bytes = traffic.hbm_rows * row_bytes
    hbm_s = 0.0
    if hbm_bytes > 0 and topology.hbm_gbps is not None:
        factors["hbm"] = slowest_rank_factor(*traffic.hbm_trials, num_ranks) if slowest_rank else 1.0
        hbm_s = hbm_bytes * factors["hbm"] / (topology.hbm_gbps * 1e9)

    components = {tier: s * 1e6 for tier, s in tier_s.items()}
    components["sms"] = sm_s * 1e6
    components["hbm"] = hbm_s * 1e6
    components["latency"] = traffic.latency_us
    time_us = max(link_s, sm_s) * 1e6 + hbm_s * 1e6 + traffic.latency_us

    candidates = {"latency": traffic.latency_us, "hbm": hbm_s * 1e6, "sms": sm_s * 1e6}
    if topology.shared_links and len([b for b in link_bytes.values() if b > 0]) > 1:
        candidates[SHARED] = link_s * 1e6
    else:
        candidates.update({tier: s * 1e6 for tier, s in tier_s.items()})
    bottleneck = max(candidates, key=lambda k: candidates[k]) if any(candidates.values()) else "none"

    received_rows = workload.num_tokens * workload.num_topk if name == "per_expert" else \
        num_ranks * workload.num_tokens * e.p_rank
    logical_bytes = received_rows * row_bytes
    return PhaseEstimate(
        phase=phase, bytes_per_token=row_bytes, link_bytes=link_bytes, hbm_bytes=hbm_bytes,
        logical_bytes=logical_bytes, component_us=components, slowest_rank_factors=factors,
        latency_us=traffic.latency_us, time_us=time_us, bottleneck=bottleneck,
        logical_gbps=logical_bytes / (time_us * 1e-6) / 1e9 if time_us > 0 else 0.0,
        num_sms=num_sms, sms_capped=capped)


def _buffers(name: str, topology: Topology, workload: Workload, e: Expectations) -> tuple[float, float]:
    """(expected, worst-case) buffer bytes per rank, formulas in the module docstring."""
    t, k = workload.num_tokens, workload.num_topk
    num_ranks, num_domains, gpus = topology.num_ranks, topology.num_domains, topology.gpus_per_domain
    row_bytes = max(workload.dispatch_bytes_per_token, workload.combine_bytes_per_token)
    if name == "allgather":
        size = num_ranks * t * row_bytes
        return float(size), float(size)
    if name == "per_expert":
        size = low_latency_size_hint(t, workload.hidden, num_ranks, workload.num_experts)
        return float(size), float(size)
    groups = workload.num_groups if workload.num_groups is not None else num_domains
    useful = num_ranks * t * e.p_rank
    expected = 2.0 * useful * row_bytes
    worst = float((t * min(k, num_ranks, groups * gpus) + num_ranks * t) * row_bytes)
    if name == "hierarchical":
        expected += 2.0 * t * (num_domains - 1) * e.p_domain * row_bytes
        worst += (t * min(k, num_domains - 1, groups) + t * (num_domains - 1)) * row_bytes
    return expected, worst


def estimate(name: str, topology: Topology, workload: Workload, e: Expectations | None = None,
             slowest_rank: bool = True, reference_only: bool = False) -> StrategyEstimate:
    """Estimate one strategy (``allgather``, ``flat``, ``hierarchical`` or ``per_expert``) for this topology
    and workload."""
    if name not in ALL_STRATEGIES:
        raise ValueError(f"strategy must be one of {ALL_STRATEGIES}, got {name!r}")
    workload.check(topology)
    if e is None:
        e = _expectations_for(topology, workload)
    expected, worst = _buffers(name, topology, workload, e)
    return StrategyEstimate(
        name=name, label=STRATEGY_LABELS[name], routing=e.routing,
        dispatch=_phase(name, "dispatch", topology, workload, e, slowest_rank),
        combine=_phase(name, "combine", topology, workload, e, slowest_rank),
        buffer_bytes=expected, buffer_bytes_worst=worst, reference_only=reference_only)


def _expectations_for(topology: Topology, workload: Workload) -> Expectations:
    """The workload's routing model, with its measured means when it has them."""
    base = expectations(workload.num_experts, workload.num_topk, topology.num_ranks, topology.num_domains,
                        workload.num_groups)
    return with_measured(base, workload.ranks_per_token, workload.domains_per_token)


def plan(topology: Topology, workload: Workload, *, strategies: tuple[str, ...] | list[str] | None = None,
         slowest_rank: bool = True) -> PlanReport:
    """Predict every applicable strategy and recommend the one with the lowest dispatch + combine time.

    ``hierarchical`` is skipped with one domain (it is ``flat`` there). With node-limited routing
    (``workload.num_groups``), ``flat`` and ``hierarchical`` are also reported under uniform routing,
    marked ``reference_only``, to show what the limit saves; they are never recommended.
    ``slowest_rank=False`` gives the mean rank's time instead of the slowest rank's.
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be a Workload, got {type(workload).__name__}")
    workload.check(topology)
    names = list(STRATEGIES if strategies is None else strategies)
    for name in names:
        if name not in ALL_STRATEGIES:
            raise ValueError(f"strategies must be drawn from {ALL_STRATEGIES}, got {name!r}")
    notes: list[str] = []
    if topology.num_domains == 1 and "hierarchical" in names:
        names.remove("hierarchical")
        if strategies is None:
            notes.append("hierarchical forwarding skipped: with one domain it is the flat all-to-all")
    if not names:
        raise ValueError("strategies: nothing to estimate for this topology (hierarchical needs num_domains > 1)")

    e = _expectations_for(topology, workload)
    estimates = [estimate(n, topology, workload, e, slowest_rank) for n in names]
    if workload.num_groups is not None and workload.num_groups < topology.num_domains and e.source == "exact":
        uniform = expectations(workload.num_experts, workload.num_topk, topology.num_ranks, topology.num_domains)
        estimates += [estimate(n, topology, workload, uniform, slowest_rank, reference_only=True)
                      for n in names if n not in ("allgather", "per_expert")]
    best = min((s for s in estimates if not s.reference_only), key=lambda s: s.total_us)

    gpus = topology.gpus_per_domain
    if e.source == "measured" and not (e.p_rank - 1e-12 <= e.p_domain <= gpus * e.p_rank + 1e-12):
        notes.append(f"measured means are inconsistent: P(domain)={e.p_domain:.4f} should lie in "
                     f"[P(rank), {gpus} P(rank)] = [{e.p_rank:.4f}, {gpus * e.p_rank:.4f}]")
    if "allgather" in names and topology.hbm_gbps is None:
        notes.append("allgather: no hbm_gbps in the topology, so its local permute/unpermute is not priced")
    for s in estimates:
        if s.reference_only:
            continue
        if s.dispatch.sms_capped or s.combine.sms_capped:
            notes.append(f"{s.label}: saturating the links needs more than max_comm_sms={topology.max_comm_sms} "
                         f"SMs at {topology.sm_copy_gbps:g} GB/s each; the time includes that SM limit")
        if s.dispatch.bottleneck == "latency":
            notes.append(f"{s.label}: latency-bound at this size (fixed per-call costs dominate; measured times "
                         "vary most here)")
    if topology.shared_links and topology.num_domains > 1:
        notes.append("virtual nodes share the host's links: tier times add up instead of overlapping")
    return PlanReport(topology=topology, workload=workload, expectations=e, strategies=estimates,
                      recommendation=best.name, notes=notes)
