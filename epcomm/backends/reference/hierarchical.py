"""Normal mode in two tiers (``Buffer(..., strategy="hierarchical")``): what the hierarchical kernels
do, on torch.distributed, as their oracle and to count each tier's bytes.

The group is split into scale-up domains of ``ranks_per_domain`` consecutive ranks (one per host by
default; ``EPCOMM_RANKS_PER_DOMAIN`` makes virtual ones). Rank ``r`` has local index ``r % rpd``;
its *mate* in domain ``d`` is the rank of that domain with the same local index.

Dispatch:
1. inter-domain: each token goes **once** to every domain that holds one of its experts, to this
   rank's mate there (own domain: to itself), with its source token index and which ranks of that
   domain want it. Rows go in ascending token order.
2. intra-domain: each rank forwards what it received to the ranks of its domain that want it.
3. Each rank orders what it received by (source rank, source token), the flat strategy's order,
   so every dispatch output is bit for bit the all-to-all strategy's.

Combine reverses it and reduces inside the destination domain before crossing the slow tier: the
ranks return their rows to the forwarder they came from, which sums them in fp32 (ascending rank
of its domain) and sends one partial row per (token, domain) back to the source, which sums the
partials in ascending domain order, adds the biases, and rounds to bf16 once. The partials travel
in fp32, so the result differs from the flat strategy's only by the order of the fp32 additions
(identical with one domain). The kernels may send bf16 partials (half the slow-tier bytes), at
the cost of one more rounding.

Bytes of each tier are recorded per call in ``ReferenceBackend.traffic`` (``inter_domain_*``: rows
sent to ranks of other domains; ``intra_domain_*``: rows sent to other ranks of the own domain).
"""

from __future__ import annotations

import torch

from ...handle import DispatchHandle
from ..rows import check_worst_tokens, pack_token_rows, unpack_token_rows
from .backend import F, Op, ReferenceBackend, from_bytes, to_bytes
from .normal import (
    combine_handshake,
    combine_rows,
    dispatch_prologue,
    dispatch_result,
    exchange_expert_counts,
    received_expert_list,
    strategy_state,
)

STRATEGY = "hierarchical"


class _Domains:
    def __init__(self, rank: int, num_ranks: int, ranks_per_domain: int) -> None:
        self.rpd = ranks_per_domain
        self.num_domains = num_ranks // ranks_per_domain
        self.mine, self.local = divmod(rank, ranks_per_domain)
        self.num_ranks = num_ranks

    def mate(self, domain: int) -> int:
        return domain * self.rpd + self.local

    def same_domain(self, a: int, b: int) -> bool:
        return a // self.rpd == b // self.rpd


def _int32_bytes(values: torch.Tensor) -> torch.Tensor:
    return to_bytes(values.to(torch.int32).view(-1, 1))


def _plan(be: ReferenceBackend, dom: _Domains, is_token_in_rank: torch.Tensor, count_matrix: torch.Tensor) -> dict:
    """Who sends what to whom in both tiers (everything but the rows themselves)."""
    num_tokens = is_token_in_rank.shape[0]
    in_domain = is_token_in_rank.view(num_tokens, dom.num_domains, dom.rpd)
    tier1_tokens = [torch.nonzero(in_domain[:, d].any(-1)).flatten() for d in range(dom.num_domains)]
    send1 = [0] * dom.num_ranks
    for d, tokens in enumerate(tier1_tokens):
        send1[dom.mate(d)] = tokens.numel()
    # Each mate learns how many rows each source sends it (not implied by the per-rank counts).
    got = be.exchange_rows(_int32_bytes(torch.tensor(send1, dtype=torch.int32, device=be.device)),
                           [1] * dom.num_ranks, [1] * dom.num_ranks, Op.DISPATCH, everyone_empty=False)
    recv1 = from_bytes(got, torch.int32, 1).flatten().tolist()
    # Forwarder f passes rank r (its domain) the rows of the sources with f's local index; so r
    # receives from f what those sources send r in the flat strategy.
    rank = be.rank
    recv2 = [0] * dom.num_ranks
    for f in range(dom.mine * dom.rpd, (dom.mine + 1) * dom.rpd):
        recv2[f] = int(sum(int(count_matrix[s, rank]) for s in range(dom.num_ranks) if s % dom.rpd == f % dom.rpd))
    return {"strategy": STRATEGY, "tier1_tokens": tier1_tokens, "send1": send1, "recv1": recv1, "recv2": recv2}


def _tier1_rows(payload: torch.Tensor, plan: dict, dom: _Domains, meta: torch.Tensor | None) -> torch.Tensor:
    """This rank's tier-1 send rows, grouped by mate (ascending domain), tokens ascending."""
    rows = payload if meta is None else torch.cat([payload, meta], dim=1)
    return rows.index_select(0, torch.cat(plan["tier1_tokens"])) if rows.shape[0] else rows


