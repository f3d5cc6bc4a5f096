"""Normal mode across scale-up domains with the CUDA kernels (``Buffer(strategy="hierarchical",
backend="cuda")``): each token crosses the slow tier once per destination domain.

The group is split into domains of ``ranks_per_domain`` consecutive ranks (one per host, or the
virtual ones EPCOMM_RANKS_PER_DOMAIN sets); rank r's mate in domain d has r's local index there.
The algorithm is the reference strategy's (backends/reference/hierarchical.py), so the results are
bitwise equal to it. The kernels: csrc/nvshmem/hierarchical.cuh (design, shared device code),
hierarchical_dispatch.cu and hierarchical_combine.cu.

Dispatch
  1. notify: every rank puts its counts (tokens, tokens per rank, tokens per expert, a digest of
     the call's shape) to every rank over NVSHMEM (bounded waits: no host collective to hang on a
     dead rank). The flat count matrix's prefix sums say where each source's rows start in each
     receiver's output; the host reads the sizes (the one host sync, like DeepEP's notify;
     ``num_worst_tokens`` skips the host read, so the call can be captured in a CUDA graph);
  2. stage: each token is copied once per destination domain into that domain's region of the
     NVSHMEM staging area, ascending, with its top-k ids rebased to the domain's experts and its
     slot at each of the domain's ranks (its index among this rank's tokens to that rank);
  3. one kernel runs both tiers at once: sender blocks put each region, chunk by chunk, to the
     mate there (NVSHMEM puts and signals); forwarder blocks take each chunk as its signal lands and
     store its rows over NVLink (CUDA IPC) straight into the final positions in the domain ranks'
     receive areas (start of the source's block + slot): the flat order, with no sort;
  4. each rank copies its received rows out of its area.
Combine reverses it in one kernel: each rank's expert outputs are copied into its IPC area; the
forwarders pull, for every row they forwarded, what the domain's ranks return, sum it in fp32 in
ascending rank order without rounding, and put each chunk's partial sums back to the source,
which sums them in ascending domain order, adds the biases and rounds to bf16 once: the
reference's additions in the reference's order.
"""

from __future__ import annotations

import ctypes
import zlib

import torch
import torch.distributed as dist

from ... import _env
from ...handle import DispatchHandle
from .build import load_library, load_nvshmem_library
from .capi import check, ptr, stream_ptr
from .intranode import dispatch_layout
from .ipc import SharedBuffer
from .nvshmem import SymmetricBuffer

_ALIGN = 256
_OP_DISPATCH, _OP_CACHED, _OP_COMBINE = 1, 2, 3
_ERRORS = {1: "timed out waiting for rank(s) {ranks} (EPCOMM_TIMEOUT_S)",
           2: "rank(s) {ranks} called another operation or shape (hidden size, dtype, top-k, scales)",
           3: "the receive area of rank(s) {ranks} is too small for this call (num_nvl_bytes)",
           4: "rank(s) {ranks} received more rows than num_worst_tokens",
           5: "rank(s) {ranks} refused the inputs (top-k ids outside [-1, num_experts), or num_tokens_per_rank not "
              "is_token_in_rank.sum(0): pass both from get_dispatch_layout)",
           6: "rank(s) {ranks} had an error in an earlier call (raised there)"}
_MAX_EXPERTS = 12 * 1024  # the layout kernel's limit: the per-expert totals are summed over this width
_SYM_HEADER = 4096    # mirrors kSymHeaderBytes (checked when the library loads)
_DOMAIN_HEADER = 16384  # mirrors kDomainHeaderBytes


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def dispatch_fields(hidden_bytes: int, num_scales: int, num_topk: int, with_weights: bool, ranks_per_domain: int,
                    routing: bool) -> list[int]:
    """Bytes per row of each slow-tier field of a dispatch, in the kernel's order (x, scales, top-k
    ids, weights, slots); 0 for a field not moved (a cached dispatch moves x and scales only)."""
    return [hidden_bytes, num_scales * 4, num_topk * 8 if routing else 0,
            num_topk * 4 if routing and with_weights else 0, ranks_per_domain * 4 if routing else 0]


