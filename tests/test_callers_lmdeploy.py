"""LMDeploy's DeepEP calls replayed as LMDeploy makes them (LMDeploy lmdeploy/pytorch/backends/cuda/
token_dispatcher.py), ``import deep_ep`` through the shim: one common Buffer (get_buffer_common: normal sizing
plus the low-latency hint, low_latency_mode=True) that serves DeepEPTokenDispatcher's normal dispatch and
combine and then DeepEPTokenDispatcherLowLatency's FP8 calls, with no clean_low_latency_buffer in between.
Results are checked against epcomm/oracle.py bit for bit; on GPUs (EPCOMM_TEST_BACKEND=nccl) the CUDA kernels
run them too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import cluster
from replay import (
    BACKENDS,
    ON_GPUS,
    assert_bits,
    backend,
    check_ll_combined,
    check_ll_dispatch,
    check_normal_dispatch,
    deep_ep,
    ll_experts,
    normal_experts,
    oracle_ll,
    oracle_pipeline,
    rank_inputs,
)

EXPERTS, TOPK, TOKENS, HIDDEN = 8, 3, 40, 256
NUM_MAX_DISPATCH_TOKENS_PER_RANK = 128  # DeepEPTokenDispatcherLowLatency's fixed value
_buffer_common = None


def get_buffer_common(group, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int,
                      hidden_bytes: int):
    """get_buffer_common: the configs' NVL and RDMA hints, the RDMA size raised to the low-latency hint, one
    low-latency-mode Buffer kept while it is large enough."""
    global _buffer_common
    Buffer = deep_ep().Buffer
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
    num_rdma_bytes = max(Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, group.size(),
                                                               num_experts), num_rdma_bytes)
    if (_buffer_common is None or _buffer_common.group != group or _buffer_common.num_nvl_bytes < num_nvl_bytes
            or _buffer_common.num_rdma_bytes < num_rdma_bytes):
        _buffer_common = Buffer(group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                                low_latency_mode=True, num_qps_per_rank=num_experts // group.size())
    return _buffer_common


class NormalDispatcher:
    """DeepEPTokenDispatcher's dispatch_normal / combine_normal (synchronous) and the _async variants."""

    def __init__(self, group, params_dtype: torch.dtype) -> None:
        self.buffer_normal = get_buffer_common(group, NUM_MAX_DISPATCH_TOKENS_PER_RANK, HIDDEN, EXPERTS,
                                               hidden_bytes=HIDDEN * params_dtype.itemsize)

    def dispatch_normal(self, x, topk_idx, topk_weights, num_experts, previous_event=None, async_finish=None):
        """async_finish None: dispatch_normal (async_finish False, weights cast to fp32); else
        dispatch_normal_async."""
        asynchronous = async_finish is not None
        async_finish = bool(async_finish)
        on_comm = previous_event is not None and async_finish
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
         previous_event) = self.buffer_normal.get_dispatch_layout(topk_idx, num_experts, previous_event=previous_event,
                                                                  async_finish=async_finish,
                                                                  allocate_on_comm_stream=on_comm)
        return self.buffer_normal.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights if asynchronous else topk_weights.to(torch.float32),
            num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
            previous_event=previous_event, async_finish=async_finish, allocate_on_comm_stream=on_comm)

    def combine_normal(self, x, handle, previous_event=None, async_finish=False):
        combined_x, _, event = self.buffer_normal.combine(x, handle, async_finish=async_finish,
                                                          previous_event=previous_event,
                                                          allocate_on_comm_stream=previous_event is not None
                                                          and async_finish)
        return combined_x, event


class LowLatencyDispatcher:
    """DeepEPTokenDispatcherLowLatency's dispatch / combine (FP8, hooks or async events)."""

    def __init__(self, group, params_dtype: torch.dtype, return_recv_hook: bool) -> None:
        self.num_max_dispatch_tokens_per_rank = NUM_MAX_DISPATCH_TOKENS_PER_RANK
        self.buffer_low_latency = get_buffer_common(group, self.num_max_dispatch_tokens_per_rank, HIDDEN, EXPERTS,
                                                    hidden_bytes=HIDDEN * params_dtype.itemsize)
        self.return_recv_hook = return_recv_hook
        self.handle = None

    def dispatch(self, hidden_states, topk_idx, topk_weights, num_experts):
        topk_idx = topk_idx.to(torch.int64)
        expected_m = (hidden_states.shape[0] * self.buffer_low_latency.group_size * topk_idx.shape[1]
                      + num_experts) // num_experts
        packed_recv_hidden, masked_m, self.handle, event, hook = self.buffer_low_latency.low_latency_dispatch(
            hidden_states, topk_idx, self.num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True,
            async_finish=not self.return_recv_hook, return_recv_hook=self.return_recv_hook)
        hook() if self.return_recv_hook else event.current_stream_wait()
        return packed_recv_hidden, topk_idx, topk_weights, masked_m, expected_m

    def combine(self, hidden_states, topk_idx, topk_weights):
        combined_hidden_states, event, hook = self.buffer_low_latency.low_latency_combine(
            hidden_states, topk_idx, topk_weights.to(torch.float32), self.handle,
            async_finish=not self.return_recv_hook, return_recv_hook=self.return_recv_hook)
        hook() if self.return_recv_hook else event.current_stream_wait()
        return combined_hidden_states


