// Measures how fast the copy engines move token rows within one GPU, and whether they need SMs.
//
// A dispatch gathers rows of x into destination order and a combine returns contiguous blocks; a
// copy engine moves bytes without an SM. Rows as in copy_rate.cu (14336 bytes from slots of the
// buffer's stride, 16384 rows, far beyond L2), gathered in a random order into a packed output:
//   - one cudaMemcpyAsync of the whole packed range (the engines' rate for a contiguous block),
//   - one cudaMemcpyBatchAsync of a copy per row (the gather),
//   - the warp copy of the kernels (registers, 8 words in flight) at 8 and 24 SMs, for comparison,
// and the engines' two again while a kernel holds every SM: if their time holds, they used none.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/ce_rate tools/microbench/ce_rate.cu && /tmp/ce_rate
// Prints one JSON object per method: bytes copied (one way) per second, and whether dst was right.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <numeric>
#include <chrono>
#include <thread>
#include <random>
#include <vector>

#include "../../epcomm/include/epcomm/common/ptx.cuh"
#include "microbench.cuh"

using namespace epcomm;

constexpr int kRowBytes = 14336;
constexpr int kSrcStride = kRowBytes + 16 * 8 + 16;  // a dispatch slot: row, top-k ids and weights, flag
constexpr int kRows = 16384;
constexpr int kThreadsPerBlock = 512;

__global__ void __launch_bounds__(kThreadsPerBlock, 1) gather_by_registers(const uint8_t* src, uint8_t* dst,
                                                                           const int* order) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
    const int num_warps = gridDim.x * (blockDim.x / kWarpSize);
    for (int r = warp; r < kRows; r += num_warps)
        warp_copy_int4<8>(reinterpret_cast<int4*>(dst + static_cast<int64_t>(r) * kRowBytes),
                          reinterpret_cast<const int4*>(src + static_cast<int64_t>(order[r]) * kSrcStride),
                          kRowBytes / 16, lane);
}

// Holds every SM for about `cycles` clocks: one block an SM, with enough shared memory that no other
// block fits beside it.
__global__ void hold_sms(int64_t cycles) {
    extern __shared__ uint8_t smem[];
    const int64_t start = clock64();
    while (clock64() - start < cycles) {
    }
    if (threadIdx.x == 0 && smem[0] == 1) smem[1] = 0;  // keeps the allocation
}

