// Intranode host launchers and C ABI: the call records Python fills, the launch configuration of each
// kernel, and the constants Python checks against its own.
#include "../include/epcomm/common/launch.cuh"
#include "../include/epcomm/common/records.cuh"
#include "../include/epcomm/impls/dispatch_layout.cuh"
#include "../include/epcomm/impls/intranode_combine.cuh"

#include <algorithm>
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstring>

// ---------------------------------------------------------------- host entry points (C ABI, no torch)
using namespace epcomm;

// The records Python fills for a call (common/records.cuh). A field means what the kernel argument
// of the same name means (NotifyArgs, DispatchArgs, CombineArgs); fields are grouped by width, so
// no record has implicit padding.
namespace epcomm {

// What every call of one rank's Buffer shares.
#define EPCOMM_CALL_CONTEXT(X)                                                                     \
    X(uint64_t, peer_bufs) /* const uint64_t [num_ranks]: every rank's buffer as mapped here */ \
    X(uint64_t, info) X(uint64_t, timeout_ns) X(int32_t, rank) X(int32_t, num_ranks)
EPCOMM_RECORD(CallContext, EPCOMM_CALL_CONTEXT)

#define EPCOMM_NOTIFY_CALL(X)                                                                                  \
    X(CallContext, context) X(uint64_t, in_rank) X(uint64_t, send_counts) X(uint64_t, expert_counts)          \
    X(uint64_t, topk_idx) X(uint64_t, slot) X(uint64_t, own_tokens) X(uint64_t, layout) X(int32_t, op)        \
    X(int32_t, num_tokens) X(int32_t, experts_per_rank) X(int32_t, num_topk) X(int32_t, expert_alignment)     \
    X(int32_t, num_worst_tokens) X(int32_t, row_bytes)                                                        \
    X(int32_t, num_sms) /* the call's SM budget: the count exchange's blocks stay within it */                \
    X(int32_t, shape_key) X(int32_t, pad0)
EPCOMM_RECORD(NotifyCall, EPCOMM_NOTIFY_CALL)

#define EPCOMM_DISPATCH_CALL(X)                                                                                \
    X(CallContext, context) X(uint64_t, x) X(uint64_t, scales) X(uint64_t, topk_idx) X(uint64_t, topk_weights) \
    X(uint64_t, in_rank) X(uint64_t, slot) X(uint64_t, own_tokens) X(uint64_t, layout) X(uint64_t, recv_x)     \
    X(uint64_t, recv_scales) X(uint64_t, recv_topk_idx) X(uint64_t, recv_topk_weights)                        \
    X(int64_t, scale_stride_t) X(int64_t, scale_stride_c) X(int64_t, recv_scale_stride_t)                     \
    X(int64_t, recv_scale_stride_c) X(int64_t, cap_rows) X(int32_t, num_tokens) X(int32_t, x_bytes)           \
    X(int32_t, num_scales) X(int32_t, num_topk) X(int32_t, has_topk) X(int32_t, has_weights)                  \
    X(int32_t, experts_per_rank) X(int32_t, row_stride) X(int32_t, num_out_rows) X(int32_t, num_sms)          \
    X(int32_t, num_send_blocks) X(int32_t, mode) X(int32_t, op)                                               \
    X(int32_t, local_by_receiver) /* the fused kernel's (mode 0): see DispatchArgs */
EPCOMM_RECORD(DispatchCall, EPCOMM_DISPATCH_CALL)

#define EPCOMM_COMBINE_CALL(X)                                                                                 \
    X(CallContext, context) X(uint64_t, x) X(uint64_t, weights) X(uint64_t, in_rank) X(uint64_t, slot)        \
    X(uint64_t, layout) X(uint64_t, bias0) X(uint64_t, bias1) X(uint64_t, out) X(uint64_t, out_weights)       \
    X(int64_t, cap_rows) X(int32_t, num_tokens) X(int32_t, hidden) X(int32_t, num_topk) X(int32_t, row_stride) \
    X(int32_t, num_sms) X(int32_t, num_send_blocks)
EPCOMM_RECORD(CombineCall, EPCOMM_COMBINE_CALL)

}  // namespace epcomm

constexpr RecordLayout kCallRecords[] = {
    record_layout<CallContext>("CallContext"), record_layout<NotifyCall>("NotifyCall"),
    record_layout<DispatchCall>("DispatchCall"), record_layout<CombineCall>("CombineCall")};

