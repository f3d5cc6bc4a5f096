"""``--plot PATH``: bandwidth against tokens per rank, one line per implementation and setting.

matplotlib is an optional dependency (``pip install 'epcomm[plot]'``), imported only here and only
when a plot is asked for, so the benchmark itself never needs it.
"""

from __future__ import annotations

import importlib.util
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
