"""Profiles where a hierarchical normal-mode call's time goes: per-kernel device time and a timeline.

Per-kernel device time (torch.profiler) of dispatch, cached dispatch and combine on the CUDA
backend, at the benchmark's shape; then a timeline of each call: when the host and the GPU reach
each kernel launch (host-bound steps show the GPU waiting for the host).

Usage (on a GPU machine, from the repository root):
    EPCOMM_RANKS_PER_DOMAIN=1 python tools/profile/hier_profile.py [--tokens 4096]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, ".")

from profiling import MarkedLibrary, Marks, kernel_lines, profile_calls, timeline_lines  # noqa: E402

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
        lines += kernel_lines(profile_calls(fn, 10, warmup=5), 10, f"rank {rank} {name}")
    lines += _timeline(buf, steps, rank)
    buf.destroy()
    return "\n".join(lines)


def _timeline(buf, steps: dict, rank: int) -> list[str]:
    """Where the host and the GPU are at each step of a call (profiling.timeline_lines)."""
    cuda = buf.normal_ops
    marks = Marks()
    lib, check_errors = cuda.nv, cuda.check_errors

    def checked(op):  # after the host sync in a dispatch without num_worst_tokens; no sync elsewhere
        marks("check_errors")
        return check_errors(op)
    cuda.nv, cuda.check_errors = MarkedLibrary(lib, marks, "epcomm_hierarchical_"), checked
    try:
        return timeline_lines(steps, marks, f"rank {rank}")
    finally:
        cuda.nv, cuda.check_errors = lib, check_errors


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
