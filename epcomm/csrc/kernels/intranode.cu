// Normal-mode kernels inside one NVLink domain.
//
// Every rank's communication buffer is mapped into every other rank's address space (CUDA IPC), so
// a sender stores token rows straight into the receiver's buffer over NVLink. A call is two
// kernels on the caller's stream, with no host round trip between them except where the API asks
// for one (the receive counts of a dispatch without num_worst_tokens):
//   notify:  advance the call counter, exchange the rank-by-rank row counts and per-expert counts,
//            validate the inputs, meet every peer at a bounded system-scope barrier, and derive
//            where every row goes (the "layout");
//   main:    half of the blocks send (each warp one token or one row), the other half receive,
//            row by row, as soon as each row's flag shows it has landed, so the copy out of the
//            buffer overlaps the NVLink transfer.
// A row's flag is the last 16 bytes of its slot and holds `call counter ^ kFlagMagic` once the
// row is complete; counters only grow, so flags never need resetting (CUDA-graph replays too).
//
// Layout of each rank's buffer (bytes):
//   [0, 64)        barrier signals, int64 per source rank: call counter * 16 + op code
//   [64, 128)      local state: call counter, abort word
//   [128, 640)     row-count matrix int32 [2 parities][src][dst]
//   [640, 1024)    header of each source int32 [2][src][6]: refusal bits, num_worst_tokens, row bytes
//                  (a fresh dispatch's), shape key, op code (every op's)
//   [1024, ...)    per-expert counts int32 [2][src][kMaxExpertsPerRank]
//   [66560, +1024) the notify kernel's scratch (this rank's only): its blocks' row counts
//   [kRowsOffset,) row slots: dispatch rows in output order; combine rows per (dst, slot)
// Count regions alternate by call parity: a fast rank can be at most one barrier ahead of a slow
// one, so it never overwrites counts the slow one still reads.
#include "../../include/epcomm/call_record.cuh"
#include "../../include/epcomm/common.cuh"
#include "../../include/epcomm/row_order.cuh"
#include "../../include/epcomm/row_sum.cuh"
#include "../../include/epcomm/tma.cuh"

#include <algorithm>
#include <cooperative_groups.h>
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstring>

namespace epcomm {

constexpr int kSignalOffset = 0;
constexpr int kSeqOffset = 64;
constexpr int kAbortOffset = 72;
constexpr int kMatrixOffset = 128;
constexpr int kHeaderOffset = 640;
// Per (parity, source rank): a fresh dispatch's refusal bits, num_worst_tokens and row bytes; every
// op's shape key and op code (read after the barrier, also when the source has gone on to its next call).
constexpr int kHeaderInts = 6;
constexpr int kExpertCountOffset = 1024;
static_assert(kHeaderOffset + 2 * kMaxRanks * kHeaderInts * 4 <= kExpertCountOffset, "the headers outgrew their area");
constexpr int kMaxExpertsPerRank = 1024;
// This rank's alone: the notify kernel's blocks' totals (int32 [kMaxNotifyBlocks][kMaxRanks + 1]).
constexpr int kNotifyScratchOffset = kExpertCountOffset + 2 * kMaxRanks * kMaxExpertsPerRank * 4;  // 66560
constexpr int kMaxNotifyBlocks = 16, kNotifyScratchStride = kMaxRanks + 1;
constexpr int kRowsOffset = kNotifyScratchOffset + 1024;  // 67584
static_assert(kMaxNotifyBlocks * kNotifyScratchStride * 4 <= 1024, "the notify scratch outgrew its area");
constexpr int kRowTrailerBytes = 16;  // flag (int64) + padding, at the end of every row slot
constexpr int64_t kFlagMagic = 0x5e9c0a11f1a90000LL;

// Op codes carried by the barrier signals: ranks that disagree on the call are told so.
constexpr int kOpDispatch = 1, kOpCachedDispatch = 2, kOpCombine = 3, kOpBarrier = 4;

// Pinned host words written by the kernels and read by the CPU at its sync points.
constexpr int kInfoError = 0;        // 0, or an ErrorCode
constexpr int kInfoErrorOp = 1;      // op code of the call that failed
constexpr int kInfoErrorRanks = 2;   // [kMaxRanks]: ranks involved (waited for; mismatched op code)
constexpr int kInfoNumRecv = 16;
constexpr int kInfoRecvCounts = 17;  // [kMaxRanks]
constexpr int kInfoMaxRecv = 25;     // most rows any rank receives (the host's one-pass check)
constexpr int kInfoMaxSend = 26;     // most rows any rank sends
constexpr int kInfoMatrix = 32;      // [kMaxRanks * kMaxRanks]
constexpr int kInfoRefusal = 96;     // [kMaxRanks]
constexpr int kInfoExperts = 128;    // [kMaxExpertsPerRank]
constexpr int kInfoInts = kInfoExperts + kMaxExpertsPerRank;
enum ErrorCode {
    kErrTimeout = 1, kErrMismatch = 2, kErrCapacity = 3, kErrWorstTokens = 4, kErrRefused = 5, kErrShapes = 6
};
// Refusal bits (input validation on the device, so no host sync is needed for it).
constexpr int kRefuseTopkRange = 1, kRefuseRankCounts = 2, kRefuseShapes = 4, kRefuseWorstTokens = 8;

// Device layout of one dispatch (int32), kept in the handle for cached dispatch and combine.
constexpr int kLayDstBase = 0;    // [R]: where this rank's rows start in each destination's output
constexpr int kLayRecvOff = 8;    // [R + 1]: where each source's rows start in this rank's output
constexpr int kLayCombBase = 24;  // [R]: where the rows destination d returns start in this buffer
constexpr int kLayRetBase = 32;   // [R]: where this rank's returned rows start in source s's buffer
constexpr int kLayMaxRecv = 40;   // most rows any rank receives in dispatch
constexpr int kLayMaxSend = 41;   // most rows any rank sends (= receives back in combine)
constexpr int kLayAbort = 42;     // nonzero: some rank refused its inputs, nothing moves
constexpr int kLayoutInts = 48;

struct PeerTable {
    uint8_t* bufs[kMaxRanks];  // base of each rank's buffer in this process's address space
};

__device__ __forceinline__ int64_t* seq_word(uint8_t* buf) { return reinterpret_cast<int64_t*>(buf + kSeqOffset); }
__device__ __forceinline__ int64_t* abort_word(uint8_t* buf) {
    return reinterpret_cast<int64_t*>(buf + kAbortOffset);
}

__device__ void report_error(int* info, int code, int op, int rank_involved) {
    info[kInfoError] = code;
    info[kInfoErrorOp] = op;
    if (rank_involved >= 0) info[kInfoErrorRanks + rank_involved] = 1;
}

// Wait until a row's flag shows `want`. Bounded: gives up when the abort word shows this call
// (another warp timed out) or after `timeout_ns`, then records who was waited for and aborts.
__device__ __forceinline__ bool wait_row_flag(const int64_t* flag, int64_t want, uint8_t* my_buf, int64_t seq,
                                              uint64_t timeout_ns, int* info, int op, int src) {
    if (ld_acquire_sys(flag) == want) return true;
    const uint64_t start = global_timer_ns();
    for (int spin = 0;; ++spin) {
        if (ld_acquire_sys(flag) == want) return true;
        if ((spin & 255) == 255) {
            if (ld_volatile(abort_word(my_buf)) == seq) return false;
            if (global_timer_ns() - start > timeout_ns) {
                *abort_word(my_buf) = seq;
                report_error(info, kErrTimeout, op, src);
                return false;
            }
        }
    }
}

// ------------------------------------------------------------------ get_dispatch_layout
// One thread per token; block-level counts in shared memory, then one global atomic per counter.
__global__ void layout_kernel(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                              int ranks_per_domain, int* per_rank, int* per_domain, int* per_expert, bool* in_rank) {
    extern __shared__ int s_counts[];  // [experts | ranks | domains]
    const int num_domains = num_ranks / ranks_per_domain;
    const int num_counters = num_experts + num_ranks + num_domains;
    for (int i = threadIdx.x; i < num_counters; i += blockDim.x) s_counts[i] = 0;
    __syncthreads();
    const int experts_per_rank = num_experts / num_ranks;
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < num_tokens) {
        unsigned rank_mask = 0;
        for (int k = 0; k < num_topk; ++k) {
            const int64_t e = topk_idx[static_cast<int64_t>(t) * num_topk + k];
            if (e < 0 || e >= num_experts) continue;  // out of range: refused by dispatch's validation
            atomicAdd(&s_counts[e], 1);
            rank_mask |= 1u << (e / experts_per_rank);
        }
        unsigned domain_mask = 0;
        for (int r = 0; r < num_ranks; ++r) {
            const bool hit = rank_mask >> r & 1u;
            in_rank[static_cast<int64_t>(t) * num_ranks + r] = hit;
            if (hit) {
                atomicAdd(&s_counts[num_experts + r], 1);
                domain_mask |= 1u << (r / ranks_per_domain);
            }
        }
        if (per_domain != nullptr)
            for (int d = 0; d < num_domains; ++d)
                if (domain_mask >> d & 1u) atomicAdd(&s_counts[num_experts + num_ranks + d], 1);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < num_counters; i += blockDim.x) {
        const int c = s_counts[i];
        if (c == 0) continue;
        if (i < num_experts) atomicAdd(&per_expert[i], c);
        else if (i < num_experts + num_ranks) atomicAdd(&per_rank[i - num_experts], c);
        else if (per_domain != nullptr) atomicAdd(&per_domain[i - num_experts - num_ranks], c);
    }
}

// ------------------------------------------------------------------ notify (count exchange + barrier)
struct NotifyArgs {
    PeerTable peers;
    int rank, num_ranks, op;
    // Count exchange (fresh dispatch only; in_rank == nullptr for the other ops).
    int num_tokens;
    const bool* in_rank;        // [T, R]
    const int* send_counts;     // [R]  num_tokens_per_rank, checked against in_rank
    const int* expert_counts;   // [E]  num_tokens_per_expert
    int experts_per_rank;
    const int64_t* topk_idx;    // [T, K] or nullptr; values checked to lie in [-1, E)
    int num_topk, expert_alignment;
    int num_worst_tokens;       // 0, or the fixed output rows: more received rows refuse the call
    int row_bytes;              // dispatch row slot bytes: every rank must agree (same shapes)
    // Every op: a digest of the call's shapes (hidden size, dtypes, FP8 scale count and dtype, top-k
    // width; made on the host). Ranks that differ would read each other's rows at the wrong size.
    int shape_key;
    int* slot;                  // [T, R] out: position of token t among the rows this rank sends to r
    int* own_tokens;            // [T] out: the tokens this rank sends to itself, by slot
    int* layout;                // [kLayoutInts] out
    int* info;                  // pinned host words
    uint64_t timeout_ns;
};

