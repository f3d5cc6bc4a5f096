"""``--diagnose``: where the time goes, per rank, and how it compares with the planner.

Three parts, each computed from the records the run produced:

1. **Latency distribution per rank**: p50, p99 and max of every timed call, and the jitter
   ``(p99 - p50) / p50``; a jitter above 20% (the level at which the seed's analysis calls
   latency unstable) is flagged.
2. **Waits per source rank** from the low-latency wait-cost statistics
   (``dispatch_wait_recv_cost_stats`` / ``combine_wait_recv_cost_stats``: ns per source rank).
   A source's wait is averaged over the ranks that waited for it (its own row is left out). A
   source is named a straggler when its mean wait exceeds ``STRAGGLER_RATIO`` times the median of
   the other sources' waits *and* that median by more than ``STRAGGLER_MIN_EXCESS_US``: the ratio
   ignores uniform slowness, the absolute margin ignores microsecond noise.
3. **Measured versus predicted**: the planner models ideal data movement, so its prediction is
   compared with the NCCL collective that performs exactly that strategy's movement
   (``all_to_all_single`` for the flat all-to-all, ``all_gather_into_tensor`` and
   ``reduce_scatter_tensor`` for allgather). Two topologies are used for the run's own rank count:
   the H200 ceilings of docs/PERFORMANCE.md (one cudaMemcpy peer copy, 394 GB/s, 3 us per hop), and calibrated
   ones whose rate and fixed cost come from ``runner.probe_ceilings``: two-point fits at blocks
   bracketing the compared sizes (4 and 256 MiB), of the per-peer NCCL send/recv ("link") or of
   the phase's own collective ("coll."), never from the times being compared. The
   reference backend's full calls are reported beside their prediction but are not its target:
   they add handshakes, host synchronization and packing.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

JITTER_FLAG_PCT = 20.0
STRAGGLER_RATIO = 2.0
STRAGGLER_MIN_EXCESS_US = 50.0
PREDICTION_TOLERANCE = 0.25  # the planner's bar: |measured - predicted| <= 25% of measured
OPS = ("dispatch", "cached_dispatch", "combine")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def latency_stats(samples_us: Sequence[float]) -> dict[str, float]:
    """p50, p99, max (us) and jitter % = (p99 - p50) / p50 of one rank's timed calls."""
    p50, p99 = percentile(samples_us, 50), percentile(samples_us, 99)
    return {"p50": p50, "p99": p99, "max": max(samples_us),
            "jitter_pct": (p99 - p50) / p50 * 100.0 if p50 > 0 else 0.0}


def per_source_waits(observed_us: Sequence[Sequence[float]]) -> list[float]:
    """Mean wait for each source rank over the ranks that observed it, ``observed_us[observer][source]``."""
    num_ranks = len(observed_us)
    out = []
    for src in range(num_ranks):
        seen = [observed_us[r][src] for r in range(num_ranks) if r != src]
        out.append(statistics.fmean(seen) if seen else 0.0)
    return out


def find_stragglers(mean_wait_us: Sequence[float], ratio: float = STRAGGLER_RATIO,
                    min_excess_us: float = STRAGGLER_MIN_EXCESS_US) -> list[int]:
    """Sources whose mean wait exceeds ``ratio`` x the median of the others' and that median + ``min_excess_us``."""
    named = []
    for src, wait in enumerate(mean_wait_us):
        others = [w for r, w in enumerate(mean_wait_us) if r != src]
        if not others:
            continue
        median = statistics.median(others)
        if wait > ratio * median and wait - median > min_excess_us:
            named.append(src)
    return named


# ----------------------------------------------------------------------------- annotating records
def annotate(records: list[dict[str, Any]]) -> None:
    """Add ``latency_us_per_rank`` (and, for low-latency records, per-source waits and stragglers)."""
    for r in records:
        samples = r.get("_samples_us", {})
        r["latency_us_per_rank"] = {op: [_rounded(latency_stats(s)) for s in per_rank]
                                    for op, per_rank in samples.items()}
        r["latency_samples_us"] = {op: [[round(v, 3) for v in s] for s in per_rank]
                                   for op, per_rank in samples.items()}
        observed = r.get("_wait_us_observed")
        if observed:
            waits = {op: per_source_waits(matrix) for op, matrix in observed.items()}
            r["wait_us_observed"] = {op: [[round(v, 3) for v in row] for row in m] for op, m in observed.items()}
            r["wait_us_per_source"] = {op: [round(v, 3) for v in w] for op, w in waits.items()}
            r["stragglers"] = sorted({s for w in waits.values() for s in find_stragglers(w)})


def _rounded(stats: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in stats.items()}


# ----------------------------------------------------------------------------- planner comparison
PLANNER_STRATEGY = {"alltoall": "flat", "allgather": "allgather"}
COLLECTIVES = {("alltoall", "dispatch"): "all_to_all_single", ("alltoall", "combine"): "all_to_all_single",
               ("allgather", "dispatch"): "all_gather_into_tensor",
               ("allgather", "combine"): "reduce_scatter_tensor"}


