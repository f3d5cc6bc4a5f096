// The order in which a normal-mode kernel's warps walk rows that come from (or go to) several
// peers. Host and device: tests/test_row_order.py checks it on the CPU.
#pragma once

#include <climits>
#include <cstdint>

namespace epcomm {

// The j-th row of num_blocks blocks of rows taken round-robin: the first row of every block, then
// the second, ..., a block that has run out passed over. Returns the block; idx: the row in it.
// size(k): block k's rows (0: passed over); j must be below their sum. The dispatch receivers and
// the combine senders walk their rows in this order, not block after block: block after block,
// every rank stores into rank 0 first (one link busy, the others idle) and the receivers copy one
// source's rows while the others' have already landed (docs/TUNING.md, row order across peers).
template <class Size>
__host__ __device__ inline int round_robin_row(int j, int num_blocks, Size size, int& idx) {
    int level = 0;      // rows every block still active has given before this span
    int64_t base = 0;   // rows of the spans before this one
    for (;;) {
        int active = 0, next = INT_MAX;
        for (int k = 0; k < num_blocks; ++k) {
            const int n = size(k);
            if (n > level) {
                ++active;
                next = next < n ? next : n;
            }
        }
        if (active == 0) break;  // j beyond the rows: not reached by the callers
        const int64_t span = static_cast<int64_t>(active) * (next - level);
        if (j < base + span) {
            const int pos = static_cast<int>((j - base) % active);
            idx = level + static_cast<int>((j - base) / active);
            for (int k = 0, c = 0; k < num_blocks; ++k)
                if (size(k) > level && c++ == pos) return k;
        }
        base += span;
        level = next;
    }
    idx = 0;
    return 0;
}

}  // namespace epcomm
