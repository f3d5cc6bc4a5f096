"""State and agreement protocol of the reference backend.

Every communicating call starts with a handshake: each rank contributes a fixed-size header
(operation, call number, whether its arguments were valid, shapes, per-rank counts, arrival time).
After it every rank knows whether all ranks called the same operation with compatible shapes and
valid arguments, so bad input and mismatched calls raise on every rank alike instead of hanging.
"""

from __future__ import annotations

import enum
import math
import time

import torch
import torch.distributed as dist

from ...utils.tensors import dense
from .transport import CALLS, Transport

_MAGIC = 0x45504331
_HEADER_FIELDS = 16


class Op(enum.IntEnum):
    DISPATCH = 1
    COMBINE = 2
    LL_DISPATCH = 3
    LL_COMBINE = 4
    CLEAN_LL = 5


def api_name(op: Op) -> str:
    """The API's name of an operation, as errors name it."""
    return CALLS.get(op.name.lower(), op.name.lower())


class F(enum.IntEnum):
    """Header field positions."""
    MAGIC = 0
    OP = 1
    SEQ = 2
    STATUS = 3
    HIDDEN = 4
    NUM_EXPERTS = 5
    X_KIND = 6
    SCALE_COLS = 7
    NUM_TOPK = 8
    HAS_WEIGHTS = 9
    CACHED = 10
    NUM_TOKENS = 11
    ARRIVAL_NS = 12
    MAX_TOKENS = 13
    FLAGS = 14


# Fields every rank must agree on, per operation.
_AGREE = {
    Op.DISPATCH: (F.HIDDEN, F.NUM_EXPERTS, F.X_KIND, F.SCALE_COLS, F.NUM_TOPK, F.HAS_WEIGHTS, F.CACHED),
    Op.COMBINE: (F.HIDDEN, F.HAS_WEIGHTS, F.NUM_TOPK, F.FLAGS),
    Op.LL_DISPATCH: (F.HIDDEN, F.NUM_EXPERTS, F.NUM_TOPK, F.MAX_TOKENS, F.FLAGS),
    Op.LL_COMBINE: (F.HIDDEN, F.NUM_EXPERTS, F.NUM_TOPK, F.MAX_TOKENS, F.FLAGS),
    Op.CLEAN_LL: (F.HIDDEN, F.NUM_EXPERTS, F.MAX_TOKENS),
}


