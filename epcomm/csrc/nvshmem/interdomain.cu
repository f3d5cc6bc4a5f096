// The hierarchical normal mode's kernels: rows cross between scale-up domains once per domain over
// NVSHMEM (GPU-initiated puts and signals: RDMA between nodes; NVLink when the domains are virtual
// ones of one host, so the same code runs there), and are forwarded inside each domain over CUDA
// IPC, with the two tiers overlapped inside one kernel.
//
// Rank r's mate in domain d is the rank of d with r's local index (r itself in its own domain).
// Two buffers per rank:
//   * slow tier, NVSHMEM symmetric: a header of signal words, then a staging and a receive area of
//     the same shape: per field (token rows, scales, top-k ids, weights, slots) one array of
//     num_domains x region_rows rows. Region d of the staging area holds the rows for domain d's
//     mate; they land in region `my_domain` of that mate's receive area. Regions are cut in
//     `chunks` chunks, each put and signalled on its own (the signal carries the call and the count).
//   * fast tier, CUDA IPC inside the domain: a header of flags, then the rows each rank receives,
//     per field, at their final (flat-order) positions.
//
// Dispatch (one launch): sender blocks put their chunks to the mates as soon as each mate has
// entered the call; forwarder blocks take each arriving chunk and store its rows straight into the
// final receive positions of their domain's ranks: source s's block of rank r starts at start[s][r]
// (the flat count matrix's prefix), and a row's place in it, its slot, came with the row. So the
// output is in the flat strategy's order (source rank, token) without a sort.
// Combine (one launch): each rank's expert outputs are in its IPC area; forwarder blocks pull, for
// each row they forwarded, the rows of the domain's ranks it went to, sum them in fp32 in ascending
// rank order (the reference's order), and put each chunk's partial sums back to the source's mate
// area; the source then sums the partials in ascending domain order (reduce_kernel).
//
// Every wait is bounded (EPCOMM_TIMEOUT_S); a timeout, a mate or domain peer running another
// operation or shape, or a receive area too small is reported in `info`; the first waiter to give
// up marks the call aborted, so the others stop waiting too.
#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "../../include/epcomm/common.cuh"

