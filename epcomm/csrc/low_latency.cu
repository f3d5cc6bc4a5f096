// Low-latency host launchers and C ABI. Built twice: into the IPC library, and with EPCOMM_NVSHMEM
// defined into the NVSHMEM library, where peers outside the NVLink domain are reached by puts.
#ifdef EPCOMM_NVSHMEM
#include "../include/epcomm/transport/nvshmem.cuh"
#else
#include "../include/epcomm/transport/ipc.cuh"
#endif
#include "../include/epcomm/common/launch.cuh"
#include "../include/epcomm/common/records.cuh"
#include "../include/epcomm/impls/ll_dispatch.cuh"
#include "../include/epcomm/impls/ll_combine_partials.cuh"

// ---------------------------------------------------------------- host entry points (C ABI, no torch)
// The records Python fills for a call (common/records.cuh): this file is built into both the IPC
// library, beside the intranode records, and the NVSHMEM library. A field means what the kernel
// argument of the same name means (DispatchArgs, CombineArgs); the phase to launch and the stream
// are arguments of their own, so the hook launches the record of its call unchanged.
namespace epcomm {

// What every call of one rank's buffer in one slot shares.
#define EPCOMM_LL_CALL_CONTEXT(X)                                                                       \
    X(uint64_t, peer_bufs) /* const uint64_t [num_ranks]: each rank's buffer as mapped here, 0 where remote */ \
    X(uint64_t, info) /* the slot's pinned host words */                                             \
    X(uint64_t, timeout_ns) X(int64_t, slot_bytes) X(int32_t, rank) X(int32_t, num_ranks) X(int32_t, slot) \
    X(int32_t, num_sms)
EPCOMM_RECORD(LLCallContext, EPCOMM_LL_CALL_CONTEXT)

// The fields both records share come first, in the same order (set_call).
#define EPCOMM_LL_DISPATCH_CALL(X)                                                                              \
    X(LLCallContext, context) X(uint64_t, x) X(uint64_t, topk_idx) X(uint64_t, mask) X(uint64_t, wait_stats)    \
    X(uint64_t, trace) X(uint64_t, sent_pairs) X(uint64_t, slot_map) X(uint64_t, topk_copy)                    \
    X(uint64_t, recv_data) X(uint64_t, recv_scales) X(uint64_t, src_info) X(uint64_t, recv_count)              \
    X(uint64_t, layout_range) X(uint64_t, cumulative_stats) X(int64_t, scale_stride_e)                         \
    X(int64_t, scale_stride_row) X(int64_t, scale_stride_col)                                                  \
    X(int64_t, arrival_key) /* dispatch_mode: the shape's arrival key (0: its format has no arrival area) */   \
    X(int32_t, num_tokens) X(int32_t, hidden) X(int32_t, num_topk) X(int32_t, num_experts)                     \
    X(int32_t, num_max_tokens) X(int32_t, shape_tag) X(int32_t, use_fp8) X(int32_t, round_scale)               \
    X(int32_t, use_ue8m0) X(int32_t, data_bytes) X(int32_t, msg_bytes) X(int32_t, num_scale_cols)              \
    X(int32_t, block_receive) X(int32_t, message_align)                                                        \
    X(int32_t, arrival) /* whether the call may go by arrival (the host's half) */                            \
    X(int32_t, arrival_msg_bytes)                                                                              \
    X(int32_t, send_blocks) /* by arrival, the blocks that send (0: send_plan's choice) */                     \
    X(int32_t, unused)
EPCOMM_RECORD(LLDispatchCall, EPCOMM_LL_DISPATCH_CALL)

#define EPCOMM_LL_COMBINE_CALL(X)                                                                               \
    X(LLCallContext, context) X(uint64_t, x) X(uint64_t, topk_idx) X(uint64_t, mask) X(uint64_t, wait_stats)    \
    X(uint64_t, trace) X(uint64_t, layout_range) X(uint64_t, caller_topk_idx) X(uint64_t, topk_weights)        \
    X(uint64_t, slot_map) X(uint64_t, out) X(uint64_t, counters)                                               \
    X(int64_t, area_tag) /* the shape tag of the slot layout's dispatch area (ArrivalKeyUpdate) */             \
    X(int32_t, num_tokens) X(int32_t, hidden) X(int32_t, num_topk) X(int32_t, num_experts)                     \
    X(int32_t, num_max_tokens) X(int32_t, shape_tag)                                                           \
    X(int32_t, partials) /* by partial sums (combine_partials_send) */ X(int32_t, request_bytes)               \
    X(uint64_t, computed) /* single-batch overlap's signal words (0: no overlap; combine_send_overlap) */      \
    X(uint64_t, packed_recv_count) X(int32_t, block_m) X(int32_t, signals_per_expert) X(uint32_t, threshold)   \
    X(int32_t, send_blocks) /* overlap: the send kernel's blocks (0: one per unit) */
EPCOMM_RECORD(LLCombineCall, EPCOMM_LL_COMBINE_CALL)

}  // namespace epcomm

