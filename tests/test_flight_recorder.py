"""The flight recorder on the portable path (CPU processes): a peer that goes silent before or during
a dispatch or combine, or exits between them, is named with the phase in the error and in the JSON
file of every rank that waited for it. The CUDA modes' records: tests/test_reliability_cuda.py."""

from __future__ import annotations

import glob
import json
import os
import tempfile
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import TEST_ENV, env_var
from routing import make_inputs

from epcomm import Buffer, Config
from epcomm import flight_recorder as fr
from epcomm.backends.cuda.errors import LOW_LATENCY, ErrorTable, RecordLayout, device_codes, phase_names, record_words
from epcomm.utils.launch import LocalCluster, RankFailure

TIMEOUT_S = "2"
HIDDEN, TOPK, TOKENS = 64, 2, 12


# ====================================================================================== unit checks
def test_phase_and_record_words_come_from_the_protocol():
    """One definition: the phases and the record's word offsets are read from common/protocol.cuh."""
    assert phase_names() == {1: "notify", 2: "send", 3: "receive", 4: "reduce"}
    words = record_words()
    assert words["kInfoErrorPhase"] not in (words["kInfoError"], words["kInfoErrorOp"])
    assert words["kInfoErrorRanks"] > words["kInfoErrorPhase"]
    assert device_codes()["kPhaseReduce"] == 4


def test_a_timeout_record_names_phase_and_calls_the_recorder():
    """An error record as a kernel writes it: the message names the ranks and the phase, and the
    flight hook gets the failed call, the reporting call, the phase and the ranks."""
    table = ErrorTable(LOW_LATENCY, RecordLayout.protocol(clear="record"))
    words = record_words()
    info = np.zeros(16, dtype=np.int32)
    info[words["kInfoError"]] = device_codes()["kErrTimeout"]
    info[words["kInfoErrorOp"]] = device_codes()["kOpLowLatencyCombine"]
    info[words["kInfoErrorPhase"]] = device_codes()["kPhaseReduce"]
    info[words["kInfoErrorRanks"] + 3] = 1
    seen = []

    def flight(*args):
        seen.append(args)
        return " Flight record: /x.json"

    with pytest.raises(RuntimeError) as error:
        table.check(info, "low_latency_dispatch", 0, 4, flight=flight)
    text = str(error.value)
    assert "timed out waiting for rank(s) [3] in the reduce phase" in text, text
    assert text.endswith(" Flight record: /x.json"), text
    assert seen == [("low_latency_combine", "low_latency_dispatch", "reduce", [3])]
    assert not info.any()  # cleared as the layout says


def test_a_family_keeping_its_hook_is_freed_without_a_collection():
    """The CUDA families keep ``hook(self, ...)`` on themselves: the hook must not hold them, or their
    device memory would live until the cyclic collector ran (destroyed and collected Buffers kept it)."""
    import gc
    import weakref

    class Family:  # a CUDA family's part the hook sees: a recorder, counters read on a timeout
        recorder = None

    ops = Family()
    ops.flight = fr.hook(ops, "intranode", lambda o: {"calls": 1})
    gone = weakref.ref(ops)
    gc.disable()
    try:
        del ops
        assert gone() is None, "the hook keeps its ops alive: a reference cycle"
    finally:
        gc.enable()


def test_recorder_file_and_off_switch(tmp_path):
    rec = fr.FlightRecorder("abc-0", 1, (4, 5), 2.0)
    for i in range(fr.RING_CALLS + 3):
        rec.note("combine", torch.Size([i, 8]), torch.bfloat16, i)
    with env_var("EPCOMM_FLIGHT_RECORDER_DIR", str(tmp_path)):
        text = rec.timeout("reference", "combine", "reduce", [0], lambda: {"this_rank_call": 7})
    path = text.split("Flight record: ")[1]
    with open(path) as f:
        record = json.load(f)
    assert (record["global_rank"], record["rank"], record["operation"], record["phase"]) == (5, 1, "combine", "reduce")
    assert record["missing_ranks"] == [0] and record["counters"] == {"this_rank_call": 7}
    calls = record["last_calls"]
    assert len(calls) == fr.RING_CALLS and calls[-1]["x"] == [fr.RING_CALLS + 2, 8]
    assert calls[-1]["dtype"] == "bfloat16" and calls[-1]["num_recv_tokens"] == fr.RING_CALLS + 2
    with env_var("EPCOMM_FLIGHT_RECORDER_DIR", "off"):
        assert rec.timeout("reference", "combine", "reduce", [0], {}) == ""
    assert len(os.listdir(tmp_path)) == 1


# ====================================================================================== silent peers
def _store():
    return dist.distributed_c10d._get_default_store()


def _go_silent(tag: str, survivors: list[int]):
    """Stand in for a rank that hangs: wait (without calling anything) until every survivor raised."""
    def silent(*args, **kwargs):
        deadline = time.monotonic() + 30
        keys = [f"test/{tag}/raised/{r}" for r in survivors]
        while not _store().check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise _Silent()
    return silent


class _Silent(Exception):
    pass


def _silence_rows(buf: Buffer, tag: str, survivors: list[int]) -> None:
    """From now on this rank's row exchanges hang (its handshakes still go through)."""
    transport = buf.agreement.transport
    for name in ("all_to_all", "start_all_to_all", "all_gather_into", "reduce_scatter"):
        setattr(transport, name, _go_silent(tag, survivors))


