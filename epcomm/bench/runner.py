"""Rank side of the benchmark: run one case on this rank, check it, time it, report this rank's numbers.

``LocalCluster.run(run_case, case)`` calls ``run_case`` on every rank. Each rank returns its own
medians and byte counts; the driver takes the slowest rank. Every rank makes the same sequence of
collective calls whatever its checks find, so a failed check is reported, never a hang.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import Buffer, per_token_cast_to_fp8
from ..utils.launch import group_device
from . import checks, megatron, memory, metrics
from .timing import HEAD_START_CYCLES, cold_start, gpu_barrier, l2_flush_buffer, time_samples
from .workloads import (
    A2A,
    AG,
    ALLGATHER,
    ALLTOALL,
    COPY,
    DEEP_EP,
    HIERARCHICAL,
    MEGATRON,
    NORMAL,
    Case,
    RankInputs,
    all_rank_inputs,
)

# The single-tensor collectives under their current names (the older ones warn in recent PyTorch).
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
    device = group_device()
    inputs = all_rank_inputs(case, num_ranks, device)
    tag = f"rank {rank}: {case.describe()}"
    if case.kind == A2A:
        return _run_a2a(case, inputs, rank, device, tag)
    if case.kind == AG:
        return _run_allgather_baseline(case, inputs, rank, device, tag)
    if case.kind == MEGATRON:
        return _run_megatron(case, inputs, rank, tag)
    if case.kind == COPY:
        return _run_copy(case, inputs, rank, device, tag)
    if case.mode == NORMAL:
        return _run_normal(case, inputs, rank, tag)
    return _run_low_latency(case, inputs, rank, tag)


def _guarded(failures: list[str], tag: str, check, *args) -> None:
    """Run a local check; a check that raises is a failure of this case, not of the run."""
    try:
        failures.extend(check(tag, *args))
    except Exception as error:  # any exception means the outputs could not be verified
        failures.append(f"{tag}: {check.__name__} raised {type(error).__name__}: {error}")


def _straggle(case: Case, rank: int, device: torch.device) -> Callable[[], None] | None:
    """The ``--straggler`` injection, run before every call outside the timed span.

    Every rank first lines up with the others (the CPU timing loop already barriers; on GPUs a
    device sync and a barrier here), then the straggler sleeps, so the injected delay is the only
    skew between the ranks' arrivals. Without the line-up the reference transport's polling
    back-off (sleeps of up to 1 ms while waiting) lets an early rank leave a collective late and
    arrive late at the next one, which would blur the demonstration.
    """
    if case.straggler is None or case.straggler_delay_us <= 0:
        return None
    delay_s = case.straggler_delay_us if case.straggler == rank else 0.0
    delay_s *= 1e-6

    def before() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            gpu_barrier(device)
            torch.cuda.synchronize(device)
        if delay_s:
            time.sleep(delay_s)

    return before


def _timed(fn: Callable[[], Any], case: Case, device: torch.device, before, samples: dict[str, list[float]],
           name: str, on_start: Callable[[], None] | None = None,
           peaks: dict[str, int | None] | None = None) -> tuple[float, Any]:
    """Median seconds of ``fn`` and its last result; every timed call's seconds go to ``samples[name]``,
    and with ``peaks`` the calls' peak memory rise to ``peaks[name]`` (bench/memory.py says how: on
    CPU from untimed calls made between the warm-ups and the timed calls, so the checks after
    timing still see the timed calls' outputs)."""
    cuda_peak = memory.CudaPeak(device) if peaks is not None and device.type == "cuda" else None

    def start() -> None:
        if peaks is not None and cuda_peak is None:
            peaks[name] = memory.untimed_peak(fn, device)
        if on_start is not None:
            on_start()
        if cuda_peak is not None:
            cuda_peak.start()

    times, last = time_samples(fn, case.warmup, case.iters, device, before, start)
    samples[name] = times
    if cuda_peak is not None:
        peaks[name] = cuda_peak.rise()
    return statistics.median(times), last


