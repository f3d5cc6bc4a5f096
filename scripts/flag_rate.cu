// What publishing a row costs a sender: the normal-mode senders (intranode.cu) store a token's row
// into every destination's buffer, then release a flag per row so the receiver may copy it out.
// A release is a fence at system scope: the warp waits until its stores are acknowledged (across
// NVLink, microseconds) before it may load the next row. scripts/nvlink_rate.cu measured the cost
// on 4 x H100 (push against push-flag: 311 -> 259 GB/s at 8 SMs, 327 -> 303 at 24). Here, the same
// pushes published six ways:
//   none        no flags (the ceiling)
//   row         a release per row by the warp that stored it (dispatch_send today)
//   batch2      one fence per two rows of a warp, then both flags (combine_send today: fence.acq_rel)
//   batch2-rel  the same with fence.release (no L1 invalidation: the acquire half is not needed)
//   flag-warp   the block's last warp publishes for the others: a data warp posts its row's flag
//               addresses to shared memory (a release at block scope) and goes on; the flag warp
//               takes what was posted, fences once at system scope, writes the flags (the fence's
//               cumulativity covers the stores it observed through the posts, as a block barrier's
//               would). "lag" is the time from a row's post to the end of that fence, mean and max
//               over the rows (a fence that waited for the stores the data warps issue after it,
//               not just those before, would show as a long lag). The post's st.release.cta is
//               MEMBAR.ALL.CTA + STS in the SASS.
//   flag-warp-mbar  the same with each ring entry's post an mbarrier arrive (release; SYNCS.ARRIVE in
//               the SASS, no membar) and its reuse an mbarrier the flag warp arrives on.
// The kernels had both flag warps for a day (commit cda2c4d, EPCOMM_SEND_FLAG_WARP: data warps that
// never wait for NVLink). On one GPU both lost, so they were taken out: here, 8-24 SMs, 15 data warps
// moved rows 17-27% (posts by st.release.cta, one H200 and one H100) and 11-20% (mbarriers, one
// H100) slower than 16 warps without flags, where a release per row cost 4-6%; the cached dispatch
// at one rank took 97 us against 88 (one H100; bench/results/2026-12-06_*). Over NVLink a release
// waits longer (microseconds): whether a flag warp wins there is this program's question on a
// machine of several GPUs.
// With 2 or more GPUs every GPU pushes its 4096 rows to every peer (as nvlink_rate's push); with one,
// to 3 buffers of its own (a stand-in: local acknowledgements are faster than NVLink's, so it shows
// whether the flag warp keeps up and what the warps' stalls cost, not the NVLink figures). One GPU
// also probes what a fence waits for: the latency of warp 0's fence while the block's other warps
// stream stores, against idle (an SM-wide drain would grow with the others' traffic).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/flag_rate scripts/flag_rate.cu && /tmp/flag_rate
// One JSON object a line.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "../epcomm/include/epcomm/common.cuh"
#include "microbench.cuh"

using namespace epcomm;

constexpr int kRowBytes = 14336;                 // 7168 BF16 channels
constexpr int kStride = kRowBytes + 128;         // a 128-byte aligned slot, the flag in its last 16 bytes
constexpr int kTokens = 4096;
constexpr int kMaxGpus = 8;
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kUnroll = 8;
constexpr int kLocalDsts = 3;                    // the one-GPU stand-in's destinations
constexpr int kPostRing = 8;                     // rows a data warp may have posted but not published
enum Method { kNone = 0, kRow = 1, kBatch2 = 2, kBatch2Release = 3, kFlagWarp = 4, kFlagWarpMbar = 5 };
const char* const kMethodNames[] = {"none", "row", "batch2", "batch2-rel", "flag-warp", "flag-warp-mbar"};

// Destination d's slot for token t of source `me` (every destination keeps [source][token] rows).
struct Dsts {
    uint8_t* base[kMaxGpus];
    int num;
    // base[d] by an unrolled select: a dynamic index would put the table in local memory.
    __host__ __device__ uint8_t* pick(int d) const {
        uint8_t* p = base[0];
#pragma unroll
        for (int k = 1; k < kMaxGpus; ++k)
            if (k == d) p = base[k];
        return p;
    }
    __host__ __device__ int64_t* flag(int d, int me, int t) const {
        return reinterpret_cast<int64_t*>(pick(d) + (static_cast<int64_t>(me) * kTokens + t) * kStride + kStride - 16);
    }
};

