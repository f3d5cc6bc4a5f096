// Low-latency (decode) kernels. A peer whose buffer is mapped into this process (CUDA IPC, or an
// NVSHMEM symmetric heap reachable over NVLink) gets each token's message (one per (token, rank))
// and its pairs' index entries stored straight into its buffer; a peer that is not (another node,
// or one the EPCOMM_LL_REMOTE_RANKS switch treats as remote) gets them by NVSHMEM puts from a
// staging copy, and its signals by NVSHMEM signal operations. The transport is the class ll::Net,
// defined by the file that includes this one: kernels/low_latency.cu (direct stores only, the IPC
// library) and nvshmem/low_latency.cu (the NVSHMEM library, relocatable device code). A remote peer
// is one whose entry in the peer table is null; receivers always read their own buffer, so only the
// sending side differs.
//
// With the receive hook a call is two kernels, so that no SM is held while data is in flight:
//   send: block b owns a contiguous range of this rank's tokens (or, in a dispatch by arrival with
//         fewer senders than tokens, every n-th token: send_plan). Every block counts, in shared
//         memory, the (token, top-k slot) pairs of each expert (all of them, and those before each
//         of its tokens), which gives each of its pairs the row it takes in the expert's block without any
//         inter-block traffic: rows follow ascending (token, slot), so outputs are deterministic and
//         equal to the reference backend's. One thread per pair plans its message and stores its
//         index entry (plan_message); each warp then loads 512 channels of a token once, casts
//         them (FP8 per 128 channels) once, and stores them into the token's message at each of
//         its ranks (with fewer tokens than blocks, a token's 512-channel units are split among
//         several blocks of the fused kernel). A per-expert counter of written pairs names the
//         last writer, which stores the block's count (+ the call counter) with one release: the
//         receiver's signal.
//   recv: one block per (local expert, source): waits for the counts of the sources up to its own
//         (the packed layout puts sources in rank order), then copies its rows out of the messages
//         their index entries name; the last source's block writes recv_count and layout_range.
// Combine mirrors it: a block per (local expert, source) returns the rows to the source, and the
// receive kernel sums, per token, weight * row over its top-k slots in slot order, in fp32 (the
// reference's order), with warps splitting the hidden dimension.
// Without a hook a dispatch is one cooperative kernel (dispatch_fused: the send role, then the
// receive role's units taken in turn by the same blocks): one launch less, which is what an eager
// call's host time is made of; a replayed graph gains little (measured on 2 H200: 40.8 vs 41.4 us).
// So is a combine whose peers are all mapped (combine_fused: each block returns its units' rows,
// its warps sharing them, then sums its tokens).
//
// Buffer layout: [header 64 bytes | slot 0 | slot 1] (16-byte aligned throughout, so that it fits in
// Buffer.get_low_latency_rdma_size_hint); each low-latency call uses the slot the Buffer assigns
// (double buffering). In a slot: acks int64[R] (first: their place must not depend on the call's
// shapes), dispatch signals int64[E], combine signals int64[E], the dispatch area (sized for a
// BF16 message per (expert, row), of which the messages [R][N] and the index [E_local][R][N] of
// int32 take part: plan_message; after them, on a 128-byte line, the arrival area [R][N] of a
// dispatch by arrival), then the combine area [E][N] rows.
// Flow control: when a rank is done reading a slot it writes the call counter into ack[slot][rank]
// of every peer: a call with a hook at the end of its receive kernel (its last block), a call
// without one at the start of the buffer's next call (pay_owed_acks); a send kernel writes into a
// peer's slot only once that peer has acknowledged the previous call that used the slot (ranks
// drift apart when hooks are called late, and the next call but one reuses the slot).
// Separate areas matter when a dispatch and a combine share a slot (two micro-batches in flight):
// a fast peer's combine then writes while this rank may still be copying the dispatch out.
// Signals hold the call counter, the call's shape tag and the count (make_signal): counters only
// grow and are the same on every rank (every rank makes the same calls), so signals never need
// resetting, CUDA-graph replays too.
// Staging for remote peers reuses areas of this rank's own slot that no peer writes during the
// call (peers write into a slot only after this rank acknowledged the slot's previous call, which
// it does after its receive, after its puts were completed by a quiet, or later still: at the start
// of its next call, where the call had no hook): a dispatch stages each
// token's message once, and its pairs' index entries, in its own combine area, a combine stages
// the rows for a source in its own dispatch area.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "../../include/epcomm/call_record.cuh"
#include "../../include/epcomm/common.cuh"

namespace epcomm {
namespace ll {

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
constexpr int kUnitWarps = 8;                  // the per-(expert, source) kernels: 256 threads
// Their blocks resident per SM. They launch one block per (local expert, source): E blocks, 288 in
// the benchmark's setting. Left free, nvcc gives them 104-126 registers a thread, which fits 2
// blocks per SM: 264 on 132 SMs, so the last 24 blocks run as a second wave, adding a block's whole
// latency (wait, copy, fence, signal) to the kernel. The IPC build fits 3 blocks (80 registers, no
// spills in ptxas -v): 396. The NVSHMEM build's put paths need more registers: at 80 they spill
// (40 / 24 bytes in combine_send / dispatch_recv), so it keeps 2 until the two are measured.
constexpr int kUnitBlocksPerSm = Net::kRemote ? 2 : 3;
constexpr int kUnitThreads = kUnitWarps * kWarpSize;
constexpr int kMaxFusedGroups = 8;             // warp groups of the fused dispatch's receive role (2 warps each)
constexpr int kMaxChunkEntries = 1024;         // (token, slot) pairs one block of a send or combine receive owns
constexpr int kMaxExperts = 4096;             // the send kernel counts pairs per expert in shared memory
constexpr int kPieceInt4 = 256;                // one warp copies a message or row in pieces of 4 KB (8 x 16 B a lane)

// Pinned host words, as in the normal-mode kernels (the Python side reads them).
constexpr int kInfoError = 0, kInfoErrorOp = 1, kInfoErrorRanks = 2;
constexpr int kErrTimeout = 1, kErrInvalidDispatch = 7, kErrIdsDiffer = 8, kErrShapeMismatch = 9, kErrAbandoned = 10;

// Record an error of this call (pinned host memory, read by the host after the call). The most
// severe one wins: a peer's timeout or shape mismatch (names the cause) over "abandoned" (this
// call stopped because another wait gave up) over the caller's input errors, which leave the
// Buffer usable (the host must not take a fatal call for a refused one). A wait that gives up
// records its error before it raises gave_up (with a fence between), so the waits that abandon
// because of it see the cause already recorded and do not cover it.
__device__ __forceinline__ int error_severity(int code) {
    if (code == 0) return 0;
    if (code == kErrInvalidDispatch || code == kErrIdsDiffer) return 1;
    return code == kErrAbandoned ? 2 : 3;
}

__device__ __forceinline__ void record_error(int* info, int code, int op, int rank) {
    if (rank >= 0) info[kInfoErrorRanks + rank] = 1;
    if (error_severity(code) > error_severity(ld_volatile_int(info + kInfoError))) {
        info[kInfoErrorOp] = op;
        info[kInfoError] = code;
    }
}

// A wait of this rank gave up (timeout or shape mismatch, recorded): every other wait stops too.
__device__ __forceinline__ void give_up(int* gave_up) {
    __threadfence_system();  // the recorded cause is visible before the mark
    atomicExch(gave_up, 1);
}
constexpr int kOpDispatch = 5, kOpCombine = 6;

// Phase timeline of a call (scripts/ll_profile.py): with a trace array, thread 0 of every block
// stores the global timer at each point it passes, after the barrier that ends the phase (and,
// at kTraceSm, not a time: its SM). A
// call's two kernels write planes 0 (send; the whole fused dispatch) and 1 (receive). Off (null)
// in every normal call: one untaken branch per point.
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

// Net (defined by the including file) carries data and signals to remote peers:
//   kRemote                                   whether it can (false: every peer is mapped)
//   put_warp / put_block(dst, src, bytes, pe) non-blocking copy of local `src` to `pe`'s copy of the
//                                             symmetric address `dst` (this rank's own), by a warp / block
//   signal(addr, value, pe)                   set `pe`'s copy of the 8-byte word `addr`, after every put
//                                             of this rank to `pe` that quiet() completed
//   quiet()                                   complete every put this rank issued
__device__ __forceinline__ bool is_remote(const Peers& peers, int r) { return Net::kRemote && peers.bufs[r] == nullptr; }

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
            reinterpret_cast<int64_t*>(mine + kSlotSeqOffset)[slot] = seq;
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

// The last block of a receive kernel to finish (all reads of the slot are done) acknowledges the
// call to every rank, so their next sends into this slot may start: the receive of a call with a
// hook. A call without one (`deferred`: the fused kernels, or send and receive kernels launched
// together) acknowledges nothing here: its next call does (pay_owed_acks), so what follows is about
// hook receives alone; the by-arrival paths (fused only) always defer.
// A GPU-scope fence, on purpose: an ack publishes no data that a peer reads (every path was
// checked: the receives only read their own slot; the self-ack is read on this GPU; Net::signal
// acks carry nothing), it tells a peer that this rank's loads of the slot are done, so that the
// peer may overwrite it. (A dispatch by arrival stores the poison back into its own arrival area,
// and a peer's next payload must land after it: with a GPU-scope fence that held on the hardware,
// not by the PTX model; it is deferred now, where the kernel's end orders it.) The loads are done
// because every one of them fed a store, an address or a branch issued before the
// block's barrier, so it has returned its value; the count orders every block's barrier
// before the acks. This relies on that hardware behaviour, not on the PTX model (a gpu-scope fence
// does not synchronize with a peer's ld.acquire.sys): a slot load added later whose value is not
// consumed before the barrier (a prefetch, an unawaited bulk copy) would need the fence_sys back.
// The fence_sys also waited for the receive's output stores to reach system scope, which no peer
// reads: at EP4, 128 tokens (4 x H100, 7459464) the last block ended 1.3 us (dispatch) and 2.4 us
// (combine) earlier without it, a graph step 67.4 -> 64.6 us (timings of the fused kernels,
// before they deferred their acknowledgements).
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

// Deferred acknowledgements. A call without a hook (phase 0: the fused kernel, or its send and
// receive kernels one after the other) does not acknowledge its slot at its end: the first kernel
// of the buffer's next call does (every call's first kernel calls this). That kernel starts after
// this call's kernels have ended (calls of a buffer are ordered on the GPU: the call counters
// already rely on it), so every load of the slot has returned and every store of the call (the
// arrival area's poison among them) has been performed: a stronger order than the fences of
// finish_recv_kernel, for none of their cost.
// Who waits longer: a peer's call that reuses the slot now waits for this rank's next call to
// start, not for this one to end. With alternating slots that next call starts before the slot's
// next user, so nobody waits; a captured graph of one call replayed (one slot, every replay) makes
// a peer's next replay wait for this rank's next replay to start, where it also waits for its data.
// Nor can it deadlock, where the payer pays before it waits for anything: a call waits for the acks
// of the slot's previous call, two calls before it (paid by the peers' previous calls), or one
// before it in that graph (paid by the peers' payers of this call, which wait for nothing first).
// Block 0's first warp pays: where a kernel's blocks are not all resident at once (a non-cooperative
// combine_send with more units than fit), this assumes block 0 is among the first to run, as the
// hardware schedules blocks in index order (the CUDA model does not promise it; a kernel of more
// blocks than fit whose first blocks wait for a peer's payer could otherwise stall until the
// timeout). The payer loads the words beside the counters its kernel reads first (a line of the
// buffer's header) and the mask; every other block goes on at once. The end of the call
// saves a barrier, a fence and an atomic per block, and the last block's stores to every peer,
// which the kernel's end waits for (EP4, 128 tokens, 4 x H100: a probe without the finish,
// c755d5f, took the dispatch kernel from 20.6 to 19.3 us; deferring them gave the dispatch
// 25.0-26.2 us eager against 26.0-27.2 in the same calls). A call with a hook acknowledges at the
// end of its receive, as before: the hook may run after later calls.
// By lane r < R of the calling warp (the whole warp calls); lane 0 clears the word before its
// block arrives in finish_send_kernel, whose last block then sets it for this call.
static_assert(kMaxRanks <= kWarpSize, "pay_owed_acks signals a rank a lane");
__device__ __forceinline__ void pay_owed_acks(const Peers& peers, int num_ranks, int me, int64_t slot_bytes,
                                              const int* mask) {
    uint8_t* mine = peers.bufs[me];
    int* owed = reinterpret_cast<int*>(mine + kOwedAckOffset);
    const auto* slot_seqs = reinterpret_cast<const int64_t*>(mine + kSlotSeqOffset);
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

// The checks every bounded wait makes now and then, beside its own. Whether an earlier wait of this
// rank gave up (then so does this call: reported as abandoned).
__device__ __forceinline__ bool abandoned(int* info, int* gave_up, int op) {
    if (ld_volatile_int(gave_up) == 0) return false;
    record_error(info, kErrAbandoned, op, -1);
    return true;
}
// Whether `timeout_ns` have passed since `start` waiting for rank `src`: with failed-rank masking
// src is masked from then on (not waited for again), else the timeout is reported and this rank
// gives up (its other waits stop).
__device__ __forceinline__ bool past_deadline(int* info, int* gave_up, int op, int src, int* mask, uint64_t start,
                                              uint64_t timeout_ns) {
    if (global_timer_ns() - start <= timeout_ns) return false;
    if (mask != nullptr) {
        atomicExch(mask + src, 1);
    } else {
        record_error(info, kErrTimeout, op, src);
        give_up(gave_up);
    }
    return true;
}

// Wait for a block's signal of call `seq`; returns its count, or -1 when the source was (or, on
// timeout with failed-rank masking, becomes) masked, or -2 on timeout without masking (reported).
// `acquire`: the signal releases data to read after it. Without (a dispatch by arrival's counts), a
// relaxed load: an acquire at system scope waits for this SM's stores in flight over NVLink to land
// (the counts, sent before the data, read as arriving at 15.3 us of a 20.5 us dispatch, EP4, 128
// tokens, 4 x H100, cdab994).
__device__ int wait_signal(const int64_t* signal, int64_t seq, int tag, int src, int* mask, uint64_t timeout_ns,
                           int* info, int* gave_up, int op, uint64_t* waited_ns, bool acquire = true) {
    const uint64_t start = global_timer_ns();
    for (int spin = 0;; ++spin) {
        const int64_t v = acquire ? ld_acquire_sys(signal) : ld_volatile(signal);
        if (signal_of_call(v, seq)) {
            if (waited_ns != nullptr) *waited_ns = global_timer_ns() - start;
            if (((v >> kTagShift) & 0xff) != tag) {  // the source made a call of another shape
                record_error(info, kErrShapeMismatch, op, src);
                give_up(gave_up);  // signals it laid out elsewhere may never come: stop every wait
                return -2;
            }
            if (v & kInvalidInputBit)  // the source's inputs were refused (its signals say so)
                record_error(info, op == kOpDispatch ? kErrInvalidDispatch : kErrIdsDiffer, op, src);
            return static_cast<int>((v & kCountMask) - 1);
        }
        if ((spin & 63) == 63) {
            if (masked(mask, src)) return -1;
            if (abandoned(info, gave_up, op)) return -2;
            if (past_deadline(info, gave_up, op, src, mask, start, timeout_ns)) return mask != nullptr ? -1 : -2;
        }
    }
}

// Before writing into `dst`'s slot: wait until `dst` has acknowledged the previous call that used
// the slot (`prev`; 0 when none). False (the writes are skipped) when dst is masked or timed out.
__device__ bool wait_ack(const uint8_t* mine, int64_t acks, int dst, int64_t prev, int* mask, uint64_t timeout_ns,
                         int* info, int op) {
    int* gave_up = gave_up_word(const_cast<uint8_t*>(mine));
    if (prev <= 0) return true;
    const auto* ack = reinterpret_cast<const int64_t*>(mine + acks) + dst;
    const uint64_t start = global_timer_ns();
    for (int spin = 0;; ++spin) {
        if (ld_acquire_sys(ack) >= prev) return true;
        if ((spin & 63) == 63 &&
            (masked(mask, dst) || abandoned(info, gave_up, op) ||
             past_deadline(info, gave_up, op, dst, mask, start, timeout_ns)))
            return false;
    }
}

// Whether this call may write into rank r's slot: neither rank masked, and r acknowledged the
// slot's previous call (wait_ack).
__device__ bool may_write_slot(const uint8_t* mine, int64_t acks, int me, int r, int64_t prev, int* mask,
                               uint64_t timeout_ns, int* info, int op) {
    return !masked(mask, me) && !masked(mask, r) && wait_ack(mine, acks, r, prev, mask, timeout_ns, info, op);
}

// ------------------------------------------------------------------ FP8 cast (the rule of epcomm/fp8.py)
struct CastMode {
    bool fp8, round_scale, ue8m0;
};

// 8 bf16 channels of one lane, cast as members of a 128-channel group spread over 16 lanes
// (lanes 0-15 or 16-31 of the warp). Returns the group's scale (fp32 bits, or its UE8M0 exponent).
__device__ __forceinline__ uint2 cast_fp8x8(const int4& raw, bool valid, const CastMode& mode, float& scale_out) {
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
    float v[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 f = __bfloat1622float2(h[k]);
        v[2 * k] = f.x;
        v[2 * k + 1] = f.y;
    }
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(v[k]));
    if (!valid) amax = 0.f;
#pragma unroll
    for (int off = 8; off >= 1; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
    amax = fmaxf(amax, 1e-4f);
    float scale = __fmul_rn(amax, static_cast<float>(1.0 / 448.0));
    float inv;
    if (mode.round_scale) {  // smallest power of two >= scale; its inverse is exact
        const int bits = __float_as_int(scale);
        const int exponent = ((bits >> 23) & 0xff) + ((bits & 0x7fffff) != 0 ? 1 : 0);
        scale = __int_as_float(exponent << 23);
        inv = __fdiv_rn(1.0f, scale);
    } else {
        inv = __fdiv_rn(448.0f, amax);
    }
    scale_out = scale;
    uint2 out;
    auto* q = reinterpret_cast<__nv_fp8x2_storage_t*>(&out);
#pragma unroll
    for (int k = 0; k < 4; ++k)
        q[k] = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(v[2 * k], inv), __fmul_rn(v[2 * k + 1], inv)),
                                        __NV_SATFINITE, __NV_E4M3);
    return out;
}

// One warp copies piece `piece` (kPieceInt4 16-byte words) of a `num_int4`-word message or row.
__device__ __forceinline__ void copy_piece(int4* dst, const int4* src, int num_int4, int piece, int lane) {
    const int begin = piece * kPieceInt4;
    warp_copy_int4<8>(dst + begin, src + begin, min(kPieceInt4, num_int4 - begin), lane);
}

__device__ __forceinline__ int num_pieces(int num_int4) { return (num_int4 + kPieceInt4 - 1) / kPieceInt4; }

// ------------------------------------------------------------------ dispatch
struct DispatchArgs {
    Peers peers;
    int rank, num_ranks, num_tokens, hidden, num_topk, num_experts, num_max_tokens;
    const __nv_bfloat16* x;   // [T, H]
    const int64_t* topk_idx;  // [T, K]
    CastMode mode;
    int data_bytes, msg_bytes;  // message: data | scales | padding to message_align
    int message_align;          // 128 where the dispatch area has room (messages_base), else 16
    int num_scale_cols;         // scale words (4 bytes) of a message
    int slot;
    int64_t slot_bytes;
    int chunk_tokens;         // tokens per block of the send kernel
    int send_blocks;          // by arrival: blocks that send (send_plan; 0: its own choice)
    int shape_tag;            // 8-bit hash of the call's shape (every rank must make the same)
    int* sent_pairs;          // [E] written pairs per expert of the running send (0 between calls)
    int* mask;                // [R] int32, or nullptr (no failed-rank masking)
    int* slot_map;            // [T, K] out: the row of (t, k) in its block, -1 when not sent
    int64_t* topk_copy;       // [T, K] out: topk_idx as sent (the handle's: combine uses and checks it)
    // receive side
    uint8_t* recv_data;       // [E_local, N*R, data_bytes]
    uint8_t* recv_scales;     // [E_local, N*R, S] with the strides below (elements of 4 bytes)
    int64_t scale_stride_e, scale_stride_row, scale_stride_col;
    int* src_info;            // [E_local, N*R]
    int* recv_count;          // [E_local]
    int64_t* layout_range;    // [E_local, R]
    int* cumulative_stats;    // [E_local] or nullptr
    int64_t* wait_stats;      // [R] or nullptr
    int* info;
    uint64_t timeout_ns;
    int64_t* trace;           // [2, kTraceBlocks, kTracePoints] phase timeline, or nullptr
    // by arrival (ArrivalMode): whether this launch may (the fused kernel; FP8 with fp32 scales, IPC,
    // no masking: the host's choice), an arrival message's bytes and the shape's arrival key
    int arrival, arrival_msg_bytes;
    int64_t arrival_key;
    bool defer_acks;          // a call without a hook: its next call acknowledges it (pay_owed_acks)
};

// ------------------------------------------------------------------ dispatch by arrival
// A fused dispatch whose signals wait for its data waits for every NVLink store of the GPU: a
// fence_sys issued while stores are in flight completes only when all of them have landed (EP4,
// 128 tokens, 4 x H100: every block's signal left at 15.6 us, its own stores issued by 7.6 us
// median), so the receivers could only start copying then (17.1 us) and ended ~4 us later. By
// arrival, the receivers tell data from what was there before by its bits instead, and copy each
// piece as it lands, while the rest is in flight:
// * messages go to an area of their own (arrival_base: in the dispatch area, after the messages
//   and index of the counted path), [R][N] of arrival_msg_bytes: a header of K tagged words (per
//   top-k slot: its local expert and row at this rank, or none; every token t < N gets one at every
//   rank, so the receiver knows which messages come), then the FP8 data and the fp32 scales;
// * a payload word not yet written holds the poison 0xffffffff: no FP8 data word is four 0xff
//   bytes (0xff is e4m3's negative NaN, which the satfinite cast never makes; send_unit replaces it
//   all the same) and no fp32 scale is a negative NaN (the scale is a positive max);
// * the counts need no data before them: every block knows every expert's count once it has
//   counted the pairs, so they leave at once, with one relaxed store each;
// * each payload word has one reader (a warp per part of a message copies it into every row its
//   header names), which stores the poison back once it has copied it, before the acknowledgement
//   that lets the slot's next call write there.
// The area holds the poison from the first call of its shape on: the slot's arrival key says
// whether it does (arrival_key_word); a call that finds it unset runs the counted path and poisons
// the area at the end of its receive. Its signals flip the shape tag's top bit, so a rank that
// went the other way (a cooperative launch refused on one rank only) is reported as a call of
// another shape, not waited for.
constexpr int kArrivalHeaderBytes = 128;  // K <= 16 tagged words, then the payload on a 128-byte line
constexpr uint32_t kPoison = 0xffffffffu;
constexpr uint32_t kNoDestination = 0xffffffffu;  // a header word's entry for a slot not at this rank
constexpr int kArrivalPerLane = 4;        // 16-byte words a lane holds of its part of a message
constexpr int kArrivalMaxParts = 8;

struct ArrivalMode {
    bool on;      // this call goes by arrival
    bool poison;  // it may but the area is not poisoned yet: the counted path, then poison the area
    int64_t base;  // the arrival area's offset in the buffer
    int tag;       // the signals' shape tag
    ArrivalKeyUpdate key_update;
    bool remote_peers;  // some peer is reached through Net (no arrival; send_plan needs it too)
};


// Where source src's message for token t lies in a buffer's arrival area (offset in the buffer).
__device__ __forceinline__ int64_t arrival_message_at(const DispatchArgs& a, const ArrivalMode& m, int src, int t) {
    return m.base + (static_cast<int64_t>(src) * a.num_max_tokens + t) * a.arrival_msg_bytes;
}
__device__ __forceinline__ uint8_t* arrival_message(const DispatchArgs& a, const ArrivalMode& m, uint8_t* buf, int src,
                                                    int t) {
    return buf + arrival_message_at(a, m, src, t);
}

// A 64-bit word tagged with a call: the call counter's low 32 bits above a 32-bit value (the
// arrival headers, the combine's request records). A word that shows a call's counter holds that
// call's value.
__device__ __forceinline__ uint64_t tagged(uint32_t value, int64_t seq) {
    return static_cast<uint64_t>(static_cast<uint32_t>(seq)) << 32 | value;
}
__device__ __forceinline__ bool tag_of_call(uint64_t word, int64_t seq) {
    return static_cast<uint32_t>(word >> 32) == static_cast<uint32_t>(seq);
}

// A message's header at a rank: word k is slot k's entry (`entry(k)`: local expert << 16 | row, or
// kNoDestination) beside the call counter, in 16-byte stores of two words each (weak stores: each
// aligned 8-byte word lands whole, and a strong system-scope store costs more to issue).
template <class Entry>
__device__ __forceinline__ void store_arrival_header_words(uint8_t* msg, const Entry& entry, int k, int num_topk,
                                                           int64_t seq) {
    const uint64_t w0 = tagged(entry(k), seq), w1 = tagged(k + 1 < num_topk ? entry(k + 1) : kNoDestination, seq);
    *reinterpret_cast<ulonglong2*>(reinterpret_cast<uint64_t*>(msg) + k) = make_ulonglong2(w0, w1);
}
template <class Entry>
__device__ __forceinline__ void store_arrival_header(uint8_t* msg, const Entry& entry, int num_topk, int64_t seq) {
    for (int k = 0; k < num_topk; k += 2) store_arrival_header_words(msg, entry, k, num_topk, seq);
}

// An FP8 data word that would read as the poison (four negative NaNs) becomes four positive ones.
__device__ __forceinline__ uint2 never_poison(uint2 q) {
    if (q.x == kPoison) q.x = 0x7f7f7f7fu;
    if (q.y == kPoison) q.y = 0x7f7f7f7fu;
    return q;
}

// A UE8M0 scale (a power of two) as its exponent byte.
__device__ __forceinline__ uint32_t ue8m0_byte(float scale) { return (__float_as_uint(scale) >> 23) & 0xff; }

__device__ __forceinline__ void store_scale(uint8_t* msg, int data_bytes, int group, float scale, bool ue8m0) {
    if (ue8m0)  // group g in byte g of the packed words (little-endian, 4 per int32)
        msg[data_bytes + group] = static_cast<uint8_t>(ue8m0_byte(scale));
    else
        reinterpret_cast<float*>(msg + data_bytes)[group] = scale;
}

// Token t's 16-byte words [64 * unit, 64 * unit + 64) (512 channels, four FP8 scale groups; lanes
// 0-15 of each half hold one group): loaded once, cast once, and stored into each of the token's
// messages that holds data, which plan_message named for its K pairs (`offsets16`, `ranks`): what
// a warp does per message is its stores.
__device__ __forceinline__ void send_unit(const DispatchArgs& a, uint8_t* const* bufs, int t, int unit,
                                          const int* offsets16, const uint8_t* ranks, bool first_unit, int lane) {
    const int num_int4 = a.hidden / 8;
    const int i0 = unit * 2 * kWarpSize + lane, i1 = i0 + kWarpSize;
    const bool v0 = i0 < num_int4, v1 = i1 < num_int4;
    const auto* x = reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * a.hidden);
    const bool stamp = a.trace != nullptr && first_unit;  // the warp's first (thread 0 stamps)
    if (stamp) trace_point(a.trace, 0, kTraceEntered);
    const int4 r0 = v0 ? ld_nc_int4(x + i0) : make_int4(0, 0, 0, 0);
    const int4 r1 = v1 ? ld_nc_int4(x + i1) : make_int4(0, 0, 0, 0);
    if (stamp) {  // the stamp waits for the loaded values
        asm volatile("" ::"r"(r0.x), "r"(r1.x));
        trace_point(a.trace, 0, kTraceLoaded);
    }
    uint2 q0 = {}, q1 = {};
    float s0 = 0.f, s1 = 0.f, s0_high = 0.f, s1_high = 0.f;
    if (a.mode.fp8) {
        q0 = never_poison(cast_fp8x8(r0, v0, a.mode, s0));
        q1 = never_poison(cast_fp8x8(r1, v1, a.mode, s1));
        // The unit's four scales (groups 4 unit .. 4 unit + 3: s0 of lanes 0 and 16, then s1) in lane
        // 0, which stores them with one 16-byte write (UE8M0: one 4-byte word) instead of four
        // 4-byte ones: over NVLink each small write is a packet of its own.
        s0_high = __shfl_sync(kFullMask, s0, 16);
        s1_high = __shfl_sync(kFullMask, s1, 16);
    }
    const bool whole_unit = (unit + 1) * 2 * kWarpSize <= num_int4;  // all four groups (H % 512 == 0)
    if (stamp) {  // the stamp waits for the cast values
        asm volatile("" ::"r"(q0.x), "r"(q1.x), "r"(r0.x), "r"(r1.x));
        trace_point(a.trace, 0, kTraceCast);
    }
    for (int k = 0; k < a.num_topk; ++k) {
        const int offset16 = offsets16[k];
        if (offset16 < 0) continue;
        uint8_t* msg = bufs[ranks[k]] + static_cast<int64_t>(offset16) * 16;
        if (a.mode.fp8) {
            // (16 bytes a lane, two lanes' words each, measured no faster: 33.8 / 44.2 us at EP4,
            // 128 tokens, against 33.7 / 45.1; bench/results/*-ll-paired-fp8-stores-35de328*)
            if (v0) reinterpret_cast<uint2*>(msg)[i0] = q0;
            if (v1) reinterpret_cast<uint2*>(msg)[i1] = q1;
            if (whole_unit) {
                if (lane == 0) {
                    if (a.mode.ue8m0)
                        reinterpret_cast<uint32_t*>(msg + a.data_bytes)[unit] =
                            ue8m0_byte(s0) | ue8m0_byte(s0_high) << 8 | ue8m0_byte(s1) << 16 | ue8m0_byte(s1_high) << 24;
                    else
                        reinterpret_cast<float4*>(msg + a.data_bytes)[unit] = make_float4(s0, s0_high, s1, s1_high);
                }
            } else if (lane % 16 == 0) {
                if (v0) store_scale(msg, a.data_bytes, i0 / 16, s0, a.mode.ue8m0);
                if (v1) store_scale(msg, a.data_bytes, i1 / 16, s1, a.mode.ue8m0);
            }
        } else {
            if (v0) reinterpret_cast<int4*>(msg)[i0] = r0;
            if (v1) reinterpret_cast<int4*>(msg)[i1] = r1;
        }
    }
    if (stamp) trace_point(a.trace, 0, kTraceStored);
}