namespace epcomm {
namespace interdomain {

constexpr int kMaxDomains = 16;
constexpr int kMaxChunks = 16;      // per region
constexpr int kMaxLocal = kMaxRanks;  // ranks per domain
constexpr int kMaxForwarders = 160;
constexpr int kThreads = 512;
constexpr int kTagBits = 20;        // ready words carry (call << kTagBits) | shape tag

// Slow-tier header (NVSHMEM, int64 words): ready[D] (a mate entered the call: its receive area is
// free), done[D][chunks] ((call << 32) | count of the mate's chunk), abort (a call given up here),
// notified[64] (the call whose counts row each rank delivered here), seq and notify_seq (this
// rank's operation and notify counters, advance_kernel). Then the counts area
// (notify_kernel), then the staging area (Call::stage_offset).
constexpr int kMaxGroupRanks = 64;
constexpr int64_t kSymHeaderBytes = 4096;
static_assert(8 * (kMaxDomains + kMaxDomains * kMaxChunks + 1 + kMaxGroupRanks + 2) <= kSymHeaderBytes,
              "slow-tier header");
// Fast-tier header (IPC, int64 words): ready[L] (a domain rank entered the call), flags[L][F] (a
// domain rank's forwarder block finished with this rank's area).
constexpr int64_t kDomainHeaderBytes = 16384;
static_assert(8 * (kMaxLocal + kMaxLocal * kMaxForwarders) <= kDomainHeaderBytes, "fast-tier header");

// info words (host-mapped) written on an error; the Python side reads them after a sync.
constexpr int kInfoError = 0;  // 1: timeout, 2: another operation or shape, 3: receive area too small,
                               // 4: more rows received than num_worst_tokens, 5: refused inputs,
                               // 6: an earlier call's error on that rank
constexpr int kRefused = -1;   // the shape digest of a rank whose inputs are invalid (notify_kernel)
constexpr int kPendingError = -2;  // ... of a rank with an earlier call's error not yet raised
constexpr int kInfoRanks = 1;  // [num_ranks]: 1 for each rank involved
constexpr int kInfoInts = 1 + 64;

__device__ __forceinline__ int64_t* sym_ready(uint8_t* sym, int d) { return reinterpret_cast<int64_t*>(sym) + d; }
__device__ __forceinline__ int64_t* sym_done(uint8_t* sym, int d, int j) {
    return reinterpret_cast<int64_t*>(sym) + kMaxDomains + d * kMaxChunks + j;
}
__device__ __forceinline__ int64_t* sym_abort(uint8_t* sym) {
    return reinterpret_cast<int64_t*>(sym) + kMaxDomains + kMaxDomains * kMaxChunks;
}
__device__ __forceinline__ int64_t* sym_notified(uint8_t* sym, int r) { return sym_abort(sym) + 1 + r; }
__device__ __forceinline__ int64_t* sym_seq(uint8_t* sym) { return sym_notified(sym, kMaxGroupRanks); }
__device__ __forceinline__ int64_t* sym_notify_seq(uint8_t* sym) { return sym_seq(sym) + 1; }
__device__ __forceinline__ int64_t* dom_ready(uint8_t* buf, int i) { return reinterpret_cast<int64_t*>(buf) + i; }
__device__ __forceinline__ int64_t* dom_flag(uint8_t* buf, int i, int b) {
    return reinterpret_cast<int64_t*>(buf) + kMaxLocal + i * kMaxForwarders + b;
}

__device__ void report(int* info, int code, int rank) {
    if (rank >= 0) info[kInfoRanks + rank] = 1;
    info[kInfoError] = code;  // racing reporters each write a valid code
    __threadfence_system();
}

// What every kernel of a call shares: who this rank is, the call, and how to give up.
struct Call {
    uint8_t* sym;  // this rank's NVSHMEM buffer (the same address names every mate's copy)
    uint8_t* peers[kMaxLocal];  // each domain rank's IPC buffer as mapped here
    uint8_t* mates[kMaxDomains];  // each mate's NVSHMEM buffer where NVLink maps it here (stores), else null (puts)
    int num_ranks, num_domains, my_domain, ranks_per_domain, local;
    int shape_tag;
    int chunks, num_forwarders;
    int64_t stage_offset;  // of the staging area in the NVSHMEM buffer (the receive area follows it)
    int* info;
    uint64_t timeout_ns;
    __device__ int mate(int d) const { return d * ranks_per_domain + local; }
    __device__ int domain_rank(int i) const { return my_domain * ranks_per_domain + i; }
    // The call's number: this rank's counter on the GPU, advanced before each operation by
    // advance_kernel (so a CUDA graph's replays take new numbers, like eager calls).
    __device__ int64_t call() const { return ld_volatile(sym_seq(sym)); }
    __device__ int64_t entered() const { return (call() << kTagBits) | shape_tag; }
    __device__ bool aborted() const { return ld_volatile(sym_abort(sym)) == call(); }
    // Give up the call: every other wait of this rank's stops at its next look.
    __device__ void abort(int code, int rank) const {
        report(info, code, rank);
        *sym_abort(sym) = call();
        __threadfence_system();
    }
};

// Spin until `word` satisfies `ok`; false (after marking the call aborted, `rank` named) on timeout
// or when another wait gave up first.
template <typename Ok>
__device__ bool wait_for(const Call& c, const int64_t* word, Ok ok, int rank, int64_t* seen) {
    const uint64_t start = global_timer_ns();
    for (int spin = 0;; ++spin) {
        const int64_t v = ld_acquire_sys(word);
        if (ok(v)) {
            *seen = v;
            return true;
        }
        if ((spin & 63) == 63) {
            if (c.aborted()) return false;
            if (global_timer_ns() - start > c.timeout_ns) {
                c.abort(1, rank);
                return false;
            }
        }
    }
}

// A ready word written by `rank` for this call: false (aborted) when it shows another shape.
__device__ bool wait_entered(const Call& c, const int64_t* word, int rank) {
    int64_t seen = 0;
    if (!wait_for(c, word, [&](int64_t v) { return v >= (c.call() << kTagBits); }, rank, &seen)) return false;
    if ((seen >> kTagBits) == c.call() && (seen & ((1 << kTagBits) - 1)) != c.shape_tag) {
        c.abort(2, rank);
        return false;
    }
    return true;
}

// The count that came with chunk j of domain d's region for this call, or -1 (aborted).
__device__ int wait_chunk(const Call& c, int d, int j) {
    int64_t seen = 0;
    if (!wait_for(c, sym_done(c.sym, d, j), [&](int64_t v) { return (v >> 32) == c.call(); }, c.mate(d), &seen))
        return -1;
    return static_cast<int>(seen & 0xffffffff);
}

__device__ __forceinline__ void chunk_rows(int64_t count, int chunks, int j, int64_t* lo, int64_t* hi) {
    const int64_t per = (count + chunks - 1) / chunks;
    *lo = min(count, j * per);
    *hi = min(count, *lo + per);
}

// The block copies `bytes` (a multiple of 4) from src to dst, a mapped peer's memory: 16-byte words
// with several loads in flight per thread where both ends allow (NVLink bandwidth per SM is bytes in
// flight / latency), 4-byte words otherwise.
__device__ void block_copy(uint8_t* dst, const uint8_t* src, int64_t bytes) {
    constexpr int kUnroll = 4;
    if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) % 16 == 0) {
        int4* d = reinterpret_cast<int4*>(dst);
        const int4* s = reinterpret_cast<const int4*>(src);
        const int64_t n = bytes / 16;
        for (int64_t i = threadIdx.x; i < n; i += kUnroll * kThreads) {
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (i + u * kThreads < n) v[u] = s[i + u * kThreads];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (i + u * kThreads < n) d[i + u * kThreads] = v[u];
        }
        return;
    }
    int* d = reinterpret_cast<int*>(dst);
    const int* s = reinterpret_cast<const int*>(src);
    for (int64_t i = threadIdx.x; i < bytes / 4; i += kThreads) d[i] = s[i];
}