def _normal_step(dispatcher: NormalDispatcher, inputs, tag: str, async_finish) -> None:
    rank, per_rank = dist.get_rank(), EXPERTS // dist.get_world_size()
    x, topk_idx, topk_weights = inputs[rank]
    recv_x, recv_idx, recv_w, counts, handle, event = dispatcher.dispatch_normal(x, topk_idx, topk_weights, EXPERTS,
                                                                                 async_finish=async_finish)
    if async_finish:
        event.current_stream_wait()
    check_normal_dispatch(tag, recv_x, recv_idx, recv_w, counts, inputs, EXPERTS)
    combined, event = dispatcher.combine_normal(normal_experts(recv_x, recv_idx, recv_w, rank, per_rank), handle,
                                                async_finish=bool(async_finish))
    if async_finish:
        event.current_stream_wait()
    want = oracle_pipeline(inputs, EXPERTS, lambda rx, ri, rw, d: normal_experts(rx, ri, rw, d, per_rank))
    assert_bits(f"{tag} combined", combined, want[rank]["combined"])


def rank_lmdeploy(name: str, return_recv_hook: bool):
    """LMDeploy lmdeploy/pytorch/backends/cuda/token_dispatcher.py, DeepEPTokenDispatcher and
    DeepEPTokenDispatcherLowLatency on get_buffer_common's Buffer: prefill in normal mode, then decode in
    low-latency mode on the same Buffer without clean_low_latency_buffer, then normal mode again."""
    global _buffer_common
    rank = dist.get_rank()
    _buffer_common = None
    with backend(name):
        normal = NormalDispatcher(dist.group.WORLD, torch.bfloat16)
    low_latency = LowLatencyDispatcher(dist.group.WORLD, torch.bfloat16, return_recv_hook)
    assert low_latency.buffer_low_latency is normal.buffer_normal and normal.buffer_normal.low_latency_mode
    for step, kind in enumerate(("normal", "normal_async", "low_latency", "low_latency", "normal")):
        tag = f"{name} hook={return_recv_hook} step {step} {kind}"
        if kind.startswith("normal"):
            _normal_step(normal, rank_inputs(600 + step, TOKENS, HIDDEN, EXPERTS, TOPK), tag,
                         True if kind == "normal_async" else None)
            continue
        inputs = rank_inputs(600 + step, 24, HIDDEN, EXPERTS, TOPK)
        x, topk_idx, topk_weights = inputs[rank]
        recv, topk_idx, topk_weights, masked_m, expected_m = low_latency.dispatch(x, topk_idx, topk_weights, EXPERTS)
        want, want_combined = oracle_ll(inputs, EXPERTS, NUM_MAX_DISPATCH_TOKENS_PER_RANK, use_fp8=True)
        check_ll_dispatch(tag, recv, masked_m, low_latency.handle, want)
        assert expected_m == (24 * dist.get_world_size() * TOPK + EXPERTS) // EXPERTS
        combined = low_latency.combine(ll_experts(recv, rank), topk_idx, topk_weights)
        check_ll_combined(tag, combined, want_combined, low_latency.buffer_low_latency, inputs[rank])
    _buffer_common.destroy()
    _buffer_common = None
    return True


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("return_recv_hook", [False, True])
def test_lmdeploy_common_buffer(name, return_recv_hook):
    cluster(2).run(rank_lmdeploy, name, return_recv_hook)


@pytest.mark.gpu
@ON_GPUS
def test_lmdeploy_on_one_rank():
    """The common Buffer on the kernels with a single EP rank."""
    cluster(1).run(rank_lmdeploy, "cuda", True)
