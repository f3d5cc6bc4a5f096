"""What DeepEP V1 callers read and do beyond the call signatures, checked as its own tests check it:
handles indexed as DeepEP's tuples (``handle[0]`` after a normal dispatch, ``handle[0][i]`` and
``handle[1][i]`` after a low-latency one), no handle from a cached dispatch, row-major received FP8
scales, low-latency calls right after normal-mode ones, ``get_local_buffer_tensor`` as a view of the
communication memory, and every path under a BF16 default dtype. On GPUs (EPCOMM_TEST_BACKEND=nccl)
the CUDA kernels run them too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import BACKEND, cluster, env_var
from routing import make_inputs

import epcomm
from epcomm import Buffer, oracle

HIDDEN, EXPERTS, TOPK, TOKENS = 256, 8, 3, 40
BACKENDS = ["reference", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    BACKEND != "nccl", reason="CUDA kernels: run with EPCOMM_TEST_BACKEND=nccl on GPUs")])]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if BACKEND == "nccl" else torch.device("cpu")


def _rank_tagged_inputs(seed: int, dev: torch.device, num_tokens: int = TOKENS):
    """DeepEP's test inputs: every channel of x is the rank (so a received row names its source), and the
    routing of make_inputs."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    _, topk_idx, weights = make_inputs(seed, rank, num_tokens, HIDDEN, EXPERTS, TOPK, num_ranks, "random")
    x = torch.full((num_tokens, HIDDEN), float(rank), dtype=torch.bfloat16, device=dev)
    return x, topk_idx.to(dev), weights.to(dev)


def _all_counts(seed: int, num_ranks: int) -> torch.Tensor:
    """[R, R] rows each source sends each destination (int64, CPU): the oracle's, from every rank's routing
    of _rank_tagged_inputs(seed)."""
    routings = [make_inputs(seed, r, TOKENS, HIDDEN, EXPERTS, TOPK, num_ranks, "random")[1] for r in range(num_ranks)]
    return oracle.count_matrix([oracle.dispatch_layout(idx, EXPERTS, num_ranks)[3] for idx in routings])


def rank_normal_handle(backend: str, num_worst_tokens: bool):
    """handle[0] is DeepEP's rank_prefix_matrix: [R, R] int32 on the Buffer's device, the inclusive sum over
    sources of the rows each rank receives; check_data of DeepEP's test_intranode.py passes with it.
    handle[4] is is_token_in_rank; an entry of DeepEP's kernels raises NotImplementedError naming its
    index; an index past the tuple raises IndexError. A cached dispatch returns no handle."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = _device()
    x, topk_idx, weights = _rank_tagged_inputs(31, dev)
    buf = Buffer(dist.group.WORLD, 32 << 20, backend=backend)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, EXPERTS)
    worst = TOKENS * num_ranks if num_worst_tokens else 0
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=weights, num_worst_tokens=worst)
    want = _all_counts(31, num_ranks).cumsum(0).to(torch.int32)
    rank_prefix_matrix = handle[0]
    assert len(handle) == 6 and handle[-6] is rank_prefix_matrix
    assert rank_prefix_matrix.dtype == torch.int32 and rank_prefix_matrix.device == x.device
    assert torch.equal(rank_prefix_matrix.cpu(), want), f"rank {rank}: {rank_prefix_matrix} vs {want}"
    # DeepEP's check_data: the rows from source i sit in [prefix[i-1][rank], prefix[i][rank]).
    start = 0
    for i in range(num_ranks):
        end = rank_prefix_matrix[i][rank].item()
        assert (recv_x[start:end].float() - i).abs().sum().item() == 0, f"rank {rank}: rows of source {i}"
        start = end
    assert handle[4] is in_rank and handle[-2] is in_rank
    for i, name in ((1, "channel_prefix_matrix"), (2, "recv_channel_prefix_matrix"), (3, "recv_src_idx"),
                    (5, "send_head")):
        with pytest.raises(NotImplementedError, match=rf"^handle\[{i}\] \({name}\)"):
            handle[i]
    with pytest.raises(NotImplementedError, match=r"^handle\[1\]"):
        tuple(handle)
    for i in (6, -7):
        with pytest.raises(IndexError, match=rf"index {i} out of range"):
            handle[i]
    with pytest.raises(TypeError):
        handle["0"]
    # A cached dispatch: DeepEP's (recv_x, None, None, None, None, event).
    cached = buf.dispatch(x, handle=handle)
    assert cached[1:5] == (None, None, None, None), cached[1:5]
    assert torch.equal(cached[0].view(torch.int16), recv_x.view(torch.int16))
    # The handle's named attributes still serve combine.
    combined, _, _ = buf.combine(recv_x, handle)
    assert torch.equal(combined.float(), x.float() * in_rank.sum(1, keepdim=True)), f"rank {rank}: combine"
    buf.destroy()
    return True


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_worst_tokens", [False, True], ids=["exact", "worst"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_normal_handle_indexes_as_deep_ep(backend, num_worst_tokens, ranks):
    cluster(ranks).run(rank_normal_handle, backend, num_worst_tokens)


def rank_internode_handle():
    """With more than one scale-up domain the handle follows DeepEP's internode tuple (ten entries):
    handle[0] is is_token_in_rank and handle[-4] (recv_gbl_rank_prefix_sum) the inclusive sum of the rows
    received from each source, as DeepEP's test_internode.py reads them."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    x, topk_idx, weights = _rank_tagged_inputs(37, torch.device("cpu"))
    with env_var("EPCOMM_RANKS_PER_DOMAIN", 1):
        buf = Buffer(dist.group.WORLD, 32 << 20, backend="reference")
    assert buf.num_domains == num_ranks
    per_rank, per_domain, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, EXPERTS)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_domain,
                                              is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                              topk_idx=topk_idx, topk_weights=weights)
    assert len(handle) == 10 and handle[0] is in_rank
    prefix = handle[-4]
    want = _all_counts(37, num_ranks)[:, rank].cumsum(0).to(torch.int32)
    assert prefix.dtype == torch.int32 and torch.equal(prefix, want), f"rank {rank}: {prefix} vs {want}"
    start = 0
    for i in range(num_ranks):
        end = prefix[i].item()
        assert (recv_x[start:end].float() - i).abs().sum().item() == 0, f"rank {rank}: rows of source {i}"
        start = end
    with pytest.raises(NotImplementedError, match=r"^handle\[4\] \(recv_rdma_rank_prefix_sum\)"):
        handle[4]
    buf.destroy()
    return True


