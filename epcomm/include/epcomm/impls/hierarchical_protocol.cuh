// The hierarchical call's shared state (Call): who this rank is, how it reports and gives up, the
// bounded waits, the copies to mates and the domain handshake.
#pragma once

#include "../layout/hierarchical.cuh"

namespace epcomm {
namespace hierarchical {

// What every kernel of a call shares: who this rank is, the call, and how to give up.
struct Call {
    uint8_t* sym;  // this rank's NVSHMEM buffer (the same address names every mate's copy)
    uint8_t* peers[kMaxLocal];  // each domain rank's IPC buffer as mapped here
    uint8_t* mates[kMaxDomains];  // each mate's NVSHMEM buffer where NVLink maps it here (stores), else null (puts)
    int num_ranks, num_domains, my_domain, ranks_per_domain, local;
    int shape_tag;
    int op;  // the Op of the call (its error record names it)
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
    // Record an error for the host (`rank`: the rank involved; a timeout: the wait's Phase) and for
    // the next notify.
    __device__ void report(int code, int rank, int phase = kPhaseNone) const {
        epcomm::hierarchical::report(info, code, op, rank, phase);
        *sym_sticky_error(sym) = code;
    }
    // Give up the call: every other wait of this rank's stops at its next look.
    __device__ void give_up() const {
        *sym_abort(sym) = call();
        __threadfence_system();
    }
    __device__ void abort(int code, int rank, int phase = kPhaseNone) const {
        report(code, rank, phase);
        give_up();
    }
};

// Spin until `word` satisfies `ok`; false (after marking the call aborted, `rank` named) on timeout
// or when another wait gave up first. `phase`: where in the call the wait is (the timeout's record).
template <typename Ok>
__device__ inline bool wait_for(const Call& c, const int64_t* word, Ok ok, int rank, int64_t* seen, int phase) {
    const WaitEnd end = bounded_wait<64>(
        global_timer_ns(), c.timeout_ns,
        [&] {
            *seen = ld_acquire_sys(word);
            return ok(*seen);
        },
        [&] { return c.aborted(); });
    if (end == WaitEnd::kTimedOut) c.abort(kErrTimeout, rank, phase);
    return end == WaitEnd::kReady;
}

// A ready word written by `rank` for this call: false (aborted) when it shows another shape, or a
// later call: `rank` cannot end this call without this rank past this wait (it waits for this
// rank's rows, which are sent after it), so it gave the call up (another shape seen there, or an
// error of its own) and went on; its next call's word hides this call's tag.
__device__ inline bool wait_entered(const Call& c, const int64_t* word, int rank, int phase) {
    int64_t seen = 0;
    if (!wait_for(c, word, [&](int64_t v) { return v >= (c.call() << kTagBits); }, rank, &seen, phase)) return false;
    if (c.aborted()) return false;  // given up here already: its report stands (a mate gone on is its echo)
    if ((seen >> kTagBits) != c.call()) {
        c.abort(kErrPeerGaveUp, rank);
        return false;
    }
    if ((seen & ((1 << kTagBits) - 1)) != c.shape_tag) {
        c.abort(kErrMismatch, rank);
        return false;
    }
    return true;
}

// A done word's count that says the mate gave the call up and sends nothing (counts fit 31 bits).
constexpr int64_t kGaveUpCount = 0xffffffff;

// The count that came with chunk j of domain d's region for this call, or -1 (aborted; also when
// the mate sent word that it gave the call up, which this rank then gives up too, naming it).
__device__ inline int wait_chunk(const Call& c, int d, int j, int phase) {
    int64_t seen = 0;
    if (!wait_for(c, sym_done(c.sym, d, j), [&](int64_t v) { return (v >> 32) == c.call(); }, c.mate(d), &seen,
                  phase))
        return -1;
    if ((seen & 0xffffffff) == kGaveUpCount) {
        if (!c.aborted()) c.abort(kErrPeerGaveUp, c.mate(d));
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
        ld_volatile_int(c.info + kInfoError) == kErrTimeout || ld_volatile(sym_notify_gave_up(c.sym)) == c.call();
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
__device__ inline bool domain_entered(const Call& c, int phase) {
    __shared__ int s_ok;
    if (threadIdx.x == 0) s_ok = 1;
    __syncthreads();
    if (threadIdx.x < c.ranks_per_domain &&
        !wait_entered(c, dom_ready(c.peers[c.local], threadIdx.x), c.domain_rank(threadIdx.x), phase))
        s_ok = 0;
    __syncthreads();
    return s_ok != 0;
}

// Forwarder block b is done with every domain rank's area: flag it there (2 x call, + 1 when this
// rank gave the call up: what it forwarded may be incomplete); then wait until every domain rank's
// block b is done with this rank's (so the caller may reuse its area after the kernel). A domain
// rank that gave the call up is named (7): this rank's outputs may lack the rows it forwards.
__device__ inline void leave_domain(const Call& c, int b, int phase) {
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
                     rank, &seen, phase) &&
            seen == 2 * c.call() + 1 && !c.aborted())
            c.abort(kErrPeerGaveUp, rank);
    }
}

}  // namespace hierarchical
}  // namespace epcomm