def _run_normal(case: Case, inputs: list[RankInputs], rank: int, tag: str) -> dict[str, Any]:
    num_ranks = len(inputs)
    # The peer (DeepEP's own Buffer, same API) runs through the same calls and checks as epcomm.
    buffer_class = _deep_ep_buffer_class() if case.kind == DEEP_EP else Buffer
    buffer_class.set_num_sms(case.num_sms)
    dispatch_config = buffer_class.get_dispatch_config(num_ranks)
    combine_config = buffer_class.get_combine_config(num_ranks)
    # DeepEP's rule: H * max(element size, 2), so one buffer serves both dtypes.
    hidden_bytes = case.hidden * 2
    configs = (dispatch_config, combine_config)
    num_nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) for c in configs)
    num_rdma_bytes = max(c.get_rdma_buffer_size_hint(hidden_bytes, num_ranks) for c in configs)
    if case.kind == DEEP_EP:
        buf = buffer_class(dist.group.WORLD, num_nvl_bytes, num_rdma_bytes)
    else:
        # One pass of the CUDA kernels holds every row: size for this routing ('auto' on GPUs may run them).
        if case.backend == "cuda" or (case.backend == "auto" and inputs[rank].x.is_cuda):
            rows, intranode_bytes = _cuda_rows(case, inputs)
            if case.strategy == HIERARCHICAL:
                from ..backends.cuda.hierarchical import nvl_bytes_needed, rdma_bytes_needed

                scales = -(-case.hidden // 128)
                num_nvl_bytes = max(num_nvl_bytes, nvl_bytes_needed(rows, case.hidden, 2, case.num_topk, scales))
                num_rdma_bytes = max(num_rdma_bytes, rdma_bytes_needed(
                    max(m.topk_idx.shape[0] for m in inputs), case.hidden, 2, num_ranks,
                    _ranks_per_domain(num_ranks), case.num_topk, scales))
            else:
                num_nvl_bytes = max(num_nvl_bytes, intranode_bytes)
        buf = Buffer(dist.group.WORLD, num_nvl_bytes, num_rdma_bytes, backend=case.backend, strategy=case.strategy)
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

    before, samples, peaks = _straggle(case, rank, buf.device), {}, {}
    dispatch_s, last = _timed(dispatch, case, buf.device, before, samples, "dispatch", peaks=peaks)
    _guarded(failures, f"{tag} (timed dispatch)", checks.check_normal_dispatch, *last[:4], want, case.dtype)
    traffic = _tier_traffic(buf, "dispatch")  # of a fresh dispatch (the cached one moves less)
    cached_s, last = _timed(cached_dispatch, case, buf.device, before, samples, "cached_dispatch", peaks=peaks)
    _guarded(failures, f"{tag} (timed cached dispatch)", checks.check_normal_dispatch, last[0], None, None,
             None, want, case.dtype)
    combine_s, last = _timed(combine, case, buf.device, before, samples, "combine", peaks=peaks)
    _guarded(failures, f"{tag} (timed combine)", checks.check_normal_combine, last[0], mine, want, case.dtype)
    traffic.update(_tier_traffic(buf, "combine"))

    suffix = "" if case.strategy == ALLTOALL else f"-{case.strategy}"
    result = {
        "impl": DEEP_EP if case.kind == DEEP_EP else f"epcomm-{buf.backend_name}{suffix}", "strategy": case.strategy,
        "samples_s": samples, "peak_memory": peaks, "num_domains": getattr(buf, "num_domains", 1),
        "buffer_bytes": buf.num_nvl_bytes + buf.num_rdma_bytes,
        "dispatch_s": dispatch_s, "cached_dispatch_s": cached_s, "combine_s": combine_s,
        "dispatch_bytes": metrics.normal_dispatch_bytes(want.num_rows, case.hidden, case.dtype),
        "combine_bytes": metrics.normal_combine_bytes(want.num_rows, case.hidden),
        "failures": failures,
    }
    if traffic:
        # Each token must cross the inter-domain tier at most once per destination domain: the rows
        # this rank sent there equal its tokens' count of other domains (get_dispatch_layout's).
        own = rank // buf.ranks_per_domain
        expected = sum(int(c) for d, c in enumerate(per_rdma_rank.tolist()) if d != own) \
            if per_rdma_rank is not None else 0
        result.update(traffic=traffic, inter_domain_rows_expected=expected)
        if traffic["dispatch_inter_domain_rows"] != expected:
            failures.append(f"{tag}: {traffic['dispatch_inter_domain_rows']} rows crossed domains, the tokens "
                            f"need {expected}")
    if hasattr(buf, "destroy"):  # DeepEP frees its buffer on garbage collection unless explicitly_destroy
        buf.destroy()
    return result


def _tier_traffic(buf: Any, op: str) -> dict[str, int]:
    """The rows and bytes each tier moved in the Buffer's latest ``op`` (strategies that count them)."""
    cuda = getattr(buf, "_cuda", None)
    if hasattr(cuda, "traffic"):  # the CUDA hierarchical kernels count their rows on the device
        return cuda.traffic(op)
    counted = getattr(getattr(buf, "_backend", None), "traffic", None) or {}
    return {k: v for k, v in counted.items() if k.startswith(op + "_")}


def deep_ep_available() -> bool:
    """Whether DeepEP is importable here (then the benchmark runs it beside epcomm, on GPUs)."""
    return importlib.util.find_spec("deep_ep") is not None


def _deep_ep_buffer_class():
    import deep_ep

    return deep_ep.Buffer


def _ranks_per_domain(num_ranks: int) -> int:
    """The domain size a hierarchical Buffer will use (EPCOMM_RANKS_PER_DOMAIN; one host by default)."""
    return int(os.environ.get("EPCOMM_RANKS_PER_DOMAIN") or num_ranks)


def _cuda_rows(case: Case, inputs: list[RankInputs]) -> tuple[int, int]:
    """The most rows any rank receives in dispatch or sends back in combine with these inputs, and
    the bytes the CUDA intranode kernels need for them (times the larger row slot: BF16 with top-k
    ids and weights)."""
    from ..backends.cuda import intranode

    num_ranks = len(inputs)
    experts_per_rank = case.num_experts // num_ranks
    matrix = torch.zeros((num_ranks, num_ranks), dtype=torch.int64, device="cpu")
    for src, mine in enumerate(inputs):
        idx = mine.topk_idx.cpu()
        dest = torch.where(idx >= 0, idx // experts_per_rank, torch.full_like(idx, num_ranks))
        hit = torch.zeros((idx.shape[0], num_ranks + 1), dtype=torch.bool, device="cpu")
        hit = hit.scatter_(1, dest, True)[:, :num_ranks]
        matrix[src] = hit.sum(0)
    rows = int(max(matrix.sum(0).max(), matrix.sum(1).max(), 1))
    k = case.num_topk
    row = max(intranode.dispatch_row_bytes(case.hidden, 2, k, -(-case.hidden // 128)),
              intranode.combine_row_bytes(case.hidden, k))
    return rows, intranode.ROWS_OFFSET + rows * row


def _run_low_latency(case: Case, inputs: list[RankInputs], rank: int, tag: str) -> dict[str, Any]:
    num_ranks = len(inputs)
    Buffer.set_num_sms(case.num_sms)  # the low-latency kernels choose their own SM count; recorded anyway
    n, hidden, num_experts = case.num_tokens, case.hidden, case.num_experts
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(n, hidden, num_ranks, num_experts)
    buf = Buffer(dist.group.WORLD, 0, num_rdma_bytes, low_latency_mode=True,
                 num_qps_per_rank=max(1, num_experts // num_ranks), backend=case.backend)
    mine = inputs[rank]
    failures: list[str] = []
    # Wait-cost statistics (ns per source rank, accumulated by every call) and the calls they cover;
    # reset when the timed calls start, so they describe the timed calls only.
    wait_stats = {name: torch.zeros(num_ranks, dtype=torch.int64, device=buf.device) if case.diagnose else None
                  for name in ("dispatch", "combine")}
    calls = {"dispatch": 0, "combine": 0}

    def reset(name: str) -> Callable[[], None]:
        def start() -> None:
            calls[name] = 0
            if wait_stats[name] is not None:
                wait_stats[name].zero_()
        return start

    def dispatch():
        calls["dispatch"] += 1
        return buf.low_latency_dispatch(mine.x, mine.topk_idx, n, num_experts, use_fp8=True,
                                        dispatch_wait_recv_cost_stats=wait_stats["dispatch"])

    recv_x, recv_count, handle, _, _ = dispatch()
    _guarded(failures, f"{tag} (first dispatch)", checks.check_ll_dispatch, recv_x, recv_count, handle,
             inputs, rank, num_experts)

    before, samples, peaks = _straggle(case, rank, buf.device), {}, {}
    dispatch_s, last = _timed(dispatch, case, buf.device, before, samples, "dispatch", reset("dispatch"),
                              peaks=peaks)
    recv_x, recv_count, handle = last[:3]
    _guarded(failures, f"{tag} (timed dispatch)", checks.check_ll_dispatch, recv_x, recv_count, handle,
             inputs, rank, num_experts)
    # Combine the latest dispatch's rows with its handle, as a decode step would.
    y = checks.ll_combine_input(recv_x, recv_count, n, num_ranks)

    def combine():
        calls["combine"] += 1
        return buf.low_latency_combine(y, mine.topk_idx, mine.topk_weights, handle,
                                       combine_wait_recv_cost_stats=wait_stats["combine"])

    _guarded(failures, f"{tag} (first combine)", checks.check_ll_combine, combine()[0], mine, _by_partials(buf))
    combine_s, last = _timed(combine, case, buf.device, before, samples, "combine", reset("combine"), peaks=peaks)
    _guarded(failures, f"{tag} (timed combine)", checks.check_ll_combine, last[0], mine, _by_partials(buf))

    # The receive hook's split: the call (sends only) and hook() (the receive), timed apart.
    def dispatch_with_hook():
        return buf.low_latency_dispatch(mine.x, mine.topk_idx, n, num_experts, use_fp8=True, return_recv_hook=True)

    def combine_with_hook():
        return buf.low_latency_combine(y, mine.topk_idx, mine.topk_weights, handle, return_recv_hook=True)

    hook_split = {op: _time_hook_split(fn, case, buf.device) for op, fn in
                  (("dispatch", dispatch_with_hook), ("combine", combine_with_hook))}
    # CUDA graphs: the kernels, or the portable path on NCCL (gloo, which shared GPUs run on, captures none).
    captures = buf.backend_name == "cuda" or (buf.device.type == "cuda" and str(dist.get_backend(buf.group)) == "nccl")
    graph_times = _time_ll_graphs(case, buf, dispatch, combine, inputs, rank, tag, failures) if captures else {}
    kernel_times = {f"{op}_kernel_s": _time_ll_kernels(fn, case, buf.device)
                    for op, fn in (("dispatch", dispatch), ("combine", combine))} if buf.backend_name == "cuda" else {}

    num_selections = int((mine.topk_idx >= 0).sum())
    result = {
        "impl": f"epcomm-{buf.backend_name}", "samples_s": samples, "peak_memory": peaks,
        "num_domains": buf.num_domains,
        "buffer_bytes": buf.num_rdma_bytes,
        "dispatch_s": dispatch_s, "combine_s": combine_s,
        "dispatch_bytes": metrics.ll_dispatch_bytes(num_selections, hidden, "fp8"),
        "combine_bytes": metrics.ll_combine_bytes(num_selections, hidden),
        "failures": failures,
    }
    for op, (send_s, recv_s) in hook_split.items():
        result[f"{op}_hook_send_s"], result[f"{op}_hook_recv_s"] = send_s, recv_s
    if buf.backend_name == "cuda":
        result["ll_transport"], result["ll_remote_ranks"] = buf.low_latency_transport()
    result.update(graph_times)
    result.update(kernel_times)
    if case.diagnose:
        # Mean wait per call for each source rank, as this rank saw it (us).
        for name, stats in wait_stats.items():
            result[f"{name}_wait_us_per_source"] = [v / 1e3 / calls[name] for v in stats.cpu().tolist()]
    buf.destroy()
    return result


def _by_partials(buf: Buffer) -> bool:
    """Whether the Buffer's last low-latency combine summed partials per (token, rank) on the expert
    side (EPCOMM_LL_COMBINE_PARTIALS: 1, or auto from 64 tokens a rank): its result is checked
    within their rounding too."""
    return bool(getattr(buf.low_latency_ops, "last_combine_partials", False))


def _time_ll_graphs(case: Case, buf: Buffer, dispatch: Callable[[], Any], combine: Callable[[], Any],
                    inputs: list[RankInputs], rank: int, tag: str, failures: list[str]) -> dict[str, float]:
    """The decode-step way to run the low-latency calls: each captured once in a CUDA graph and
    replayed (no Python between the kernels). Times the dispatch, the combine, and both in one
    graph; the dispatch graph's outputs are checked after its timed replays."""
    graphs, outputs = {}, {}
    for name, fn in (("dispatch", dispatch), ("combine", combine), ("step", lambda: (dispatch(), combine()))):
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            outputs[name] = fn()
    times, samples = {}, {}
    for name, graph in graphs.items():
        times[f"{name}_graph_s"] = _timed(graph.replay, case, buf.device, None, samples, name)[0]
    torch.cuda.synchronize(buf.device)
    recv_x, recv_count, handle = outputs["dispatch"][:3]
    _guarded(failures, f"{tag} (CUDA-graph dispatch)", checks.check_ll_dispatch, recv_x, recv_count, handle,
             inputs, rank, case.num_experts)
    _guarded(failures, f"{tag} (CUDA-graph combine)", checks.check_ll_combine, outputs["combine"][0], inputs[rank],
             _by_partials(buf))
    return times


def _time_ll_kernels(call: Callable[[], Any], case: Case, device: torch.device) -> float:
    """Median seconds of the device time of a low-latency call's own kernels (those of
    epcomm::ll; a combine's two are summed), from torch.profiler over ``case.iters`` calls with the
    L2 flushed before each: how DeepEP's test reports its per-operation times (bench_kineto), so
    they compare directly. The event spans (``dispatch_us``) add the launch floor to them.

    The GPU first sleeps long enough for the host to queue every call, queued right after the
    barrier and before the profiler starts: otherwise a rank whose host queues more slowly (the
    profiler's overhead, or its start-up) makes the peers' kernels wait for its data inside their
    span, which then times the hosts (docs/PERFORMANCE.md, Method)."""
    flush = l2_flush_buffer(device)
    for _ in range(case.warmup):
        call()
    torch.cuda.synchronize(device)
    iters = max(case.iters, 1)
    # the ranks' sleeps start together; the first call absorbs what skew is left
    gpu_barrier(device)
    torch.cuda._sleep(HEAD_START_CYCLES * (40 + iters * 5))  # ~9 ms for the profiler's start, ~1.1 ms a call
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            call()
        torch.cuda.synchronize(device)
    kernels = sorted((e.time_range.start, e.device_time) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and "epcomm::ll::" in e.name)
    per_call = len(kernels) // iters
    if per_call == 0 or len(kernels) % iters:
        raise RuntimeError(f"the profiler saw {len(kernels)} low-latency kernels in {iters} calls")
    sums = [sum(t for _, t in kernels[i:i + per_call]) for i in range(0, len(kernels), per_call)]
    return statistics.median(sums) * 1e-6


def _time_hook_split(call_with_hook: Callable[[], Any], case: Case, device: torch.device) -> tuple[float, float]:
    """Median seconds of a low-latency call made with ``return_recv_hook=True`` (the sends) and of its
    hook (the receive), each timed on its own; every rank makes the same calls.

    On GPU each span is the device time of its kernels alone, as DeepEP's test reports its
    send/receive split: an L2 flush and a spin (timing.cold_start) are queued before each
    span, so the host has queued the call (or the hook) by the time the GPU reaches the span's
    start event, and no host time counts (an
    earlier version synced every iteration and timed the host's launch latency with the kernels:
    147 / 116 us for a 21 / 13 us dispatch). The flush between the call and its hook also lets the
    peers' data land first, as when the hook is called after other work. On CPU, wall time."""
    if device.type != "cuda":
        def wall() -> tuple[float, float]:
            start = time.perf_counter()
            hook = call_with_hook()[-1]
            mid = time.perf_counter()
            hook()
            return mid - start, time.perf_counter() - mid

        for _ in range(case.warmup):
            wall()
        sends, recvs = zip(*(wall() for _ in range(max(case.iters, 1))))
        return statistics.median(sends), statistics.median(recvs)
    flush = l2_flush_buffer(device)

    def queued() -> list[torch.cuda.Event]:
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        cold_start(flush)  # the host queues the call meanwhile (timing.py says why)
        marks[0].record()
        hook = call_with_hook()[-1]
        marks[1].record()
        cold_start(flush)
        marks[2].record()
        hook()
        marks[3].record()
        return marks

    for _ in range(case.warmup):
        queued()
    torch.cuda.synchronize(device)
    runs = [queued() for _ in range(max(case.iters, 1))]
    torch.cuda.synchronize(device)
    return (statistics.median(m[0].elapsed_time(m[1]) / 1e3 for m in runs),
            statistics.median(m[2].elapsed_time(m[3]) / 1e3 for m in runs))


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
    before, samples, peaks = _straggle(case, rank, device), {}, {}
    dispatch_s, _ = _timed(forward, case, device, before, samples, "dispatch", peaks=peaks)
    combine_s, _ = _timed(backward, case, device, before, samples, "combine", peaks=peaks)
    _guarded(failures, f"{tag} (timed exchange)", checks.check_a2a, recv, want, back, send)
    backend = str(dist.get_backend())
    num_bytes = want.num_rows * case.hidden * 2  # recv bytes, this rank's own rows included
    return {
        "impl": f"{backend}-a2a", "strategy": case.strategy, "samples_s": samples, "peak_memory": peaks,
        "num_domains": 1,
        "buffer_bytes": send.nbytes + recv.nbytes,
        "dispatch_s": dispatch_s, "combine_s": combine_s,
        "dispatch_bytes": num_bytes, "combine_bytes": num_bytes,
        "failures": failures,
    }


def _run_copy(case: Case, inputs: list[RankInputs], rank: int, device: torch.device, tag: str) -> dict[str, Any]:
    """A plain copy of this rank's x into another tensor on its device ("dispatch") and back
    ("combine"): the bytes a one-rank dispatch moves with no communication, layout or permute. The
    portable path's one-rank times are judged against it."""
    x = inputs[rank].x
    copy, back = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))  # poisoned: the timed calls fill
    before, samples, peaks = _straggle(case, rank, device), {}, {}
    dispatch_s, _ = _timed(lambda: copy.copy_(x), case, device, before, samples, "dispatch", peaks=peaks)
    combine_s, _ = _timed(lambda: back.copy_(copy), case, device, before, samples, "combine", peaks=peaks)
    same = checks.same_bits(copy, x) and checks.same_bits(back, x)
    num_bytes = x.numel() * x.element_size()
    return {"impl": f"{device.type}-copy", "strategy": case.strategy, "samples_s": samples, "peak_memory": peaks,
            "num_domains": 1, "buffer_bytes": copy.nbytes + back.nbytes, "dispatch_s": dispatch_s,
            "combine_s": combine_s, "dispatch_bytes": num_bytes, "combine_bytes": num_bytes,
            "failures": [] if same else [f"{tag}: the copies differ from x"]}


def _run_allgather_baseline(case: Case, inputs: list[RankInputs], rank: int, device: torch.device,
                            tag: str) -> dict[str, Any]:
    """The allgather strategy's data movement alone: ``all_gather_into_tensor`` of every rank's BF16 rows
    ("dispatch") and ``reduce_scatter_tensor`` (sum) of an ``[R T, H]`` BF16 buffer ("combine").

    What the planner's allgather strategy prices as link traffic (no local permute, no packing, no
    handshake), so its times are what the planner's prediction is compared with. Bytes are the
    useful rows (as for every record), so GB/s compare with the all-to-all's. Without NCCL the
    combine is an all-to-all of the blocks plus a local sum (older gloo has no reduce-scatter).
    """
    num_ranks = len(inputs)
    want = checks.Expected(inputs, rank, case.num_experts)
    mine = inputs[rank]
    num_tokens = mine.x.shape[0]
    gathered = torch.empty((num_ranks * num_tokens, case.hidden), dtype=torch.bfloat16, device=device)
    reduced = torch.empty_like(mine.x)
    nccl = "nccl" in str(dist.get_backend())
    failures: list[str] = []

    def forward():
        if nccl:
            _all_gather_into(gathered, mine.x)
        else:
            dist.all_gather(list(gathered.chunk(num_ranks)), mine.x)
        return gathered

    def backward():
        if nccl:
            _reduce_scatter(reduced, gathered)
        else:
            blocks = torch.empty_like(gathered)
            dist.all_to_all_single(blocks, gathered)
            torch.sum(blocks.view(num_ranks, num_tokens, case.hidden), 0, out=reduced)
        return reduced

    def check() -> list[str]:
        out = []
        if not checks.same_bits(gathered, torch.cat([src.x for src in inputs])):
            out.append(f"{tag}: all_gather rows differ from the inputs")
        # Every rank reduces the same gathered rows, so block `rank` sums to R x this rank's rows
        # (up to one bf16 rounding per addition).
        err = (reduced.double() - mine.x.double() * num_ranks).abs()
        if not bool((err <= mine.x.double().abs() * num_ranks * 2.0 ** -8 * num_ranks + 1e-6).all()):
            out.append(f"{tag}: reduce_scatter sum is off (max abs error {float(err.max()):.3g})")
        return out

    forward()
    backward()
    failures.extend(check())
    gathered.fill_(float("nan"))
    reduced.fill_(float("nan"))
    before, samples, peaks = _straggle(case, rank, device), {}, {}
    dispatch_s, _ = _timed(forward, case, device, before, samples, "dispatch", peaks=peaks)
    combine_s, _ = _timed(backward, case, device, before, samples, "combine", peaks=peaks)
    failures.extend(check())
    num_bytes = want.num_rows * case.hidden * 2  # useful recv bytes, as the all-to-all baseline counts
    return {
        "impl": f"{dist.get_backend()}-allgather", "strategy": ALLGATHER, "samples_s": samples,
        "peak_memory": peaks,
        "num_domains": 1, "buffer_bytes": gathered.nbytes + reduced.nbytes,
        "dispatch_s": dispatch_s, "combine_s": combine_s,
        "dispatch_bytes": num_bytes, "combine_bytes": num_bytes,
        "failures": failures,
    }


def _run_megatron(case: Case, inputs: list[RankInputs], rank: int, tag: str) -> dict[str, Any]:
    """Megatron-LM's alltoall dispatcher sequence (bench/megatron.py) on the same routing, the experts
    returning their rows. Bytes are those of the same dispatch (the rows one row per destination rank
    would move), as every record counts them, so GB/s compare; the rows it sends, one per (token,
    selected expert), are reported beside."""
    mine = inputs[rank]
    want = checks.Expected(inputs, rank, case.num_experts)
    failures: list[str] = []

    def dispatch():
        return megatron.dispatch(mine.x, mine.topk_idx, mine.topk_weights, case.num_experts)

    handle = dispatch()
    _guarded(failures, f"{tag} (first dispatch)", megatron.check_dispatch, handle, want)
    y = handle.x.clone()  # what identity experts return

    def combine():
        return megatron.combine(y, handle, mine.x.shape[0])

    _guarded(failures, f"{tag} (first combine)", megatron.check_combine, combine(), mine)
    before, samples, peaks = _straggle(case, rank, mine.x.device), {}, {}
    dispatch_s, last = _timed(dispatch, case, mine.x.device, before, samples, "dispatch", peaks=peaks)
    _guarded(failures, f"{tag} (timed dispatch)", megatron.check_dispatch, last, want)
    combine_s, last = _timed(combine, case, mine.x.device, before, samples, "combine", peaks=peaks)
    _guarded(failures, f"{tag} (timed combine)", megatron.check_combine, last, mine)
    num_bytes = want.num_rows * case.hidden * 2
    return {
        "impl": f"{dist.get_backend()}-megatron-a2a", "samples_s": samples, "peak_memory": peaks,
        "num_domains": 1, "buffer_bytes": 0, "sent_rows": handle.sent_tokens.numel(),
        "dispatch_s": dispatch_s, "combine_s": combine_s,
        "dispatch_bytes": num_bytes, "combine_bytes": num_bytes,
        "failures": failures,
    }


def _alpha_beta(sizes: tuple[int, int], seconds: tuple[float, float]) -> tuple[float, float]:
    """(fixed cost in us, GB/s) of the line through two (bytes, seconds) points; the cost is clamped at 0."""
    gbps = (sizes[1] - sizes[0]) / (seconds[1] - seconds[0]) / 1e9 if seconds[1] > seconds[0] else \
        sizes[1] / seconds[1] / 1e9
    return max(0.0, (seconds[0] - sizes[0] / (gbps * 1e9)) * 1e6), gbps


def probe_ceilings(block_bytes: tuple[int, int] = (4 * 2**20, 256 * 2**20), iters: int = 20) -> dict[str, Any]:
    """Measured link properties the planner is calibrated with (GPU/NCCL only), measured as the benchmark measures.

    Each primitive is timed (median, CUDA events, as the benchmark times everything) with blocks of
    two sizes that bracket every size the benchmark compares (it moves 7 to 117 MB per rank at
    H=7168, T=512..8192; the blocks are 4 MiB and 256 MiB), and the line through the two points
    gives its rate (GB/s per GPU per direction: each rank's bytes that cross links, over the time)
    and its fixed per-call cost (the intercept):

    * ``link``: a point-to-point exchange, every rank sending a block to its ring successor while
      receiving one from its predecessor (with two GPUs: both directions of the one pair at once):
      the per-peer NVLink rate and per-transfer cost as NCCL drives them.
    * ``collective``: each collective the baselines use (``all_to_all_single``,
      ``all_gather_into_tensor``, ``reduce_scatter_tensor``) with blocks of those sizes.

    None of these is one of the compared measurements (different sizes, and for ``link`` a different
    primitive). NCCL's time is not affine in the size over wide ranges (its rate keeps rising past
    128 MiB), so the fit is only meant for sizes between the two blocks.
    """
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = group_device()
    if device.type != "cuda" or num_ranks < 2:
        return {}
    nxt, prv = (rank + 1) % num_ranks, (rank - 1) % num_ranks

    def median_s(fn, warmup: int = 3, n: int = iters) -> float:
        return statistics.median(time_samples(fn, warmup, n, device)[0])

    def collectives_s(size: int) -> dict[str, float]:
        whole = torch.empty(num_ranks * size // 2, dtype=torch.bfloat16, device=device)
        whole_out = torch.empty_like(whole)
        part = torch.empty(size // 2, dtype=torch.bfloat16, device=device)
        return {"all_to_all_single": median_s(lambda: dist.all_to_all_single(whole_out, whole)),
                "all_gather_into_tensor": median_s(lambda: _all_gather_into(whole_out, part)),
                "reduce_scatter_tensor": median_s(lambda: _reduce_scatter(part, whole))}

    def exchange_s(size: int) -> float:
        send = torch.empty(size, dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)

        def exchange():
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)])
            for w in works:
                w.wait()

        return median_s(exchange)

    link_s = [exchange_s(size) for size in block_bytes]
    per_size = [collectives_s(size) for size in block_bytes]
    coll_s = {name: [t[name] for t in per_size] for name in per_size[0]}
    crossing = tuple((num_ranks - 1) * b for b in block_bytes)
    link_us, link_gbps = _alpha_beta(block_bytes, tuple(link_s))
    fits = {name: _alpha_beta(crossing, tuple(t)) for name, t in coll_s.items()}

    return {
        "link_gbps": link_gbps, "link_fixed_us": link_us,
        "collective_gbps": {name: fit[1] for name, fit in fits.items()},
        "collective_fixed_us": {name: fit[0] for name, fit in fits.items()},
        "block_bytes": list(block_bytes), "iters": iters, "link_median_us": [t * 1e6 for t in link_s],
        "collective_median_us": {name: [t * 1e6 for t in times] for name, times in coll_s.items()},
        "method": "two-point fits at 4 and 256 MiB blocks: NCCL ring send/recv (both directions at once) "
                  "for the link, each collective for its own",
    }
