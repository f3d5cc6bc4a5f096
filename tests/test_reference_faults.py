"""The portable path (backend="reference") on gloo when a peer dies, hangs or is slow: a dead or hung
peer gives a RuntimeError naming the operation and the rank within EPCOMM_TIMEOUT_S, never gloo's own
error; a peer late by half the timeout is waited for."""

import json
import os
import signal
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from conftest import TEST_ENV, peer_timeout
from routing import make_inputs

from epcomm import Buffer
from epcomm.utils.launch import LocalCluster, RankFailure

TIMEOUT_S = 3.0
HIDDEN, NUM_EXPERTS, NUM_TOKENS, NUM_TOPK = 256, 8, 32, 2
LL_BYTES = Buffer.get_low_latency_rdma_size_hint(NUM_TOKENS, HIDDEN, 2, NUM_EXPERTS)


def _calls(mode: str):
    """(buffer, the first call, the second call) of ``mode`` on this rank's inputs."""
    x, idx, w = make_inputs(5, dist.get_rank(), NUM_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, 2, "random")
    if mode == "normal":
        buf = Buffer(dist.group.WORLD, 1 << 26, backend="reference")
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, NUM_EXPERTS)
        state = {}

        def first():
            state["out"] = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)

        def second():
            recv_x, _, recv_w, _, handle, _ = state["out"]
            return buf.combine(recv_x, handle, topk_weights=recv_w)[0]
    else:
        buf = Buffer(dist.group.WORLD, 0, LL_BYTES, low_latency_mode=True, backend="reference")
        state = {}

        def first():
            state["out"] = buf.low_latency_dispatch(x, idx, NUM_TOKENS, NUM_EXPERTS, use_fp8=False)

        def second():
            recv_x, _, handle, _, _ = state["out"]
            return buf.low_latency_combine(recv_x, idx, w, handle)[0]
    return buf, first, second


def rank_faulty_peer(path: str, mode: str, fault: str, when: str):
    """Rank 1 dies ("dead") or stops calling for twice the timeout ("hung") before its ``when`` call;
    rank 0 records what its calls raised and when."""
    with peer_timeout(TIMEOUT_S):
        _, first, second = _calls(mode)
    dist.barrier()
    if dist.get_rank() == 1:
        if when == "second":
            first()
        if fault == "dead":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(2 * TIMEOUT_S)
        return
    outcome = {"error": None}
    start = time.monotonic()
    try:
        first()
        start = time.monotonic()
        second()
    except RuntimeError as error:
        outcome["error"], outcome["type"] = str(error), type(error).__name__
    outcome["raised_after_s"] = time.monotonic() - start
    with open(path, "w") as f:
        json.dump(outcome, f)


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("fault,when", [("dead", "first"), ("dead", "second"), ("hung", "first"),
                                        ("hung", "second")])
def test_dead_or_hung_peer_is_named_within_the_timeout(mode, fault, when):
    op = {"normal": ("dispatch", "combine"), "low_latency": ("low_latency_dispatch", "low_latency_combine")}[mode]
    op = op[0] if when == "first" else op[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.json")
        cluster = LocalCluster(2, "gloo", env={**TEST_ENV, "EPCOMM_TIMEOUT_S": str(TIMEOUT_S)})
        try:
            cluster.run(rank_faulty_peer, path, mode, fault, when, timeout_s=60)
        except RankFailure as failure:
            assert fault == "dead" and "died" in failure.errors.get(1, ""), failure.errors
        finally:
            cluster.close()
        with open(path) as f:
            outcome = json.load(f)
    error = outcome["error"]
    assert error is not None, outcome
    assert error.startswith(f"epcomm {op}:") and "rank(s) [1]" in error, outcome
    assert "gloo" not in error and "Connection" not in error, outcome
    assert outcome["raised_after_s"] < TIMEOUT_S + 2, outcome


def rank_slow_peer(mode: str):
    with peer_timeout(TIMEOUT_S):
        _, first, second = _calls(mode)
    first()
    on_time = second().clone()
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(TIMEOUT_S / 2)
    first()
    late = second()
    assert torch.equal(on_time.view(torch.int16), late.view(torch.int16))


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_slow_peer_is_not_an_error(mode):
    cluster = LocalCluster(2, "gloo", env={**TEST_ENV, "EPCOMM_TIMEOUT_S": str(TIMEOUT_S)})
    try:
        cluster.run(rank_slow_peer, mode, timeout_s=60)
    finally:
        cluster.close()


def rank_store_headers(mode: str) -> list[int]:
    """Per call, this rank's handshake headers left in the store (what ``tidy`` bounds)."""
    buf, first, second = _calls(mode)
    store = dist.distributed_c10d._get_default_store()
    mine = f"/{dist.get_rank()}"
    left = []
    for _ in range(6):
        first()
        second()
        left.append(sum(1 for k in store.list_keys() if f"{buf.uid}/header/" in k and k.endswith(mine)))
    dist.barrier()
    buf.destroy()
    return left


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_store_headers_stay_bounded(mode):
    """Each call leaves a header in the store; the exchanges delete those every peer has read."""
    with LocalCluster(2, "gloo", env=TEST_ENV) as cluster:
        for left in cluster.run(rank_store_headers, mode, timeout_s=60):
            assert max(left) <= 3 and left[-1] == left[-2], left