// The fields every kernel's arguments share, from the call's context.
template <class Args>
static void set_context(Args& a, const CallContext& c) {
    const auto* bufs = reinterpret_cast<const uint64_t*>(static_cast<uintptr_t>(c.peer_bufs));
    for (int r = 0; r < c.num_ranks; ++r) set_ptr(a.peers.bufs[r], bufs[r]);
    a.rank = c.rank;
    a.num_ranks = c.num_ranks;
    set_ptr(a.info, c.info);
    a.timeout_ns = c.timeout_ns;
}

// What a dispatch and its combine share: the dispatch's routing, the buffer's row slots, the
// token count and top-k width.
template <class Args, class Call>
static void set_routing(Args& a, const Call& c) {
    a.num_tokens = c.num_tokens;
    a.num_topk = c.num_topk;
    set_ptr(a.in_rank, c.in_rank);
    set_ptr(a.slot, c.slot);
    set_ptr(a.layout, c.layout);
    a.row_stride = c.row_stride;
    a.cap_rows = c.cap_rows;
}

// Blocks of a kernel whose first num_send_blocks send and the others receive (or reduce): num_sms,
// and at least one block for each role.
static int split_blocks(int num_sms, int num_send_blocks, int& send_blocks) {
    const int blocks = num_sms > 1 ? num_sms : 2;
    send_blocks = num_send_blocks < 1 ? 1 : (num_send_blocks >= blocks ? blocks - 1 : num_send_blocks);
    return blocks;
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

// Constants the Python side mirrors (checked when the library loads).
int epcomm_constant(const char* name) {
    struct Entry {
        const char* name;
        int value;
    };
    static const Entry entries[] = {
        {"rows_offset", kRowsOffset},       {"row_trailer_bytes", kRowTrailerBytes},
        {"max_ranks", kMaxRanks},           {"max_experts_per_rank", kMaxExpertsPerRank},
        {"info_ints", kInfoInts},           {"layout_ints", kLayoutInts},
        {"info_error", kInfoError},         {"info_error_op", kInfoErrorOp},
        {"info_error_phase", kInfoErrorPhase}, {"info_error_ranks", kInfoErrorRanks},
        {"info_num_recv", kInfoNumRecv},
        {"info_recv_counts", kInfoRecvCounts}, {"info_matrix", kInfoMatrix},
        {"info_max_recv", kInfoMaxRecv},    {"info_max_send", kInfoMaxSend},
        {"info_refusal", kInfoRefusal},     {"info_experts", kInfoExperts},
        {"op_dispatch", kOpDispatch},       {"op_cached_dispatch", kOpCachedDispatch},
        {"op_combine", kOpCombine},         {"op_barrier", kOpBarrier},
        {"lay_max_recv", kLayMaxRecv},      {"lay_max_send", kLayMaxSend},
    };
    for (const Entry& e : entries)
        if (std::strcmp(e.name, name) == 0) return e.value;
    return -1;
}

int epcomm_get_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                               int ranks_per_domain, int* per_rank, int* per_domain, int* per_expert, bool* in_rank,
                               cudaStream_t stream) {
    if (num_tokens == 0) return 0;
    constexpr int kThreads = 256;
    const int num_counters = num_experts + num_ranks + num_ranks / ranks_per_domain;
    const size_t smem = static_cast<size_t>(num_counters) * sizeof(int);
    if (smem > 48 * 1024) return static_cast<int>(cudaErrorInvalidValue);
    layout_kernel<<<(num_tokens + kThreads - 1) / kThreads, kThreads, smem, stream>>>(
        topk_idx, num_tokens, num_topk, num_experts, num_ranks, ranks_per_domain, per_rank, per_domain, per_expert,
        in_rank);
    return static_cast<int>(cudaGetLastError());
}

