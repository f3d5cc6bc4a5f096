// Hopper bulk copies (TMA, cp.async.bulk) for moving whole token rows, and a per-warp pipeline built
// on them. Never includes torch: compiles alone with nvcc (sm_90).
//
// Why: a warp that copies a row with 16-byte loads and stores keeps only its registers' worth of
// bytes in flight (a few KB), so a copy's rate per SM is bound by latency x registers. A bulk copy
// moves a whole row (up to the shared memory stage) with one instruction, so one lane keeps several
// rows in flight: global -> shared (completing on an mbarrier), then shared -> global, to local
// memory or to a peer's buffer mapped by CUDA IPC (NVLink), as many destinations as needed.
//
// Ordering: a bulk store is complete, and its writes visible to the issuing thread, once that
// thread's `cp.async.bulk.wait_group N` returns with the store's group among the completed ones
// (the completion carries an implicit generic-async proxy fence). The issuing thread may then
// release a flag with st.release.sys; `wait_group.read` only frees the shared source and says
// nothing about the destination. Bulk groups belong to the thread that committed them, so one lane
// issues, commits and waits for everything.
#pragma once

#include <cstdint>

#include "../../epcomm/include/epcomm/common/ptx.cuh"

namespace epcomm {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
    // Make the initialised barrier visible to the async proxy (the TMA unit completes on it).
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Copy `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory;
// the barrier's current phase completes when they have landed.
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* gmem_src, int bytes, uint64_t* bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(smem_dst)), "l"(gmem_src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}

__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(smem_u32(bar)), "r"(parity)
                     : "memory");
}

// Store `bytes` from shared memory to global memory (local, or a peer's mapped buffer).
__device__ __forceinline__ void bulk_store(void* gmem_dst, const void* smem_src, int bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem_dst), "r"(smem_u32(smem_src)),
                 "r"(bytes)
                 : "memory");
}

// Closes the bulk group of the stores issued since the last commit (an empty group if none).
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Wait until at most kPending of this thread's groups have not completed (writes done and visible).
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}

// Wait until at most kPending of this thread's groups still read their shared source.
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Shared memory of one warp's row pipeline: kStages row buffers with one mbarrier each, and for
// the last kInFlight steps the flags (addresses, nullptr = none) to release once that step's stores
// have completed. A stage is reused as soon as its stores have read it, so more steps' stores are
// in flight (kInFlight) than rows fit in shared memory (kStages).
template <int kStages, int kInFlight>
struct RowRing {
    static_assert(kStages >= 2 && kInFlight >= kStages - 1 && kInFlight <= 32, "2+ stages, 32 steps in flight at most");
    uint8_t* rows;       // [kStages][stage_bytes], 128-byte aligned
    uint64_t* bars;      // [kStages]
    int64_t** flags;     // [kInFlight + 1][kMaxRanks]
    int stage_bytes;

    static constexpr int kFlagSteps = kInFlight + 1;

    // Bytes of dynamic shared memory for `warps` rings of rows of `row_bytes`.
    __host__ __device__ static int64_t smem_bytes(int warps, int row_bytes) {
        return static_cast<int64_t>(warps) * (kStages * (stage_size(row_bytes) + 8) + kFlagSteps * kMaxRanks * 8);
    }
    __host__ __device__ static int stage_size(int row_bytes) { return (row_bytes + 127) / 128 * 128; }

    // Ring `w` of `warps` in the block's dynamic shared memory `smem`.
    __device__ static RowRing carve(uint8_t* smem, int w, int warps, int row_bytes) {
        RowRing r;
        r.stage_bytes = stage_size(row_bytes);
        r.rows = smem + static_cast<int64_t>(w) * kStages * r.stage_bytes;
        uint8_t* tail = smem + static_cast<int64_t>(warps) * kStages * r.stage_bytes;
        r.bars = reinterpret_cast<uint64_t*>(tail) + w * kStages;
        r.flags = reinterpret_cast<int64_t**>(tail + static_cast<int64_t>(warps) * kStages * 8) +
                  w * kFlagSteps * kMaxRanks;
        return r;
    }
};

// One warp moves the rows of items warp, warp + num_warps, ... < num_items through its ring: up
// to kStages - 1 rows are loaded ahead while earlier ones are stored, and up to kInFlight steps'
// stores are in flight; a step's flags are released once all its stores have completed.
//   source(item) -> const void*: the row to load (row_bytes), or nullptr: nothing to move;
//   send(item, stage, flags): called by every lane of the warp once the row is in `stage`
//     (lane 0 issues the bulk stores of it, every lane may write metadata with plain stores) and
//     sets flags[d] (lanes d < kMaxRanks) to the flag address to release for destination d, or
//     nullptr. The flags are then released with `flag_value` by lane 0, after the stores complete
//     (the warp's plain stores before that are ordered by a __syncwarp and the release).
template <int kStages, int kInFlight, class Source, class Send>
__device__ void warp_row_pipeline(const RowRing<kStages, kInFlight>& ring, int num_items, int warp, int num_warps,
                                  int row_bytes, int64_t flag_value, Source source, Send send) {
    using Ring = RowRing<kStages, kInFlight>;
    const int lane = threadIdx.x % kWarpSize;
    if (lane == 0)
        for (int s = 0; s < kStages; ++s) mbarrier_init(ring.bars + s);
    __syncwarp();
    uint32_t parity = 0;  // lane 0: the phase each stage's barrier is to complete next
    auto prefetch = [&](int k) {
        const int item = warp + k * num_warps;
        if (item >= num_items) return;
        const void* src = source(item);
        if (lane == 0 && src != nullptr)
            bulk_load(ring.rows + (k % kStages) * ring.stage_bytes, src, row_bytes, ring.bars + k % kStages);
    };
    auto release = [&](int k) {  // lane 0, after the stores of step k completed
        int64_t* const* flags = ring.flags + (k % Ring::kFlagSteps) * kMaxRanks;
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d)
            if (flags[d] != nullptr) st_release_sys(flags[d], flag_value);
    };
    for (int k = 0; k < kStages - 1; ++k) prefetch(k);
    int k = 0;
    for (; warp + k * num_warps < num_items; ++k) {
        const int item = warp + k * num_warps, s = k % kStages;
        int64_t** flags = ring.flags + (k % Ring::kFlagSteps) * kMaxRanks;
        const void* src = source(item);
        if (src != nullptr) {
            if (lane == 0) {
                mbarrier_wait(ring.bars + s, (parity >> s) & 1u);
                parity ^= 1u << s;
            }
            __syncwarp();
            send(item, ring.rows + s * ring.stage_bytes, flags);
        } else if (lane < kMaxRanks) {
            flags[lane] = nullptr;
        }
        if (lane == 0) bulk_commit();  // one group per step, empty or not: the waits count steps
        __syncwarp();                  // the warp's metadata stores and flag entries come before the release
        // The stage of step k - 1 is free once its stores have read it: refill it with step k + S - 1.
        if (lane == 0) bulk_wait_read<1>();
        __syncwarp();
        prefetch(k + kStages - 1);
        // Step k - kInFlight has completed: its rows are in their destinations, release their flags.
        if (lane == 0 && k >= kInFlight) {
            bulk_wait<kInFlight>();
            release(k - kInFlight);
        }
    }
    if (lane == 0) {
        bulk_wait<0>();
        for (int j = k - kInFlight < 0 ? 0 : k - kInFlight; j < k; ++j) release(j);
    }
    __syncwarp();
}

}  // namespace epcomm
