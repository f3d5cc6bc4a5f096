// Low-latency combine by partial sums: the expert side sums each token's rows over its own experts
// and returns one row per (token, rank); the source adds the ranks' partials in rank order.
#pragma once

#include "ll_combine.cuh"

namespace epcomm {
namespace ll {

// ------------------------------------------------------------------ combine by partial sums
// EPCOMM_LL_COMBINE_PARTIALS (1, or auto from 64 tokens a rank), every peer mapped (the IPC
// transport), no receive hook. Why: one bf16 row per (token, rank) crosses NVLink, not one per
// (token, expert): at EP8 with top-8 of 288 experts ~5.3 rows a token instead of 8. The weights are
// the combine's, so each source first sends each peer request records (its pairs there and their
// weights, in top-k slot order); the expert side sums in fp32 in that order and rounds to bf16; the
// source adds the partials in rank order (one rank: bitwise the reference's sum; more: within each
// partial's bf16 rounding). Each 64-bit element of a record is single-copy atomic (relaxed, system
// scope) and carries the call counter, so a token is served as its record lands, not after the
// source's signal (held back by a fence and the slowest block), and needs no acquire (nothing else
// is read through it). Areas, record format, signals, when the host picks it: docs/DESIGN.md.

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
    const WaitEnd end = bounded_wait<64>(
        start, timeout_ns,
        [&] {
            if (index <= 0) {
                asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(out.x) : "l"(at) : "memory");
                out.y = out.x;
            } else {
                out = ld_relaxed_sys_v2(at);
            }
            return tag_of_call(out.x, seq) && tag_of_call(out.y, seq);
        },
        [&] {
            if (*gone || masked(mask, src) || abandoned(info, gave_up, kOpLowLatencyCombine)) return true;
            const int64_t probe = ld_acquire_sys(shape_probe);
            if (!signal_of_call(probe, seq) || ((probe >> kTagShift) & 0xff) == tag) return false;
            record_error(info, kErrShapes, kOpLowLatencyCombine, src);
            give_up(gave_up);
            return true;
        });
    if (end == WaitEnd::kTimedOut) timed_out(info, gave_up, kOpLowLatencyCombine, src, mask, kPhaseSend);
    return end == WaitEnd::kReady;
}

__device__ __forceinline__ int64_t partials_requests_offset(const Layout& lay, int num_ranks, int n, int hidden) {
    return lay.combine_data + static_cast<int64_t>(num_ranks) * n * hidden * 2;
}

// The send phase of combine_partials; returns the call counter.
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
    const int64_t prev = ld_volatile(slot_seq(mine, a.slot));
    if (blockIdx.x == 0 && warp == 0) pay_owed_acks(a.peers, R, me, a.slot_bytes, a.mask);
    const Layout lay(a.slot, a.slot_bytes, E, R, N, a.hidden);
    const int64_t requests = partials_requests_offset(lay, R, N, a.hidden);
    const auto* signals = reinterpret_cast<const int64_t*>(mine + lay.combine_signals);

    __shared__ bool src_gone[kMaxRanks];  // a warp of the block gave up on the source's records
    if (tid < R) {  // a peer still reading the previous call of this slot must acknowledge it first
        skip_dst[tid] = !may_write_slot(mine, lay.acks, me, tid, prev, a.mask, a.timeout_ns, a.info, kOpLowLatencyCombine);
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
    // kPartialsBatch at a time (a token has ~2-3 pairs on a rank at top-8 of 288: few batches); 2
    // words and 4 rows beat 2 and 8 (which spills) and 4 and 2 (docs/TUNING.md).
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
                                kOpLowLatencyCombine, nullptr, true, kPhaseSend);
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

// The receive phase of combine_partials: block b owns a range of tokens; a token's output is the sum, in rank
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
                             kOpLowLatencyCombine, &waited) >= 0;
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

// The combine by partial sums: both phases in one cooperative launch (the send's blocks wait for
// each other through the peers), whose sums' waits start as a block's partials are out, not after
// a send launch's drain and a receive launch's start (docs/TUNING.md, fused partials combine); or,
// where a call's token blocks outnumber the SMs, the send and the receive in two launches.
__global__ void __launch_bounds__(kThreads, 1) combine_partials(CombineArgs a) {
    const int64_t seq = a.phase == kReceivePhase ? *slot_seq(a.peers.bufs[a.rank], a.slot) : send_partials_role(a);
    if (a.phase != kSendPhase) receive_partials_role(a, seq);
}

}  // namespace ll
}  // namespace epcomm
