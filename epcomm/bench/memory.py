"""Peak memory of the benchmark's calls: ``peak_memory_bytes`` beside their times.

What is counted is tensor memory allocated through torch's allocator, as a rise above what was
allocated when the calls started: their outputs and temporaries. The Buffer's own buffers, the
inputs and the previous call's outputs were allocated before and do not count; memory a
collective library allocates by itself (NCCL's or gloo's buffers) is not seen.

GPU: ``torch.cuda.max_memory_allocated`` over the timed calls, its peak statistic reset when they
start. CPU: torch keeps no allocator statistics there, so a few untimed calls run under
``torch.profiler`` with ``profile_memory``, whose allocation records give the same rise (the
profiler's cost never enters a timed call).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

PROBE_BYTES = 4096  # the allocation that shows the profiler records them
CPU_CALLS = 2  # untimed calls profiled on CPU after the timed ones (the first may still fill caches)
CUDA_METHOD = "torch.cuda.max_memory_allocated over the timed calls, above the allocation when they started"
CPU_METHOD = f"torch.profiler allocation records of {CPU_CALLS} untimed calls, above the allocation when each started"


@dataclass
class CallMemory:
    """One call's memory: its peak rise above the allocation when it started, and what was alive
    when it started, relative to the first call's start (growth from call to call shows there).

    On CPU the level is the bytes of the tensors Python can reach (gc), not the profiler's running
    sum: the profiler records allocations and frees of the calling thread only, and a tensor whose
    last reference a gloo worker thread drops (its work held it) is freed there, so the running sum
    would drift up. The same lost frees can only inflate a call's peak, never lower it, and a
    collective still in flight on a worker thread can raise one call's level for a moment: compare
    the least of a few calls."""

    peak_bytes: int
    level_bytes: int


def live_tensor_bytes(device: torch.device) -> int:
    """Bytes of the distinct storages of the tensors on ``device`` that Python can reach."""
    import gc

    gc.collect()  # garbage in reference cycles is not alive, only not yet collected
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == device.type:
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, meta)
                continue
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class CudaPeak:
    """The peak rise of allocated CUDA memory between ``start()`` and ``rise()``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base: int | None = None

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)

    def rise(self) -> int:
        if self.base is None:
            raise RuntimeError("CudaPeak.rise() before start()")
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base


def call_memory(fn: Callable[[], Any], calls: int, device: torch.device) -> list[CallMemory] | None:
    """Run ``fn`` ``calls`` times (collective: every rank the same count) and measure each call;
    None where nothing honest is measurable (a profiler that records no allocations)."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    if device.type == "cuda":
        out = []
        start = torch.cuda.memory_allocated(device)
        result = None
        for _ in range(calls):
            tracker = CudaPeak(device)
            tracker.start()
            level = tracker.base - start
            result = fn()
            out.append(CallMemory(tracker.rise(), level))
        del result
        return out
    return _cpu_call_memory(fn, calls)


def _cpu_call_memory(fn: Callable[[], Any], calls: int) -> list[CallMemory] | None:
    # Kineto prints two log lines per profiler session (level USDT) unless its level is raised above it.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import ProfilerActivity, profile, record_function

    label, probe_label = "epcomm.bench.memory.call", "epcomm.bench.memory.probe"
    result = None
    levels = []
    cpu = torch.device("cpu")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function(probe_label):  # shows that allocations are recorded, so no allocation means 0
            probe = torch.empty(PROBE_BYTES, dtype=torch.uint8)
        del probe
        for _ in range(calls):
            levels.append(live_tensor_bytes(cpu))
            with record_function(label):
                result = fn()  # the previous call's result is freed after this one returned, as in the timing loop
    del result
    events = prof.profiler.kineto_results.events()
    spans = sorted((e.start_ns(), e.end_ns()) for e in events if e.name() == label)
    probes = [(e.start_ns(), e.end_ns()) for e in events if e.name() == probe_label]
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events
                         if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    seen = len(probes) == 1 and any(probes[0][0] <= t <= probes[0][1] and n == PROBE_BYTES for t, n in allocations)
    if len(spans) != calls or not seen:
        return None
    out = []
    level, i = 0, 0
    for call, (begin, end) in enumerate(spans):
        while i < len(allocations) and allocations[i][0] < begin:
            level += allocations[i][1]
            i += 1
        start_level, peak = level, level
        while i < len(allocations) and allocations[i][0] <= end:
            level += allocations[i][1]
            peak = max(peak, level)
            i += 1
        out.append(CallMemory(peak - start_level, levels[call] - levels[0]))
    return out


def untimed_peak(fn: Callable[[], Any], device: torch.device, calls: int = CPU_CALLS) -> int | None:
    """The largest peak rise of ``calls`` untimed calls of ``fn`` (None where not measurable)."""
    measured = call_memory(fn, calls, device)
    return None if measured is None else max(m.peak_bytes for m in measured)
