"""SGLang's DeepEP calls replayed as SGLang makes them (SGLang python/sglang/srt/layers/moe/token_dispatcher/
deepep.py), ``import deep_ep`` through the shim: DeepEPBuffer's sizing and construction, the normal
dispatcher (Buffer.capture() events, expert_alignment=128, FP8 with DeepGEMM's scales), the low-latency one
(hooks or async events, expected_m) and its CUDA graph capture, and the AUTO mode's switch between them.
Results are checked against epcomm/oracle.py bit for bit; on GPUs (EPCOMM_TEST_BACKEND=nccl) the CUDA kernels
run them too.
"""

from __future__ import annotations

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
    ll_experts,
    normal_experts,
    oracle_ll,
    oracle_pipeline,
    rank_inputs,
)

import epcomm
from epcomm.fp8 import pack_ue8m0, quantize_groups

EXPERTS, TOPK, TOKENS, LL_MAX_TOKENS = 8, 3, 40, 16


# --deepep-config as SGLang reads it (DeepEP's tuned configs): one Config per direction, the same num_sms.
DEEPEP_CONFIG = {"normal_dispatch": {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 8,
                                     "num_max_nvl_chunked_recv_tokens": 256, "num_max_rdma_chunked_send_tokens": 6,
                                     "num_max_rdma_chunked_recv_tokens": 128},
                 "normal_combine": {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 4,
                                    "num_max_nvl_chunked_recv_tokens": 128, "num_max_rdma_chunked_send_tokens": 6,
                                    "num_max_rdma_chunked_recv_tokens": 128}}


class DeepEPConfig:
    """DeepEPConfig: the configs of --deepep-config (Config(**entry)), else None and Buffer.num_sms."""

    def __init__(self, parsed: dict | None) -> None:
        Buffer, Config = deep_ep().Buffer, deep_ep().Config
        if parsed:
            self.normal_dispatch_config = Config(**parsed["normal_dispatch"])
            self.normal_combine_config = Config(**parsed["normal_combine"])
            assert parsed["normal_dispatch"]["num_sms"] == parsed["normal_combine"]["num_sms"]
            self.num_sms = parsed["normal_dispatch"]["num_sms"]
        else:
            self.normal_dispatch_config = self.normal_combine_config = None
            self.num_sms = Buffer.num_sms