constexpr int kNotifyThreads = 1024, kNotifyWarps = kNotifyThreads / kWarpSize;
constexpr int kScanSteps = 2;  // steps of 32 tokens whose loads a notify warp has in flight at once (4 spilled)

// Bit i * kMaxRanks + r: token base + 32 i + lane (below t1) goes to rank r. The loads are all
// issued before any is used; one register holds the bits.
static_assert(kScanSteps * kMaxRanks <= 32, "a notify lane packs its tokens' in_rank bits into one word");
__device__ __forceinline__ unsigned load_in_rank(const NotifyArgs& a, int base, int t1, int lane) {
    bool in[kScanSteps][kMaxRanks];
#pragma unroll
    for (int i = 0; i < kScanSteps; ++i) {
        const int t = base + i * kWarpSize + lane;
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r)
            in[i][r] = t < t1 && r < a.num_ranks && a.in_rank[static_cast<int64_t>(t) * a.num_ranks + r];
    }
    unsigned bits = 0;
#pragma unroll
    for (int i = 0; i < kScanSteps; ++i)
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r) bits |= static_cast<unsigned>(in[i][r]) << (i * kMaxRanks + r);
    return bits;
}

// Lane l's bit: the step's token l goes to rank r (a ballot: every lane of the warp calls it).
__device__ __forceinline__ unsigned step_hits(unsigned bits, int i, int r) {
    return __ballot_sync(kFullMask, bits >> (i * kMaxRanks + r) & 1u);
}

// Slots: an exclusive scan of is_token_in_rank over tokens, per destination, and the check of the
// top-k ids, spread over the grid (a cooperative launch): block b takes the b-th of gridDim.x
// contiguous token ranges, and each of its warps a contiguous part of that, 32 tokens at a time (a
// lane per token: the loads of a step are coalesced) and kScanSteps steps in flight; ballots count
// the hits. A pass counts; the block totals meet in `scratch` across a grid barrier, the warp
// totals in shared memory, which gives each warp its start; a second pass writes the slots. Block 0
// gets this rank's row of the count matrix (`totals`) and the refusal bits (`refuse`).
// One block alone (a thread per contiguous chunk of tokens, one token after another) took 16 us at
// 4096 tokens and 47 at 16384 (one H100): a block streams only some 45 GB/s, and the top-k ids are
// 64 bytes a token.
__device__ void scan_slots(const NotifyArgs& a, int* scratch, int (&s_warp_sums)[kNotifyWarps][kMaxRanks],
                           int* totals, int* refuse) {
    const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
    const int R = a.num_ranks, b = blockIdx.x, nb = gridDim.x;
    __shared__ int s_block_base[kMaxRanks];
    const int bt0 = static_cast<int>(static_cast<int64_t>(a.num_tokens) * b / nb);
    const int bt1 = static_cast<int>(static_cast<int64_t>(a.num_tokens) * (b + 1) / nb);
    const int per_warp = (bt1 - bt0 + kNotifyWarps - 1) / kNotifyWarps;
    const int t0 = min(bt1, bt0 + warp * per_warp), t1 = min(bt1, t0 + per_warp);
    int count[kMaxRanks];  // warp-uniform: this warp's tokens to each rank so far
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) count[r] = 0;
    for (int base = t0; base < t1; base += kScanSteps * kWarpSize) {
        const unsigned bits = load_in_rank(a, base, t1, lane);
#pragma unroll
        for (int i = 0; i < kScanSteps; ++i)
#pragma unroll
            for (int r = 0; r < kMaxRanks; ++r) count[r] += __popc(step_hits(bits, i, r));
    }
    if (lane == 0)
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r) s_warp_sums[warp][r] = count[r];
    // The block's top-k ids, kIdsInFlight loads per thread at once, each coalesced across the block.
    bool bad = false;
    if (a.topk_idx != nullptr) {
        constexpr int kIdsInFlight = 8;
        const int64_t num_experts = static_cast<int64_t>(a.experts_per_rank) * R;
        const int64_t n = static_cast<int64_t>(bt1) * a.num_topk;
        for (int64_t i0 = static_cast<int64_t>(bt0) * a.num_topk + tid; i0 < n;
             i0 += static_cast<int64_t>(kNotifyThreads) * kIdsInFlight) {
            int64_t e[kIdsInFlight];
#pragma unroll
            for (int u = 0; u < kIdsInFlight; ++u) {
                const int64_t i = i0 + static_cast<int64_t>(u) * kNotifyThreads;
                e[u] = i < n ? a.topk_idx[i] : -1;
            }
#pragma unroll
            for (int u = 0; u < kIdsInFlight; ++u) bad |= e[u] < -1 || e[u] >= num_experts;
        }
    }
    bad = __syncthreads_or(bad);
    if (tid < kMaxRanks) {  // scan of the warp sums, one thread per destination
        int run = 0;
        for (int w = 0; w < kNotifyWarps; ++w) {
            const int v = s_warp_sums[w][tid];
            s_warp_sums[w][tid] = run;
            run += v;
        }
        scratch[b * kNotifyScratchStride + tid] = run;
    }
    if (tid == 0) scratch[b * kNotifyScratchStride + kMaxRanks] = bad;
    if (nb > 1) cooperative_groups::this_grid().sync();
    else __syncthreads();
    if (tid < kMaxRanks) {  // this block's start, and (block 0) the rank's totals
        int before = 0, total = 0;
        for (int i = 0; i < nb; ++i) {
            const int v = ld_volatile_int(scratch + i * kNotifyScratchStride + tid);
            before += i < b ? v : 0;
            total += v;
        }
        s_block_base[tid] = before;
        if (b == 0) totals[tid] = total;
    }
    if (b == 0 && tid == kMaxRanks) {
        int any_bad = 0;
        for (int i = 0; i < nb; ++i) any_bad |= ld_volatile_int(scratch + i * kNotifyScratchStride + kMaxRanks);
        if (any_bad) atomicOr(refuse, kRefuseTopkRange);
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) count[r] = s_block_base[r] + s_warp_sums[warp][r];
    const unsigned below = (1u << lane) - 1;  // lanes before this one: tokens before its token
    for (int base = t0; base < t1; base += kScanSteps * kWarpSize) {
        const unsigned bits = load_in_rank(a, base, t1, lane);
#pragma unroll
        for (int i = 0; i < kScanSteps; ++i) {
            const int t = base + i * kWarpSize + lane;
#pragma unroll
            for (int r = 0; r < kMaxRanks; ++r) {
                if (r >= R) continue;
                const unsigned hits = step_hits(bits, i, r);
                const int slot = count[r] + __popc(hits & below);
                if (t < t1) {
                    a.slot[static_cast<int64_t>(t) * R + r] = slot;
                    if (r == a.rank && (hits >> lane & 1u)) a.own_tokens[slot] = t;
                }
                count[r] += __popc(hits);
            }
        }
    }
}

