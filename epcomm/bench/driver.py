"""The driver of ``python -m epcomm.bench``: spawn the ranks, run every case, report.

The ranks are one ``LocalCluster`` (NCCL on all GPUs, or gloo CPU processes) kept alive for the
whole run, so start-up is paid once. Each case is one ``cluster.run``, which lets the driver print
a progress line per configuration as it finishes. NVLink multicast is disabled in the ranks
always: it must stay off on the H200 hosts (docs/PERFORMANCE.md, Method) and is irrelevant elsewhere.
"""

from __future__ import annotations

import os
import sys
import time

from ..utils.launch import LocalCluster, RankFailure
from . import diagnose, pressure, report, runner
from .options import Options, parse_args
from .workloads import plan_cases

RANK_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CASE_TIMEOUT_S = 1800.0  # one configuration; the ranks' own collectives time out sooner (EPCOMM_TIMEOUT_S)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _progress(i: int, n: int, case, record: dict, seconds: float) -> str:
    status = "checked" if record["checked"] else "CHECK FAILED"
    return (f"[{i}/{n}] {case.describe()}: dispatch {record['dispatch_us']:.1f} us "
            f"{report.fmt_gbps(record['dispatch_gbps'])} GB/s, combine {record['combine_us']:.1f} us "
            f"{report.fmt_gbps(record['combine_gbps'])} GB/s, {status} ({seconds:.1f} s)")


def _merge_probes(per_rank: list[dict]) -> dict:
    """The bottleneck over ranks: the lowest rates and the largest fixed costs (the slowest rank rules)."""
    if not per_rank or not per_rank[0]:
        return {}
    merged = dict(per_rank[0])
    merged["link_gbps"] = min(p["link_gbps"] for p in per_rank)
    merged["link_fixed_us"] = max(p["link_fixed_us"] for p in per_rank)
    for key, pick in (("collective_gbps", min), ("collective_fixed_us", max)):
        merged[key] = {name: pick(p[key][name] for p in per_rank) for name in per_rank[0][key]}
    return merged


def run(opts: Options, probe: dict | None = None) -> tuple[list[dict], list[str]]:
    """Run every case; returns (records, errors). A rank error stops the run: its group may be wedged.

    With ``opts.diagnose`` on GPUs the link probe (``runner.probe_ceilings``) runs first and its
    merged result is stored into ``probe`` (a dict the caller passes in).
    """
    cases = plan_cases(opts.modes, opts.tokens, opts.ll_tokens, opts.hidden, opts.topk, opts.experts,
                       opts.ll_experts, opts.num_sms, opts.dtypes, opts.warmup, opts.iters, opts.seed,
                       opts.backend, strategies=opts.strategies, diagnose=opts.diagnose,
                       straggler=opts.straggler, straggler_delay_us=opts.straggler_delay_us,
                       with_deep_ep=opts.pg_backend == "nccl" and runner.deep_ep_available(),
                       ranks_per_domain=opts.ranks_per_domain, num_groups=opts.groups, num_ranks=opts.num_ranks)
    _log(f"epcomm.bench: {opts.num_ranks} rank(s) on {opts.pg_backend}, {len(cases)} configuration(s), "
         f"{opts.warmup} warm-up(s) + {opts.iters} timed call(s) each")
    records: list[dict] = []
    errors: list[str] = []
    commit, date = opts.commit or report.git_commit(), report.today()
    timer = "cuda-events" if opts.pg_backend == "nccl" else "perf_counter"
    env = dict(RANK_ENV)
    if "EPCOMM_TIMEOUT_S" in os.environ:  # the launcher sizes its own wait after a rank failure on it
        env["EPCOMM_TIMEOUT_S"] = os.environ["EPCOMM_TIMEOUT_S"]
    if opts.ranks_per_domain:
        env["EPCOMM_RANKS_PER_DOMAIN"] = str(opts.ranks_per_domain)
    with LocalCluster(opts.num_ranks, opts.pg_backend, env=env) as cluster:
        try:
            info = cluster.run(runner.device_info)[0]
        except RankFailure as failure:
            return records, [f"the ranks failed to start: {failure}"]
        device = report.device_string(info, opts.num_ranks)
        if opts.diagnose and opts.pg_backend == "nccl" and probe is not None:
            try:
                probe.update(_merge_probes(cluster.run(runner.probe_ceilings, timeout_s=CASE_TIMEOUT_S)))
                _log(f"probe: link {probe['link_gbps']:.1f} GB/s per direction + {probe['link_fixed_us']:.1f} us; "
                     + ", ".join(f"{k} {probe['collective_gbps'][k]:.1f} GB/s + {v:.1f} us"
                                 for k, v in probe["collective_fixed_us"].items()))
            except RankFailure as failure:
                return records, [f"the link probe failed: {failure}"]
        for i, case in enumerate(cases, 1):
            start = time.monotonic()
            try:
                per_rank = cluster.run(runner.run_case, case, timeout_s=CASE_TIMEOUT_S)
            except RankFailure as failure:
                errors.append(f"{case.describe()}: {failure}")
                _log(f"[{i}/{len(cases)}] {case.describe()}: FAILED, stopping\n{failure}")
                break
            record = report.make_record(case, per_rank, device, commit, date, timer)
            records.append(record)
            _log(_progress(i, len(cases), case, record, time.monotonic() - start))
            for failure_message in record.get("failures", [])[:5]:
                _log(f"    {failure_message}")
    return records, errors