def sglang_buffer(group, hidden: int, param_bytes: int, mode: str, num_max_dispatch_tokens_per_rank: int,
                  num_experts: int, deepep_config: DeepEPConfig | None = None):
    """DeepEPBuffer.get_deepep_buffer: normal sizing from the dispatch and combine configs at
    hidden * param_bytes, the low-latency RDMA hint, num_qps_per_rank by mode, allow_mnnvl=True."""
    Buffer = deep_ep().Buffer
    deepep_config = deepep_config or DeepEPConfig(None)
    num_nvl_bytes, num_rdma_bytes = 0, 0
    if mode in ("normal", "auto"):
        hidden_bytes = hidden * param_bytes
        for config in (deepep_config.normal_dispatch_config or Buffer.get_dispatch_config(group.size()),
                       deepep_config.normal_combine_config or Buffer.get_combine_config(group.size())):
            num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
            num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
    if mode in ("low_latency", "auto"):
        assert num_experts % group.size() == 0
        num_rdma_bytes = max(Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden,
                                                                    group.size(), num_experts), num_rdma_bytes)
    num_qps_per_rank = {"normal": deepep_config.num_sms, "low_latency": num_experts // group.size(),
                        "auto": max(deepep_config.num_sms, num_experts // group.size())}[mode]
    return Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=mode != "normal",
                  num_qps_per_rank=num_qps_per_rank, allow_mnnvl=True)


def sglang_quant(x: torch.Tensor, ue8m0: bool):
    """sglang_per_token_group_quant_fp8(x, 128, column_major_scales=ue8m0, scale_tma_aligned=ue8m0,
    scale_ue8m0=ue8m0): fp32 row-major scales on Hopper; on Blackwell UE8M0-packed int32 scales, column-major
    with the token dimension padded to 4 (16 bytes, TMA's alignment)."""
    data, scales = quantize_groups(x, round_scale=ue8m0)
    if not ue8m0:
        return data, scales
    packed = pack_ue8m0(scales)
    tokens, cols = packed.shape
    padded = (tokens + 3) // 4 * 4
    storage = torch.zeros((cols, padded), dtype=torch.int32, device=x.device)
    storage[:, :tokens] = packed.t()
    column_major = storage.t()[:tokens]
    assert column_major.stride() == (1, padded) and torch.equal(column_major, packed)
    return data, column_major


def _fp8_middle(recv, recv_idx, recv_w, rank, experts_per_rank):
    """The expert layer of an FP8 dispatch: DeepGEMM reads the FP8 rows; its bf16 output is the dequantized
    rows through the stand-in experts."""
    if isinstance(recv, tuple):
        recv = epcomm.per_token_cast_back(*recv).to(torch.bfloat16)
    return normal_experts(recv, recv_idx, recv_w, rank, experts_per_rank)


class NormalDispatcher:
    """_DeepEPDispatcherImplNormal: dispatch_a/_dispatch_core/dispatch_b and combine_a/_combine_core/
    combine_b as SGLang sequences them, the handle kept as a member."""

    def __init__(self, buffer, num_experts: int, async_finish: bool, deepep_config: DeepEPConfig | None = None):
        self.buffer, self.num_experts, self.async_finish = buffer, num_experts, async_finish
        self.config = deepep_config or DeepEPConfig(None)
        self.handle = None

    def dispatch(self, hidden_states, topk_ids, topk_weights):
        Buffer = deep_ep().Buffer
        topk_ids = topk_ids.to(torch.int64)
        previous_event = Buffer.capture() if self.async_finish else None
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
         previous_event) = self.buffer.get_dispatch_layout(topk_ids, self.num_experts, previous_event=previous_event,
                                                           async_finish=self.async_finish,
                                                           allocate_on_comm_stream=previous_event is not None)
        (recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, self.handle,
         event) = self.buffer.dispatch(
            hidden_states, topk_idx=topk_ids, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, previous_event=previous_event,
            async_finish=self.async_finish, allocate_on_comm_stream=(previous_event is not None) and self.async_finish,
            expert_alignment=128, config=self.config.normal_dispatch_config)
        event.current_stream_wait() if self.async_finish else ()
        return recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert

    def combine(self, output):
        previous_event = deep_ep().Buffer.capture() if self.async_finish else None
        combined_x, _, event = self.buffer.combine(output, self.handle, async_finish=self.async_finish,
                                                   previous_event=previous_event,
                                                   allocate_on_comm_stream=previous_event is not None,
                                                   config=self.config.normal_combine_config)
        event.current_stream_wait() if self.async_finish else ()
        self.handle = None
        return combined_x


