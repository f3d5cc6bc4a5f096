"""DeepEP callers' own patterns, as they call ``deep_ep`` (the drop-in promise): SGLang's buffer sizing
for FP8 (H bytes a token, for its BF16 combine too), FP8 scales of any grouping, Megatron's
``EventOverlap(EventHandle())`` from ``deep_ep.utils``, and Buffers freed when collected. On GPUs
(EPCOMM_TEST_BACKEND=nccl) the CUDA kernels run them; the reference backend is the oracle.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from conftest import BACKEND, cluster
from routing import make_inputs

import epcomm
from epcomm import Buffer
from epcomm.bench.checks import same_bits

HIDDEN, EXPERTS, TOPK, TOKENS = 1024, 16, 4, 300


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if BACKEND == "nccl" else torch.device("cpu")


def _sglang_nvl_bytes(hidden_bytes: int, num_ranks: int) -> int:
    """SGLang's DeepEPBuffer: the larger hint of the dispatch and combine configs, hidden_bytes = H *
    param_bytes (1 for FP8 output)."""
    return max(config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)
               for config in (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks)))


def rank_sglang_fp8_sizing(backend: str):
    """An FP8 dispatch and a BF16 combine on a Buffer sized as SGLang sizes it for FP8; on the CUDA
    backend the rows do not fit one pass here and run in rounds. Equal to a reference Buffer sized by
    DeepEP's rule."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = _device()
    hidden, tokens = 7168, 2000  # ~3800 rows a rank; SGLang's FP8 sizing holds ~2700 BF16 combine rows
    x, topk_idx, weights = (t.to(dev) for t in make_inputs(17, rank, tokens, hidden, EXPERTS, TOPK, num_ranks,
                                                           "random"))
    x_fp8 = epcomm.per_token_cast_to_fp8(x)
    outs = []
    for buf in (Buffer(dist.group.WORLD, _sglang_nvl_bytes(hidden * 1, num_ranks), backend=backend),
                Buffer(dist.group.WORLD, _sglang_nvl_bytes(hidden * 2, num_ranks), backend="reference")):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, EXPERTS)
        (recv_x, recv_scales), recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x_fp8, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=weights)
        y = epcomm.per_token_cast_back(recv_x, recv_scales)
        combined, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w)
        outs.append([recv_x, recv_scales, recv_idx, recv_w, combined, combined_w])
        if buf.backend_name == "cuda":
            assert "rounds" in handle.backend_state, "expected the small Buffer to run in rounds"
        buf.destroy()
    for name, got, want in zip(("recv_x", "recv_scales", "recv_idx", "recv_w", "combined", "combined_w"), *outs):
        assert got.shape == want.shape and same_bits(got, want), f"rank {rank}: {name} differs"
    return True


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_sglang_fp8_buffer_sizing(backend):
    if backend == "cuda" and BACKEND != "nccl":
        pytest.skip("CUDA kernels: run with EPCOMM_TEST_BACKEND=nccl on GPUs")
    cluster(2).run(rank_sglang_fp8_sizing, backend)


