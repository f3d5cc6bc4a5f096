// Low-latency (decode) kernels inside one NVLink domain: every rank's buffer is mapped into its
// peers (CUDA IPC), so a sender stores each (token, expert) message straight into the receiver.
//
// A call is two kernels, so that no SM is held while data is in flight (the receive hook):
//   send: one warp per expert (global id). It walks this rank's tokens in ascending order, and for
//         each (token, top-k slot) routed to the expert it casts the token (FP8 per 128 channels,
//         or BF16 as is) straight into the expert's rank, at the next row of the (expert, source)
//         block; then one release store of the block's count (+ the call counter) signals it.
//         Blocks are laid out by ascending token, so outputs are deterministic.
//   recv: one warp per (local expert, source): waits for the counts of the sources before it (the
//         packed layout puts sources in rank order, as the reference backend does), then copies its
//         block into the outputs; the last source's warp writes recv_count and layout_range.
// Combine mirrors it: the send kernel returns each block to its source, the recv kernel sums, per
// token, weight * row over its top-k slots in slot order, in fp32 (the reference's order).
//
// Buffer layout: [header 48 bytes | slot 0 | slot 1] (16-byte aligned throughout, so that it fits in
// Buffer.get_low_latency_rdma_size_hint); each low-latency call uses the slot the Buffer assigns
// (double buffering). In a slot: acks int64[R] (first: their place must not depend on the call's
// shapes), dispatch signals int64[E], combine signals int64[E], the dispatch area [E_local][R][N] messages (sized for BF16 ones), then the combine area
// [E][N] rows.
// Flow control: when a rank's receive of a call is done with a slot, its last block writes the call
// counter into ack[slot][rank] of every peer; a send kernel writes into a peer's slot only once
// that peer has acknowledged the previous call that used the slot (ranks drift apart when hooks are
// called late, and the next call but one reuses the slot).
// Separate areas matter when a dispatch and a combine share a slot (two micro-batches in flight):
// a fast peer's combine then writes while this rank may still be copying the dispatch out.
// Signals hold (call counter << 24) | (count + 1): counters only grow and are the same on every
// rank (every rank makes the same calls), so signals never need resetting, CUDA-graph replays too.
#include "../../include/epcomm/common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace epcomm {
namespace ll {

constexpr int kHeaderBytes = 48;
constexpr int kCounterOffset = 0;    // int64: the last call counter used by this rank
constexpr int kDoneOffset = 8;       // int32: blocks of the running send kernel that have finished
constexpr int kRecvDoneOffset = 32;  // int32[2]: the same for the receive kernel of each slot (hooks may
                                     // run the receives of the two slots at once, on two streams)
constexpr int kSlotSeqOffset = 16;   // int64[2]: the call counter of the call that last used each slot
constexpr int kSignalShift = 24;
constexpr int64_t kCountMask = (1LL << kSignalShift) - 1;
constexpr int kWarpsPerBlock = 16;

// Pinned host words, as in the normal-mode kernels (the Python side reads them).
constexpr int kInfoError = 0, kInfoErrorOp = 1, kInfoErrorRanks = 2;
constexpr int kErrTimeout = 1, kErrOverflow = 6;
constexpr int kOpDispatch = 5, kOpCombine = 6;

struct Peers {
    uint8_t* bufs[kMaxRanks];
};

struct Layout {  // where things live inside one slot
    int64_t dispatch_signals, combine_signals, acks, data, combine_data;
    __device__ Layout(int slot, int64_t slot_bytes, int num_experts, int num_ranks, int num_max_tokens, int hidden) {
        const int64_t slot_base = kHeaderBytes + slot * slot_bytes;
        acks = slot_base;  // first, at a place that does not depend on the call's shapes
        dispatch_signals = acks + (num_ranks * 8 + 15) / 16 * 16;
        combine_signals = dispatch_signals + num_experts * 8;
        data = combine_signals + num_experts * 8;
        // The largest dispatch message (BF16: 2H data + the token index, padded to 16 bytes).
        combine_data = data + static_cast<int64_t>(num_experts) * num_max_tokens * (hidden * 2 + 16);
    }
};

// Failed-rank masking: rank r is masked (treated as gone) when mask[r] != 0.
__device__ __forceinline__ bool masked(const int* mask, int r) {
    return mask != nullptr && ld_volatile_int(mask + r) != 0;
}

__device__ __forceinline__ int64_t* counter(uint8_t* buf) { return reinterpret_cast<int64_t*>(buf + kCounterOffset); }

// The call counter of a send kernel: every block reads the same value (the previous call's,
// written by that call's last block), uses one more, and the last block of this call stores it.
__device__ __forceinline__ int64_t next_seq(uint8_t* mine) { return ld_volatile(counter(mine)) + 1; }

// The last block to finish (every block has read the counter and the slot's previous call by then)
// records this call as the slot's latest and as the rank's last.
__device__ void finish_send_kernel(uint8_t* mine, int64_t seq, int slot) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        int* done = reinterpret_cast<int*>(mine + kDoneOffset);
        if (atomicAdd(done, 1) == static_cast<int>(gridDim.x) - 1) {
            *done = 0;
            reinterpret_cast<int64_t*>(mine + kSlotSeqOffset)[slot] = seq;
            *counter(mine) = seq;
            __threadfence();
        }
    }
}

