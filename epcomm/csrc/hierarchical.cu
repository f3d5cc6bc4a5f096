// Hierarchical host launchers and C ABI (the NVSHMEM library).
#include "../include/epcomm/impls/hierarchical_combine.cuh"
#include "../include/epcomm/impls/hierarchical_dispatch.cuh"
#include "../include/epcomm/impls/hierarchical_notify.cuh"

namespace epcomm {
namespace hierarchical {

// ------------------------------------------------------------------ host side of the entry points
// The call's common part, from `call_params`: sym, num_ranks, num_domains, my_domain,
// ranks_per_domain, local, op, shape_tag, chunks, num_forwarders, timeout_ns, stage_offset, then each domain
// rank's IPC buffer (kMaxLocal entries), then each domain's mate's mapped NVSHMEM buffer or 0
// (kMaxDomains entries).
inline int make_call(const int64_t* p, int* info, Call* c) {
    c->sym = reinterpret_cast<uint8_t*>(p[0]);
    c->num_ranks = static_cast<int>(p[1]);
    c->num_domains = static_cast<int>(p[2]);
    c->my_domain = static_cast<int>(p[3]);
    c->ranks_per_domain = static_cast<int>(p[4]);
    c->local = static_cast<int>(p[5]);
    c->op = static_cast<int>(p[6]);  // for error records (the call number lives on the GPU: advance_kernel)
    c->shape_tag = static_cast<int>(p[7] & ((1 << kTagBits) - 1));
    c->chunks = static_cast<int>(p[8]);
    c->num_forwarders = static_cast<int>(p[9]);
    c->timeout_ns = static_cast<uint64_t>(p[10]);
    c->stage_offset = p[11];
    c->info = info;
    if (c->num_domains < 1 || c->num_domains > kMaxDomains || c->ranks_per_domain < 1 ||
        c->ranks_per_domain > kMaxLocal || c->chunks < 1 || c->chunks > kMaxChunks || c->num_forwarders < 1 ||
        c->num_forwarders > kMaxForwarders || c->num_ranks > kMaxGroupRanks)
        return static_cast<int>(cudaErrorInvalidValue);
    for (int i = 0; i < c->ranks_per_domain; ++i) c->peers[i] = reinterpret_cast<uint8_t*>(p[12 + i]);
    for (int d = 0; d < c->num_domains; ++d) c->mates[d] = reinterpret_cast<uint8_t*>(p[12 + kMaxLocal + d]);
    return 0;
}

// Blocks of 256 threads, a warp per token (at most 1024 blocks).
inline int grid_for(int num_tokens) {
    const int blocks = (num_tokens + 7) / 8;
    return blocks < 1 ? 1 : (blocks < 1024 ? blocks : 1024);
}

}  // namespace hierarchical
}  // namespace epcomm

using namespace epcomm::hierarchical;

