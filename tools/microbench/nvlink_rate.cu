// Measures how fast SMs and copy engines move token rows between the GPUs of one host over NVLink.
//
// Every GPU sends to every other at once (an all-to-all, as a dispatch or combine loads the switch),
// by the means the normal-mode kernels could use:
//   push      a warp per token loads its row once and stores it into every peer's buffer (the
//             intranode dispatch's senders), optionally releasing a per-row flag after it (sys scope)
//   push-dst  a warp per (token, peer): the row is loaded once per peer, each warp stores to one GPU
//   push-tma  as push, by bulk copies through shared memory (tma.cuh's row pipeline, 3 warps a block)
//   pull      a warp per row reads it from the peer's buffer into local memory (a receiver-pulls design)
// at 8-132 SMs per GPU, slot strides 16-byte (the kernels' rows today) or 128-byte aligned.
// cudaMemcpyPeerAsync to every peer at once is the copy engines' figure for the same bytes; with
// `ce` as the argument only the copy engines run, in more ways (why: SMs store 128-byte payloads over
// NVLink, copy engines 256-byte ones, so their ceiling is higher if they can keep every link busy):
//   ce-one-way     GPU 0 to GPU 1 alone (the one-way ceiling)
//   ce-pair        GPU 0 and GPU 1 to each other at once
//   ce-push        every GPU to every peer, the copies issued by the source, a stream per peer
//   ce-pull        the same bytes, the copies issued by the destination (it reads from the peers)
//   ce-push-chunk  the push with each peer's rows cut in chunks of `chunk` bytes, issued round-robin
//                  over the peers on a stream per peer (the shape a pipelined dispatch would issue)
//   ce-push-serial the push with all of a GPU's copies on one stream, one peer after the other
//   ce-rounds      every GPU to g+1, g+2, ... (mod n) in turn on one stream: each round a permutation
//   ce-rounds-pull the rounds issued by the destinations; -chunk: each peer's rows in chunks, in rounds
//   ce-rounds+local-copy  the rounds beside 24 SMs copying (n-1) x T rows inside the GPU
//   sm+ce          half of every peer's rows pushed by 24 SMs, the other half by the copy engines
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/nvlink_rate tools/microbench/nvlink_rate.cu && /tmp/nvlink_rate [ce]
// One JSON object a line: per GPU bytes leaving it (push) or entering it (pull) over NVLink per
// second, the slowest GPU's median time of 10 launches.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "../../epcomm/include/epcomm/common/ptx.cuh"
#include "tma.cuh"
#include "microbench.cuh"

using namespace epcomm;

constexpr int kRowBytes = 14336;  // 7168 BF16 channels
constexpr int kTokens = 4096;
constexpr int kMaxGpus = 8;
constexpr int kThreads = 512;
constexpr int kUnroll = 8;

struct Peers {
    uint8_t* p[kMaxGpus];
};

__device__ __forceinline__ void copy_row(int4* const* dst, int num_dst, const int4* src, int lane) {
    constexpr int n = kRowBytes / 16;
    for (int i = lane; i < n; i += kUnroll * kWarpSize) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i + u * kWarpSize < n) v[u] = ld_nc_int4(src + i + u * kWarpSize);
        for (int d = 0; d < num_dst; ++d)
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (i + u * kWarpSize < n) dst[d][i + u * kWarpSize] = v[u];
    }
}

// Token t < `tokens` of GPU `me` goes to slot (me, t) of every peer's buffer: [source][token] rows
// of `stride`.
template <bool kFlag>
__global__ void __launch_bounds__(kThreads, 1) push(const uint8_t* src, Peers peers, int me, int num_gpus,
                                                    int stride, int64_t flag, int tokens = kTokens) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = blockIdx.x * (kThreads / kWarpSize) + threadIdx.x / kWarpSize;
    const int num_warps = gridDim.x * (kThreads / kWarpSize);
    for (int t = warp; t < tokens; t += num_warps) {
        int4* dst[kMaxGpus];
        int n = 0;
        for (int d = 0; d < num_gpus; ++d)
            if (d != me)
                dst[n++] = reinterpret_cast<int4*>(peers.p[d] + (static_cast<int64_t>(me) * kTokens + t) * stride);
        copy_row(dst, n, reinterpret_cast<const int4*>(src + static_cast<int64_t>(t) * kRowBytes), lane);
        if (kFlag) {
            __syncwarp();
            if (lane < n)
                for (int d = 0; d < n; ++d)
                    if (d == lane)
                        st_release_sys(reinterpret_cast<int64_t*>(reinterpret_cast<uint8_t*>(dst[d]) + stride - 16),
                                       flag);
        }
    }
}