// The last block of a receive kernel to finish (all reads of the slot are done) acknowledges the
// call to every rank, so their next sends into this slot may start.
__device__ void finish_recv_kernel(const Peers& peers, int num_ranks, int me, int slot, int64_t acks, int64_t seq,
                                   const int* mask) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        int* done = reinterpret_cast<int*>(peers.bufs[me] + kRecvDoneOffset) + slot;
        if (atomicAdd(done, 1) == static_cast<int>(gridDim.x) - 1) {
            *done = 0;
            fence_sys();
            for (int r = 0; r < num_ranks; ++r)  // not to masked ranks: they may be gone
                if (r == me || !masked(mask, r)) st_release_sys(reinterpret_cast<int64_t*>(peers.bufs[r] + acks) + me, seq);
        }
    }
}


// Wait for a block's signal of call `seq`; returns its count, or -1 when the source was (or, on
// timeout with failed-rank masking, becomes) masked, or -2 on timeout without masking (reported).
__device__ int wait_signal(const int64_t* signal, int64_t seq, int src, int* mask, uint64_t timeout_ns, int* info,
                           int op, uint64_t* waited_ns) {
    const uint64_t start = global_timer_ns();
    for (int spin = 0;; ++spin) {
        const int64_t v = ld_acquire_sys(signal);
        if ((v >> kSignalShift) == seq) {
            if (waited_ns != nullptr) *waited_ns = global_timer_ns() - start;
            return static_cast<int>((v & kCountMask) - 1);
        }
        if ((spin & 63) == 63) {
            if (masked(mask, src)) return -1;
            if (ld_volatile_int(info + kInfoError) == kErrTimeout) return -2;  // someone gave up already
            if (global_timer_ns() - start > timeout_ns) {
                if (mask != nullptr) {  // failed-rank masking: stop waiting for this rank from now on
                    atomicExch(mask + src, 1);
                    return -1;
                }
                info[kInfoErrorRanks + src] = 1;
                info[kInfoErrorOp] = op;
                info[kInfoError] = kErrTimeout;
                return -2;
            }
        }
    }
}

// Before writing into `dst`'s slot: wait until `dst` has acknowledged the previous call that used
// the slot (`prev`; 0 when none). False (the writes are skipped) when dst is masked or timed out.
__device__ bool wait_ack(const uint8_t* mine, int64_t acks, int dst, int64_t prev, int* mask, uint64_t timeout_ns,
                         int* info, int op) {
    if (prev <= 0) return true;
    const auto* ack = reinterpret_cast<const int64_t*>(mine + acks) + dst;
    const uint64_t start = global_timer_ns();
    for (int spin = 0;; ++spin) {
        if (ld_acquire_sys(ack) >= prev) return true;
        if ((spin & 63) == 63) {
            if (masked(mask, dst)) return false;
            if (ld_volatile_int(info + kInfoError) == kErrTimeout) return false;
            if (global_timer_ns() - start > timeout_ns) {
                if (mask != nullptr) {
                    atomicExch(mask + dst, 1);
                    return false;
                }
                info[kInfoErrorRanks + dst] = 1;
                info[kInfoErrorOp] = op;
                info[kInfoError] = kErrTimeout;
                return false;
            }
        }
    }
}

