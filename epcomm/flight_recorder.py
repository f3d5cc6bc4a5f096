"""The flight recorder: when a call times out waiting for its peers, what this rank saw of them.

Every Buffer keeps a small ring of its last calls (op, shapes, arguments: ``FlightRecorder.note``).
On a timeout, in any mode and on either backend, the error's message gains the path of a JSON file
(``timeout``) holding: the operation, the phase the wait gave up in (notify: the count exchange or
the call's barrier; send; receive; reduce), the ranks that had not arrived, the call counters of
every peer as this rank's buffers show them (read after the kernels gave up), and the ring. In a job
of many ranks the files of the ranks that timed out name the same rank and phase: the one that
hung, and where (docs/ERRORS.md, "Flight recorder").

The directory is EPCOMM_FLIGHT_RECORDER_DIR: unset, ``<temp dir>/epcomm-flight-records``; ``off``
(or 0), no file (the message still names the phase and the ranks).
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import socket
import tempfile
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import _env

RING_CALLS = 16  # the calls a record lists: enough to see the pattern a job was in when it hung
FORMAT = 1       # the file's "format" field; raised when a field changes meaning
_OFF = ("off", "0")


def directory() -> str | None:
    """Where records go (EPCOMM_FLIGHT_RECORDER_DIR), or None when they are off."""
    raw = _env.env_str("EPCOMM_FLIGHT_RECORDER_DIR").strip()
    if raw.lower() in _OFF:
        return None
    return os.path.expanduser(raw) if raw else os.path.join(tempfile.gettempdir(), "epcomm-flight-records")


# What each op's ring entry holds (Buffer passes them in this order; shapes as torch.Size, False
# for a dispatch without top-k ids).
FIELDS = {
    "dispatch": ("x", "dtype", "topk_idx", "fresh"),
    "combine": ("x", "dtype", "num_recv_tokens"),
    "low_latency_dispatch": ("slot", "x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts", "use_fp8",
                             "return_recv_hook"),
    "low_latency_combine": ("slot", "x", "topk_idx", "zero_copy", "return_recv_hook"),
}


def _plain(value: Any) -> Any:
    """A ring value as JSON holds it: a shape as a list, a dtype by name."""
    if isinstance(value, torch.Size):
        return list(value)
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return value


class FlightRecorder:
    """One Buffer's ring of calls and its records of timeouts."""

    def __init__(self, uid: str, rank: int, group_ranks: tuple[int, ...], timeout_s: float) -> None:
        self.uid, self.rank, self.group_ranks, self.timeout_s = uid, rank, group_ranks, timeout_s
        self.calls: collections.deque = collections.deque(maxlen=RING_CALLS)
        self.count = 0
        self.written: list[str] = []  # the files written, oldest first

    def note(self, op: str, *values: Any) -> None:
        """Remember a call: ``values`` as FIELDS[op] names them (shapes, not tensors: the ring must not
        keep the caller's memory). On every call's host path, so nothing is formatted here."""
        self.count += 1
        self.calls.append((self.count, time.time(), op, values))

    def last_calls(self) -> list[dict[str, Any]]:
        return [{"call": n, "time": t, "op": op, **{name: _plain(v) for name, v in zip(FIELDS[op], values)}}
                for n, t, op, values in self.calls]

    def timeout(self, mode: str, operation: str, phase: str | None, missing: list[int] | None,
                counters: Callable[[], dict[str, Any]] | dict[str, Any], reported_by: str = "") -> str:
        """Write the record of a timeout; the text to end the error's message with (the file's path)."""
        where = directory()
        if where is None:
            return ""
        try:
            seen = counters() if callable(counters) else counters
        except Exception as error:  # a broken context must not hide the timeout itself
            seen = {"unreadable": f"{type(error).__name__}: {error}"}
        record = {
            "format": FORMAT,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "global_rank": self.group_ranks[self.rank] if self.rank < len(self.group_ranks) else None,
            "rank": self.rank,
            "group_ranks": list(self.group_ranks),
            "buffer": self.uid,
            "mode": mode,
            "operation": operation,
            "reported_by": reported_by or operation,
            "phase": phase,
            "missing_ranks": missing,
            "timeout_s": self.timeout_s,
            "counters": seen,
            "last_calls": self.last_calls(),
        }
        name = (f"epcomm-flight-rank{record['global_rank'] or 0:05d}-{record['host']}-{record['pid']}-"
                f"{self.uid}-{len(self.written)}.json")
        path = os.path.join(where, name)
        try:
            os.makedirs(where, exist_ok=True)
            with open(path + ".part", "w") as f:
                f.write(_lines(record))
            os.replace(path + ".part", path)  # a reader never sees half a record
        except OSError as error:
            return f" (flight record not written: {error})"
        self.written.append(path)
        return f" Flight record: {path}"


def _lines(record: dict[str, Any]) -> str:
    """JSON with a line per field and per ring entry: readable with cat, short with a thousand ranks."""
    def one(value: Any) -> str:
        return json.dumps(value, default=str)

    fields = []
    for key, value in record.items():
        if key == "last_calls":
            value = "[\n  " + ",\n  ".join(one(call) for call in value) + "\n ]" if value else "[]"
            fields.append(f" {one(key)}: {value}")
        else:
            fields.append(f" {one(key)}: {one(value)}")
    return "{\n" + ",\n".join(fields) + "\n}\n"


