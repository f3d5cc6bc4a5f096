// Intranode dispatch: sender warps store each token's row (and scales, top-k) into every
// destination's buffer; receiver warps copy each row out as its flag shows it landed.
#pragma once

#include "intranode_notify.cuh"

namespace epcomm {

// ------------------------------------------------------------------ dispatch
struct DispatchArgs {
    PeerTable peers;
    int rank, num_ranks, num_tokens;
    const uint8_t* x;           // [T, x_bytes]
    int x_bytes;                // H * element size, a multiple of 16
    const uint32_t* scales;     // [T, S] (fp32 or packed UE8M0 int32), any strides; nullptr for BF16
    int num_scales;
    int64_t scale_stride_t, scale_stride_c;
    const int64_t* topk_idx;    // [T, K] global expert ids, or nullptr
    const float* topk_weights;  // [T, K] or nullptr
    int num_topk, experts_per_rank;
    bool has_topk, has_weights;  // from the shapes, not the pointers (an empty tensor has none)
    const bool* in_rank;        // [T, R]
    const int* slot;            // [T, R]
    const int* own_tokens;      // [T]: token index of each of this rank's rows to itself, by slot
    const int* layout;
    int row_stride;             // bytes of one row slot in the buffer (trailer included)
    int64_t cap_rows;           // row slots the buffer holds
    uint8_t* recv_x;            // [num_out_rows, x_bytes]
    uint32_t* recv_scales;
    int64_t recv_scale_stride_t, recv_scale_stride_c;
    int64_t* recv_topk_idx;     // [num_out_rows, K] local expert ids
    float* recv_topk_weights;
    int num_out_rows;           // num_recv (host-synced) or num_worst_tokens
    int num_send_blocks;        // fused kernel: blocks [0, num_send_blocks) send, the rest receive
    // This rank's rows to itself: copied by the receivers straight from x (a split's halves, and the
    // fused kernel above 2 ranks), else written by the senders beside their stores to the peers (the
    // host's choice: CudaIntranode._launch_dispatch says why).
    bool local_by_receiver;
    int op;
    int* info;
    uint64_t timeout_ns;
};

// Where each piece of a token lives inside a dispatch row slot: x, then the top-k ids (8-byte
// aligned because x_bytes is a multiple of 16), the weights and the scales.
struct DispatchRow {
    int idx_offset, weight_offset, scale_offset;
    __device__ DispatchRow(int x_bytes, int num_topk)
        : idx_offset(x_bytes), weight_offset(x_bytes + num_topk * 8), scale_offset(x_bytes + num_topk * 12) {}
};

// Token t's top-k entry `lane` as destination d sees it: its local expert id (-1 for other
// ranks' experts) and the weight (0 there).
__device__ __forceinline__ void local_topk(const DispatchArgs& a, int64_t e, float w, int d, int64_t& local_e,
                                          float& local_w) {
    const int64_t lo = static_cast<int64_t>(d) * a.experts_per_rank;
    local_e = (e >= lo && e < lo + a.experts_per_rank) ? e - lo : -1;
    local_w = local_e >= 0 ? w : 0.f;
}

// A token's metadata as a warp holds it: lane k < K its k-th expert and weight, and its FP8 scales
// c = lane + 32 i (i < kMetaScales: up to 64 scales, H up to 8192; more are read where written).
// Loaded once, with the token's other loads, and stored from registers to every destination: a
// load per destination and scale, each waiting behind the stores before it, was a memory round
// trip per copy.
constexpr int kMetaScales = 2;
struct TokenMeta {
    int64_t e;
    float w;
    bool scales_held;  // scale[] holds the first scales (else they are read where written)
    uint32_t scale[kMetaScales];
};

// hold_scales = false for a warp that copies a row between this load and the stores: registers
// kept through the copy cost it its words in flight (docs/TUNING.md, FP8 scales in registers).
__device__ __forceinline__ TokenMeta load_token_meta(const DispatchArgs& a, int t, int lane, bool hold_scales = true) {
    TokenMeta m{-1, 0.f, hold_scales, {}};
    if (a.has_topk && lane < a.num_topk) {
        m.e = a.topk_idx[static_cast<int64_t>(t) * a.num_topk + lane];
        if (a.has_weights) m.w = a.topk_weights[static_cast<int64_t>(t) * a.num_topk + lane];
    }
    if (hold_scales) {
#pragma unroll
        for (int i = 0; i < kMetaScales; ++i) {
            const int c = lane + i * kWarpSize;
            m.scale[i] = c < a.num_scales ? a.scales[t * a.scale_stride_t + c * a.scale_stride_c] : 0;
        }
    }
    return m;
}

// Scale c of token t, for c < a.num_scales, into dst[c * stride].
__device__ __forceinline__ void write_scales(const DispatchArgs& a, int t, const TokenMeta& m, uint32_t* dst,
                                             int64_t stride, int lane) {
    int from = lane;
    if (m.scales_held) {
#pragma unroll
        for (int i = 0; i < kMetaScales; ++i) {
            const int c = lane + i * kWarpSize;
            if (c < a.num_scales) dst[c * stride] = m.scale[i];
        }
        from += kMetaScales * kWarpSize;
    }
    for (int c = from; c < a.num_scales; c += kWarpSize)
        dst[c * stride] = a.scales[t * a.scale_stride_t + c * a.scale_stride_c];
}

// Metadata of token t into this rank's own output row p (top-k ids, weights, scales).
__device__ __forceinline__ void write_own_meta(const DispatchArgs& a, int t, int64_t p, const TokenMeta& m, int lane) {
    const int K = a.num_topk;
    if (a.has_topk && lane < K) {
        int64_t local_e;
        float local_w;
        local_topk(a, m.e, m.w, a.rank, local_e, local_w);
        a.recv_topk_idx[p * K + lane] = local_e;
        if (a.has_weights) a.recv_topk_weights[p * K + lane] = local_w;
    }
    if (a.num_scales > 0)
        write_scales(a, t, m, a.recv_scales + p * a.recv_scale_stride_t, a.recv_scale_stride_c, lane);
}

// Metadata of token t into its row slot `dst_row` in destination d's buffer: top-k ids local to d,
// weights, scales. Plain stores: the caller orders them before the row's flag.
__device__ __forceinline__ void write_peer_meta(const DispatchArgs& a, uint8_t* dst_row, int d, int t,
                                                const TokenMeta& m, int lane) {
    const DispatchRow row(a.x_bytes, a.num_topk);
    if (a.has_topk && lane < a.num_topk) {
        int64_t local_e;
        float local_w;
        local_topk(a, m.e, m.w, d, local_e, local_w);
        reinterpret_cast<int64_t*>(dst_row + row.idx_offset)[lane] = local_e;
        if (a.has_weights) reinterpret_cast<float*>(dst_row + row.weight_offset)[lane] = local_w;
    }
    if (a.num_scales > 0)
        write_scales(a, t, m, reinterpret_cast<uint32_t*>(dst_row + row.scale_offset), 1, lane);
}

// What a sending warp needs of token t: lane d < R whether the token goes to rank d and is this
// sender's to write (the receivers copy this rank's own rows when `local_by_receiver`) and its
// slot there; lane k < K its k-th expert and weight. The loads do not depend on each other, so
// they are in flight together, and a warp loads its next token's route before copying this one's
// row: a warp that waited for the destinations, then the slots, then the experts spent about a
// third of its time on those latencies (docs/TUNING.md, sender route loads).
struct TokenRoute {
    bool hit;
    int slot;
    TokenMeta meta;
};

// Lane d < R: whether token t goes to rank d and is this sender's to write.
__device__ __forceinline__ bool token_hit(const DispatchArgs& a, int t, int lane) {
    if (t >= a.num_tokens || lane >= a.num_ranks) return false;
    return a.in_rank[static_cast<int64_t>(t) * a.num_ranks + lane] && !(lane == a.rank && a.local_by_receiver);
}

__device__ __forceinline__ TokenRoute load_route(const DispatchArgs& a, int t, int lane) {
    TokenRoute r{false, 0, {-1, 0.f, true, {}}};
    if (t >= a.num_tokens) return r;
    r.hit = token_hit(a, t, lane);
    if (lane < a.num_ranks) r.slot = a.slot[static_cast<int64_t>(t) * a.num_ranks + lane];
    r.meta = load_token_meta(a, t, lane);
    return r;
}

// Bit d: the token goes to rank d. A ballot: every lane of the warp calls it.
__device__ __forceinline__ unsigned route_mask(const TokenRoute& r) { return __ballot_sync(kFullMask, r.hit); }

// Lane d: where the token's row goes in destination d's output (0 where it does not go).
__device__ __forceinline__ int route_row_pos(const TokenRoute& r, const int* s_layout, int lane) {
    return r.hit ? s_layout[kLayDstBase + lane] + r.slot : 0;
}

// Sender: one warp per token; x is read once and stored to every destination. Rows to other
// ranks go to their buffers (then a flag per row); the row to this rank goes straight to the
// outputs unless the receivers do it (`local_by_receiver`).
__device__ void dispatch_send(const DispatchArgs& a, const int* s_layout, int64_t flag_value, int warp, int num_warps) {
    const int lane = threadIdx.x % kWarpSize;
    const int me = a.rank;
    const int x_int4 = a.x_bytes / 16;
    TokenRoute next = load_route(a, warp, lane);
    for (int t = warp; t < a.num_tokens; t += num_warps) {
        const TokenRoute route = next;
        next = load_route(a, t + num_warps, lane);
        const unsigned mask = route_mask(route);
        if (mask == 0) continue;
        const int pos_lane = route_row_pos(route, s_layout, lane);
        int4* dst_x[kMaxRanks];
        uint8_t* dst_row[kMaxRanks];  // remote row slot, or nullptr
        int dst_pos[kMaxRanks];
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
            const int pos = __shfl_sync(kFullMask, pos_lane, d);
            dst_pos[d] = pos;
            dst_x[d] = nullptr;
            dst_row[d] = nullptr;
            if (!(mask >> d & 1u)) continue;
            if (d == me) {
                if (pos < a.num_out_rows)
                    dst_x[d] = reinterpret_cast<int4*>(a.recv_x + static_cast<int64_t>(pos) * a.x_bytes);
            } else {
                dst_row[d] = a.peers.bufs[d] + kRowsOffset + static_cast<int64_t>(pos) * a.row_stride;
                dst_x[d] = reinterpret_cast<int4*>(dst_row[d]);
            }
        }
        const int4* src = reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * a.x_bytes);
        // 8 words per lane in flight, not 4: at many SMs the loads wait longer, so more bytes in
        // flight pay, still without spills (docs/TUNING.md; tools/microbench/copy_rate.cu).
        constexpr int kUnroll = 8;
        for (int i = lane; i < x_int4; i += kUnroll * kWarpSize) {
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (i + u * kWarpSize < x_int4) v[u] = ld_nc_int4(src + i + u * kWarpSize);
#pragma unroll
            for (int d = 0; d < kMaxRanks; ++d) {
                if (dst_x[d] == nullptr) continue;
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (i + u * kWarpSize < x_int4) dst_x[d][i + u * kWarpSize] = v[u];
            }
        }
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
            if (dst_x[d] == nullptr) continue;
            if (dst_row[d] == nullptr)
                write_own_meta(a, t, dst_pos[d], route.meta, lane);
            else
                write_peer_meta(a, dst_row[d], d, t, route.meta, lane);
        }
        // Publish: after the warp's stores, lane d releases the flag of destination d's row (a row at
        // a time: batched, the receivers waited longer than the senders gained, see kCombineFlagBatch).
        __syncwarp();
        if (lane < kMaxRanks) {
            uint8_t* r = nullptr;
#pragma unroll
            for (int d = 0; d < kMaxRanks; ++d)
                if (d == lane) r = dst_row[d];
            if (r != nullptr)
                st_release_sys(reinterpret_cast<int64_t*>(r + a.row_stride - kRowTrailerBytes), flag_value);
        }
    }
}

