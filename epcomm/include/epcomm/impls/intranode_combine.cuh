// Intranode combine: sender warps return each received row to its source; receiver warps sum each
// token's rows, weighted, in rank order in fp32.
#pragma once

#include "../common/row_sum.cuh"
#include "intranode_dispatch.cuh"

namespace epcomm {

// ------------------------------------------------------------------ combine
struct CombineArgs {
    PeerTable peers;
    int rank, num_ranks, num_tokens, hidden, num_topk;
    const __nv_bfloat16* x;     // [rows, H] the expert outputs, in dispatch's receive order
    const float* weights;       // [rows, K] or nullptr
    const bool* in_rank;        // [T, R] of the dispatch
    const int* slot;            // [T, R] of the dispatch
    const int* layout;
    int row_stride;
    int64_t cap_rows;
    const __nv_bfloat16* bias0;
    const __nv_bfloat16* bias1;
    __nv_bfloat16* out;         // [T, H]
    float* out_weights;         // [T, K] or nullptr
    int num_send_blocks;
    int* info;
    uint64_t timeout_ns;
};

// Combine row j of the rows this rank returns (its received rows of other ranks, the sources
// round-robin: round_robin_row): its index i among the received rows and the slot it goes to in its
// source's buffer.
__device__ __forceinline__ uint8_t* combine_return_row(const CombineArgs& a, const int* s_layout, int j, int& i) {
    const int me = a.rank;
    int idx;
    const int src = round_robin_row(j, a.num_ranks, [&](int k) {
        return k == me ? 0 : s_layout[kLayRecvOff + k + 1] - s_layout[kLayRecvOff + k];
    }, idx);
    i = s_layout[kLayRecvOff + src] + idx;
    const int64_t pos = s_layout[kLayRetBase + src] + idx;
    return a.peers.bufs[src] + kRowsOffset + pos * a.row_stride;
}

__device__ __forceinline__ int combine_num_returned(const CombineArgs& a, const int* s_layout) {
    return s_layout[kLayRecvOff + a.num_ranks] - (s_layout[kLayRecvOff + a.rank + 1] - s_layout[kLayRecvOff + a.rank]);
}

// A combine sender's words per lane in flight. 4 here, but what is in flight is ptxas's choice too:
// it once overlapped the next loads with the stores and stopped after a refactor of the reducer.
// 8 (as the dispatch senders) gained nothing beyond the noise (docs/TUNING.md, combine sender words
// per lane).
constexpr int kCombineSendUnroll = 4;

// Rows a combine sender publishes with one fence (PendingFlags). A release per row (st.release.sys)
// holds the warp until its row's stores are acknowledged across NVLink before it may go on. Batched,
// the warp stalls once per batch, but a receiver sees a row only after the warp's next batch - 1
// rows, and one warp's share of the links is small. 2 suits the combine; the dispatch, whose
// receivers wait for the rows, keeps a release per row (docs/TUNING.md, combine rows per flag fence).
constexpr int kCombineFlagBatch = 2;

struct PendingFlags {
    static constexpr int kFlagBatch = kCombineFlagBatch;
    int row[kFlagBatch];
    int count = 0;

    // Every lane of the warp calls it, with the number of a row it stored last that needs a flag (or -1).
    __device__ __forceinline__ void add(int r) {
#pragma unroll
        for (int k = 0; k < kFlagBatch; ++k)
            if (k == count) row[k] = r;
        ++count;
    }
    __device__ __forceinline__ bool full() const { return count == kFlagBatch; }

