"""The training frameworks' DeepEP calls replayed as they make them, ``import deep_ep`` and ``deep_ep.utils``
through the shim: Megatron-LM's autograd Functions around dispatch and combine
(megatron/core/transformer/moe/fused_a2a.py) and torchtitan's DeepEP ops
(torchtitan/distributed/deepep/deepep.py), forward and backward, the handle of a forward reused by the
backward. Results and gradients are checked against epcomm/oracle.py (bit for bit where the framework's own
ops are deterministic); on GPUs (EPCOMM_TEST_BACKEND=nccl) the CUDA kernels run them too.
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
    check_normal_dispatch,
    deep_ep,
    device,
    expert_scale,
    normal_experts,
    oracle_pipeline,
    rank_inputs,
)

EXPERTS, TOPK, TOKENS, HIDDEN = 8, 3, 40, 256


def get_hidden_bytes(x: torch.Tensor) -> int:
    """Megatron's and torchtitan's: H * max(element size, 2)."""
    return x.size(1) * max(x.element_size(), 2)


def size_and_get(current, group, hidden_bytes: int):
    """get_buffer of both frameworks: the larger of the dispatch and combine configs' hints; a new Buffer
    (the old one dropped, not destroyed) when there is none, the group differs or it is too small."""
    Buffer = deep_ep().Buffer
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
    if (current is None or current.group != group or current.num_nvl_bytes < num_nvl_bytes
            or current.num_rdma_bytes < num_rdma_bytes):
        current = Buffer(group, num_nvl_bytes, num_rdma_bytes)
    return current


# --------------------------------------------------------------------------------------------- Megatron
_megatron_buffer = None


def megatron_get_buffer(group, hidden_bytes: int):
    global _megatron_buffer
    _megatron_buffer = size_and_get(_megatron_buffer, group, hidden_bytes)
    return _megatron_buffer


def _previous_event(async_finish: bool):
    from deep_ep.utils import EventHandle, EventOverlap
    return EventOverlap(EventHandle()) if async_finish else None


class FusedDispatch(torch.autograd.Function):
    """Megatron's FusedDispatch: layout and dispatch forward, combine (with the probs' gradients) backward."""

    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, group, async_finish=False,
                allocate_on_comm_stream=False):
        previous_event = _previous_event(async_finish)
        buffer = megatron_get_buffer(group, get_hidden_bytes(x))
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
         event) = buffer.get_dispatch_layout(token_indices, num_experts, previous_event=previous_event,
                                             async_finish=async_finish,
                                             allocate_on_comm_stream=allocate_on_comm_stream)
        (recv_x, recv_token_indices, recv_token_probs, num_recv_tokens_per_expert_list, handle,
         after_event_overlap) = buffer.dispatch(
            x, topk_idx=token_indices, topk_weights=token_probs, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, previous_event=event, async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after_event_overlap.current_stream_wait()
        ctx.group, ctx.handle, ctx.async_finish = group, handle, async_finish
        ctx.allocate_on_comm_stream = allocate_on_comm_stream
        tokens_per_expert = torch.tensor(num_recv_tokens_per_expert_list)
        return recv_x, recv_token_indices, recv_token_probs, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_output, grad_token_indices, grad_token_probs, grad_tokens_per_expert, grad_handle):
        buffer = megatron_get_buffer(ctx.group, get_hidden_bytes(grad_output))
        previous_event = _previous_event(ctx.async_finish)
        grad_x, grad_token_probs, after_event = buffer.combine(
            grad_output.contiguous(), ctx.handle, topk_weights=grad_token_probs.float(), previous_event=previous_event,
            async_finish=ctx.async_finish, allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        if ctx.async_finish:
            after_event.current_stream_wait()
        return grad_x, None, grad_token_probs, None, None, None, None


class FusedCombine(torch.autograd.Function):
    """Megatron's FusedCombine: combine forward, a dispatch with the forward's handle backward."""

    @staticmethod
    def forward(ctx, x, group, handle, async_finish=False, allocate_on_comm_stream=False):
        previous_event = _previous_event(async_finish)
        buffer = megatron_get_buffer(group, get_hidden_bytes(x))
        combined_x, _, after_event = buffer.combine(x, handle=handle, async_finish=async_finish,
                                                    previous_event=previous_event,
                                                    allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after_event.current_stream_wait()
        ctx.handle, ctx.group, ctx.async_finish = handle, group, async_finish
        ctx.allocate_on_comm_stream = allocate_on_comm_stream
        return combined_x, None

    @staticmethod
    def backward(ctx, grad_output, previous_event=None):
        previous_event = _previous_event(ctx.async_finish)
        buffer = megatron_get_buffer(ctx.group, get_hidden_bytes(grad_output))
        grad_x, _, _, _, _, after_event = buffer.dispatch(grad_output.contiguous(), handle=ctx.handle,
                                                           previous_event=previous_event,
                                                           async_finish=ctx.async_finish,
                                                           allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        if ctx.async_finish:
            after_event.current_stream_wait()
        return grad_x, None, None, None, None


def _grads(seed: int, num_tokens: int, hidden: int = HIDDEN) -> list[torch.Tensor]:
    """Every rank's gradient of the combined output (bf16)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16).to(device())
            for _ in range(dist.get_world_size())]


