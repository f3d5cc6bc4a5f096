"""Failed-rank masking in normal mode on the portable path (enable_shrink, gloo): a peer that exits or
goes silent is masked by every survivor alike, the call completes over the live ranks and equals the
oracle computed over them alone; later calls do not wait for it; clean brings back every rank."""

import json
import os
import signal
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from conftest import TEST_ENV, env_var, peer_timeout
from routing import make_inputs

from epcomm import Buffer, oracle
from epcomm.utils.launch import LocalCluster, RankFailure

TIMEOUT_S = 3.0
HIDDEN, NUM_EXPERTS, NUM_TOKENS, NUM_TOPK = 128, 24, 24, 3
MARGIN_S = 2.0


def _inputs(rank: int, num_ranks: int, seed: int):
    return make_inputs(seed, rank, NUM_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, num_ranks, "random")


def _without(idx: torch.Tensor, masked: set[int], num_ranks: int) -> torch.Tensor:
    """``idx`` with the entries on masked ranks' experts dropped (as if -1)."""
    owner = torch.where(idx >= 0, idx // (NUM_EXPERTS // num_ranks), -1)
    drop = torch.zeros_like(idx, dtype=torch.bool)
    for r in masked:
        drop |= owner == r
    return idx.masked_fill(drop, -1)


def _dispatch(buf: Buffer, x, idx, w):
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, NUM_EXPERTS)
    return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=idx, topk_weights=w)


def _check_live_dispatch(out, rank: int, num_ranks: int, seed: int, masked: set[int]) -> None:
    """A fresh dispatch under the mask equals the oracle of the live ranks' inputs (masked ranks: none)."""
    xs, idxs, ws = [], [], []
    for r in range(num_ranks):
        x, idx, w = _inputs(r, num_ranks, seed)
        if r in masked:
            x, idx, w = x[:0], idx[:0], w[:0]
        xs.append(x), idxs.append(_without(idx, masked, num_ranks)), ws.append(w)
    want = oracle.dispatch_to(rank, xs, idxs, NUM_EXPERTS, topk_weights=ws)
    recv_x, recv_idx, recv_w, counts, handle, _ = out
    assert torch.equal(recv_x.view(torch.int16), want.x.view(torch.int16))
    assert torch.equal(recv_idx, want.topk_idx) and torch.equal(recv_w, want.topk_weights)
    assert counts == want.expert_counts and handle.recv_counts == want.recv_counts


def _check_combine(combined, out, rank: int, num_ranks: int, seed: int, masked: set[int], routed: set[int]) -> None:
    """A combine of rows ``y = recv_x`` sums only what the live ranks returned (``routed``: the ranks
    masked when the dispatch ran, whose inputs it did not see)."""
    in_ranks, ys = [], []
    for r in range(num_ranks):
        x, idx, w = _inputs(r, num_ranks, seed)
        if r in routed:
            idx = idx[:0]
        in_rank = oracle.dispatch_layout(_without(idx, routed, num_ranks), NUM_EXPERTS, num_ranks)[3]
        in_ranks.append(in_rank)
    everyone = oracle.dispatch([_inputs(r, num_ranks, seed)[0][:in_ranks[r].shape[0]] for r in range(num_ranks)],
                               None, NUM_EXPERTS, in_ranks=in_ranks)
    ys = [d.x for d in everyone]
    for s in range(num_ranks):  # what masked ranks would have returned is absent
        for d in masked:
            in_ranks[s] = in_ranks[s].clone()
            in_ranks[s][:, d] = False
    want = oracle.combine(ys, in_ranks)[rank][0]
    assert torch.equal(combined.view(torch.int16), want.view(torch.int16))


def shrink_buffer(kind: str) -> Buffer:
    """A Buffer with enable_shrink on the portable path ("reference"), or on the kernels: "intranode", or
    "hierarchical" over domains of two ranks (the failed rank then inside one and across the others)."""
    with peer_timeout(TIMEOUT_S):
        if kind == "reference":
            return Buffer(dist.group.WORLD, 1 << 26, backend="reference", enable_shrink=True)
        if kind == "intranode":
            return Buffer(dist.group.WORLD, 1 << 26, backend="cuda", enable_shrink=True)
        from epcomm.backends.cuda.hierarchical import rdma_bytes_needed

        rdma = rdma_bytes_needed(NUM_TOKENS, HIDDEN, 2, dist.get_world_size(), 2, NUM_TOPK, HIDDEN // 128)
        with env_var("EPCOMM_RANKS_PER_DOMAIN", 2):
            return Buffer(dist.group.WORLD, 1 << 26, rdma, backend="cuda", strategy="hierarchical",
                          enable_shrink=True)


def _run(num_ranks: int, backend: str, fn, *args, timeout_s: float = 60) -> None:
    """``fn(*args)`` on ``num_ranks`` fresh ranks with the tests' timeout."""
    cluster = LocalCluster(num_ranks, backend, env={**TEST_ENV, "EPCOMM_TIMEOUT_S": str(TIMEOUT_S)})
    try:
        cluster.run(fn, *args, timeout_s=timeout_s)
    finally:
        cluster.close()


def _on(buf: Buffer, tensors):
    """``tensors`` on the Buffer's device (the oracle's inputs are on the host)."""
    return tuple(t.to(buf.device) for t in tensors)


def _host(out) -> tuple:
    """A dispatch's outputs with its tensors on the host (the oracle's side), the handle as it is."""
    return tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in out)


