// Device helpers shared by every epcomm kernel. Never includes torch: compiles alone with nvcc.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace epcomm {

constexpr int kMaxRanks = 8;
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Release/acquire at system scope: the flags are written and read by different GPUs over NVLink.
__device__ __forceinline__ void st_release_sys(int64_t* ptr, int64_t value) {
    asm volatile("st.release.sys.global.s64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

// A flag that orders no data before it (nothing to release).
__device__ __forceinline__ void st_relaxed_sys(int64_t* ptr, int64_t value) {
    asm volatile("st.relaxed.sys.global.s64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ int64_t ld_acquire_sys(const int64_t* ptr) {
    int64_t value;
    asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
    return value;
}

// A word another kernel of this GPU raises once the data it covers is written (an acquire: reads
// after it see that data).
__device__ __forceinline__ uint32_t ld_acquire_gpu_u32(const uint32_t* ptr) {
    uint32_t value;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ int64_t ld_volatile(const int64_t* ptr) {
    int64_t value;
    asm volatile("ld.volatile.global.s64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ int ld_volatile_int(const int* ptr) {
    int value;
    asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

// Release/acquire fences (not the sequentially consistent __threadfence / __threadfence_system,
// which cost more): a fence then a strong store is a release of everything before the fence (this
// thread's accesses and what it observed, e.g. its block's stores before a barrier); a strong load
// then a fence is an acquire. _sys for what peers on other GPUs read, _gpu for what stays on this GPU.
__device__ __forceinline__ void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void fence_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
// A release alone (PTX 8.6): what a fence before a flag store needs, without the acquire half's L1
// invalidation (CCTL.IVALL in the SASS of fence.acq_rel).
__device__ __forceinline__ void fence_release_sys() { asm volatile("fence.release.sys;" ::: "memory"); }

// Atomic add that releases this thread's writes (and what it observed) at GPU scope and acquires
// those released by the earlier adds: a count of writers whose last one then publishes for all.
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* ptr, int value) {
    int old;
    asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(value) : "memory");
    return old;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Streaming 16-byte load of data no one writes during the kernel (the caller's input tensors):
// read-only path, no L1 allocation, so the copy does not evict what the waits poll.
__device__ __forceinline__ int4 ld_nc_int4(const int4* ptr) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr));
    return v;
}

// One warp copies `num_int4` 16-byte words; kUnroll loads per lane are in flight before the
// stores (bytes in flight per SM are what bound a copy's bandwidth: latency x rate). The last,
// partial round is predicated, not a word at a time: a 7 KB FP8 row in 4 KB pieces would otherwise
// end with six load-then-store round trips in a row. No __restrict__: with it nvcc turned the loads
// into ld.global.nc, whose cache is not coherent with what peers write during the kernel.
template <int kUnroll = 4>
__device__ __forceinline__ void warp_copy_int4(int4* dst, const int4* src, int num_int4, int lane) {
    for (int i = lane; i < num_int4; i += kUnroll * kWarpSize) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i + u * kWarpSize < num_int4) v[u] = src[i + u * kWarpSize];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i + u * kWarpSize < num_int4) dst[i + u * kWarpSize] = v[u];
    }
}

// Exclusive prefix sum of one value per thread over a block of exactly kWarps warps (every thread
// calls it); `total` gets the block's sum. Two barriers; `scratch` is kWarps ints of shared memory,
// free again once the call returns (a caller that reuses it right away needs a barrier first).
template <int kWarps>
__device__ __forceinline__ int block_exclusive_sum(int value, int* scratch, int& total) {
    static_assert(kWarps >= 1 && kWarps <= kWarpSize, "warp 0 scans the warps' totals: at most 32 warps");
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    int inclusive = value;
    for (int d = 1; d < kWarpSize; d <<= 1) {
        const int v = __shfl_up_sync(kFullMask, inclusive, d);
        if (lane >= d) inclusive += v;
    }
    if (lane == kWarpSize - 1) scratch[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {  // the warps' totals, scanned in place
        int w = lane < kWarps ? scratch[lane] : 0;
        for (int d = 1; d < kWarpSize; d <<= 1) {
            const int v = __shfl_up_sync(kFullMask, w, d);
            if (lane >= d) w += v;
        }
        if (lane < kWarps) scratch[lane] = w;
    }
    __syncthreads();
    total = scratch[kWarps - 1];
    return inclusive - value + (warp > 0 ? scratch[warp - 1] : 0);
}

}  // namespace epcomm