__global__ void __launch_bounds__(kNotifyThreads, 1) notify_kernel(NotifyArgs a) {
    const int tid = threadIdx.x;
    const int R = a.num_ranks;
    uint8_t* mine = a.peers.bufs[a.rank];
    __shared__ int64_t s_seq;
    __shared__ int s_warp_sums[kNotifyWarps][kMaxRanks];
    __shared__ int s_refuse;
    __shared__ int s_matrix[kMaxRanks][kMaxRanks];
    __shared__ int s_headers[kMaxRanks][kHeaderInts];
    const bool exchange = a.op == kOpDispatch;  // a rank with no tokens still exchanges its (zero) counts
    if (tid == 0) s_refuse = 0;
    __syncthreads();
    if (exchange) {
        scan_slots(a, reinterpret_cast<int*>(mine + kNotifyScratchOffset), s_warp_sums, s_matrix[a.rank], &s_refuse);
        if (blockIdx.x != 0) return;  // the other blocks only scan
    }
    if (tid == 0) {
        s_seq = *seq_word(mine) + 1;  // every rank makes the same calls, so counters agree
        *seq_word(mine) = s_seq;
    }
    __syncthreads();
    const int64_t seq = s_seq;
    const int parity = static_cast<int>(seq & 1);

    if (exchange) {
        // Validation, on the device so that no host sync is needed for it.
        if (tid < R && a.send_counts[tid] != s_matrix[a.rank][tid]) atomicOr(&s_refuse, kRefuseRankCounts);
        __syncthreads();
        // Publish this rank's counts into every peer (its row of the matrix, its refusal code and
        // its per-expert counts for the peer's experts).
        if (tid < R * R) {
            const int peer = tid / R, dst = tid % R;
            reinterpret_cast<int*>(a.peers.bufs[peer] + kMatrixOffset)[(parity * kMaxRanks + a.rank) * kMaxRanks + dst] =
                s_matrix[a.rank][dst];
        }
        if (tid < R) {
            int* header = reinterpret_cast<int*>(a.peers.bufs[tid] + kHeaderOffset) +
                          (parity * kMaxRanks + a.rank) * kHeaderInts;
            header[0] = s_refuse;
            header[1] = a.num_worst_tokens;
            header[2] = a.row_bytes;
        }
        for (int i = tid; i < R * a.experts_per_rank; i += kNotifyThreads) {
            const int dst = i / a.experts_per_rank, e = i % a.experts_per_rank;
            reinterpret_cast<int*>(a.peers.bufs[dst] + kExpertCountOffset)
                [(parity * kMaxRanks + a.rank) * kMaxExpertsPerRank + e] = a.expert_counts[i];
        }
    }

    if (tid < R) {
        int* header = reinterpret_cast<int*>(a.peers.bufs[tid] + kHeaderOffset) +
                      (parity * kMaxRanks + a.rank) * kHeaderInts;
        header[3] = a.shape_key;
        header[4] = a.op;
    }

    // Barrier: everything this rank wrote (and every earlier kernel on the stream) is visible to
    // a peer before the peer sees this rank's signal.
    __syncthreads();
    fence_sys();
    __syncthreads();
    if (tid < R) {
        st_release_sys(reinterpret_cast<int64_t*>(a.peers.bufs[tid] + kSignalOffset) + a.rank, seq * 16 + a.op);
        const int64_t* signal = reinterpret_cast<const int64_t*>(mine + kSignalOffset) + tid;
        const uint64_t start = global_timer_ns();
        int64_t v;
        while ((v = ld_acquire_sys(signal)) < seq * 16) {
            if (global_timer_ns() - start > a.timeout_ns) {
                report_error(a.info, kErrTimeout, a.op, tid);
                *abort_word(mine) = seq;
                break;
            }
        }
        // The peer's words of this call, read also when it has already gone on to its next call (its
        // signal then shows that call): they stay until the call after next, which waits for this
        // rank's next signal. Every rank compares, so all of them skip the call alike.
        const int* peer = reinterpret_cast<const int*>(mine + kHeaderOffset) + (parity * kMaxRanks + tid) * kHeaderInts;
        const int peer_op = v >= seq * 16 ? ld_volatile_int(peer + 4) : a.op;
        if (peer_op != a.op) {  // same call number, another operation
            a.info[kInfoErrorRanks + tid] = peer_op;
            a.info[kInfoErrorOp] = a.op;
            a.info[kInfoError] = kErrMismatch;
            *abort_word(mine) = seq;
        } else if (v >= seq * 16 && !exchange && ld_volatile_int(peer + 3) != a.shape_key) {
            // The same operation on rows of another shape: nothing moves, and the host raises at
            // its next check. A fresh dispatch refuses instead (below): every rank raises at once.
            a.info[kInfoErrorRanks + tid] = 1;
            a.info[kInfoErrorOp] = a.op;
            a.info[kInfoError] = kErrShapes;
            *abort_word(mine) = seq;
        }
    }
    __syncthreads();
    if (!exchange) return;

    // Every rank's counts are here now: derive the layout (identical arithmetic on every rank).
    const int* matrix = reinterpret_cast<const int*>(mine + kMatrixOffset) + parity * kMaxRanks * kMaxRanks;
    // The host's copy is written by R * R threads at once, not by one thread's 64 writes over PCIe.
    if (tid < R * R) {
        const int v = ld_volatile_int(matrix + (tid / R) * kMaxRanks + tid % R);
        s_matrix[tid / R][tid % R] = v;
        a.info[kInfoMatrix + tid] = v;
    }
    if (tid < R * kHeaderInts)
        s_headers[tid / kHeaderInts][tid % kHeaderInts] =
            ld_volatile_int(reinterpret_cast<const int*>(mine + kHeaderOffset) + parity * kMaxRanks * kHeaderInts + tid);
    __syncthreads();
    if (tid == 0) {
        const int me = a.rank;
        int run = 0, refused = 0, max_recv = 0, max_send = 0;
        for (int s = 0; s < R; ++s) {
            a.layout[kLayRecvOff + s] = run;
            a.info[kInfoRecvCounts + s] = s_matrix[s][me];
            run += s_matrix[s][me];
            int why = s_headers[s][0];
            int received = 0;  // rows rank s receives: more than its num_worst_tokens refuses the call
            for (int x = 0; x < R; ++x) received += s_matrix[x][s];
            if (s_headers[s][1] > 0 && received > s_headers[s][1]) why |= kRefuseWorstTokens;
            if (s_headers[s][1] != s_headers[0][1] || s_headers[s][2] != s_headers[0][2] ||
                s_headers[s][3] != s_headers[0][3])
                why |= kRefuseShapes;
            refused |= why;
            a.info[kInfoRefusal + s] = why;
        }
        a.layout[kLayRecvOff + R] = run;
        a.info[kInfoNumRecv] = run;
        for (int d = 0; d < R; ++d) {
            int below = 0, col = 0, row = 0, comb = 0;
            for (int s = 0; s < R; ++s) {
                if (s < me) below += s_matrix[s][d];
                col += s_matrix[s][d];
                row += s_matrix[d][s];
                if (s < d) comb += s_matrix[me][s];
            }
            a.layout[kLayDstBase + d] = below;
            a.layout[kLayCombBase + d] = comb;
            int ret = 0;  // rows source d sends to ranks below me: where mine start in its buffer
            for (int x = 0; x < me; ++x) ret += s_matrix[d][x];
            a.layout[kLayRetBase + d] = ret;
            max_recv = max(max_recv, col);
            max_send = max(max_send, row);
        }
        a.layout[kLayMaxRecv] = a.info[kInfoMaxRecv] = max_recv;
        a.layout[kLayMaxSend] = a.info[kInfoMaxSend] = max_send;
        // A timed-out or mismatched barrier leaves stale counts: nothing may move on them.
        const bool broken = ld_volatile(abort_word(mine)) == seq;
        a.layout[kLayAbort] = refused | (broken ? 1 << 30 : 0);
        if (refused && !broken) report_error(a.info, kErrRefused, a.op, -1);
    }
    // Received tokens per local expert, summed over sources and rounded up to the alignment.
    const int* experts = reinterpret_cast<const int*>(mine + kExpertCountOffset) + parity * kMaxRanks * kMaxExpertsPerRank;
    for (int e = tid; e < a.experts_per_rank; e += kNotifyThreads) {
        int total = 0;
        for (int s = 0; s < R; ++s) total += ld_volatile_int(experts + s * kMaxExpertsPerRank + e);
        const int al = a.expert_alignment;
        a.info[kInfoExperts + e] = (total + al - 1) / al * al;
    }
}

// ------------------------------------------------------------------ dispatch
struct DispatchArgs {
    PeerTable peers;
    int rank, num_ranks, num_tokens;
    const uint8_t* x;           // [T, x_bytes]
    int x_bytes;                // H * element size, a multiple of 16
    const uint32_t* scales;     // [T, S] (fp32 or packed UE8M0 int32), any strides; nullptr for BF16
    int num_scales;
    int64_t scale_stride_t, scale_stride_c;
    const int64_t* topk_idx;    // [T, K] global expert ids, or nullptr
    const float* topk_weights;  // [T, K] or nullptr
    int num_topk, experts_per_rank;
    bool has_topk, has_weights;  // from the shapes, not the pointers (an empty tensor has none)
    const bool* in_rank;        // [T, R]
    const int* slot;            // [T, R]
    const int* own_tokens;      // [T]: token index of each of this rank's rows to itself, by slot
    const int* layout;
    int row_stride;             // bytes of one row slot in the buffer (trailer included)
    int64_t cap_rows;           // row slots the buffer holds
    uint8_t* recv_x;            // [num_out_rows, x_bytes]
    uint32_t* recv_scales;
    int64_t recv_scale_stride_t, recv_scale_stride_c;
    int64_t* recv_topk_idx;     // [num_out_rows, K] local expert ids
    float* recv_topk_weights;
    int num_out_rows;           // num_recv (host-synced) or num_worst_tokens
    int num_send_blocks;        // fused kernel: blocks [0, num_send_blocks) send, the rest receive
    // This rank's rows to itself: copied by the receivers straight from x (a split's halves, and the
    // fused kernel above 2 ranks), else written by the senders beside their stores to the peers (the
    // host's choice: CudaIntranode._launch_dispatch says why).
    bool local_by_receiver;
    int tma_warps;              // > 0: each sending block's first tma_warps warps move rows by bulk copies
    int op;
    int* info;
    uint64_t timeout_ns;
};

// Where each piece of a token lives inside a dispatch row slot: x, then the top-k ids (8-byte
// aligned because x_bytes is a multiple of 16), the weights and the scales.
struct DispatchRow {
    int idx_offset, weight_offset, scale_offset;
    __device__ DispatchRow(int x_bytes, int num_topk)
        : idx_offset(x_bytes), weight_offset(x_bytes + num_topk * 8), scale_offset(x_bytes + num_topk * 12) {}
};

// Token t's top-k entry `lane` as destination d sees it: its local expert id (-1 for other
// ranks' experts) and the weight (0 there).
__device__ __forceinline__ void local_topk(const DispatchArgs& a, int64_t e, float w, int d, int64_t& local_e,
                                          float& local_w) {
    const int64_t lo = static_cast<int64_t>(d) * a.experts_per_rank;
    local_e = (e >= lo && e < lo + a.experts_per_rank) ? e - lo : -1;
    local_w = local_e >= 0 ? w : 0.f;
}

// A token's metadata as a warp holds it: lane k < K its k-th expert and weight, and its FP8 scales
// c = lane + 32 i (i < kMetaScales: up to 64 scales, H up to 8192; more are read where written).
// Loaded once, with the token's other loads, and stored from registers to every destination: a
// load per destination and scale, each waiting behind the stores before it, was a memory round
// trip per copy.
constexpr int kMetaScales = 2;
struct TokenMeta {
    int64_t e;
    float w;
    bool scales_held;  // scale[] holds the first scales (else they are read where written)
    uint32_t scale[kMetaScales];
};

// hold_scales = false for a warp that copies a row between this load and the stores: registers
// kept through the copy cost it its words in flight (a receiver's copy of its own rows from x ran
// 1.8x slower, one H100).
__device__ __forceinline__ TokenMeta load_token_meta(const DispatchArgs& a, int t, int lane, bool hold_scales = true) {
    TokenMeta m{-1, 0.f, hold_scales, {}};
    if (a.has_topk && lane < a.num_topk) {
        m.e = a.topk_idx[static_cast<int64_t>(t) * a.num_topk + lane];
        if (a.has_weights) m.w = a.topk_weights[static_cast<int64_t>(t) * a.num_topk + lane];
    }
    if (hold_scales) {
#pragma unroll
        for (int i = 0; i < kMetaScales; ++i) {
            const int c = lane + i * kWarpSize;
            m.scale[i] = c < a.num_scales ? a.scales[t * a.scale_stride_t + c * a.scale_stride_c] : 0;
        }
    }
    return m;
}