def rank_exits(path: str, when: str, dead: int, num_ranks: int, kind: str = "reference"):
    rank = dist.get_rank()
    buf = shrink_buffer(kind)
    x, idx, w = _on(buf, _inputs(rank, num_ranks, 1))
    dist.barrier()
    if rank == dead and when == "before_dispatch":
        os.kill(os.getpid(), signal.SIGKILL)
    if when == "silent_before_dispatch" and rank == dead:
        time.sleep(3 * TIMEOUT_S)
        return
    record = {}
    start = time.monotonic()
    out = _dispatch(buf, x, idx, w)
    record["dispatch_s"] = time.monotonic() - start
    before_combine = when.endswith("before_combine")
    routed = set() if before_combine else {dead}
    if before_combine:
        dist.barrier()
        if rank == dead and when == "before_combine":
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == dead:  # silent: its peers' combine gives up on it, then it leaves
            time.sleep(3 * TIMEOUT_S)
            return
    else:
        _check_live_dispatch(_host(out), rank, num_ranks, 1, {dead})
    start = time.monotonic()
    combined = buf.combine(out[0], out[4])[0].cpu()
    record["combine_s"] = time.monotonic() - start
    _check_combine(combined, out, rank, num_ranks, 1, {dead}, routed)
    if before_combine:  # a cached dispatch of the handle made before: the dead rank's rows are zero
        cached = buf.dispatch(x, handle=out[4])[0].cpu()
        sources = torch.repeat_interleave(torch.arange(num_ranks), torch.tensor(out[4].recv_counts))
        want = out[0].cpu()
        want[sources == dead] = 0
        assert torch.equal(cached.view(torch.int16), want.view(torch.int16))
    status = torch.zeros(num_ranks, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    record["masked"] = torch.nonzero(status).flatten().tolist()
    start = time.monotonic()  # the next calls do not wait for the masked rank
    x2, idx2, w2 = _on(buf, _inputs(rank, num_ranks, 2))
    out2 = _dispatch(buf, x2, idx2, w2)
    _check_live_dispatch(_host(out2), rank, num_ranks, 2, {dead})
    _check_combine(buf.combine(out2[0], out2[4])[0].cpu(), out2, rank, num_ranks, 2, {dead}, {dead})
    record["next_s"] = time.monotonic() - start
    buf.low_latency_clean_mask_buffer()  # every rank waited for again: the dead one is masked anew
    buf.low_latency_query_mask_buffer(status)
    record["cleaned"] = status.tolist()
    start = time.monotonic()
    out3 = _dispatch(buf, x2, idx2, w2)
    record["after_clean_s"] = time.monotonic() - start
    _check_live_dispatch(_host(out3), rank, num_ranks, 2, {dead})
    buf.low_latency_query_mask_buffer(status)
    record["masked_again"] = torch.nonzero(status).flatten().tolist()
    with open(os.path.join(path, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


@pytest.mark.parametrize("num_ranks,dead,when", [(3, 1, "before_dispatch"), (4, 2, "before_combine"),
                                                 (3, 2, "before_combine"), (4, 0, "before_dispatch"),
                                                 (3, 1, "silent_before_dispatch"), (4, 3, "silent_before_combine")])
def test_failed_peer_is_masked_and_the_call_completes(num_ranks, dead, when, kind="reference", backend="gloo"):
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(num_ranks, backend, env={**TEST_ENV, "EPCOMM_TIMEOUT_S": str(TIMEOUT_S)})
        try:
            cluster.run(rank_exits, tmp, when, dead, num_ranks, kind, timeout_s=90)
        except RankFailure as failure:
            assert set(failure.errors) == {dead} and "died" in failure.errors[dead], failure.errors
        finally:
            cluster.close()
        records = {}
        for r in range(num_ranks):
            if r != dead:
                with open(os.path.join(tmp, f"rank{r}.json")) as f:
                    records[r] = json.load(f)
    for r, record in records.items():
        failing = record["dispatch_s"] if "dispatch" in when else record["combine_s"]
        assert failing < TIMEOUT_S + MARGIN_S, (r, record)
        assert record["masked"] == [dead] and record["masked_again"] == [dead], (r, record)
        assert record["next_s"] < 1.0, (r, record)
        assert record["cleaned"] == [0] * num_ranks, (r, record)


def rank_without_shrink(strategy: str):
    with peer_timeout(TIMEOUT_S):
        buf = Buffer(dist.group.WORLD, 1 << 26, backend="reference", enable_shrink=True, strategy=strategy)
    x, idx, w = _inputs(dist.get_rank(), 2, 1)
    with pytest.raises(RuntimeError, match="strategy='alltoall' only"):
        _dispatch(buf, x, idx, w)


@pytest.mark.parametrize("strategy", ["allgather", "hierarchical"])
def test_other_strategies_refuse_shrink_in_normal_mode(strategy):
    _run(2, "gloo", rank_without_shrink, strategy)


def rank_wakes_up_masked(path: str, kind: str = "reference"):
    """Rank 1 goes silent for longer than the timeout, then calls: its peers masked it, so it raises."""
    rank = dist.get_rank()
    buf = shrink_buffer(kind)
    x, idx, w = _on(buf, _inputs(rank, 3, 1))
    dist.barrier()
    if rank == 1:
        time.sleep(1.5 * TIMEOUT_S)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="masked as failed") as error:
            out = _dispatch(buf, x, idx, w)
            buf.combine(out[0], out[4])
        with open(os.path.join(path, "late.json"), "w") as f:
            json.dump({"s": time.monotonic() - start, "error": str(error.value)}, f)
        return
    out = _dispatch(buf, x, idx, w)
    _check_live_dispatch(_host(out), rank, 3, 1, {1})
    buf.combine(out[0], out[4])
    time.sleep(3 * TIMEOUT_S)  # the late rank's calls find its peers still there


def test_a_rank_masked_while_silent_raises_when_it_calls(kind="reference", backend="gloo"):
    with tempfile.TemporaryDirectory() as tmp:
        _run(3, backend, rank_wakes_up_masked, tmp, kind, timeout_s=90)
        with open(os.path.join(tmp, "late.json")) as f:
            late = json.load(f)
    assert late["s"] < 2 * TIMEOUT_S + MARGIN_S, late


def rank_masked_by_hand(kind: str = "reference"):
    """Every rank masks rank 2: ranks 0 and 1 run without waiting for it and rank 2 refuses to take
    part; once every rank cleans the mask, all three run together again."""
    rank = dist.get_rank()
    buf = shrink_buffer(kind)
    x, idx, w = _on(buf, _inputs(rank, 3, 1))
    buf.low_latency_update_mask_buffer(2, True)
    if rank == 2:
        with pytest.raises(RuntimeError, match="rank 2 is masked as failed"):
            _dispatch(buf, x, idx, w)
    else:
        start = time.monotonic()
        out = _dispatch(buf, x, idx, w)
        _check_live_dispatch(_host(out), rank, 3, 1, {2})
        _check_combine(buf.combine(out[0], out[4])[0].cpu(), out, rank, 3, 1, {2}, {2})
        assert time.monotonic() - start < 1.0
    buf.low_latency_clean_mask_buffer()
    dist.barrier()
    for _ in range(2):  # (on the kernels: the first call after the clean meets, zeroes and runs on them)
        out = _dispatch(buf, x, idx, w)
        _check_live_dispatch(_host(out), rank, 3, 1, set())
        _check_combine(buf.combine(out[0], out[4])[0].cpu(), out, rank, 3, 1, set(), set())
    if kind != "reference":  # the second call ran on the kernels again
        assert not buf.normal_ops.off_kernels


def test_masked_by_hand_then_cleaned_restores_every_rank(kind="reference", backend="gloo"):
    _run(3, backend, rank_masked_by_hand, kind)


def rank_late(kind: str = "reference"):
    """Rank 1 reaches the dispatch and the combine half the timeout late: nobody is masked, every
    output is the whole group's, and the kernels (kind != "reference") stay in use."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    buf = shrink_buffer(kind)
    x, idx, w = _on(buf, _inputs(rank, num_ranks, 1))
    dist.barrier()
    if rank == 1:
        time.sleep(TIMEOUT_S / 2)
    out = _dispatch(buf, x, idx, w)
    _check_live_dispatch(_host(out), rank, num_ranks, 1, set())
    if rank == 1:
        time.sleep(TIMEOUT_S / 2)
    _check_combine(buf.combine(out[0], out[4])[0].cpu(), out, rank, num_ranks, 1, set(), set())
    status = torch.ones(num_ranks, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * num_ranks
    if kind != "reference":
        assert not buf.normal_ops.off_kernels


def test_a_late_peer_is_not_masked(kind="reference", backend="gloo"):
    _run(3, backend, rank_late, kind)