// Messages are token-major: a token's data crosses to a rank once, whatever number of that rank's
// experts it picked, into the rank's message [me][t] (dispatch area: [R][N] messages of msg_bytes),
// and each of its pairs names it by the token in the rank's index [E_local][R][N] (int32, after the
// messages: index_entry), at the pair's row. The receiver copies row i of (local expert, source)
// from message [source][index[local expert][source][i]]. Dense, the messages of one source fill
// ~N x 7 KB of a peer's buffer, where a message per (expert, row) spread them over E_local blocks of
// N rows each (a 2 MB page for every expert or two: one address translation each on both sides).
// Where the messages [R][N] start: the dispatch area's start, rounded up to message_align. At 128 (with
// messages of a multiple of 128 bytes), every 512-byte unit of FP8 data a warp stores fills whole
// 128-byte lines over NVLink, where 16-byte alignment split each into three partial ones
// (scripts/nvlink_rate.cu, 4 x H100: 128-byte strides pushed 4% faster; the normal mode's
// dispatch went 588 -> 567 us with its rows aligned so, b28c2ea). Buffers are 256-byte aligned.
__device__ __forceinline__ int64_t messages_base(const DispatchArgs& a, const Layout& lay) {
    return (lay.data + a.message_align - 1) / a.message_align * a.message_align;
}

__device__ __forceinline__ int64_t index_entry(const DispatchArgs& a, const Layout& lay, int local_e, int src,
                                               int row) {
    const int R = a.num_ranks, N = a.num_max_tokens;
    const int64_t index = messages_base(a, lay) + static_cast<int64_t>(R) * N * a.msg_bytes;  // after the messages
    return index + ((static_cast<int64_t>(local_e) * R + src) * N + row) * 4;
}

// Read by every block at its start (the last block of the send role updates the key: every block
// has read it by then).
__device__ ArrivalMode dispatch_mode(const DispatchArgs& a, const Layout& lay, uint8_t* mine) {
    const int R = a.num_ranks, N = a.num_max_tokens;
    const int64_t index_end = index_entry(a, lay, a.num_experts / R, 0, 0);  // the counted path's index ends
    ArrivalMode m{};
    m.base = (index_end + 127) / 128 * 128;
    const int64_t area_end = lay.data + static_cast<int64_t>(a.num_experts) * N * (a.hidden * 2 + 16);
    for (int r = 0; r < R; ++r) m.remote_peers |= is_remote(a.peers, r);
    // (At least two blocks, one to send and one to receive where send_plan splits them: the grid is
    // the SM count, alike on every rank. And N tokens fit the grid's chunks: then every rank's T <= N
    // does, so every rank launches the fused kernel, where the host asked for arrival; a rank whose
    // T alone decided would fall back to the two kernels and go counted while its peers did not.)
    const int grid = static_cast<int>(gridDim.x);
    const bool able = a.arrival != 0 && a.arrival_key != 0 && !m.remote_peers && a.mask == nullptr && grid >= 2 &&
                      N <= grid * (kMaxChunkEntries / max(1, a.num_topk)) &&
                      m.base + static_cast<int64_t>(R) * N * a.arrival_msg_bytes <= area_end;
    const int64_t key = ld_volatile(arrival_key_word(mine, a.slot));
    m.on = able && key == a.arrival_key;
    m.poison = able && !m.on;
    m.tag = m.on ? a.shape_tag ^ 0x80 : a.shape_tag;
    // Calls that do not go by arrival keep the key only where their stores miss the area: those of
    // its own format, whose messages and index lie before it.
    m.key_update = {true, able ? a.arrival_key : (key == a.arrival_key ? key : 0), 0};
    return m;
}

// Whether an earlier pair of pair j's token, one with a row, goes to rank dst: that one holds the
// token's message there.
__device__ __forceinline__ bool earlier_pair_at(const int* pair_expert, const int* pair_row, int j, int num_topk,
                                                int experts_per_rank, int dst) {
    for (int i = j - j % num_topk; i < j; ++i)
        if (pair_row[i] >= 0 && pair_expert[i] / experts_per_rank == dst) return true;
    return false;
}

// For remote ranks, in this rank's combine area (no peer writes it during a dispatch: see the
// staging note at the top): the token's staged message [t] (N of them), then each pair's index
// entry [T][K], which the send kernel puts to the pair's rank with the message.
__device__ __forceinline__ int64_t remote_index_staging(const DispatchArgs& a, const Layout& lay) {
    return lay.combine_data + static_cast<int64_t>(a.num_max_tokens) * a.msg_bytes;
}

// Where pair j of the block (of its token t, whose pairs start at [t][0]) has its data written, once every pair's row
// is known: in rank `rank`'s buffer at byte 16 * the value returned (layouts are 16-byte aligned;
// the host keeps buffers under 32 GiB), -1 for nowhere. The token's first pair with a row at a
// mapped rank (the holder) gets the token's message there; for a remote rank, the token's first
// remote pair gets its staging message in this rank's buffer (the send kernel puts it to each
// remote rank); the other pairs, and those not sent, nothing. With `write_index`, the pair's index
// entry is stored too (mapped rank), or staged for its put (remote: [T][K] after the staged messages).
// Computed by one thread per pair instead of by each of a token's warps for each of its messages
// (with divisions and peer-table lookups on every warp's way to its stores).
__device__ __forceinline__ int plan_message(const DispatchArgs& a, const Layout& lay, uint8_t* const* bufs,
                                            const int* pair_expert, const int* pair_row, int t, int j,
                                            bool write_index, uint8_t& rank) {
    const int K = a.num_topk, R = a.num_ranks, me = a.rank, N = a.num_max_tokens;
    const int experts_per_rank = a.num_experts / R;
    const int row = pair_row[j], e = pair_expert[j];
    rank = 0;
    if (row < 0) return -1;
    const int dst = e / experts_per_rank;
    if (is_remote(a.peers, dst)) {
        if (write_index)
            reinterpret_cast<int*>(bufs[me] + remote_index_staging(a, lay))[static_cast<int64_t>(t) * K + j % K] = t;
        for (int i = j - j % K; i < j; ++i)  // an earlier remote pair of the token has it staged
            if (pair_row[i] >= 0 && is_remote(a.peers, pair_expert[i] / experts_per_rank)) return -1;
        rank = static_cast<uint8_t>(me);
        return static_cast<int>((lay.combine_data + static_cast<int64_t>(t) * a.msg_bytes) / 16);
    }
    if (write_index) *reinterpret_cast<int*>(bufs[dst] + index_entry(a, lay, e % experts_per_rank, me, row)) = t;
    if (earlier_pair_at(pair_expert, pair_row, j, K, experts_per_rank, dst)) return -1;
    rank = static_cast<uint8_t>(dst);
    return static_cast<int>((messages_base(a, lay) + (static_cast<int64_t>(me) * N + t) * a.msg_bytes) / 16);
}

// Where this rank's message of token t keeps its payload at every rank, in 16-byte units.
__device__ __forceinline__ int arrival_payload16(const DispatchArgs& a, const ArrivalMode& m, int t) {
    return static_cast<int>((arrival_message_at(a, m, a.rank, t) + kArrivalHeaderBytes) / 16);
}

// Where pair j's data goes by arrival (at byte 16 * the value returned of rank `rank`'s buffer, -1
// for nowhere): the payload of the token's message at the pair's rank, for the token's first pair
// with a row there.
__device__ __forceinline__ int plan_arrival_message(const DispatchArgs& a, const ArrivalMode& m, const int* pair_expert,
                                                    const int* pair_row, int t, int j, uint8_t& rank) {
    const int K = a.num_topk, experts_per_rank = a.num_experts / a.num_ranks;
    const int row = pair_row[j], dst = pair_expert[j] / experts_per_rank;
    rank = 0;
    if (row < 0 || earlier_pair_at(pair_expert, pair_row, j, K, experts_per_rank, dst)) return -1;
    rank = static_cast<uint8_t>(dst);
    return arrival_payload16(a, m, t);
}

