"""The single-process oracle: every rank's inputs in, every rank's outputs out, in plain torch.

What each operation of the API must return, written as directly as the definitions allow, with no
collective and no concern for speed, so that the portable path, the CUDA kernels, the benchmark's
checks and the tests all compare against one statement of the semantics:

- normal dispatch: rank d receives the tokens routed to any of its experts, ordered by source rank,
  then source token; top-k ids become local expert ids (-1 for other ranks' experts, weight 0);
  per-expert counts are rounded up to ``expert_alignment``; with ``num_worst_tokens`` the outputs
  have that many rows, the rows past the received ones x = 0, ids -1, weights 0 (and no counts list);
- normal combine: a token's rows from its destinations are summed in fp32 in ascending destination
  rank, then the biases in order, then rounded once to bf16; the returned weights likewise (fp32);
- low-latency dispatch: per local expert, one block per source rank in rank order, each block the
  source's (token, top-k slot) entries for that expert by token then slot; FP8 as epcomm/fp8.py casts;
- low-latency combine: per token, ``acc = acc + w_k * row_k`` in fp32 for slot k = 0, 1, ... (slots
  without an expert or routed to a masked rank skipped), then rounded to bf16.

A rank's inputs are given as lists indexed by rank. ``exact=True`` on the combines accumulates in
float64 and does not round, for checks of paths that sum in another order (NCCL's reduce-scatter,
sums by partials), which must lie within a rounding of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8 import pack_ue8m0, quantize_groups

XInput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # bf16 rows, or (FP8 data, scales)


def _take(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of ``t`` (dense); one-byte floats move as bytes (not every device gathers FP8)."""
    if t.element_size() == 1 and t.is_floating_point():
        return t.contiguous().view(torch.uint8)[rows].view(t.dtype)
    return t[rows].contiguous()