__device__ __forceinline__ void copy_row(const Dsts& dsts, int me, int t, const int4* src, int lane) {
    constexpr int n = kRowBytes / 16;
    for (int i = lane; i < n; i += kUnroll * kWarpSize) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i + u * kWarpSize < n) v[u] = ld_nc_int4(src + i + u * kWarpSize);
#pragma unroll
        for (int d = 0; d < kMaxGpus; ++d) {  // unrolled: the destinations stay in registers
            if (d >= dsts.num) break;
            int4* dst = reinterpret_cast<int4*>(dsts.base[d] + (static_cast<int64_t>(me) * kTokens + t) * kStride);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (i + u * kWarpSize < n) dst[i + u * kWarpSize] = v[u];
        }
    }
}

__device__ __forceinline__ void st_release_cta(int* p, int v) {
    asm volatile("st.release.cta.shared.s32 [%0], %1;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(p))), "r"(v)
                 : "memory");
}
__device__ __forceinline__ int ld_acquire_cta(const int* p) {
    int v;
    asm volatile("ld.acquire.cta.shared.s32 %0, [%1];"
                 : "=r"(v)
                 : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p)))
                 : "memory");
    return v;
}

// The flag warp's shared state: per data warp, a ring of posted rows (token, post time), how many
// it posted (-1 - count once it is done) and how many were published; for flag-warp-mbar, each
// entry's mbarriers (full: the data warp posted it; empty: the flag warp published it) and each
// warp's row count once it is done (-1 before).
struct PostBoard {
    int token[kWarps][kPostRing];
    uint64_t posted_at[kWarps][kPostRing];
    int posted[kWarps];
    int published[kWarps];
    uint64_t full[kWarps][kPostRing], empty[kWarps][kPostRing];
    int total[kWarps];
};

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))),
                 "r"(count)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive_release(uint64_t* bar) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.release.cta.shared::cta.b64 st, [%0]; }" ::"r"(
                     static_cast<unsigned>(__cvta_generic_to_shared(bar)))
                 : "memory");
}
// Whether the phase of `parity` has completed (acquire: what the arrivals released is visible).
__device__ __forceinline__ bool mbar_test_acquire(uint64_t* bar, int parity) {
    unsigned done;
    asm volatile("{ .reg .pred p; mbarrier.test_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))), "r"(parity)
                 : "memory");
    return done != 0;
}

// A flag warp's publish lags (now - the row's post time), summed into lags[block]: [sum of ns, max
// ns, rows].
struct LagStats {
    unsigned long long sum = 0, max = 0, rows = 0;
    __device__ void add(uint64_t now, uint64_t posted_at) {
        const unsigned long long lag = now - posted_at;
        sum += lag;
        max = lag > max ? lag : max;
        ++rows;
    }
    __device__ void flush(unsigned long long* lags) const {
        atomicAdd(&lags[blockIdx.x * 3], sum);
        atomicMax(&lags[blockIdx.x * 3 + 1], max);
        atomicAdd(&lags[blockIdx.x * 3 + 2], rows);
    }
};

// The fence before a batch's flags: acq_rel as combine_send's, or a release alone.
template <int kMethod>
__device__ __forceinline__ void batch_fence() {
    if (kMethod == kBatch2)
        fence_sys();
    else
        fence_release_sys();
}

