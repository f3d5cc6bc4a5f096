"""Rank side of the benchmark: run one case on this rank, check it, time it, report this rank's numbers.

``LocalCluster.run(run_case, case)`` calls ``run_case`` on every rank. Each rank returns its own
medians and byte counts; the driver takes the slowest rank. Every rank makes the same sequence of
collective calls whatever its checks find, so a failed check is reported, never a hang.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from .. import Buffer, per_token_cast_to_fp8
from . import checks, metrics
from .timing import time_call
from .workloads import A2A, NORMAL, Case, RankInputs, all_rank_inputs


def rank_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")


def device_info() -> dict[str, Any]:
    """What the ranks run on, asked of the ranks so the driver never creates a CUDA context itself."""
    info: dict[str, Any] = {"pg_backend": str(dist.get_backend()), "num_ranks": dist.get_world_size(),
                            "pid": os.getpid()}
    if info["pg_backend"] == "nccl":
        info["device_name"] = torch.cuda.get_device_name()
        info["device_count"] = torch.cuda.device_count()
    return info


def run_case(case: Case) -> dict[str, Any]:
    """Run ``case`` on this rank; returns this rank's medians (s), byte counts and check failures."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    inputs = all_rank_inputs(case, num_ranks, device)
    tag = f"rank {rank}: {case.describe()}"
    if case.kind == A2A:
        return _run_a2a(case, inputs, rank, device, tag)
    if case.mode == NORMAL:
        return _run_normal(case, inputs, rank, tag)
    return _run_low_latency(case, inputs, rank, tag)


def _guarded(failures: list[str], tag: str, check, *args) -> None:
    """Run a local check; a check that raises is a failure of this case, not of the run."""
    try:
        failures.extend(check(tag, *args))
    except Exception as error:  # any exception means the outputs could not be verified
        failures.append(f"{tag}: {check.__name__} raised {type(error).__name__}: {error}")


def _run_normal(case: Case, inputs: list[RankInputs], rank: int, tag: str) -> dict[str, Any]:
    num_ranks = len(inputs)
    Buffer.set_num_sms(case.num_sms)
    dispatch_config = Buffer.get_dispatch_config(num_ranks)
    combine_config = Buffer.get_combine_config(num_ranks)
    # DeepEP's rule: H * max(element size, 2), so one buffer serves both dtypes.
    hidden_bytes = case.hidden * 2
    configs = (dispatch_config, combine_config)
    num_nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) for c in configs)
    num_rdma_bytes = max(c.get_rdma_buffer_size_hint(hidden_bytes, num_ranks) for c in configs)
    buf = Buffer(dist.group.WORLD, num_nvl_bytes, num_rdma_bytes, backend=case.backend)
    mine = inputs[rank]
    want = checks.Expected(inputs, rank, case.num_experts)
    failures: list[str] = []

    per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(mine.topk_idx, case.num_experts)
    x_in = mine.x if case.dtype == "bf16" else per_token_cast_to_fp8(mine.x)

    def dispatch():
        return buf.dispatch(x_in, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
                            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                            topk_idx=mine.topk_idx, topk_weights=mine.topk_weights, config=dispatch_config)

    recv_x, recv_idx, recv_w, expert_list, handle, _ = dispatch()
    _guarded(failures, f"{tag} (first dispatch)", checks.check_normal_dispatch, recv_x, recv_idx, recv_w,
             expert_list, want, case.dtype)
    y = checks.normal_combine_input(recv_x, case.dtype)

    def cached_dispatch():
        return buf.dispatch(x_in, handle=handle, config=dispatch_config)

    def combine():
        return buf.combine(y, handle, config=combine_config)

    _guarded(failures, f"{tag} (first combine)", checks.check_normal_combine, combine()[0], mine, want,
             case.dtype)

    dispatch_s, last = time_call(dispatch, case.warmup, case.iters, buf.device)
    _guarded(failures, f"{tag} (timed dispatch)", checks.check_normal_dispatch, *last[:4], want, case.dtype)
    cached_s, last = time_call(cached_dispatch, case.warmup, case.iters, buf.device)
    _guarded(failures, f"{tag} (timed cached dispatch)", checks.check_normal_dispatch, last[0], None, None,
             None, want, case.dtype)
    combine_s, last = time_call(combine, case.warmup, case.iters, buf.device)
    _guarded(failures, f"{tag} (timed combine)", checks.check_normal_combine, last[0], mine, want, case.dtype)

    result = {
        "impl": f"epcomm-{buf.backend_name}", "num_domains": buf.num_domains,
        "buffer_bytes": buf.num_nvl_bytes + buf.num_rdma_bytes,
        "dispatch_s": dispatch_s, "cached_dispatch_s": cached_s, "combine_s": combine_s,
        "dispatch_bytes": metrics.normal_dispatch_bytes(want.num_rows, case.hidden, case.dtype),
        "combine_bytes": metrics.normal_combine_bytes(want.num_rows, case.hidden),
        "failures": failures,
    }
    buf.destroy()
    return result


