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
//     mate when it is reached by puts; they land in region `my_domain` of that mate's receive area.
//     The other regions are not staged: a mate NVLink maps gets its rows stored there straight from
//     the caller's tensors, and the own domain's are forwarded from them. Regions are cut in
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
// Every wait is bounded (EPCOMM_TIMEOUT_S). A timeout, a mate or domain peer running another
// operation or shape, or a rank refusing its inputs gives up the call: it is reported in `info`
// and the first waiter to give up marks the call aborted, so the others stop waiting too. Rows that
// would land outside a receive area or their block are skipped and reported without giving up, so
// every rank still reaches its host check. A call given up on one rank sends its mates no rows but
// a done word that says so, and its domain ranks a leave flag that says so: they give up too,
// naming it (7), instead of waiting out the timeout or ending with rows missing. Every report also sets a sticky word: the rank's next dispatch
// tells every rank (error 6), and its later calls give up; the Buffer must be destroyed.
//
// This header: the layout constants, the call's common state (Call), the bounded waits, the copies
// to mates, the domain handshake, and the host side of the entry points. The kernels:
// hierarchical_dispatch.cu (advance, plan, notify, counts, stage, dispatch, copy-out) and hierarchical_combine.cu.
#pragma once

#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "../../include/epcomm/common.cuh"
#include "../../include/epcomm/row_sum.cuh"