def _normal_round(dispatcher: NormalDispatcher, inputs, hidden: int, fp8: str, tag: str) -> None:
    """One normal-mode round of a layer: quantize as SGLang does, dispatch, the experts, combine; every
    output against the oracle."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    per_rank = EXPERTS // num_ranks
    x, topk_ids, topk_weights = inputs[rank]
    xs = None
    if fp8 != "bf16":
        xs = [sglang_quant(i[0], fp8 == "ue8m0") for i in inputs]
        x = xs[rank]
    recv_x, recv_ids, recv_w, counts = dispatcher.dispatch(x, topk_ids, topk_weights)
    check_normal_dispatch(tag, recv_x, recv_ids, recv_w, counts, inputs, EXPERTS, expert_alignment=128, xs=xs)
    output = _fp8_middle(recv_x, recv_ids, recv_w, rank, per_rank)
    combined = dispatcher.combine(output)
    want = oracle_pipeline(inputs, EXPERTS, lambda rx, ri, rw, d: _fp8_middle(rx, ri, rw, d, per_rank), xs=xs)
    assert_bits(f"{tag} combined", combined, want[rank]["combined"])


def rank_sglang_normal(name: str, fp8: str, async_finish: bool, tuned: bool):
    """SGLang python/sglang/srt/layers/moe/token_dispatcher/deepep.py, _DeepEPDispatcherImplNormal with
    DeepEPBuffer.get_deepep_buffer (mode NORMAL, param_bytes 1 for FP8 output) and DeepEPConfig (default or
    --deepep-config): two layers' rounds on one Buffer, BF16 or FP8 with fp32 (Hopper) or UE8M0 column-major
    TMA-aligned (Blackwell) scales."""
    hidden = 1024
    deepep_config = DeepEPConfig(DEEPEP_CONFIG if tuned else None)
    with backend(name):
        buf = sglang_buffer(dist.group.WORLD, hidden, 2 if fp8 == "bf16" else 1, "normal", -1, EXPERTS,
                            deepep_config)
    assert not buf.low_latency_mode and buf.group_size == dist.get_world_size()
    dispatcher = NormalDispatcher(buf, EXPERTS, async_finish, deepep_config)
    for layer in range(2):
        inputs = rank_inputs(300 + layer, TOKENS, hidden, EXPERTS, TOPK)
        _normal_round(dispatcher, inputs, hidden, fp8, f"{name} {fp8} async={async_finish} layer {layer}")
    buf.destroy()
    return True


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("fp8, async_finish, tuned", [("bf16", False, False), ("bf16", True, True),
                                                      ("fp32", True, False), ("ue8m0", False, True)])
def test_sglang_normal_dispatcher(name, fp8, async_finish, tuned):
    cluster(2).run(rank_sglang_normal, name, fp8, async_finish, tuned)


class LowLatencyDispatcher:
    """_DeepEPDispatcherImplLowLatency: dispatch_a/_dispatch_core/dispatch_b and combine_a/_combine_core/
    combine_b, Hopper's FP8 options (round_scale and use_ue8m0 False), no NVFP4 and no overlap args."""

    def __init__(self, buffer, num_experts: int, num_max_dispatch_tokens_per_rank: int, use_fp8: bool,
                 return_recv_hook: bool):
        self.buffer, self.num_experts = buffer, num_experts
        self.num_max_dispatch_tokens_per_rank, self.use_fp8 = num_max_dispatch_tokens_per_rank, use_fp8
        self.return_recv_hook = return_recv_hook
        self.handle = self.packed_recv_count = None

    def dispatch_a(self, hidden_states, topk_ids):
        topk_ids = topk_ids.to(torch.int64)
        expected_m = (hidden_states.shape[0] * self.buffer.group_size * topk_ids.shape[1]
                      + self.num_experts) // self.num_experts
        fp8_opts = dict(round_scale=False, use_ue8m0=False) if self.use_fp8 else dict()
        packed_recv_hidden, self.packed_recv_count, self.handle, event, hook = self.buffer.low_latency_dispatch(
            hidden_states, topk_ids, self.num_max_dispatch_tokens_per_rank, self.num_experts, use_fp8=self.use_fp8,
            async_finish=not self.return_recv_hook, return_recv_hook=self.return_recv_hook, **fp8_opts)
        return packed_recv_hidden, self.packed_recv_count, expected_m, event, hook

    def dispatch_b(self, event, hook):
        hook() if self.return_recv_hook else event.current_stream_wait()

    def combine_a(self, hidden_states, topk_ids, topk_weights):
        combined, event, hook = self.buffer.low_latency_combine(
            x=hidden_states, topk_idx=topk_ids, topk_weights=topk_weights, handle=self.handle,
            async_finish=not self.return_recv_hook, return_recv_hook=self.return_recv_hook)
        self.packed_recv_count = self.handle = None
        return combined, event, hook

    def combine_b(self, combined, event, hook):
        hook() if self.return_recv_hook else event.current_stream_wait()
        return combined


def _ll_round(dispatcher: LowLatencyDispatcher, inputs, tag: str) -> None:
    rank = dist.get_rank()
    x, topk_ids, topk_weights = inputs[rank]
    recv, count, expected_m, event, hook = dispatcher.dispatch_a(x, topk_ids)
    handle = dispatcher.handle
    dispatcher.dispatch_b(event, hook)
    assert expected_m == (x.shape[0] * dist.get_world_size() * TOPK + EXPERTS) // EXPERTS
    want, want_combined = oracle_ll(inputs, EXPERTS, dispatcher.num_max_dispatch_tokens_per_rank, dispatcher.use_fp8)
    check_ll_dispatch(tag, recv, count, handle, want)
    combined = dispatcher.combine_b(*dispatcher.combine_a(ll_experts(recv, rank), topk_ids, topk_weights))
    check_ll_combined(tag, combined, want_combined)