// lags: per block, [sum of ns, max ns, rows] (flag warps only).
template <int kMethod>
__global__ void __launch_bounds__(kThreads, 1) push(const uint8_t* src, Dsts dsts, int me, int64_t flag,
                                                    unsigned long long* lags) {
    __shared__ PostBoard board;
    const int lane = threadIdx.x % kWarpSize, w = threadIdx.x / kWarpSize;
    constexpr bool kMbar = kMethod == kFlagWarpMbar;
    const int data_warps = kMethod == kFlagWarp || kMbar ? kWarps - 1 : kWarps;
    if (kMethod == kFlagWarp) {
        if (threadIdx.x < kWarps) board.posted[threadIdx.x] = board.published[threadIdx.x] = 0;
        __syncthreads();
    }
    if (kMbar) {
        if (threadIdx.x < kWarps * kPostRing) {
            mbar_init(&board.full[0][0] + threadIdx.x, 1);
            mbar_init(&board.empty[0][0] + threadIdx.x, 1);
        }
        if (threadIdx.x < kWarps) board.total[threadIdx.x] = -1;
        __syncthreads();
    }
    if (kMbar && w == data_warps) {
        // The flag warp: lane v takes data warp v's entries in order as their full barriers complete.
        int seen = 0;
        bool done = lane >= data_warps;
        LagStats stats;
        while (__any_sync(kFullMask, !done)) {
            int took = 0;
            if (!done)
                while (took < kPostRing && mbar_test_acquire(&board.full[lane][(seen + took) % kPostRing],
                                                             ((seen + took) / kPostRing) & 1))
                    ++took;
            if (__any_sync(kFullMask, took > 0)) {
                fence_release_sys();  // releases every row the warp took
                const uint64_t now = global_timer_ns();
                for (int k = seen; k < seen + took; ++k) {
                    const int e = k % kPostRing;
                    const int t = board.token[lane][e];
                    for (int d = 0; d < dsts.num; ++d) st_relaxed_sys(dsts.flag(d, me, t), flag);
                    stats.add(now, board.posted_at[lane][e]);
                    mbar_arrive_release(&board.empty[lane][e]);  // the entry may be rewritten
                }
                seen += took;
            } else {
                __nanosleep(64);
            }
            if (!done) {
                const int total = ld_acquire_cta(&board.total[lane]);
                done = total >= 0 && seen == total;
            }
        }
        stats.flush(lags);
        return;
    }
    if (kMethod == kFlagWarp && w == data_warps) {
        // The flag warp: lane v watches data warp v.
        int seen = 0;  // published rows of warp `lane`
        bool done = lane >= data_warps;
        LagStats stats;
        while (__any_sync(kFullMask, !done)) {
            int posted = done ? seen : ld_acquire_cta(&board.posted[lane]);
            const bool finished = posted < 0;
            if (finished) posted = -1 - posted;
            if (__any_sync(kFullMask, posted > seen)) {
                fence_release_sys();  // releases every row the warp observed posted
                const uint64_t now = global_timer_ns();
                for (int k = seen; k < posted; ++k) {
                    const int t = board.token[lane][k % kPostRing];
                    for (int d = 0; d < dsts.num; ++d) st_relaxed_sys(dsts.flag(d, me, t), flag);
                    stats.add(now, board.posted_at[lane][k % kPostRing]);
                }
                if (posted > seen) st_release_cta(&board.published[lane], posted);
                seen = posted;
            } else {
                __nanosleep(64);  // as the kernels' flag warp
            }
            done = done || (finished && seen == posted);
        }
        stats.flush(lags);
        return;
    }
    const int warp = blockIdx.x * data_warps + w, num_warps = gridDim.x * data_warps;
    int count = 0, pending = -1;
    for (int t = warp; t < kTokens; t += num_warps) {
        copy_row(dsts, me, t, reinterpret_cast<const int4*>(src + static_cast<int64_t>(t) * kRowBytes), lane);
        __syncwarp();
        if (kMethod == kFlagWarp && lane == 0)  // a free entry in this warp's ring (after the stores, as the kernels)
            while (count - ld_acquire_cta(&board.published[w]) >= kPostRing) {
            }
        if (kMethod == kRow) {
            if (lane < dsts.num) st_release_sys(dsts.flag(lane, me, t), flag);
        } else if (kMethod == kBatch2 || kMethod == kBatch2Release) {
            if (pending >= 0) {
                batch_fence<kMethod>();
                if (lane < dsts.num) {
                    st_relaxed_sys(dsts.flag(lane, me, pending), flag);
                    st_relaxed_sys(dsts.flag(lane, me, t), flag);
                }
                pending = -1;
            } else {
                pending = t;
            }
        } else if (kMethod == kFlagWarp && lane == 0) {
            board.token[w][count % kPostRing] = t;
            board.posted_at[w][count % kPostRing] = global_timer_ns();
            st_release_cta(&board.posted[w], count + 1);
        } else if (kMbar && lane == 0) {
            const int e = count % kPostRing, use = count / kPostRing;
            if (use > 0)  // the entry's previous row published
                while (!mbar_test_acquire(&board.empty[w][e], (use - 1) & 1)) {
                }
            board.token[w][e] = t;
            board.posted_at[w][e] = global_timer_ns();
            mbar_arrive_release(&board.full[w][e]);  // after __syncwarp: releases the warp's row too
        }
        ++count;
    }
    if (kMbar && lane == 0) st_release_cta(&board.total[w], count);
    if ((kMethod == kBatch2 || kMethod == kBatch2Release) && pending >= 0) {
        batch_fence<kMethod>();
        if (lane < dsts.num) st_relaxed_sys(dsts.flag(lane, me, pending), flag);
    }
    if (kMethod == kFlagWarp && lane == 0) st_release_cta(&board.posted[w], -1 - count);
}