def in_graph(device: torch.device) -> bool:
    """Whether the calls are being captured into a CUDA graph: then nothing may wait on the host, and
    the exchanges take fixed sizes (low_latency.py, normal.py)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class ReferenceBackend:
    name = "reference"

    def __init__(self, group: dist.ProcessGroup, device: torch.device, uid: str, timeout_s: float) -> None:
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.transport = Transport(group, uid, timeout_s)
        self.seq = 0
        self.ranks_per_domain = self.num_ranks  # set by the Buffer once the ranks agree on it
        # Rows and bytes each tier moved in the latest call (strategies that count them).
        self.traffic: dict[str, int] = {}
        # Low-latency state: combine buffers for zero-copy, one per slot.
        self.ll_combine_buffers: dict[int, torch.Tensor] = {}
        # The Buffer's failed-rank mask with enable_shrink (normal mode masks on a peer's failure:
        # shrink.py), else None.
        self.mask: torch.Tensor | None = None
        self.decisions_seen: set = set()  # the calls whose masking decision this rank applied
        self.was_masked = False  # a rank was masked since the last call on the whole group (shrink.rejoin)
        self.rejoins = 0
        # CUDA graphs (normal.py's fixed-size path): the tokens every rank passed to the last eager dispatch,
        # and a flag a graph's dispatch raises on the device when it received past num_worst_tokens.
        self.dispatch_tokens: list[int] = []
        self.graph_overflow = torch.zeros((), dtype=torch.int32, device=device)
        self._overflow_noted = False
        self._scratch: dict[str, torch.Tensor] = {}

    def scratch(self, use: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Memory an eager call's temporaries of one ``use`` (the rows a dispatch sends, a combine's
        returned rows, its fp32 sums) keep across calls on the host, whose allocator hands blocks this
        big back to the system, so that a fresh one faults in every page each call (a GPU's caching
        allocator keeps them: there a fresh tensor). Grown to the largest call's size; eager calls end
        their exchanges, so one call at a time holds a use's memory (drop_scratch: one abandoned)."""
        if self.device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=self.device)
        nbytes = dtype.itemsize * math.prod(shape)
        held = self._scratch.get(use)
        if held is None or held.numel() < nbytes:
            held = self._scratch[use] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return held[:nbytes].view(dtype).view(shape)

    def drop_scratch(self) -> None:
        """Let go of the kept memory: an exchange that timed out may still write into it (a late peer
        completes it), so calls after it take fresh memory; and at destroy."""
        self._scratch.clear()

    # ----------------------------------------------------------------- CUDA graphs
    def note_graph_overflow(self, dropped: torch.Tensor) -> None:
        """Raise the overflow flag on the device where ``dropped`` (rows past num_worst_tokens) has any."""
        self.graph_overflow.bitwise_or_(dropped.any().to(torch.int32))
        self._overflow_noted = True

    def take_graph_overflow(self) -> RuntimeError | None:
        """The error, once, of what a dispatch that could not read the host could not report: rows dropped
        past num_worst_tokens (a host read only once a fixed-size dispatch ran). The handshake of every
        eager call takes it, and refuses, so the peers raise too."""
        if not self._overflow_noted:
            return None
        if self.graph_overflow.is_cuda:  # a replay may run on any stream: wait for every one
            torch.cuda.synchronize(self.graph_overflow.device)
        if not bool(self.graph_overflow):
            return None
        self.graph_overflow.zero_()
        return RuntimeError("epcomm dispatch: a fixed-size (CUDA graph) dispatch received more rows than "
                            "num_worst_tokens; the rows past it were left out of its outputs. Pass at least "
                            "num_tokens * num_ranks")

    # ----------------------------------------------------------------- agreement
    def handshake(self, op: Op, fields: dict[F, int], counts: list[int] | None = None,
                  refused: bool = False) -> torch.Tensor:
        """Exchange headers; return them as int64 [R, 16 + R] on the host. Raises on refusal or
        mismatch. The header has one size for every operation, so mismatched calls meet here."""
        overflow = self.take_graph_overflow()
        refused = refused or overflow is not None
        self.seq += 1
        seq = self.seq
        words = [0] * (_HEADER_FIELDS + self.num_ranks)  # built on the host, one tensor: no op per field
        words[F.MAGIC], words[F.OP], words[F.SEQ] = _MAGIC, int(op), seq
        words[F.STATUS] = 1 if refused else 0
        words[F.ARRIVAL_NS] = time.time_ns()
        for key, value in fields.items():
            words[key] = int(value)
        if counts is not None:
            words[_HEADER_FIELDS:] = [int(c) for c in counts]
        header = torch.tensor(words, dtype=torch.int64, device="cpu")
        deadline = time.monotonic() + self.transport.timeout_s
        headers = self.transport.share_header(header, api_name(op), seq, deadline, self.device)
        if self.transport.live is not None:  # a masked rank's row is this rank's: it sends nothing
            masked = [r for r in range(self.num_ranks) if r not in self.transport.live]
            headers[masked, _HEADER_FIELDS:] = 0
        if overflow is not None:
            raise overflow
        if refused:
            return headers  # the caller raises its own, more precise error
        self._check_agreement(op, headers)
        return headers

    def _check_agreement(self, op: Op, headers: torch.Tensor) -> None:
        name = api_name(op)
        columns = list(zip(*headers.tolist()))  # one host read, then plain Python
        ops, seqs = columns[F.OP], columns[F.SEQ]
        if any(h != _MAGIC for h in columns[F.MAGIC]) or len(set(ops)) > 1 or len(set(seqs)) > 1:
            calls = ", ".join(f"rank {r}: {_op_name(o)} (call #{s})" for r, (o, s) in enumerate(zip(ops, seqs)))
            raise RuntimeError(f"epcomm {name}: ranks made mismatched calls on one Buffer ({calls}); every "
                               "rank must call the same operations in the same order")
        refused = [r for r, s in enumerate(columns[F.STATUS]) if s != 0]
        if refused:
            raise ValueError(f"epcomm {name}: rank(s) {refused} refused their arguments (see the error on "
                             "those ranks); no data was exchanged")
        for f in _AGREE[op]:
            values = columns[f]
            if len(set(values)) > 1:
                raise RuntimeError(f"epcomm {name}: ranks disagree on {f.name.lower()}: "
                                   + ", ".join(f"rank {r}={v}" for r, v in enumerate(values)))

    def count_matrix(self, headers: torch.Tensor) -> torch.Tensor:
        """The handshake's per-rank counts: [src, dst] int64 on the host."""
        return headers[:, _HEADER_FIELDS:_HEADER_FIELDS + self.num_ranks]

    def arrival_wait_ns(self, headers: torch.Tensor) -> torch.Tensor:
        """Per source rank, how long this rank waited for it to arrive (ns, >= 0)."""
        arrivals = headers[:, F.ARRIVAL_NS]
        return (arrivals - arrivals[self.rank]).clamp(min=0)

    def exchange_rows(self, send: torch.Tensor, send_rows: list[int], recv_rows: list[int], op: Op,
                      everyone_empty: bool) -> torch.Tensor:
        """All-to-all of byte rows; skipped consistently on every rank when nobody sends anything."""
        if everyone_empty:
            return send.new_empty((0, send.shape[1]))
        deadline = time.monotonic() + self.transport.timeout_s
        return self.transport.all_to_all(send, send_rows, recv_rows, api_name(op), self.seq, deadline)


