"""Two decode micro-batches overlapped with the low-latency receive hook.

While micro-batch A's tokens are in flight, the GPU computes micro-batch B's attention (here a
stand-in matrix product); only then does A's hook receive them. With ``return_recv_hook=True`` the
dispatch and combine calls only launch their sends, so no SM waits for the network in between:

    dispatch(A, hook) -> dispatch(B, hook) -> [attention of B] -> hook A -> experts(A) -> combine(A, hook)
    -> hook B -> experts(B) -> combine(B, hook) -> [attention of A'] -> hook combine A -> hook combine B

At most two low-latency results may be pending at once (double buffering), which this schedule
respects. Run it on the local GPUs with ``python -m epcomm.examples.ll_overlap``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..buffer import Buffer


def _experts(recv_x: torch.Tensor, e_local: int) -> torch.Tensor:
    """Stand-in grouped GEMM: expert e scales its rows by (e + 1) / 2."""
    scale = (torch.arange(e_local, device=recv_x.device, dtype=torch.float32) + 1).view(-1, 1, 1) / 2
    return (recv_x.float() * scale).to(torch.bfloat16)


def run_two_micro_batches(backend: str = "auto", num_tokens: int = 64, hidden: int = 2048, num_topk: int = 4,
                          experts_per_rank: int = 4, check: bool = False) -> float:
    """Run the overlapped schedule once on this rank; with ``check`` compare with a plain schedule on the
    reference backend. Returns the largest absolute difference (0 when unchecked)."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    num_experts = experts_per_rank * num_ranks
    size = Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
    buf = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, backend=backend)
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    batches = []
    for _ in range(2):
        x = torch.randn((num_tokens, hidden), generator=gen, dtype=torch.float32, device=dev).to(torch.bfloat16)
        scores = torch.rand((num_tokens, num_experts), generator=gen, dtype=torch.float32, device=dev)
        weights, idx = scores.topk(num_topk, dim=1)
        batches.append((x, idx, weights.float()))
    attention = torch.randn((2048, 2048), generator=gen, dtype=torch.float32, device=dev)

    (xa, ia, wa), (xb, ib, wb) = batches
    recv_a, _, handle_a, _, hook_a = buf.low_latency_dispatch(xa, ia, num_tokens, num_experts, use_fp8=False,
                                                              return_recv_hook=True)
    recv_b, _, handle_b, _, hook_b = buf.low_latency_dispatch(xb, ib, num_tokens, num_experts, use_fp8=False,
                                                              return_recv_hook=True)
    attention = attention @ attention  # B's attention runs while A's and B's tokens travel
    hook_a()
    out_a, _, comb_hook_a = buf.low_latency_combine(_experts(recv_a, experts_per_rank), ia, wa, handle_a,
                                                    return_recv_hook=True)
    hook_b()
    out_b, _, comb_hook_b = buf.low_latency_combine(_experts(recv_b, experts_per_rank), ib, wb, handle_b,
                                                    return_recv_hook=True)
    attention = attention @ attention  # the next layer's attention overlaps both combines
    comb_hook_a()
    comb_hook_b()
    torch.cuda.synchronize()
    buf.destroy()
    if not check:
        return 0.0
    ref = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, backend="reference")
    worst = 0.0
    for (x, idx, w), got in ((batches[0], out_a), (batches[1], out_b)):
        recv, _, handle, _, _ = ref.low_latency_dispatch(x, idx, num_tokens, num_experts, use_fp8=False)
        want, _, _ = ref.low_latency_combine(_experts(recv, experts_per_rank), idx, w, handle)
        worst = max(worst, float((got.float() - want.float()).abs().max()) if got.numel() else 0.0)
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            raise AssertionError(f"rank {rank}: the overlapped schedule differs from the plain one (max abs "
                                 f"difference {worst})")
    ref.destroy()
    return worst


def _main() -> None:
    from ..utils.launch import LocalCluster

    count = torch.cuda.device_count()
    if count < 2:
        raise SystemExit("this example needs at least 2 GPUs")
    with LocalCluster(count, "nccl", env={"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                          "NVSHMEM_DISABLE_NVLS": "1"}) as cluster:
        worst = cluster.run(run_two_micro_batches, "cuda", check=True)
    print(f"two micro-batches overlapped on {count} GPUs: outputs equal the plain schedule (max diff {max(worst)})")


if __name__ == "__main__":
    _main()
