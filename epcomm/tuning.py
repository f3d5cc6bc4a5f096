"""Measured constants and the automatic rules built on them: every tuned choice of the host side.

Each constant carries one line on why it has its value. The measurements behind them (machine,
commit, figures) are in docs/TUNING.md; the backends import their constants from here.
"""

from __future__ import annotations

# ---------------------------------------------------------------- normal mode inside one NVLink domain
# Row slots start on 128-byte boundaries: NVLink moves all-to-all stores faster into aligned slots.
ROW_ALIGN = 128

# Bytes a reducing SM sums per byte a sending SM stores into a peer in the same time (combine):
# stores over NVLink are slower than local sums, so senders get more SMs.
COMBINE_REDUCE_PER_SEND = 1.43

# A receiving SM's time per byte of an FP8 row against a sending SM's (dispatch, 3 or more ranks):
# half a BF16 row's bytes, but the per-row work (index, top-k entries, scales) stays.
FP8_RECEIVE_PER_SEND = 1.5
# At 2 ranks the two rates measured equal, as for BF16.
FP8_RECEIVE_PER_SEND_TWO_RANKS = 1.0

# The senders' share of a BF16 dispatch that reads its counts on the host (its send kernel runs
# alone until the receive kernel is launched), where measured; other rank counts take the bytes' rule.
SPLIT_DISPATCH_SHARE = {2: 3 / 8, 4: 2 / 5}


def send_share(work: str, num_ranks: int) -> float:
    """The share of a call's SMs that send when EPCOMM_*_SEND_SMS_PCT is auto: both roles busy for
    the same time. Per byte that a rank receives in dispatch (or sends back in combine), with R ranks:

        work            senders move                   receivers / reducers move   share (equal rates)
        dispatch        (R-1)/R                        1 (own rows from x)         (R-1) / (2R-1)
        dispatch_fp8    as dispatch, but a receiver's byte weighs FP8_RECEIVE_PER_SEND against a
                        sender's from 3 ranks (1/3 at 4 ranks); at 2 ranks as dispatch
        dispatch_split  BF16 rows of a dispatch that reads its counts on the host (send and
                        receive kernels): SPLIT_DISPATCH_SHARE where measured, else as dispatch
        dispatch_own    1 (this rank's own rows too)   (R-1)/R                     R / (2R-1)
        combine         (R-1)/R (rows of other ranks)  1 (every row summed)        (R-1) / (2R-1)

    A dispatch's receivers copy this rank's own rows from x (`dispatch`), but a fused kernel's at
    1 or 2 ranks has its senders write them (`dispatch_own`; own_rows_by_receivers). Dispatch takes
    the rates as equal; in combine a sender's stores to a peer move slower than a reducer's local
    sums (COMBINE_REDUCE_PER_SEND), so senders get more. At one rank the side with nothing to move
    keeps one SM (send_blocks)."""
    if work == "dispatch":
        return (num_ranks - 1) / (2 * num_ranks - 1)
    if work == "dispatch_own":
        return num_ranks / (2 * num_ranks - 1)
    if work == "dispatch_split":
        return SPLIT_DISPATCH_SHARE.get(num_ranks, (num_ranks - 1) / (2 * num_ranks - 1))
    if work == "dispatch_fp8":
        sent = (num_ranks - 1) / num_ranks
        weight = FP8_RECEIVE_PER_SEND_TWO_RANKS if num_ranks <= 2 else FP8_RECEIVE_PER_SEND
        return sent / (sent + weight)
    if work == "combine":
        sent = (num_ranks - 1) / num_ranks * COMBINE_REDUCE_PER_SEND
        return sent / (sent + 1)
    raise ValueError(f"unknown work {work!r}")