// A token's units of 512 channels (a warp's share of it in send_unit: 64 16-byte words of x).
__device__ __forceinline__ int send_units_per_token(const DispatchArgs& a) {
    return (a.hidden / 8 + 2 * kWarpSize - 1) / (2 * kWarpSize);
}

// Which blocks send which tokens. A block that has stored its messages cannot receive until they
// have left: its loads wait behind its stores in flight over NVLink (EP4, 128 tokens, 4 x H100,
// 85601d4: blocks with tokens read the counts at 15.2 us, ~5 us after their last store, the
// blocks without at 5.0). So by arrival, where 2/3 of the grid hold every token (or part of one),
// the blocks from `senders` on send nothing and receive while the data lands (4 x H100, 3018f36,
// against the counted path: 22.3 -> 20.8 us at 1 token, 25.4 -> 22.1 at 32, 27.6 -> 25.6 at 64);
// with more tokens every block sends a token and then receives (128 tokens: 32.7 -> 31.3 us, 256:
// 45.8 -> 43.9, 85601d4). Counted, every block sends. Each rank plans its own (T differs).
// With more tokens, a.send_blocks (the host's: a third of the SMs, or EPCOMM_LL_DISPATCH_SENDERS)
// send and sender b owns tokens b, b + senders, b + 2 senders, ... (`stride`), so that every rank's
// tokens land in about token order (each SM's stores drain in the order it issued them) and the
// receivers, which take messages in token order, copy each one while later ones are in flight.
// (Contiguous ranges of two or three tokens a sender, read in source order, had cost more than the
// early copies gained: 256 tokens, 45.5 -> 51.5 us.) Senders swept in one call (EP4, 4 x H100,
// 6818d0b, eager / graph us; every block sending: 128 tokens 31.1 / 30.4, 256 44.4 / 44.8): 88
// senders 33.2 / 32.4 and 46.8 / 46.1 (44 receivers are too few), 66 30.3 / 29.7 and 40.4 / 40.3,
// 44 30.8 / 29.2 and 40.5 / 40.1, 33 31.5 / 31.0 and 39.8 / 39.7
// (bench/results/2026-11-27_ep4-ll-senders-sweep-*).
// Unasked (EPCOMM_LL_DISPATCH_SENDERS auto), the senders of a dispatch by arrival on `grid` blocks:
// 2/3 of them up to that many tokens (a token or part of one each), beyond it the other third (each
// every n-th token). One rule for send_plan and for the host, which sizes the senders' shared counts.
__host__ __device__ __forceinline__ int auto_senders(int num_tokens, int grid) {
    const int most = grid - (grid / 3 > 1 ? grid / 3 : 1);
    return num_tokens <= most ? most : grid - most;
}
struct SendPlan {
    int chunk;    // tokens a sending block owns, at most
    int parts;    // blocks a token's units are split among (part p takes units p, p + parts, ...)
    int senders;  // blocks that send; the others only receive
    int stride;   // a block's tokens: first, first + stride, ... (1: a contiguous range)
};
__device__ __forceinline__ SendPlan send_plan(const DispatchArgs& a, const ArrivalMode& m) {
    const int T = a.num_tokens, grid = static_cast<int>(gridDim.x);
    SendPlan p{a.chunk_tokens, 1, grid, 1};
    const int asked = m.on && !m.remote_peers && a.send_blocks > 0 && a.send_blocks < grid ? a.send_blocks : 0;
    if (asked > 0 && T > asked) {  // (the host sized the shared counts for it and checked the pairs fit)
        p.chunk = (T + asked - 1) / asked;
        p.senders = p.stride = asked;
        return p;
    }
    const int most = asked > 0 ? asked : auto_senders(T, grid);  // (fewer than T beyond the split)
    const bool split = m.on && T <= most;  // (a.chunk_tokens is 1 then)
    // With fewer tokens than sending blocks, a token's units (512 channels each) are split among
    // `parts` blocks: one SM storing all of a token's messages (8 x 7 KB at top-8, H 7168) is bound
    // by its own store rate, and at one token the other SMs idle. The fused kernel has a block per
    // SM; the hook's send kernel a block per token range (parts 1). Not with remote peers: a
    // staged message is put whole, once every unit of it is written.
    if (p.chunk == 1 && T > 0 && !m.remote_peers) p.parts = max(1, min(send_units_per_token(a), (split ? most : grid) / T));
    if (split) p.senders = T * p.parts;
    return p;
}

// Whether senders by stride, and senders of a contiguous range of at most 32 pairs, plan their
// pairs a warp per token group (send_dispatch_messages) instead of a thread per pair scanning the
// token's earlier pairs in shared memory, once for the rows and once for the plan, a barrier after
// each (by arrival only). Those two passes held every sender 0.8 and
// 2.0 us (phase timeline, EP4, 128 tokens, 4 x H100; a sender's pair-rows 3.1 us, rows 5.1, first
// x load 5.2), where the receive-only blocks passed the same points at 2.3 and 2.5. Measured, not
// the cause: x not in L2 (prefetched at the start: same), the argument bank's lines (read at the
// start: same), the receivers' polls (receivers asleep: same), the instruction cache (the plan's
// code run once before: as slow again), a moment of the call (senders held 3 us at the start: the
// same 2 us in the plan pass, later); a 32-ns %globaltimer. With one warp pass and one barrier
// (same call): rows 3.4, first x load 3.6, kernel 20.5-21.3 us against 21.9-22.3 in a replayed
// graph; bench 27.8 / 27.2 us eager / graph against 28.3 / 27.7 (bench/results/2026-11-27_ep4-ll-warp-plan-*).
constexpr bool kWarpPlan = true;

// The send role of a dispatch, run by every block of the kernel (block b owns tokens by the plan);
// returns the call counter.
__device__ int64_t send_dispatch_messages(const DispatchArgs& a, const ArrivalMode& m, const SendPlan& plan) {
    // [E] all pairs, then [segments][E] the pairs before each of this block's tokens: segment c
    // counts those before token c of the block and after token c - 1, then a scan sums them. A
    // contiguous range has one (the pairs before it: the range's own pairs give the rest).
    extern __shared__ int expert_counts[];
    int* total = expert_counts;
    int* before = expert_counts + a.num_experts;
    __shared__ int pair_expert[kMaxChunkEntries];  // this block's pairs: expert (-1: none)
    __shared__ int pair_row[kMaxChunkEntries];     // and row in the expert's block (-1: not sent)
    __shared__ int pair_offset16[kMaxChunkEntries];  // and where its data goes: plan_message (static shared
    __shared__ uint8_t pair_rank[kMaxChunkEntries];  // memory plus 2E ints of counts stay under 48 KB)
    __shared__ uint8_t* bufs[kMaxRanks];            // the peer table, read per message
    __shared__ bool skip_dst[kMaxRanks];
    const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
    const int R = a.num_ranks, K = a.num_topk, E = a.num_experts, me = a.rank, N = a.num_max_tokens;
    const int experts_per_rank = E / R;
    uint8_t* mine = a.peers.bufs[me];
    __shared__ int64_t call_seq;
    trace_point(a.trace, 0, kTraceStart);
    trace_sm(a.trace, 0);
    const Layout lay(a.slot, a.slot_bytes, E, R, N, a.hidden);
    // Every block computes the same plan (its counts depend on `parts`). Every part of a token
    // plans the token's pairs alike; part 0 writes the handle's records and the index.
    const int parts = plan.parts, part = static_cast<int>(blockIdx.x) % parts, stride = plan.stride;
    const int b = static_cast<int>(blockIdx.x);
    const int first = b >= plan.senders ? a.num_tokens : stride == 1 ? b / parts * plan.chunk : b;
    const int num_own = first >= a.num_tokens ? 0
                        : stride == 1        ? min(a.num_tokens - first, plan.chunk)
                                             : (a.num_tokens - 1 - first) / stride + 1;
    const auto token_of = [&](int c) { return first + c * stride; };  // the block's token c
    const int num_pairs = num_own * K;
    const int segments = stride == 1 ? 1 : max(1, num_own);

    for (int e = tid; e < (1 + segments) * E; e += kThreads) expert_counts[e] = 0;
    if (tid < R) bufs[tid] = a.peers.bufs[tid];
    __syncthreads();
    // Warp 0 reads the call counters and waits for the acknowledgements while the other warps
    // count: the counting warps' loads go out first thing, not after a round trip for the counters.
    bool bad = false;
    if (warp == 0) {
        if (tid == 0) call_seq = next_seq(mine);
        if (b == 0) pay_owed_acks(a.peers, R, me, a.slot_bytes, a.mask);
        if (tid < R) {  // a peer still reading the previous call of this slot must acknowledge it first
            const int64_t prev = ld_volatile(reinterpret_cast<const int64_t*>(mine + kSlotSeqOffset) + a.slot);
            skip_dst[tid] = !may_write_slot(mine, lay.acks, me, tid, prev, a.mask, a.timeout_ns, a.info, kOpDispatch);
        }
    } else {
        // Every pair, in batches of kCountBatch loads in flight per thread (a load, then its atomics,
        // one at a time would cost a memory round trip per pair); this block's own pairs' experts
        // are kept on the way.
        constexpr int kCounters = kThreads - kWarpSize, kCountBatch = 4;
        const int num_all = a.num_tokens * K;
        for (int base = tid - kWarpSize; base < num_all; base += kCountBatch * kCounters) {
            int64_t ids[kCountBatch];
#pragma unroll
            for (int u = 0; u < kCountBatch; ++u) {
                const int i = base + u * kCounters;
                ids[u] = i < num_all ? __ldg(a.topk_idx + i) : -1;
            }
#pragma unroll
            for (int u = 0; u < kCountBatch; ++u) {
                const int i = base + u * kCounters;
                const int64_t e = ids[u];
                if (e < -1 || e >= E) bad = true;
                const bool valid = e >= 0 && e < E;
                const int t = i / K, after = (t - first) / stride;  // (after: where t >= first)
                if (t >= first && (t - first) % stride == 0 && after < num_own) {
                    pair_expert[after * K + i % K] = valid ? static_cast<int>(e) : -1;
                    if (part == 0) a.topk_copy[i] = e;  // the handle's copy, from the register
                }
                if (!valid) continue;
                atomicAdd(total + e, 1);
                const int segment = t < first ? 0 : after + 1;
                if (segment < segments) atomicAdd(before + segment * E + e, 1);
            }
        }
    }
    __syncthreads();
    for (int e = tid; e < E; e += kThreads) {
        bad |= total[e] > N;  // more pairs for one expert than N
        for (int c = 1; c < segments; ++c) before[c * E + e] += before[(c - 1) * E + e];
    }
    // Every block counted every pair, so all of them agree on this (it goes into every signal).
    const int64_t invalid = __syncthreads_or(bad) ? kInvalidInputBit : 0;
    const int64_t seq = call_seq;
    trace_point(a.trace, 0, kTraceReady);
    // Experts no pair chose get their (empty) signal now, from one block each: no data to wait for,
    // so it travels while the messages are written. By arrival, every expert's count does. Where
    // some blocks only receive, they store these (and the missing tokens' headers below), so that a
    // sender's first NVLink stores are its data (a block's loads wait behind its stores in flight).
    // With the call counters read by warp 0 (above), at 66 senders (EP4, 128 tokens, 4 x H100):
    // graph dispatch 28.2 / 27.6 us against 28.7 / 29.1 (cb953a7 vs 6818d0b), its `ready` 1.9 us
    // against 2.7. (A sender's data then started ~3 us after its counts: its rows and plan passes
    // below, not these stores; see kWarpPlan.)
    const int grid = static_cast<int>(gridDim.x);
    const int signal_blocks = plan.senders < grid ? grid - plan.senders : grid;
    const int signal_block = plan.senders < grid ? b - plan.senders : b;  // < 0: none here
    for (int e = signal_block + signal_blocks * tid; signal_block >= 0 && e < E; e += signal_blocks * kThreads) {
        const int dst = e / experts_per_rank;
        if ((total[e] != 0 && !m.on) || skip_dst[dst]) continue;
        const int64_t offset = lay.dispatch_signals + 8 * ((e % experts_per_rank) * R + me);
        const int64_t value = make_signal(seq, m.tag, invalid, min(total[e], N));
        if (is_remote(a.peers, dst))
            Net::signal(reinterpret_cast<int64_t*>(mine + offset), value, dst);
        else
            st_relaxed_sys(reinterpret_cast<int64_t*>(a.peers.bufs[dst] + offset), value);  // no data to order before it
    }
    if (a.trace != nullptr) __syncthreads();
    trace_point(a.trace, 0, kTraceSignals);
    // By stride (one token a segment), rows and plan in one pass, a warp per 32 / K tokens: a pair's
    // row counts the token's earlier pairs of its expert (match on token and expert), and it holds
    // the token's message at its rank if no earlier pair with a row goes there (match on token and
    // rank), where the loops below scan the token's earlier pairs from shared memory pair by pair.
    // A contiguous range (one segment: a pair's row counts the range's earlier pairs of its expert,
    // whatever their token) of at most 32 pairs goes to one warp, its pairs in one group.
    const bool warp_plan = kWarpPlan && m.on && K >= 1 && K <= kWarpSize && (stride > 1 || num_pairs <= kWarpSize);
    if (warp_plan) {
        const int per_warp = stride > 1 ? kWarpSize / K : num_own, within = lane / K, k = lane % K;
        const unsigned earlier = (1u << lane) - 1;
        for (int c0 = warp * per_warp; c0 < num_own; c0 += kWarpsPerBlock * per_warp) {
            const int c = c0 + within, j = c * K + k;
            const bool live = within < per_warp && c < num_own;
            const int e = live ? pair_expert[j] : -1;
            const int group = stride > 1 ? within : 0, segment = stride > 1 ? c : 0;
            const unsigned same_expert = __match_any_sync(kFullMask, e >= 0 ? group * (E + 1) + e : -1 - lane);
            int row = -1, dst = 0;
            if (e >= 0) {
                dst = e / experts_per_rank;
                row = before[segment * E + e] + __popc(same_expert & earlier);
                if (row >= N || skip_dst[dst]) row = -1;  // past the block's room: dropped
            }
            const unsigned same_rank = __match_any_sync(kFullMask, row >= 0 ? within * R + dst : -1 - lane);
            if (live) {
                const bool holds = row >= 0 && (same_rank & earlier) == 0;
                pair_row[j] = row;
                pair_rank[j] = holds ? static_cast<uint8_t>(dst) : 0;
                pair_offset16[j] = holds ? arrival_payload16(a, m, token_of(c)) : -1;
                if (part == 0) a.slot_map[static_cast<int64_t>(token_of(c)) * K + k] = row;
            }
        }
    }
    for (int j = tid; !warp_plan && j < num_pairs; j += kThreads) {
        const int e = pair_expert[j], c = j / K;
        int row = -1;
        if (e >= 0) {
            // the pairs before the token's segment, then the block's own pairs before j from it
            const int segment = segments == 1 ? 0 : c;
            row = before[segment * E + e];
            for (int i = segment * K; i < j; ++i) row += pair_expert[i] == e;
            if (row >= N || skip_dst[e / experts_per_rank]) row = -1;  // past the block's room: dropped
        }
        pair_row[j] = row;
        if (part == 0) a.slot_map[static_cast<int64_t>(token_of(c)) * K + j % K] = row;
    }

    if (m.on) {  // the headers of tokens this rank does not have (t >= T): no message, at every rank
        const int missing = (N - min(a.num_tokens, N)) * R;
        for (int i = signal_block * kThreads + tid; signal_block >= 0 && i < missing; i += signal_blocks * kThreads) {
            const auto none = [](int) { return kNoDestination; };
            if (!skip_dst[i % R]) store_arrival_header(arrival_message(a, m, bufs[i % R], me, a.num_tokens + i / R), none, K, seq);
        }
    }

    __syncthreads();  // every pair's row is known
    trace_point(a.trace, 0, kTracePairRows);
    for (int j = tid; !warp_plan && j < num_pairs; j += kThreads)
        pair_offset16[j] = m.on ? plan_arrival_message(a, m, pair_expert, pair_row, token_of(j / K), j, pair_rank[j])
                                : plan_message(a, lay, bufs, pair_expert, pair_row, token_of(j / K), j, part == 0,
                                               pair_rank[j]);
    // Each of the block's tokens' header at each rank (part 0 of the token). Where send_plan does not
    // split (T above 2/3 of the grid: no receive-only blocks read the messages as they land, only
    // the few blocks without a token when T < grid), after the data: a block that sent reads no
    // header before its own stores have landed, and the data is what the kernel waits for.
    // (The header stores before the data held the median block 3.0 us between its rows and its
    // first data store; after it: EP4, 128 tokens, 4 x H100, graph dispatch 29.8 / 29.9 us against
    // 30.8 / 30.8, kernel 23.5 us against 25.1, bench/results/2026-11-27_ep4-ll-headers-last-*.)
    // A sender of tokens by stride (receivers copy the first while the later are in flight) stores
    // each token's headers after that token's data instead: the warp that sent its last unit.
    const bool headers_last = plan.senders >= grid && stride == 1;
    // (hidden 0: no unit to follow, so the headers go before, as store_headers stores them)
    const bool headers_per_token = m.on && part == 0 && stride > 1 && send_units_per_token(a) > 0;
    const auto header_entry = [&](int c, int dst) {
        return [&, c, dst](int k) {
            const int j = c * K + k, e = pair_expert[j], row = pair_row[j];
            return row >= 0 && e / experts_per_rank == dst
                       ? static_cast<uint32_t>(e % experts_per_rank) << 16 | static_cast<uint32_t>(row)
                       : kNoDestination;
        };
    };
    const auto store_headers = [&] {
        for (int i = tid; i < num_own * R; i += kThreads) {
            const int c = i / R, dst = i % R;
            if (!skip_dst[dst]) store_arrival_header(arrival_message(a, m, bufs[dst], me, token_of(c)), header_entry(c, dst), K, seq);
        }
    };
    if (m.on && part == 0 && !headers_last && !headers_per_token) store_headers();
    __syncthreads();
    trace_point(a.trace, 0, kTraceRows);

    // Each warp loads 512 channels of a token once and stores them (cast to FP8, or as they are)
    // into every message of the token that holds data: x read once.
    uint8_t* staging = mine + lay.combine_data;  // [N] messages, for remote peers
    const int block_units = (send_units_per_token(a) - part + parts - 1) / parts;  // units of each token here
    for (int v = warp; v < num_own * block_units; v += kWarpsPerBlock) {
        const int c = v / block_units;
        send_unit(a, bufs, token_of(c), part + v % block_units * parts, pair_offset16 + c * K, pair_rank + c * K,
                  v == warp, lane);
        if (headers_per_token && v % block_units == block_units - 1) {  // a 16-byte pair of words a lane
            const int words = (K + 1) / 2;
            for (int i = lane; i < R * words; i += kWarpSize) {
                const int dst = i / words;
                if (!skip_dst[dst])
                    store_arrival_header_words(arrival_message(a, m, bufs[dst], me, token_of(c)), header_entry(c, dst),
                                               i % words * 2, K, seq);
            }
        }
    }
    if (m.on && part == 0 && headers_last) store_headers();
    __syncthreads();
    if constexpr (Net::kRemote) {
        // A warp puts each remote pair's index entry to its rank, and the token's staged message
        // there with the token's first pair at that rank.
        const int64_t index_staging = remote_index_staging(a, lay);
        bool put = false;
        for (int j = warp; j < num_pairs; j += kWarpsPerBlock) {
            const int row = pair_row[j], e = pair_expert[j], dst = e / experts_per_rank, t = token_of(j / K);
            if (row < 0 || !is_remote(a.peers, dst)) continue;
            Net::put_warp(mine + index_entry(a, lay, e % experts_per_rank, me, row),
                          mine + index_staging + (static_cast<int64_t>(t) * K + j % K) * 4, 4, dst);
            if (!earlier_pair_at(pair_expert, pair_row, j, K, experts_per_rank, dst))
                Net::put_warp(mine + messages_base(a, lay) + (static_cast<int64_t>(me) * N + t) * a.msg_bytes,
                              staging + static_cast<int64_t>(t) * a.msg_bytes, a.msg_bytes, dst);
            put = true;
        }
        if (__syncthreads_or(put) && tid == 0) Net::quiet();  // delivered before any count is signalled
        __syncthreads();
    }
    trace_point(a.trace, 0, kTraceWritten);

    // Count the pairs; the expert's last one (in any block) signals its count to the expert's rank.
    // Skipped pairs count too, so the counter always returns to 0 for the next call. (By arrival
    // the counts have left already, and the counter stays 0.)
    for (int j = tid; !m.on && j < num_pairs; j += kThreads) {
        const int e = pair_expert[j];
        if (e < 0) continue;
        // The count releases this block's stores of the message (before the barrier) at GPU scope
        // and acquires the earlier writers'; the last writer's fence_sys below then releases all of
        // them to the peer (causality is transitive across the two scopes). A fence_sys per pair
        // instead cost 1 us a dispatch at T=128 (one H100). Each part of a token counts its pairs.
        if (atomic_add_acq_rel_gpu(a.sent_pairs + e, 1) != total[e] * parts - 1) continue;
        a.sent_pairs[e] = 0;
        const int dst = e / experts_per_rank;
        if (skip_dst[dst]) continue;
        fence_sys();  // acquires the other writers' counts (each released its stores), releases all to the peer
        signal_peer(a.peers, me, dst, lay.dispatch_signals + 8 * ((e % experts_per_rank) * R + me),
                    make_signal(seq, m.tag, invalid, min(total[e], N)));
    }
    if (a.trace != nullptr) __syncthreads();  // every count of the block is signalled
    trace_point(a.trace, 0, kTraceSignalled);
    finish_send_kernel(mine, seq, a.slot, m.key_update, a.defer_acks);
    return seq;
}