// Move `bytes` of this rank's NVSHMEM buffer at `offset` to mate d's buffer at `dst_offset`: stores
// into its mapping, or a put. The caller completes them (finish_to_mate) before signalling.
__device__ void copy_to_mate(const Call& c, int d, int64_t dst_offset, int64_t offset, int64_t bytes) {
    if (bytes <= 0) return;
    if (c.mates[d] != nullptr)
        block_copy(c.mates[d] + dst_offset, c.sym + offset, bytes);
    else
        nvshmemx_putmem_nbi_block(c.sym + dst_offset, c.sym + offset, static_cast<size_t>(bytes), c.mate(d));
}

// After the block's copy_to_mate calls: they are delivered, then the chunk's done word is set there.
__device__ void finish_to_mate(const Call& c, int d, int j, int64_t count) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (c.mates[d] == nullptr) nvshmem_quiet();
        __threadfence_system();
        nvshmemx_signal_op(reinterpret_cast<uint64_t*>(sym_done(c.sym, c.my_domain, j)),
                           static_cast<uint64_t>((c.call() << 32) | count), NVSHMEM_SIGNAL_SET, c.mate(d));
    }
}

// Tell every domain rank this rank entered the call (its IPC area may be written / read).
__device__ void enter_domain(const Call& c) {
    for (int i = 0; i < c.ranks_per_domain; ++i) st_release_sys(dom_ready(c.peers[i], c.local), c.entered());
}

// Wait until every domain rank entered the call (thread i < L waits for rank i); false: aborted.
__device__ bool domain_entered(const Call& c) {
    __shared__ int s_ok;
    if (threadIdx.x == 0) s_ok = 1;
    __syncthreads();
    if (threadIdx.x < c.ranks_per_domain &&
        !wait_entered(c, dom_ready(c.peers[c.local], threadIdx.x), c.domain_rank(threadIdx.x)))
        s_ok = 0;
    __syncthreads();
    return s_ok != 0;
}

// Forwarder block b is done with every domain rank's area: flag it there; then wait until every
// domain rank's block b is done with this rank's (so the caller may reuse its area after the kernel).
__device__ void leave_domain(const Call& c, int b) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        for (int i = 0; i < c.ranks_per_domain; ++i) st_release_sys(dom_flag(c.peers[i], c.local, b), c.call());
    }
    if (threadIdx.x < c.ranks_per_domain) {
        int64_t seen = 0;
        wait_for(c, dom_flag(c.peers[c.local], threadIdx.x, b), [&](int64_t v) { return v == c.call(); },
                 c.domain_rank(threadIdx.x), &seen);
    }
}

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
        // An error of an earlier call still pending here: tell every rank, so all give up this call
        // (error 6) instead of some of them waiting for a rank that raises on the host.
        if (ld_volatile_int(c.info + kInfoError) != 0) {
            const_cast<int*>(outgoing)[1] = kPendingError;
            __threadfence();
        }
        nvshmem_putmem_nbi(incoming + me * width, outgoing, static_cast<size_t>(row_ints) * 4, r);
        nvshmem_quiet();
        __threadfence_system();
        nvshmemx_signal_op(reinterpret_cast<uint64_t*>(sym_notified(c.sym, me)), static_cast<uint64_t>(c.call()),
                           NVSHMEM_SIGNAL_SET, r);
        int64_t seen = 0;
        ok = wait_for(c, sym_notified(c.sym, r), [&](int64_t v) { return v >= c.call(); }, r, &seen);
        const int digest = ok ? ld_volatile_int(incoming + r * width + 1) : 0;
        const int mine = ld_volatile_int(outgoing + 1);
        if (ok && (digest == kRefused || digest == kPendingError)) {  // every rank names rank r
            c.abort(digest == kRefused ? 5 : 6, r);
            ok = false;
        } else if (ok && digest != mine) {
            if (mine == kRefused || mine == kPendingError)
                c.abort(mine == kRefused ? 5 : 6, me);
            else
                c.abort(2, r);
            ok = false;
        }
    }
    ok = __shfl_sync(kFullMask, ok, 0);
    for (int k = threadIdx.x; k < row_ints; k += kWarpSize)
        current[r * width + k] = ok ? ld_volatile_int(incoming + r * width + k) : 0;
}

