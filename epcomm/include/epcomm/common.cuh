// Device helpers shared by every epcomm kernel. Never includes torch: compiles alone with nvcc.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace epcomm {

constexpr int kMaxRanks = 8;
constexpr int kWarpSize = 32;

// Release/acquire at system scope: the flags are read by other GPUs over NVLink.
__device__ __forceinline__ void st_release_sys(int64_t* ptr, int64_t value) {
    asm volatile("st.release.sys.global.s64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ int64_t ld_acquire_sys(const int64_t* ptr) {
    int64_t value;
    asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// One warp copies `num_int4` 16-byte words; several loads are issued before the stores.
__device__ __forceinline__ void warp_copy_int4(int4* __restrict__ dst, const int4* __restrict__ src, int num_int4,
                                               int lane) {
    constexpr int kUnroll = 4;
    int i = lane;
    for (; i + (kUnroll - 1) * kWarpSize < num_int4; i += kUnroll * kWarpSize) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = src[i + u * kWarpSize];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) dst[i + u * kWarpSize] = v[u];
    }
    for (; i < num_int4; i += kWarpSize) dst[i] = src[i];
}

}  // namespace epcomm