using namespace epcomm;

namespace {

constexpr RecordLayout kLLCallRecords[] = {record_layout<LLCallContext>("LLCallContext"),
                                           record_layout<LLDispatchCall>("LLDispatchCall"),
                                           record_layout<LLCombineCall>("LLCombineCall")};

// Tokens per block of a kernel that owns token ranges: enough blocks to cover the SMs, and a block's
// (token, slot) pairs fit its shared arrays.
int chunk_tokens(int num_tokens, int num_topk, int num_sms) {
    int chunk = (num_tokens + num_sms - 1) / num_sms;
    const int most = ll::kMaxChunkEntries / (num_topk > 0 ? num_topk : 1);
    if (chunk > most) chunk = most;
    return chunk > 0 ? chunk : 1;
}

// The most dynamic shared memory of a dispatch's send role: its counts at kMaxExperts, which fit
// beside the kernel's static arrays (~14 KB) under the 48 KB a launch gets without opting in to more.
constexpr size_t kMaxSendShared = 2 * sizeof(int) * ll::kMaxExperts;

int num_blocks(int num_tokens, int chunk) {
    const int blocks = (num_tokens + chunk - 1) / chunk;
    return blocks > 0 ? blocks : 1;
}

// Whether `blocks` blocks of a kernel (kThreads each) can all be resident at once: its blocks
// wait for each other's signals, so all must run together (the cooperative launch guarantees it,
// or refuses).
// Asked once per kernel, with the most shared memory a call may use (the calls stay fast).
template <auto kKernel>
bool fits_at_once(int blocks, size_t most_shared, int num_sms) {
    static const int per_sm = [&] {
        int n = 0;
        return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, ll::kThreads, most_shared) == cudaSuccess ? n : 0;
    }();
    return blocks <= per_sm * num_sms;
}

// The low-latency kernels' cooperative launches: kThreads a block.
template <class Args>
cudaError_t launch_cooperative(void (*kernel)(Args), int blocks, size_t shared, cudaStream_t stream, const Args& a) {
    return epcomm::launch_cooperative(kernel, blocks, ll::kThreads, shared, stream, a);
}

// The kernel arguments both records give alike: the slot's context, the inputs' shapes and the
// shared pointers; and the token range of a block (from num_sms).
template <class Args, class Call>
void set_call(Args& a, const Call& c) {
    const LLCallContext& ctx = c.context;
    const auto* bufs = reinterpret_cast<const uint64_t*>(static_cast<uintptr_t>(ctx.peer_bufs));
    for (int r = 0; r < ctx.num_ranks; ++r) set_ptr(a.peers.bufs[r], bufs[r]);
    a.rank = ctx.rank;
    a.num_ranks = ctx.num_ranks;
    a.slot = ctx.slot;
    a.slot_bytes = ctx.slot_bytes;
    set_ptr(a.info, ctx.info);
    a.timeout_ns = ctx.timeout_ns;
    set_ptr(a.x, c.x);
    set_ptr(a.topk_idx, c.topk_idx);
    set_ptr(a.mask, c.mask);
    set_ptr(a.wait_stats, c.wait_stats);
    set_ptr(a.trace, c.trace);
    a.num_tokens = c.num_tokens;
    a.hidden = c.hidden;
    a.num_topk = c.num_topk;
    a.num_experts = c.num_experts;
    a.num_max_tokens = c.num_max_tokens;
    a.shape_tag = c.shape_tag;
    a.chunk_tokens = chunk_tokens(c.num_tokens, c.num_topk, ctx.num_sms);
}

}  // namespace

