// The low-latency dispatch kernel: one kernel a call, launched once with both phases (no hook) or
// twice, the send and then the hook's receive, as DeepEP launches its own.
#pragma once

#include "ll_dispatch_recv.cuh"

namespace epcomm {
namespace ll {

// Both phases: each block, once its sends are out, receives (its blocks wait for each other's
// signals, so this launch is cooperative: every block resident at once; see the launcher).
// kSendPhase: a block per token range. kReceivePhase: the same receive as both phases' (one block
// per SM), with the data already in flight or landed. kBlockReceive: a block's units together
// (balanced over blocks, or one block's units at a time under a failed-rank mask) instead of a
// warp group per unit.
template <bool kBlockReceive>
__global__ void __launch_bounds__(kThreads, 1) dispatch(DispatchArgs a) {
    const Layout lay(a.slot, a.slot_bytes, a.num_experts, a.num_ranks, a.num_max_tokens, a.hidden);
    uint8_t* mine = a.peers.bufs[a.rank];
    const int plane = a.phase == kReceivePhase ? 1 : 0;  // the trace's timeline of a receive launch
    ArrivalMode m{};
    SendPlan plan{};
    int64_t seq;
    if (a.phase == kReceivePhase) {
        trace_point(a.trace, plane, kTraceStart);
        seq = *slot_seq(mine, a.slot);
    } else {
        m = dispatch_mode(a, lay, mine);
        plan = send_plan(a, m);
        seq = send_dispatch_messages(a, m, plan);
        if (a.phase == kSendPhase) return;
    }
    if (m.on) {
        // (all of them sending: every block receives after its sends)
        receive_dispatch_arrival(a, m, seq, lay, plan.senders < static_cast<int>(gridDim.x) ? plan.senders : 0);
    } else if constexpr (kBlockReceive) {
        if (a.mask == nullptr)
            receive_dispatch_balanced(a, seq, lay, plane);
        else
            receive_dispatch_units_together(a, seq, lay, plane);
    } else {
        // The units are split among groups of warps, enough groups that every unit has one at once
        // (288 units on 132 blocks: 4 groups of 4 warps): a block's units in turn would each add a
        // wait, a copy and two barriers to the kernel.
        const int wanted = (a.num_experts + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x);
        const int groups = wanted <= 1 ? 1 : wanted <= 2 ? 2 : wanted <= 4 ? 4 : kMaxFusedGroups;
        const int group_threads = kThreads / groups, group = static_cast<int>(threadIdx.x) / group_threads;
        __shared__ int counts[kMaxFusedGroups][kMaxRanks];
        // Barrier 0 is __syncthreads'; the groups take 1.. (a block has 16).
        const WarpGroup g{group * group_threads, group_threads, groups == 1 ? 0 : 1 + group, counts[group]};
        const int first_unit = static_cast<int>(blockIdx.x) * groups;
        for (int unit = first_unit + group; unit < a.num_experts; unit += static_cast<int>(gridDim.x) * groups)
            receive_dispatch_unit(a, seq, lay, unit, plane, g, first_unit);
    }
    if (m.poison) poison_arrival_area(a, m);
    if (a.trace != nullptr) __syncthreads();  // every copy of the block is done
    trace_point(a.trace, plane, kTraceReceived);
    finish_recv_kernel(a.peers, a.num_ranks, a.rank, a.slot, lay.acks, seq, a.mask, a.defer_acks);
    trace_point(a.trace, plane, kTraceEnd);
}

}  // namespace ll
}  // namespace epcomm
