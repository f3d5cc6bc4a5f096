"""Shared pieces of the caller replays (tests/test_callers_*.py): ``import deep_ep`` through the shim, the
backends a replay runs on, every rank's inputs, stand-in experts, and the oracle's results of a whole
dispatch -> experts -> combine pipeline to check a replay against."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import BACKEND, env_var
from routing import combined_matches, make_inputs, partials_bound

import epcomm
from epcomm import oracle
from epcomm.bench.checks import same_bits
from epcomm.fp8 import unpack_ue8m0

SHIM = Path(__file__).resolve().parent.parent / "shim"

# The reference backend everywhere; the CUDA kernels where the suite runs on GPUs.
BACKENDS = ["reference", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    BACKEND != "nccl", reason="CUDA kernels: run with EPCOMM_TEST_BACKEND=nccl on GPUs")])]
ON_GPUS = pytest.mark.skipif(BACKEND != "nccl", reason="CUDA: run with EPCOMM_TEST_BACKEND=nccl on GPUs")


def deep_ep():
    """``import deep_ep`` as an unmodified caller does, found through the shim's folder on sys.path (as
    pip installs it): the module must hold epcomm's own objects."""
    if str(SHIM) not in sys.path:
        sys.path.insert(0, str(SHIM))
    assert importlib.util.find_spec("deep_ep") is not None, "find_spec('deep_ep') finds no shim"
    module = importlib.import_module("deep_ep")
    assert module.Buffer is epcomm.Buffer, f"deep_ep is {module.__file__}, not the shim"
    return module


@contextlib.contextmanager
def backend(name: str):
    """Buffers built inside run on ``name`` (callers pass no backend=: EPCOMM_BACKEND chooses)."""
    with env_var("EPCOMM_BACKEND", name):
        yield


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if BACKEND == "nccl" else torch.device("cpu")


