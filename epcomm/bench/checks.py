"""A rank's checks of its own outputs against the single-process oracle (epcomm/oracle.py).

Dispatch is a copy, so its outputs must match bit for bit (BF16 rows, FP8 bytes and scales, top-k
ids and weights). Combine sums in fp32 and rounds to BF16 once, so it must lie within one BF16
rounding (2^-8 relative) of a float64 sum. Each check returns a list of failure messages (empty
when everything matched) instead of raising: a rank that raised would leave its peers waiting in
the next collective, while a returned failure lets the whole run finish and report it.
"""

from __future__ import annotations

import torch

from .. import oracle
from ..fp8 import per_token_cast_back, per_token_cast_to_fp8
from ..utils.tensors import as_bytes
from .workloads import RankInputs

BF16_REL_TOL = 2.0 ** -8
ABS_TOL = 1e-6


class Expected:
    """What a rank should receive in normal mode (the oracle's dispatch): rows by source rank, then
    ascending source token."""

    def __init__(self, inputs: list[RankInputs], rank: int, num_experts: int) -> None:
        got = oracle.dispatch_to(rank, [src.x for src in inputs], [src.topk_idx for src in inputs], num_experts,
                                 topk_weights=[src.topk_weights for src in inputs])
        self.x, self.topk_idx, self.topk_weights = got.x, got.topk_idx, got.topk_weights
        self.recv_splits: list[int] = got.recv_counts
        self.num_rows = got.num_recv
        self.expert_counts: list[int] = got.expert_counts
        # is_token_in_rank of this rank's own tokens: where its rows go, in rank order.
        self.in_rank = oracle.dispatch_layout(inputs[rank].topk_idx, num_experts, len(inputs))[3]


def poison_(t: torch.Tensor, byte: int = 0x7F) -> None:
    """Fill ``t`` (any dtype, any strides) with the byte pattern ``byte``, so an output the kernels
    leave unwritten shows."""
    pattern = torch.full((t.numel() * t.element_size(),), byte, dtype=torch.uint8, device=t.device)
    t.copy_(pattern.view(t.dtype).view(t.shape))


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise equality (so -0.0 vs 0.0 or a NaN pattern counts as a difference)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    return torch.equal(as_bytes(got), as_bytes(want))


def _close_to_bf16(got: torch.Tensor, ref: torch.Tensor, rounded: torch.Tensor | None = None) -> tuple[bool, float]:
    """Within bf16 rounding of ref, and of `rounded` too where given (the magnitude of intermediate
    values that were rounded to bf16 on the way)."""
    if got.shape != ref.shape:
        return False, float("inf")
    err = (got.double() - ref).abs()
    scale = ref.abs() if rounded is None else rounded + ref.abs()
    ok = bool((err <= scale * BF16_REL_TOL + ABS_TOL).all())
    return ok, float(err.max()) if err.numel() else 0.0


def check_normal_dispatch(tag: str, recv_x, recv_topk_idx, recv_topk_weights, expert_list,
                          want: Expected, dtype: str) -> list[str]:
    """Full (non-cached) dispatch outputs; ``recv_topk_*``/``expert_list`` None for a cached one."""
    failures = []
    if dtype == "fp8":
        want_data, want_scales = per_token_cast_to_fp8(want.x)
        if not same_bits(recv_x[0], want_data):
            failures.append(f"{tag}: recv_x FP8 data differs from the reference")
        if not torch.equal(recv_x[1], want_scales):
            failures.append(f"{tag}: recv_x FP8 scales differ from the reference")
    elif not same_bits(recv_x, want.x):
        failures.append(f"{tag}: recv_x differs from the reference (shape {tuple(recv_x.shape)}, want "
                        f"{tuple(want.x.shape)})")
    if recv_topk_idx is not None and not torch.equal(recv_topk_idx, want.topk_idx):
        failures.append(f"{tag}: recv_topk_idx differs from the reference")
    if recv_topk_weights is not None and not torch.equal(recv_topk_weights, want.topk_weights):
        failures.append(f"{tag}: recv_topk_weights differ from the reference")
    if expert_list is not None and list(expert_list) != want.expert_counts:
        failures.append(f"{tag}: num_recv_tokens_per_expert_list {list(expert_list)} != {want.expert_counts}")
    return failures


def normal_combine_input(recv_x, dtype: str) -> torch.Tensor:
    """The BF16 rows combine sends back: the dispatched rows, dequantized when dispatch was FP8."""
    return recv_x if dtype == "bf16" else per_token_cast_back(recv_x[0], recv_x[1])


def check_normal_combine(tag: str, combined: torch.Tensor, mine: RankInputs, want: Expected,
                         dtype: str) -> list[str]:
    """Each token comes back once per destination rank, so the sum is (destinations) x its row."""
    base = mine.x if dtype == "bf16" else per_token_cast_back(*per_token_cast_to_fp8(mine.x))
    num_dest = want.in_rank.sum(1, keepdim=True).double()
    ok, err = _close_to_bf16(combined, base.double() * num_dest)
    return [] if ok else [f"{tag}: combined_x is not within BF16 rounding of the float64 reference "
                          f"(max abs error {err:.3g})"]