// Scale c of token t, for c < a.num_scales, into dst[c * stride].
__device__ __forceinline__ void write_scales(const DispatchArgs& a, int t, const TokenMeta& m, uint32_t* dst,
                                             int64_t stride, int lane) {
    int from = lane;
    if (m.scales_held) {
#pragma unroll
        for (int i = 0; i < kMetaScales; ++i) {
            const int c = lane + i * kWarpSize;
            if (c < a.num_scales) dst[c * stride] = m.scale[i];
        }
        from += kMetaScales * kWarpSize;
    }
    for (int c = from; c < a.num_scales; c += kWarpSize)
        dst[c * stride] = a.scales[t * a.scale_stride_t + c * a.scale_stride_c];
}

// Metadata of token t into this rank's own output row p (top-k ids, weights, scales).
__device__ __forceinline__ void write_own_meta(const DispatchArgs& a, int t, int64_t p, const TokenMeta& m, int lane) {
    const int K = a.num_topk;
    if (a.has_topk && lane < K) {
        int64_t local_e;
        float local_w;
        local_topk(a, m.e, m.w, a.rank, local_e, local_w);
        a.recv_topk_idx[p * K + lane] = local_e;
        if (a.has_weights) a.recv_topk_weights[p * K + lane] = local_w;
    }
    if (a.num_scales > 0)
        write_scales(a, t, m, a.recv_scales + p * a.recv_scale_stride_t, a.recv_scale_stride_c, lane);
}

// Metadata of token t into its row slot `dst_row` in destination d's buffer: top-k ids local to d,
// weights, scales. Plain stores: the caller orders them before the row's flag.
__device__ __forceinline__ void write_peer_meta(const DispatchArgs& a, uint8_t* dst_row, int d, int t,
                                                const TokenMeta& m, int lane) {
    const DispatchRow row(a.x_bytes, a.num_topk);
    if (a.has_topk && lane < a.num_topk) {
        int64_t local_e;
        float local_w;
        local_topk(a, m.e, m.w, d, local_e, local_w);
        reinterpret_cast<int64_t*>(dst_row + row.idx_offset)[lane] = local_e;
        if (a.has_weights) reinterpret_cast<float*>(dst_row + row.weight_offset)[lane] = local_w;
    }
    if (a.num_scales > 0)
        write_scales(a, t, m, reinterpret_cast<uint32_t*>(dst_row + row.scale_offset), 1, lane);
}

// What a sending warp needs of token t: lane d < R whether the token goes to rank d and is this
// sender's to write (the receivers copy this rank's own rows when `local_by_receiver`) and its
// slot there; lane k < K its k-th expert and weight. The loads do not depend on each other, so
// they are in flight together, and a warp loads its next token's route before copying this one's
// row: a warp that waited for the destinations, then the slots, then the experts spent about a
// third of its time on those latencies (one rank, 24 SMs: ~31 GB/s per sending SM against 44 for
// a bare copy, scripts/copy_rate.cu).
struct TokenRoute {
    bool hit;
    int slot;
    TokenMeta meta;
};

// Lane d < R: whether token t goes to rank d and is this sender's to write.
__device__ __forceinline__ bool token_hit(const DispatchArgs& a, int t, int lane) {
    if (t >= a.num_tokens || lane >= a.num_ranks) return false;
    return a.in_rank[static_cast<int64_t>(t) * a.num_ranks + lane] && !(lane == a.rank && a.local_by_receiver);
}

__device__ __forceinline__ TokenRoute load_route(const DispatchArgs& a, int t, int lane) {
    TokenRoute r{false, 0, {-1, 0.f, true, {}}};
    if (t >= a.num_tokens) return r;
    r.hit = token_hit(a, t, lane);
    if (lane < a.num_ranks) r.slot = a.slot[static_cast<int64_t>(t) * a.num_ranks + lane];
    r.meta = load_token_meta(a, t, lane);
    return r;
}

// Bit d: the token goes to rank d. A ballot: every lane of the warp calls it.
__device__ __forceinline__ unsigned route_mask(const TokenRoute& r) { return __ballot_sync(kFullMask, r.hit); }

// Lane d: where the token's row goes in destination d's output (0 where it does not go).
__device__ __forceinline__ int route_row_pos(const TokenRoute& r, const int* s_layout, int lane) {
    return r.hit ? s_layout[kLayDstBase + lane] + r.slot : 0;
}

// Sender: one warp per token; x is read once and stored to every destination. Rows to other
// ranks go to their buffers (then a flag per row); the row to this rank goes straight to the
// outputs unless the receivers do it (`local_by_receiver`).
__device__ void dispatch_send(const DispatchArgs& a, const int* s_layout, int64_t flag_value, int warp, int num_warps) {
    const int lane = threadIdx.x % kWarpSize;
    const int me = a.rank;
    const int x_int4 = a.x_bytes / 16;
    TokenRoute next = load_route(a, warp, lane);
    for (int t = warp; t < a.num_tokens; t += num_warps) {
        const TokenRoute route = next;
        next = load_route(a, t + num_warps, lane);
        const unsigned mask = route_mask(route);
        if (mask == 0) continue;
        const int pos_lane = route_row_pos(route, s_layout, lane);
        int4* dst_x[kMaxRanks];
        uint8_t* dst_row[kMaxRanks];  // remote row slot, or nullptr
        int dst_pos[kMaxRanks];
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
            const int pos = __shfl_sync(kFullMask, pos_lane, d);
            dst_pos[d] = pos;
            dst_x[d] = nullptr;
            dst_row[d] = nullptr;
            if (!(mask >> d & 1u)) continue;
            if (d == me) {
                if (pos < a.num_out_rows)
                    dst_x[d] = reinterpret_cast<int4*>(a.recv_x + static_cast<int64_t>(pos) * a.x_bytes);
            } else {
                dst_row[d] = a.peers.bufs[d] + kRowsOffset + static_cast<int64_t>(pos) * a.row_stride;
                dst_x[d] = reinterpret_cast<int4*>(dst_row[d]);
            }
        }
        const int4* src = reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * a.x_bytes);
        // 8 words per lane in flight, not 4: one H100, one rank, 23 sending SMs: cached BF16
        // dispatch 94.4 -> 86.2 us (at many SMs the loads wait longer; scripts/copy_rate.cu shows
        // the same, 37 -> 44 GB/s per SM at 24 SMs). 126 registers, no spills.
        constexpr int kUnroll = 8;
        for (int i = lane; i < x_int4; i += kUnroll * kWarpSize) {
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (i + u * kWarpSize < x_int4) v[u] = ld_nc_int4(src + i + u * kWarpSize);
#pragma unroll
            for (int d = 0; d < kMaxRanks; ++d) {
                if (dst_x[d] == nullptr) continue;
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (i + u * kWarpSize < x_int4) dst_x[d][i + u * kWarpSize] = v[u];
            }
        }
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
            if (dst_x[d] == nullptr) continue;
            if (dst_row[d] == nullptr)
                write_own_meta(a, t, dst_pos[d], route.meta, lane);
            else
                write_peer_meta(a, dst_row[d], d, t, route.meta, lane);
        }
        // Publish: after the warp's stores, lane d releases the flag of destination d's row (a row at
        // a time: batched, the receivers waited longer than the senders gained, see kCombineFlagBatch).
        __syncwarp();
        if (lane < kMaxRanks) {
            uint8_t* r = nullptr;
#pragma unroll
            for (int d = 0; d < kMaxRanks; ++d)
                if (d == lane) r = dst_row[d];
            if (r != nullptr)
                st_release_sys(reinterpret_cast<int64_t*>(r + a.row_stride - kRowTrailerBytes), flag_value);
        }
    }
}

// A sending warp's row ring: two rows loading while one is stored, and the stores of the last
// kSendInFlight rows in flight (a remote store takes microseconds to complete).
constexpr int kSendStages = 3;
constexpr int kSendInFlight = 8;
using SendRing = RowRing<kSendStages, kSendInFlight>;

// The sender with bulk copies: the same rows, metadata and flags as dispatch_send, but x's row is
// loaded once into the warp's ring and stored from there to every destination by the TMA unit, so
// several rows per warp are in flight instead of a few KB of registers.
__device__ void dispatch_send_tma(const DispatchArgs& a, const int* s_layout, int64_t flag_value, int warp,
                                  int num_warps, const SendRing& ring) {
    const int lane = threadIdx.x % kWarpSize;
    const int me = a.rank;
    auto source = [&](int t) -> const void* {
        return __ballot_sync(kFullMask, token_hit(a, t, lane)) != 0 ? a.x + static_cast<int64_t>(t) * a.x_bytes
                                                                      : nullptr;
    };
    auto send = [&](int t, const uint8_t* stage, int64_t** flags) {
        const TokenRoute route = load_route(a, t, lane);
        const unsigned mask = route_mask(route);
        const int pos_lane = route_row_pos(route, s_layout, lane);
        int64_t* my_flag = nullptr;  // lane d: the flag of destination d's row
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
            if (!(mask >> d & 1u)) continue;
            const int pos = __shfl_sync(kFullMask, pos_lane, d);
            if (d == me) {  // this rank's own output row: no flag
                if (pos >= a.num_out_rows) continue;
                if (lane == 0) bulk_store(a.recv_x + static_cast<int64_t>(pos) * a.x_bytes, stage, a.x_bytes);
                write_own_meta(a, t, pos, route.meta, lane);
                continue;
            }
            uint8_t* dst = a.peers.bufs[d] + kRowsOffset + static_cast<int64_t>(pos) * a.row_stride;
            if (lane == 0) bulk_store(dst, stage, a.x_bytes);
            write_peer_meta(a, dst, d, t, route.meta, lane);
            if (lane == d) my_flag = reinterpret_cast<int64_t*>(dst + a.row_stride - kRowTrailerBytes);
        }
        if (lane < kMaxRanks) flags[lane] = my_flag;
    };
    warp_row_pipeline(ring, a.num_tokens, warp, num_warps, a.x_bytes, flag_value, source, send);
}

// Receivers keep more loads in flight than senders (they hold fewer registers: no destination table).
constexpr int kRecvUnroll = 8;

