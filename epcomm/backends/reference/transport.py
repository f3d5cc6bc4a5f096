"""Collectives with a deadline: every wait is bounded and names the ranks that did not arrive.

Each call first publishes "rank r reached call #seq" in the process group's store (with its
handshake's header, which small non-NCCL groups exchange there), then runs an asynchronous
torch.distributed collective and polls it. If the deadline passes (or the collective
fails: a peer that exited), the store tells which ranks never reached this call, or, of those that
did, which never reached this exchange (each rank that gives up says where it is, ``_positions``),
and the error names them with the phase and the flight recorder's file. After such a timeout the
group holds an unfinished collective: destroy the Buffer and the process group (with enable_shrink,
normal mode instead moves its exchanges onto a group of the live ranks: ``use``, shrink.py).
"""

from __future__ import annotations

import datetime
import json
import time

import torch
import torch.distributed as dist

from ...tuning import STORE_HEADER_RANKS


class PeerTimeoutError(RuntimeError):
    """A peer did not arrive within the timeout. What enable_shrink's agreement starts from (shrink.py):
    the call's key ``seq``, the ranks ``missing`` (None: unknown) and the exchange's ``deadline``."""

    def __init__(self, message: str, seq: int | str, missing: list[int] | None, deadline: float = 0.0) -> None:
        super().__init__(message)
        self.seq, self.missing, self.deadline = seq, missing, deadline


# The Buffer method an exchange's op tag stands for, where the two differ (the handshakes tag by
# backend.Op): the error and its flight record name the call the caller made.
CALLS = {"ll_dispatch": "low_latency_dispatch", "ll_combine": "low_latency_combine",
          "clean_ll": "clean_low_latency_buffer"}


# The store connection the handshakes wait on, one a process (and its store): a wait holds its client for as
# long as it waits, so the process's own client, which torch.distributed and every other user share, must not be
# it; one a Buffer would pile connections onto the store's server as Buffers come and go.
_header_clients: tuple = (None, None)


def _header_client(store: dist.Store):
    """epcomm's own connection to ``store`` (None where the store cannot clone itself or read many keys at
    once: the headers then take a collective)."""
    global _header_clients
    if _header_clients[0] is not store:
        try:
            clone = store.clone()
            usable = hasattr(clone, "multi_get") and hasattr(clone, "multi_set")
        except Exception:
            clone, usable = None, False
        _header_clients = (store, clone if usable else None)
    return _header_clients[1]


