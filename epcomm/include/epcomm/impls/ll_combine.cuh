// Low-latency combine: every (local expert, source) unit returns its rows to the source, which sums
// weight * row per token over its top-k slots in slot order, in fp32.
#pragma once

#include "ll_dispatch_send.cuh"  // the tagged words of messages by arrival

namespace epcomm {
namespace ll {

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
    int phase;          // Phase
    bool units_together;  // the send's units a block's batch at a time (every peer mapped; else one a block)
    // Single-batch overlap (combine<true>; unused elsewhere): a unit's rows go once the expert
    // GEMM has raised the words of their blocks (block_m rows of a local expert each) to `threshold`.
    const uint32_t* computed;      // [E_local][signals_per_expert]: comp_signal, or src_signals (one an expert)
    const int* packed_recv_count;  // [E_local] the rows the GEMM computes (comp_signal), or nullptr
    int block_m, signals_per_expert;
    uint32_t threshold;
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

// Single-batch overlap: whether the caller's packed_recv_count differs from the rows the dispatch
// gave each local expert (the end of its last source's rows), compared by `num_threads` threads from
// `tid`. Carried like topk_differs' verdict: a GEMM told other counts computes other rows.
__device__ __forceinline__ bool counts_differ(const CombineArgs& a, int tid, int num_threads) {
    bool differs = false;
    const int R = a.num_ranks, N = a.num_max_tokens;
    if (a.packed_recv_count != nullptr)
        for (int e = tid; e < a.num_experts / R; e += num_threads) {
            const int2 last = unit_rows(a.layout_range[static_cast<int64_t>(e) * R + R - 1], N, R);
            differs |= a.packed_recv_count[e] != last.x + last.y;
        }
    return differs;
}

// Single-batch overlap, by one thread: wait until the expert GEMM has raised the word of every block
// of block_m rows that holds some of local expert local_e's rows [begin, begin + count) to the
// threshold (with comp_signal only the blocks it computes: below packed_recv_count). The word is
// read with an acquire, so the rows it covers are read after it (the block's barrier passes that on).
// Bounded: a GEMM that never raises one is reported (kErrComputeTimeout) and this rank gives up;
// false then, or when another wait of this rank gave up.
__device__ bool wait_computed(const CombineArgs& a, int local_e, int begin, int count) {
    int end = begin + count;
    if (a.packed_recv_count != nullptr) end = min(end, a.packed_recv_count[local_e]);
    const uint32_t* words = a.computed + static_cast<int64_t>(local_e) * a.signals_per_expert;
    int* gave_up = gave_up_word(a.peers.bufs[a.rank]);
    const uint64_t start = global_timer_ns();
    for (int b = begin / a.block_m; b * a.block_m < end && b < a.signals_per_expert; ++b) {
        const WaitEnd waited = bounded_wait<64>(
            start, a.timeout_ns, [&] { return ld_acquire_gpu_u32(words + b) >= a.threshold; },
            [&] { return abandoned(a.info, gave_up, kOpLowLatencyCombine); });
        if (waited == WaitEnd::kTimedOut) {
            record_error(a.info, kErrComputeTimeout, kOpLowLatencyCombine, a.rank, kPhaseSend);
            give_up(gave_up);
        }
        if (waited != WaitEnd::kReady) return false;
    }
    return true;
}

// The send role of a combine for one (local expert, source) unit, run by a whole block (any number
// of warps): the expert's outputs for that source's rows go back to it. kOverlap: once the expert
// GEMM has computed them (wait_computed).
template <bool kOverlap>
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
        skip = !may_write_slot(mine, lay.acks, me, src, prev, a.mask, a.timeout_ns, a.info, kOpLowLatencyCombine);
        // Rows for a remote source are staged in this rank's own dispatch area: its own receive of
        // the slot's previous call must be done reading it.
        if (remote && !skip) skip = !wait_ack(mine, lay.acks, me, prev, a.mask, a.timeout_ns, a.info, kOpLowLatencyCombine);
        if constexpr (kOverlap) {
            const int2 rows = unit_rows(word, N, R);
            if (!skip && rows.y > 0) skip = !wait_computed(a, local_e, rows.x, rows.y);
        }
    }
    // The caller's topk_idx must be its dispatch's (the handle's copy is what the kernels use). The
    // blocks of local expert 0 compare them and mark their signals: every receiver waits for those
    // (the receive's blocks wait for every expert), so every rank sees the verdict.
    bool differs = local_e == 0 && topk_differs(a, tid, num_threads);
    if constexpr (kOverlap) differs |= local_e == 0 && counts_differ(a, tid, num_threads);
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
    if constexpr (kNetReachesUnmapped) {
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
                                kOpLowLatencyCombine, timed ? &waited : nullptr);
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

// The receive role of the combine kernel (after its send, or in the hook's launch): the
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

// The send role of a combine with every peer mapped: block b returns the rows of its
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
            skip[tid] = !may_write_slot(mine, lay.acks, me, unit % R, prev, a.mask, a.timeout_ns, a.info, kOpLowLatencyCombine);
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

// The low-latency combine kernel, launched as the dispatch kernel is: once with both phases (no
// hook; cooperative, every peer mapped: the units a batch at a time, then the same blocks sum), or
// the send and then the hook's receive. A send by units one at a time (peers reached through Net)
// runs a block per (local expert, source); with single-batch overlap, beside the expert GEMM on
// as few blocks as the caller leaves it (kOverlap), block b takes the units b, b + grid, ... in order
// (local expert-major, the order a grouped GEMM computes them in), each once the GEMM has computed
// its rows.
template <bool kOverlap>
__global__ void __launch_bounds__(kThreads, 1) combine(CombineArgs a) {
    uint8_t* mine = a.peers.bufs[a.rank];
    const Layout lay(a.slot, a.slot_bytes, a.num_experts, a.num_ranks, a.num_max_tokens, a.hidden);
    int64_t seq;
    if (a.phase == kReceivePhase) {
        seq = *slot_seq(mine, a.slot);
    } else {
        seq = next_seq(mine);
        const int64_t prev = ld_volatile(slot_seq(mine, a.slot));
        if (blockIdx.x == 0 && threadIdx.x < kWarpSize) pay_owed_acks(a.peers, a.num_ranks, a.rank, a.slot_bytes, a.mask);
        trace_point(a.trace, 0, kTraceStart);
        if (!kOverlap && a.units_together) {
            send_combine_units_together(a, seq, prev, lay);
        } else {
            for (int unit = blockIdx.x; unit < a.num_experts; unit += gridDim.x)
                send_combine_unit<kOverlap>(a, seq, prev, lay, unit);
        }
        finish_send_kernel(mine, seq, a.slot, {false, 0, a.area_tag}, a.defer_acks);
        trace_point(a.trace, 0, kTraceEnd);
        if (a.phase == kSendPhase) return;
    }
    receive_combine_role(a, seq, lay);
}

}  // namespace ll
}  // namespace epcomm