// Receiver: one warp per output row, the sources' rows round-robin (round_robin_row). Rows of
// other ranks are copied out of the buffer as soon as their flag lands; this rank's own rows come
// straight from x when `local_by_receiver`; num_worst_tokens padding rows are filled.
__device__ void dispatch_recv(const DispatchArgs& a, const int* s_layout, int64_t seq, int64_t flag_value, int warp,
                              int num_warps) {
    const int lane = threadIdx.x % kWarpSize;
    const int R = a.num_ranks, me = a.rank, K = a.num_topk;
    uint8_t* mine = a.peers.bufs[me];
    const DispatchRow row(a.x_bytes, a.num_topk);
    const int x_int4 = a.x_bytes / 16;
    const int num_valid = min(s_layout[kLayRecvOff + R], a.num_out_rows);
    const int own_begin = min(s_layout[kLayRecvOff + me], a.num_out_rows);
    const int own_end = min(s_layout[kLayRecvOff + me + 1], a.num_out_rows);
    const int num_skip = a.local_by_receiver ? 0 : own_end - own_begin;  // rows the senders wrote
    // Blocks: each source's rows (this rank's own passed over when the senders wrote them), then
    // the num_worst_tokens padding.
    auto begin_of = [&](int k) { return k < R ? min(s_layout[kLayRecvOff + k], a.num_out_rows) : num_valid; };
    auto size_of = [&](int k) {
        if (k == R) return a.num_out_rows - num_valid;
        if (k == me && !a.local_by_receiver) return 0;
        return min(s_layout[kLayRecvOff + k + 1], a.num_out_rows) - begin_of(k);
    };
    for (int j = warp; j < a.num_out_rows - num_skip; j += num_warps) {
        int idx;
        const int src = round_robin_row(j, R + 1, size_of, idx);
        const int i = begin_of(src) + idx;
        const int64_t p = i;
        int4* out = reinterpret_cast<int4*>(a.recv_x + p * a.x_bytes);
        if (i >= num_valid) {  // num_worst_tokens padding: x = 0, scales = 0, ids = -1, weights = 0
            for (int c = lane; c < x_int4; c += kWarpSize) out[c] = make_int4(0, 0, 0, 0);
            for (int c = lane; c < a.num_scales; c += kWarpSize)
                a.recv_scales[p * a.recv_scale_stride_t + c * a.recv_scale_stride_c] = 0;
            if (a.has_topk && lane < K) {
                a.recv_topk_idx[p * K + lane] = -1;
                if (a.has_weights) a.recv_topk_weights[p * K + lane] = 0.f;
            }
            continue;
        }
        if (i >= own_begin && i < own_end) {  // this rank's own token, straight from x
            const int t = a.own_tokens[i - own_begin];
            const int4* src = reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * a.x_bytes);
            // The top-k ids and weights in flight with the row's first loads; the scales after.
            const TokenMeta meta = load_token_meta(a, t, lane, false);
            constexpr int kUnroll = kRecvUnroll;
            for (int c = lane; c < x_int4; c += kUnroll * kWarpSize) {
                int4 v[kUnroll];
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (c + u * kWarpSize < x_int4) v[u] = ld_nc_int4(src + c + u * kWarpSize);
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (c + u * kWarpSize < x_int4) out[c + u * kWarpSize] = v[u];
            }
            write_own_meta(a, t, p, meta, lane);
            continue;
        }
        const uint8_t* r = mine + kRowsOffset + p * a.row_stride;
        if (!wait_row_flag(reinterpret_cast<const int64_t*>(r + a.row_stride - kRowTrailerBytes), flag_value, mine,
                           seq, a.timeout_ns, a.info, a.op, src))
            return;
        // The row's top-k ids and weights are loaded with its first words, stored after them (its
        // scales too would be registers held through the copy: see load_token_meta).
        int64_t e = -1;
        float w = 0.f;
        if (a.has_topk && lane < K) {
            e = reinterpret_cast<const int64_t*>(r + row.idx_offset)[lane];
            if (a.has_weights) w = reinterpret_cast<const float*>(r + row.weight_offset)[lane];
        }
        warp_copy_int4<kRecvUnroll>(out, reinterpret_cast<const int4*>(r), x_int4, lane);
        if (a.has_topk && lane < K) {
            a.recv_topk_idx[p * K + lane] = e;
            if (a.has_weights) a.recv_topk_weights[p * K + lane] = w;
        }
        for (int c = lane; c < a.num_scales; c += kWarpSize)
            a.recv_scales[p * a.recv_scale_stride_t + c * a.recv_scale_stride_c] =
                reinterpret_cast<const uint32_t*>(r + row.scale_offset)[c];
    }
}

// The block's dynamic shared memory: the sending warps' row rings (bulk-copy senders only).
__device__ __forceinline__ uint8_t* dynamic_smem() {
    extern __shared__ __align__(128) uint8_t smem[];
    return smem;
}

// Sending block `block` of `num_blocks` (dispatch or combine): its first tma_warps warps move rows
// of row_bytes by bulk copies through their rings (by_bulk(warp, num_warps, ring)), or, without
// them, all of its warps by register copies (by_registers(warp, num_warps)).
template <class ByRegisters, class ByBulk>
__device__ __forceinline__ void send_role(int tma_warps, int row_bytes, int block, int num_blocks,
                                          ByRegisters&& by_registers, ByBulk&& by_bulk) {
    const int w = threadIdx.x / kWarpSize;
    if (tma_warps > 0) {
        if (w >= tma_warps) return;
        by_bulk(block * tma_warps + w, num_blocks * tma_warps, SendRing::carve(dynamic_smem(), w, tma_warps, row_bytes));
        return;
    }
    const int warps_per_block = blockDim.x / kWarpSize;
    by_registers(block * warps_per_block + w, num_blocks * warps_per_block);
}

__device__ void dispatch_send_role(const DispatchArgs& a, const int* s_layout, int64_t flag_value, int block,
                                   int num_blocks) {
    send_role(
        a.tma_warps, a.x_bytes, block, num_blocks,
        [&](int warp, int num_warps) { dispatch_send(a, s_layout, flag_value, warp, num_warps); },
        [&](int warp, int num_warps, const SendRing& ring) {
            dispatch_send_tma(a, s_layout, flag_value, warp, num_warps, ring);
        });
}

// kSend and kRecv: the fused kernel (num_worst_tokens and cached dispatch: one launch, no host
// round trip), its first blocks send and the others receive. One role alone: the two halves of a
// dispatch whose outputs are sized after the host reads the counts; the send half is launched on
// a side stream before that read, so the transfer starts while the CPU waits.
template <bool kSend, bool kRecv>
__global__ void __launch_bounds__(512, 1) dispatch_kernel(DispatchArgs a) {
    const int warps_per_block = blockDim.x / kWarpSize;
    uint8_t* mine = a.peers.bufs[a.rank];
    __shared__ int s_layout[kLayoutInts];
    if (threadIdx.x < kLayoutInts) s_layout[threadIdx.x] = a.layout[threadIdx.x];
    __syncthreads();
    if (s_layout[kLayAbort] != 0) return;  // a rank refused its inputs: every rank skips alike
    const int64_t seq = ld_volatile(seq_word(mine));
    if (ld_volatile(abort_word(mine)) == seq) return;  // this call's barrier failed (reported)
    const bool reporter = kRecv && threadIdx.x == 0 && blockIdx.x == gridDim.x - 1;
    if (s_layout[kLayMaxRecv] > a.cap_rows) {  // every rank sees the same matrix, so all skip alike
        if (reporter) report_error(a.info, kErrCapacity, a.op, -1);
        return;
    }
    if (reporter && s_layout[kLayRecvOff + a.num_ranks] > a.num_out_rows)
        report_error(a.info, kErrWorstTokens, a.op, a.rank);
    const int64_t flag_value = seq ^ kFlagMagic;
    const int warp_in_block = threadIdx.x / kWarpSize;
    if (kSend && kRecv) {
        if (static_cast<int>(blockIdx.x) < a.num_send_blocks)
            dispatch_send_role(a, s_layout, flag_value, blockIdx.x, a.num_send_blocks);
        else
            dispatch_recv(a, s_layout, seq, flag_value, (blockIdx.x - a.num_send_blocks) * warps_per_block + warp_in_block,
                          (gridDim.x - a.num_send_blocks) * warps_per_block);
    } else if (kSend) {
        dispatch_send_role(a, s_layout, flag_value, blockIdx.x, gridDim.x);
    } else {
        dispatch_recv(a, s_layout, seq, flag_value, blockIdx.x * warps_per_block + warp_in_block,
                      gridDim.x * warps_per_block);
    }
}

// ------------------------------------------------------------------ combine
struct CombineArgs {
    PeerTable peers;
    int rank, num_ranks, num_tokens, hidden, num_topk;
    const __nv_bfloat16* x;     // [rows, H] the expert outputs, in dispatch's receive order
    const float* weights;       // [rows, K] or nullptr
    const bool* in_rank;        // [T, R] of the dispatch
    const int* slot;            // [T, R] of the dispatch
    const int* layout;
    int row_stride;
    int64_t cap_rows;
    const __nv_bfloat16* bias0;
    const __nv_bfloat16* bias1;
    __nv_bfloat16* out;         // [T, H]
    float* out_weights;         // [T, K] or nullptr
    int num_send_blocks;
    int tma_warps;              // > 0: each sending block's first tma_warps warps move rows by bulk copies
    int* info;
    uint64_t timeout_ns;
};

// Combine row j of the rows this rank returns (its received rows of other ranks, the sources
// round-robin: round_robin_row): its index i among the received rows and the slot it goes to in its
// source's buffer.
__device__ __forceinline__ uint8_t* combine_return_row(const CombineArgs& a, const int* s_layout, int j, int& i) {
    const int me = a.rank;
    int idx;
    const int src = round_robin_row(j, a.num_ranks, [&](int k) {
        return k == me ? 0 : s_layout[kLayRecvOff + k + 1] - s_layout[kLayRecvOff + k];
    }, idx);
    i = s_layout[kLayRecvOff + src] + idx;
    const int64_t pos = s_layout[kLayRetBase + src] + idx;
    return a.peers.bufs[src] + kRowsOffset + pos * a.row_stride;
}

__device__ __forceinline__ int combine_num_returned(const CombineArgs& a, const int* s_layout) {
    return s_layout[kLayRecvOff + a.num_ranks] - (s_layout[kLayRecvOff + a.rank + 1] - s_layout[kLayRecvOff + a.rank]);
}