def rank_megatron(name: str, async_finish: bool, allocate_on_comm_stream: bool):
    """Megatron-LM megatron/core/transformer/moe/fused_a2a.py, fused_dispatch / fused_combine (FusedDispatch,
    FusedCombine) with get_buffer: two layers forward, then backward through both; the outputs, the received
    counts and the gradients of x and of the probs against the oracle."""
    global _megatron_buffer
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    per_rank = EXPERTS // num_ranks
    _megatron_buffer = None
    deep_ep()  # the framework's module-level imports: `from deep_ep import Buffer`, `from deep_ep.utils import ...`
    from deep_ep.utils import EventOverlap
    assert EventOverlap is deep_ep().EventOverlap
    try:  # fused_a2a's probe for DeepEP's HybridEP: an ImportError means HAVE_HYBRIDEP = False
        from deep_ep import HybridEPBuffer  # noqa: F401
        have_hybridep = True
    except ImportError:
        have_hybridep = False
    assert not have_hybridep
    with backend(name):
        megatron_get_buffer(dist.group.WORLD, HIDDEN * 2)
    layers = []
    for layer in range(2):
        inputs = rank_inputs(500 + layer, TOKENS, HIDDEN, EXPERTS, TOPK)
        x0, token_indices, probs0 = inputs[rank]
        x, token_probs = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
        recv_x, recv_idx, recv_probs, tokens_per_expert, handle = FusedDispatch.apply(
            x.contiguous(), token_indices, token_probs, EXPERTS, dist.group.WORLD, async_finish,
            allocate_on_comm_stream)
        check_normal_dispatch(f"{name} layer {layer}", recv_x.detach(), recv_idx, recv_probs.detach(),
                              tokens_per_expert.tolist(), inputs, EXPERTS)
        y = normal_experts(recv_x, recv_idx, recv_probs, rank, per_rank)
        combined, _ = FusedCombine.apply(y, dist.group.WORLD, handle, async_finish, allocate_on_comm_stream)
        layers.append((inputs, x, token_probs, combined))
    grads = [_grads(510 + layer, TOKENS) for layer in range(2)]
    torch.autograd.backward([entry[3] for entry in layers], [g[rank] for g in grads])
    for layer, (inputs, x, token_probs, combined) in enumerate(layers):
        want = oracle_pipeline(inputs, EXPERTS, lambda rx, ri, rw, d: normal_experts(rx, ri, rw, d, per_rank),
                               grads=grads[layer])[rank]
        tag = f"{name} async={async_finish} layer {layer}"
        assert_bits(f"{tag} combined", combined, want["combined"])
        assert_bits(f"{tag} grad x", x.grad, want["grad_x"])
        assert_bits(f"{tag} grad probs", token_probs.grad, want["grad_w"])
    _megatron_buffer.destroy()
    _megatron_buffer = None
    return True


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("async_finish, allocate_on_comm_stream", [(False, False), (True, True)])
def test_megatron_fused_a2a(name, async_finish, allocate_on_comm_stream):
    cluster(2).run(rank_megatron, name, async_finish, allocate_on_comm_stream)


