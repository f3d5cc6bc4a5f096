"""The errors the CUDA kernels report, and what the host raises for each: one table for every mode.

The kernels write an error record into pinned host memory (an error code, the failed call's op
code, the phase of the wait that gave up, and a word per rank involved:
include/epcomm/common/protocol.cuh); the host reads it at its sync points and raises. Each code
appears here by name with its exception type, its message and whether it leaves the Buffer unusable
(fatal). Their values, and the record's word offsets, are read from protocol.cuh, the one place that
defines them (``device_codes``, ``record_words``). A timeout also hands the flight recorder its
facts (``ErrorTable.check``'s ``flight``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class DeviceError:
    """One error code of a kernel family. ``message`` may name {ranks} (the ranks the record flags)
    and, for the intranode family, {mismatch} (each flagged rank's op) or {refusals} (why each rank
    refused); a ``whole`` message is raised as it is, without the call's name and rank before it."""
    name: str            # the code's name in common/protocol.cuh (ErrorCode)
    exception: type[Exception]
    message: str
    fatal: bool          # the Buffer cannot be used after it (its waits give up, or its peers left)
    whole: bool = False


@dataclasses.dataclass(frozen=True)
class RecordLayout:
    """Where an error record's words lie in the pinned info words (offsets in int32 words)."""
    code: int
    op: int | None       # the failed call's op code; None where the record has none
    phase: int           # the Phase of the wait that recorded a timeout
    ranks: int           # first of one word per rank: nonzero where that rank is involved
    clear: str           # after reading: "record" zeroes the whole record, "ranks" the code and every
    #                      rank word, "flagged" the code and the flagged rank words only (a kernel
    #                      may still be writing the others)

    @classmethod
    def protocol(cls, clear: str) -> RecordLayout:
        """The record at the start of the info words, as common/protocol.cuh places it."""
        words = record_words()
        return cls(code=words["kInfoError"], op=words["kInfoErrorOp"], phase=words["kInfoErrorPhase"],
                   ranks=words["kInfoErrorRanks"], clear=clear)


@dataclasses.dataclass(frozen=True)
class Family:
    """The errors of one kernel family and how its messages read."""
    name: str
    errors: tuple[DeviceError, ...]
    ops: dict[str, str]               # op code name in common/protocol.cuh (Op) -> its name in messages
    head: str                         # the message's start: {failed} (the failed call), {op} (the caller)
    unknown_op: str                   # {failed} where the record names no known op
    fatal_tail: str                   # appended to a RuntimeError's message


_TIMED_OUT = "timed out waiting for rank(s) {ranks}{phase} (EPCOMM_TIMEOUT_S)"

INTRANODE = Family(
    name="intranode",
    errors=(
        DeviceError("kErrTimeout", RuntimeError, _TIMED_OUT, True),
        DeviceError("kErrMismatch", RuntimeError, "ranks called different operations: {mismatch}", True),
        DeviceError("kErrCapacity", RuntimeError, "the communication buffer is too small for the rows of this "
                    "call", True),
        DeviceError("kErrWorstTokens", RuntimeError, "received more tokens than num_worst_tokens", True),
        # Refused inputs: every rank refuses alike, nothing moved, so the Buffer stays usable.
        DeviceError("kErrRefused", ValueError, "epcomm dispatch refused its inputs, nothing was sent: {refusals}",
                    False, whole=True),
        DeviceError("kErrShapes", RuntimeError, "rank(s) {ranks} passed rows of another shape to this call than "
                    "this rank (hidden size, dtype, FP8 scale count or dtype, top-k width); nothing was moved", True),
    ),
    ops={"kOpDispatch": "dispatch", "kOpCachedDispatch": "cached dispatch", "kOpCombine": "combine",
         "kOpBarrier": "destroy"},  # the barrier runs in destroy only
    head="{failed} (reported by {op})",
    unknown_op="call",
    fatal_tail=". Destroy the Buffer and the process group.",
)

# Why a rank refused a dispatch (the refusal word's bits, kRefuse* in the intranode kernels).
INTRANODE_REFUSALS = {
    1: "topk_idx values outside [-1, num_experts)",
    2: "num_tokens_per_rank does not match is_token_in_rank.sum(0) (pass both from get_dispatch_layout)",
    4: "ranks disagree on the row shape (hidden size, dtype, FP8 scale count or dtype, top-k width, weights) or "
       "num_worst_tokens",
    8: "it receives more tokens than its num_worst_tokens",
}

