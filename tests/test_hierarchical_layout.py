"""The host-side arithmetic of the hierarchical CUDA backend (no GPU needed): buffer sizes that hold
exactly what they promise, the prefix counts that place rows, and the transport setting."""

from __future__ import annotations

import pytest
from conftest import env_var

from epcomm import _env
from epcomm.backends.cuda import hierarchical as h


@pytest.mark.parametrize("tokens, hidden, elem, ranks, rpd, topk, scales", [
    (1, 256, 2, 2, 1, 1, 2), (32, 256, 2, 2, 1, 4, 2), (4096, 7168, 2, 2, 1, 8, 56), (4096, 7168, 1, 8, 4, 8, 56),
    (300, 2048, 2, 8, 2, 8, 16), (7, 512, 2, 4, 2, 3, 4), (5, 7168, 2, 64, 8, 8, 56)])
def test_buffer_sizes_hold_what_they_promise(tokens, hidden, elem, ranks, rpd, topk, scales):
    """rdma_bytes_needed(T) gives regions of at least T rows for a dispatch (either dtype, as the
    dispatch sizes them) and its combine; nvl_bytes_needed(N) holds N received rows of both."""
    num_domains = ranks // rpd
    rdma = h.rdma_bytes_needed(tokens, hidden, elem, ranks, rpd, topk, scales)
    area = (rdma - h.stage_offset(ranks)) // 2 // h.ALIGN * h.ALIGN
    for e in {elem, 1}:  # an FP8 call on a buffer sized for BF16 fits too
        row1 = h.dispatch_fields(hidden * e, scales if e == 1 else 0, topk, True, rpd, True)
        rows = min(h.fit_rows(row1, area), h.fit_rows(h.combine_fields(hidden, topk), area)) // num_domains
        assert rows >= tokens, (e, rows, tokens)
        assert h.field_offsets(row1, num_domains * rows)[1] <= area
        assert h.field_offsets(h.combine_fields(hidden, topk), num_domains * rows)[1] <= area
    received = tokens * ranks
    nvl = h.nvl_bytes_needed(received, hidden, elem, topk, scales)
    for row2 in ([hidden * elem, scales * 4, topk * 8, topk * 4], [hidden * 2, topk * 4]):
        fit = h.fit_rows(row2, nvl - h.DOMAIN_HEADER)
        assert fit >= received and h.field_offsets(row2, fit)[1] <= nvl - h.DOMAIN_HEADER


def test_transport_setting_is_parsed_strictly():
    for good in ("auto", "put"):
        with env_var("EPCOMM_HIER_TRANSPORT", good):
            assert _env.hier_transport() == good
    with env_var("EPCOMM_HIER_TRANSPORT", "rdma"), pytest.raises(ValueError, match="auto or put"):
        _env.hier_transport()
