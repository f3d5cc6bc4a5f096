// The intranode buffer: byte offsets of its areas, the pinned info words, the per-dispatch layout
// ints, and the bounded wait for a row's flag. Protocol and layout: docs/DESIGN.md.
#pragma once

#include "../common/protocol.cuh"

namespace epcomm {

constexpr int kSignalOffset = 0;
constexpr int kSeqOffset = 64;
constexpr int kAbortOffset = 72;
constexpr int kMatrixOffset = 128;
constexpr int kHeaderOffset = 640;
// Per (parity, source rank): a fresh dispatch's refusal bits, num_worst_tokens and row bytes; every
// op's shape key and op code (read after the barrier, also when the source has gone on to its next call).
constexpr int kHeaderInts = 6;
constexpr int kExpertCountOffset = 1024;
static_assert(kHeaderOffset + 2 * kMaxRanks * kHeaderInts * 4 <= kExpertCountOffset, "the headers outgrew their area");
constexpr int kMaxExpertsPerRank = 1024;
// This rank's alone: the notify kernel's blocks' totals (int32 [kMaxNotifyBlocks][kMaxRanks + 1]).
constexpr int kNotifyScratchOffset = kExpertCountOffset + 2 * kMaxRanks * kMaxExpertsPerRank * 4;  // 66560
constexpr int kMaxNotifyBlocks = 16, kNotifyScratchStride = kMaxRanks + 1;
constexpr int kRowsOffset = kNotifyScratchOffset + 1024;  // 67584
static_assert(kMaxNotifyBlocks * kNotifyScratchStride * 4 <= 1024, "the notify scratch outgrew its area");
constexpr int kRowTrailerBytes = 16;  // flag (int64) + padding, at the end of every row slot
constexpr int64_t kFlagMagic = 0x5e9c0a11f1a90000LL;

// Pinned host words written by the kernels and read by the CPU at its sync points.
// kInfoError, kInfoErrorOp, kInfoErrorPhase, kInfoErrorRanks [kMaxRanks]: the error record
// (common/protocol.cuh; a mismatched op writes the peer's op code into its rank word).
constexpr int kInfoNumRecv = 16;
static_assert(kInfoErrorRanks + kMaxRanks <= kInfoNumRecv, "the error record outgrew its words");
constexpr int kInfoRecvCounts = 17;  // [kMaxRanks]
constexpr int kInfoMaxRecv = 25;     // most rows any rank receives (the host's one-pass check)
constexpr int kInfoMaxSend = 26;     // most rows any rank sends
constexpr int kInfoMatrix = 32;      // [kMaxRanks * kMaxRanks]
constexpr int kInfoRefusal = 96;     // [kMaxRanks]
constexpr int kInfoExperts = 128;    // [kMaxExpertsPerRank]
constexpr int kInfoInts = kInfoExperts + kMaxExpertsPerRank;
// Refusal bits (input validation on the device, so no host sync is needed for it).
constexpr int kRefuseTopkRange = 1, kRefuseRankCounts = 2, kRefuseShapes = 4, kRefuseWorstTokens = 8;

// Device layout of one dispatch (int32), kept in the handle for cached dispatch and combine.
constexpr int kLayDstBase = 0;    // [R]: where this rank's rows start in each destination's output
constexpr int kLayRecvOff = 8;    // [R + 1]: where each source's rows start in this rank's output
constexpr int kLayCombBase = 24;  // [R]: where the rows destination d returns start in this buffer
constexpr int kLayRetBase = 32;   // [R]: where this rank's returned rows start in source s's buffer
constexpr int kLayMaxRecv = 40;   // most rows any rank receives in dispatch
constexpr int kLayMaxSend = 41;   // most rows any rank sends (= receives back in combine)
constexpr int kLayAbort = 42;     // nonzero: some rank refused its inputs, nothing moves
constexpr int kLayoutInts = 48;

struct PeerTable {
    uint8_t* bufs[kMaxRanks];  // base of each rank's buffer in this process's address space
};

__device__ __forceinline__ int64_t* seq_word(uint8_t* buf) { return reinterpret_cast<int64_t*>(buf + kSeqOffset); }
__device__ __forceinline__ int64_t* abort_word(uint8_t* buf) {
    return reinterpret_cast<int64_t*>(buf + kAbortOffset);
}

// Wait until a row's flag shows `want`. Bounded: gives up when the abort word shows this call
// (another warp timed out) or after `timeout_ns`, then records who was waited for, in which phase
// (dispatch: receive; combine: reduce), and aborts.
__device__ __forceinline__ bool wait_row_flag(const int64_t* flag, int64_t want, uint8_t* my_buf, int64_t seq,
                                              uint64_t timeout_ns, int* info, int op, int src, int phase) {
    if (ld_acquire_sys(flag) == want) return true;
    const WaitEnd end = bounded_wait<256>(
        global_timer_ns(), timeout_ns, [&] { return ld_acquire_sys(flag) == want; },
        [&] { return ld_volatile(abort_word(my_buf)) == seq; });
    if (end == WaitEnd::kTimedOut) {
        *abort_word(my_buf) = seq;
        record_error(info, kErrTimeout, op, src, phase);
    }
    return end == WaitEnd::kReady;
}

}  // namespace epcomm