def benchmark_topology(num_ranks: int):
    """One domain of ``num_ranks`` H200 at its measured ceilings (the 8xh200 preset resized), collectives only."""
    from ..planner import preset

    base = preset("8xh200")
    return dataclasses.replace(base, name=f"{num_ranks}xh200 ceilings", gpus_per_domain=num_ranks,
                               hbm_gbps=None, description="")


def calibrated_topology(num_ranks: int, gbps: float, fixed_us: float, strategy: str, per_call: bool):
    """One domain of ``num_ranks`` GPUs with a measured rate and fixed cost.

    The planner charges the flat all-to-all one hop of latency and the allgather ring ``R - 1``
    hops. ``per_call``: ``fixed_us`` is a whole call's fixed cost (a collective's fit), so the hop
    latency is it divided by the hops charged; otherwise it is one transfer's (the link's fit) and
    is the hop latency itself.
    """
    from ..planner import Tier, Topology

    hops = 1 if strategy == "flat" or num_ranks < 2 else num_ranks - 1
    return Topology(num_domains=1, gpus_per_domain=num_ranks, intra=Tier(gbps, fixed_us / hops if per_call else
                                                                         fixed_us),
                    name=f"{num_ranks} GPUs calibrated", hbm_gbps=None)


def predict_us(record: dict[str, Any], topology, phase: str) -> float:
    """The planner's slowest-rank time (us) of ``phase`` for the record's shape on ``topology``."""
    from ..planner import Workload, estimate

    workload = Workload(num_tokens=record["num_tokens"], hidden=record["hidden"], num_topk=record["num_topk"],
                        num_experts=record["num_experts"], dispatch_dtype=record["dispatch_dtype"])
    est = estimate(PLANNER_STRATEGY[record.get("strategy", "alltoall")], topology, workload)
    return (est.dispatch if phase == "dispatch" else est.combine).time_us


CALIBRATIONS = (
    # key, label
    ("link", "link"),  # one link rate for the topology: the measured per-peer NCCL send/recv rate
    ("collective", "coll."),  # the large-message ceiling of the collective that implements the phase
    ("preset", "preset"),  # the H200 ceilings of the 8xh200 preset, no measurement of this run
)


