// Hierarchical dispatch: staging, the kernel that runs both tiers (puts between domains, forwarding
// inside), and the copy of the received rows out of the IPC area.
#pragma once

#include "hierarchical_protocol.cuh"

namespace epcomm {
namespace hierarchical {

// ------------------------------------------------------------------ dispatch
// Slow-tier fields, in each area: token rows, scales, top-k ids (of the destination domain's
// experts), weights, slots (per domain rank: the row's place in its block of this source there, -1).
enum { kX, kScales, kTopk, kWeights, kSlots, kNumFields };

// Fast-tier fields, in each rank's IPC area: token rows, scales, top-k ids (the rank's), weights.
enum { kOutX, kOutScales, kOutTopk, kOutWeights, kNumOutFields };

struct DispatchArgs {
    Call c;
    int64_t area, region_rows;
    int64_t off[kNumFields];       // of each field's array in the staging area (the receive area: + area)
    int64_t out_off[kNumOutFields];  // of each field's array in the IPC buffer
    int64_t out_rows;              // rows each IPC area holds
    int64_t x_bytes;
    int num_scales, num_topk, experts_per_rank;
    bool with_weights, fresh;      // fresh: routing travels (slots, top-k); cached: rows and scales only
    const int* send_counts;        // [D]
    int* recv_counts;              // [D] written
    const int* start;              // [R, R]: where source s's block starts in rank r's output
    const int* matrix;             // [R, R]: rows source s sends rank r (a slot past it is refused)
    int* slots;                    // [D * region_rows, L]: fresh: written (the handle keeps them); cached: read
    const int* recv_total;         // rows this rank receives (device: no host sync needed)
    int64_t num_out;               // rows of its outputs with num_worst_tokens, else -1 (the host sizes them)
    // Regions not staged (this rank's own domain's, forwarded here, and those of mates NVLink maps,
    // stored there) are read straight from the caller's tensors: region_tokens[d][p] is the token of
    // row p of region d; token_slots [T, R] its slots (fresh).
    const uint8_t* x;
    const int* scales;             // 4-byte words at t * scale_stride0 + c * scale_stride1
    int64_t scale_stride0, scale_stride1;
    const int64_t* topk_idx;       // [T, K] global expert ids (fresh)
    const float* weights;          // [T, K] (fresh, with_weights)
    const int* token_slots;        // [T, R] (fresh)
    const int* region_tokens;      // [D, region_rows]
};

// Staging (before the dispatch kernel): token t goes to staging region d, row pos[t][d], for every
// domain d in stage_mask (mates reached by puts) it has a destination in (flags[t][d]; the own
// domain's region and the mapped mates' are read from the caller's tensors); pos is the exclusive
// prefix count of flags over
// tokens, so each region holds its tokens in ascending order. Its top-k ids become ids of d's
// experts (-1 where the expert is elsewhere), and its slots (the token's index among this rank's
// tokens to each rank, -1 if not sent there) shrink to d's ranks. One warp per token: x is read once
// for all its domains. Null pointers: fields not staged (a cached dispatch moves x and scales only).
struct StageArgs {
    const uint8_t* x;
    int64_t x_bytes;
    const uint8_t* scales;  // 4-byte elements at t * scale_stride0 + c * scale_stride1 (elements)
    int num_scales;
    int64_t scale_stride0, scale_stride1;
    const int64_t* topk_idx;
    const float* weights;
    int num_topk;
    const int* slots;       // [T, num_domains * ranks_per_domain]
    const bool* flags;      // [T, D]
    const int* pos;         // [T, D]
    int num_tokens, num_domains, ranks_per_domain, experts_per_domain;
    unsigned stage_mask;    // bit d: stage region d (a mate reached by puts); the others are read unstaged
    uint8_t* stage;
    int64_t region_rows;
    int64_t off_x, off_scales, off_topk, off_weights, off_slots;
};

// After the dispatch kernel: this rank's received rows out of its IPC area (the next call reuses
// it) into the caller's tensors, every field in one launch; a warp per row. Scales are written with
// the output's strides (in elements), so column-major scales come back column-major.
struct CopyOutArgs {
    const uint8_t* area;           // this rank's IPC receive area (after the header)
    int64_t off[kNumOutFields];    // of each field's array in it
    int64_t num_rows, x_bytes;
    int num_scales, num_topk;
    int64_t scale_stride0, scale_stride1;
    uint8_t* x;
    int* scales;                   // or null
    int64_t* topk_idx;             // or null
    float* weights;                // or null
};

// num_worst_tokens padding: this rank's rows [recv_total, num_out) get x = 0, scales = 0, ids = -1,
// weights = 0 (the reference's padding); more received rows than num_out is an error (4). The
// forwarder blocks share the rows; no other rank writes there.
__device__ void pad_rows(const DispatchArgs& a, int b) {
    const Call& c = a.c;
    const int64_t total = *a.recv_total;
    if (total > a.out_rows) {  // this rank's receive area cannot hold its rows (the forwarders skip them)
        if (b == 0 && threadIdx.x == 0) c.report(kErrCapacity, c.domain_rank(c.local));
        return;
    }
    if (a.num_out < 0) return;
    if (total > a.num_out) {
        if (b == 0 && threadIdx.x == 0) c.report(kErrWorstTokens, c.domain_rank(c.local));
        return;
    }
    uint8_t* out = c.peers[c.local] + kDomainHeaderBytes;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, num_warps = kDispatchThreads / kWarpSize;
    const int K = a.num_topk;
    for (int64_t p = total + b * num_warps + warp; p < a.num_out; p += c.num_forwarders * num_warps) {
        int4* x = reinterpret_cast<int4*>(out + a.out_off[kOutX] + p * a.x_bytes);
        for (int k = lane; k < a.x_bytes / 16; k += kWarpSize) x[k] = make_int4(0, 0, 0, 0);
        int* scales = reinterpret_cast<int*>(out + a.out_off[kOutScales] + p * a.num_scales * 4);
        for (int k = lane; k < a.num_scales; k += kWarpSize) scales[k] = 0;
        if (a.fresh && lane < K) {
            reinterpret_cast<int64_t*>(out + a.out_off[kOutTopk] + p * K * 8)[lane] = -1;
            if (a.with_weights) reinterpret_cast<float*>(out + a.out_off[kOutWeights] + p * K * 4)[lane] = 0.f;
        }
    }
}

// Rows [lo, hi) of region d, for a mate that NVLink maps here, stored straight into its receive area
// (region my_domain) from the caller's tensors, a warp per row, in the staged layout: the token's x,
// scales, top-k ids rebased to domain d's experts, weights and its slots at d's ranks. Staging them
// first (stage_kernel) would be a local copy more of every row.
__device__ void send_rows_unstaged(const DispatchArgs& a, int d, int64_t lo, int64_t hi) {
    const Call& c = a.c;
    const int L = c.ranks_per_domain, K = a.num_topk, R = c.num_ranks;
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, num_warps = kDispatchThreads / kWarpSize;
    uint8_t* recv = c.mates[d] + c.stage_offset + a.area;
    const int64_t experts_per_domain = static_cast<int64_t>(L) * a.experts_per_rank;
    for (int64_t p = lo + warp; p < hi; p += num_warps) {
        const int64_t t = a.region_tokens[d * a.region_rows + p];
        const int64_t q = c.my_domain * a.region_rows + p;  // its row in the mate's receive area
        warp_copy_int4(reinterpret_cast<int4*>(recv + a.off[kX] + q * a.x_bytes),
                       reinterpret_cast<const int4*>(a.x + t * a.x_bytes), static_cast<int>(a.x_bytes / 16), lane);
        int* scales = reinterpret_cast<int*>(recv + a.off[kScales] + q * a.num_scales * 4);
        for (int k = lane; k < a.num_scales; k += kWarpSize)
            scales[k] = a.scales[t * a.scale_stride0 + k * a.scale_stride1];
        if (!a.fresh) continue;  // a cached dispatch moves rows and scales only
        if (lane < K) {
            const int64_t e = a.topk_idx[t * K + lane] - d * experts_per_domain;
            reinterpret_cast<int64_t*>(recv + a.off[kTopk] + q * K * 8)[lane] = e >= 0 && e < experts_per_domain ? e : -1;
            if (a.with_weights) reinterpret_cast<float*>(recv + a.off[kWeights] + q * K * 4)[lane] = a.weights[t * K + lane];
        }
        if (lane < L) reinterpret_cast<int*>(recv + a.off[kSlots] + q * L * 4)[lane] = a.token_slots[t * R + d * L + lane];
    }
}

// Sender block for chunk j of region d (another domain): once the mate has entered the call, its
// rows go to the mate's receive area, then the chunk's signal (with the region's count; a given-up
// call sends no rows and a done word that says so: mate_to_send).
__device__ void send_chunk(const DispatchArgs& a, int d, int j) {
    const Call& c = a.c;
    __shared__ int s_ok;
    if (threadIdx.x == 0) {
        if (j == 0)
            nvshmemx_signal_op(reinterpret_cast<uint64_t*>(sym_ready(c.sym, c.my_domain)),
                               static_cast<uint64_t>(c.entered()), NVSHMEM_SIGNAL_SET, c.mate(d));
        const uint64_t start = global_timer_ns();
        s_ok = mate_to_send(c, d, j, wait_entered(c, sym_ready(c.sym, d), c.mate(d), kPhaseSend), start);
    }
    __syncthreads();
    if (!s_ok) return;
    const int64_t count = a.send_counts[d];
    int64_t lo, hi;
    chunk_rows(count, c.chunks, j, &lo, &hi);
    if (c.mates[d] != nullptr) {  // mapped: each row from the caller's tensors into the mate's receive area
        send_rows_unstaged(a, d, lo, hi);
        finish_to_mate(c, d, j, count);
        return;
    }
    const int64_t bytes[kNumFields] = {a.x_bytes, a.num_scales * 4, a.fresh ? a.num_topk * 8 : 0,
                                       a.fresh && a.with_weights ? a.num_topk * 4 : 0,
                                       a.fresh ? c.ranks_per_domain * 4 : 0};
    for (int f = 0; f < kNumFields; ++f) {
        if (bytes[f] == 0 || hi <= lo) continue;
        const int64_t src = c.stage_offset + a.off[f] + (d * a.region_rows + lo) * bytes[f];
        const int64_t dst = c.stage_offset + a.area + a.off[f] + (c.my_domain * a.region_rows + lo) * bytes[f];
        copy_to_mate(c, d, dst, src, (hi - lo) * bytes[f]);
    }
    finish_to_mate(c, d, j, count);
}

// Forward the rows of chunk j of region d (source s = d's mate of this rank) to the domain's ranks:
// another domain's from the receive area, this rank's own domain's straight from the caller's
// tensors (through region_tokens; staging them would be a copy more of every row).
__device__ void forward_chunk(const DispatchArgs& a, int d, int j) {
    const Call& c = a.c;
    __shared__ int s_count;
    const bool own = d == c.my_domain;  // this rank's own tokens: read from the caller's tensors
    if (threadIdx.x == 0) {
        s_count = own ? a.send_counts[d] : wait_chunk(c, d, j, kPhaseReceive);
        if (c.aborted()) s_count = -1;  // a given-up call forwards nothing (its counts may be zeros)
        if (j == 0 && s_count >= 0) a.recv_counts[d] = s_count;
    }
    __syncthreads();
    if (s_count < 0) {
        __syncthreads();  // s_count is rewritten by the block's next chunk
        return;
    }
    int64_t lo, hi;
    chunk_rows(s_count, c.chunks, j, &lo, &hi);
    const uint8_t* recv = c.sym + c.stage_offset + a.area;  // other regions: the mates' rows landed there
    const int L = c.ranks_per_domain, K = a.num_topk, R = c.num_ranks;
    const int s = c.mate(d);
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, num_warps = kDispatchThreads / kWarpSize;
    for (int64_t p = lo + warp; p < hi; p += num_warps) {
        const int64_t q = d * a.region_rows + p;
        const int64_t t = own ? a.region_tokens[q] : -1;  // own region: the row's token in the caller's tensors
        int slot_lane = -1;
        if (lane < L) {
            if (a.fresh) {
                slot_lane = own ? a.token_slots[t * R + c.domain_rank(lane)]
                                : reinterpret_cast<const int*>(recv + a.off[kSlots] + q * L * 4)[lane];
                a.slots[q * L + lane] = slot_lane;
            } else {
                slot_lane = a.slots[q * L + lane];
            }
        }
        const int4* x = reinterpret_cast<const int4*>(own ? a.x + t * a.x_bytes : recv + a.off[kX] + q * a.x_bytes);
        for (int i = 0; i < L; ++i) {
            const int slot = __shfl_sync(kFullMask, slot_lane, i);
            if (slot < 0) continue;
            const int r = c.domain_rank(i);
            // Rows that would land outside their block or the receive area are skipped and reported,
            // without giving up the call: the others still arrive, so every rank reaches its host
            // check instead of waiting out the timeout.
            if (slot >= a.matrix[s * R + r]) {  // more rows than the source's counts promised
                if (lane == 0) c.report(kErrRefused, s);
                continue;
            }
            const int64_t pos = static_cast<int64_t>(a.start[s * R + r]) + slot;
            if (pos >= a.out_rows) {
                if (lane == 0) c.report(kErrCapacity, r);
                continue;
            }
            uint8_t* out = c.peers[i] + kDomainHeaderBytes;
            warp_copy_int4(reinterpret_cast<int4*>(out + a.out_off[kOutX] + pos * a.x_bytes), x,
                           static_cast<int>(a.x_bytes / 16), lane);
            if (a.num_scales > 0) {
                int* dst = reinterpret_cast<int*>(out + a.out_off[kOutScales] + pos * a.num_scales * 4);
                if (own) {
                    for (int k = lane; k < a.num_scales; k += kWarpSize)
                        dst[k] = a.scales[t * a.scale_stride0 + k * a.scale_stride1];
                } else {
                    const int* src = reinterpret_cast<const int*>(recv + a.off[kScales] + q * a.num_scales * 4);
                    for (int k = lane; k < a.num_scales; k += kWarpSize) dst[k] = src[k];
                }
            }
            if (a.fresh && lane < K) {  // the domain's expert ids become rank r's (-1: another rank's)
                // Staged rows carry the domain's ids; the own region's come global from the caller.
                const int64_t e = own ? a.topk_idx[t * K + lane] - static_cast<int64_t>(c.my_domain) * L *
                                                                       a.experts_per_rank
                                      : reinterpret_cast<const int64_t*>(recv + a.off[kTopk] + q * K * 8)[lane];
                const int64_t first = static_cast<int64_t>(i) * a.experts_per_rank;
                const bool mine = e >= first && e < first + a.experts_per_rank;
                reinterpret_cast<int64_t*>(out + a.out_off[kOutTopk] + pos * K * 8)[lane] = mine ? e - first : -1;
                if (a.with_weights) {
                    const float w = own ? a.weights[t * K + lane]
                                        : reinterpret_cast<const float*>(recv + a.off[kWeights] + q * K * 4)[lane];
                    reinterpret_cast<float*>(out + a.out_off[kOutWeights] + pos * K * 4)[lane] = mine ? w : 0.f;
                }
            }
        }
    }
    __syncthreads();  // s_count is reused by the block's next chunk
}

// Blocks [0, (D - 1) x chunks) send a chunk of another domain's region each; the others forward
// every region's chunks (this rank's own region straight from the caller's tensors, region_tokens).
__global__ void __launch_bounds__(kDispatchThreads, 1) dispatch_kernel(DispatchArgs a) {
    const Call& c = a.c;
    const int num_senders = (c.num_domains - 1) * c.chunks;
    if (static_cast<int>(blockIdx.x) < num_senders) {
        const int other = blockIdx.x / c.chunks;
        send_chunk(a, other < c.my_domain ? other : other + 1, blockIdx.x % c.chunks);
        return;
    }
    const int b = blockIdx.x - num_senders;
    if (b == 0 && threadIdx.x == 0) enter_domain(c);
    pad_rows(a, b);
    if (domain_entered(c, kPhaseReceive)) {
        const int num_chunks = c.num_domains * c.chunks;
        for (int k = b; k < num_chunks; k += c.num_forwarders) forward_chunk(a, k / c.chunks, k % c.chunks);
    }
    leave_domain(c, b, kPhaseReceive);
}

__global__ void __launch_bounds__(256) stage_kernel(StageArgs a) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarpSize;
    const int num_warps = gridDim.x * blockDim.x / kWarpSize;
    const int D = a.num_domains, L = a.ranks_per_domain, K = a.num_topk;
    for (int t = warp; t < a.num_tokens; t += num_warps) {
        const int4* x = reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * a.x_bytes);
        for (int d = 0; d < D; ++d) {
            if (!(a.stage_mask >> d & 1u) || !a.flags[static_cast<int64_t>(t) * D + d]) continue;
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
            if (a.slots != nullptr && lane < L)
                reinterpret_cast<int*>(a.stage + a.off_slots + row * L * 4)[lane] =
                    a.slots[static_cast<int64_t>(t) * D * L + d * L + lane];
        }
    }
}