// A combine sender's words per lane in flight. 4 here, but what is in flight is ptxas's choice too:
// up to 9d043c2 it overlapped the next 4 loads with the stores (~8 in flight), from 3417412 on it
// does not, and the EP2 combine at 8 sending SMs went from 279-285 to 309-311 us (2 x H200,
// bench/results/2026-11-24_ep2-combine-bisect_nvidia-h200-x2.txt). 8 (as the dispatch senders) is
// measured by scripts/multi_gpu_plan.sh STEP=split (variant send8).
constexpr int kCombineSendUnroll = 4;

// Rows a combine sender publishes with one fence (PendingFlags). A release per row (st.release.sys) holds the warp
// until its row's stores are acknowledged across NVLink before it may go on: 4 GPUs storing to each
// other at 8 SMs a GPU moved 309 GB/s without flags and 260 with one per row (scripts/nvlink_rate.cu).
// Batched, the warp stalls once per batch, but a receiver sees a row only after the warp's next
// batch - 1 rows, and a sending warp moves only ~1.5 GB/s (~190 warps share the links). Measured at
// EP4 (4 x H100, 24 SMs, BF16, 3120115; batch 1 / 2 / 4 / 8): combine 690 / 615 / 617 / 650 us;
// cached dispatch 581 / 589 / 609 / 658 us (its receivers wait for the rows): its senders keep a
// release per row.
constexpr int kCombineFlagBatch = 2;

struct PendingFlags {
    static constexpr int kFlagBatch = kCombineFlagBatch;
    int row[kFlagBatch];
    int count = 0;

    // Every lane of the warp calls it, with the number of a row it stored last that needs a flag (or -1).
    __device__ __forceinline__ void add(int r) {
#pragma unroll
        for (int k = 0; k < kFlagBatch; ++k)
            if (k == count) row[k] = r;
        ++count;
    }
    __device__ __forceinline__ bool full() const { return count == kFlagBatch; }

    // After the warp's stores of these rows (every lane calls it): one fence, then each row's flag
    // (flag_of(row)). The fence orders the other lanes' stores too, which __syncwarp made this lane
    // observe first.
    template <class FlagOf>
    __device__ __forceinline__ void publish(int64_t value, FlagOf&& flag_of) {
        __syncwarp();
        bool any = false;
#pragma unroll
        for (int k = 0; k < kFlagBatch; ++k) any |= k < count && row[k] >= 0;
        if (any) {
            fence_sys();
#pragma unroll
            for (int k = 0; k < kFlagBatch; ++k)
                if (k < count && row[k] >= 0) st_relaxed_sys(flag_of(row[k]), value);
        }
        count = 0;
    }
};

// Sender with register copies: every received row of another rank goes back to its source, at
// the slot the source reduces from.
__device__ void combine_send(const CombineArgs& a, const int* s_layout, int64_t flag_value, int warp, int num_warps) {
    const int lane = threadIdx.x % kWarpSize, K = a.num_topk, x_int4 = a.hidden / 8;
    const int num_returned = combine_num_returned(a, s_layout);
    PendingFlags pending;  // lane 0's: a flag per row
    auto flag_of = [&](int j) {
        int i;
        return reinterpret_cast<int64_t*>(combine_return_row(a, s_layout, j, i) + a.row_stride - kRowTrailerBytes);
    };
    for (int j = warp; j < num_returned; j += num_warps) {
        int i;
        uint8_t* r = combine_return_row(a, s_layout, j, i);
        const int4* x = reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(i) * a.hidden);
        // K = 0 without weights (the pointer is null also when no rows arrived); loaded with the
        // row's first words, stored after them.
        const float w = lane < K ? a.weights[static_cast<int64_t>(i) * K + lane] : 0.f;
        constexpr int kUnroll = kCombineSendUnroll;
        for (int c = lane; c < x_int4; c += kUnroll * kWarpSize) {
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (c + u * kWarpSize < x_int4) v[u] = ld_nc_int4(x + c + u * kWarpSize);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (c + u * kWarpSize < x_int4) reinterpret_cast<int4*>(r)[c + u * kWarpSize] = v[u];
        }
        if (lane < K) reinterpret_cast<float*>(r + a.hidden * 2)[lane] = w;
        pending.add(lane == 0 ? j : -1);
        if (pending.full()) pending.publish(flag_value, flag_of);
    }
    pending.publish(flag_value, flag_of);
}

// The same with bulk copies through the warp's row ring (see dispatch_send_tma).
__device__ void combine_send_tma(const CombineArgs& a, const int* s_layout, int64_t flag_value, int warp,
                                 int num_warps, const SendRing& ring) {
    const int lane = threadIdx.x % kWarpSize, K = a.num_topk;
    const int row_bytes = a.hidden * 2;
    auto source = [&](int j) -> const void* {
        int i;
        combine_return_row(a, s_layout, j, i);
        return a.x + static_cast<int64_t>(i) * a.hidden;
    };
    auto send = [&](int j, const uint8_t* stage, int64_t** flags) {
        int i;
        uint8_t* r = combine_return_row(a, s_layout, j, i);
        if (lane == 0) bulk_store(r, stage, row_bytes);
        if (lane < K) reinterpret_cast<float*>(r + row_bytes)[lane] = a.weights[static_cast<int64_t>(i) * K + lane];
        if (lane < kMaxRanks)
            flags[lane] = lane == 0 ? reinterpret_cast<int64_t*>(r + a.row_stride - kRowTrailerBytes) : nullptr;
    };
    warp_row_pipeline(ring, combine_num_returned(a, s_layout), warp, num_warps, row_bytes, flag_value, source, send);
}

// Reducer: token t sums, in fp32 and ascending rank order, the rows its destinations returned
// (its own destination's row straight from x), then the biases; one rounding to bf16.
__device__ void combine_reduce(const CombineArgs& a, const int* s_layout, int64_t seq, int64_t flag_value, int warp,
                               int num_warps) {
    const int lane = threadIdx.x % kWarpSize;
    const int R = a.num_ranks, me = a.rank, K = a.num_topk, x_int4 = a.hidden / 8;
    uint8_t* mine = a.peers.bufs[me];
    const int own_begin = s_layout[kLayRecvOff + me];
    // Lane d < R: whether token t went to rank d, and its slot there; loaded a token ahead (as the
    // dispatch's senders do, see TokenRoute), so the loads do not wait for each other or the sums.
    auto load_hit = [&](int t, bool& hit, int& slot) {
        hit = false;
        slot = 0;
        if (t < a.num_tokens && lane < R) {
            hit = a.in_rank[static_cast<int64_t>(t) * R + lane];
            slot = a.slot[static_cast<int64_t>(t) * R + lane];
        }
    };
    bool next_hit;
    int next_slot;
    load_hit(warp, next_hit, next_slot);
    for (int t = warp; t < a.num_tokens; t += num_warps) {
        const bool hit = next_hit;
        const int64_t s = next_slot;
        load_hit(t + num_warps, next_hit, next_slot);
        const unsigned mask = __ballot_sync(kFullMask, hit);
        // Lane d finds (and for another rank, waits for) the row destination d returned: the waits
        // of all sources overlap.
        const int4* row_lane = nullptr;
        const float* w_lane = nullptr;
        bool ok = true;
        if (hit) {
            if (lane == me) {
                row_lane = reinterpret_cast<const int4*>(a.x + (own_begin + s) * a.hidden);
                if (K > 0) w_lane = a.weights + (own_begin + s) * K;
            } else {
                const uint8_t* r = mine + kRowsOffset + (s_layout[kLayCombBase + lane] + s) * a.row_stride;
                ok = wait_row_flag(reinterpret_cast<const int64_t*>(r + a.row_stride - kRowTrailerBytes), flag_value,
                                   mine, seq, a.timeout_ns, a.info, kOpCombine, lane);
                row_lane = reinterpret_cast<const int4*>(r);
                if (K > 0) w_lane = reinterpret_cast<const float*>(r + a.hidden * 2);
            }
        }
        if (!__all_sync(kFullMask, ok)) return;  // lanes must leave together (warp collectives follow)
        __syncwarp();  // lane d acquired row d's flag; the warp's loads of that row come after (memory order)
        auto row_of = [&](int d) {
            return reinterpret_cast<const int4*>(__shfl_sync(kFullMask, reinterpret_cast<uint64_t>(row_lane), d));
        };
        if (a.out_weights != nullptr) {
            // Every source's weights are loaded before the first is added (a loop over the mask
            // would wait for each load in turn); the sum keeps ascending rank order.
            float w[kMaxRanks];
#pragma unroll
            for (int d = 0; d < kMaxRanks; ++d) {
                const auto* p = reinterpret_cast<const float*>(
                    __shfl_sync(kFullMask, reinterpret_cast<uint64_t>(w_lane), d));
                w[d] = (mask >> d & 1u) && lane < K ? p[lane] : 0.f;
            }
            float acc = 0.f;
#pragma unroll
            for (int d = 0; d < kMaxRanks; ++d)
                if (mask >> d & 1u) acc += w[d];
            if (lane < K) a.out_weights[static_cast<int64_t>(t) * K + lane] = acc;
        }
        int4* out = reinterpret_cast<int4*>(a.out + static_cast<int64_t>(t) * a.hidden);
        const int4* b0 = a.bias0 != nullptr ? reinterpret_cast<const int4*>(a.bias0 + static_cast<int64_t>(t) * a.hidden)
                                            : nullptr;
        const int4* b1 = a.bias1 != nullptr ? reinterpret_cast<const int4*>(a.bias1 + static_cast<int64_t>(t) * a.hidden)
                                            : nullptr;
        // kUnroll words per lane at a time, two sources' loads in flight (sum_sources).
        constexpr int kUnroll = 4;
        auto load = [&](int d, int c0, int4 (&v)[kUnroll]) {
            const int4* p = row_of(d);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int c = c0 + u * kWarpSize;
                if (c < x_int4) v[u] = d == me ? ld_nc_int4(p + c) : p[c];
            }
        };
        for (int c0 = lane; c0 < x_int4; c0 += kUnroll * kWarpSize)
            sum_sources<kUnroll>(mask, c0, x_int4, load, [&](int u, float (&acc)[8]) {
                const int c = c0 + u * kWarpSize;
                if (b0 != nullptr) add_bf16x8(acc, ld_nc_int4(b0 + c));
                if (b1 != nullptr) add_bf16x8(acc, ld_nc_int4(b1 + c));
                out[c] = round_bf16x8(acc);
            });
    }
}