def test_internode_handle_indexes_as_deep_ep():
    cluster(2).run(rank_internode_handle)


def rank_low_latency_handle(backend: str):
    """DeepEP's test_low_latency.py checks: handle[0][i] (src_info) and handle[1][i] (layout_range) of local
    expert i. The low 32 bits of layout_range sum to the expert's count, each source's block holds its
    rows, and src_info names each row's source token (x's last 128 channels carry the token index)."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = _device()
    n, hidden, num_experts = 16, 256, 4 * num_ranks
    e_local = num_experts // num_ranks
    _, topk_idx, weights = make_inputs(41, rank, n, hidden, num_experts, TOPK, num_ranks, "random")
    topk_idx, weights = topk_idx.to(dev), weights.to(dev)
    x = torch.full((n, hidden), float(rank - 8), dtype=torch.bfloat16, device=dev)
    x[:, -128:] = torch.arange(n, dtype=torch.bfloat16, device=dev).view(-1, 1)
    all_idx = [torch.empty_like(topk_idx) for _ in range(num_ranks)]
    dist.all_gather(all_idx, topk_idx)
    all_idx = torch.stack(all_idx)
    buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(n, hidden, num_ranks, num_experts),
                 low_latency_mode=True, backend=backend)
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, n, num_experts, use_fp8=False)
    assert len(handle) == 5
    assert (handle[2], handle[3], handle[4], handle[-1]) == (n, hidden, num_experts, num_experts)
    assert handle[0].dtype == torch.int32 and tuple(handle[0].shape) == (e_local, n * num_ranks)
    assert handle[1].dtype == torch.int64 and tuple(handle[1].shape) == (e_local, num_ranks)
    int_mask = (1 << 32) - 1
    for i in range(e_local):
        expert_id = rank * e_local + i
        count, src_info, layout_range = recv_count[i].item(), handle[0][i], handle[1][i]
        assert count == (layout_range & int_mask).sum().item() == (all_idx == expert_id).sum().item()
        rows = recv_x[i, :count]
        assert (rows[:, -128:].float() - src_info[:count].view(-1, 1).float()).abs().sum().item() == 0
        for j in range(num_ranks):
            begin, num = (layout_range[j] >> 32).item(), (layout_range[j] & int_mask).item()
            assert num == (all_idx[j] == expert_id).sum().item()
            assert (rows[begin:begin + num, :-128].float() - (j - 8)).abs().sum().item() == 0
    with pytest.raises(IndexError):
        handle[5]
    combined, _, _ = buf.low_latency_combine(recv_x, topk_idx, weights, handle)
    want = x.float() * (weights * (topk_idx >= 0)).sum(1, keepdim=True)
    assert torch.allclose(combined.float(), want, rtol=2 ** -7, atol=1e-3), f"rank {rank}: combine"
    buf.destroy()
    return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_low_latency_handle_indexes_as_deep_ep(backend):
    cluster(2).run(rank_low_latency_handle, backend)


def rank_fp8_column_major_scales(backend: str):
    """DeepGEMM's TMA-aligned scales ([T, S] with strides (1, T)), as vLLM and SGLang pass them: the received
    scales are [num_recv, S] row-major and contiguous, as DeepEP returns them, with the same values as for
    row-major input; a cached dispatch does the same."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = _device()
    x, topk_idx, weights = make_inputs(43, rank, TOKENS, HIDDEN, EXPERTS, TOPK, num_ranks, "random")
    data, scales = epcomm.per_token_cast_to_fp8(x.to(dev))
    column_major = scales.t().contiguous().t()
    assert column_major.stride() == (1, TOKENS)
    buf = Buffer(dist.group.WORLD, 32 << 20, backend=backend)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx.to(dev), EXPERTS)
    outs = []
    for s in (scales, column_major):
        (recv_data, recv_scales), _, _, _, handle, _ = buf.dispatch(
            (data, s), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        cached_scales = buf.dispatch((data, s), handle=handle)[0][1]
        for got in (recv_scales, cached_scales):
            assert got.is_contiguous() and got.shape == (recv_data.shape[0], scales.shape[1]), got.stride()
        outs.append((recv_scales, cached_scales))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    buf.destroy()
    return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_column_major_scales_come_back_row_major(backend):
    cluster(2).run(rank_fp8_column_major_scales, backend)


def rank_low_latency_after_normal(backend: str):
    """LMDeploy's order: a low-latency Buffer used in normal mode, then low-latency calls with no
    clean_low_latency_buffer in between (DeepEP allows it inside a node), then normal mode again."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = _device()
    n, num_experts = 16, 4 * num_ranks
    buf = Buffer(dist.group.WORLD, 32 << 20, Buffer.get_low_latency_rdma_size_hint(n, HIDDEN, num_ranks, num_experts),
                 low_latency_mode=True, backend=backend)
    x, topk_idx, weights = (t.to(dev) for t in make_inputs(47, rank, n, HIDDEN, num_experts, TOPK, num_ranks,
                                                           "random"))
    for _ in range(2):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
        recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert)
        combined, _, _ = buf.combine(recv_x, handle)
        assert torch.equal(combined.float(), x.float() * in_rank.sum(1, keepdim=True)), f"rank {rank}: combine"
        for use_fp8 in (False, True):
            recv, _, ll_handle, _, _ = buf.low_latency_dispatch(x, topk_idx, n, num_experts, use_fp8=use_fp8)
            y = epcomm.per_token_cast_back(recv[0].view(-1, HIDDEN), recv[1].reshape(-1, HIDDEN // 128)).view(
                recv[0].shape).to(torch.bfloat16) if use_fp8 else recv
            out, _, _ = buf.low_latency_combine(y, topk_idx, weights, ll_handle)
            want = x.float() * (weights * (topk_idx >= 0)).sum(1, keepdim=True)
            tolerance = 0.07 if use_fp8 else 2 ** -7
            assert torch.allclose(out.float(), want, rtol=tolerance, atol=tolerance), f"rank {rank} fp8={use_fp8}"
    buf.destroy()
    return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_low_latency_after_normal_mode_without_clean(backend):
    cluster(2).run(rank_low_latency_after_normal, backend)


def rank_local_buffer_tensor(backend: str):
    """get_local_buffer_tensor: DeepEP's arguments (dtype, size, byte offset, use_rdma_buffer); views of the
    same memory each call (no copy, no second allocation). On the CUDA backend the view is the kernels'
    memory itself, and vLLM's reset (zeroing the RDMA view on every rank between calls) leaves the
    low-latency calls working."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = _device()
    n, num_experts = 16, 4 * num_ranks
    rdma = Buffer.get_low_latency_rdma_size_hint(n, HIDDEN, num_ranks, num_experts)
    buf = Buffer(dist.group.WORLD, 32 << 20, rdma, low_latency_mode=True, backend=backend)
    whole = buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True)
    assert whole.dtype == torch.int8 and whole.numel() == rdma and whole.device == dev
    words = buf.get_local_buffer_tensor(torch.int32, torch.Size([4, 2]), offset=64, use_rdma_buffer=True)
    assert words.shape == (4, 2) and words.data_ptr() == whole.data_ptr() + 64
    nvl = buf.get_local_buffer_tensor(torch.bfloat16)
    assert nvl.numel() == (32 << 20) // 2 and nvl.data_ptr() != whole.data_ptr()
    assert buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True).data_ptr() == whole.data_ptr()
    if backend == "cuda":
        assert whole.data_ptr() == buf.low_latency_ops.local_memory(True).data_ptr()
        assert nvl.data_ptr() == buf.normal_ops.local_memory(False).data_ptr()
    with pytest.raises(ValueError, match="multiple of"):
        buf.get_local_buffer_tensor(torch.int32, offset=2)
    with pytest.raises(ValueError, match="needs"):
        buf.get_local_buffer_tensor(torch.int8, torch.Size([rdma]), offset=1, use_rdma_buffer=True)
    x, topk_idx, weights = (t.to(dev) for t in make_inputs(53, rank, n, HIDDEN, num_experts, TOPK, num_ranks,
                                                           "random"))
    want = x.float() * (weights * (topk_idx >= 0)).sum(1, keepdim=True)
    for step in range(3):
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, n, num_experts, use_fp8=False)
        out, _, _ = buf.low_latency_combine(recv, topk_idx, weights, handle)
        assert torch.allclose(out.float(), want, rtol=2 ** -7, atol=1e-3), f"rank {rank} step {step}"
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dist.barrier()  # every rank's calls are done: the reset may zero the memory
        whole.zero_()
        dist.barrier()
    buf.destroy()
    return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_local_buffer_tensor_views_the_buffer(backend):
    cluster(2).run(rank_local_buffer_tensor, backend)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype.is_floating_point else t


