"""Failed-rank masking in normal mode on the portable path (``Buffer(..., enable_shrink=True)``).

A dispatch or combine whose exchange times out or loses a peer does not raise: every rank that saw
the failure posts its view (the ranks that had not reached the call when its timeout passed: a
peer that exits counts as one that went silent) in the process group's store and waits,
bounded by the timeout, until every rank that nobody suspects has posted too. The first rank to get
there writes the decision once (``compare_set``): the ranks that did not post failed. So every
survivor reads the same set, ORs it into the Buffer's mask, moves its exchanges onto a group of the
live ranks (made by them alone) and runs the call again with the mask applied. A collective of the
whole group cannot serve here: a dead rank never joins it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch

from .backend import ReferenceBackend
from .transport import PeerTimeoutError


def masked_ranks(be: ReferenceBackend) -> list[int]:
    """The ranks the Buffer's mask holds (reading it waits for the device where the mask lives there)."""
    return [r for r, m in enumerate(be.mask.tolist()) if m]


def follow_mask(be: ReferenceBackend, op: str) -> list[int]:
    """Point the exchanges at the ranks the mask leaves (the whole group once it is clean); the
    masked ranks. Raises on a rank the mask holds: its peers no longer exchange with it."""
    masked = masked_ranks(be)
    if masked:
        be.was_masked = True
    elif be.was_masked:
        rejoin(be)
    if be.rank in masked:
        raise RuntimeError(f"epcomm {op}: rank {be.rank} is masked as failed (its peers stopped waiting for it); "
                           "it takes no part in normal-mode calls until the mask is cleaned on every rank")
    live = [r for r in range(be.num_ranks) if r not in masked]
    if live != be.transport.expected():
        be.transport.use(live)
    return masked


def rejoin(be: ReferenceBackend, reset: Callable[[], None] | None = None) -> None:
    """The first call after the mask was cleaned: every rank meets in the store (bounded), on the whole
    group again, and takes the highest call number announced (a masked rank made fewer calls); with
    ``reset`` (the kernels' buffers zeroed), every rank then resets and meets again, so no peer writes
    into a buffer before its owner has zeroed it. A rank still missing fails this call as a timeout
    would, and is masked anew."""
    be.was_masked = False
    be.rejoins += 1
    transport = be.transport
    transport.use(list(range(be.num_ranks)))
    tag = f"rejoin-{be.rejoins}"
    store = transport._store
    if store is None:  # no meeting to hold (nor an agreement to have masked a rank by)
        if reset is not None:
            reset()
        return
    store.set(f"epcomm/{transport.uid}/{tag}/seq/{be.rank}", str(be.seq))  # read by the peers after the meeting
    missing = transport.meet(tag, time.monotonic() + transport.timeout_s)
    be.seq = max(int(store.get(f"epcomm/{transport.uid}/{tag}/seq/{r}")) for r in range(be.num_ranks)
                 if r not in missing)
    if not missing and reset is not None:
        reset()
        tag = f"{tag}-reset"
        missing = transport.meet(tag, time.monotonic() + transport.timeout_s)
    if missing:
        raise PeerTimeoutError(f"epcomm: rank(s) {missing} did not meet after the mask was cleaned", tag, missing)


def agree(be: ReferenceBackend, error: PeerTimeoutError) -> list[int]:
    """The ranks the survivors of ``error``'s call agree have failed (see the module's docstring);
    re-raises ``error`` where the store is missing or no rank can be named."""
    transport = be.transport
    store = transport._store
    if store is None or getattr(error, "missing", None) is None:
        raise error
    base = f"epcomm/{transport.uid}/shrink/{error.seq}"
    decision = f"{base}/decision"
    expected = transport.expected()
    latest = f"epcomm/{transport.uid}/shrink/latest"
    if store.check([latest]):  # a rank that completed a call its peers gave up on learns it here
        seq, failed = json.loads(store.get(latest))
        if seq not in be.decisions_seen and be.rank in failed:
            be.decisions_seen.add(seq)
            return failed
    # A peer lost at once (an exit resets its connections) leaves the ranks that have not reached the
    # call yet unknown: they are suspects only once the exchange's own timeout has passed.
    missing = error.missing
    while missing and time.monotonic() < error.deadline and not store.check([decision]):
        time.sleep(0.01)
        missing = transport.missing_ranks(error.seq)
    store.set(f"{base}/view/{be.rank}", json.dumps(sorted(missing)))
    deadline = time.monotonic() + transport.timeout_s
    pause = 1e-4
    while not store.check([decision]):
        views = {r: json.loads(store.get(f"{base}/view/{r}")) for r in expected
                 if store.check([f"{base}/view/{r}"])}
        suspects = {s for view in views.values() for s in view}
        waiting = [r for r in expected if r not in views and r not in suspects]
        if not waiting or time.monotonic() > deadline:
            store.compare_set(decision, "", json.dumps([r for r in expected if r not in views]))
            break
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    failed = json.loads(store.get(decision))
    be.decisions_seen.add(error.seq)
    if failed:
        store.set(latest, json.dumps([error.seq, failed]))
    if not failed:  # every rank is still there: nothing to mask, the failure stands
        raise error
    return failed


def run_masked(be: ReferenceBackend, op: str, call: Callable[[list[int]], object]):
    """``call(masked ranks)``; on a peer's failure, agree on the failed ranks, mask them and call
    again (each round masks at least one more rank, so this ends)."""
    while True:
        try:
            return call(follow_mask(be, op))
        except PeerTimeoutError as error:
            be.drop_scratch()  # the abandoned exchange keeps its memory
            mask_failed(be, op, agree(be, error))


def mask_failed(be: ReferenceBackend, op: str, failed: list[int]) -> None:
    """Mask the ``failed`` ranks the survivors agreed on; raise where this rank is one of them."""
    be.mask[torch.tensor(failed, dtype=torch.long, device=be.mask.device)] = 1
    if be.rank in failed:
        raise RuntimeError(f"epcomm {op}: rank {be.rank} is masked as failed (its peers gave up on it past the "
                           "timeout); it takes no part in normal-mode calls until the mask is cleaned on every "
                           "rank") from None


def mask_routing(be: ReferenceBackend, masked: list[int], num_experts: int, num_tokens_per_rank, is_token_in_rank,
                 num_tokens_per_expert):
    """A fresh dispatch's routing without the masked ranks (their top-k entries dropped as if -1):
    (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert)."""
    keep = torch.ones(be.num_ranks, dtype=torch.bool, device=is_token_in_rank.device)
    keep[masked] = False
    is_token_in_rank = is_token_in_rank & keep
    num_tokens_per_rank = is_token_in_rank.sum(0).to(num_tokens_per_rank.dtype)
    if num_tokens_per_expert is not None:
        per_expert_keep = keep.repeat_interleave(num_experts // be.num_ranks).to(num_tokens_per_expert.device)
        num_tokens_per_expert = num_tokens_per_expert * per_expert_keep
    return num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert
