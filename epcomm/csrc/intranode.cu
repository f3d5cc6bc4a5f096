// Intranode host launchers and C ABI: the call records Python fills, the launch configuration of each
// kernel, and the constants Python checks against its own.
#include "../include/epcomm/common/records.cuh"
#include "../include/epcomm/impls/dispatch_layout.cuh"
#include "../include/epcomm/impls/intranode_combine.cuh"

#include <algorithm>
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstring>

// ---------------------------------------------------------------- host entry points (C ABI, no torch)
using namespace epcomm;

// The records Python fills for a call (common/records.cuh; ctypes mirrors in backends/cuda/intranode.py,
// checked through epcomm_struct_layout and epcomm_struct_field_name). A field means what the kernel
// argument of the same name means (NotifyArgs, DispatchArgs, CombineArgs).

// What every call of one rank's Buffer shares.
struct CallContext {
    uint64_t peer_bufs;  // const uint64_t [num_ranks]: every rank's buffer in this process's address space
    uint64_t info, timeout_ns;
    int32_t rank, num_ranks;
};

struct NotifyCall {
    CallContext context;
    uint64_t in_rank, send_counts, expert_counts, topk_idx, slot, own_tokens, layout;
    int32_t op, num_tokens, experts_per_rank, num_topk, expert_alignment, num_worst_tokens, row_bytes;
    int32_t num_sms;  // the call's SM budget: the count exchange's blocks stay within it
    int32_t shape_key, pad0;
};

struct DispatchCall {
    CallContext context;
    uint64_t x, scales, topk_idx, topk_weights, in_rank, slot, own_tokens, layout;
    uint64_t recv_x, recv_scales, recv_topk_idx, recv_topk_weights;
    int64_t scale_stride_t, scale_stride_c, recv_scale_stride_t, recv_scale_stride_c, cap_rows;
    int32_t num_tokens, x_bytes, num_scales, num_topk, has_topk, has_weights, experts_per_rank, row_stride;
    int32_t num_out_rows, num_sms, num_send_blocks, mode, op;
    int32_t local_by_receiver;  // the fused kernel's (mode 0): see DispatchArgs
};

struct CombineCall {
    CallContext context;
    uint64_t x, weights, in_rank, slot, layout, bias0, bias1, out, out_weights;
    int64_t cap_rows;
    int32_t num_tokens, hidden, num_topk, row_stride, num_sms, num_send_blocks;
};

namespace epcomm {  // where the template fields_of lives
template <>
constexpr auto fields_of<CallContext>() {
    using S = CallContext;
    return std::array{EPCOMM_FIELD(peer_bufs), EPCOMM_FIELD(info), EPCOMM_FIELD(timeout_ns), EPCOMM_FIELD(rank),
                      EPCOMM_FIELD(num_ranks)};
}
template <>
constexpr auto fields_of<NotifyCall>() {
    using S = NotifyCall;
    return std::array{EPCOMM_FIELD(context), EPCOMM_FIELD(in_rank), EPCOMM_FIELD(send_counts),
                      EPCOMM_FIELD(expert_counts), EPCOMM_FIELD(topk_idx), EPCOMM_FIELD(slot),
                      EPCOMM_FIELD(own_tokens), EPCOMM_FIELD(layout), EPCOMM_FIELD(op), EPCOMM_FIELD(num_tokens),
                      EPCOMM_FIELD(experts_per_rank), EPCOMM_FIELD(num_topk), EPCOMM_FIELD(expert_alignment),
                      EPCOMM_FIELD(num_worst_tokens), EPCOMM_FIELD(row_bytes), EPCOMM_FIELD(num_sms),
                      EPCOMM_FIELD(shape_key), EPCOMM_FIELD(pad0)};
}
template <>
constexpr auto fields_of<DispatchCall>() {
    using S = DispatchCall;
    return std::array{EPCOMM_FIELD(context), EPCOMM_FIELD(x), EPCOMM_FIELD(scales), EPCOMM_FIELD(topk_idx),
                      EPCOMM_FIELD(topk_weights), EPCOMM_FIELD(in_rank), EPCOMM_FIELD(slot), EPCOMM_FIELD(own_tokens),
                      EPCOMM_FIELD(layout), EPCOMM_FIELD(recv_x), EPCOMM_FIELD(recv_scales),
                      EPCOMM_FIELD(recv_topk_idx), EPCOMM_FIELD(recv_topk_weights), EPCOMM_FIELD(scale_stride_t),
                      EPCOMM_FIELD(scale_stride_c), EPCOMM_FIELD(recv_scale_stride_t),
                      EPCOMM_FIELD(recv_scale_stride_c), EPCOMM_FIELD(cap_rows), EPCOMM_FIELD(num_tokens),
                      EPCOMM_FIELD(x_bytes), EPCOMM_FIELD(num_scales), EPCOMM_FIELD(num_topk),
                      EPCOMM_FIELD(has_topk), EPCOMM_FIELD(has_weights), EPCOMM_FIELD(experts_per_rank),
                      EPCOMM_FIELD(row_stride), EPCOMM_FIELD(num_out_rows), EPCOMM_FIELD(num_sms),
                      EPCOMM_FIELD(num_send_blocks), EPCOMM_FIELD(mode), EPCOMM_FIELD(op),
                      EPCOMM_FIELD(local_by_receiver)};
}
template <>
constexpr auto fields_of<CombineCall>() {
    using S = CombineCall;
    return std::array{EPCOMM_FIELD(context), EPCOMM_FIELD(x), EPCOMM_FIELD(weights), EPCOMM_FIELD(in_rank),
                      EPCOMM_FIELD(slot), EPCOMM_FIELD(layout), EPCOMM_FIELD(bias0), EPCOMM_FIELD(bias1),
                      EPCOMM_FIELD(out), EPCOMM_FIELD(out_weights), EPCOMM_FIELD(cap_rows), EPCOMM_FIELD(num_tokens),
                      EPCOMM_FIELD(hidden), EPCOMM_FIELD(num_topk), EPCOMM_FIELD(row_stride), EPCOMM_FIELD(num_sms),
                      EPCOMM_FIELD(num_send_blocks)};
}
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
        {"info_error_ranks", kInfoErrorRanks}, {"info_num_recv", kInfoNumRecv},
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

// The layout and field names of call record `name` (CallContext, NotifyCall, DispatchCall,
// CombineCall): write_record_layout and record_field_name (common/records.cuh) say what they return.
int epcomm_struct_layout(const char* name, int64_t* out, int max) {
    return write_record_layout(kCallRecords, name, out, max);
}

const char* epcomm_struct_field_name(const char* name, int index) {
    return record_field_name(kCallRecords, name, index);
}

}  // extern "C"