def _cat(parts: list[torch.Tensor], like: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``parts`` stacked by rows and zero-padded to ``num_rows`` (bytewise, so FP8 works everywhere)."""
    width = like.shape[1:]
    out = torch.zeros((num_rows, *width), dtype=like.dtype, device=like.device)
    as_bytes = like.element_size() == 1 and like.is_floating_point()
    dst = out.view(torch.uint8) if as_bytes else out
    begin = 0
    for p in parts:
        dst[begin:begin + p.shape[0]] = p.view(torch.uint8) if as_bytes else p
        begin += p.shape[0]
    return out


# ----------------------------------------------------------------------------------------------- normal
def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_domain: int | None = None):
    """``get_dispatch_layout`` of one rank: (tokens per rank [R] int32, per domain [D] int32 or None with
    one domain, per expert [E] int32, is_token_in_rank [T, R] bool); -1 ids are ignored."""
    experts_per_rank = num_experts // num_ranks
    owner = torch.where(topk_idx >= 0, topk_idx // experts_per_rank, -1)
    in_rank = torch.stack([(owner == r).any(1) for r in range(num_ranks)], 1)
    per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).to(torch.int32)
    per_domain = None
    domain = ranks_per_domain or num_ranks
    if num_ranks // domain > 1:
        per_domain = in_rank.view(in_rank.shape[0], num_ranks // domain, domain).any(2).sum(0).to(torch.int32)
    return in_rank.sum(0).to(torch.int32), per_domain, per_expert, in_rank


def count_matrix(in_ranks: list[torch.Tensor]) -> torch.Tensor:
    """[src, dst] int64: the rows each rank sends each rank. Its cumulative sum over sources (int32)
    is DeepEP's ``handle[0]``, the rank prefix matrix."""
    return torch.stack([m.sum(0).to(torch.int64).cpu() for m in in_ranks])


@dataclass
class Dispatched:
    """What rank ``rank`` receives from a normal dispatch."""

    x: XInput  # [rows, H] (data, [rows, S] row-major scales) with FP8
    topk_idx: torch.Tensor | None  # [rows, K] local expert ids, -1 elsewhere
    topk_weights: torch.Tensor | None  # [rows, K] fp32, 0 where the id is -1
    expert_counts: list[int]  # per local expert, aligned; [] with num_worst_tokens
    recv_counts: list[int]  # rows from each source rank
    src_rank: torch.Tensor  # [num_recv] int64: the source rank of each received row
    src_token: torch.Tensor  # [num_recv] int64: its token index there

    @property
    def num_recv(self) -> int:
        return int(self.src_rank.numel())


def dispatch_to(rank: int, xs: list[XInput], topk_idx: list[torch.Tensor] | None, num_experts: int,
                topk_weights: list[torch.Tensor] | None = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                in_ranks: list[torch.Tensor] | None = None) -> Dispatched:
    """Rank ``rank``'s outputs of a dispatch of every rank's ``xs`` (routing by ``topk_idx``, or by
    ``in_ranks``, every rank's is_token_in_rank, when there are no top-k ids: a cached dispatch)."""
    num_ranks = len(xs)
    if in_ranks is None:
        in_ranks = [dispatch_layout(idx, num_experts, num_ranks)[3] for idx in topk_idx]
    tokens = [torch.nonzero(in_ranks[s][:, rank]).flatten().to(torch.int64) for s in range(num_ranks)]
    num_recv = sum(t.numel() for t in tokens)
    if num_worst_tokens and num_recv > num_worst_tokens:
        raise ValueError(f"rank {rank} receives {num_recv} rows, more than num_worst_tokens={num_worst_tokens}")
    rows = num_worst_tokens or num_recv
    parts = [xs] if isinstance(xs[0], torch.Tensor) else [[x[0] for x in xs], [x[1] for x in xs]]
    out = [_cat([_take(p[s], tokens[s]) for s in range(num_ranks)], p[rank], rows) for p in parts]
    recv_x = out[0] if len(out) == 1 else (out[0], out[1])
    recv_idx = recv_w = None
    expert_counts: list[int] = []
    if topk_idx is not None:
        experts_per_rank = num_experts // num_ranks
        glob = torch.cat([topk_idx[s][tokens[s]] for s in range(num_ranks)])
        mine = (glob >= rank * experts_per_rank) & (glob < (rank + 1) * experts_per_rank)
        local = torch.where(mine, glob - rank * experts_per_rank, -1)
        recv_idx = torch.full((rows, glob.shape[1]), -1, dtype=torch.int64, device=glob.device)
        recv_idx[:num_recv] = local
        if topk_weights is not None:
            w = torch.cat([topk_weights[s][tokens[s]] for s in range(num_ranks)])
            recv_w = torch.zeros((rows, glob.shape[1]), dtype=torch.float32, device=w.device)
            recv_w[:num_recv] = torch.where(mine, w, 0.0)
        if not num_worst_tokens:
            counts = torch.bincount(local[local >= 0], minlength=experts_per_rank).tolist()
            a = expert_alignment
            expert_counts = [(c + a - 1) // a * a for c in counts]
    src_rank = torch.cat([torch.full((t.numel(),), s, dtype=torch.int64) for s, t in enumerate(tokens)])
    return Dispatched(recv_x, recv_idx, recv_w, expert_counts, [t.numel() for t in tokens], src_rank,
                      torch.cat([t.cpu() for t in tokens]))


def dispatch(xs: list[XInput], topk_idx: list[torch.Tensor] | None, num_experts: int, **kwargs) -> list[Dispatched]:
    """Every rank's outputs of a dispatch (``dispatch_to``'s arguments)."""
    return [dispatch_to(r, xs, topk_idx, num_experts, **kwargs) for r in range(len(xs))]


def combine(ys: list[torch.Tensor], in_ranks: list[torch.Tensor], topk_weights: list[torch.Tensor] | None = None,
            biases: list[tuple[torch.Tensor, ...]] | None = None, exact: bool = False
            ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Every source rank's (combined_x [T, H] bf16, combined_topk_weights [T, K] fp32 or None) when rank
    d returns ``ys[d]`` (its dispatch's rows, in the receive order, padding past them ignored), and its
    ``topk_weights[d]``; ``in_ranks`` is the dispatch's routing, ``biases[s]`` rank s's biases."""
    num_ranks = len(ys)
    acc_dtype = torch.float64 if exact else torch.float32
    results = []
    for s in range(num_ranks):
        num_tokens, hidden = in_ranks[s].shape[0], ys[s].shape[1]
        acc = torch.zeros((num_tokens, hidden), dtype=acc_dtype, device=ys[s].device)
        acc_w = None
        if topk_weights is not None:
            acc_w = torch.zeros((num_tokens, topk_weights[s].shape[1]), dtype=acc_dtype, device=ys[s].device)
        for d in range(num_ranks):  # ascending destination rank
            # Rank d holds the rows of sources 0..s-1 first, then rank s's tokens routed to it, ascending.
            begin = sum(int(in_ranks[j][:, d].sum()) for j in range(s))
            tokens = torch.nonzero(in_ranks[s][:, d]).flatten()
            rows = slice(begin, begin + tokens.numel())
            acc[tokens] = acc[tokens] + ys[d][rows].to(acc_dtype)
            if acc_w is not None:
                acc_w[tokens] = acc_w[tokens] + topk_weights[d][rows].to(acc_dtype)
        for bias in (biases[s] if biases is not None else ()):
            acc = acc + bias.to(acc_dtype)
        results.append((acc if exact else acc.to(torch.bfloat16), acc_w))
    return results


# ------------------------------------------------------------------------------------------ low latency
@dataclass
class LowLatencyDispatched:
    """What rank ``rank`` receives from a low-latency dispatch (rows past ``count[e]`` are zeros, their
    ``src_info`` -1; the API leaves them unspecified)."""

    x: XInput  # [E_local, N * R, H] bf16, or (e4m3 data, [E_local, N * R, S] scales, dense)
    count: torch.Tensor  # [E_local] int32
    src_info: torch.Tensor  # [E_local, N * R] int32: each row's source token
    layout_range: torch.Tensor  # [E_local, R] int64: (begin << 32) | count of each source's block


def _entries(topk_idx: torch.Tensor, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, slots) of the entries of ``topk_idx`` that select ``expert``, by token then slot."""
    tokens, slots = torch.nonzero(topk_idx == expert, as_tuple=True)  # row-major: by token, then slot
    return tokens.cpu(), slots.cpu()


def low_latency_dispatch_to(rank: int, xs: list[torch.Tensor], topk_idx: list[torch.Tensor], num_experts: int,
                            num_max_tokens: int, use_fp8: bool = True, round_scale: bool = False,
                            use_ue8m0: bool = False, masked: set[int] | None = None) -> LowLatencyDispatched:
    """Rank ``rank``'s outputs of a low-latency dispatch of every rank's bf16 ``xs`` routed by
    ``topk_idx``; ``masked`` ranks receive nothing (their own tokens still go to the others)."""
    num_ranks = len(xs)
    experts_per_rank = num_experts // num_ranks
    hidden = xs[rank].shape[1]
    rows = num_max_tokens * num_ranks
    blocks: list[list[torch.Tensor]] = [[] for _ in range(experts_per_rank)]
    src_info = torch.full((experts_per_rank, rows), -1, dtype=torch.int32)
    layout_range = torch.zeros((experts_per_rank, num_ranks), dtype=torch.int64)
    count = torch.zeros(experts_per_rank, dtype=torch.int32)
    for e in range(experts_per_rank):
        begin = 0
        for j in range(num_ranks):
            tokens = _entries(topk_idx[j], rank * experts_per_rank + e)[0] if rank not in (masked or ()) else \
                torch.empty(0, dtype=torch.int64)
            c = tokens.numel()
            blocks[e].append(xs[j][tokens.to(xs[j].device)])
            src_info[e, begin:begin + c] = tokens.to(torch.int32)
            layout_range[e, j] = (begin << 32) | c
            begin += c
        count[e] = begin
    data = torch.zeros((experts_per_rank, rows, hidden), dtype=torch.bfloat16, device=xs[rank].device)
    for e in range(experts_per_rank):
        data[e, :int(count[e])] = torch.cat(blocks[e])
    dev = data.device
    src_info, layout_range, count = src_info.to(dev), layout_range.to(dev), count.to(dev)
    if not use_fp8:
        return LowLatencyDispatched(data, count, src_info, layout_range)
    # The cast is per row, so casting the received rows equals receiving each sender's cast rows.
    q, scales = quantize_groups(data.view(-1, hidden), round_scale=round_scale)
    if use_ue8m0:
        scales = pack_ue8m0(scales)
    q = q.view(experts_per_rank, rows, hidden)
    scales = scales.view(experts_per_rank, rows, -1)
    for e, c in enumerate(count.tolist()):  # rows past the count: zero bytes, zero scales, as for bf16
        q.view(torch.uint8)[e, c:] = 0
        scales[e, c:] = 0
    return LowLatencyDispatched((q, scales), count, src_info, layout_range)


def low_latency_dispatch(xs: list[torch.Tensor], topk_idx: list[torch.Tensor], num_experts: int,
                         num_max_tokens: int, **kwargs) -> list[LowLatencyDispatched]:
    """Every rank's outputs of a low-latency dispatch (``low_latency_dispatch_to``'s arguments)."""
    return [low_latency_dispatch_to(r, xs, topk_idx, num_experts, num_max_tokens, **kwargs) for r in range(len(xs))]


def low_latency_combine(ys: list[torch.Tensor], src_info: list[torch.Tensor], layout_range: list[torch.Tensor],
                        topk_idx: list[torch.Tensor], topk_weights: list[torch.Tensor], num_experts: int,
                        masked: set[int] | None = None, exact: bool = False) -> list[torch.Tensor]:
    """Every rank's combined_x [T, H] (bf16, or float64 when ``exact``) when rank d returns ``ys[d]``
    [E_local, N * R, H] for the rows its dispatch received, located by its handle's ``src_info[d]`` and
    ``layout_range[d]`` (a block's rows in any order; a token's repeated rows go to its slots in order)."""
    num_ranks = len(ys)
    experts_per_rank = num_experts // num_ranks
    hidden = ys[0].shape[2]
    acc_dtype = torch.float64 if exact else torch.float32
    # rows[j][t, k]: the row that came back for rank j's token t, slot k; present[j][t, k]: whether one did.
    rows = [torch.zeros((*idx.shape, hidden), dtype=acc_dtype) for idx in topk_idx]
    present = [torch.zeros(idx.shape, dtype=torch.bool) for idx in topk_idx]
    for d in range(num_ranks):
        if d in (masked or ()):
            continue
        for e in range(experts_per_rank):
            for j in range(num_ranks):
                word = int(layout_range[d][e, j])
                begin, c = word >> 32, word & 0xFFFFFFFF
                got = src_info[d][e, begin:begin + c].cpu().to(torch.int64)
                order = torch.sort(got, stable=True).indices
                tokens, slots = _entries(topk_idx[j], d * experts_per_rank + e)
                if not torch.equal(got[order], tokens):
                    raise ValueError(f"rank {d} expert {e}: the handle's rows from rank {j} are not the tokens "
                                     "routed to that expert")
                rows[j][tokens, slots] = ys[d][e, begin + order.to(ys[d].device)].cpu().to(acc_dtype)
                present[j][tokens, slots] = True
    out = []
    for j in range(num_ranks):
        acc = torch.zeros((topk_idx[j].shape[0], hidden), dtype=acc_dtype)
        w = topk_weights[j].cpu().to(acc_dtype)
        for k in range(topk_idx[j].shape[1]):  # slot 0 first
            acc = torch.where(present[j][:, k:k + 1], acc + w[:, k:k + 1] * rows[j][:, k], acc)
        out.append((acc if exact else acc.to(torch.bfloat16)).to(ys[j].device))
    return out
