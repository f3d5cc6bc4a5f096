"""Profiles the portable path (backend="reference"): where an eager call's time goes.

For each operation (normal dispatch, cached dispatch and combine at the main job's shapes;
low-latency dispatch and combine): the time per call with the device caught up, the device time
of its kernels by kernel (GPU), and a cProfile by own time, so the host's share (handshakes,
waits, launches) and the device's can be told apart. Runs on CPU ranks (gloo) too.

Usage (from the repository root):
    python tools/profile/reference_profile.py [--ranks 1] [--tokens 4096] [--ll-tokens 128]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, ".")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from profiling import cprofile_calls, kernel_lines, profile_calls  # noqa: E402

from epcomm import Buffer  # noqa: E402
from epcomm.bench.workloads import make_pattern_topk_idx  # noqa: E402
from epcomm.utils.launch import LocalCluster  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _per_call_us(fn, dev: torch.device, calls: int) -> float:
    for _ in range(3):
        fn()
    _sync(dev)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(dev)
    return (time.perf_counter() - start) / calls * 1e6


def rank_profile(tokens: int, ll_tokens: int, hidden: int, num_experts: int, ll_experts: int, calls: int,
                 times_only: bool = False) -> str:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator().manual_seed(rank)
    lines: list[str] = []

    def say(text: str) -> None:
        lines.append(f"rank {rank}: {text}")

    ops = {}
    nvl_bytes = Buffer.get_dispatch_config(num_ranks).get_nvl_buffer_size_hint(hidden * 2, num_ranks)
    buf = Buffer(dist.group.WORLD, nvl_bytes, 0, backend="reference")
    x = torch.randn((tokens, hidden), generator=gen).to(torch.bfloat16).to(dev)
    idx = make_pattern_topk_idx(gen, tokens, num_experts, 8, num_ranks, "random").to(dev)
    w = torch.rand((tokens, 8), generator=gen).to(dev)
    layout = buf.get_dispatch_layout(idx, num_experts)
    state = {}

    def dispatch():
        out = buf.dispatch(x, num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1],
                           is_token_in_rank=layout[3], num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w)
        state["recv"], state["handle"] = out[0], out[4]

    dispatch()
    ops["layout"] = lambda: buf.get_dispatch_layout(idx, num_experts)
    ops["dispatch"] = dispatch
    ops["cached dispatch"] = lambda: buf.dispatch(x, handle=state["handle"])
    ops["combine"] = lambda: buf.combine(state["recv"], state["handle"])

    rdma_bytes = Buffer.get_low_latency_rdma_size_hint(ll_tokens, hidden, num_ranks, ll_experts)
    ll = Buffer(dist.group.WORLD, 0, rdma_bytes, low_latency_mode=True, num_qps_per_rank=ll_experts // num_ranks,
                backend="reference")
    lx = torch.randn((ll_tokens, hidden), generator=gen).to(torch.bfloat16).to(dev)
    lidx = make_pattern_topk_idx(gen, ll_tokens, ll_experts, 8, num_ranks, "random").to(dev)
    lw = torch.rand((ll_tokens, 8), generator=gen).to(dev)
    ly = torch.randn((ll_experts // num_ranks, ll_tokens * num_ranks, hidden), generator=gen).to(torch.bfloat16).to(dev)

    def ll_dispatch():
        state["ll_handle"] = ll.low_latency_dispatch(lx, lidx, ll_tokens, ll_experts, use_fp8=True)[2]

    ll_dispatch()
    ops["ll dispatch"] = ll_dispatch
    ops["ll combine"] = lambda: ll.low_latency_combine(ly, lidx, lw, state["ll_handle"])

    for name, fn in ops.items():
        say(f"{name}: {_per_call_us(fn, dev, calls):.1f} us per call (device caught up)")
    if dev.type == "cuda" and not times_only:
        for name, fn in ops.items():
            dist.barrier()
            prof = profile_calls(fn, calls, warmup=2)
            lines.extend(f"rank {rank}: {line}" for line in kernel_lines(prof, calls, name)[:8])
    if not times_only:
        for name, fn in ops.items():
            text = cprofile_calls(fn, calls, "tottime", 18)  # (collective: every rank profiles)
            if rank == 0:
                say(f"cProfile of {calls} calls of {name}, by own time\n" + text)
    dist.barrier()
    buf.destroy()
    ll.destroy()
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--ranks", type=int, default=max(torch.cuda.device_count(), 1))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--ll-tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--ll-experts", type=int, default=288)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--times-only", action="store_true", help="the times per call, no profiles")
    args = parser.parse_args()
    with LocalCluster(args.ranks) as cluster:
        for text in cluster.run(rank_profile, args.tokens, args.ll_tokens, args.hidden, args.experts,
                                args.ll_experts, args.calls, args.times_only, timeout_s=900):
            print(text)


if __name__ == "__main__":
    main()
