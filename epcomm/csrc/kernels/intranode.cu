// Normal-mode kernels inside one NVLink domain. Every rank's communication buffer is mapped into
// every other rank's address space (CUDA IPC), so a sender writes token rows straight into the
// receiver's buffer. Layout of each rank's buffer:
//   [signals int64[kMaxRanks] | counts int32[kMaxRanks] | expert counts int32[kMaxRanks][kMaxExpertsPerRank]
//    | error words | rows: kMaxRanks blocks of `capacity` rows of `row_bytes`]
// Block s of the rows region holds what source rank s sent (dispatch) or returned (combine).
#include "../../include/epcomm/common.cuh"

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstring>

namespace epcomm {

struct PeerTable {
    uint8_t* bufs[kMaxRanks];  // base of each rank's buffer in this process's address space
};

constexpr int kSignalOffset = 0;
constexpr int kCountOffset = 64;
constexpr int kExpertCountOffset = 128;
constexpr int kMaxExpertsPerRank = 256;
constexpr int kRowsOffset = 128 + kMaxRanks * kMaxExpertsPerRank * 4;  // 8320, a multiple of 128

// Publish this rank's send counts into each peer, then meet every rank at `seq`.
// Waits are bounded: on timeout the ranks that did not arrive are flagged in `timed_out` (host memory).
__global__ void notify_and_barrier(PeerTable peers, int rank, int num_ranks, const int* send_counts,
                                   const int* expert_counts, int experts_per_rank, int64_t seq, uint64_t timeout_ns,
                                   int* timed_out) {
    const int tid = threadIdx.x;
    if (expert_counts != nullptr) {
        for (int i = tid; i < num_ranks * experts_per_rank; i += blockDim.x) {
            const int dst = i / experts_per_rank, e = i % experts_per_rank;
            auto* counts = reinterpret_cast<int*>(peers.bufs[dst] + kExpertCountOffset);
            counts[rank * kMaxExpertsPerRank + e] = expert_counts[i];
        }
    }
    if (send_counts != nullptr && tid < num_ranks)
        reinterpret_cast<int*>(peers.bufs[tid] + kCountOffset)[rank] = send_counts[tid];
    __syncthreads();
    // Earlier kernels on this stream and the stores above happen before the signal.
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    __syncthreads();
    if (tid < num_ranks) {
        st_release_sys(reinterpret_cast<int64_t*>(peers.bufs[tid] + kSignalOffset) + rank, seq);
        const int64_t* mine = reinterpret_cast<const int64_t*>(peers.bufs[rank] + kSignalOffset) + tid;
        const uint64_t start = global_timer_ns();
        while (ld_acquire_sys(mine) < seq) {
            if (global_timer_ns() - start > timeout_ns) {
                timed_out[tid] = 1;
                break;
            }
        }
    }
}

// Sender: warp per token; each token row goes to every rank it is routed to, at its slot there.
__global__ void push_rows(PeerTable peers, int rank, int num_ranks, const uint8_t* rows, int num_rows,
                          int row_bytes, const bool* in_rank, const int* slot, int64_t capacity) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarpSize;
    const int num_warps = gridDim.x * blockDim.x / kWarpSize;
    const int num_int4 = row_bytes / 16;
    for (int t = warp; t < num_rows; t += num_warps) {
        const int4* src = reinterpret_cast<const int4*>(rows + static_cast<int64_t>(t) * row_bytes);
        for (int r = 0; r < num_ranks; ++r) {
            if (!in_rank[t * num_ranks + r]) continue;
            uint8_t* block = peers.bufs[r] + kRowsOffset + static_cast<int64_t>(rank) * capacity * row_bytes;
            warp_copy_int4(reinterpret_cast<int4*>(block + static_cast<int64_t>(slot[t * num_ranks + r]) * row_bytes),
                           src, num_int4, lane);
        }
    }
}