def check_a2a(tag: str, recv: torch.Tensor, want: Expected, back: torch.Tensor | None,
              sent: torch.Tensor) -> list[str]:
    failures = []
    if not same_bits(recv, want.x):
        failures.append(f"{tag}: all_to_all_single received rows differ from the reference")
    if back is not None and not same_bits(back, sent):
        failures.append(f"{tag}: the reverse all_to_all_single did not return the rows sent")
    return failures


def check_ll_dispatch(tag: str, recv_x, recv_count: torch.Tensor, handle, inputs: list[RankInputs], rank: int,
                      num_experts: int) -> list[str]:
    """Per local expert, one block per source rank (any block order, any row order inside a block).

    The handle's ``layout_range`` ((begin << 32) | count per [expert, source]) locates each block
    and ``src_info`` names each row's source token, so each block, its rows put in token order, is
    compared with the oracle's block of the same expert and source.
    """
    failures: list[str] = []
    num_ranks = len(inputs)
    data, scales = recv_x
    want = oracle.low_latency_dispatch_to(rank, [src.x for src in inputs], [src.topk_idx for src in inputs],
                                          num_experts, data.shape[1] // num_ranks, use_fp8=True)
    want_data, want_scales = want.x
    # Compare FP8 as bytes: row gathers are not implemented for float8 on every device.
    got_bytes, want_bytes = data.view(torch.uint8), want_data.view(torch.uint8)
    layout, want_layout = handle.layout_range.cpu().tolist(), want.layout_range.cpu().tolist()
    counts, want_counts = recv_count.cpu().tolist(), want.count.cpu().tolist()
    for e in range(len(want_counts)):
        for j in range(num_ranks):
            begin, got_count = layout[e][j] >> 32, layout[e][j] & 0xFFFFFFFF
            want_begin, c = want_layout[e][j] >> 32, want_layout[e][j] & 0xFFFFFFFF
            if got_count != c:
                failures.append(f"{tag}: expert {e} got {got_count} rows from rank {j}, want {c}")
                continue
            src_idx, order = handle.src_info[e, begin:begin + c].to(torch.int64).sort(stable=True)
            if not torch.equal(src_idx, want.src_info[e, want_begin:want_begin + c].to(src_idx)):
                failures.append(f"{tag}: expert {e}: the tokens received from rank {j} are not those routed")
                continue
            rows = begin + order.to(data.device)
            if not same_bits(got_bytes[e, rows], want_bytes[e, want_begin:want_begin + c].to(data.device)):
                failures.append(f"{tag}: expert {e}: FP8 rows from rank {j} differ from the reference")
            if not torch.equal(scales[e, rows], want_scales[e, want_begin:want_begin + c].to(scales.device)):
                failures.append(f"{tag}: expert {e}: FP8 scales from rank {j} differ from the reference")
        if counts[e] != want_counts[e]:
            failures.append(f"{tag}: recv_count[{e}] = {counts[e]}, want {want_counts[e]}")
        if len(failures) > 8:
            break  # enough to diagnose; the rest would repeat
    return failures


def ll_combine_input(recv_x, recv_count: torch.Tensor, num_max_tokens: int, num_ranks: int) -> torch.Tensor:
    """What the experts return: the dequantized received rows, zeros past each expert's count."""
    data, scales = recv_x
    e_local, rows, hidden = data.shape
    out = torch.zeros((e_local, rows, hidden), dtype=torch.bfloat16, device=data.device)
    for e, c in enumerate(recv_count.cpu().tolist()):
        if c:
            out[e, :c] = per_token_cast_back(data[e, :c], scales[e, :c])
    return out


def check_ll_combine(tag: str, combined: torch.Tensor, mine: RankInputs, partials: bool = False) -> list[str]:
    """Every selected expert returns the same dequantized row, so the sum is (sum of weights) x row.

    ``partials``: a combine by partial sums on several ranks (EPCOMM_LL_COMBINE_PARTIALS) rounds
    each rank's partial to bf16 before the final sum, so the result is within bf16 rounding of the
    partials' summed magnitude (at most sum |w| x |row|) plus that of the output, as its tests allow."""
    base = per_token_cast_back(*per_token_cast_to_fp8(mine.x)).double()
    valid = mine.topk_idx >= 0
    weight = torch.where(valid, mine.topk_weights, 0.0).double().sum(1, keepdim=True)
    partial_magnitude = (torch.where(valid, mine.topk_weights.abs(), 0.0).double().sum(1, keepdim=True) * base.abs()
                         if partials else None)
    ok, err = _close_to_bf16(combined, base * weight, partial_magnitude)
    what = "the bf16 rounding of its partials and of the result" if partials else "BF16 rounding"
    return [] if ok else [f"{tag}: low-latency combined_x is not within {what} of the float64 reference "
                          f"(max abs error {err:.3g})"]