// The warps of a block that take a receive unit together: `threads` threads from thread `first`,
// synchronized by named barrier `barrier` (0: the whole block's barrier), with their own copy of
// the unit's counts in shared memory.
struct WarpGroup {
    int first, threads, barrier;
    int* counts;  // [kMaxRanks]
    __device__ __forceinline__ void sync() const {
        asm volatile("bar.sync %0, %1;" ::"r"(barrier), "r"(threads) : "memory");
    }
};

// Piece `piece` of row i of (local expert, source)'s block, copied from the source's message of the
// row's token (its index entry) into row begin + i of the expert's packed rows; piece 0 also its
// scales and src_info. This and the two helpers below are the steps of both receive paths (a warp
// group per unit, or a block's units together).
__device__ __forceinline__ void copy_received_piece(const DispatchArgs& a, const Layout& lay, const uint8_t* mine,
                                                    int local_e, int src, int begin, int i, int piece, int lane) {
    const int R = a.num_ranks, N = a.num_max_tokens;
    const int rows_per_expert = N * R;
    // A token read from the buffer is bounded before use: a peer that made a call of another shape
    // (reported: its signals carry its shape tag) may have written over this rank's index with its
    // layout, and a count that is valid can then come with an entry that is not. Its rows are
    // garbage then, but the call raises and nothing faults.
    const int token = *reinterpret_cast<const int*>(mine + index_entry(a, lay, local_e, src, i));
    const bool valid = token >= 0 && token < N;
    const uint8_t* data = mine + messages_base(a, lay) + (static_cast<int64_t>(src) * N + (valid ? token : 0)) * a.msg_bytes;
    const int64_t row = static_cast<int64_t>(local_e) * rows_per_expert + begin + i;
    // Piece 0 also carries the row's scales, loaded with the data rather than after its stores:
    // the warps of piece 0 then end one memory round trip sooner (H <= 8192 at 128 channels a
    // scale: kScaleWords a lane in registers; the rest of a larger row after).
    constexpr int kScaleWords = 2;
    const auto* scales = reinterpret_cast<const uint32_t*>(data + a.data_bytes);
    uint32_t held[kScaleWords] = {};
    if (piece == 0) {
#pragma unroll
        for (int u = 0; u < kScaleWords; ++u)
            if (lane + u * kWarpSize < a.num_scale_cols) held[u] = scales[lane + u * kWarpSize];
    }
    copy_piece(reinterpret_cast<int4*>(a.recv_data + row * a.data_bytes), reinterpret_cast<const int4*>(data),
               a.data_bytes / 16, piece, lane);
    if (piece != 0) return;
    auto* out = reinterpret_cast<uint32_t*>(a.recv_scales) + local_e * a.scale_stride_e + (begin + i) * a.scale_stride_row;
#pragma unroll
    for (int u = 0; u < kScaleWords; ++u)
        if (lane + u * kWarpSize < a.num_scale_cols) out[(lane + u * kWarpSize) * a.scale_stride_col] = held[u];
    for (int c = lane + kScaleWords * kWarpSize; c < a.num_scale_cols; c += kWarpSize)
        out[c * a.scale_stride_col] = scales[c];
    if (lane == 0) a.src_info[row] = valid ? token : -1;
}

// Thread j (< R) waits for source j's count of `local_e` and returns it: 0 when masked (or timed
// out: reported, and nothing to copy), never more than a block's room. The wait of the unit's own
// source (`src`) is timed into the wait-cost statistics for local expert 0. `tag`: the signals'
// shape tag, when not the call's (ArrivalMode: by arrival, the counts release no data, so they are
// read with relaxed loads).
__device__ __forceinline__ int wait_source_count(const DispatchArgs& a, int64_t seq, const Layout& lay,
                                                 uint8_t* mine, int local_e, int src, int j, int tag = -1) {
    const int R = a.num_ranks, me = a.rank, N = a.num_max_tokens;
    int count = 0;
    uint64_t waited = 0;
    if (!masked(a.mask, me) && !masked(a.mask, j)) {
        const auto* signal = reinterpret_cast<const int64_t*>(mine + lay.dispatch_signals) + local_e * R + j;
        count = wait_signal(signal, seq, tag < 0 ? a.shape_tag : tag, j, a.mask, a.timeout_ns, a.info, gave_up_word(mine),
                            kOpDispatch, &waited, tag < 0);
        count = count < 0 ? 0 : min(count, N);
    }
    if (a.wait_stats != nullptr && local_e == 0 && j == src) atomicAdd(
        reinterpret_cast<unsigned long long*>(a.wait_stats + src), static_cast<unsigned long long>(waited));
    return count;
}

// By the last source's unit of an expert: its receive count, layout ranges and the src_info of the
// rows past its count (-1), from the R sources' counts (`total` their sum); `tid` of `num_threads`.
__device__ __forceinline__ void complete_expert(const DispatchArgs& a, int local_e, const int* counts, int total,
                                                int tid, int num_threads) {
    const int R = a.num_ranks, rows_per_expert = a.num_max_tokens * R;
    if (tid == 0) {
        a.recv_count[local_e] = total;
        if (a.cumulative_stats != nullptr) atomicAdd(a.cumulative_stats + local_e, total);
    }
    if (tid < R) {
        int run = 0;
        for (int j = 0; j < tid; ++j) run += counts[j];
        a.layout_range[static_cast<int64_t>(local_e) * R + tid] = (static_cast<int64_t>(run) << 32) | counts[tid];
    }
    for (int r = total + tid; r < rows_per_expert; r += num_threads)
        a.src_info[static_cast<int64_t>(local_e) * rows_per_expert + r] = -1;
}

// The receive role of a dispatch for one (local expert, source) unit, run by a group of warps: its
// rows go after those of the sources before it. `first_unit`: the block's first (it stamps the trace).
__device__ void receive_dispatch_unit(const DispatchArgs& a, int64_t seq, const Layout& lay, int unit, int plane,
                                      const WarpGroup& g, int first_unit) {
    int* counts = g.counts;
    const int tid = static_cast<int>(threadIdx.x) - g.first, lane = tid % kWarpSize, warp = tid / kWarpSize;
    const int num_threads = g.threads, num_warps = num_threads / kWarpSize;
    const int R = a.num_ranks;
    uint8_t* mine = a.peers.bufs[a.rank];
    const int local_e = unit / R, src = unit % R;
    if (tid < R) counts[tid] = wait_source_count(a, seq, lay, mine, local_e, src, tid);
    g.sync();
    if (unit == first_unit) trace_point(a.trace, plane, kTraceArrived);  // thread 0 of the block's first unit
    int begin = 0, total = 0;
    for (int j = 0; j < R; ++j) {
        if (j < src) begin += counts[j];
        total += counts[j];
    }
    const int pieces = num_pieces(a.data_bytes / 16), mine_count = counts[src];
    for (int u = warp; u < mine_count * pieces; u += num_warps)
        copy_received_piece(a, lay, mine, local_e, src, begin, u / pieces, u % pieces, lane);
    if (src == R - 1) complete_expert(a, local_e, counts, total, tid, num_threads);  // the expert's last source
    g.sync();  // counts[] is reused by the group's next unit
}

// The fused dispatch's receive role for calls with many rows per unit (the host's choice:
// EPCOMM_LL_BLOCK_RECEIVE): a block takes its units (unit blockIdx.x + m * gridDim.x)
// kMaxFusedGroups at a time, waits for all of their counts, and its 16 warps share their messages'
// pieces, instead of each unit's group of warps copying its own rows, where the unit with the
// most rows sets the kernel's end (random top-8 of 288 at 128 tokens: ~11 rows against 3.6 on
// average, copied by 4 warps while the block's other warps idle). With few rows the wait for
// every unit's count first costs more than it saves (one H100, one rank: +1.3 us at 1 token).
__device__ void receive_dispatch_units_together(const DispatchArgs& a, int64_t seq, const Layout& lay) {
    __shared__ int counts[kMaxFusedGroups][kMaxRanks];
    __shared__ int begins[kMaxFusedGroups];     // the unit's first row in its expert's packed rows
    __shared__ int pieces_end[kMaxFusedGroups];  // pieces of the batch's units up to this one's (inclusive)
    const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
    const int R = a.num_ranks, E = a.num_experts, grid = static_cast<int>(gridDim.x);
    const int pieces = num_pieces(a.data_bytes / 16);
    uint8_t* mine = a.peers.bufs[a.rank];
    for (int batch = blockIdx.x; batch < E; batch += grid * kMaxFusedGroups) {
        const int units = min(kMaxFusedGroups, (E - batch + grid - 1) / grid);
        if (tid < units * R) {
            const int unit = batch + tid / R * grid;
            counts[tid / R][tid % R] = wait_source_count(a, seq, lay, mine, unit / R, unit % R, tid % R);
        }
        __syncthreads();
        if (batch == static_cast<int>(blockIdx.x)) trace_point(a.trace, 0, kTraceArrived);
        if (tid == 0) {
            int run = 0;
            for (int m = 0; m < units; ++m) {
                const int src = (batch + m * grid) % R;
                int begin = 0;
                for (int j = 0; j < src; ++j) begin += counts[m][j];
                begins[m] = begin;
                run += counts[m][src] * pieces;
                pieces_end[m] = run;
            }
        }
        __syncthreads();
        for (int f = warp; f < pieces_end[units - 1]; f += kWarpsPerBlock) {
            int m = 0;
            while (f >= pieces_end[m]) ++m;
            const int unit = batch + m * grid, within = f - (m > 0 ? pieces_end[m - 1] : 0);
            copy_received_piece(a, lay, mine, unit / R, unit % R, begins[m], within / pieces, within % pieces, lane);
        }
        for (int m = 0; m < units; ++m) {
            const int unit = batch + m * grid;
            if (unit % R != R - 1) continue;  // the last source's unit completes the expert's metadata
            int total = 0;
            for (int j = 0; j < R; ++j) total += counts[m][j];
            complete_expert(a, unit / R, counts[m], total, tid, kThreads);
        }
        __syncthreads();  // counts[] is reused by the next batch
    }
}

// The block receive of the fused dispatch (kBalancedReceive in dispatch_fused): the rows spread
// evenly over the whole grid instead of by (expert, source) unit. Every block waits for all units'
// counts (the signals arrive within ~1 us of each other at EP4, 128 tokens), numbers their
// messages' pieces in unit order, and takes an equal contiguous share of them. At EP4, 128 tokens
// (4 x H100, b28c2ea) the per-unit batches left the last block copying 2.8 us after the median one
// (phase timeline: received 21.9 median, 24.7 last); spread evenly (d1787213, same run): dispatch
// 35.5 -> 33.4 us at 128 tokens (kernel 31.0 -> 29.1), 49.4 -> 47.3 at 256, unchanged at 1-64
// (those take the unit path: EPCOMM_LL_BLOCK_RECEIVE=auto). Blocks must agree on every count,
// so only without failed-rank masking (a rank masked mid-call reads as 0 to the blocks that look
// later); a timeout or a shape mismatch gives the call up, whose outputs are invalid anyway.
__device__ void receive_dispatch_balanced(const DispatchArgs& a, int64_t seq, const Layout& lay) {
    // The send role's per-expert counts (2 E ints of dynamic shared memory) are free now: they
    // hold each unit's count, then, in place, the exclusive prefix of the units' pieces (E + 1).
    extern __shared__ int pieces_before[];
    __shared__ int warp_sums[kWarpsPerBlock];
    const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
    const int R = a.num_ranks, E = a.num_experts, grid = static_cast<int>(gridDim.x);
    const int pieces = max(1, num_pieces(a.data_bytes / 16));  // a count is recovered from its pieces
    uint8_t* mine = a.peers.bufs[a.rank];
    __syncthreads();  // the send role's last reads of the counts
    for (int u = tid; u < E; u += kThreads)  // one block's waits feed the wait-cost statistics
        pieces_before[u] = pieces * wait_source_count(a, seq, lay, mine, u / R, blockIdx.x == 0 ? u % R : -1, u % R);
    __syncthreads();
    trace_point(a.trace, 0, kTraceArrived);
    // Exclusive scan: thread i sums a contiguous segment of units, the block scans the segment
    // sums; each thread then rewrites its own segment.
    const int per = (E + kThreads - 1) / kThreads, lo = min(E, tid * per), hi = min(E, lo + per);
    int segment = 0;
    for (int u = lo; u < hi; ++u) segment += pieces_before[u];
    int all_pieces;
    int run = block_exclusive_sum<kWarpsPerBlock>(segment, warp_sums, all_pieces);
    for (int u = lo; u < hi; ++u) {
        const int own = pieces_before[u];
        pieces_before[u] = run;
        run += own;
    }
    if (tid == 0) pieces_before[E] = all_pieces;
    __syncthreads();
    auto count_of = [&](int u) { return (pieces_before[u + 1] - pieces_before[u]) / pieces; };
    const int64_t total = pieces_before[E];
    const int first = static_cast<int>(total * blockIdx.x / grid);
    const int last = static_cast<int>(total * (blockIdx.x + 1) / grid);
    for (int f = first + warp; f < last; f += kWarpsPerBlock) {
        int low = 0, high = E - 1;  // the unit holding piece f: the last whose pieces start at or before f
        while (low < high) {
            const int mid = (low + high + 1) / 2;
            if (pieces_before[mid] <= f)
                low = mid;
            else
                high = mid - 1;
        }
        const int local_e = low / R, src = low % R, within = f - pieces_before[low];
        int begin = 0;
        for (int j = 0; j < src; ++j) begin += count_of(local_e * R + j);
        copy_received_piece(a, lay, mine, local_e, src, begin, within / pieces, within % pieces, lane);
    }
    __shared__ int counts[kMaxRanks];
    for (int local_e = blockIdx.x; local_e < E / R; local_e += grid) {  // each expert's metadata, by one block
        if (tid < R) counts[tid] = count_of(local_e * R + tid);
        __syncthreads();
        int sum = 0;
        for (int j = 0; j < R; ++j) sum += counts[j];
        complete_expert(a, local_e, counts, sum, tid, kThreads);
        __syncthreads();  // counts[] is rewritten for the block's next expert
    }
}

__device__ __forceinline__ int4 ld_volatile_int4(const int4* ptr) {
    int4 v;
    asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr)
                 : "memory");
    return v;
}

// Whether payload word q (16 bytes) still holds poison where a sender writes: every FP8 data word;
// of the scales, the num_scale_cols words (the last 16-byte word's others are never written).
__device__ __forceinline__ bool payload_pending(const int4& v, int q, int data_int4, int num_scale_cols) {
    const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                           static_cast<uint32_t>(v.w)};
    const int first_col = (q - data_int4) * 4;
    bool pending = false;
#pragma unroll
    for (int i = 0; i < 4; ++i) pending |= w[i] == kPoison && (q < data_int4 || first_col + i < num_scale_cols);
    return pending;
}

// Between two polls of a word not there yet: a short sleep (the words land over ~10 us; polling
// them all back to back would load L2 with several TB/s while NVLink writes into it), and the
// checks of wait_signal every 16th time. False: give up (reported; the call is incomplete).
struct ArrivalWait {
    uint64_t start;
    unsigned sleep_ns;
    int polls;
};
__device__ bool keep_waiting(ArrivalWait& w, const DispatchArgs& a, int src, uint8_t* mine) {
    __nanosleep(w.sleep_ns);
    w.sleep_ns = min(2 * w.sleep_ns, 256u);
    if ((++w.polls & 15) != 0) return true;
    int* gave_up = gave_up_word(mine);
    return !abandoned(a.info, gave_up, kOpDispatch) &&
           !past_deadline(a.info, gave_up, kOpDispatch, src, nullptr, w.start, a.timeout_ns);
}

