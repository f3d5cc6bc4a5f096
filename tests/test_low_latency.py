"""Low-latency dispatch and combine on 2-4 gloo ranks, checked against the oracle (epcomm/oracle.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import cluster
from routing import device, make_inputs

from epcomm import Buffer, oracle


def _ll_buffer(n: int, hidden: int, num_experts: int, **kwargs) -> Buffer:
    r = dist.get_world_size()
    return Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(n, hidden, r, num_experts),
                  low_latency_mode=True, backend="reference", **kwargs)


def _check_dispatch(recv_x, recv_count, handle, all_inputs, rank, num_ranks, num_experts, use_fp8, round_scale,
                    use_ue8m0, tag):
    """This rank's outputs are the oracle's, bit for bit; returns the blocks (expert, source, begin, count,
    source tokens)."""
    want = oracle.low_latency_dispatch_to(rank, [i[0] for i in all_inputs], [i[1] for i in all_inputs], num_experts,
                                          handle.num_max_dispatch_tokens_per_rank, use_fp8=use_fp8,
                                          round_scale=round_scale, use_ue8m0=use_ue8m0)
    rows = []
    for e in range(num_experts // num_ranks):
        for src in range(num_ranks):
            word, want_word = int(handle.layout_range[e, src]), int(want.layout_range[e, src])
            begin, cnt = word >> 32, word & 0xFFFFFFFF
            assert word == want_word, f"{tag} expert {e} src {src}: {cnt} rows at {begin}, want " \
                                      f"{want_word & 0xFFFFFFFF} at {want_word >> 32}"
            block = slice(begin, begin + cnt)
            assert torch.equal(handle.src_info[e, block], want.src_info[e, block]), tag
            if use_fp8:
                assert torch.equal(recv_x[0][e, block].view(torch.uint8), want.x[0][e, block].view(torch.uint8)), tag
                assert torch.equal(recv_x[1][e, block], want.x[1][e, block]), tag
            else:
                assert torch.equal(recv_x[e, block].view(torch.int16), want.x[e, block].view(torch.int16)), tag
            rows.append((e, src, begin, cnt, want.src_info[e, block].to(torch.int64)))
        assert int(recv_count[e]) == int(want.count[e]), tag
    if use_fp8:
        n_rows = recv_x[0].shape[1]
        assert recv_x[1].stride(1) == 1 or recv_x[1].shape[2] == 1, f"{tag}: scales not column-major"
        assert recv_x[1].dtype == (torch.int32 if use_ue8m0 else torch.float32), tag
    else:
        n_rows = recv_x.shape[1]
    assert n_rows == handle.num_max_dispatch_tokens_per_rank * num_ranks, tag
    return rows


def rank_low_latency(tokens_per_rank, n, hidden, num_experts, num_topk, routing, seed, use_fp8, round_scale,
                     use_ue8m0, use_hook, zero_copy, use_out):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    tag = (f"rank={rank} R={num_ranks} T={tokens_per_rank} N={n} H={hidden} E={num_experts} K={num_topk} "
           f"routing={routing} fp8={use_fp8} round={round_scale} ue8m0={use_ue8m0} hook={use_hook}")
    all_inputs = [make_inputs(seed, r, tokens_per_rank[r], hidden, num_experts, num_topk, num_ranks, routing)
                  for r in range(num_ranks)]
    x, topk_idx, topk_weights = all_inputs[rank]
    dev = device()
    buf = _ll_buffer(n, hidden, num_experts)
    e_local = num_experts // num_ranks
    recv_stats = torch.zeros(e_local, dtype=torch.int32, device=dev)
    wait_stats = torch.zeros(num_ranks, dtype=torch.int64, device=dev)
    recv_x, recv_count, handle, _, hook = buf.low_latency_dispatch(
        x.to(dev), topk_idx.to(dev), n, num_experts, cumulative_local_expert_recv_stats=recv_stats,
        dispatch_wait_recv_cost_stats=wait_stats, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
        return_recv_hook=use_hook)
    if use_hook:
        assert hook is not None, tag
        hook()
    else:
        assert hook is None, tag
    recv_x = (recv_x[0].cpu(), recv_x[1].cpu()) if use_fp8 else recv_x.cpu()
    recv_count, recv_stats, wait_stats = recv_count.cpu(), recv_stats.cpu(), wait_stats.cpu()
    handle_cpu = type("H", (), {"layout_range": handle.layout_range.cpu(), "src_info": handle.src_info.cpu(),
                                "num_max_dispatch_tokens_per_rank": handle.num_max_dispatch_tokens_per_rank})
    rows = _check_dispatch(recv_x, recv_count, handle_cpu, all_inputs, rank, num_ranks, num_experts, use_fp8,
                           round_scale, use_ue8m0, tag)
    assert torch.equal(recv_stats, recv_count), tag
    assert bool((wait_stats >= 0).all()), tag

    # Expert "compute": each row becomes its source token's x times (global expert + 1) / 2.
    y_host = torch.full((e_local, n * num_ranks, hidden), float("nan"), dtype=torch.bfloat16)
    for e, src, begin, cnt, tokens in rows:  # rows past recv_count stay NaN: they must never be read
        g = rank * e_local + e
        y_host[e, begin:begin + cnt] = (all_inputs[src][0][tokens].float() * (g + 1) / 2).to(torch.bfloat16)
    if zero_copy:  # the combine reads the buffer; x gives only the shape (NaN: read, it would show)
        buf.get_next_low_latency_combine_buffer(handle).copy_(y_host)
        y = torch.full_like(y_host, float("nan"), device=dev)
    else:
        y = y_host.to(dev)
    out = torch.full((x.shape[0], hidden), float("nan"), dtype=torch.bfloat16, device=dev) if use_out else None
    combined, _, hook = buf.low_latency_combine(y, topk_idx.to(dev), topk_weights.to(dev), handle,
                                                zero_copy=zero_copy, return_recv_hook=use_hook, out=out)
    if use_hook:
        hook()
    if use_out:
        assert combined.data_ptr() == out.data_ptr(), tag
    combined = combined.cpu()
    ref = torch.zeros((x.shape[0], hidden), dtype=torch.float64)
    for k in range(num_topk):
        g = topk_idx[:, k]
        ok = g >= 0
        term = (x.float() * (g.clamp(min=0).float() + 1).unsqueeze(1) / 2).to(torch.bfloat16).double()
        ref[ok] += topk_weights[ok, k].double().unsqueeze(1) * term[ok]
    err = (combined.double() - ref).abs()
    assert bool((err <= ref.abs() * 2 ** -7 + 1e-5).all()), f"{tag}: max err {err.max()}"
    return int(recv_count.sum())


LL_CASES = [
    # (ranks, tokens per rank, N, hidden, experts, topk, routing)
    (2, [8, 5], 8, 512, 8, 4, "random"),
    (4, [16, 0, 3, 16], 16, 512, 16, 4, "random"),
    (4, [6, 6, 6, 6], 6, 512, 8, 2, "imbalanced"),
    (4, [5, 5, 5, 5], 8, 512, 16, 3, "empty_rank"),
    (3, [4, 4, 4], 4, 1024, 6, 2, "one_expert"),
    (2, [0, 0], 4, 512, 4, 2, "random"),
    (2, [1, 1], 1, 512, 4, 4, "random"),
]


@pytest.mark.parametrize("case", LL_CASES, ids=lambda c: f"R{c[0]}-T{sum(c[1])}-{c[6]}")
@pytest.mark.parametrize("mode", ["fp8", "bf16", "fp8-round", "fp8-ue8m0"])
def test_low_latency(case, mode):
    ranks, tokens, n, hidden, experts, topk, routing = case
    use_fp8 = mode != "bf16"
    cluster(ranks).run(rank_low_latency, tokens, n, hidden, experts, topk, routing,
                       seed=LL_CASES.index(case) + 50, use_fp8=use_fp8, round_scale="round" in mode or "ue8m0" in mode,
                       use_ue8m0="ue8m0" in mode, use_hook=False, zero_copy=False, use_out=False)


@pytest.mark.parametrize("ranks", [2, 4])
def test_low_latency_hook_zero_copy_out(ranks):
    cluster(ranks).run(rank_low_latency, [7] * ranks, 8, 512, 4 * ranks, 3, "random", seed=9, use_fp8=True,
                       round_scale=False, use_ue8m0=False, use_hook=True, zero_copy=True, use_out=True)


def rank_double_buffering(n, hidden, num_experts):
    """Two micro-batches in flight (hooks pending) is allowed; each result stays intact."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    buf = _ll_buffer(n, hidden, num_experts)
    dev = device()
    batches = [tuple(t.to(dev) for t in make_inputs(70 + b, rank, n, hidden, num_experts, 2, num_ranks, "random"))
               for b in range(2)]
    results = []
    for x, idx, _ in batches:
        results.append(buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False, return_recv_hook=True))
    for *_, hook in results:
        hook()
    for (x, idx, w), (recv_x, _, handle, _, _) in zip(batches, results):
        out, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
        # Identity experts: the combine is sum_k w_k * x over non-negative slots.
        ref = (w * (idx >= 0)).sum(1, keepdim=True).double() * x.double()
        assert torch.allclose(out.double(), ref, rtol=2 ** -7, atol=1e-5), f"rank {rank}"
    # A clean between calls restarts them; the calls go on as before.
    x, idx, _ = batches[0]
    buf.clean_low_latency_buffer(n, hidden, num_experts)
    buf.low_latency_dispatch(x, idx, n, num_experts)
    return True