// Receivers keep more loads in flight than senders (they hold fewer registers: no destination table).
constexpr int kRecvUnroll = 8;

// Receiver: one warp per output row, the sources' rows round-robin (round_robin_row). Rows of
// other ranks are copied out of the buffer as soon as their flag lands; this rank's own rows come
// straight from x when `local_by_receiver`; num_worst_tokens padding rows are filled.
__device__ void dispatch_recv(const DispatchArgs& a, const int* s_layout, int64_t seq, int64_t flag_value, int warp,
                              int num_warps) {
    const int lane = threadIdx.x % kWarpSize;
    const int R = a.num_ranks, me = a.rank, K = a.num_topk;
    uint8_t* mine = a.peers.bufs[me];
    const DispatchRow row(a.x_bytes, a.num_topk);
    const int x_int4 = a.x_bytes / 16;
    const int num_valid = min(s_layout[kLayRecvOff + R], a.num_out_rows);
    const int own_begin = min(s_layout[kLayRecvOff + me], a.num_out_rows);
    const int own_end = min(s_layout[kLayRecvOff + me + 1], a.num_out_rows);
    const int num_skip = a.local_by_receiver ? 0 : own_end - own_begin;  // rows the senders wrote
    // Blocks: each source's rows (this rank's own passed over when the senders wrote them), then
    // the num_worst_tokens padding.
    auto begin_of = [&](int k) { return k < R ? min(s_layout[kLayRecvOff + k], a.num_out_rows) : num_valid; };
    auto size_of = [&](int k) {
        if (k == R) return a.num_out_rows - num_valid;
        if (k == me && !a.local_by_receiver) return 0;
        return min(s_layout[kLayRecvOff + k + 1], a.num_out_rows) - begin_of(k);
    };
    for (int j = warp; j < a.num_out_rows - num_skip; j += num_warps) {
        int idx;
        const int src = round_robin_row(j, R + 1, size_of, idx);
        const int i = begin_of(src) + idx;
        const int64_t p = i;
        int4* out = reinterpret_cast<int4*>(a.recv_x + p * a.x_bytes);
        if (i >= num_valid) {  // num_worst_tokens padding: x = 0, scales = 0, ids = -1, weights = 0
            for (int c = lane; c < x_int4; c += kWarpSize) out[c] = make_int4(0, 0, 0, 0);
            for (int c = lane; c < a.num_scales; c += kWarpSize)
                a.recv_scales[p * a.recv_scale_stride_t + c * a.recv_scale_stride_c] = 0;
            if (a.has_topk && lane < K) {
                a.recv_topk_idx[p * K + lane] = -1;
                if (a.has_weights) a.recv_topk_weights[p * K + lane] = 0.f;
            }
            continue;
        }
        if (i >= own_begin && i < own_end) {  // this rank's own token, straight from x
            const int t = a.own_tokens[i - own_begin];
            const int4* src = reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * a.x_bytes);
            // The top-k ids and weights in flight with the row's first loads; the scales after.
            const TokenMeta meta = load_token_meta(a, t, lane, false);
            constexpr int kUnroll = kRecvUnroll;
            for (int c = lane; c < x_int4; c += kUnroll * kWarpSize) {
                int4 v[kUnroll];
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (c + u * kWarpSize < x_int4) v[u] = ld_nc_int4(src + c + u * kWarpSize);
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (c + u * kWarpSize < x_int4) out[c + u * kWarpSize] = v[u];
            }
            write_own_meta(a, t, p, meta, lane);
            continue;
        }
        const uint8_t* r = mine + kRowsOffset + p * a.row_stride;
        if (!wait_row_flag(reinterpret_cast<const int64_t*>(r + a.row_stride - kRowTrailerBytes), flag_value, mine,
                           seq, a.timeout_ns, a.info, a.op, src, kPhaseReceive))
            return;
        // The row's top-k ids and weights are loaded with its first words, stored after them (its
        // scales too would be registers held through the copy: see load_token_meta).
        int64_t e = -1;
        float w = 0.f;
        if (a.has_topk && lane < K) {
            e = reinterpret_cast<const int64_t*>(r + row.idx_offset)[lane];
            if (a.has_weights) w = reinterpret_cast<const float*>(r + row.weight_offset)[lane];
        }
        warp_copy_int4<kRecvUnroll>(out, reinterpret_cast<const int4*>(r), x_int4, lane);
        if (a.has_topk && lane < K) {
            a.recv_topk_idx[p * K + lane] = e;
            if (a.has_weights) a.recv_topk_weights[p * K + lane] = w;
        }
        for (int c = lane; c < a.num_scales; c += kWarpSize)
            a.recv_scales[p * a.recv_scale_stride_t + c * a.recv_scale_stride_c] =
                reinterpret_cast<const uint32_t*>(r + row.scale_offset)[c];
    }
}