// Before each operation: the next call number (and, for a dispatch's notify, the next notify).
__global__ void advance_kernel(uint8_t* sym, int notify) {
    *sym_seq(sym) += 1;
    if (notify) *sym_notify_seq(sym) += 1;
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
};

// num_worst_tokens padding: this rank's rows [recv_total, num_out) get x = 0, scales = 0, ids = -1,
// weights = 0 (the reference's padding); more received rows than num_out is an error (4). The
// forwarder blocks share the rows; no other rank writes there.
__device__ void pad_rows(const DispatchArgs& a, int b) {
    const Call& c = a.c;
    const int64_t total = *a.recv_total;
    if (total > a.out_rows) {  // this rank's receive area cannot hold its rows (the forwarders skip them)
        if (b == 0 && threadIdx.x == 0) report(c.info, 3, c.domain_rank(c.local));
        return;
    }
    if (a.num_out < 0) return;
    if (total > a.num_out) {
        if (b == 0 && threadIdx.x == 0) report(c.info, 4, c.domain_rank(c.local));
        return;
    }
    uint8_t* out = c.peers[c.local] + kDomainHeaderBytes;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, num_warps = kThreads / kWarpSize;
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

// Sender block for chunk j of region d (another domain): once the mate has entered the call, its
// rows go to the mate's receive area, then the chunk's signal (with the region's count).
__device__ void send_chunk(const DispatchArgs& a, int d, int j) {
    const Call& c = a.c;
    __shared__ int s_ok;
    if (threadIdx.x == 0) {
        if (j == 0)
            nvshmemx_signal_op(reinterpret_cast<uint64_t*>(sym_ready(c.sym, c.my_domain)),
                               static_cast<uint64_t>(c.entered()), NVSHMEM_SIGNAL_SET, c.mate(d));
        s_ok = wait_entered(c, sym_ready(c.sym, d), c.mate(d));
    }
    __syncthreads();
    if (!s_ok) return;
    const int64_t count = a.send_counts[d];
    int64_t lo, hi;
    chunk_rows(count, c.chunks, j, &lo, &hi);
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

// Forward the rows of chunk j of region d (source s = d's mate of this rank) to the domain's ranks.
__device__ void forward_chunk(const DispatchArgs& a, int d, int j) {
    const Call& c = a.c;
    __shared__ int s_count;
    const bool own = d == c.my_domain;  // this rank's own tokens: read where they were staged
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
    const uint8_t* recv = c.sym + c.stage_offset + (own ? 0 : a.area);
    const int L = c.ranks_per_domain, K = a.num_topk, R = c.num_ranks;
    const int s = c.mate(d);
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, num_warps = kThreads / kWarpSize;
    for (int64_t p = lo + warp; p < hi; p += num_warps) {
        const int64_t q = d * a.region_rows + p;
        int slot_lane = -1;
        if (lane < L) {
            if (a.fresh) {
                slot_lane = reinterpret_cast<const int*>(recv + a.off[kSlots] + q * L * 4)[lane];
                a.slots[q * L + lane] = slot_lane;
            } else {
                slot_lane = a.slots[q * L + lane];
            }
        }
        const int4* x = reinterpret_cast<const int4*>(recv + a.off[kX] + q * a.x_bytes);
        for (int i = 0; i < L; ++i) {
            const int slot = __shfl_sync(kFullMask, slot_lane, i);
            if (slot < 0) continue;
            const int r = c.domain_rank(i);
            // Rows that would land outside their block or the receive area are skipped and reported,
            // without giving up the call: the others still arrive, so every rank reaches its host
            // check instead of waiting out the timeout.
            if (slot >= a.matrix[s * R + r]) {  // more rows than the source's counts promised
                if (lane == 0) report(c.info, 5, s);
                continue;
            }
            const int64_t pos = static_cast<int64_t>(a.start[s * R + r]) + slot;
            if (pos >= a.out_rows) {
                if (lane == 0) report(c.info, 3, r);
                continue;
            }
            uint8_t* out = c.peers[i] + kDomainHeaderBytes;
            warp_copy_int4(reinterpret_cast<int4*>(out + a.out_off[kOutX] + pos * a.x_bytes), x,
                           static_cast<int>(a.x_bytes / 16), lane);
            if (a.num_scales > 0) {
                const int* src = reinterpret_cast<const int*>(recv + a.off[kScales] + q * a.num_scales * 4);
                int* dst = reinterpret_cast<int*>(out + a.out_off[kOutScales] + pos * a.num_scales * 4);
                for (int k = lane; k < a.num_scales; k += kWarpSize) dst[k] = src[k];
            }
            if (a.fresh && lane < K) {  // the domain's expert ids become rank r's (-1: another rank's)
                const int64_t e = reinterpret_cast<const int64_t*>(recv + a.off[kTopk] + q * K * 8)[lane];
                const int64_t first = static_cast<int64_t>(i) * a.experts_per_rank;
                const bool mine = e >= first && e < first + a.experts_per_rank;
                reinterpret_cast<int64_t*>(out + a.out_off[kOutTopk] + pos * K * 8)[lane] = mine ? e - first : -1;
                if (a.with_weights) {
                    const float w = reinterpret_cast<const float*>(recv + a.off[kWeights] + q * K * 4)[lane];
                    reinterpret_cast<float*>(out + a.out_off[kOutWeights] + pos * K * 4)[lane] = mine ? w : 0.f;
                }
            }
        }
    }
    __syncthreads();  // s_count is reused by the block's next chunk
}

// Blocks [0, (D - 1) x chunks) send a chunk of another domain's region each; the others forward
// every region's chunks (this rank's own region straight from its staging area).
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(DispatchArgs a) {
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

// ------------------------------------------------------------------ combine
struct CombineArgs {
    Call c;
    int64_t area, region_rows;
    int64_t off_partial, off_partial_weights;  // in the staging area (the receive area: + area)
    int64_t in_off_y, in_off_weights;          // in the IPC buffer: this call's expert outputs and weights
    int hidden, num_topk;
    const int* counts;  // [D] rows of each region the dispatch forwarded (from its recv_counts)
    const int* start;
    const int* slots;
    int64_t in_rows;    // rows each domain rank's IPC area holds (a position past it is an error)
};

// Sum, for each row of chunk j of region d, what the domain's ranks return for it, and send the
// chunk's partial sums to the source's mate area: written there directly when the mate is this rank
// or mapped, else staged and put.
__device__ void reduce_chunk(const CombineArgs& a, int d, int j) {
    const Call& c = a.c;
    __shared__ int s_ok;
    const bool own = d == c.my_domain, direct = own || c.mates[d] != nullptr;
    if (threadIdx.x == 0) s_ok = own || wait_entered(c, sym_ready(c.sym, d), c.mate(d));  // its area is free
    __syncthreads();
    if (!s_ok) {
        __syncthreads();  // s_ok is rewritten by the block's next chunk
        return;
    }
    const int L = c.ranks_per_domain, K = a.num_topk, R = c.num_ranks, H = a.hidden;
    const int s = c.mate(d);
    const int64_t count = min(static_cast<int64_t>(a.counts[d]), a.region_rows);
    int64_t lo, hi;
    chunk_rows(count, c.chunks, j, &lo, &hi);
    // Where the partial sums go: row my_domain x region_rows + p of the mate's receive area, or row
    // d x region_rows + p of this rank's staging area.
    uint8_t* dst_base = own ? c.sym + c.stage_offset + a.area
                            : (direct ? c.mates[d] + c.stage_offset + a.area : c.sym + c.stage_offset);
    const int64_t dst_region = direct ? c.my_domain : d;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, num_warps = kThreads / kWarpSize;
    for (int64_t p = lo + warp; p < hi; p += num_warps) {
        const int64_t q = d * a.region_rows + p, q_dst = dst_region * a.region_rows + p;
        const int slot_lane = lane < L ? a.slots[q * L + lane] : -1;
        const int4* rows[kMaxLocal];
        const float* weights[kMaxLocal];
#pragma unroll
        for (int i = 0; i < kMaxLocal; ++i) {
            const int slot = __shfl_sync(kFullMask, slot_lane, i);
            rows[i] = nullptr;
            weights[i] = nullptr;
            if (i >= L || slot < 0) continue;
            const int64_t pos = static_cast<int64_t>(a.start[s * R + c.domain_rank(i)]) + slot;
            if (pos >= a.in_rows) {
                if (lane == 0) report(c.info, 3, c.domain_rank(i));
                continue;
            }
            const uint8_t* in = c.peers[i] + kDomainHeaderBytes;
            rows[i] = reinterpret_cast<const int4*>(in + a.in_off_y + pos * H * 2);
            if (K > 0) weights[i] = reinterpret_cast<const float*>(in + a.in_off_weights + pos * K * 4);
        }
        float4* partial = reinterpret_cast<float4*>(dst_base + a.off_partial + q_dst * H * 4);
        for (int k = lane; k < H / 8; k += kWarpSize) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int i = 0; i < kMaxLocal; ++i) {
                if (rows[i] == nullptr) continue;
                const int4 v = rows[i][k];
                const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const float2 f = __bfloat1622float2(h[u]);
                    acc[2 * u] += f.x;
                    acc[2 * u + 1] += f.y;
                }
            }
            partial[2 * k] = make_float4(acc[0], acc[1], acc[2], acc[3]);
            partial[2 * k + 1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
        }
        if (lane < K) {
            float acc = 0.f;
#pragma unroll
            for (int i = 0; i < kMaxLocal; ++i)
                if (weights[i] != nullptr) acc += weights[i][lane];
            reinterpret_cast<float*>(dst_base + a.off_partial_weights + q_dst * K * 4)[lane] = acc;
        }
    }
    if (own) {
        __syncthreads();  // s_ok is reused by the block's next chunk
        return;
    }
    if (!direct) {
        __syncthreads();
        const int64_t at = c.my_domain * a.region_rows + lo, from = d * a.region_rows + lo;
        copy_to_mate(c, d, c.stage_offset + a.area + a.off_partial + at * H * 4,
                     c.stage_offset + a.off_partial + from * H * 4, (hi - lo) * H * 4);
        copy_to_mate(c, d, c.stage_offset + a.area + a.off_partial_weights + at * K * 4,
                     c.stage_offset + a.off_partial_weights + from * K * 4, (hi - lo) * K * 4);
    }
    finish_to_mate(c, d, j, count);
    __syncthreads();
}

__global__ void __launch_bounds__(kThreads, 1) combine_kernel(CombineArgs a) {
    const Call& c = a.c;
    const int b = blockIdx.x, num_chunks = c.num_domains * c.chunks;
    if (b == 0 && threadIdx.x == 0) {
        enter_domain(c);  // this rank's expert outputs are in its IPC area
        for (int d = 0; d < c.num_domains; ++d)  // its receive area is free for the partial sums
            nvshmemx_signal_op(reinterpret_cast<uint64_t*>(sym_ready(c.sym, c.my_domain)),
                               static_cast<uint64_t>(c.entered()), NVSHMEM_SIGNAL_SET, c.mate(d));
    }
    if (domain_entered(c)) {
        for (int k = b; k < num_chunks; k += c.num_forwarders) reduce_chunk(a, k / c.chunks, k % c.chunks);
    }
    leave_domain(c, b);  // no domain rank reads this rank's expert outputs any more
    // The partial sums of this rank's tokens have arrived (the blocks share the chunks to wait for;
    // this rank's own domain's were written by this kernel).
    if (threadIdx.x == 0)
        for (int k = b; k < num_chunks; k += c.num_forwarders)
            if (k / c.chunks != c.my_domain && !c.aborted()) wait_chunk(c, k / c.chunks, k % c.chunks);
}

// Staging (before the dispatch kernel): token t goes to staging region d, row pos[t][d], for every
// domain d it has a destination in (flags[t][d]); pos is the exclusive prefix count of flags over
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
            if (!a.flags[static_cast<int64_t>(t) * D + d]) continue;
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

// The source's sum after the combine kernel: token t adds, in fp32 and ascending domain
// order, the partial sum each of its domains returned (region d, row pos[t][d] of the receive
// area), then the biases, and rounds to bf16 once: the reference backend's order.
struct ReduceArgs {
    const float* partial;   // the receive area's partial-sum field: [D * region_rows, hidden]
    const float* partial_weights;  // [D * region_rows, K] or null
    int64_t region_rows;
    const bool* flags;
    const int* pos;
    const __nv_bfloat16* bias0;
    const __nv_bfloat16* bias1;
    __nv_bfloat16* out;
    float* out_weights;
    int num_tokens, hidden, num_topk, num_domains;
};

__global__ void __launch_bounds__(256) reduce_kernel(ReduceArgs a) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarpSize;
    const int num_warps = gridDim.x * blockDim.x / kWarpSize;
    const int D = a.num_domains, K = a.num_topk;
    for (int t = warp; t < a.num_tokens; t += num_warps) {
        const bool* flags = a.flags + static_cast<int64_t>(t) * D;
        const int* pos = a.pos + static_cast<int64_t>(t) * D;
        for (int c = lane; c < a.hidden / 8; c += kWarpSize) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int d = 0; d < D; ++d) {
                if (!flags[d]) continue;
                const float4* p = reinterpret_cast<const float4*>(
                    a.partial + (d * a.region_rows + pos[d]) * static_cast<int64_t>(a.hidden)) + 2 * c;
                const float4 lo = p[0], hi = p[1];
                acc[0] += lo.x; acc[1] += lo.y; acc[2] += lo.z; acc[3] += lo.w;
                acc[4] += hi.x; acc[5] += hi.y; acc[6] += hi.z; acc[7] += hi.w;
            }
            for (const __nv_bfloat16* bias : {a.bias0, a.bias1}) {
                if (bias == nullptr) continue;
                const int4 v = *reinterpret_cast<const int4*>(bias + static_cast<int64_t>(t) * a.hidden + 8 * c);
                const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
                for (int k = 0; k < 4; ++k) {
                    const float2 f = __bfloat1622float2(h[k]);
                    acc[2 * k] += f.x;
                    acc[2 * k + 1] += f.y;
                }
            }
            int4 o;
            auto* oh = reinterpret_cast<__nv_bfloat162*>(&o);
            for (int k = 0; k < 4; ++k) oh[k] = __floats2bfloat162_rn(acc[2 * k], acc[2 * k + 1]);
            reinterpret_cast<int4*>(a.out + static_cast<int64_t>(t) * a.hidden)[c] = o;
        }
        if (a.out_weights != nullptr && lane < K) {
            float acc = 0.f;
            for (int d = 0; d < D; ++d)
                if (flags[d]) acc += a.partial_weights[(d * a.region_rows + pos[d]) * K + lane];
            a.out_weights[static_cast<int64_t>(t) * K + lane] = acc;
        }
    }
}

}  // namespace interdomain
}  // namespace epcomm