def dispatch(be: ReferenceBackend, x: torch.Tensor, scales: torch.Tensor | None, handle: DispatchHandle | None,
             num_tokens_per_rank: torch.Tensor | None, is_token_in_rank: torch.Tensor | None,
             num_tokens_per_expert: torch.Tensor | None, topk_idx: torch.Tensor | None,
             topk_weights: torch.Tensor | None, expert_alignment: int, num_worst_tokens: int, num_experts: int,
             buffer_uid: str):
    """Same arguments and results as ``normal.dispatch`` (the all-to-all strategy)."""
    rank, num_ranks = be.rank, be.num_ranks
    dom = _Domains(rank, num_ranks, be.ranks_per_domain)
    num_tokens = x.shape[0]
    cached = handle is not None
    headers, count_matrix, recv_counts, is_token_in_rank, send_counts, num_worst_tokens = dispatch_prologue(
        be, STRATEGY, x, scales, handle, num_tokens_per_rank, is_token_in_rank, topk_idx, topk_weights,
        num_worst_tokens, num_experts)
    everyone_empty = int(count_matrix.sum()) == 0
    # Per-expert counts: from the received top-k ids, else (no ids) the caller's, exchanged.
    num_recv_tokens_per_expert_list = None if cached or topk_idx is not None else \
        exchange_expert_counts(be, num_tokens_per_expert, num_experts, expert_alignment, num_worst_tokens)
    num_recv_tokens = sum(recv_counts)
    check_worst_tokens(rank, num_recv_tokens, num_worst_tokens)
    plan = handle.backend_state if cached else _plan(be, dom, is_token_in_rank, count_matrix)

    # Tier 1: the token rows (plus, when routing is new, token index and the domain's wishes).
    payload = pack_token_rows(x, scales, None if cached else topk_idx, None if cached else topk_weights)
    payload_bytes = payload.shape[1]
    meta = None
    if not cached:
        # The whole is_token_in_rank row rides along (R bytes, small next to a token row); each mate
        # reads its own domain's part.
        meta = torch.cat([_int32_bytes(torch.arange(num_tokens, dtype=torch.int32, device=x.device)),
                          is_token_in_rank.to(torch.uint8)], dim=1)
    send1 = _tier1_rows(payload, plan, dom, meta)
    recv1 = be.exchange_rows(send1, plan["send1"], plan["recv1"], Op.DISPATCH, everyone_empty)

    # Tier 2: forward to the ranks of this domain that want each row, in tier-1 order.
    if not cached:
        first = dom.mine * dom.rpd
        wants = recv1[:, payload_bytes + 4 + first:payload_bytes + 4 + first + dom.rpd] != 0
        src_of_row = torch.repeat_interleave(torch.arange(num_ranks, dtype=torch.int64, device=x.device),
                                             torch.tensor(plan["recv1"], dtype=torch.int64, device=x.device))
        plan["forward"] = [torch.nonzero(wants[:, j]).flatten() for j in range(dom.rpd)]
        plan["send2"] = [0] * num_ranks
        for j, sel in enumerate(plan["forward"]):
            plan["send2"][first + j] = sel.numel()
        token_of_row = from_bytes(recv1[:, payload_bytes:payload_bytes + 4], torch.int32, 1).flatten()
        keys2 = torch.cat([_int32_bytes(src_of_row), _int32_bytes(token_of_row)], dim=1)
        forward_rows = torch.cat([recv1[:, :payload_bytes], keys2], dim=1)
    else:
        forward_rows = recv1
    send2 = forward_rows.index_select(0, torch.cat(plan["forward"])) if forward_rows.shape[0] else forward_rows
    recv2 = be.exchange_rows(send2, plan["send2"], plan["recv2"], Op.DISPATCH, everyone_empty)
    if recv2.shape[0] != num_recv_tokens:
        raise RuntimeError(f"epcomm dispatch: rank {rank} received {recv2.shape[0]} rows in two tiers but the "
                           f"ranks' num_tokens_per_rank promise {num_recv_tokens}")

    # The flat strategy's order: by source rank, then source token index.
    if not cached:
        src = from_bytes(recv2[:, payload_bytes:payload_bytes + 4], torch.int32, 1).flatten().long()
        token = from_bytes(recv2[:, payload_bytes + 4:payload_bytes + 8], torch.int32, 1).flatten().long()
        span = int(headers[:, F.NUM_TOKENS].max()) + 1
        plan["order"] = torch.argsort(src * span + token, stable=True)
    recv = recv2[:, :payload_bytes].index_select(0, plan["order"])
    _record_traffic(be, dom, "dispatch", plan["send1"], send1.shape[1], plan["send2"], send2.shape[1])

    recv_x_out, recv_topk_idx, recv_topk_weights = unpack_token_rows(
        recv, num_recv_tokens, num_worst_tokens or num_recv_tokens, x, scales, None if cached else topk_idx,
        None if cached else topk_weights, rank, num_experts, num_ranks)
    if cached:
        return recv_x_out, None, None, None, handle
    if recv_topk_idx is not None and not num_worst_tokens:
        num_recv_tokens_per_expert_list = received_expert_list(recv_topk_idx, num_recv_tokens, num_experts // num_ranks,
                                                               expert_alignment, num_worst_tokens)
    return dispatch_result((recv_x_out, recv_topk_idx, recv_topk_weights), num_recv_tokens_per_expert_list,
                           buffer_uid, x, num_recv_tokens, num_worst_tokens, is_token_in_rank, send_counts,
                           recv_counts, count_matrix, plan)