def run_pressure(opts: Options) -> tuple[dict | None, list[str]]:
    """The pressure test on every rank; one record (the slowest rank's time, every rank's failures)."""
    env = dict(RANK_ENV)
    if "EPCOMM_TIMEOUT_S" in os.environ:
        env["EPCOMM_TIMEOUT_S"] = os.environ["EPCOMM_TIMEOUT_S"]
    _log(f"epcomm.bench --pressure: {opts.num_ranks} rank(s) on {opts.pg_backend}, {opts.pressure} random "
         f"case(s), {opts.pressure_replays} replay(s) each, backend={opts.backend}")
    with LocalCluster(opts.num_ranks, opts.pg_backend, env=env) as cluster:
        try:
            info = cluster.run(runner.device_info)[0]
            per_rank = cluster.run(pressure.rank_pressure, opts.pressure, opts.seed, opts.backend,
                                   opts.pressure_replays, timeout_s=CASE_TIMEOUT_S)
        except RankFailure as failure:
            return None, [f"pressure test: {failure}"]
    failures = [f for r in per_rank for f in r["failures"]]
    record = {
        "mode": "pressure", "impl": f"epcomm-{opts.backend}", "num_ranks": opts.num_ranks,
        "cases": per_rank[0]["cases"], "replays": per_rank[0]["replays"],
        "graph_replays": per_rank[0]["graph_replays"], "buffers_created": per_rank[0]["buffers_created"],
        "ll_cases": per_rank[0]["ll_cases"], "ll_replays": per_rank[0]["ll_replays"],
        "ll_graph_replays": per_rank[0]["ll_graph_replays"],
        "hier_cases": per_rank[0]["hier_cases"], "hier_replays": per_rank[0]["hier_replays"],
        "hier_graph_replays": per_rank[0]["hier_graph_replays"],
        "seconds": max(r["seconds"] for r in per_rank), "checked": not failures, "failures": failures[:50],
        "device": report.device_string(info, opts.num_ranks), "commit": opts.commit or report.git_commit(),
        "date": report.today(), "seed": opts.seed,
    }
    return record, []


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m epcomm.bench`` / ``epcomm-bench`` / ``epcomm bench``.

    Returns 0 when every case ran and matched the reference, 1 otherwise (2 for bad options).
    """
    opts = parse_args(argv)
    if opts.pressure:
        record, errors = run_pressure(opts)
        if record is not None:
            print(f"epcomm bench --pressure: {record['device']}, commit {record['commit'][:12]}: {record['cases']} "
                  f"case(s), {record['replays']} replay(s), {record['graph_replays']} CUDA-graph replay(s); low "
                  f"latency: {record['ll_cases']} case(s), {record['ll_replays']} replay(s), "
                  f"{record['ll_graph_replays']} CUDA-graph replay(s); hierarchical: {record['hier_cases']} "
                  f"case(s), {record['hier_replays']} replay(s), {record['hier_graph_replays']} CUDA-graph "
                  f"replay(s); {record['buffers_created']} Buffer(s) "
                  f"created, {record['seconds']:.1f} s: "
                  + ("every output bitwise equal to the reference and across replays" if record["checked"]
                     else f"{len(record['failures'])} FAILURE(S)"), flush=True)
            for failure in record["failures"][:10]:
                _log("    " + failure)
            if opts.json:
                report.write_json([record], opts.json)
        for error in errors:
            _log("error: " + "\n  ".join(error.splitlines()[:6]))
        return 0 if record is not None and record["checked"] and not errors else 1
    probe: dict = {}
    records, errors = run(opts, probe)
    if opts.straggler is not None:
        _log(f"injected straggler: rank {opts.straggler} sleeps {opts.straggler_delay_us:g} us before every call")
    if records:
        first = records[0]
        header = (f"epcomm bench: {first['device']}, commit {first['commit'][:12]}, backend={opts.backend}, "
                  f"{opts.warmup} warm-up + {opts.iters} timed calls, times = slowest rank's median "
                  f"({first['timer']})")
        print(report.format_table(records, header), flush=True)
        if opts.diagnose:
            diagnose.annotate(records)
            rows = diagnose.compare_with_planner(records, probe) if opts.pg_backend == "nccl" else []
            for r in records:
                if probe:
                    r["ceilings"] = probe
                if opts.straggler is not None:
                    r["injected_straggler"] = {"rank": opts.straggler, "delay_us": opts.straggler_delay_us}
            print("\n" + diagnose.format_report(records, rows, probe, opts.pg_backend), flush=True)
    if opts.json:
        report.write_json(records, opts.json)
        _log(f"wrote {len(records)} record(s) to {opts.json}")
    if opts.plot and records:
        from .plot import latency_plot_path, write_latency_plot, write_plot

        write_plot(records, opts.plot)
        write_latency_plot(records, latency_plot_path(opts.plot))
        _log(f"wrote {opts.plot} and {latency_plot_path(opts.plot)}")
    failed = [r for r in records if not r["checked"]]
    if failed:
        _log(f"{len(failed)} configuration(s) did not match the reference")
    for error in errors:
        _log("error: " + "\n  ".join(error.splitlines()[:6]))
    return 1 if failed or errors else 0
