// The hierarchical buffers: the NVSHMEM (slow tier) header and areas, the IPC (fast tier) flags,
// and the pinned info words. Protocol and layout: docs/DESIGN.md.
#pragma once

#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "../common/protocol.cuh"
#include "../common/row_sum.cuh"

namespace epcomm {
namespace hierarchical {

constexpr int kMaxDomains = 16;
constexpr int kMaxChunks = 16;      // per region
constexpr int kMaxLocal = kMaxRanks;  // ranks per domain
constexpr int kMaxForwarders = 160;
// Threads per block. The combine's blocks are bound by bytes in flight per SM: 32 warps (faster than
// 16: docs/TUNING.md) take a whole SM's registers. The dispatch kernel keeps 16 warps
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

// The info words (host-mapped) hold the error record of common/protocol.cuh alone.
constexpr int kRefused = -1;   // the shape digest of a rank whose inputs are invalid (notify_kernel)
constexpr int kPendingError = -2;  // ... of a rank with an earlier call's error not yet raised
constexpr int kInfoInts = kInfoErrorRanks + kMaxGroupRanks;

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

__device__ inline void report(int* info, int code, int op, int rank, int phase) {
    record_error(info, code, op, rank, phase);  // the host raises it with the call that reads it
    __threadfence_system();
}

}  // namespace hierarchical
}  // namespace epcomm
