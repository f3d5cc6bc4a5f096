// Hierarchical combine: forwarders pull their domain's rows, sum them and put the partial sums back;
// the source sums the partials in domain order.
#pragma once

#include "hierarchical_protocol.cuh"

namespace epcomm {
namespace hierarchical {

// ------------------------------------------------------------------ combine
struct CombineArgs {
    Call c;
    int64_t area, region_rows;
    int64_t off_partial, off_partial_weights;  // in the staging area (the receive area: + area)
    int64_t in_off_y, in_off_weights;          // in the IPC buffer: this call's expert outputs and weights
    int hidden, num_topk;
    const int* counts;  // [D] rows of each region the dispatch forwarded (from its recv_counts)
    const int* start;
    const int* slots;
    int64_t in_rows;    // rows each domain rank's IPC area holds (a position past it is an error)
};

// The source's sum after the combine kernel: token t adds, in fp32 and ascending domain
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

// Sum, for each row of chunk j of region d, what the domain's ranks return for it, and send the
// chunk's partial sums to the source's mate area: written there directly when the mate is this rank
// or mapped, else staged and put.
__device__ void reduce_chunk(const CombineArgs& a, int d, int j) {
    const Call& c = a.c;
    __shared__ int s_ok;
    const bool own = d == c.my_domain, direct = own || c.mates[d] != nullptr;
    if (threadIdx.x == 0) {  // the mate's area is free; a given-up call sends no sums, says so (mate_to_send)
        const uint64_t start = global_timer_ns();
        s_ok = own ? !c.aborted()
                   : mate_to_send(c, d, j, wait_entered(c, sym_ready(c.sym, d), c.mate(d), kPhaseSend), start);
    }
    __syncthreads();
    if (!s_ok) {
        __syncthreads();  // s_ok is rewritten by the block's next chunk
        return;
    }
    const int L = c.ranks_per_domain, K = a.num_topk, R = c.num_ranks, H = a.hidden;
    const int s = c.mate(d);
    const int64_t count = min(static_cast<int64_t>(a.counts[d]), a.region_rows);
    int64_t lo, hi;
    chunk_rows(count, c.chunks, j, &lo, &hi);
    // Where the partial sums go: row my_domain x region_rows + p of the mate's receive area, or row
    // d x region_rows + p of this rank's staging area.
    uint8_t* dst_base = own ? c.sym + c.stage_offset + a.area
                            : (direct ? c.mates[d] + c.stage_offset + a.area : c.sym + c.stage_offset);
    const int64_t dst_region = direct ? c.my_domain : d;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, num_warps = kCombineThreads / kWarpSize;
    for (int64_t p = lo + warp; p < hi; p += num_warps) {
        const int64_t q = d * a.region_rows + p, q_dst = dst_region * a.region_rows + p;
        // Lane i < L: the row's position at domain rank i, or -1 (not sent there, or past the area).
        int64_t pos_lane = -1;
        if (lane < L) {
            const int slot = a.slots[q * L + lane];
            if (slot >= 0) {
                pos_lane = static_cast<int64_t>(a.start[s * R + c.domain_rank(lane)]) + slot;
                if (pos_lane >= a.in_rows) {
                    c.report(kErrCapacity, c.domain_rank(lane));
                    pos_lane = -1;
                }
            }
        }
        // The rows' addresses stay in registers through the sum; the weights' are made when used
        // (both at once would spill at 1024 threads per block).
        const int4* rows[kMaxLocal];
#pragma unroll
        for (int i = 0; i < kMaxLocal; ++i) {
            const int64_t pos = __shfl_sync(kFullMask, pos_lane, i);
            rows[i] = i < L && pos >= 0
                          ? reinterpret_cast<const int4*>(c.peers[i] + kDomainHeaderBytes + a.in_off_y + pos * H * 2)
                          : nullptr;
        }
        float4* partial = reinterpret_cast<float4*>(dst_base + a.off_partial + q_dst * H * 4);
        for (int k = lane; k < H / 8; k += kWarpSize) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int i = 0; i < kMaxLocal; ++i) {
                if (rows[i] == nullptr) continue;
                add_bf16x8(acc, rows[i][k]);
            }
            partial[2 * k] = make_float4(acc[0], acc[1], acc[2], acc[3]);
            partial[2 * k + 1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
        }
        if (K > 0) {
            float acc = 0.f;
            for (int i = 0; i < L; ++i) {  // ascending rank order, as the rows
                const int64_t pos = __shfl_sync(kFullMask, pos_lane, i);
                if (pos >= 0 && lane < K)
                    acc += reinterpret_cast<const float*>(c.peers[i] + kDomainHeaderBytes + a.in_off_weights)[pos * K +
                                                                                                            lane];
            }
            if (lane < K) reinterpret_cast<float*>(dst_base + a.off_partial_weights + q_dst * K * 4)[lane] = acc;
        }
    }
    if (own) {
        __syncthreads();  // s_ok is reused by the block's next chunk
        return;
    }
    if (!direct) {
        __syncthreads();
        const int64_t at = c.my_domain * a.region_rows + lo, from = d * a.region_rows + lo;
        copy_to_mate(c, d, c.stage_offset + a.area + a.off_partial + at * H * 4,
                     c.stage_offset + a.off_partial + from * H * 4, (hi - lo) * H * 4);
        copy_to_mate(c, d, c.stage_offset + a.area + a.off_partial_weights + at * K * 4,
                     c.stage_offset + a.off_partial_weights + from * K * 4, (hi - lo) * K * 4);
    }
    finish_to_mate(c, d, j, count);
    __syncthreads();
}

__global__ void __launch_bounds__(kCombineThreads, 1) combine_kernel(CombineArgs a) {
    const Call& c = a.c;
    const int b = blockIdx.x, num_chunks = c.num_domains * c.chunks;
    if (b == 0 && threadIdx.x == 0) {
        enter_domain(c);  // this rank's expert outputs are in its IPC area
        for (int d = 0; d < c.num_domains; ++d)  // its receive area is free for the partial sums
            nvshmemx_signal_op(reinterpret_cast<uint64_t*>(sym_ready(c.sym, c.my_domain)),
                               static_cast<uint64_t>(c.entered()), NVSHMEM_SIGNAL_SET, c.mate(d));
    }
    // Every chunk is visited even when the domain's entry failed (the call is then given up): its
    // mate still gets the done word that says so (reduce_chunk, mate_to_send).
    domain_entered(c, kPhaseReduce);
    for (int k = b; k < num_chunks; k += c.num_forwarders) reduce_chunk(a, k / c.chunks, k % c.chunks);
    leave_domain(c, b, kPhaseReduce);  // no domain rank reads this rank's expert outputs any more
    // The partial sums of this rank's tokens have arrived (the blocks share the chunks to wait for;
    // this rank's own domain's were written by this kernel).
    if (threadIdx.x == 0)
        for (int k = b; k < num_chunks; k += c.num_forwarders)
            if (k / c.chunks != c.my_domain && !c.aborted()) wait_chunk(c, k / c.chunks, k % c.chunks, kPhaseReduce);
}

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
                add_bf16x8(acc, *reinterpret_cast<const int4*>(bias + static_cast<int64_t>(t) * a.hidden + 8 * c));
            }
            reinterpret_cast<int4*>(a.out + static_cast<int64_t>(t) * a.hidden)[c] = round_bf16x8(acc);
        }
        if (a.out_weights != nullptr && lane < K) {
            float acc = 0.f;
            for (int d = 0; d < D; ++d)
                if (flags[d]) acc += a.partial_weights[(d * a.region_rows + pos[d]) * K + lane];
            a.out_weights[static_cast<int64_t>(t) * K + lane] = acc;
        }
    }
}

}  // namespace hierarchical
}  // namespace epcomm
