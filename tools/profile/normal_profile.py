"""Profiles where a normal-mode call's time goes on the CUDA intranode kernels, per token count.

The device time of each kernel of a dispatch (with its count exchange), a cached dispatch and a combine
(torch.profiler), and the GPU activities of one call in start order with the gaps between them,
per token count. The benchmark's time of a call is these kernels plus the launch gaps; what is
fixed (the notify / barrier kernel, launches) shows at small token counts, what scales with the
rows at large ones. Then a timeline of each call: where the host and the GPU are at each step (in a
fresh dispatch: its wait for the counts, and the receive launch after it).

Usage (on a GPU machine, from the repository root):
    python tools/profile/normal_profile.py [--ranks 1] [--tokens 512,4096] [--num-sms 24]
        [--dtype bf16|fp8]   (fp8: x cast per token, 1x128 scales, as the bench)
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, ".")

from profiling import MarkedLibrary, Marks, kernel_lines, last_call_lines, profile_calls, timeline_lines  # noqa: E402

from epcomm import Buffer, per_token_cast_to_fp8  # noqa: E402
from epcomm.backends.cuda.intranode import buffer_bytes_needed  # noqa: E402
from epcomm.bench.workloads import make_rank_inputs  # noqa: E402
from epcomm.utils.launch import LocalCluster  # noqa: E402


def rank_profile(tokens: list[int], hidden: int, num_experts: int, num_topk: int, num_sms: int,
                 dtype: str = "bf16") -> str:
    return "\n".join(_profile(n, hidden, num_experts, num_topk, num_sms, dtype) for n in tokens)


def _profile(n: int, hidden: int, num_experts: int, num_topk: int, num_sms: int, dtype: str) -> str:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    Buffer.set_num_sms(num_sms)
    configs = (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks))
    num_bytes = max([buffer_bytes_needed(n, hidden, 2, num_ranks, num_topk)] +
                    [c.get_nvl_buffer_size_hint(hidden * 2, num_ranks) for c in configs])
    buf = Buffer(dist.group.WORLD, num_bytes, backend="cuda")
    mine = make_rank_inputs(0, rank, n, hidden, num_experts, num_topk)
    x, idx, w = mine.x.to(dev), mine.topk_idx.to(dev), mine.topk_weights.to(dev)
    if dtype == "fp8":
        x = per_token_cast_to_fp8(x)  # (data, scales): the dispatch takes the pair
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    # The combine sends BF16 back whatever the dispatch carried.
    combine_x = recv_x if dtype == "bf16" else torch.randn(recv_x[0].shape, dtype=torch.bfloat16, device=dev)
    calls = {"dispatch": lambda: buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w),
             "cached dispatch": lambda: buf.dispatch(x, handle=handle),
             "combine": lambda: buf.combine(combine_x, handle)}
    lines = []
    for name, fn in calls.items():
        prof = profile_calls(fn, 20, warmup=5)
        lines += kernel_lines(prof, 20, f"rank {rank} T={n} {name}")
        lines += last_call_lines(prof, 20, f"rank {rank} T={n} {name}")
        dist.barrier()
    lines += _timeline(buf, calls, f"rank {rank} T={n}")
    buf.destroy()
    return "\n".join(lines)


class _MarkedEvent:
    """Stands in for the event a dispatch's host waits on: marks the wait's start and end."""

    def __init__(self, event: torch.cuda.Event, marks: Marks):
        self._event, self._marks = event, marks

    def record(self, stream) -> None:
        self._event.record(stream)

    def wait(self, stream=None) -> None:  # the send half's stream waits on it (more than one rank)
        self._event.wait(stream)

    def synchronize(self) -> None:
        self._marks("host waits")
        self._event.synchronize()
        self._marks("host has counts", gpu=False)


def _timeline(buf, calls: dict, prefix: str) -> list[str]:
    """Where the host and the GPU are at each step of each call (profiling.timeline_lines): in a
    dispatch, the host's wait for the counts, its error check, each output allocation, and the
    receive launch after them (host-only marks, but for the kernel launches and the wait)."""
    cuda = buf.normal_ops
    marks = Marks()
    lib, counted, check_errors, empty = cuda.lib, cuda._counted, cuda.check_errors, torch.empty

    def checked(op):
        marks("check_errors", gpu=False)
        return check_errors(op)

    def allocated(*args, **kwargs):
        marks("torch.empty", gpu=False)
        return empty(*args, **kwargs)

    def around(name: str):  # marks a backend method's entry and return (host only)
        method = getattr(cuda, name)

        def marked(*args, **kwargs):
            marks(f"{name} in", gpu=False)
            out = method(*args, **kwargs)
            marks(f"{name} out", gpu=False)
            return out
        setattr(cuda, name, marked)

    cuda.lib, cuda._counted, cuda.check_errors = MarkedLibrary(lib, marks), _MarkedEvent(counted, marks), checked
    torch.empty = allocated
    for name in ("dispatch", "combine", "_launch_dispatch"):
        around(name)
    try:
        return timeline_lines(calls, marks, prefix)
    finally:
        cuda.lib, cuda._counted, cuda.check_errors = lib, counted, check_errors
        torch.empty = empty
        for name in ("dispatch", "combine", "_launch_dispatch"):
            delattr(cuda, name)  # the instance attribute goes; the class's method shows again


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    parser.add_argument("--tokens", default="512,4096")
    parser.add_argument("--num-sms", type=int, default=24)
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    with LocalCluster(args.ranks) as cluster:
        for text in cluster.run(rank_profile, tokens, 7168, 256, 8, args.num_sms, args.dtype):
            print(text)


if __name__ == "__main__":
    main()
