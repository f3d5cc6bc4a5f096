// Measures how fast SMs sum a combine's returned BF16 rows, the reducer's loop against variants.
//
// The inner loop of the normal-mode reducer (intranode.cu, combine_reduce) on its own, against
// variants that keep more loads in flight. At
// EP8 a token's rows come back from ~5 ranks (top-8 of 256), into this rank's buffer: local reads,
// so one GPU measures this part of an EP8 combine as it is. 4096 tokens of 7168 BF16 channels,
// each summing M rows (M = 1..8) found at random slots of a buffer, fp32 sums rounded once to BF16.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/reduce_rate tools/microbench/reduce_rate.cu && /tmp/reduce_rate
// Prints one JSON object per (variant, M, SMs): rows read per second, in total and per SM.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "../../epcomm/include/epcomm/common/ptx.cuh"
#include "../../epcomm/include/epcomm/common/row_sum.cuh"
#include "microbench.cuh"

using namespace epcomm;

constexpr int kHidden = 7168;
constexpr int kRowInt4 = kHidden / 8;
constexpr int kStrideInt4 = kRowInt4 + 3;  // a combine slot: row, top-k weights, flag (16-byte words)
constexpr int kTokens = 4096;
constexpr int kSlots = kTokens * kMaxRanks;
constexpr int kThreads = 512;

// Lane d < M: the row of token t's d-th source; every lane gets the mask of sources.
__device__ __forceinline__ const int4* source_row(const int4* buf, const int* slots, int t, int lane, unsigned& mask) {
    const int s = lane < kMaxRanks ? slots[t * kMaxRanks + lane] : -1;
    mask = __ballot_sync(kFullMask, s >= 0);
    return s >= 0 ? buf + static_cast<int64_t>(s) * kStrideInt4 : nullptr;
}

__device__ __forceinline__ const int4* row_of(const int4* row_lane, int d) {
    return reinterpret_cast<const int4*>(__shfl_sync(kFullMask, reinterpret_cast<uint64_t>(row_lane), d));
}

// The kernel's loop (sum_sources, row_sum.cuh): kUnroll words per lane, the next source's loads
// issued before the current source's adds (two sources in flight).
template <int kUnroll>
__global__ void __launch_bounds__(kThreads, 1) reduce_two_in_flight(const int4* buf, const int* slots, int4* out) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = blockIdx.x * (kThreads / kWarpSize) + threadIdx.x / kWarpSize;
    const int num_warps = gridDim.x * (kThreads / kWarpSize);
    for (int t = warp; t < kTokens; t += num_warps) {
        unsigned mask;
        const int4* row_lane = source_row(buf, slots, t, lane, mask);
        auto load = [&](int d, int c0, int4 (&v)[kUnroll]) {
            const int4* p = row_of(row_lane, d);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (c0 + u * kWarpSize < kRowInt4) v[u] = p[c0 + u * kWarpSize];
        };
        for (int c0 = lane; c0 < kRowInt4; c0 += kUnroll * kWarpSize)
            sum_sources<kUnroll>(mask, c0, kRowInt4, load, [&](int u, float (&acc)[8]) {
                out[static_cast<int64_t>(t) * kRowInt4 + c0 + u * kWarpSize] = round_bf16x8(acc);
            });
    }
}

// Every source's loads of a step issued at once (up to kMaxRanks x kUnroll words per lane), then
// added in ascending rank order.
template <int kUnroll>
__global__ void __launch_bounds__(kThreads, 1) reduce_all_in_flight(const int4* buf, const int* slots, int4* out) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = blockIdx.x * (kThreads / kWarpSize) + threadIdx.x / kWarpSize;
    const int num_warps = gridDim.x * (kThreads / kWarpSize);
    for (int t = warp; t < kTokens; t += num_warps) {
        unsigned mask;
        const int4* row_lane = source_row(buf, slots, t, lane, mask);
        const int4* rows[kMaxRanks];
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) rows[d] = row_of(row_lane, d);
        for (int c0 = lane; c0 < kRowInt4; c0 += kUnroll * kWarpSize) {
            int4 v[kMaxRanks][kUnroll];
#pragma unroll
            for (int d = 0; d < kMaxRanks; ++d)
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if ((mask >> d & 1u) && c0 + u * kWarpSize < kRowInt4) v[d][u] = rows[d][c0 + u * kWarpSize];
            float acc[kUnroll][8] = {};
#pragma unroll
            for (int d = 0; d < kMaxRanks; ++d)
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if ((mask >> d & 1u) && c0 + u * kWarpSize < kRowInt4) add_bf16x8(acc[u], v[d][u]);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (c0 + u * kWarpSize < kRowInt4)
                    out[static_cast<int64_t>(t) * kRowInt4 + c0 + u * kWarpSize] = round_bf16x8(acc[u]);
        }
    }
}

