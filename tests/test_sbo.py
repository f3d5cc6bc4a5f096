"""Single-batch overlap keywords of low_latency_combine on the portable path (gloo ranks): the same
results as without overlap, a bounded wait for signal words raised late by another thread, and the
argument checks, which both backends share."""

from __future__ import annotations

import inspect
import threading
import time

import pytest
import torch
import torch.distributed as dist
from conftest import cluster, peer_timeout
from routing import device, make_inputs

from epcomm import Buffer

N, HIDDEN, EXPERTS_PER_RANK, TOPK = 8, 256, 2, 3


def _setup(seed: int, timeout_s: float = 30):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    num_experts = EXPERTS_PER_RANK * num_ranks
    with peer_timeout(timeout_s):
        buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(N, HIDDEN, num_ranks, num_experts),
                     low_latency_mode=True, backend="reference")
    x, idx, w = (t.to(device()) for t in make_inputs(seed, rank, N, HIDDEN, num_experts, TOPK, num_ranks, "random"))
    return buf, x, idx, w, num_experts


def _outputs(recv_x: torch.Tensor) -> torch.Tensor:
    scale = (torch.arange(recv_x.shape[0], dtype=torch.float32, device=recv_x.device) + 1).view(-1, 1, 1) / 4
    return (recv_x.float().nan_to_num() * scale).to(torch.bfloat16)


def rank_sbo_reference():
    """comp_signal and src_signals (uint32 or int32), with a hook and without, raised before the call or
    by another thread while it waits: the output equals the combine without overlap, bit for bit."""
    num_ranks = dist.get_world_size()
    buf, x, idx, w, num_experts = _setup(11)
    e_local, rows = num_experts // num_ranks, N * num_ranks
    for kind, hook, late in (("comp", False, False), ("comp", True, True), ("src", False, True), ("src", True, False)):
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, N, num_experts, use_fp8=False)
        y = _outputs(recv_x)
        ref = buf.low_latency_combine(y, idx, w, handle)[0].clone()
        block_m = 3 if kind == "comp" else rows
        words = torch.zeros(e_local * -(-rows // block_m), dtype=torch.int32, device=device())
        if kind == "comp":
            keywords = dict(packed_recv_count=recv_count, comp_signal=words, block_m=block_m, threshold=5)
        else:
            words = words[:e_local]
            keywords = dict(src_signals=words.view(torch.uint32) if hook else words, src_signal_expect_value=5)
        raiser = threading.Timer(0.2, words.fill_, (5,)) if late else None
        if late:
            raiser.start()
        else:
            words.fill_(7)  # past the threshold counts too
        start = time.monotonic()
        combined, _, receive = buf.low_latency_combine(y, idx, w, handle, overlap=True, return_recv_hook=hook,
                                                       num_sms=2, **keywords)
        if late:
            assert time.monotonic() - start >= 0.15, "the combine did not wait for the signal words"
            raiser.join()
        if hook:
            receive()
        assert torch.equal(combined.view(torch.int16), ref.view(torch.int16)), (kind, hook, late)
    buf.destroy()


def test_sbo_reference_matches_the_combine_without_overlap():
    cluster(2).run(rank_sbo_reference)


def rank_sbo_reference_timeout():
    """Words that never reach the threshold: RuntimeError after EPCOMM_TIMEOUT_S, naming the words."""
    buf, x, idx, w, num_experts = _setup(12, timeout_s=1)
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, N, num_experts, use_fp8=False)
    e_local = num_experts // dist.get_world_size()
    words = torch.full((e_local * N * dist.get_world_size(),), 4, dtype=torch.int32, device=device())
    with pytest.raises(RuntimeError, match="expert GEMM did not raise signal words"):
        buf.low_latency_combine(recv_x, idx, w, handle, overlap=True, packed_recv_count=recv_count,
                                comp_signal=words, block_m=1, threshold=5)
    buf.destroy()


def test_sbo_reference_times_out():
    cluster(2).run(rank_sbo_reference_timeout)


def rank_sbo_checks():
    """Each bad keyword is refused, naming it, on every rank; the Buffer works on."""
    num_ranks = dist.get_world_size()
    buf, x, idx, w, num_experts = _setup(13)
    e_local, rows = num_experts // num_ranks, N * num_ranks
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, N, num_experts, use_fp8=False)
    words = torch.full((e_local * rows,), 1, dtype=torch.int32, device=device())
    comp = dict(overlap=True, packed_recv_count=recv_count, comp_signal=words, block_m=1, threshold=1)
    src = dict(overlap=True, src_signals=words[:e_local], src_signal_expect_value=1)
    bad = [
        (TypeError, "overlap must be a bool", dict(overlap="yes")),
        (ValueError, "comp_signal was given without overlap=True", dict(comp_signal=words)),
        (ValueError, "src_signals was given without overlap=True", dict(src_signals=words[:e_local])),
        (ValueError, "got neither", dict(overlap=True)),
        (ValueError, "not both", {**comp, "src_signals": words[:e_local]}),
        (ValueError, "needs packed_recv_count", {**comp, "packed_recv_count": None}),
        (ValueError, "packed_recv_count must have shape", {**comp, "packed_recv_count": recv_count[:1]}),
        (TypeError, "packed_recv_count must have dtype", {**comp, "packed_recv_count": recv_count.long()}),
        (ValueError, "packed_recv_count differs", {**comp, "packed_recv_count": recv_count + 1}),
        (ValueError, "block_m must be >= 1", {**comp, "block_m": 0}),
        (TypeError, "block_m must be an int", {**comp, "block_m": 1.5}),
        (ValueError, "threshold must be >= 1", {**comp, "threshold": 0}),
        (TypeError, "comp_signal must have dtype", {**comp, "comp_signal": words.long()}),
        (ValueError, "at least", {**comp, "comp_signal": words[:-1]}),
        (ValueError, "num_sms must be >= 0", {**comp, "num_sms": -1}),
        (ValueError, "src_signals must have shape", {**src, "src_signals": words}),
        (TypeError, "src_signals must have dtype", {**src, "src_signals": words[:e_local].float()}),
        (ValueError, "src_signal_expect_value must be >= 1", {**src, "src_signal_expect_value": 0}),
        (ValueError, "src_signal_expect_value must be <= 4294967295", {**src, "src_signal_expect_value": 2**32}),
    ]
    for error, text, keywords in bad:
        with pytest.raises(error, match=text):
            buf.low_latency_combine(recv_x, idx, w, handle, **keywords)
    # Without overlap SGLang's other keywords pass unused; with it, each form works.
    ref = buf.low_latency_combine(recv_x, idx, w, handle, overlap=False, packed_recv_count=recv_count, block_m=None,
                                  threshold=None, num_sms=3)[0]
    for keywords in (comp, src):
        out = buf.low_latency_combine(recv_x, idx, w, handle, **keywords)[0]
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    buf.destroy()


def test_sbo_argument_checks():
    cluster(2).run(rank_sbo_checks)


def test_sbo_signature():
    """DeepEP forks' keyword names and defaults; NVFP4 (use_nvfp4, x_global_scale) stays out, so callers
    that look for it (vLLM) keep to FP8 and BF16."""
    combine = inspect.signature(Buffer.low_latency_combine).parameters
    want = dict(overlap=False, packed_recv_count=None, comp_signal=None, block_m=64, threshold=0, num_sms=0,
                src_signals=None, src_signal_expect_value=0)
    assert {name: combine[name].default for name in want} == want
    dispatch = inspect.signature(Buffer.low_latency_dispatch).parameters
    assert "use_nvfp4" not in dispatch and "x_global_scale" not in dispatch
