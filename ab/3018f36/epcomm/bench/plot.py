"""``--plot PATH``: bandwidth against tokens per rank, one line per implementation and setting; and
next to it (``latency_plot_path``) the histogram of every timed call's latency, one row of panels
per rank, so a rank whose calls are slower or more spread out stands out.

matplotlib is an optional dependency (``pip install 'epcomm[plot]'``), imported only here and only
when a plot is asked for, so the benchmark itself never needs it.
"""

from __future__ import annotations

import importlib.util
import os
from collections import defaultdict
from typing import Any

from .workloads import MODES

MISSING_MATPLOTLIB = "--plot needs matplotlib, which is not installed (pip install 'epcomm[plot]')"


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _label(r: dict[str, Any], hiddens: set[int]) -> str:
    parts = [r["impl"], r["dispatch_dtype"]]
    if r["num_sms"] is not None:
        parts.append(f"{r['num_sms']} SMs")
    if len(hiddens) > 1:
        parts.append(f"H={r['hidden']}")
    return " ".join(parts)


def write_plot(records: list[dict[str, Any]], path: str) -> None:
    """One row of panels per mode (dispatch and combine GB/s against tokens per rank)."""
    if not matplotlib_available():
        raise RuntimeError(MISSING_MATPLOTLIB)
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if any(r["mode"] == m for r in records)]
    if not modes:
        raise ValueError("--plot: no results to plot")
    hiddens = {r["hidden"] for r in records}
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 4 * len(modes)), squeeze=False)
    for row, mode in enumerate(modes):
        series: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in records:
            if r["mode"] == mode:
                series[_label(r, hiddens)].append(r)
        for col, what in enumerate(("dispatch", "combine")):
            ax = axes[row][col]
            for label, rs in sorted(series.items()):
                rs = sorted(rs, key=lambda r: r["num_tokens"])
                style = "--" if rs[0].get("baseline") else "-"
                ax.plot([r["num_tokens"] for r in rs], [r[f"{what}_gbps"] for r in rs], style, marker="o",
                        label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens per rank")
            ax.set_ylabel("GB/s (slowest rank)")
            ax.set_title(f"{mode} {what}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    first = records[0]
    fig.suptitle(f"epcomm bench on {first['device']}, commit {first['commit'][:10]}, {first['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def latency_plot_path(path: str) -> str:
    """``bw.png`` -> ``bw-latency.png`` (the latency histograms go next to the bandwidth plot)."""
    root, ext = os.path.splitext(path)
    return f"{root}-latency{ext or '.png'}"


def write_latency_plot(records: list[dict[str, Any]], path: str) -> None:
    """Histograms of the timed calls' latency: a row per rank, a column per (mode, op).

    Each panel overlays every implementation at the mode's largest token count (the most
    communication-bound size); bins are logarithmic because implementations differ by orders of
    magnitude. Needs the per-call samples: the runner's (``_samples_us``) or, for records read
    back from a ``--diagnose`` JSON file, ``latency_samples_us``.
    """
    records = [r if r.get("_samples_us") else {**r, "_samples_us": r.get("latency_samples_us", {})}
               for r in records]
    if not matplotlib_available():
        raise RuntimeError(MISSING_MATPLOTLIB)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []  # (mode, op, records at the mode's largest token count)
    for mode in MODES:
        rs = [r for r in records if r["mode"] == mode and r.get("_samples_us")]
        if not rs:
            continue
        largest = max(r["num_tokens"] for r in rs)
        rs = [r for r in rs if r["num_tokens"] == largest]
        for op in ("dispatch", "combine"):
            panels.append((mode, op, [r for r in rs if op in r["_samples_us"]]))
    if not panels:
        raise ValueError("--plot: no per-call latency samples to plot")
    num_ranks = max(r["num_ranks"] for r in records)
    hiddens = {r["hidden"] for r in records}
    fig, axes = plt.subplots(num_ranks, len(panels), figsize=(4.2 * len(panels), 2.4 * num_ranks), squeeze=False)
    for col, (mode, op, rs) in enumerate(panels):
        values = [v for r in rs for per_rank in r["_samples_us"][op] for v in per_rank if v > 0]
        lo, hi = (min(values), max(values)) if values else (1.0, 10.0)
        hi = max(hi, lo * 1.01)
        bins = [lo * (hi / lo) ** (i / 40) for i in range(41)]
        for rank in range(num_ranks):
            ax = axes[rank][col]
            for r in rs:
                per_rank = r["_samples_us"][op]
                if rank < len(per_rank) and per_rank[rank]:
                    ax.hist(per_rank[rank], bins=bins, histtype="step", label=_label(r, hiddens))
            ax.set_xscale("log")
            ax.set_title(f"rank {rank}: {mode} {op}, T={rs[0]['num_tokens'] if rs else '-'}", fontsize=8)
            ax.tick_params(labelsize=7)
            if rank == num_ranks - 1:
                ax.set_xlabel("latency per call (us)")
            if col == 0:
                ax.set_ylabel("calls")
            if rank == 0:
                ax.legend(fontsize=6)
    first = records[0]
    fig.suptitle(f"epcomm bench latency per call on {first['device']}, commit {first['commit'][:10]}, "
                 f"{first['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