class Transport:
    recorder = None  # the Buffer's FlightRecorder (flight_recorder.attach)

    def __init__(self, group: dist.ProcessGroup, uid: str, timeout_s: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.timeout_s = timeout_s
        self.uid = uid
        self._nccl = "nccl" in str(dist.get_backend(group))  # a group of the live ranks has the same backend
        # Masked ranks (enable_shrink): exchanges then run on a group of the live ranks only, made once
        # per live set (``use``); ``live`` is None while every rank takes part.
        self.world = group
        self.live: list[int] | None = None
        self._subgroups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        try:
            self._store = dist.distributed_c10d._get_default_store()
        except Exception:  # not every launcher exposes the store; errors then name no rank
            self._store = None
        self._header_store = None
        self._header_seq = 0  # the latest call whose header this rank left in the store
        self._stale_header: str | None = None  # a header every peer has read, to delete (``tidy``)
        if self._store is not None and not self._nccl and 1 < self.num_ranks <= STORE_HEADER_RANKS:
            self._header_store = _header_client(self._store)

    def expected(self) -> list[int]:
        """The ranks an exchange waits for: the live ones."""
        return self.live if self.live is not None else list(range(self.num_ranks))

    def use(self, live: list[int]) -> None:
        """Run the exchanges among ``live`` (ascending) only, or among every rank again. The group of
        the live ranks is made by them alone (``use_local_synchronization``: a dead rank cannot take
        part in a collective of the whole group), bounded by the timeout."""
        self._drop_headers()
        if len(live) == self.num_ranks:
            self.group, self.live = self.world, None
            return
        key = tuple(live)
        if key not in self._subgroups:
            ranks = dist.get_process_group_ranks(self.world)
            self._subgroups[key] = dist.new_group(
                [ranks[r] for r in live], backend=str(dist.get_backend(self.world)),
                timeout=datetime.timedelta(seconds=self.timeout_s), use_local_synchronization=True)
        self.group, self.live = self._subgroups[key], list(live)

    def _key(self, rank: int) -> str:
        return f"epcomm/{self.uid}/arrived/{rank}"

    def announce(self, seq: int) -> None:
        if self._store is not None:
            self._store.set(self._key(self.rank), str(seq))

    def missing_ranks(self, seq: int) -> list[int] | None:
        """Ranks whose last announced call is older than ``seq`` (None when unknowable)."""
        if self._store is None:
            return None
        missing = []
        for r in self.expected():
            key = self._key(r)
            if not self._store.check([key]) or int(self._store.get(key)) < seq:
                missing.append(r)
        return missing

    def meet(self, tag: str, deadline: float) -> list[int] | None:
        """A barrier through the store, bounded by ``deadline``: the ranks that did not arrive (None
        without a store). Safe with a dead peer, unlike a collective of the group.

        A rank that gives up says so in the store, and a rank arriving later counts it as absent: it
        left, so what the meeting guards (a collective free, say) must not go on with it, although its
        arrival key is there."""
        if self._store is None:
            return None
        self._store.set(f"epcomm/{self.uid}/{tag}/{self.rank}", "1")
        keys = {r: f"epcomm/{self.uid}/{tag}/{r}" for r in self.expected()}
        gave_up = {r: f"epcomm/{self.uid}/{tag}/gave-up/{r}" for r in self.expected()}
        pause = 1e-4
        while True:
            missing = [r for r, key in keys.items() if not self._store.check([key])]
            if not missing:
                return [r for r, key in gave_up.items() if self._store.check([key])]
            if time.monotonic() > deadline:
                # A rank arriving between the check above and this key still goes on (a window of one
                # store round trip): a meeting bounded by time cannot close it entirely.
                self._store.set(gave_up[self.rank], "1")
                return missing
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def wait(self, work: dist.Work, op: str, seq: int, deadline: float, phase: str | None = None) -> None:
        """Complete ``work`` by ``deadline``, or raise a RuntimeError naming ``op`` and the ranks at fault.

        gloo: a blocking wait bounded by the time left (woken as soon as the data is in, no polling).
        NCCL: the host polls, since ``wait`` there only orders the stream; while a CUDA graph is being
        captured nothing may wait on the host, so the stream is ordered and NCCL's own watchdog rules.
        A transport error (a peer's process gone resets its connections) gives the same kind of error
        as a timeout, naming the ranks. ``phase``: the flight recorder's (default: a combine's exchange
        reduces, any other receives)."""
        if self._nccl:
            if torch.cuda.is_current_stream_capturing():
                work.wait()
                return
            pause = 2e-5
            while not work.is_completed():
                if time.monotonic() > deadline:
                    self._give_up(op, seq, phase, None, deadline)
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)  # back off so the poll does not starve the transport thread
        done = True
        try:
            if self._nccl:
                work.wait()
            else:
                left = max(deadline - time.monotonic(), 1e-3)  # a zero timeout would mean none
                done = work.wait(timeout=datetime.timedelta(seconds=left))
        except RuntimeError as error:  # gloo's own timeout, or a peer gone (its connection closed)
            self._give_up(op, seq, phase, None if time.monotonic() > deadline else error, deadline)
        if not done:
            self._give_up(op, seq, phase, None, deadline)

    def _position_key(self, rank: int) -> str:
        return f"epcomm/{self.uid}/gave-up-at/{rank}"

    def _positions(self, seq: int, here: list, grace_s: float) -> dict[int, list]:
        """Say where this rank gave up (``here``: [seq, phase]) and collect where its peers did, waiting
        up to ``grace_s`` for the peers of call ``seq`` (they give up about when this rank does); a
        rank that never says is silent or gone (a word of an earlier call counts as none)."""
        positions: dict[int, list] = {}
        if self._store is None:
            return positions
        self._store.set(self._position_key(self.rank), json.dumps(here))
        end = time.monotonic() + grace_s
        expected = self.expected()
        while True:
            for r in expected:
                if r not in positions and self._store.check([self._position_key(r)]):
                    position = json.loads(self._store.get(self._position_key(r)))
                    if position[0] >= seq:
                        positions[r] = position
            if len(positions) == len(expected) or time.monotonic() > end:
                return positions
            time.sleep(0.01)

    def _give_up(self, op: str, seq: int, phase: str | None, error: Exception | None, deadline: float) -> None:
        """Raise PeerTimeoutError naming the ranks this exchange waited for, with the flight record."""
        op = CALLS.get(op, op)
        phase = phase or ("reduce" if "combine" in op else "receive")
        arrived: dict[int, int] = {}
        positions: dict[int, list] = {}
        try:
            missing = self.missing_ranks(seq)
            if missing == []:  # every rank reached the call: the ones that never reached this exchange
                positions = self._positions(seq, [seq, phase], min(1.0, self.timeout_s / 4))
                missing = [r for r in self.expected() if r not in positions]
            if self._store is not None:
                for r in range(self.num_ranks):
                    key = self._key(r)
                    arrived[r] = int(self._store.get(key)) if self._store.check([key]) else None
        except RuntimeError:  # the store is gone too (its host was a peer): the ranks at fault are unknown
            missing = None
        who = (f"rank(s) {missing} did not arrive" if missing
               else "every rank arrived, so a peer failed during the exchange" if missing == []
               else "the ranks that did not arrive are unknown (no store to ask)")
        what = (f"timed out after {self.timeout_s:g} s (EPCOMM_TIMEOUT_S)" if error is None
                else "lost a peer (the exchange failed)")
        flight = ""
        if self.recorder is not None:
            counters = {"this_rank_call": seq, "arrived_call": arrived, "gave_up_at": dict(sorted(positions.items()))}
            flight = self.recorder.timeout("reference", op, phase, missing, counters)
        raise PeerTimeoutError(
            f"epcomm {op}: rank {self.rank} {what} waiting for its peers in the {phase} phase; {who}. "
            f"Destroy the Buffer and the process group.{flight}", seq, missing, deadline) from None  # no transport text

    def share_header(self, header: torch.Tensor, op: str, seq: int, deadline: float, device: torch.device
                     ) -> torch.Tensor:
        """Every rank's header (1-D int64, built on the host) as rows [R, n] on the host, this rank's
        arrival at call ``seq`` announced. Where a collective of the group costs more than a few store
        round trips (not NCCL, at most STORE_HEADER_RANKS ranks: tuning.py), through the store;
        else a collective on ``device``."""
        if self.num_ranks == 1:
            return header.unsqueeze(0)
        store = self._header_store
        if store is None:
            self.announce(seq)
            return self.share(header.to(device), op, seq, deadline).cpu()
        me, live = self.rank, self.expected()
        keys = [self._header_key(seq, r) for r in live]
        try:
            self.tidy()  # a stale header no exchange has deleted yet (a call that exchanged nothing)
            store.multi_set([self._key(me), self._header_key(seq, me)], [str(seq), header.numpy().tobytes()])
            store.set_timeout(datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            values = store.multi_get(keys)  # waits for every key: one round trip less than wait, then read
            self._header_seq = seq
            self._stale_header = self._header_key(seq - 2, me)  # every peer has read it: they are at seq
        except RuntimeError as error:  # the wait's timeout, or the store gone with its host
            self._give_up(op, seq, "notify", None if time.monotonic() > deadline else error, deadline)
        out = header.unsqueeze(0).repeat(self.num_ranks, 1)  # a masked rank's row: this rank's own
        out[live] = torch.frombuffer(bytearray(b"".join(values)), dtype=torch.int64).view(len(live), -1)
        return out

    def tidy(self) -> None:
        """Delete the header of this rank's call before last from the store: a round trip that the
        exchanges take while their data travels (``start_all_to_all``), off the handshake's path."""
        if self._stale_header is not None:
            key, self._stale_header = self._stale_header, None
            try:
                self._header_store.delete_key(key)
            except RuntimeError:  # the store is gone with its host: the exchange's wait names the ranks
                pass

    def _drop_headers(self) -> None:
        """Delete this rank's headers still in the store under the live set it leaves (the latest three)."""
        if self._header_store is not None and self._header_seq:
            self._stale_header = None
            for seq in (self._header_seq - 2, self._header_seq - 1, self._header_seq):
                try:
                    self._header_store.delete_key(self._header_key(seq, self.rank))
                except RuntimeError:  # the store is gone with its host: nothing to clean
                    return
        self._header_seq = 0

    def _header_key(self, seq: int, rank: int) -> str:
        # Keyed by the live set too: a masked rank that wakes inside an abandoned call must not meet its
        # peers' retry of that call (same number, the live ranks only); it times out and learns it is masked.
        live = "all" if self.live is None else "-".join(map(str, self.live))
        return f"epcomm/{self.uid}/header/{live}/{seq}/{rank}"

    def all_gather(self, t: torch.Tensor, op: str, seq: int, deadline: float) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.num_ranks)]
        self.wait(dist.all_gather(out, t, group=self.group, async_op=True), op, seq, deadline, "notify")
        return out

    def share(self, t: torch.Tensor, op: str, seq: int, deadline: float) -> torch.Tensor:
        """Every rank's 1-D ``t`` as rows [R, n]. On NCCL an all-gather; elsewhere one all-to-all of
        ``t`` to every rank, which completes in one step where gloo's all-gather takes R - 1."""
        if self.live is not None:  # masked ranks' rows: this rank's own (the caller reads none of them)
            live = self.live
            rows = t.new_empty((len(live), t.numel()))
            send = t.unsqueeze(0).expand(len(live), -1).contiguous()
            self.wait(dist.all_to_all_single(rows, send, group=self.group, async_op=True), op, seq, deadline, "notify")
            out = t.unsqueeze(0).repeat(self.num_ranks, 1)
            out[live] = rows
            return out
        out = t.new_empty((self.num_ranks, t.numel()))
        if self._nccl:
            return self.all_gather_into(out, t.unsqueeze(0), op, seq, deadline, "notify")
        send = t.unsqueeze(0).expand(self.num_ranks, -1).contiguous()
        self.wait(dist.all_to_all_single(out, send, group=self.group, async_op=True), op, seq, deadline, "notify")
        return out

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor, op: str, seq: int, deadline: float,
                        phase: str | None = None) -> torch.Tensor:
        """Gather ``t`` [n, ...] of every rank into ``out`` [R * n, ...], rank j's rows in block j.

        NCCL gathers into ``out`` directly; other backends use the list form into views of ``out``,
        which every gloo version supports (the single-tensor form is recent there).
        """
        if self._nccl:
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            work = gather(out, t, group=self.group, async_op=True)
        else:
            work = dist.all_gather(list(out.chunk(self.num_ranks)), t, group=self.group, async_op=True)
        self.wait(work, op, seq, deadline, phase)
        return out

    def reduce_scatter(self, send: torch.Tensor, op: str, seq: int, deadline: float) -> torch.Tensor:
        """Sum ``send`` [R * n, W] over the ranks and return block ``rank`` of the sum, [n, W].

        NCCL: ``reduce_scatter_tensor`` (its summation order is NCCL's own). Other backends (gloo has
        no reduce-scatter before recent PyTorch): an all-to-all of the blocks, then a local sum in
        ascending source-rank order, which is deterministic and is the order of the all-to-all
        strategy's combine, so on gloo both strategies agree bit for bit.
        """
        n = send.shape[0] // self.num_ranks
        if self._nccl:
            out = send.new_empty((n, *send.shape[1:]))
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            self.wait(scatter(out, send, group=self.group, async_op=True), op, seq, deadline)
            return out
        blocks = self.all_to_all(send, [n] * self.num_ranks, [n] * self.num_ranks, op, seq, deadline)
        out = torch.zeros((n, *send.shape[1:]), dtype=send.dtype, device=send.device)
        for src in range(self.num_ranks):
            out += blocks[src * n:(src + 1) * n]
        return out

    def all_to_all(self, send: torch.Tensor, send_rows: list[int], recv_rows: list[int], op: str, seq: int,
                   deadline: float) -> torch.Tensor:
        """Variable-size all-to-all of the rows of a 2-D byte tensor; rows of rank j land in block j."""
        return self.start_all_to_all(send, send_rows, recv_rows).wait(op, seq, deadline)

    def start_all_to_all(self, send: torch.Tensor, send_rows: list[int], recv_rows: list[int],
                         out: torch.Tensor | None = None) -> PendingExchange:
        """Issue the all-to-all (into ``out`` if given: the caller's output, so no copy follows);
        ``.wait()`` on the result completes it and returns the received rows. With masked ranks the
        rows for them stay here and theirs read as zeros (a handle made before they were masked)."""
        if self.live is not None:
            return self._start_among_live(send, send_rows, recv_rows, out)
        recv = out if out is not None else \
            torch.empty((sum(recv_rows), send.shape[1]), dtype=send.dtype, device=send.device)
        work = dist.all_to_all_single(recv, send, recv_rows, send_rows, group=self.group, async_op=True)
        self.tidy()
        return PendingExchange(self, work, recv, keep_alive=send)


    def _start_among_live(self, send: torch.Tensor, send_rows: list[int], recv_rows: list[int],
                          out: torch.Tensor | None) -> PendingExchange:
        live = self.live
        starts = [0]
        for n in send_rows:
            starts.append(starts[-1] + n)
        if any(send_rows[r] for r in range(self.num_ranks) if r not in live):
            send = torch.cat([send[starts[r]:starts[r + 1]] for r in live])
        live_recv = [recv_rows[r] for r in live]
        if out is None:
            out = torch.empty((sum(recv_rows), send.shape[1]), dtype=send.dtype, device=send.device)
        if sum(live_recv) == out.shape[0]:  # nothing from masked ranks: receive in place
            recv, place = out, None
        else:
            recv, place = out.new_empty((sum(live_recv), out.shape[1])), (out, recv_rows, live)
        work = dist.all_to_all_single(recv, send, live_recv, [send_rows[r] for r in live], group=self.group,
                                      async_op=True)
        self.tidy()
        return PendingExchange(self, work, recv, keep_alive=send, place=place)


class PendingExchange:
    def __init__(self, transport: Transport, work: dist.Work, recv: torch.Tensor, keep_alive: torch.Tensor,
                 place: tuple | None = None) -> None:
        self.transport, self.work, self.recv = transport, work, recv
        self._keep_alive = keep_alive  # the send buffer must outlive the asynchronous exchange
        self._place = place  # (world-shaped out, its rows per source, the live sources): zeros for the rest

    def wait(self, op: str, seq: int, deadline: float) -> torch.Tensor:
        self.transport.wait(self.work, op, seq, deadline)
        self._keep_alive = self.work = None  # the work holds the send buffer too: free it before the reduce
        if self._place is not None:
            out, rows, live = self._place
            out.zero_()
            begin, at = 0, 0
            for r, n in enumerate(rows):
                if r in live:
                    out[at:at + n] = self.recv[begin:begin + n]
                    begin += n
                at += n
            self.recv, self._place = out, None
        return self.recv