def compare_with_planner(records: list[dict[str, Any]], probe: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (normal-mode record, phase) with measured and predicted times; adds ``predicted`` to records.

    Predictions, per calibration (``CALIBRATIONS``): ``preset_us`` always; with a probe (GPU runs),
    ``link_us`` (the topology's link = the measured per-peer send/recv rate and fixed cost) and
    ``collective_us`` (the rate and fixed cost of the collective that implements the phase, fitted
    at blocks bracketing the compared sizes). ``*_error_pct`` = (predicted - measured) / measured.
    """
    rows = []
    for r in records:
        if r["mode"] != "normal" or r.get("strategy") not in PLANNER_STRATEGY:
            continue
        strategy = r["strategy"]
        planner_name = PLANNER_STRATEGY[strategy]
        predicted: dict[str, Any] = {"planner_strategy": planner_name}
        for phase in ("dispatch", "combine"):
            measured = r[f"{phase}_us"]
            collective = COLLECTIVES[(strategy, phase)]
            row = {"impl": r["impl"], "strategy": strategy, "planner_strategy": planner_name, "phase": phase,
                   "num_tokens": r["num_tokens"], "dtype": r["dispatch_dtype"], "baseline": bool(r.get("baseline")),
                   "measured_us": measured, "collective": collective}
            row["preset_us"] = predict_us(r, benchmark_topology(r["num_ranks"]), phase)
            if probe.get("link_gbps"):
                fits = {"link": (probe["link_gbps"], probe["link_fixed_us"], False),
                        "collective": (probe["collective_gbps"][collective], probe["collective_fixed_us"][collective],
                                       True)}
                for key, (gbps, fixed_us, per_call) in fits.items():
                    topo = calibrated_topology(r["num_ranks"], gbps, fixed_us, planner_name, per_call)
                    row[f"{key}_us"] = predict_us(r, topo, phase)
            for key, _ in CALIBRATIONS:
                if f"{key}_us" in row:
                    row[f"{key}_error_pct"] = (row[f"{key}_us"] - measured) / measured * 100.0
                    predicted[f"{phase}_{key}_us"] = round(row[f"{key}_us"], 3)
            rows.append(row)
        r["predicted"] = predicted
    return rows


# ----------------------------------------------------------------------------- the report
def _case_name(r: dict[str, Any]) -> str:
    return f"{r['mode']} {r['impl']} {r['dispatch_dtype']} T={r['num_tokens']}"


def format_latency(records: list[dict[str, Any]]) -> list[str]:
    lines = [f"per-rank latency of the timed calls (jitter = (p99 - p50) / p50; ! = jitter > {JITTER_FLAG_PCT:g}%)"]
    width = max([len(_case_name(r)) for r in records] + [4])
    lines.append(f"{'case':<{width}}  {'op':<15}  rank  {'p50 us':>10}  {'p99 us':>10}  {'max us':>10}  jitter")
    for r in records:
        for op in OPS:
            for rank, st in enumerate(r.get("latency_us_per_rank", {}).get(op, [])):
                flag = " !" if st["jitter_pct"] > JITTER_FLAG_PCT else ""
                lines.append(f"{_case_name(r):<{width}}  {op:<15}  {rank:>4}  {st['p50']:>10.1f}  {st['p99']:>10.1f}  "
                             f"{st['max']:>10.1f}  {st['jitter_pct']:5.1f}%{flag}")
    return lines


def format_waits(records: list[dict[str, Any]]) -> list[str]:
    ll = [r for r in records if r.get("wait_us_per_source")]
    if not ll:
        return ["waits per source rank: no low-latency case measured them (run --modes low_latency)"]
    lines = [f"waits per source rank (low-latency wait-cost statistics, mean us per call over the ranks that waited; "
             f"straggler = > {STRAGGLER_RATIO:g}x the other sources' median and > {STRAGGLER_MIN_EXCESS_US:g} us "
             "above it)"]
    for r in ll:
        waits = r["wait_us_per_source"]
        lines.append(f"{_case_name(r)}:")
        lines.append(f"  {'source':>6}  {'dispatch wait us':>16}  {'combine wait us':>15}")
        for src in range(r["num_ranks"]):
            mark = "  <- straggler" if src in r["stragglers"] else ""
            lines.append(f"  {src:>6}  {waits['dispatch'][src]:>16.1f}  {waits['combine'][src]:>15.1f}{mark}")
        named = ", ".join(f"rank {s}" for s in r["stragglers"]) or "none"
        lines.append(f"  stragglers: {named}")
    return lines


def format_comparison(rows: list[dict[str, Any]], probe: dict[str, Any], pg_backend: str) -> list[str]:
    lines = ["measured vs predicted (epcomm.planner, slowest rank, uniform top-k routing)"]
    if pg_backend != "nccl":
        lines.append("  no prediction for CPU/gloo: the planner models GPU links (NVLink, NICs), not loopback TCP")
        return lines
    if not rows:
        return lines + ["  no normal-mode record to compare"]
    lines.append("  preset = the H200 ceilings (394 GB/s one-way cudaMemcpy peer copy, 3 us per hop)")
    if probe.get("link_gbps"):
        lines.append(f"  measured here ({probe['method']}):")
        lines.append(f"  link  = per-peer NCCL send/recv: {probe['link_gbps']:.1f} GB/s per direction + "
                     f"{probe['link_fixed_us']:.1f} us per transfer")
        fits = ", ".join(f"{k} {probe['collective_gbps'][k]:.1f} GB/s + {v:.1f} us"
                         for k, v in probe["collective_fixed_us"].items())
        lines.append(f"  coll. = the phase's own collective: {fits}")
    lines.append("  the planner's target: the NCCL collective that performs the strategy's data movement")
    columns = "".join(f"  {label + ' us':>10}  {'error':>7}" for _, label in CALIBRATIONS)
    what_width = max([22] + [len(f"{row['impl']} {row['dtype']}") for row in rows])
    header = f"  {'strategy':<9}  {'what':<{what_width}}  {'phase':<8}  {'tokens':>6}  {'measured us':>11}{columns}"
    for baseline in (True, False):
        chosen = [row for row in rows if row["baseline"] == baseline]
        if not chosen:
            continue
        if not baseline:
            lines.append("  reference backend, full calls (handshakes, host syncs, packing; not the planner's target):")
        lines.append(header)
        for row in chosen:
            what = row["collective"] if baseline else f"{row['impl']} {row['dtype']}"
            cells = "".join(f"  {row[key + '_us']:>10.1f}  {row[key + '_error_pct']:>+6.1f}%" if key + "_us" in row
                            else f"  {'-':>10}  {'-':>7}" for key, _ in CALIBRATIONS)
            lines.append(f"  {row['planner_strategy']:<9}  {what:<{what_width}}  {row['phase']:<8}  "
                         f"{row['num_tokens']:>6}  {row['measured_us']:>11.1f}{cells}")
    targets = [row for row in rows if row["baseline"]]
    for key, label in CALIBRATIONS:
        scored = [row for row in targets if f"{key}_error_pct" in row]
        for strategy in sorted({row["planner_strategy"] for row in scored}):
            mine = [row for row in scored if row["planner_strategy"] == strategy]
            ok = sum(abs(row[f"{key}_error_pct"]) <= PREDICTION_TOLERANCE * 100 for row in mine)
            worst = max(mine, key=lambda row: abs(row[f"{key}_error_pct"]))
            lines.append(f"  {label:>6}: {strategy:<9} {ok}/{len(mine)} within {PREDICTION_TOLERANCE * 100:g}% "
                         f"(worst {worst[f'{key}_error_pct']:+.1f}%: {worst['collective']} {worst['phase']} "
                         f"T={worst['num_tokens']})")
    return lines


def format_report(records: list[dict[str, Any]], rows: list[dict[str, Any]], probe: dict[str, Any],
                  pg_backend: str) -> str:
    parts = [format_latency(records), format_waits(records), format_comparison(rows, probe, pg_backend)]
    return "\n\n".join("\n".join(p) for p in parts)