// Warp 0's fence latency (lane 0, `probes` fences 2 us apart) while warps 1.. stream rows to the
// stand-in destinations (`stream`) or do nothing.
__global__ void __launch_bounds__(kThreads, 1) fence_probe(const uint8_t* src, Dsts dsts, bool stream, int probes,
                                                           unsigned long long* ns) {
    const int lane = threadIdx.x % kWarpSize, w = threadIdx.x / kWarpSize;
    __shared__ int stop;
    if (threadIdx.x == 0) stop = 0;
    __syncthreads();
    if (w == 0) {
        for (int i = 0; i < probes; ++i) {
            if (lane == 0) {
                const uint64_t t0 = global_timer_ns();
                fence_sys();
                ns[blockIdx.x * probes + i] = global_timer_ns() - t0;
            }
            __nanosleep(2000);
        }
        if (lane == 0) atomicExch(&stop, 1);
        return;
    }
    if (!stream) return;
    for (int t = blockIdx.x * (kWarps - 1) + w - 1;; t = (t + gridDim.x * (kWarps - 1)) % kTokens) {
        if (*reinterpret_cast<volatile int*>(&stop)) break;
        copy_row(dsts, 0, t, reinterpret_cast<const int4*>(src + static_cast<int64_t>(t) * kRowBytes), lane);
    }
}