    // After the warp's stores of these rows (every lane calls it): one fence, then each row's flag
    // (flag_of(row)). The fence orders the other lanes' stores too, which __syncwarp made this lane
    // observe first.
    template <class FlagOf>
    __device__ __forceinline__ void publish(int64_t value, FlagOf&& flag_of) {
        __syncwarp();
        bool any = false;
#pragma unroll
        for (int k = 0; k < kFlagBatch; ++k) any |= k < count && row[k] >= 0;
        if (any) {
            fence_sys();
#pragma unroll
            for (int k = 0; k < kFlagBatch; ++k)
                if (k < count && row[k] >= 0) st_relaxed_sys(flag_of(row[k]), value);
        }
        count = 0;
    }
};

// Sender with register copies: every received row of another rank goes back to its source, at
// the slot the source reduces from.
__device__ void combine_send(const CombineArgs& a, const int* s_layout, int64_t flag_value, int warp, int num_warps) {
    const int lane = threadIdx.x % kWarpSize, K = a.num_topk, x_int4 = a.hidden / 8;
    const int num_returned = combine_num_returned(a, s_layout);
    PendingFlags pending;  // lane 0's: a flag per row
    auto flag_of = [&](int j) {
        int i;
        return reinterpret_cast<int64_t*>(combine_return_row(a, s_layout, j, i) + a.row_stride - kRowTrailerBytes);
    };
    for (int j = warp; j < num_returned; j += num_warps) {
        int i;
        uint8_t* r = combine_return_row(a, s_layout, j, i);
        const int4* x = reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(i) * a.hidden);
        // K = 0 without weights (the pointer is null also when no rows arrived); loaded with the
        // row's first words, stored after them.
        const float w = lane < K ? a.weights[static_cast<int64_t>(i) * K + lane] : 0.f;
        constexpr int kUnroll = kCombineSendUnroll;
        for (int c = lane; c < x_int4; c += kUnroll * kWarpSize) {
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (c + u * kWarpSize < x_int4) v[u] = ld_nc_int4(x + c + u * kWarpSize);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (c + u * kWarpSize < x_int4) reinterpret_cast<int4*>(r)[c + u * kWarpSize] = v[u];
        }
        if (lane < K) reinterpret_cast<float*>(r + a.hidden * 2)[lane] = w;
        pending.add(lane == 0 ? j : -1);
        if (pending.full()) pending.publish(flag_value, flag_of);
    }
    pending.publish(flag_value, flag_of);
}