LOW_LATENCY = Family(
    name="low_latency",
    errors=(
        DeviceError("kErrTimeout", RuntimeError, _TIMED_OUT, True),
        # The caller's mistakes, found on the GPU without a host sync: the Buffer stays usable.
        DeviceError("kErrInvalidDispatch", ValueError, "rank(s) {ranks} passed an invalid topk_idx: values outside "
                    "[-1, num_experts), or one expert named more often than num_max_dispatch_tokens_per_rank (a token "
                    "naming an expert twice); those entries were not sent", False),
        DeviceError("kErrIdsDiffer", ValueError, "rank(s) {ranks} passed low_latency_combine a topk_idx that "
                    "differs from the one of its dispatch (the dispatch's was used), or with overlap=True a "
                    "packed_recv_count other than its dispatch's recv_count (that combine's output is invalid)", False),
        DeviceError("kErrComputeTimeout", RuntimeError, "the expert GEMM of rank(s) {ranks} did not raise "
                    "low_latency_combine's comp_signal (or src_signals) words to the threshold within "
                    "EPCOMM_TIMEOUT_S (overlap=True)", True),
        DeviceError("kErrShapes", RuntimeError, "rank(s) {ranks} made this call with another shape (hidden, "
                    "num_experts, num_max_dispatch_tokens_per_rank or FP8 format differ across ranks); their rows were "
                    "not read", True),
        DeviceError("kErrAbandoned", RuntimeError, "an earlier low-latency call of this rank failed (a timeout or "
                    "a call of another shape), so this one did not wait for its peers and is incomplete", True),
    ),
    ops={"kOpLowLatencyDispatch": "low_latency_dispatch", "kOpLowLatencyCombine": "low_latency_combine"},
    head="{failed} (reported by {op})",
    unknown_op="a low-latency call",
    fatal_tail=". Destroy the Buffer and the process group (or enable failed-rank masking).",
)

HIERARCHICAL = Family(
    name="hierarchical",
    errors=(
        DeviceError("kErrTimeout", RuntimeError, _TIMED_OUT, True),
        DeviceError("kErrMismatch", RuntimeError, "rank(s) {ranks} called another operation or shape (hidden size, "
                    "dtype, top-k, scales)", True),
        DeviceError("kErrCapacity", RuntimeError, "the receive area of rank(s) {ranks} is too small for this call "
                    "(num_nvl_bytes)", True),
        DeviceError("kErrWorstTokens", RuntimeError, "rank(s) {ranks} received more rows than num_worst_tokens", True),
        DeviceError("kErrRefused", RuntimeError, "rank(s) {ranks} refused the inputs (top-k ids outside [-1, "
                    "num_experts), or num_tokens_per_rank not is_token_in_rank.sum(0): pass both from "
                    "get_dispatch_layout)", True),
        DeviceError("kErrEarlierError", RuntimeError, "rank(s) {ranks} had an error in an earlier call (raised "
                    "there)", True),
        DeviceError("kErrPeerGaveUp", RuntimeError, "rank(s) {ranks} gave this call up (another operation or "
                    "shape seen there or at a rank it waits for, or an error of its own: see its message)", True),
    ),
    # The failed call, for the flight record (the message names the call that raises it).
    ops={"kOpDispatch": "dispatch", "kOpCachedDispatch": "cached dispatch", "kOpCombine": "combine"},
    head="{op} (hierarchical)",
    unknown_op="call",
    fatal_tail=". Destroy the Buffer and the process group.",
)


_PROTOCOL = Path(__file__).resolve().parents[2] / "include" / "epcomm" / "common" / "protocol.cuh"


@functools.cache
def device_codes() -> dict[str, int]:
    """Every ErrorCode, Op and Phase of common/protocol.cuh by name (the library is built from the same file)."""
    found = dict(re.findall(r"^\s*(k(?:Err|Op|Phase)\w+) = (\d+),", _PROTOCOL.read_text(), re.MULTILINE))
    return {name: int(value) for name, value in found.items()}


@functools.cache
def record_words() -> dict[str, int]:
    """The error record's word offsets (kInfoError...) of common/protocol.cuh by name."""
    found = dict(re.findall(r"^constexpr int (kInfoError\w*) = (\d+);", _PROTOCOL.read_text(), re.MULTILINE))
    return {name: int(value) for name, value in found.items()}


@functools.cache
def phase_names() -> dict[int, str]:
    """Each Phase's value -> its name in messages and flight records (kPhaseReceive: "receive")."""
    return {value: name[len("kPhase"):].lower() for name, value in device_codes().items()
            if name.startswith("kPhase") and value}


# What the flight recorder is told of a timeout: (the failed call's name, the call that reported it,
# the phase or None, the ranks waited for) -> text appended to the error's message.
FlightHook = Callable[[str, str, "str | None", "list[int]"], str]


