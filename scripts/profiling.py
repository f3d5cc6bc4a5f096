"""What the profiling scripts (normal_profile.py, hier_profile.py, ll_profile.py) share: what they
read out of a torch.profiler run of `calls` identical calls (each kernel's device times, and the GPU
activities of the last call in start order: the gaps between a call's kernels, and what else runs in
it), and a call's timeline of where the host and the GPU are at each of its steps."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def short_name(name: str) -> str:
    """A kernel's name without its namespace, template and argument lists."""
    return name.split("(")[0].split("<")[0].split("::")[-1][:40]


def profile_calls(fn: Callable[[], object], calls: int) -> torch.profiler.profile:
    """Profiles `calls` back-to-back calls of fn (CUDA activities only), synchronised at the end."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def _activities(prof: torch.profiler.profile) -> list[tuple[float, float, str]]:
    return sorted((e.time_range.start, e.time_range.end, short_name(e.name)) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)


def kernel_lines(prof: torch.profiler.profile, calls: int, prefix: str) -> list[str]:
    """The device time of a call (all its kernels), then each kernel's count, median, min and max, in
    microseconds, most total time first."""
    times: dict[str, list[float]] = {}
    for start, end, name in _activities(prof):
        times.setdefault(name, []).append(end - start)
    total = sum(sum(ts) for ts in times.values()) / max(calls, 1)
    lines = [f"{prefix}: {total:.1f} us of kernels per call"]
    for name, ts in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        ts.sort()
        lines.append(f"{prefix}: {name:40s} n={len(ts):3d} median {ts[len(ts) // 2]:8.1f} us "
                     f"min {ts[0]:8.1f} max {ts[-1]:8.1f}")
    return lines


def last_call_lines(prof: torch.profiler.profile, calls: int, prefix: str) -> list[str]:
    """The last call's GPU activities in start order, start and end relative to its first."""
    acts = _activities(prof)
    per = len(acts) // calls if calls else 0
    if per == 0:
        return []
    last = acts[-per:]
    t0 = last[0][0]
    return [f"{prefix}: activity {name:40s} {start - t0:8.1f} -> {end - t0:8.1f} us" for start, end, name in last]


class MarkedLibrary:
    """Stands in for a kernel library: notes the host time and a CUDA event before each entry point
    (named without `strip`)."""

    def __init__(self, lib, marks: list, strip: str = "epcomm_"):
        self._lib, self._marks, self._strip = lib, marks, strip

    def __getattr__(self, name: str):
        fn = getattr(self._lib, name)

        def marked(*args):
            mark(self._marks, name.replace(self._strip, ""))
            return fn(*args)
        return marked


def mark(marks: list, step: str) -> None:
    """Notes the host's time and records a CUDA event on the current stream, as step `step`."""
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    marks.append((step, time.perf_counter(), e))


def timeline_lines(steps: dict[str, Callable[[], object]], marks: list, prefix: str, calls: int = 20) -> list[str]:
    """Where the host and the GPU are at each marked step of each call in `steps`: the host's time
    when it reaches the step and the GPU's (the step's event), both from the call's start, medians of
    `calls` calls. Something that wraps the library's entry points (MarkedLibrary) fills `marks`."""
    lines = []
    for name, fn in steps.items():
        rows: dict[str, list[tuple[float, float]]] = {}
        for _ in range(calls):
            marks.clear()
            mark(marks, "start")
            fn()
            mark(marks, "end")
            torch.cuda.synchronize()
            t0, e0 = marks[0][1], marks[0][2]
            for i, (step, t, e) in enumerate(marks):
                rows.setdefault(f"{i:2d} {step}", []).append(((t - t0) * 1e6, e0.elapsed_time(e) * 1e3))
        for step, vals in rows.items():
            host = sorted(v[0] for v in vals)[len(vals) // 2]
            gpu = sorted(v[1] for v in vals)[len(vals) // 2]
            lines.append(f"{prefix} {name} timeline: {step:20s} host {host:8.1f} us  gpu {gpu:8.1f} us")
    return lines