// Sending block `block` of `num_blocks`: each of its warps takes every (num_blocks * warps)-th token.
__device__ __forceinline__ void dispatch_send_role(const DispatchArgs& a, const int* s_layout, int64_t flag_value,
                                                   int block, int num_blocks) {
    const int warps_per_block = blockDim.x / kWarpSize;
    dispatch_send(a, s_layout, flag_value, block * warps_per_block + threadIdx.x / kWarpSize,
                  num_blocks * warps_per_block);
}

// kSend and kRecv: the fused kernel (num_worst_tokens and cached dispatch: one launch, no host
// round trip), its first blocks send and the others receive. One role alone: the two halves of a
// dispatch whose outputs are sized after the host reads the counts; the send half is launched on
// a side stream before that read, so the transfer starts while the CPU waits.
template <bool kSend, bool kRecv>
__global__ void __launch_bounds__(512, 1) dispatch_kernel(DispatchArgs a) {
    const int warps_per_block = blockDim.x / kWarpSize;
    uint8_t* mine = a.peers.bufs[a.rank];
    __shared__ int s_layout[kLayoutInts];
    if (threadIdx.x < kLayoutInts) s_layout[threadIdx.x] = a.layout[threadIdx.x];
    __syncthreads();
    if (s_layout[kLayAbort] != 0) return;  // a rank refused its inputs: every rank skips alike
    const int64_t seq = ld_volatile(seq_word(mine));
    if (ld_volatile(abort_word(mine)) == seq) return;  // this call's barrier failed (reported)
    const bool reporter = kRecv && threadIdx.x == 0 && blockIdx.x == gridDim.x - 1;
    if (s_layout[kLayMaxRecv] > a.cap_rows) {  // every rank sees the same matrix, so all skip alike
        if (reporter) record_error(a.info, kErrCapacity, a.op, -1);
        return;
    }
    if (reporter && s_layout[kLayRecvOff + a.num_ranks] > a.num_out_rows)
        record_error(a.info, kErrWorstTokens, a.op, a.rank);
    const int64_t flag_value = seq ^ kFlagMagic;
    const int warp_in_block = threadIdx.x / kWarpSize;
    if (kSend && kRecv) {
        if (static_cast<int>(blockIdx.x) < a.num_send_blocks)
            dispatch_send_role(a, s_layout, flag_value, blockIdx.x, a.num_send_blocks);
        else
            dispatch_recv(a, s_layout, seq, flag_value, (blockIdx.x - a.num_send_blocks) * warps_per_block + warp_in_block,
                          (gridDim.x - a.num_send_blocks) * warps_per_block);
    } else if (kSend) {
        dispatch_send_role(a, s_layout, flag_value, blockIdx.x, gridDim.x);
    } else {
        dispatch_recv(a, s_layout, seq, flag_value, blockIdx.x * warps_per_block + warp_in_block,
                      gridDim.x * warps_per_block);
    }
}

}  // namespace epcomm
