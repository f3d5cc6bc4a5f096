"""Results: per-case records (keys in docs/PERFORMANCE.md, Method), the printed table and the JSON file.

A record's times are the slowest rank's medians; its bandwidths are that rank's bytes over its
time (see ``metrics.slowest_rank``). Per-rank times are kept as extra keys so a straggler shows.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from typing import Any

from .. import _env
from . import memory, metrics
from .workloads import Case

# Every record's first keys, in this order; records carry extra keys after them.
RECORD_KEYS = ("mode", "impl", "num_ranks", "num_domains", "num_tokens", "hidden", "num_topk", "num_experts",
               "num_sms", "dispatch_dtype", "dispatch_us", "dispatch_gbps", "combine_us", "combine_gbps",
               "inter_domain_gbps", "buffer_bytes", "checked", "device", "commit", "date")


def git_commit(path: str | None = None) -> str:
    """``git rev-parse HEAD`` of the checkout epcomm was imported from (or of ``path``), with
    "+modified" when tracked files differ from it (a result must not pass for a commit's when its
    sources were edited, e.g. a working tree copied to a GPU machine beside an older .git); "unknown"
    outside a checkout (e.g. a wheel)."""
    here = path or os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return None

    out = git("rev-parse", "HEAD")
    sha = out.stdout.strip() if out is not None else ""
    if out is None or out.returncode != 0 or not re.fullmatch(r"[0-9a-f]{40}", sha):
        return "unknown"
    status = git("status", "--porcelain", "--untracked-files=no")
    if status is None or status.returncode != 0 or status.stdout.strip():
        return sha + "+modified"
    return sha


def device_string(info: dict[str, Any], num_ranks: int) -> str:
    """"nvidia-h200-x4" style (the GPU name, slugged, and the ranks used), or "cpu-gloo-xN"."""
    if info.get("pg_backend") == "nccl":
        slug = re.sub(r"[^a-z0-9]+", "-", str(info.get("device_name", "gpu")).lower()).strip("-")
        return f"{slug}-x{num_ranks}"
    return f"cpu-{info.get('pg_backend', 'gloo')}-x{num_ranks}"


def _sig(value: float) -> float:
    """Six significant digits: enough for any comparison, and small bandwidths never round to 0."""
    return float(f"{value:.6g}")


def env_settings() -> dict[str, str]:
    """The epcomm variables set in the environment (the ranks inherit it): an A/B's records say which
    side they are (e.g. EPCOMM_COMBINE_SEND_SMS_PCT), whatever their file is called."""
    return {name: os.environ[name] for name in sorted(_env.ENV_VARS) if name in os.environ}


def fmt_gbps(value: float) -> str:
    return f"{value:.2f}" if value >= 1 else f"{value:.4f}"


def make_record(case: Case, per_rank: list[dict[str, Any]], device: str, commit: str, date: str,
                timer: str) -> dict[str, Any]:
    """One record from the ranks' results of ``case``."""
    num_ranks = len(per_rank)
    failures = [f for r in per_rank for f in r["failures"]]
    d_us, d_gbps, d_rank = metrics.slowest_rank([r["dispatch_s"] for r in per_rank],
                                                [r["dispatch_bytes"] for r in per_rank])
    c_us, c_gbps, c_rank = metrics.slowest_rank([r["combine_s"] for r in per_rank],
                                                [r["combine_bytes"] for r in per_rank])
    record: dict[str, Any] = {
        "mode": case.mode, "impl": per_rank[0]["impl"], "num_ranks": num_ranks,
        "num_domains": per_rank[0]["num_domains"], "num_tokens": case.num_tokens, "hidden": case.hidden,
        "num_topk": case.num_topk, "num_experts": case.num_experts, "num_sms": case.num_sms,
        "dispatch_dtype": case.dtype, "dispatch_us": _sig(d_us), "dispatch_gbps": _sig(d_gbps),
        "combine_us": _sig(c_us), "combine_gbps": _sig(c_gbps), "inter_domain_gbps": None,
        "buffer_bytes": max(r["buffer_bytes"] for r in per_rank), "checked": not failures,
        "device": device, "commit": commit, "date": date,
    }
    if "cached_dispatch_s" in per_rank[0]:
        cd_us, cd_gbps, _ = metrics.slowest_rank([r["cached_dispatch_s"] for r in per_rank],
                                                 [r["dispatch_bytes"] for r in per_rank])
        record["cached_dispatch_us"] = _sig(cd_us)
        record["cached_dispatch_gbps"] = _sig(cd_gbps)
    record.update({
        "baseline": case.baseline, "backend": case.backend, "timer": timer,
        "warmup": case.warmup, "iters": case.iters, "seed": case.seed,
        "slowest_dispatch_rank": d_rank, "slowest_combine_rank": c_rank,
        "dispatch_us_per_rank": [_sig(r["dispatch_s"] * 1e6) for r in per_rank],
        "combine_us_per_rank": [_sig(r["combine_s"] * 1e6) for r in per_rank],
        "dispatch_bytes_per_rank": [r["dispatch_bytes"] for r in per_rank],
    })
    record["env"] = env_settings()
    record.update(_peak_memory(per_rank, timer))
    if "sent_rows" in per_rank[0]:  # a baseline that sends other rows than the dispatch's (megatron-a2a)
        record["sent_rows_per_rank"] = [r["sent_rows"] for r in per_rank]
    if "strategy" in per_rank[0]:
        record["strategy"] = per_rank[0]["strategy"]
    if "ll_transport" in per_rank[0]:  # CUDA low latency: IPC or NVSHMEM, and the peers reached by puts
        record["ll_transport"] = per_rank[0]["ll_transport"]
        record["ll_remote_ranks_per_rank"] = [r["ll_remote_ranks"] for r in per_rank]
    if "traffic" in per_rank[0]:  # per tier, like DeepEP's internode test: bytes sent / the call's time
        for op in ("dispatch", "combine"):
            for tier in ("inter_domain", "intra_domain"):
                record[f"{op}_{tier}_bytes_per_rank"] = [r["traffic"][f"{op}_{tier}_bytes"] for r in per_rank]
                record[f"{op}_{tier}_rows_per_rank"] = [r["traffic"][f"{op}_{tier}_rows"] for r in per_rank]
        slowest = per_rank[d_rank]
        record["inter_domain_gbps"] = _sig(slowest["traffic"]["dispatch_inter_domain_bytes"]
                                           / slowest["dispatch_s"] / 1e9)
        record["intra_domain_gbps"] = _sig(slowest["traffic"]["dispatch_intra_domain_bytes"]
                                           / slowest["dispatch_s"] / 1e9)
        record["inter_domain_rows_expected_per_rank"] = [r["inter_domain_rows_expected"] for r in per_rank]
        record["each_token_crosses_once_per_domain"] = all(
            r["traffic"]["dispatch_inter_domain_rows"] == r["inter_domain_rows_expected"] for r in per_rank)
    for op in ("dispatch", "combine"):  # low latency: the send half (the call) and the receive (the hook)
        if f"{op}_hook_send_s" in per_rank[0]:
            record[f"{op}_send_us"] = _sig(max(r[f"{op}_hook_send_s"] for r in per_rank) * 1e6)
            record[f"{op}_recv_us"] = _sig(max(r[f"{op}_hook_recv_s"] for r in per_rank) * 1e6)
    for op in ("dispatch", "combine"):  # low latency on the CUDA backend: its kernels' device time
        if f"{op}_kernel_s" in per_rank[0]:
            record[f"{op}_kernel_us"] = _sig(max(r[f"{op}_kernel_s"] for r in per_rank) * 1e6)
    for op in ("dispatch", "combine", "step"):  # low latency on the CUDA backend: replayed CUDA graphs
        if f"{op}_graph_s" in per_rank[0]:
            key = "dispatch_combine" if op == "step" else op
            record[f"{key}_graph_us"] = _sig(max(r[f"{op}_graph_s"] for r in per_rank) * 1e6)
    # In memory only (keys starting with "_" are not written): every timed call, and the
    # low-latency waits as each rank observed them; --diagnose turns them into reported keys.
    record["_samples_us"] = {op: [[t * 1e6 for t in r["samples_s"][op]] for r in per_rank]
                             for op in per_rank[0].get("samples_s", {})}
    if "dispatch_wait_us_per_source" in per_rank[0]:
        record["_wait_us_observed"] = {op: [r[f"{op}_wait_us_per_source"] for r in per_rank]
                                       for op in ("dispatch", "combine")}
    if failures:
        record["failures"] = failures[:20]
    return record