// ------------------------------------------------------------------ FP8 cast (the rule of epcomm/fp8.py)
struct CastMode {
    bool fp8, round_scale, ue8m0;
};

// 8 bf16 channels of one lane, cast as members of a 128-channel group spread over 16 lanes
// (lanes 0-15 or 16-31 of the warp). Returns the group's scale (fp32 bits, or its UE8M0 exponent).
__device__ __forceinline__ uint2 cast_fp8x8(const int4& raw, bool valid, const CastMode& mode, float& scale_out) {
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
    float v[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 f = __bfloat1622float2(h[k]);
        v[2 * k] = f.x;
        v[2 * k + 1] = f.y;
    }
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(v[k]));
    if (!valid) amax = 0.f;
#pragma unroll
    for (int off = 8; off >= 1; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
    amax = fmaxf(amax, 1e-4f);
    float scale = __fmul_rn(amax, static_cast<float>(1.0 / 448.0));
    float inv;
    if (mode.round_scale) {  // smallest power of two >= scale; its inverse is exact
        const int bits = __float_as_int(scale);
        const int exponent = ((bits >> 23) & 0xff) + ((bits & 0x7fffff) != 0 ? 1 : 0);
        scale = __int_as_float(exponent << 23);
        inv = __fdiv_rn(1.0f, scale);
    } else {
        inv = __fdiv_rn(448.0f, amax);
    }
    scale_out = scale;
    uint2 out;
    auto* q = reinterpret_cast<__nv_fp8x2_storage_t*>(&out);
#pragma unroll
    for (int k = 0; k < 4; ++k)
        q[k] = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(v[2 * k], inv), __fmul_rn(v[2 * k + 1], inv)),
                                        __NV_SATFINITE, __NV_E4M3);
    return out;
}

// One warp writes token row `x` (bf16 [H]) as one message: data, scales, source token index.
__device__ __forceinline__ void write_message(uint8_t* msg, const __nv_bfloat16* x, int hidden, const CastMode& mode,
                                              int data_bytes, int token, int lane) {
    const int num_int4 = hidden / 8;
    const int4* src = reinterpret_cast<const int4*>(x);
    if (!mode.fp8) {
        warp_copy_int4<4>(reinterpret_cast<int4*>(msg), src, num_int4, lane);
    } else {
        // Step j: lanes 0-15 hold group 2j, lanes 16-31 group 2j+1 (16 int4 = 128 channels each).
        for (int base = 0; base < num_int4; base += kWarpSize) {
            const int i = base + lane;
            const bool valid = i < num_int4;
            const int4 raw = valid ? ld_nc_int4(src + i) : make_int4(0, 0, 0, 0);
            float scale;
            const uint2 q = cast_fp8x8(raw, valid, mode, scale);
            if (valid) reinterpret_cast<uint2*>(msg)[i] = q;
            if (valid && lane % 16 == 0) {
                const int group = i / 16;
                if (mode.ue8m0)  // group g in byte g of the packed words (little-endian, 4 per int32)
                    msg[data_bytes + group] = static_cast<uint8_t>((__float_as_int(scale) >> 23) & 0xff);
                else
                    reinterpret_cast<float*>(msg + data_bytes)[group] = scale;
            }
        }
    }
    if (lane == 0) *reinterpret_cast<int*>(msg + data_bytes + (mode.fp8 ? (mode.ue8m0 ? hidden / 128 : hidden / 32)
                                                                        : 0)) = token;
}

