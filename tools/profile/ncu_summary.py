"""Summarizes an Nsight Compute report as text: per kernel its stalls and hottest SASS lines.

The report is ncu_ll.sh's. Per profiled kernel: its duration and launch shape, its warp-stall
samples by reason, and its hottest SASS lines by stall samples with their CUDA source lines.

Usage: python tools/profile/ncu_summary.py REPORT.ncu-rep [--lines 40]
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess

_STALL_PREFIX = "smsp__pcsamp_warps_issue_stalled_"
_KEEP = ("Duration", "Elapsed Cycles", "Registers Per Thread", "Block Size", "Grid Size", "Achieved Occupancy",
         "Theoretical Occupancy", "Memory Throughput", "DRAM Throughput", "Compute (SM) Throughput",
         "Warp Cycles Per Issued Instruction", "Issued Warp Per Scheduler", "Avg. Active Threads Per Warp",
         "Dynamic Shared Memory Per Block", "Static Shared Memory Per Block", "Waves Per SM")


def ncu_csv(report: str, *page: str) -> list[list[str]]:
    text = subprocess.run(["ncu", "-i", report, "--csv", *page], capture_output=True, text=True).stdout
    return [row for row in csv.reader(io.StringIO(text)) if row]


def details(report: str) -> None:
    rows = ncu_csv(report, "--page", "details")
    if not rows:
        print("(no details page)")
        return
    head = rows[0]
    col = {name: i for i, name in enumerate(head)}
    seen: dict[str, list[str]] = {}
    for row in rows[1:]:
        if len(row) != len(head):
            continue
        key = f"#{row[col['ID']]} {row[col['Kernel Name']][:60]}"
        if row[col["Metric Name"]] in _KEEP:
            seen.setdefault(key, []).append(f"{row[col['Metric Name']]}={row[col['Metric Value']]} "
                                            f"{row[col['Metric Unit']]}".strip())
    for key, metrics in seen.items():
        print(key)
        print("   " + "; ".join(metrics))


def stalls(report: str) -> None:
    rows = ncu_csv(report, "--page", "raw")
    if len(rows) < 3:
        print("(no raw page)")
        return
    head, data = rows[0], rows[2:]  # row 1: units
    names = [i for i, h in enumerate(head) if h.startswith(_STALL_PREFIX) and not h.endswith("_not_issued")]
    kernel = head.index("Kernel Name") if "Kernel Name" in head else None
    for row in data:
        values = []
        for i in names:
            try:
                values.append((float(row[i].replace(",", "")), head[i][len(_STALL_PREFIX):]))
            except ValueError:
                continue
        total = sum(v for v, _ in values) or 1.0
        top = sorted(values, reverse=True)[:10]
        label = row[kernel][:60] if kernel is not None else "kernel"
        print(f"{label}: stall samples {int(total)}: " +
              ", ".join(f"{name} {100 * v / total:.0f}%" for v, name in top if v))


def source(report: str, num_lines: int) -> None:
    """The SASS view of each kernel, hottest lines first (ncu prints one table per kernel)."""
    for view in ("cuda,sass", "sass"):
        text = subprocess.run(["ncu", "-i", report, "--page", "source", "--csv", "--print-source", view],
                              capture_output=True, text=True)
        if text.stdout.strip():
            break
    else:
        print("(no source page)", text.stderr[-500:])
        return
    tables: list[list[list[str]]] = []
    for row in csv.reader(io.StringIO(text.stdout)):
        if not row:
            continue
        if any("Warp Stall Sampling (All" in c for c in row) or (row and row[0] in ("#", "Address", "Line")):
            tables.append([row])
        elif tables:
            tables[-1].append(row)
        else:
            print(" ".join(row)[:200])  # a kernel's title line
    for table in tables:
        head = table[0]
        samples = next((i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All")), None)
        text_col = next((i for i, h in enumerate(head) if h in ("Source", "Address")), 0)
        if samples is None:
            print("columns:", head[:12])
            continue
        body = [r for r in table[1:] if len(r) == len(head)]
        if head[0] == "Line No":  # "cuda,sass": keep the CUDA source lines (the SASS rows repeat their samples)
            body = [r for r in body if r[0].strip()]

        def count(r: list[str], at: int = samples) -> float:
            try:
                return float(r[at].replace(",", ""))
            except ValueError:
                return 0.0

        total = sum(count(r) for r in body) or 1.0
        print(f"--- {len(body)} lines, {int(total)} stall samples; columns: {head[:6]}")
        for r in sorted(body, key=count, reverse=True)[:num_lines]:
            print(f"{100 * count(r) / total:5.1f}%  line {r[0]:>5}  {r[text_col][:120]}")


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("report")
    parser.add_argument("--lines", type=int, default=40)
    args = parser.parse_args()
    details(args.report)
    stalls(args.report)
    source(args.report, args.lines)


if __name__ == "__main__":
    main()
