"""Normal mode across scale-up domains with the CUDA kernels (``Buffer(strategy="hierarchical",
backend="cuda")``): each token crosses the slow tier once per destination domain.

The group is split into domains of ``ranks_per_domain`` consecutive ranks (one per host, or the
virtual ones EPCOMM_RANKS_PER_DOMAIN sets); rank r's mate in domain d has r's local index there.
The same algorithm as the reference strategy (backends/reference/hierarchical.py), so results are
bitwise equal to it:

Dispatch
  1. counts: one all_gather of (tokens, tokens per rank, tokens per expert) gives every rank the
     flat count matrix (where each row lands in the end) and the host the sizes (the one host
     sync, like DeepEP's notify; ``num_worst_tokens`` skips the host read);
  2. stage (csrc/nvshmem/interdomain.cu): each token is copied once per destination domain into
     that domain's region of the NVSHMEM staging area, ascending, with its top-k ids rebased to the
     domain's experts and its is_token_in_rank restricted to the domain's ranks;
  3. slow tier: NVSHMEM puts of each region to the mate there, with signals (interdomain.cu);
  4. fast tier: the mate forwards what it received to its domain's ranks with the intranode
     kernels over CUDA IPC (CudaIntranode on the domain's group), whose inputs are the receive
     area itself (rows past each region's count carry no destination);
  5. the rows arrive ordered by (forwarder, source domain, token); one permutation makes the flat
     order (source rank, token).
Combine reverses it: the expert outputs go back to their forwarders, which sum them in fp32 in
ascending rank order without rounding (into the staging area), put one fp32 partial row per
(token, domain) back to the source, and the source sums the partials in ascending domain order,
adds the biases and rounds to bf16 once: the reference's additions in the reference's order.

The tiers run one after the other (the overlap of the two is still to do: README "Status").
"""

from __future__ import annotations

import ctypes
import zlib

import torch
import torch.distributed as dist

from ...handle import DispatchHandle
from .build import load_library, load_nvshmem_library
from .capi import check, ptr, stream_ptr
from .intranode import CudaIntranode, dispatch_layout
from .nvshmem import SymmetricBuffer

_ALIGN = 256
_OP_DISPATCH, _OP_CACHED, _OP_COMBINE = 1, 2, 3
_ERRORS = {1: "timed out waiting for rank(s) {ranks} (EPCOMM_TIMEOUT_S)",
           2: "rank(s) {ranks} called with another shape (hidden size, dtype, top-k, scales, operation)"}


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def dispatch_fields(hidden_bytes: int, num_scales: int, num_topk: int, with_weights: bool, ranks_per_domain: int,
                    routing: bool) -> list[tuple[str, int, int]]:
    """(name, bytes per row, fill byte of the rows past the count, -1 for none) of a dispatch's
    slow-tier rows; a cached dispatch (``routing=False``) moves the data and scales only."""
    fields = [("x", hidden_bytes, -1)]
    if num_scales:
        fields.append(("scales", num_scales * 4, -1))
    if routing:
        if num_topk:
            fields.append(("topk_idx", num_topk * 8, 0xFF))  # -1: no expert (the intranode kernels check ids)
            if with_weights:
                fields.append(("weights", num_topk * 4, -1))
        fields.append(("in_rank", ranks_per_domain, 0))  # no destination: the forwarder skips the row
    return fields


def combine_fields(hidden: int, num_topk: int) -> list[tuple[str, int, int]]:
    fields = [("partial", hidden * 4, -1)]
    if num_topk:
        fields.append(("weights", num_topk * 4, -1))
    return fields


def _area_bytes(fields: list[tuple[str, int, int]], num_domains: int, region_rows: int) -> int:
    return sum(_round_up(num_domains * region_rows * rb, _ALIGN) for _, rb, _ in fields)