def rank_megatron_rebuilt_buffer(name: str):
    """Megatron-LM megatron/core/transformer/moe/fused_a2a.py, get_buffer growing the Buffer between layers (a
    later layer's hidden_bytes needs more): the earlier layer's backward then runs on the new Buffer with the
    handle the old one made, as DeepEP's plain-tensor handles allow. Outputs and gradients against the oracle."""
    global _megatron_buffer
    rank, per_rank = dist.get_rank(), EXPERTS // dist.get_world_size()
    _megatron_buffer = None
    deep_ep()
    layers, uids = [], []
    with backend(name):
        for layer, hidden in enumerate((HIDDEN, 2 * HIDDEN)):
            inputs = rank_inputs(530 + layer, TOKENS, hidden, EXPERTS, TOPK)
            x0, token_indices, probs0 = inputs[rank]
            x, probs = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
            recv_x, recv_idx, recv_probs, _, handle = FusedDispatch.apply(x, token_indices, probs, EXPERTS,
                                                                          dist.group.WORLD)
            combined, _ = FusedCombine.apply(normal_experts(recv_x, recv_idx, recv_probs, rank, per_rank),
                                             dist.group.WORLD, handle)
            layers.append((inputs, x, probs, combined))
            uids.append(_megatron_buffer.uid)
    assert uids[0] != uids[1], "get_buffer did not grow the Buffer"
    grads = [_grads(540 + layer, TOKENS, hidden) for layer, hidden in enumerate((HIDDEN, 2 * HIDDEN))]
    torch.autograd.backward([entry[3] for entry in layers], [g[rank] for g in grads])
    for layer, (inputs, x, probs, combined) in enumerate(layers):
        want = oracle_pipeline(inputs, EXPERTS, lambda rx, ri, rw, d: normal_experts(rx, ri, rw, d, per_rank),
                               grads=grads[layer])[rank]
        assert_bits(f"{name} layer {layer} combined", combined, want["combined"])
        assert_bits(f"{name} layer {layer} grad x", x.grad, want["grad_x"])
        assert_bits(f"{name} layer {layer} grad probs", probs.grad, want["grad_w"])
    _megatron_buffer.destroy()
    _megatron_buffer = None
    # The replaced Buffer was collected without destroy(): the next Buffer built on the group frees it, here
    # rather than in a later test that counts memory.
    with backend(name):
        deep_ep().Buffer(dist.group.WORLD, 1 << 20).destroy()
    return True


@pytest.mark.parametrize("name", BACKENDS)
def test_megatron_backward_after_buffer_growth(name):
    results = cluster(2).run(rank_megatron_rebuilt_buffer, name)
    assert results == [True, True], results


# -------------------------------------------------------------------------------------------- torchtitan
_titan_buffer = None
_handle_cache: dict = {}
_handle_counter = 0
_pending_combine_event = None


def titan_get_buffer(group, hidden_bytes: int):
    global _titan_buffer
    _titan_buffer = size_and_get(_titan_buffer, group, hidden_bytes)
    return _titan_buffer


def _next_handle_id() -> torch.Tensor:
    global _handle_counter
    _handle_counter += 1
    return torch.tensor([_handle_counter], dtype=torch.int64, device="cpu")