int epcomm_notify(const NotifyCall* call, cudaStream_t stream) {
    const NotifyCall& c = *call;
    NotifyArgs a{};
    set_context(a, c.context);
    a.op = c.op;
    a.num_tokens = c.num_tokens;
    set_ptr(a.in_rank, c.in_rank);
    set_ptr(a.send_counts, c.send_counts);
    set_ptr(a.expert_counts, c.expert_counts);
    a.experts_per_rank = c.experts_per_rank;
    set_ptr(a.topk_idx, c.topk_idx);
    a.num_topk = c.num_topk;
    a.expert_alignment = c.expert_alignment;
    a.num_worst_tokens = c.num_worst_tokens;
    a.row_bytes = c.row_bytes;
    a.shape_key = c.shape_key;
    set_ptr(a.slot, c.slot);
    set_ptr(a.own_tokens, c.own_tokens);
    set_ptr(a.layout, c.layout);
    if (a.op != kOpDispatch) {  // a barrier only: one block
        notify_kernel<<<1, kNotifyThreads, 0, stream>>>(a);
        return static_cast<int>(cudaGetLastError());
    }
    // The count exchange: a block per kTokensPerNotifyBlock tokens scans them (scan_slots), all at
    // once (they meet at a grid barrier).
    // No more blocks than the call's SM budget (a cooperative launch waits for all of its SMs to be
    // free: work overlapping on other streams keeps the rest), nor than the device's SMs (one block
    // fills an SM; a cooperative launch of more is refused: a MIG slice).
    constexpr int kTokensPerNotifyBlock = 1024;
    int device = 0, sms = 1;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
        return static_cast<int>(cudaGetLastError());
    const int blocks = std::max(1, std::min({kMaxNotifyBlocks, sms, c.num_sms,
                                             (c.num_tokens + kTokensPerNotifyBlock - 1) / kTokensPerNotifyBlock}));
    if (blocks > 1) {
        if (launch_cooperative(notify_kernel, blocks, kNotifyThreads, 0, stream, a) == cudaSuccess) return 0;
        // Refused (fewer SMs are this process's than the device has: MPS, green contexts): one block
        // scans every token, as before the grid. The refusal is not left for a later call to report.
        (void)cudaGetLastError();
    }
    notify_kernel<<<1, kNotifyThreads, 0, stream>>>(a);  // one block meets no grid barrier
    return static_cast<int>(cudaGetLastError());
}

// mode 0: the fused kernel (its senders write this rank's own rows); 1: send half only; 2: receive
// half only (1 and 2 together: own rows copied by the receivers from x).
int epcomm_dispatch(const DispatchCall* call, cudaStream_t stream) {
    const DispatchCall& c = *call;
    DispatchArgs a{};
    set_context(a, c.context);
    set_routing(a, c);
    set_ptr(a.own_tokens, c.own_tokens);
    set_ptr(a.x, c.x);
    a.x_bytes = c.x_bytes;
    set_ptr(a.scales, c.scales);
    a.num_scales = c.num_scales;
    a.scale_stride_t = c.scale_stride_t;
    a.scale_stride_c = c.scale_stride_c;
    set_ptr(a.topk_idx, c.topk_idx);
    set_ptr(a.topk_weights, c.topk_weights);
    a.has_topk = c.has_topk != 0;
    a.has_weights = c.has_weights != 0;
    a.experts_per_rank = c.experts_per_rank;
    set_ptr(a.recv_x, c.recv_x);
    set_ptr(a.recv_scales, c.recv_scales);
    a.recv_scale_stride_t = c.recv_scale_stride_t;
    a.recv_scale_stride_c = c.recv_scale_stride_c;
    set_ptr(a.recv_topk_idx, c.recv_topk_idx);
    set_ptr(a.recv_topk_weights, c.recv_topk_weights);
    a.num_out_rows = c.num_out_rows;
    a.op = c.op;
    const int blocks = split_blocks(c.num_sms, c.num_send_blocks, a.num_send_blocks);
    if (c.mode == 0) {
        a.local_by_receiver = c.local_by_receiver != 0;
        dispatch_kernel<true, true><<<blocks, 512, 0, stream>>>(a);
    } else if (c.mode == 1) {
        a.local_by_receiver = true;
        dispatch_kernel<true, false><<<a.num_send_blocks, 512, 0, stream>>>(a);
    } else {
        a.local_by_receiver = true;
        dispatch_kernel<false, true><<<blocks - a.num_send_blocks, 512, 0, stream>>>(a);
    }
    return static_cast<int>(cudaGetLastError());
}

int epcomm_combine(const CombineCall* call, cudaStream_t stream) {
    const CombineCall& c = *call;
    CombineArgs a{};
    set_context(a, c.context);
    set_routing(a, c);
    a.hidden = c.hidden;
    set_ptr(a.x, c.x);
    set_ptr(a.weights, c.weights);
    set_ptr(a.bias0, c.bias0);
    set_ptr(a.bias1, c.bias1);
    set_ptr(a.out, c.out);
    set_ptr(a.out_weights, c.out_weights);
    const int blocks = split_blocks(c.num_sms, c.num_send_blocks, a.num_send_blocks);
    combine_kernel<<<blocks, 512, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

}  // extern "C"

// epcomm_struct_layout, _field_name and _field_type: the records' tables (common/records.cuh).
EPCOMM_EXPORT_RECORDS(epcomm_struct, kCallRecords)
