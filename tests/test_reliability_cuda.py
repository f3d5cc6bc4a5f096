"""Reliability of the CUDA backend on GPUs (skipped without them): lifecycle, in-flight destroy,
mismatched calls and a dead peer. Every wait in the kernels is bounded, so each case must end in
an error naming the operation and the rank, never in a hang.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist
from conftest import BACKEND, cluster, env_var, fresh_cluster, nvshmem_found, peer_timeout
from routing import make_inputs

from epcomm import Buffer
from epcomm.bench.checks import same_bits
from epcomm.utils.launch import RankFailure

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(BACKEND != "nccl", reason="CUDA kernels: run with EPCOMM_TEST_BACKEND=nccl on GPUs")]

NVL_BYTES = 64 << 20


def _inputs(seed: int, num_tokens: int = 64, hidden: int = 1024, num_experts: int = 16, num_topk: int = 4):
    dev = torch.device("cuda", torch.cuda.current_device())
    x, idx, w = make_inputs(seed, dist.get_rank(), num_tokens, hidden, num_experts, num_topk, dist.get_world_size(),
                            "random")
    return x.to(dev), idx.to(dev), w.to(dev), num_experts


def _dispatch_kwargs(buf: Buffer, idx, w, num_experts) -> dict:
    """A fresh dispatch's arguments: the layout of ``idx`` and the top-k ids and weights."""
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx, topk_weights=w)


def _round_trip(buf: Buffer, x, idx, w, num_experts, async_finish: bool = False):
    recv_x, _, recv_w, _, handle, event = buf.dispatch(x, **_dispatch_kwargs(buf, idx, w, num_experts))
    combined, _, event = buf.combine(recv_x, handle, topk_weights=recv_w, async_finish=async_finish,
                                     previous_event=None)
    return combined, event


def _mapped_regions() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def rank_lifecycle(num_buffers: int):
    """Create and destroy a Buffer many times: GPU memory and mappings must not grow."""
    x, idx, w, num_experts = _inputs(1)
    buf = Buffer(dist.group.WORLD, NVL_BYTES, backend="cuda")  # warm-up: compile, load, first IPC
    _round_trip(buf, x, idx, w, num_experts)
    buf.destroy()
    torch.cuda.synchronize()
    gc.collect()
    allocated, regions = torch.cuda.memory_allocated(), _mapped_regions()
    free_before, _ = torch.cuda.mem_get_info()
    for i in range(num_buffers):
        buf = Buffer(dist.group.WORLD, NVL_BYTES, backend="cuda")
        if i % 10 == 0:
            _round_trip(buf, x, idx, w, num_experts)
        buf.destroy()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info()
    grown = {"allocated": torch.cuda.memory_allocated() - allocated, "regions": _mapped_regions() - regions,
             "free_lost": free_before - free_after}
    assert grown["allocated"] <= 0, grown
    assert grown["regions"] <= 8, grown  # a few from lazily loaded libraries at most
    assert grown["free_lost"] < 2 * NVL_BYTES, grown  # not one buffer per iteration
    return grown


def test_create_and_destroy_100_buffers():
    cluster(2).run(rank_lifecycle, 100)


def rank_destroy_in_flight():
    """destroy() with an asynchronous combine still in flight waits for it; the result stays right."""
    x, idx, w, num_experts = _inputs(2)
    ref = Buffer(dist.group.WORLD, NVL_BYTES, backend="reference")
    want, _ = _round_trip(ref, x, idx, w, num_experts)
    ref.destroy()
    buf = Buffer(dist.group.WORLD, NVL_BYTES, backend="cuda")
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **_dispatch_kwargs(buf, idx, w, num_experts))
    previous = buf.capture()
    combined, _, event = buf.combine(recv_x, handle, topk_weights=recv_w, previous_event=previous,
                                     async_finish=True)
    buf.destroy()  # must wait for the combine, not unmap under it
    event.current_stream_wait()
    torch.cuda.synchronize()
    assert torch.equal(combined.view(torch.int16), want.view(torch.int16))


def test_destroy_waits_for_work_in_flight():
    cluster(2).run(rank_destroy_in_flight)


