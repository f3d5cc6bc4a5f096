"""The CUDA intranode kernels against the reference backend, on GPUs (skipped without them).

Copies must be bitwise equal. The combine sums in the same order as the reference (fp32, ascending
source rank, then the biases), so it must be bitwise equal too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import BACKEND, cluster
from routing import make_inputs

import epcomm
from epcomm import Buffer

pytestmark = pytest.mark.skipif(BACKEND != "nccl", reason="CUDA kernels: run with EPCOMM_TEST_BACKEND=nccl on GPUs")

NVL_BYTES = 512 << 20


def _same(a, b) -> bool:
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def rank_cuda_vs_reference(tokens_per_rank, hidden, num_experts, num_topk, routing, seed, fp8, col_major,
                           num_worst_tokens, use_bias, num_sms):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    tag = (f"rank={rank} R={num_ranks} T={tokens_per_rank} H={hidden} E={num_experts} K={num_topk} {routing} "
           f"fp8={fp8} col_major={col_major} worst={num_worst_tokens} bias={use_bias} sms={num_sms}")
    dev = torch.device("cuda", torch.cuda.current_device())
    x, topk_idx, topk_weights = (t.to(dev) for t in make_inputs(seed, rank, tokens_per_rank[rank], hidden,
                                                                 num_experts, num_topk, num_ranks, routing))
    if fp8:
        data, scales = epcomm.per_token_cast_to_fp8(x)
        x_in = (data, scales.t().contiguous().t() if col_major else scales)
    else:
        x_in = x
    config = epcomm.Config(num_sms=num_sms)
    outs = {}
    for backend in ("reference", "cuda"):
        buf = Buffer(dist.group.WORLD, NVL_BYTES, backend=backend)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=num_worst_tokens, config=config)
        cached_x, *_ = buf.dispatch(x_in, handle=handle, config=config)
        rows = (recv_x[0] if fp8 else recv_x).shape[0]
        gen = torch.Generator().manual_seed(seed + 1000 + rank)
        y = torch.randn((rows, hidden), generator=gen).to(torch.bfloat16).to(dev)
        biases = tuple(torch.randn((x.shape[0], hidden), generator=gen).to(torch.bfloat16).to(dev)
                       for _ in range(2)) if use_bias else None
        combined, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w, bias=biases, config=config)
        torch.cuda.synchronize()
        n = handle.num_recv_tokens
        outs[backend] = dict(recv_x=tuple(t[:n] for t in recv_x) if fp8 else recv_x[:n], recv_idx=recv_idx,
                             recv_w=recv_w, counts=counts, cached=tuple(t[:n] for t in cached_x) if fp8
                             else cached_x[:n], combined=combined, combined_w=combined_w, n=n)
        buf.destroy()
    ref, got = outs["reference"], outs["cuda"]
    assert got["n"] == ref["n"], tag
    assert got["counts"] == ref["counts"], tag
    for key in ("recv_x", "recv_idx", "recv_w", "cached", "combined", "combined_w"):
        assert _same(got[key], ref[key]), f"{tag}: {key} differs from the reference backend"
    return ref["n"]


CASES = [
    # (tokens per rank, hidden, experts, topk, routing)
    ([256, 200], 7168, 256, 8, "random"),
    ([64, 0], 2048, 16, 4, "random"),
    ([96, 96], 4096, 32, 8, "imbalanced"),
    ([80, 80], 1024, 32, 4, "empty_rank"),
    ([50, 31], 512, 8, 2, "one_expert"),
    ([1, 1], 256, 8, 4, "random"),
    ([0, 0], 256, 8, 4, "random"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{sum(c[0])}-H{c[1]}-{c[4]}")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cuda_matches_reference(case, fp8):
    tokens, hidden, experts, topk, routing = case
    ranks = 2
    cluster(ranks).run(rank_cuda_vs_reference, tokens, hidden, experts, topk, routing, seed=CASES.index(case),
                       fp8=fp8, col_major=fp8, num_worst_tokens=0, use_bias=True, num_sms=24)


@pytest.mark.parametrize("num_sms", [2, 8])
def test_cuda_num_worst_tokens_and_sm_counts(num_sms):
    cluster(2).run(rank_cuda_vs_reference, [128, 77], 2048, 16, 4, "random", seed=7, fp8=False, col_major=False,
                   num_worst_tokens=2 * 128, use_bias=False, num_sms=num_sms)