class TitanDispatch(torch.autograd.Function):
    """torchtitan's deepep::dispatch op: _dispatch_op_impl forward (handle cached by a CPU handle_id),
    _dispatch_setup_context, _dispatch_backward (combine of the gradients, with the scores')."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                num_tokens_per_expert):
        from deep_ep.utils import EventHandle, EventOverlap
        recv_x, recv_indices, recv_scores, recv_list, handle, after_event = _titan_buffer.dispatch(
            x=x, topk_idx=topk_idx, topk_weights=topk_weights.to(torch.float32),
            num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
            previous_event=EventOverlap(EventHandle()), async_finish=True, allocate_on_comm_stream=True)
        after_event.current_stream_wait()
        handle_id = _next_handle_id()
        _handle_cache[handle_id.item()] = handle
        ctx.input_dtype = x.dtype
        ctx.saved_handle = _handle_cache.get(handle_id.item())
        recv_num = torch.tensor(recv_list, dtype=torch.int32, device="cpu")
        return recv_x, recv_indices, recv_scores, recv_num, handle_id

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_indices, grad_recv_scores, grad_recv_num, grad_handle_id):
        from deep_ep.utils import EventHandle, EventOverlap
        if grad_recv_x is None:
            return None, None, None, None, None, None, None
        handle = ctx.saved_handle
        assert handle is not None
        grad_x, grad_scores, after_event = _titan_buffer.combine(
            x=grad_recv_x, handle=handle,
            topk_weights=grad_recv_scores.float() if grad_recv_scores is not None else None,
            previous_event=EventOverlap(EventHandle()), async_finish=True, allocate_on_comm_stream=True)
        after_event.current_stream_wait()
        grad_x = grad_x.to(ctx.input_dtype)
        grad_topk_weights = grad_scores.to(ctx.input_dtype) if grad_scores is not None else None
        return grad_x, None, grad_topk_weights, None, None, None, None


class TitanCombine(torch.autograd.Function):
    """torchtitan's deepep::combine op: _combine_op_impl forward (its event kept for sync_combine),
    _combine_setup_context (the handle popped from the cache), _combine_backward (a cached dispatch)."""

    @staticmethod
    def forward(ctx, x, handle_id):
        from deep_ep.utils import EventHandle, EventOverlap
        global _pending_combine_event
        handle = _handle_cache.get(handle_id.item())
        assert handle is not None
        combined, _, after_event = _titan_buffer.combine(x=x, handle=handle,
                                                         previous_event=EventOverlap(EventHandle()),
                                                         async_finish=True, allocate_on_comm_stream=True)
        _pending_combine_event = after_event
        ctx.saved_handle = _handle_cache.pop(handle_id.item(), None)
        return combined

    @staticmethod
    def backward(ctx, grad_combined):
        from deep_ep.utils import EventHandle, EventOverlap
        grad_x, _, _, _, _, after_event = _titan_buffer.dispatch(
            x=grad_combined, topk_idx=None, topk_weights=None, num_tokens_per_rank=None,
            num_tokens_per_rdma_rank=None, is_token_in_rank=None, num_tokens_per_expert=None,
            handle=ctx.saved_handle, previous_event=EventOverlap(EventHandle()), async_finish=True,
            allocate_on_comm_stream=True)
        after_event.current_stream_wait()
        return grad_x, None


def sync_combine() -> None:
    global _pending_combine_event
    if _pending_combine_event is not None:
        _pending_combine_event.current_stream_wait()
        _pending_combine_event = None


def _permute_tokens(hidden_states, dispatched_indices, dispatched_scores):
    mask = dispatched_indices != -1
    valid_expert_ids = dispatched_indices[mask]
    valid_scores = dispatched_scores[mask]
    sort_order = torch.argsort(valid_expert_ids, stable=True)
    permuted_indices = torch.arange(len(hidden_states), device=hidden_states.device).repeat_interleave(
        mask.sum(dim=1))[sort_order]
    return hidden_states.index_select(0, permuted_indices), valid_scores[sort_order], permuted_indices


def _unpermute_tokens(permuted_hidden_states, permuted_indices, num_tokens: int):
    hidden_dim = permuted_hidden_states.shape[1]
    out = torch.zeros((num_tokens, hidden_dim), dtype=permuted_hidden_states.dtype,
                      device=permuted_hidden_states.device)
    out.scatter_add_(0, permuted_indices.unsqueeze(1).expand(-1, hidden_dim), permuted_hidden_states)
    return out


def titan_experts(recv_x, recv_idx, recv_w, rank: int, per_rank: int) -> torch.Tensor:
    """Between torchtitan's dispatch and combine: permute by expert, scores before the experts, the grouped
    experts (group sizes from the counts), unpermute into the received rows."""
    permuted, scores, permuted_indices = _permute_tokens(recv_x, recv_idx, recv_w)
    permuted = permuted * scores.to(permuted.dtype).reshape(-1, 1)
    counts = torch.bincount(recv_idx[recv_idx >= 0], minlength=per_rank)
    experts = torch.repeat_interleave(torch.arange(per_rank, device=recv_x.device), counts) + rank * per_rank
    out = (permuted.float() * expert_scale(experts).view(-1, 1)).to(permuted.dtype)
    return _unpermute_tokens(out, permuted_indices, recv_x.shape[0])


def _close(tag: str, got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    """Bitwise where the framework's scatter_add is deterministic (CPU); within a bf16 rounding on GPUs."""
    if exact:
        assert_bits(tag, got, want)
    else:
        torch.testing.assert_close(got.float(), want.float().to(got.device), rtol=2 ** -6, atol=2 ** -6, msg=tag)


