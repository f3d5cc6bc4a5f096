// The low-latency buffer: the header words, the slot layout, the signal word and the trace points.
// The protocol they serve is described in docs/DESIGN.md. Needs the transport's Net (transport/*.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "../common/protocol.cuh"

namespace epcomm {
namespace ll {

// Whether this library's transport reaches unmapped peers (the NVSHMEM one): its put paths compile in.
constexpr bool kNetReachesUnmapped = Net::kReach == Reach::kAnyPeer;

constexpr int kHeaderBytes = 64;
constexpr int kCounterOffset = 0;    // int64: the last call counter used by this rank
constexpr int kDoneOffset = 8;       // int32: blocks of the running send kernel that have finished
constexpr int kOwedAckOffset = 12;   // int32: 1 + the slot of the last call if its acknowledgements are
                                     // owed (a call without a hook: pay_owed_acks), else 0
constexpr int kRecvDoneOffset = 32;  // int32[2]: the same for the receive kernel of each slot (hooks may
                                     // run the receives of the two slots at once, on two streams)
constexpr int kSlotSeqOffset = 16;   // int64[2]: the call counter of the call that last used each slot
constexpr int kGaveUpOffset = 40;    // int32: set when a wait of this rank timed out (the others stop waiting);
                                     // in device memory: the waits poll it, and host memory is far
constexpr int kArrivalKeyOffset = 48;  // int64[2]: per slot, which arrival area is poisoned (arrival_key)
// A signal: [63:32] the call counter (its low 32 bits), [31:24] the call's shape tag, [23] invalid
// input, [22:0] count + 1. The shape tag (a hash of hidden, experts, N and the message format, made
// by the host) lets a receiver tell a peer that made a call of another shape: its rows would not
// fit this rank's layout, so the call is reported instead of returning garbage.
constexpr int kSeqShift = 32, kTagShift = 24;
// A sender whose inputs were invalid says so in every signal of the call, so that every rank reports
// it (and raises at the same call: a rank raising alone would leave its peers waiting for it).
constexpr int64_t kInvalidInputBit = 1LL << (kTagShift - 1);
constexpr int64_t kCountMask = kInvalidInputBit - 1;

// Built and compared as unsigned: the counter's bit 31 lands in the sign bit.
__device__ __forceinline__ int64_t make_signal(int64_t seq, int tag, int64_t invalid, int count) {
    const uint64_t bits = ((static_cast<uint64_t>(seq) & 0xffffffffull) << kSeqShift) |
                          (static_cast<uint64_t>(tag & 0xff) << kTagShift) | static_cast<uint64_t>(invalid) |
                          static_cast<uint64_t>(count + 1);
    return static_cast<int64_t>(bits);
}

__device__ __forceinline__ bool signal_of_call(int64_t v, int64_t seq) {
    return (static_cast<uint64_t>(v) >> kSeqShift) == (static_cast<uint64_t>(seq) & 0xffffffffull);
}
constexpr int kWarpsPerBlock = 16;             // send and combine-receive kernels: 512 threads
constexpr int kThreads = kWarpsPerBlock * kWarpSize;
// A combine's send by units one at a time (peers reached through Net, or beside the expert GEMM):
// a block of 256 threads per (local expert, source), two resident per SM at the kernel's registers.
constexpr int kUnitThreads = 8 * kWarpSize;
constexpr int kMaxFusedGroups = 8;             // warp groups of the fused dispatch's receive role (2 warps each)
constexpr int kMaxChunkEntries = 1024;         // (token, slot) pairs one block of a send or combine receive owns
constexpr int kMaxExperts = 4096;             // the send kernel counts pairs per expert in shared memory
constexpr int kPieceInt4 = 256;                // one warp copies a message or row in pieces of 4 KB (8 x 16 B a lane)

// A wait of this rank gave up (timeout or shape mismatch, recorded): every other wait stops too.
__device__ __forceinline__ void give_up(int* gave_up) {
    __threadfence_system();  // the recorded cause is visible before the mark
    atomicExch(gave_up, 1);
}

// Phase timeline of a call (tools/profile/ll_profile.py): with a trace array, thread 0 of every
// block stores the global timer at each point it passes, after the barrier that ends the phase (and,
// at kTraceSm, not a time: its SM). A call's send phase writes plane 0 (a dispatch's receive too
// when in the same launch), its receive phase plane 1. Off (null) in every normal call: one untaken branch per point.
constexpr int kTracePoints = 15, kTraceBlocks = 4096;
enum TracePoint {  // 0-9 in the order a block passes them; 10-13 break up the dispatch's send phases; 14 no time
    kTraceStart = 0,
    kTraceReady = 1,      // the slot's acknowledgements waited for (and, dispatch, the pairs counted)
    kTraceRows = 2,       // dispatch: the rows of the block's pairs are known and planned (the data is next)
    kTraceCast = 3,       // dispatch, thread 0 alone: its first unit's channels loaded and cast
    kTraceStored = 4,     // dispatch, thread 0 alone: its stores of them issued
    kTraceWritten = 5,    // the block's messages or rows are stored (dispatch: remote ones put too; a
                          // combine's puts to remote sources come after, before kTraceSignalled)
    kTraceSignalled = 6,  // the block's counts are signalled
    kTraceArrived = 7,    // the receive's (first) signals arrived (a combine by partial sums, thread 0:
                          // its first record of the first peer, which comes before its kTraceSignalled)
    kTraceReceived = 8,   // the receive's copies or sums are done
    kTraceEnd = 9,
    // dispatch send, between kTraceReady and kTraceCast (a barrier before the first while tracing):
    kTraceSignals = 10,   // the counts signalled early (by arrival) or the empty experts' signals issued
    kTracePairRows = 11,  // the rows of the block's pairs known (and the missing tokens' headers stored)
    // dispatch send, thread 0 alone, between kTraceRows and kTraceCast:
    kTraceEntered = 12,   // its first unit's loads of x about to issue
    kTraceLoaded = 13,    // and their values back
    // not a time: the SM the block ran on, plus one (stamped with kTraceStart by the dispatch send), to
    // tell whether the blocks that lag run on SMs of one part of the GPU
    kTraceSm = 14,
};

// Thread 0's cell of this block at `point` (nullptr: no trace, or not thread 0, or past the traced
// blocks: a longer grid stamps its first ones).
__device__ __forceinline__ int64_t* trace_cell(int64_t* trace, int plane, TracePoint point) {
    if (trace == nullptr || threadIdx.x != 0 || blockIdx.x >= kTraceBlocks) return nullptr;
    return trace + (static_cast<int64_t>(plane) * kTraceBlocks + blockIdx.x) * kTracePoints + point;
}
__device__ __forceinline__ void trace_point(int64_t* trace, int plane, TracePoint point) {
    if (int64_t* cell = trace_cell(trace, plane, point)) *cell = static_cast<int64_t>(global_timer_ns());
}
__device__ __forceinline__ void trace_sm(int64_t* trace, int plane) {
    if (int64_t* cell = trace_cell(trace, plane, kTraceSm)) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        *cell = sm + 1;
    }
}

struct Peers {
    uint8_t* bufs[kMaxRanks];  // each rank's buffer as mapped here; null: reached through Net (remote)
};

// Peer r is reached through Net (transport/transport.cuh) when it is not mapped here.
__device__ __forceinline__ bool is_remote(const Peers& peers, int r) { return kNetReachesUnmapped && peers.bufs[r] == nullptr; }

// Set rank r's copy of the signal word at `offset` of the buffer, after the caller's fence_sys: a
// strong store when r is mapped (fence then store: a release of the caller's writes and of what it
// observed), a signal operation when it is remote (the caller completed its puts with Net::quiet).
__device__ __forceinline__ void signal_peer(const Peers& peers, int me, int r, int64_t offset, int64_t value) {
    if (is_remote(peers, r))
        Net::signal(reinterpret_cast<int64_t*>(peers.bufs[me] + offset), value, r);
    else
        st_relaxed_sys(reinterpret_cast<int64_t*>(peers.bufs[r] + offset), value);
}

// Where a slot's acknowledgements are: its first bytes, whatever the call's shape.
__device__ __forceinline__ int64_t slot_acks(int slot, int64_t slot_bytes) { return kHeaderBytes + slot * slot_bytes; }

struct Layout {  // where things live inside one slot
    int64_t dispatch_signals, combine_signals, acks, data, combine_data;
    __device__ Layout(int slot, int64_t slot_bytes, int num_experts, int num_ranks, int num_max_tokens, int hidden) {
        const int64_t slot_base = slot_acks(slot, slot_bytes);
        acks = slot_base;  // first, at a place that does not depend on the call's shapes
        dispatch_signals = acks + (num_ranks * 8 + 15) / 16 * 16;
        combine_signals = dispatch_signals + num_experts * 8;
        data = combine_signals + num_experts * 8;
        // The dispatch area: what a message per (expert, row) would take at 2H + 16 bytes (the size
        // hint's message), of which the messages [R][N] and the index [E_local][R][N] take a part.
        combine_data = data + static_cast<int64_t>(num_experts) * num_max_tokens * (hidden * 2 + 16);
        // The combine area's rows start on a 128-byte line (buffers are 256-byte aligned) where the
        // slot has room for the rounding (every rank has the same slot_bytes, which slot 1's place
        // already assumes): rows of whole lines go over NVLink without partial ones at their ends.
        const int64_t aligned = (combine_data + 127) / 128 * 128;
        if (aligned + static_cast<int64_t>(num_experts) * num_max_tokens * hidden * 2 <= slot_base + slot_bytes)
            combine_data = aligned;
    }
};

// Failed-rank masking: rank r is masked (treated as gone) when mask[r] != 0.
__device__ __forceinline__ bool masked(const int* mask, int r) {
    return mask != nullptr && ld_volatile_int(mask + r) != 0;
}

__device__ __forceinline__ int64_t* counter(uint8_t* buf) { return reinterpret_cast<int64_t*>(buf + kCounterOffset); }
__device__ __forceinline__ int* gave_up_word(uint8_t* buf) { return reinterpret_cast<int*>(buf + kGaveUpOffset); }
// The call counter of the call that last used a slot (its receive phase reads it; a send waits on its acks).
__device__ __forceinline__ int64_t* slot_seq(uint8_t* buf, int slot) {
    return reinterpret_cast<int64_t*>(buf + kSlotSeqOffset) + slot;
}

// The call counter of a send kernel: every block reads the same value (the previous call's,
// written by that call's last block), uses one more, and the last block of this call stores it.
__device__ __forceinline__ int64_t next_seq(uint8_t* mine) { return ld_volatile(counter(mine)) + 1; }

// The arrival key of a slot (header word kArrivalKeyOffset + 8 slot): nonzero when this rank's
// arrival area of that key (a dispatch's shape, arrival_key in the call record: the area's shape tag
// in the high 32 bits, its message bytes in the low ones) holds poison wherever a payload word can
// land, as a dispatch by arrival needs (receive_dispatch_arrival). Every call that uses the slot
// updates it the same way on every rank (every rank makes the same calls), so the ranks agree on
// it without a word exchanged, in CUDA-graph replays too.
__device__ __forceinline__ int64_t* arrival_key_word(uint8_t* buf, int slot) {
    return reinterpret_cast<int64_t*>(buf + kArrivalKeyOffset) + slot;
}

// What a call does to its slot's arrival key (finish_send_kernel): a dispatch sets it (the key its
// area keeps after it: arrival_key_after); a combine keeps it where its shape has the same area
// (`area_tag`: its stores stay out of that dispatch area), else clears it.
struct ArrivalKeyUpdate {
    bool set;
    int64_t key;
    uint32_t area_tag;
};

}  // namespace ll
}  // namespace epcomm