def rank_inputs(seed: int, num_tokens: int, hidden: int, num_experts: int, num_topk: int,
                routing: str = "random") -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every rank's (x bf16, topk_idx int64, topk_weights fp32), on this rank's device."""
    dev, num_ranks = device(), dist.get_world_size()
    return [tuple(t.to(dev) for t in make_inputs(seed, r, num_tokens, hidden, num_experts, num_topk, num_ranks,
                                                 routing)) for r in range(num_ranks)]


def expert_scale(global_expert: torch.Tensor) -> torch.Tensor:
    """The stand-in expert e multiplies its rows by 1 + e / 16 (fp32): every expert of a test differs."""
    return 1.0 + global_expert.to(torch.float32) / 16


def normal_experts(recv_x: torch.Tensor, recv_idx: torch.Tensor, recv_w: torch.Tensor, rank: int,
                   experts_per_rank: int) -> torch.Tensor:
    """The expert layer after a normal dispatch (bf16 [rows, H]): each row times the sum over its local
    slots of weight * expert scale, as a fused MoE layer returns it reduced over top-k. Differentiable."""
    valid = recv_idx >= 0
    glob = torch.where(valid, recv_idx + rank * experts_per_rank, 0)
    factor = (recv_w * expert_scale(glob) * valid).sum(1, keepdim=True)
    return (recv_x.float() * factor).to(torch.bfloat16)


def dequant_ll(recv: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A low-latency dispatch's rows [E, N*R, H] as bf16 (FP8: data times its 128-channel scales)."""
    if isinstance(recv, torch.Tensor):
        return recv
    data, scales = recv
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales)
    e, rows, hidden = data.shape
    groups = data.float().view(e, rows, hidden // 128, 128) * scales.contiguous().view(e, rows, -1, 1)
    return groups.view(e, rows, hidden).to(torch.bfloat16)


def ll_experts(recv: torch.Tensor | tuple[torch.Tensor, torch.Tensor], rank: int) -> torch.Tensor:
    """The expert layer after a low-latency dispatch: local expert e's rows times its scale (bf16)."""
    x = dequant_ll(recv)
    scale = expert_scale(torch.arange(x.shape[0], device=x.device) + rank * x.shape[0])
    return (x.float() * scale.view(-1, 1, 1)).to(torch.bfloat16)


def assert_bits(tag: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape, f"{tag}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    assert same_bits(got, want.to(got.device)), f"rank {dist.get_rank()}: {tag} differs from the oracle"


def check_normal_dispatch(tag: str, recv, recv_idx, recv_w, counts, inputs, num_experts: int,
                          expert_alignment: int = 1, xs=None) -> oracle.Dispatched:
    """This rank's dispatch outputs equal the oracle's bit for bit; FP8 scales row-major as DeepEP's."""
    rank = dist.get_rank()
    want = oracle.dispatch_to(rank, xs if xs is not None else [i[0] for i in inputs], [i[1] for i in inputs],
                              num_experts, topk_weights=[i[2] for i in inputs], expert_alignment=expert_alignment)
    if isinstance(recv, tuple):
        assert_bits(f"{tag} recv_x", recv[0], want.x[0])
        assert recv[1].is_contiguous(), f"{tag}: received scales not row-major, strides {recv[1].stride()}"
        assert_bits(f"{tag} recv scales", recv[1], want.x[1])
    else:
        assert_bits(f"{tag} recv_x", recv, want.x)
    assert_bits(f"{tag} recv_topk_idx", recv_idx, want.topk_idx)
    assert_bits(f"{tag} recv_topk_weights", recv_w, want.topk_weights)
    assert list(counts) == want.expert_counts, f"{tag}: counts {list(counts)}, want {want.expert_counts}"
    return want


def oracle_pipeline(inputs, num_experts: int, middle: Callable, grads: list[torch.Tensor] | None = None,
                    xs=None) -> list[dict]:
    """Every rank's results of dispatch -> ``middle(recv_x, recv_idx, recv_w, rank)`` -> combine done by
    the oracle; with ``grads`` (every rank's gradient of the combined output) the backward too: a
    combine's backward is a cached dispatch, a dispatch's a combine of the gradients (with the weights').
    Returns per rank: combined, and with grads grad_x, grad_w."""
    num_ranks = len(inputs)
    in_ranks = [oracle.dispatch_layout(i[1], num_experts, num_ranks)[3] for i in inputs]
    got = oracle.dispatch(xs if xs is not None else [i[0] for i in inputs], [i[1] for i in inputs], num_experts,
                          topk_weights=[i[2] for i in inputs])
    leaves, ys = [], []
    for d, out in enumerate(got):
        x = out.x if isinstance(out.x, tuple) else out.x.detach().clone().requires_grad_(grads is not None)
        w = out.topk_weights.detach().clone().requires_grad_(grads is not None)
        leaves.append((x, w))
        ys.append(middle(x, out.topk_idx, w, d))
    combined = [c for c, _ in oracle.combine([y.detach() for y in ys], in_ranks)]
    results = [{"combined": c} for c in combined]
    if grads is None:
        return results
    # Backward: each rank's rows of the gradient come back by a cached dispatch, through the middle, then
    # go home by a combine that sums the weights' gradients too.
    back = oracle.dispatch(grads, None, num_experts, in_ranks=in_ranks)
    grad_xs, grad_ws = [], []
    for d, (y, (x, w)) in enumerate(zip(ys, leaves, strict=True)):
        gx, gw = torch.autograd.grad(y, (x, w), back[d].x, allow_unused=True)
        grad_xs.append(gx)
        grad_ws.append(gw if gw is not None else torch.zeros_like(w))
    for r, (gx, gw) in enumerate(oracle.combine(grad_xs, in_ranks, topk_weights=grad_ws)):
        results[r].update(grad_x=gx, grad_w=gw)
    return results


def oracle_ll(inputs, num_experts: int, num_max_tokens: int, use_fp8: bool, round_scale: bool = False,
              use_ue8m0: bool = False) -> tuple[oracle.LowLatencyDispatched, torch.Tensor]:
    """This rank's low-latency dispatch by the oracle, and its combined output when every rank's experts
    are ``ll_experts`` (the oracle's combine order)."""
    xs, idx, ws = ([i[k] for i in inputs] for k in range(3))
    got = oracle.low_latency_dispatch(xs, idx, num_experts, num_max_tokens, use_fp8=use_fp8, round_scale=round_scale,
                                      use_ue8m0=use_ue8m0)
    ys = [ll_experts(g.x, d) for d, g in enumerate(got)]
    combined = oracle.low_latency_combine(ys, [g.src_info for g in got], [g.layout_range for g in got], idx, ws,
                                          num_experts)
    rank = dist.get_rank()
    return got[rank], combined[rank]


def check_ll_dispatch(tag: str, recv, count, handle, want: oracle.LowLatencyDispatched) -> None:
    """A low-latency dispatch's rows, counts and handle equal the oracle's (rows past a count unspecified)."""
    assert_bits(f"{tag} recv_count", count, want.count)
    assert_bits(f"{tag} layout_range", handle[1], want.layout_range)
    parts = recv if isinstance(recv, tuple) else (recv,)
    wants = want.x if isinstance(want.x, tuple) else (want.x,)
    for e, c in enumerate(want.count.tolist()):
        assert_bits(f"{tag} src_info[{e}]", handle[0][e, :c], want.src_info[e, :c])
        for name, got_part, want_part in zip(("x", "scales")[:len(parts)], parts, wants, strict=True):
            assert_bits(f"{tag} {name}[{e}]", got_part[e, :c], want_part[e, :c])


def check_ll_combined(tag: str, got: torch.Tensor, want: torch.Tensor, buf=None, inputs=None) -> None:
    """A low-latency combine equals the oracle's (fp32 in slot order, then bf16) bit for bit; with ``buf``
    and this rank's ``inputs`` (x, topk_idx, topk_weights), a combine the CUDA kernels made by partial
    sums on several ranks (their default without a hook from 64 tokens a rank, EPCOMM_LL_COMBINE_PARTIALS)
    within the partials' bf16 rounding: each partial rounds once, to 2^-8 of the sum of |w| times the
    expert's output (under twice |x| after the FP8 round trip), and the result once more."""
    if buf is not None and getattr(buf.low_latency_ops, "last_combine_partials", False) and dist.get_world_size() > 1:
        x, topk_idx, topk_weights = (t.to(got.device) for t in inputs)
        assert combined_matches(got, want.to(got.device), partials_bound(x, topk_idx, topk_weights, expert_scale)), \
            f"rank {dist.get_rank()}: {tag} combined (by partial sums) differs from the oracle past bf16 rounding"
        return
    assert_bits(f"{tag} combined", got, want)
