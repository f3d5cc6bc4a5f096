// The slow tier of the hierarchical normal mode: rows cross between scale-up domains over NVSHMEM
// (GPU-initiated puts and signals: RDMA between nodes; NVLink when the domains are virtual ones of
// one host, so the same code runs there).
//
// Each rank talks only to its mates: the rank with its local index in every domain (itself in its
// own). The symmetric buffer holds, after a header of signal words, a staging area and a receive
// area of the same shape: per field (token rows, scales, top-k ids, ...) one array of
// num_domains x region_rows rows. Region d of the staging area holds the rows for domain d's mate;
// they land in region `my_domain` of that mate's receive area. A call:
//   1. tells every mate this rank has entered the call (its receive area is free: the previous
//      call's rows were consumed by work queued before this kernel), and waits for each mate's
//      word before writing into it;
//   2. puts its regions (blocks of one destination split the rows) and, after completing them
//      (quiet), signals each block's part done, the row count travelling with the first block;
//   3. waits for every mate's parts, records the counts, and fills the rows past each count of the
//      fields named for it (so the next kernels, which read whole regions, skip them).
// Every wait is bounded (EPCOMM_TIMEOUT_S); a timeout or a mate whose call has another shape is
// reported in `info` and leaves the counts at zero, so nothing downstream reads unwritten rows.
#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "../../include/epcomm/common.cuh"