// Reducer: token t sums, in fp32 and ascending rank order, the rows its destinations returned
// (its own destination's row straight from x), then the biases; one rounding to bf16.
__device__ void combine_reduce(const CombineArgs& a, const int* s_layout, int64_t seq, int64_t flag_value, int warp,
                               int num_warps) {
    const int lane = threadIdx.x % kWarpSize;
    const int R = a.num_ranks, me = a.rank, K = a.num_topk, x_int4 = a.hidden / 8;
    uint8_t* mine = a.peers.bufs[me];
    const int own_begin = s_layout[kLayRecvOff + me];
    // Lane d < R: whether token t went to rank d, and its slot there; loaded a token ahead (as the
    // dispatch's senders do, see TokenRoute), so the loads do not wait for each other or the sums.
    auto load_hit = [&](int t, bool& hit, int& slot) {
        hit = false;
        slot = 0;
        if (t < a.num_tokens && lane < R) {
            hit = a.in_rank[static_cast<int64_t>(t) * R + lane];
            slot = a.slot[static_cast<int64_t>(t) * R + lane];
        }
    };
    bool next_hit;
    int next_slot;
    load_hit(warp, next_hit, next_slot);
    for (int t = warp; t < a.num_tokens; t += num_warps) {
        const bool hit = next_hit;
        const int64_t s = next_slot;
        load_hit(t + num_warps, next_hit, next_slot);
        const unsigned mask = __ballot_sync(kFullMask, hit);
        // Lane d finds (and for another rank, waits for) the row destination d returned: the waits
        // of all sources overlap.
        const int4* row_lane = nullptr;
        const float* w_lane = nullptr;
        bool ok = true;
        if (hit) {
            if (lane == me) {
                row_lane = reinterpret_cast<const int4*>(a.x + (own_begin + s) * a.hidden);
                if (K > 0) w_lane = a.weights + (own_begin + s) * K;
            } else {
                const uint8_t* r = mine + kRowsOffset + (s_layout[kLayCombBase + lane] + s) * a.row_stride;
                ok = wait_row_flag(reinterpret_cast<const int64_t*>(r + a.row_stride - kRowTrailerBytes), flag_value,
                                   mine, seq, a.timeout_ns, a.info, kOpCombine, lane, kPhaseReduce);
                row_lane = reinterpret_cast<const int4*>(r);
                if (K > 0) w_lane = reinterpret_cast<const float*>(r + a.hidden * 2);
            }
        }
        if (!__all_sync(kFullMask, ok)) return;  // lanes must leave together (warp collectives follow)
        __syncwarp();  // lane d acquired row d's flag; the warp's loads of that row come after (memory order)
        auto row_of = [&](int d) {
            return reinterpret_cast<const int4*>(__shfl_sync(kFullMask, reinterpret_cast<uint64_t>(row_lane), d));
        };
        if (a.out_weights != nullptr) {
            // Every source's weights are loaded before the first is added (a loop over the mask
            // would wait for each load in turn); the sum keeps ascending rank order.
            float w[kMaxRanks];
#pragma unroll
            for (int d = 0; d < kMaxRanks; ++d) {
                const auto* p = reinterpret_cast<const float*>(
                    __shfl_sync(kFullMask, reinterpret_cast<uint64_t>(w_lane), d));
                w[d] = (mask >> d & 1u) && lane < K ? p[lane] : 0.f;
            }
            float acc = 0.f;
#pragma unroll
            for (int d = 0; d < kMaxRanks; ++d)
                if (mask >> d & 1u) acc += w[d];
            if (lane < K) a.out_weights[static_cast<int64_t>(t) * K + lane] = acc;
        }
        int4* out = reinterpret_cast<int4*>(a.out + static_cast<int64_t>(t) * a.hidden);
        const int4* b0 = a.bias0 != nullptr ? reinterpret_cast<const int4*>(a.bias0 + static_cast<int64_t>(t) * a.hidden)
                                            : nullptr;
        const int4* b1 = a.bias1 != nullptr ? reinterpret_cast<const int4*>(a.bias1 + static_cast<int64_t>(t) * a.hidden)
                                            : nullptr;
        // kUnroll words per lane at a time, two sources' loads in flight (sum_sources).
        constexpr int kUnroll = 4;
        auto load = [&](int d, int c0, int4 (&v)[kUnroll]) {
            const int4* p = row_of(d);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int c = c0 + u * kWarpSize;
                if (c < x_int4) v[u] = d == me ? ld_nc_int4(p + c) : p[c];
            }
        };
        for (int c0 = lane; c0 < x_int4; c0 += kUnroll * kWarpSize)
            sum_sources<kUnroll>(mask, c0, x_int4, load, [&](int u, float (&acc)[8]) {
                const int c = c0 + u * kWarpSize;
                if (b0 != nullptr) add_bf16x8(acc, ld_nc_int4(b0 + c));
                if (b1 != nullptr) add_bf16x8(acc, ld_nc_int4(b1 + c));
                out[c] = round_bf16x8(acc);
            });
    }
}

__global__ void __launch_bounds__(512, 1) combine_kernel(CombineArgs a) {
    const int w = threadIdx.x / kWarpSize, warps_per_block = blockDim.x / kWarpSize;
    uint8_t* mine = a.peers.bufs[a.rank];
    __shared__ int s_layout[kLayoutInts];
    if (threadIdx.x < kLayoutInts) s_layout[threadIdx.x] = a.layout[threadIdx.x];
    __syncthreads();
    if (s_layout[kLayAbort] != 0) return;
    const int64_t seq = ld_volatile(seq_word(mine));
    if (ld_volatile(abort_word(mine)) == seq) return;
    if (s_layout[kLayMaxSend] > a.cap_rows) {
        if (threadIdx.x == 0 && blockIdx.x == 0) record_error(a.info, kErrCapacity, kOpCombine, -1);
        return;
    }
    const int64_t flag_value = seq ^ kFlagMagic;
    const int block = blockIdx.x;
    if (block < a.num_send_blocks) {
        combine_send(a, s_layout, flag_value, block * warps_per_block + w, a.num_send_blocks * warps_per_block);
        return;
    }
    combine_reduce(a, s_layout, seq, flag_value, (block - a.num_send_blocks) * warps_per_block + w,
                   (gridDim.x - a.num_send_blocks) * warps_per_block);
}

}  // namespace epcomm
