// Low-latency dispatch, receive side: a warp group per (local expert, source) unit, a block's units
// together, balanced over blocks, or by arrival (each message taken as it lands).
#pragma once

#include "ll_dispatch_send.cuh"

namespace epcomm {
namespace ll {

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
                            kOpLowLatencyDispatch, &waited, tag < 0);
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

// The dispatch kernel's receive role for calls with many rows per unit (the host's choice:
// EPCOMM_LL_BLOCK_RECEIVE): a block takes its units (unit blockIdx.x + m * gridDim.x)
// kMaxFusedGroups at a time, waits for all of their counts, and its 16 warps share their messages'
// pieces, instead of each unit's group of warps copying its own rows, where the unit with the
// most rows sets the kernel's end (random top-8 of 288 at 128 tokens: ~11 rows against 3.6 on
// average, copied by 4 warps while the block's other warps idle). With few rows the wait for
// every unit's count first costs more than it saves (docs/TUNING.md, block receive auto).
__device__ void receive_dispatch_units_together(const DispatchArgs& a, int64_t seq, const Layout& lay, int plane) {
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
        if (batch == static_cast<int>(blockIdx.x)) trace_point(a.trace, plane, kTraceArrived);
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

// The block receive of the dispatch kernel (without a mask): the rows spread evenly
// over the whole grid instead of by (expert, source) unit, whose batches left the last block
// copying well after the median one (docs/TUNING.md, balanced fused receive). Every block waits for
// all units' counts (they arrive close together), numbers their messages' pieces in unit order and
// takes an equal contiguous share. Blocks must agree on every count, so only without failed-rank
// masking (a rank masked mid-call reads as 0 to the blocks that look later); a timeout or a shape
// mismatch gives the call up, whose outputs are invalid anyway.
__device__ void receive_dispatch_balanced(const DispatchArgs& a, int64_t seq, const Layout& lay, int plane) {
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
    trace_point(a.trace, plane, kTraceArrived);
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

// Between two polls of a word not there yet: a short sleep (the words land over several
// microseconds; polling them all back to back would flood L2 while NVLink writes into it), and the
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
    if (abandoned(a.info, gave_up, kOpLowLatencyDispatch)) return false;
    if (global_timer_ns() - w.start <= a.timeout_ns) return true;
    timed_out(a.info, gave_up, kOpLowLatencyDispatch, src, nullptr, kPhaseReceive);
    return false;
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
        // The part's payload words are loaded once the header is here, not with its first poll: a
        // warp mostly reaches its item before its message lands, so that early load found poison
        // and was thrown away, and the warp slept (its grown backoff) before loading again. Where
        // the senders go by stride a token's headers follow its data, so the payload is (nearly
        // all) there with its header (docs/TUNING.md, arrival payload loaded after its header).
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

}  // namespace ll
}  // namespace epcomm
