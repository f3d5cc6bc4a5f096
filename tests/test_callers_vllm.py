"""vLLM's DeepEP calls replayed as vLLM makes them, ``import deep_ep`` through the shim: the all2all managers
(vllm/distributed/device_communicators/all2all.py: DeepEPHTAll2AllManager, DeepEPLLAll2AllManager, on vLLM's
gloo CPU group, found by find_spec) and the prepare/finalize modules
(vllm/model_executor/layers/fused_moe/deepep_ht_prepare_finalize.py, deepep_ll_prepare_finalize.py), the Buffers
built under the model loader's default dtype and device.
Results are checked against epcomm/oracle.py bit for bit; on GPUs (EPCOMM_TEST_BACKEND=nccl) the CUDA kernels
run them too.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
import torch.distributed as dist
from conftest import capture_graph, cluster
from replay import (
    BACKENDS,
    ON_GPUS,
    assert_bits,
    backend,
    check_ll_combined,
    check_ll_dispatch,
    check_normal_dispatch,
    deep_ep,
    device,
    expert_scale,
    ll_experts,
    oracle_ll,
    oracle_pipeline,
    rank_inputs,
)

import epcomm
from epcomm.fp8 import quantize_groups

EXPERTS, TOPK, TOKENS = 8, 3, 40
VLLM_DEEPEP_BUFFER_SIZE_MB = 64  # the environment variable's value here (vLLM's default is 1024)
_cpu_group = None


def cpu_group():
    """vLLM's CPU group of the EP ranks (gloo), which it hands to deep_ep.Buffer."""
    global _cpu_group
    if _cpu_group is None:
        _cpu_group = dist.new_group(backend="gloo")
    return _cpu_group