def rank_silent_peer(moment: str, silent: int, tag: str, path: str) -> dict | str:
    """Rank ``silent`` hangs at ``moment``; every other rank returns its error (and the record it wrote)."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    survivors = [r for r in range(num_ranks) if r != silent]
    num_experts = 2 * num_ranks
    if moment.startswith("low_latency"):
        return _silent_low_latency(moment, silent, tag, survivors)
    buf = Buffer(dist.group.WORLD, Config().get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks), backend="reference")
    x, idx, w = make_inputs(7, rank, TOKENS, HIDDEN, num_experts, TOPK, num_ranks, "random")
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    kwargs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=idx, topk_weights=w)
    if rank == silent:
        try:
            if moment == "before dispatch":
                _go_silent(tag, survivors)()
            if moment == "in dispatch":
                _silence_rows(buf, tag, survivors)
            recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **kwargs)
            if moment == "exit before combine":
                dist.barrier()
                os._exit(0)  # as a crashing rank: no cleanup
            if moment == "before combine":
                _go_silent(tag, survivors)()
            if moment == "in combine":
                _silence_rows(buf, tag, survivors)
            buf.combine(recv_x, handle, topk_weights=recv_w)
        except _Silent:
            return "silent"
        raise AssertionError("the silent rank's calls went through")
    start = time.monotonic()
    outcome: dict = {"error": None}
    try:
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **kwargs)
        if moment == "exit before combine":
            dist.barrier()  # rank `silent`'s dispatch is done too: it exits next
        buf.combine(recv_x, handle, topk_weights=recv_w)
    except RuntimeError as error:
        outcome["error"] = str(error)
    outcome["raised_after_s"] = time.monotonic() - start
    _store().set(f"test/{tag}/raised/{rank}", "1")
    if moment == "exit before combine":
        with open(f"{path}.{rank}", "w") as f:
            json.dump(outcome, f)
    return outcome


def _silent_low_latency(moment: str, silent: int, tag: str, survivors: list[int]) -> dict | str:
    """Low latency on the portable path: rank ``silent`` skips the dispatch, or its rows exchange."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    n, num_experts = TOKENS, 2 * num_ranks
    buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(n, HIDDEN, num_ranks, num_experts),
                 low_latency_mode=True, backend="reference")
    x, idx, _ = make_inputs(8, rank, n, HIDDEN, num_experts, TOPK, num_ranks, "random")
    buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)  # every rank
    if rank == silent:
        try:
            if moment == "low_latency_dispatch silent":
                _go_silent(tag, survivors)()
            _silence_rows(buf, tag, survivors)
            buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
        except _Silent:
            return "silent"
        raise AssertionError("the silent rank's calls went through")
    start = time.monotonic()
    outcome: dict = {"error": None}
    try:
        buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
    except RuntimeError as error:
        outcome["error"] = str(error)
    outcome["raised_after_s"] = time.monotonic() - start
    _store().set(f"test/{tag}/raised/{rank}", "1")
    return outcome


CASES = {  # moment -> (operation, phase) the survivors' records name
    "before dispatch": ("dispatch", "notify"),
    "in dispatch": ("dispatch", "receive"),
    "before combine": ("combine", "notify"),
    "in combine": ("combine", "reduce"),
    "exit before combine": ("combine", "notify"),
    "low_latency_dispatch silent": ("low_latency_dispatch", "notify"),
    "low_latency_dispatch rows": ("low_latency_dispatch", "receive"),
}


def _run(num_ranks: int, moment: str, silent: int, records: str) -> list[dict]:
    env = {**TEST_ENV, "EPCOMM_TIMEOUT_S": TIMEOUT_S, "EPCOMM_FLIGHT_RECORDER_DIR": records}
    tag = f"{moment}-{num_ranks}-{time.monotonic_ns()}"
    path = os.path.join(records, "outcome")
    with LocalCluster(num_ranks, backend="gloo", env=env) as cluster:
        if moment != "exit before combine":
            results = cluster.run(rank_silent_peer, moment, silent, tag, path, timeout_s=120)
            assert results[silent] == "silent"
            return [results[r] for r in range(num_ranks) if r != silent]
        with pytest.raises(RankFailure) as failure:
            cluster.run(rank_silent_peer, moment, silent, tag, path, timeout_s=120)
        assert "died" in failure.value.errors.get(silent, ""), failure.value.errors
    outcomes = []
    for r in range(num_ranks):
        if r != silent:
            with open(f"{path}.{r}") as f:
                outcomes.append(json.load(f))
    return outcomes


@pytest.mark.parametrize("num_ranks,silent,moment", [(2, 1, m) for m in CASES] + [(4, 2, "in dispatch"),
                                                                                 (4, 0, "in combine")])
def test_silent_peer_is_named_with_its_phase(num_ranks, silent, moment):
    operation, phase = CASES[moment]
    with tempfile.TemporaryDirectory() as records:
        outcomes = _run(num_ranks, moment, silent, records)
        files = sorted(glob.glob(os.path.join(records, "epcomm-flight-*.json")))
        assert len(files) == num_ranks - 1, (files, outcomes)
        written = []
        for name in files:
            with open(name) as f:
                written.append(json.load(f))
    for outcome in outcomes:
        error = outcome["error"]
        assert error is not None and f"rank(s) [{silent}]" in error and f"in the {phase} phase" in error, outcome
        assert "Flight record: " in error, error
        assert outcome["raised_after_s"] < float(TIMEOUT_S) + 5, outcome
    assert sorted(r["rank"] for r in written) == [r for r in range(num_ranks) if r != silent]
    for record in written:
        assert record["mode"] == "reference" and record["operation"] == operation, record
        assert record["phase"] == phase and record["missing_ranks"] == [silent], record
        arrived = record["counters"]["arrived_call"]
        assert len(arrived) == num_ranks, record
        ops = [call["op"] for call in record["last_calls"]]
        assert ops[-1] == operation and ops[0] == operation.replace("combine", "dispatch"), ops
        assert record["last_calls"][0]["x"] == [TOKENS, HIDDEN], record["last_calls"]
