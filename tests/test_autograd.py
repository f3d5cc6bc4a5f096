"""The example MoE layer trains through dispatch/combine: output and gradients match a dense layer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import BACKEND, cluster
from routing import device
from torch import nn

from epcomm import Buffer, Config
from epcomm.examples.moe_layer import ExpertMLP, ExpertParallelMoE, dense_moe


def _params(seed, hidden, ffn, num_experts):
    gen = torch.Generator().manual_seed(seed)
    router = nn.Linear(hidden, num_experts, bias=False)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    return router, ExpertMLP(hidden, ffn, num_experts, generator=gen)


def rank_moe_layer(tokens_per_rank, hidden, ffn, num_experts, num_topk, seed, backend="reference"):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    e_local = num_experts // num_ranks
    router, all_experts = _params(seed, hidden, ffn, num_experts)
    dense_router, dense_experts = _params(seed, hidden, ffn, num_experts)
    local = ExpertMLP(hidden, ffn, e_local)
    with torch.no_grad():
        local.w_in.copy_(all_experts.w_in[rank * e_local:(rank + 1) * e_local])
        local.w_out.copy_(all_experts.w_out[rank * e_local:(rank + 1) * e_local])
    buf = Buffer(dist.group.WORLD, Config().get_nvl_buffer_size_hint(hidden * 2, num_ranks), backend=backend)
    assert backend == "reference" or buf.backends["normal"] == "cuda", buf.backends  # 'auto' only on GPUs
    dev = device()
    layer = ExpertParallelMoE(buf, hidden, ffn, num_experts, num_topk, router, local).to(dev)
    xs = [torch.randn((t, hidden), generator=torch.Generator().manual_seed(seed + 1 + r)) for r, t in
          enumerate(tokens_per_rank)]
    x = xs[rank].clone().to(dev).requires_grad_(True)
    y = layer(x)
    grad_out = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 100 + rank)).to(dev)
    (y * grad_out).sum().backward()

    # Dense oracle over every rank's tokens.
    x_all = torch.cat(xs).requires_grad_(True)
    y_all = dense_moe(x_all, dense_router, dense_experts, num_topk)
    g_all = torch.cat([torch.randn((t, hidden), generator=torch.Generator().manual_seed(seed + 100 + r))
                       for r, t in enumerate(tokens_per_rank)])
    (y_all * g_all).sum().backward()
    begin = sum(tokens_per_rank[:rank])
    mine = slice(begin, begin + tokens_per_rank[rank])
    tag = f"rank={rank} R={num_ranks} T={tokens_per_rank}"

    router_grad = router.weight.grad.clone()
    dist.all_reduce(router_grad)  # the router is replicated: its gradient is the sum over ranks

    def close(a, b, what, tol=3e-2):
        a = a.detach().cpu()
        assert a.shape == b.shape, f"{tag}: {what} shape {tuple(a.shape)} != {tuple(b.shape)}"
        if b.numel() == 0:
            return
        scale = b.abs().max().clamp(min=1e-3)
        err = (a - b).abs().max() / scale
        assert err < tol, f"{tag}: {what} relative error {err:.3g}"

    close(y.detach(), y_all.detach()[mine], "output")
    close(x.grad, x_all.grad[mine], "grad x")
    close(local.w_in.grad, dense_experts.w_in.grad[rank * e_local:(rank + 1) * e_local], "grad w_in")
    close(local.w_out.grad, dense_experts.w_out.grad[rank * e_local:(rank + 1) * e_local], "grad w_out")
    close(router_grad, dense_router.weight.grad, "grad router")
    return True


# On GPUs also 'auto', which runs the CUDA kernels there (on CPU ranks it would repeat the reference).
BACKENDS = ["reference", pytest.param("auto", marks=pytest.mark.gpu)] if BACKEND == "nccl" else ["reference"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_layer_matches_dense_2_ranks(backend):
    cluster(2).run(rank_moe_layer, [24, 17], 64, 32, 8, 2, seed=3, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_layer_matches_dense_4_ranks_with_empty_rank(backend):
    cluster(4).run(rank_moe_layer, [20, 0, 9, 1], 32, 16, 8, 3, seed=4, backend=backend)
