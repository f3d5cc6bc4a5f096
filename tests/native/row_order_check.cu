// Host-side check of round_robin_row (epcomm/include/epcomm/common/row_order.cuh), run by
// tests/test_row_order.py: for random block sizes (zeros, one huge block, equal sizes), every
// (block, row) is visited once, rows in order within each block, and no block is more than one
// round ahead of a block that still has rows. Prints "ok" or the first failure; exit status 1 on it.
#include <cstdio>
#include <random>
#include <vector>

#include "../../epcomm/include/epcomm/common/row_order.cuh"

int main() {
    std::mt19937 rng(1234);
    for (int trial = 0; trial < 3000; ++trial) {
        const int nb = 1 + static_cast<int>(rng() % 9);
        std::vector<int> size(nb);
        const int shape = trial % 4;
        for (int k = 0; k < nb; ++k) {
            if (shape == 0) size[k] = static_cast<int>(rng() % 50);
            else if (shape == 1) size[k] = rng() % 3 == 0 ? 0 : static_cast<int>(rng() % 7);
            else if (shape == 2) size[k] = k == 0 ? 1000 + static_cast<int>(rng() % 100) : static_cast<int>(rng() % 3);
            else size[k] = 37;
        }
        int total = 0;
        for (int n : size) total += n;
        std::vector<std::vector<int>> seen(nb);
        for (int k = 0; k < nb; ++k) seen[k].assign(size[k], 0);
        std::vector<int> next_idx(nb, 0);
        for (int j = 0; j < total; ++j) {
            int idx = -1;
            const int k = epcomm::round_robin_row(j, nb, [&](int b) { return size[b]; }, idx);
            if (k < 0 || k >= nb || idx < 0 || idx >= size[k]) {
                std::printf("trial %d: row %d -> block %d row %d out of range\n", trial, j, k, idx);
                return 1;
            }
            if (idx != next_idx[k]) {
                std::printf("trial %d: row %d -> block %d row %d, expected row %d\n", trial, j, k, idx, next_idx[k]);
                return 1;
            }
            ++next_idx[k];
            ++seen[k][idx];
            for (int b = 0; b < nb; ++b)  // round-robin: a block with rows left is at most one round behind
                if (next_idx[b] < size[b] && next_idx[k] > next_idx[b] + 1) {
                    std::printf("trial %d: row %d: block %d at round %d, block %d still at %d\n", trial, j, k,
                                next_idx[k], b, next_idx[b]);
                    return 1;
                }
        }
        for (int k = 0; k < nb; ++k)
            if (next_idx[k] != size[k]) {
                std::printf("trial %d: block %d gave %d of its %d rows\n", trial, k, next_idx[k], size[k]);
                return 1;
            }
    }
    std::printf("ok\n");
    return 0;
}
