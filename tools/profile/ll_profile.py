"""Profiles where a low-latency call's time goes: per-kernel device time, phase timeline, host time.

The per-kernel device time is torch.profiler's (as DeepEP's tests measure), the host time of an
eager call cProfile's, per token count.

Usage (on a GPU machine, from the repository root):
    python tools/profile/ll_profile.py [--ranks 2] [--tokens 1,128] [--after dispatch]

--after dispatch: the replayed step is two dispatches (the timeline shows the second) instead of a
dispatch and a combine, so a dispatch starts with the state its own kernel left (instruction cache,
address translations) rather than the combine's: a phase that shrinks then was a cold start.

--cold: a second timeline where every replay follows the benchmark's L2 flush and head start
(epcomm.bench.timing.cold_start), as the benchmark times a call: what the cold caches add to the
kernel, apart from the events' own overhead in the benchmark's columns. --cold read: the flush
reads the 256 MB instead of writing it, so L2 is left cold but clean: a phase that is slow after
the write and not after the read waits for dirty lines going back to HBM, not for misses.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, ".")

from profiling import cprofile_calls, kernel_lines, last_call_lines, profile_calls  # noqa: E402

from epcomm import Buffer  # noqa: E402
from epcomm.bench.timing import cold_start, l2_flush_buffer  # noqa: E402
from epcomm.bench.workloads import make_pattern_topk_idx  # noqa: E402
from epcomm.utils.launch import LocalCluster  # noqa: E402


def rank_profile(tokens: list[int], hidden: int, num_experts: int, num_topk: int, after: str = "combine",
                 cold: str = "") -> str:
    return "\n".join(_profile(n, hidden, num_experts, num_topk, after, cold) for n in tokens)


def decode_step_inputs(n: int, hidden: int, num_experts: int, num_topk: int):
    """A CUDA low-latency Buffer sized by the hint and this rank's decode-step inputs: (buf, x [n,
    H] bf16, topk_idx [n, K] random routing, weights, expert outputs y [E_local, n*R, H] bf16)."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    size = Buffer.get_low_latency_rdma_size_hint(n, hidden, num_ranks, num_experts)
    buf = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, backend="cuda")
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn((n, hidden), generator=gen).to(torch.bfloat16).to(dev)
    idx = make_pattern_topk_idx(gen, n, num_experts, num_topk, num_ranks, "random").to(dev)
    w = torch.rand((n, num_topk), generator=gen).to(dev)
    y = torch.randn((num_experts // num_ranks, n * num_ranks, hidden), dtype=torch.bfloat16, device=dev)
    return buf, x, idx, w, y


def _profile(n: int, hidden: int, num_experts: int, num_topk: int, after: str, cold: str) -> str:
    rank = dist.get_rank()
    lines = []
    buf, x, idx, w, y = decode_step_inputs(n, hidden, num_experts, num_topk)

    def step():
        _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=True)
        if after == "dispatch":  # (two results alive at once: the double buffering's limit)
            buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=True)
        else:
            buf.low_latency_combine(y, idx, w, handle)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()  # replays keep the ranks in step (no host time between kernels)
    with torch.cuda.graph(graph):
        step()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(41)]
    events[0].record()
    for i in range(40):
        graph.replay()
        events[i + 1].record()
    torch.cuda.synchronize()
    per_step = sorted(events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(40))
    lines.append(f"rank {rank} T={n}: graph step (dispatch + {after}) back to back: median {per_step[20]:.1f} us, "
                 f"min {per_step[0]:.1f}, max {per_step[-1]:.1f}")
    dist.barrier()
    lines += _timeline(buf, step, n)
    dist.barrier()
    if cold:
        lines += _timeline(buf, step, n, cold=cold)
        dist.barrier()
    prof = profile_calls(graph.replay, 20)
    lines += kernel_lines(prof, 20, f"rank {rank} T={n}")
    lines += last_call_lines(prof, 20, f"rank {rank} T={n} replay")
    dist.barrier()

    for name, fn in (("dispatch", lambda: buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=True)),
                     (f"dispatch+{after}", step)):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            fn()
        host = (time.perf_counter() - start) / 50 * 1e6
        torch.cuda.synchronize()
        whole = (time.perf_counter() - start) / 50 * 1e6
        lines.append(f"rank {rank} T={n}: eager {name}: host {host:.1f} us per call, with the GPU {whole:.1f} us")
    text = cprofile_calls(lambda: buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=True), 50, "tottime", 30)
    if rank == 0:
        lines.append(f"rank 0 T={n}: host profile of 50 eager dispatches\n" + text)
    dist.barrier()
    buf.destroy()
    return "\n".join(lines)


_POINTS = ("start", "ready", "rows", "cast", "stored", "written", "signalled", "arrived", "received", "end",
           "signals", "pair-rows", "entered", "loaded")  # TracePoint's indices
_PASS_ORDER = ("start", "ready", "signals", "pair-rows", "rows", "entered", "loaded", "cast", "stored", "written",
               "signalled", "arrived", "received", "end")  # the order a block passes them (the printed order)
_SM = 14  # TracePoint kTraceSm: not a time, the block's SM + 1 (the fused dispatch's send role stamps it)
_KERNELS = {("dispatch", 0): "dispatch send (fused: all)", ("dispatch", 1): "dispatch recv",
            ("combine", 0): "combine send", ("combine", 1): "combine recv"}