extern "C" {

int epcomm_ll_header_bytes() { return ll::kHeaderBytes; }

int epcomm_ll_max_experts() { return ll::kMaxExperts; }

// The phase timeline's shape: int64 [2, blocks, points] per call (trace_point).
void epcomm_ll_trace_shape(int* blocks, int* points) {
    *blocks = ll::kTraceBlocks;
    *points = ll::kTracePoints;
}

// phase 1: send (and return); phase 2: receive (the hook), with the same record; phase 0: both
// in one launch (no hook), or one after the other where its blocks cannot all be resident. Every
// phase launches the same kernel (ll::dispatch), as DeepEP does: a profiler shows one per call.
static int launch_dispatch(const LLDispatchCall* call, int phase, cudaStream_t stream) {
    const LLDispatchCall& c = *call;
    if (c.num_experts > ll::kMaxExperts) return static_cast<int>(cudaErrorInvalidValue);
    ll::DispatchArgs a{};
    set_call(a, c);
    a.mode = {c.use_fp8 != 0, c.round_scale != 0, c.use_ue8m0 != 0};
    a.data_bytes = c.data_bytes;
    a.msg_bytes = c.msg_bytes;
    a.message_align = c.message_align == 128 ? 128 : 16;
    a.num_scale_cols = c.num_scale_cols;
    set_ptr(a.sent_pairs, c.sent_pairs);
    set_ptr(a.slot_map, c.slot_map);
    set_ptr(a.topk_copy, c.topk_copy);
    set_ptr(a.recv_data, c.recv_data);
    set_ptr(a.recv_scales, c.recv_scales);
    a.scale_stride_e = c.scale_stride_e;
    a.scale_stride_row = c.scale_stride_row;
    a.scale_stride_col = c.scale_stride_col;
    set_ptr(a.src_info, c.src_info);
    set_ptr(a.recv_count, c.recv_count);
    set_ptr(a.layout_range, c.layout_range);
    set_ptr(a.cumulative_stats, c.cumulative_stats);
    a.arrival = phase == 0 ? c.arrival : 0;  // both phases in one launch alone (dispatch_mode)
    a.defer_acks = phase == 0;
    a.arrival_msg_bytes = c.arrival_msg_bytes;
    a.arrival_key = c.arrival_key;
    const int num_sms = c.context.num_sms, num_experts = c.num_experts;
    // The send role's counts: all pairs per expert, and those before each of a block's tokens (one
    // range a block, or one segment per token where send_plan gives senders tokens by stride).
    // Where they would not fit kMaxSendShared, or the pairs a block's arrays, the senders' count is
    // send_plan's own.
    int segments = 1, senders = c.send_blocks;
    if (senders == 0) senders = ll::auto_senders(c.num_tokens, num_sms);
    a.send_blocks = phase == 0 && c.arrival != 0 && senders > 0 && senders < num_sms ? senders : 0;
    if (a.send_blocks > 0 && c.num_tokens > a.send_blocks) {
        segments = (c.num_tokens + a.send_blocks - 1) / a.send_blocks;
        if (segments * c.num_topk > ll::kMaxChunkEntries ||
            (1 + segments) * sizeof(int) * static_cast<size_t>(num_experts) > kMaxSendShared)
            a.send_blocks = 0, segments = 1;
    }
    const size_t shared = (1 + segments) * sizeof(int) * static_cast<size_t>(num_experts);
    const bool together = c.block_receive != 0;
    auto kernel = together ? ll::dispatch<true> : ll::dispatch<false>;
    if (phase == 0 && num_blocks(c.num_tokens, a.chunk_tokens) <= num_sms &&
        (together ? fits_at_once<ll::dispatch<true>>(num_sms, kMaxSendShared, num_sms)
                  : fits_at_once<ll::dispatch<false>>(num_sms, kMaxSendShared, num_sms))) {
        a.phase = ll::kBothPhases;
        const cudaError_t launched = launch_cooperative(kernel, num_sms, shared, stream, a);
        if (launched != cudaErrorCooperativeLaunchTooLarge) return static_cast<int>(launched);
        // Fewer SMs than the device has are ours (MPS, green contexts): the two phases instead.
        (void)cudaGetLastError();
    }
    a.arrival = 0;
    // The send: a block per token range (no token parts: idle blocks would spin on the
    // acknowledgements on every SM, and a hook's send must leave the SMs to the work beside it).
    if (phase != 2) {
        a.phase = ll::kSendPhase;
        kernel<<<num_blocks(c.num_tokens, a.chunk_tokens), ll::kThreads, shared, stream>>>(a);
    }
    // The receive: a block per SM, as in one launch (its blocks wait only for the peers' signals).
    if (phase != 1) {
        a.phase = ll::kReceivePhase;
        kernel<<<num_sms, ll::kThreads, shared, stream>>>(a);
    }
    return static_cast<int>(cudaGetLastError());
}

// Whether a dispatch without a hook can run as one cooperative launch here (either receive, one
// block per SM with the most shared memory a call uses); else every such call takes two launches
// (slower: docs/TUNING.md, fused dispatch), which the tests must see.
int epcomm_ll_dispatch_fused_fit(int num_sms) {
    return fits_at_once<ll::dispatch<true>>(num_sms, kMaxSendShared, num_sms) &&
                   fits_at_once<ll::dispatch<false>>(num_sms, kMaxSendShared, num_sms)
               ? 1
               : 0;
}

// Whether a combine by partial sums can launch here: its kernel fits one block per SM of the
// device (registers, shared memory). Not whether the process may use every SM: under MPS or green
// contexts the cooperative launch can still be refused at the call, which then raises.
int epcomm_ll_combine_partials_fit(int num_sms) {
    return fits_at_once<ll::combine_partials>(num_sms, 0, num_sms) ? 1 : 0;
}

// phases as in launch_dispatch; every phase launches one kernel: ll::combine (<true>: single-batch
// overlap) or, by partial sums, ll::combine_partials.
static int launch_combine(const LLCombineCall* call, int phase, cudaStream_t stream) {
    const LLCombineCall& c = *call;
    ll::CombineArgs a{};
    set_call(a, c);
    set_ptr(a.layout_range, c.layout_range);
    set_ptr(a.caller_topk_idx, c.caller_topk_idx);
    set_ptr(a.topk_weights, c.topk_weights);
    set_ptr(a.slot_map, c.slot_map);
    set_ptr(a.out, c.out);
    set_ptr(a.counters, c.counters);
    a.request_bytes = c.request_bytes;
    a.area_tag = static_cast<uint32_t>(c.area_tag);
    a.defer_acks = phase == 0;
    const int num_sms = c.context.num_sms, num_experts = c.num_experts;
    const int recv_blocks = num_blocks(c.num_tokens, a.chunk_tokens);
    if (c.partials != 0) {
        // Its send's blocks wait for each other through the peers: all resident at once, or not
        // launched (the host then raises; fewer SMs than the device has, under MPS or green contexts).
        if (!fits_at_once<ll::combine_partials>(num_sms, 0, num_sms))
            return static_cast<int>(cudaErrorCooperativeLaunchTooLarge);
        if (phase == 0 && recv_blocks <= num_sms) {
            a.phase = ll::kBothPhases;
            return static_cast<int>(launch_cooperative(ll::combine_partials, num_sms, 0, stream, a));
        }
        if (phase != 2) {
            a.phase = ll::kSendPhase;
            const cudaError_t launched = launch_cooperative(ll::combine_partials, num_sms, 0, stream, a);
            if (launched != cudaSuccess) return static_cast<int>(launched);
        }
        if (phase != 1) {
            a.phase = ll::kReceivePhase;
            ll::combine_partials<<<recv_blocks, ll::kThreads, 0, stream>>>(a);
        }
        return static_cast<int>(cudaGetLastError());
    }
    // The send's blocks: single-batch overlap's (the send waits for the expert GEMM on the blocks
    // it is left: the GEMM holds the other SMs); with every peer mapped, one per SM, each taking its
    // units a batch at a time; else one per (local expert, source).
    bool any_remote = false;
    for (int r = 0; r < a.num_ranks; ++r) any_remote |= a.peers.bufs[r] == nullptr;
    int send_blocks = num_sms, send_threads = ll::kThreads;
    if (c.computed != 0) {
        set_ptr(a.computed, c.computed);
        set_ptr(a.packed_recv_count, c.packed_recv_count);
        a.block_m = c.block_m;
        a.signals_per_expert = c.signals_per_expert;
        a.threshold = c.threshold;
        send_blocks = c.send_blocks > 0 && c.send_blocks < num_experts ? c.send_blocks : num_experts;
        send_threads = ll::kUnitThreads;
    } else if (any_remote) {
        send_blocks = num_experts, send_threads = ll::kUnitThreads;
    } else {
        a.units_together = true;
        // Both phases in one cooperative launch, where it fits.
        if (phase == 0 && recv_blocks <= num_sms && fits_at_once<ll::combine<false>>(num_sms, 0, num_sms)) {
            a.phase = ll::kBothPhases;
            const cudaError_t launched = launch_cooperative(ll::combine<false>, num_sms, 0, stream, a);
            if (launched != cudaErrorCooperativeLaunchTooLarge) return static_cast<int>(launched);
            (void)cudaGetLastError();  // fewer SMs than the device has are ours: two launches instead
        }
    }
    const auto kernel = c.computed != 0 ? ll::combine<true> : ll::combine<false>;
    if (phase != 2) {
        a.phase = ll::kSendPhase;
        kernel<<<send_blocks > 0 ? send_blocks : 1, send_threads, 0, stream>>>(a);
    }
    if (phase != 1) {
        a.phase = ll::kReceivePhase;
        kernel<<<recv_blocks, ll::kThreads, 0, stream>>>(a);
    }
    return static_cast<int>(cudaGetLastError());
}

// A call's kernels of `phase`, then `done` recorded on the stream after them (nullptr: none): the
// event the host waits on before it reads the slot's error record (after a receive), or the one a
// receive hook on another stream waits on (after a send). Recorded here, the host needs no stream
// object per call (an eager call's host time is what an eager decode step waits on).
int epcomm_ll_dispatch(const LLDispatchCall* call, int phase, cudaStream_t stream, cudaEvent_t done) {
    const int launched = launch_dispatch(call, phase, stream);
    if (launched != 0 || done == nullptr) return launched;
    return static_cast<int>(cudaEventRecord(done, stream));
}

int epcomm_ll_combine(const LLCombineCall* call, int phase, cudaStream_t stream, cudaEvent_t done) {
    const int launched = launch_combine(call, phase, stream);
    if (launched != 0 || done == nullptr) return launched;
    return static_cast<int>(cudaEventRecord(done, stream));
}

// The buffer's events (two per slot), on the current device, without timing.
int epcomm_ll_event_create(cudaEvent_t* event) {
    return static_cast<int>(cudaEventCreateWithFlags(event, cudaEventDisableTiming));
}

int epcomm_ll_event_synchronize(cudaEvent_t event) { return static_cast<int>(cudaEventSynchronize(event)); }

int epcomm_ll_stream_wait_event(cudaStream_t stream, cudaEvent_t event) {
    return static_cast<int>(cudaStreamWaitEvent(stream, event, 0));
}

int epcomm_ll_event_destroy(cudaEvent_t event) { return static_cast<int>(cudaEventDestroy(event)); }

}  // extern "C"

// epcomm_ll_struct_layout, _field_name and _field_type: the records' tables (common/records.cuh).
EPCOMM_EXPORT_RECORDS(epcomm_ll_struct, kLLCallRecords)
