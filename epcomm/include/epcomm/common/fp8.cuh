// The FP8 cast of the kernels, bit for bit the rule of epcomm/fp8.py: E4M3 values with one scale per
// 128 channels (amax / 448, optionally rounded up to a power of two; UE8M0 keeps only its exponent).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ptx.cuh"

namespace epcomm {

struct CastMode {
    bool fp8, round_scale, ue8m0;
};

// 8 bf16 channels of one lane, cast as members of a 128-channel group spread over 16 lanes
// (lanes 0-15 or 16-31 of the warp). Returns the group's scale (fp32 bits, or its UE8M0 exponent).
__device__ __forceinline__ uint2 cast_fp8x8(const int4& raw, bool valid, const CastMode& mode, float& scale_out) {
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
    float v[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 f = __bfloat1622float2(h[k]);
        v[2 * k] = f.x;
        v[2 * k + 1] = f.y;
    }
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(v[k]));
    if (!valid) amax = 0.f;
#pragma unroll
    for (int off = 8; off >= 1; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
    amax = fmaxf(amax, 1e-4f);
    float scale = __fmul_rn(amax, static_cast<float>(1.0 / 448.0));
    float inv;
    if (mode.round_scale) {  // smallest power of two >= scale; its inverse is exact
        const int bits = __float_as_int(scale);
        const int exponent = ((bits >> 23) & 0xff) + ((bits & 0x7fffff) != 0 ? 1 : 0);
        scale = __int_as_float(exponent << 23);
        inv = __fdiv_rn(1.0f, scale);
    } else {
        inv = __fdiv_rn(448.0f, amax);
    }
    scale_out = scale;
    uint2 out;
    auto* q = reinterpret_cast<__nv_fp8x2_storage_t*>(&out);
#pragma unroll
    for (int k = 0; k < 4; ++k)
        q[k] = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(v[2 * k], inv), __fmul_rn(v[2 * k + 1], inv)),
                                        __NV_SATFINITE, __NV_E4M3);
    return out;
}

}  // namespace epcomm
