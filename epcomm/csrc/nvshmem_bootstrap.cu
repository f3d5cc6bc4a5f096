// NVSHMEM transport: GPU-initiated puts and signals to peers that CUDA IPC cannot reach (other
// nodes over RDMA; on one host NVSHMEM carries them over NVLink, so the same path is tested there).
//
// Built apart from the IPC kernels (build.py): NVSHMEM device code needs relocatable device code
// and a device link against libnvshmem_device.a. Bootstrapped without MPI: rank 0 of the
// torch.distributed group makes a unique id, the group broadcasts it, and every rank calls
// nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID) with its rank in the group (= its NVSHMEM PE).
//
// Here: bootstrap, the symmetric heap, and a probe kernel (a put with a signal to the next PE, then
// a wait for the previous PE's) that the GPU tests use to check the path end to end. The
// low-latency kernels over this transport are in low_latency.cu.
#include <cstdint>
#include <cstring>

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

namespace {

// Each PE puts its `num_words` words of `src` into the next PE's `dst`, with a signal set to
// `round` on the next PE's `signal`; then waits until its own signal reaches `round` (from the
// previous PE), bounded by `timeout_ns`.
__global__ void probe_ring(uint64_t* dst, const uint64_t* src, uint64_t* signal, int num_words, uint64_t round,
                           uint64_t timeout_ns, int* timed_out) {
    const int me = nvshmem_my_pe(), npes = nvshmem_n_pes();
    const int next = (me + 1) % npes;
    if (threadIdx.x == 0) {
        nvshmem_uint64_put_signal_nbi(dst, src, num_words, signal, round, NVSHMEM_SIGNAL_SET, next);
        nvshmem_quiet();
        uint64_t start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        while (nvshmem_signal_fetch(signal) < round) {
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if (now - start > timeout_ns) {
                *timed_out = 1;
                break;
            }
        }
    }
}

}  // namespace

extern "C" {

int epcomm_nvshmem_uid_bytes() { return static_cast<int>(sizeof(nvshmemx_uniqueid_t)); }

// Rank 0 makes the unique id that every rank passes to epcomm_nvshmem_init.
int epcomm_nvshmem_get_uid(void* uid_out) {
    nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
    const int status = nvshmemx_get_uniqueid(&uid);
    std::memcpy(uid_out, &uid, sizeof(uid));
    return status;
}

int epcomm_nvshmem_init(const void* uid_in, int rank, int num_ranks) {
    nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
    std::memcpy(&uid, uid_in, sizeof(uid));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    int status = nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &uid, &attr);
    if (status != 0) return status;
    status = nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
    if (status != 0) return status;
    // NVSHMEM numbers PEs itself; the transports assume PE == rank in the group.
    return nvshmem_my_pe() == rank && nvshmem_n_pes() == num_ranks ? 0 : -1;
}

void epcomm_nvshmem_finalize() { nvshmem_finalize(); }

// Collective: every PE allocates the same size (symmetric heap).
void* epcomm_nvshmem_malloc(int64_t num_bytes) { return nvshmem_malloc(static_cast<size_t>(num_bytes)); }

void epcomm_nvshmem_free(void* ptr) { nvshmem_free(ptr); }

void epcomm_nvshmem_barrier_all() { nvshmem_barrier_all(); }

// Whether `pe` is reachable by loads and stores (NVLink P2P) rather than only by the NVSHMEM transport.
int epcomm_nvshmem_is_p2p(void* symmetric_ptr, int pe) { return nvshmem_ptr(symmetric_ptr, pe) != nullptr; }

// `pe`'s copy of a symmetric address as mapped in this process (NVLink), or null when it is not.
void* epcomm_nvshmem_peer_ptr(void* symmetric_ptr, int pe) { return nvshmem_ptr(symmetric_ptr, pe); }

int epcomm_nvshmem_probe_ring(void* dst, const void* src, void* signal, int num_words, uint64_t round,
                              uint64_t timeout_ns, int* timed_out, cudaStream_t stream) {
    probe_ring<<<1, 32, 0, stream>>>(static_cast<uint64_t*>(dst), static_cast<const uint64_t*>(src),
                                     static_cast<uint64_t*>(signal), num_words, round, timeout_ns, timed_out);
    return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
