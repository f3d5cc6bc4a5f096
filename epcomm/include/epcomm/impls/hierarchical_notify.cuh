// Hierarchical notify: the counts exchange without a host collective, the call counter, and the
// layout's derived tables (before and after the exchange).
#pragma once

#include "hierarchical_protocol.cuh"

namespace epcomm {
namespace hierarchical {

// ------------------------------------------------------------------ plan
// What a fresh dispatch derives from its layout before the counts exchange, in one launch (as
// tensor operations it cost more host time than the transfer itself). Block c < R scans column c of
// is_token_in_rank: each token's slot at rank c (its index among this rank's tokens to c, -1 when
// not sent there) and their count, which must equal num_tokens_per_rank[c]; block R + d scans "sent
// to any of domain d's ranks": flags, each token's row in staging region d (pos: the exclusive
// prefix count), its inverse region_tokens[d][pos] (the token of each region row, for the regions
// sent unstaged) and the region's count. All blocks share the copy of the per-expert counts into the
// counts row, the check of the top-k ids and the -1 fill of the handle's slot table. A count that
// disagrees or an id outside [-1, E) sets `refused` (advance_kernel makes it the row's digest).
constexpr int kPlanThreads = 512;

struct PlanArgs {
    const bool* in_rank;           // [T, R]
    const int* tokens_per_rank;    // [R]
    const int* tokens_per_expert;  // [E]
    const int64_t* topk_idx;       // [T, K] or null
    int num_tokens, num_ranks, num_domains, ranks_per_domain, num_topk, num_experts;
    int* outgoing;     // the counts row: tokens, digest (advance_kernel), tokens per rank, per expert
    int* refused;
    int* slots;        // [T, R]
    bool* flags;       // [T, D]
    int* pos;          // [T, D]
    int* send_counts;  // [D]
    int* recv_counts;  // [D]: zeroed (stays 0 when the call gives up)
    int* slot_table;   // [table_ints]: -1 (rows a given-up call leaves unwritten have no destination)
    int64_t table_ints;
    int* region_tokens;  // [D, region_rows]: the token of each row of each region (rows sent unstaged)
    int64_t region_rows;
};

// After the notify: the handle's copy of the count matrix (the next notify rewrites the rows), where
// each source's block starts in each rank's output (the prefix of the matrix's columns), this rank's
// total, and what the host reads after its sync (`summary`, host-mapped): every rank's token count,
// the matrix, and the totals of this rank's experts.
//
// A call that does not fit (a rank has more tokens than a staging region holds, or receives more
// rows than a receive area holds) moves nothing when `rounds` is set: the counts it moves by (this
// rank's region counts, the matrix, the starts, the total) are zeroed, so the dispatch kernel runs
// its protocol with empty regions and reports nothing; the host, which sees the true counts in the
// summary, reruns the call in rounds that fit. Every rank decides alike: from the same rows and the
// same limits (the buffers' sizes are equal on every rank, the shape digest made the rows' shapes so).
struct CountsArgs {
    const int* current;  // [R, width]: the notify's rows
    int width, num_ranks, rank, experts_per_rank, num_domains;
    int* matrix;         // [R, R]
    int* start;          // [R, R]
    int* recv_total;     // [1]
    int* summary;        // [R + R * R + experts_per_rank]
    int* send_counts;    // [D]: this rank's staging regions' counts (plan_kernel)
    int64_t region_rows; // tokens a staging region holds
    int64_t recv_rows;   // rows a rank may receive (its receive area, for the dispatch and its combine)
    int rounds;          // 1: a call that does not fit moves nothing (the host runs it in rounds)
};

__device__ __forceinline__ bool plan_column(const PlanArgs& a, int col, int64_t t) {
    const bool* row = a.in_rank + t * a.num_ranks;
    if (col < a.num_ranks) return row[col];
    const int first = (col - a.num_ranks) * a.ranks_per_domain;
    bool any = false;
    for (int i = 0; i < a.ranks_per_domain; ++i) any |= row[first + i];
    return any;
}

// ------------------------------------------------------------------ kernels
// The counts exchange of a dispatch, without a host collective (a dead rank is named within the
// timeout, never waited for): every rank puts its counts row (tokens, shape digest, tokens per
// rank, tokens per expert) from the outgoing row of its counts area into row `rank` of every rank's
// incoming rows, in two sets used by alternate notifies (a rank may run one notify ahead of
// another, never two, since each notify waits for every rank's), and signals it. Block r (a warp)
// delivers to rank r, waits for rank r's row and copies it to row r of the current rows, which the
// host and later kernels read (the same place whichever set it came in). A row with another shape
// digest gives up the call (error 2); a rank whose inputs are invalid sends the digest kRefused, and
// every rank gives up naming it (error 5). Counts area: incoming[2][R], outgoing, current[R] rows.
__global__ void notify_kernel(Call c, int64_t counts_offset, int width, int row_ints) {
    const int r = blockIdx.x, me = c.domain_rank(c.local);
    int* counts = reinterpret_cast<int*>(c.sym + counts_offset);
    int* incoming = counts + (ld_volatile(sym_notify_seq(c.sym)) % 2) * c.num_ranks * width;
    const int* outgoing = counts + 2 * c.num_ranks * width;
    int* current = counts + (2 * c.num_ranks + 1) * width;
    bool ok = false;
    if (threadIdx.x == 0) {
        nvshmem_putmem_nbi(incoming + me * width, outgoing, static_cast<size_t>(row_ints) * 4, r);
        nvshmem_quiet();
        __threadfence_system();
        nvshmemx_signal_op(reinterpret_cast<uint64_t*>(sym_notified(c.sym, me)), static_cast<uint64_t>(c.call()),
                           NVSHMEM_SIGNAL_SET, r);
        int64_t seen = 0;
        ok = wait_for(c, sym_notified(c.sym, r), [&](int64_t v) { return v >= c.call(); }, r, &seen, kPhaseNotify);
        const int digest = ok ? ld_volatile_int(incoming + r * width + 1) : 0;
        const int mine = ld_volatile_int(outgoing + 1);
        if (ok && mine == kPendingError) {  // this rank's own earlier error: give up this call too
            if (ld_volatile_int(c.info + kInfoError) == 0) c.report(kErrEarlierError, me);  // the host raised it already
            c.give_up();
            ok = false;
        } else if (ok && (digest == kRefused || digest == kPendingError)) {  // every rank names rank r
            c.abort(digest == kRefused ? kErrRefused : kErrEarlierError, r);
            ok = false;
        } else if (ok && digest != mine) {
            c.abort(mine == kRefused ? kErrRefused : kErrMismatch, mine == kRefused ? me : r);
            ok = false;
        }
    }
    if (threadIdx.x == 0 && !ok) *sym_notify_gave_up(c.sym) = c.call();  // read by this call's dispatch kernel
    ok = __shfl_sync(kFullMask, ok, 0);
    for (int k = threadIdx.x; k < row_ints; k += kWarpSize)
        current[r * width + k] = ok ? ld_volatile_int(incoming + r * width + k) : 0;
}

// Before each operation: the next call number; for a dispatch's notify also the next notify and
// its outgoing digest: kPendingError when an earlier call of this rank reported an error, kRefused
// when plan_kernel refused the inputs (the word is cleared for the next plan), else the call's
// shape digest. Decided once here, so every block of the notify sends the same row.
__global__ void advance_kernel(uint8_t* sym, int notify, int* outgoing_digest, int* refused, int digest) {
    *sym_seq(sym) += 1;
    if (notify) {
        *sym_notify_seq(sym) += 1;
        int value = digest;
        if (*refused != 0) value = kRefused;
        *refused = 0;
        if (ld_volatile(sym_sticky_error(sym)) != 0) value = kPendingError;
        *outgoing_digest = value;
    }
}

__global__ void __launch_bounds__(kPlanThreads) plan_kernel(PlanArgs a) {
    constexpr int kWarps = kPlanThreads / kWarpSize;
    __shared__ int s_warp[kWarps];
    const int col = blockIdx.x, R = a.num_ranks, D = a.num_domains;
    // Each thread takes a contiguous segment of tokens; a block-wide scan of the segments' counts
    // gives each segment's first index.
    const int64_t per = (a.num_tokens + kPlanThreads - 1) / kPlanThreads;
    const int64_t num_tokens = a.num_tokens;
    const int64_t lo = min(num_tokens, static_cast<int64_t>(threadIdx.x) * per), hi = min(num_tokens, lo + per);
    int count = 0;
    for (int64_t t = lo; t < hi; ++t) count += plan_column(a, col, t);
    int total;
    int index = block_exclusive_sum<kWarps>(count, s_warp, total);
    for (int64_t t = lo; t < hi; ++t) {
        const bool set = plan_column(a, col, t);
        if (col < R) {
            a.slots[t * R + col] = set ? index : -1;
        } else {
            a.flags[t * D + col - R] = set;
            a.pos[t * D + col - R] = index;
            if (set && index < a.region_rows) a.region_tokens[(col - R) * a.region_rows + index] = static_cast<int>(t);
        }
        index += set;
    }
    if (threadIdx.x == 0) {
        if (col < R) {
            a.outgoing[2 + col] = a.tokens_per_rank[col];
            if (total != a.tokens_per_rank[col]) *a.refused = 1;
        } else {
            a.send_counts[col - R] = total;
            a.recv_counts[col - R] = 0;
        }
        if (col == 0) a.outgoing[0] = a.num_tokens;
    }
    const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t e = first; e < a.num_experts; e += stride) a.outgoing[2 + R + e] = a.tokens_per_expert[e];
    if (a.topk_idx != nullptr) {
        bool bad = false;
        for (int64_t i = first; i < static_cast<int64_t>(a.num_tokens) * a.num_topk; i += stride)
            bad |= a.topk_idx[i] < -1 || a.topk_idx[i] >= a.num_experts;
        if (bad) *a.refused = 1;
    }
    for (int64_t i = first; i < a.table_ints; i += stride) a.slot_table[i] = -1;
}

__global__ void counts_kernel(CountsArgs a) {
    const int R = a.num_ranks;
    bool too_big = false;
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        int received = 0;
        for (int s = 0; s < R; ++s) received += a.current[s * a.width + 2 + r];
        too_big |= a.current[r * a.width] > a.region_rows || received > a.recv_rows;
    }
    const bool skip = __syncthreads_or(too_big) && a.rounds != 0;
    for (int i = threadIdx.x; i < R * R; i += blockDim.x) {
        const int v = a.current[(i / R) * a.width + 2 + i % R];
        a.matrix[i] = skip ? 0 : v;
        a.summary[R + i] = v;
    }
    for (int d = threadIdx.x; skip && d < a.num_domains; d += blockDim.x) a.send_counts[d] = 0;
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        a.summary[r] = a.current[r * a.width];
        int running = 0;
        for (int s = 0; s < R; ++s) {
            a.start[s * R + r] = skip ? 0 : running;
            running += a.current[s * a.width + 2 + r];
        }
        if (r == a.rank) *a.recv_total = skip ? 0 : running;
    }
    const int first_expert = 2 + R + a.rank * a.experts_per_rank;
    for (int e = threadIdx.x; e < a.experts_per_rank; e += blockDim.x) {
        int sum = 0;
        for (int s = 0; s < R; ++s) sum += a.current[s * a.width + first_expert + e];
        a.summary[R + R * R + e] = sum;
    }
}

}  // namespace hierarchical
}  // namespace epcomm