namespace epcomm {
namespace interdomain {

constexpr int kMaxDomains = 16;
constexpr int kMaxFields = 6;
constexpr int kMaxBlocksPerDomain = 16;
constexpr int kThreads = 512;
// Signal words at the start of the buffer: ready[D], count[D], done[D][kMaxBlocksPerDomain].
constexpr int64_t kHeaderBytes = 8 * kMaxDomains * (2 + kMaxBlocksPerDomain);
constexpr int kTagBits = 20;  // ready words carry (call << kTagBits) | shape tag

// info words (host-mapped) written on an error; the Python side reads them after a sync.
constexpr int kInfoError = 0;      // 1: timeout, 2: a mate's call has another shape
constexpr int kInfoRanks = 1;      // [num_ranks]: 1 for each rank that did not arrive or disagreed
constexpr int kInfoInts = 1 + 64;

struct Field {
    int64_t offset;     // of the field's array in the staging area (the receive area's is the same + recv)
    int64_t row_bytes;
    int fill;           // byte written into rows past the count on receipt; -1: left as they are
};

struct ExchangeArgs {
    uint8_t* base;      // this rank's symmetric buffer (the same address names every mate's copy)
    int64_t recv;       // offset of the receive area from the staging area's start (kHeaderBytes)
    int64_t region_rows;
    Field fields[kMaxFields];
    int num_fields;
    const int* send_counts;  // [D] rows of each staging region to send
    int* recv_counts;        // [D] rows received from each domain's mate (written)
    int num_domains, my_domain, ranks_per_domain, local;
    int64_t call;
    int shape_tag;
    int blocks_per_domain;
    int* info;
    uint64_t timeout_ns;
};

__device__ __forceinline__ int64_t* ready_word(uint8_t* base, int d) { return reinterpret_cast<int64_t*>(base) + d; }
__device__ __forceinline__ int64_t* count_word(uint8_t* base, int d) {
    return reinterpret_cast<int64_t*>(base) + kMaxDomains + d;
}
__device__ __forceinline__ int64_t* done_word(uint8_t* base, int d, int j) {
    return reinterpret_cast<int64_t*>(base) + 2 * kMaxDomains + d * kMaxBlocksPerDomain + j;
}

__device__ void report(int* info, int code, int rank) {
    info[kInfoRanks + rank] = 1;
    info[kInfoError] = code;  // racing reporters each write a valid code
    __threadfence_system();
}

// Spin until `word` (written by a mate's signal) reaches `want`; false on timeout.
__device__ bool wait_at_least(const int64_t* word, int64_t want, uint64_t timeout_ns, int64_t* seen) {
    const uint64_t start = global_timer_ns();
    while (true) {
        const int64_t v = ld_volatile(word);
        if (v >= want) {
            *seen = v;
            return true;
        }
        if (global_timer_ns() - start > timeout_ns) return false;
    }
}

__global__ void __launch_bounds__(kThreads, 1) exchange_kernel(ExchangeArgs a) {
    const int d = blockIdx.x / a.blocks_per_domain, j = blockIdx.x % a.blocks_per_domain;
    const int mate = d * a.ranks_per_domain + a.local;
    const int tid = threadIdx.x;
    __shared__ bool s_ok;
    __shared__ int s_count;
    uint8_t* stage = a.base + kHeaderBytes;

    // 1. Enter the call: tell mate d, then wait for its word (its receive area is free) and check
    //    that it runs a call of the same shape.
    if (tid == 0) {
        const int64_t entered = (a.call << kTagBits) | a.shape_tag;
        if (j == 0) nvshmemx_signal_op(reinterpret_cast<uint64_t*>(ready_word(a.base, a.my_domain)),
                                       static_cast<uint64_t>(entered), NVSHMEM_SIGNAL_SET, mate);
        int64_t seen = 0;
        s_ok = wait_at_least(ready_word(a.base, d), a.call << kTagBits, a.timeout_ns, &seen);
        if (!s_ok) {
            report(a.info, 1, mate);
        } else if ((seen >> kTagBits) == a.call && (seen & ((1 << kTagBits) - 1)) != a.shape_tag) {
            s_ok = false;
            report(a.info, 2, mate);
        }
    }
    __syncthreads();

    // 2. Put this block's share of region d's rows into the mate's region my_domain.
    if (s_ok) {
        const int64_t count = a.send_counts[d];
        const int64_t per_block = (count + a.blocks_per_domain - 1) / a.blocks_per_domain;
        const int64_t lo = min(count, j * per_block), hi = min(count, lo + per_block);
        if (hi > lo) {
            for (int f = 0; f < a.num_fields; ++f) {
                const Field& fd = a.fields[f];
                const int64_t src = fd.offset + (d * a.region_rows + lo) * fd.row_bytes;
                const int64_t dst = a.recv + fd.offset + (a.my_domain * a.region_rows + lo) * fd.row_bytes;
                nvshmemx_putmem_nbi_block(stage + dst, stage + src, static_cast<size_t>((hi - lo) * fd.row_bytes),
                                          mate);
            }
        }
        __syncthreads();
        if (tid == 0) {
            if (j == 0) nvshmemx_signal_op(reinterpret_cast<uint64_t*>(count_word(a.base, a.my_domain)),
                                           static_cast<uint64_t>((a.call << 32) | count), NVSHMEM_SIGNAL_SET, mate);
            nvshmem_quiet();  // the rows (and the count) are delivered before the done word
            __threadfence_system();
            nvshmemx_signal_op(reinterpret_cast<uint64_t*>(done_word(a.base, a.my_domain, j)),
                               static_cast<uint64_t>(a.call), NVSHMEM_SIGNAL_SET, mate);
        }
    }

    // 3. Wait for mate d's part j (and its first part, which carries the count).
    if (tid == 0) {
        int64_t seen = 0;
        bool ok = s_ok && wait_at_least(done_word(a.base, d, j), a.call, a.timeout_ns, &seen) &&
                  wait_at_least(done_word(a.base, d, 0), a.call, a.timeout_ns, &seen);
        if (s_ok && !ok) report(a.info, 1, mate);
        int count = 0;
        if (ok) {
            const int64_t c = ld_volatile(count_word(a.base, d));
            count = (c >> 32) == (a.call & 0xffffffff) ? static_cast<int>(c & 0xffffffff) : 0;
            fence_sys();  // the rows are read after the signals
        }
        s_count = ok ? min(static_cast<int64_t>(count), a.region_rows) : 0;
        if (j == 0) a.recv_counts[d] = s_count;
    }
    __syncthreads();

    // Rows past the count (all of them after an error) get the field's fill byte, this block's share.
    const int64_t empty = a.region_rows - s_count;
    const int64_t per_block = (empty + a.blocks_per_domain - 1) / a.blocks_per_domain;
    const int64_t lo = s_count + min(empty, j * per_block), hi = min(a.region_rows, lo + per_block);
    for (int f = 0; f < a.num_fields; ++f) {
        const Field& fd = a.fields[f];
        if (fd.fill < 0 || hi <= lo) continue;
        uint8_t* rows = stage + a.recv + fd.offset + (d * a.region_rows + lo) * fd.row_bytes;
        const int64_t bytes = (hi - lo) * fd.row_bytes;
        for (int64_t i = tid; i < bytes; i += kThreads) rows[i] = static_cast<uint8_t>(fd.fill);
    }
}

// Staging (before the exchange): token t goes to staging region d, row pos[t][d], for every domain d
// it has a destination in (flags[t][d]); pos is the exclusive prefix count of flags over tokens, so
// each region holds its tokens in ascending order. Its top-k ids become ids of d's experts
// (-1 where the expert is elsewhere) and its is_token_in_rank row shrinks to d's ranks. One warp
// per token: x is read once for all its domains. Null pointers: fields not staged (a cached dispatch
// moves x and scales only).
struct StageArgs {
    const uint8_t* x;
    int64_t x_bytes;
    const uint8_t* scales;  // 4-byte elements at t * scale_stride0 + c * scale_stride1 (elements)
    int num_scales;
    int64_t scale_stride0, scale_stride1;
    const int64_t* topk_idx;
    const float* weights;
    int num_topk;
    const bool* in_rank;    // [T, num_domains * ranks_per_domain]
    const bool* flags;      // [T, D]
    const int* pos;         // [T, D]
    int num_tokens, num_domains, ranks_per_domain, experts_per_domain;
    uint8_t* stage;
    int64_t region_rows;
    int64_t off_x, off_scales, off_topk, off_weights, off_in_rank;
};

__global__ void __launch_bounds__(256) stage_kernel(StageArgs a) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarpSize;
    const int num_warps = gridDim.x * blockDim.x / kWarpSize;
    const int D = a.num_domains, L = a.ranks_per_domain, K = a.num_topk;
    for (int t = warp; t < a.num_tokens; t += num_warps) {
        const int4* x = reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * a.x_bytes);
        for (int d = 0; d < D; ++d) {
            if (!a.flags[static_cast<int64_t>(t) * D + d]) continue;
            const int64_t row = d * a.region_rows + a.pos[static_cast<int64_t>(t) * D + d];
            warp_copy_int4(reinterpret_cast<int4*>(a.stage + a.off_x + row * a.x_bytes), x,
                           static_cast<int>(a.x_bytes / 16), lane);
            if (a.scales != nullptr) {
                auto* dst = reinterpret_cast<int*>(a.stage + a.off_scales + row * a.num_scales * 4);
                const auto* src = reinterpret_cast<const int*>(a.scales);
                for (int c = lane; c < a.num_scales; c += kWarpSize)
                    dst[c] = src[t * a.scale_stride0 + c * a.scale_stride1];
            }
            if (a.topk_idx != nullptr && lane < K) {
                const int64_t e = a.topk_idx[static_cast<int64_t>(t) * K + lane];
                const int64_t first = static_cast<int64_t>(d) * a.experts_per_domain;
                const bool here = e >= first && e < first + a.experts_per_domain;
                reinterpret_cast<int64_t*>(a.stage + a.off_topk + row * K * 8)[lane] = here ? e - first : -1;
                if (a.weights != nullptr)
                    reinterpret_cast<float*>(a.stage + a.off_weights + row * K * 4)[lane] =
                        a.weights[static_cast<int64_t>(t) * K + lane];
            }
            if (a.in_rank != nullptr && lane < L)
                reinterpret_cast<bool*>(a.stage + a.off_in_rank + row * L)[lane] =
                    a.in_rank[static_cast<int64_t>(t) * D * L + d * L + lane];
        }
    }
}

