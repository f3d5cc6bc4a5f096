// The hierarchical normal mode's dispatch (design: hierarchical.cuh): the counts exchange
// (notify_kernel), the call counter (advance_kernel), the layout's derived tables (plan_kernel,
// before the exchange; counts_kernel, after it), staging (stage_kernel), the kernel that runs
// both tiers (dispatch_kernel) and the copy of the received rows out of the IPC area (copy_out_kernel).
#include "hierarchical.cuh"

namespace epcomm {
namespace hierarchical {

// ------------------------------------------------------------------ notify
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
        ok = wait_for(c, sym_notified(c.sym, r), [&](int64_t v) { return v >= c.call(); }, r, &seen);
        const int digest = ok ? ld_volatile_int(incoming + r * width + 1) : 0;
        const int mine = ld_volatile_int(outgoing + 1);
        if (ok && mine == kPendingError) {  // this rank's own earlier error: give up this call too
            if (ld_volatile_int(c.info + kInfoError) == 0) c.report(6, me);  // the host raised it already
            c.give_up();
            ok = false;
        } else if (ok && (digest == kRefused || digest == kPendingError)) {  // every rank names rank r
            c.abort(digest == kRefused ? 5 : 6, r);
            ok = false;
        } else if (ok && digest != mine) {
            c.abort(mine == kRefused ? 5 : 2, mine == kRefused ? me : r);
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

__device__ __forceinline__ bool plan_column(const PlanArgs& a, int col, int64_t t) {
    const bool* row = a.in_rank + t * a.num_ranks;
    if (col < a.num_ranks) return row[col];
    const int first = (col - a.num_ranks) * a.ranks_per_domain;
    bool any = false;
    for (int i = 0; i < a.ranks_per_domain; ++i) any |= row[first + i];
    return any;
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

// ------------------------------------------------------------------ dispatch
// Slow-tier fields, in each area: token rows, scales, top-k ids (of the destination domain's
// experts), weights, slots (per domain rank: the row's place in its block of this source there, -1).
enum { kX, kScales, kTopk, kWeights, kSlots, kNumFields };
// Fast-tier fields, in each rank's IPC area: token rows, scales, top-k ids (the rank's), weights.
enum { kOutX, kOutScales, kOutTopk, kOutWeights, kNumOutFields };

struct DispatchArgs {
    Call c;
    int64_t area, region_rows;
    int64_t off[kNumFields];       // of each field's array in the staging area (the receive area: + area)
    int64_t out_off[kNumOutFields];  // of each field's array in the IPC buffer
    int64_t out_rows;              // rows each IPC area holds
    int64_t x_bytes;
    int num_scales, num_topk, experts_per_rank;
    bool with_weights, fresh;      // fresh: routing travels (slots, top-k); cached: rows and scales only
    const int* send_counts;        // [D]
    int* recv_counts;              // [D] written
    const int* start;              // [R, R]: where source s's block starts in rank r's output
    const int* matrix;             // [R, R]: rows source s sends rank r (a slot past it is refused)
    int* slots;                    // [D * region_rows, L]: fresh: written (the handle keeps them); cached: read
    const int* recv_total;         // rows this rank receives (device: no host sync needed)
    int64_t num_out;               // rows of its outputs with num_worst_tokens, else -1 (the host sizes them)
    // Regions not staged (this rank's own domain's, forwarded here, and those of mates NVLink maps,
    // stored there) are read straight from the caller's tensors: region_tokens[d][p] is the token of
    // row p of region d; token_slots [T, R] its slots (fresh).
    const uint8_t* x;
    const int* scales;             // 4-byte words at t * scale_stride0 + c * scale_stride1
    int64_t scale_stride0, scale_stride1;
    const int64_t* topk_idx;       // [T, K] global expert ids (fresh)
    const float* weights;          // [T, K] (fresh, with_weights)
    const int* token_slots;        // [T, R] (fresh)
    const int* region_tokens;      // [D, region_rows]
};

// num_worst_tokens padding: this rank's rows [recv_total, num_out) get x = 0, scales = 0, ids = -1,
// weights = 0 (the reference's padding); more received rows than num_out is an error (4). The
// forwarder blocks share the rows; no other rank writes there.
__device__ void pad_rows(const DispatchArgs& a, int b) {
    const Call& c = a.c;
    const int64_t total = *a.recv_total;
    if (total > a.out_rows) {  // this rank's receive area cannot hold its rows (the forwarders skip them)
        if (b == 0 && threadIdx.x == 0) c.report(3, c.domain_rank(c.local));
        return;
    }
    if (a.num_out < 0) return;
    if (total > a.num_out) {
        if (b == 0 && threadIdx.x == 0) c.report(4, c.domain_rank(c.local));
        return;
    }
    uint8_t* out = c.peers[c.local] + kDomainHeaderBytes;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, num_warps = kDispatchThreads / kWarpSize;
    const int K = a.num_topk;
    for (int64_t p = total + b * num_warps + warp; p < a.num_out; p += c.num_forwarders * num_warps) {
        int4* x = reinterpret_cast<int4*>(out + a.out_off[kOutX] + p * a.x_bytes);
        for (int k = lane; k < a.x_bytes / 16; k += kWarpSize) x[k] = make_int4(0, 0, 0, 0);
        int* scales = reinterpret_cast<int*>(out + a.out_off[kOutScales] + p * a.num_scales * 4);
        for (int k = lane; k < a.num_scales; k += kWarpSize) scales[k] = 0;
        if (a.fresh && lane < K) {
            reinterpret_cast<int64_t*>(out + a.out_off[kOutTopk] + p * K * 8)[lane] = -1;
            if (a.with_weights) reinterpret_cast<float*>(out + a.out_off[kOutWeights] + p * K * 4)[lane] = 0.f;
        }
    }
}

// Rows [lo, hi) of region d, for a mate that NVLink maps here, stored straight into its receive area
// (region my_domain) from the caller's tensors, a warp per row, in the staged layout: the token's x,
// scales, top-k ids rebased to domain d's experts, weights and its slots at d's ranks. Staging them
// first (stage_kernel) would be a local copy more of every row.
__device__ void send_rows_unstaged(const DispatchArgs& a, int d, int64_t lo, int64_t hi) {
    const Call& c = a.c;
    const int L = c.ranks_per_domain, K = a.num_topk, R = c.num_ranks;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, num_warps = kDispatchThreads / kWarpSize;
    uint8_t* recv = c.mates[d] + c.stage_offset + a.area;
    const int64_t experts_per_domain = static_cast<int64_t>(L) * a.experts_per_rank;
    for (int64_t p = lo + warp; p < hi; p += num_warps) {
        const int64_t t = a.region_tokens[d * a.region_rows + p];
        const int64_t q = c.my_domain * a.region_rows + p;  // its row in the mate's receive area
        warp_copy_int4(reinterpret_cast<int4*>(recv + a.off[kX] + q * a.x_bytes),
                       reinterpret_cast<const int4*>(a.x + t * a.x_bytes), static_cast<int>(a.x_bytes / 16), lane);
        int* scales = reinterpret_cast<int*>(recv + a.off[kScales] + q * a.num_scales * 4);
        for (int k = lane; k < a.num_scales; k += kWarpSize)
            scales[k] = a.scales[t * a.scale_stride0 + k * a.scale_stride1];
        if (!a.fresh) continue;  // a cached dispatch moves rows and scales only
        if (lane < K) {
            const int64_t e = a.topk_idx[t * K + lane] - d * experts_per_domain;
            reinterpret_cast<int64_t*>(recv + a.off[kTopk] + q * K * 8)[lane] = e >= 0 && e < experts_per_domain ? e : -1;
            if (a.with_weights) reinterpret_cast<float*>(recv + a.off[kWeights] + q * K * 4)[lane] = a.weights[t * K + lane];
        }
        if (lane < L) reinterpret_cast<int*>(recv + a.off[kSlots] + q * L * 4)[lane] = a.token_slots[t * R + d * L + lane];
    }
}

// Sender block for chunk j of region d (another domain): once the mate has entered the call, its
// rows go to the mate's receive area, then the chunk's signal (with the region's count; a given-up
// call sends no rows and a done word that says so: mate_to_send).
__device__ void send_chunk(const DispatchArgs& a, int d, int j) {
    const Call& c = a.c;
    __shared__ int s_ok;
    if (threadIdx.x == 0) {
        if (j == 0)
            nvshmemx_signal_op(reinterpret_cast<uint64_t*>(sym_ready(c.sym, c.my_domain)),
                               static_cast<uint64_t>(c.entered()), NVSHMEM_SIGNAL_SET, c.mate(d));
        const uint64_t start = global_timer_ns();
        s_ok = mate_to_send(c, d, j, wait_entered(c, sym_ready(c.sym, d), c.mate(d)), start);
    }
    __syncthreads();
    if (!s_ok) return;
    const int64_t count = a.send_counts[d];
    int64_t lo, hi;
    chunk_rows(count, c.chunks, j, &lo, &hi);
    if (c.mates[d] != nullptr) {  // mapped: each row from the caller's tensors into the mate's receive area
        send_rows_unstaged(a, d, lo, hi);
        finish_to_mate(c, d, j, count);
        return;
    }
    const int64_t bytes[kNumFields] = {a.x_bytes, a.num_scales * 4, a.fresh ? a.num_topk * 8 : 0,
                                       a.fresh && a.with_weights ? a.num_topk * 4 : 0,
                                       a.fresh ? c.ranks_per_domain * 4 : 0};
    for (int f = 0; f < kNumFields; ++f) {
        if (bytes[f] == 0 || hi <= lo) continue;
        const int64_t src = c.stage_offset + a.off[f] + (d * a.region_rows + lo) * bytes[f];
        const int64_t dst = c.stage_offset + a.area + a.off[f] + (c.my_domain * a.region_rows + lo) * bytes[f];
        copy_to_mate(c, d, dst, src, (hi - lo) * bytes[f]);
    }
    finish_to_mate(c, d, j, count);
}

// Forward the rows of chunk j of region d (source s = d's mate of this rank) to the domain's ranks:
// another domain's from the receive area, this rank's own domain's straight from the caller's
// tensors (through region_tokens; staging them would be a copy more of every row).
__device__ void forward_chunk(const DispatchArgs& a, int d, int j) {
    const Call& c = a.c;
    __shared__ int s_count;
    const bool own = d == c.my_domain;  // this rank's own tokens: read from the caller's tensors
    if (threadIdx.x == 0) {
        s_count = own ? a.send_counts[d] : wait_chunk(c, d, j);
        if (c.aborted()) s_count = -1;  // a given-up call forwards nothing (its counts may be zeros)
        if (j == 0 && s_count >= 0) a.recv_counts[d] = s_count;
    }
    __syncthreads();
    if (s_count < 0) {
        __syncthreads();  // s_count is rewritten by the block's next chunk
        return;
    }
    int64_t lo, hi;
    chunk_rows(s_count, c.chunks, j, &lo, &hi);
    const uint8_t* recv = c.sym + c.stage_offset + a.area;  // other regions: the mates' rows landed there
    const int L = c.ranks_per_domain, K = a.num_topk, R = c.num_ranks;
    const int s = c.mate(d);
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, num_warps = kDispatchThreads / kWarpSize;
    for (int64_t p = lo + warp; p < hi; p += num_warps) {
        const int64_t q = d * a.region_rows + p;
        const int64_t t = own ? a.region_tokens[q] : -1;  // own region: the row's token in the caller's tensors
        int slot_lane = -1;
        if (lane < L) {
            if (a.fresh) {
                slot_lane = own ? a.token_slots[t * R + c.domain_rank(lane)]
                                : reinterpret_cast<const int*>(recv + a.off[kSlots] + q * L * 4)[lane];
                a.slots[q * L + lane] = slot_lane;
            } else {
                slot_lane = a.slots[q * L + lane];
            }
        }
        const int4* x = reinterpret_cast<const int4*>(own ? a.x + t * a.x_bytes : recv + a.off[kX] + q * a.x_bytes);
        for (int i = 0; i < L; ++i) {
            const int slot = __shfl_sync(kFullMask, slot_lane, i);
            if (slot < 0) continue;
            const int r = c.domain_rank(i);
            // Rows that would land outside their block or the receive area are skipped and reported,
            // without giving up the call: the others still arrive, so every rank reaches its host
            // check instead of waiting out the timeout.
            if (slot >= a.matrix[s * R + r]) {  // more rows than the source's counts promised
                if (lane == 0) c.report(5, s);
                continue;
            }
            const int64_t pos = static_cast<int64_t>(a.start[s * R + r]) + slot;
            if (pos >= a.out_rows) {
                if (lane == 0) c.report(3, r);
                continue;
            }
            uint8_t* out = c.peers[i] + kDomainHeaderBytes;
            warp_copy_int4(reinterpret_cast<int4*>(out + a.out_off[kOutX] + pos * a.x_bytes), x,
                           static_cast<int>(a.x_bytes / 16), lane);
            if (a.num_scales > 0) {
                int* dst = reinterpret_cast<int*>(out + a.out_off[kOutScales] + pos * a.num_scales * 4);
                if (own) {
                    for (int k = lane; k < a.num_scales; k += kWarpSize)
                        dst[k] = a.scales[t * a.scale_stride0 + k * a.scale_stride1];
                } else {
                    const int* src = reinterpret_cast<const int*>(recv + a.off[kScales] + q * a.num_scales * 4);
                    for (int k = lane; k < a.num_scales; k += kWarpSize) dst[k] = src[k];
                }
            }
            if (a.fresh && lane < K) {  // the domain's expert ids become rank r's (-1: another rank's)
                // Staged rows carry the domain's ids; the own region's come global from the caller.
                const int64_t e = own ? a.topk_idx[t * K + lane] - static_cast<int64_t>(c.my_domain) * L *
                                                                       a.experts_per_rank
                                      : reinterpret_cast<const int64_t*>(recv + a.off[kTopk] + q * K * 8)[lane];
                const int64_t first = static_cast<int64_t>(i) * a.experts_per_rank;
                const bool mine = e >= first && e < first + a.experts_per_rank;
                reinterpret_cast<int64_t*>(out + a.out_off[kOutTopk] + pos * K * 8)[lane] = mine ? e - first : -1;
                if (a.with_weights) {
                    const float w = own ? a.weights[t * K + lane]
                                        : reinterpret_cast<const float*>(recv + a.off[kWeights] + q * K * 4)[lane];
                    reinterpret_cast<float*>(out + a.out_off[kOutWeights] + pos * K * 4)[lane] = mine ? w : 0.f;
                }
            }
        }
    }
    __syncthreads();  // s_count is reused by the block's next chunk
}

// Blocks [0, (D - 1) x chunks) send a chunk of another domain's region each; the others forward
// every region's chunks (this rank's own region straight from the caller's tensors, region_tokens).
__global__ void __launch_bounds__(kDispatchThreads, 1) dispatch_kernel(DispatchArgs a) {
    const Call& c = a.c;
    const int num_senders = (c.num_domains - 1) * c.chunks;
    if (static_cast<int>(blockIdx.x) < num_senders) {
        const int other = blockIdx.x / c.chunks;
        send_chunk(a, other < c.my_domain ? other : other + 1, blockIdx.x % c.chunks);
        return;
    }
    const int b = blockIdx.x - num_senders;
    if (b == 0 && threadIdx.x == 0) enter_domain(c);
    pad_rows(a, b);
    if (domain_entered(c)) {
        const int num_chunks = c.num_domains * c.chunks;
        for (int k = b; k < num_chunks; k += c.num_forwarders) forward_chunk(a, k / c.chunks, k % c.chunks);
    }
    leave_domain(c, b);
}

// Staging (before the dispatch kernel): token t goes to staging region d, row pos[t][d], for every
// domain d in stage_mask (mates reached by puts) it has a destination in (flags[t][d]; the own
// domain's region and the mapped mates' are read from the caller's tensors); pos is the exclusive
// prefix count of flags over
// tokens, so each region holds its tokens in ascending order. Its top-k ids become ids of d's
// experts (-1 where the expert is elsewhere), and its slots (the token's index among this rank's
// tokens to each rank, -1 if not sent there) shrink to d's ranks. One warp per token: x is read once
// for all its domains. Null pointers: fields not staged (a cached dispatch moves x and scales only).
struct StageArgs {
    const uint8_t* x;
    int64_t x_bytes;
    const uint8_t* scales;  // 4-byte elements at t * scale_stride0 + c * scale_stride1 (elements)
    int num_scales;
    int64_t scale_stride0, scale_stride1;
    const int64_t* topk_idx;
    const float* weights;
    int num_topk;
    const int* slots;       // [T, num_domains * ranks_per_domain]
    const bool* flags;      // [T, D]
    const int* pos;         // [T, D]
    int num_tokens, num_domains, ranks_per_domain, experts_per_domain;
    unsigned stage_mask;    // bit d: stage region d (a mate reached by puts); the others are read unstaged
    uint8_t* stage;
    int64_t region_rows;
    int64_t off_x, off_scales, off_topk, off_weights, off_slots;
};

__global__ void __launch_bounds__(256) stage_kernel(StageArgs a) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarpSize;
    const int num_warps = gridDim.x * blockDim.x / kWarpSize;
    const int D = a.num_domains, L = a.ranks_per_domain, K = a.num_topk;
    for (int t = warp; t < a.num_tokens; t += num_warps) {
        const int4* x = reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * a.x_bytes);
        for (int d = 0; d < D; ++d) {
            if (!(a.stage_mask >> d & 1u) || !a.flags[static_cast<int64_t>(t) * D + d]) continue;
            const int64_t row = d * a.region_rows + a.pos[static_cast<int64_t>(t) * D + d];
            warp_copy_int4(reinterpret_cast<int4*>(a.stage + a.off_x + row * a.x_bytes), x,
                           static_cast<int>(a.x_bytes / 16), lane);
            if (a.scales != nullptr) {
                auto* dst = reinterpret_cast<int*>(a.stage + a.off_scales + row * a.num_scales * 4);
                const auto* src = reinterpret_cast<const int*>(a.scales);
                for (int c = lane; c < a.num_scales; c += kWarpSize)
                    dst[c] = src[t * a.scale_stride0 + c * a.scale_stride1];
            }
            if (a.topk_idx != nullptr && lane < K) {
                const int64_t e = a.topk_idx[static_cast<int64_t>(t) * K + lane];
                const int64_t first = static_cast<int64_t>(d) * a.experts_per_domain;
                const bool here = e >= first && e < first + a.experts_per_domain;
                reinterpret_cast<int64_t*>(a.stage + a.off_topk + row * K * 8)[lane] = here ? e - first : -1;
                if (a.weights != nullptr)
                    reinterpret_cast<float*>(a.stage + a.off_weights + row * K * 4)[lane] =
                        a.weights[static_cast<int64_t>(t) * K + lane];
            }
            if (a.slots != nullptr && lane < L)
                reinterpret_cast<int*>(a.stage + a.off_slots + row * L * 4)[lane] =
                    a.slots[static_cast<int64_t>(t) * D * L + d * L + lane];
        }
    }
}

// After the dispatch kernel: this rank's received rows out of its IPC area (the next call reuses
// it) into the caller's tensors, every field in one launch; a warp per row. Scales are written with
// the output's strides (in elements), so column-major scales come back column-major.
struct CopyOutArgs {
    const uint8_t* area;           // this rank's IPC receive area (after the header)
    int64_t off[kNumOutFields];    // of each field's array in it
    int64_t num_rows, x_bytes;
    int num_scales, num_topk;
    int64_t scale_stride0, scale_stride1;
    uint8_t* x;
    int* scales;                   // or null
    int64_t* topk_idx;             // or null
    float* weights;                // or null
};

__global__ void __launch_bounds__(256) copy_out_kernel(CopyOutArgs a) {
    const int lane = threadIdx.x % kWarpSize;
    const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
    const int K = a.num_topk;
    for (int64_t p = warp; p < a.num_rows; p += num_warps) {
        warp_copy_int4(reinterpret_cast<int4*>(a.x + p * a.x_bytes),
                       reinterpret_cast<const int4*>(a.area + a.off[kOutX] + p * a.x_bytes),
                       static_cast<int>(a.x_bytes / 16), lane);
        if (a.scales != nullptr) {
            const int* src = reinterpret_cast<const int*>(a.area + a.off[kOutScales]) + p * a.num_scales;
            for (int k = lane; k < a.num_scales; k += kWarpSize)
                a.scales[p * a.scale_stride0 + k * a.scale_stride1] = src[k];
        }
        if (a.topk_idx != nullptr && lane < K)
            a.topk_idx[p * K + lane] = reinterpret_cast<const int64_t*>(a.area + a.off[kOutTopk])[p * K + lane];
        if (a.weights != nullptr && lane < K)
            a.weights[p * K + lane] = reinterpret_cast<const float*>(a.area + a.off[kOutWeights])[p * K + lane];
    }
}

}  // namespace hierarchical
}  // namespace epcomm

