"""Measures the floor of the benchmark's timing method on this GPU: the span of a call doing nothing.

The span is what the benchmark's CUDA events measure around a call that does (almost) nothing,
eager and replayed from a CUDA graph, with the benchmark's L2 flush and head start before each span
(epcomm/bench/timing.py, cold_start). A low-latency call's figure is its kernels plus this floor, so
the floor says how much of a short dispatch is the launch. The "+ event" cases record one more
event without timing after the call, as the low-latency buffer does after each of its calls, to
show what that event adds to the span.

    python3 tools/profile/launch_floor.py [--iters 200]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from epcomm.bench.timing import cold_start, l2_flush_buffer

LONG_KERNEL_CYCLES = 35_000  # ~20 us at the H100/H200's 1.7-1.98 GHz


def spans(fn, iters: int, device: torch.device) -> list[float]:
    flush = l2_flush_buffer(device)
    for _ in range(20):
        fn()
    torch.cuda.synchronize(device)
    marks = []
    for _ in range(iters):
        cold_start(flush)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        marks.append((start, end))
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) * 1e3 for s, e in marks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    x = torch.zeros(1, device=device)

    def one_kernel():
        x.add_(1)

    def two_kernels():
        x.add_(1)
        x.mul_(1)

    done = torch.cuda.Event()  # without timing, as the low-latency buffer's own (recorded after each call)

    def kernel_and_event():
        x.add_(1)
        done.record()

    def long_kernel():  # ~20 us, as a low-latency dispatch
        torch.cuda._sleep(LONG_KERNEL_CYCLES)

    def long_kernel_and_event():
        torch.cuda._sleep(LONG_KERNEL_CYCLES)
        done.record()

    results = {"nothing (two events)": spans(lambda: None, args.iters, device),
               "eager, one tiny kernel": spans(one_kernel, args.iters, device),
               "eager, two tiny kernels": spans(two_kernels, args.iters, device),
               "eager, tiny kernel + event": spans(kernel_and_event, args.iters, device),
               "eager, 20 us kernel": spans(long_kernel, args.iters, device),
               "eager, 20 us kernel + event": spans(long_kernel_and_event, args.iters, device)}
    for name, fn in (("one", one_kernel), ("two", two_kernels)):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        results[f"graph replay, {name} tiny kernel(s)"] = spans(graph.replay, args.iters, device)
    print(f"{torch.cuda.get_device_name(device)}: event span, us (median / min / max of {args.iters})")
    for name, values in results.items():
        print(f"  {name:34s} {statistics.median(values):6.2f} {min(values):6.2f} {max(values):6.2f}")


if __name__ == "__main__":
    main()