def combine_fields(hidden: int, num_topk: int) -> list[int]:
    """Bytes per row of a combine's slow-tier fields: the fp32 partial sums and the weights' sums."""
    return [hidden * 4, num_topk * 4]


def _offsets(row_bytes: list[int], rows: int) -> tuple[list[int], int]:
    """Each field's array of ``rows`` rows, one after the other (256-byte aligned); and their total."""
    offsets, at = [], 0
    for rb in row_bytes:
        offsets.append(at)
        at += _round_up(rows * rb, _ALIGN)
    return offsets, at


def _fit_rows(row_bytes: list[int], area: int) -> int:
    per_row = sum(row_bytes)
    return max(0, (area - _ALIGN * len(row_bytes)) // max(per_row, 1))


def rdma_bytes_needed(num_tokens: int, hidden: int, element_size: int, num_ranks: int, ranks_per_domain: int,
                      num_topk: int = 0, num_scales: int = 0) -> int:
    """num_rdma_bytes a hierarchical Buffer on the CUDA backend needs for calls of up to
    ``num_tokens`` tokens per rank: a header, then a staging and a receive area, each holding one
    region of ``num_tokens`` rows per domain of the larger of a dispatch's and a combine's rows."""
    rows = (num_ranks // ranks_per_domain) * max(num_tokens, 1)
    area = max(_offsets(dispatch_fields(hidden * element_size, num_scales, num_topk, True, ranks_per_domain, True),
                        rows)[1], _offsets(combine_fields(hidden, num_topk), rows)[1])
    return _stage_offset(num_ranks) + 2 * (area + _ALIGN * 5)  # room for each field's alignment (_fit_rows)


def _counts_width(num_ranks: int) -> int:
    """Ints of a counts row (notify_kernel): tokens, shape digest, tokens per rank, per expert."""
    return 2 + num_ranks + _MAX_EXPERTS


def _stage_offset(num_ranks: int) -> int:
    """Where the staging area starts in the NVSHMEM buffer: after the header and the counts area
    (two sets of incoming rows, one per rank, the outgoing row, the current rows)."""
    return _SYM_HEADER + _round_up((3 * num_ranks + 1) * _counts_width(num_ranks) * 4, 4096)


def nvl_bytes_needed(num_recv_tokens: int, hidden: int, element_size: int, num_topk: int = 0,
                     num_scales: int = 0) -> int:
    """num_nvl_bytes a hierarchical Buffer on the CUDA backend needs when a rank receives up to
    ``num_recv_tokens`` rows (at most num_tokens x num_ranks)."""
    rows = max(num_recv_tokens, 1)
    return _DOMAIN_HEADER + _ALIGN * 4 + max(
        _offsets([hidden * element_size, num_scales * 4, num_topk * 8, num_topk * 4], rows)[1],
        _offsets([hidden * 2, num_topk * 4], rows)[1])


def _exclusive_prefix(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a [T, C] bool tensor: each row's index among the rows set in its column (int32 [T, C],
    valid where set), and each column's count. Scanned along the inner dimension of the transpose
    (a scan down the outer dimension of [T, C] is two orders of magnitude slower on the GPU)."""
    by_column = flags.t().to(torch.int32)
    inclusive = torch.cumsum(by_column, 1, dtype=torch.int32)
    return (inclusive - by_column).t().contiguous(), inclusive[:, -1].contiguous() if flags.shape[0] else \
        torch.zeros(flags.shape[1], dtype=torch.int32, device=flags.device)


_domain_groups: dict[tuple, dist.ProcessGroup] = {}


def _domain_group(group: dist.ProcessGroup, ranks_per_domain: int, my_domain: int) -> dist.ProcessGroup:
    """This rank's domain as a process group, made once per (group, split): new_group is collective
    over the whole group, so every rank makes every domain's, in the same order."""
    members = dist.get_process_group_ranks(group)
    key = (tuple(members), ranks_per_domain)
    if key not in _domain_groups:
        for d in range(len(members) // ranks_per_domain):
            g = dist.new_group(members[d * ranks_per_domain:(d + 1) * ranks_per_domain])
            if d == my_domain:
                _domain_groups[key] = g
    return _domain_groups[key]


class CudaHierarchical:
    frees_after_meeting = True  # Buffer.destroy meets every rank (bounded) before close()

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
        self.c = {name: self.nv.epcomm_hierarchical_constant(name.encode()) for name in (
            "sym_header_bytes", "domain_header_bytes", "max_domains", "max_chunks", "max_local", "max_forwarders",
            "info_ints", "max_group_ranks")}
        if (self.c["sym_header_bytes"], self.c["domain_header_bytes"]) != (_SYM_HEADER, _DOMAIN_HEADER):
            raise RuntimeError(f"epcomm: kernel library constants {self.c} disagree with hierarchical.py")
        if self.num_domains > self.c["max_domains"] or ranks_per_domain > self.c["max_local"] or \
                self.num_ranks > self.c["max_group_ranks"]:
            raise ValueError(f"the hierarchical kernels support up to {self.c['max_domains']} domains of up to "
                             f"{self.c['max_local']} ranks ({self.c['max_group_ranks']} ranks); the group has "
                             f"{self.num_domains} of {ranks_per_domain}")
        self.stage_offset = _stage_offset(self.num_ranks)
        if num_rdma_bytes <= self.stage_offset + 4 * _ALIGN * 5:
            raise ValueError(f"num_rdma_bytes={num_rdma_bytes}: the hierarchical CUDA backend needs the NVSHMEM buffer "
                             "of the slow tier; size it with epcomm.backends.cuda.hierarchical.rdma_bytes_needed")
        if num_nvl_bytes <= _DOMAIN_HEADER + 4 * _ALIGN:
            raise ValueError(f"num_nvl_bytes={num_nvl_bytes}: too small for the receive area; size it with "
                             "epcomm.backends.cuda.hierarchical.nvl_bytes_needed")
        # The fast tier: one IPC buffer per rank, shared inside the domain.
        self.shared = SharedBuffer(self.lib, _domain_group(group, ranks_per_domain, self.my_domain), device,
                                   num_nvl_bytes, "num_nvl_bytes")
        # The slow tier: the NVSHMEM buffer (header of signals, staging area, receive area).
        self.sym = SymmetricBuffer(group, device, num_rdma_bytes, set(), "num_rdma_bytes")
        self.area = (num_rdma_bytes - self.stage_offset) // 2 // _ALIGN * _ALIGN
        # Each mate's buffer where NVSHMEM maps it over NVLink (direct stores), else 0 (NVSHMEM puts:
        # other hosts, or every mate with EPCOMM_HIER_TRANSPORT=put).
        stores = _env.hier_transport() == "auto"
        self.mates = [self.sym.tensor.data_ptr() if d == self.my_domain else
                      (self.sym.team.peer_ptr(self.sym._words, d * ranks_per_domain + self.local) if stores else 0)
                      for d in range(self.num_domains)]
        self.put_domains = sorted(d for d in range(self.num_domains) if d != self.my_domain and not self.mates[d])
        self.info = torch.zeros(self.c["info_ints"], dtype=torch.int32, pin_memory=True)
        self.info_np = self.info.numpy()
        self.traffic_state: dict[str, object] = {}
        self.failed = False
        dist.barrier(group=group)

    # ------------------------------------------------------------------ lifecycle and errors
    def close(self) -> None:
        """Free both buffers (collective: every rank's kernels have ended, Buffer.destroy met them)."""
        self.shared.close()
        self.sym.close()

    def check_errors(self, op: str) -> None:
        """Raise what the kernels reported (call after a sync that covers them)."""
        code = int(self.info_np[0])
        if code == 0:
            if self.failed and op != "destroy":  # an error was raised before: later calls give up on the GPU
                raise RuntimeError(f"epcomm {op} (hierarchical) on rank {self.rank}: this Buffer had an error "
                                   "before; destroy it and the process group")
            return
        self.failed = True
        ranks = [r for r in range(self.num_ranks) if self.info_np[1 + r]]
        self.info_np[0] = 0  # only the words read (a kernel may be writing others)
        for r in ranks:
            self.info_np[1 + r] = 0
        message = _ERRORS.get(code, f"error {code}").format(ranks=ranks)
        raise RuntimeError(f"epcomm {op} (hierarchical) on rank {self.rank}: {message}. Destroy the Buffer and the "
                           "process group.")

    def _capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    # ------------------------------------------------------------------ kernel arguments
    def _sym_view(self, offset: int, rows: int, row_bytes: int, recv: bool) -> torch.Tensor:
        begin = self.stage_offset + (self.area if recv else 0) + offset
        return self.sym.tensor[begin:begin + rows * row_bytes].view(rows, row_bytes)

    def _nvl_view(self, offset: int, rows: int, row_bytes: int) -> torch.Tensor:
        begin = _DOMAIN_HEADER + offset
        return self.shared.tensor[begin:begin + rows * row_bytes].view(rows, row_bytes)

    def _call_params(self, op: int, shape: tuple, num_sms: int, advance: bool = True,
                     notify_digest: torch.Tensor | None = None) -> ctypes.Array:
        """The kernels' common arguments. ``advance``: first advance the call number, which lives on
        the GPU, so a CUDA graph's replays take new ones (a dispatch's notify and main kernel share
        one). ``notify_digest``: the notify's outgoing digest word: also advance the notify counter
        (its parity picks the set of incoming rows), and mark the row when an earlier call of this
        rank reported an error (advance_kernel)."""
        if advance:
            check(self.nv.epcomm_hierarchical_advance(
                ctypes.c_void_p(self.sym.tensor.data_ptr()), int(notify_digest is not None), ptr(notify_digest),
                stream_ptr(self.device)), "hierarchical call counter")
        others = max(1, self.num_domains - 1)
        chunks = max(1, min(self.c["max_chunks"], num_sms // (2 * others)))
        # Dispatch: a block per chunk of another domain's region sends, the other SMs forward;
        # combine: every SM forwards (and sends).
        senders = 0 if op == _OP_COMBINE else (self.num_domains - 1) * chunks
        forwarders = max(1, min(self.c["max_forwarders"], num_sms - senders))
        tag = zlib.crc32(repr((op, shape, chunks, forwarders)).encode()) & 0xFFFFF  # ranks must agree on all
        peers = list(self.shared.ptrs) + [0] * (self.c["max_local"] - self.rpd)
        mates = self.mates + [0] * (self.c["max_domains"] - self.num_domains)
        values = [self.sym.tensor.data_ptr(), self.num_ranks, self.num_domains, self.my_domain, self.rpd, self.local,
                  0, tag, chunks, forwarders, self.timeout_ns, self.stage_offset, *peers, *mates]
        return (ctypes.c_int64 * len(values))(*values)

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, ranks_per_domain: int):
        return dispatch_layout(self.lib, self.device, topk_idx, num_experts, self.num_ranks, ranks_per_domain)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x, scales, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                 topk_weights, expert_alignment, num_worst_tokens, num_experts, buffer_uid, num_sms):
        R, D, L = self.num_ranks, self.num_domains, self.rpd
        num_tokens, hidden = x.shape
        x_bytes = hidden * x.element_size()
        cached = handle is not None
        num_scales = scales.shape[1] if scales is not None else 0
        num_topk = 0 if cached or topk_idx is None else topk_idx.shape[1]
        with_weights = not cached and topk_weights is not None
        row1 = dispatch_fields(x_bytes, num_scales, num_topk, with_weights, L, not cached)
        row2 = [x_bytes, num_scales * 4, num_topk * 8, num_topk * 4 if with_weights else 0]
        out_rows = _fit_rows(row2, self.shared.num_bytes - _DOMAIN_HEADER)
        # Checks before anything moves or the call counter advances. They fail on this rank alone: its
        # peers then time out waiting for it (name it); destroy the Buffer after such an error.
        worst = handle.num_worst_tokens if cached else num_worst_tokens
        if worst > out_rows:
            raise ValueError(f"epcomm dispatch (hierarchical): num_worst_tokens={worst} rows do not fit "
                             f"num_nvl_bytes={self.shared.num_bytes} ({out_rows} rows); size it with "
                             "epcomm.backends.cuda.hierarchical.nvl_bytes_needed")
        if cached:
            region_rows = handle.backend_state["region_rows"]
            if _offsets(row1, D * region_rows)[1] > self.area or hidden != handle.hidden:
                raise ValueError("epcomm dispatch (hierarchical): a cached dispatch must move rows of its handle's "
                                 "shape")
            if handle.backend_state["most_recv"] > out_rows:  # every rank knows the most: all raise
                raise ValueError(f"epcomm dispatch (hierarchical): a rank receives {handle.backend_state['most_recv']} "
                                 f"rows, num_nvl_bytes={self.shared.num_bytes} holds {out_rows} of these; size it "
                                 "with epcomm.backends.cuda.hierarchical.nvl_bytes_needed")
        if cached:
            st = handle.backend_state
            flags, pos, send1, region_rows, start = st["flags"], st["pos"], st["send1"], st["region_rows"], st["start"]
            recv_total, recv1, slots1, matrix = st["recv_total"], st["recv1"], st["slots1"], st["matrix"]
            num_worst_tokens, num_recv = handle.num_worst_tokens, handle.num_recv_tokens
            experts_per_rank = 0
        else:
            experts_per_rank = num_experts // R
            if num_experts > _MAX_EXPERTS:
                raise ValueError(f"the hierarchical CUDA kernels count up to {_MAX_EXPERTS} experts, got {num_experts}")
            # The regions are sized by the buffer (the same on every rank), not by this call.
            region_rows = min(_fit_rows(row1, self.area), _fit_rows(combine_fields(hidden, num_topk), self.area)) // D
            if num_tokens > region_rows:
                raise ValueError(f"epcomm dispatch (hierarchical): {num_tokens} tokens, but num_rdma_bytes="
                                 f"{self.sym.num_bytes} holds {region_rows} per domain for these rows; size it with "
                                 "epcomm.backends.cuda.hierarchical.rdma_bytes_needed")
            in_rank = is_token_in_rank.contiguous()
            slots, wanted_per_rank = _exclusive_prefix(in_rank)
            # Invalid values are found on the device (no host sync): the rank sends a refusal instead
            # of its shape digest, and every rank gives up the call naming it.
            refused = (wanted_per_rank != num_tokens_per_rank).any()
            if num_topk:
                refused = refused | ((topk_idx < -1) | (topk_idx >= num_experts)).any()
            incoming = self._notify(num_tokens, num_tokens_per_rank, num_tokens_per_expert, num_experts, (
                hidden, x.dtype, num_scales, num_topk, with_weights, num_experts, num_worst_tokens), refused, num_sms)
            matrix = incoming[:, 2:2 + R].clone()  # the handle keeps it; the next notify rewrites the rows
            start = (torch.cumsum(matrix, 0, dtype=torch.int32) - matrix).contiguous()
            recv_total = matrix[:, self.rank].sum(dtype=torch.int32).view(1)
            flags = in_rank.view(num_tokens, D, L).any(-1).contiguous()
            pos, send1 = _exclusive_prefix(flags)
            slots = torch.where(in_rank, slots, torch.full_like(slots, -1))
            recv1 = torch.zeros(D, dtype=torch.int32, device=self.device)  # stays 0 if the call gives up
            # -1: no destination, for rows a given-up call leaves unwritten (combine then skips them)
            slots1 = torch.full((D * region_rows, L), -1, dtype=torch.int32, device=self.device)
        off1, _ = _offsets(row1, D * region_rows)
        off2, _ = _offsets(row2, out_rows)

        # Stage each token once per destination domain, then both tiers in one kernel; all of it is
        # queued before the host reads the counts (below), so the GPU does not wait for the host.
        code = self.nv.epcomm_hierarchical_stage(
            ptr(x), ctypes.c_int64(x_bytes), ptr(scales), num_scales,
            ctypes.c_int64(scales.stride(0) if scales is not None else 0),
            ctypes.c_int64(scales.stride(1) if scales is not None else 0),
            ptr(topk_idx.contiguous() if num_topk else None), ptr(topk_weights if with_weights else None),
            num_topk, ptr(None if cached else slots), ptr(flags), ptr(pos), num_tokens, D, L,
            (num_experts // D) if not cached else 0, ctypes.c_void_p(self.sym.tensor.data_ptr() + self.stage_offset),
            ctypes.c_int64(region_rows), (ctypes.c_int64 * 5)(*off1), stream_ptr(self.device))
        check(code, "hierarchical dispatch (stage)")
        params = [self.area, region_rows, *off1, *off2, out_rows, x_bytes, num_scales, num_topk, experts_per_rank,
                  int(with_weights), int(not cached), num_worst_tokens or -1]
        call = self._call_params(_OP_CACHED if cached else _OP_DISPATCH, (region_rows, *row1), num_sms,
                                 advance=cached)  # a fresh dispatch's number was taken by its notify
        code = self.nv.epcomm_hierarchical_dispatch(
            call, (ctypes.c_int64 * len(params))(*params), ptr(send1),
            ptr(torch.empty(D, dtype=torch.int32, device=self.device) if cached else recv1), ptr(start), ptr(matrix),
            ptr(slots1), ptr(recv_total), ctypes.c_void_p(self.info.data_ptr()), stream_ptr(self.device))
        check(code, "hierarchical dispatch")

        host = totals = None
        most = num_worst_tokens  # the most rows a rank receives (with num_worst_tokens: at most that)
        if (cached or num_worst_tokens) and not self._capturing():
            # No host sync: what the kernels of earlier calls reported, raised after this call's
            # launches (so no peer waits for this rank); every rank learns of it at the next
            # dispatch's counts exchange at the latest (notify_kernel, error 6).
            self.check_errors("dispatch")
        if not cached and not num_worst_tokens:  # the one host sync: it covers this call's kernels too
            epr = experts_per_rank
            expert_totals = incoming[:, 2 + R + self.rank * epr:2 + R + (self.rank + 1) * epr].sum(0)
            both = torch.cat([incoming[:, :2 + R].flatten(), expert_totals]).cpu()
            self.check_errors("dispatch")  # a rank gone, another shape, refused inputs, an earlier call's error
            host, totals = both[:R * (2 + R)].view(R, 2 + R), both[R * (2 + R):]
            host = host[:, [0, *range(2, 2 + R)]]  # tokens, then the count matrix
            num_recv = int(host[:, 1 + self.rank].sum())
            most = int(host[:, 1:].sum(0).max())
            if most > out_rows:  # the kernels skipped those rows; every rank sees the matrix: all raise
                raise ValueError(f"epcomm dispatch (hierarchical): a rank receives {most} rows, num_nvl_bytes="
                                 f"{self.shared.num_bytes} holds {out_rows}; size it with "
                                 "epcomm.backends.cuda.hierarchical.nvl_bytes_needed")
        elif not cached:
            num_recv = -1  # not known on the host: num_worst_tokens rows come back
        num_out = num_worst_tokens or num_recv

        # The received rows, out of the IPC area (the next call reuses it).
        recv_x = self._nvl_view(off2[0], num_out, x_bytes).view(x.dtype).clone()
        if scales is not None:
            col_major = scales.stride(0) == 1 and num_scales > 1  # the layout comes back as it went
            got = self._nvl_view(off2[1], num_out, num_scales * 4).view(scales.dtype)
            recv_scales = got.t().contiguous().t() if col_major else got.clone()
            recv_x = (recv_x, recv_scales)
        self.traffic_state.update(send1=send1, row1=sum(row1), host=host, row2=sum(row2))
        if cached:
            return recv_x, None, None, None, handle
        recv_topk_idx = recv_topk_weights = None
        if num_topk:
            recv_topk_idx = self._nvl_view(off2[2], num_out, num_topk * 8).view(torch.int64).clone()
            if with_weights:
                recv_topk_weights = self._nvl_view(off2[3], num_out, num_topk * 4).view(torch.float32).clone()
        if num_worst_tokens:
            expert_list, send_counts, recv_counts = [], [], []
        else:
            a = expert_alignment
            expert_list = [(int(c) + a - 1) // a * a for c in totals.tolist()]
            send_counts = host[self.rank, 1:1 + R].tolist()
            recv_counts = host[:, 1 + self.rank].tolist()
        new_handle = DispatchHandle(
            buffer_uid=buffer_uid, num_tokens=num_tokens, hidden=hidden, num_recv_tokens=num_recv,
            num_worst_tokens=num_worst_tokens, is_token_in_rank=is_token_in_rank, send_counts=send_counts,
            recv_counts=recv_counts,
            backend_state={"flags": flags, "pos": pos, "send1": send1, "recv1": recv1, "slots1": slots1,
                           "start": start, "matrix": matrix, "recv_total": recv_total, "region_rows": region_rows,
                           "most_recv": most})
        return recv_x, recv_topk_idx, recv_topk_weights, expert_list, new_handle

    def _notify(self, num_tokens: int, num_tokens_per_rank, num_tokens_per_expert, num_experts: int, shape: tuple,
                refused: torch.Tensor, num_sms: int) -> torch.Tensor:
        """The counts exchange (notify_kernel over NVSHMEM): every rank's row of (tokens, shape digest,
        tokens per rank, tokens per expert), as an int32 [R, width] view on the device. No host
        collective, so a rank that is gone is named within the timeout instead of waited for; ranks
        whose shapes differ give up the call alike."""
        R = self.num_ranks
        width = _counts_width(R)
        counts = self.sym.tensor[_SYM_HEADER:_SYM_HEADER + (3 * R + 1) * width * 4].view(torch.int32).view(
            3 * R + 1, width)
        row_ints = 2 + R + num_experts
        outgoing = counts[2 * R, :row_ints]
        outgoing[:1].fill_(num_tokens)  # fills, not host copies: capturable in a CUDA graph
        digest = zlib.crc32(repr(shape).encode()) & 0x7FFFFFFF
        outgoing[1:2].copy_(torch.where(refused, -1, digest).view(1))  # -1: kRefused
        outgoing[2:2 + R] = num_tokens_per_rank
        outgoing[2 + R:] = num_tokens_per_expert
        call = self._call_params(_OP_DISPATCH, (), num_sms, notify_digest=outgoing[1:2])
        code = self.nv.epcomm_hierarchical_notify(call, ctypes.c_int64(_SYM_HEADER), width, row_ints,
                                                 ctypes.c_void_p(self.info.data_ptr()), stream_ptr(self.device))
        check(code, "hierarchical dispatch (notify)")
        return counts[2 * R + 1:3 * R + 1]  # the rows of this notify (notify_kernel copies them here)

    # ------------------------------------------------------------------ combine
    def combine(self, x, handle: DispatchHandle, topk_weights, biases, num_sms):
        st = handle.backend_state
        D = self.num_domains
        num_tokens, hidden = handle.num_tokens, x.shape[1]
        num_topk = topk_weights.shape[1] if topk_weights is not None else 0
        region_rows = st["region_rows"]
        rows = x.shape[0]
        if hidden != handle.hidden or _offsets(combine_fields(hidden, num_topk), D * region_rows)[1] > self.area:
            raise ValueError(f"epcomm combine (hierarchical): rows of hidden {hidden} (and {num_topk} weights) do not "
                             f"fit the regions of the handle's dispatch (hidden {handle.hidden})")
        row2 = [hidden * 2, num_topk * 4]
        # Laid out for the area's capacity, not this rank's rows: the forwarders of the other ranks
        # compute the same offsets.
        in_rows = _fit_rows(row2, self.shared.num_bytes - _DOMAIN_HEADER)
        if rows > in_rows:
            raise ValueError(f"epcomm combine (hierarchical): {rows} rows do not fit num_nvl_bytes="
                             f"{self.shared.num_bytes}")
        off2, _ = _offsets(row2, in_rows)
        # This rank's expert outputs go into its IPC area, where the forwarders read them.
        self._nvl_view(off2[0], rows, hidden * 2).view(torch.bfloat16).copy_(x)
        if num_topk:
            self._nvl_view(off2[1], rows, num_topk * 4).view(torch.float32).copy_(topk_weights)
        row1 = combine_fields(hidden, num_topk)
        off1, _ = _offsets(row1, D * region_rows)
        params = [self.area, region_rows, off1[0], off1[1], off2[0], off2[1], hidden, num_topk, in_rows]
        call = self._call_params(_OP_COMBINE, (region_rows, *row1), num_sms)
        code = self.nv.epcomm_hierarchical_combine(
            call, (ctypes.c_int64 * len(params))(*params), ptr(st["recv1"]), ptr(st["start"]),
            ptr(st["slots1"]), ctypes.c_void_p(self.info.data_ptr()), stream_ptr(self.device))
        check(code, "hierarchical combine")
        out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=self.device)
        out_w = torch.empty((num_tokens, num_topk), dtype=torch.float32, device=self.device) if num_topk else None
        bias0 = biases[0] if len(biases) > 0 else None
        bias1 = biases[1] if len(biases) > 1 else None
        partial = self._sym_view(off1[0], D * region_rows, hidden * 4, recv=True)
        partial_w = self._sym_view(off1[1], D * region_rows, num_topk * 4, recv=True) if num_topk else None
        code = self.nv.epcomm_hierarchical_reduce(
            ptr(partial), ptr(partial_w), ctypes.c_int64(region_rows), ptr(st["flags"]), ptr(st["pos"]), ptr(bias0),
            ptr(bias1), ptr(out), ptr(out_w), num_tokens, hidden, num_topk, D, stream_ptr(self.device))
        check(code, "hierarchical combine (reduce)")
        if not self._capturing():
            self.check_errors("combine")  # of earlier calls, raised after this call's launches (see dispatch)
        self.traffic_state.update(recv1=st["recv1"], row1c=sum(row1), row2c=sum(row2),
                                  host_c=self.traffic_state.get("host"))
        return out, out_w

    # ------------------------------------------------------------------ per-tier bytes
    def traffic(self, op: str) -> dict[str, int]:
        """Rows and bytes this rank sent over each tier in its latest ``op`` (host read: syncs),
        counted as the reference backend counts them: its own rows to itself excluded. Intra-domain
        rows: what this rank forwarded to the other ranks of its domain (the flat matrix tells: the
        rows of the sources with its local index to each of them)."""
        s = self.traffic_state
        host = s.get("host") if op == "dispatch" else s.get("host_c")
        if op == "dispatch" and "send1" in s:
            sent1, row1, row2 = s["send1"].tolist(), s["row1"], s["row2"]
        elif op == "combine" and "row1c" in s:
            sent1, row1, row2 = s["recv1"].tolist(), s["row1c"], s["row2c"]
        else:
            return {}
        inter = sum(c for d, c in enumerate(sent1) if d != self.my_domain)
        intra = 0
        if host is not None:
            m = host[:, 1:1 + self.num_ranks]
            first = self.my_domain * self.rpd
            for i in range(self.rpd):
                if i == self.local:
                    continue
                if op == "dispatch":  # forwarded to domain rank i: the rows of this rank's sources to it
                    intra += int(m[self.local::self.rpd, first + i].sum())
                else:  # returned to forwarder i: the rows this rank received from i's sources
                    intra += int(m[i::self.rpd, self.rank].sum())
        return {f"{op}_inter_domain_rows": inter, f"{op}_inter_domain_bytes": inter * row1,
                f"{op}_intra_domain_rows": intra, f"{op}_intra_domain_bytes": intra * row2}