// ------------------------------------------------------------------ dispatch
struct DispatchArgs {
    Peers peers;
    int rank, num_ranks, num_tokens, hidden, num_topk, num_experts, num_max_tokens;
    const __nv_bfloat16* x;   // [T, H]
    const int64_t* topk_idx;  // [T, K]
    CastMode mode;
    int data_bytes, msg_bytes;  // message: data | scales | int32 token | padding to 16
    int slot;
    int64_t slot_bytes;
    int* mask;                // [R] int32, or nullptr (no failed-rank masking)
    int* slot_map;            // [T, K] out: the row of (t, k) in its block, -1 when not sent
    // receive side
    uint8_t* recv_data;       // [E_local, N*R, data_bytes]
    uint8_t* recv_scales;     // [E_local, N*R, S] with the strides below (elements of 4 bytes)
    int64_t scale_stride_e, scale_stride_row, scale_stride_col;
    int num_scale_cols;
    int* src_info;            // [E_local, N*R]
    int* recv_count;          // [E_local]
    int64_t* layout_range;    // [E_local, R]
    int* cumulative_stats;    // [E_local] or nullptr
    int64_t* wait_stats;      // [R] or nullptr
    int* info;
    uint64_t timeout_ns;
};

__global__ void __launch_bounds__(kWarpsPerBlock * kWarpSize, 1) dispatch_send(DispatchArgs a) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
    const int num_warps = gridDim.x * kWarpsPerBlock;
    const int R = a.num_ranks, K = a.num_topk, me = a.rank;
    const int experts_per_rank = a.num_experts / R;
    uint8_t* mine = a.peers.bufs[me];
    const int64_t seq = next_seq(mine);
    const int64_t prev = ld_volatile(reinterpret_cast<const int64_t*>(mine + kSlotSeqOffset) + a.slot);
    const Layout lay(a.slot, a.slot_bytes, a.num_experts, a.num_ranks, a.num_max_tokens, a.hidden);
    const bool me_masked = masked(a.mask, me);
    for (int e = warp; e < a.num_experts; e += num_warps) {
        const int dst = e / experts_per_rank, local_e = e % experts_per_rank;
        bool skip = me_masked || masked(a.mask, dst);
        if (!skip) skip = !wait_ack(mine, lay.acks, dst, prev, a.mask, a.timeout_ns, a.info, kOpDispatch);
        skip = __any_sync(kFullMask, skip);  // the lanes agree (they poll the same words)
        uint8_t* block = a.peers.bufs[dst] + lay.data +
                         (static_cast<int64_t>(local_e) * R + me) * a.num_max_tokens * a.msg_bytes;
        int count = 0;
        for (int t0 = 0; t0 < a.num_tokens; t0 += kWarpSize) {
            const int t = t0 + lane;
            unsigned hits = 0;  // top-k slots of token t that choose expert e
            if (t < a.num_tokens)
                for (int k = 0; k < K; ++k)
                    if (a.topk_idx[static_cast<int64_t>(t) * K + k] == e) hits |= 1u << k;
            unsigned tokens = __ballot_sync(kFullMask, hits != 0);
            while (tokens != 0) {  // ascending token, then ascending slot
                const int src_lane = __ffs(tokens) - 1;
                tokens &= tokens - 1;
                unsigned slots = __shfl_sync(kFullMask, hits, src_lane);
                const int token = t0 + src_lane;
                while (slots != 0) {
                    const int k = __ffs(slots) - 1;
                    slots &= slots - 1;
                    const bool fits = count < a.num_max_tokens;
                    if (lane == 0) a.slot_map[static_cast<int64_t>(token) * K + k] = (skip || !fits) ? -1 : count;
                    if (skip) continue;
                    if (!fits) {  // more rows for one expert than N (a token naming it twice): refuse them
                        if (lane == 0) {
                            a.info[kInfoErrorOp] = kOpDispatch;
                            a.info[kInfoError] = kErrOverflow;
                        }
                        continue;
                    }
                    write_message(block + static_cast<int64_t>(count) * a.msg_bytes,
                                  a.x + static_cast<int64_t>(token) * a.hidden, a.hidden, a.mode, a.data_bytes, token,
                                  lane);
                    ++count;
                }
            }
        }
        __syncwarp();
        if (lane == 0 && !skip) {
            auto* signal = reinterpret_cast<int64_t*>(a.peers.bufs[dst] + lay.dispatch_signals) + local_e * R + me;
            st_release_sys(signal, (seq << kSignalShift) | (count + 1));
        }
    }
    finish_send_kernel(mine, seq, a.slot);
}