extern "C" {

int epcomm_hierarchical_constant(const char* name) {
    const struct {
        const char* name;
        int value;
    } entries[] = {{"sym_header_bytes", static_cast<int>(kSymHeaderBytes)},
                   {"domain_header_bytes", static_cast<int>(kDomainHeaderBytes)},
                   {"max_domains", kMaxDomains}, {"max_chunks", kMaxChunks}, {"max_local", kMaxLocal},
                   {"max_forwarders", kMaxForwarders}, {"info_ints", kInfoInts}, {"tag_bits", kTagBits},
                   {"max_group_ranks", kMaxGroupRanks}};
    for (const auto& e : entries)
        if (std::strcmp(e.name, name) == 0) return e.value;
    return -1;
}

// counts: the counts area's offset, its row width (ints), the ints of this call's rows.
int epcomm_hierarchical_notify(const int64_t* call_params, int64_t counts_offset, int width, int row_ints, int* info,
                              cudaStream_t stream) {
    Call c{};
    const int status = make_call(call_params, info, &c);
    if (status != 0) return status;
    if (row_ints > width || row_ints < 2) return static_cast<int>(cudaErrorInvalidValue);
    notify_kernel<<<c.num_ranks, 32, 0, stream>>>(c, counts_offset, width, row_ints);
    return static_cast<int>(cudaGetLastError());
}

// outgoing_digest, refused, digest: the notify's outgoing digest word, plan_kernel's refusal word
// and the call's shape digest (used when notify != 0).
int epcomm_hierarchical_advance(void* sym, int notify, int* outgoing_digest, int* refused, int digest,
                                cudaStream_t stream) {
    if (notify && (outgoing_digest == nullptr || refused == nullptr || digest < 0))
        return static_cast<int>(cudaErrorInvalidValue);
    advance_kernel<<<1, 1, 0, stream>>>(static_cast<uint8_t*>(sym), notify, outgoing_digest, refused, digest);
    return static_cast<int>(cudaGetLastError());
}

// sizes: num_tokens, num_ranks, num_domains, ranks_per_domain, num_topk, num_experts, table_ints,
// region_rows.
int epcomm_hierarchical_plan(const bool* in_rank, const int* tokens_per_rank, const int* tokens_per_expert,
                             const int64_t* topk_idx, const int64_t* sizes, int* outgoing, int* refused, int* slots,
                             bool* flags, int* pos, int* send_counts, int* recv_counts, int* slot_table,
                             int* region_tokens, cudaStream_t stream) {
    PlanArgs a{in_rank, tokens_per_rank, tokens_per_expert, topk_idx};
    a.num_tokens = static_cast<int>(sizes[0]);
    a.num_ranks = static_cast<int>(sizes[1]);
    a.num_domains = static_cast<int>(sizes[2]);
    a.ranks_per_domain = static_cast<int>(sizes[3]);
    a.num_topk = static_cast<int>(sizes[4]);
    a.num_experts = static_cast<int>(sizes[5]);
    a.table_ints = sizes[6];
    a.region_rows = sizes[7];
    a.region_tokens = region_tokens;
    a.outgoing = outgoing;
    a.refused = refused;
    a.slots = slots;
    a.flags = flags;
    a.pos = pos;
    a.send_counts = send_counts;
    a.recv_counts = recv_counts;
    a.slot_table = slot_table;
    if (a.num_ranks != a.num_domains * a.ranks_per_domain || a.num_ranks < 1 || a.num_tokens < 0)
        return static_cast<int>(cudaErrorInvalidValue);
    plan_kernel<<<a.num_ranks + a.num_domains, kPlanThreads, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

// current: the notify's rows (width ints each); summary: host-mapped.
// limits: region_rows, recv_rows, rounds (CountsArgs).
int epcomm_hierarchical_counts(const int* current, int width, int num_ranks, int rank, int experts_per_rank,
                               int num_domains, int* matrix, int* start, int* recv_total, int* summary,
                               int* send_counts, const int64_t* limits, cudaStream_t stream) {
    const CountsArgs a{current, width, num_ranks, rank, experts_per_rank, num_domains, matrix, start, recv_total,
                       summary, send_counts, limits[0], limits[1], static_cast<int>(limits[2])};
    counts_kernel<<<1, 1024, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

// params: area, region_rows, off[5], out_off[4], out_rows, x_bytes, num_scales, num_topk,
// experts_per_rank, with_weights, fresh, num_out, scale_stride0, scale_stride1.
// own: the caller's x, scales, top-k ids, weights, the [T, R] slots and region_tokens (null where absent).
int epcomm_hierarchical_dispatch(const int64_t* call_params, const int64_t* params,
                                const int* send_counts, int* recv_counts, const int* start, const int* matrix,
                                int* slots, const int* recv_total, const void* const* own, int* info,
                                cudaStream_t stream) {
    DispatchArgs a{};
    const int status = make_call(call_params, info, &a.c);
    if (status != 0) return status;
    a.area = params[0];
    a.region_rows = params[1];
    for (int f = 0; f < kNumFields; ++f) a.off[f] = params[2 + f];
    for (int f = 0; f < kNumOutFields; ++f) a.out_off[f] = params[7 + f];
    a.out_rows = params[11];
    a.x_bytes = params[12];
    a.num_scales = static_cast<int>(params[13]);
    a.num_topk = static_cast<int>(params[14]);
    a.experts_per_rank = static_cast<int>(params[15]);
    a.with_weights = params[16] != 0;
    a.fresh = params[17] != 0;
    a.num_out = params[18];
    a.scale_stride0 = params[19];
    a.scale_stride1 = params[20];
    a.x = static_cast<const uint8_t*>(own[0]);
    a.scales = static_cast<const int*>(own[1]);
    a.topk_idx = static_cast<const int64_t*>(own[2]);
    a.weights = static_cast<const float*>(own[3]);
    a.token_slots = static_cast<const int*>(own[4]);
    a.region_tokens = static_cast<const int*>(own[5]);
    a.recv_total = recv_total;
    a.send_counts = send_counts;
    a.recv_counts = recv_counts;
    a.start = start;
    a.matrix = matrix;
    a.slots = slots;
    // (The own pointers may be null with no tokens: an empty tensor's; no own row reads them then.)
    if (a.x_bytes % 16 != 0 || a.num_topk > epcomm::kWarpSize || a.region_tokens == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    dispatch_kernel<<<(a.c.num_domains - 1) * a.c.chunks + a.c.num_forwarders, kDispatchThreads, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

int epcomm_hierarchical_stage(const void* x, int64_t x_bytes, const void* scales, int num_scales, int64_t scale_stride0,
                             int64_t scale_stride1, const int64_t* topk_idx, const float* weights, int num_topk,
                             const int* slots, const bool* flags, const int* pos, int num_tokens, int num_domains,
                             int ranks_per_domain, int experts_per_domain, unsigned stage_mask, void* stage,
                             int64_t region_rows, const int64_t* offsets, cudaStream_t stream) {
    if (num_tokens == 0 || stage_mask == 0) return 0;  // every region is read unstaged
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
    a.slots = slots;
    a.flags = flags;
    a.pos = pos;
    a.num_tokens = num_tokens;
    a.num_domains = num_domains;
    a.ranks_per_domain = ranks_per_domain;
    a.experts_per_domain = experts_per_domain;
    a.stage_mask = stage_mask;
    a.stage = static_cast<uint8_t*>(stage);
    a.region_rows = region_rows;
    a.off_x = offsets[0];
    a.off_scales = offsets[1];
    a.off_topk = offsets[2];
    a.off_weights = offsets[3];
    a.off_slots = offsets[4];
    stage_kernel<<<grid_for(num_tokens), 256, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

// offsets: of each field's array in the IPC area; sizes: num_rows, x_bytes, num_scales, num_topk,
// scale_stride0, scale_stride1 (of the output scales, in elements).
int epcomm_hierarchical_copy_out(const void* area, const int64_t* offsets, const int64_t* sizes, void* x, int* scales,
                                 int64_t* topk_idx, float* weights, cudaStream_t stream) {
    CopyOutArgs a{static_cast<const uint8_t*>(area)};
    for (int f = 0; f < kNumOutFields; ++f) a.off[f] = offsets[f];
    a.num_rows = sizes[0];
    a.x_bytes = sizes[1];
    a.num_scales = static_cast<int>(sizes[2]);
    a.num_topk = static_cast<int>(sizes[3]);
    a.scale_stride0 = sizes[4];
    a.scale_stride1 = sizes[5];
    a.x = static_cast<uint8_t*>(x);
    a.scales = scales;
    a.topk_idx = topk_idx;
    a.weights = weights;
    if (a.num_rows == 0) return 0;
    if (a.x_bytes % 16 != 0 || a.num_topk > epcomm::kWarpSize || (reinterpret_cast<uintptr_t>(x) % 16) != 0)
        return static_cast<int>(cudaErrorInvalidValue);
    copy_out_kernel<<<grid_for(static_cast<int>(a.num_rows < (1 << 30) ? a.num_rows : (1 << 30))), 256, 0,
                      stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

}  // extern "C"


extern "C" {

// params: area, region_rows, off_partial, off_partial_weights, in_off_y, in_off_weights, hidden, num_topk,
// in_rows.
int epcomm_hierarchical_combine(const int64_t* call_params, const int64_t* params,
                               const int* counts, const int* start, const int* slots, int* info, cudaStream_t stream) {
    CombineArgs a{};
    const int status = make_call(call_params, info, &a.c);
    if (status != 0) return status;
    a.area = params[0];
    a.region_rows = params[1];
    a.off_partial = params[2];
    a.off_partial_weights = params[3];
    a.in_off_y = params[4];
    a.in_off_weights = params[5];
    a.in_rows = params[8];
    a.hidden = static_cast<int>(params[6]);
    a.num_topk = static_cast<int>(params[7]);
    a.counts = counts;
    a.start = start;
    a.slots = slots;
    if (a.hidden % 8 != 0 || a.num_topk > epcomm::kWarpSize) return static_cast<int>(cudaErrorInvalidValue);
    combine_kernel<<<a.c.num_forwarders, kCombineThreads, 0, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

int epcomm_hierarchical_reduce(const float* partial, const float* partial_weights, int64_t region_rows,
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
