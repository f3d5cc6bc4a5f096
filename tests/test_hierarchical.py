"""The hierarchical strategy (two tiers over scale-up domains) against the flat all-to-all strategy,
on every backend the suite runs on: dispatch outputs bit for bit, combine within fp32 rounding (the
partial sums are added per domain first); each token crosses the inter-domain tier at most once per
destination domain (the rows are counted); node-limited routing bounds that count."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import cluster, env_var
from routing import device, make_inputs

import epcomm
from epcomm import Buffer
from epcomm.bench.checks import same_bits
from epcomm.bench.workloads import make_topk_idx

NVL = 64 << 20


def domains_of(ranks_per_domain: int):
    """EPCOMM_RANKS_PER_DOMAIN for the Buffers built inside."""
    return env_var("EPCOMM_RANKS_PER_DOMAIN", ranks_per_domain)


def _inputs(seed: int, num_tokens: int, hidden: int, num_experts: int, num_topk: int, routing: str,
            ranks_per_domain: int):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = device()
    x, idx, w = make_inputs(seed, rank, num_tokens, hidden, num_experts, num_topk, num_ranks,
                            "random" if routing == "empty_domain" else routing)
    if routing == "empty_domain" and num_tokens:  # nobody routes to the last domain
        last = num_experts - num_experts // num_ranks * ranks_per_domain
        idx = torch.where(idx >= last, torch.full_like(idx, -1), idx)
    return x.to(dev), idx.to(dev), w.to(dev)


def _round_trip(buf: Buffer, x, idx, w, num_experts: int, fp8: bool, worst: int, bias):
    per_rank, per_domain, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    x_in = epcomm.per_token_cast_to_fp8(x) if fp8 else x
    recv_x, recv_idx, recv_w, expert_list, handle, _ = buf.dispatch(
        x_in, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_domain, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, num_worst_tokens=worst)
    traffic = dict(buf.normal_ops.traffic)
    cached = buf.dispatch(x_in, handle=handle)[0]
    data = recv_x[0].float() if fp8 else recv_x.float()
    y = (data * 0.75).to(torch.bfloat16)
    combined, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w, bias=bias)
    traffic.update({k: v for k, v in buf.normal_ops.traffic.items() if k.startswith("combine")})
    return (recv_x, recv_idx, recv_w, expert_list, cached, combined, combined_w), traffic, per_domain


def _flat(t):
    return list(t) if isinstance(t, tuple) else [t]


def rank_hierarchical_vs_flat(ranks_per_domain: int, cases: list[tuple]) -> list[dict]:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    hidden, num_experts, num_topk = 256, 4 * num_ranks, 4
    reports = []
    for tokens, routing, fp8, worst, with_bias, seed in cases:
        num_tokens = tokens[rank % len(tokens)]
        x, idx, w = _inputs(seed, num_tokens, hidden, num_experts, num_topk, routing, ranks_per_domain)
        bias = (torch.randn((num_tokens, hidden), generator=torch.Generator().manual_seed(seed + rank))
                .to(torch.bfloat16).to(x.device)) if with_bias else None
        results = {}
        with domains_of(ranks_per_domain):
            for strategy in ("alltoall", "hierarchical"):
                buf = Buffer(dist.group.WORLD, NVL, strategy=strategy)
                results[strategy] = _round_trip(buf, x, idx, w, num_experts, fp8, worst * num_tokens, bias)
                buf.destroy()
        (flat, _, per_domain), (tiered, traffic, _) = results["alltoall"], results["hierarchical"]
        tag = f"rank {rank} {ranks_per_domain}/{num_ranks} T={num_tokens} {routing} fp8={fp8} worst={worst}"
        for name, a, b in zip(("recv_x", "recv_topk_idx", "recv_topk_weights", "cached recv_x"),
                              flat[:3] + flat[4:5], tiered[:3] + tiered[4:5]):
            for pa, pb in zip(_flat(a), _flat(b)):
                assert same_bits(pa, pb), f"{tag}: {name} differs from the flat strategy"
        assert flat[3] == tiered[3], f"{tag}: num_recv_tokens_per_expert_list differs"
        combined_flat, combined_tiered = flat[5].float(), tiered[5].float()
        # fp32 sums in another order, rounded to bf16 once: at most one bf16 step apart.
        step = combined_flat.abs().clamp(min=2 ** -100) * 2 ** -7
        assert bool(((combined_flat - combined_tiered).abs() <= step).all()), f"{tag}: combine differs"
        assert torch.allclose(flat[6], tiered[6], rtol=1e-6, atol=1e-6), f"{tag}: combined weights differ"
        if ranks_per_domain == num_ranks:  # one domain: the same sums in the same order
            assert same_bits(flat[5], tiered[5]), f"{tag}: one domain, yet combine differs"
        own = rank // ranks_per_domain
        expected = sum(c for d, c in enumerate(per_domain.tolist()) if d != own) if per_domain is not None else 0
        assert traffic["dispatch_inter_domain_rows"] == expected, (tag, traffic, expected)
        reports.append(traffic)
    return reports


CASES = [
    # (tokens per rank, cycled; routing; fp8; num_worst_tokens as a multiple of T; bias; seed)
    ([40, 7], "random", False, 0, True, 1),
    ([33], "imbalanced", True, 0, False, 2),
    ([25, 0], "empty_domain", False, 0, False, 3),
    ([0], "random", False, 0, False, 4),
    ([19], "random", True, 4, True, 5),
]


@pytest.mark.parametrize("ranks, ranks_per_domain", [(2, 1), (4, 2), (4, 1), (4, 4)], ids=["2x1", "2x2", "4x1", "1x4"])
def test_hierarchical_equals_flat(ranks, ranks_per_domain):
    reports = cluster(ranks).run(rank_hierarchical_vs_flat, ranks_per_domain, CASES)
    for i in range(len(CASES)):  # what crossed the slow tier comes back across it, once per row
        sent = sum(r[i]["dispatch_inter_domain_rows"] for r in reports)
        returned = sum(r[i]["combine_inter_domain_rows"] for r in reports)
        assert sent == returned, (CASES[i], sent, returned)


@pytest.mark.parametrize("ranks_per_domain", [4, 2], ids=["2x4", "4x2"])
def test_hierarchical_equals_flat_8_ranks(ranks_per_domain):
    cluster(8).run(rank_hierarchical_vs_flat, ranks_per_domain, CASES[:3])


def rank_strategy_mismatch():
    """Refused when the Buffers are built, on every rank: they would run different protocols."""
    strategy = "hierarchical" if dist.get_rank() == 0 else "alltoall"
    with domains_of(1), pytest.raises(ValueError, match="different strategy values .*rank 0: hierarchical, rank 1: "
                                                        "alltoall"):
        Buffer(dist.group.WORLD, NVL, strategy=strategy)


def test_ranks_with_different_strategies_raise():
    cluster(2).run(rank_strategy_mismatch)


def test_node_limited_routing_keeps_each_token_in_its_groups():
    gen = torch.Generator().manual_seed(0)
    num_domains, num_experts = 4, 64
    for groups in (1, 2, 3):
        idx = make_topk_idx(gen, 500, num_experts, 8, num_domains, groups)
        domains = idx // (num_experts // num_domains)
        per_token = torch.zeros((500, num_domains), dtype=torch.bool).scatter_(1, domains, True).sum(1)
        assert int(per_token.max()) <= groups and int(per_token.min()) >= 1, groups
    unlimited = make_topk_idx(torch.Generator().manual_seed(0), 500, num_experts, 8)
    again = make_topk_idx(torch.Generator().manual_seed(0), 500, num_experts, 8, num_domains, None)
    assert torch.equal(unlimited, again)  # no limit: the benchmark's routing is unchanged


def rank_tier_rows(num_tokens: int, num_experts: int, num_topk: int, ranks_per_domain: int,
                   num_groups: int | None) -> dict:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(100 + rank)
    idx = make_topk_idx(gen, num_tokens, num_experts, num_topk, num_ranks // ranks_per_domain, num_groups)
    x = torch.randn((num_tokens, 8), generator=gen).to(torch.bfloat16)
    dev = device()
    with domains_of(ranks_per_domain):
        buf = Buffer(dist.group.WORLD, NVL, strategy="hierarchical")
    per_rank, per_domain, per_expert, in_rank, _ = buf.get_dispatch_layout(idx.to(dev), num_experts)
    buf.dispatch(x.to(dev), num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_domain,
                 is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx.to(dev))
    traffic = dict(buf.normal_ops.traffic)
    buf.destroy()
    return traffic


@pytest.mark.parametrize("num_groups", [None, 1], ids=["uniform", "node-limited"])
def test_planner_predicts_the_rows_each_tier_moves(num_groups):
    """The planner's reach model (epcomm/planner/expectations.py) against the rows the hierarchical
    strategy really moves, per rank: inter-domain T (D-1) p_domain, intra-domain D T (g-1) p_rank."""
    from epcomm.planner.expectations import expectations

    num_tokens, num_experts, num_topk, ranks, rpd = 2000, 32, 4, 4, 2
    reports = cluster(ranks).run(rank_tier_rows, num_tokens, num_experts, num_topk, rpd, num_groups)
    e = expectations(num_experts, num_topk, ranks, ranks // rpd, num_groups)
    inter = num_tokens * e.other_domains_per_token
    intra = e.num_domains * num_tokens * e.same_domain_remote_ranks_per_token
    for r in reports:
        assert abs(r["dispatch_inter_domain_rows"] - inter) < 0.05 * inter, (r, inter)
        assert abs(r["dispatch_intra_domain_rows"] - intra) < 0.05 * intra, (r, intra)