__device__ void dispatch_recv_unit(const DispatchArgs& a, const Layout& lay, int64_t seq, int warp, int lane) {
    const int R = a.num_ranks, me = a.rank;
    const int rows_per_expert = a.num_max_tokens * R;
    uint8_t* mine = a.peers.bufs[me];
    const int local_e = warp / R, src = warp % R;
    // Lane j waits for source j's count of this expert (sources below `src` give the offset).
    int count = 0;
    if (lane < R) {
        uint64_t waited = 0;
        const bool skip = masked(a.mask, me) || masked(a.mask, lane);
        if (!skip) {
            const auto* signal = reinterpret_cast<const int64_t*>(mine + lay.dispatch_signals) + local_e * R + lane;
            count = wait_signal(signal, seq, lane, a.mask, a.timeout_ns, a.info, kOpDispatch, &waited);
            // masked (or timed out: reported, and nothing to copy); never more than a block's room
            count = count < 0 ? 0 : min(count, a.num_max_tokens);
        }
        if (a.wait_stats != nullptr && local_e == 0 && lane == src) atomicAdd(
            reinterpret_cast<unsigned long long*>(a.wait_stats + src), static_cast<unsigned long long>(waited));
    }
    __syncwarp();  // the lanes that acquired the signals publish them to the rest of the warp
    int begin = 0, total = 0, mine_count = 0;
    for (int j = 0; j < R; ++j) {
        const int c = __shfl_sync(kFullMask, count, j);
        if (j < src) begin += c;
        if (j == src) mine_count = c;
        total += c;
    }
    const uint8_t* block = mine + lay.data + (static_cast<int64_t>(local_e) * R + src) * a.num_max_tokens * a.msg_bytes;
    const int scale_offset = a.data_bytes;
    const int token_offset = a.data_bytes + a.num_scale_cols * 4;
    for (int i = 0; i < mine_count; ++i) {
        const uint8_t* msg = block + static_cast<int64_t>(i) * a.msg_bytes;
        const int64_t row = static_cast<int64_t>(local_e) * rows_per_expert + begin + i;
        warp_copy_int4<4>(reinterpret_cast<int4*>(a.recv_data + row * a.data_bytes),
                          reinterpret_cast<const int4*>(msg), a.data_bytes / 16, lane);
        for (int c = lane; c < a.num_scale_cols; c += kWarpSize)
            reinterpret_cast<uint32_t*>(a.recv_scales)[local_e * a.scale_stride_e +
                                                       (begin + i) * a.scale_stride_row + c * a.scale_stride_col] =
                reinterpret_cast<const uint32_t*>(msg + scale_offset)[c];
        if (lane == 0) a.src_info[row] = *reinterpret_cast<const int*>(msg + token_offset);
    }
    if (src == R - 1) {  // the last source's warp completes the expert's metadata
        if (lane == 0) {
            a.recv_count[local_e] = total;
            if (a.cumulative_stats != nullptr) atomicAdd(a.cumulative_stats + local_e, total);
        }
        int run = 0;
        for (int j = 0; j < R; ++j) {
            const int c = __shfl_sync(kFullMask, count, j);
            if (lane == j) a.layout_range[static_cast<int64_t>(local_e) * R + j] = (static_cast<int64_t>(run) << 32) | c;
            run += c;
        }
        for (int r = total + lane; r < rows_per_expert; r += kWarpSize)
            a.src_info[static_cast<int64_t>(local_e) * rows_per_expert + r] = -1;
    }
}

__global__ void __launch_bounds__(kWarpsPerBlock * kWarpSize, 1) dispatch_recv(DispatchArgs a) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
    uint8_t* mine = a.peers.bufs[a.rank];
    const int64_t seq = reinterpret_cast<const int64_t*>(mine + kSlotSeqOffset)[a.slot];
    const Layout lay(a.slot, a.slot_bytes, a.num_experts, a.num_ranks, a.num_max_tokens, a.hidden);
    if (warp < a.num_experts) dispatch_recv_unit(a, lay, seq, warp, lane);  // one warp per (local expert, source)
    finish_recv_kernel(a.peers, a.num_ranks, a.rank, a.slot, lay.acks, seq, a.mask);
}