def rank_mismatched_ops(timeout_s: str):
    """Rank 0 dispatches while rank 1 makes a cached dispatch: both learn it, neither hangs."""
    with peer_timeout(timeout_s):
        buf = Buffer(dist.group.WORLD, NVL_BYTES, backend="cuda")
    x, idx, w, num_experts = _inputs(3)
    kwargs = _dispatch_kwargs(buf, idx, w, num_experts)
    handle = buf.dispatch(x, **kwargs)[4]
    start = time.monotonic()
    if dist.get_rank() == 0:
        with pytest.raises(RuntimeError, match=r"ranks called different operations: rank 1: cached dispatch"):
            buf.dispatch(x, **kwargs)
        buf.destroy()
    else:
        buf.dispatch(x, handle=handle)  # no host sync on this path: the error comes with the next one
        with pytest.raises(RuntimeError, match=r"ranks called different operations: rank 0: dispatch"):
            buf.destroy()
    return time.monotonic() - start


def test_mismatched_operations_raise_on_both_ranks():
    elapsed = cluster(2).run(rank_mismatched_ops, "5")
    assert max(elapsed) < 10, elapsed  # found at the barrier, not by waiting out the timeout


def _die(how: str) -> None:
    """End this process the way a crashing rank does: no cleanup, no destroy."""
    if how == "clean exit":
        os._exit(0)
    if how == "non-zero exit":
        os._exit(3)
    if how == "abort":
        os.abort()
    os.kill(os.getpid(), signal.SIGKILL)


def _context_is_usable() -> bool | str:
    """After a peer's death: this rank's kernels have all ended and its CUDA context still works
    (True), or the error that shows it does not."""
    try:
        torch.cuda.synchronize()
        a = torch.randn(256, 256, device=torch.cuda.current_device())
        ok = bool(torch.isfinite(a @ a).all())
        torch.cuda.synchronize()
        return ok
    except Exception as error:  # a sticky CUDA error: record it rather than lose the outcome
        return f"{type(error).__name__}: {error}"


def rank_ll_mismatched_shapes(what: str):
    """Low latency: ranks whose calls disagree on hidden, num_experts or the FP8 format get a
    RuntimeError naming the other rank on every rank (at one of their next two calls), not garbage
    and not a hang."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    n, hidden, num_experts = 16, 512, 4 * num_ranks
    size = Buffer.get_low_latency_rdma_size_hint(n, 2 * hidden, num_ranks, 2 * num_experts)
    with peer_timeout(5):
        buf = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, backend="cuda")
    odd = rank == num_ranks - 1
    h = 2 * hidden if odd and what == "hidden" else hidden
    e = 2 * num_experts if odd and what == "num_experts" else num_experts
    fp8 = odd and what == "fp8"
    x, idx, _ = (t.to(dev) for t in make_inputs(73, rank, n, h, e, 3, num_ranks, "random"))
    buf.low_latency_dispatch(x, idx, n, e, use_fp8=fp8)  # slot 0: every rank sees another shape
    x, idx, _ = (t.to(dev) for t in make_inputs(74, rank, n, hidden, num_experts, 3, num_ranks, "random"))
    # A fatal record is raised by the first call that finds it: the next one (slot 1) if slot 0's
    # receive has written it by then, else the one after (slot 0 again, which waits for that receive).
    with pytest.raises(RuntimeError, match=rf"rank\(s\) \[{1 - rank}\] made this call with another shape"):
        buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
        buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
    torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()


@pytest.mark.parametrize("what", ["hidden", "num_experts", "fp8"])
def test_ll_mismatched_shapes_raise_on_every_rank(what):
    cluster(2).run(rank_ll_mismatched_shapes, what)


def rank_ll_mismatched_operations():
    """Low latency: rank 0 combines while rank 1 dispatches. They wait on different signals, so both
    time out; within the next calls each raises a RuntimeError naming the other, well before the
    test's bound, and the Buffer can still be destroyed."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    n, hidden, num_experts = 16, 512, 4 * num_ranks
    with peer_timeout(2):
        buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(n, hidden, num_ranks, num_experts),
                     low_latency_mode=True, backend="cuda")
    x, idx, w = (t.to(dev) for t in make_inputs(75, rank, n, hidden, num_experts, 3, num_ranks, "random"))
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)  # together
    torch.cuda.synchronize()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"timed out waiting for rank\(s\) \[{1 - rank}\]"):
        if rank == 0:
            buf.low_latency_combine(recv_x, idx, w, handle)
        else:
            buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
        for _ in range(3):  # the error is raised by one of the next calls (the GPU records it after 2 s)
            buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
    torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    buf.destroy()
    return elapsed


