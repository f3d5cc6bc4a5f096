"""Argument errors (API.md "Errors"): a refused call raises ValueError/TypeError naming the argument,
on every rank alike and within seconds, before any data moves, and leaves the Buffer usable.

Rank-side functions run many cases in one cluster call and return, per case, the error type, message
and seconds; the parent asserts, listing every problem at once. In the "one bad rank" modes only some
ranks pass the bad argument: each of them must raise its own precise error, and every other rank a
ValueError naming the refusing rank(s). After every case a full dispatch/combine on the same Buffer
must still reproduce the reference outputs (the refusal moved no data and left the ranks in step).
"""

from __future__ import annotations

import os
import re
import socket
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from conftest import cluster as _cluster
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from routing import make_inputs

import epcomm
from epcomm import Buffer, Config, lifecycle
from epcomm.backends.reference.backend import Op
from epcomm.backends.reference.transport import Transport
from epcomm.handle import DispatchHandle, LowLatencyHandle

# The reference backend's argument checks with CPU tensors on gloo ranks, also on GPU machines
# (the CUDA kernels' device-side checks are tested in test_intranode_cuda.py).
cluster = partial(_cluster, backend="gloo")

HIDDEN = 128
TOPK = 3
N_MAX = 8  # num_max_dispatch_tokens_per_rank
SEED = 3
FAST_S = 5.0  # a refused call answers in milliseconds; the tests' peer timeout is 30 s
RUN_TIMEOUT_S = 60
SHORT_TIMEOUT_S = "2"  # EPCOMM_TIMEOUT_S of the Buffers that exercise a peer timeout
REFUSED = "epcomm {op}: rank\\(s\\) {ranks} refused their arguments"


def _num_tokens(rank: int) -> int:
    return 6 - rank  # ranks hold different token counts


def _num_experts(num_ranks: int) -> int:
    return 4 * num_ranks


def _outcome(call: Callable[[], Any]) -> tuple[str | None, str, float]:
    """(error type name or None, message, seconds) of ``call()``."""
    start = time.monotonic()
    try:
        call()
    except Exception as error:  # every error is reported to the parent
        return type(error).__name__, str(error), time.monotonic() - start
    return None, "", time.monotonic() - start


def _fake_ll_handle(buf: Buffer) -> LowLatencyHandle:
    return LowLatencyHandle(buffer_uid=buf.uid, num_max_dispatch_tokens_per_rank=N_MAX, hidden=HIDDEN,
                            num_experts=8, num_tokens=1, num_topk=1, src_info=torch.zeros(0, dtype=torch.int32),
                            layout_range=torch.zeros(0, dtype=torch.int64))


def _fake_dispatch_handle(buf: Buffer) -> DispatchHandle:
    r = buf.group_size
    return DispatchHandle(buffer_uid=buf.uid, num_tokens=0, hidden=HIDDEN, num_recv_tokens=0, num_worst_tokens=0,
                          is_token_in_rank=torch.zeros((0, r), dtype=torch.bool), send_counts=[0] * r,
                          recv_counts=[0] * r)