// Receiver after dispatch: compact the blocks of all sources (in rank order) into `out`.
__global__ void gather_rows(const uint8_t* buf, int num_ranks, const int* recv_begin, const int* recv_counts,
                            int row_bytes, int64_t capacity, uint8_t* out, int num_out_rows) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarpSize;
    const int num_warps = gridDim.x * blockDim.x / kWarpSize;
    for (int i = warp; i < num_out_rows; i += num_warps) {
        int s = 0;
        while (s + 1 < num_ranks && i >= recv_begin[s + 1]) ++s;
        const int64_t src_row = static_cast<int64_t>(s) * capacity + (i - recv_begin[s]);
        warp_copy_int4(reinterpret_cast<int4*>(out + static_cast<int64_t>(i) * row_bytes),
                       reinterpret_cast<const int4*>(buf + kRowsOffset + src_row * row_bytes), row_bytes / 16, lane);
    }
}

// Source after combine: token t sums, in fp32 and ascending rank order, the rows its destinations
// returned, adds the biases, and rounds once to bf16. Optional top-k weights are summed alike.
__global__ void reduce_rows(const uint8_t* buf, int num_ranks, int num_tokens, int hidden, int num_topk,
                            int row_bytes, int64_t capacity, const bool* in_rank, const int* slot,
                            const __nv_bfloat16* bias0, const __nv_bfloat16* bias1, __nv_bfloat16* out,
                            float* out_weights) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarpSize;
    const int num_warps = gridDim.x * blockDim.x / kWarpSize;
    for (int t = warp; t < num_tokens; t += num_warps) {
        const uint8_t* srcs[kMaxRanks];
        int n = 0;
        for (int r = 0; r < num_ranks; ++r)
            if (in_rank[t * num_ranks + r])
                srcs[n++] = buf + kRowsOffset + (static_cast<int64_t>(r) * capacity + slot[t * num_ranks + r]) * row_bytes;
        // 8 bf16 per 16-byte word.
        for (int w = lane; w < hidden / 8; w += kWarpSize) {
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int j = 0; j < n; ++j) {
                const int4 v = reinterpret_cast<const int4*>(srcs[j])[w];
                const auto* h = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
                for (int k = 0; k < 8; ++k) acc[k] += __bfloat162float(h[k]);
            }
            if (bias0 != nullptr) {
                const int4 b = reinterpret_cast<const int4*>(bias0 + static_cast<int64_t>(t) * hidden)[w];
                const auto* h = reinterpret_cast<const __nv_bfloat16*>(&b);
#pragma unroll
                for (int k = 0; k < 8; ++k) acc[k] += __bfloat162float(h[k]);
            }
            if (bias1 != nullptr) {
                const int4 b = reinterpret_cast<const int4*>(bias1 + static_cast<int64_t>(t) * hidden)[w];
                const auto* h = reinterpret_cast<const __nv_bfloat16*>(&b);
#pragma unroll
                for (int k = 0; k < 8; ++k) acc[k] += __bfloat162float(h[k]);
            }
            int4 o;
            auto* oh = reinterpret_cast<__nv_bfloat16*>(&o);
#pragma unroll
            for (int k = 0; k < 8; ++k) oh[k] = __float2bfloat16_rn(acc[k]);
            reinterpret_cast<int4*>(out + static_cast<int64_t>(t) * hidden)[w] = o;
        }
        if (out_weights != nullptr && lane < num_topk) {
            float acc = 0;
            for (int j = 0; j < n; ++j)
                acc += reinterpret_cast<const float*>(srcs[j] + hidden * 2)[lane];
            out_weights[static_cast<int64_t>(t) * num_topk + lane] = acc;
        }
    }
}

}  // namespace epcomm

// ---------------------------------------------------------------- host entry points (C ABI, no torch)
using epcomm::PeerTable;

static PeerTable make_table(const uint64_t* bufs, int num_ranks) {
    PeerTable table{};
    for (int r = 0; r < num_ranks; ++r) table.bufs[r] = reinterpret_cast<uint8_t*>(bufs[r]);
    return table;
}