@contextlib.contextmanager
def model_init_defaults():
    """What vLLM's model loader sets while the model (and with it the MoE layers' all2all handles) is built:
    the model dtype as torch's default dtype, the target device as the default device."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device()):
            yield
    finally:
        torch.set_default_dtype(saved)


class HandleCache:
    """base_device_communicator.Cache: one Buffer per set of keyword arguments."""

    def __init__(self) -> None:
        self._cache: dict = {}

    def get_or_create(self, kwargs: dict, func):
        key = tuple(sorted((k, id(v) if isinstance(v, dist.ProcessGroup) else v) for k, v in kwargs.items()))
        if key not in self._cache:
            self._cache[key] = func(**kwargs)
        return self._cache[key]


class HTManager:
    """DeepEPHTAll2AllManager (intranode): get_handle, set_num_sms, destroy."""

    def __init__(self, group) -> None:
        assert importlib.util.find_spec("deep_ep") is not None  # vllm.utils.import_utils.has_deep_ep
        self.cpu_group, self.handle_cache, self.num_sms = group, HandleCache(), 20

    def _make_all2all_kwargs(self) -> dict:
        return dict(group=self.cpu_group, num_nvl_bytes=VLLM_DEEPEP_BUFFER_SIZE_MB * 1024 * 1024, num_rdma_bytes=0,
                    low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True)

    def get_handle(self, kwargs: dict):
        assert len(kwargs) == 0
        import deep_ep
        return self.handle_cache.get_or_create(self._make_all2all_kwargs(), deep_ep.Buffer)

    def set_num_sms(self, num_sms: int) -> None:
        import deep_ep
        deep_ep.Buffer.set_num_sms(min(num_sms, self.num_sms))

    def destroy(self) -> None:
        for handle in self.handle_cache._cache.values():
            handle.destroy()
        self.handle_cache._cache.clear()


def vllm_ht_experts(recv_x, recv_ids, recv_w, rank: int, per_rank: int) -> torch.Tensor:
    """The fused experts of the Standard format and TopKWeightAndReduceContiguous: each slot's expert
    output ([M, K, H] bf16, zero where expert_map has -1), times its weight, summed over K."""
    if isinstance(recv_x, tuple):
        recv_x = epcomm.per_token_cast_back(recv_x[0], recv_x[1].contiguous()).to(torch.bfloat16)
    valid = recv_ids >= 0
    glob = torch.where(valid, recv_ids + rank * per_rank, 0)
    per_slot = (recv_x.float().unsqueeze(1) * expert_scale(glob).unsqueeze(2)).to(torch.bfloat16) * valid.unsqueeze(2)
    return (per_slot.float() * recv_w.unsqueeze(2)).sum(1).to(torch.bfloat16)


class HTPrepareAndFinalize:
    """DeepEPHTPrepareAndFinalize: prepare_async/_do_dispatch/_receiver and _finalize, with or without DBO
    (dbo_get_previous_event gives buffer.capture() under DBO, else None)."""

    available_rank_configs = [2, 4, 8, 16, 24, 32, 64, 128, 144, 160]

    def __init__(self, buffer, num_dispatchers: int, rank_expert_offset: int, dbo: bool) -> None:
        self.buffer, self.num_dispatchers_, self.rank_expert_offset, self.dbo = buffer, num_dispatchers, \
            rank_expert_offset, dbo
        self.async_prepare = True
        self.handles = [None, None]

    def _get_dispatch_config(self):
        import deep_ep
        if self.num_dispatchers_ not in self.available_rank_configs:
            return None
        return deep_ep.Buffer.get_dispatch_config(self.num_dispatchers_)

    def _get_combine_config(self):
        import deep_ep
        if self.num_dispatchers_ not in self.available_rank_configs:
            return None
        return deep_ep.Buffer.get_combine_config(self.num_dispatchers_)

    def prepare(self, tokens, token_scales, rank_topk_ids, rank_topk_weights, num_experts, ubatch: int = 0):
        previous_event = self.buffer.capture() if self.dbo else None
        (num_tokens_per_rank, num_tokens_per_rdma_rank, dispatch_expert_num_tokens, is_token_in_rank,
         event) = self.buffer.get_dispatch_layout(topk_idx=rank_topk_ids, num_experts=num_experts,
                                                  previous_event=previous_event, async_finish=False,
                                                  allocate_on_comm_stream=False)
        token_data = (tokens, token_scales) if token_scales is not None else tokens
        (token_data, expert_topk_ids, expert_topk_weights, expert_num_tokens_per_expert_list, handle,
         event) = self.buffer.dispatch(
            x=token_data, handle=None, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=dispatch_expert_num_tokens, topk_idx=rank_topk_ids, topk_weights=rank_topk_weights,
            expert_alignment=1, config=self._get_dispatch_config(), previous_event=previous_event,
            async_finish=self.async_prepare and not self.dbo, allocate_on_comm_stream=False)
        self.handles[ubatch] = handle  # dbo_current_ubatch_id()
        # _receiver
        if event.event is not None:
            event.current_stream_wait()
        raw_ids = expert_topk_ids
        expert_topk_ids = torch.where(expert_topk_ids == -1, num_experts - 1 if self.rank_expert_offset == 0 else 0,
                                      expert_topk_ids + self.rank_expert_offset)
        expert_num_tokens = torch.tensor(expert_num_tokens_per_expert_list, dtype=torch.int32, device=tokens.device)
        return token_data, raw_ids, expert_topk_ids, expert_topk_weights, expert_num_tokens, \
            expert_num_tokens_per_expert_list

    def finalize(self, output, fused_expert_output, do_async: bool, ubatch: int = 0) -> None:
        handle = self.handles[ubatch]
        assert handle is not None and fused_expert_output.dtype == torch.bfloat16
        previous_event = self.buffer.capture() if self.dbo else None
        combined_x, _, event = self.buffer.combine(
            x=fused_expert_output, handle=handle, topk_weights=None, config=self._get_combine_config(),
            previous_event=previous_event, async_finish=do_async and not self.dbo, allocate_on_comm_stream=False)
        if do_async:
            if event.event is not None:
                event.current_stream_wait()
        output.copy_(combined_x, non_blocking=True)


def _ht_micro_batch(quant: str, seed: int, routing: str, hidden: int):
    """A micro-batch's every-rank inputs and its quantized tokens (moe_kernel_quantize_input with block
    shape [128, 128]: fp32 scales, column-major where the experts read DeepGEMM's layout)."""
    inputs = rank_inputs(seed, TOKENS, hidden, EXPERTS, TOPK, routing)
    xs = None
    if quant != "bf16":
        xs = [quantize_groups(i[0]) for i in inputs]
        if quant == "fp8-column-major":
            xs = [(d, s.t().contiguous().t()) for d, s in xs]
    return inputs, xs