using namespace epcomm::hierarchical;

extern "C" {

int epcomm_hierarchical_constant(const char* name) {
    const struct {
        const char* name;
        int value;
    } entries[] = {{"sym_header_bytes", static_cast<int>(kSymHeaderBytes)},
                   {"domain_header_bytes", static_cast<int>(kDomainHeaderBytes)},
                   {"max_domains", kMaxDomains}, {"max_chunks", kMaxChunks}, {"max_local", kMaxLocal},
                   {"max_forwarders", kMaxForwarders}, {"info_ints", kInfoInts}, {"tag_bits", kTagBits},
                   {"max_group_ranks", kMaxGroupRanks}};
    for (const auto& e : entries)
        if (std::strcmp(e.name, name) == 0) return e.value;
    return -1;
}

// counts: the counts area's offset, its row width (ints), the ints of this call's rows.
int epcomm_hierarchical_notify(const int64_t* call_params, int64_t counts_offset, int width, int row_ints, int* info,
                              cudaStream_t stream) {
    Call c{};
    const int status = make_call(call_params, info, &c);
    if (status != 0) return status;
    if (row_ints > width || row_ints < 2) return static_cast<int>(cudaErrorInvalidValue);
    notify_kernel<<<c.num_ranks, 32, 0, stream>>>(c, counts_offset, width, row_ints);
    return static_cast<int>(cudaGetLastError());
}

// outgoing_digest, refused, digest: the notify's outgoing digest word, plan_kernel's refusal word
// and the call's shape digest (used when notify != 0).
int epcomm_hierarchical_advance(void* sym, int notify, int* outgoing_digest, int* refused, int digest,
                                cudaStream_t stream) {
    if (notify && (outgoing_digest == nullptr || refused == nullptr || digest < 0))
        return static_cast<int>(cudaErrorInvalidValue);
    advance_kernel<<<1, 1, 0, stream>>>(static_cast<uint8_t*>(sym), notify, outgoing_digest, refused, digest);
    return static_cast<int>(cudaGetLastError());
}

// sizes: num_tokens, num_ranks, num_domains, ranks_per_domain, num_topk, num_experts, table_ints,
// region_rows.
int epcomm_hierarchical_plan(const bool* in_rank, const int* tokens_per_rank, const int* tokens_per_expert,
                             const int64_t* topk_idx, const int64_t* sizes, int* outgoing, int* refused, int* slots,
                             bool* flags, int* pos, int* send_counts, int* recv_counts, int* slot_table,
                             int* region_tokens, cudaStream_t stream) {
    PlanArgs a{in_rank, tokens_per_rank, tokens_per_expert, topk_idx};
    a.num_tokens = static_cast<int>(sizes[0]);
    a.num_ranks = static_cast<int>(sizes[1]);
    a.num_domains = static_cast<int>(sizes[2]);
    a.ranks_per_domain = static_cast<int>(sizes[3]);
    a.num_topk = static_cast<int>(sizes[4]);
    a.num_experts = static_cast<int>(sizes[5]);
    a.table_ints = sizes[6];
    a.region_rows = sizes[7];
    a.region_tokens = region_tokens;
    a.outgoing = outgoing;
    a.refused = refused;
    a.slots = slots;
    a.flags = flags;
    a.pos = pos;
    a.send_counts = send_counts;
    a.recv_counts = recv_counts;
    a.slot_table = slot_table;
    if (a.num_ranks != a.num_domains * a.ranks_per_domain || a.num_ranks < 1 || a.num_tokens < 0)
        return static_cast<int>(cudaErrorInvalidValue);
    plan_kernel<<<a.num_ranks + a.num_domains, kPlanThreads, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

// current: the notify's rows (width ints each); summary: host-mapped.
// limits: region_rows, recv_rows, rounds (CountsArgs).
int epcomm_hierarchical_counts(const int* current, int width, int num_ranks, int rank, int experts_per_rank,
                               int num_domains, int* matrix, int* start, int* recv_total, int* summary,
                               int* send_counts, const int64_t* limits, cudaStream_t stream) {
    const CountsArgs a{current, width, num_ranks, rank, experts_per_rank, num_domains, matrix, start, recv_total,
                       summary, send_counts, limits[0], limits[1], static_cast<int>(limits[2])};
    counts_kernel<<<1, 1024, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

// params: area, region_rows, off[5], out_off[4], out_rows, x_bytes, num_scales, num_topk,
// experts_per_rank, with_weights, fresh, num_out, scale_stride0, scale_stride1.
// own: the caller's x, scales, top-k ids, weights, the [T, R] slots and region_tokens (null where absent).
int epcomm_hierarchical_dispatch(const int64_t* call_params, const int64_t* params,
                                const int* send_counts, int* recv_counts, const int* start, const int* matrix,
                                int* slots, const int* recv_total, const void* const* own, int* info,
                                cudaStream_t stream) {
    DispatchArgs a{};
    const int status = make_call(call_params, info, &a.c);
    if (status != 0) return status;
    a.area = params[0];
    a.region_rows = params[1];
    for (int f = 0; f < kNumFields; ++f) a.off[f] = params[2 + f];
    for (int f = 0; f < kNumOutFields; ++f) a.out_off[f] = params[7 + f];
    a.out_rows = params[11];
    a.x_bytes = params[12];
    a.num_scales = static_cast<int>(params[13]);
    a.num_topk = static_cast<int>(params[14]);
    a.experts_per_rank = static_cast<int>(params[15]);
    a.with_weights = params[16] != 0;
    a.fresh = params[17] != 0;
    a.num_out = params[18];
    a.scale_stride0 = params[19];
    a.scale_stride1 = params[20];
    a.x = static_cast<const uint8_t*>(own[0]);
    a.scales = static_cast<const int*>(own[1]);
    a.topk_idx = static_cast<const int64_t*>(own[2]);
    a.weights = static_cast<const float*>(own[3]);
    a.token_slots = static_cast<const int*>(own[4]);
    a.region_tokens = static_cast<const int*>(own[5]);
    a.recv_total = recv_total;
    a.send_counts = send_counts;
    a.recv_counts = recv_counts;
    a.start = start;
    a.matrix = matrix;
    a.slots = slots;
    // (The own pointers may be null with no tokens: an empty tensor's; no own row reads them then.)
    if (a.x_bytes % 16 != 0 || a.num_topk > epcomm::kWarpSize || a.region_tokens == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    dispatch_kernel<<<(a.c.num_domains - 1) * a.c.chunks + a.c.num_forwarders, kDispatchThreads, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

int epcomm_hierarchical_stage(const void* x, int64_t x_bytes, const void* scales, int num_scales, int64_t scale_stride0,
                             int64_t scale_stride1, const int64_t* topk_idx, const float* weights, int num_topk,
                             const int* slots, const bool* flags, const int* pos, int num_tokens, int num_domains,
                             int ranks_per_domain, int experts_per_domain, unsigned stage_mask, void* stage,
                             int64_t region_rows, const int64_t* offsets, cudaStream_t stream) {
    if (num_tokens == 0 || stage_mask == 0) return 0;  // every region is read unstaged
    if (x_bytes % 16 != 0) return static_cast<int>(cudaErrorInvalidValue);
    StageArgs a{};
    a.x = static_cast<const uint8_t*>(x);
    a.x_bytes = x_bytes;
    a.scales = static_cast<const uint8_t*>(scales);
    a.num_scales = num_scales;
    a.scale_stride0 = scale_stride0;
    a.scale_stride1 = scale_stride1;
    a.topk_idx = topk_idx;
    a.weights = weights;
    a.num_topk = num_topk;
    a.slots = slots;
    a.flags = flags;
    a.pos = pos;
    a.num_tokens = num_tokens;
    a.num_domains = num_domains;
    a.ranks_per_domain = ranks_per_domain;
    a.experts_per_domain = experts_per_domain;
    a.stage_mask = stage_mask;
    a.stage = static_cast<uint8_t*>(stage);
    a.region_rows = region_rows;
    a.off_x = offsets[0];
    a.off_scales = offsets[1];
    a.off_topk = offsets[2];
    a.off_weights = offsets[3];
    a.off_slots = offsets[4];
    stage_kernel<<<grid_for(num_tokens), 256, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

// offsets: of each field's array in the IPC area; sizes: num_rows, x_bytes, num_scales, num_topk,
// scale_stride0, scale_stride1 (of the output scales, in elements).
int epcomm_hierarchical_copy_out(const void* area, const int64_t* offsets, const int64_t* sizes, void* x, int* scales,
                                 int64_t* topk_idx, float* weights, cudaStream_t stream) {
    CopyOutArgs a{static_cast<const uint8_t*>(area)};
    for (int f = 0; f < kNumOutFields; ++f) a.off[f] = offsets[f];
    a.num_rows = sizes[0];
    a.x_bytes = sizes[1];
    a.num_scales = static_cast<int>(sizes[2]);
    a.num_topk = static_cast<int>(sizes[3]);
    a.scale_stride0 = sizes[4];
    a.scale_stride1 = sizes[5];
    a.x = static_cast<uint8_t*>(x);
    a.scales = scales;
    a.topk_idx = topk_idx;
    a.weights = weights;
    if (a.num_rows == 0) return 0;
    if (a.x_bytes % 16 != 0 || a.num_topk > epcomm::kWarpSize || (reinterpret_cast<uintptr_t>(x) % 16) != 0)
        return static_cast<int>(cudaErrorInvalidValue);
    copy_out_kernel<<<grid_for(static_cast<int>(a.num_rows < (1 << 30) ? a.num_rows : (1 << 30))), 256, 0,
                      stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