def rank_sglang_low_latency(name: str, use_fp8: bool, return_recv_hook: bool):
    """SGLang python/sglang/srt/layers/moe/token_dispatcher/deepep.py, _DeepEPDispatcherImplLowLatency with
    DeepEPBuffer.get_deepep_buffer (mode LOW_LATENCY): decode steps of fewer tokens than the maximum."""
    hidden = 256
    with backend(name):
        buf = sglang_buffer(dist.group.WORLD, hidden, 1 if use_fp8 else 2, "low_latency", LL_MAX_TOKENS, EXPERTS)
    assert buf.low_latency_mode and buf.num_nvl_bytes == 0
    dispatcher = LowLatencyDispatcher(buf, EXPERTS, LL_MAX_TOKENS, use_fp8, return_recv_hook)
    for step, tokens in enumerate((LL_MAX_TOKENS, 5)):
        _ll_round(dispatcher, rank_inputs(310 + step, tokens, hidden, EXPERTS, TOPK),
                  f"{name} fp8={use_fp8} hook={return_recv_hook} step {step}")
    buf.destroy()
    return True


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("use_fp8, return_recv_hook", [(False, False), (True, False), (True, True)])
def test_sglang_low_latency_dispatcher(name, use_fp8, return_recv_hook):
    cluster(2).run(rank_sglang_low_latency, name, use_fp8, return_recv_hook)


def rank_sglang_two_batch_overlap(name: str, use_fp8: bool):
    """SGLang python/sglang/srt/layers/moe/token_dispatcher/deepep.py with two-batch overlap (two
    DeepEPDispatcher instances on the one DeepEPBuffer, return_recv_hook=True), in the order the decode
    operations strategy interleaves them: dispatch and combine_a of batch A, dispatch_a of batch B while
    A's combine is pending, A's combine_b, then B's. Two layers, each batch checked against the oracle."""
    rank, hidden = dist.get_rank(), 256
    with backend(name):
        buf = sglang_buffer(dist.group.WORLD, hidden, 1 if use_fp8 else 2, "low_latency", LL_MAX_TOKENS, EXPERTS)
    a, b = (LowLatencyDispatcher(buf, EXPERTS, LL_MAX_TOKENS, use_fp8, return_recv_hook=True) for _ in range(2))
    for layer in range(2):
        ins_a = rank_inputs(340 + 2 * layer, 12, hidden, EXPERTS, TOPK)
        ins_b = rank_inputs(341 + 2 * layer, 7, hidden, EXPERTS, TOPK)
        (xa, ida, wa), (xb, idb, wb) = ins_a[rank], ins_b[rank]
        recv_a, count_a, _, event, hook = a.dispatch_a(xa, ida)
        handle_a = a.handle
        a.dispatch_b(event, hook)
        pending_a = a.combine_a(ll_experts(recv_a, rank), ida, wa)
        recv_b, count_b, _, event_b, hook_b = b.dispatch_a(xb, idb)
        handle_b = b.handle
        combined_a = a.combine_b(*pending_a)
        b.dispatch_b(event_b, hook_b)
        combined_b = b.combine_b(*b.combine_a(ll_experts(recv_b, rank), idb, wb))
        for tag, ins, recv, count, handle, combined in (("A", ins_a, recv_a, count_a, handle_a, combined_a),
                                                         ("B", ins_b, recv_b, count_b, handle_b, combined_b)):
            want, want_combined = oracle_ll(ins, EXPERTS, LL_MAX_TOKENS, use_fp8)
            check_ll_dispatch(f"{name} TBO layer {layer} batch {tag}", recv, count, handle, want)
            check_ll_combined(f"{name} TBO layer {layer} batch {tag}", combined, want_combined)
    buf.destroy()
    return True


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("use_fp8", [False, True])
def test_sglang_two_batch_overlap(name, use_fp8):
    cluster(2).run(rank_sglang_two_batch_overlap, name, use_fp8)