def _timeline(buf: Buffer, step, n: int, samples: int = 5, cold: str = "") -> list[str]:
    """The phase timeline of a replayed decode step: each block's global-timer stamps at the points
    of include/epcomm/layout/low_latency.cuh (TracePoint), relative to the step's first dispatch block start.
    Per point: the earliest, median and latest block, medians over `samples` steady-state replays.
    `cold` "write": each replay after the benchmark's L2 flush and head start (timing.cold_start);
    "read": the same with the 256 MB read instead of written (L2 cold but clean)."""
    flush = l2_flush_buffer(torch.device("cuda", torch.cuda.current_device())) if cold else None
    ll = buf.low_latency_ops
    traces = ll.trace()
    graph = torch.cuda.CUDAGraph()  # captured with the trace on (the timed graph above had it off)
    with torch.cuda.graph(graph):
        step()
    rows: dict[tuple, list[tuple[float, float, float]]] = {}
    for _ in range(samples):
        # Every replay stamps the same cells: zeroed once, then back to back as in decode (each
        # call waits for its peers' previous one), the last replay's stamps are read.
        for t in traces.values():
            t.zero_()
        for _ in range(30):
            if flush is not None:
                cold_start(flush, write=cold == "write")
            graph.replay()
        torch.cuda.synchronize()
        host = {op: t.cpu() for op, t in traces.items()}
        origin = host["dispatch"][0, :, 0]
        origin = int(origin[origin > 0].min())
        for op, plane in _KERNELS:
            stamps = host[op][plane]
            for role, blocks in _roles(op, plane, stamps).items():
                for p in range(min(len(_POINTS), stamps.shape[-1])):
                    col = stamps[blocks, p]
                    col = col[col > 0]
                    if col.numel() == 0:
                        continue
                    us = (col - origin).double().sort().values / 1e3
                    rows.setdefault((op, plane, role, p), []).append(
                        (float(us[0]), float(us[us.numel() // 2]), float(us[-1])))
    ll.trace(False)
    rank = dist.get_rank()
    after_flush = {"": "", "write": " after an L2 flush", "read": " after an L2 flush by reads"}[cold]
    out = [f"rank {rank} T={n}: phase timeline of one replayed step{after_flush} "
           "(us from the first dispatch block's start; "
           f"earliest / median / latest block; median of {samples} samples)"]
    order = [_POINTS.index(name) for name in _PASS_ORDER]

    def printed(kv) -> tuple[int, str, int]:
        return list(_KERNELS).index(kv[0][:2]), kv[0][2], order.index(kv[0][3])

    for (op, plane, role, p), vals in sorted(rows.items(), key=printed):
        med = [sorted(v[i] for v in vals)[len(vals) // 2] for i in range(3)]
        out.append(f"rank {rank} T={n}:   {_KERNELS[(op, plane)] + role:38s} {_POINTS[p]:9s} "
                   f"{med[0]:7.1f} {med[1]:7.1f} {med[2]:7.1f}")
    out.extend(_senders_by_sm(rank, n, host["dispatch"][0], origin))
    return out


def _senders_by_sm(rank: int, n: int, stamps: torch.Tensor, origin: int) -> list[str]:
    """The fused dispatch's senders in the last replay, in SM order, each as block@SM:written (us
    from the step's start): whether the senders that store their messages last share a part of the
    GPU (their `written` spread is then wider than their share of the work)."""
    if stamps.shape[-1] <= _SM:
        return []
    sent = (_senders(stamps) & (stamps[:, _SM] > 0)).nonzero().flatten().tolist()
    if not sent:
        return []
    rows = sorted((int(stamps[b, _SM]) - 1, b, (int(stamps[b, _POINTS.index("written")]) - origin) / 1e3) for b in sent)
    return [f"rank {rank} T={n}: senders by SM (block@SM:written us): "
            + " ".join(f"{b}@{sm}:{w:.1f}" for sm, b, w in rows)]


def _senders(stamps: torch.Tensor) -> torch.Tensor:
    """A fused dispatch's blocks that sent: those that stamped `entered` (a first load of x)."""
    return stamps[:, _POINTS.index("entered")] > 0


def _roles(op: str, plane: int, stamps: torch.Tensor) -> dict[str, torch.Tensor]:
    """The blocks of a kernel's plane to summarize apart: a fused dispatch's senders (the blocks
    that stamped `entered`, a first load of x) and its receive-only blocks, where it has both (their
    median would otherwise be whichever role has more blocks, and where most blocks only receive,
    a median block read as a sender hides the senders' rows phase); else all."""
    every = stamps[:, 0] > 0
    if op == "dispatch" and plane == 0:
        sent = _senders(stamps)
        if sent.any() and (every & ~sent).any():
            return {": senders": sent, ": receivers": every & ~sent}
    return {"": every}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    parser.add_argument("--tokens", default="1,128")
    parser.add_argument("--after", choices=("combine", "dispatch"), default="combine",
                        help="what a replayed step has after its dispatch [combine]")
    parser.add_argument("--cold", nargs="?", const="write", default="", choices=("write", "read"),
                        help="also a timeline of replays that each follow an L2 flush, as the benchmark times "
                        "(write), or a flush by reads that leaves L2 clean (read)")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    with LocalCluster(args.ranks) as cluster:
        for text in cluster.run(rank_profile, tokens, 7168, 288, 8, args.after, args.cold):
            print(text)


if __name__ == "__main__":
    main()
