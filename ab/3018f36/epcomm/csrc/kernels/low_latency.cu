// The low-latency kernels of the IPC library: every peer's buffer is mapped into this process
// (CUDA IPC, one node), so every message and signal is a direct store (no remote transport).
#include "../../include/epcomm/common.cuh"

namespace epcomm {
namespace ll {

struct Net {
    static constexpr bool kRemote = false;  // is_remote() is false for every peer: nothing below runs
    __device__ static void put_warp(void*, const void*, size_t, int) { __trap(); }
    __device__ static void put_block(void*, const void*, size_t, int) { __trap(); }
    __device__ static void signal(int64_t*, int64_t, int) { __trap(); }
    __device__ static void quiet() {}
};

}  // namespace ll
}  // namespace epcomm

#include "low_latency.cuh"