def combine(be: ReferenceBackend, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None,
            biases: tuple[torch.Tensor, ...]):
    """Same arguments and results as ``normal.combine``, summed per domain first (module docstring)."""
    plan = strategy_state(handle, STRATEGY)
    dom = _Domains(be.rank, be.num_ranks, be.ranks_per_domain)
    hidden = x.shape[1]
    k = topk_weights.shape[1] if topk_weights is not None else 0
    count_matrix = combine_handshake(be, STRATEGY, hidden, handle, topk_weights, len(biases))
    everyone_empty = int(count_matrix.sum()) == 0
    num_recv = handle.num_recv_tokens

    # Tier 2 back: every row to the forwarder it came from, in the order it arrived.
    rows = combine_rows(x, topk_weights, num_recv)
    arrival = torch.empty_like(plan["order"])
    arrival[plan["order"]] = torch.arange(plan["order"].numel(), dtype=arrival.dtype, device=arrival.device)
    back2 = rows.index_select(0, arrival) if num_recv else rows
    got2 = be.exchange_rows(back2, plan["recv2"], plan["send2"], Op.COMBINE, everyone_empty)

    # The forwarder sums, per tier-1 row, what its domain's ranks returned (ascending rank), in fp32.
    num_rows1 = sum(plan["recv1"])
    partial = torch.zeros((num_rows1, hidden + k), dtype=torch.float32, device=x.device)
    begin = 0
    for sel in plan["forward"]:
        block = got2[begin:begin + sel.numel()]
        values = from_bytes(block[:, :hidden * 2], torch.bfloat16, hidden).float()
        if k:
            values = torch.cat([values, from_bytes(block[:, hidden * 2:], torch.float32, k)], dim=1)
        partial.index_add_(0, sel, values)
        begin += sel.numel()

    # Tier 1 back: one partial row per (token, domain) to its source; the source sums them by domain.
    got1 = be.exchange_rows(to_bytes(partial), plan["recv1"], plan["send1"], Op.COMBINE, everyone_empty)
    _record_traffic(be, dom, "combine", plan["recv1"], partial.shape[1] * 4, plan["recv2"], back2.shape[1])
    acc = torch.zeros((handle.num_tokens, hidden + k), dtype=torch.float32, device=x.device)
    begin = 0
    for tokens in plan["tier1_tokens"]:  # ascending domain
        acc.index_add_(0, tokens, from_bytes(got1[begin:begin + tokens.numel()], torch.float32, hidden + k))
        begin += tokens.numel()
    out = acc[:, :hidden]
    for bias in biases:
        out = out + bias.float()
    combined = torch.empty((handle.num_tokens, hidden), dtype=torch.bfloat16, device=x.device).copy_(out)
    acc_w = None
    if k:
        acc_w = torch.empty((handle.num_tokens, k), dtype=torch.float32, device=x.device).copy_(acc[:, hidden:])
    return combined, acc_w


def _record_traffic(be: ReferenceBackend, dom: _Domains, op: str, counts1: list[int], row_bytes1: int,
                    counts2: list[int], row_bytes2: int) -> None:
    """Rows and bytes this rank sent in this call, per tier (its own rows to itself excluded)."""
    inter = sum(c for r, c in enumerate(counts1) if not dom.same_domain(r, be.rank))
    intra = sum(c for r, c in enumerate(counts2) if r != be.rank and dom.same_domain(r, be.rank))
    be.traffic[f"{op}_inter_domain_rows"] = inter
    be.traffic[f"{op}_inter_domain_bytes"] = inter * row_bytes1
    be.traffic[f"{op}_intra_domain_rows"] = intra
    be.traffic[f"{op}_intra_domain_bytes"] = intra * row_bytes2