// The source's sum after the combine's exchange: token t adds, in fp32 and ascending domain
// order, the partial sum each of its domains returned (region d, row pos[t][d] of the receive
// area), then the biases, and rounds to bf16 once: the reference backend's order.
struct ReduceArgs {
    const float* partial;   // the receive area's partial-sum field: [D * region_rows, hidden]
    const float* partial_weights;  // [D * region_rows, K] or null
    int64_t region_rows;
    const bool* flags;
    const int* pos;
    const __nv_bfloat16* bias0;
    const __nv_bfloat16* bias1;
    __nv_bfloat16* out;
    float* out_weights;
    int num_tokens, hidden, num_topk, num_domains;
};

__global__ void __launch_bounds__(256) reduce_kernel(ReduceArgs a) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarpSize;
    const int num_warps = gridDim.x * blockDim.x / kWarpSize;
    const int D = a.num_domains, K = a.num_topk;
    for (int t = warp; t < a.num_tokens; t += num_warps) {
        const bool* flags = a.flags + static_cast<int64_t>(t) * D;
        const int* pos = a.pos + static_cast<int64_t>(t) * D;
        for (int c = lane; c < a.hidden / 8; c += kWarpSize) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int d = 0; d < D; ++d) {
                if (!flags[d]) continue;
                const float4* p = reinterpret_cast<const float4*>(
                    a.partial + (d * a.region_rows + pos[d]) * static_cast<int64_t>(a.hidden)) + 2 * c;
                const float4 lo = p[0], hi = p[1];
                acc[0] += lo.x; acc[1] += lo.y; acc[2] += lo.z; acc[3] += lo.w;
                acc[4] += hi.x; acc[5] += hi.y; acc[6] += hi.z; acc[7] += hi.w;
            }
            for (const __nv_bfloat16* bias : {a.bias0, a.bias1}) {
                if (bias == nullptr) continue;
                const int4 v = *reinterpret_cast<const int4*>(bias + static_cast<int64_t>(t) * a.hidden + 8 * c);
                const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
                for (int k = 0; k < 4; ++k) {
                    const float2 f = __bfloat1622float2(h[k]);
                    acc[2 * k] += f.x;
                    acc[2 * k + 1] += f.y;
                }
            }
            int4 o;
            auto* oh = reinterpret_cast<__nv_bfloat162*>(&o);
            for (int k = 0; k < 4; ++k) oh[k] = __floats2bfloat162_rn(acc[2 * k], acc[2 * k + 1]);
            reinterpret_cast<int4*>(a.out + static_cast<int64_t>(t) * a.hidden)[c] = o;
        }
        if (a.out_weights != nullptr && lane < K) {
            float acc = 0.f;
            for (int d = 0; d < D; ++d)
                if (flags[d]) acc += a.partial_weights[(d * a.region_rows + pos[d]) * K + lane];
            a.out_weights[static_cast<int64_t>(t) * K + lane] = acc;
        }
    }
}

}  // namespace interdomain
}  // namespace epcomm