// ------------------------------------------------------------------ combine
struct CombineArgs {
    Peers peers;
    int rank, num_ranks, num_experts, num_max_tokens, hidden, num_tokens, num_topk;
    const __nv_bfloat16* x;        // [E_local, N*R, H] expert outputs, in dispatch's receive layout
    const int64_t* layout_range;   // [E_local, R] of the dispatch
    const int64_t* topk_idx;       // [T, K]
    const float* topk_weights;     // [T, K]
    const int* slot_map;           // [T, K] of the dispatch
    __nv_bfloat16* out;            // [T, H]
    int slot;
    int64_t slot_bytes;
    int* mask;
    int64_t* wait_stats;           // [R] or nullptr
    int* info;
    uint64_t timeout_ns;
};

__global__ void __launch_bounds__(kWarpsPerBlock * kWarpSize, 1) combine_send(CombineArgs a) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
    const int num_warps = gridDim.x * kWarpsPerBlock;
    const int R = a.num_ranks, me = a.rank;
    const int experts_per_rank = a.num_experts / R;
    const int rows_per_expert = a.num_max_tokens * R;
    const int row_bytes = a.hidden * 2;
    uint8_t* mine = a.peers.bufs[me];
    const int64_t seq = next_seq(mine);
    const int64_t prev = ld_volatile(reinterpret_cast<const int64_t*>(mine + kSlotSeqOffset) + a.slot);
    const Layout lay(a.slot, a.slot_bytes, a.num_experts, a.num_ranks, a.num_max_tokens, a.hidden);
    const bool me_masked = masked(a.mask, me);
    for (int unit = warp; unit < experts_per_rank * R; unit += num_warps) {  // (local expert, source)
        const int local_e = unit / R, src = unit % R;
        bool skip = me_masked || masked(a.mask, src);
        if (!skip) skip = !wait_ack(mine, lay.acks, src, prev, a.mask, a.timeout_ns, a.info, kOpCombine);
        if (__any_sync(kFullMask, skip)) continue;
        const int64_t word = a.layout_range[static_cast<int64_t>(local_e) * R + src];
        // Clamped to the block's room: a layout never filled (no receive ran) cannot write elsewhere.
        const int begin = min(static_cast<int>(word >> 32), rows_per_expert);
        const int count = max(0, min(static_cast<int>(word & 0xffffffff), min(a.num_max_tokens, rows_per_expert - begin)));
        const int global_e = me * experts_per_rank + local_e;
        uint8_t* rows =
            a.peers.bufs[src] + lay.combine_data + static_cast<int64_t>(global_e) * a.num_max_tokens * row_bytes;
        for (int i = 0; i < count; ++i)
            warp_copy_int4<4>(reinterpret_cast<int4*>(rows + static_cast<int64_t>(i) * row_bytes),
                              reinterpret_cast<const int4*>(a.x + (static_cast<int64_t>(local_e) * rows_per_expert +
                                                                   begin + i) * a.hidden),
                              row_bytes / 16, lane);
        __syncwarp();
        if (lane == 0) {
            auto* signal = reinterpret_cast<int64_t*>(a.peers.bufs[src] + lay.combine_signals) + global_e;
            st_release_sys(signal, (seq << kSignalShift) | (count + 1));
        }
    }
    finish_send_kernel(mine, seq, a.slot);
}