def _peak_memory(per_rank: list[dict[str, Any]], timer: str) -> dict[str, Any]:
    """``peak_memory_bytes``: the largest rank's peak rise of allocated tensor memory over the
    operations' calls (bench/memory.py); per operation too; null where it was not measurable."""
    ops = per_rank[0].get("peak_memory")
    if ops is None:
        return {}
    per_op = {}
    for op in ops:
        values = [r["peak_memory"].get(op) for r in per_rank]
        per_op[op] = None if any(v is None for v in values) else max(values)
    measured = [v for v in per_op.values() if v is not None]
    method = memory.CUDA_METHOD if timer == "cuda-events" else memory.CPU_METHOD
    if len(measured) < len(per_op):
        method += "; null: the profiler recorded no allocations"
    return {"peak_memory_bytes": max(measured) if measured and len(measured) == len(per_op) else None,
            "peak_memory_bytes_per_op": per_op, "peak_memory_method": method}


def today() -> str:
    return datetime.date.today().isoformat()


def write_json(records: list[dict[str, Any]], path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in records]
    with open(path, "w") as f:
        json.dump(public, f, indent=1)
        f.write("\n")


_COLUMNS = (
    # header, width, how to render a record
    ("mode", 11, lambda r: r["mode"]),
    ("impl", 30, lambda r: r["impl"]),
    ("dtype", 5, lambda r: r["dispatch_dtype"]),
    ("tokens", 6, lambda r: str(r["num_tokens"])),
    ("hidden", 6, lambda r: str(r["hidden"])),
    ("K/E", 7, lambda r: f"{r['num_topk']}/{r['num_experts']}"),
    ("SMs", 3, lambda r: "-" if r["num_sms"] is None else str(r["num_sms"])),
    ("disp us", 10, lambda r: f"{r['dispatch_us']:.1f}"),
    ("GB/s", 7, lambda r: fmt_gbps(r["dispatch_gbps"])),
    ("cached us", 10, lambda r: f"{r['cached_dispatch_us']:.1f}" if "cached_dispatch_us" in r else "-"),
    ("comb us", 10, lambda r: f"{r['combine_us']:.1f}"),
    ("GB/s", 7, lambda r: fmt_gbps(r["combine_gbps"])),
    ("graph d/c/d+c us", 17, lambda r: "/".join(f"{r[k]:.1f}" for k in ("dispatch_graph_us", "combine_graph_us",
                                                                       "dispatch_combine_graph_us"))
     if "dispatch_graph_us" in r else ""),
    ("kernel d/c us", 13, lambda r: f"{r['dispatch_kernel_us']:.1f}/{r['combine_kernel_us']:.1f}"
     if "dispatch_kernel_us" in r else ""),
    ("peak MB", 8, lambda r: "-" if r.get("peak_memory_bytes") is None else f"{r['peak_memory_bytes'] / 1e6:.2f}"),
    ("a2a/disp", 8, lambda r: r.get("_vs_a2a", "")),
    ("checked", 7, lambda r: "yes" if r["checked"] else "FAILED"),
)