def test_ll_mismatched_operations_raise_on_both_ranks():
    elapsed = cluster(2).run(rank_ll_mismatched_operations)
    assert max(elapsed) < 10, elapsed


def flight_record(error: str | None) -> dict | None:
    """The flight record an error names ("Flight record: PATH"), read back; None without one."""
    if error is None or "Flight record: " not in error:
        return None
    with open(error.split("Flight record: ")[1].strip()) as f:
        return json.load(f)


def rank_dead_peer(timeout_s: float, path: str, how: str, when: str):
    """Rank 1 dies (``how``) before the dispatch, inside it (a timer kills it while its dispatch waits
    for rank 0, which starts 1 s late), or between the dispatch and the combine. Rank 0 raises a
    RuntimeError naming rank 1 within the timeout, no kernel of rank 0 outlives twice the timeout,
    and rank 0's CUDA context stays usable. Its flight record (written next to ``path``) is returned
    in the outcome."""
    with peer_timeout(timeout_s), env_var("EPCOMM_FLIGHT_RECORDER_DIR", os.path.dirname(path)):
        buf = Buffer(dist.group.WORLD, NVL_BYTES, backend="cuda")
    x, idx, w, num_experts = _inputs(4)
    kwargs = _dispatch_kwargs(buf, idx, w, num_experts)
    torch.cuda.synchronize()
    dist.barrier()
    if dist.get_rank() == 1:
        if when == "in dispatch":
            threading.Timer(0.3, _die, (how,)).start()
            buf.dispatch(x, **kwargs)  # dies in here: rank 0 starts its dispatch 1 s later
        elif when == "before combine":
            buf.dispatch(x, **kwargs)
            torch.cuda.synchronize()  # rank 0 then goes into its combine alone
        _die(how)
    outcome = {"error": None}
    if when == "in dispatch":
        time.sleep(1.0)
    start = time.monotonic()
    try:
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **kwargs)
        if when == "before combine":
            start = time.monotonic()
            buf.combine(recv_x, handle, topk_weights=recv_w)
        torch.cuda.synchronize()
        buf.destroy()  # a call that did not sync (combine, a dispatch's data kernel) reports here
    except RuntimeError as error:
        outcome["error"] = str(error)
    outcome["raised_after_s"] = time.monotonic() - start
    outcome["context_usable"] = _context_is_usable()  # synchronizes: every kernel has ended
    outcome["idle_after_s"] = time.monotonic() - start
    outcome["record"] = flight_record(outcome["error"])
    with open(path, "w") as f:
        json.dump(outcome, f)


def _survivor_outcome(failure: RankFailure, path: str) -> dict:
    assert "died" in failure.errors.get(1, ""), failure.errors  # rank 1's process died, as planned
    with open(path) as f:
        return json.load(f)


def _check_survivor(outcome: dict, timeout_s: float) -> None:
    """Rank 0 named the dead rank within the timeout, no kernel outlived twice it, and the context works."""
    assert outcome["error"] is not None and "rank(s) [1]" in outcome["error"], outcome
    assert outcome["raised_after_s"] < timeout_s + 5, outcome
    assert outcome["idle_after_s"] < 2 * timeout_s + 5, outcome
    assert outcome["context_usable"] is True, outcome


def check_flight_record(outcome: dict, mode: str, operation: str, phases: tuple[str, ...]) -> dict:
    """The survivor's flight record names the dead rank 1, the operation and the phase (the error says
    the phase too), and holds the counters read from its buffers and its last calls."""
    record = outcome.get("record")
    assert record is not None, outcome
    assert (record["mode"], record["operation"], record["missing_ranks"]) == (mode, operation, [1]), record
    assert record["phase"] in phases and f"in the {record['phase']} phase" in outcome["error"], (phases, record)
    assert isinstance(record["counters"], dict) and "unreadable" not in record["counters"], record
    assert record["last_calls"] and record["last_calls"][-1]["op"] in ("dispatch", "combine", "low_latency_dispatch",
                                                                       "low_latency_combine"), record
    return record


DEATHS = ["clean exit", "non-zero exit", "abort", "SIGKILL"]
MOMENTS = ["before dispatch", "in dispatch", "before combine"]


