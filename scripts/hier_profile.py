"""Where a hierarchical normal-mode call's time goes on the GPU machine: per-kernel device time
(torch.profiler) of dispatch, cached dispatch and combine on the CUDA backend, at the benchmark's
shape; then a timeline of each call: when the host and the GPU reach each kernel launch (host-bound
steps show the GPU waiting for the host).
Usage (on the GPU machine): EPCOMM_RANKS_PER_DOMAIN=1 python scripts/hier_profile.py [--tokens 4096]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, ".")

from epcomm import Buffer  # noqa: E402
from epcomm.backends.cuda.hierarchical import nvl_bytes_needed, rdma_bytes_needed  # noqa: E402
from epcomm.bench.workloads import make_pattern_topk_idx  # noqa: E402
from epcomm.utils.launch import LocalCluster  # noqa: E402


def rank_profile(n: int, hidden: int, num_experts: int, num_topk: int, num_sms: int) -> str:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    rpd = int(os.environ.get("EPCOMM_RANKS_PER_DOMAIN") or num_ranks)
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(dist.group.WORLD, nvl_bytes_needed(n * num_ranks, hidden, 2, num_topk, hidden // 128),
                 rdma_bytes_needed(n, hidden, 2, num_ranks, rpd, num_topk, hidden // 128), backend="cuda",
                 strategy="hierarchical")
    Buffer.set_num_sms(num_sms)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn((n, hidden), generator=gen).to(torch.bfloat16).to(dev)
    idx = make_pattern_topk_idx(gen, n, num_experts, num_topk, num_ranks, "random").to(dev)
    w = torch.rand((n, num_topk), generator=gen).to(dev)
    per_rank, per_domain, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)

    def dispatch():
        return buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_domain,
                            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)

    recv_x, _, recv_w, _, handle, _ = dispatch()
    y = (recv_x.float() * 0.5).to(torch.bfloat16)
    steps = {"dispatch": dispatch, "cached": lambda: buf.dispatch(x, handle=handle),
             "combine": lambda: buf.combine(y, handle, topk_weights=recv_w)}
    lines = []
    for name, fn in steps.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        times: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                times.setdefault(e.name, []).append(e.device_time)
        total = sum(sum(ts) for ts in times.values()) / 10
        lines.append(f"rank {rank} {name}: {total:.1f} us of kernels per call")
        for kname, ts in sorted(times.items(), key=lambda kv: -sum(kv[1])):
            ts = sorted(ts)
            lines.append(f"rank {rank} {name}:   {kname.split('(')[0][:60]:60s} n={len(ts):3d} "
                         f"median {ts[len(ts) // 2]:8.1f} us")
    lines += _timeline(buf, steps, rank)
    buf.destroy()
    return "\n".join(lines)


class _Marked:
    """Stands in for the kernel library: notes the host time and a CUDA event before each entry point."""

    def __init__(self, lib, marks: list):
        self._lib, self._marks = lib, marks

    def __getattr__(self, name: str):
        fn = getattr(self._lib, name)

        def marked(*args):
            self._marks.append((name.replace("epcomm_hierarchical_", ""), time.perf_counter(), _event()))
            return fn(*args)
        return marked


def _event() -> torch.cuda.Event:
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def _timeline(buf, steps: dict, rank: int) -> list[str]:
    """Where the host and the GPU are at each step of a call: the host's time when it reaches the
    step, and the GPU's (an event recorded there), both from the call's start, medians of 20 calls."""
    cuda = buf._cuda
    marks: list = []
    lib, check_errors = cuda.nv, cuda.check_errors

    def checked(op):  # after the host sync in a dispatch without num_worst_tokens; no sync elsewhere
        marks.append(("check_errors", time.perf_counter(), _event()))
        return check_errors(op)
    cuda.nv, cuda.check_errors = _Marked(lib, marks), checked
    try:
        return _timeline_lines(steps, rank, marks)
    finally:
        cuda.nv, cuda.check_errors = lib, check_errors


def _timeline_lines(steps: dict, rank: int, marks: list) -> list[str]:
    lines = []
    for name, fn in steps.items():
        rows: dict[str, list[tuple[float, float]]] = {}
        for _ in range(20):
            marks.clear()
            marks.append(("start", time.perf_counter(), _event()))
            fn()
            marks.append(("end", time.perf_counter(), _event()))
            torch.cuda.synchronize()
            t0, e0 = marks[0][1], marks[0][2]
            for i, (step, t, e) in enumerate(marks):
                rows.setdefault(f"{i:2d} {step}", []).append(((t - t0) * 1e6, e0.elapsed_time(e) * 1e3))
        for step, vals in rows.items():
            host = sorted(v[0] for v in vals)[len(vals) // 2]
            gpu = sorted(v[1] for v in vals)[len(vals) // 2]
            lines.append(f"rank {rank} {name} timeline: {step:16s} host {host:8.1f} us  gpu {gpu:8.1f} us")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--num-sms", type=int, default=24)
    args = parser.parse_args()
    env = {"NVSHMEM_SYMMETRIC_SIZE": str(3 << 30)}
    with LocalCluster(args.ranks, backend="nccl", env=env) as cluster:
        for text in cluster.run(rank_profile, args.tokens, 7168, 256, 8, args.num_sms):
            print(text)


if __name__ == "__main__":
    main()
