// Measures how fast SMs copy token rows within one GPU, by registers and by bulk copies, at 4-24 SMs.
//
// The two means the normal-mode kernels have: warps moving 16-byte words through registers
// (warp_copy_int4, the receivers; the senders' loop is the same with 4 words), and bulk copies
// (cp.async.bulk, tma.cuh) through a ring of shared-memory stages.
// Rows as a dispatch's receivers see them: 14336 bytes (7168 BF16 channels) from slots of the
// buffer's stride into a packed output, 16384 rows (235 MB each way, far beyond L2), local memory.
// The rate per SM at 4-24 SMs says which side of a dispatch or combine needs how many SMs.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/copy_rate tools/microbench/copy_rate.cu && /tmp/copy_rate
// Prints one JSON object per (method, SMs): bytes copied (one way) per second, in total and per SM.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "../../epcomm/include/epcomm/common/ptx.cuh"
#include "tma.cuh"
#include "microbench.cuh"

using namespace epcomm;

constexpr int kRowBytes = 14336;
constexpr int kSrcStride = kRowBytes + 16 * 8 + 16;  // a dispatch slot: row, top-k ids and weights, flag
constexpr int kRows = 16384;
constexpr int kThreadsPerBlock = 512;

template <int kUnroll>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) copy_by_registers(const uint8_t* src, uint8_t* dst) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
    const int num_warps = gridDim.x * (blockDim.x / kWarpSize);
    for (int r = warp; r < kRows; r += num_warps)
        warp_copy_int4<kUnroll>(reinterpret_cast<int4*>(dst + static_cast<int64_t>(r) * kRowBytes),
                                reinterpret_cast<const int4*>(src + static_cast<int64_t>(r) * kSrcStride),
                                kRowBytes / 16, lane);
}

// Each of the block's `issuers` warps (lane 0) streams its rows through its own kStages stages of
// kChunk bytes (a row is kRowBytes / kChunk chunks): the next kStages - 1 chunks load while one is
// stored, and a stage is refilled once its store has read it.
template <int kStages, int kChunk>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) copy_by_bulk(const uint8_t* src, uint8_t* dst, int issuers) {
    extern __shared__ __align__(128) uint8_t smem[];
    constexpr int kChunksPerRow = kRowBytes / kChunk;
    static_assert(kRowBytes % kChunk == 0 && kChunk % 16 == 0, "whole 16-byte chunks");
    const int w = threadIdx.x / kWarpSize;
    if (w >= issuers || threadIdx.x % kWarpSize != 0) return;
    uint8_t* stages = smem + static_cast<int64_t>(w) * kStages * kChunk;
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + static_cast<int64_t>(issuers) * kStages * kChunk) + w * kStages;
    for (int s = 0; s < kStages; ++s) mbarrier_init(bars + s);
    const int issuer = blockIdx.x * issuers + w, num_issuers = gridDim.x * issuers;
    const int64_t num_chunks = static_cast<int64_t>(kRows) * kChunksPerRow;
    auto chunk_of = [&](int64_t k) { return issuer + k * num_issuers; };  // k-th chunk of this issuer
    auto load = [&](int64_t k) {
        const int64_t c = chunk_of(k);
        if (c >= num_chunks) return;
        const int64_t row = c / kChunksPerRow, part = c % kChunksPerRow;
        bulk_load(stages + (k % kStages) * kChunk, src + row * kSrcStride + part * kChunk, kChunk, bars + k % kStages);
    };
    for (int k = 0; k < kStages - 1; ++k) load(k);
    uint32_t parity = 0;
    int64_t k = 0;
    for (; chunk_of(k) < num_chunks; ++k) {
        const int s = k % kStages;
        mbarrier_wait(bars + s, (parity >> s) & 1u);
        parity ^= 1u << s;
        const int64_t c = chunk_of(k), row = c / kChunksPerRow, part = c % kChunksPerRow;
        bulk_store(dst + row * kRowBytes + part * kChunk, stages + s * kChunk, kChunk);
        bulk_commit();
        bulk_wait_read<1>();  // the store of step k - 1 has read its stage: refill it
        load(k + kStages - 1);
    }
    bulk_wait<0>();
}