# Where the survivor's wait gives up, and in which call (intranode): the count exchange (notify) of a
# dispatch or of a combine's barrier, or the dispatch's receive of the rows the dead rank never sent;
# and the last call (the Buffer's first is 1) whose signal the dead rank left in the survivor's buffer.
INTRANODE_PHASES = {"before dispatch": ("dispatch", "notify", 0), "in dispatch": ("dispatch", "receive", 1),
                    "before combine": ("combine", "notify", 1)}


@pytest.mark.parametrize("when", MOMENTS)
@pytest.mark.parametrize("how", DEATHS)
def test_dead_peer_is_named_within_the_timeout(how, when):
    timeout_s = 2.0  # short: the launcher gives the survivors a few seconds once it sees a rank die
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.json")
        with pytest.raises(RankFailure) as failure:
            cluster(2).run(rank_dead_peer, timeout_s, path, how, when, timeout_s=60)
        outcome = _survivor_outcome(failure.value, path)
    _check_survivor(outcome, timeout_s)
    operation, phase, dead_rank_call = INTRANODE_PHASES[when]
    record = check_flight_record(outcome, "intranode", operation, (phase,))
    # The dead rank never entered the call the survivor gave up in the notify of, and had entered the
    # one whose rows it never sent. (The survivor's own counter may be further on: a call that does
    # not sync, a combine, is raised by the next one, destroy's barrier.)
    counters = record["counters"]
    assert counters["peer_call"][1] == dead_rank_call <= counters["this_rank_call"], counters