def read_device_words(t: torch.Tensor, dtype: torch.dtype, wait_s: float = 2.0) -> list[int] | str:
    """The words of ``t`` (bytes of a buffer) as ``dtype``, read from the host after a timeout.

    A GPU buffer is copied on a stream of its own, waited for at most ``wait_s``: the kernels have
    given up, but a copy queued behind a kernel that still spins must not hang the error path. The
    words are counters that only grow, so a copy taken while a kernel runs is still a true snapshot
    of each. Returns the reason instead where it could not be read."""
    try:
        if t.device.type != "cuda":
            return t.contiguous().view(dtype).tolist()
        host = torch.empty(t.numel(), dtype=torch.uint8, pin_memory=True)
        stream = torch.cuda.Stream(t.device)
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        deadline = time.monotonic() + wait_s
        while not done.query():
            if time.monotonic() > deadline:
                return f"not read: the copy did not finish within {wait_s:g} s"
            time.sleep(1e-3)
        return host.view(dtype).tolist()
    except Exception as error:  # a sticky CUDA error: say so rather than hide the timeout
        return f"not read: {type(error).__name__}: {error}"


def _op_names() -> dict[int, str]:
    from .backends.cuda.errors import device_codes

    return {value: name[len("kOp"):] for name, value in device_codes().items() if name.startswith("kOp")}


def intranode_counters(ops: Any) -> dict[str, Any]:
    """CUDA intranode: this rank's call counter, the call it gave up, and each rank's last signal in
    this rank's buffer (the call and op of the notify it last entered)."""
    from .backends.cuda.errors import header_constants

    k = header_constants("layout/intranode.cuh")
    words = read_device_words(ops.buffer[:k["kAbortOffset"] + 8], torch.int64)
    if isinstance(words, str):
        return {"unreadable": words}
    signals = words[k["kSignalOffset"] // 8:][:ops.num_ranks]
    names = _op_names()
    return {"this_rank_call": words[k["kSeqOffset"] // 8], "gave_up_call": words[k["kAbortOffset"] // 8],
            "peer_call": [v >> 4 for v in signals], "peer_op": [names.get(v & 15, v & 15) for v in signals]}


def low_latency_counters(ops: Any) -> dict[str, Any]:
    """CUDA low latency: this rank's call counter, the call that last used each slot, whether a wait
    gave up, and per slot the call each rank last acknowledged here (its receive of that slot ended)."""
    from .backends.cuda.errors import header_constants

    k = header_constants("layout/low_latency.cuh")
    memory = ops.shared.tensor
    words = read_device_words(memory[:k["kHeaderBytes"]], torch.int64)
    if isinstance(words, str):
        return {"unreadable": words}
    acks = []
    for slot in range(2):
        base = k["kHeaderBytes"] + slot * ops.slot_bytes
        acks.append(read_device_words(memory[base:base + 8 * ops.num_ranks], torch.int64))
    seqs = k["kSlotSeqOffset"] // 8
    return {"this_rank_call": words[k["kCounterOffset"] // 8], "slot_call": words[seqs:seqs + 2],
            "gave_up": (words[k["kGaveUpOffset"] // 8] >> (8 * (k["kGaveUpOffset"] % 8))) & 0xffffffff,
            "peer_acknowledged_call": acks}


def hierarchical_counters(ops: Any) -> dict[str, Any]:
    """CUDA hierarchical: this rank's call and notify counters, the call it gave up, the call whose
    counts each rank delivered here, the call each mate (same local index, every domain) and each
    rank of this domain last entered as this rank's buffers show."""
    from .backends.cuda.errors import header_constants

    k = header_constants("layout/hierarchical.cuh")
    c, rpd = ops.c, ops.rpd
    abort = c["max_domains"] * (1 + c["max_chunks"])  # after ready[D] and done[D][chunks] (sym_abort)
    sym = read_device_words(ops.sym.tensor[:8 * (abort + 1 + k["kMaxGroupRanks"] + 4)], torch.int64)
    domain = read_device_words(ops.shared.tensor[:8 * rpd], torch.int64)
    if isinstance(sym, str):
        return {"unreadable": sym}
    seq = abort + 1 + k["kMaxGroupRanks"]  # sym_seq, then notify_seq and sticky_error
    tag = k["kTagBits"]
    return {"this_rank_call": sym[seq], "notify_call": sym[seq + 1], "gave_up_call": sym[abort],
            "sticky_error": sym[seq + 2], "counts_delivered_call": sym[abort + 1:abort + 1 + ops.num_ranks],
            "mate_entered_call": {d * rpd + ops.local: sym[d] >> tag for d in range(ops.num_domains)},
            "domain_entered_call": domain if isinstance(domain, str) else
            {ops.my_domain * rpd + i: v >> tag for i, v in enumerate(domain)}}


def hook(ops: Any, mode: str, counters: Callable[[Any], dict[str, Any]]) -> Callable[..., str]:
    """The ``flight`` argument of a CUDA family's ErrorTable.check: records a timeout with ``ops``'s
    recorder (none: only the message names phase and ranks), reading ``counters(ops)`` then. It holds
    ``ops`` weakly: ``ops`` keeps the hook, and a cycle would keep its GPU memory until a collection."""
    ops_ref = weakref.ref(ops)

    def flight(operation: str, reported_by: str, phase: str | None, missing: list[int]) -> str:
        ops = ops_ref()
        if ops is None or ops.recorder is None:
            return ""
        return ops.recorder.timeout(mode, operation, phase, missing, lambda: counters(ops), reported_by)
    return flight


def attach(buf: Any) -> FlightRecorder:
    """Give a built Buffer its recorder and hand it to every part that may time out."""
    recorder = FlightRecorder(buf.uid, buf.rank, tuple(buf._group_ranks), buf._backend.transport.timeout_s)
    buf._backend.transport.recorder = recorder
    for ops in (buf._normal_ops, buf._ll_ops):
        ops.recorder = recorder
    return recorder