def rank_vllm_high_throughput(name: str, quant: str, dbo: bool, routing: str):
    """vLLM vllm/distributed/device_communicators/all2all.py DeepEPHTAll2AllManager and
    vllm/model_executor/layers/fused_moe/deepep_ht_prepare_finalize.py DeepEPHTPrepareAndFinalize:
    block-quantized FP8 dispatched with its scales (row- or column-major) or BF16; the expert layer's
    reduced output combined into vLLM's output tensor; an EP rank that receives nothing still combines.
    Under DBO two micro-batches are in flight: both prepared, then both finalized, a handle each."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    hidden, per_rank = 512, EXPERTS // num_ranks
    saved_sms = epcomm.Buffer.num_sms
    deep_ep()
    with backend(name), model_init_defaults():
        manager = HTManager(cpu_group())
        buffer = manager.get_handle({})
    assert manager.get_handle({}) is buffer
    manager.set_num_sms(24)  # capped at the manager's 20
    assert epcomm.Buffer.num_sms == 20
    try:
        pf = HTPrepareAndFinalize(buffer, num_ranks, rank * per_rank, dbo)
        for layer in range(2):
            batches = [_ht_micro_batch(quant, 400 + 2 * layer + ub, routing, hidden) for ub in range(2 if dbo else 1)]
            prepared = []
            for ub, (inputs, xs) in enumerate(batches):
                tag = f"{name} {quant} dbo={dbo} {routing} layer {layer} ubatch {ub}"
                a1, topk_ids, topk_weights = inputs[rank]
                tokens, scales = xs[rank] if xs is not None else (a1, None)
                data, raw_ids, ids, weights, num_tokens, counts = pf.prepare(tokens, scales, topk_ids, topk_weights,
                                                                             EXPERTS, ub)
                check_normal_dispatch(tag, data, raw_ids, weights, counts, inputs, EXPERTS, xs=xs)
                assert torch.equal(num_tokens.cpu(), torch.tensor(counts, dtype=torch.int32))
                assert bool(((ids >= rank * per_rank) & (ids < (rank + 1) * per_rank) | (raw_ids == -1)).all()), tag
                # The experts' reduced output; zero rows when no token reached this EP rank.
                fused_expert_output = torch.empty((0, hidden), dtype=torch.bfloat16, device=a1.device)
                if (data[0] if isinstance(data, tuple) else data).numel() != 0:
                    fused_expert_output = vllm_ht_experts(data, raw_ids, weights, rank, per_rank)
                prepared.append((tag, fused_expert_output))
            for ub, ((inputs, xs), (tag, fused_expert_output)) in enumerate(zip(batches, prepared, strict=True)):
                output = torch.empty_like(inputs[rank][0])
                pf.finalize(output, fused_expert_output, do_async=layer == 0, ubatch=ub)
                want = oracle_pipeline(inputs, EXPERTS,
                                       lambda rx, ri, rw, d: vllm_ht_experts(rx, ri, rw, d, per_rank), xs=xs)
                assert_bits(f"{tag} output", output, want[rank]["combined"])
    finally:
        manager.destroy()
        epcomm.Buffer.set_num_sms(saved_sms)
    return True


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("quant, dbo, routing", [("bf16", False, "random"), ("fp8", False, "random"),
                                                 ("fp8-column-major", True, "random"), ("bf16", True, "empty_rank")])
def test_vllm_high_throughput(name, quant, dbo, routing):
    cluster(2).run(rank_vllm_high_throughput, name, quant, dbo, routing)


class LLManager:
    """DeepEPLLAll2AllManager: get_handle from _make_all2all_kwargs (the RDMA size from
    Buffer.get_low_latency_rdma_size_hint by keyword), and the fault-tolerance mask calls."""

    def __init__(self, group, fault_tolerance: bool) -> None:
        assert importlib.util.find_spec("deep_ep") is not None
        self.cpu_group, self.handle_cache, self.support_fault_tolerance = group, HandleCache(), fault_tolerance
        self.world_size = group.size()
        self._buffer = self._mask = self._last_mask = None

    def _make_all2all_kwargs(self, max_num_tokens_per_dp_rank, token_hidden_size, num_ep_ranks, num_global_experts,
                             num_local_experts) -> dict:
        import deep_ep
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank=max_num_tokens_per_dp_rank, hidden=token_hidden_size,
            num_ranks=num_ep_ranks, num_experts=num_global_experts)
        return dict(group=self.cpu_group, num_nvl_bytes=VLLM_DEEPEP_BUFFER_SIZE_MB * 1024 * 1024,
                    num_rdma_bytes=num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=num_local_experts,
                    allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=True,
                    enable_shrink=self.support_fault_tolerance)

    def get_handle(self, kwargs: dict):
        import deep_ep
        self._buffer = self.handle_cache.get_or_create(self._make_all2all_kwargs(**kwargs), deep_ep.Buffer)
        return self._buffer

    def query_active_mask(self) -> torch.Tensor:
        if self._mask is None:
            self._mask = torch.zeros(self.world_size, device=self._buffer.device, dtype=torch.int32)
        self._buffer.low_latency_query_mask_buffer(self._mask)
        return self._mask

    def query_fault(self) -> torch.Tensor:
        current = self.query_active_mask()
        if self._last_mask is None:
            self._last_mask = torch.zeros_like(current)
        return (current != self._last_mask).any()

    def clean_buffers(self) -> None:
        self._buffer.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_()
        _synchronize()
        self._buffer.low_latency_clean_mask_buffer()
        _synchronize()
        self._last_mask = None

    def destroy(self) -> None:
        for handle in self.handle_cache._cache.values():
            handle.destroy()
        self.handle_cache._cache.clear()


def _synchronize() -> None:
    """torch.accelerator.synchronize() where there is an accelerator."""
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


class LLPrepareAndFinalize:
    """DeepEPLLPrepareAndFinalize: prepare_async (low_latency_dispatch with return_recv_hook=True) and its
    receiver's _do_quant, _finalize (low_latency_combine into out=, zero_copy=False)."""

    SUPPORTED_HIDDEN_SIZES = [2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192]

    def __init__(self, buffer, max_tokens_per_rank: int, use_fp8_dispatch: bool, use_ue8m0: bool,
                 block_k: int | None) -> None:
        self.buffer, self.max_tokens_per_rank, self.use_fp8_dispatch = buffer, max_tokens_per_rank, use_fp8_dispatch
        self.use_ue8m0_dispatch, self.block_k = use_ue8m0, block_k
        self.handles = [None, None]

    def prepare_async(self, a1, topk_ids, num_experts):
        assert a1.size(1) in self.SUPPORTED_HIDDEN_SIZES
        expert_x, expert_num_tokens, handle, _, hook = self.buffer.low_latency_dispatch(
            a1, topk_ids, self.max_tokens_per_rank, num_experts, use_fp8=self.use_fp8_dispatch,
            round_scale=self.use_ue8m0_dispatch, use_ue8m0=self.use_ue8m0_dispatch, async_finish=False,
            return_recv_hook=True)
        self.handles[0] = handle
        return hook, lambda: self._receiver(expert_x, expert_num_tokens, a1.dtype)

    def _receiver(self, expert_x, expert_num_tokens, a1_dtype):
        if self.use_fp8_dispatch and self.block_k != 128:  # _do_quant: dequant_fp8 back to the input dtype
            x_fp8, x_scales = expert_x
            assert x_fp8.is_contiguous()
            num_experts = x_fp8.size(0)
            x32 = x_fp8.to(torch.float32).view(num_experts, -1, 128) * x_scales.contiguous().view(num_experts, -1, 1)
            expert_x = x32.view(x_fp8.size()).to(dtype=a1_dtype)
        return expert_x, expert_num_tokens

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, do_async: bool):
        handle = self.handles[0]
        assert handle is not None
        _, _, recv_hook = self.buffer.low_latency_combine(
            fused_expert_output, topk_ids, topk_weights, handle, async_finish=False, zero_copy=False,
            return_recv_hook=do_async, out=output)
        return recv_hook, lambda: None


