// Shared by the microbenchmarks: error checks, a fill pattern and the median time of a launch, on one
// GPU or all (copy_rate.cu, ce_rate.cu, reduce_rate.cu, nvlink_rate.cu; times taken by CUDA events).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                                    \
    do {                                                                                               \
        cudaError_t e_ = (call);                                                                       \
        if (e_ != cudaSuccess) {                                                                       \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            std::exit(1);                                                                              \
        }                                                                                              \
    } while (0)

// Fills n bytes with a pattern of `seed` (never all zeros), so a copy that moved nothing fails its check.
__global__ void fill(uint8_t* p, int64_t n, uint32_t seed) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        p[i] = static_cast<uint8_t>((i * 2654435761u + seed) >> 13);
}

// Median time in us of `iters` launches after 3 warm-ups (each timed alone by two events).
template <class Launch>
static double time_us(Launch launch, int iters) {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    for (int i = 0; i < 3; ++i) launch();
    std::vector<float> ms;
    for (int i = 0; i < iters; ++i) {
        CHECK(cudaEventRecord(a));
        launch();
        CHECK(cudaEventRecord(b));
        CHECK(cudaEventSynchronize(b));
        float t;
        CHECK(cudaEventElapsedTime(&t, a, b));
        ms.push_back(t);
    }
    CHECK(cudaGetLastError());
    CHECK(cudaEventDestroy(a));
    CHECK(cudaEventDestroy(b));
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2] * 1e3;
}

// Launch on every GPU at once (launch_on(g) after `before(g)`, each GPU idle first), then wait for
// all: the slowest GPU's time per run, each GPU timed by two events on its stream stream_of(g); the
// median of `runs` after `warmups`.
template <class StreamOf, class Before, class Launch>
static double slowest_gpu_us(int num_gpus, StreamOf stream_of, Before before, Launch launch_on, int runs = 10,
                             int warmups = 3) {
    std::vector<cudaEvent_t> a(num_gpus), b(num_gpus);
    for (int g = 0; g < num_gpus; ++g) {
        CHECK(cudaSetDevice(g));
        CHECK(cudaEventCreate(&a[g]));
        CHECK(cudaEventCreate(&b[g]));
    }
    std::vector<double> times;
    for (int it = 0; it < warmups + runs; ++it) {
        for (int g = 0; g < num_gpus; ++g) {
            CHECK(cudaSetDevice(g));
            CHECK(cudaDeviceSynchronize());
            before(g);
            CHECK(cudaDeviceSynchronize());
        }
        for (int g = 0; g < num_gpus; ++g) {
            CHECK(cudaSetDevice(g));
            CHECK(cudaEventRecord(a[g], stream_of(g)));
            launch_on(g);
            CHECK(cudaEventRecord(b[g], stream_of(g)));
        }
        double slowest = 0;
        for (int g = 0; g < num_gpus; ++g) {
            CHECK(cudaSetDevice(g));
            CHECK(cudaEventSynchronize(b[g]));
            CHECK(cudaGetLastError());
            float ms;
            CHECK(cudaEventElapsedTime(&ms, a[g], b[g]));
            slowest = std::max(slowest, ms * 1e3);
        }
        if (it >= warmups) times.push_back(slowest);
    }
    for (int g = 0; g < num_gpus; ++g) {
        CHECK(cudaSetDevice(g));
        CHECK(cudaEventDestroy(a[g]));
        CHECK(cudaEventDestroy(b[g]));
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
}