def rank_scales_of_any_grouping(backend: str, columns: int, col_major: bool):
    """FP8 data with scales of another grouping than one per 128 channels (one a token, as per-token
    quantization makes; or any count): they travel with their token, as DeepEP moves them. Fresh and
    cached dispatch equal the reference backend's bit for bit."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = _device()
    x, topk_idx, weights = (t.to(dev) for t in make_inputs(23, rank, TOKENS, HIDDEN, EXPERTS, TOPK, num_ranks,
                                                           "random"))
    amax = x.float().abs().view(TOKENS, columns, -1).amax(-1).clamp(min=1e-4)
    scales = amax / 448
    data = (x.float().view(TOKENS, columns, -1) / scales.unsqueeze(-1)).view(TOKENS, -1).to(torch.float8_e4m3fn)
    if col_major:
        scales = scales.t().contiguous().t()
    outs = []
    for name in (backend, "reference"):
        buf = Buffer(dist.group.WORLD, _sglang_nvl_bytes(HIDDEN * 2, num_ranks), backend=name)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, EXPERTS)
        (recv_x, recv_scales), recv_idx, recv_w, _, handle, _ = buf.dispatch(
            (data, scales), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=weights)
        (cached_x, cached_scales), *_ = buf.dispatch((data, scales), handle=handle)
        outs.append([recv_x, recv_scales, recv_idx, recv_w, cached_x, cached_scales])
        buf.destroy()
    for name, got, want in zip(("recv_x", "recv_scales", "recv_idx", "recv_w", "cached_x", "cached_scales"), *outs):
        assert got.shape == want.shape and same_bits(got, want), f"rank {rank}: {name} differs"
    assert outs[0][1].shape[1] == columns
    return True


@pytest.mark.parametrize("backend", ["reference", "cuda"])
@pytest.mark.parametrize("columns, col_major", [(1, False), (4, True)], ids=["per-token", "per-256-col-major"])
def test_fp8_scales_of_any_grouping(backend, columns, col_major):
    if backend == "cuda" and BACKEND != "nccl":
        pytest.skip("CUDA kernels: run with EPCOMM_TEST_BACKEND=nccl on GPUs")
    cluster(2).run(rank_scales_of_any_grouping, backend, columns, col_major)


def rank_megatron_events():
    """Megatron's fused_a2a: previous_event=EventOverlap(EventHandle()), async_finish, the outputs on the
    communication stream, then after_event.current_stream_wait(); equal to plain calls of the
    reference backend."""
    from epcomm.utils import EventHandle, EventOverlap

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = _device()
    x, topk_idx, weights = (t.to(dev) for t in make_inputs(19, rank, TOKENS, HIDDEN, EXPERTS, TOPK, num_ranks,
                                                           "random"))
    nvl = _sglang_nvl_bytes(HIDDEN * 2, num_ranks)
    outs = []
    for backend in ("auto", "reference"):
        buf = Buffer(dist.group.WORLD, nvl, backend=backend)
        megatron = backend == "auto"
        previous = EventOverlap(EventHandle()) if megatron else None
        per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(
            topk_idx, EXPERTS, previous_event=previous, async_finish=megatron, allocate_on_comm_stream=False)
        recv_x, recv_idx, recv_w, counts, handle, after = buf.dispatch(
            x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            previous_event=event if megatron else None, async_finish=megatron, allocate_on_comm_stream=megatron)
        after.current_stream_wait()
        previous = EventOverlap(EventHandle()) if megatron else None
        combined, _, after = buf.combine(recv_x, handle=handle, async_finish=megatron, previous_event=previous,
                                         allocate_on_comm_stream=megatron)
        after.current_stream_wait()
        outs.append([recv_x, recv_idx, recv_w, combined])
        buf.destroy()
    for name, got, want in zip(("recv_x", "recv_idx", "recv_w", "combined"), *outs):
        assert got.shape == want.shape and same_bits(got, want), f"rank {rank}: {name} differs"
    return True


@pytest.mark.skipif(BACKEND != "nccl", reason="CUDA events: run with EPCOMM_TEST_BACKEND=nccl on GPUs")
@pytest.mark.parametrize("ranks", [1, 2])
def test_megatron_event_handles(ranks):
    cluster(ranks).run(rank_megatron_events)


def rank_collected_buffers(backend: str):
    """DeepEP's rule at collection: explicitly_destroy=False frees the Buffer (Megatron drops and
    rebuilds its Buffer); True without destroy() warns of the leak. On GPUs the kernels' buffers are
    returned to PyTorch's allocator."""
    dev = _device()
    on_gpu = backend == "cuda"  # the kernels' buffer is a PyTorch allocation; the reference backend has none
    called: list[str] = []
    real_destroy = Buffer.destroy

    def recording_destroy(self):
        called.append(self.uid)
        real_destroy(self)

    Buffer.destroy = recording_destroy
    try:
        before = torch.cuda.memory_allocated(dev) if on_gpu else 0
        buf = Buffer(dist.group.WORLD, 64 << 20, backend=backend)
        uid = buf.uid
        if on_gpu:
            assert torch.cuda.memory_allocated(dev) >= before + (64 << 20), "the Buffer's memory is not PyTorch's"
        del buf  # the last reference, at the same point on every rank
        assert called == [uid], called
        if on_gpu:
            torch.cuda.synchronize(dev)
            assert torch.cuda.memory_allocated(dev) < before + (1 << 20), "the collected Buffer's memory stayed"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kept = Buffer(dist.group.WORLD, 1 << 22, backend="reference", explicitly_destroy=True)
            del kept
        assert any(issubclass(w.category, ResourceWarning) and "without destroy()" in str(w.message)
                   for w in caught), [str(w.message) for w in caught]
        assert len(called) == 1, called
    finally:
        Buffer.destroy = real_destroy
    return True


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_collected_buffers_follow_deep_ep(backend):
    if backend == "cuda" and BACKEND != "nccl":
        pytest.skip("CUDA kernels: run with EPCOMM_TEST_BACKEND=nccl on GPUs")
    cluster(2).run(rank_collected_buffers, backend)


def test_deep_ep_utils_names():
    """`from deep_ep.utils import EventHandle, EventOverlap` becomes `from epcomm.utils import ...`."""
    from epcomm.utils import EventHandle, EventOverlap

    assert EventOverlap is epcomm.EventOverlap and issubclass(EventHandle, torch.cuda.Event)