def _noncontig(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` (2-D) in a non-contiguous view."""
    wide = torch.cat([t, t], dim=1)
    return wide[:, :t.shape[1]]


def _with_timeout(seconds: str, make: Callable[[], Any]) -> Any:
    """Build Buffers (which read EPCOMM_TIMEOUT_S when constructed) under another timeout."""
    old = os.environ.get("EPCOMM_TIMEOUT_S")
    os.environ["EPCOMM_TIMEOUT_S"] = seconds
    try:
        return make()
    finally:
        if old is None:
            del os.environ["EPCOMM_TIMEOUT_S"]
        else:
            os.environ["EPCOMM_TIMEOUT_S"] = old


def _wait_keys(keys: list[str], timeout_s: float) -> bool:
    """Poll the process group's store until every key exists; False on timeout."""
    store = dist.distributed_c10d._get_default_store()
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ====================================================================================== normal mode
class _NormalCtx:
    """One rank's Buffers, inputs and reference outputs for normal mode."""

    def __init__(self, num_rdma_bytes: int = 0, low_latency_mode: bool = False) -> None:
        self.rank, self.num_ranks = dist.get_rank(), dist.get_world_size()
        r = self.num_ranks
        self.num_experts = _num_experts(r)
        nvl = Config().get_nvl_buffer_size_hint(2 * HIDDEN * 2, r)  # room for a 2*HIDDEN mismatch case
        self.buf = Buffer(dist.group.WORLD, nvl, num_rdma_bytes, low_latency_mode=low_latency_mode,
                          backend="reference")
        # Another kind of Buffer (a handle serves every Buffer of its own group and kind)
        self.other = Buffer(dist.group.WORLD, nvl, backend="reference", strategy="allgather")
        self.inputs = [make_inputs(SEED, s, _num_tokens(s), HIDDEN, self.num_experts, TOPK, r, "random")
                       for s in range(r)]
        self.x, self.topk_idx, self.topk_weights = self.inputs[self.rank]
        self.per_rank, per_domain, self.per_expert, self.in_rank, _ = self.buf.get_dispatch_layout(
            self.topk_idx, self.num_experts)
        assert per_domain is None
        (self.recv_x, self.recv_idx, self.recv_w, self.expert_list, self.handle, _) = self.buf.dispatch(
            **self.kwargs())
        self.other_handle = self.other.dispatch(**self.kwargs())[4]
        self.rows = self.recv_x.shape[0]
        self.combined, self.combined_w, _ = self.buf.combine(self.recv_x, self.handle, topk_weights=self.recv_w)
        # Oracle: identity experts, so each token comes back once per rank it reached, and each weight
        # once (from the rank that owns its expert).
        e_local = self.num_experts // r
        owner = torch.where(self.topk_idx >= 0, self.topk_idx // e_local, -1)
        reached = torch.stack([(owner == d).any(1) for d in range(r)], 1).sum(1)
        assert torch.equal(self.combined, (self.x.float() * reached.unsqueeze(1)).to(torch.bfloat16))
        assert torch.equal(self.combined_w, torch.where(self.topk_idx >= 0, self.topk_weights, 0.0))
        assert self.rows > 0  # the cases below rely on every rank receiving something

    def kwargs(self, **overrides: Any) -> dict[str, Any]:
        kw = dict(x=self.x, num_tokens_per_rank=self.per_rank, is_token_in_rank=self.in_rank,
                  num_tokens_per_expert=self.per_expert, topk_idx=self.topk_idx, topk_weights=self.topk_weights)
        kw.update(overrides)
        return kw

    def dispatch(self, **overrides: Any):
        return self.buf.dispatch(**self.kwargs(**overrides))

    def combine(self, **overrides: Any):
        kw: dict[str, Any] = dict(x=self.recv_x, handle=self.handle, topk_weights=self.recv_w)
        kw.update(overrides)
        return self.buf.combine(**kw)

    def verify(self) -> str:
        """'' when a fresh dispatch, cached dispatch and combine reproduce the reference outputs."""
        try:
            recv_x, recv_idx, recv_w, expert_list, handle, _ = self.buf.dispatch(**self.kwargs())
            assert torch.equal(recv_x.view(torch.int16), self.recv_x.view(torch.int16)), "recv_x differs"
            assert torch.equal(recv_idx, self.recv_idx), "recv_topk_idx differs"
            assert torch.equal(recv_w, self.recv_w), "recv_topk_weights differs"
            assert expert_list == self.expert_list, "num_recv_tokens_per_expert_list differs"
            cached_x = self.buf.dispatch(self.x, handle=handle)[0]
            assert torch.equal(cached_x.view(torch.int16), self.recv_x.view(torch.int16)), "cached recv_x differs"
            combined, combined_w, _ = self.buf.combine(recv_x, handle, topk_weights=recv_w)
            assert torch.equal(combined.view(torch.int16), self.combined.view(torch.int16)), "combined_x differs"
            assert torch.equal(combined_w, self.combined_w), "combined_topk_weights differs"
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return ""


class Case(NamedTuple):
    op: str  # what the ranks with good arguments call meanwhile: a key of GOOD_CALLS
    call: Callable[[Any], Any]  # the bad call, given the rank's context
    exc: str  # the error type the bad rank must raise
    match: str  # regex its message must contain (naming the argument)
    # False: raised without telling the peers, so only tried with every rank passing it
    # (test_refusal_alone_is_announced checks one rank alone).
    announced: bool = True


def _fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return epcomm.per_token_cast_to_fp8(x)


def _x_with_hidden(c: Any, hidden: int) -> torch.Tensor:
    return c.x.repeat(1, 2)[:, :hidden].contiguous()


NORMAL_CASES: dict[str, Case] = {
    # ---- get_dispatch_layout: local, nothing to tell the peers
    "layout/topk_idx=E": Case("local", lambda c: c.buf.get_dispatch_layout(
        torch.full_like(c.topk_idx, c.num_experts), c.num_experts), "ValueError",
        r"^topk_idx values must lie in \[-1, \d+\)"),
    "layout/topk_idx=-2": Case("local", lambda c: c.buf.get_dispatch_layout(
        torch.full_like(c.topk_idx, -2), c.num_experts), "ValueError", r"^topk_idx values must lie in \[-1, "),
    "layout/topk_idx int32": Case("local", lambda c: c.buf.get_dispatch_layout(
        c.topk_idx.int(), c.num_experts), "TypeError", r"^topk_idx must have dtype torch\.int64"),
    "layout/topk_idx 1-D": Case("local", lambda c: c.buf.get_dispatch_layout(
        c.topk_idx.flatten(), c.num_experts), "ValueError", r"^topk_idx must be 2-D"),
    "layout/topk_idx non-contiguous": Case("local", lambda c: c.buf.get_dispatch_layout(
        _noncontig(c.topk_idx), c.num_experts), "ValueError", r"^topk_idx must be contiguous"),
    "layout/topk_idx meta device": Case("local", lambda c: c.buf.get_dispatch_layout(
        c.topk_idx.to("meta"), c.num_experts), "ValueError", r"^topk_idx must be on cpu"),
    "layout/topk_idx list": Case("local", lambda c: c.buf.get_dispatch_layout(
        c.topk_idx.tolist(), c.num_experts), "TypeError", r"^topk_idx must be a torch\.Tensor"),
    "layout/num_experts not multiple of R": Case("local", lambda c: c.buf.get_dispatch_layout(
        c.topk_idx, c.num_experts + 1), "ValueError", r"^num_experts \(\d+\) must be a multiple of the group"),
    "layout/num_experts float": Case("local", lambda c: c.buf.get_dispatch_layout(
        c.topk_idx, float(c.num_experts)), "TypeError", r"^num_experts must be an int"),
    "layout/num_experts=0": Case("local", lambda c: c.buf.get_dispatch_layout(c.topk_idx, 0), "ValueError",
                                 r"^num_experts must be >= 1"),
    "layout/previous_event type": Case("local", lambda c: c.buf.get_dispatch_layout(
        c.topk_idx, c.num_experts, previous_event="event"), "TypeError", r"^previous_event must be an EventOverlap"),
    "layout/allocate_on_comm_stream alone": Case("local", lambda c: c.buf.get_dispatch_layout(
        c.topk_idx, c.num_experts, allocate_on_comm_stream=True), "ValueError", r"^allocate_on_comm_stream=True"),
    # ---- dispatch: x
    "dispatch/x float16": Case("dispatch", lambda c: c.dispatch(x=c.x.half()), "TypeError",
                               r"^x must have dtype torch\.bfloat16"),
    "dispatch/x float32": Case("dispatch", lambda c: c.dispatch(x=c.x.float()), "TypeError",
                               r"^x must have dtype torch\.bfloat16"),
    "dispatch/x 1-D": Case("dispatch", lambda c: c.dispatch(x=c.x.flatten()), "ValueError", r"^x must be 2-D"),
    "dispatch/x str": Case("dispatch", lambda c: c.dispatch(x="x"), "TypeError", r"^x must be a torch\.Tensor"),
    "dispatch/x 3-tuple": Case("dispatch", lambda c: c.dispatch(x=(*_fp8(c.x), c.x)), "ValueError",
                               r"^x as a tuple must be \(x_e4m3, scales\)"),
    "dispatch/x non-contiguous": Case("dispatch", lambda c: c.dispatch(x=_noncontig(c.x)), "ValueError",
                                      r"^x must be contiguous"),
    "dispatch/x meta device": Case("dispatch", lambda c: c.dispatch(x=c.x.to("meta")), "ValueError",
                                   r"^x must be on cpu"),
    "dispatch/bf16 hidden*2 % 16": Case("dispatch", lambda c: c.dispatch(x=_x_with_hidden(c, 36)), "ValueError",
                                        r"^x: hidden \(36\) \* element size \(2\) must be a multiple of 16"),
    "dispatch/fp8 hidden*1 % 16": Case("dispatch", lambda c: c.dispatch(x=_fp8(_x_with_hidden(c, 40))),
                                       "ValueError", r"^x: hidden \(40\) \* element size \(1\) must be a multiple"),
    "dispatch/fp8 data bf16": Case("dispatch", lambda c: c.dispatch(x=(c.x, _fp8(c.x)[1])), "TypeError",
                                   r"^x\[0\] must have dtype torch\.float8_e4m3fn"),
    "dispatch/fp8 scales float64": Case("dispatch", lambda c: c.dispatch(
        x=(_fp8(c.x)[0], _fp8(c.x)[1].double())), "TypeError", r"^x\[1\] must have dtype torch\.float32"),
    "dispatch/fp8 scales rows": Case("dispatch", lambda c: c.dispatch(x=(_fp8(c.x)[0], _fp8(c.x)[1][:-1])),
                                     "ValueError", r"^x\[1\] \(scales\) must have \d+ rows"),
    "dispatch/fp8 scales 1-D": Case("dispatch", lambda c: c.dispatch(x=(_fp8(c.x)[0], _fp8(c.x)[1].flatten())),
                                    "ValueError", r"^x\[1\] must be 2-D"),
    "dispatch/fp8 scales no columns": Case("dispatch", lambda c: c.dispatch(x=(_fp8(c.x)[0], _fp8(c.x)[1][:, :0])),
                                           "ValueError", r"^x\[1\] \(scales\) must have at least one column"),
    "dispatch/fp8 scales strided": Case("dispatch", lambda c: c.dispatch(
        x=(_fp8(_x_with_hidden(c, 256))[0], torch.ones((c.x.shape[0], 4))[:, ::2])), "ValueError",
        r"^x\[1\] \(scales\) must be row- or column-major"),
    # ---- dispatch: routing arguments
    "dispatch/topk_idx=E": Case("dispatch", lambda c: c.dispatch(topk_idx=torch.full_like(c.topk_idx, c.num_experts)),
                                "ValueError", r"^topk_idx values must lie in \[-1, \d+\)"),
    "dispatch/topk_idx=-2": Case("dispatch", lambda c: c.dispatch(topk_idx=torch.full_like(c.topk_idx, -2)),
                                 "ValueError", r"^topk_idx values must lie in \[-1, \d+\)"),
    "dispatch/topk_idx int32": Case("dispatch", lambda c: c.dispatch(topk_idx=c.topk_idx.int()), "TypeError",
                                    r"^topk_idx must have dtype torch\.int64"),
    "dispatch/topk_idx rows": Case("dispatch", lambda c: c.dispatch(topk_idx=c.topk_idx[:-1],
                                                                    topk_weights=c.topk_weights[:-1]),
                                   "ValueError", r"^topk_idx must have \d+ rows \(one per token of x\)"),
    "dispatch/topk_idx non-contiguous": Case("dispatch", lambda c: c.dispatch(topk_idx=_noncontig(c.topk_idx)),
                                             "ValueError", r"^topk_idx must be contiguous"),
    "dispatch/topk_idx meta device": Case("dispatch", lambda c: c.dispatch(topk_idx=c.topk_idx.to("meta")),
                                          "ValueError", r"^topk_idx must be on cpu"),
    "dispatch/topk_weights float64": Case("dispatch", lambda c: c.dispatch(topk_weights=c.topk_weights.double()),
                                          "TypeError", r"^topk_weights must have dtype torch\.float32"),
    "dispatch/topk_weights K+1": Case("dispatch", lambda c: c.dispatch(
        topk_weights=torch.zeros((c.x.shape[0], TOPK + 1))), "ValueError",
        r"^topk_weights must have shape \[\d+, 3\]"),
    "dispatch/topk_weights rows": Case("dispatch", lambda c: c.dispatch(topk_weights=c.topk_weights[:-1]),
                                       "ValueError", r"^topk_weights must have shape \[\d+, 3\]"),
    "dispatch/topk_weights non-contiguous": Case("dispatch", lambda c: c.dispatch(
        topk_weights=_noncontig(c.topk_weights)), "ValueError", r"^topk_weights must be contiguous"),
    "dispatch/topk_weights without topk_idx": Case("dispatch", lambda c: c.dispatch(topk_idx=None), "ValueError",
                                                   r"^topk_weights given without topk_idx"),
    "dispatch/is_token_in_rank rows": Case("dispatch", lambda c: c.dispatch(
        is_token_in_rank=torch.cat([c.in_rank, c.in_rank[:1]])), "ValueError",
        r"^is_token_in_rank must have shape \[\d+, \d+\]"),
    "dispatch/is_token_in_rank cols": Case("dispatch", lambda c: c.dispatch(
        is_token_in_rank=torch.cat([c.in_rank, c.in_rank[:, :1]], 1)), "ValueError",
        r"^is_token_in_rank must have shape \[\d+, \d+\]"),
    "dispatch/is_token_in_rank int32": Case("dispatch", lambda c: c.dispatch(is_token_in_rank=c.in_rank.int()),
                                            "TypeError", r"^is_token_in_rank must have dtype torch\.bool"),
    "dispatch/is_token_in_rank missing": Case("dispatch", lambda c: c.dispatch(is_token_in_rank=None),
                                              "ValueError", r"^is_token_in_rank is required"),
    "dispatch/num_tokens_per_rank int64": Case("dispatch", lambda c: c.dispatch(
        num_tokens_per_rank=c.per_rank.long()), "TypeError", r"^num_tokens_per_rank must have dtype torch\.int32"),
    "dispatch/num_tokens_per_rank R+1": Case("dispatch", lambda c: c.dispatch(
        num_tokens_per_rank=torch.cat([c.per_rank, c.per_rank[:1]])), "ValueError",
        r"^num_tokens_per_rank must have shape \[\d+\]"),
    "dispatch/num_tokens_per_rank != is_token_in_rank": Case("dispatch", lambda c: c.dispatch(
        num_tokens_per_rank=c.per_rank + 1), "ValueError", r"^num_tokens_per_rank does not match is_token_in_rank"),
    "dispatch/num_tokens_per_rank missing": Case("dispatch", lambda c: c.dispatch(num_tokens_per_rank=None),
                                                 "ValueError", r"^num_tokens_per_rank is required"),
    "dispatch/num_tokens_per_expert not multiple of R": Case("dispatch", lambda c: c.dispatch(
        num_tokens_per_expert=c.per_expert[:-1]), "ValueError",
        r"^num_tokens_per_expert has \d+ entries; expected a positive multiple of the group size"),
    "dispatch/num_tokens_per_expert int64": Case("dispatch", lambda c: c.dispatch(
        num_tokens_per_expert=c.per_expert.long()), "TypeError",
        r"^num_tokens_per_expert must have dtype torch\.int32"),
    "dispatch/num_tokens_per_expert missing": Case("dispatch", lambda c: c.dispatch(num_tokens_per_expert=None),
                                                   "ValueError", r"^num_tokens_per_expert is required"),
    "dispatch/num_tokens_per_rdma_rank shape": Case("dispatch", lambda c: c.dispatch(
        num_tokens_per_rdma_rank=torch.zeros(5, dtype=torch.int32)), "ValueError",
        r"^num_tokens_per_rdma_rank must have shape \[1\]"),
    "dispatch/expert_alignment=0": Case("dispatch", lambda c: c.dispatch(expert_alignment=0), "ValueError",
                                        r"^expert_alignment must be >= 1"),
    "dispatch/expert_alignment float": Case("dispatch", lambda c: c.dispatch(expert_alignment=2.0), "TypeError",
                                            r"^expert_alignment must be an int"),
    "dispatch/num_worst_tokens=-1": Case("dispatch", lambda c: c.dispatch(num_worst_tokens=-1), "ValueError",
                                         r"^num_worst_tokens must be >= 0"),
    "dispatch/config type": Case("dispatch", lambda c: c.dispatch(config={"num_sms": 20}), "TypeError",
                                 r"^config must be an epcomm\.Config"),
    "dispatch/num_nvl_bytes below hint": Case("dispatch", lambda c: c.dispatch(config=Config(20, 6, 4096, 6, 256)),
                                              "ValueError",
                                              r"^num_nvl_bytes=\d+ is too small .*get_nvl_buffer_size_hint"),
    "dispatch/previous_event type": Case("dispatch", lambda c: c.dispatch(previous_event="event"), "TypeError",
                                         r"^previous_event must be an EventOverlap", announced=False),
    "dispatch/allocate_on_comm_stream alone": Case("dispatch", lambda c: c.dispatch(allocate_on_comm_stream=True),
                                                   "ValueError", r"^allocate_on_comm_stream=True requires",
                                                   announced=False),
    # ---- cached dispatch
    "cached/with topk_idx": Case("cached", lambda c: c.buf.dispatch(c.x, handle=c.handle, topk_idx=c.topk_idx),
                                 "ValueError", r"^topk_idx must be None for a cached dispatch"),
    "cached/with topk_weights": Case("cached", lambda c: c.buf.dispatch(
        c.x, handle=c.handle, topk_weights=c.topk_weights), "ValueError",
        r"^topk_weights must be None for a cached dispatch"),
    "cached/with layout": Case("cached", lambda c: c.buf.dispatch(
        c.x, handle=c.handle, num_tokens_per_rank=c.per_rank, is_token_in_rank=c.in_rank), "ValueError",
        r"^num_tokens_per_rank must be None for a cached dispatch"),
    "cached/with num_tokens_per_expert": Case("cached", lambda c: c.buf.dispatch(
        c.x, handle=c.handle, num_tokens_per_expert=c.per_expert), "ValueError",
        r"^num_tokens_per_expert must be None for a cached dispatch"),
    "cached/handle of a Buffer of another kind": Case("cached", lambda c: c.buf.dispatch(c.x, handle=c.other_handle),
                                            "ValueError", r"^handle was created by another Buffer"),
    "cached/handle tuple": Case("cached", lambda c: c.buf.dispatch(c.x, handle=(c.per_rank, c.in_rank)),
                                "TypeError", r"^handle must be the DispatchHandle returned by this Buffer, got tuple"),
    "cached/low-latency handle": Case("cached", lambda c: c.buf.dispatch(c.x, handle=_fake_ll_handle(c.buf)),
                                      "TypeError", r"^handle must be the DispatchHandle .*got LowLatencyHandle"),
    "cached/x rows": Case("cached", lambda c: c.buf.dispatch(c.x[:-1], handle=c.handle), "ValueError",
                          r"^x has \d+ tokens but the handle was made for \d+"),
    "cached/x float16": Case("cached", lambda c: c.buf.dispatch(c.x.half(), handle=c.handle), "TypeError",
                             r"^x must have dtype torch\.bfloat16"),
    # ---- combine
    "combine/x float32": Case("combine", lambda c: c.combine(x=c.recv_x.float()), "TypeError",
                              r"^x must have dtype torch\.bfloat16"),
    "combine/x rows": Case("combine", lambda c: c.combine(x=torch.zeros((c.rows + 1, HIDDEN), dtype=torch.bfloat16)),
                           "ValueError", r"^x must have \d+ rows \(the rows dispatch returned\)"),
    "combine/x 1-D": Case("combine", lambda c: c.combine(x=c.recv_x.flatten()), "ValueError", r"^x must be 2-D"),
    "combine/x non-contiguous": Case("combine", lambda c: c.combine(x=_noncontig(c.recv_x)), "ValueError",
                                     r"^x must be contiguous"),
    "combine/x meta device": Case("combine", lambda c: c.combine(x=c.recv_x.to("meta")), "ValueError",
                                  r"^x must be on cpu"),
    "combine/hidden*2 % 16": Case("combine", lambda c: c.combine(x=torch.zeros((c.rows, 36), dtype=torch.bfloat16)),
                                  "ValueError", r"^x: hidden \(36\) \* 2 bytes must be a multiple of 16"),
    "combine/topk_weights float64": Case("combine", lambda c: c.combine(topk_weights=c.recv_w.double()),
                                         "TypeError", r"^topk_weights must have dtype torch\.float32"),
    "combine/topk_weights rows": Case("combine", lambda c: c.combine(topk_weights=torch.zeros((c.rows + 1, TOPK))),
                                      "ValueError", r"^topk_weights must have \d+ rows"),
    "combine/topk_weights 1-D": Case("combine", lambda c: c.combine(topk_weights=c.recv_w.flatten()),
                                     "ValueError", r"^topk_weights must be 2-D"),
    "combine/topk_weights non-contiguous": Case("combine", lambda c: c.combine(topk_weights=_noncontig(c.recv_w)),
                                                "ValueError", r"^topk_weights must be contiguous"),
    "combine/bias rows": Case("combine", lambda c: c.combine(
        bias=torch.zeros((c.x.shape[0] + 1, HIDDEN), dtype=torch.bfloat16)), "ValueError",
        r"^bias\[0\] must have shape \[\d+, 128\]"),
    "combine/bias float32": Case("combine", lambda c: c.combine(bias=torch.zeros((c.x.shape[0], HIDDEN))),
                                 "TypeError", r"^bias\[0\] must have dtype torch\.bfloat16"),
    "combine/second bias hidden": Case("combine", lambda c: c.combine(
        bias=(torch.zeros((c.x.shape[0], HIDDEN), dtype=torch.bfloat16),
              torch.zeros((c.x.shape[0], HIDDEN // 2), dtype=torch.bfloat16))), "ValueError",
        r"^bias\[1\] must have shape"),
    "combine/three biases": Case("combine", lambda c: c.combine(
        bias=(torch.zeros((c.x.shape[0], HIDDEN), dtype=torch.bfloat16),) * 3), "ValueError",
        r"^bias must be a tensor or a tuple of at most two"),
    "combine/handle None": Case("combine", lambda c: c.combine(handle=None), "TypeError",
                                r"^handle must be the DispatchHandle returned by this Buffer, got NoneType"),
    "combine/handle tuple": Case("combine", lambda c: c.combine(handle=(c.per_rank,)), "TypeError",
                                 r"^handle must be the DispatchHandle"),
    "combine/low-latency handle": Case("combine", lambda c: c.combine(handle=_fake_ll_handle(c.buf)),
                                       "TypeError", r"^handle must be the DispatchHandle .*got LowLatencyHandle"),
    "combine/handle of a Buffer of another kind": Case("combine", lambda c: c.combine(handle=c.other_handle),
                                                       "ValueError", r"^handle was created by another Buffer"),
    "combine/config type": Case("combine", lambda c: c.combine(config="config"), "TypeError",
                                r"^config must be an epcomm\.Config"),
    "combine/num_nvl_bytes below hint": Case("combine", lambda c: c.combine(config=Config(20, 6, 4096, 6, 256)),
                                             "ValueError", r"^num_nvl_bytes=\d+ is too small .*get_nvl_buffer_size"),
    "combine/previous_event type": Case("combine", lambda c: c.combine(previous_event=object()), "TypeError",
                                        r"^previous_event must be an EventOverlap", announced=False),
    "combine/allocate_on_comm_stream alone": Case("combine", lambda c: c.combine(allocate_on_comm_stream=True),
                                                  "ValueError", r"^allocate_on_comm_stream=True requires",
                                                  announced=False),
    # ---- Buffer constructor (collective: only tried with every rank passing the bad value)
    "ctor/num_nvl_bytes=-1": Case("local", lambda c: Buffer(dist.group.WORLD, -1, backend="reference"),
                                  "ValueError", r"^num_nvl_bytes must be >= 0", announced=False),
    "ctor/num_rdma_bytes float": Case("local", lambda c: Buffer(dist.group.WORLD, 0, 1.5, backend="reference"),
                                      "TypeError", r"^num_rdma_bytes must be an int", announced=False),
    "ctor/num_qps_per_rank=0": Case("local", lambda c: Buffer(dist.group.WORLD, num_qps_per_rank=0,
                                                              backend="reference"),
                                    "ValueError", r"^num_qps_per_rank must be >= 1", announced=False),
    "ctor/backend unknown": Case("local", lambda c: Buffer(dist.group.WORLD, backend="nvshmem"), "ValueError",
                                 r"^backend must be one of", announced=False),
    "ctor/backend cuda on gloo": Case("local", lambda c: Buffer(dist.group.WORLD, backend="cuda"), "ValueError",
                                      r"^backend='cuda' needs the Buffer on a GPU", announced=False),
}

GOOD_CALLS: dict[str, Callable[[Any], Any]] = {
    "local": lambda c: None,
    "dispatch": lambda c: c.dispatch(),
    "cached": lambda c: c.buf.dispatch(c.x, handle=c.handle),
    "combine": lambda c: c.combine(),
    "ll_dispatch": lambda c: c.ll_dispatch(),
    "ll_combine": lambda c: c.ll_combine(),
}


def _run_cases(ctx: Any, table: dict[str, Case], names: list[str], bad_ranks: list[int]) -> dict[str, tuple]:
    bad = ctx.rank in bad_ranks
    report = {}
    for name in names:
        case = table[name]
        outcome = _outcome(partial(case.call if bad else GOOD_CALLS[case.op], ctx))
        report[name] = (*outcome, ctx.verify())
    return report


def rank_normal_cases(names: list[str], bad_ranks: list[int]) -> dict[str, tuple]:
    return _run_cases(_NormalCtx(), NORMAL_CASES, names, bad_ranks)


def _problems(reports: list[dict[str, tuple]], table: dict[str, Case], bad_ranks: list[int]) -> list[str]:
    """Every deviation from: bad ranks raise their own error, the others ValueError naming them, all fast."""
    problems = []
    for rank, report in enumerate(reports):
        for name, (exc, msg, secs, verify) in report.items():
            case = table[name]
            where = f"[{name}] rank {rank} (bad ranks {bad_ranks})"
            if secs > FAST_S:
                problems.append(f"{where}: took {secs:.1f} s (a refusal must not wait for the peer timeout)")
            if verify:
                problems.append(f"{where}: the Buffer no longer works after the refused call: {verify}")
            if rank in bad_ranks:
                if exc != case.exc or not re.search(case.match, msg):
                    problems.append(f"{where}: expected {case.exc} matching {case.match!r}, got {exc}: {msg}")
            elif case.op == "local":
                if exc is not None:
                    problems.append(f"{where}: a rank with good arguments raised {exc}: {msg}")
            else:
                op = {"cached": "dispatch", "ll_dispatch": "low_latency_dispatch",
                      "ll_combine": "low_latency_combine"}.get(case.op, case.op)
                want = REFUSED.format(op=op, ranks=re.escape(str(sorted(bad_ranks))))
                if exc != "ValueError" or not re.search(want, msg):
                    problems.append(f"{where}: expected ValueError matching {want!r} (the peer refused), "
                                    f"got {exc}: {msg}")
    return problems


# (ranks, bad ranks): every rank bad; one rank bad (the first, the last); two bad ranks out of three.
BAD_RANK_MODES = [(2, [0, 1]), (2, [0]), (2, [1]), (3, [1]), (3, [0, 2])]


def _mode_id(mode: tuple[int, list[int]]) -> str:
    ranks, bad = mode
    return f"R{ranks}-all-bad" if len(bad) == ranks else f"R{ranks}-bad{''.join(map(str, bad))}"


@pytest.mark.parametrize("mode", BAD_RANK_MODES, ids=_mode_id)
def test_normal_mode_refusals(mode):
    ranks, bad_ranks = mode
    every_rank = len(bad_ranks) == ranks
    names = [n for n, case in NORMAL_CASES.items() if every_rank or case.announced]
    reports = cluster(ranks).run(rank_normal_cases, names, bad_ranks, timeout_s=RUN_TIMEOUT_S)
    problems = _problems(reports, NORMAL_CASES, bad_ranks)
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


# ====================================================================================== low-latency mode
class _LowLatencyCtx:
    """One rank's low-latency Buffers, inputs and reference outputs."""

    def __init__(self) -> None:
        self.rank, self.num_ranks = dist.get_rank(), dist.get_world_size()
        r = self.num_ranks
        self.num_experts = e = _num_experts(r)
        self.e_local = e // r
        rdma = Buffer.get_low_latency_rdma_size_hint(N_MAX, HIDDEN, r, e)
        self.buf = Buffer(dist.group.WORLD, 0, rdma, low_latency_mode=True, backend="reference")
        self.other = Buffer(dist.group.WORLD, 0, rdma, low_latency_mode=True, backend="reference")
        self.normal = Buffer(dist.group.WORLD, Config().get_nvl_buffer_size_hint(HIDDEN * 2, r), backend="reference")
        self.shrink = Buffer(dist.group.WORLD, 0, rdma, low_latency_mode=True, enable_shrink=True,
                             backend="reference")
        self.x, self.topk_idx, self.topk_weights = make_inputs(SEED, self.rank, _num_tokens(self.rank), HIDDEN, e,
                                                               TOPK, r, "random")
        self.recv_x, self.recv_count, self.handle, _, _ = self.ll_dispatch()
        self.other_handle = self.other.low_latency_dispatch(self.x, self.topk_idx, N_MAX, e, use_fp8=False)[2]
        self.combined = self.ll_combine()[0]
        # Oracle: identity experts, so the combine is sum_k w_k * x over the non-negative slots.
        ref = (self.topk_weights * (self.topk_idx >= 0)).sum(1, keepdim=True).double() * self.x.double()
        assert torch.allclose(self.combined.double(), ref, rtol=2 ** -7, atol=1e-5)

    def ll_dispatch(self, x=None, topk_idx=None, n=N_MAX, num_experts=None, **kwargs: Any):
        kwargs.setdefault("use_fp8", False)
        return self.buf.low_latency_dispatch(self.x if x is None else x, self.topk_idx if topk_idx is None
                                             else topk_idx, n, num_experts or self.num_experts, **kwargs)

    def ll_combine(self, **overrides: Any):
        kw: dict[str, Any] = dict(x=self.recv_x, topk_idx=self.topk_idx, topk_weights=self.topk_weights,
                                  handle=self.handle)
        kw.update(overrides)
        return self.buf.low_latency_combine(**kw)

    def verify(self) -> str:
        try:
            recv_x, recv_count, handle, _, hook = self.ll_dispatch()
            assert hook is None
            assert torch.equal(recv_count, self.recv_count), "recv_count differs"
            combined = self.buf.low_latency_combine(recv_x, self.topk_idx, self.topk_weights, handle)[0]
            assert torch.equal(combined.view(torch.int16), self.combined.view(torch.int16)), "combined_x differs"
            status = torch.ones(self.num_ranks, dtype=torch.int32)
            self.shrink.low_latency_query_mask_buffer(status)
            assert status.tolist() == [0] * self.num_ranks, f"mask changed by a refused call: {status.tolist()}"
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return ""


def _changed_topk_idx(c: _LowLatencyCtx) -> torch.Tensor:
    idx = c.topk_idx.clone()
    idx[0, 0] = (int(idx[0, 0]) + 1) % c.num_experts
    return idx


LL_CASES: dict[str, Case] = {
    # ---- low_latency_dispatch
    "ll_dispatch/x float16": Case("ll_dispatch", lambda c: c.ll_dispatch(x=c.x.half()), "TypeError",
                                  r"^x must have dtype torch\.bfloat16"),
    "ll_dispatch/x 3-D": Case("ll_dispatch", lambda c: c.ll_dispatch(x=c.x.unsqueeze(0)), "ValueError",
                              r"^x must be 2-D"),
    "ll_dispatch/x non-contiguous": Case("ll_dispatch", lambda c: c.ll_dispatch(x=_noncontig(c.x)), "ValueError",
                                         r"^x must be contiguous"),
    "ll_dispatch/x meta device": Case("ll_dispatch", lambda c: c.ll_dispatch(x=c.x.to("meta")), "ValueError",
                                      r"^x must be on cpu"),
    "ll_dispatch/T > N": Case("ll_dispatch", lambda c: c.ll_dispatch(
        x=torch.zeros((N_MAX + 1, HIDDEN), dtype=torch.bfloat16), topk_idx=torch.zeros((N_MAX + 1, TOPK),
                                                                                     dtype=torch.int64)),
        "ValueError", r"^x has 9 tokens, more than num_max_dispatch_tokens_per_rank=8"),
    "ll_dispatch/topk_idx=E": Case("ll_dispatch", lambda c: c.ll_dispatch(
        topk_idx=torch.full_like(c.topk_idx, c.num_experts)), "ValueError", r"^topk_idx values must lie in \[-1, "),
    "ll_dispatch/topk_idx=-2": Case("ll_dispatch", lambda c: c.ll_dispatch(topk_idx=torch.full_like(c.topk_idx, -2)),
                                    "ValueError", r"^topk_idx values must lie in \[-1, "),
    "ll_dispatch/topk_idx int32": Case("ll_dispatch", lambda c: c.ll_dispatch(topk_idx=c.topk_idx.int()),
                                       "TypeError", r"^topk_idx must have dtype torch\.int64"),
    "ll_dispatch/topk_idx rows": Case("ll_dispatch", lambda c: c.ll_dispatch(topk_idx=c.topk_idx[:-1]),
                                      "ValueError", r"^topk_idx must have \d+ rows \(one per token of x\)"),
    "ll_dispatch/topk_idx non-contiguous": Case("ll_dispatch", lambda c: c.ll_dispatch(
        topk_idx=_noncontig(c.topk_idx)), "ValueError", r"^topk_idx must be contiguous"),
    "ll_dispatch/num_experts not multiple of R": Case("ll_dispatch", lambda c: c.ll_dispatch(
        num_experts=c.num_experts + 1), "ValueError", r"^num_experts \(\d+\) must be a multiple of the group"),
    "ll_dispatch/num_experts float": Case("ll_dispatch", lambda c: c.ll_dispatch(num_experts=float(c.num_experts)),
                                          "TypeError", r"^num_experts must be an int"),
    "ll_dispatch/N=0": Case("ll_dispatch", lambda c: c.ll_dispatch(n=0), "ValueError",
                            r"^num_max_dispatch_tokens_per_rank must be >= 1"),
    "ll_dispatch/fp8 hidden % 128": Case("ll_dispatch", lambda c: c.ll_dispatch(x=_x_with_hidden(c, 64),
                                                                               use_fp8=True),
                                         "ValueError", r"^x: hidden \(64\) must be a multiple of 128 for FP8"),
    "ll_dispatch/bf16 hidden*2 % 16": Case("ll_dispatch", lambda c: c.ll_dispatch(x=_x_with_hidden(c, 36)),
                                           "ValueError", r"^x: hidden \(36\) \* 2 bytes must be a multiple of 16"),
    "ll_dispatch/use_ue8m0 without round_scale": Case("ll_dispatch", lambda c: c.ll_dispatch(
        use_fp8=True, use_ue8m0=True), "ValueError", r"^use_ue8m0=True requires round_scale=True"),
    "ll_dispatch/use_ue8m0 hidden % 512": Case("ll_dispatch", lambda c: c.ll_dispatch(
        use_fp8=True, round_scale=True, use_ue8m0=True), "ValueError",
        r"^x: hidden \(128\) must be a multiple of 512 with use_ue8m0"),
    "ll_dispatch/async_finish with return_recv_hook": Case("ll_dispatch", lambda c: c.ll_dispatch(
        async_finish=True, return_recv_hook=True), "ValueError",
        r"^async_finish and return_recv_hook are mutually exclusive"),
    "ll_dispatch/recv stats int64": Case("ll_dispatch", lambda c: c.ll_dispatch(
        cumulative_local_expert_recv_stats=torch.zeros(c.e_local, dtype=torch.int64)), "TypeError",
        r"^cumulative_local_expert_recv_stats must have dtype torch\.int32"),
    "ll_dispatch/recv stats shape": Case("ll_dispatch", lambda c: c.ll_dispatch(
        cumulative_local_expert_recv_stats=torch.zeros(c.e_local + 1, dtype=torch.int32)), "ValueError",
        r"^cumulative_local_expert_recv_stats must have shape \[\d+\]"),
    "ll_dispatch/wait stats int32": Case("ll_dispatch", lambda c: c.ll_dispatch(
        dispatch_wait_recv_cost_stats=torch.zeros(c.num_ranks, dtype=torch.int32)), "TypeError",
        r"^dispatch_wait_recv_cost_stats must have dtype torch\.int64"),
    "ll_dispatch/num_rdma_bytes below hint": Case("ll_dispatch", lambda c: c.ll_dispatch(n=64), "ValueError",
                                                  r"^num_rdma_bytes=\d+ is too small: "
                                                  r"Buffer\.get_low_latency_rdma_size_hint\(64, 128, \d, \d+\)"),
    "ll_dispatch/on a normal-mode Buffer": Case("local", lambda c: c.normal.low_latency_dispatch(
        c.x, c.topk_idx, N_MAX, c.num_experts), "RuntimeError", r"^low-latency calls need Buffer\(\.\.\., "
        r"low_latency_mode=True\)", announced=False),
    # ---- low_latency_combine
    "ll_combine/use_logfmt": Case("ll_combine", lambda c: c.ll_combine(use_logfmt=True), "NotImplementedError",
                                  r"^use_logfmt=True .*not implemented"),
    "ll_combine/x shape": Case("ll_combine", lambda c: c.ll_combine(x=c.recv_x[:, :-1].contiguous()), "ValueError",
                               r"^x must have shape \[\d+, \d+, 128\]"),
    "ll_combine/x float32": Case("ll_combine", lambda c: c.ll_combine(x=c.recv_x.float()), "TypeError",
                                 r"^x must have dtype torch\.bfloat16"),
    "ll_combine/x non-contiguous": Case("ll_combine", lambda c: c.ll_combine(
        x=torch.cat([c.recv_x, c.recv_x], 2)[..., :HIDDEN]), "ValueError", r"^x must be contiguous"),
    "ll_combine/topk_idx differs from dispatch": Case("ll_combine", lambda c: c.ll_combine(
        topk_idx=_changed_topk_idx(c)), "ValueError", r"^topk_idx differs from the one passed to the low_latency"),
    "ll_combine/topk_idx int32": Case("ll_combine", lambda c: c.ll_combine(topk_idx=c.topk_idx.int()),
                                      "TypeError", r"^topk_idx must have dtype torch\.int64"),
    "ll_combine/topk_idx rows": Case("ll_combine", lambda c: c.ll_combine(topk_idx=c.topk_idx[:-1]), "ValueError",
                                     r"^topk_idx must have shape \[\d+, 3\]"),
    "ll_combine/topk_weights float64": Case("ll_combine", lambda c: c.ll_combine(
        topk_weights=c.topk_weights.double()), "TypeError", r"^topk_weights must have dtype torch\.float32"),
    "ll_combine/topk_weights vs topk_idx": Case("ll_combine", lambda c: c.ll_combine(
        topk_weights=c.topk_weights[:, :-1]), "ValueError", r"^topk_weights must have shape \[\d+, 3\]"),
    "ll_combine/async_finish with return_recv_hook": Case("ll_combine", lambda c: c.ll_combine(
        async_finish=True, return_recv_hook=True), "ValueError",
        r"^async_finish and return_recv_hook are mutually exclusive"),
    "ll_combine/zero_copy without its buffer": Case("ll_combine", lambda c: c.ll_combine(zero_copy=True), "ValueError",
                                                    r"^zero_copy=True reads get_next_low_latency_combine_buffer"),
    "ll_combine/out shape": Case("ll_combine", lambda c: c.ll_combine(
        out=torch.zeros((c.x.shape[0] + 1, HIDDEN), dtype=torch.bfloat16)), "ValueError",
        r"^out must have shape \[\d+, 128\]"),
    "ll_combine/out float32": Case("ll_combine", lambda c: c.ll_combine(out=torch.zeros(c.x.shape)), "TypeError",
                                   r"^out must have dtype torch\.bfloat16"),
    "ll_combine/wait stats int32": Case("ll_combine", lambda c: c.ll_combine(
        combine_wait_recv_cost_stats=torch.zeros(c.num_ranks, dtype=torch.int32)), "TypeError",
        r"^combine_wait_recv_cost_stats must have dtype torch\.int64"),
    "ll_combine/normal-mode handle": Case("ll_combine", lambda c: c.ll_combine(handle=_fake_dispatch_handle(c.buf)),
                                          "TypeError", r"^handle must be the LowLatencyHandle .*got DispatchHandle"),
    "ll_combine/handle None": Case("ll_combine", lambda c: c.ll_combine(handle=None), "TypeError",
                                   r"^handle must be the LowLatencyHandle"),
    "ll_combine/handle of another Buffer": Case("ll_combine", lambda c: c.ll_combine(handle=c.other_handle),
                                                "ValueError", r"^handle was created by another Buffer"),
    # ---- local helpers
    "next_combine_buffer/normal-mode handle": Case("local", lambda c: c.buf.get_next_low_latency_combine_buffer(
        _fake_dispatch_handle(c.buf)), "TypeError", r"^handle must be the LowLatencyHandle"),
    "next_combine_buffer/handle of another Buffer": Case("local", lambda c: c.buf.get_next_low_latency_combine_buffer(
        c.other_handle), "ValueError", r"^handle was created by another Buffer"),
    "clean/hidden float": Case("local", lambda c: c.buf.clean_low_latency_buffer(N_MAX, float(HIDDEN),
                                                                                 c.num_experts),
                               "TypeError", r"^hidden must be an int"),
    "clean/N=0": Case("local", lambda c: c.buf.clean_low_latency_buffer(0, HIDDEN, c.num_experts), "ValueError",
                      r"^num_max_dispatch_tokens_per_rank must be >= 1"),
    "clean/num_experts=0": Case("local", lambda c: c.buf.clean_low_latency_buffer(N_MAX, HIDDEN, 0), "ValueError",
                                r"^num_experts must be >= 1"),
    "clean/normal-mode Buffer": Case("local", lambda c: c.normal.clean_low_latency_buffer(
        N_MAX, HIDDEN, c.num_experts), "RuntimeError", r"^clean_low_latency_buffer needs Buffer\(\.\.\., "
        r"low_latency_mode=True\)"),
    "mask/update without enable_shrink": Case("local", lambda c: c.buf.low_latency_update_mask_buffer(0, True),
                                              "RuntimeError", r"needs Buffer\(\.\.\., enable_shrink=True\)"),
    "mask/query without enable_shrink": Case("local", lambda c: c.buf.low_latency_query_mask_buffer(
        torch.zeros(c.num_ranks, dtype=torch.int32)), "RuntimeError", r"needs Buffer\(\.\.\., enable_shrink=True\)"),
    "mask/clean without enable_shrink": Case("local", lambda c: c.buf.low_latency_clean_mask_buffer(),
                                             "RuntimeError", r"needs Buffer\(\.\.\., enable_shrink=True\)"),
    "mask/rank_to_mask=R": Case("local", lambda c: c.shrink.low_latency_update_mask_buffer(c.num_ranks, True),
                                "ValueError", r"^rank_to_mask must be <= \d+"),
    "mask/rank_to_mask=-1": Case("local", lambda c: c.shrink.low_latency_update_mask_buffer(-1, True), "ValueError",
                                 r"^rank_to_mask must be >= 0"),
    "mask/rank_to_mask float": Case("local", lambda c: c.shrink.low_latency_update_mask_buffer(0.0, True),
                                    "TypeError", r"^rank_to_mask must be an int"),
    "mask/query int64": Case("local", lambda c: c.shrink.low_latency_query_mask_buffer(
        torch.zeros(c.num_ranks, dtype=torch.int64)), "TypeError", r"^mask_status must have dtype torch\.int32"),
    "mask/query shape": Case("local", lambda c: c.shrink.low_latency_query_mask_buffer(
        torch.zeros(c.num_ranks + 1, dtype=torch.int32)), "ValueError", r"^mask_status must have shape \[\d+\]"),
    "mask/query list": Case("local", lambda c: c.shrink.low_latency_query_mask_buffer([0] * c.num_ranks),
                            "TypeError", r"^mask_status must be a torch\.Tensor"),
}


def rank_low_latency_cases(names: list[str], bad_ranks: list[int]) -> dict[str, tuple]:
    return _run_cases(_LowLatencyCtx(), LL_CASES, names, bad_ranks)


@pytest.mark.parametrize("mode", BAD_RANK_MODES, ids=_mode_id)
def test_low_latency_refusals(mode):
    ranks, bad_ranks = mode
    every_rank = len(bad_ranks) == ranks
    names = [n for n, case in LL_CASES.items() if every_rank or case.announced]
    reports = cluster(ranks).run(rank_low_latency_cases, names, bad_ranks, timeout_s=RUN_TIMEOUT_S)
    problems = _problems(reports, LL_CASES, bad_ranks)
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


# ====================================================================================== mismatched calls
class _MixedCtx(_NormalCtx):
    """A Buffer for both modes: normal dispatch/combine and low-latency calls (cleaned before each)."""

    def __init__(self) -> None:
        num_ranks = dist.get_world_size()
        super().__init__(Buffer.get_low_latency_rdma_size_hint(2 * N_MAX, HIDDEN, num_ranks, _num_experts(num_ranks)),
                         low_latency_mode=True)
        self.clean()
        self.ll_recv_x, _, self.ll_handle, _, _ = self.ll_dispatch()
        self.ll_combined = self.ll_combine()[0]

    def clean(self) -> None:
        self.buf.clean_low_latency_buffer(2 * N_MAX, HIDDEN, self.num_experts)

    def ll_dispatch(self, n: int = N_MAX, use_fp8: bool = False):
        return self.buf.low_latency_dispatch(self.x, self.topk_idx, n, self.num_experts, use_fp8=use_fp8)

    def ll_combine(self):
        return self.buf.low_latency_combine(self.ll_recv_x, self.topk_idx, self.topk_weights, self.ll_handle)

    def verify(self) -> str:
        problem = super().verify()
        if problem:
            return problem
        try:
            self.clean()
            recv_x, _, handle, _, _ = self.ll_dispatch()
            combined = self.buf.low_latency_combine(recv_x, self.topk_idx, self.topk_weights, handle)[0]
            assert torch.equal(combined.view(torch.int16), self.ll_combined.view(torch.int16)), "ll combine differs"
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return ""


def _ll(call: Callable[[_MixedCtx], Any]) -> Callable[[_MixedCtx], Any]:
    def run(c: _MixedCtx) -> Any:
        c.clean()
        return call(c)
    return run


# name -> (what rank 0 calls, what the other ranks call, regex every rank's RuntimeError must match)
MISMATCHES: dict[str, tuple[Callable[[_MixedCtx], Any], Callable[[_MixedCtx], Any], str]] = {
    "combine vs dispatch": (lambda c: c.combine(), lambda c: c.dispatch(),
                            r"^epcomm (dispatch|combine): ranks made mismatched calls on one Buffer \(rank 0: combine "
                            r"\(call #\d+\), rank 1: dispatch"),
    "dispatch hidden 256 vs 128": (lambda c: c.dispatch(x=_x_with_hidden(c, 2 * HIDDEN)), lambda c: c.dispatch(),
                                   r"^epcomm dispatch: ranks disagree on hidden: rank 0=256, rank 1=128"),
    "dispatch fp8 vs bf16": (lambda c: c.dispatch(x=_fp8(c.x)), lambda c: c.dispatch(),
                             r"^epcomm dispatch: ranks disagree on x_kind"),
    "dispatch fp8 scales 2 vs 1 columns": (lambda c: c.dispatch(x=(_fp8(c.x)[0], _fp8(c.x)[1].repeat(1, 2))),
                                           lambda c: c.dispatch(x=_fp8(c.x)),
                                           r"^epcomm dispatch: ranks disagree on scale_cols: rank 0=2, rank 1=1"),
    "dispatch fp8 scales int32 vs fp32": (lambda c: c.dispatch(x=(_fp8(c.x)[0], _fp8(c.x)[1].view(torch.int32))),
                                          lambda c: c.dispatch(x=_fp8(c.x)),
                                          r"^epcomm dispatch: ranks disagree on x_kind: rank 0=2, rank 1=1"),
    "dispatch without topk": (lambda c: c.dispatch(topk_idx=None, topk_weights=None), lambda c: c.dispatch(),
                              r"^epcomm dispatch: ranks disagree on num_topk"),
    "dispatch without weights": (lambda c: c.dispatch(topk_weights=None), lambda c: c.dispatch(),
                                 r"^epcomm dispatch: ranks disagree on has_weights"),
    "dispatch num_experts": (lambda c: c.dispatch(num_tokens_per_expert=torch.cat([c.per_expert, c.per_expert * 0])),
                             lambda c: c.dispatch(), r"^epcomm dispatch: ranks disagree on num_experts"),
    "cached vs fresh dispatch": (lambda c: c.buf.dispatch(c.x, handle=c.handle), lambda c: c.dispatch(),
                                 r"^epcomm dispatch: ranks disagree on (num_experts|num_topk|has_weights|cached)"),
    "combine hidden 256 vs 128": (lambda c: c.combine(x=c.recv_x.repeat(1, 2)),
                                  lambda c: c.combine(), r"^epcomm combine: ranks disagree on hidden"),
    "combine weights vs none": (lambda c: c.combine(), lambda c: c.combine(topk_weights=None),
                                r"^epcomm combine: ranks disagree on has_weights"),
    "ll_dispatch vs dispatch": (_ll(lambda c: c.ll_dispatch()), lambda c: c.dispatch(),
                                r"ranks made mismatched calls on one Buffer \(rank 0: low_latency_dispatch "
                                r"\(call #\d+\), rank 1: dispatch"),
    "ll_combine vs ll_dispatch": (_ll(lambda c: c.ll_combine()), _ll(lambda c: c.ll_dispatch()),
                                  r"ranks made mismatched calls on one Buffer \(rank 0: low_latency_combine"),
    "ll_dispatch N 16 vs 8": (_ll(lambda c: c.ll_dispatch(n=2 * N_MAX)), _ll(lambda c: c.ll_dispatch()),
                              r"^epcomm low_latency_dispatch: ranks disagree on max_tokens: rank 0=16, rank 1=8"),
    "ll_dispatch fp8 vs bf16": (_ll(lambda c: c.ll_dispatch(use_fp8=True)), _ll(lambda c: c.ll_dispatch()),
                                r"^epcomm low_latency_dispatch: ranks disagree on flags"),
}


def rank_mismatched_calls(names: list[str]) -> dict[str, tuple]:
    c = _MixedCtx()
    report = {}
    for name in names:
        first, rest, _ = MISMATCHES[name]
        outcome = _outcome(partial(first if c.rank == 0 else rest, c))
        report[name] = (*outcome, c.verify())
    return report


@pytest.mark.parametrize("ranks", [2, 3])
def test_mismatched_calls(ranks):
    """Rank 0 calls another operation (or other shapes) than its peers: every rank raises RuntimeError."""
    reports = cluster(ranks).run(rank_mismatched_calls, list(MISMATCHES), timeout_s=RUN_TIMEOUT_S)
    problems = []
    for rank, report in enumerate(reports):
        for name, (exc, msg, secs, verify) in report.items():
            where = f"[{name}] rank {rank}"
            if exc != "RuntimeError" or not re.search(MISMATCHES[name][2], msg):
                problems.append(f"{where}: expected RuntimeError matching {MISMATCHES[name][2]!r}, got {exc}: {msg}")
            if secs > FAST_S:
                problems.append(f"{where}: took {secs:.1f} s")
            if verify:
                problems.append(f"{where}: the Buffer no longer works afterwards: {verify}")
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


# ====================================================================================== hooks and slots
def rank_hooks_and_slots() -> dict[str, tuple]:
    """Two pending hooks fill both low-latency slots; a third call, clean and destroy are refused until a hook runs."""
    c = _LowLatencyCtx()
    report: dict[str, tuple] = {}
    first = c.ll_dispatch(return_recv_hook=True)
    second = c.ll_dispatch(return_recv_hook=True)
    report["third ll_dispatch"] = _outcome(lambda: c.ll_dispatch())
    report["third ll_combine"] = _outcome(lambda: c.ll_combine())
    report["clean while pending"] = _outcome(lambda: c.buf.clean_low_latency_buffer(N_MAX, HIDDEN, c.num_experts))
    report["destroy while pending"] = _outcome(lambda: c.buf.destroy())
    hook1, hook2 = first[4], second[4]
    report["first hook"] = _outcome(hook1)
    report["first hook again"] = _outcome(hook1)
    # One slot is free again: a combine with a hook takes it, and the next call is refused again.
    pending = c.ll_combine(return_recv_hook=True)
    report["third call after one hook"] = _outcome(lambda: c.ll_dispatch())
    report["second hook"] = _outcome(hook2)
    report["combine hook"] = _outcome(pending[2])
    report["combine hook again"] = _outcome(pending[2])
    # Every result is intact: both hooked dispatches combine to the reference.
    for i, (recv_x, recv_count, handle, _, _) in enumerate((first, second)):
        combined = c.buf.low_latency_combine(recv_x, c.topk_idx, c.topk_weights, handle)[0]
        assert torch.equal(recv_count, c.recv_count), f"hooked dispatch {i}: recv_count"
        assert torch.equal(combined.view(torch.int16), c.combined.view(torch.int16)), f"hooked dispatch {i}"
    assert torch.equal(pending[0].view(torch.int16), c.combined.view(torch.int16)), "hooked combine"
    report["verify"] = (None, c.verify(), 0.0)
    report["destroy"] = _outcome(lambda: c.buf.destroy())
    report["dispatch after destroy"] = _outcome(lambda: c.ll_dispatch())
    return report


HOOK_EXPECTED = {
    "third ll_dispatch": ("RuntimeError", r"^epcomm low_latency_dispatch: low-latency slot \d still holds the receive "
                          r"of low_latency_dispatch whose hook\(\) was not called; at most two"),
    "third ll_combine": ("RuntimeError", r"^epcomm low_latency_combine: low-latency slot \d still holds"),
    "clean while pending": ("RuntimeError", r"^clean_low_latency_buffer: a low-latency receive is pending"),
    "destroy while pending": ("RuntimeError", r"^epcomm destroy: low-latency receive\(s\) .* still pending"),
    "first hook": (None, "^$"),
    "first hook again": ("RuntimeError", r"^the receive hook of low_latency_dispatch was already called"),
    "third call after one hook": ("RuntimeError", r"at most two low-latency results may be pending"),
    "second hook": (None, "^$"),
    "combine hook": (None, "^$"),
    "combine hook again": ("RuntimeError", r"^the receive hook of low_latency_combine was already called"),
    "verify": (None, "^$"),
    "destroy": (None, "^$"),
    "dispatch after destroy": ("RuntimeError", r"^this epcomm Buffer was destroyed"),
}


def test_hooks_and_slots():
    reports = cluster(2).run(rank_hooks_and_slots, timeout_s=RUN_TIMEOUT_S)
    for rank, report in enumerate(reports):
        assert set(report) == set(HOOK_EXPECTED)
        for name, (exc, msg, secs) in report.items():
            want_exc, want = HOOK_EXPECTED[name]
            assert exc == want_exc and re.search(want, msg), f"[{name}] rank {rank}: got {exc}: {msg}"
            assert secs < FAST_S, f"[{name}] rank {rank}: took {secs:.1f} s"


# ====================================================================================== num_worst_tokens
def rank_worst_tokens_too_small() -> dict[str, tuple]:
    """Every token goes to rank 0's experts, so only rank 0 receives more rows than num_worst_tokens."""
    c = _NormalCtx()
    topk_idx = torch.tensor([[0, 1]] * c.x.shape[0], dtype=torch.int64)
    weights = torch.ones(topk_idx.shape)
    per_rank, _, per_expert, in_rank, _ = c.buf.get_dispatch_layout(topk_idx, c.num_experts)
    total = sum(_num_tokens(r) for r in range(c.num_ranks))
    kw = dict(x=c.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
              topk_idx=topk_idx, topk_weights=weights)
    report = {"too small": (*_outcome(lambda: c.buf.dispatch(**kw, num_worst_tokens=total - 1)), c.verify())}
    exact = []
    report["exact"] = (*_outcome(lambda: exact.append(c.buf.dispatch(**kw, num_worst_tokens=total))), c.verify())
    if exact:
        recv_x, recv_idx, _, expert_list, _, _ = exact[0]
        assert recv_x.shape[0] == total and expert_list == []
        assert int((recv_idx >= 0).any(1).sum()) == (total if c.rank == 0 else 0)
    return report


def test_num_worst_tokens_too_small():
    """The rank that would receive more than num_worst_tokens rows raises RuntimeError naming it; nobody waits.

    Only that rank raises (its peers' receive counts fit), and only after the exchange: the library
    documents this RuntimeError rather than a ValueError before communication.
    """
    reports = cluster(2).run(rank_worst_tokens_too_small, timeout_s=RUN_TIMEOUT_S)
    total = sum(_num_tokens(r) for r in range(2))
    for rank, report in enumerate(reports):
        for name, (_, _, secs, verify) in report.items():
            assert secs < FAST_S, f"[{name}] rank {rank}: took {secs:.1f} s"
            assert verify == "", f"[{name}] rank {rank}: the Buffer no longer works afterwards: {verify}"
        assert report["exact"][0] is None, f"rank {rank}: num_worst_tokens == received rows must work"
    exc, msg, _, _ = reports[0]["too small"]
    assert exc == "RuntimeError" and re.search(
        rf"^epcomm dispatch: rank 0 received {total} tokens but num_worst_tokens={total - 1}", msg), f"{exc}: {msg}"


# ====================================================================================== refusals by one rank alone
# Checks that once raised without the refusal handshake (async arguments, a busy low-latency slot, the
# constructor): a rank raising alone must still release its peers at once. Should that regress, the
# Buffers here have a 2 s timeout and the refusing rank joins the peers' abandoned handshake, so the
# shared cluster stays in step and the assertion (not a hang) reports it.
def _join_abandoned_handshake(buf: Buffer, op: Op, seq_before: int, tag: str) -> None:
    if buf.agreement.seq != seq_before:
        return  # the refusal was announced: nobody waits
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    if not _wait_keys([f"{tag}/done/{r}" for r in range(num_ranks) if r != rank], 30):
        raise RuntimeError("the peers never finished their call")
    buf.agreement.handshake(op, {}, refused=True)


def rank_refusal_alone(kind: str, bad_rank: int, tag: str) -> tuple:
    rank = dist.get_rank()
    bad = rank == bad_rank
    store = dist.distributed_c10d._get_default_store()
    if kind == "dispatch previous_event":
        c: Any = _with_timeout(SHORT_TIMEOUT_S, _NormalCtx)
        op, seq = Op.DISPATCH, c.buf.agreement.seq
        outcome = _outcome(lambda: c.dispatch(previous_event="event") if bad else c.dispatch())
        store.set(f"{tag}/done/{rank}", "1")
    elif kind == "combine allocate_on_comm_stream":
        c = _with_timeout(SHORT_TIMEOUT_S, _NormalCtx)
        op, seq = Op.COMBINE, c.buf.agreement.seq
        outcome = _outcome(lambda: c.combine(allocate_on_comm_stream=True) if bad else c.combine())
        store.set(f"{tag}/done/{rank}", "1")
    elif kind == "third low-latency call":
        # The peers ran their hooks; the bad rank still holds two pending receives.
        c = _with_timeout(SHORT_TIMEOUT_S, _LowLatencyCtx)
        hooks = [c.ll_dispatch(return_recv_hook=True)[4] for _ in range(2)]
        if not bad:
            for hook in hooks:
                hook()
        op, seq = Op.LL_DISPATCH, c.buf.agreement.seq
        outcome = _outcome(lambda: c.ll_dispatch())
        store.set(f"{tag}/done/{rank}", "1")
        if bad:
            for hook in hooks:
                hook()
    else:
        raise ValueError(kind)
    if bad:
        _join_abandoned_handshake(c.buf, op, seq, tag)
    verify = c.verify()
    if verify:
        raise RuntimeError(f"rank {rank}: the cluster is out of step after the test: {verify}")
    return outcome


ALONE_CASES = {
    # kind: (error of the refusing rank, regex)
    "dispatch previous_event": ("TypeError", r"^previous_event must be an EventOverlap"),
    "combine allocate_on_comm_stream": ("ValueError", r"^allocate_on_comm_stream=True requires previous_event"),
    "third low-latency call": ("RuntimeError", r"at most two low-latency results may be pending"),
}


@pytest.mark.parametrize("kind", list(ALONE_CASES))
def test_refusal_alone_is_announced(kind):
    bad_rank = 1
    outcomes = cluster(2).run(rank_refusal_alone, kind, bad_rank, uuid.uuid4().hex, timeout_s=RUN_TIMEOUT_S)
    exc, msg, _ = outcomes[bad_rank]
    want_exc, want = ALONE_CASES[kind]
    if exc != want_exc or not re.search(want, msg):
        raise RuntimeError(f"the refusing rank raised {exc}: {msg}")  # not the bug this test is about
    exc, msg, secs = outcomes[0]
    assert exc == "ValueError" and re.search(r"rank\(s\) \[1\] refused", msg) and secs < 1.0, \
        f"rank 0 got {exc} after {secs:.1f} s: {msg}"


def rank_constructor_refusal_alone(bad_rank: int, tag: str) -> tuple:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    bad = rank == bad_rank
    outcome = _outcome(lambda: Buffer(dist.group.WORLD, -1 if bad else 0, backend="reference"))
    dist.distributed_c10d._get_default_store().set(f"{tag}/done/{rank}", "1")
    if bad and not _wait_keys([f"{tag}/done/{r}" for r in range(num_ranks) if r != rank],
                              float(SHORT_TIMEOUT_S)):
        # The peers wait in the constructor's all_gather_object, bounded only by the process group's
        # own timeout (30 min on gloo): join it, and take a Buffer id as their Buffer did.
        dist.all_gather_object([None] * num_ranks, socket.gethostname())
        lifecycle.next_uid(dist.group.WORLD)
    ranks: list[Any] = [None] * num_ranks
    dist.all_gather_object(ranks, rank)
    if ranks != list(range(num_ranks)):
        raise RuntimeError(f"rank {rank}: the cluster is out of step after the test: {ranks}")
    return outcome


def test_constructor_refusal_alone_is_announced():
    outcomes = cluster(2).run(rank_constructor_refusal_alone, 1, uuid.uuid4().hex, timeout_s=RUN_TIMEOUT_S)
    exc, msg, _ = outcomes[1]
    if exc != "ValueError" or not msg.startswith("num_nvl_bytes must be >= 0"):
        raise RuntimeError(f"the refusing rank raised {exc}: {msg}")
    exc, msg, secs = outcomes[0]
    assert exc == "ValueError" and re.search(r"rank.*1", msg) and secs < 1.0, \
        f"rank 0 got {exc} after {secs:.1f} s: {msg!r}"


# ====================================================================================== one received row
def rank_single_received_row(fp8: bool, num_topk: int) -> tuple:
    """Each rank's only token goes to its own first expert, so every rank receives exactly one row."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    num_experts = _num_experts(num_ranks)
    buf = Buffer(dist.group.WORLD, Config().get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks), backend="reference")
    x = make_inputs(SEED, rank, 1, HIDDEN, num_experts, num_topk, num_ranks, "random")[0]
    idx = torch.full((1, num_topk), -1, dtype=torch.int64)
    idx[0, 0] = rank * (num_experts // num_ranks)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    x_in = _fp8(x) if fp8 else x
    out: list = []
    outcome = _outcome(lambda: out.append(buf.dispatch(
        x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=torch.ones((1, num_topk)))))
    if out:
        recv_x, recv_idx, recv_w = out[0][:3]
        data = recv_x[0] if fp8 else recv_x
        want = x_in[0] if fp8 else x_in
        assert torch.equal(data.view(torch.uint8), want.view(torch.uint8)), f"rank {rank}: recv_x"
        assert recv_idx.tolist() == [[0] + [-1] * (num_topk - 1)], f"rank {rank}: {recv_idx.tolist()}"
        assert recv_w.tolist() == [[1.0] + [0.0] * (num_topk - 1)], f"rank {rank}: {recv_w.tolist()}"
    return outcome


@pytest.mark.parametrize("fp8, num_topk", [
    (False, 2),
    (False, 4),
    (False, 3),
    (False, 1),
    (True, 2),
], ids=["bf16-K2", "bf16-K4", "bf16-K3", "bf16-K1", "fp8-H128-K2"])
def test_single_received_row(fp8, num_topk):
    """Not an argument error: found by the property test below (valid arguments must dispatch)."""
    for rank, (exc, msg, _) in enumerate(cluster(2).run(rank_single_received_row, fp8, num_topk,
                                                        timeout_s=RUN_TIMEOUT_S)):
        assert exc is None, f"rank {rank}: valid arguments failed with {exc}: {msg}"


# ====================================================================================== property test
_FAULTS = [None] * 6 + [
    "x dtype", "x non-contiguous", "scales float64", "scales rows", "scales strided", "topk_idx int32",
    "topk_idx rows", "topk_idx value", "topk_idx non-contiguous", "topk_weights float64", "topk_weights cols",
    "topk_weights without topk_idx", "is_token_in_rank rows", "is_token_in_rank int32", "num_tokens_per_rank",
    "num_tokens_per_expert shorter", "expert_alignment", "num_worst_tokens", "cached with topk_idx",
]


def _apply_fault(fault: str | None, x_in: Any, kw: dict[str, Any], t: int) -> Any:
    """Spoil one argument of an otherwise valid dispatch (a no-op where the fault does not apply)."""
    fp8 = isinstance(x_in, tuple)
    if fault == "x dtype":
        x_in = (kw["x"], x_in[1]) if fp8 else x_in.half()
    elif fault == "x non-contiguous":
        x_in = (_noncontig(x_in[0]), x_in[1]) if fp8 else _noncontig(x_in)
    elif fault == "scales float64" and fp8:
        x_in = (x_in[0], x_in[1].double())
    elif fault == "scales rows" and fp8:
        x_in = (x_in[0], torch.cat([x_in[1], torch.ones((1, x_in[1].shape[1]))]))
    elif fault == "scales strided" and fp8 and x_in[1].shape[1] > 1:
        x_in = (x_in[0], torch.cat([x_in[1], x_in[1]], 1)[:, ::2])
    elif fault == "topk_idx int32" and kw["topk_idx"] is not None:
        kw["topk_idx"] = kw["topk_idx"].int()
    elif fault == "topk_idx rows" and kw["topk_idx"] is not None:
        kw["topk_idx"] = torch.cat([kw["topk_idx"], kw["topk_idx"][:1] * 0])
    elif fault == "topk_idx value" and kw["topk_idx"] is not None and t:
        kw["topk_idx"] = kw["topk_idx"].clone()
        kw["topk_idx"][t // 2, 0] = kw["num_tokens_per_expert"].shape[0] if t % 2 else -2
    elif fault == "topk_idx non-contiguous" and kw["topk_idx"] is not None:
        kw["topk_idx"] = _noncontig(kw["topk_idx"])
    elif fault == "topk_weights float64" and kw["topk_weights"] is not None:
        kw["topk_weights"] = kw["topk_weights"].double()
    elif fault == "topk_weights cols" and kw["topk_weights"] is not None:
        kw["topk_weights"] = torch.cat([kw["topk_weights"], kw["topk_weights"][:, :1]], 1)
    elif fault == "topk_weights without topk_idx":
        kw["topk_idx"] = None
        kw["topk_weights"] = torch.ones((t, 1))
    elif fault == "is_token_in_rank rows":
        kw["is_token_in_rank"] = kw["is_token_in_rank"][1:] if t else torch.ones((1, 1), dtype=torch.bool)
    elif fault == "is_token_in_rank int32":
        kw["is_token_in_rank"] = kw["is_token_in_rank"].int()
    elif fault == "num_tokens_per_rank":
        kw["num_tokens_per_rank"] = kw["num_tokens_per_rank"] + 1
    elif fault == "num_tokens_per_expert shorter":
        kw["num_tokens_per_expert"] = kw["num_tokens_per_expert"][:-1]
    elif fault == "expert_alignment":
        kw["expert_alignment"] = 0
    elif fault == "num_worst_tokens":
        kw["num_worst_tokens"] = -1
    return x_in


def _expected_refusals(x_in: Any, kw: dict[str, Any], t: int) -> list[tuple[type, str]]:
    """What API.md's rules refuse in these dispatch arguments (R = 1): (error type, regex) per broken rule."""
    refusals = []
    if isinstance(x_in, tuple):
        data, scales = x_in
        if data.dtype != torch.float8_e4m3fn:
            refusals.append((TypeError, r"^x\[0\] must have dtype"))
        if scales.dtype != torch.float32:
            refusals.append((TypeError, r"^x\[1\] must have dtype"))
        if scales.shape[0] != t:
            refusals.append((ValueError, r"^x\[1\] \(scales\) must have \d+ rows"))
        if scales.stride(1) != 1 and scales.stride(0) != 1:
            refusals.append((ValueError, r"^x\[1\] \(scales\) must be row- or column-major"))
    else:
        data = x_in
        if data.dtype != torch.bfloat16:
            refusals.append((TypeError, r"^x must have dtype torch\.bfloat16"))
    if not data.is_contiguous():
        refusals.append((ValueError, r"^x must be contiguous"))
    if data.shape[1] * data.element_size() % 16:
        refusals.append((ValueError, r"^x: hidden \(\d+\) \* element size"))
    idx, weights, in_rank = kw["topk_idx"], kw["topk_weights"], kw["is_token_in_rank"]
    num_experts = kw["num_tokens_per_expert"].shape[0]
    if num_experts == 0:
        refusals.append((ValueError, r"^num_tokens_per_expert has 0 entries"))
    if in_rank.dtype != torch.bool:
        refusals.append((TypeError, r"^is_token_in_rank must have dtype torch\.bool"))
    if tuple(in_rank.shape) != (t, 1):
        refusals.append((ValueError, r"^is_token_in_rank must have shape"))
    elif not torch.equal(in_rank.sum(0).int(), kw["num_tokens_per_rank"]):
        refusals.append((ValueError, r"^num_tokens_per_rank does not match is_token_in_rank"))
    if idx is not None:
        if idx.dtype != torch.int64:
            refusals.append((TypeError, r"^topk_idx must have dtype torch\.int64"))
        if idx.shape[0] != t:
            refusals.append((ValueError, r"^topk_idx must have \d+ rows"))
        if not idx.is_contiguous():
            refusals.append((ValueError, r"^topk_idx must be contiguous"))
        if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= num_experts):
            refusals.append((ValueError, r"^topk_idx values must lie in \[-1, \d+\)"))
    if weights is not None:
        if idx is None:
            refusals.append((ValueError, r"^topk_weights given without topk_idx"))
        elif weights.dtype != torch.float32:
            refusals.append((TypeError, r"^topk_weights must have dtype torch\.float32"))
        elif weights.shape != idx.shape:
            refusals.append((ValueError, r"^topk_weights must have shape"))
    if kw["expert_alignment"] < 1:
        refusals.append((ValueError, r"^expert_alignment must be >= 1"))
    if kw["num_worst_tokens"] < 0:
        refusals.append((ValueError, r"^num_worst_tokens must be >= 0"))
    return refusals


def _check_dispatch_outputs(buf: Buffer, x_in: Any, kw: dict[str, Any], out: tuple, tag: str) -> None:
    """Compare a single-rank dispatch (and its cached dispatch and combine) with a direct computation."""
    recv_x, recv_idx, recv_w, expert_list, handle, _ = out
    fp8 = isinstance(x_in, tuple)
    data = x_in[0] if fp8 else x_in
    sel = kw["is_token_in_rank"][:, 0]
    n = int(sel.sum())
    rows = kw["num_worst_tokens"] or n
    got = recv_x[0] if fp8 else recv_x
    assert got.shape == (rows, data.shape[1]) and got.dtype == data.dtype, tag
    assert torch.equal(got[:n].view(torch.uint8), data[sel].view(torch.uint8)), tag
    if fp8:
        assert torch.equal(recv_x[1][:n], x_in[1][sel]), tag
    idx, weights = kw["topk_idx"], kw["topk_weights"]
    if idx is None:
        assert recv_idx is None and recv_w is None, tag
    else:
        assert torch.equal(recv_idx[:n], idx[sel]) and bool((recv_idx[n:] == -1).all()), tag
        if weights is not None:
            assert torch.equal(recv_w[:n], torch.where(idx[sel] >= 0, weights[sel], 0.0)), tag
    if kw["num_worst_tokens"]:
        assert expert_list == [], tag
    else:
        a = kw["expert_alignment"]
        counts = kw["num_tokens_per_expert"].tolist()  # R = 1: every expert is local
        assert expert_list == [(c + a - 1) // a * a for c in counts], f"{tag}: {expert_list} vs {counts}"
    cached = buf.dispatch(x_in, handle=handle)
    assert cached[1:4] == (None, None, None), tag
    got = cached[0][0] if fp8 else cached[0]
    assert torch.equal(got[:n].view(torch.uint8), data[sel].view(torch.uint8)), tag
    if not fp8:
        combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        assert torch.equal(combined, torch.where(sel[:, None], data, 0.0).to(torch.bfloat16)), tag
        if recv_w is not None:
            assert torch.equal(combined_w, torch.where(sel[:, None] & (idx >= 0), weights, 0.0)), tag


def rank_dispatch_property(max_examples: int) -> dict[str, int]:
    """Random dispatch arguments on one rank: each call raises an error the rules predict (type, and a
    message naming the argument) or returns exactly the direct computation. One Buffer serves every
    example, so a refused call that spoiled it would fail the valid examples after it."""
    buf = Buffer(dist.group.WORLD, Config().get_nvl_buffer_size_hint(1024, 1), backend="reference")
    seen = {"valid": 0, "refused": 0}

    @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data):
        t = data.draw(st.integers(0, 6), label="T")
        hidden = data.draw(st.sampled_from([8, 36, 64, 128, 136, 256]), label="H")
        num_experts = data.draw(st.sampled_from([1, 2, 4, 8]), label="E")
        num_topk = data.draw(st.integers(1, 4), label="K")
        fp8 = data.draw(st.booleans(), label="fp8")
        col_major = data.draw(st.booleans(), label="column-major scales")
        with_topk = data.draw(st.sampled_from(["idx+weights", "idx+weights", "idx", "none"]), label="topk")
        fault = data.draw(st.sampled_from(_FAULTS), label="fault")
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16), label="seed"))
        x = torch.randn((t, hidden), generator=gen).to(torch.bfloat16)
        idx = torch.randint(-1, num_experts, (t, num_topk), generator=gen)
        weights = torch.rand((t, num_topk), generator=gen)
        in_rank = (idx >= 0).any(1, keepdim=True)
        kw: dict[str, Any] = dict(
            x=x, num_tokens_per_rank=in_rank.sum(0).int(), is_token_in_rank=in_rank,
            num_tokens_per_expert=torch.bincount(idx[idx >= 0], minlength=num_experts).int(),
            topk_idx=idx if with_topk != "none" else None, topk_weights=weights if with_topk == "idx+weights" else None,
            expert_alignment=data.draw(st.sampled_from([1, 2, 8]), label="expert_alignment"),
            num_worst_tokens=data.draw(st.sampled_from([0, t, t + 3]), label="num_worst_tokens"))
        x_in: Any = x
        if fp8:
            q, scales = _fp8(x)
            x_in = (q, scales.t().contiguous().t() if col_major else scales)
        x_in = _apply_fault(fault, x_in, kw, t)
        kw.pop("x")
        tag = f"T={t} H={hidden} E={num_experts} K={num_topk} fp8={fp8} topk={with_topk} fault={fault}"
        expected = _expected_refusals(x_in, kw, t)
        cached_fault = fault == "cached with topk_idx" and not expected
        if cached_fault:  # the dispatch is valid; its cached dispatch with topk_idx is not
            expected = [(ValueError, r"^topk_idx must be None for a cached dispatch")]
        try:
            out = buf.dispatch(x_in, **kw)
            if cached_fault:
                buf.dispatch(x_in, handle=out[4], topk_idx=idx)
        except (ValueError, TypeError) as error:
            assert expected, f"{tag}: valid arguments refused: {type(error).__name__}: {error}"
            assert any(isinstance(error, kind) and re.search(match, str(error)) for kind, match in expected), \
                f"{tag}: expected one of {expected}, got {type(error).__name__}: {error}"
            seen["refused"] += 1
            return
        assert not expected, f"{tag}: not refused, expected one of {expected}"
        _check_dispatch_outputs(buf, x_in, kw, out, tag)
        seen["valid"] += 1

    check()
    return seen


def test_dispatch_arguments_property():
    (seen,) = cluster(1).run(rank_dispatch_property, 25, timeout_s=RUN_TIMEOUT_S)
    assert seen["valid"] and seen["refused"], seen  # both kinds were drawn (25 examples, about half faulty)


# ====================================================================================== local API (no cluster)
LOCAL_CASES = {
    "Config num_sms odd": (lambda: Config(num_sms=3), ValueError, r"^Config\.num_sms must be even"),
    "Config num_sms=0": (lambda: Config(num_sms=0), ValueError, r"^Config\.num_sms must be a positive int"),
    "Config num_sms float": (lambda: Config(num_sms=2.0), (ValueError, TypeError), r"^Config\.num_sms"),
    "Config num_sms bool": (lambda: Config(num_sms=True), (ValueError, TypeError), r"^Config\.num_sms"),
    "Config nvl send=0": (lambda: Config(20, 0), ValueError, r"^Config\.num_max_nvl_chunked_send_tokens"),
    "Config nvl send > recv": (lambda: Config(20, 300, 256), ValueError,
                               r"^Config\.num_max_nvl_chunked_send_tokens must be <= num_max_nvl_chunked_recv"),
    "Config rdma recv=-1": (lambda: Config(20, 6, 256, 6, -1), ValueError,
                            r"^Config\.num_max_rdma_chunked_recv_tokens must be a positive int"),
    "Config rdma send > recv": (lambda: Config(20, 6, 256, 64, 32), ValueError,
                                r"^Config\.num_max_rdma_chunked_send_tokens must be <="),
    "nvl hint hidden_bytes=0": (lambda: Config().get_nvl_buffer_size_hint(0, 2), ValueError,
                                r"^hidden_bytes must be a positive int"),
    "nvl hint hidden_bytes float": (lambda: Config().get_nvl_buffer_size_hint(256.0, 2), (ValueError, TypeError),
                                    r"^hidden_bytes must be a positive int"),
    "nvl hint num_ranks=0": (lambda: Config().get_nvl_buffer_size_hint(256, 0), ValueError,
                             r"^num_ranks must be a positive int"),
    "rdma hint hidden_bytes<0": (lambda: Config().get_rdma_buffer_size_hint(-256, 16), ValueError,
                                 r"^hidden_bytes must be a positive int"),
    "rdma hint num_ranks str": (lambda: Config().get_rdma_buffer_size_hint(256, "16"), (ValueError, TypeError),
                                r"^num_ranks must be a positive int"),
    "ll hint N=0": (lambda: Buffer.get_low_latency_rdma_size_hint(0, 128, 2, 8), ValueError,
                    r"^num_max_dispatch_tokens_per_rank must be a positive int"),
    "ll hint hidden=0": (lambda: Buffer.get_low_latency_rdma_size_hint(8, 0, 2, 8), ValueError,
                         r"^hidden must be a positive int"),
    "ll hint num_ranks=-2": (lambda: Buffer.get_low_latency_rdma_size_hint(8, 128, -2, 8), ValueError,
                             r"^num_ranks must be a positive int"),
    "ll hint num_experts float": (lambda: Buffer.get_low_latency_rdma_size_hint(8, 128, 2, 8.0),
                                  (ValueError, TypeError), r"^num_experts must be a positive int"),
    "set_num_sms odd": (lambda: Buffer.set_num_sms(3), ValueError, r"^new_num_sms must be even"),
    "set_num_sms=0": (lambda: Buffer.set_num_sms(0), ValueError, r"^new_num_sms must be >= 2"),
    "set_num_sms float": (lambda: Buffer.set_num_sms(2.0), TypeError, r"^new_num_sms must be an int"),
    "set_num_sms bool": (lambda: Buffer.set_num_sms(True), TypeError, r"^new_num_sms must be an int"),
    "get_dispatch_config(0)": (lambda: Buffer.get_dispatch_config(0), ValueError, r"^num_ranks must be >= 1"),
    "get_combine_config str": (lambda: Buffer.get_combine_config("8"), TypeError, r"^num_ranks must be an int"),
    "cast_to_fp8 list": (lambda: epcomm.per_token_cast_to_fp8([[1.0]]), TypeError, r"^x must be a torch\.Tensor"),
    "cast_to_fp8 int32": (lambda: epcomm.per_token_cast_to_fp8(torch.zeros((2, 128), dtype=torch.int32)),
                          TypeError, r"^x must be a floating tensor"),
    "cast_to_fp8 1-D": (lambda: epcomm.per_token_cast_to_fp8(torch.zeros(128)), ValueError, r"^x must be 2-D"),
    "cast_to_fp8 3-D": (lambda: epcomm.per_token_cast_to_fp8(torch.zeros((1, 2, 128))), ValueError,
                        r"^x must be 2-D"),
    "cast_back x_fp8 bf16": (lambda: epcomm.per_token_cast_back(torch.zeros((2, 128), dtype=torch.bfloat16),
                                                                torch.ones((2, 1))),
                             TypeError, r"^x_fp8 must be float8_e4m3fn"),
    "cast_back scales float64": (lambda: epcomm.per_token_cast_back(*_cast_pair(scales_dtype=torch.float64)),
                                 TypeError, r"^scales must be float32 or UE8M0-packed int32"),
    "cast_back scales columns": (lambda: epcomm.per_token_cast_back(_cast_pair(hidden=256)[0],
                                                                    _cast_pair(hidden=256)[1][:, :1]),
                                 ValueError, r"^scales shape \(2, 1\) is not one fp32 scale per 128 channels of "
                                             r"x_fp8 \(2, 256\): expected \(2, 2\)"),
    "cast_back scales columns too many": (lambda: epcomm.per_token_cast_back(
        _cast_pair(hidden=256)[0], _cast_pair(hidden=256)[1].repeat(1, 2)), ValueError,
        r"^scales shape \(2, 4\) is not one fp32 scale per 128 channels"),
    "cast_back scales rows": (lambda: epcomm.per_token_cast_back(_cast_pair()[0], _cast_pair()[1][:1]),
                              ValueError, r"^scales shape \(1, 1\) is not one fp32 scale per 128 channels of "
                                          r"x_fp8 \(2, 128\): expected \(2, 1\)"),
    "Buffer without torch.distributed": (lambda: Buffer(None), RuntimeError,
                                         r"^epcomm\.Buffer needs torch\.distributed initialized"),
}


def _cast_pair(hidden: int = 128, scales_dtype: torch.dtype = torch.float32):
    q, scales = epcomm.per_token_cast_to_fp8(torch.randn((2, hidden)))
    return q, scales.to(scales_dtype)


@pytest.mark.parametrize("name", list(LOCAL_CASES))
def test_local_argument_errors(name):
    call, kind, match = LOCAL_CASES[name]
    assert not dist.is_initialized()  # the parent process: these calls need no process group
    num_sms = Buffer.num_sms
    with pytest.raises(kind, match=match):
        call()
    assert Buffer.num_sms == num_sms, "a refused set_num_sms changed the SM count"


@pytest.mark.parametrize("case", ["x_fp8 list", "scales list", "scales 1-D", "x_fp8 1-D"])
def test_per_token_cast_back_argument_types(case):
    q, scales = _cast_pair()
    args = {"x_fp8 list": ([[0.0] * 128] * 2, scales), "scales list": (q, scales.tolist()),
            "scales 1-D": (q, scales.flatten()), "x_fp8 1-D": (q.flatten(), scales)}[case]
    name = "x_fp8" if case.startswith("x_fp8") else "scales"
    with pytest.raises((TypeError, ValueError), match=rf"^{name}\b"):
        epcomm.per_token_cast_back(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="wrong-device checks with real CUDA tensors need a GPU; "
                                                          "the meta-device cases above cover the check on CPU")
def test_wrong_device_cuda_tensors():
    reports = cluster(2).run(rank_cuda_tensors_on_cpu_buffer, timeout_s=RUN_TIMEOUT_S)
    for rank, report in enumerate(reports):
        for name, (exc, msg, secs, verify) in report.items():
            assert exc == "ValueError" and re.search(rf"^{name} must be on cpu", msg), f"[{name}] rank {rank}: {msg}"
            assert secs < FAST_S and not verify, f"[{name}] rank {rank}: {secs:.1f} s, {verify}"


def rank_cuda_tensors_on_cpu_buffer() -> dict[str, tuple]:
    c = _NormalCtx()  # gloo: the Buffer's device is the CPU
    cuda = torch.device("cuda", 0)
    return {
        "x": (*_outcome(lambda: c.dispatch(x=c.x.to(cuda))), c.verify()),
        "topk_idx": (*_outcome(lambda: c.dispatch(topk_idx=c.topk_idx.to(cuda))), c.verify()),
        "is_token_in_rank": (*_outcome(lambda: c.dispatch(is_token_in_rank=c.in_rank.to(cuda))), c.verify()),
    }


def rank_low_latency_property(max_examples: int) -> dict[str, int]:
    """Random low-latency and layout arguments on one rank: each call raises ValueError/TypeError
    (or NotImplementedError for use_logfmt) or returns exactly the direct computation; one Buffer
    serves every example, so a refused call that spoiled it fails the examples after it."""
    n_max, h_max, e_max = 8, 512, 8
    buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(n_max, h_max, 1, e_max),
                 low_latency_mode=True, backend="reference")
    other = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(n_max, h_max, 1, e_max),
                   low_latency_mode=True, backend="reference")
    seen = {"valid": 0, "refused": 0}
    faults = [None, None, None, "x dtype", "x non-contiguous", "topk int32", "topk rows", "id too large",
              "id below -1", "too many tokens", "ue8m0 without round", "combine x shape", "weights dtype",
              "weights shape", "combine ids differ", "other buffer's handle", "logfmt", "layout ids"]

    @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data):
        n = data.draw(st.integers(1, n_max), label="N")
        t = data.draw(st.integers(0, n), label="T")
        hidden = data.draw(st.sampled_from([128, 256, 512]), label="H")
        num_experts = data.draw(st.sampled_from([1, 4, 8]), label="E")
        k = data.draw(st.integers(1, 4), label="K")
        mode = data.draw(st.sampled_from(["bf16", "fp8", "fp8-ue8m0"]), label="mode")
        fault = data.draw(st.sampled_from(faults), label="fault")
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16), label="seed"))
        x = torch.randn((t, hidden), generator=gen).to(torch.bfloat16)
        chosen = torch.rand((t, num_experts), generator=gen).argsort(1)[:, :min(k, num_experts)]
        idx = torch.full((t, k), -1, dtype=torch.int64)
        idx[:, :chosen.shape[1]] = chosen
        w = torch.rand((t, k), generator=gen)
        fp8, ue8m0 = mode != "bf16", mode == "fp8-ue8m0"
        kwargs: dict[str, Any] = dict(use_fp8=fp8, round_scale=ue8m0, use_ue8m0=ue8m0)
        if ue8m0 and hidden % 512:
            kwargs.update(round_scale=False, use_ue8m0=False)  # a valid FP8 call instead
        if fault in ("x non-contiguous", "topk rows", "id too large", "id below -1", "combine ids differ") and t == 0:
            fault = None
        if fault == "too many tokens" and t < 2:
            fault = None
        x_in, idx_in, w_in, n_in, y_cut = x, idx, w, n, False
        if fault == "x dtype":
            x_in = x.half()
        elif fault == "x non-contiguous":
            x_in = torch.cat([x, x], 1)[:, ::2]
        elif fault == "topk int32":
            idx_in = idx.int()
        elif fault == "topk rows":
            idx_in = idx[:-1]
        elif fault == "id too large":
            idx_in = idx.clone()
            idx_in[t // 2, 0] = num_experts
        elif fault == "id below -1":
            idx_in = idx.clone()
            idx_in[0, k - 1] = -2
        elif fault == "too many tokens":
            n_in = t - 1
        elif fault == "ue8m0 without round":
            kwargs.update(use_ue8m0=True, round_scale=False)
        elif fault == "weights dtype":
            w_in = w.double()
        elif fault == "weights shape":
            w_in = w[:, :1] if k > 1 else torch.rand((t, 2))
        elif fault == "combine x shape":
            y_cut = True
        if fault == "layout ids" and t == 0:
            fault = None  # no tokens: no id to make bad
        tag = f"T={t} N={n} H={hidden} E={num_experts} K={k} {mode} fault={fault}"
        try:
            if fault == "layout ids":
                bad = idx.clone()
                bad[...] = num_experts  # every id out of range
                buf.get_dispatch_layout(bad, num_experts)
                raise AssertionError(f"{tag}: get_dispatch_layout accepted ids past num_experts")
            recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x_in, idx_in, n_in, num_experts, **kwargs)
            data_out = recv_x[0].float() if fp8 else recv_x.float()
            y = data_out.nan_to_num().clamp(-50, 50).to(torch.bfloat16)
            if y_cut:
                y = y[:, :, : hidden // 2].contiguous()
            combine_ids = idx_in
            if fault == "combine ids differ":
                combine_ids = idx.clone()
                combine_ids[0, 0] = -1 if int(idx[0, 0]) != -1 else 0
            use = other if fault == "other buffer's handle" else buf
            combined = use.low_latency_combine(y, combine_ids, w_in, handle, use_logfmt=fault == "logfmt")[0]
        except (ValueError, TypeError, NotImplementedError) as error:
            assert fault is not None, f"{tag}: valid arguments refused: {type(error).__name__}: {error}"
            assert not isinstance(error, NotImplementedError) or fault == "logfmt", f"{tag}: {error}"
            seen["refused"] += 1
            return
        assert fault is None, f"{tag}: not refused"
        # R = 1: every expert is local. Expert e's rows are the tokens choosing it, ascending.
        for e in range(num_experts):
            tokens = torch.nonzero((idx == e).any(1)).flatten()
            assert int(recv_count[e]) == tokens.numel(), tag
            assert torch.equal(handle.src_info[e, :tokens.numel()], tokens.int()), tag
            if not fp8:
                assert torch.equal(recv_x[e, :tokens.numel()].view(torch.int16), x[tokens].view(torch.int16)), tag
        # Combine: sum over the token's slots of weight * the row its expert returned, in fp32.
        want = torch.zeros((t, hidden), dtype=torch.float32)
        for tok in range(t):
            for slot in range(k):
                e = int(idx[tok, slot])
                if e >= 0:
                    row = int(torch.nonzero(handle.src_info[e] == tok).flatten()[0])
                    want[tok] += w[tok, slot] * y[e, row].float()
        assert torch.allclose(combined.float(), want, rtol=2 ** -7, atol=1e-3), tag
        seen["valid"] += 1

    check()
    buf.destroy()
    other.destroy()
    return seen


def test_low_latency_arguments_property():
    (seen,) = cluster(1).run(rank_low_latency_property, 40, timeout_s=RUN_TIMEOUT_S * 3)
    assert seen["valid"] and seen["refused"], seen


# ====================================================================================== a meeting given up
def rank_meeting_given_up(uid: str) -> list[int]:
    """Rank 0 gives up waiting for a late rank 1 at a store meeting (as destroy does before a collective
    free); rank 1, arriving later, finds every arrival key but counts rank 0 as absent, so it does not go
    on to a free rank 0 will never join (NVSHMEM's would wait forever)."""
    rank = dist.get_rank()
    transport = Transport(dist.group.WORLD, uid, timeout_s=1.0)
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        missing = transport.meet("free", time.monotonic() + 0.3)
        store.set(f"{uid}/rank0-left", "1")
    else:
        store.wait([f"{uid}/rank0-left"])  # arrive only after rank 0 gave up
        missing = transport.meet("free", time.monotonic() + 5.0)
    return missing


def test_a_rank_arriving_after_a_peer_gave_up_counts_it_absent():
    assert cluster(2).run(rank_meeting_given_up, uuid.uuid4().hex) == [[1], [0]]