__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint32_t seed) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        p[i] = __float2bfloat16(static_cast<float>(static_cast<int>((i * 2654435761u + seed) >> 20) % 2001 - 1000) / 256.f);
}

int main() {
    int4 *buf, *out, *ref;
    int* slots;
    CHECK(cudaMalloc(&buf, static_cast<size_t>(kSlots) * kStrideInt4 * 16));
    CHECK(cudaMalloc(&out, static_cast<size_t>(kTokens) * kRowInt4 * 16));
    CHECK(cudaMalloc(&ref, static_cast<size_t>(kTokens) * kRowInt4 * 16));
    CHECK(cudaMalloc(&slots, static_cast<size_t>(kTokens) * kMaxRanks * 4));
    fill_bf16<<<1024, 256>>>(reinterpret_cast<__nv_bfloat16*>(buf), static_cast<int64_t>(kSlots) * kStrideInt4 * 8, 7u);
    CHECK(cudaDeviceSynchronize());
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("{\"device\": \"%s\", \"hidden\": %d, \"tokens\": %d}\n", prop.name, kHidden, kTokens);
    std::mt19937 rng(1);
    for (int m : {1, 2, 5, 8}) {
        // Token t's M sources at M distinct random ranks, each at a random unused slot.
        std::vector<int> host(static_cast<size_t>(kTokens) * kMaxRanks, -1), perm(kSlots);
        for (int i = 0; i < kSlots; ++i) perm[i] = i;
        std::shuffle(perm.begin(), perm.end(), rng);
        int next = 0;
        for (int t = 0; t < kTokens; ++t) {
            int ranks[kMaxRanks];
            for (int d = 0; d < kMaxRanks; ++d) ranks[d] = d;
            std::shuffle(ranks, ranks + kMaxRanks, rng);
            for (int j = 0; j < m; ++j) host[t * kMaxRanks + ranks[j]] = perm[next++];
        }
        CHECK(cudaMemcpy(slots, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
        reduce_two_in_flight<4><<<132, kThreads>>>(buf, slots, ref);
        CHECK(cudaDeviceSynchronize());
        const double bytes = static_cast<double>(kTokens) * m * kHidden * 2;  // rows read
        auto run = [&](const char* name, int sms, auto launch) {
            CHECK(cudaMemset(out, 0xff, static_cast<size_t>(kTokens) * kRowInt4 * 16));  // poison
            const double us = time_us(launch, 10);
            std::vector<int4> a(static_cast<size_t>(kTokens) * kRowInt4), b(a.size());
            CHECK(cudaMemcpy(a.data(), out, a.size() * 16, cudaMemcpyDeviceToHost));
            CHECK(cudaMemcpy(b.data(), ref, b.size() * 16, cudaMemcpyDeviceToHost));
            const bool same = std::equal(a.begin(), a.end(), b.begin(), [](const int4& x, const int4& y) {
                return x.x == y.x && x.y == y.y && x.z == y.z && x.w == y.w;
            });
            const double gbps = bytes / us / 1e3;
            std::printf("{\"variant\": \"%s\", \"sources\": %d, \"sms\": %d, \"us\": %.1f, \"read_gbps\": %.1f, "
                        "\"read_gbps_per_sm\": %.1f, \"bitwise\": %s}\n",
                        name, m, sms, us, gbps, gbps / sms, same ? "true" : "false");
            std::fflush(stdout);
        };
        for (int sms : {8, 16}) {
            run("two in flight x4 (kernel)", sms, [&] { reduce_two_in_flight<4><<<sms, kThreads>>>(buf, slots, out); });
            run("two in flight x2", sms, [&] { reduce_two_in_flight<2><<<sms, kThreads>>>(buf, slots, out); });
            run("all in flight x1", sms, [&] { reduce_all_in_flight<1><<<sms, kThreads>>>(buf, slots, out); });
            run("all in flight x2", sms, [&] { reduce_all_in_flight<2><<<sms, kThreads>>>(buf, slots, out); });
            run("all in flight x3", sms, [&] { reduce_all_in_flight<3><<<sms, kThreads>>>(buf, slots, out); });
        }
    }
    return 0;
}