namespace epcomm {
namespace hierarchical {

constexpr int kMaxDomains = 16;
constexpr int kMaxChunks = 16;      // per region
constexpr int kMaxLocal = kMaxRanks;  // ranks per domain
constexpr int kMaxForwarders = 160;
// Threads per block. The combine's blocks are bound by bytes in flight per SM: 32 warps (combine
// 642 -> 557 us on 2x1 against 16) take a whole SM's registers. The dispatch kernel keeps 16 warps
// (no measured gain from 32) so that its blocks can share an SM with the caller's compute kernels.
constexpr int kDispatchThreads = 512;
constexpr int kCombineThreads = 1024;
constexpr int kTagBits = 20;        // ready words carry (call << kTagBits) | shape tag

// Slow-tier header (NVSHMEM, int64 words): ready[D] (a mate entered the call: its receive area is
// free), done[D][chunks] ((call << 32) | count of the mate's chunk), abort (a call given up here),
// notified[64] (the call whose counts row each rank delivered here), seq and notify_seq (this
// rank's operation and notify counters, advance_kernel), sticky_error, notify_gave_up (the last
// call whose counts exchange gave up here: mate_to_send). Then the counts area
// (notify_kernel), then the staging area (Call::stage_offset).
constexpr int kMaxGroupRanks = 64;
constexpr int64_t kSymHeaderBytes = 4096;
static_assert(8 * (kMaxDomains + kMaxDomains * kMaxChunks + 1 + kMaxGroupRanks + 4) <= kSymHeaderBytes,
              "slow-tier header");
// Fast-tier header (IPC, int64 words): ready[L] (a domain rank entered the call), flags[L][F] (a
// domain rank's forwarder block finished with this rank's area).
constexpr int64_t kDomainHeaderBytes = 16384;
static_assert(8 * (kMaxLocal + kMaxLocal * kMaxForwarders) <= kDomainHeaderBytes, "fast-tier header");

// info words (host-mapped) written on an error; the Python side reads them after a sync.
constexpr int kInfoError = 0;  // 1: timeout, 2: another operation or shape, 3: receive area too small,
                               // 4: more rows received than num_worst_tokens, 5: refused inputs,
                               // 6: an earlier call's error on that rank, 7: that rank gave this call up
constexpr int kRefused = -1;   // the shape digest of a rank whose inputs are invalid (notify_kernel)
constexpr int kPendingError = -2;  // ... of a rank with an earlier call's error not yet raised
constexpr int kInfoRanks = 1;  // [num_ranks]: 1 for each rank involved
constexpr int kInfoInts = 1 + kMaxGroupRanks;

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
// Set by every error report and never cleared (the Buffer must be destroyed after one): the next
// notify tells every rank (kPendingError), whatever the host has read and cleared of `info`.
__device__ __forceinline__ int64_t* sym_sticky_error(uint8_t* sym) { return sym_notify_seq(sym) + 1; }
// The call whose counts exchange gave up on this rank. Every rank that finished that exchange saw
// the same rows and gave up too, so no mate waits for this rank's chunks: mate_to_send need not wait
// to tell it (a rank that raised early and went away would never come, and the wait would run to the
// timeout).
__device__ __forceinline__ int64_t* sym_notify_gave_up(uint8_t* sym) { return sym_sticky_error(sym) + 1; }
__device__ __forceinline__ int64_t* dom_ready(uint8_t* buf, int i) { return reinterpret_cast<int64_t*>(buf) + i; }
__device__ __forceinline__ int64_t* dom_flag(uint8_t* buf, int i, int b) {
    return reinterpret_cast<int64_t*>(buf) + kMaxLocal + i * kMaxForwarders + b;
}

__device__ inline void report(int* info, int code, int rank) {
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
    // Record an error for the host (`rank`: the rank involved) and for the next notify.
    __device__ void report(int code, int rank) const {
        epcomm::hierarchical::report(info, code, rank);
        *sym_sticky_error(sym) = code;
    }
    // Give up the call: every other wait of this rank's stops at its next look.
    __device__ void give_up() const {
        *sym_abort(sym) = call();
        __threadfence_system();
    }
    __device__ void abort(int code, int rank) const {
        report(code, rank);
        give_up();
    }
};

// Spin until `word` satisfies `ok`; false (after marking the call aborted, `rank` named) on timeout
// or when another wait gave up first.
template <typename Ok>
__device__ inline bool wait_for(const Call& c, const int64_t* word, Ok ok, int rank, int64_t* seen) {
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

// A ready word written by `rank` for this call: false (aborted) when it shows another shape, or a
// later call: `rank` cannot end this call without this rank past this wait (it waits for this
// rank's rows, which are sent after it), so it gave the call up (another shape seen there, or an
// error of its own) and went on; its next call's word hides this call's tag.
__device__ inline bool wait_entered(const Call& c, const int64_t* word, int rank) {
    int64_t seen = 0;
    if (!wait_for(c, word, [&](int64_t v) { return v >= (c.call() << kTagBits); }, rank, &seen)) return false;
    if (c.aborted()) return false;  // given up here already: its report stands (a mate gone on is its echo)
    if ((seen >> kTagBits) != c.call()) {
        c.abort(7, rank);
        return false;
    }
    if ((seen & ((1 << kTagBits) - 1)) != c.shape_tag) {
        c.abort(2, rank);
        return false;
    }
    return true;
}

// A done word's count that says the mate gave the call up and sends nothing (counts fit 31 bits).
constexpr int64_t kGaveUpCount = 0xffffffff;

// The count that came with chunk j of domain d's region for this call, or -1 (aborted; also when
// the mate sent word that it gave the call up, which this rank then gives up too, naming it).
__device__ inline int wait_chunk(const Call& c, int d, int j) {
    int64_t seen = 0;
    if (!wait_for(c, sym_done(c.sym, d, j), [&](int64_t v) { return (v >> 32) == c.call(); }, c.mate(d), &seen))
        return -1;
    if ((seen & 0xffffffff) == kGaveUpCount) {
        if (!c.aborted()) c.abort(7, c.mate(d));
        return -1;
    }
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
__device__ inline void block_copy(uint8_t* dst, const uint8_t* src, int64_t bytes) {
    constexpr int kUnroll = 4;
    if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) % 16 == 0) {
        int4* d = reinterpret_cast<int4*>(dst);
        const int4* s = reinterpret_cast<const int4*>(src);
        const int64_t n = bytes / 16;
        for (int64_t i = threadIdx.x; i < n; i += kUnroll * static_cast<int64_t>(blockDim.x)) {
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (i + u * blockDim.x < n) v[u] = s[i + u * blockDim.x];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (i + u * blockDim.x < n) d[i + u * blockDim.x] = v[u];
        }
        return;
    }
    int* d = reinterpret_cast<int*>(dst);
    const int* s = reinterpret_cast<const int*>(src);
    for (int64_t i = threadIdx.x; i < bytes / 4; i += blockDim.x) d[i] = s[i];
}

// Move `bytes` of this rank's NVSHMEM buffer at `offset` to mate d's buffer at `dst_offset`: stores
// into its mapping, or a put. The caller completes them (finish_to_mate) before signalling.
__device__ inline void copy_to_mate(const Call& c, int d, int64_t dst_offset, int64_t offset, int64_t bytes) {
    if (bytes <= 0) return;
    if (c.mates[d] != nullptr)
        block_copy(c.mates[d] + dst_offset, c.sym + offset, bytes);
    else
        nvshmemx_putmem_nbi_block(c.sym + dst_offset, c.sym + offset, static_cast<size_t>(bytes), c.mate(d));
}

// After the block's copy_to_mate calls: they are delivered, then the chunk's done word is set there.
__device__ inline void finish_to_mate(const Call& c, int d, int j, int64_t count) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (c.mates[d] == nullptr) nvshmem_quiet();
        __threadfence_system();
        nvshmemx_signal_op(reinterpret_cast<uint64_t*>(sym_done(c.sym, c.my_domain, j)),
                           static_cast<uint64_t>((c.call() << 32) | count), NVSHMEM_SIGNAL_SET, c.mate(d));
    }
}