__global__ void __launch_bounds__(512, 1) combine_kernel(CombineArgs a) {
    const int w = threadIdx.x / kWarpSize, warps_per_block = blockDim.x / kWarpSize;
    uint8_t* mine = a.peers.bufs[a.rank];
    __shared__ int s_layout[kLayoutInts];
    if (threadIdx.x < kLayoutInts) s_layout[threadIdx.x] = a.layout[threadIdx.x];
    __syncthreads();
    if (s_layout[kLayAbort] != 0) return;
    const int64_t seq = ld_volatile(seq_word(mine));
    if (ld_volatile(abort_word(mine)) == seq) return;
    if (s_layout[kLayMaxSend] > a.cap_rows) {
        if (threadIdx.x == 0 && blockIdx.x == 0) report_error(a.info, kErrCapacity, kOpCombine, -1);
        return;
    }
    const int64_t flag_value = seq ^ kFlagMagic;
    const int block = blockIdx.x;
    if (block < a.num_send_blocks) {
        send_role(
            a.tma_warps, a.hidden * 2, block, a.num_send_blocks,
            [&](int warp, int num_warps) { combine_send(a, s_layout, flag_value, warp, num_warps); },
            [&](int warp, int num_warps, const SendRing& ring) {
                combine_send_tma(a, s_layout, flag_value, warp, num_warps, ring);
            });
        return;
    }
    combine_reduce(a, s_layout, seq, flag_value, (block - a.num_send_blocks) * warps_per_block + w,
                   (gridDim.x - a.num_send_blocks) * warps_per_block);
}

}  // namespace epcomm

// ---------------------------------------------------------------- host entry points (C ABI, no torch)
using namespace epcomm;

// Shared memory the bulk-copy senders may take per block (of the 227 KB an SM has): their row rings.
constexpr int64_t kSendSmemBudget = 200 * 1024;

// Warps per sending block that move rows of `row_bytes` by bulk copies (0: register copies, when
// asked for or when not even one ring fits), and the dynamic shared memory they need.
static int send_tma_warps(bool use_tma, int row_bytes, int64_t& smem) {
    const int64_t per_warp = SendRing::smem_bytes(1, row_bytes);
    int warps = use_tma ? static_cast<int>(kSendSmemBudget / per_warp) : 0;
    warps = warps > 16 ? 16 : warps;  // a block has 512 threads
    smem = warps * per_warp;
    return warps;
}

// Let `kernel` take `smem` bytes of dynamic shared memory (above the default 48 KB); set once per size.
template <class Kernel>
static cudaError_t allow_smem(Kernel kernel, int64_t smem, int64_t& allowed) {
    if (smem <= allowed) return cudaSuccess;
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err == cudaSuccess) allowed = smem;
    return err;
}

// The records Python fills for a call (call_record.cuh; ctypes mirrors in backends/cuda/intranode.py,
// checked through epcomm_struct_layout and epcomm_struct_field_name). A field means what the kernel
// argument of the same name means (NotifyArgs, DispatchArgs, CombineArgs).

// What every call of one rank's Buffer shares.
struct CallContext {
    uint64_t peer_bufs;  // const uint64_t [num_ranks]: every rank's buffer in this process's address space
    uint64_t info, timeout_ns;
    int32_t rank, num_ranks;
};

struct NotifyCall {
    CallContext context;
    uint64_t in_rank, send_counts, expert_counts, topk_idx, slot, own_tokens, layout;
    int32_t op, num_tokens, experts_per_rank, num_topk, expert_alignment, num_worst_tokens, row_bytes;
    int32_t num_sms;  // the call's SM budget: the count exchange's blocks stay within it
    int32_t shape_key, pad0;
};

struct DispatchCall {
    CallContext context;
    uint64_t x, scales, topk_idx, topk_weights, in_rank, slot, own_tokens, layout;
    uint64_t recv_x, recv_scales, recv_topk_idx, recv_topk_weights;
    int64_t scale_stride_t, scale_stride_c, recv_scale_stride_t, recv_scale_stride_c, cap_rows;
    int32_t num_tokens, x_bytes, num_scales, num_topk, has_topk, has_weights, experts_per_rank, row_stride;
    int32_t num_out_rows, num_sms, num_send_blocks, mode, op, use_tma;
    int32_t local_by_receiver, pad0;  // the fused kernel's (mode 0): see DispatchArgs
};

struct CombineCall {
    CallContext context;
    uint64_t x, weights, in_rank, slot, layout, bias0, bias1, out, out_weights;
    int64_t cap_rows;
    int32_t num_tokens, hidden, num_topk, row_stride, num_sms, num_send_blocks, use_tma, pad0;
};

namespace epcomm {  // where the template fields_of lives
template <>
constexpr auto fields_of<CallContext>() {
    using S = CallContext;
    return std::array{EPCOMM_FIELD(peer_bufs), EPCOMM_FIELD(info), EPCOMM_FIELD(timeout_ns), EPCOMM_FIELD(rank),
                      EPCOMM_FIELD(num_ranks)};
}
template <>
constexpr auto fields_of<NotifyCall>() {
    using S = NotifyCall;
    return std::array{EPCOMM_FIELD(context), EPCOMM_FIELD(in_rank), EPCOMM_FIELD(send_counts),
                      EPCOMM_FIELD(expert_counts), EPCOMM_FIELD(topk_idx), EPCOMM_FIELD(slot),
                      EPCOMM_FIELD(own_tokens), EPCOMM_FIELD(layout), EPCOMM_FIELD(op), EPCOMM_FIELD(num_tokens),
                      EPCOMM_FIELD(experts_per_rank), EPCOMM_FIELD(num_topk), EPCOMM_FIELD(expert_alignment),
                      EPCOMM_FIELD(num_worst_tokens), EPCOMM_FIELD(row_bytes), EPCOMM_FIELD(num_sms),
                      EPCOMM_FIELD(shape_key), EPCOMM_FIELD(pad0)};
}
template <>
constexpr auto fields_of<DispatchCall>() {
    using S = DispatchCall;
    return std::array{EPCOMM_FIELD(context), EPCOMM_FIELD(x), EPCOMM_FIELD(scales), EPCOMM_FIELD(topk_idx),
                      EPCOMM_FIELD(topk_weights), EPCOMM_FIELD(in_rank), EPCOMM_FIELD(slot), EPCOMM_FIELD(own_tokens),
                      EPCOMM_FIELD(layout), EPCOMM_FIELD(recv_x), EPCOMM_FIELD(recv_scales),
                      EPCOMM_FIELD(recv_topk_idx), EPCOMM_FIELD(recv_topk_weights), EPCOMM_FIELD(scale_stride_t),
                      EPCOMM_FIELD(scale_stride_c), EPCOMM_FIELD(recv_scale_stride_t),
                      EPCOMM_FIELD(recv_scale_stride_c), EPCOMM_FIELD(cap_rows), EPCOMM_FIELD(num_tokens),
                      EPCOMM_FIELD(x_bytes), EPCOMM_FIELD(num_scales), EPCOMM_FIELD(num_topk),
                      EPCOMM_FIELD(has_topk), EPCOMM_FIELD(has_weights), EPCOMM_FIELD(experts_per_rank),
                      EPCOMM_FIELD(row_stride), EPCOMM_FIELD(num_out_rows), EPCOMM_FIELD(num_sms),
                      EPCOMM_FIELD(num_send_blocks), EPCOMM_FIELD(mode), EPCOMM_FIELD(op), EPCOMM_FIELD(use_tma),
                      EPCOMM_FIELD(local_by_receiver), EPCOMM_FIELD(pad0)};
}
template <>
constexpr auto fields_of<CombineCall>() {
    using S = CombineCall;
    return std::array{EPCOMM_FIELD(context), EPCOMM_FIELD(x), EPCOMM_FIELD(weights), EPCOMM_FIELD(in_rank),
                      EPCOMM_FIELD(slot), EPCOMM_FIELD(layout), EPCOMM_FIELD(bias0), EPCOMM_FIELD(bias1),
                      EPCOMM_FIELD(out), EPCOMM_FIELD(out_weights), EPCOMM_FIELD(cap_rows), EPCOMM_FIELD(num_tokens),
                      EPCOMM_FIELD(hidden), EPCOMM_FIELD(num_topk), EPCOMM_FIELD(row_stride), EPCOMM_FIELD(num_sms),
                      EPCOMM_FIELD(num_send_blocks), EPCOMM_FIELD(use_tma), EPCOMM_FIELD(pad0)};
}
}  // namespace epcomm

constexpr RecordLayout kCallRecords[] = {
    record_layout<CallContext>("CallContext"), record_layout<NotifyCall>("NotifyCall"),
    record_layout<DispatchCall>("DispatchCall"), record_layout<CombineCall>("CombineCall")};

// The fields every kernel's arguments share, from the call's context.
template <class Args>
static void set_context(Args& a, const CallContext& c) {
    const auto* bufs = reinterpret_cast<const uint64_t*>(static_cast<uintptr_t>(c.peer_bufs));
    for (int r = 0; r < c.num_ranks; ++r) set_ptr(a.peers.bufs[r], bufs[r]);
    a.rank = c.rank;
    a.num_ranks = c.num_ranks;
    set_ptr(a.info, c.info);
    a.timeout_ns = c.timeout_ns;
}

// What a dispatch and its combine share: the dispatch's routing, the buffer's row slots, the
// token count and top-k width.
template <class Args, class Call>
static void set_routing(Args& a, const Call& c) {
    a.num_tokens = c.num_tokens;
    a.num_topk = c.num_topk;
    set_ptr(a.in_rank, c.in_rank);
    set_ptr(a.slot, c.slot);
    set_ptr(a.layout, c.layout);
    a.row_stride = c.row_stride;
    a.cap_rows = c.cap_rows;
}

// Blocks of a kernel whose first num_send_blocks send and the others receive (or reduce): num_sms,
// and at least one block for each role.
static int split_blocks(int num_sms, int num_send_blocks, int& send_blocks) {
    const int blocks = num_sms > 1 ? num_sms : 2;
    send_blocks = num_send_blocks < 1 ? 1 : (num_send_blocks >= blocks ? blocks - 1 : num_send_blocks);
    return blocks;
}