def _run_low_latency(case: Case, inputs: list[RankInputs], rank: int, tag: str) -> dict[str, Any]:
    num_ranks = len(inputs)
    Buffer.set_num_sms(case.num_sms)  # the low-latency kernels choose their own SM count; recorded anyway
    n, hidden, num_experts = case.num_tokens, case.hidden, case.num_experts
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(n, hidden, num_ranks, num_experts)
    buf = Buffer(dist.group.WORLD, 0, num_rdma_bytes, low_latency_mode=True,
                 num_qps_per_rank=max(1, num_experts // num_ranks), backend=case.backend)
    mine = inputs[rank]
    failures: list[str] = []

    def dispatch():
        return buf.low_latency_dispatch(mine.x, mine.topk_idx, n, num_experts, use_fp8=True)

    recv_x, recv_count, handle, _, _ = dispatch()
    _guarded(failures, f"{tag} (first dispatch)", checks.check_ll_dispatch, recv_x, recv_count, handle,
             inputs, rank, num_experts)

    dispatch_s, last = time_call(dispatch, case.warmup, case.iters, buf.device)
    recv_x, recv_count, handle = last[:3]
    _guarded(failures, f"{tag} (timed dispatch)", checks.check_ll_dispatch, recv_x, recv_count, handle,
             inputs, rank, num_experts)
    # Combine the latest dispatch's rows with its handle, as a decode step would.
    y = checks.ll_combine_input(recv_x, recv_count, n, num_ranks)

    def combine():
        return buf.low_latency_combine(y, mine.topk_idx, mine.topk_weights, handle)

    _guarded(failures, f"{tag} (first combine)", checks.check_ll_combine, combine()[0], mine)
    combine_s, last = time_call(combine, case.warmup, case.iters, buf.device)
    _guarded(failures, f"{tag} (timed combine)", checks.check_ll_combine, last[0], mine)

    num_selections = int((mine.topk_idx >= 0).sum())
    result = {
        "impl": f"epcomm-{buf.backend_name}", "num_domains": buf.num_domains,
        "buffer_bytes": buf.num_rdma_bytes,
        "dispatch_s": dispatch_s, "combine_s": combine_s,
        "dispatch_bytes": metrics.ll_dispatch_bytes(num_selections, hidden, "fp8"),
        "combine_bytes": metrics.ll_combine_bytes(num_selections, hidden),
        "failures": failures,
    }
    buf.destroy()
    return result


def _run_a2a(case: Case, inputs: list[RankInputs], rank: int, device: torch.device,
             tag: str) -> dict[str, Any]:
    """The peer baseline: one plain ``all_to_all_single`` of BF16 rows with the same routing.

    Each token is sent once to every rank holding one of its experts, ordered by destination and
    then token, i.e. exactly the rows a normal dispatch moves, without layout or packing. The
    "combine" direction is the reverse exchange of the same rows.
    """
    want = checks.Expected(inputs, rank, case.num_experts)
    mine = inputs[rank]
    order = torch.cat([torch.nonzero(want.in_rank[:, r]).flatten() for r in range(len(inputs))])
    send = mine.x[order].contiguous()
    send_splits = want.in_rank.sum(0).tolist()
    recv_splits = want.recv_splits
    recv = torch.empty((sum(recv_splits), case.hidden), dtype=torch.bfloat16, device=device)
    back = torch.empty_like(send)
    failures: list[str] = []

    def forward():
        dist.all_to_all_single(recv, send, recv_splits, send_splits)
        return recv

    def backward():
        dist.all_to_all_single(back, recv, send_splits, recv_splits)
        return back

    forward()
    backward()
    _guarded(failures, f"{tag} (first exchange)", checks.check_a2a, recv, want, back, send)
    # Poison the outputs so the check after timing sees what the timed calls wrote.
    recv.fill_(float("nan"))
    back.fill_(float("nan"))
    dispatch_s, _ = time_call(forward, case.warmup, case.iters, device)
    combine_s, _ = time_call(backward, case.warmup, case.iters, device)
    _guarded(failures, f"{tag} (timed exchange)", checks.check_a2a, recv, want, back, send)
    backend = str(dist.get_backend())
    num_bytes = want.num_rows * case.hidden * 2  # recv bytes, this rank's own rows included
    return {
        "impl": f"{backend}-a2a", "num_domains": 1, "buffer_bytes": send.nbytes + recv.nbytes,
        "dispatch_s": dispatch_s, "combine_s": combine_s,
        "dispatch_bytes": num_bytes, "combine_bytes": num_bytes,
        "failures": failures,
    }
