"""Per-rank timing of one collective call, as the benchmark's method has it (docs/PERFORMANCE.md).

GPU: CUDA events around each call, with L2 flushed before every timed call (a 256 MB write), so a
call never finds the previous call's data in cache. The GPU then spins for a while before the
start event (HEAD_START_CYCLES), so that the host has queued the call by the time the GPU reaches
it: otherwise a host slower than the flush leaks its own time into the span, by how much depending
on the host's jitter (docs/PERFORMANCE.md, Method). A call that waits for the GPU on the host (a normal
dispatch reading its counts) still counts that wait: it is the call's. CPU: ``time.perf_counter`` around each call,
with a barrier before every iteration so no rank starts its clock while a peer is still in the
previous call (gloo has no device timeline to measure on). ``time_call`` returns the median,
``time_samples`` every timed call (the diagnosis reads their distribution).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

L2_FLUSH_BYTES = 256 * 1000 * 1000
HEAD_START_CYCLES = 400_000  # ~200-235 us at the H100/H200's 1.7-1.98 GHz

_flush_buffer: torch.Tensor | None = None


def l2_flush_buffer(device: torch.device) -> torch.Tensor:
    """One 256 MB buffer per process, allocated on first use and reused (allocation is not timed)."""
    global _flush_buffer
    if _flush_buffer is None or _flush_buffer.device != device:
        _flush_buffer = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    return _flush_buffer


def gpu_barrier(device: torch.device) -> None:
    """dist.barrier on the NCCL group, bound to ``device`` (NCCL otherwise guesses the GPU)."""
    dist.barrier(device_ids=[device.index if device.index is not None else torch.cuda.current_device()])


def cold_start(flush: torch.Tensor, before: Callable[[], None] | None = None, write: bool = True) -> None:
    """Queue what precedes a timed span on the GPU: the L2 flush (``flush``, from
    :func:`l2_flush_buffer`), then, after the host work ``before`` if any, the head start.
    The benchmark's flush writes the buffer (as DeepEP's does), leaving L2 full of dirty lines;
    ``write=False`` reads it instead (a reduction), leaving L2 cold but clean (a profiling probe)."""
    if write:
        flush.zero_()
    else:
        flush.max()
    if before is not None:
        before()
    torch.cuda._sleep(HEAD_START_CYCLES)


def time_call(fn: Callable[[], Any], warmup: int, iters: int, device: torch.device,
              before: Callable[[], None] | None = None) -> tuple[float, Any]:
    """Run ``fn`` ``warmup`` times untimed, then ``iters`` times timed; return (median seconds, last result).

    Every rank must call this with the same counts: ``fn`` is collective.
    """
    samples, result = time_samples(fn, warmup, iters, device, before)
    return statistics.median(samples), result


def time_samples(fn: Callable[[], Any], warmup: int, iters: int, device: torch.device,
                 before: Callable[[], None] | None = None,
                 on_start: Callable[[], None] | None = None) -> tuple[list[float], Any]:
    """As :func:`time_call`, but return every timed call's seconds (for distributions and jitter).

    ``before`` runs ahead of every call, outside the timed span: the benchmark's straggler
    injection (``--straggler``) sleeps there, so the late rank's own clock excludes its delay
    while its peers' clocks include the wait for it. ``on_start`` runs once, after the warm-ups,
    right before the timed calls (to reset statistics that should cover the timed calls only).
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if device.type == "cuda":
        return _time_cuda(fn, warmup, iters, device, before, on_start)
    return _time_cpu(fn, warmup, iters, before, on_start)


def _time_cpu(fn: Callable[[], Any], warmup: int, iters: int, before: Callable[[], None] | None,
              on_start: Callable[[], None] | None) -> tuple[list[float], Any]:
    result = None
    for _ in range(warmup):
        dist.barrier()
        if before is not None:
            before()
        result = fn()
    if on_start is not None:
        on_start()
    times = []
    for _ in range(iters):
        dist.barrier()
        if before is not None:
            before()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return times, result


def _time_cuda(fn: Callable[[], Any], warmup: int, iters: int, device: torch.device,
               before: Callable[[], None] | None, on_start: Callable[[], None] | None) -> tuple[list[float], Any]:
    flush = l2_flush_buffer(device)
    result = None
    for _ in range(warmup):
        if before is not None:
            before()
        result = fn()
    torch.cuda.synchronize(device)
    gpu_barrier(device)
    if on_start is not None:
        on_start()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        cold_start(flush, before)
        starts[i].record()
        result = fn()
        ends[i].record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)], result