# Normal-mode strategies mark their handshakes, so ranks using different ones find out (0 = the
# all-to-all strategy, which leaves the slot unset). The slot is the first header field unused.
STRATEGY_CODES = {"alltoall": 0, "allgather": 1, "hierarchical": 2}
_STRATEGY_FIELD = max(F) + 1


def mark_strategy(fields: dict, strategy: str) -> dict:
    if _STRATEGY_FIELD < _HEADER_FIELDS:
        fields[_STRATEGY_FIELD] = STRATEGY_CODES[strategy]
    return fields


def check_strategy(headers: torch.Tensor, strategy: str, name: str) -> None:
    """Raise on this rank if a peer's handshake carries another strategy (that peer then raises or
    times out, naming the call)."""
    if _STRATEGY_FIELD >= _HEADER_FIELDS:
        return
    codes = headers[:, _STRATEGY_FIELD].tolist()
    if any(c != STRATEGY_CODES[strategy] for c in codes):
        names = {v: k for k, v in STRATEGY_CODES.items()}
        who = ", ".join(f"rank {r}: {names.get(c, c)}" for r, c in enumerate(codes))
        raise RuntimeError(f"epcomm {name}: ranks use different normal-mode strategies ({who}); create the "
                           "Buffer with the same strategy= on every rank")


def _op_name(code: int) -> str:
    try:
        return api_name(Op(code))
    except ValueError:
        return f"unknown op {code}"


def counts(values: torch.Tensor, size: int) -> torch.Tensor:
    """How often each of 0 .. size - 1 occurs in ``values`` (all below ``size``), as int64. On a GPU a
    scatter_add_ of that size, which reads nothing back (bincount reads the maximum on the host);
    elsewhere bincount, several times faster there."""
    if values.device.type != "cuda":
        return torch.bincount(values, minlength=size)
    return torch.zeros(size, dtype=torch.int64, device=values.device).scatter_add_(0, values, torch.ones_like(values))


def to_bytes(t: torch.Tensor) -> torch.Tensor:
    """View a 2-D tensor's rows as raw bytes (contiguous copy if needed)."""
    row_bytes = _row_numel(t) * t.element_size()
    if t.numel() == 0:  # empty tensors may carry strides that forbid a dtype view
        return torch.empty((t.shape[0], row_bytes), dtype=torch.uint8, device=t.device)
    return dense(t).view(torch.uint8).reshape(t.shape[0], row_bytes)


def _row_numel(t: torch.Tensor) -> int:
    n = 1
    for s in t.shape[1:]:
        n *= s
    return n


def from_bytes(b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
    if b.numel() == 0:
        return torch.empty((b.shape[0], cols), dtype=dtype, device=b.device)
    if b.stride() != (b.shape[1], 1):  # a column slice (even of one row) needs dense rows to change dtype
        b = torch.empty(b.shape, dtype=b.dtype, device=b.device).copy_(b)
    return b.view(dtype).reshape(b.shape[0], cols)
