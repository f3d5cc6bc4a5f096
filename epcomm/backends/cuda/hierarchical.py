"""Normal mode across scale-up domains with the CUDA kernels (``Buffer(strategy="hierarchical",
backend="cuda")``): each token crosses the slow tier once per destination domain.

The group is split into domains of ``ranks_per_domain`` consecutive ranks (one per host, or the
virtual ones EPCOMM_RANKS_PER_DOMAIN sets); rank r's mate in domain d has r's local index there.
The algorithm is the reference strategy's (backends/reference/hierarchical.py), so the results are
bitwise equal to it. The kernels: include/epcomm/impls/hierarchical_*.cuh (docs/DESIGN.md: design),
hierarchical_dispatch.cu and hierarchical_combine.cu.

Dispatch
  0. plan: one kernel derives the layout's tables on the device (each token's slot at each rank,
     the domains it goes to and its row in each staging region, the regions' counts) and checks
     the inputs (a fresh dispatch is host-bound otherwise: as tensor operations these took longer
     than the transfer);
  1. notify: every rank puts its counts (tokens, tokens per rank, tokens per expert, a digest of
     the call's shape) to every rank over NVSHMEM (bounded waits: no host collective to hang on a
     dead rank). The flat count matrix's prefix sums (counts kernel) say where each source's rows
     start in each receiver's output; the host reads the sizes (the one host sync, like DeepEP's
     notify, after every kernel of the call is queued; ``num_worst_tokens`` skips the host read, so
     the call can be captured in a CUDA graph);
  2. stage: each token is copied once per destination domain reached by NVSHMEM puts (other hosts)
     into that domain's region of the NVSHMEM staging area, ascending, with its top-k ids rebased to
     the domain's experts and its slot at each of the domain's ranks (its index among this rank's
     tokens to that rank); the other regions are not staged: the own domain's forwarders and the
     senders to mates NVLink maps read the caller's tensors through a token list per region;
  3. one kernel runs both tiers at once: sender blocks send each region, chunk by chunk, to the
     mate there (NVSHMEM puts of the staged rows, or stores where NVLink maps the mate, then a
     signal); forwarder blocks take each chunk as its signal lands and
     store its rows over NVLink (CUDA IPC) straight into the final positions in the domain ranks'
     receive areas (start of the source's block + slot): the flat order, with no sort;
  4. each rank copies its received rows out of its area (one launch for every field).
Combine reverses it in one kernel: each rank's expert outputs are copied into its IPC area; the
forwarders pull, for every row they forwarded, what the domain's ranks return, sum it in fp32 in
ascending rank order without rounding, and put each chunk's partial sums back to the source,
which sums them in ascending domain order, adds the biases and rounds to bf16 once: the
reference's additions in the reference's order.

A call that does not fit (a rank with more tokens than a staging region holds, or receiving more
rows than its receive area holds, for the dispatch or its combine) runs in rounds over ranges of
source tokens, like the intranode backend's: its first pass moves nothing (counts_kernel zeroes the
counts on every rank alike), and the host, seeing the true counts, reruns it in rounds that fit.
With ``num_worst_tokens`` (no host read) such a call is an error instead.
"""

from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

from ... import _env
from ...flight_recorder import hierarchical_counters, hook
from ...handle import DispatchHandle
from ...tuning import hierarchical_roles
from ..rounds import cached_dispatch_in_rounds, combine_in_rounds, dispatch_in_rounds
from ..rows import round_up, scale_kind, shape_digest
from .build import load_library, load_nvshmem_library
from .capi import check, library_constants, ptr, stream_ptr
from .errors import HIERARCHICAL, ErrorTable, RecordLayout, device_codes
from .intranode import dispatch_layout
from .ipc import SharedBuffer
from .nvshmem import SymmetricBuffer

ALIGN = 256
# The calls' op codes (common/protocol.cuh), hashed into each call's shape tag.
_OP_DISPATCH, _OP_CACHED, _OP_COMBINE = (device_codes()[name] for name in ("kOpDispatch", "kOpCachedDispatch",
                                                                            "kOpCombine"))
# The error record: the code, the failed call's op, the phase, then a word per rank (only the words
# read are cleared: a kernel may still be writing the others).
_ERROR_TABLE = ErrorTable(HIERARCHICAL, RecordLayout.protocol(clear="flagged"))
_MAX_EXPERTS = 12 * 1024  # the layout kernel's limit: the per-expert totals are summed over this width
_SYM_HEADER = 4096    # mirrors kSymHeaderBytes (checked when the library loads)
DOMAIN_HEADER = 16384  # mirrors kDomainHeaderBytes


def dispatch_fields(hidden_bytes: int, num_scales: int, num_topk: int, with_weights: bool, ranks_per_domain: int,
                    routing: bool) -> list[int]:
    """Bytes per row of each slow-tier field of a dispatch, in the kernel's order (x, scales, top-k
    ids, weights, slots); 0 for a field not moved (a cached dispatch moves x and scales only)."""
    return [hidden_bytes, num_scales * 4, num_topk * 8 if routing else 0,
            num_topk * 4 if routing and with_weights else 0, ranks_per_domain * 4 if routing else 0]