__global__ void __launch_bounds__(kWarpsPerBlock * kWarpSize, 1) combine_recv(CombineArgs a) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
    const int num_warps = gridDim.x * kWarpsPerBlock;
    const int R = a.num_ranks, K = a.num_topk, me = a.rank;
    const int experts_per_rank = a.num_experts / R;
    const int row_bytes = a.hidden * 2;
    uint8_t* mine = a.peers.bufs[me];
    const int64_t seq = reinterpret_cast<const int64_t*>(mine + kSlotSeqOffset)[a.slot];
    const Layout lay(a.slot, a.slot_bytes, a.num_experts, a.num_ranks, a.num_max_tokens, a.hidden);
    const auto* signals = reinterpret_cast<const int64_t*>(mine + lay.combine_signals);
    // Wait-cost statistics: block 0 times the arrival of each source rank's first expert.
    if (a.wait_stats != nullptr && blockIdx.x == 0 && threadIdx.x < R && !masked(a.mask, me)) {
        const int src = threadIdx.x;
        uint64_t waited = 0;
        if (!masked(a.mask, src) &&
            wait_signal(signals + src * experts_per_rank, seq, src, a.mask, a.timeout_ns, a.info, kOpCombine,
                        &waited) >= 0)
            atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + src),
                      static_cast<unsigned long long>(waited));
    }
    __syncwarp();  // warp 0's timing lanes rejoin before the warp-wide steps below
    const int num_int4 = a.hidden / 8;
    for (int t = warp; t < a.num_tokens; t += num_warps) {
        // Which slots contribute: valid id, sent at dispatch, and its block has arrived.
        unsigned present = 0;
        for (int k = 0; k < K; ++k) {
            const int64_t e = a.topk_idx[static_cast<int64_t>(t) * K + k];
            const int s = a.slot_map[static_cast<int64_t>(t) * K + k];
            if (e < 0 || e >= a.num_experts || s < 0) continue;
            const int src = static_cast<int>(e / experts_per_rank);
            if (masked(a.mask, src)) continue;
            if (wait_signal(signals + e, seq, src, a.mask, a.timeout_ns, a.info, kOpCombine, nullptr) < 0) continue;
            present |= 1u << k;
        }
        present = __reduce_and_sync(kFullMask, present);  // every lane saw every arrival (or drop it)
        int4* out = reinterpret_cast<int4*>(a.out + static_cast<int64_t>(t) * a.hidden);
        for (int c = lane; c < num_int4; c += kWarpSize) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int k = 0; k < K; ++k) {  // slot order, fp32: acc = acc + w * row (no fused multiply-add)
                if (!(present >> k & 1u)) continue;
                const int64_t e = a.topk_idx[static_cast<int64_t>(t) * K + k];
                const int s = a.slot_map[static_cast<int64_t>(t) * K + k];
                const float w = a.topk_weights[static_cast<int64_t>(t) * K + k];
                const int4 v = reinterpret_cast<const int4*>(
                    mine + lay.combine_data + (e * a.num_max_tokens + s) * static_cast<int64_t>(row_bytes))[c];
                const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float2 f = __bfloat1622float2(h[j]);
                    acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(w, f.x));
                    acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(w, f.y));
                }
            }
            int4 o;
            auto* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
            for (int j = 0; j < 4; ++j) oh[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
            out[c] = o;
        }
    }
    finish_recv_kernel(a.peers, R, me, a.slot, lay.acks, seq, a.mask);
}

}  // namespace ll
}  // namespace epcomm

// ---------------------------------------------------------------- host entry points (C ABI, no torch)
using namespace epcomm;