def rank_ll_dead_peer(timeout_s: float, path: str, how: str, transport: str = "ipc", n: int = 16):
    """Low latency without masking: rank 1 dies after its send; rank 0's receive gives up within the
    timeout and its next low-latency call raises RuntimeError naming rank 1. ``transport`` "nvshmem"
    treats the peer as remote, so the survivor's sends and waits go through NVSHMEM. From 64 tokens
    (``n``) the combine goes by partial sums (EPCOMM_LL_COMBINE_PARTIALS=auto): the survivor waits
    for the dead rank's requests instead of its rows."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    hidden, num_experts = 512, 4 * num_ranks
    with peer_timeout(timeout_s), env_var("EPCOMM_LL_TRANSPORT", transport), \
            env_var("EPCOMM_LL_REMOTE_RANKS", "all" if transport == "nvshmem" else ""), \
            env_var("EPCOMM_FLIGHT_RECORDER_DIR", os.path.dirname(path)):
        buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(n, hidden, num_ranks, num_experts),
                     low_latency_mode=True, backend="cuda")
    x, idx, w = (t.to(dev) for t in make_inputs(71, rank, n, hidden, num_experts, 3, num_ranks, "random"))
    recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False,
                                                          return_recv_hook=True)
    if rank == 1:
        torch.cuda.synchronize()  # its sends have landed; it dies before its receive and the combine
        _die(how)
    hook()
    outcome = {"error": None, "transport": buf.low_latency_transport()[0]}
    start = time.monotonic()
    try:
        buf.low_latency_combine(recv_x, idx, w, handle)  # rank 1 never returns rows: waits, then gives up
        torch.cuda.synchronize()
        buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
    except RuntimeError as error:
        outcome["error"] = str(error)
    outcome["raised_after_s"] = time.monotonic() - start
    outcome["partials"] = buf.low_latency_ops.last_combine_partials
    outcome["record"] = flight_record(outcome["error"])
    outcome["context_usable"] = _context_is_usable()  # synchronizes: every kernel has ended
    outcome["idle_after_s"] = time.monotonic() - start
    buf.destroy()  # does not wait for the dead peer
    outcome["destroyed_after_s"] = time.monotonic() - start
    with open(path, "w") as f:
        json.dump(outcome, f)


@pytest.mark.parametrize("how", ["non-zero exit", "SIGKILL"])
def test_ll_dead_peer_is_named_within_the_timeout(how):
    timeout_s = 2.0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.json")
        with pytest.raises(RankFailure) as failure:
            cluster(2).run(rank_ll_dead_peer, timeout_s, path, how, timeout_s=60)
        outcome = _survivor_outcome(failure.value, path)
    _check_survivor(outcome, timeout_s)
    assert outcome["destroyed_after_s"] < 2 * timeout_s + 10, outcome
    # The combine's receive waited for the rows the dead rank never returned.
    record = check_flight_record(outcome, "low_latency", "low_latency_combine", ("reduce",))
    assert record["counters"]["this_rank_call"] == 2, record  # the dispatch, then the combine


def test_ll_dead_peer_in_a_combine_by_partial_sums_is_named_within_the_timeout():
    timeout_s = 2.0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.json")
        with pytest.raises(RankFailure) as failure:
            cluster(2).run(rank_ll_dead_peer, timeout_s, path, "non-zero exit", n=64, timeout_s=60)
        outcome = _survivor_outcome(failure.value, path)
    assert outcome["partials"], outcome  # else this would test the per-expert combine again
    _check_survivor(outcome, timeout_s)
    assert outcome["destroyed_after_s"] < 2 * timeout_s + 10, outcome
    # Its send role waits for the dead rank's requests, its receive role for its partial sums: the
    # first of the two to give up names its phase.
    check_flight_record(outcome, "low_latency", "low_latency_combine", ("send", "reduce"))


@pytest.mark.skipif(not nvshmem_found(), reason="NVSHMEM not installed (pip install nvidia-nvshmem-cu13)")
def test_ll_dead_peer_over_nvshmem_is_named_within_the_timeout():
    """The same on the NVSHMEM transport (the path to other hosts): the survivor is not aborted by
    NVSHMEM, names the rank, and its context stays usable."""
    timeout_s = 2.0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.json")
        with pytest.raises(RankFailure) as failure:
            with fresh_cluster(2) as fresh:  # NVSHMEM: once per process
                fresh.run(rank_ll_dead_peer, timeout_s, path, "SIGKILL", "nvshmem", timeout_s=60)
        outcome = _survivor_outcome(failure.value, path)
    _check_survivor(outcome, timeout_s)
    assert outcome["transport"] == "nvshmem", outcome
    check_flight_record(outcome, "low_latency", "low_latency_combine", ("reduce",))
    assert outcome["destroyed_after_s"] < 2 * timeout_s + 10, outcome


def rank_slow_peer(timeout_s: float):
    """A peer late by half the timeout is waited for: no error, and the results equal an on-time run's."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    with peer_timeout(timeout_s):
        buf = Buffer(dist.group.WORLD, NVL_BYTES, backend="cuda")
        n, hidden, num_experts_ll = 16, 512, 4 * num_ranks
        ll = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(n, hidden, num_ranks, num_experts_ll),
                    low_latency_mode=True, backend="cuda")
    x, idx, w, num_experts = _inputs(5)
    xl, il, wl = (t.to(dev) for t in make_inputs(72, rank, n, hidden, num_experts_ll, 3, num_ranks, "random"))

    def both():
        combined, _ = _round_trip(buf, x, idx, w, num_experts)
        recv_x, _, handle, _, _ = ll.low_latency_dispatch(xl, il, n, num_experts_ll, use_fp8=False)
        out, _, _ = ll.low_latency_combine(recv_x, il, wl, handle)
        torch.cuda.synchronize()
        return combined.clone(), out.clone()

    on_time = both()
    dist.barrier()
    if rank == 1:
        time.sleep(timeout_s / 2)
    late = both()
    for a, b in zip(on_time, late):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"rank {rank}: a late peer changed the results"
    both()  # and no error was recorded for a later call to raise
    buf.destroy()
    ll.destroy()


def test_slow_peer_is_not_an_error():
    cluster(2).run(rank_slow_peer, 4.0)