def combine_fields(hidden: int, num_topk: int) -> list[int]:
    """Bytes per row of a combine's slow-tier fields: the fp32 partial sums and the weights' sums."""
    return [hidden * 4, num_topk * 4]


def field_offsets(row_bytes: list[int], rows: int) -> tuple[list[int], int]:
    """Each field's array of ``rows`` rows, one after the other (256-byte aligned); and their total."""
    offsets, at = [], 0
    for rb in row_bytes:
        offsets.append(at)
        at += round_up(rows * rb, ALIGN)
    return offsets, at


def fit_rows(row_bytes: list[int], area: int) -> int:
    """Rows of ``row_bytes`` fields that fit ``area`` bytes with each field's array aligned."""
    per_row = sum(row_bytes)
    return max(0, (area - ALIGN * len(row_bytes)) // max(per_row, 1))


def rdma_bytes_needed(num_tokens: int, hidden: int, element_size: int, num_ranks: int, ranks_per_domain: int,
                      num_topk: int = 0, num_scales: int = 0) -> int:
    """num_rdma_bytes a hierarchical Buffer on the CUDA backend needs for calls of up to
    ``num_tokens`` tokens per rank: a header, then a staging and a receive area, each holding one
    region of ``num_tokens`` rows per domain of the larger of a dispatch's and a combine's rows."""
    rows = (num_ranks // ranks_per_domain) * max(num_tokens, 1)
    area = max(field_offsets(dispatch_fields(hidden * element_size, num_scales, num_topk, True, ranks_per_domain, True),
                        rows)[1], field_offsets(combine_fields(hidden, num_topk), rows)[1])
    return stage_offset(num_ranks) + 2 * (area + ALIGN * 5)  # room for each field's alignment (fit_rows)


def _counts_width(num_ranks: int) -> int:
    """Ints of a counts row (notify_kernel): tokens, shape digest, tokens per rank, per expert."""
    return 2 + num_ranks + _MAX_EXPERTS


def stage_offset(num_ranks: int) -> int:
    """Where the staging area starts in the NVSHMEM buffer: after the header and the counts area
    (two sets of incoming rows, one per rank, the outgoing row, the current rows)."""
    return _SYM_HEADER + round_up((3 * num_ranks + 1) * _counts_width(num_ranks) * 4, 4096)


def nvl_bytes_needed(num_recv_tokens: int, hidden: int, element_size: int, num_topk: int = 0,
                     num_scales: int = 0) -> int:
    """num_nvl_bytes a hierarchical Buffer on the CUDA backend needs when a rank receives up to
    ``num_recv_tokens`` rows (at most num_tokens x num_ranks)."""
    rows = max(num_recv_tokens, 1)
    return DOMAIN_HEADER + ALIGN * 4 + max(
        field_offsets([hidden * element_size, num_scales * 4, num_topk * 8, num_topk * 4], rows)[1],
        field_offsets([hidden * 2, num_topk * 4], rows)[1])


def _table(state: torch.Tensor, at: dict[str, int], name: str) -> ctypes.c_void_p:
    """The address of table ``name`` in a dispatch's int32 state tensor (offsets: _state_offsets)."""
    return ctypes.c_void_p(state.data_ptr() + 4 * at[name])


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
    """Normal mode across domains on the CUDA kernels (the NormalOps of backends/base.py)."""

    on_kernels = True
    recorder = None  # the Buffer's FlightRecorder (flight_recorder.attach)
    frees_after_meeting = True  # Buffer.destroy meets every rank (bounded) before close()
    handles_outlive_buffer = False  # a handle's plan names regions of this Buffer's NVSHMEM memory

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
        self.c = library_constants(self.nv, "epcomm_hierarchical_constant", (
            "sym_header_bytes domain_header_bytes max_domains max_chunks max_local max_forwarders info_ints "
            "max_group_ranks"))
        if (self.c["sym_header_bytes"], self.c["domain_header_bytes"]) != (_SYM_HEADER, DOMAIN_HEADER):
            raise RuntimeError(f"epcomm: kernel library constants {self.c} disagree with hierarchical.py")
        if self.num_domains > self.c["max_domains"] or ranks_per_domain > self.c["max_local"] or \
                self.num_ranks > self.c["max_group_ranks"]:
            raise ValueError(f"the hierarchical kernels support up to {self.c['max_domains']} domains of up to "
                             f"{self.c['max_local']} ranks ({self.c['max_group_ranks']} ranks); the group has "
                             f"{self.num_domains} of {ranks_per_domain}")
        self.stage_offset = stage_offset(self.num_ranks)
        if num_rdma_bytes <= self.stage_offset + 4 * ALIGN * 5:
            raise ValueError(f"num_rdma_bytes={num_rdma_bytes}: the hierarchical CUDA backend needs the NVSHMEM buffer "
                             "of the slow tier; size it with epcomm.backends.cuda.hierarchical.rdma_bytes_needed")
        if num_nvl_bytes <= DOMAIN_HEADER + 4 * ALIGN:
            raise ValueError(f"num_nvl_bytes={num_nvl_bytes}: too small for the receive area; size it with "
                             "epcomm.backends.cuda.hierarchical.nvl_bytes_needed")
        # The fast tier: one IPC buffer per rank, shared inside the domain.
        self.shared = SharedBuffer(self.lib, _domain_group(group, ranks_per_domain, self.my_domain), device,
                                   num_nvl_bytes, "num_nvl_bytes")
        # The slow tier: the NVSHMEM buffer (header of signals, staging area, receive area).
        self.sym = SymmetricBuffer(group, device, num_rdma_bytes, set(), "num_rdma_bytes")
        self.area = (num_rdma_bytes - self.stage_offset) // 2 // ALIGN * ALIGN
        # Each mate's buffer where NVSHMEM maps it over NVLink (direct stores), else 0 (NVSHMEM puts:
        # other hosts, or every mate with EPCOMM_HIER_TRANSPORT=put).
        stores = _env.hier_transport() == "auto"
        self.mates = [self.sym.tensor.data_ptr() if d == self.my_domain else
                      (self.sym.team.peer_ptr(self.sym._words, d * ranks_per_domain + self.local) if stores else 0)
                      for d in range(self.num_domains)]
        self.put_domains = sorted(d for d in range(self.num_domains) if d != self.my_domain and not self.mates[d])
        # Only the puts' regions are staged (a put's source must lie in the symmetric heap); the own
        # domain's rows are forwarded, the mapped mates' stored, straight from the caller's tensors.
        self.stage_mask = sum(1 << d for d in self.put_domains)
        self.info = torch.zeros(self.c["info_ints"], dtype=torch.int32, device="cpu", pin_memory=True)
        self.info_np = self.info.numpy()
        self._flight = hook(self, "hierarchical", hierarchical_counters)
        # What a dispatch's host read needs (counts_kernel writes it, host-mapped): every rank's
        # tokens, the count matrix, this rank's experts' totals.
        self.summary = torch.zeros(self.num_ranks * (1 + self.num_ranks) + _MAX_EXPERTS, dtype=torch.int32,
                                   device="cpu", pin_memory=True)
        self.summary_np = self.summary.numpy()
        self.refused = torch.zeros(1, dtype=torch.int32, device=device)  # plan_kernel -> advance_kernel
        self.cached_recv = torch.zeros(self.num_domains, dtype=torch.int32, device=device)  # a cached call's counts
        self.calls: dict[tuple, ctypes.Array] = {}  # the kernels' common arguments, per call shape
        # The counts area (notify_kernel): incoming rows [2][R], the outgoing row, the current rows [R].
        self.sym_ptr = ctypes.c_void_p(self.sym.tensor.data_ptr())
        self.width = _counts_width(self.num_ranks)
        self.outgoing_ptr = self.sym.tensor.data_ptr() + _SYM_HEADER + 2 * self.num_ranks * self.width * 4
        self.current_ptr = self.outgoing_ptr + self.width * 4
        self.out_area_ptr = self.shared.tensor.data_ptr() + DOMAIN_HEADER
        self.layouts: dict[tuple, tuple] = {}  # a dispatch's field layouts, per shape
        self.traffic_state: dict[str, object] = {}
        self.failed = False
        dist.barrier(group=group)

    # ------------------------------------------------------------------ lifecycle and errors
    def local_memory(self, rdma: bool) -> torch.Tensor | None:
        return self.sym.tensor if rdma else self.shared.tensor

    def close(self) -> None:
        """Free both buffers (collective: every rank's kernels have ended, Buffer.destroy met them). The
        NVSHMEM free runs whatever happens to the IPC unmapping: the peers wait for it in a barrier."""
        try:
            self.shared.close()
        finally:
            self.sym.close()

    def reset(self) -> None:
        """Zero this rank's buffers, counters and error words: the calls restart from the first (with
        every peer doing the same between two meetings, where no kernel runs: failed-rank masking's
        restore)."""
        for t in (self.shared.tensor, self.sym.tensor, self.refused, self.cached_recv, self.info, self.summary):
            t.zero_()
        self.failed = False
        torch.cuda.synchronize(self.device)

    def check_errors(self, op: str) -> None:
        """Raise what the kernels reported (call after a sync that covers them)."""
        code = int(self.info_np[0])
        if code == 0:
            if self.failed and op != "destroy":  # an error was raised before: later calls give up on the GPU
                raise RuntimeError(f"epcomm {op} (hierarchical) on rank {self.rank}: this Buffer had an error "
                                   "before; destroy it and the process group")
            return
        self.failed = True
        _ERROR_TABLE.check(self.info_np, op, self.rank, self.num_ranks, flight=self._flight)

    def _capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    # ------------------------------------------------------------------ kernel arguments
    def _nvl_view(self, offset: int, rows: int, row_bytes: int) -> torch.Tensor:
        begin = DOMAIN_HEADER + offset
        return self.shared.tensor[begin:begin + rows * row_bytes].view(rows, row_bytes)

    def _call_params(self, op: int, shape: tuple, num_sms: int, stream: ctypes.c_void_p, advance: bool = True,
                     digest: int | None = None) -> ctypes.Array:
        """The kernels' common arguments. ``advance``: first advance the call number, which lives on
        the GPU, so a CUDA graph's replays take new ones (a dispatch's notify and main kernel share
        one). ``digest``: a dispatch's notify: also advance the notify counter (its parity picks the
        set of incoming rows) and decide the outgoing row's digest word: this shape digest, or the
        mark of refused inputs (plan_kernel) or of an earlier call's error (advance_kernel)."""
        if advance:
            notify = digest is not None
            check(self.nv.epcomm_hierarchical_advance(
                self.sym_ptr, int(notify), ctypes.c_void_p(self.outgoing_ptr + 4 if notify else 0),
                ctypes.c_void_p(self.refused.data_ptr() if notify else 0), digest or 0, stream),
                "hierarchical call counter")
        key = (op, shape, num_sms)
        call = self.calls.get(key)
        if call is None:
            chunks, forwarders = hierarchical_roles(num_sms, self.num_domains, op == _OP_COMBINE,
                                                    self.c["max_chunks"], self.c["max_forwarders"])
            tag = shape_digest(op, *shape, chunks, forwarders, bits=20)  # kTagBits: ranks must agree on all
            peers = list(self.shared.ptrs) + [0] * (self.c["max_local"] - self.rpd)
            mates = self.mates + [0] * (self.c["max_domains"] - self.num_domains)
            values = [self.sym.tensor.data_ptr(), self.num_ranks, self.num_domains, self.my_domain, self.rpd,
                      self.local, op, tag, chunks, forwarders, self.timeout_ns, self.stage_offset, *peers, *mates]
            call = self.calls[key] = (ctypes.c_int64 * len(values))(*values)
        return call

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, ranks_per_domain: int):
        return dispatch_layout(self.lib, self.device, topk_idx, num_experts, self.num_ranks, ranks_per_domain)

    # ------------------------------------------------------------------ dispatch
    def _dispatch_layout(self, x_bytes: int, num_scales: int, num_topk: int, with_weights: bool, fresh: bool,
                         hidden: int) -> tuple:
        """Row bytes of the slow-tier (row1) and fast-tier (row2) fields, the rows the IPC area holds,
        the rows per region the NVSHMEM areas hold (sized by the buffer, the same on every rank), and
        the fields' offsets at that size (row1's with region_rows filled in later). Made once per shape."""
        key = (x_bytes, num_scales, num_topk, with_weights, fresh, hidden)
        layout = self.layouts.get(key)
        if layout is None:
            row1 = dispatch_fields(x_bytes, num_scales, num_topk, with_weights, self.rpd, fresh)
            row2 = [x_bytes, num_scales * 4, num_topk * 8, num_topk * 4 if with_weights else 0]
            out_rows = fit_rows(row2, self.shared.num_bytes - DOMAIN_HEADER)
            region_rows = min(fit_rows(row1, self.area), fit_rows(combine_fields(hidden, num_topk), self.area)) \
                // self.num_domains
            layout = self.layouts[key] = (row1, row2, out_rows, region_rows, field_offsets(row2, out_rows)[0])
        return layout

    def _state_offsets(self, num_tokens: int, region_rows: int) -> dict[str, int]:
        """Where each of a fresh dispatch's tables lies in its one int32 state tensor (16-byte aligned
        entries): slots [T, R] and the rest for this call's kernels, then what the handle keeps for
        cached dispatches and the combine."""
        R, D, L = self.num_ranks, self.num_domains, self.rpd
        at, total = {}, 0
        for name, ints in (("slots", num_tokens * R), ("flags", -(-num_tokens * D // 4)), ("pos", num_tokens * D),
                           ("send1", D), ("recv1", D), ("slots1", D * region_rows * L), ("matrix", R * R),
                           ("start", R * R), ("recv_total", 1), ("region_tokens", D * region_rows)):
            at[name] = total
            total += round_up(ints, 4)
        at["total"] = total
        return at

    def dispatch(self, x, scales, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                 topk_weights, expert_alignment, num_worst_tokens, num_experts, buffer_uid, num_sms):
        R, D, L = self.num_ranks, self.num_domains, self.rpd
        if handle is not None and "rounds" in handle.backend_state:
            return self._cached_in_rounds(x, scales, handle, num_sms)
        num_tokens, hidden = x.shape
        x_bytes = hidden * x.element_size()
        cached = handle is not None
        num_scales = scales.shape[1] if scales is not None else 0
        kind = scale_kind(scales)  # the shape digests carry it
        num_topk = 0 if cached or topk_idx is None else topk_idx.shape[1]
        with_weights = not cached and topk_weights is not None
        row1, row2, out_rows, region_rows, off2 = self._dispatch_layout(x_bytes, num_scales, num_topk, with_weights,
                                                                         not cached, hidden)
        stream = stream_ptr(self.device)
        # Checks before anything moves or the call counter advances. They fail on this rank alone: its
        # peers then time out waiting for it (name it); destroy the Buffer after such an error.
        worst = handle.num_worst_tokens if cached else num_worst_tokens
        if worst > out_rows:
            raise ValueError(f"epcomm dispatch (hierarchical): num_worst_tokens={worst} rows do not fit "
                             f"num_nvl_bytes={self.shared.num_bytes} ({out_rows} rows); size it with "
                             "epcomm.backends.cuda.hierarchical.nvl_bytes_needed")
        if cached:
            st = handle.backend_state
            region_rows = st["region_rows"]
            if field_offsets(row1, D * region_rows)[1] > self.area or hidden != handle.hidden:
                raise ValueError("epcomm dispatch (hierarchical): a cached dispatch must move rows of its handle's "
                                 "shape")
            if st["most_recv"] > out_rows:  # every rank knows the most: all raise
                raise ValueError(f"epcomm dispatch (hierarchical): a rank receives {st['most_recv']} rows, "
                                 f"num_nvl_bytes={self.shared.num_bytes} holds {out_rows} of these; size it with "
                                 "epcomm.backends.cuda.hierarchical.nvl_bytes_needed")
            state, at = st["state"], st["at"]
            num_worst_tokens, num_recv = handle.num_worst_tokens, handle.num_recv_tokens
            experts_per_rank = 0
        else:
            experts_per_rank = num_experts // R
            if num_experts > _MAX_EXPERTS:
                raise ValueError(f"the hierarchical CUDA kernels count up to {_MAX_EXPERTS} experts, got {num_experts}")
            if num_tokens > region_rows and num_worst_tokens:  # no host read: no rounds
                raise ValueError(f"epcomm dispatch (hierarchical): {num_tokens} tokens, but num_rdma_bytes="
                                 f"{self.sym.num_bytes} holds {region_rows} per domain for these rows; with "
                                 "num_worst_tokens a call must fit (size it with epcomm.backends.cuda.hierarchical."
                                 "rdma_bytes_needed); without, it runs in rounds")
            at = self._state_offsets(num_tokens, region_rows)
            state = torch.empty(at["total"], dtype=torch.int32, device=self.device)

        def table(name: str) -> ctypes.c_void_p:
            return _table(state, at, name)

        idx = topk_idx.contiguous() if num_topk else None  # read by plan, stage and the dispatch kernel
        if not cached:
            # The layout's tables and this rank's counts row (plan_kernel; invalid inputs are found
            # there, without a host sync, and refused with the counts: every rank gives up naming
            # this one), the counts exchange (notify_kernel), the matrix's prefixes (counts_kernel).
            sizes = (ctypes.c_int64 * 8)(num_tokens, R, D, L, num_topk, num_experts, D * region_rows * L, region_rows)
            check(self.nv.epcomm_hierarchical_plan(
                ptr(is_token_in_rank.contiguous()), ptr(num_tokens_per_rank.contiguous()),
                ptr(num_tokens_per_expert.contiguous()), ptr(idx), sizes,
                ctypes.c_void_p(self.outgoing_ptr), ptr(self.refused), table("slots"), table("flags"), table("pos"),
                table("send1"), table("recv1"), table("slots1"), table("region_tokens"), stream),
                "hierarchical dispatch (plan)")
            digest = shape_digest(hidden, x.dtype, num_scales, kind, num_topk, int(with_weights), num_experts,
                                  num_worst_tokens)
            call = self._call_params(_OP_DISPATCH, (), num_sms, stream, digest=digest)
            check(self.nv.epcomm_hierarchical_notify(call, ctypes.c_int64(_SYM_HEADER), self.width,
                                                     2 + R + num_experts, ctypes.c_void_p(self.info.data_ptr()),
                                                     stream), "hierarchical dispatch (notify)")
            # A call that does not fit moves nothing and is rerun in rounds (not with num_worst_tokens).
            recv_rows = self._recv_rows(out_rows, hidden, num_topk)
            limits = (ctypes.c_int64 * 3)(region_rows, recv_rows, int(not num_worst_tokens))
            check(self.nv.epcomm_hierarchical_counts(
                ctypes.c_void_p(self.current_ptr), self.width, R, self.rank, experts_per_rank, D, table("matrix"),
                table("start"), table("recv_total"), ctypes.c_void_p(self.summary.data_ptr()), table("send1"), limits,
                stream), "hierarchical dispatch (counts)")
        off1, _ = field_offsets(row1, D * region_rows)

        # Stage each token once per destination domain reached by puts, then both tiers in one kernel; all of it is
        # queued before the host reads the counts (below), so the GPU does not wait for the host.
        # Tokens that overflow the staging regions are not staged: the call then moves nothing.
        if num_tokens <= region_rows:
            code = self.nv.epcomm_hierarchical_stage(
                ptr(x), ctypes.c_int64(x_bytes), ptr(scales), num_scales,
                ctypes.c_int64(scales.stride(0) if scales is not None else 0),
                ctypes.c_int64(scales.stride(1) if scales is not None else 0),
                ptr(idx), ptr(topk_weights if with_weights else None),
                num_topk, ctypes.c_void_p(0) if cached else table("slots"), table("flags"), table("pos"), num_tokens,
                D, L, (num_experts // D) if not cached else 0, ctypes.c_uint(self.stage_mask),
                ctypes.c_void_p(self.sym.tensor.data_ptr() + self.stage_offset), ctypes.c_int64(region_rows),
                (ctypes.c_int64 * 5)(*off1), stream)
            check(code, "hierarchical dispatch (stage)")
        params = [self.area, region_rows, *off1, *off2, out_rows, x_bytes, num_scales, num_topk, experts_per_rank,
                  int(with_weights), int(not cached), num_worst_tokens or -1,
                  scales.stride(0) if scales is not None else 0, scales.stride(1) if scales is not None else 0]
        # Regions not staged (the own domain's, the mapped mates') are read from the caller's tensors.
        own = (ctypes.c_void_p * 6)(x.data_ptr(), scales.data_ptr() if scales is not None else None,
                                    idx.data_ptr() if idx is not None else None,
                                    topk_weights.data_ptr() if with_weights else None,
                                    None if cached else table("slots").value, table("region_tokens").value)
        call = self._call_params(_OP_CACHED if cached else _OP_DISPATCH, (region_rows, *row1, kind), num_sms,
                                 stream, advance=cached)  # a fresh dispatch's number was taken by its notify
        code = self.nv.epcomm_hierarchical_dispatch(
            call, (ctypes.c_int64 * len(params))(*params), table("send1"),
            ptr(self.cached_recv) if cached else table("recv1"), table("start"), table("matrix"), table("slots1"),
            table("recv_total"), own, ctypes.c_void_p(self.info.data_ptr()), stream)
        check(code, "hierarchical dispatch")

        matrix = None
        most = num_worst_tokens  # the most rows a rank receives (with num_worst_tokens: at most that)
        if (cached or num_worst_tokens) and not self._capturing():
            # No host sync: what the kernels of earlier calls reported, raised after this call's
            # launches (so no peer waits for this rank); every rank learns of it at the next
            # dispatch's counts exchange at the latest (notify_kernel, error 6).
            self.check_errors("dispatch")
        if not cached and not num_worst_tokens:  # the one host sync: it covers this call's kernels too
            torch.cuda.current_stream(self.device).synchronize()
            self.check_errors("dispatch")  # a rank gone, another shape, refused inputs, an earlier call's error
            summary = self.summary_np
            matrix = summary[R:R + R * R].reshape(R, R).copy()
            a = expert_alignment
            expert_list = [(c + a - 1) // a * a for c in summary[R + R * R:R + R * R + experts_per_rank].tolist()]
            num_recv = int(matrix[:, self.rank].sum())
            most = int(matrix.sum(0).max())
            most_tokens = int(summary[:R].max())
            if most_tokens > region_rows or most > recv_rows:
                # counts_kernel decided alike on every rank: nothing moved; now in rounds that fit.
                return self._dispatch_in_rounds(
                    x, scales, is_token_in_rank, topk_idx, topk_weights, num_experts, matrix, most, most_tokens,
                    expert_list, region_rows, recv_rows, buffer_uid, num_sms)
            if most > out_rows:  # the kernels skipped those rows; every rank sees the matrix: all raise
                raise ValueError(f"epcomm dispatch (hierarchical): a rank receives {most} rows, num_nvl_bytes="
                                 f"{self.shared.num_bytes} holds {out_rows}; size it with "
                                 "epcomm.backends.cuda.hierarchical.nvl_bytes_needed")
        elif not cached:
            num_recv = -1  # not known on the host: num_worst_tokens rows come back
        num_out = num_worst_tokens or num_recv

        # The received rows, out of the IPC area (the next call reuses it), in one launch.
        recv_x = torch.empty((num_out, hidden), dtype=x.dtype, device=self.device)
        recv_scales = recv_topk_idx = recv_topk_weights = None
        if scales is not None:
            # Row-major whatever the input's layout (DeepEP's), the kernel reads the input by its strides.
            recv_scales = torch.empty((num_out, num_scales), dtype=scales.dtype, device=self.device)
        if num_topk:
            recv_topk_idx = torch.empty((num_out, num_topk), dtype=torch.int64, device=self.device)
            if with_weights:
                recv_topk_weights = torch.empty((num_out, num_topk), dtype=torch.float32, device=self.device)
        sizes = (ctypes.c_int64 * 6)(num_out, x_bytes, num_scales, num_topk,
                                     recv_scales.stride(0) if recv_scales is not None else 0,
                                     recv_scales.stride(1) if recv_scales is not None else 0)
        check(self.nv.epcomm_hierarchical_copy_out(
            ctypes.c_void_p(self.out_area_ptr), (ctypes.c_int64 * 4)(*off2), sizes, ptr(recv_x), ptr(recv_scales),
            ptr(recv_topk_idx), ptr(recv_topk_weights), stream), "hierarchical dispatch (copy out)")
        if scales is not None:
            recv_x = (recv_x, recv_scales)
        self.traffic_state.pop("dispatch_rounds", None)
        self.traffic_state.update(state=state, at=at, row1=sum(row1), row2=sum(row2),
                                  matrix=handle.backend_state["matrix"] if cached else matrix)
        if cached:
            return recv_x, None, None, None, handle
        if num_worst_tokens:
            expert_list, send_counts, recv_counts = [], [], []
        else:
            send_counts = matrix[self.rank].tolist()
            recv_counts = matrix[:, self.rank].tolist()
        new_handle = DispatchHandle(
            buffer_uid=buffer_uid, num_tokens=num_tokens, hidden=hidden, num_recv_tokens=num_recv,
            num_worst_tokens=num_worst_tokens, is_token_in_rank=is_token_in_rank, send_counts=send_counts,
            recv_counts=recv_counts, count_matrix=matrix,
            backend_state={"state": state, "at": at, "region_rows": region_rows, "most_recv": most, "matrix": matrix})
        return recv_x, recv_topk_idx, recv_topk_weights, expert_list, new_handle

    # ------------------------------------------------------------------ combine
    def combine(self, x, handle: DispatchHandle, topk_weights, biases, num_sms):
        st = handle.backend_state
        if "rounds" in st:
            return self._combine_in_rounds(x, handle, topk_weights, biases, num_sms)
        D = self.num_domains
        num_tokens, hidden = handle.num_tokens, x.shape[1]
        num_topk = topk_weights.shape[1] if topk_weights is not None else 0
        region_rows = st["region_rows"]
        rows = x.shape[0]
        if hidden != handle.hidden or field_offsets(combine_fields(hidden, num_topk), D * region_rows)[1] > self.area:
            raise ValueError(f"epcomm combine (hierarchical): rows of hidden {hidden} (and {num_topk} weights) do not "
                             f"fit the regions of the handle's dispatch (hidden {handle.hidden})")
        row2 = [hidden * 2, num_topk * 4]
        # Laid out for the area's capacity, not this rank's rows: the forwarders of the other ranks
        # compute the same offsets.
        in_rows = fit_rows(row2, self.shared.num_bytes - DOMAIN_HEADER)
        if rows > in_rows:
            raise ValueError(f"epcomm combine (hierarchical): {rows} rows do not fit num_nvl_bytes="
                             f"{self.shared.num_bytes}")
        off2, _ = field_offsets(row2, in_rows)
        # This rank's expert outputs go into its IPC area, where the forwarders read them.
        self._nvl_view(off2[0], rows, hidden * 2).view(torch.bfloat16).copy_(x)
        if num_topk:
            self._nvl_view(off2[1], rows, num_topk * 4).view(torch.float32).copy_(topk_weights)
        row1 = combine_fields(hidden, num_topk)
        off1, _ = field_offsets(row1, D * region_rows)
        params = [self.area, region_rows, off1[0], off1[1], off2[0], off2[1], hidden, num_topk, in_rows]
        stream = stream_ptr(self.device)
        state, at = st["state"], st["at"]

        def table(name: str) -> ctypes.c_void_p:
            return _table(state, at, name)

        call = self._call_params(_OP_COMBINE, (region_rows, *row1), num_sms, stream)
        code = self.nv.epcomm_hierarchical_combine(
            call, (ctypes.c_int64 * len(params))(*params), table("recv1"), table("start"), table("slots1"),
            ctypes.c_void_p(self.info.data_ptr()), stream)
        check(code, "hierarchical combine")
        out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=self.device)
        out_w = torch.empty((num_tokens, num_topk), dtype=torch.float32, device=self.device) if num_topk else None
        bias0 = biases[0] if len(biases) > 0 else None
        bias1 = biases[1] if len(biases) > 1 else None
        recv_area = self.sym.tensor.data_ptr() + self.stage_offset + self.area
        code = self.nv.epcomm_hierarchical_reduce(
            ctypes.c_void_p(recv_area + off1[0]), ctypes.c_void_p(recv_area + off1[1] if num_topk else 0),
            ctypes.c_int64(region_rows), table("flags"), table("pos"), ptr(bias0), ptr(bias1), ptr(out), ptr(out_w),
            num_tokens, hidden, num_topk, D, stream)
        check(code, "hierarchical combine (reduce)")
        if not self._capturing():
            self.check_errors("combine")  # of earlier calls, raised after this call's launches (see dispatch)
        self.traffic_state.pop("combine_rounds", None)
        self.traffic_state.update(recv1_state=(state, at), row1c=sum(row1), row2c=sum(row2),
                                  matrix_c=st["matrix"])
        return out, out_w

    # ------------------------------------------------------------------ calls larger than the buffers
    # Rounds over ranges of B source tokens, the same ranges on every rank, as in the intranode backend
    # (rounds.py): B fits a staging region, and R * B rows fit every receive area (a rank receives at
    # most B rows from each source per round), for the dispatch and its combine. Every rank takes the
    # round count from the same summary (the most tokens of any rank), so no collective is needed.
    def _recv_rows(self, out_rows: int, hidden: int, num_topk: int) -> int:
        """Rows a rank may receive in one call: what its receive area holds for the dispatch's rows
        and for the combine's (a BF16 combine row outgrows an FP8 dispatch row)."""
        return min(out_rows, fit_rows([hidden * 2, num_topk * 4], self.shared.num_bytes - DOMAIN_HEADER))

    def _dispatch_in_rounds(self, x, scales, is_token_in_rank, topk_idx, topk_weights, num_experts, matrix, most,
                            most_tokens, expert_list, region_rows, recv_rows, buffer_uid, num_sms):
        self.traffic_state.pop("dispatch_rounds", None)  # the previous call's, whatever happens here
        step = min(region_rows, recv_rows // self.num_ranks)
        if step < 1:  # the same sizes on every rank: all raise
            raise ValueError(f"epcomm dispatch (hierarchical): num_nvl_bytes={self.shared.num_bytes} holds "
                             f"{recv_rows} rows, fewer than one per rank ({self.num_ranks}), and num_rdma_bytes="
                             f"{self.sym.num_bytes} {region_rows} tokens per region: too small for rounds; size them "
                             "with epcomm.backends.cuda.hierarchical.nvl_bytes_needed and rdma_bytes_needed")
        traffic: list[dict] = []
        recv_x, recv_topk_idx, recv_topk_weights, handle = dispatch_in_rounds(
            self, x, scales, is_token_in_rank, topk_idx, topk_weights, num_experts, step, -(-most_tokens // step),
            matrix, buffer_uid, num_sms, {"most_recv": most, "matrix": matrix},
            lambda: traffic.append(dict(self.traffic_state)))
        self.traffic_state["dispatch_rounds"] = traffic
        return recv_x, recv_topk_idx, recv_topk_weights, expert_list, handle

    def _cached_in_rounds(self, x, scales, handle, num_sms):
        traffic: list[dict] = []
        recv_x = cached_dispatch_in_rounds(self, x, scales, handle, num_sms,
                                           lambda: traffic.append(dict(self.traffic_state)))
        self.traffic_state["dispatch_rounds"] = traffic
        return recv_x, None, None, None, handle

    def _combine_in_rounds(self, x, handle, topk_weights, biases, num_sms):
        traffic: list[dict] = []
        out = combine_in_rounds(self, x, handle, topk_weights, biases, num_sms,
                                lambda: traffic.append(dict(self.traffic_state)))
        self.traffic_state["combine_rounds"] = traffic
        return out

    # ------------------------------------------------------------------ per-tier bytes
    def traffic(self, op: str) -> dict[str, int]:
        """Rows and bytes this rank sent over each tier in its latest ``op`` (host read: syncs),
        counted as the reference backend counts them: its own rows to itself excluded. Intra-domain
        rows: what this rank forwarded to the other ranks of its domain (the flat matrix tells: the
        rows of the sources with its local index to each of them). A call in rounds: their sum."""
        rounds = self.traffic_state.get(f"{op}_rounds")
        if rounds is None:
            return self._traffic_of(self.traffic_state, op)
        total: dict[str, int] = {}
        for s in rounds:
            for key, value in self._traffic_of(s, op).items():
                total[key] = total.get(key, 0) + value
        return total

    def _traffic_of(self, s: dict, op: str) -> dict[str, int]:
        if op == "dispatch" and "row1" in s:
            state, at = s["state"], s["at"]
            sent1, row1, row2, m = state[at["send1"]:at["send1"] + self.num_domains].tolist(), s["row1"], s["row2"], \
                s["matrix"]
        elif op == "combine" and "row1c" in s:
            state, at = s["recv1_state"]
            sent1, row1, row2, m = state[at["recv1"]:at["recv1"] + self.num_domains].tolist(), s["row1c"], s["row2c"], \
                s["matrix_c"]
        else:
            return {}
        inter = sum(c for d, c in enumerate(sent1) if d != self.my_domain)
        intra = 0
        if m is not None:  # the count matrix (None after num_worst_tokens calls: not read on the host)
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