__global__ void __launch_bounds__(256) copy_out_kernel(CopyOutArgs a) {
    const int lane = threadIdx.x % kWarpSize;
    const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
    const int K = a.num_topk;
    for (int64_t p = warp; p < a.num_rows; p += num_warps) {
        warp_copy_int4(reinterpret_cast<int4*>(a.x + p * a.x_bytes),
                       reinterpret_cast<const int4*>(a.area + a.off[kOutX] + p * a.x_bytes),
                       static_cast<int>(a.x_bytes / 16), lane);
        if (a.scales != nullptr) {
            const int* src = reinterpret_cast<const int*>(a.area + a.off[kOutScales]) + p * a.num_scales;
            for (int k = lane; k < a.num_scales; k += kWarpSize)
                a.scales[p * a.scale_stride0 + k * a.scale_stride1] = src[k];
        }
        if (a.topk_idx != nullptr && lane < K)
            a.topk_idx[p * K + lane] = reinterpret_cast<const int64_t*>(a.area + a.off[kOutTopk])[p * K + lane];
        if (a.weights != nullptr && lane < K)
            a.weights[p * K + lane] = reinterpret_cast<const float*>(a.area + a.off[kOutWeights])[p * K + lane];
    }
}

}  // namespace hierarchical
}  // namespace epcomm