def rank_shrink_after_silent_peer(timeout_s: str):
    """Failed-rank masking: rank 1 stops making low-latency calls; rank 0 masks it on timeout and goes
    on; its outputs equal the reference restricted to the live ranks; query returns exactly the masked
    set, and cleaning (the mask, then the buffer on every rank) restores full operation."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    n, hidden, num_experts = 16, 512, 4 * num_ranks
    with peer_timeout(timeout_s):
        buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(n, hidden, num_ranks, num_experts),
                     low_latency_mode=True, enable_shrink=True, backend="cuda")
    x, idx, w = (t.to(dev) for t in make_inputs(61, rank, n, hidden, num_experts, 3, num_ranks, "random"))
    status = torch.zeros(num_ranks, dtype=torch.int32, device=dev)
    if rank == 0:
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
        out, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)  # identity experts
        torch.cuda.synchronize()
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] + [1] * (num_ranks - 1), status.tolist()
        e_local = num_experts // num_ranks
        live = (idx >= 0) & (idx // e_local == 0)
        ref = (w * live).sum(1, keepdim=True).double() * x.double()
        assert torch.allclose(out.double(), ref, rtol=2 ** -7, atol=1e-5), "outputs differ from the live-rank reference"
        buf.low_latency_clean_mask_buffer()
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] * num_ranks
    dist.barrier()
    # The silent rank comes back: every rank cleans (collective; the calls diverged: rank 0 made two
    # that rank 1 did not), and full operation is restored: outputs bitwise as the reference's.
    buf.clean_low_latency_buffer(n, hidden, num_experts)
    ref = Buffer(dist.group.WORLD, 0, buf.num_rdma_bytes, low_latency_mode=True, backend="reference")
    outs = []
    for b in (buf, ref):
        for _ in range(3):  # both slots, and back to the first
            recv_x, count, handle, _, _ = b.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
            out, _, _ = b.low_latency_combine(recv_x, idx, w, handle)
        torch.cuda.synchronize()
        outs.append((count.clone(), out.clone()))
    for a, b in zip(*outs):
        assert same_bits(a, b), f"rank {rank}: after clean, outputs differ from the reference backend"
    buf.destroy()
    ref.destroy()


def test_shrink_masks_a_silent_peer():
    cluster(2).run(rank_shrink_after_silent_peer, "3")


def rank_silent_peer_recorded(mode: str, silent: int, tag: str, records: str):
    """Rank ``silent`` stops calling (it hangs, alive) after a round trip every rank made; the others'
    next calls give up within the timeout, and each one's error and flight record name that rank
    alone, the operation and the phase. Returns the survivors' records."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    store = dist.distributed_c10d._get_default_store()
    n, hidden, num_experts = 16, 512, 4 * num_ranks
    with peer_timeout(2), env_var("EPCOMM_FLIGHT_RECORDER_DIR", records):
        if mode == "intranode":
            buf = Buffer(dist.group.WORLD, NVL_BYTES, backend="cuda")
            x, idx, w, num_experts = _inputs(9)
            _round_trip(buf, x, idx, w, num_experts)
        else:
            buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(n, hidden, num_ranks, num_experts),
                         low_latency_mode=True, backend="cuda")
            x, idx, w = (t.to(dev) for t in make_inputs(73, rank, n, hidden, num_experts, 3, num_ranks, "random"))
            recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
            buf.low_latency_combine(recv_x, idx, w, handle)
        torch.cuda.synchronize()
        dist.barrier()
        if rank == silent:  # hangs until every other rank has raised
            keys = [f"test/{tag}/raised/{r}" for r in range(num_ranks) if r != silent]
            deadline = time.monotonic() + 60
            while not store.check(keys) and time.monotonic() < deadline:
                time.sleep(0.05)
            return None
        error = None
        try:
            if mode == "intranode":
                buf.dispatch(x, **_dispatch_kwargs(buf, idx, w, num_experts))
            else:
                for _ in range(3):  # the error is raised by one of the next calls
                    buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
            torch.cuda.synchronize()
        except RuntimeError as e:
            error = str(e)
        store.set(f"test/{tag}/raised/{rank}", "1")
    assert error is not None and f"rank(s) [{silent}] in the " in error, error
    return flight_record(error)


@pytest.mark.parametrize("mode", ["intranode", "low_latency"])
def test_silent_peer_is_named_by_every_flight_record(mode):
    """4 ranks, rank 2 silent: all three records name rank 2, the call and the phase: a dispatch's
    count exchange (intranode), a low-latency dispatch waiting to send into rank 2's slot (its
    acknowledgement of the slot's last call) or for its rows."""
    import uuid

    silent = 2
    with tempfile.TemporaryDirectory() as records:
        with fresh_cluster(4) as c:
            records_seen = c.run(rank_silent_peer_recorded, mode, silent, uuid.uuid4().hex, records, timeout_s=120)
    assert records_seen[silent] is None
    for rank, record in enumerate(records_seen):
        if rank == silent:
            continue
        assert record is not None and record["missing_ranks"] == [silent] and record["mode"] == mode, record
        counters = record["counters"]
        if mode == "intranode":
            assert (record["operation"], record["phase"]) == ("dispatch", "notify"), record
            assert counters["peer_call"][silent] < counters["this_rank_call"], counters
            assert all(c == counters["this_rank_call"] for r, c in enumerate(counters["peer_call"]) if r != silent)
        else:
            assert record["operation"] == "low_latency_dispatch" and record["phase"] in ("send", "receive"), record