extern "C" {

// CUDA IPC of a buffer that may sit inside a larger allocation (PyTorch's caching allocator):
// export the allocation's handle plus the offset of `ptr` in it.
int epcomm_ipc_export(int device, void* ptr, void* handle_out, int64_t* offset_out) {
    if (cudaSetDevice(device) != cudaSuccess) return static_cast<int>(cudaGetLastError());
    CUdeviceptr base = 0;
    size_t size = 0;
    if (cuMemGetAddressRange(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) return -1;
    *offset_out = static_cast<int64_t>(reinterpret_cast<CUdeviceptr>(ptr) - base);
    cudaIpcMemHandle_t handle;
    const cudaError_t err = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
    if (err != cudaSuccess) return static_cast<int>(err);
    std::memcpy(handle_out, &handle, sizeof(handle));
    return 0;
}

// Map a peer's buffer into this process on `device` (the caller's own GPU), peer access enabled.
int epcomm_ipc_open(int device, const void* handle_in, int64_t offset, void** base_out, void** ptr_out) {
    if (cudaSetDevice(device) != cudaSuccess) return static_cast<int>(cudaGetLastError());
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, handle_in, sizeof(handle));
    void* base = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) return static_cast<int>(err);
    *base_out = base;
    *ptr_out = static_cast<char*>(base) + offset;
    return 0;
}

int epcomm_ipc_close(void* base) { return static_cast<int>(cudaIpcCloseMemHandle(base)); }

int epcomm_rows_offset() { return epcomm::kRowsOffset; }
int epcomm_max_experts_per_rank() { return epcomm::kMaxExpertsPerRank; }

int epcomm_notify(const uint64_t* bufs, int rank, int num_ranks, const int* send_counts, const int* expert_counts,
                  int experts_per_rank, int64_t seq, uint64_t timeout_ns, int* timed_out, cudaStream_t stream) {
    epcomm::notify_and_barrier<<<1, 256, 0, stream>>>(make_table(bufs, num_ranks), rank, num_ranks, send_counts,
                                                      expert_counts, experts_per_rank, seq, timeout_ns, timed_out);
    return static_cast<int>(cudaGetLastError());
}

int epcomm_push_rows(const uint64_t* bufs, int rank, int num_ranks, const void* rows, int num_rows, int row_bytes,
                     const bool* in_rank, const int* slot, int64_t capacity, int num_sms, cudaStream_t stream) {
    if (num_rows > 0)
        epcomm::push_rows<<<num_sms, 512, 0, stream>>>(make_table(bufs, num_ranks), rank, num_ranks,
                                                         static_cast<const uint8_t*>(rows), num_rows, row_bytes,
                                                         in_rank, slot, capacity);
    return static_cast<int>(cudaGetLastError());
}

int epcomm_gather_rows(uint64_t buf, int num_ranks, const int* recv_begin, const int* recv_counts, int row_bytes,
                       int64_t capacity, void* out, int num_out_rows, int num_sms, cudaStream_t stream) {
    if (num_out_rows > 0)
        epcomm::gather_rows<<<num_sms, 512, 0, stream>>>(reinterpret_cast<const uint8_t*>(buf), num_ranks,
                                                           recv_begin, recv_counts, row_bytes, capacity,
                                                           static_cast<uint8_t*>(out), num_out_rows);
    return static_cast<int>(cudaGetLastError());
}

int epcomm_reduce_rows(uint64_t buf, int num_ranks, int num_tokens, int hidden, int num_topk, int row_bytes,
                       int64_t capacity, const bool* in_rank, const int* slot, const void* bias0, const void* bias1,
                       void* out, float* out_weights, int num_sms, cudaStream_t stream) {
    if (num_tokens > 0)
        epcomm::reduce_rows<<<num_sms, 512, 0, stream>>>(
            reinterpret_cast<const uint8_t*>(buf), num_ranks, num_tokens, hidden, num_topk, row_bytes, capacity,
            in_rank, slot, static_cast<const __nv_bfloat16*>(bias0), static_cast<const __nv_bfloat16*>(bias1),
            static_cast<__nv_bfloat16*>(out), out_weights);
    return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