def rank_sglang_auto(name: str):
    """SGLang python/sglang/srt/layers/moe/token_dispatcher/deepep.py, DeepEPDispatcher in AUTO mode: one
    Buffer sized for both modes; prefill batches take the normal dispatcher, decode batches the low-latency
    one, DeepEPBuffer.set_dispatch_mode_as_low_latency cleaning the buffer (clean_low_latency_buffer) only
    when the mode was normal."""
    hidden = 256
    with backend(name):
        buf = sglang_buffer(dist.group.WORLD, hidden, 2, "auto", LL_MAX_TOKENS, EXPERTS)
    normal = NormalDispatcher(buf, EXPERTS, async_finish=False)
    low_latency = LowLatencyDispatcher(buf, EXPERTS, LL_MAX_TOKENS, use_fp8=True, return_recv_hook=False)
    mode = None
    for step, kind in enumerate(("normal", "low_latency", "low_latency", "normal", "low_latency")):
        tag = f"{name} auto step {step} {kind}"
        if kind == "normal":
            mode = "normal"
            _normal_round(normal, rank_inputs(320 + step, TOKENS, hidden, EXPERTS, TOPK), hidden, "bf16", tag)
            continue
        if mode == "normal" and buf.low_latency_mode:
            buf.clean_low_latency_buffer(LL_MAX_TOKENS, hidden, EXPERTS)
        mode = "low_latency"
        _ll_round(low_latency, rank_inputs(320 + step, LL_MAX_TOKENS, hidden, EXPERTS, TOPK), tag)
    buf.destroy()
    return True


@pytest.mark.parametrize("name", BACKENDS)
def test_sglang_auto_mode(name):
    cluster(2).run(rank_sglang_auto, name)


def rank_sglang_ll_graph(use_fp8: bool):
    """SGLang python/sglang/srt/model_executor/cuda_graph_runner.py, CudaGraphRunner: a decode step captured
    with its MoE layers on _DeepEPDispatcherImplLowLatency (return_recv_hook False: async_finish events inside
    the capture); replays with new inputs copied into the captured ones match the oracle."""
    rank = dist.get_rank()
    hidden = 256
    dev = device()
    with backend("cuda"):
        buf = sglang_buffer(dist.group.WORLD, hidden, 1, "low_latency", LL_MAX_TOKENS, EXPERTS)
    dispatcher = LowLatencyDispatcher(buf, EXPERTS, LL_MAX_TOKENS, use_fp8, return_recv_hook=False)
    static = [t.clone() for t in rank_inputs(330, LL_MAX_TOKENS, hidden, EXPERTS, TOPK)[rank]]

    def step(x, topk_ids, topk_weights):
        recv, _, _, event, hook = dispatcher.dispatch_a(x, topk_ids)
        dispatcher.dispatch_b(event, hook)
        return dispatcher.combine_b(*dispatcher.combine_a(ll_experts(recv, rank), topk_ids, topk_weights))

    graph, combined = capture_graph(step, *static)
    for replay in range(3):
        inputs = rank_inputs(331 + replay, LL_MAX_TOKENS, hidden, EXPERTS, TOPK)
        for s, t in zip(static, inputs[rank], strict=True):
            s.copy_(t)
        graph.replay()
        torch.cuda.synchronize(dev)
        check_ll_combined(f"graph fp8={use_fp8} replay {replay}", combined, oracle_ll(inputs, EXPERTS, LL_MAX_TOKENS,
                                                                                      use_fp8)[1])
    del graph
    buf.destroy()
    return True


@pytest.mark.gpu
@ON_GPUS
@pytest.mark.parametrize("use_fp8", [False, True])
@pytest.mark.parametrize("ranks", [1, 2])
def test_sglang_low_latency_cuda_graph(use_fp8, ranks):
    cluster(ranks).run(rank_sglang_ll_graph, use_fp8)


@pytest.mark.gpu
@ON_GPUS
def test_sglang_on_one_rank():
    """The dispatchers on the kernels with a single EP rank (every token stays home)."""
    ranks = cluster(1)
    ranks.run(rank_sglang_normal, "cuda", "fp32", True, False)
    ranks.run(rank_sglang_low_latency, "cuda", True, True)
    ranks.run(rank_sglang_two_batch_overlap, "cuda", True)
    ranks.run(rank_sglang_auto, "cuda")