int main() {
    int num_gpus = 0;
    CHECK(cudaGetDeviceCount(&num_gpus));
    num_gpus = std::min(num_gpus, kMaxGpus);
    const bool stand_in = num_gpus == 1;
    const int64_t slots = static_cast<int64_t>(stand_in ? 1 : num_gpus) * kTokens;
    std::vector<uint8_t*> src(num_gpus), buf(num_gpus * kLocalDsts);
    std::vector<unsigned long long*> lags(num_gpus);
    std::vector<cudaStream_t> streams(num_gpus);
    for (int g = 0; g < num_gpus; ++g) {
        CHECK(cudaSetDevice(g));
        for (int p = 0; p < num_gpus; ++p)
            if (p != g) CHECK(cudaDeviceEnablePeerAccess(p, 0));
        CHECK(cudaMalloc(&src[g], static_cast<int64_t>(kTokens) * kRowBytes));
        CHECK(cudaMemset(src[g], 0x3c + g, static_cast<int64_t>(kTokens) * kRowBytes));  // not zeros
        for (int k = 0; k < (stand_in ? kLocalDsts : 1); ++k) {
            CHECK(cudaMalloc(&buf[g * kLocalDsts + k], slots * kStride));
            CHECK(cudaMemset(buf[g * kLocalDsts + k], 0x5a, slots * kStride));
        }
        CHECK(cudaMalloc(&lags[g], 132 * 3 * sizeof(unsigned long long)));
        CHECK(cudaStreamCreateWithFlags(&streams[g], cudaStreamNonBlocking));
    }
    auto dsts_of = [&](int g) {
        Dsts d{};
        if (stand_in) {
            for (int k = 0; k < kLocalDsts; ++k) d.base[d.num++] = buf[k];
        } else {
            for (int p = 0; p < num_gpus; ++p)
                if (p != g) d.base[d.num++] = buf[p * kLocalDsts];
        }
        return d;
    };
    const int num_dsts = dsts_of(0).num;
    const int64_t bytes = static_cast<int64_t>(kTokens) * num_dsts * kRowBytes;  // per GPU

    // Launch on every GPU, then wait for all: the slowest GPU's median time of 10 runs. Every GPU's flags
    // of one run hold that run's value.
    int64_t flag = 1;
    auto run_all = [&](auto launch_on) -> double {
        return slowest_gpu_us(
            num_gpus, [&](int g) { return streams[g]; },
            [&](int g) {
                if (g == 0) ++flag;
                CHECK(cudaMemset(lags[g], 0, 132 * 3 * sizeof(unsigned long long)));
            },
            launch_on);
    };
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("{\"device\": \"%s\", \"gpus\": %d, \"destinations\": %d, \"stand_in\": %s}\n", prop.name, num_gpus,
                num_dsts, stand_in ? "true" : "false");

    for (int sms : {8, 10, 12, 16, 24}) {
        for (int method : {kNone, kRow, kBatch2, kBatch2Release, kFlagWarp, kFlagWarpMbar}) {
            const double us = run_all([&](int g) {
                const Dsts d = dsts_of(g);
                switch (method) {
                    case kNone: push<kNone><<<sms, kThreads, 0, streams[g]>>>(src[g], d, g, flag, lags[g]); break;
                    case kRow: push<kRow><<<sms, kThreads, 0, streams[g]>>>(src[g], d, g, flag, lags[g]); break;
                    case kBatch2: push<kBatch2><<<sms, kThreads, 0, streams[g]>>>(src[g], d, g, flag, lags[g]); break;
                    case kBatch2Release:
                        push<kBatch2Release><<<sms, kThreads, 0, streams[g]>>>(src[g], d, g, flag, lags[g]);
                        break;
                    case kFlagWarp: push<kFlagWarp><<<sms, kThreads, 0, streams[g]>>>(src[g], d, g, flag, lags[g]); break;
                    default: push<kFlagWarpMbar><<<sms, kThreads, 0, streams[g]>>>(src[g], d, g, flag, lags[g]);
                }
            });
            // The last run's lags, and whether every flag of GPU 0's rows holds that run's value (that the
            // flags were written at all: nothing reads the rows here, so no ordering is checked).
            unsigned long long host[132 * 3];
            CHECK(cudaSetDevice(0));
            CHECK(cudaMemcpy(host, lags[0], sizeof(host), cudaMemcpyDeviceToHost));
            unsigned long long sum = 0, mx = 0, rows = 0;
            for (int k = 0; k < sms; ++k) sum += host[k * 3], mx = std::max(mx, host[k * 3 + 1]), rows += host[k * 3 + 2];
            int missing = 0;
            if (method != kNone) {
                const Dsts d = dsts_of(0);
                for (int k = 0; k < d.num; ++k)
                    for (int t = 0; t < kTokens; ++t) {
                        int64_t v;
                        CHECK(cudaMemcpy(&v, d.flag(k, 0, t), 8, cudaMemcpyDefault));
                        missing += v != flag;
                    }
            }
            std::printf("{\"method\": \"%s\", \"sms\": %d, \"us\": %.1f, \"gbps\": %.1f, \"gbps_per_sm\": %.2f, "
                        "\"flags_missing\": %d, \"lag_mean_ns\": %.0f, \"lag_max_ns\": %llu}\n",
                        kMethodNames[method], sms, us, bytes / us / 1e3, bytes / us / 1e3 / sms, missing,
                        rows ? static_cast<double>(sum) / rows : 0.0, mx);
            std::fflush(stdout);
        }
    }
    if (stand_in) {
        constexpr int kProbes = 200, kSms = 24;
        unsigned long long* ns;
        CHECK(cudaMalloc(&ns, kSms * kProbes * sizeof(unsigned long long)));
        for (bool stream : {false, true}) {
            fence_probe<<<kSms, kThreads>>>(src[0], dsts_of(0), stream, kProbes, ns);
            CHECK(cudaDeviceSynchronize());
            std::vector<unsigned long long> h(kSms * kProbes);
            CHECK(cudaMemcpy(h.data(), ns, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
            std::sort(h.begin(), h.end());
            std::printf("{\"probe\": \"fence.acq_rel.sys latency\", \"others_streaming\": %s, \"sms\": %d, "
                        "\"median_ns\": %llu, \"p90_ns\": %llu, \"max_ns\": %llu}\n",
                        stream ? "true" : "false", kSms, h[h.size() / 2], h[h.size() * 9 / 10], h.back());
        }
    }
    return 0;
}
