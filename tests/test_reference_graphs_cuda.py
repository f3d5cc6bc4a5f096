"""The portable path captured in a CUDA graph on NCCL (one GPU, one rank: ranks that share a GPU run on
gloo, which no graph captures): normal-mode layout, dispatch with num_worst_tokens and combine, and
low-latency dispatch and combine, replayed on new inputs written into the captured tensors, each replay
checked bit for bit against the oracle."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import BACKEND, cluster
from replay import ll_experts
from routing import make_inputs

from epcomm import Buffer, Config, oracle

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(BACKEND != "nccl", reason="CUDA graphs: run with EPCOMM_TEST_BACKEND=nccl on a GPU")]


def rank_low_latency_graph(n: int, hidden: int, num_experts: int, num_topk: int, use_fp8: bool) -> int:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(n, hidden, num_ranks, num_experts),
                 low_latency_mode=True, backend="reference")

    def everyone(seed: int):
        return [make_inputs(seed, r, n, hidden, num_experts, num_topk, num_ranks, "random") for r in range(num_ranks)]

    static = [t.to(dev) for t in everyone(1)[rank]]  # x, topk_idx, topk_weights: the graph's inputs

    def step():
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(static[0], static[1], n, num_experts,
                                                                    use_fp8=use_fp8)
        combined, _, _ = buf.low_latency_combine(ll_experts(recv_x, rank), static[1], static[2],
                                                 handle)
        return recv_count, handle, combined

    step()  # eager first: the ranks agree on the shapes, NCCL sets up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_count, handle, combined = step()
    checked = 0
    for seed in (2, 3, 4):
        inputs = everyone(seed)
        for t, new in zip(static, inputs[rank], strict=True):
            t.copy_(new)
        combined.fill_(float("nan"))  # poisoned: the replay must write every row
        graph.replay()
        torch.cuda.synchronize()
        xs, idxs, ws = ([i[k] for i in inputs] for k in range(3))
        got = oracle.low_latency_dispatch(xs, idxs, num_experts, n, use_fp8=use_fp8)
        want = got[rank]
        tag = f"rank {rank} seed {seed} fp8={use_fp8}"
        assert torch.equal(recv_count.cpu(), want.count.to(recv_count.dtype)), f"{tag}: recv_count"
        assert torch.equal(handle.layout_range.cpu(), want.layout_range), f"{tag}: layout_range"
        ys = [ll_experts(d.x, r) for r, d in enumerate(got)]
        want_combined = oracle.low_latency_combine(ys, [d.src_info for d in got], [d.layout_range for d in got],
                                                   idxs, ws, num_experts)[rank]
        assert torch.equal(combined.cpu().view(torch.int16), want_combined.view(torch.int16)), f"{tag}: combined"
        checked += int(want.count.sum())
    return checked


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_low_latency_graph_replays_on_new_inputs(use_fp8):
    assert cluster(1).run(rank_low_latency_graph, 16, 1024, 8, 4, use_fp8)[0] > 0


def rank_normal_graph(tokens: int, hidden: int, num_experts: int, num_topk: int) -> int:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    worst = tokens * num_ranks
    buf = Buffer(dist.group.WORLD, Config().get_nvl_buffer_size_hint(hidden * 2, num_ranks), backend="reference")

    def everyone(seed: int):
        return [make_inputs(seed, r, tokens, hidden, num_experts, num_topk, num_ranks, "random")
                for r in range(num_ranks)]

    static = [t.to(dev) for t in everyone(1)[rank]]

    def step():
        layout = buf.get_dispatch_layout(static[1], num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
            static[0], num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
            topk_idx=static[1], topk_weights=static[2], num_worst_tokens=worst)
        combined, combined_w, _ = buf.combine((recv_x.float() * 0.5).to(torch.bfloat16), handle, topk_weights=recv_w)
        return recv_x, recv_idx, combined, combined_w

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    checked = 0
    for seed in (2, 3, 4):
        inputs = everyone(seed)
        for t, new in zip(static, inputs[rank], strict=True):
            t.copy_(new)
        for t in outs:
            t.fill_(float("nan") if t.is_floating_point() else -7)  # poisoned: every replay writes them all
        graph.replay()
        torch.cuda.synchronize()
        recv_x, recv_idx, combined, combined_w = (t.cpu() for t in outs)
        xs, idxs, ws = ([i[k] for i in inputs] for k in range(3))
        got = oracle.dispatch(xs, idxs, num_experts, topk_weights=ws, num_worst_tokens=worst)
        want = got[rank]
        tag = f"rank {rank} seed {seed}"
        assert torch.equal(recv_x.view(torch.int16), want.x.view(torch.int16)), f"{tag}: recv_x"
        assert torch.equal(recv_idx, want.topk_idx), f"{tag}: recv_topk_idx"
        in_ranks = [oracle.dispatch_layout(i, num_experts, num_ranks)[3] for i in idxs]
        ys = [(d.x.float() * 0.5).to(torch.bfloat16) for d in got]
        want_x, want_w = oracle.combine(ys, in_ranks, [d.topk_weights for d in got])[rank]
        assert torch.equal(combined.view(torch.int16), want_x.view(torch.int16)), f"{tag}: combined_x"
        assert torch.equal(combined_w, want_w), f"{tag}: combined_topk_weights"
        checked += want.num_recv
    return checked


def test_normal_graph_replays_on_new_inputs():
    assert cluster(1).run(rank_normal_graph, 64, 1024, 16, 4)[0] > 0