@functools.cache
def header_constants(name: str) -> dict[str, int]:
    """The integer constants (``constexpr int kX = N;``) of include/epcomm/``name``, by name: the
    host reads buffer words where the kernels' headers place them."""
    text = (_PROTOCOL.parents[1] / name).read_text()
    return {k: int(v) for k, v in re.findall(r"^constexpr int (k\w+) = (\d+);", text, re.MULTILINE)}


class ErrorTable:
    """The codes of one family as one library numbers them, and the raising of its error records."""

    def __init__(self, family: Family, layout: RecordLayout) -> None:
        self.family, self.layout = family, layout
        values = device_codes()
        self.by_code = {values[e.name]: e for e in family.errors}
        self.op_names = {values[name]: shown for name, shown in family.ops.items()}
        self.fatal = frozenset(code for code, e in self.by_code.items() if e.fatal)

    def code(self, name: str) -> int:
        """The value of the error named ``name`` (DeviceError.name)."""
        return next(code for code, e in self.by_code.items() if e.name == name)

    def take(self, info: np.ndarray, num_ranks: int) -> tuple[int, int | None, int, list[int]]:
        """Read the record in ``info`` (code, op code or None, phase, the rank words) and clear it as
        the layout says; code 0: nothing reported (nothing cleared)."""
        lay = self.layout
        code = int(info[lay.code])
        if code == 0:
            return 0, None, 0, []
        flags = [int(v) for v in info[lay.ranks:lay.ranks + num_ranks]]
        op = int(info[lay.op]) if lay.op is not None else None
        phase = int(info[lay.phase])
        if lay.clear == "record":
            info[:] = 0
        elif lay.clear == "ranks":
            info[lay.code] = 0
            info[lay.ranks:lay.ranks + num_ranks] = 0
        else:
            info[lay.code] = 0
            for r, flag in enumerate(flags):
                if flag:
                    info[lay.ranks + r] = 0
        return code, op, phase, flags

    def error(self, code: int, op: str, rank: int, failed_op: int | None, flags: list[int],
              refusals: list[int] | None = None, phase: int = 0, flight: FlightHook | None = None) -> Exception:
        """The exception for a reported ``code``: raised by the call ``op`` on ``rank``; ``failed_op`` is
        the record's op code, ``flags`` its rank words, ``refusals`` each rank's refusal bits, ``phase``
        the Phase of a timeout, which ``flight`` (if given) records."""
        family = self.family
        entry = self.by_code.get(code)
        ranks = [r for r, flag in enumerate(flags) if flag]
        phase_name = phase_names().get(phase)
        fields = {"ranks": ranks, "phase": f" in the {phase_name} phase" if phase_name else ""}
        if entry is not None and "{mismatch}" in entry.message:
            fields["mismatch"] = ", ".join(f"rank {r}: {self.op_names.get(flags[r], '?')}" for r in ranks)
        if entry is not None and "{refusals}" in entry.message:
            fields["refusals"] = " | ".join(
                f"rank {r}: " + "; ".join(text for bit, text in INTRANODE_REFUSALS.items() if bits & bit)
                for r, bits in enumerate(refusals or []) if bits)
        text = (entry.message if entry is not None else f"error {code}").format(**fields)
        exception = entry.exception if entry is not None else RuntimeError
        if entry is not None and entry.whole:
            return exception(text)
        failed = self.op_names.get(failed_op, family.unknown_op) if failed_op is not None else family.unknown_op
        head = family.head.format(failed=failed, op=op)
        tail = family.fatal_tail if exception is RuntimeError else ""
        timed_out = entry is not None and entry.name == "kErrTimeout"
        if flight is not None and timed_out:
            tail += flight(failed if failed_op is not None else op, op, phase_name, ranks)
        error = exception(f"epcomm {head} on rank {rank}: {text}{tail}")
        # For failed-rank masking (backends/shrink.py): the ranks waited for; none known where a peer
        # gave the call up (it may be one that waited for the failed rank).
        if timed_out or (entry is not None and entry.name == "kErrPeerGaveUp"):
            error.timed_out_ranks = ranks if timed_out else []
        return error

    def check(self, info: np.ndarray, op: str, rank: int, num_ranks: int, refusals_at: int | None = None,
              flight: FlightHook | None = None) -> None:
        """Raise what the record in ``info`` reports, clearing it; nothing if it reports nothing.
        ``refusals_at``: where each rank's refusal bits lie in ``info`` (the intranode family);
        ``flight``: called on a timeout (the flight recorder), its text ends the message."""
        if int(info[self.layout.code]) == 0:  # the common case, on every call's host path
            return
        code, failed_op, phase, flags = self.take(info, num_ranks)
        refusals = [int(v) for v in info[refusals_at:refusals_at + num_ranks]] if refusals_at is not None else None
        raise self.error(code, op, rank, failed_op, flags, refusals, phase, flight)