// The receive role by arrival (ArrivalMode): every block waits for every (local expert, source)
// count (they left before the data) and places each unit's rows after those of the sources before
// it; then a warp per part of a message [src][t] reads the header, waits for each of its words of
// the payload, copies them into every row the header names (the scales into the scale layout), and
// stores the poison back. The last source's counts give each expert's metadata, as
// receive_dispatch_balanced does. Without failed-rank masking only (the host's choice).
__device__ void receive_dispatch_arrival(const DispatchArgs& a, const ArrivalMode& m, int64_t seq, const Layout& lay,
                                         int first_block) {
    // Only the blocks from first_block on (those that sent nothing, where send_plan splits them: the
    // others' loads would wait for their stores).
    if (static_cast<int>(blockIdx.x) < first_block) return;
    // The send role's per-expert counts (2 E ints of dynamic shared memory) are free now: each
    // (local expert, source) unit's count, then its first row among its expert's rows.
    extern __shared__ int unit_counts[];
    int* begins = unit_counts + a.num_experts;
    const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
    const int R = a.num_ranks, E = a.num_experts, N = a.num_max_tokens, K = a.num_topk;
    const int block = static_cast<int>(blockIdx.x) - first_block, grid = static_cast<int>(gridDim.x) - first_block;
    const int experts_per_rank = E / R;
    uint8_t* mine = a.peers.bufs[a.rank];
    __syncthreads();  // the send role's last reads of the counts
    for (int u = tid; u < E; u += kThreads)  // one block's waits feed the wait-cost statistics
        unit_counts[u] = wait_source_count(a, seq, lay, mine, u / R, block == 0 ? u % R : -1, u % R, m.tag);
    __syncthreads();
    trace_point(a.trace, 0, kTraceArrived);
    for (int local_e = tid; local_e < experts_per_rank; local_e += kThreads) {
        int run = 0;
        for (int j = 0; j < R; ++j) {
            begins[local_e * R + j] = run;
            run += unit_counts[local_e * R + j];
        }
    }
    __syncthreads();

    const int data_int4 = a.data_bytes / 16;
    const int payload_int4 = data_int4 + (a.num_scale_cols * 4 + 15) / 16;
    const int warps = grid * kWarpsPerBlock;
    const int least_parts = (payload_int4 + kWarpSize * kArrivalPerLane - 1) / (kWarpSize * kArrivalPerLane);
    const int parts = max(least_parts, min(kArrivalMaxParts, warps / max(1, R * N)));
    const int per_part = (payload_int4 + parts - 1) / parts;  // at most kWarpSize * kArrivalPerLane
    const int64_t items = static_cast<int64_t>(R) * N * parts;
    const int4 poison4 = make_int4(-1, -1, -1, -1);
    ArrivalWait w{global_timer_ns(), 32, 0};
    for (int64_t item = static_cast<int64_t>(block) * kWarpsPerBlock + warp; item < items; item += warps) {
        w.sleep_ns = 32;
        // Token-major: messages land in about token order at every source (send_plan), and a
        // warp's later items are later tokens.
        const int part = static_cast<int>(item % parts), src = static_cast<int>(item / parts % R);
        const int t = static_cast<int>(item / parts / R);
        uint8_t* msg = arrival_message(a, m, mine, src, t);
        // The part's payload words are loaded once the header is here, not before it. They were
        // loaded first, with the header's first poll, to save a round trip where both were there
        // at once; but a warp mostly waits for its message (it reaches its item ~2 us into the
        // kernel, the data lands over the next ~10), so that load found poison and was thrown
        // away, and once the header came the warp first slept (its backoff, grown to up to 256 ns
        // while it waited for the header) and then loaded the payload again. Where the senders go
        // by stride (T above 2/3 of the SMs; at EP4 from 89 tokens) a token's headers follow its
        // data, so the payload is (nearly all) there with its header. In one call against the
        // order before (EP4, 128 tokens, 4 x H100; this code as f63236a against 17bc684): eager
        // dispatch 27.4 / 27.0 us against 27.7 / 28.0, graph 26.6 / 26.3 against 27.5 / 27.2,
        // replayed-graph kernel 20.2 against 20.6; 256 tokens 36.9 / 36.7 against 37.9 / 37.6
        // (bench/results/2026-11-27_ep4-ll-poll-ab-*; 1-64 tokens, where the headers go first, were
        // not in that A/B). A longer backoff (up to 1 us, for header and payload alike: 1f64492)
        // was slower: 28.1 / 28.3 us.
        const int q_begin = part * per_part, q_end = min(payload_int4, q_begin + per_part);
        auto* payload = reinterpret_cast<int4*>(msg + kArrivalHeaderBytes);
        int4 v[kArrivalPerLane];
        bool gone = false;
        uint32_t entry = kNoDestination;
        if (lane < K) {  // the header, a word a lane
            const auto* word = reinterpret_cast<const int64_t*>(msg) + lane;
            int64_t header = ld_volatile(word);
            while (!tag_of_call(static_cast<uint64_t>(header), seq)) {
                if (!keep_waiting(w, a, src, mine)) {
                    gone = true;
                    break;
                }
                header = ld_volatile(word);
            }
            if (!gone) entry = static_cast<uint32_t>(header);
        }
        if (__any_sync(kFullMask, gone)) break;  // given up: the call is reported
        const unsigned named = __ballot_sync(kFullMask, entry != kNoDestination);
        if (named == 0) continue;  // no message from src for t
        // A word that is not the poison is this call's (the area is poisoned again before every
        // ack), so what is loaded now is kept and only the words still poisoned are polled again.
#pragma unroll
        for (int i = 0; i < kArrivalPerLane; ++i) {
            const int q = q_begin + lane + i * kWarpSize;
            if (q < q_end) v[i] = ld_volatile_int4(payload + q);
        }
        // This lane's destination (for its top-k slot): the row among its expert's rows, bounded
        // (a header is trusted no further than the counts: a peer of another shape is reported).
        const int local_e = static_cast<int>(entry >> 16), row = static_cast<int>(entry & 0xffff);
        const bool valid = entry != kNoDestination && local_e < experts_per_rank && row < unit_counts[local_e * R + src];
        const unsigned dests = __ballot_sync(kFullMask, valid);
        const int row_in_expert = valid ? begins[local_e * R + src] + row : 0;

        for (;;) {
            bool pending = false;
#pragma unroll
            for (int i = 0; i < kArrivalPerLane; ++i) {
                const int q = q_begin + lane + i * kWarpSize;
                pending |= q < q_end && payload_pending(v[i], q, data_int4, a.num_scale_cols);
            }
            if (!__any_sync(kFullMask, pending)) break;
            if (__any_sync(kFullMask, pending && !keep_waiting(w, a, src, mine))) {
                gone = true;
                break;
            }
#pragma unroll
            for (int i = 0; i < kArrivalPerLane; ++i) {
                const int q = q_begin + lane + i * kWarpSize;
                if (q < q_end && payload_pending(v[i], q, data_int4, a.num_scale_cols)) v[i] = ld_volatile_int4(payload + q);
            }
        }
        if (gone) break;
        for (unsigned d = dests; d != 0; d &= d - 1) {
            const int k = __ffs(d) - 1;
            const int e = __shfl_sync(kFullMask, local_e, k), r = __shfl_sync(kFullMask, row_in_expert, k);
            const int64_t out_row = static_cast<int64_t>(e) * N * R + r;
            auto* out = reinterpret_cast<int4*>(a.recv_data) + out_row * data_int4;
            auto* scales = reinterpret_cast<uint32_t*>(a.recv_scales) + e * a.scale_stride_e + r * a.scale_stride_row;
#pragma unroll
            for (int i = 0; i < kArrivalPerLane; ++i) {
                const int q = q_begin + lane + i * kWarpSize;
                if (q >= q_end) continue;
                if (q < data_int4) {
                    out[q] = v[i];
                } else {
                    const int col = (q - data_int4) * 4;
                    const uint32_t words[4] = {static_cast<uint32_t>(v[i].x), static_cast<uint32_t>(v[i].y),
                                               static_cast<uint32_t>(v[i].z), static_cast<uint32_t>(v[i].w)};
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        if (col + c < a.num_scale_cols) scales[(col + c) * a.scale_stride_col] = words[c];
                }
            }
            if (part == 0 && lane == 0) a.src_info[out_row] = t;
        }
        // This warp is the only reader of these words: the poison goes back for the slot's next
        // call (its senders write only after this rank's acknowledgement: pay_owed_acks).
#pragma unroll
        for (int i = 0; i < kArrivalPerLane; ++i) {
            const int q = q_begin + lane + i * kWarpSize;
            if (q < q_end) payload[q] = poison4;
        }
    }
    for (int local_e = block; local_e < experts_per_rank; local_e += grid) {  // each expert's metadata
        int sum = 0;
        for (int j = 0; j < R; ++j) sum += unit_counts[local_e * R + j];
        complete_expert(a, local_e, unit_counts + local_e * R, sum, tid, kThreads);
    }
}

// A call that may go by arrival but found its area not poisoned yet (its first of this shape in
// the slot, or after a call of another shape) poisons all of it after its receive, before the
// acknowledgement.
__device__ void poison_arrival_area(const DispatchArgs& a, const ArrivalMode& m) {
    auto* area = reinterpret_cast<int4*>(a.peers.bufs[a.rank] + m.base);
    const int64_t words = static_cast<int64_t>(a.num_ranks) * a.num_max_tokens * a.arrival_msg_bytes / 16;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < words;
         i += static_cast<int64_t>(gridDim.x) * kThreads)
        area[i] = make_int4(-1, -1, -1, -1);
}

__global__ void __launch_bounds__(kThreads, 1) dispatch_send(DispatchArgs a) {
    const Layout lay(a.slot, a.slot_bytes, a.num_experts, a.num_ranks, a.num_max_tokens, a.hidden);
    const ArrivalMode m = dispatch_mode(a, lay, a.peers.bufs[a.rank]);  // (never by arrival: a.arrival is 0)
    send_dispatch_messages(a, m, send_plan(a, m));
}

// The receive hook's kernel: one block per (local expert, source).
__global__ void __launch_bounds__(kUnitThreads, kUnitBlocksPerSm) dispatch_recv(DispatchArgs a) {
    trace_point(a.trace, 1, kTraceStart);
    uint8_t* mine = a.peers.bufs[a.rank];
    const int64_t seq = reinterpret_cast<const int64_t*>(mine + kSlotSeqOffset)[a.slot];
    const Layout lay(a.slot, a.slot_bytes, a.num_experts, a.num_ranks, a.num_max_tokens, a.hidden);
    __shared__ int counts[kMaxRanks];
    receive_dispatch_unit(a, seq, lay, blockIdx.x, 1, WarpGroup{0, kUnitThreads, 0, counts}, blockIdx.x);
    trace_point(a.trace, 1, kTraceReceived);
    finish_recv_kernel(a.peers, a.num_ranks, a.rank, a.slot, lay.acks, seq, a.mask, a.defer_acks);
    trace_point(a.trace, 1, kTraceEnd);
}

// Without a hook, one kernel sends and then receives: each block, once its sends are out, takes
// (local expert, source) units in turn. Its blocks wait for each other's signals, so it is launched
// cooperatively (every block resident at once; see the launcher). kBlockReceive: the receive role
// of receive_dispatch_units_together instead of a warp group per unit.
// receive_dispatch_balanced in place of receive_dispatch_units_together (EPCOMM_LL_BLOCK_RECEIVE's
// block receive), where no failed-rank masking is on (measured above).
constexpr bool kBalancedReceive = true;

template <bool kBlockReceive>
__global__ void __launch_bounds__(kThreads, 1) dispatch_fused(DispatchArgs a) {
    const Layout lay(a.slot, a.slot_bytes, a.num_experts, a.num_ranks, a.num_max_tokens, a.hidden);
    const ArrivalMode m = dispatch_mode(a, lay, a.peers.bufs[a.rank]);
    const SendPlan plan = send_plan(a, m);
    const int64_t seq = send_dispatch_messages(a, m, plan);
    if (m.on) {
        // (all of them sending: every block receives after its sends)
        receive_dispatch_arrival(a, m, seq, lay, plan.senders < static_cast<int>(gridDim.x) ? plan.senders : 0);
    } else if constexpr (kBlockReceive) {
        if (kBalancedReceive && a.mask == nullptr)
            receive_dispatch_balanced(a, seq, lay);
        else
            receive_dispatch_units_together(a, seq, lay);
    } else {
        // The units are split among groups of warps, enough groups that every unit has one at once
        // (288 units on 132 blocks: 4 groups of 4 warps): a block's units in turn would each add a
        // wait, a copy and two barriers to the kernel.
        const int wanted = (a.num_experts + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x);
        const int groups = wanted <= 1 ? 1 : wanted <= 2 ? 2 : wanted <= 4 ? 4 : kMaxFusedGroups;
        const int group_threads = kThreads / groups, group = static_cast<int>(threadIdx.x) / group_threads;
        __shared__ int counts[kMaxFusedGroups][kMaxRanks];
        // Barrier 0 is __syncthreads'; the groups take 1.. (a block has 16).
        const WarpGroup g{group * group_threads, group_threads, groups == 1 ? 0 : 1 + group, counts[group]};
        const int first_unit = static_cast<int>(blockIdx.x) * groups;
        for (int unit = first_unit + group; unit < a.num_experts; unit += static_cast<int>(gridDim.x) * groups)
            receive_dispatch_unit(a, seq, lay, unit, 0, g, first_unit);
    }
    if (m.poison) poison_arrival_area(a, m);
    if (a.trace != nullptr) __syncthreads();  // every copy of the block is done
    trace_point(a.trace, 0, kTraceReceived);
    finish_recv_kernel(a.peers, a.num_ranks, a.rank, a.slot, lay.acks, seq, a.mask, a.defer_acks);
    trace_point(a.trace, 0, kTraceEnd);
}

// ------------------------------------------------------------------ combine
struct CombineArgs {
    Peers peers;
    int rank, num_ranks, num_experts, num_max_tokens, hidden, num_tokens, num_topk;
    const __nv_bfloat16* x;        // [E_local, N*R, H] expert outputs, in dispatch's receive layout
    const int64_t* layout_range;   // [E_local, R] of the dispatch
    const int64_t* topk_idx;       // [T, K] the dispatch's (the handle's copy)
    const int64_t* caller_topk_idx;  // [T, K] as passed to combine (must equal the dispatch's), or nullptr
    const float* topk_weights;     // [T, K]
    const int* slot_map;           // [T, K] of the dispatch
    __nv_bfloat16* out;            // [T, H]
    int slot;
    int64_t slot_bytes;
    int chunk_tokens;              // tokens per block of the receive kernel
    int shape_tag;                 // 8-bit hash of the call's shape (every rank must make the same)
    int* mask;
    int64_t* wait_stats;           // [R] or nullptr
    int* info;
    uint64_t timeout_ns;
    int64_t* trace;                // [2, kTraceBlocks, kTracePoints] phase timeline, or nullptr
    // By partial sums (below): the slot's call counters (the dispatch's sent_pairs, 0 between calls)
    // and the bytes of a request record (request_bytes)
    int* counters;
    int request_bytes;
    uint32_t area_tag;  // the shape tag of the slot layout's dispatch area (arrival_key's high half)
    bool defer_acks;    // a call without a hook: its next call acknowledges it (pay_owed_acks)
};

// {begin, count} of a (local expert, source) unit's rows from its layout word, clamped to the
// unit's room: a layout never filled (no receive ran) cannot make a combine write elsewhere.
__device__ __forceinline__ int2 unit_rows(int64_t word, int n, int num_ranks) {
    const int begin = max(0, min(static_cast<int>(word >> 32), n * num_ranks));
    return make_int2(begin, max(0, min(static_cast<int>(word & 0xffffffff), min(n, n * num_ranks - begin))));
}

// Whether the caller's topk_idx differs from its dispatch's (the handle's copy is what the kernels
// use), compared by the `num_threads` threads from `tid`; every signal of local expert 0 carries
// the verdict (combine receives wait for every expert), so every rank sees it.
__device__ __forceinline__ bool topk_differs(const CombineArgs& a, int tid, int num_threads) {
    bool differs = false;
    if (a.caller_topk_idx != nullptr)
        for (int i = tid; i < a.num_tokens * a.num_topk; i += num_threads) differs |= a.caller_topk_idx[i] != a.topk_idx[i];
    return differs;
}

// The send role of a combine for one (local expert, source) unit, run by a whole block (any number
// of warps): the expert's outputs for that source's rows go back to it.
__device__ void send_combine_unit(const CombineArgs& a, int64_t seq, int64_t prev, const Layout& lay, int unit) {
    __shared__ bool skip;
    const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
    const int num_threads = blockDim.x, num_warps = num_threads / kWarpSize;
    const int R = a.num_ranks, me = a.rank, N = a.num_max_tokens;
    const int experts_per_rank = a.num_experts / R;
    const int rows_per_expert = N * R;
    const int row_int4 = a.hidden / 8;
    uint8_t* mine = a.peers.bufs[me];
    const int local_e = unit / R, src = unit % R;
    const int global_e = me * experts_per_rank + local_e;
    const bool remote = is_remote(a.peers, src);
    // Loaded first: in flight while the acknowledgement is waited for (after the barrier below it
    // was a memory round trip of its own).
    const int64_t word = a.layout_range[static_cast<int64_t>(local_e) * R + src];
    if (tid == 0) {
        skip = !may_write_slot(mine, lay.acks, me, src, prev, a.mask, a.timeout_ns, a.info, kOpCombine);
        // Rows for a remote source are staged in this rank's own dispatch area: its own receive of
        // the slot's previous call must be done reading it.
        if (remote && !skip) skip = !wait_ack(mine, lay.acks, me, prev, a.mask, a.timeout_ns, a.info, kOpCombine);
    }
    // The caller's topk_idx must be its dispatch's (the handle's copy is what the kernels use). The
    // blocks of local expert 0 compare them and mark their signals: every receiver waits for those
    // (combine_recv's blocks wait for every expert), so every rank sees the verdict.
    const bool differs = local_e == 0 && topk_differs(a, tid, num_threads);
    const int64_t invalid = __syncthreads_or(differs) ? kInvalidInputBit : 0;
    trace_point(a.trace, 0, kTraceReady);
    const int2 rows = unit_rows(word, N, R);
    const int begin = rows.x, count = rows.y;
    const int64_t rows_offset = lay.combine_data + static_cast<int64_t>(global_e) * N * row_int4 * 16;
    uint8_t* staging = mine + lay.data + (static_cast<int64_t>(local_e) * R + src) * N * row_int4 * 16;
    if (!skip) {
        auto* rows = reinterpret_cast<int4*>(remote ? staging : a.peers.bufs[src] + rows_offset);
        const auto* x = reinterpret_cast<const int4*>(a.x) + (static_cast<int64_t>(local_e) * rows_per_expert + begin) *
                                                              row_int4;
        const int pieces = num_pieces(row_int4);
        for (int u = warp; u < count * pieces; u += num_warps) {
            const int64_t i = u / pieces;
            copy_piece(rows + i * row_int4, x + i * row_int4, row_int4, u % pieces, lane);
        }
    }
    __syncthreads();
    trace_point(a.trace, 0, kTraceWritten);
    if constexpr (Net::kRemote) {
        if (remote && !skip && count > 0) {  // skip is the block's (shared): the whole block puts
            Net::put_block(mine + rows_offset, staging, static_cast<size_t>(count) * row_int4 * 16, src);
            __syncthreads();
            if (tid == 0) Net::quiet();  // delivered before the signal
        }
    }
    if (tid == 0 && !skip) {
        fence_sys();  // the block's rows (before the barrier) are released by the signal
        signal_peer(a.peers, me, src, lay.combine_signals + 8 * global_e, make_signal(seq, a.shape_tag, invalid, count));
    }
    trace_point(a.trace, 0, kTraceSignalled);
    __syncthreads();  // skip is reused by the block's next unit
}

// The combine kernels' sums: a warp's unit is kSumColumns 16-byte words a lane (kSumSpan words of
// the row), whose rows it loads kSumBatch at a time, all in flight together.
constexpr int kSumColumns = 2, kSumBatch = 8, kSumSpan = kSumColumns * kWarpSize;

// A warp's share of a combined row: kColumns 16-byte words a lane (8 bf16 channels each), summed
// in fp32. acc += w * row, with no fused multiply-add: the reference's rounding.
template <int kColumns>
__device__ __forceinline__ void add_weighted_row(float (&acc)[kColumns][8], const int4 (&row)[kColumns], float w) {
#pragma unroll
    for (int h = 0; h < kColumns; ++h) {
        const auto* p = reinterpret_cast<const __nv_bfloat162*>(&row[h]);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float2 f = __bfloat1622float2(p[q]);
            acc[h][2 * q] = __fadd_rn(acc[h][2 * q], __fmul_rn(w, f.x));
            acc[h][2 * q + 1] = __fadd_rn(acc[h][2 * q + 1], __fmul_rn(w, f.y));
        }
    }
}