// `rows` rows from `src` (row r mod T) into `out`, inside the GPU (ce-rounds+local-copy).
__global__ void __launch_bounds__(kThreads, 1) local_copy(const uint8_t* src, uint8_t* out, int rows) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = blockIdx.x * (kThreads / kWarpSize) + threadIdx.x / kWarpSize;
    const int num_warps = gridDim.x * (kThreads / kWarpSize);
    for (int r = warp; r < rows; r += num_warps) {
        int4* dst[1] = {reinterpret_cast<int4*>(out + static_cast<int64_t>(r) * kRowBytes)};
        copy_row(dst, 1, reinterpret_cast<const int4*>(src + static_cast<int64_t>(r % kTokens) * kRowBytes), lane);
    }
}

// push-tma: as push, each row moved by bulk copies (global -> shared -> every peer) through a ring
// per warp (tma.cuh's warp_row_pipeline, no flags), kTmaWarps warps a block: a bulk store keeps a
// whole row in flight with one instruction, where register copies keep a few KB a warp.
using TmaRing = RowRing<4, 8>;
constexpr int kTmaWarps = 3;
__global__ void __launch_bounds__(kTmaWarps * kWarpSize, 1) push_tma(const uint8_t* src, Peers peers, int me,
                                                                     int num_gpus, int stride) {
    extern __shared__ __align__(128) uint8_t smem[];
    const int w = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const TmaRing ring = TmaRing::carve(smem, w, kTmaWarps, kRowBytes);
    warp_row_pipeline(
        ring, kTokens, blockIdx.x * kTmaWarps + w, gridDim.x * kTmaWarps, kRowBytes, 0,
        [&](int t) -> const void* { return src + static_cast<int64_t>(t) * kRowBytes; },
        [&](int t, const uint8_t* stage, int64_t** flags) {
            if (lane == 0)
                for (int d = 0; d < num_gpus; ++d)
                    if (d != me) bulk_store(peers.p[d] + (static_cast<int64_t>(me) * kTokens + t) * stride, stage, kRowBytes);
            if (lane < kMaxRanks) flags[lane] = nullptr;
        });
}

// A warp per (token, peer), peers interleaved. kPull false (push-dst): the warp loads the token's
// row and stores it into that peer's buffer (one GPU per warp); true (pull): GPU `me` reads the
// row the peer holds for it (slot (me, t) of the peer's buffer) into its output.
template <bool kPull>
__global__ void __launch_bounds__(kThreads, 1) one_peer_per_warp(const uint8_t* src, Peers peers, uint8_t* out,
                                                                 int me, int num_gpus, int stride) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = blockIdx.x * (kThreads / kWarpSize) + threadIdx.x / kWarpSize;
    const int num_warps = gridDim.x * (kThreads / kWarpSize);
    const int num_peers = num_gpus - 1;
    for (int r = warp; r < kTokens * num_peers; r += num_warps) {
        const int t = r / num_peers, k = r % num_peers, peer = k < me ? k : k + 1;
        uint8_t* slot = peers.p[peer] + (static_cast<int64_t>(me) * kTokens + t) * stride;
        int4* dst[1] = {reinterpret_cast<int4*>(kPull ? out + static_cast<int64_t>(r) * kRowBytes : slot)};
        // ld.global.nc for the pulled rows too: no one writes them during the kernel.
        copy_row(dst, 1, reinterpret_cast<const int4*>(kPull ? slot : src + static_cast<int64_t>(t) * kRowBytes), lane);
    }
}