def _ll_setup(name: str, hidden: int, num_tokens: int, fault_tolerance: bool = False):
    num_ranks = dist.get_world_size()
    deep_ep()
    with backend(name), model_init_defaults():
        manager = LLManager(cpu_group(), fault_tolerance)
        buffer = manager.get_handle(dict(max_num_tokens_per_dp_rank=num_tokens, token_hidden_size=hidden,
                                         num_ep_ranks=num_ranks, num_global_experts=EXPERTS,
                                         num_local_experts=EXPERTS // num_ranks))
    return manager, buffer


def _ll_step(pf: LLPrepareAndFinalize, inputs, do_async: bool, apply_router_weight_on_input: bool = False):
    """One MoE layer: prepare (hook, then the receiver), the batched experts, finalize. With
    apply_router_weight_on_input (top-1 only) prepare scales a1 by the weights and finalize combines with ones."""
    rank = dist.get_rank()
    a1, topk_ids, topk_weights = inputs[rank]
    if apply_router_weight_on_input:
        assert topk_ids.size(1) == 1
        a1 = a1 * topk_weights.to(a1.dtype)
    hook, receiver = pf.prepare_async(a1, topk_ids, EXPERTS)
    hook()
    expert_x, expert_num_tokens = receiver()
    output = torch.empty_like(a1)
    combine_topk_weights = torch.ones_like(topk_weights) if apply_router_weight_on_input else topk_weights
    recv_hook, finish = pf.finalize(output, ll_experts(expert_x, rank), combine_topk_weights, topk_ids, do_async)
    if do_async:
        recv_hook()
    else:
        assert recv_hook is None
    finish()
    return expert_x, expert_num_tokens, output


def rank_vllm_low_latency(name: str, use_fp8: bool, use_ue8m0: bool, block_k: int | None, weight_on_input: bool):
    """vLLM vllm/distributed/device_communicators/all2all.py DeepEPLLAll2AllManager and
    vllm/model_executor/layers/fused_moe/deepep_ll_prepare_finalize.py DeepEPLLPrepareAndFinalize: BF16,
    FP8 kept for block-128 experts (UE8M0-packed scales where the experts take them) or dequantized by
    dequant_fp8; finalize sync and async (the recv hook); apply_router_weight_on_input with top-1 routing."""
    hidden, n = 2048, 8
    topk = 1 if weight_on_input else TOPK
    manager, buffer = _ll_setup(name, hidden, n)
    try:
        pf = LLPrepareAndFinalize(buffer, n, use_fp8, use_ue8m0, block_k)
        for step, tokens in enumerate((n, 3)):
            tag = f"{name} fp8={use_fp8} ue8m0={use_ue8m0} block_k={block_k} on_input={weight_on_input} step {step}"
            inputs = rank_inputs(410 + step, tokens, hidden, EXPERTS, topk)
            expert_x, counts, output = _ll_step(pf, inputs, step == 1, weight_on_input)
            if weight_on_input:  # what the ranks dispatch and combine with
                inputs = [(x * w.to(x.dtype), i, torch.ones_like(w)) for x, i, w in inputs]
            want, want_combined = oracle_ll(inputs, EXPERTS, n, use_fp8, round_scale=use_ue8m0, use_ue8m0=use_ue8m0)
            if use_fp8 and block_k != 128:
                assert expert_x.dtype == torch.bfloat16, tag
            else:
                check_ll_dispatch(tag, expert_x, counts, pf.handles[0], want)
            assert_bits(f"{tag} expert_num_tokens", counts, want.count)
            check_ll_combined(tag, output, want_combined)
    finally:
        manager.destroy()
    return True


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("use_fp8, use_ue8m0, block_k, weight_on_input", [
    (False, False, None, False), (True, False, 128, False), (True, True, 128, False), (True, False, None, False),
    (False, False, None, True)])
def test_vllm_low_latency(name, use_fp8, use_ue8m0, block_k, weight_on_input):
    cluster(2).run(rank_vllm_low_latency, name, use_fp8, use_ue8m0, block_k, weight_on_input)


def rank_vllm_fault_tolerance(name: str):
    """vLLM vllm/distributed/device_communicators/all2all.py, DeepEPLLAll2AllManager with enable_fault_tolerance:
    enable_shrink=True, query_fault between steps, and clean_buffers (get_local_buffer_tensor(torch.int8,
    use_rdma_buffer=True).zero_() then low_latency_clean_mask_buffer) with every rank idle; the steps after it
    still match the oracle."""
    hidden, n = 2048, 8
    manager, buffer = _ll_setup(name, hidden, n, fault_tolerance=True)
    try:
        pf = LLPrepareAndFinalize(buffer, n, True, False, 128)
        for step in range(3):
            inputs = rank_inputs(420 + step, n, hidden, EXPERTS, TOPK)
            _, _, output = _ll_step(pf, inputs, do_async=False)
            check_ll_combined(f"{name} step {step}", output, oracle_ll(inputs, EXPERTS, n, True)[1])
            assert not bool(manager.query_fault()), f"step {step}: a fault reported with every rank alive"
            _synchronize()
            dist.barrier()
            manager.clean_buffers()
            dist.barrier()
    finally:
        manager.destroy()
    return True


@pytest.mark.parametrize("name", BACKENDS)
def test_vllm_fault_tolerance_reset(name):
    cluster(2).run(rank_vllm_fault_tolerance, name)


def rank_vllm_ll_graph():
    """vLLM vllm/v1/worker/gpu_model_runner.py, GPUModelRunner.capture_model: decode steps captured in CUDA
    graphs with DeepEPLLPrepareAndFinalize (prepare's hook and finalize inside the capture); replays with new
    inputs copied in match the oracle."""
    rank, dev = dist.get_rank(), device()
    hidden, n = 2048, 8
    manager, buffer = _ll_setup("cuda", hidden, n)
    try:
        pf = LLPrepareAndFinalize(buffer, n, True, False, 128)
        static = [t.clone() for t in rank_inputs(430, n, hidden, EXPERTS, TOPK)[rank]]

        def step(a1, topk_ids, topk_weights):
            inputs = [None] * dist.get_world_size()
            inputs[rank] = (a1, topk_ids, topk_weights)
            return _ll_step(pf, inputs, do_async=False)[2]

        graph, output = capture_graph(step, *static)
        for replay in range(3):
            inputs = rank_inputs(431 + replay, n, hidden, EXPERTS, TOPK)
            for s, t in zip(static, inputs[rank], strict=True):
                s.copy_(t)
            graph.replay()
            torch.cuda.synchronize(dev)
            check_ll_combined(f"graph replay {replay}", output, oracle_ll(inputs, EXPERTS, n, True)[1])
        del graph
    finally:
        manager.destroy()
    return True


@pytest.mark.gpu
@ON_GPUS
@pytest.mark.parametrize("ranks", [1, 2])
def test_vllm_low_latency_cuda_graph(ranks):
    cluster(ranks).run(rank_vllm_ll_graph)


@pytest.mark.gpu
@ON_GPUS
def test_vllm_on_one_rank():
    """The managers and prepare/finalize modules on the kernels with a single EP rank."""
    ranks = cluster(1)
    ranks.run(rank_vllm_high_throughput, "cuda", "fp8-column-major", True, "random")
    ranks.run(rank_vllm_low_latency, "cuda", True, False, 128, False)
    ranks.run(rank_vllm_fault_tolerance, "cuda")
