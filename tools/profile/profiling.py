"""Shared by the profilers (normal_profile.py, hier_profile.py, ll_profile.py): reading profiler runs.

What they read out of a torch.profiler run of `calls` identical calls (each kernel's device times,
and the GPU activities of the last call in start order: the gaps between a call's kernels, and what
else runs in it), and a call's timeline of where the host and the GPU are at each of its steps."""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def short_name(name: str) -> str:
    """A kernel's name without its return type, namespaces and arguments; template arguments kept
    (instantiations of one kernel stay apart)."""
    head, bracket, template = name.split("(")[0].removeprefix("void ").partition("<")
    return (head.split("::")[-1].strip() + bracket + template)[:40]


def cprofile_calls(fn: Callable[[], object], calls: int, order: str, rows: int) -> str:
    """cProfile of ``calls`` calls of ``fn`` (collective: every rank calls it), its ``rows`` top lines by
    ``order``; the device caught up after (on CPU ranks nothing to wait for)."""
    dist.barrier()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(rows)
    return out.getvalue()


def profile_calls(fn: Callable[[], object], calls: int, warmup: int = 0) -> torch.profiler.profile:
    """Profiles `calls` back-to-back calls of fn (CUDA activities only), synchronised at the end;
    first `warmup` unprofiled calls, after which every rank meets (fn is collective)."""
    if warmup:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
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


class Marks:
    """A call's marked steps: the host's time at each, and for steps marked with `gpu` a CUDA event
    recorded there on the current stream. Events come from a pool made up front: creating one
    costs the host microseconds, which would show in the timeline."""

    def __init__(self, pool: int = 64):
        self.steps: list[tuple[str, float, torch.cuda.Event | None]] = []
        self._pool = [torch.cuda.Event(enable_timing=True) for _ in range(pool)]

    def clear(self) -> None:
        self.steps.clear()

    def __call__(self, step: str, gpu: bool = True) -> None:  # the event goes on the current stream
        event = None
        if gpu:
            used = sum(e is not None for _, _, e in self.steps)
            event = self._pool[used]
            event.record()
        self.steps.append((step, time.perf_counter(), event))


class MarkedLibrary:
    """Stands in for a kernel library: marks each entry point (named without `strip`) before the call."""

    def __init__(self, lib, marks: Marks, strip: str = "epcomm_"):
        self._lib, self._marks, self._strip = lib, marks, strip

    def __getattr__(self, name: str):
        fn = getattr(self._lib, name)

        def marked(*args):
            self._marks(name.replace(self._strip, ""))
            return fn(*args)
        return marked


def timeline_lines(steps: dict[str, Callable[[], object]], marks: Marks, prefix: str, calls: int = 20) -> list[str]:
    """Where the host and the GPU are at each marked step of each call in `steps`: the host's time
    when it reaches the step and the GPU's (the step's event, where it has one), both from the call's
    start, medians of `calls` calls. Something that wraps the library's entry points (MarkedLibrary)
    and the host's other steps fills `marks`."""
    lines = []
    for name, fn in steps.items():
        rows: dict[str, list[tuple[float, float | None]]] = {}
        for _ in range(calls):
            marks.clear()
            marks("start")
            fn()
            marks("end")
            torch.cuda.synchronize()
            _, t0, e0 = marks.steps[0]
            for i, (step, t, e) in enumerate(marks.steps):
                gpu = e0.elapsed_time(e) * 1e3 if e is not None else None
                rows.setdefault(f"{i:2d} {step}", []).append(((t - t0) * 1e6, gpu))
        for step, vals in rows.items():
            host = sorted(v[0] for v in vals)[len(vals) // 2]
            line = f"{prefix} {name} timeline: {step:20s} host {host:8.1f} us"
            if vals[0][1] is not None:
                line += f"  gpu {sorted(v[1] for v in vals)[len(vals) // 2]:8.1f} us"
            lines.append(line)
    return lines