// Rounds a warp's share of a row to bf16 and stores it: lane words base + h * 32 of `out`, within
// the row's row_int4 words.
template <int kColumns>
__device__ __forceinline__ void store_bf16_row(int4* out, const float (&acc)[kColumns][8], int base, int row_int4) {
#pragma unroll
    for (int h = 0; h < kColumns; ++h) {
        const int col = base + h * kWarpSize;
        if (col >= row_int4) continue;
        int4 o;
        auto* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
        for (int q = 0; q < 4; ++q) oh[q] = __floats2bfloat162_rn(acc[h][2 * q], acc[h][2 * q + 1]);
        out[col] = o;
    }
}

// The receive role of a combine: block b owns a range of tokens (a.chunk_tokens each): it waits for
// the blocks its pairs read, then its warps sum 256-channel columns of its tokens, in top-k slot
// order, in fp32.
__device__ void receive_combined_tokens(const CombineArgs& a, int64_t seq, const Layout& lay) {
    __shared__ int64_t pair_offset[kMaxChunkEntries];  // 16-byte word of the pair's row; -1: absent
    __shared__ float pair_weight[kMaxChunkEntries];
    __shared__ int expert_rows[kMaxExperts];            // rows each expert returned (below)
    const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
    const int R = a.num_ranks, K = a.num_topk, me = a.rank, N = a.num_max_tokens;
    const int experts_per_rank = a.num_experts / R;
    const int row_int4 = a.hidden / 8;
    uint8_t* mine = a.peers.bufs[me];
    const auto* signals = reinterpret_cast<const int64_t*>(mine + lay.combine_signals);
    const int first = blockIdx.x * a.chunk_tokens;
    const int last = min(a.num_tokens, first + a.chunk_tokens);
    const int num_pairs = max(0, last - first) * K;
    // The block's pairs (at most kMaxChunkEntries = 2 a thread) are loaded first, so that their
    // loads and the signals' below are in flight together: a pair's signal waited for after its
    // expert id arrived cost a memory round trip more.
    static_assert(kMaxChunkEntries <= 2 * kThreads, "two pairs a thread");
    int64_t pair_e[2];
    int pair_s[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int j = tid + q * kThreads;
        const int64_t i = static_cast<int64_t>(first) * K + j;
        pair_e[q] = j < num_pairs ? a.topk_idx[i] : -1;
        pair_s[q] = j < num_pairs ? a.slot_map[i] : -1;
        if (j < num_pairs) pair_weight[j] = a.topk_weights[i];
    }
    // Every expert's signal, whatever this block's tokens chose: each source signals all of its
    // experts at every call, and waiting for the few that a block's tokens skip costs nothing
    // next to a round trip; so every block also sees every source's verdict on its inputs. The
    // count is the rows the source returned (a block it skipped returns none); -1 for a masked
    // source, -2 after a timeout. Block 0 times the arrival of each source's first expert
    // (wait-cost statistics).
    for (int e = tid; e < a.num_experts; e += kThreads) {
        const int src = e / experts_per_rank;
        int count = -1;
        if (!masked(a.mask, me) && !masked(a.mask, src)) {
            uint64_t waited = 0;
            const bool timed = blockIdx.x == 0 && a.wait_stats != nullptr && e % experts_per_rank == 0;
            count = wait_signal(signals + e, seq, a.shape_tag, src, a.mask, a.timeout_ns, a.info, gave_up_word(mine),
                                kOpCombine, timed ? &waited : nullptr);
            if (timed && count >= 0)
                atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + src), static_cast<unsigned long long>(waited));
        }
        expert_rows[e] = min(count, N);  // a block's room (the 8-bit shape tag can collide)
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int j = tid + q * kThreads;
        if (j >= num_pairs) continue;
        const int64_t e = pair_e[q];
        const int s = pair_s[q];
        // present: a valid id, sent at dispatch, within the rows its source returned
        const bool present = e >= 0 && e < a.num_experts && s >= 0 && s < expert_rows[e];
        pair_offset[j] = present ? (e * N + s) * row_int4 : -1;
    }
    __syncthreads();
    trace_point(a.trace, 1, kTraceArrived);
    const auto* rows = reinterpret_cast<const int4*>(mine + lay.combine_data);
    // A warp's unit: kSumColumns 16-byte words of each lane (kSumColumns * 32 of the row), whose
    // rows it loads kSumBatch slots at a time, all in flight together, then sums in slot order.
    // 7168 channels: 14 units a token, so a block's 16 warps take a token in one memory round trip
    // per 8 slots (one word, 4 slots a time, took four).
    const int units_per_token = (row_int4 + kSumSpan - 1) / kSumSpan;
    for (int u = warp; u < (last - first) * units_per_token; u += kWarpsPerBlock) {
        const int c = u / units_per_token, base = (u % units_per_token) * kSumSpan + lane;
        const int64_t* offsets = pair_offset + c * K;
        const float* weights = pair_weight + c * K;
        float acc[kSumColumns][8] = {};
        for (int k0 = 0; k0 < K; k0 += kSumBatch) {
            int4 v[kSumBatch][kSumColumns];
#pragma unroll
            for (int d = 0; d < kSumBatch; ++d) {
                const int64_t offset = k0 + d < K ? offsets[k0 + d] : -1;
#pragma unroll
                for (int h = 0; h < kSumColumns; ++h) {
                    const int col = base + h * kWarpSize;
                    v[d][h] = offset >= 0 && col < row_int4 ? rows[offset + col] : make_int4(0, 0, 0, 0);
                }
            }
#pragma unroll
            for (int d = 0; d < kSumBatch; ++d)
                if (k0 + d < K && offsets[k0 + d] >= 0) add_weighted_row(acc, v[d], weights[k0 + d]);
        }
        store_bf16_row(reinterpret_cast<int4*>(a.out + static_cast<int64_t>(first + c) * a.hidden), acc, base, row_int4);
    }
}

// The call's send kernel: one block per (local expert, source).
__global__ void __launch_bounds__(kUnitThreads, kUnitBlocksPerSm) combine_send(CombineArgs a) {
    uint8_t* mine = a.peers.bufs[a.rank];
    const int64_t seq = next_seq(mine);
    const int64_t prev = ld_volatile(reinterpret_cast<const int64_t*>(mine + kSlotSeqOffset) + a.slot);
    if (blockIdx.x == 0 && threadIdx.x < kWarpSize) pay_owed_acks(a.peers, a.num_ranks, a.rank, a.slot_bytes, a.mask);
    const Layout lay(a.slot, a.slot_bytes, a.num_experts, a.num_ranks, a.num_max_tokens, a.hidden);
    trace_point(a.trace, 0, kTraceStart);
    send_combine_unit(a, seq, prev, lay, blockIdx.x);
    finish_send_kernel(mine, seq, a.slot, {false, 0, a.area_tag}, a.defer_acks);
    trace_point(a.trace, 0, kTraceEnd);
}

// The receive role of a combine's last kernel (combine_fused, or the hook's combine_recv): the
// block's tokens summed, then, with a hook, the slot acknowledged by the last block (without one
// the next call acknowledges it: pay_owed_acks).
__device__ __forceinline__ void receive_combine_role(const CombineArgs& a, int64_t seq, const Layout& lay) {
    trace_point(a.trace, 1, kTraceStart);
    receive_combined_tokens(a, seq, lay);
    if (a.trace != nullptr) __syncthreads();  // every sum of the block is stored
    trace_point(a.trace, 1, kTraceReceived);
    finish_recv_kernel(a.peers, a.num_ranks, a.rank, a.slot, lay.acks, seq, a.mask, a.defer_acks);
    trace_point(a.trace, 1, kTraceEnd);
}

// The send role of a fused combine (no hook, every peer mapped): block b returns the rows of its
// units b, b + grid, ... (up to kMaxFusedGroups at a time), its 16 warps sharing their pieces, and
// thread m signals unit m once the block's stores are done. Then the same blocks receive: the
// units' last stores and the receives' first waits overlap, where two kernels put the send
// kernel's drain and the receive kernel's start between them.
__device__ void send_combine_units_together(const CombineArgs& a, int64_t seq, int64_t prev, const Layout& lay) {
    __shared__ int2 rows[kMaxFusedGroups];        // {begin, count} of the batch's units
    __shared__ bool skip[kMaxFusedGroups];
    __shared__ int pieces_end[kMaxFusedGroups];   // pieces of the batch's units up to this one's (inclusive)
    const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
    const int R = a.num_ranks, me = a.rank, N = a.num_max_tokens, E = a.num_experts, grid = static_cast<int>(gridDim.x);
    const int experts_per_rank = E / R, row_int4 = a.hidden / 8, pieces = num_pieces(row_int4);
    uint8_t* mine = a.peers.bufs[me];
    const auto* x = reinterpret_cast<const int4*>(a.x);
    // The verdict on topk_idx goes with local expert 0's units (units 0 .. R-1): their blocks compare.
    const bool judges = static_cast<int>(blockIdx.x) < R;
    const int64_t invalid = __syncthreads_or(judges && topk_differs(a, tid, kThreads)) ? kInvalidInputBit : 0;
    for (int batch = blockIdx.x; batch < E; batch += grid * kMaxFusedGroups) {
        const int units = min(kMaxFusedGroups, (E - batch + grid - 1) / grid);
        if (tid < units) {  // thread m: unit m's rows, and its source's acknowledgement
            const int unit = batch + tid * grid;
            rows[tid] = unit_rows(a.layout_range[unit], N, R);  // [local expert][source] = unit
            skip[tid] = !may_write_slot(mine, lay.acks, me, unit % R, prev, a.mask, a.timeout_ns, a.info, kOpCombine);
        }
        __syncthreads();
        if (tid == 0) {
            int run = 0;
            for (int m = 0; m < units; ++m) pieces_end[m] = run += skip[m] ? 0 : rows[m].y * pieces;
        }
        __syncthreads();
        if (batch == static_cast<int>(blockIdx.x)) trace_point(a.trace, 0, kTraceReady);
        for (int f = warp; f < pieces_end[units - 1]; f += kWarpsPerBlock) {
            int m = 0;
            while (f >= pieces_end[m]) ++m;
            const int unit = batch + m * grid, within = f - (m > 0 ? pieces_end[m - 1] : 0);
            const int local_e = unit / R, src = unit % R, i = within / pieces;
            auto* out = reinterpret_cast<int4*>(a.peers.bufs[src] + lay.combine_data) +
                        (static_cast<int64_t>(me * experts_per_rank + local_e) * N + i) * row_int4;
            copy_piece(out, x + (static_cast<int64_t>(local_e) * N * R + rows[m].x + i) * row_int4, row_int4,
                       within % pieces, lane);
        }
        __syncthreads();
        if (batch == static_cast<int>(blockIdx.x)) trace_point(a.trace, 0, kTraceWritten);
        if (tid < units && !skip[tid]) {
            const int unit = batch + tid * grid, local_e = unit / R, src = unit % R;
            fence_sys();  // the block's rows (before the barrier) are released by the signal
            signal_peer(a.peers, me, src, lay.combine_signals + 8 * (me * experts_per_rank + local_e),
                        make_signal(seq, a.shape_tag, local_e == 0 ? invalid : 0, rows[tid].y));
        }
        __syncthreads();  // rows, skip and pieces_end are reused by the next batch
    }
    trace_point(a.trace, 0, kTraceSignalled);
}

// Without a hook, with every peer mapped: one cooperative kernel returns the rows and then sums
// them (its blocks wait for each other's signals: all resident at once).
__global__ void __launch_bounds__(kThreads, 1) combine_fused(CombineArgs a) {
    uint8_t* mine = a.peers.bufs[a.rank];
    const int64_t seq = next_seq(mine);
    const int64_t prev = ld_volatile(reinterpret_cast<const int64_t*>(mine + kSlotSeqOffset) + a.slot);
    if (blockIdx.x == 0 && threadIdx.x < kWarpSize) pay_owed_acks(a.peers, a.num_ranks, a.rank, a.slot_bytes, a.mask);
    const Layout lay(a.slot, a.slot_bytes, a.num_experts, a.num_ranks, a.num_max_tokens, a.hidden);
    trace_point(a.trace, 0, kTraceStart);
    send_combine_units_together(a, seq, prev, lay);
    finish_send_kernel(mine, seq, a.slot, {false, 0, a.area_tag}, a.defer_acks);
    trace_point(a.trace, 0, kTraceEnd);
    receive_combine_role(a, seq, lay);
}

// The receive hook's kernel.
__global__ void __launch_bounds__(kThreads, 1) combine_recv(CombineArgs a) {
    uint8_t* mine = a.peers.bufs[a.rank];
    const int64_t seq = reinterpret_cast<const int64_t*>(mine + kSlotSeqOffset)[a.slot];
    const Layout lay(a.slot, a.slot_bytes, a.num_experts, a.num_ranks, a.num_max_tokens, a.hidden);
    receive_combine_role(a, seq, lay);
}

// ------------------------------------------------------------------ combine by partial sums
// EPCOMM_LL_COMBINE_PARTIALS (1, or auto from 64 tokens a rank), with every peer mapped (the IPC
// transport), without a receive hook. The expert side sums,
// per (source, token), weight * row over its own experts of the token and returns one bf16 row
// per (token, rank), not one per (token, expert): at EP8 with top-8 of 288 experts 5.3 rows a
// token cross NVLink instead of 8 (-34%), at one rank one instead of 8. The weights are the
// combine's, so each source first stores, per (token, peer), the list of its pairs there (local
// expert * N + row, weight; in top-k slot order) into that peer's slot and signals every rank once
// (itself too: the signal carries the verdict on its inputs; its own pairs it reads from its arrays).
// The expert side sums in fp32 in that order and rounds to bf16; the source adds its ranks'
// partials in rank order in fp32. One rank: bitwise the reference's sum; more: within the bf16
// rounding of each partial (the issue's tolerance for combine).
// In a slot's combine area (Layout::combine_data, [E][N] rows): partials [R][N] rows (rank r's
// for token t at [r][t]), then requests [R][N] records of request_bytes (source s's for token t
// at [s][t], for t below the source's token count, which record [s][0] holds too). A record is
// tagged, so that the expert side serves each token as its record lands rather than after the
// source's signal (which a fence and the source's slowest block hold back: at EP4, 128 tokens it
// came 4.3 us after the median block's records, with NVLink idle meanwhile): a uint64 {pair count,
// call counter}, 8 bytes unused, then per pair two uint64 {local expert * N + row, counter} and
// {weight bits, counter}, stored as one 16-byte vector; record [s][0]'s unused 8 bytes: {the
// source's token count, counter}, stored first (a token past it has no record). Every 64-bit
// element is single-copy atomic (relaxed, system scope) and carries the call counter's low 32 bits,
// so an element that shows this call's counter holds this call's value, whatever order the elements
// land in; nothing else is read through them (the rows summed are this rank's own), so no acquire
// is needed.
// Signals: combine_signals[s] (source s's requests, count = its tokens; it carries the verdict on
// the source's inputs, and is waited for before the partials' signal, long after it came),
// combine_signals[R + r] (rank r's partials). The host uses the mode only where these fit
// (partials_fit in backends/cuda/low_latency.py: E >= 2R and R * (2H + request_bytes) <= E * 2H).
// counters (the slot's sent_pairs, 0 between calls): [0] blocks done with their requests, [1] a
// block saw the caller's topk_idx differ from the dispatch's, [2] blocks done with their partials,
// [3] bit r set by a block that gave up on source r's requests (timed out, or masked it): blocks
// wait on their own, so one may give up on a source whose signal another then sees.
// The send kernel is cooperative (its blocks wait for each other's signals through the peers).
constexpr int kPartialsRequestsDone = 0, kPartialsDiffers = 1, kPartialsDone = 2, kPartialsUnserved = 3;

__device__ __forceinline__ void st_relaxed_sys_v2(uint64_t* ptr, uint64_t a, uint64_t b) {
    asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(ptr), "l"(a), "l"(b) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* ptr, uint64_t a) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(a) : "memory");
}
__device__ __forceinline__ ulonglong2 ld_relaxed_sys_v2(const uint64_t* ptr) {
    ulonglong2 v;
    asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(ptr) : "memory");
    return v;
}

// Poll a request record's element `index` (0: the header; 1 + j: pair j, both of its elements;
// -1: record [s][0]'s token count) until it shows call `seq`; false once source src is given up
// on: masked, this rank gave up, its requests signal (`shape_probe`, at a place no shape moves)
// shows a call of another shape (reported: its records lie elsewhere), `timeout_ns` after `start`
// (a timeout masks src with failed-rank masking, else is reported and gives the call up, as
// wait_signal does), or `gone` (shared: another warp of the block gave up on src).
__device__ bool poll_request(const uint64_t* record, int index, int64_t seq, ulonglong2& out, int src,
                             const int64_t* shape_probe, int tag, int* mask, uint64_t start, uint64_t timeout_ns,
                             int* info, int* gave_up, volatile bool* gone) {
    const uint64_t* at = index == 0 ? record : index < 0 ? record + 1 : record + 2 * index;
    for (int spin = 0;; ++spin) {
        if (index <= 0) {
            asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(out.x) : "l"(at) : "memory");
            out.y = out.x;
        } else {
            out = ld_relaxed_sys_v2(at);
        }
        if (tag_of_call(out.x, seq) && tag_of_call(out.y, seq)) return true;
        if ((spin & 63) == 63) {
            if (*gone || masked(mask, src) || abandoned(info, gave_up, kOpCombine)) return false;
            const int64_t probe = ld_acquire_sys(shape_probe);
            if (signal_of_call(probe, seq) && ((probe >> kTagShift) & 0xff) != tag) {
                record_error(info, kErrShapeMismatch, kOpCombine, src);
                give_up(gave_up);
                return false;
            }
            if (past_deadline(info, gave_up, kOpCombine, src, mask, start, timeout_ns)) return false;
        }
    }
}

__device__ __forceinline__ int64_t partials_requests_offset(const Layout& lay, int num_ranks, int n, int hidden) {
    return lay.combine_data + static_cast<int64_t>(num_ranks) * n * hidden * 2;
}