extern "C" {

// CUDA IPC of a buffer that may sit inside a larger allocation (PyTorch's caching allocator):
// export the allocation's handle plus the offset of `ptr` in it.
int epcomm_ipc_export(int device, void* ptr, void* handle_out, int64_t* offset_out) {
    if (cudaSetDevice(device) != cudaSuccess) return static_cast<int>(cudaGetLastError());
    CUdeviceptr base = 0;
    size_t size = 0;
    if (cuMemGetAddressRange(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) return -1;
    *offset_out = static_cast<int64_t>(reinterpret_cast<CUdeviceptr>(ptr) - base);
    cudaIpcMemHandle_t handle;
    const cudaError_t err = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
    if (err != cudaSuccess) return static_cast<int>(err);
    std::memcpy(handle_out, &handle, sizeof(handle));
    return 0;
}

// Map a peer's buffer into this process on `device` (the caller's own GPU), peer access enabled.
int epcomm_ipc_open(int device, const void* handle_in, int64_t offset, void** base_out, void** ptr_out) {
    if (cudaSetDevice(device) != cudaSuccess) return static_cast<int>(cudaGetLastError());
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, handle_in, sizeof(handle));
    void* base = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) return static_cast<int>(err);
    *base_out = base;
    *ptr_out = static_cast<char*>(base) + offset;
    return 0;
}

int epcomm_ipc_close(void* base) { return static_cast<int>(cudaIpcCloseMemHandle(base)); }

// Constants the Python side mirrors (checked when the library loads).
int epcomm_constant(const char* name) {
    struct Entry {
        const char* name;
        int value;
    };
    static const Entry entries[] = {
        {"rows_offset", kRowsOffset},       {"row_trailer_bytes", kRowTrailerBytes},
        {"max_ranks", kMaxRanks},           {"max_experts_per_rank", kMaxExpertsPerRank},
        {"info_ints", kInfoInts},           {"layout_ints", kLayoutInts},
        {"info_error", kInfoError},         {"info_error_op", kInfoErrorOp},
        {"info_error_ranks", kInfoErrorRanks}, {"info_num_recv", kInfoNumRecv},
        {"info_recv_counts", kInfoRecvCounts}, {"info_matrix", kInfoMatrix},
        {"info_max_recv", kInfoMaxRecv},    {"info_max_send", kInfoMaxSend},
        {"info_refusal", kInfoRefusal},     {"info_experts", kInfoExperts},
        {"op_dispatch", kOpDispatch},       {"op_cached_dispatch", kOpCachedDispatch},
        {"op_combine", kOpCombine},         {"op_barrier", kOpBarrier},
        {"lay_max_recv", kLayMaxRecv},      {"lay_max_send", kLayMaxSend},
    };
    for (const Entry& e : entries)
        if (std::strcmp(e.name, name) == 0) return e.value;
    return -1;
}

int epcomm_get_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                               int ranks_per_domain, int* per_rank, int* per_domain, int* per_expert, bool* in_rank,
                               cudaStream_t stream) {
    if (num_tokens == 0) return 0;
    constexpr int kThreads = 256;
    const int num_counters = num_experts + num_ranks + num_ranks / ranks_per_domain;
    const size_t smem = static_cast<size_t>(num_counters) * sizeof(int);
    if (smem > 48 * 1024) return static_cast<int>(cudaErrorInvalidValue);
    layout_kernel<<<(num_tokens + kThreads - 1) / kThreads, kThreads, smem, stream>>>(
        topk_idx, num_tokens, num_topk, num_experts, num_ranks, ranks_per_domain, per_rank, per_domain, per_expert,
        in_rank);
    return static_cast<int>(cudaGetLastError());
}

int epcomm_notify(const NotifyCall* call, cudaStream_t stream) {
    const NotifyCall& c = *call;
    NotifyArgs a{};
    set_context(a, c.context);
    a.op = c.op;
    a.num_tokens = c.num_tokens;
    set_ptr(a.in_rank, c.in_rank);
    set_ptr(a.send_counts, c.send_counts);
    set_ptr(a.expert_counts, c.expert_counts);
    a.experts_per_rank = c.experts_per_rank;
    set_ptr(a.topk_idx, c.topk_idx);
    a.num_topk = c.num_topk;
    a.expert_alignment = c.expert_alignment;
    a.num_worst_tokens = c.num_worst_tokens;
    a.row_bytes = c.row_bytes;
    a.shape_key = c.shape_key;
    set_ptr(a.slot, c.slot);
    set_ptr(a.own_tokens, c.own_tokens);
    set_ptr(a.layout, c.layout);
    if (a.op != kOpDispatch) {  // a barrier only: one block
        notify_kernel<<<1, kNotifyThreads, 0, stream>>>(a);
        return static_cast<int>(cudaGetLastError());
    }
    // The count exchange: a block per kTokensPerNotifyBlock tokens scans them (scan_slots), all at
    // once (they meet at a grid barrier).
    // No more blocks than the call's SM budget (a cooperative launch waits for all of its SMs to be
    // free: work overlapping on other streams keeps the rest), nor than the device's SMs (one block
    // fills an SM; a cooperative launch of more is refused: a MIG slice).
    constexpr int kTokensPerNotifyBlock = 1024;
    int device = 0, sms = 1;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
        return static_cast<int>(cudaGetLastError());
    const int blocks = std::max(1, std::min({kMaxNotifyBlocks, sms, c.num_sms,
                                             (c.num_tokens + kTokensPerNotifyBlock - 1) / kTokensPerNotifyBlock}));
    if (blocks > 1) {
        if (launch_cooperative(notify_kernel, blocks, kNotifyThreads, 0, stream, a) == cudaSuccess) return 0;
        // Refused (fewer SMs are this process's than the device has: MPS, green contexts): one block
        // scans every token, as before the grid. The refusal is not left for a later call to report.
        (void)cudaGetLastError();
    }
    notify_kernel<<<1, kNotifyThreads, 0, stream>>>(a);  // one block meets no grid barrier
    return static_cast<int>(cudaGetLastError());
}

// mode 0: the fused kernel (its senders write this rank's own rows); 1: send half only; 2: receive
// half only (1 and 2 together: own rows copied by the receivers from x).
int epcomm_dispatch(const DispatchCall* call, cudaStream_t stream) {
    const DispatchCall& c = *call;
    DispatchArgs a{};
    set_context(a, c.context);
    set_routing(a, c);
    set_ptr(a.own_tokens, c.own_tokens);
    set_ptr(a.x, c.x);
    a.x_bytes = c.x_bytes;
    set_ptr(a.scales, c.scales);
    a.num_scales = c.num_scales;
    a.scale_stride_t = c.scale_stride_t;
    a.scale_stride_c = c.scale_stride_c;
    set_ptr(a.topk_idx, c.topk_idx);
    set_ptr(a.topk_weights, c.topk_weights);
    a.has_topk = c.has_topk != 0;
    a.has_weights = c.has_weights != 0;
    a.experts_per_rank = c.experts_per_rank;
    set_ptr(a.recv_x, c.recv_x);
    set_ptr(a.recv_scales, c.recv_scales);
    a.recv_scale_stride_t = c.recv_scale_stride_t;
    a.recv_scale_stride_c = c.recv_scale_stride_c;
    set_ptr(a.recv_topk_idx, c.recv_topk_idx);
    set_ptr(a.recv_topk_weights, c.recv_topk_weights);
    a.num_out_rows = c.num_out_rows;
    a.op = c.op;
    const int blocks = split_blocks(c.num_sms, c.num_send_blocks, a.num_send_blocks);
    int64_t smem = 0;
    a.tma_warps = send_tma_warps(c.use_tma != 0 && c.mode != 2, c.x_bytes, smem);
    cudaError_t err = cudaSuccess;
    if (c.mode == 0) {
        static int64_t allowed = 48 * 1024;
        a.local_by_receiver = c.local_by_receiver != 0;
        err = allow_smem(dispatch_kernel<true, true>, smem, allowed);
        if (err == cudaSuccess) dispatch_kernel<true, true><<<blocks, 512, smem, stream>>>(a);
    } else if (c.mode == 1) {
        static int64_t allowed = 48 * 1024;
        a.local_by_receiver = true;
        err = allow_smem(dispatch_kernel<true, false>, smem, allowed);
        if (err == cudaSuccess) dispatch_kernel<true, false><<<a.num_send_blocks, 512, smem, stream>>>(a);
    } else {
        a.local_by_receiver = true;
        dispatch_kernel<false, true><<<blocks - a.num_send_blocks, 512, 0, stream>>>(a);
    }
    return static_cast<int>(err != cudaSuccess ? err : cudaGetLastError());
}

int epcomm_combine(const CombineCall* call, cudaStream_t stream) {
    const CombineCall& c = *call;
    CombineArgs a{};
    set_context(a, c.context);
    set_routing(a, c);
    a.hidden = c.hidden;
    set_ptr(a.x, c.x);
    set_ptr(a.weights, c.weights);
    set_ptr(a.bias0, c.bias0);
    set_ptr(a.bias1, c.bias1);
    set_ptr(a.out, c.out);
    set_ptr(a.out_weights, c.out_weights);
    const int blocks = split_blocks(c.num_sms, c.num_send_blocks, a.num_send_blocks);
    int64_t smem = 0;
    a.tma_warps = send_tma_warps(c.use_tma != 0, c.hidden * 2, smem);
    static int64_t allowed = 48 * 1024;
    const cudaError_t err = allow_smem(combine_kernel, smem, allowed);
    if (err != cudaSuccess) return static_cast<int>(err);
    combine_kernel<<<blocks, 512, smem, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

// The layout and field names of call record `name` (CallContext, NotifyCall, DispatchCall,
// CombineCall): write_record_layout and record_field_name (call_record.cuh) say what they return.
int epcomm_struct_layout(const char* name, int64_t* out, int max) {
    return write_record_layout(kCallRecords, name, out, max);
}

const char* epcomm_struct_field_name(const char* name, int index) {
    return record_field_name(kCallRecords, name, index);
}

}  // extern "C"
