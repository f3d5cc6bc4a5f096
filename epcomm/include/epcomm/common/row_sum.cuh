// Summing BF16 token rows in fp32, a lane's 16-byte words at a time: the inner loop of the
// normal-mode combine's reducers (impls/intranode_combine.cuh), shared with
// tools/microbench/reduce_rate.cu, which measures it alone. Never includes torch: compiles alone
// with nvcc (sm_90).
#pragma once

#include <cuda_bf16.h>

#include "ptx.cuh"

namespace epcomm {

// v by value: a reference bound straight to global memory (add_bf16x8(acc, row[k])) let nvcc read
// it as four 4-byte loads through the bf16x2 view below, a quarter of the bytes per load
// instruction (docs/TUNING.md).
__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4 v) {
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 f = __bfloat1622float2(h[k]);
        acc[2 * k] += f.x;
        acc[2 * k + 1] += f.y;
    }
}

// One rounding of 8 fp32 sums to BF16.
__device__ __forceinline__ int4 round_bf16x8(const float (&acc)[8]) {
    int4 o;
    auto* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int k = 0; k < 4; ++k) oh[k] = __floats2bfloat162_rn(acc[2 * k], acc[2 * k + 1]);
    return o;
}

// Sums, in fp32 and ascending order of the set bits d of `mask`, source d's words c0 + u * 32 (u <
// kUnroll, those below num_int4), which load(d, c0, v) loads into v; finish(u, acc) then takes word
// u's sums (8 floats), right after its last add. The next source's loads are issued before the
// current source's adds, so two sources' loads are in flight (a loop that added each source before
// loading the next kept one); each word's sums are finished right after its last add (figures:
// docs/TUNING.md, reducer loads; tools/microbench/reduce_rate.cu).
template <int kUnroll, class Load, class Finish>
__device__ __forceinline__ void sum_sources(unsigned mask, int c0, int num_int4, Load&& load, Finish&& finish) {
    float acc[kUnroll][8] = {};
    int4 cur[kUnroll], next[kUnroll];
    unsigned m = mask;
    if (m != 0) {
        load(__ffs(m) - 1, c0, cur);
        m &= m - 1;
    }
    for (; m != 0; m &= m - 1) {
        load(__ffs(m) - 1, c0, next);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            if (c0 + u * kWarpSize < num_int4) add_bf16x8(acc[u], cur[u]);
            cur[u] = next[u];
        }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
        if (c0 + u * kWarpSize < num_int4) {
            if (mask != 0) add_bf16x8(acc[u], cur[u]);
            finish(u, acc[u]);
        }
}

}  // namespace epcomm
