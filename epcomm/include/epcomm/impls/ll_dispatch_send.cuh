// Low-latency dispatch, send side: the kernel arguments, the message formats (packed by count, or
// by arrival with tagged headers), the send plan and the loop that casts and stores every message.
#pragma once

#include "ll_protocol.cuh"

namespace epcomm {
namespace ll {

// What a launch of a call's kernel does (the C ABI's `phase`): both phases (a call without a receive
// hook), or its send, then, in the hook, its receive.
enum Phase : int { kBothPhases = 0, kSendPhase = 1, kReceivePhase = 2 };

// ------------------------------------------------------------------ dispatch
struct DispatchArgs {
    Peers peers;
    int rank, num_ranks, num_tokens, hidden, num_topk, num_experts, num_max_tokens;
    const __nv_bfloat16* x;   // [T, H]
    const int64_t* topk_idx;  // [T, K]
    CastMode mode;
    int data_bytes, msg_bytes;  // message: data | scales | padding to message_align
    int message_align;          // 128 where the dispatch area has room (messages_base), else 16
    int num_scale_cols;         // scale words (4 bytes) of a message
    int slot;
    int64_t slot_bytes;
    int chunk_tokens;         // tokens per block of the send kernel
    int send_blocks;          // by arrival: blocks that send (send_plan; 0: its own choice)
    int shape_tag;            // 8-bit hash of the call's shape (every rank must make the same)
    int* sent_pairs;          // [E] written pairs per expert of the running send (0 between calls)
    int* mask;                // [R] int32, or nullptr (no failed-rank masking)
    int* slot_map;            // [T, K] out: the row of (t, k) in its block, -1 when not sent
    int64_t* topk_copy;       // [T, K] out: topk_idx as sent (the handle's: combine uses and checks it)
    // receive side
    uint8_t* recv_data;       // [E_local, N*R, data_bytes]
    uint8_t* recv_scales;     // [E_local, N*R, S] with the strides below (elements of 4 bytes)
    int64_t scale_stride_e, scale_stride_row, scale_stride_col;
    int* src_info;            // [E_local, N*R]
    int* recv_count;          // [E_local]
    int64_t* layout_range;    // [E_local, R]
    int* cumulative_stats;    // [E_local] or nullptr
    int64_t* wait_stats;      // [R] or nullptr
    int* info;
    uint64_t timeout_ns;
    int64_t* trace;           // [2, kTraceBlocks, kTracePoints] phase timeline, or nullptr
    // by arrival (ArrivalMode): whether this launch may (both phases in one; FP8 with fp32 scales, IPC,
    // no masking: the host's choice), an arrival message's bytes and the shape's arrival key
    int arrival, arrival_msg_bytes;
    int64_t arrival_key;
    bool defer_acks;          // a call without a hook: its next call acknowledges it (pay_owed_acks)
    int phase;                // Phase
};

// ------------------------------------------------------------------ dispatch by arrival
// Why: a signal after the data needs a fence_sys, which completes only once every NVLink store of
// the GPU has landed, so the receivers would start copying late. By arrival, they tell data from
// what was there before by its bits (the poison 0xffffffff, which no FP8 data word or positive fp32
// scale is; send_unit replaces a data word that would be one) and copy each piece as it lands; the
// counts leave at once. Each payload word has one reader, which stores the poison back before the
// acknowledgement. A call that finds its area unpoisoned (arrival_key_word) goes counted and
// poisons it; its signals flip the shape tag's top bit, so a rank that went the other way (a
// cooperative launch refused on one rank only) is reported, not waited for. Layout: docs/DESIGN.md.
constexpr int kArrivalHeaderBytes = 128;  // K <= 16 tagged words, then the payload on a 128-byte line
constexpr uint32_t kPoison = 0xffffffffu;
constexpr uint32_t kNoDestination = 0xffffffffu;  // a header word's entry for a slot not at this rank
constexpr int kArrivalPerLane = 4;        // 16-byte words a lane holds of its part of a message
constexpr int kArrivalMaxParts = 8;

struct ArrivalMode {
    bool on;      // this call goes by arrival
    bool poison;  // it may but the area is not poisoned yet: the counted path, then poison the area
    int64_t base;  // the arrival area's offset in the buffer
    int tag;       // the signals' shape tag
    ArrivalKeyUpdate key_update;
    bool remote_peers;  // some peer is reached through Net (no arrival; send_plan needs it too)
};


// Where source src's message for token t lies in a buffer's arrival area (offset in the buffer).
__device__ __forceinline__ int64_t arrival_message_at(const DispatchArgs& a, const ArrivalMode& m, int src, int t) {
    return m.base + (static_cast<int64_t>(src) * a.num_max_tokens + t) * a.arrival_msg_bytes;
}
__device__ __forceinline__ uint8_t* arrival_message(const DispatchArgs& a, const ArrivalMode& m, uint8_t* buf, int src,
                                                    int t) {
    return buf + arrival_message_at(a, m, src, t);
}

// A 64-bit word tagged with a call: the call counter's low 32 bits above a 32-bit value (the
// arrival headers, the combine's request records). A word that shows a call's counter holds that
// call's value.
__device__ __forceinline__ uint64_t tagged(uint32_t value, int64_t seq) {
    return static_cast<uint64_t>(static_cast<uint32_t>(seq)) << 32 | value;
}
__device__ __forceinline__ bool tag_of_call(uint64_t word, int64_t seq) {
    return static_cast<uint32_t>(word >> 32) == static_cast<uint32_t>(seq);
}

// A message's header at a rank: word k is slot k's entry (`entry(k)`: local expert << 16 | row, or
// kNoDestination) beside the call counter, in 16-byte stores of two words each (weak stores: each
// aligned 8-byte word lands whole, and a strong system-scope store costs more to issue).
template <class Entry>
__device__ __forceinline__ void store_arrival_header_words(uint8_t* msg, const Entry& entry, int k, int num_topk,
                                                           int64_t seq) {
    const uint64_t w0 = tagged(entry(k), seq), w1 = tagged(k + 1 < num_topk ? entry(k + 1) : kNoDestination, seq);
    *reinterpret_cast<ulonglong2*>(reinterpret_cast<uint64_t*>(msg) + k) = make_ulonglong2(w0, w1);
}
template <class Entry>
__device__ __forceinline__ void store_arrival_header(uint8_t* msg, const Entry& entry, int num_topk, int64_t seq) {
    for (int k = 0; k < num_topk; k += 2) store_arrival_header_words(msg, entry, k, num_topk, seq);
}

// An FP8 data word that would read as the poison (four negative NaNs) becomes four positive ones.
__device__ __forceinline__ uint2 never_poison(uint2 q) {
    if (q.x == kPoison) q.x = 0x7f7f7f7fu;
    if (q.y == kPoison) q.y = 0x7f7f7f7fu;
    return q;
}

// A UE8M0 scale (a power of two) as its exponent byte.
__device__ __forceinline__ uint32_t ue8m0_byte(float scale) { return (__float_as_uint(scale) >> 23) & 0xff; }

__device__ __forceinline__ void store_scale(uint8_t* msg, int data_bytes, int group, float scale, bool ue8m0) {
    if (ue8m0)  // group g in byte g of the packed words (little-endian, 4 per int32)
        msg[data_bytes + group] = static_cast<uint8_t>(ue8m0_byte(scale));
    else
        reinterpret_cast<float*>(msg + data_bytes)[group] = scale;
}

// Token t's 16-byte words [64 * unit, 64 * unit + 64) (512 channels, four FP8 scale groups; lanes
// 0-15 of each half hold one group): loaded once, cast once, and stored into each of the token's
// messages that holds data, which plan_message named for its K pairs (`offsets16`, `ranks`): what
// a warp does per message is its stores.
__device__ __forceinline__ void send_unit(const DispatchArgs& a, uint8_t* const* bufs, int t, int unit,
                                          const int* offsets16, const uint8_t* ranks, bool first_unit, int lane) {
    const int num_int4 = a.hidden / 8;
    const int i0 = unit * 2 * kWarpSize + lane, i1 = i0 + kWarpSize;
    const bool v0 = i0 < num_int4, v1 = i1 < num_int4;
    const auto* x = reinterpret_cast<const int4*>(a.x + static_cast<int64_t>(t) * a.hidden);
    const bool stamp = a.trace != nullptr && first_unit;  // the warp's first (thread 0 stamps)
    if (stamp) trace_point(a.trace, 0, kTraceEntered);
    const int4 r0 = v0 ? ld_nc_int4(x + i0) : make_int4(0, 0, 0, 0);
    const int4 r1 = v1 ? ld_nc_int4(x + i1) : make_int4(0, 0, 0, 0);
    if (stamp) {  // the stamp waits for the loaded values
        asm volatile("" ::"r"(r0.x), "r"(r1.x));
        trace_point(a.trace, 0, kTraceLoaded);
    }
    uint2 q0 = {}, q1 = {};
    float s0 = 0.f, s1 = 0.f, s0_high = 0.f, s1_high = 0.f;
    if (a.mode.fp8) {
        q0 = never_poison(cast_fp8x8(r0, v0, a.mode, s0));
        q1 = never_poison(cast_fp8x8(r1, v1, a.mode, s1));
        // The unit's four scales (groups 4 unit .. 4 unit + 3: s0 of lanes 0 and 16, then s1) in lane
        // 0, which stores them with one 16-byte write (UE8M0: one 4-byte word) instead of four
        // 4-byte ones: over NVLink each small write is a packet of its own.
        s0_high = __shfl_sync(kFullMask, s0, 16);
        s1_high = __shfl_sync(kFullMask, s1, 16);
    }
    const bool whole_unit = (unit + 1) * 2 * kWarpSize <= num_int4;  // all four groups (H % 512 == 0)
    if (stamp) {  // the stamp waits for the cast values
        asm volatile("" ::"r"(q0.x), "r"(q1.x), "r"(r0.x), "r"(r1.x));
        trace_point(a.trace, 0, kTraceCast);
    }
    for (int k = 0; k < a.num_topk; ++k) {
        const int offset16 = offsets16[k];
        if (offset16 < 0) continue;
        uint8_t* msg = bufs[ranks[k]] + static_cast<int64_t>(offset16) * 16;
        if (a.mode.fp8) {
            // (16 bytes a lane, two lanes' words each, measured no faster: docs/TUNING.md, FP8 stores)
            if (v0) reinterpret_cast<uint2*>(msg)[i0] = q0;
            if (v1) reinterpret_cast<uint2*>(msg)[i1] = q1;
            if (whole_unit) {
                if (lane == 0) {
                    if (a.mode.ue8m0)
                        reinterpret_cast<uint32_t*>(msg + a.data_bytes)[unit] =
                            ue8m0_byte(s0) | ue8m0_byte(s0_high) << 8 | ue8m0_byte(s1) << 16 | ue8m0_byte(s1_high) << 24;
                    else
                        reinterpret_cast<float4*>(msg + a.data_bytes)[unit] = make_float4(s0, s0_high, s1, s1_high);
                }
            } else if (lane % 16 == 0) {
                if (v0) store_scale(msg, a.data_bytes, i0 / 16, s0, a.mode.ue8m0);
                if (v1) store_scale(msg, a.data_bytes, i1 / 16, s1, a.mode.ue8m0);
            }
        } else {
            if (v0) reinterpret_cast<int4*>(msg)[i0] = r0;
            if (v1) reinterpret_cast<int4*>(msg)[i1] = r1;
        }
    }
    if (stamp) trace_point(a.trace, 0, kTraceStored);
}

// Messages are token-major: a token's data crosses to a rank once, whatever number of that rank's
// experts it picked, into message [me][t] of the rank's dispatch area ([R][N] of msg_bytes); each of
// its pairs names it in the rank's index [E_local][R][N] (int32, after the messages: index_entry) at
// the pair's row; the receiver copies row i of (local expert, source) from message
// [source][index[local expert][source][i]]. Dense, one source's messages span far fewer 2 MB pages
// of a peer's buffer (address translations on both sides) than a message per (expert, row) would.
// Where the messages [R][N] start: the dispatch area's start, rounded up to message_align. At 128
// (messages of a multiple of 128 bytes), a warp's 512-byte unit of FP8 data fills whole 128-byte
// lines over NVLink, not three partial ones (docs/TUNING.md, message alignment). Buffers are
// 256-byte aligned.
__device__ __forceinline__ int64_t messages_base(const DispatchArgs& a, const Layout& lay) {
    return (lay.data + a.message_align - 1) / a.message_align * a.message_align;
}

__device__ __forceinline__ int64_t index_entry(const DispatchArgs& a, const Layout& lay, int local_e, int src,
                                               int row) {
    const int R = a.num_ranks, N = a.num_max_tokens;
    const int64_t index = messages_base(a, lay) + static_cast<int64_t>(R) * N * a.msg_bytes;  // after the messages
    return index + ((static_cast<int64_t>(local_e) * R + src) * N + row) * 4;
}

// Read by every block at its start (the last block of the send role updates the key: every block
// has read it by then).
__device__ ArrivalMode dispatch_mode(const DispatchArgs& a, const Layout& lay, uint8_t* mine) {
    const int R = a.num_ranks, N = a.num_max_tokens;
    const int64_t index_end = index_entry(a, lay, a.num_experts / R, 0, 0);  // the counted path's index ends
    ArrivalMode m{};
    m.base = (index_end + 127) / 128 * 128;
    const int64_t area_end = lay.data + static_cast<int64_t>(a.num_experts) * N * (a.hidden * 2 + 16);
    for (int r = 0; r < R; ++r) m.remote_peers |= is_remote(a.peers, r);
    // (At least two blocks, one to send and one to receive where send_plan splits them: the grid is
    // the SM count, alike on every rank. And N tokens fit the grid's chunks: then every rank's T <= N
    // does, so every rank launches the fused kernel, where the host asked for arrival; a rank whose
    // T alone decided would fall back to the two kernels and go counted while its peers did not.)
    const int grid = static_cast<int>(gridDim.x);
    const bool able = a.arrival != 0 && a.arrival_key != 0 && !m.remote_peers && a.mask == nullptr && grid >= 2 &&
                      N <= grid * (kMaxChunkEntries / max(1, a.num_topk)) &&
                      m.base + static_cast<int64_t>(R) * N * a.arrival_msg_bytes <= area_end;
    const int64_t key = ld_volatile(arrival_key_word(mine, a.slot));
    m.on = able && key == a.arrival_key;
    m.poison = able && !m.on;
    m.tag = m.on ? a.shape_tag ^ 0x80 : a.shape_tag;
    // Calls that do not go by arrival keep the key only where their stores miss the area: those of
    // its own format, whose messages and index lie before it.
    m.key_update = {true, able ? a.arrival_key : (key == a.arrival_key ? key : 0), 0};
    return m;
}

// Whether an earlier pair of pair j's token, one with a row, goes to rank dst: that one holds the
// token's message there.
__device__ __forceinline__ bool earlier_pair_at(const int* pair_expert, const int* pair_row, int j, int num_topk,
                                                int experts_per_rank, int dst) {
    for (int i = j - j % num_topk; i < j; ++i)
        if (pair_row[i] >= 0 && pair_expert[i] / experts_per_rank == dst) return true;
    return false;
}

// For remote ranks, in this rank's combine area (no peer writes it during a dispatch: see the
// staging note at the top): the token's staged message [t] (N of them), then each pair's index
// entry [T][K], which the send kernel puts to the pair's rank with the message.
__device__ __forceinline__ int64_t remote_index_staging(const DispatchArgs& a, const Layout& lay) {
    return lay.combine_data + static_cast<int64_t>(a.num_max_tokens) * a.msg_bytes;
}

// Where pair j of the block (of its token t, whose pairs start at [t][0]) has its data written, once every pair's row
// is known: in rank `rank`'s buffer at byte 16 * the value returned (layouts are 16-byte aligned;
// the host keeps buffers under 32 GiB), -1 for nowhere. The token's first pair with a row at a
// mapped rank (the holder) gets the token's message there; for a remote rank, the token's first
// remote pair gets its staging message in this rank's buffer (the send kernel puts it to each
// remote rank); the other pairs, and those not sent, nothing. With `write_index`, the pair's index
// entry is stored too (mapped rank), or staged for its put (remote: [T][K] after the staged messages).
// Computed by one thread per pair instead of by each of a token's warps for each of its messages
// (with divisions and peer-table lookups on every warp's way to its stores).
__device__ __forceinline__ int plan_message(const DispatchArgs& a, const Layout& lay, uint8_t* const* bufs,
                                            const int* pair_expert, const int* pair_row, int t, int j,
                                            bool write_index, uint8_t& rank) {
    const int K = a.num_topk, R = a.num_ranks, me = a.rank, N = a.num_max_tokens;
    const int experts_per_rank = a.num_experts / R;
    const int row = pair_row[j], e = pair_expert[j];
    rank = 0;
    if (row < 0) return -1;
    const int dst = e / experts_per_rank;
    if (is_remote(a.peers, dst)) {
        if (write_index)
            reinterpret_cast<int*>(bufs[me] + remote_index_staging(a, lay))[static_cast<int64_t>(t) * K + j % K] = t;
        for (int i = j - j % K; i < j; ++i)  // an earlier remote pair of the token has it staged
            if (pair_row[i] >= 0 && is_remote(a.peers, pair_expert[i] / experts_per_rank)) return -1;
        rank = static_cast<uint8_t>(me);
        return static_cast<int>((lay.combine_data + static_cast<int64_t>(t) * a.msg_bytes) / 16);
    }
    if (write_index) *reinterpret_cast<int*>(bufs[dst] + index_entry(a, lay, e % experts_per_rank, me, row)) = t;
    if (earlier_pair_at(pair_expert, pair_row, j, K, experts_per_rank, dst)) return -1;
    rank = static_cast<uint8_t>(dst);
    return static_cast<int>((messages_base(a, lay) + (static_cast<int64_t>(me) * N + t) * a.msg_bytes) / 16);
}

// Where this rank's message of token t keeps its payload at every rank, in 16-byte units.
__device__ __forceinline__ int arrival_payload16(const DispatchArgs& a, const ArrivalMode& m, int t) {
    return static_cast<int>((arrival_message_at(a, m, a.rank, t) + kArrivalHeaderBytes) / 16);
}

// Where pair j's data goes by arrival (at byte 16 * the value returned of rank `rank`'s buffer, -1
// for nowhere): the payload of the token's message at the pair's rank, for the token's first pair
// with a row there.
__device__ __forceinline__ int plan_arrival_message(const DispatchArgs& a, const ArrivalMode& m, const int* pair_expert,
                                                    const int* pair_row, int t, int j, uint8_t& rank) {
    const int K = a.num_topk, experts_per_rank = a.num_experts / a.num_ranks;
    const int row = pair_row[j], dst = pair_expert[j] / experts_per_rank;
    rank = 0;
    if (row < 0 || earlier_pair_at(pair_expert, pair_row, j, K, experts_per_rank, dst)) return -1;
    rank = static_cast<uint8_t>(dst);
    return arrival_payload16(a, m, t);
}

// A token's units of 512 channels (a warp's share of it in send_unit: 64 16-byte words of x).
__device__ __forceinline__ int send_units_per_token(const DispatchArgs& a) {
    return (a.hidden / 8 + 2 * kWarpSize - 1) / (2 * kWarpSize);
}

// Which blocks send which tokens. A block that has stored its messages cannot receive until they
// have left: its loads wait behind its stores in flight over NVLink. So by arrival, where 2/3 of the
// grid hold every token (or part of one), the blocks from `senders` on send nothing and receive
// while the data lands. With more tokens, a.send_blocks (the host's: a third of the SMs, or
// EPCOMM_LL_DISPATCH_SENDERS) send, sender b owning tokens b, b + senders, ... (`stride`): every
// rank's tokens land in about token order (an SM's stores drain in issue order), so the receivers,
// taking messages in token order, copy each while later ones are in flight. Counted, every block
// sends. Each rank plans its own (T differs). Figures: docs/TUNING.md, arrival senders.
// Unasked (EPCOMM_LL_DISPATCH_SENDERS auto), the senders of a dispatch by arrival on `grid` blocks:
// 2/3 of them up to that many tokens (a token or part of one each), beyond it the other third (each
// every n-th token). One rule for send_plan and for the host, which sizes the senders' shared counts.
__host__ __device__ __forceinline__ int auto_senders(int num_tokens, int grid) {
    const int most = grid - (grid / 3 > 1 ? grid / 3 : 1);
    return num_tokens <= most ? most : grid - most;
}
struct SendPlan {
    int chunk;    // tokens a sending block owns, at most
    int parts;    // blocks a token's units are split among (part p takes units p, p + parts, ...)
    int senders;  // blocks that send; the others only receive
    int stride;   // a block's tokens: first, first + stride, ... (1: a contiguous range)
};
__device__ __forceinline__ SendPlan send_plan(const DispatchArgs& a, const ArrivalMode& m) {
    const int T = a.num_tokens, grid = static_cast<int>(gridDim.x);
    SendPlan p{a.chunk_tokens, 1, grid, 1};
    const int asked = m.on && !m.remote_peers && a.send_blocks > 0 && a.send_blocks < grid ? a.send_blocks : 0;
    if (asked > 0 && T > asked) {  // (the host sized the shared counts for it and checked the pairs fit)
        p.chunk = (T + asked - 1) / asked;
        p.senders = p.stride = asked;
        return p;
    }
    const int most = asked > 0 ? asked : auto_senders(T, grid);  // (fewer than T beyond the split)
    const bool split = m.on && T <= most;  // (a.chunk_tokens is 1 then)
    // With fewer tokens than sending blocks, a token's units (512 channels each) are split among
    // `parts` blocks: one SM storing all of a token's messages (8 x 7 KB at top-8, H 7168) is bound
    // by its own store rate, and at one token the other SMs idle. The fused kernel has a block per
    // SM; the hook's send kernel a block per token range (parts 1). Not with remote peers: a
    // staged message is put whole, once every unit of it is written.
    if (p.chunk == 1 && T > 0 && !m.remote_peers) p.parts = max(1, min(send_units_per_token(a), (split ? most : grid) / T));
    if (split) p.senders = T * p.parts;
    return p;
}

// The send role of a dispatch, run by every block of the kernel (block b owns tokens by the plan);
// returns the call counter.
__device__ int64_t send_dispatch_messages(const DispatchArgs& a, const ArrivalMode& m, const SendPlan& plan) {
    // [E] all pairs, then [segments][E] the pairs before each of this block's tokens: segment c
    // counts those before token c of the block and after token c - 1, then a scan sums them. A
    // contiguous range has one (the pairs before it: the range's own pairs give the rest).
    extern __shared__ int expert_counts[];
    int* total = expert_counts;
    int* before = expert_counts + a.num_experts;
    __shared__ int pair_expert[kMaxChunkEntries];  // this block's pairs: expert (-1: none)
    __shared__ int pair_row[kMaxChunkEntries];     // and row in the expert's block (-1: not sent)
    __shared__ int pair_offset16[kMaxChunkEntries];  // and where its data goes: plan_message (static shared
    __shared__ uint8_t pair_rank[kMaxChunkEntries];  // memory plus 2E ints of counts stay under 48 KB)
    __shared__ uint8_t* bufs[kMaxRanks];            // the peer table, read per message
    __shared__ bool skip_dst[kMaxRanks];
    const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
    const int R = a.num_ranks, K = a.num_topk, E = a.num_experts, me = a.rank, N = a.num_max_tokens;
    const int experts_per_rank = E / R;
    uint8_t* mine = a.peers.bufs[me];
    __shared__ int64_t call_seq;
    trace_point(a.trace, 0, kTraceStart);
    trace_sm(a.trace, 0);
    const Layout lay(a.slot, a.slot_bytes, E, R, N, a.hidden);
    // Every block computes the same plan (its counts depend on `parts`). Every part of a token
    // plans the token's pairs alike; part 0 writes the handle's records and the index.
    const int parts = plan.parts, part = static_cast<int>(blockIdx.x) % parts, stride = plan.stride;
    const int b = static_cast<int>(blockIdx.x);
    const int first = b >= plan.senders ? a.num_tokens : stride == 1 ? b / parts * plan.chunk : b;
    const int num_own = first >= a.num_tokens ? 0
                        : stride == 1        ? min(a.num_tokens - first, plan.chunk)
                                             : (a.num_tokens - 1 - first) / stride + 1;
    const auto token_of = [&](int c) { return first + c * stride; };  // the block's token c
    const int num_pairs = num_own * K;
    const int segments = stride == 1 ? 1 : max(1, num_own);

    for (int e = tid; e < (1 + segments) * E; e += kThreads) expert_counts[e] = 0;
    if (tid < R) bufs[tid] = a.peers.bufs[tid];
    __syncthreads();
    // Warp 0 reads the call counters and waits for the acknowledgements while the other warps
    // count: the counting warps' loads go out first thing, not after a round trip for the counters.
    bool bad = false;
    if (warp == 0) {
        if (tid == 0) call_seq = next_seq(mine);
        if (b == 0) pay_owed_acks(a.peers, R, me, a.slot_bytes, a.mask);
        if (tid < R) {  // a peer still reading the previous call of this slot must acknowledge it first
            const int64_t prev = ld_volatile(slot_seq(mine, a.slot));
            skip_dst[tid] = !may_write_slot(mine, lay.acks, me, tid, prev, a.mask, a.timeout_ns, a.info, kOpLowLatencyDispatch);
        }
    } else {
        // Every pair, in batches of kCountBatch loads in flight per thread (a load, then its atomics,
        // one at a time would cost a memory round trip per pair); this block's own pairs' experts
        // are kept on the way.
        constexpr int kCounters = kThreads - kWarpSize, kCountBatch = 4;
        const int num_all = a.num_tokens * K;
        for (int base = tid - kWarpSize; base < num_all; base += kCountBatch * kCounters) {
            int64_t ids[kCountBatch];
#pragma unroll
            for (int u = 0; u < kCountBatch; ++u) {
                const int i = base + u * kCounters;
                ids[u] = i < num_all ? __ldg(a.topk_idx + i) : -1;
            }
#pragma unroll
            for (int u = 0; u < kCountBatch; ++u) {
                const int i = base + u * kCounters;
                const int64_t e = ids[u];
                if (e < -1 || e >= E) bad = true;
                const bool valid = e >= 0 && e < E;
                const int t = i / K, after = (t - first) / stride;  // (after: where t >= first)
                if (t >= first && (t - first) % stride == 0 && after < num_own) {
                    pair_expert[after * K + i % K] = valid ? static_cast<int>(e) : -1;
                    if (part == 0) a.topk_copy[i] = e;  // the handle's copy, from the register
                }
                if (!valid) continue;
                atomicAdd(total + e, 1);
                const int segment = t < first ? 0 : after + 1;
                if (segment < segments) atomicAdd(before + segment * E + e, 1);
            }
        }
    }
    __syncthreads();
    for (int e = tid; e < E; e += kThreads) {
        bad |= total[e] > N;  // more pairs for one expert than N
        for (int c = 1; c < segments; ++c) before[c * E + e] += before[(c - 1) * E + e];
    }
    // Every block counted every pair, so all of them agree on this (it goes into every signal).
    const int64_t invalid = __syncthreads_or(bad) ? kInvalidInputBit : 0;
    const int64_t seq = call_seq;
    trace_point(a.trace, 0, kTraceReady);
    // Experts no pair chose get their (empty) signal now, from one block each: no data to wait for,
    // so it travels while the messages are written. By arrival, every expert's count does. Where
    // some blocks only receive, they store these (and the missing tokens' headers below), so that a
    // sender's first NVLink stores are its data (a block's loads wait behind its stores in flight;
    // docs/TUNING.md, empty experts' signals).
    const int grid = static_cast<int>(gridDim.x);
    const int signal_blocks = plan.senders < grid ? grid - plan.senders : grid;
    const int signal_block = plan.senders < grid ? b - plan.senders : b;  // < 0: none here
    for (int e = signal_block + signal_blocks * tid; signal_block >= 0 && e < E; e += signal_blocks * kThreads) {
        const int dst = e / experts_per_rank;
        if ((total[e] != 0 && !m.on) || skip_dst[dst]) continue;
        const int64_t offset = lay.dispatch_signals + 8 * ((e % experts_per_rank) * R + me);
        const int64_t value = make_signal(seq, m.tag, invalid, min(total[e], N));
        if (is_remote(a.peers, dst))
            Net::signal(reinterpret_cast<int64_t*>(mine + offset), value, dst);
        else
            st_relaxed_sys(reinterpret_cast<int64_t*>(a.peers.bufs[dst] + offset), value);  // no data to order before it
    }
    if (a.trace != nullptr) __syncthreads();
    trace_point(a.trace, 0, kTraceSignals);
    // By stride (one token a segment), rows and plan in one pass, a warp per 32 / K tokens: a pair's
    // row counts the token's earlier pairs of its expert (match on token and expert), and it holds
    // the token's message at its rank if no earlier pair with a row goes there (match on token and
    // rank), where the loops below scan the token's earlier pairs from shared memory pair by pair.
    // A contiguous range (one segment: a pair's row counts the range's earlier pairs of its expert,
    // whatever their token) of at most 32 pairs goes to one warp, its pairs in one group.
    const bool warp_plan = m.on && K >= 1 && K <= kWarpSize && (stride > 1 || num_pairs <= kWarpSize);
    if (warp_plan) {
        const int per_warp = stride > 1 ? kWarpSize / K : num_own, within = lane / K, k = lane % K;
        const unsigned earlier = (1u << lane) - 1;
        for (int c0 = warp * per_warp; c0 < num_own; c0 += kWarpsPerBlock * per_warp) {
            const int c = c0 + within, j = c * K + k;
            const bool live = within < per_warp && c < num_own;
            const int e = live ? pair_expert[j] : -1;
            const int group = stride > 1 ? within : 0, segment = stride > 1 ? c : 0;
            const unsigned same_expert = __match_any_sync(kFullMask, e >= 0 ? group * (E + 1) + e : -1 - lane);
            int row = -1, dst = 0;
            if (e >= 0) {
                dst = e / experts_per_rank;
                row = before[segment * E + e] + __popc(same_expert & earlier);
                if (row >= N || skip_dst[dst]) row = -1;  // past the block's room: dropped
            }
            const unsigned same_rank = __match_any_sync(kFullMask, row >= 0 ? within * R + dst : -1 - lane);
            if (live) {
                const bool holds = row >= 0 && (same_rank & earlier) == 0;
                pair_row[j] = row;
                pair_rank[j] = holds ? static_cast<uint8_t>(dst) : 0;
                pair_offset16[j] = holds ? arrival_payload16(a, m, token_of(c)) : -1;
                if (part == 0) a.slot_map[static_cast<int64_t>(token_of(c)) * K + k] = row;
            }
        }
    }
    for (int j = tid; !warp_plan && j < num_pairs; j += kThreads) {
        const int e = pair_expert[j], c = j / K;
        int row = -1;
        if (e >= 0) {
            // the pairs before the token's segment, then the block's own pairs before j from it
            const int segment = segments == 1 ? 0 : c;
            row = before[segment * E + e];
            for (int i = segment * K; i < j; ++i) row += pair_expert[i] == e;
            if (row >= N || skip_dst[e / experts_per_rank]) row = -1;  // past the block's room: dropped
        }
        pair_row[j] = row;
        if (part == 0) a.slot_map[static_cast<int64_t>(token_of(c)) * K + j % K] = row;
    }

    if (m.on) {  // the headers of tokens this rank does not have (t >= T): no message, at every rank
        const int missing = (N - min(a.num_tokens, N)) * R;
        for (int i = signal_block * kThreads + tid; signal_block >= 0 && i < missing; i += signal_blocks * kThreads) {
            const auto none = [](int) { return kNoDestination; };
            if (!skip_dst[i % R]) store_arrival_header(arrival_message(a, m, bufs[i % R], me, a.num_tokens + i / R), none, K, seq);
        }
    }

    __syncthreads();  // every pair's row is known
    trace_point(a.trace, 0, kTracePairRows);
    for (int j = tid; !warp_plan && j < num_pairs; j += kThreads)
        pair_offset16[j] = m.on ? plan_arrival_message(a, m, pair_expert, pair_row, token_of(j / K), j, pair_rank[j])
                                : plan_message(a, lay, bufs, pair_expert, pair_row, token_of(j / K), j, part == 0,
                                               pair_rank[j]);
    // Each of the block's tokens' header at each rank (part 0 of the token). Where send_plan does not
    // split (T above 2/3 of the grid: no receive-only blocks read the messages as they land, only
    // the few blocks without a token when T < grid), after the data: a block that sent reads no
    // header before its own stores have landed, and the data is what the kernel waits for
    // (docs/TUNING.md, headers after the data).
    // A sender of tokens by stride (receivers copy the first while the later are in flight) stores
    // each token's headers after that token's data instead: the warp that sent its last unit.
    const bool headers_last = plan.senders >= grid && stride == 1;
    // (hidden 0: no unit to follow, so the headers go before, as store_headers stores them)
    const bool headers_per_token = m.on && part == 0 && stride > 1 && send_units_per_token(a) > 0;
    const auto header_entry = [&](int c, int dst) {
        return [&, c, dst](int k) {
            const int j = c * K + k, e = pair_expert[j], row = pair_row[j];
            return row >= 0 && e / experts_per_rank == dst
                       ? static_cast<uint32_t>(e % experts_per_rank) << 16 | static_cast<uint32_t>(row)
                       : kNoDestination;
        };
    };
    const auto store_headers = [&] {
        for (int i = tid; i < num_own * R; i += kThreads) {
            const int c = i / R, dst = i % R;
            if (!skip_dst[dst]) store_arrival_header(arrival_message(a, m, bufs[dst], me, token_of(c)), header_entry(c, dst), K, seq);
        }
    };
    if (m.on && part == 0 && !headers_last && !headers_per_token) store_headers();
    __syncthreads();
    trace_point(a.trace, 0, kTraceRows);

    // Each warp loads 512 channels of a token once and stores them (cast to FP8, or as they are)
    // into every message of the token that holds data: x read once.
    uint8_t* staging = mine + lay.combine_data;  // [N] messages, for remote peers
    const int block_units = (send_units_per_token(a) - part + parts - 1) / parts;  // units of each token here
    for (int v = warp; v < num_own * block_units; v += kWarpsPerBlock) {
        const int c = v / block_units;
        send_unit(a, bufs, token_of(c), part + v % block_units * parts, pair_offset16 + c * K, pair_rank + c * K,
                  v == warp, lane);
        if (headers_per_token && v % block_units == block_units - 1) {  // a 16-byte pair of words a lane
            const int words = (K + 1) / 2;
            for (int i = lane; i < R * words; i += kWarpSize) {
                const int dst = i / words;
                if (!skip_dst[dst])
                    store_arrival_header_words(arrival_message(a, m, bufs[dst], me, token_of(c)), header_entry(c, dst),
                                               i % words * 2, K, seq);
            }
        }
    }
    if (m.on && part == 0 && headers_last) store_headers();
    __syncthreads();
    if constexpr (kNetReachesUnmapped) {
        // A warp puts each remote pair's index entry to its rank, and the token's staged message
        // there with the token's first pair at that rank.
        const int64_t index_staging = remote_index_staging(a, lay);
        bool put = false;
        for (int j = warp; j < num_pairs; j += kWarpsPerBlock) {
            const int row = pair_row[j], e = pair_expert[j], dst = e / experts_per_rank, t = token_of(j / K);
            if (row < 0 || !is_remote(a.peers, dst)) continue;
            Net::put_warp(mine + index_entry(a, lay, e % experts_per_rank, me, row),
                          mine + index_staging + (static_cast<int64_t>(t) * K + j % K) * 4, 4, dst);
            if (!earlier_pair_at(pair_expert, pair_row, j, K, experts_per_rank, dst))
                Net::put_warp(mine + messages_base(a, lay) + (static_cast<int64_t>(me) * N + t) * a.msg_bytes,
                              staging + static_cast<int64_t>(t) * a.msg_bytes, a.msg_bytes, dst);
            put = true;
        }
        if (__syncthreads_or(put) && tid == 0) Net::quiet();  // delivered before any count is signalled
        __syncthreads();
    }
    trace_point(a.trace, 0, kTraceWritten);

    // Count the pairs; the expert's last one (in any block) signals its count to the expert's rank.
    // Skipped pairs count too, so the counter always returns to 0 for the next call. (By arrival
    // the counts have left already, and the counter stays 0.)
    for (int j = tid; !m.on && j < num_pairs; j += kThreads) {
        const int e = pair_expert[j];
        if (e < 0) continue;
        // The count releases this block's stores of the message (before the barrier) at GPU scope
        // and acquires the earlier writers'; the last writer's fence_sys below then releases all of
        // them to the peer (causality is transitive across the two scopes), one fence_sys for all
        // (one per pair costs more: docs/TUNING.md). Each part of a token counts its pairs.
        if (atomic_add_acq_rel_gpu(a.sent_pairs + e, 1) != total[e] * parts - 1) continue;
        a.sent_pairs[e] = 0;
        const int dst = e / experts_per_rank;
        if (skip_dst[dst]) continue;
        fence_sys();  // acquires the other writers' counts (each released its stores), releases all to the peer
        signal_peer(a.peers, me, dst, lay.dispatch_signals + 8 * ((e % experts_per_rank) * R + me),
                    make_signal(seq, m.tag, invalid, min(total[e], N)));
    }
    if (a.trace != nullptr) __syncthreads();  // every count of the block is signalled
    trace_point(a.trace, 0, kTraceSignalled);
    finish_send_kernel(mine, seq, a.slot, m.key_update, a.defer_acks);
    return seq;
}

}  // namespace ll
}  // namespace epcomm