def send_blocks(work: str, num_ranks: int, num_sms: int, pct: float | None = None) -> int:
    """The SMs of a call that send, at least one for each role: `pct` percent of num_sms when given
    (EPCOMM_{DISPATCH,COMBINE}_SEND_SMS_PCT), else send_share's share."""
    blocks = round(num_sms * (pct / 100 if pct is not None else send_share(work, num_ranks)))
    return min(max(1, blocks), max(1, num_sms - 1))


def own_rows_by_receivers(mode: int, num_ranks: int) -> bool:
    """Whether a dispatch's receivers copy this rank's own rows from x (``mode``: 0 the fused kernel,
    1 / 2 the send / receive half of a split). A split's receive half always does; the fused
    kernel above 2 ranks too, where every sender's store should cross a link. At 1 or 2 ranks the
    fused kernel's senders write them: half the rows are the rank's own and one link carries the rest."""
    return mode != 0 or num_ranks > 2


def dispatch_work(mode: int, num_ranks: int, fp8: bool) -> str:
    """The send_share work of a dispatch kernel (both halves of a split take the same count)."""
    if not own_rows_by_receivers(mode, num_ranks):
        return "dispatch_own"
    if fp8:
        return "dispatch_fp8"
    return "dispatch_split" if mode != 0 else "dispatch"


# ---------------------------------------------------------------- normal mode across domains
def hierarchical_roles(num_sms: int, num_domains: int, combine: bool, max_chunks: int,
                       max_forwarders: int) -> tuple[int, int]:
    """(chunks per region, forwarder blocks) of a hierarchical call on ``num_sms`` SMs. Dispatch: a
    block per chunk of each other domain's region sends and the other SMs forward, half the SMs
    to each role; combine: every SM forwards (and sends)."""
    others = max(1, num_domains - 1)
    chunks = max(1, min(max_chunks, num_sms // (2 * others)))
    senders = 0 if combine else (num_domains - 1) * chunks
    return chunks, max(1, min(max_forwarders, num_sms - senders))


# ---------------------------------------------------------------- low-latency mode
# EPCOMM_LL_COMBINE_PARTIALS=auto combines by partial sums from this num_max_dispatch_tokens_per_rank:
# the second exchange (requests, then partials) costs a few microseconds that fewer bytes repay from here.
PARTIALS_AUTO_MIN_TOKENS = 64


def partials_asked(mode: str, num_max_tokens: int) -> bool:
    """Whether EPCOMM_LL_COMBINE_PARTIALS (``mode``: auto, 0 or 1) asks for partial sums at this
    num_max_dispatch_tokens_per_rank (where the Buffer can and the shape allows: combine_by_partials)."""
    return mode == "1" or (mode == "auto" and num_max_tokens >= PARTIALS_AUTO_MIN_TOKENS)


def receive_together(mode: str, num_tokens: int, num_topk: int, num_experts: int) -> bool:
    """Whether a fused dispatch's blocks receive their (expert, source) units together (their warps
    share the rows' copies) rather than a group of warps per unit (EPCOMM_LL_BLOCK_RECEIVE). auto:
    at 2 or more pairs per expert, where the unit with the most rows would otherwise set the end;
    below it, waiting for all of a block's counts first costs more than a few rows' copies. Every
    source sends about T * K / E pairs to each unit."""
    if mode != "auto":
        return mode == "1"
    return num_tokens * num_topk >= 2 * num_experts


# The senders of a low-latency dispatch by arrival, unasked (EPCOMM_LL_DISPATCH_SENDERS auto), are
# chosen by the library (auto_senders, shared by its host and device code): 2/3 of the blocks up to
# that many tokens, beyond it the other third. See docs/TUNING.md.


# ---------------------------------------------------------------- portable path
# Up to this many ranks a group not on NCCL exchanges the handshake's headers through the process
# group's store (a set, and a read that waits for the peers' headers) rather than with a collective,
# which costs each rank several times the CPU there; the store's server answers every rank's read of
# every header (R^2 words a call), which bounds it.
STORE_HEADER_RANKS = 16