def _fit_rows(fields: list[tuple[str, int, int]], num_domains: int, area: int) -> int:
    per_row = num_domains * sum(rb for _, rb, _ in fields)
    return max(0, (area - _ALIGN * len(fields)) // per_row)


def rdma_bytes_needed(num_tokens: int, hidden: int, element_size: int, num_ranks: int, ranks_per_domain: int,
                      num_topk: int = 0, num_scales: int = 0, header_bytes: int = 2304) -> int:
    """num_rdma_bytes a hierarchical Buffer on the CUDA backend needs for calls of up to
    ``num_tokens`` tokens per rank: a header, then a staging and a receive area, each holding one
    region of ``num_tokens`` rows per domain of the larger of a dispatch's and a combine's rows."""
    num_domains = num_ranks // ranks_per_domain
    rows = max(num_tokens, 1)
    area = max(_area_bytes(dispatch_fields(hidden * element_size, num_scales, num_topk, True, ranks_per_domain, True),
                           num_domains, rows),
               _area_bytes(combine_fields(hidden, num_topk), num_domains, rows))
    return header_bytes + 2 * (area + _ALIGN * 8)


_domain_groups: dict[tuple, dist.ProcessGroup] = {}


def _domain_group(group: dist.ProcessGroup, ranks_per_domain: int, my_domain: int) -> dist.ProcessGroup:
    """This rank's domain as a process group, made once per (group, split): new_group is collective
    over the whole group, so every rank makes every domain's, in the same order."""
    members = dist.get_process_group_ranks(group)
    key = (tuple(members), ranks_per_domain)
    if key not in _domain_groups:
        for d in range(len(members) // ranks_per_domain):
            ranks = members[d * ranks_per_domain:(d + 1) * ranks_per_domain]
            g = dist.new_group(ranks)
            if d == my_domain:
                _domain_groups[key] = g
    return _domain_groups[key]


class CudaHierarchical:
    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_nvl_bytes: int, num_rdma_bytes: int,
                 ranks_per_domain: int, timeout_s: float) -> None:
        self.group, self.device = group, device
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.rpd = ranks_per_domain
        self.num_domains = self.num_ranks // ranks_per_domain
        self.my_domain, self.local = divmod(self.rank, ranks_per_domain)
        self.timeout_ns = int(timeout_s * 1e9)
        self.lib = load_library()
        self.nv = load_nvshmem_library()
        self.c = {name: self.nv.epcomm_interdomain_constant(name.encode())
                  for name in ("header_bytes", "max_domains", "max_fields", "max_blocks_per_domain", "info_ints")}
        if self.num_domains > self.c["max_domains"]:
            raise ValueError(f"the hierarchical kernels support up to {self.c['max_domains']} domains, the group has "
                             f"{self.num_domains}")
        if num_rdma_bytes <= self.c["header_bytes"] + 4 * _ALIGN * 8:
            raise ValueError(f"num_rdma_bytes={num_rdma_bytes}: the hierarchical CUDA backend needs the NVSHMEM buffer "
                             "of the slow tier; size it with epcomm.backends.cuda.hierarchical.rdma_bytes_needed")
        # The fast tier: the intranode kernels on this rank's domain (every rank makes every domain's
        # group: new_group is collective over the whole group).
        self.tier2 = CudaIntranode(_domain_group(group, ranks_per_domain, self.my_domain), device, num_nvl_bytes,
                                   timeout_s)
        # The slow tier: this rank's NVSHMEM buffer (header of signals, staging area, receive area).
        self.sym = SymmetricBuffer(group, device, num_rdma_bytes, set(), "num_rdma_bytes")
        self.area = (num_rdma_bytes - self.c["header_bytes"]) // 2 // _ALIGN * _ALIGN
        self.base = self.sym.tensor.data_ptr()
        self.info = torch.zeros(self.c["info_ints"], dtype=torch.int32, pin_memory=True)
        self.info_np = self.info.numpy()
        self.call = 0
        self.traffic_state: dict[str, object] = {}
        dist.barrier(group=group)

    # ------------------------------------------------------------------ lifecycle and errors
    def close(self) -> None:
        self.tier2.close()
        self.sym.close()

    def barrier(self, op: str) -> None:
        self.tier2.barrier(op)
        self.check_errors(op)

    def check_errors(self, op: str) -> None:
        """Raise what the slow-tier kernel reported (call after a sync that covers it)."""
        self.tier2.check_errors(op)
        code = int(self.info_np[0])
        if code == 0:
            return
        ranks = [r for r in range(self.num_ranks) if self.info_np[1 + r]]
        self.info_np[:] = 0
        message = _ERRORS.get(code, f"error {code}").format(ranks=ranks)
        raise RuntimeError(f"epcomm {op} (hierarchical, inter-domain tier) on rank {self.rank}: {message}. Destroy "
                           "the Buffer and the process group.")

    # ------------------------------------------------------------------ the symmetric areas
    def _views(self, fields: list[tuple[str, int, int]], region_rows: int, area: str) -> dict[str, torch.Tensor]:
        """Each field of the staging or receive area as a [num_domains * region_rows, row bytes] uint8 view."""
        begin = self.c["header_bytes"] + (self.area if area == "recv" else 0)
        views, offset = {}, 0
        rows = self.num_domains * region_rows
        for name, rb, _ in fields:
            views[name] = self.sym.tensor[begin + offset:begin + offset + rows * rb].view(rows, rb)
            offset += _round_up(rows * rb, _ALIGN)
        return views

    def _offsets(self, fields: list[tuple[str, int, int]], region_rows: int) -> list[int]:
        offsets, offset = [], 0
        for _, rb, _ in fields:
            offsets.append(offset)
            offset += _round_up(self.num_domains * region_rows * rb, _ALIGN)
        return offsets

    def _region_rows(self, *layouts: list[tuple[str, int, int]]) -> int:
        return min(_fit_rows(f, self.num_domains, self.area) for f in layouts)

    def _exchange(self, fields, region_rows: int, send_counts: torch.Tensor, recv_counts: torch.Tensor, op: int,
                  num_sms: int) -> None:
        """The slow tier: every region to its domain's mate (interdomain.cu exchange_kernel)."""
        offsets = self._offsets(fields, region_rows)
        desc = (ctypes.c_int64 * (3 * len(fields)))(*[v for (_, rb, fill), off in zip(fields, offsets)
                                                      for v in (off, rb, fill)])
        tag = zlib.crc32(repr((op, region_rows, [rb for _, rb, _ in fields])).encode()) & 0xFFFFF
        blocks = max(1, min(self.c["max_blocks_per_domain"], num_sms // self.num_domains))
        self.call += 1
        code = self.nv.epcomm_interdomain_exchange(
            ctypes.c_void_p(self.base),
            ctypes.c_int64(self.area), ctypes.c_int64(region_rows), desc, len(fields), ptr(send_counts),
            ptr(recv_counts), self.num_domains, self.my_domain, self.rpd, self.local, ctypes.c_int64(self.call), tag,
            blocks, ctypes.c_void_p(self.info.data_ptr()), ctypes.c_uint64(self.timeout_ns), stream_ptr(self.device))
        check(code, "hierarchical exchange")

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, ranks_per_domain: int):
        return dispatch_layout(self.lib, self.device, topk_idx, num_experts, self.num_ranks, ranks_per_domain)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x, scales, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                 topk_weights, expert_alignment, num_worst_tokens, num_experts, buffer_uid, num_sms):
        R, D, L = self.num_ranks, self.num_domains, self.rpd
        num_tokens, hidden = x.shape
        cached = handle is not None
        num_scales = scales.shape[1] if scales is not None else 0
        num_topk = topk_idx.shape[1] if topk_idx is not None else 0
        if cached:
            st = handle.backend_state
            flags, pos, send1, region_rows = st["flags"], st["pos"], st["send1"], st["region_rows"]
            experts_per_domain, num_worst_tokens = st["experts_per_domain"], handle.num_worst_tokens
            fields = dispatch_fields(hidden * x.element_size(), num_scales, 0, False, L, False)
        else:
            experts_per_domain = num_experts // D
            fields = dispatch_fields(hidden * x.element_size(), num_scales, num_topk, topk_weights is not None, L, True)
            comb = combine_fields(hidden, num_topk)
            # Counts: where every row lands in the end (the flat matrix), and the per-expert totals.
            mine = torch.cat([torch.full((1,), num_tokens, dtype=torch.int32, device=self.device),
                              num_tokens_per_rank.to(torch.int32), num_tokens_per_expert.to(torch.int32)])
            gathered = torch.empty((R, mine.numel()), dtype=torch.int32, device=self.device)
            dist.all_gather_into_tensor(gathered, mine, group=self.group)
            matrix = gathered[:, 1:1 + R]
            region_rows = self._region_rows(fields, comb)
            if num_worst_tokens:
                most = num_tokens  # no host read: each rank checks its own
            else:
                host = gathered.cpu()
                most = int(host[:, 0].max())
                region_rows = min(region_rows, _round_up(max(most, 1), 16))  # less work for the forwarders
            if most > region_rows:
                raise ValueError(f"epcomm dispatch (hierarchical): {most} tokens on a rank, but num_rdma_bytes="
                                 f"{self.sym.num_bytes} holds {region_rows} per domain region for these rows; size "
                                 "it with epcomm.backends.cuda.hierarchical.rdma_bytes_needed")
            in_domain = is_token_in_rank.view(num_tokens, D, L)
            flags = in_domain.any(-1).contiguous()
            counts = flags.to(torch.int32)
            pos = (torch.cumsum(counts, 0, dtype=torch.int32) - counts).contiguous()
            send1 = counts.sum(0, dtype=torch.int32)
        if num_tokens > region_rows:
            raise ValueError(f"x has {num_tokens} tokens but this dispatch's regions hold {region_rows}")

        # Stage, then the slow tier.
        stage = self._views(fields, region_rows, "stage")
        offsets = [stage[name].data_ptr() - stage["x"].data_ptr() if name in stage else 0
                   for name in ("x", "scales", "topk_idx", "weights", "in_rank")]
        code = self.nv.epcomm_interdomain_stage(
            ptr(x), ctypes.c_int64(hidden * x.element_size()), ptr(scales), num_scales,
            ctypes.c_int64(scales.stride(0) if scales is not None else 0),
            ctypes.c_int64(scales.stride(1) if scales is not None else 0),
            ptr(None if cached else topk_idx.contiguous() if num_topk else None),
            ptr(None if cached else topk_weights), num_topk,
            ptr(None if cached else is_token_in_rank.contiguous()), ptr(flags), ptr(pos), num_tokens, D, L,
            experts_per_domain,
            ctypes.c_void_p(stage["x"].data_ptr()), ctypes.c_int64(region_rows),
            (ctypes.c_int64 * 5)(*offsets), stream_ptr(self.device))
        check(code, "hierarchical dispatch (stage)")
        recv1 = torch.empty(D, dtype=torch.int32, device=self.device)
        self._exchange(fields, region_rows, send1, recv1, _OP_CACHED if cached else _OP_DISPATCH, num_sms)

        # The fast tier: forward the receive area's rows inside the domain.
        got = self._views(fields, region_rows, "recv")
        x1 = got["x"].view(x.dtype)
        scales1 = got["scales"].view(scales.dtype) if scales is not None else None
        if cached:
            out = self.tier2.dispatch(x1, scales1, st["tier2"], None, None, None, None, None, 1, 0, 0, buffer_uid,
                                      num_sms)
        else:
            # A copy: the tier-2 handle keeps it for the combine, and later calls overwrite the area.
            in_rank1 = got["in_rank"].view(torch.bool).clone()
            topk1 = got["topk_idx"].view(torch.int64) if num_topk else None
            weights1 = got["weights"].view(torch.float32) if topk_weights is not None else None
            # The per-expert counts are taken from the gathered totals below, not from the forwarders.
            no_expert_counts = torch.zeros(experts_per_domain, dtype=torch.int32, device=self.device)
            out = self.tier2.dispatch(x1, scales1, None, in_rank1.sum(0, dtype=torch.int32), in_rank1,
                                      no_expert_counts, topk1, weights1, 1, num_worst_tokens, experts_per_domain,
                                      buffer_uid, num_sms)
        self.check_errors("dispatch")
        recv_x, recv_topk_idx, recv_topk_weights, _, handle2 = out

        # The flat order: (source rank, token) from (forwarder, source domain, token).
        if cached:
            dest, col_major = st["dest"], st["col_major"]
        else:
            col_major = scales is not None and scales.stride(0) == 1 and num_scales > 1
            num_rows = num_worst_tokens or handle2.num_recv_tokens
            dest = self._flat_order(matrix[:, self.rank], num_rows)
        if dest is not None:
            recv_x = _scatter_rows(recv_x, dest)
            if not cached:
                recv_topk_idx, recv_topk_weights = _scatter_rows(recv_topk_idx, dest), _scatter_rows(
                    recv_topk_weights, dest)
        if col_major:
            recv_x = (recv_x[0], recv_x[1].t().contiguous().t())
        self.traffic_state.update(op="dispatch", send1=send1, row1=sum(rb for _, rb, _ in fields),
                                  send2=handle2.send_counts, row2=_tier2_row_bytes(recv_x, num_topk, cached,
                                                                                    topk_weights is not None))
        if cached:
            return recv_x, None, None, None, handle
        if num_worst_tokens:
            expert_list, send_counts, recv_counts = [], [], []
        else:
            epr = num_experts // R
            totals = host[:, 1 + R + self.rank * epr:1 + R + (self.rank + 1) * epr].sum(0).tolist()
            a = expert_alignment
            expert_list = [(int(c) + a - 1) // a * a for c in totals]
            send_counts = host[self.rank, 1:1 + R].tolist()
            recv_counts = host[:, 1 + self.rank].tolist()
        new_handle = DispatchHandle(
            buffer_uid=buffer_uid, num_tokens=num_tokens, hidden=hidden, num_recv_tokens=handle2.num_recv_tokens,
            num_worst_tokens=num_worst_tokens, is_token_in_rank=is_token_in_rank, send_counts=send_counts,
            recv_counts=recv_counts,
            backend_state={"flags": flags, "pos": pos, "send1": send1, "recv1": recv1, "region_rows": region_rows,
                           "experts_per_domain": experts_per_domain, "tier2": handle2, "dest": dest,
                           "col_major": col_major})
        return recv_x, recv_topk_idx, recv_topk_weights, expert_list, new_handle

    def _flat_order(self, column: torch.Tensor, num_rows: int) -> torch.Tensor | None:
        """Where each received row goes in the flat order, on the device (no host sync): the rows come
        in blocks (forwarder f, source domain d) of column[d * L + f] rows; the flat order wants the
        blocks by source rank d * L + f. None when the two orders are the same."""
        D, L = self.num_domains, self.rpd
        if D == 1 or L == 1:
            return None
        sizes = column.to(torch.int64)
        arrival_sizes = sizes.view(D, L).t().reshape(-1)  # block b = f * D + d
        arrival_end = torch.cumsum(arrival_sizes, 0)
        arrival_start = arrival_end - arrival_sizes
        flat_start = torch.cumsum(sizes, 0) - sizes
        b = torch.arange(D * L, device=self.device)
        flat_block = (b % D) * L + b // D
        i = torch.arange(num_rows, device=self.device)
        block = torch.searchsorted(arrival_end, i, right=True)
        valid = block < D * L
        block = block.clamp(max=D * L - 1)
        # Rows past the received ones (num_worst_tokens padding) stay where they are.
        return torch.where(valid, flat_start[flat_block[block]] + i - arrival_start[block], i)

    # ------------------------------------------------------------------ combine
    def combine(self, x, handle: DispatchHandle, topk_weights, biases, num_sms):
        st = handle.backend_state
        D = self.num_domains
        num_tokens, hidden = handle.num_tokens, x.shape[1]
        num_topk = topk_weights.shape[1] if topk_weights is not None else 0
        dest, region_rows = st["dest"], st["region_rows"]
        if dest is not None:  # back to the order the rows arrived in
            x = x.index_select(0, dest)
            topk_weights = topk_weights.index_select(0, dest) if num_topk else None
        fields = combine_fields(hidden, num_topk)
        stage = self._views(fields, region_rows, "stage")
        partial = stage["partial"].view(torch.float32)
        partial_w = stage["weights"].view(torch.float32) if num_topk else None
        # The fast tier: each forwarder sums its domain's rows per received row, in fp32, unrounded.
        self.tier2.combine(x, st["tier2"], topk_weights, (), num_sms, out=partial, out_w=partial_w)
        # The slow tier: each partial row back to its source (the dispatch's counts, reversed).
        back = torch.empty(D, dtype=torch.int32, device=self.device)
        self._exchange(fields, region_rows, st["recv1"], back, _OP_COMBINE, num_sms)
        got = self._views(fields, region_rows, "recv")
        out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=self.device)
        out_w = torch.empty((num_tokens, num_topk), dtype=torch.float32, device=self.device) if num_topk else None
        bias0 = biases[0] if len(biases) > 0 else None
        bias1 = biases[1] if len(biases) > 1 else None
        code = self.nv.epcomm_interdomain_reduce(
            ptr(got["partial"]), ptr(got["weights"] if num_topk else None), ctypes.c_int64(region_rows),
            ptr(st["flags"]), ptr(st["pos"]), ptr(bias0), ptr(bias1), ptr(out), ptr(out_w), num_tokens, hidden,
            num_topk, D, stream_ptr(self.device))
        check(code, "hierarchical combine (reduce)")
        self.traffic_state.update(op="combine", recv1=st["recv1"], row1c=sum(rb for _, rb, _ in fields),
                                  send2c=st["tier2"].recv_counts, row2c=hidden * 2 + num_topk * 4)
        return out, out_w

    # ------------------------------------------------------------------ per-tier bytes
    def traffic(self, op: str) -> dict[str, int]:
        """Rows and bytes this rank sent over each tier in its latest ``op`` (host read: syncs),
        counted as the reference backend counts them: its own rows to itself excluded."""
        s = self.traffic_state
        mine, me2 = self.my_domain, self.local
        if op == "dispatch" and "send1" in s:
            sent1, row1, sent2, row2 = s["send1"].tolist(), s["row1"], s["send2"], s["row2"]
        elif op == "combine" and "recv1" in s and "row1c" in s:
            sent1, row1, sent2, row2 = s["recv1"].tolist(), s["row1c"], s["send2c"], s["row2c"]
        else:
            return {}
        inter = sum(c for d, c in enumerate(sent1) if d != mine)
        intra = sum(c for j, c in enumerate(sent2) if j != me2)
        return {f"{op}_inter_domain_rows": inter, f"{op}_inter_domain_bytes": inter * row1,
                f"{op}_intra_domain_rows": intra, f"{op}_intra_domain_bytes": intra * row2}


def _tier2_row_bytes(recv_x, num_topk: int, cached: bool, with_weights: bool) -> int:
    data, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    row = data.shape[1] * data.element_size() + (scales.shape[1] * 4 if scales is not None else 0)
    if not cached and num_topk:
        row += num_topk * 8 + (num_topk * 4 if with_weights else 0)
    return row


def _scatter_rows(t, dest: torch.Tensor):
    """``out[dest[i]] = t[i]`` for a tensor, an FP8 (data, scales) pair, or None; rows move as bytes."""
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(_scatter_rows(part, dest) for part in t)
    if t.shape[0] == 0:
        return t
    rows = t.contiguous()
    width = rows[0].numel() * rows.element_size()
    out = torch.empty_like(rows)
    if width:
        out.view(rows.shape[0], -1).view(torch.uint8).index_copy_(0, dest, rows.view(rows.shape[0], -1).view(
            torch.uint8))
    return out
