// The low-latency slot protocol shared by dispatch and combine: finishing a kernel, acknowledging a
// slot (now or at the next call), the bounded waits for signals and acknowledgements, and the
// piecewise warp copy.
#pragma once

#include "../common/fp8.cuh"
#include "../layout/low_latency.cuh"

namespace epcomm {
namespace ll {

// The last block to finish (every block has read the counter and the slot's previous call by then)
// records this call as the slot's latest and as the rank's last, updates the slot's arrival key,
// and records whether the next call owes this one's acknowledgements (`owes_acks`: a call without
// a hook, see pay_owed_acks; this kernel's payer has paid the previous call's by then).
__device__ void finish_send_kernel(uint8_t* mine, int64_t seq, int slot, ArrivalKeyUpdate key_update,
                                   bool owes_acks) {
    __syncthreads();
    if (threadIdx.x == 0) {
        fence_gpu();  // the block's reads of the counter and the slot come before its arrival
        int* done = reinterpret_cast<int*>(mine + kDoneOffset);
        if (atomicAdd(done, 1) == static_cast<int>(gridDim.x) - 1) {
            *done = 0;
            *slot_seq(mine, slot) = seq;
            *counter(mine) = seq;
            int64_t* key = arrival_key_word(mine, slot);
            if (key_update.set)
                *key = key_update.key;
            else if (static_cast<uint32_t>(static_cast<uint64_t>(*key) >> 32) != key_update.area_tag)
                *key = 0;
            *reinterpret_cast<int*>(mine + kOwedAckOffset) = owes_acks ? slot + 1 : 0;
            fence_gpu();  // the next kernel on this GPU reads them
        }
    }
}

// The last block of a receive phase to finish (all reads of the slot are done) acknowledges the
// call to every rank, so their next sends into this slot may start: the receive of a call with a
// hook. A call without one (`deferred`: both phases in one launch or two launched together, every
// by-arrival path) acknowledges at its next call instead (pay_owed_acks).
// A GPU-scope fence, on purpose: an ack publishes no data a peer reads, it only says that this
// rank's loads of the slot are done. They are: each fed a store, an address or a branch issued
// before the block's barrier, and the count orders every barrier before the acks. That relies on
// the hardware, not the PTX model: a slot load not consumed before the barrier (a prefetch, an
// unawaited bulk copy) would need fence_sys back (docs/DESIGN.md, flow control).
__device__ void finish_recv_kernel(const Peers& peers, int num_ranks, int me, int slot, int64_t acks, int64_t seq,
                                   const int* mask, bool deferred) {
    if (deferred) return;
    __syncthreads();
    if (threadIdx.x == 0) {
        fence_gpu();  // the block's reads of the slot come before its arrival
        int* done = reinterpret_cast<int*>(peers.bufs[me] + kRecvDoneOffset) + slot;
        if (atomicAdd(done, 1) == static_cast<int>(gridDim.x) - 1) {
            *done = 0;
            fence_gpu();  // acquires every block's arrival (each fenced its reads first)
            for (int r = 0; r < num_ranks; ++r)  // not to masked ranks: they may be gone
                if (r == me || !masked(mask, r)) signal_peer(peers, me, r, acks + 8 * me, seq);
        }
    }
}

// Deferred acknowledgements: a call without a hook does not acknowledge its slot at its end; the
// first kernel of the buffer's next call does (every call's first kernel calls this). That kernel
// starts after this call's kernels ended (a buffer's calls are ordered on the GPU), so every load
// of the slot has returned and every store (the arrival area's poison too) has been performed: a
// stronger order than finish_recv_kernel's fences, at none of their cost. It cannot deadlock, as
// the payer pays before it waits for anything; block 0's first warp pays, which assumes block 0
// runs among the first where not all blocks are resident (docs/DESIGN.md, flow control).
// By lane r < R of the calling warp (the whole warp calls); lane 0 clears the word before its
// block arrives in finish_send_kernel, whose last block then sets it for this call.
static_assert(kMaxRanks <= kWarpSize, "pay_owed_acks signals a rank a lane");
__device__ __forceinline__ void pay_owed_acks(const Peers& peers, int num_ranks, int me, int64_t slot_bytes,
                                              const int* mask) {
    uint8_t* mine = peers.bufs[me];
    int* owed = reinterpret_cast<int*>(mine + kOwedAckOffset);
    const int64_t* slot_seqs = slot_seq(mine, 0);
    const int slot_plus_one = ld_volatile_int(owed), lane = static_cast<int>(threadIdx.x) % kWarpSize;
    const int64_t seqs[2] = {ld_volatile(slot_seqs), ld_volatile(slot_seqs + 1)};  // in flight together
    if (slot_plus_one == 0) return;
    const int slot = slot_plus_one - 1;
    const int64_t seq = seqs[slot];
    if (lane < num_ranks && (lane == me || !masked(mask, lane)))  // not to masked ranks: they may be gone
        signal_peer(peers, me, lane, slot_acks(slot, slot_bytes) + 8 * me, seq);
    __syncwarp();
    if (lane == 0) *owed = 0;
}

// Whether an earlier wait of this rank gave up (then so does this call: reported as abandoned).
__device__ __forceinline__ bool abandoned(int* info, int* gave_up, int op) {
    if (ld_volatile_int(gave_up) == 0) return false;
    record_error(info, kErrAbandoned, op, -1);
    return true;
}
// A wait for rank `src` timed out: with failed-rank masking src is masked from then on (not waited
// for again), else the timeout is reported, with the wait's phase, and this rank gives up (its
// other waits stop).
__device__ __forceinline__ void timed_out(int* info, int* gave_up, int op, int src, int* mask, int phase) {
    if (mask != nullptr) {
        atomicExch(mask + src, 1);
    } else {
        record_error(info, kErrTimeout, op, src, phase);
        give_up(gave_up);
    }
}

// Wait for a block's signal of call `seq`; returns its count, or -1 when the source was (or, on
// timeout with failed-rank masking, becomes) masked, or -2 on timeout without masking (reported).
// `acquire`: the signal releases data to read after it. Without (a dispatch by arrival's counts), a
// relaxed load: an acquire at system scope waits for this SM's stores in flight over NVLink to land,
// so the counts, sent before the data, would be read only after it (docs/TUNING.md). `phase`: the
// timeout's; kPhaseNone: a dispatch's wait receives, a combine's reduces.
__device__ int wait_signal(const int64_t* signal, int64_t seq, int tag, int src, int* mask, uint64_t timeout_ns,
                           int* info, int* gave_up, int op, uint64_t* waited_ns, bool acquire = true,
                           int phase = kPhaseNone) {
    const uint64_t start = global_timer_ns();
    int64_t v = 0;
    const WaitEnd end = bounded_wait<64>(
        start, timeout_ns,
        [&] {
            v = acquire ? ld_acquire_sys(signal) : ld_volatile(signal);
            return signal_of_call(v, seq);
        },
        [&] { return masked(mask, src) || abandoned(info, gave_up, op); });
    if (end == WaitEnd::kStopped) return masked(mask, src) ? -1 : -2;
    if (end == WaitEnd::kTimedOut) {
        if (phase == kPhaseNone) phase = op == kOpLowLatencyDispatch ? kPhaseReceive : kPhaseReduce;
        timed_out(info, gave_up, op, src, mask, phase);
        return mask != nullptr ? -1 : -2;
    }
    if (waited_ns != nullptr) *waited_ns = global_timer_ns() - start;
    if (((v >> kTagShift) & 0xff) != tag) {  // the source made a call of another shape
        record_error(info, kErrShapes, op, src);
        give_up(gave_up);  // signals it laid out elsewhere may never come: stop every wait
        return -2;
    }
    if (v & kInvalidInputBit)  // the source's inputs were refused (its signals say so)
        record_error(info, op == kOpLowLatencyDispatch ? kErrInvalidDispatch : kErrIdsDiffer, op, src);
    return static_cast<int>((v & kCountMask) - 1);
}

// Before writing into `dst`'s slot: wait until `dst` has acknowledged the previous call that used
// the slot (`prev`; 0 when none). False (the writes are skipped) when dst is masked or timed out.
__device__ bool wait_ack(const uint8_t* mine, int64_t acks, int dst, int64_t prev, int* mask, uint64_t timeout_ns,
                         int* info, int op) {
    int* gave_up = gave_up_word(const_cast<uint8_t*>(mine));
    if (prev <= 0) return true;
    const auto* ack = reinterpret_cast<const int64_t*>(mine + acks) + dst;
    const WaitEnd end = bounded_wait<64>(
        global_timer_ns(), timeout_ns, [&] { return ld_acquire_sys(ack) >= prev; },
        [&] { return masked(mask, dst) || abandoned(info, gave_up, op); });
    if (end == WaitEnd::kTimedOut) timed_out(info, gave_up, op, dst, mask, kPhaseSend);
    return end == WaitEnd::kReady;
}

// Whether this call may write into rank r's slot: neither rank masked, and r acknowledged the
// slot's previous call (wait_ack).
__device__ bool may_write_slot(const uint8_t* mine, int64_t acks, int me, int r, int64_t prev, int* mask,
                               uint64_t timeout_ns, int* info, int op) {
    return !masked(mask, me) && !masked(mask, r) && wait_ack(mine, acks, r, prev, mask, timeout_ns, info, op);
}

// One warp copies piece `piece` (kPieceInt4 16-byte words) of a `num_int4`-word message or row.
__device__ __forceinline__ void copy_piece(int4* dst, const int4* src, int num_int4, int piece, int lane) {
    const int begin = piece * kPieceInt4;
    warp_copy_int4<8>(dst + begin, src + begin, min(kPieceInt4, num_int4 - begin), lane);
}

__device__ __forceinline__ int num_pieces(int num_int4) { return (num_int4 + kPieceInt4 - 1) / kPieceInt4; }

}  // namespace ll
}  // namespace epcomm