// The send kernel's work (combine_partials_send, or the first role of combine_partials_fused);
// returns the call counter.
__device__ __forceinline__ int64_t send_partials_role(const CombineArgs& a) {
    __shared__ bool skip_dst[kMaxRanks];
    __shared__ int src_tokens[kMaxRanks];  // tokens of each source's requests; -1: they never came
    __shared__ int2 layout[kMaxExperts];    // the dispatch's {begin, count} per (local expert, source)
    const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
    const int R = a.num_ranks, K = a.num_topk, N = a.num_max_tokens, E = a.num_experts, me = a.rank;
    const int experts_per_rank = E / R, row_int4 = a.hidden / 8;
    const int grid_warps = static_cast<int>(gridDim.x) * kWarpsPerBlock;
    const int gwarp = static_cast<int>(blockIdx.x) * kWarpsPerBlock + warp;
    uint8_t* mine = a.peers.bufs[me];
    trace_point(a.trace, 0, kTraceStart);
    const int64_t seq = next_seq(mine);
    const int64_t prev = ld_volatile(reinterpret_cast<const int64_t*>(mine + kSlotSeqOffset) + a.slot);
    if (blockIdx.x == 0 && warp == 0) pay_owed_acks(a.peers, R, me, a.slot_bytes, a.mask);
    const Layout lay(a.slot, a.slot_bytes, E, R, N, a.hidden);
    const int64_t requests = partials_requests_offset(lay, R, N, a.hidden);
    const auto* signals = reinterpret_cast<const int64_t*>(mine + lay.combine_signals);

    __shared__ bool src_gone[kMaxRanks];  // a warp of the block gave up on the source's records
    if (tid < R) {  // a peer still reading the previous call of this slot must acknowledge it first
        skip_dst[tid] = !may_write_slot(mine, lay.acks, me, tid, prev, a.mask, a.timeout_ns, a.info, kOpCombine);
        src_gone[tid] = false;
    }
    for (int i = tid; i < E; i += kThreads) {
        const int64_t word = a.layout_range[i];  // [local expert][source]: a layout never filled is clamped
        const int begin = max(0, min(static_cast<int>(word >> 32), N * R));
        layout[i] = make_int2(begin, max(0, min(static_cast<int>(word & 0xffffffff), min(N, N * R - begin))));
    }
    // The caller's topk_idx must be its dispatch's (the handle's copy is the one used): every block
    // compares a share; the verdict goes into every request signal, so every rank reports it.
    bool differs = false;
    if (a.caller_topk_idx != nullptr)
        for (int i = static_cast<int>(blockIdx.x) * kThreads + tid; i < a.num_tokens * K; i += gridDim.x * kThreads)
            differs |= a.caller_topk_idx[i] != a.topk_idx[i];
    if (__syncthreads_or(differs) && tid == 0) atomicOr(a.counters + kPartialsDiffers, 1);
    trace_point(a.trace, 0, kTraceReady);

    // Requests: first this rank's token count to every peer (record [me][0]'s spare word: the peer
    // serves no token past it); then a warp per token; lane k holds pair k (K <= 32); for each peer,
    // the pairs there are stored in slot order (their rank among the ballot's lanes), each element
    // tagged with the call. This rank's own pairs need none (its round 0 below reads the same
    // arrays), only the signal, which carries the verdict.
    if (blockIdx.x == 0 && tid < R && tid != me && !skip_dst[tid])
        st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(a.peers.bufs[tid] + requests + static_cast<int64_t>(me) * N *
                                                       a.request_bytes) + 1,
                           tagged(a.num_tokens, seq));
    for (int t = gwarp; t < a.num_tokens; t += grid_warps) {
        const int64_t i = static_cast<int64_t>(t) * K + lane;
        const int64_t e = lane < K ? a.topk_idx[i] : -1;
        const int row = lane < K ? a.slot_map[i] : -1;
        const float w = lane < K ? a.topk_weights[i] : 0.f;
        const int dst = e >= 0 && e < E && row >= 0 ? static_cast<int>(e / experts_per_rank) : -1;
        for (int r = 0; r < R; ++r) {
            if (skip_dst[r] || r == me) continue;
            const unsigned pairs = __ballot_sync(kFullMask, dst == r);
            auto* record = reinterpret_cast<uint64_t*>(a.peers.bufs[r] + requests +
                                                       (static_cast<int64_t>(me) * N + t) * a.request_bytes);
            if (lane == 0) st_relaxed_sys_u64(record, tagged(__popc(pairs), seq));
            if (dst == r)
                st_relaxed_sys_v2(record + 2 * (1 + __popc(pairs & ((1u << lane) - 1))),
                                  tagged(static_cast<uint32_t>(e % experts_per_rank) * N + row, seq),
                                  tagged(__float_as_uint(w), seq));
        }
    }
    // The last block to finish its requests signals every rank: this rank's token count.
    __syncthreads();
    if (tid == 0 && atomic_add_acq_rel_gpu(a.counters + kPartialsRequestsDone, 1) == static_cast<int>(gridDim.x) - 1) {
        a.counters[kPartialsRequestsDone] = 0;
        const int64_t invalid = ld_volatile_int(a.counters + kPartialsDiffers) != 0 ? kInvalidInputBit : 0;
        a.counters[kPartialsDiffers] = 0;
        fence_sys();  // (the records need no release: they are tagged; the signal carries the verdict)
        for (int r = 0; r < R; ++r)
            if (!skip_dst[r])
                signal_peer(a.peers, me, r, lay.combine_signals + 8 * me, make_signal(seq, a.shape_tag, invalid, a.num_tokens));
    }
    trace_point(a.trace, 0, kTraceWritten);

    // A warp's task: kPartialsColumns 16-byte words a lane of one token's partial, whose rows it loads
    // kPartialsBatch at a time (a token has ~2-3 pairs on a rank at top-8 of 288: few batches). EP4
    // (4 x H100, b80a093, events / kernel us) at 64, 128, 256 tokens: 2 and 4 rows 34.2/29.6,
    // 43.7/38.8, 63.1/58.4; 2 and 8 (as the per-expert sums; 16 bytes of spills) 36.9/31.2,
    // 47.6/40.2, 64.9/59.4; 4 words and 2 rows 39.1/33.6, 45.8/40.5, 63.9/58.5.
    constexpr int kPartialsColumns = 2, kPartialsBatch = 4, kPartialsSpan = kPartialsColumns * kWarpSize;
    // Partials in rounds: round k serves source (me + k) % R, so in each round every rank writes into
    // another rank's slot (one sender per NVLink ingress; in source-major order all ranks wrote into
    // the same one). Round 0 is this rank's own tokens, planned from the caller's arrays (no request
    // to wait for) while the peers' requests travel; then each peer's tokens, each as its record
    // lands (a warp polls the record of its token: no barrier between rounds).
    // The waits share one deadline, as when they ran side by side: with failed-rank masking (a
    // timeout masks the source and the call goes on) d dead peers would otherwise cost d timeouts.
    const int units = (row_int4 + kPartialsSpan - 1) / kPartialsSpan;
    const auto* x = reinterpret_cast<const int4*>(a.x);
    const uint64_t waits_start = global_timer_ns();
    // Thread `src`, after the rounds: source src's requests signal (its verdict on its inputs), its
    // token count into src_tokens (-1: no partials signal: masked, or timed out and reported).
    auto wait_requests = [&](int src) {
        int count = -1;
        if (!skip_dst[src]) {
            const uint64_t left = a.timeout_ns - min(a.timeout_ns, global_timer_ns() - waits_start);
            count = wait_signal(signals + src, seq, a.shape_tag, src, a.mask, left, a.info, gave_up_word(mine),
                                kOpCombine, nullptr);
            count = count < 0 ? -1 : min(count, N);
        }
        src_tokens[src] = count;
        if (count < 0) atomicOr(a.counters + kPartialsUnserved, 1 << src);  // released by the block's count below
    };
    for (int k = 0; k < R; ++k) {
        const int src = (me + k) % R;
        if (k > 0 && (skip_dst[src] || src_gone[src])) continue;
        const auto* src_records = reinterpret_cast<const uint64_t*>(mine + requests + static_cast<int64_t>(src) * N *
                                                                    a.request_bytes);
        const int64_t* src_signal = signals + src;
        int tokens = skip_dst[me] ? 0 : a.num_tokens;
        if (k > 0) {  // the source's token count (lane 0 polls it, the warp takes it)
            ulonglong2 v = {};
            const bool ok = lane != 0 || poll_request(src_records, -1, seq, v, src, src_signal, a.shape_tag, a.mask,
                                                      waits_start, a.timeout_ns, a.info, gave_up_word(mine),
                                                      src_gone + src);
            if (!__shfl_sync(kFullMask, ok, 0)) {
                if (lane == 0) {
                    src_gone[src] = true;
                    atomicOr(a.counters + kPartialsUnserved, 1 << src);  // released by the block's count below
                }
                continue;
            }
            tokens = min(static_cast<int>(static_cast<uint32_t>(__shfl_sync(kFullMask, v.x, 0))), N);
        }
        // A token's units go to neighbouring warps (each polls the token's record).
        for (int f = gwarp; f < tokens * units; f += grid_warps) {
            const int t = f / units, base = (f % units) * kPartialsSpan + lane;
            // Lane j < n: pair j's place among the token's pairs here (local expert * N + row), weight
            int n, entry = -1;
            float w = 0.f;
            if (k == 0) {  // from the caller's arrays, as the requests are made
                const int64_t i = static_cast<int64_t>(t) * K + lane;
                const int64_t e = lane < K ? a.topk_idx[i] : -1;
                const int row = lane < K ? a.slot_map[i] : -1;
                const float weight = lane < K ? a.topk_weights[i] : 0.f;
                const bool here = e >= 0 && e < E && row >= 0 && static_cast<int>(e / experts_per_rank) == me;
                const unsigned pairs = __ballot_sync(kFullMask, here);
                n = __popc(pairs);
                // lane j takes the lane of the (j + 1)-th pair (slot order, as a record keeps them)
                const int from = lane < n ? static_cast<int>(__fns(pairs, 0, lane + 1)) : 0;
                const int place = here ? static_cast<int>(e % experts_per_rank) * N + row : -1;
                entry = __shfl_sync(kFullMask, place, from);
                w = __shfl_sync(kFullMask, weight, from);
                if (lane >= n) entry = -1;
            } else {
                const uint64_t* record = src_records + static_cast<int64_t>(t) * (a.request_bytes / 8);
                ulonglong2 v = {};
                bool ok = lane != 0 || poll_request(record, 0, seq, v, src, src_signal, a.shape_tag, a.mask, waits_start,
                                                    a.timeout_ns, a.info, gave_up_word(mine), src_gone + src);
                n = min(static_cast<int>(static_cast<uint32_t>(__shfl_sync(kFullMask, v.x, 0))), K);
                if (__shfl_sync(kFullMask, ok, 0) && lane < n) {
                    ok = poll_request(record, 1 + lane, seq, v, src, src_signal, a.shape_tag, a.mask, waits_start,
                                      a.timeout_ns, a.info, gave_up_word(mine), src_gone + src);
                    entry = static_cast<int>(static_cast<uint32_t>(v.x));
                    w = __uint_as_float(static_cast<uint32_t>(v.y));
                }
                if (!__all_sync(kFullMask, ok)) {  // src given up on: no more of its tokens, no signal
                    if (lane == 0) {
                        src_gone[src] = true;
                        atomicOr(a.counters + kPartialsUnserved, 1 << src);  // released by the block's count below
                    }
                    break;
                }
                if (k == 1 && f == gwarp) trace_point(a.trace, 0, kTraceArrived);  // thread 0: its first record
            }
            if (n == 0) continue;
            int64_t x_row = -1;  // lane j: pair j's row of x, -1: none (outside the dispatch's layout)
            if (entry >= 0 && entry / N < experts_per_rank) {
                const int local_e = entry / N, row = entry % N;
                const int2 place = layout[local_e * R + src];
                if (row < place.y) x_row = static_cast<int64_t>(local_e) * N * R + place.x + row;
            }
            float acc[kPartialsColumns][8] = {};
            for (int k0 = 0; k0 < n; k0 += kPartialsBatch) {
                int4 v[kPartialsBatch][kPartialsColumns];
#pragma unroll
                for (int d = 0; d < kPartialsBatch; ++d) {
                    const int64_t xr = __shfl_sync(kFullMask, x_row, min(k0 + d, kWarpSize - 1));
#pragma unroll
                    for (int h = 0; h < kPartialsColumns; ++h) {
                        const int col = base + h * kWarpSize;
                        v[d][h] = k0 + d < n && xr >= 0 && col < row_int4 ? x[xr * row_int4 + col] : make_int4(0, 0, 0, 0);
                    }
                }
#pragma unroll
                for (int d = 0; d < kPartialsBatch; ++d) {
                    const int64_t xr = __shfl_sync(kFullMask, x_row, min(k0 + d, kWarpSize - 1));
                    const float wd = __shfl_sync(kFullMask, w, min(k0 + d, kWarpSize - 1));
                    if (k0 + d < n && xr >= 0) add_weighted_row(acc, v[d], wd);
                }
            }
            store_bf16_row(reinterpret_cast<int4*>(a.peers.bufs[src] + lay.combine_data +
                                                   (static_cast<int64_t>(me) * N + t) * a.hidden * 2),
                           acc, base, row_int4);
        }
    }
    // Every source's requests signal (this rank's own too): it carries the source's verdict on its
    // inputs, which every rank records alike, and its token count; long since come, unless the
    // source is gone.
    if (tid < R) wait_requests(tid);
    // The last block to finish its partials signals every source it served (one whose requests
    // never came is not: it times out or masks this rank, rather than adding stale rows).
    __syncthreads();
    if (tid == 0 && atomic_add_acq_rel_gpu(a.counters + kPartialsDone, 1) == static_cast<int>(gridDim.x) - 1) {
        a.counters[kPartialsDone] = 0;
        const int unserved = ld_volatile_int(a.counters + kPartialsUnserved);  // by any block
        a.counters[kPartialsUnserved] = 0;
        fence_sys();  // every block's partial rows (each released by its count) before the signals
        for (int r = 0; r < R; ++r)
            if (src_tokens[r] >= 0 && !(unserved >> r & 1))
                signal_peer(a.peers, me, r, lay.combine_signals + 8 * (R + me),
                            make_signal(seq, a.shape_tag, 0, src_tokens[r]));
    }
    trace_point(a.trace, 0, kTraceSignalled);
    finish_send_kernel(mine, seq, a.slot, {false, 0, a.area_tag}, a.defer_acks);
    trace_point(a.trace, 0, kTraceEnd);
    return seq;
}

// The receive of a combine by partial sums (combine_partials_recv, or the second role of
// combine_partials_fused): block b owns a range of tokens; a token's output is the sum, in rank
// order, of the partials of the ranks its sent pairs went to.
__device__ __forceinline__ void receive_partials_role(const CombineArgs& a, int64_t seq) {
    __shared__ bool arrived[kMaxRanks];
    __shared__ unsigned token_ranks[kMaxChunkEntries];  // per token of the block: the ranks to add (bits)
    const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
    const int R = a.num_ranks, K = a.num_topk, N = a.num_max_tokens, E = a.num_experts, me = a.rank;
    const int experts_per_rank = E / R, row_int4 = a.hidden / 8;
    uint8_t* mine = a.peers.bufs[me];
    const Layout lay(a.slot, a.slot_bytes, E, R, N, a.hidden);
    trace_point(a.trace, 1, kTraceStart);
    const auto* signals = reinterpret_cast<const int64_t*>(mine + lay.combine_signals) + R;
    const int first = blockIdx.x * a.chunk_tokens;
    const int last = min(a.num_tokens, first + a.chunk_tokens);
    for (int c = tid; c < last - first; c += kThreads) token_ranks[c] = 0;
    if (tid < R) {  // every rank's partials (block 0 times the arrivals: wait-cost statistics)
        bool ok = false;
        if (!masked(a.mask, me) && !masked(a.mask, tid)) {
            uint64_t waited = 0;
            ok = wait_signal(signals + tid, seq, a.shape_tag, tid, a.mask, a.timeout_ns, a.info, gave_up_word(mine),
                             kOpCombine, &waited) >= 0;
            if (ok && blockIdx.x == 0 && a.wait_stats != nullptr)
                atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + tid), static_cast<unsigned long long>(waited));
        }
        arrived[tid] = ok;
    }
    __syncthreads();
    for (int j = tid; j < (last - first) * K; j += kThreads) {
        const int64_t i = static_cast<int64_t>(first) * K + j;
        const int64_t e = a.topk_idx[i];
        if (e < 0 || e >= E || a.slot_map[i] < 0) continue;
        const int r = static_cast<int>(e / experts_per_rank);
        if (arrived[r]) atomicOr(token_ranks + j / K, 1u << r);
    }
    __syncthreads();
    trace_point(a.trace, 1, kTraceArrived);
    const auto* partials = reinterpret_cast<const int4*>(mine + lay.combine_data);
    const int units_per_token = (row_int4 + kSumSpan - 1) / kSumSpan;
    for (int u = warp; u < (last - first) * units_per_token; u += kWarpsPerBlock) {
        const int c = u / units_per_token, base = (u % units_per_token) * kSumSpan + lane;
        const unsigned ranks = token_ranks[c];
        const int t = first + c;
        int4 v[kMaxRanks][kSumColumns];
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r)
#pragma unroll
            for (int h = 0; h < kSumColumns; ++h) {
                const int col = base + h * kWarpSize;
                v[r][h] = (ranks >> r & 1u) && col < row_int4
                              ? partials[(static_cast<int64_t>(r) * N + t) * row_int4 + col]
                              : make_int4(0, 0, 0, 0);
            }
        // The first partial is taken as it is, not added to 0: at one rank the output is then the
        // expert side's bf16 sum itself (-0 included), which is the reference's.
        float acc[kSumColumns][8] = {};
        bool first_rank = true;
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r) {
            if (!(ranks >> r & 1u)) continue;
#pragma unroll
            for (int h = 0; h < kSumColumns; ++h) {
                const auto* q = reinterpret_cast<const __nv_bfloat162*>(&v[r][h]);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float2 fv = __bfloat1622float2(q[j]);
                    acc[h][2 * j] = first_rank ? fv.x : __fadd_rn(acc[h][2 * j], fv.x);
                    acc[h][2 * j + 1] = first_rank ? fv.y : __fadd_rn(acc[h][2 * j + 1], fv.y);
                }
            }
            first_rank = false;
        }
        store_bf16_row(reinterpret_cast<int4*>(a.out + static_cast<int64_t>(t) * a.hidden), acc, base, row_int4);
    }
    if (a.trace != nullptr) __syncthreads();  // every sum of the block is stored
    trace_point(a.trace, 1, kTraceReceived);
    finish_recv_kernel(a.peers, a.num_ranks, a.rank, a.slot, lay.acks, seq, a.mask, a.defer_acks);
    trace_point(a.trace, 1, kTraceEnd);
}

__global__ void __launch_bounds__(kThreads, 1) combine_partials_send(CombineArgs a) { send_partials_role(a); }

__global__ void __launch_bounds__(kThreads, 1) combine_partials_recv(CombineArgs a) {
    receive_partials_role(a, reinterpret_cast<const int64_t*>(a.peers.bufs[a.rank] + kSlotSeqOffset)[a.slot]);
}

// Both in one cooperative kernel (kFusedPartials): the sums' waits start as a block's partials
// are out, not after the send kernel's drain and the receive kernel's start. One H100, one rank,
// graph combine: 1.2-2.5 us faster than the two kernels at 1-256 tokens (26.8 vs 29.2 us at 128).
__global__ void __launch_bounds__(kThreads, 1) combine_partials_fused(CombineArgs a) {
    receive_partials_role(a, send_partials_role(a));
}

}  // namespace ll
}  // namespace epcomm

