"""DeepEP callers' own patterns, as they call ``deep_ep`` (the drop-in promise): SGLang's buffer sizing
for FP8 (H bytes a token, for its BF16 combine too), FP8 scales of any grouping, Megatron's
``EventOverlap(EventHandle())`` from ``deep_ep.utils``, and what a collected Buffer does (Megatron
drops its Buffer without destroy()). On GPUs (EPCOMM_TEST_BACKEND=nccl) the CUDA kernels run them;
the reference backend is the oracle.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist
from conftest import BACKEND, EpcommLog, cluster
from routing import make_inputs

import epcomm
from epcomm import Buffer
from epcomm.bench.checks import same_bits

HIDDEN, EXPERTS, TOPK, TOKENS = 1024, 16, 4, 300
# The reference backend everywhere; the CUDA kernels where the suite runs on GPUs.
BACKENDS = ["reference", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    BACKEND != "nccl", reason="CUDA kernels: run with EPCOMM_TEST_BACKEND=nccl on GPUs")])]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if BACKEND == "nccl" else torch.device("cpu")


def _assert_same_bits(names: tuple[str, ...], got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for name, a, b in zip(names, got, want, strict=True):
        assert a.shape == b.shape and same_bits(a, b), f"rank {dist.get_rank()}: {name} differs"


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
    _assert_same_bits(("recv_x", "recv_scales", "recv_idx", "recv_w", "combined", "combined_w"), *outs)
    return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_sglang_fp8_buffer_sizing(backend):
    cluster(2).run(rank_sglang_fp8_sizing, backend)


# (dtype, columns for HIDDEN = 1024, column-major): per-token, an odd count, 64-channel groups, UE8M0 packed
SCALE_GROUPINGS = [(torch.float32, 1, False), (torch.float32, 3, True), (torch.float32, 16, False),
                   (torch.int32, 2, False), (torch.int32, 5, True)]


def _scales_of(data: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
    """Scales that are a function of their token's e4m3 row (so a receiver can recompute them): column c
    from byte c % H of the row, plus c."""
    picked = data[:, torch.arange(cols, device=data.device) % data.shape[1]]
    if dtype == torch.float32:
        return picked.float() + torch.arange(cols, dtype=torch.float32, device=data.device) * 0.5
    return picked.view(torch.uint8).to(torch.int32) * 65536 + torch.arange(cols, dtype=torch.int32,
                                                                           device=data.device)


def _grouping_buffer(kind: str, num_tokens: int) -> Buffer:
    num_ranks = dist.get_world_size()
    if kind == "cuda-hierarchical":  # one rank per domain: every token crosses the slow tier
        from conftest import env_var

        from epcomm.backends.cuda.hierarchical import rdma_bytes_needed
        rdma = rdma_bytes_needed(num_tokens, HIDDEN, 1, num_ranks, 1, TOPK, max(c for _, c, _ in SCALE_GROUPINGS))
        with env_var("EPCOMM_RANKS_PER_DOMAIN", 1):
            return Buffer(dist.group.WORLD, 64 << 20, rdma, backend="cuda", strategy="hierarchical")
    return Buffer(dist.group.WORLD, 64 << 20, backend=kind)


def rank_fp8_scales_of_any_grouping(kind: str):
    """FP8 dispatch carries scales of any count, fp32 or int32, row- or column-major (DeepEP's rule): each
    received scale row is its token's, the received scales are row-major whatever the input's layout
    (DeepEP's), and every output equals the reference backend's bit for bit (combine included)."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = _device()
    x, topk_idx, weights = (t.to(dev) for t in make_inputs(23, rank, TOKENS, HIDDEN, EXPERTS, TOPK, num_ranks,
                                                           "random"))
    data = epcomm.per_token_cast_to_fp8(x)[0]
    bufs = {"reference": Buffer(dist.group.WORLD, 64 << 20, backend="reference")}
    if kind != "reference":
        bufs[kind] = _grouping_buffer(kind, TOKENS)
    for dtype, cols, col_major in SCALE_GROUPINGS:
        tag = f"rank {rank} {kind} scales {dtype} x {cols} col_major={col_major}"
        scales = _scales_of(data, dtype, cols)
        if col_major:
            scales = scales.t().contiguous().t()
        outs = []
        for buf in bufs.values():
            per_rank, per_domain, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, EXPERTS)
            (recv_data, recv_scales), recv_idx, recv_w, counts, handle, _ = buf.dispatch(
                (data, scales), num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_domain,
                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights)
            cached_data, cached_scales = buf.dispatch((data, scales), handle=handle)[0]
            assert recv_scales.dtype == dtype and recv_scales.shape == (recv_data.shape[0], cols), tag
            assert same_bits(recv_scales, _scales_of(recv_data, dtype, cols)), f"{tag}: a scale row is not its token's"
            # Row-major [rows, S] whatever the input's layout, as DeepEP returns them.
            assert recv_scales.is_contiguous() and cached_scales.is_contiguous(), f"{tag}: {recv_scales.stride()}"
            combined = buf.combine(recv_data.float().to(torch.bfloat16), handle, topk_weights=recv_w)[0]
            outs.append([recv_data, recv_scales, recv_idx, recv_w, cached_data, cached_scales, combined])
        if len(outs) > 1:
            _assert_same_bits(("recv_x", "recv_scales", "recv_idx", "recv_w", "cached recv_x", "cached scales",
                               "combined"), *outs)
    for buf in bufs.values():
        buf.destroy()
    return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_scales_of_any_grouping(backend):
    cluster(2).run(rank_fp8_scales_of_any_grouping, backend)


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
    _assert_same_bits(("recv_x", "recv_idx", "recv_w", "combined"), *outs)
    return True


@pytest.mark.gpu
@pytest.mark.skipif(BACKEND != "nccl", reason="CUDA events: run with EPCOMM_TEST_BACKEND=nccl on GPUs")
@pytest.mark.parametrize("ranks", [1, 2])
def test_megatron_event_handles(ranks):
    cluster(ranks).run(rank_megatron_events)


def rank_collected_buffers(backend: str, low_latency: bool):
    """A collected Buffer is not destroyed at once (a meeting of the peers at an arbitrary time could stall
    or break calls in flight): one holding CUDA buffers keeps them (not handed back to PyTorch while
    peers may map them) and logs a warning; the next Buffer built on the group frees them once every
    rank has collected it (Megatron drops its Buffer for a larger one without destroy()). A reference
    one goes quietly. A refused call leaves no reference cycle, so dropping the last reference
    collects the Buffer at once."""
    import gc

    from epcomm import lifecycle

    rank, dev = dist.get_rank(), _device()
    size = 64 << 20

    def new_buffer() -> Buffer:
        if low_latency:
            return Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, backend=backend)
        return Buffer(dist.group.WORLD, size, backend=backend)
    gc.collect()  # earlier tests' garbage first: only this test's Buffers are counted below
    gc.disable()  # only reference counts collect below
    try:
        base = torch.cuda.memory_allocated(dev) if backend == "cuda" else 0

        def pending(uid: str) -> bool:
            return uid in lifecycle.collected_uids()

        with EpcommLog() as log:
            buf = new_buffer()
            uid, gone = buf.uid, weakref.ref(buf)
            with pytest.raises(ValueError):  # 200-byte rows: refused
                x = torch.zeros((4, 100), dtype=torch.bfloat16, device=dev)
                if low_latency:
                    buf.low_latency_dispatch(x, torch.zeros((4, 2), dtype=torch.int64, device=dev), 4, 8)
                else:
                    buf.dispatch(x)
            del buf
        assert gone() is None, "the refused call left the Buffer in a reference cycle"
        warned = [m for m in log.messages if "without destroy()" in m]
        if backend != "cuda":
            assert not pending(uid) and not warned, log.messages
            return True
        assert pending(uid) and warned, log.messages
        assert torch.cuda.memory_allocated(dev) >= base + size, "the kept buffer went back to PyTorch"
        # Every rank collected it: the next Buffer frees it.
        nxt = new_buffer()
        assert not pending(uid), "the next Buffer did not free the collected one"
        assert torch.cuda.memory_allocated(dev) < base + size + (16 << 20), "the collected buffer was not freed"
        # Rank 0 alone collects one: kept on every rank until the others have collected it too.
        buf = new_buffer()
        uid = buf.uid
        held = None if rank == 0 else buf
        del buf
        third = new_buffer()
        assert pending(uid) == (rank == 0), "a Buffer some rank still holds was freed"
        if held is not None:
            held = None  # now every rank has collected it
        fourth = new_buffer()
        assert not pending(uid), "the next Buffer did not free a Buffer every rank has collected"
        for b in (nxt, third, fourth):
            b.destroy()
        # Megatron's order: `buf = Buffer(...)` drops the old Buffer after the new one is built, so each
        # rebuild frees the Buffer replaced before it: at most one replaced Buffer is kept.
        buf = new_buffer()
        first = buf.uid
        buf = new_buffer()
        second = buf.uid
        assert pending(first) and not pending(second)
        buf = new_buffer()
        assert not pending(first) and pending(second), "a rebuild did not free the Buffer replaced before it"
        buf.destroy()
        nxt = new_buffer()  # frees the second
        assert not pending(second)
        nxt.destroy()
    finally:
        gc.enable()
    return True


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("low_latency", [False, True], ids=["normal", "low_latency"])
def test_collected_buffers_are_freed_by_the_next_buffer(backend, low_latency):
    cluster(2).run(rank_collected_buffers, backend, low_latency)


def test_deep_ep_utils_names():
    """`from deep_ep.utils import EventHandle, EventOverlap` becomes `from epcomm.utils import ...`."""
    from epcomm.utils import EventHandle, EventOverlap

    assert EventOverlap is epcomm.EventOverlap and issubclass(EventHandle, torch.cuda.Event)