def format_table(records: list[dict[str, Any]], header: str) -> str:
    """The run as a text table, each epcomm row after the baselines of the same routing.

    "a2a/disp" is the all_to_all_single baseline's dispatch time over the row's: above 1 means the
    row is faster than one plain all_to_all_single of the same rows. "peak MB" is the largest rise
    of allocated tensor memory in the row's calls (1e6 bytes; "-" where not measurable).
    """
    rows = []
    baseline: dict[tuple, dict[str, Any]] = {}
    for r in records:
        key = (r["mode"], r["num_tokens"], r["hidden"], r["num_topk"], r["num_experts"])
        shown = dict(r)
        if r.get("baseline") and re.fullmatch(r"[a-z0-9_]+-a2a", r["impl"]):  # the plain one, not megatron-a2a
            baseline[key] = r
        elif key in baseline and r["dispatch_us"] > 0:
            shown["_vs_a2a"] = f"{baseline[key]['dispatch_us'] / r['dispatch_us']:.2f}x"
        rows.append(shown)
    lines = [header]
    lines.append("  ".join(f"{h:>{w}}" for h, w, _ in _COLUMNS))
    lines.append("  ".join("-" * w for _, w, _ in _COLUMNS))
    for r in rows:
        lines.append("  ".join(f"{fmt(r):>{w}}" for _, w, fmt in _COLUMNS))
    return "\n".join(lines)