using namespace epcomm::interdomain;

extern "C" {

int epcomm_interdomain_constant(const char* name) {
    const struct {
        const char* name;
        int value;
    } entries[] = {{"header_bytes", static_cast<int>(kHeaderBytes)}, {"max_domains", kMaxDomains},
                   {"max_fields", kMaxFields}, {"max_blocks_per_domain", kMaxBlocksPerDomain},
                   {"info_ints", kInfoInts}, {"tag_bits", kTagBits}};
    for (const auto& e : entries)
        if (std::strcmp(e.name, name) == 0) return e.value;
    return -1;
}

// fields: num_fields x (offset, row_bytes, fill) as int64.
int epcomm_interdomain_exchange(void* base, int64_t recv, int64_t region_rows, const int64_t* fields, int num_fields,
                                const int* send_counts, int* recv_counts, int num_domains, int my_domain,
                                int ranks_per_domain, int local, int64_t call, int shape_tag, int blocks_per_domain,
                                int* info, uint64_t timeout_ns, cudaStream_t stream) {
    if (num_domains < 1 || num_domains > kMaxDomains || num_fields < 1 || num_fields > kMaxFields ||
        blocks_per_domain < 1 || blocks_per_domain > kMaxBlocksPerDomain)
        return static_cast<int>(cudaErrorInvalidValue);
    ExchangeArgs a{};
    a.base = static_cast<uint8_t*>(base);
    a.recv = recv;
    a.region_rows = region_rows;
    for (int f = 0; f < num_fields; ++f)
        a.fields[f] = Field{fields[3 * f], fields[3 * f + 1], static_cast<int>(fields[3 * f + 2])};
    a.num_fields = num_fields;
    a.send_counts = send_counts;
    a.recv_counts = recv_counts;
    a.num_domains = num_domains;
    a.my_domain = my_domain;
    a.ranks_per_domain = ranks_per_domain;
    a.local = local;
    a.call = call;
    a.shape_tag = shape_tag & ((1 << kTagBits) - 1);
    a.blocks_per_domain = blocks_per_domain;
    a.info = info;
    a.timeout_ns = timeout_ns;
    exchange_kernel<<<num_domains * blocks_per_domain, kThreads, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

static int grid_for(int num_tokens) { return num_tokens > 0 ? (num_tokens + 7) / 8 < 1024 ? (num_tokens + 7) / 8 : 1024 : 1; }

int epcomm_interdomain_stage(const void* x, int64_t x_bytes, const void* scales, int num_scales, int64_t scale_stride0,
                             int64_t scale_stride1, const int64_t* topk_idx, const float* weights, int num_topk,
                             const bool* in_rank, const bool* flags, const int* pos, int num_tokens, int num_domains,
                             int ranks_per_domain, int experts_per_domain, void* stage, int64_t region_rows,
                             const int64_t* offsets, cudaStream_t stream) {
    if (num_tokens == 0) return 0;
    if (x_bytes % 16 != 0) return static_cast<int>(cudaErrorInvalidValue);
    StageArgs a{};
    a.x = static_cast<const uint8_t*>(x);
    a.x_bytes = x_bytes;
    a.scales = static_cast<const uint8_t*>(scales);
    a.num_scales = num_scales;
    a.scale_stride0 = scale_stride0;
    a.scale_stride1 = scale_stride1;
    a.topk_idx = topk_idx;
    a.weights = weights;
    a.num_topk = num_topk;
    a.in_rank = in_rank;
    a.flags = flags;
    a.pos = pos;
    a.num_tokens = num_tokens;
    a.num_domains = num_domains;
    a.ranks_per_domain = ranks_per_domain;
    a.experts_per_domain = experts_per_domain;
    a.stage = static_cast<uint8_t*>(stage);
    a.region_rows = region_rows;
    a.off_x = offsets[0];
    a.off_scales = offsets[1];
    a.off_topk = offsets[2];
    a.off_weights = offsets[3];
    a.off_in_rank = offsets[4];
    stage_kernel<<<grid_for(num_tokens), 256, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

int epcomm_interdomain_reduce(const float* partial, const float* partial_weights, int64_t region_rows,
                              const bool* flags, const int* pos, const void* bias0, const void* bias1, void* out,
                              float* out_weights, int num_tokens, int hidden, int num_topk, int num_domains,
                              cudaStream_t stream) {
    if (num_tokens == 0) return 0;
    if (hidden % 8 != 0) return static_cast<int>(cudaErrorInvalidValue);
    ReduceArgs a{};
    a.partial = partial;
    a.partial_weights = partial_weights;
    a.region_rows = region_rows;
    a.flags = flags;
    a.pos = pos;
    a.bias0 = static_cast<const __nv_bfloat16*>(bias0);
    a.bias1 = static_cast<const __nv_bfloat16*>(bias1);
    a.out = static_cast<__nv_bfloat16*>(out);
    a.out_weights = out_weights;
    a.num_tokens = num_tokens;
    a.hidden = hidden;
    a.num_topk = num_topk;
    a.num_domains = num_domains;
    reduce_kernel<<<grid_for(num_tokens), 256, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