using namespace epcomm::interdomain;

extern "C" {

int epcomm_interdomain_constant(const char* name) {
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

// The call's common part, from `call_params`: sym, num_ranks, num_domains, my_domain,
// ranks_per_domain, local, call, shape_tag, chunks, num_forwarders, timeout_ns, stage_offset, then each domain
// rank's IPC buffer (kMaxLocal entries), then each domain's mate's mapped NVSHMEM buffer or 0
// (kMaxDomains entries).
static int make_call(const int64_t* p, int* info, Call* c) {
    c->sym = reinterpret_cast<uint8_t*>(p[0]);
    c->num_ranks = static_cast<int>(p[1]);
    c->num_domains = static_cast<int>(p[2]);
    c->my_domain = static_cast<int>(p[3]);
    c->ranks_per_domain = static_cast<int>(p[4]);
    c->local = static_cast<int>(p[5]);
    // p[6]: unused (the call number lives on the GPU: advance_kernel)
    c->shape_tag = static_cast<int>(p[7] & ((1 << kTagBits) - 1));
    c->chunks = static_cast<int>(p[8]);
    c->num_forwarders = static_cast<int>(p[9]);
    c->timeout_ns = static_cast<uint64_t>(p[10]);
    c->stage_offset = p[11];
    c->info = info;
    if (c->num_domains < 1 || c->num_domains > kMaxDomains || c->ranks_per_domain < 1 ||
        c->ranks_per_domain > kMaxLocal || c->chunks < 1 || c->chunks > kMaxChunks || c->num_forwarders < 1 ||
        c->num_forwarders > kMaxForwarders || c->num_ranks > kMaxGroupRanks)
        return static_cast<int>(cudaErrorInvalidValue);
    for (int i = 0; i < c->ranks_per_domain; ++i) c->peers[i] = reinterpret_cast<uint8_t*>(p[12 + i]);
    for (int d = 0; d < c->num_domains; ++d) c->mates[d] = reinterpret_cast<uint8_t*>(p[12 + kMaxLocal + d]);
    return 0;
}

// counts: the counts area's offset, its row width (ints), the ints of this call's rows.
int epcomm_interdomain_notify(const int64_t* call_params, int64_t counts_offset, int width, int row_ints, int* info,
                              cudaStream_t stream) {
    Call c{};
    const int status = make_call(call_params, info, &c);
    if (status != 0) return status;
    if (row_ints > width || row_ints < 2) return static_cast<int>(cudaErrorInvalidValue);
    notify_kernel<<<c.num_ranks, 32, 0, stream>>>(c, counts_offset, width, row_ints);
    return static_cast<int>(cudaGetLastError());
}

int epcomm_interdomain_advance(void* sym, int notify, cudaStream_t stream) {
    advance_kernel<<<1, 1, 0, stream>>>(static_cast<uint8_t*>(sym), notify);
    return static_cast<int>(cudaGetLastError());
}

// params: area, region_rows, off[5], out_off[4], out_rows, x_bytes, num_scales, num_topk,
// experts_per_rank, with_weights, fresh, num_out.
int epcomm_interdomain_dispatch(const int64_t* call_params, const int64_t* params,
                                const int* send_counts, int* recv_counts, const int* start, const int* matrix,
                                int* slots, const int* recv_total, int* info, cudaStream_t stream) {
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
    a.recv_total = recv_total;
    a.send_counts = send_counts;
    a.recv_counts = recv_counts;
    a.start = start;
    a.matrix = matrix;
    a.slots = slots;
    if (a.x_bytes % 16 != 0 || a.num_topk > epcomm::kWarpSize) return static_cast<int>(cudaErrorInvalidValue);
    dispatch_kernel<<<(a.c.num_domains - 1) * a.c.chunks + a.c.num_forwarders, kThreads, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

// params: area, region_rows, off_partial, off_partial_weights, in_off_y, in_off_weights, hidden, num_topk,
// in_rows.
int epcomm_interdomain_combine(const int64_t* call_params, const int64_t* params,
                               const int* counts, const int* start, const int* slots, int* info, cudaStream_t stream) {
    CombineArgs a{};
    const int status = make_call(call_params, info, &a.c);
    if (status != 0) return status;
    a.area = params[0];
    a.region_rows = params[1];
    a.off_partial = params[2];
    a.off_partial_weights = params[3];
    a.in_off_y = params[4];
    a.in_off_weights = params[5];
    a.in_rows = params[8];
    a.hidden = static_cast<int>(params[6]);
    a.num_topk = static_cast<int>(params[7]);
    a.counts = counts;
    a.start = start;
    a.slots = slots;
    if (a.hidden % 8 != 0 || a.num_topk > epcomm::kWarpSize) return static_cast<int>(cudaErrorInvalidValue);
    combine_kernel<<<a.c.num_forwarders, kThreads, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

static int grid_for(int num_tokens) { return num_tokens > 0 ? (num_tokens + 7) / 8 < 1024 ? (num_tokens + 7) / 8 : 1024 : 1; }

int epcomm_interdomain_stage(const void* x, int64_t x_bytes, const void* scales, int num_scales, int64_t scale_stride0,
                             int64_t scale_stride1, const int64_t* topk_idx, const float* weights, int num_topk,
                             const int* slots, const bool* flags, const int* pos, int num_tokens, int num_domains,
                             int ranks_per_domain, int experts_per_domain, void* stage, int64_t region_rows,
                             const int64_t* offsets, cudaStream_t stream) {
    if (num_tokens == 0) return 0;
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

int epcomm_interdomain_reduce(const float* partial, const float* partial_weights, int64_t region_rows,
                              const bool* flags, const int* pos, const void* bias0, const void* bias1, void* out,
                              float* out_weights, int num_tokens, int hidden, int num_topk, int num_domains,
                              cudaStream_t stream) {
    if (num_tokens == 0) return 0;
    if (hidden % 8 != 0) return static_cast<int>(cudaErrorInvalidValue);
    ReduceArgs a{};
    a.partial = partial;
    a.partial_weights = partial_weights;
    a.region_rows = region_rows;
    a.flags = flags;
    a.pos = pos;
    a.bias0 = static_cast<const __nv_bfloat16*>(bias0);
    a.bias1 = static_cast<const __nv_bfloat16*>(bias1);
    a.out = static_cast<__nv_bfloat16*>(out);
    a.out_weights = out_weights;
    a.num_tokens = num_tokens;
    a.hidden = hidden;
    a.num_topk = num_topk;
    a.num_domains = num_domains;
    reduce_kernel<<<grid_for(num_tokens), 256, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