// dst row r equals source row order[r] (contiguous: order = nullptr, source rows packed).
static bool check(const uint8_t* src, int64_t src_stride, const uint8_t* dst, const std::vector<int>* order) {
    std::vector<uint8_t> a(static_cast<size_t>(kRows) * src_stride), b(static_cast<size_t>(kRows) * kRowBytes);
    CHECK(cudaMemcpy(a.data(), src, a.size(), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(b.data(), dst, b.size(), cudaMemcpyDeviceToHost));
    for (int64_t r = 0; r < kRows; ++r) {
        const int64_t s = order != nullptr ? (*order)[r] : r;
        for (int64_t off : {0, 16 * 223, kRowBytes - 16})
            for (int i = 0; i < 16; ++i)
                if (a[s * src_stride + off + i] != b[r * kRowBytes + off + i]) return false;
    }
    return true;
}

static void print(const char* method, int sms, double us, bool ok) {
    const double gbps = static_cast<double>(kRows) * kRowBytes / us / 1e3;
    std::printf("{\"method\": \"%s\", \"sms\": %d, \"us\": %.1f, \"gbps\": %.1f, \"checked\": %s}\n", method, sms, us,
                gbps, ok ? "true" : "false");
    std::fflush(stdout);
}

int main() {
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    uint8_t *src, *packed, *dst;
    int* order_d;
    CHECK(cudaMalloc(&src, static_cast<size_t>(kRows) * kSrcStride));
    CHECK(cudaMalloc(&packed, static_cast<size_t>(kRows) * kRowBytes));
    CHECK(cudaMalloc(&dst, static_cast<size_t>(kRows) * kRowBytes));
    CHECK(cudaMalloc(&order_d, kRows * sizeof(int)));
    fill<<<1024, 256>>>(src, static_cast<int64_t>(kRows) * kSrcStride, 12345u);
    fill<<<1024, 256>>>(packed, static_cast<int64_t>(kRows) * kRowBytes, 777u);
    std::vector<int> order(kRows);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(7));
    CHECK(cudaMemcpy(order_d, order.data(), kRows * sizeof(int), cudaMemcpyHostToDevice));
    CHECK(cudaDeviceSynchronize());
    std::printf("{\"device\": \"%s\", \"sms\": %d, \"row_bytes\": %d, \"rows\": %d, \"async_engines\": %d}\n", prop.name,
                prop.multiProcessorCount, kRowBytes, kRows, prop.asyncEngineCount);

    cudaStream_t copies, holder;
    CHECK(cudaStreamCreateWithFlags(&copies, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&holder, cudaStreamNonBlocking));
    std::vector<void*> dsts(kRows);
    std::vector<const void*> srcs(kRows);
    std::vector<size_t> sizes(kRows, kRowBytes);
    for (int r = 0; r < kRows; ++r) {
        dsts[r] = dst + static_cast<int64_t>(r) * kRowBytes;
        srcs[r] = src + static_cast<int64_t>(order[r]) * kSrcStride;
    }
    cudaMemcpyAttributes attrs{};
    attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attrs.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attrs_idx = 0;
    const size_t bytes = static_cast<size_t>(kRows) * kRowBytes;
    auto one_copy = [&] { CHECK(cudaMemcpyAsync(dst, packed, bytes, cudaMemcpyDeviceToDevice, copies)); };
    auto batch = [&] {
        CHECK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), kRows, &attrs, &attrs_idx, 1, copies));
    };

    // Each timed on the copies stream (events there), dst poisoned first; `before` runs ahead of the
    // first event (the SM holder, launched and given time to take every SM).
    auto timed = [&](const std::function<void()>& launch, int iters, const std::function<void()>& before) {
        cudaEvent_t a, b;
        CHECK(cudaEventCreate(&a));
        CHECK(cudaEventCreate(&b));
        std::vector<float> ms;
        for (int i = 0; i < iters + 2; ++i) {
            CHECK(cudaMemsetAsync(dst, 0xff, bytes, copies));
            CHECK(cudaStreamSynchronize(copies));
            before();
            CHECK(cudaEventRecord(a, copies));
            launch();
            CHECK(cudaEventRecord(b, copies));
            CHECK(cudaEventSynchronize(b));
            CHECK(cudaDeviceSynchronize());
            float t;
            CHECK(cudaEventElapsedTime(&t, a, b));
            if (i >= 2) ms.push_back(t);
        }
        CHECK(cudaEventDestroy(a));
        CHECK(cudaEventDestroy(b));
        std::sort(ms.begin(), ms.end());
        return ms[ms.size() / 2] * 1e3;
    };
    const auto nothing = [] {};
    double us = timed(one_copy, 10, nothing);
    print("engines: one memcpy", 0, us, check(packed, kRowBytes, dst, nullptr));
    us = timed(batch, 10, nothing);
    print("engines: batch of row copies (gather)", 0, us, check(src, kSrcStride, dst, &order));
    for (int sms : {8, 24}) {
        us = timed([&] { gather_by_registers<<<sms, kThreadsPerBlock, 0, copies>>>(src, dst, order_d); }, 10, nothing);
        print("registers x8 (gather)", sms, us, check(src, kSrcStride, dst, &order));
    }

    // The engines again while every SM is held for about 20 ms (longer than any copy above), the
    // holder started 2 ms before the copy is issued.
    const int smem = static_cast<int>(prop.sharedMemPerBlockOptin);
    CHECK(cudaFuncSetAttribute(hold_sms, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int khz = 0;
    CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
    const auto hold = [&] {
        hold_sms<<<prop.multiProcessorCount, 1024, smem, holder>>>(static_cast<int64_t>(khz) * 20);
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    };
    us = timed(one_copy, 5, hold);
    print("engines: one memcpy, every SM held", 0, us, check(packed, kRowBytes, dst, nullptr));
    us = timed(batch, 5, hold);
    print("engines: batch of row copies, every SM held", 0, us, check(src, kSrcStride, dst, &order));
    us = timed([&] { gather_by_registers<<<8, kThreadsPerBlock, 0, copies>>>(src, dst, order_d); }, 5, hold);
    print("registers x8 (gather), every SM held", 8, us, check(src, kSrcStride, dst, &order));
    CHECK(cudaGetLastError());
    return 0;
}