def rank_bf16_default_dtype(backend: str, strategy: str):
    """DeepEP's tests set torch.set_default_dtype(torch.bfloat16) (and the default device): every Buffer
    path (layout, dispatch BF16 and FP8, cached, combine, low latency with a hook) still builds and returns
    what it returns under the stock defaults, bit for bit."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = _device()
    n, num_experts = 16, EXPERTS

    x, topk_idx, weights = (t.to(dev) for t in make_inputs(59, rank, n, HIDDEN, num_experts, TOPK, num_ranks,
                                                           "random"))

    def run_all() -> list[torch.Tensor]:
        with env_var("EPCOMM_RANKS_PER_DOMAIN", 1 if strategy == "hierarchical" else num_ranks):
            buf = Buffer(dist.group.WORLD, 32 << 20, Buffer.get_low_latency_rdma_size_hint(n, HIDDEN, num_ranks,
                                                                                           num_experts),
                         low_latency_mode=True, backend=backend, strategy=strategy)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
        outs = [per_rank, per_expert, in_rank]
        for x_in in (x, epcomm.per_token_cast_to_fp8(x)):
            recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
                x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk_idx, topk_weights=weights)
            cached = buf.dispatch(x_in, handle=handle)[0]
            y = recv_x if isinstance(recv_x, torch.Tensor) else epcomm.per_token_cast_back(*recv_x).to(torch.bfloat16)
            combined, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w)
            outs += [*(recv_x if isinstance(recv_x, tuple) else (recv_x,)), recv_idx, recv_w, handle[0],
                     *(cached if isinstance(cached, tuple) else (cached,)), combined, combined_w,
                     torch.tensor(counts, dtype=torch.int64, device="cpu")]
        for use_fp8 in (False, True):
            recv, count, ll_handle, _, hook = buf.low_latency_dispatch(x, topk_idx, n, num_experts, use_fp8=use_fp8,
                                                                       return_recv_hook=True)
            hook()
            y = epcomm.per_token_cast_back(recv[0].view(-1, HIDDEN), recv[1].reshape(-1, HIDDEN // 128)).view(
                recv[0].shape).to(torch.bfloat16) if use_fp8 else recv
            out, _, _ = buf.low_latency_combine(y, topk_idx, weights, ll_handle)
            # Rows past an expert's count hold whatever the memory held (as in DeepEP): not compared.
            for e, c in enumerate(count.tolist()):
                outs += [t[e, :c] for t in (*(recv if use_fp8 else (recv,)), ll_handle[0])]
            outs += [count, ll_handle[1], out]
        buf.destroy()
        return outs

    want = run_all()
    saved_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device(dev)  # the CPU here (named all the same), the rank's GPU under NCCL
    try:
        got = run_all()
    finally:
        torch.set_default_dtype(saved_dtype)
        torch.set_default_device(None)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"rank {rank} output {i}: {a.dtype} {a.shape} vs {b.shape}"
        assert torch.equal(_bits(a), _bits(b)), f"rank {rank} output {i}"
    return True


@pytest.mark.parametrize("backend, strategy", [*(("reference", s) for s in ("alltoall", "allgather", "hierarchical")),
                                               pytest.param("cuda", "alltoall", marks=BACKENDS[1].marks)])
def test_paths_under_bf16_default_dtype(backend, strategy):
    cluster(2).run(rank_bf16_default_dtype, backend, strategy)