// Every row of dst equals its source row (the first and last 16 bytes of each, and a middle word).
static bool check(const uint8_t* src, uint8_t* dst) {
    std::vector<uint8_t> a(static_cast<size_t>(kRows) * kSrcStride), b(static_cast<size_t>(kRows) * kRowBytes);
    CHECK(cudaMemcpy(a.data(), src, a.size(), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(b.data(), dst, b.size(), cudaMemcpyDeviceToHost));
    for (int64_t r = 0; r < kRows; ++r)
        for (int64_t off : {0, 16 * 223, kRowBytes - 16})
            for (int i = 0; i < 16; ++i)
                if (a[r * kSrcStride + off + i] != b[r * kRowBytes + off + i]) return false;
    return true;
}

template <class Launch>
static void report(const char* method, int sms, Launch launch, const uint8_t* src, uint8_t* dst) {
    CHECK(cudaMemset(dst, 0xff, static_cast<size_t>(kRows) * kRowBytes));  // poison
    const double us = time_us(launch, 10);
    const bool ok = check(src, dst);
    const double gbps = static_cast<double>(kRows) * kRowBytes / us / 1e3;
    std::printf("{\"method\": \"%s\", \"sms\": %d, \"us\": %.1f, \"gbps\": %.1f, \"gbps_per_sm\": %.1f, \"checked\": %s}\n",
                method, sms, us, gbps, gbps / sms, ok ? "true" : "false");
    std::fflush(stdout);
}

template <int kStages, int kChunk>
static void bulk_variant(int issuers, int sms, const uint8_t* src, uint8_t* dst) {
    const int smem = issuers * kStages * (kChunk + 8);
    if (smem > 227 * 1024) return;
    CHECK(cudaFuncSetAttribute(copy_by_bulk<kStages, kChunk>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    char name[96];
    std::snprintf(name, sizeof name, "bulk %d issuers x %d stages x %d B", issuers, kStages, kChunk);
    report(name, sms, [&] { copy_by_bulk<kStages, kChunk><<<sms, kThreadsPerBlock, smem>>>(src, dst, issuers); }, src,
           dst);
}

int main() {
    uint8_t *src, *dst;
    CHECK(cudaMalloc(&src, static_cast<size_t>(kRows) * kSrcStride));
    CHECK(cudaMalloc(&dst, static_cast<size_t>(kRows) * kRowBytes));
    fill<<<1024, 256>>>(src, static_cast<int64_t>(kRows) * kSrcStride, 12345u);
    CHECK(cudaDeviceSynchronize());
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("{\"device\": \"%s\", \"row_bytes\": %d, \"rows\": %d}\n", prop.name, kRowBytes, kRows);
    for (int sms : {4, 8, 12, 16, 24}) {
        report("registers x4", sms, [&] { copy_by_registers<4><<<sms, kThreadsPerBlock>>>(src, dst); }, src, dst);
        report("registers x8", sms, [&] { copy_by_registers<8><<<sms, kThreadsPerBlock>>>(src, dst); }, src, dst);
        report("registers x16", sms, [&] { copy_by_registers<16><<<sms, kThreadsPerBlock>>>(src, dst); }, src, dst);
        bulk_variant<3, 14336>(4, sms, src, dst);
        bulk_variant<14, 14336>(1, sms, src, dst);
        bulk_variant<7, 14336>(2, sms, src, dst);
        bulk_variant<4, 7168>(7, sms, src, dst);
        bulk_variant<2, 7168>(14, sms, src, dst);
        bulk_variant<4, 3584>(14, sms, src, dst);
        bulk_variant<8, 3584>(7, sms, src, dst);
        bulk_variant<2, 3584>(16, sms, src, dst);
        bulk_variant<4, 2048>(16, sms, src, dst);
    }
    return 0;
}
