"""Single-batch overlap of low_latency_combine on the CUDA kernels (skipped without GPUs).

A stand-in for the expert GEMM runs on a stream of its own beside the combine: in a shuffled order
of the blocks of block_m rows, it sleeps, raises a block's signal word halfway, sleeps again, only
then writes the block's rows (which start as NaN) and raises the word to the threshold. A block sent
before its word reached the threshold would carry NaN or stale rows: the output must equal, bit for
bit, the combine without overlap of the same rows on the same Buffer. A GEMM that never raises a
word must end in a RuntimeError, not a hang; a packed_recv_count other than the dispatch's in a
ValueError on every rank, the Buffer working on.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from conftest import BACKEND, cluster, peer_timeout, poison_allocator
from routing import make_inputs

from epcomm import Buffer
from epcomm.bench.checks import same_bits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(BACKEND != "nccl", reason="CUDA kernels: run with EPCOMM_TEST_BACKEND=nccl on GPUs")]

N, HIDDEN, EXPERTS_PER_RANK, TOPK = 16, 512, 4, 3  # N < 64: the combine without overlap is per pair too
THRESHOLD = 2


def _setup(seed: int, timeout_s: float = 30):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts = EXPERTS_PER_RANK * num_ranks
    size = Buffer.get_low_latency_rdma_size_hint(N, HIDDEN, num_ranks, num_experts)
    with peer_timeout(timeout_s):
        buf = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, backend="cuda")
    x, idx, w = (t.to(dev) for t in make_inputs(seed, rank, N, HIDDEN, num_experts, TOPK, num_ranks, "random"))
    return buf, x, idx, w, num_experts


def _expert_outputs(recv_x: torch.Tensor) -> torch.Tensor:
    """The experts' outputs: each received row times (local expert + 1) / 4, in bf16."""
    scale = (torch.arange(recv_x.shape[0], device=recv_x.device, dtype=torch.float32) + 1).view(-1, 1, 1) / 4
    return (recv_x.float().nan_to_num() * scale).to(torch.bfloat16)


def _gemm_stand_in(y: torch.Tensor, want: torch.Tensor, signal: torch.Tensor, counts: list[int], block_m: int,
                   per_expert: int, seed: int) -> torch.cuda.Stream:
    """Writes ``want``'s valid rows into ``y`` block by block on a stream of its own, late and in a shuffled
    order, each block's word raised halfway first and to THRESHOLD only once its rows are written."""
    blocks = [(e, b) for e, count in enumerate(counts) for b in range(-(-count // block_m))]
    random.Random(seed).shuffle(blocks)
    side = torch.cuda.Stream(y.device)
    side.wait_stream(torch.cuda.current_stream(y.device))
    with torch.cuda.stream(side):
        for e, b in blocks:
            word = signal[e * per_expert + b:e * per_expert + b + 1]
            torch.cuda._sleep(20000)
            word.add_(1)
            torch.cuda._sleep(20000)
            rows = slice(b * block_m, min((b + 1) * block_m, counts[e]))
            y[e, rows].copy_(want[e, rows])
            word.add_(THRESHOLD - 1)
    return side


# (signal kind, receive hook, num_sms, block_m; src_signals cover a whole expert)
VARIANTS = [("comp", False, 3, 16), ("comp", True, 0, 7), ("comp", False, 1, 64), ("src", False, 2, None),
            ("src", True, 0, None)]


def rank_sbo(seed: int):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    buf, x, idx, w, num_experts = _setup(seed)
    e_local, rows = num_experts // num_ranks, N * num_ranks
    for i, (kind, hook, num_sms, block_m) in enumerate(VARIANTS):
        tag = f"rank {rank} of {num_ranks}: {kind} hook={hook} num_sms={num_sms} block_m={block_m}"
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, N, num_experts, use_fp8=False)
        ref = buf.low_latency_combine(_expert_outputs(recv_x), idx, w, handle)[0].clone()  # without overlap
        # The same dispatch again (its layout is the same) for the overlapped combine.
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, N, num_experts, use_fp8=False)
        want = _expert_outputs(recv_x)
        counts = recv_count.tolist()
        block_m = block_m or rows
        per_expert = -(-rows // block_m)
        words = torch.zeros(e_local * per_expert + 3, dtype=torch.int32, device=x.device)  # more than needed: fine
        if kind == "comp":
            keywords = dict(packed_recv_count=recv_count, comp_signal=words, block_m=block_m, threshold=THRESHOLD)
        else:  # uint32 as SGLang allocates them, or int32
            words = words[:e_local]
            keywords = dict(src_signals=words.view(torch.uint32) if i % 2 else words, src_signal_expect_value=THRESHOLD)
        poison_allocator(x.device)
        y = torch.full_like(want, float("nan"))
        side = _gemm_stand_in(y, want, words, counts, block_m, per_expert, seed + 7 * rank + i)
        combined, _, receive = buf.low_latency_combine(y, idx, w, handle, overlap=True, num_sms=num_sms,
                                                       return_recv_hook=hook, **keywords)
        if hook:
            receive()
        torch.cuda.synchronize()
        del side
        assert same_bits(combined, ref), f"{tag}: the overlapped combine differs from the combine without overlap"
    # A packed_recv_count other than the dispatch's: every rank raises at the slot's next call; the
    # Buffer works on.
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, N, num_experts, use_fp8=False)
    words = torch.full((e_local,), THRESHOLD, dtype=torch.int32, device=x.device)
    buf.low_latency_combine(recv_x, idx, w, handle, overlap=True, packed_recv_count=recv_count + 1,
                            comp_signal=words, block_m=rows, threshold=THRESHOLD)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, N, num_experts, use_fp8=False)
    with pytest.raises(ValueError, match=r"packed_recv_count"):
        buf.low_latency_combine(recv_x, idx, w, handle)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, N, num_experts, use_fp8=False)
    want = _expert_outputs(recv_x)
    again = buf.low_latency_combine(want, idx, w, handle)[0]
    torch.cuda.synchronize()
    assert same_bits(again, ref), f"rank {rank}: the Buffer no longer works after the refusal"
    buf.destroy()


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_sbo_combine_waits_for_each_block(ranks):
    cluster(ranks).run(rank_sbo, 31 + ranks)


def rank_sbo_never_raised():
    """The GEMM stand-in raises every word to THRESHOLD - 1 only: the send kernel's bounded wait ends,
    and the next call raises RuntimeError naming the GEMM, on every rank."""
    buf, x, idx, w, num_experts = _setup(5, timeout_s=2)
    e_local, rows = num_experts // dist.get_world_size(), N * dist.get_world_size()
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, N, num_experts, use_fp8=False)
    words = torch.full((e_local * rows,), THRESHOLD - 1, dtype=torch.int32, device=x.device)
    buf.low_latency_combine(recv_x, idx, w, handle, overlap=True, packed_recv_count=recv_count, comp_signal=words,
                            block_m=1, threshold=THRESHOLD, num_sms=2)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match=rf"expert GEMM of rank\(s\) \[{dist.get_rank()}\] did not raise"):
        buf.low_latency_dispatch(x, idx, N, num_experts, use_fp8=False)
    torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()


def test_sbo_signal_never_raised_times_out():
    cluster(2).run(rank_sbo_never_raised)
