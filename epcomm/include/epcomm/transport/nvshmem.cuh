// The NVSHMEM transport: peers mapped into this process (nvshmem_ptr: NVLink) get direct stores;
// the others (other nodes over RDMA, or peers EPCOMM_LL_REMOTE_RANKS marks remote) get NVSHMEM puts
// and signal operations.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include "transport.cuh"

namespace epcomm {
namespace ll {

struct Net {
    static constexpr Reach kReach = Reach::kAnyPeer;
    __device__ static void put_warp(void* dst, const void* src, size_t bytes, int pe) {
        nvshmemx_putmem_nbi_warp(dst, src, bytes, pe);
    }
    __device__ static void put_block(void* dst, const void* src, size_t bytes, int pe) {
        nvshmemx_putmem_nbi_block(dst, src, bytes, pe);
    }
    __device__ static void signal(int64_t* addr, int64_t value, int pe) {
        nvshmemx_signal_op(reinterpret_cast<uint64_t*>(addr), static_cast<uint64_t>(value), NVSHMEM_SIGNAL_SET, pe);
    }
    __device__ static void quiet() { nvshmem_quiet(); }
};

}  // namespace ll
}  // namespace epcomm