def rank_torchtitan(name: str):
    """torchtitan torchtitan/distributed/deepep/deepep.py, dispatch_tokens / combine_tokens with its ops:
    zero-score slots masked to -1, get_dispatch_layout by keyword, EventOverlap(EventHandle()) before every
    call with async_finish and allocate_on_comm_stream, the combine's event waited in sync_combine, the
    backward's cached dispatch with every routing keyword None."""
    global _titan_buffer
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    per_rank = EXPERTS // num_ranks
    exact = device().type == "cpu"
    _titan_buffer = None
    deep_ep()
    inputs = rank_inputs(520, TOKENS, HIDDEN, EXPERTS, TOPK)
    for _, _, w in inputs:  # some slots with zero score (masked_fill to -1 below)
        w[::4, 1] = 0.0
    x0, selected_experts_indices, top_scores0 = inputs[rank]
    hidden_states, top_scores = x0.clone().requires_grad_(), top_scores0.clone().requires_grad_()
    # dispatch_tokens
    selected = selected_experts_indices.contiguous().masked_fill(top_scores.detach().contiguous() == 0, -1)
    with backend(name):
        buffer = titan_get_buffer(dist.group.WORLD, get_hidden_bytes(hidden_states))
    (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
     _) = buffer.get_dispatch_layout(topk_idx=selected, num_experts=EXPERTS)
    recv_x, recv_idx, recv_scores, recv_num, handle_id = TitanDispatch.apply(
        hidden_states, selected, top_scores.contiguous().float(), num_tokens_per_rank, num_tokens_per_rdma_rank,
        is_token_in_rank, num_tokens_per_expert)
    assert recv_num.dtype == torch.int32 and recv_num.device.type == "cpu"
    assert torch.equal(recv_num.to(torch.int64), torch.bincount(recv_idx[recv_idx >= 0].cpu(), minlength=per_rank))
    # the experts, then combine_tokens and sync_combine
    combined = TitanCombine.apply(titan_experts(recv_x, recv_idx, recv_scores, rank, per_rank), handle_id)
    sync_combine()
    assert not _handle_cache, "combine's setup did not pop the handle"
    grads = _grads(521, TOKENS)
    combined.backward(grads[rank])
    masked = [(x, i.masked_fill(w == 0, -1), w) for x, i, w in inputs]
    want = oracle_pipeline(masked, EXPERTS, lambda rx, ri, rw, d: titan_experts(rx, ri, rw, d, per_rank),
                           grads=grads)[rank]
    _close(f"{name} combined", combined, want["combined"], exact)
    _close(f"{name} grad x", hidden_states.grad, want["grad_x"], exact)
    # The scores' gradient comes back in the input dtype (bf16), then autograd casts it to fp32.
    _close(f"{name} grad scores", top_scores.grad, want["grad_w"].to(torch.bfloat16).float(), exact)
    _titan_buffer.destroy()
    _titan_buffer = None
    return True


@pytest.mark.parametrize("name", BACKENDS)
def test_torchtitan_deepep_ops(name):
    cluster(2).run(rank_torchtitan, name)


@pytest.mark.gpu
@ON_GPUS
def test_training_on_one_rank():
    """Megatron's and torchtitan's replays on the kernels with a single EP rank."""
    ranks = cluster(1)
    ranks.run(rank_megatron, "cuda", True, True)
    ranks.run(rank_torchtitan, "cuda")