// Thread 0 of a block that sends chunk j to domain d's mate, once the mate's ready word was waited
// for: whether to send (the mate is in this call with this shape, and this rank has not given the
// call up). A rank that gave the call up still tells the mate so, in the chunk's done word, as soon
// as the mate is in the call (within what is left of the timeout since `start`): the mate would
// otherwise wait for the chunk to its timeout (a rank can give up after its domain peer's shape or
// error while its mate, in another domain, saw nothing wrong). It only looks once after a timeout
// of this call (code 1: a rank is gone or stuck; waiting again would add a timeout to the call) and
// when the call's counts exchange gave up (every mate that finished it gave up as well; one that did
// not may have left for good: its host raised the error of its previous call at once).
__device__ inline bool mate_to_send(const Call& c, int d, int j, bool entered, uint64_t start) {
    if (entered && !c.aborted()) return true;
    if (!c.aborted()) return false;  // not entered and not given up: cannot be (wait_entered aborts)
    const bool look_once =
        ld_volatile_int(c.info + kInfoError) == 1 || ld_volatile(sym_notify_gave_up(c.sym)) == c.call();
    const int64_t* word = sym_ready(c.sym, d);
    for (int spin = 0;; ++spin) {
        const int64_t v = ld_acquire_sys(word);
        if (v >= (c.call() << kTagBits)) {
            if ((v >> kTagBits) == c.call())  // not when it went on to a later call: it waits for nothing
                nvshmemx_signal_op(reinterpret_cast<uint64_t*>(sym_done(c.sym, c.my_domain, j)),
                                   static_cast<uint64_t>((c.call() << 32) | kGaveUpCount), NVSHMEM_SIGNAL_SET,
                                   c.mate(d));
            return false;
        }
        if (look_once || ((spin & 63) == 63 && global_timer_ns() - start > c.timeout_ns)) return false;  // not there
    }
}

// Tell every domain rank this rank entered the call (its IPC area may be written / read).
__device__ inline void enter_domain(const Call& c) {
    for (int i = 0; i < c.ranks_per_domain; ++i) st_release_sys(dom_ready(c.peers[i], c.local), c.entered());
}

// Wait until every domain rank entered the call (thread i < L waits for rank i); false: aborted.
__device__ inline bool domain_entered(const Call& c) {
    __shared__ int s_ok;
    if (threadIdx.x == 0) s_ok = 1;
    __syncthreads();
    if (threadIdx.x < c.ranks_per_domain &&
        !wait_entered(c, dom_ready(c.peers[c.local], threadIdx.x), c.domain_rank(threadIdx.x)))
        s_ok = 0;
    __syncthreads();
    return s_ok != 0;
}

// Forwarder block b is done with every domain rank's area: flag it there (2 x call, + 1 when this
// rank gave the call up: what it forwarded may be incomplete); then wait until every domain rank's
// block b is done with this rank's (so the caller may reuse its area after the kernel). A domain
// rank that gave the call up is named (7): this rank's outputs may lack the rows it forwards.
__device__ inline void leave_domain(const Call& c, int b) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        const int64_t flag = 2 * c.call() + (c.aborted() ? 1 : 0);
        for (int i = 0; i < c.ranks_per_domain; ++i) st_release_sys(dom_flag(c.peers[i], c.local, b), flag);
    }
    if (threadIdx.x < c.ranks_per_domain) {
        int64_t seen = 0;
        const int rank = c.domain_rank(threadIdx.x);
        if (wait_for(c, dom_flag(c.peers[c.local], threadIdx.x, b), [&](int64_t v) { return v >= 2 * c.call(); },
                     rank, &seen) &&
            seen == 2 * c.call() + 1 && !c.aborted())
            c.abort(7, rank);
    }
}

// ------------------------------------------------------------------ host side of the entry points
// The call's common part, from `call_params`: sym, num_ranks, num_domains, my_domain,
// ranks_per_domain, local, call, shape_tag, chunks, num_forwarders, timeout_ns, stage_offset, then each domain
// rank's IPC buffer (kMaxLocal entries), then each domain's mate's mapped NVSHMEM buffer or 0
// (kMaxDomains entries).
inline int make_call(const int64_t* p, int* info, Call* c) {
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

// Blocks of 256 threads, a warp per token (at most 1024 blocks).
inline int grid_for(int num_tokens) {
    const int blocks = (num_tokens + 7) / 8;
    return blocks < 1 ? 1 : (blocks < 1024 ? blocks : 1024);
}

}  // namespace hierarchical
}  // namespace epcomm