def test_double_buffering_and_clean():
    cluster(2).run(rank_double_buffering, 6, 256, 8)


def rank_mask(n, hidden, num_experts):
    """Masked ranks are skipped: outputs equal the reference restricted to live ranks."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = device()
    buf = _ll_buffer(n, hidden, num_experts, enable_shrink=True)
    buf.low_latency_update_mask_buffer(num_ranks - 1, True)
    status = torch.zeros(num_ranks, dtype=torch.int32, device=dev)
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * (num_ranks - 1) + [1]
    x, idx, w = (t.to(dev) for t in make_inputs(90, rank, n, hidden, num_experts, 3, num_ranks, "random"))
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
    if rank == num_ranks - 1:
        assert int(recv_count.sum()) == 0
    out, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
    e_local = num_experts // num_ranks
    live = (idx >= 0) & (idx // e_local != num_ranks - 1)
    ref = (w * live).sum(1, keepdim=True).double() * x.double()
    assert torch.allclose(out.double(), ref, rtol=2 ** -7, atol=1e-5), f"rank {rank}"
    buf.low_latency_clean_mask_buffer()
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * num_ranks
    return True


def test_failed_rank_mask():
    cluster(4).run(rank_mask, 8, 256, 16)


def rank_combine_before_hook():
    """A combine whose dispatch has not been received (hook not called) is refused on every rank, and the
    Buffer goes on: after the hook the combine returns the oracle's result."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = device()
    n, hidden, num_experts = 8, 256, 4 * num_ranks
    buf = _ll_buffer(n, hidden, num_experts)
    inputs = [make_inputs(51, r, n, hidden, num_experts, 2, num_ranks, "random") for r in range(num_ranks)]
    x, idx, w = (t.to(dev) for t in inputs[rank])
    recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False,
                                                          return_recv_hook=True)
    with pytest.raises(ValueError, match="call its receive hook first"):
        buf.low_latency_combine(recv_x, idx, w, handle)
    hook()
    out = buf.low_latency_combine(recv_x, idx, w, handle)[0]
    # Every rank's dispatch outputs, returned unchanged (identity experts), as the oracle combines them.
    sent = oracle.low_latency_dispatch([i[0] for i in inputs], [i[1] for i in inputs], num_experts, n, use_fp8=False)
    want = oracle.low_latency_combine([d.x for d in sent], [d.src_info for d in sent],
                                      [d.layout_range for d in sent], [i[1] for i in inputs],
                                      [i[2] for i in inputs], num_experts)[rank]
    assert torch.equal(out.cpu().view(torch.int16), want.cpu().view(torch.int16)), f"rank {rank}"
    buf.destroy()


def test_combine_before_hook_is_refused():
    cluster(2).run(rank_combine_before_hook)
