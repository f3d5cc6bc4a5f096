"""Profiles where the host time of an eager (not graph-captured) call goes, per token count.

Low-latency mode (default): the host time per call of back-to-back eager dispatches, combines and
decode steps, the time of each piece of the Python path (monkeypatched timers around the CUDA
backend's methods), the cost of the torch calls it makes (empty, clone, event record), and a
cProfile by cumulative time. Normal mode (--mode normal, CUDA intranode kernels): the host time
per call of eager dispatches (with the layout), cached dispatches and combines, against the time
with the GPU, and a cProfile of each.

Usage (on a GPU machine, from the repository root):
    python tools/profile/host_profile.py [--mode low_latency|normal] [--ranks 1] [--tokens 1,128]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, ".")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ll_profile import decode_step_inputs  # noqa: E402
from profiling import cprofile_calls  # noqa: E402

from epcomm import Buffer  # noqa: E402
from epcomm.backends.cuda import low_latency as cuda_ll  # noqa: E402
from epcomm.bench.workloads import make_pattern_topk_idx  # noqa: E402
from epcomm.utils.launch import LocalCluster  # noqa: E402


def _per_call_us(fn, calls: int = 200) -> tuple[float, float]:
    """(host us per call, us per call once the GPU has caught up), after a warm-up."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host, (time.perf_counter() - start) / calls * 1e6


def _timed_methods(spent: dict[str, list[float]]):
    """Wrap the CUDA low-latency backend's methods with host timers; returns the undo."""
    cls = cuda_ll.CudaLowLatency
    saved = {}
    for name in ("check_errors", "dispatch", "combine", "check_dispatch_args", "check_combine_args", "_launch"):
        original = getattr(cls, name)
        saved[name] = original

        def timed(*args, _original=original, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_name].append((time.perf_counter() - start) * 1e6)

        setattr(cls, name, timed)

    def undo():
        for name, original in saved.items():
            setattr(cls, name, original)

    return undo


def _profile(n: int, hidden: int, num_experts: int, num_topk: int) -> str:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    lines = []
    buf, x, idx, w, y = decode_step_inputs(n, hidden, num_experts, num_topk)
    handles = []

    def dispatch():
        handles[:] = [buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=True)[2]]

    def combine():
        buf.low_latency_combine(y, idx, w, handles[0])

    def step():
        dispatch()
        combine()

    def say(text: str) -> None:
        lines.append(f"rank {rank} T={n}: {text}")

    for name, fn in (("dispatch", dispatch), ("combine", combine), ("dispatch+combine", step)):
        if name == "combine":
            dispatch()
        dist.barrier()
        host, whole = _per_call_us(fn)
        say(f"eager {name}: host {host:.1f} us per call, with the GPU {whole:.1f} us")

    spent: dict[str, list[float]] = defaultdict(list)
    undo = _timed_methods(spent)
    try:
        dist.barrier()
        for _ in range(100):
            step()
        torch.cuda.synchronize()
    finally:
        undo()
    for name, ts in sorted(spent.items()):
        ts = sorted(ts)
        say(f"  backend {name:22s} n={len(ts):4d} median {ts[len(ts) // 2]:7.1f} us  max {ts[-1]:7.1f}")

    rows = n * num_ranks
    e_local = num_experts // num_ranks
    pieces = {
        "torch.empty recv_x fp8": lambda: torch.empty((e_local, rows, hidden), dtype=torch.float8_e4m3fn, device=dev),
        "torch.empty int32 [E_local, rows]": lambda: torch.empty((e_local, rows), dtype=torch.int32, device=dev),
        "torch.empty bf16 [T, H]": lambda: torch.empty((n, hidden), dtype=torch.bfloat16, device=dev),
        "topk_idx.clone()": lambda: idx.clone(),
        "topk_idx.contiguous()": lambda: idx.contiguous(),
        "Event().record()": lambda: torch.cuda.Event().record(),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(dev),
        "is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
    }
    for name, fn in pieces.items():
        host, _ = _per_call_us(fn, 1000)
        say(f"  piece {name:32s} {host:7.2f} us")

    if rank == 0:
        say("cProfile of 50 eager steps (dispatch + combine), by cumulative time\n" +
            cprofile_calls(step, 50, "cumulative", 35))
    else:
        cprofile_calls(step, 50, "cumulative", 35)
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
    if rank == 0:
        say("torch profiler (CPU) of 20 eager steps\n" +
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    dist.barrier()
    buf.destroy()
    return "\n".join(lines)


def _normal_profile(n: int, hidden: int, num_experts: int, num_topk: int) -> str:
    from epcomm.backends.cuda import intranode

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    lines = []
    config = Buffer.get_dispatch_config(num_ranks)
    rows = n * num_ranks  # every token to every rank: the most a rank receives
    row = max(intranode.dispatch_row_bytes(hidden, 2, num_topk, hidden // 128),
              intranode.combine_row_bytes(hidden, num_topk))
    size = max(config.get_nvl_buffer_size_hint(hidden * 2, num_ranks), intranode.ROWS_OFFSET + rows * row)
    buf = Buffer(dist.group.WORLD, size, 0, backend="cuda")
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn((n, hidden), generator=gen).to(torch.bfloat16).to(dev)
    idx = make_pattern_topk_idx(gen, n, num_experts, num_topk, num_ranks, "random").to(dev)
    w = torch.rand((n, num_topk), generator=gen).to(dev)
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    handles = []

    def dispatch():
        out = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
                           is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
                           topk_weights=w)
        handles[:] = [out[0], out[4]]

    def layout_and_dispatch():
        buf.get_dispatch_layout(idx, num_experts)
        dispatch()

    def cached():
        buf.dispatch(x, handle=handles[1])

    def combine():
        buf.combine(handles[0], handles[1])

    def say(text: str) -> None:
        lines.append(f"rank {rank} T={n}: {text}")

    for name, fn in (("dispatch", dispatch), ("layout+dispatch", layout_and_dispatch), ("cached dispatch", cached),
                     ("combine", combine)):
        dist.barrier()
        host, whole = _per_call_us(fn, 50)
        say(f"eager {name}: host {host:.1f} us per call, with the GPU {whole:.1f} us")
    for name, fn in (("dispatch", dispatch), ("cached dispatch", cached), ("combine", combine)):
        text = cprofile_calls(fn, 100, "tottime", 25)
        if rank == 0:
            say(f"cProfile of 100 eager calls of {name}, by own time\n" + text)
    dist.barrier()
    buf.destroy()
    return "\n".join(lines)


def rank_profile(mode: str, tokens: list[int], hidden: int, num_experts: int, num_topk: int) -> str:
    profile = _normal_profile if mode == "normal" else _profile
    return "\n".join(profile(n, hidden, num_experts, num_topk) for n in tokens)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    parser.add_argument("--mode", choices=("low_latency", "normal"), default="low_latency")
    parser.add_argument("--tokens", help="tokens per rank (default 1,128; normal mode 4096)")
    args = parser.parse_args()
    tokens = [int(t) for t in (args.tokens or ("4096" if args.mode == "normal" else "1,128")).split(",")]
    num_experts = 256 if args.mode == "normal" else 288
    with LocalCluster(args.ranks) as cluster:
        for text in cluster.run(rank_profile, args.mode, tokens, 7168, num_experts, 8):
            print(text)


if __name__ == "__main__":
    main()