// ---------------------------------------------------------------- host entry points (C ABI, no torch)
namespace epcomm {
namespace ll {

// The records Python fills for a call (call_record.cuh; ctypes mirrors in backends/cuda/low_latency.py,
// checked through epcomm_ll_struct_layout and epcomm_ll_struct_field_name: this file is built into
// both the IPC library, beside the intranode kernels and their epcomm_struct_layout, and the NVSHMEM
// library). A field means what the kernel argument of the same name means (DispatchArgs,
// CombineArgs); the phase to launch and the stream are arguments of their own, so the hook launches
// the record of its call unchanged.

// What every call of one rank's buffer in one slot shares.
struct LLCallContext {
    uint64_t peer_bufs;  // const uint64_t [num_ranks]: each rank's buffer as mapped here, 0 where remote
    uint64_t info;       // the slot's pinned host words
    uint64_t timeout_ns;
    int64_t slot_bytes;
    int32_t rank, num_ranks, slot, num_sms;
};

// The fields both records share come first, in the same order (set_call).
struct LLDispatchCall {
    LLCallContext context;
    uint64_t x, topk_idx, mask, wait_stats, trace;
    uint64_t sent_pairs, slot_map, topk_copy, recv_data, recv_scales, src_info, recv_count, layout_range;
    uint64_t cumulative_stats;
    int64_t scale_stride_e, scale_stride_row, scale_stride_col;
    int64_t arrival_key;  // dispatch_mode: the shape's arrival key (0: its format has no arrival area)
    int32_t num_tokens, hidden, num_topk, num_experts, num_max_tokens, shape_tag;
    int32_t use_fp8, round_scale, use_ue8m0, data_bytes, msg_bytes, num_scale_cols;
    int32_t block_receive, message_align;
    int32_t arrival, arrival_msg_bytes;  // whether the call may go by arrival (the host's half), its messages' bytes
    int32_t send_blocks;  // by arrival, the blocks that send (EPCOMM_LL_DISPATCH_SENDERS; 0: send_plan's choice)
    int32_t unused;       // (records have no implicit padding)
};

struct LLCombineCall {
    LLCallContext context;
    uint64_t x, topk_idx, mask, wait_stats, trace;
    uint64_t layout_range, caller_topk_idx, topk_weights, slot_map, out, counters;
    int64_t area_tag;  // the shape tag of the slot layout's dispatch area (ArrivalKeyUpdate)
    int32_t num_tokens, hidden, num_topk, num_experts, num_max_tokens, shape_tag;
    int32_t partials, request_bytes;  // by partial sums (combine_partials_send), and its record bytes
};

}  // namespace ll

template <>
constexpr auto fields_of<ll::LLCallContext>() {
    using S = ll::LLCallContext;
    return std::array{EPCOMM_FIELD(peer_bufs), EPCOMM_FIELD(info), EPCOMM_FIELD(timeout_ns),
                      EPCOMM_FIELD(slot_bytes), EPCOMM_FIELD(rank), EPCOMM_FIELD(num_ranks), EPCOMM_FIELD(slot),
                      EPCOMM_FIELD(num_sms)};
}
template <>
constexpr auto fields_of<ll::LLDispatchCall>() {
    using S = ll::LLDispatchCall;
    return std::array{EPCOMM_FIELD(context), EPCOMM_FIELD(x), EPCOMM_FIELD(topk_idx), EPCOMM_FIELD(mask),
                      EPCOMM_FIELD(wait_stats), EPCOMM_FIELD(trace), EPCOMM_FIELD(sent_pairs),
                      EPCOMM_FIELD(slot_map), EPCOMM_FIELD(topk_copy), EPCOMM_FIELD(recv_data),
                      EPCOMM_FIELD(recv_scales),
                      EPCOMM_FIELD(src_info), EPCOMM_FIELD(recv_count), EPCOMM_FIELD(layout_range),
                      EPCOMM_FIELD(cumulative_stats), EPCOMM_FIELD(scale_stride_e), EPCOMM_FIELD(scale_stride_row),
                      EPCOMM_FIELD(scale_stride_col), EPCOMM_FIELD(arrival_key), EPCOMM_FIELD(num_tokens),
                      EPCOMM_FIELD(hidden),
                      EPCOMM_FIELD(num_topk), EPCOMM_FIELD(num_experts), EPCOMM_FIELD(num_max_tokens),
                      EPCOMM_FIELD(shape_tag), EPCOMM_FIELD(use_fp8), EPCOMM_FIELD(round_scale),
                      EPCOMM_FIELD(use_ue8m0), EPCOMM_FIELD(data_bytes), EPCOMM_FIELD(msg_bytes),
                      EPCOMM_FIELD(num_scale_cols), EPCOMM_FIELD(block_receive),
                      EPCOMM_FIELD(message_align), EPCOMM_FIELD(arrival), EPCOMM_FIELD(arrival_msg_bytes),
                      EPCOMM_FIELD(send_blocks), EPCOMM_FIELD(unused)};
}
template <>
constexpr auto fields_of<ll::LLCombineCall>() {
    using S = ll::LLCombineCall;
    return std::array{EPCOMM_FIELD(context), EPCOMM_FIELD(x), EPCOMM_FIELD(topk_idx), EPCOMM_FIELD(mask),
                      EPCOMM_FIELD(wait_stats), EPCOMM_FIELD(trace), EPCOMM_FIELD(layout_range),
                      EPCOMM_FIELD(caller_topk_idx), EPCOMM_FIELD(topk_weights), EPCOMM_FIELD(slot_map),
                      EPCOMM_FIELD(out), EPCOMM_FIELD(counters), EPCOMM_FIELD(area_tag), EPCOMM_FIELD(num_tokens),
                      EPCOMM_FIELD(hidden),
                      EPCOMM_FIELD(num_topk), EPCOMM_FIELD(num_experts), EPCOMM_FIELD(num_max_tokens),
                      EPCOMM_FIELD(shape_tag), EPCOMM_FIELD(partials), EPCOMM_FIELD(request_bytes)};
}

}  // namespace epcomm

using namespace epcomm;

namespace {

constexpr RecordLayout kLLCallRecords[] = {record_layout<ll::LLCallContext>("LLCallContext"),
                                           record_layout<ll::LLDispatchCall>("LLDispatchCall"),
                                           record_layout<ll::LLCombineCall>("LLCombineCall")};

// Tokens per block of a kernel that owns token ranges: enough blocks to cover the SMs, and a block's
// (token, slot) pairs fit its shared arrays.
int chunk_tokens(int num_tokens, int num_topk, int num_sms) {
    int chunk = (num_tokens + num_sms - 1) / num_sms;
    const int most = ll::kMaxChunkEntries / (num_topk > 0 ? num_topk : 1);
    if (chunk > most) chunk = most;
    return chunk > 0 ? chunk : 1;
}

// The most dynamic shared memory of a dispatch's send role: its counts at kMaxExperts, which fit
// beside the kernel's static arrays (~14 KB) under the 48 KB a launch gets without opting in to more.
constexpr size_t kMaxSendShared = 2 * sizeof(int) * ll::kMaxExperts;

int num_blocks(int num_tokens, int chunk) {
    const int blocks = (num_tokens + chunk - 1) / chunk;
    return blocks > 0 ? blocks : 1;
}

// Whether `blocks` blocks of a fused kernel (kThreads each) can all be resident at once: its blocks
// wait for each other's signals, so all must run together (the cooperative launch guarantees it,
// or refuses).
// Asked once per kernel, with the most shared memory a call may use (the calls stay fast).
template <auto kKernel>
bool fits_at_once(int blocks, size_t most_shared, int num_sms) {
    static const int per_sm = [&] {
        int n = 0;
        return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, ll::kThreads, most_shared) == cudaSuccess ? n : 0;
    }();
    return blocks <= per_sm * num_sms;
}

// The low-latency kernels' cooperative launches: kThreads a block.
template <class Args>
cudaError_t launch_cooperative(void (*kernel)(Args), int blocks, size_t shared, cudaStream_t stream, const Args& a) {
    return epcomm::launch_cooperative(kernel, blocks, ll::kThreads, shared, stream, a);
}

// The kernel arguments both records give alike: the slot's context, the inputs' shapes and the
// shared pointers; and the token range of a block (from num_sms).
template <class Args, class Call>
void set_call(Args& a, const Call& c) {
    const ll::LLCallContext& ctx = c.context;
    const auto* bufs = reinterpret_cast<const uint64_t*>(static_cast<uintptr_t>(ctx.peer_bufs));
    for (int r = 0; r < ctx.num_ranks; ++r) set_ptr(a.peers.bufs[r], bufs[r]);
    a.rank = ctx.rank;
    a.num_ranks = ctx.num_ranks;
    a.slot = ctx.slot;
    a.slot_bytes = ctx.slot_bytes;
    set_ptr(a.info, ctx.info);
    a.timeout_ns = ctx.timeout_ns;
    set_ptr(a.x, c.x);
    set_ptr(a.topk_idx, c.topk_idx);
    set_ptr(a.mask, c.mask);
    set_ptr(a.wait_stats, c.wait_stats);
    set_ptr(a.trace, c.trace);
    a.num_tokens = c.num_tokens;
    a.hidden = c.hidden;
    a.num_topk = c.num_topk;
    a.num_experts = c.num_experts;
    a.num_max_tokens = c.num_max_tokens;
    a.shape_tag = c.shape_tag;
    a.chunk_tokens = chunk_tokens(c.num_tokens, c.num_topk, ctx.num_sms);
}

}  // namespace

extern "C" {

int epcomm_ll_header_bytes() { return ll::kHeaderBytes; }

int epcomm_ll_max_experts() { return ll::kMaxExperts; }

// The phase timeline's shape: int64 [2, blocks, points] per call (trace_point).
void epcomm_ll_trace_shape(int* blocks, int* points) {
    *blocks = ll::kTraceBlocks;
    *points = ll::kTracePoints;
}

// phase 1: send (and return); phase 2: receive (the hook), with the same record; phase 0: both
// in one kernel (no hook), or one after the other where its blocks cannot all be resident.
static int launch_dispatch(const ll::LLDispatchCall* call, int phase, cudaStream_t stream) {
    const ll::LLDispatchCall& c = *call;
    if (c.num_experts > ll::kMaxExperts) return static_cast<int>(cudaErrorInvalidValue);
    ll::DispatchArgs a{};
    set_call(a, c);
    a.mode = {c.use_fp8 != 0, c.round_scale != 0, c.use_ue8m0 != 0};
    a.data_bytes = c.data_bytes;
    a.msg_bytes = c.msg_bytes;
    a.message_align = c.message_align == 128 ? 128 : 16;
    a.num_scale_cols = c.num_scale_cols;
    set_ptr(a.sent_pairs, c.sent_pairs);
    set_ptr(a.slot_map, c.slot_map);
    set_ptr(a.topk_copy, c.topk_copy);
    set_ptr(a.recv_data, c.recv_data);
    set_ptr(a.recv_scales, c.recv_scales);
    a.scale_stride_e = c.scale_stride_e;
    a.scale_stride_row = c.scale_stride_row;
    a.scale_stride_col = c.scale_stride_col;
    set_ptr(a.src_info, c.src_info);
    set_ptr(a.recv_count, c.recv_count);
    set_ptr(a.layout_range, c.layout_range);
    set_ptr(a.cumulative_stats, c.cumulative_stats);
    a.arrival = phase == 0 ? c.arrival : 0;  // the fused kernel's alone (dispatch_mode)
    a.defer_acks = phase == 0;
    a.arrival_msg_bytes = c.arrival_msg_bytes;
    a.arrival_key = c.arrival_key;
    const int num_sms = c.context.num_sms, num_experts = c.num_experts;
    // The send role's counts: all pairs per expert, and those before each of a block's tokens (one
    // range a block, or one segment per token where send_plan gives senders tokens by stride).
    // Where they would not fit kMaxSendShared, or the pairs a block's arrays, the senders' count is
    // send_plan's own.
    int segments = 1, senders = c.send_blocks;
    if (senders == 0) senders = ll::auto_senders(c.num_tokens, num_sms);
    a.send_blocks = phase == 0 && c.arrival != 0 && senders > 0 && senders < num_sms ? senders : 0;
    if (a.send_blocks > 0 && c.num_tokens > a.send_blocks) {
        segments = (c.num_tokens + a.send_blocks - 1) / a.send_blocks;
        if (segments * c.num_topk > ll::kMaxChunkEntries ||
            (1 + segments) * sizeof(int) * static_cast<size_t>(num_experts) > kMaxSendShared)
            a.send_blocks = 0, segments = 1;
    }
    const size_t shared = (1 + segments) * sizeof(int) * static_cast<size_t>(num_experts);
    const bool together = c.block_receive != 0;
    if (phase == 0 && num_blocks(c.num_tokens, a.chunk_tokens) <= num_sms &&
        (together ? fits_at_once<ll::dispatch_fused<true>>(num_sms, kMaxSendShared, num_sms)
                  : fits_at_once<ll::dispatch_fused<false>>(num_sms, kMaxSendShared, num_sms))) {
        const cudaError_t launched = together ? launch_cooperative(ll::dispatch_fused<true>, num_sms, shared, stream, a)
                                              : launch_cooperative(ll::dispatch_fused<false>, num_sms, shared, stream, a);
        if (launched != cudaErrorCooperativeLaunchTooLarge) return static_cast<int>(launched);
        // Fewer SMs than the device has are ours (MPS, green contexts): the two kernels instead.
        (void)cudaGetLastError();
    }
    a.arrival = 0;
    // The hook's send: a block per token range (no token parts: idle blocks would spin on the
    // acknowledgements on every SM, and a hook's send must leave the SMs to the work beside it).
    if (phase != 2)
        ll::dispatch_send<<<num_blocks(c.num_tokens, a.chunk_tokens), ll::kThreads, shared, stream>>>(a);
    if (phase != 1)
        ll::dispatch_recv<<<num_experts > 0 ? num_experts : 1, ll::kUnitThreads, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

// Whether a dispatch without a hook can run as one cooperative kernel here (dispatch_fused, either
// receive, one block per SM with the most shared memory a call uses); else every such call takes
// the two kernels (measured: 36.0 against ~30 us at EP4, 128 tokens), which the tests must see.
int epcomm_ll_dispatch_fused_fit(int num_sms) {
    return fits_at_once<ll::dispatch_fused<true>>(num_sms, kMaxSendShared, num_sms) &&
                   fits_at_once<ll::dispatch_fused<false>>(num_sms, kMaxSendShared, num_sms)
               ? 1
               : 0;
}

// Whether a combine by partial sums can launch here: its send kernel fits one block per SM of the
// device (registers, shared memory). Not whether the process may use every SM: under MPS or green
// contexts the cooperative launch can still be refused at the call, which then raises.
int epcomm_ll_combine_partials_fit(int num_sms) {
    return fits_at_once<ll::combine_partials_send>(num_sms, 0, num_sms) ? 1 : 0;
}

// A combine without a hook as one cooperative kernel (combine_fused) rather than two; the same for
// a combine by partial sums (combine_partials_fused).
constexpr bool kFusedCombine = true;
constexpr bool kFusedPartials = true;

// phases as in launch_dispatch
static int launch_combine(const ll::LLCombineCall* call, int phase, cudaStream_t stream) {
    const ll::LLCombineCall& c = *call;
    ll::CombineArgs a{};
    set_call(a, c);
    set_ptr(a.layout_range, c.layout_range);
    set_ptr(a.caller_topk_idx, c.caller_topk_idx);
    set_ptr(a.topk_weights, c.topk_weights);
    set_ptr(a.slot_map, c.slot_map);
    set_ptr(a.out, c.out);
    set_ptr(a.counters, c.counters);
    a.request_bytes = c.request_bytes;
    a.area_tag = static_cast<uint32_t>(c.area_tag);
    a.defer_acks = phase == 0;
    const int num_experts = c.num_experts;
    if (c.partials != 0) {
        // Its blocks wait for each other through the peers: all resident at once, or not launched
        // (the host then raises; fewer SMs than the device has, under MPS or green contexts).
        const int num_sms = c.context.num_sms;
        if (kFusedPartials && phase == 0 && num_blocks(c.num_tokens, a.chunk_tokens) <= num_sms &&
            fits_at_once<ll::combine_partials_fused>(num_sms, 0, num_sms))
            return static_cast<int>(launch_cooperative(ll::combine_partials_fused, num_sms, 0, stream, a));
        if (phase != 2) {
            if (!fits_at_once<ll::combine_partials_send>(num_sms, 0, num_sms))
                return static_cast<int>(cudaErrorCooperativeLaunchTooLarge);
            const cudaError_t launched = launch_cooperative(ll::combine_partials_send, num_sms, 0, stream, a);
            if (launched != cudaSuccess) return static_cast<int>(launched);
        }
        if (phase != 1) ll::combine_partials_recv<<<num_blocks(c.num_tokens, a.chunk_tokens), ll::kThreads, 0, stream>>>(a);
        return static_cast<int>(cudaGetLastError());
    }
    // Phase 0 with every peer mapped: one cooperative kernel (combine_fused), where it fits.
    const int num_sms = c.context.num_sms;
    bool any_remote = false;
    for (int r = 0; r < a.num_ranks; ++r) any_remote |= a.peers.bufs[r] == nullptr;
    if (kFusedCombine && phase == 0 && !any_remote && num_blocks(c.num_tokens, a.chunk_tokens) <= num_sms &&
        fits_at_once<ll::combine_fused>(num_sms, 0, num_sms)) {
        const cudaError_t launched = launch_cooperative(ll::combine_fused, num_sms, 0, stream, a);
        if (launched != cudaErrorCooperativeLaunchTooLarge) return static_cast<int>(launched);
        (void)cudaGetLastError();  // fewer SMs than the device has are ours: the two kernels instead
    }
    if (phase != 2) ll::combine_send<<<num_experts > 0 ? num_experts : 1, ll::kUnitThreads, 0, stream>>>(a);
    if (phase != 1) ll::combine_recv<<<num_blocks(c.num_tokens, a.chunk_tokens), ll::kThreads, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

// A call's kernels of `phase`, then `done` recorded on the stream after them (nullptr: none): the
// event the host waits on before it reads the slot's error record (after a receive), or the one a
// receive hook on another stream waits on (after a send). Recorded here, the host needs no stream
// object per call (an eager call's host time is what an eager decode step waits on).
int epcomm_ll_dispatch(const ll::LLDispatchCall* call, int phase, cudaStream_t stream, cudaEvent_t done) {
    const int launched = launch_dispatch(call, phase, stream);
    if (launched != 0 || done == nullptr) return launched;
    return static_cast<int>(cudaEventRecord(done, stream));
}

int epcomm_ll_combine(const ll::LLCombineCall* call, int phase, cudaStream_t stream, cudaEvent_t done) {
    const int launched = launch_combine(call, phase, stream);
    if (launched != 0 || done == nullptr) return launched;
    return static_cast<int>(cudaEventRecord(done, stream));
}

// The buffer's events (two per slot), on the current device, without timing.
int epcomm_ll_event_create(cudaEvent_t* event) {
    return static_cast<int>(cudaEventCreateWithFlags(event, cudaEventDisableTiming));
}

int epcomm_ll_event_synchronize(cudaEvent_t event) { return static_cast<int>(cudaEventSynchronize(event)); }

int epcomm_ll_stream_wait_event(cudaStream_t stream, cudaEvent_t event) {
    return static_cast<int>(cudaStreamWaitEvent(stream, event, 0));
}

int epcomm_ll_event_destroy(cudaEvent_t event) { return static_cast<int>(cudaEventDestroy(event)); }

// The layout and field names of call record `name` (LLCallContext, LLDispatchCall, LLCombineCall):
// write_record_layout and record_field_name (call_record.cuh) say what they return.
int epcomm_ll_struct_layout(const char* name, int64_t* out, int max) {
    return write_record_layout(kLLCallRecords, name, out, max);
}

const char* epcomm_ll_struct_field_name(const char* name, int index) {
    return record_field_name(kLLCallRecords, name, index);
}

}  // extern "C"