extern "C" {

int epcomm_ll_header_bytes() { return ll::kHeaderBytes; }

// phase 1: send (and return); phase 2: receive (the hook). The caller passes the same arguments.
int epcomm_ll_dispatch(const uint64_t* bufs, int rank, int num_ranks, int num_tokens, int hidden, int num_topk,
                       int num_experts, int num_max_tokens, const void* x, const int64_t* topk_idx, int use_fp8,
                       int round_scale, int use_ue8m0, int data_bytes, int msg_bytes, int slot, int64_t slot_bytes,
                       int* mask, int* slot_map, void* recv_data, void* recv_scales, int64_t scale_stride_e,
                       int64_t scale_stride_row, int64_t scale_stride_col, int num_scale_cols, int* src_info,
                       int* recv_count, int64_t* layout_range, int* cumulative_stats, int64_t* wait_stats, int phase,
                       int num_sms, int* info, uint64_t timeout_ns, cudaStream_t stream) {
    ll::DispatchArgs a{};
    for (int r = 0; r < num_ranks; ++r) a.peers.bufs[r] = reinterpret_cast<uint8_t*>(bufs[r]);
    a.rank = rank;
    a.num_ranks = num_ranks;
    a.num_tokens = num_tokens;
    a.hidden = hidden;
    a.num_topk = num_topk;
    a.num_experts = num_experts;
    a.num_max_tokens = num_max_tokens;
    a.x = static_cast<const __nv_bfloat16*>(x);
    a.topk_idx = topk_idx;
    a.mode = {use_fp8 != 0, round_scale != 0, use_ue8m0 != 0};
    a.data_bytes = data_bytes;
    a.msg_bytes = msg_bytes;
    a.slot = slot;
    a.slot_bytes = slot_bytes;
    a.mask = mask;
    a.slot_map = slot_map;
    a.recv_data = static_cast<uint8_t*>(recv_data);
    a.recv_scales = static_cast<uint8_t*>(recv_scales);
    a.scale_stride_e = scale_stride_e;
    a.scale_stride_row = scale_stride_row;
    a.scale_stride_col = scale_stride_col;
    a.num_scale_cols = num_scale_cols;
    a.src_info = src_info;
    a.recv_count = recv_count;
    a.layout_range = layout_range;
    a.cumulative_stats = cumulative_stats;
    a.wait_stats = wait_stats;
    a.info = info;
    a.timeout_ns = timeout_ns;
    const int threads = ll::kWarpsPerBlock * kWarpSize;
    const int units_blocks = (num_experts + ll::kWarpsPerBlock - 1) / ll::kWarpsPerBlock;
    if (phase == 1) {
        const int blocks = units_blocks < num_sms ? units_blocks : num_sms;
        ll::dispatch_send<<<blocks > 0 ? blocks : 1, threads, 0, stream>>>(a);
    } else {
        ll::dispatch_recv<<<units_blocks > 0 ? units_blocks : 1, threads, 0, stream>>>(a);
    }
    return static_cast<int>(cudaGetLastError());
}

int epcomm_ll_combine(const uint64_t* bufs, int rank, int num_ranks, int num_experts, int num_max_tokens, int hidden,
                      int num_tokens, int num_topk, const void* x, const int64_t* layout_range,
                      const int64_t* topk_idx, const float* topk_weights, const int* slot_map, void* out, int slot,
                      int64_t slot_bytes, int* mask, int64_t* wait_stats, int phase, int num_sms, int* info,
                      uint64_t timeout_ns, cudaStream_t stream) {
    ll::CombineArgs a{};
    for (int r = 0; r < num_ranks; ++r) a.peers.bufs[r] = reinterpret_cast<uint8_t*>(bufs[r]);
    a.rank = rank;
    a.num_ranks = num_ranks;
    a.num_experts = num_experts;
    a.num_max_tokens = num_max_tokens;
    a.hidden = hidden;
    a.num_tokens = num_tokens;
    a.num_topk = num_topk;
    a.x = static_cast<const __nv_bfloat16*>(x);
    a.layout_range = layout_range;
    a.topk_idx = topk_idx;
    a.topk_weights = topk_weights;
    a.slot_map = slot_map;
    a.out = static_cast<__nv_bfloat16*>(out);
    a.slot = slot;
    a.slot_bytes = slot_bytes;
    a.mask = mask;
    a.wait_stats = wait_stats;
    a.info = info;
    a.timeout_ns = timeout_ns;
    const int threads = ll::kWarpsPerBlock * kWarpSize;
    if (phase == 1) {
        const int units_blocks = (num_experts + ll::kWarpsPerBlock - 1) / ll::kWarpsPerBlock;
        const int blocks = units_blocks < num_sms ? units_blocks : num_sms;
        ll::combine_send<<<blocks > 0 ? blocks : 1, threads, 0, stream>>>(a);
    } else {
        const int token_blocks = (num_tokens + ll::kWarpsPerBlock - 1) / ll::kWarpsPerBlock;
        const int blocks = token_blocks < num_sms ? token_blocks : num_sms;
        ll::combine_recv<<<blocks > 0 ? blocks : 1, threads, 0, stream>>>(a);
    }
    return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
