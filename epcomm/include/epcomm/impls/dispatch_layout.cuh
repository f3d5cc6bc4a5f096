// get_dispatch_layout: per-rank, per-domain and per-expert token counts and the token-in-rank mask.
#pragma once

#include "../layout/intranode.cuh"

namespace epcomm {

// ------------------------------------------------------------------ get_dispatch_layout
// One thread per token; block-level counts in shared memory, then one global atomic per counter.
__global__ void layout_kernel(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                              int ranks_per_domain, int* per_rank, int* per_domain, int* per_expert, bool* in_rank) {
    extern __shared__ int s_counts[];  // [experts | ranks | domains]
    const int num_domains = num_ranks / ranks_per_domain;
    const int num_counters = num_experts + num_ranks + num_domains;
    for (int i = threadIdx.x; i < num_counters; i += blockDim.x) s_counts[i] = 0;
    __syncthreads();
    const int experts_per_rank = num_experts / num_ranks;
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < num_tokens) {
        unsigned rank_mask = 0;
        for (int k = 0; k < num_topk; ++k) {
            const int64_t e = topk_idx[static_cast<int64_t>(t) * num_topk + k];
            if (e < 0 || e >= num_experts) continue;  // out of range: refused by dispatch's validation
            atomicAdd(&s_counts[e], 1);
            rank_mask |= 1u << (e / experts_per_rank);
        }
        unsigned domain_mask = 0;
        for (int r = 0; r < num_ranks; ++r) {
            const bool hit = rank_mask >> r & 1u;
            in_rank[static_cast<int64_t>(t) * num_ranks + r] = hit;
            if (hit) {
                atomicAdd(&s_counts[num_experts + r], 1);
                domain_mask |= 1u << (r / ranks_per_domain);
            }
        }
        if (per_domain != nullptr)
            for (int d = 0; d < num_domains; ++d)
                if (domain_mask >> d & 1u) atomicAdd(&s_counts[num_experts + num_ranks + d], 1);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < num_counters; i += blockDim.x) {
        const int c = s_counts[i];
        if (c == 0) continue;
        if (i < num_experts) atomicAdd(&per_expert[i], c);
        else if (i < num_experts + num_ranks) atomicAdd(&per_rank[i - num_experts], c);
        else if (per_domain != nullptr) atomicAdd(&per_domain[i - num_experts - num_ranks], c);
    }
}

}  // namespace epcomm
