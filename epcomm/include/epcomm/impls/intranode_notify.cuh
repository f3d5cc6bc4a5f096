// Intranode notify: the call counter, the exchange of row and expert counts, input validation, the
// bounded barrier, and the layout every later kernel of the call reads.
#pragma once

#include <cooperative_groups.h>

#include "../common/row_order.cuh"
#include "../layout/intranode.cuh"

namespace epcomm {

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
// Spread, because one block alone streams the top-k ids (64 bytes a token) too slowly for large
// calls (docs/TUNING.md, count scan).
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
                record_error(a.info, kErrTimeout, a.op, tid, kPhaseNotify);
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
        if (refused && !broken) record_error(a.info, kErrRefused, a.op, -1);
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

}  // namespace epcomm