int main(int argc, char** argv) {
    const bool ce_only = argc > 1 && std::string(argv[1]) == "ce";
    int num_gpus = 0;
    CHECK(cudaGetDeviceCount(&num_gpus));
    num_gpus = std::min(num_gpus, kMaxGpus);
    if (num_gpus < 2) {
        std::printf("{\"error\": \"needs 2 or more GPUs, %d present\"}\n", num_gpus);
        return 0;
    }
    constexpr int kMaxStride = kRowBytes + 128;
    const int64_t buf_bytes = static_cast<int64_t>(num_gpus) * kTokens * kMaxStride;
    std::vector<uint8_t*> src(num_gpus), buf(num_gpus), out(num_gpus);
    std::vector<cudaStream_t> streams(num_gpus * kMaxGpus);
    for (int g = 0; g < num_gpus; ++g) {
        CHECK(cudaSetDevice(g));
        for (int p = 0; p < num_gpus; ++p)
            if (p != g) CHECK(cudaDeviceEnablePeerAccess(p, 0));
        CHECK(cudaMalloc(&src[g], static_cast<int64_t>(kTokens) * kRowBytes));
        CHECK(cudaMalloc(&buf[g], buf_bytes));
        CHECK(cudaMalloc(&out[g], static_cast<int64_t>(kTokens) * (num_gpus - 1) * kRowBytes));
        CHECK(cudaMemset(src[g], 0x3c + g, static_cast<int64_t>(kTokens) * kRowBytes));  // not zeros
        CHECK(cudaMemset(buf[g], 0x5a, buf_bytes));
        for (int s = 0; s < kMaxGpus; ++s)
            CHECK(cudaStreamCreateWithFlags(&streams[g * kMaxGpus + s], cudaStreamNonBlocking));
    }
    Peers peers{};
    for (int g = 0; g < num_gpus; ++g) peers.p[g] = buf[g];
    const int64_t bytes = static_cast<int64_t>(kTokens) * (num_gpus - 1) * kRowBytes;  // per GPU, one way

    // Launch on every GPU, then wait for all: the slowest GPU's median time of 10 runs.
    auto run_all = [&](auto launch_on) -> double {
        return slowest_gpu_us(
            num_gpus, [&](int g) { return streams[g * kMaxGpus]; }, [](int) {}, launch_on);
    };
    auto report = [&](const char* method, int sms, int stride, double us) {
        std::printf("{\"method\": \"%s\", \"gpus\": %d, \"sms\": %d, \"stride\": %d, \"us\": %.1f, \"gbps\": %.1f, "
                    "\"gbps_per_sm\": %.2f}\n",
                    method, num_gpus, sms, stride, us, bytes / us / 1e3, sms ? bytes / us / 1e3 / sms : 0.0);
        std::fflush(stdout);
    };
    // The copy engines: every GPU copies its rows to every peer at once, a stream per peer.
    std::vector<cudaEvent_t> fork(num_gpus * kMaxGpus);
    for (int g = 0; g < num_gpus; ++g) {
        CHECK(cudaSetDevice(g));
        for (int s = 0; s < kMaxGpus; ++s) CHECK(cudaEventCreateWithFlags(&fork[g * kMaxGpus + s], cudaEventDisableTiming));
    }
    const int64_t peer_bytes = static_cast<int64_t>(kTokens) * kRowBytes;
    // Rows of GPU g for peer d land at slot g of d's buffer (the push's layout, stride kRowBytes).
    auto slot_of = [&](int g, int d) { return buf[d] + static_cast<int64_t>(g) * peer_bytes; };
    // Fork GPU g's main stream to its per-peer streams, `issue(d, stream)` for each peer, join back.
    auto fan_out = [&](int g, auto issue) {
        cudaStream_t main_stream = streams[g * kMaxGpus];
        CHECK(cudaEventRecord(fork[g * kMaxGpus], main_stream));
        int k = 0;
        for (int d = 0; d < num_gpus; ++d) {
            if (d == g) continue;
            cudaStream_t s = streams[g * kMaxGpus + 1 + k];
            CHECK(cudaStreamWaitEvent(s, fork[g * kMaxGpus], 0));
            issue(d, s);
            CHECK(cudaEventRecord(fork[g * kMaxGpus + 1 + k], s));
            ++k;
        }
        for (int j = 1; j <= k; ++j) CHECK(cudaStreamWaitEvent(main_stream, fork[g * kMaxGpus + j], 0));
    };
    if (ce_only) {
        int engines = 0;
        CHECK(cudaDeviceGetAttribute(&engines, cudaDevAttrAsyncEngineCount, 0));
        std::printf("{\"async_engine_count\": %d}\n", engines);
        auto report_bytes = [&](const char* method, int64_t chunk, int64_t b, double us) {
            std::printf("{\"method\": \"%s\", \"gpus\": %d, \"chunk\": %lld, \"bytes_per_gpu\": %lld, \"us\": %.1f, "
                        "\"gbps\": %.1f}\n",
                        method, num_gpus, static_cast<long long>(chunk), static_cast<long long>(b), us, b / us / 1e3);
            std::fflush(stdout);
        };
        // One way and both ways between GPUs 0 and 1 (run_all launches nothing on the others).
        report_bytes("ce-one-way", 0, peer_bytes, run_all([&](int g) {
                         if (g == 0)
                             CHECK(cudaMemcpyAsync(slot_of(0, 1), src[0], peer_bytes, cudaMemcpyDefault,
                                                   streams[0]));
                     }));
        report_bytes("ce-pair", 0, peer_bytes, run_all([&](int g) {
                         if (g < 2)
                             CHECK(cudaMemcpyAsync(slot_of(g, 1 - g), src[g], peer_bytes, cudaMemcpyDefault,
                                                   streams[g * kMaxGpus]));
                     }));
        const int64_t all_bytes = peer_bytes * (num_gpus - 1);
        report_bytes("ce-push", 0, all_bytes, run_all([&](int g) {
                         fan_out(g, [&](int d, cudaStream_t s) {
                             CHECK(cudaMemcpyAsync(slot_of(g, d), src[g], peer_bytes, cudaMemcpyDefault, s));
                         });
                     }));
        report_bytes("ce-pull", 0, all_bytes, run_all([&](int d) {  // d reads peer g's rows for it
                         fan_out(d, [&](int g, cudaStream_t s) {
                             CHECK(cudaMemcpyAsync(slot_of(g, d), src[g], peer_bytes, cudaMemcpyDefault, s));
                         });
                     }));
        report_bytes("ce-push-serial", 0, all_bytes, run_all([&](int g) {
                         for (int d = 0; d < num_gpus; ++d)
                             if (d != g)
                                 CHECK(cudaMemcpyAsync(slot_of(g, d), src[g], peer_bytes, cudaMemcpyDefault,
                                                       streams[g * kMaxGpus]));
                     }));
        for (int64_t chunk : {int64_t{256} << 10, int64_t{1} << 20, int64_t{4} << 20}) {
            report_bytes("ce-push-chunk", chunk, all_bytes, run_all([&](int g) {
                             fan_out(g, [&](int d, cudaStream_t s) {
                                 for (int64_t off = 0; off < peer_bytes; off += chunk)
                                     CHECK(cudaMemcpyAsync(slot_of(g, d) + off, src[g] + off,
                                                           std::min(chunk, peer_bytes - off), cudaMemcpyDefault, s));
                             });
                         }));
        }
        // Rounds: GPU g copies to g+1, then g+2, ... (mod n) on one stream, so while the GPUs keep
        // pace every round is a permutation (each GPU sends to one peer and receives from one).
        report_bytes("ce-rounds", 0, all_bytes, run_all([&](int g) {
                         for (int k = 1; k < num_gpus; ++k) {
                             const int d = (g + k) % num_gpus;
                             CHECK(cudaMemcpyAsync(slot_of(g, d), src[g], peer_bytes, cudaMemcpyDefault,
                                                   streams[g * kMaxGpus]));
                         }
                     }));
        report_bytes("ce-rounds-pull", 0, all_bytes, run_all([&](int d) {  // d reads from d-1, d-2, ...
                         for (int k = 1; k < num_gpus; ++k) {
                             const int g = (d + num_gpus - k) % num_gpus;
                             CHECK(cudaMemcpyAsync(slot_of(g, d), src[g], peer_bytes, cudaMemcpyDefault,
                                                   streams[d * kMaxGpus]));
                         }
                     }));
        for (int64_t chunk : {int64_t{1} << 20, int64_t{4} << 20, int64_t{16} << 20}) {
            report_bytes("ce-rounds-chunk", chunk, all_bytes, run_all([&](int g) {
                             for (int64_t off = 0; off < peer_bytes; off += chunk)
                                 for (int k = 1; k < num_gpus; ++k) {
                                     const int d = (g + k) % num_gpus;
                                     CHECK(cudaMemcpyAsync(slot_of(g, d) + off, src[g] + off,
                                                           std::min(chunk, peer_bytes - off), cudaMemcpyDefault,
                                                           streams[g * kMaxGpus]));
                                 }
                         }));
        }
        // The rounds while 24 SMs copy (n-1) x T rows inside the GPU on another stream (a dispatch's
        // packing or a combine's reduction beside the copy engines): does either slow the other?
        report_bytes("ce-rounds+local-copy", 0, all_bytes, run_all([&](int g) {
                         fan_out(g, [&](int d, cudaStream_t s) {
                             if (d != (g + 1) % num_gpus) return;
                             for (int k = 1; k < num_gpus; ++k)
                                 CHECK(cudaMemcpyAsync(slot_of(g, (g + k) % num_gpus), src[g], peer_bytes,
                                                       cudaMemcpyDefault, s));
                         });
                         local_copy<<<24, kThreads, 0, streams[g * kMaxGpus]>>>(src[g], out[g], (num_gpus - 1) * kTokens);
                     }));
        report_bytes("local-copy-alone", 0, all_bytes, run_all([&](int g) {
                         local_copy<<<24, kThreads, 0, streams[g * kMaxGpus]>>>(src[g], out[g], (num_gpus - 1) * kTokens);
                     }));
        // Half of each peer's rows by 24 SMs (tokens [0, T/2): push's rows), half by the copy engines.
        const int64_t half = peer_bytes / 2;
        report_bytes("sm+ce", 0, all_bytes, run_all([&](int g) {
                         fan_out(g, [&](int d, cudaStream_t s) {
                             CHECK(cudaMemcpyAsync(slot_of(g, d) + half, src[g] + half, peer_bytes - half,
                                                   cudaMemcpyDefault, s));
                         });
                         push<false><<<24, kThreads, 0, streams[g * kMaxGpus]>>>(src[g], peers, g, num_gpus, kRowBytes, 0, kTokens / 2);
                     }));
        report_bytes("sm-half-alone", 0, all_bytes / 2, run_all([&](int g) {
                         push<false><<<24, kThreads, 0, streams[g * kMaxGpus]>>>(src[g], peers, g, num_gpus, kRowBytes, 0, kTokens / 2);
                     }));
        return 0;
    }
    // cudaMemcpyPeerAsync to every peer at once, a stream per peer (ce-push by the peer API).
    report("memcpy-peer", 0, kRowBytes, run_all([&](int g) {
               fan_out(g, [&](int d, cudaStream_t s) {
                   CHECK(cudaMemcpyPeerAsync(slot_of(g, d), d, src[g], g, peer_bytes, s));
               });
           }));
    const int64_t tma_smem = TmaRing::smem_bytes(kTmaWarps, kRowBytes);
    for (int g = 0; g < num_gpus; ++g) {
        CHECK(cudaSetDevice(g));
        CHECK(cudaFuncSetAttribute(push_tma, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(tma_smem)));
    }
    const int strides[] = {kRowBytes + 96 + 16, kRowBytes + 128};  // 14448 (16-aligned, today's BF16 slot), 14464
    for (int sms : {8, 16, 24, 32, 64, 132}) {
        for (int stride : strides) {
            int64_t flag = 1;
            report("push", sms, stride, run_all([&](int g) {
                       push<false><<<sms, kThreads, 0, streams[g * kMaxGpus]>>>(src[g], peers, g, num_gpus, stride, 0);
                   }));
            report("push-flag", sms, stride, run_all([&](int g) {
                       push<true><<<sms, kThreads, 0, streams[g * kMaxGpus]>>>(src[g], peers, g, num_gpus, stride,
                                                                               ++flag);
                   }));
            report("push-dst", sms, stride, run_all([&](int g) {
                       one_peer_per_warp<false><<<sms, kThreads, 0, streams[g * kMaxGpus]>>>(src[g], peers, out[g], g,
                                                                                            num_gpus, stride);
                   }));
            report("push-tma", sms, stride, run_all([&](int g) {
                       push_tma<<<sms, kTmaWarps * kWarpSize, tma_smem, streams[g * kMaxGpus]>>>(src[g], peers, g,
                                                                                                 num_gpus, stride);
                   }));
            report("pull", sms, stride, run_all([&](int g) {
                       one_peer_per_warp<true><<<sms, kThreads, 0, streams[g * kMaxGpus]>>>(src[g], peers, out[g], g,
                                                                                           num_gpus, stride);
                   }));
        }
    }
    return 0;
}
