// The error record every mode writes, its codes and op codes: one numbering for the whole library.
// The host reads the record from pinned memory at its sync points; backends/cuda/errors.py takes the
// codes' values from this file by name, so nothing else defines them.
#pragma once

#include "ptx.cuh"

namespace epcomm {

enum ErrorCode : int {
    kErrTimeout = 1,          // a peer did not arrive within EPCOMM_TIMEOUT_S
    kErrMismatch = 2,         // ranks called different operations (hierarchical: or shapes)
    kErrCapacity = 3,         // a buffer or receive area is too small for the call's rows
    kErrWorstTokens = 4,      // more rows arrived than num_worst_tokens
    kErrRefused = 5,          // a rank refused its inputs: nothing moved
    kErrShapes = 6,           // a rank made the call with rows of another shape
    kErrInvalidDispatch = 7,  // low latency: topk_idx out of range, or an expert over its capacity
    kErrIdsDiffer = 8,        // low latency: combine's topk_idx differs from its dispatch's
    kErrAbandoned = 9,        // an earlier wait of this rank gave up, so this call stopped waiting
    kErrEarlierError = 10,    // hierarchical: a rank reported an error in an earlier call
    kErrPeerGaveUp = 11,      // hierarchical: a rank gave this call up
    kErrComputeTimeout = 12,  // low latency: the expert GEMM did not raise a combine's overlap signal in time
};

// The call a record or a barrier signal names (ranks that disagree on the call are told so).
enum Op : int {
    kOpNone = 0,
    kOpDispatch = 1,
    kOpCachedDispatch = 2,
    kOpCombine = 3,
    kOpBarrier = 4,
    kOpLowLatencyDispatch = 5,
    kOpLowLatencyCombine = 6,
};

// Where in its call a wait gave up (the flight recorder's phase; written only with an error).
enum Phase : int {
    kPhaseNone = 0,
    kPhaseNotify = 1,   // the count exchange or the call's barrier: the peer has not entered the call
    kPhaseSend = 2,     // waiting for room at the peer (its acknowledgement, or its receive area)
    kPhaseReceive = 3,  // waiting for the peer's rows or counts of a dispatch
    kPhaseReduce = 4,   // waiting for the rows a combine sums
};

// The record's words at the start of a Buffer's pinned info area.
constexpr int kInfoError = 0;       // 0, or an ErrorCode
constexpr int kInfoErrorOp = 1;     // the Op of the call that failed
constexpr int kInfoErrorPhase = 2;  // the Phase of the wait that recorded it
constexpr int kInfoErrorRanks = 3;  // [ranks]: nonzero for each rank involved

// Input errors leave the Buffer usable; a call abandoned because of another wait names no cause of
// its own; everything else is fatal and names its cause.
__device__ __forceinline__ int error_severity(int code) {
    if (code == 0) return 0;
    if (code == kErrRefused || code == kErrInvalidDispatch || code == kErrIdsDiffer) return 1;
    return code == kErrAbandoned ? 2 : 3;
}

// Record an error of this call: the most severe wins, so the host never takes a fatal call for a
// refused one and a wait that gave up first keeps its cause over the waits it stopped. A timeout
// names the phase of the wait that gave up.
__device__ __forceinline__ void record_error(int* info, int code, int op, int rank, int phase = kPhaseNone) {
    if (rank >= 0) info[kInfoErrorRanks + rank] = 1;
    if (error_severity(code) > error_severity(ld_volatile_int(info + kInfoError))) {
        info[kInfoErrorOp] = op;
        info[kInfoErrorPhase] = phase;
        info[kInfoError] = code;
    }
}

// How a bounded wait ended: what it waited for came, another wait of the call stopped it, or the
// deadline passed. The caller reports what that means in its mode.
enum class WaitEnd { kReady, kStopped, kTimedOut };

// The one bounded wait: poll `ready()` until it holds, and every kChecksEvery polls ask `stop()`
// and the clock (a peer that never comes must not hang the GPU). Polls between checks stay cheap.
template <int kChecksEvery, class Ready, class Stop>
__device__ __forceinline__ WaitEnd bounded_wait(uint64_t start, uint64_t timeout_ns, Ready&& ready, Stop&& stop) {
    static_assert((kChecksEvery & (kChecksEvery - 1)) == 0, "a power of two: the check is a mask");
    for (int spin = 0;; ++spin) {
        if (ready()) return WaitEnd::kReady;
        if ((spin & (kChecksEvery - 1)) == kChecksEvery - 1) {
            if (stop()) return WaitEnd::kStopped;
            if (global_timer_ns() - start > timeout_ns) return WaitEnd::kTimedOut;
        }
    }
}

}  // namespace epcomm
