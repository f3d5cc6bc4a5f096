"""The intranode and low-latency entry points take call records (declared once, in csrc/intranode.cu
and csrc/low_latency.cu) that Python fills through ctypes structures built from the library's field
tables; a structure that drifted from its struct would pass garbage to the kernels. Checked without
a GPU: a library is built from one source alone (intranode.cu; low_latency.cu, the IPC library's
low-latency kernels), as host code and PTX (nothing is launched), and loaded lazily (the CUDA driver
it links against may be absent)."""

from __future__ import annotations

import ctypes
import os
import subprocess

import pytest

from epcomm import tuning
from epcomm.backends.cuda import build, intranode, low_latency
from epcomm.backends.cuda.capi import check_struct_layout, load_records


def build_alone(tmp_path_factory, name: str) -> ctypes.CDLL:
    try:
        nvcc = build.find_nvcc()
    except RuntimeError:
        pytest.skip("nvcc not found")
    out = tmp_path_factory.mktemp("records") / f"lib{name}.so"
    source = build.PACKAGE_DIR / "csrc" / f"{name}.cu"
    subprocess.run([nvcc, "-std=c++17", "-gencode=arch=compute_90,code=compute_90", "-Xcompiler", "-fPIC", "-shared",
                    "-o", str(out), str(source)], check=True, capture_output=True)
    return ctypes.CDLL(str(out), mode=os.RTLD_LAZY)


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> ctypes.CDLL:
    return build_alone(tmp_path_factory, "intranode")


@pytest.fixture(scope="module")
def ll_library(tmp_path_factory) -> ctypes.CDLL:
    return build_alone(tmp_path_factory, "low_latency")


def test_call_records_are_built_from_the_library(library):
    records = intranode.bind_calls(library)
    names = [name for name, _ in records.DispatchCall._fields_]
    assert names[:3] == ["context", "x", "scales"] and names[-1] == "local_by_receiver", names
    assert dict(records.DispatchCall._fields_)["context"] is records.CallContext
    assert dict(records.DispatchCall._fields_)["cap_rows"] is ctypes.c_int64
    with pytest.raises(ctypes.ArgumentError):  # each entry point takes its own kind of record
        library.epcomm_dispatch(records.CombineCall(), None)


def test_every_buffer_fills_the_same_record_classes(library):
    # The entry points' argtypes name the record classes: a second Buffer binding the library again must
    # not swap them for new ones, or the first Buffer's records would be refused.
    first, second = intranode.bind_calls(library), intranode.bind_calls(library)
    assert first.DispatchCall is second.DispatchCall and first.CallContext is second.CallContext
    assert library.epcomm_dispatch.argtypes[0]._type_ is first.DispatchCall


def test_a_record_with_two_fields_swapped_is_refused(library):
    records = intranode.bind_calls(library)
    names = [name for name, _ in records.DispatchCall._fields_]
    i, j = names.index("x"), names.index("scales")  # same type, adjacent: the layout alone agrees
    swapped = list(records.DispatchCall._fields_)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    mirror = type("DispatchCall", (ctypes.Structure,), {"_fields_": swapped})
    with pytest.raises(RuntimeError, match=r"field 1 is x at offset 32 \(8 bytes\) in the library, scales"):
        check_struct_layout(library, mirror)


def test_a_record_missing_a_field_is_refused(library):
    records = intranode.bind_calls(library)
    mirror = type("CombineCall", (ctypes.Structure,), {"_fields_": records.CombineCall._fields_[:-1]})
    with pytest.raises(RuntimeError, match="num_send_blocks at offset 132 .* nothing in the mirror"):
        check_struct_layout(library, mirror)


def test_an_unknown_record_is_refused(library):
    with pytest.raises(RuntimeError, match="no call record LLDispatchCall"):
        load_records(library, "LLDispatchCall")


def test_ll_call_records_are_built_from_the_library(ll_library):
    records = low_latency.bind_calls(ll_library)
    assert [name for name, _ in records.LLCombineCall._fields_][-2:] == ["threshold", "send_blocks"]
    with pytest.raises(ctypes.ArgumentError):
        ll_library.epcomm_ll_dispatch(records.LLCombineCall(), 1, None, None)


def test_ll_records_are_read_through_their_own_exports(ll_library):
    # The IPC library holds the intranode records too: the low-latency ones answer to other names.
    assert ll_library.epcomm_ll_struct_layout(b"DispatchCall", None, 0) == -1
    records = low_latency.bind_calls(ll_library)
    names = [name for name, _ in records.LLCombineCall._fields_]
    i, j = names.index("topk_weights"), names.index("slot_map")  # same type, adjacent
    swapped = list(records.LLCombineCall._fields_)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    mirror = type("LLCombineCall", (ctypes.Structure,), {"_fields_": swapped})
    with pytest.raises(RuntimeError, match=r"field 8 is topk_weights at offset 104 \(8 bytes\) in the library"):
        check_struct_layout(ll_library, mirror, "epcomm_ll_struct")


def test_combine_partials_fit_the_slot():
    """A combine by partial sums needs [R][N] partial rows and [R][N] request records in the slot's
    [E][N]-row combine area, and 2R signals in its E: one expert per rank leaves no room."""
    assert low_latency.request_bytes(8) == 144 and low_latency.request_bytes(32) == 528
    assert low_latency.partials_fit(8, 288, 7168, 8)
    assert low_latency.partials_fit(1, 2, 512, 2)
    assert not low_latency.partials_fit(8, 8, 7168, 8)  # E = R
    assert not low_latency.partials_fit(4, 8, 64, 32)  # records (528 bytes) larger than a row (128)


def test_combine_by_partial_sums_is_asked_for_from_64_tokens_by_default():
    """EPCOMM_LL_COMBINE_PARTIALS=auto takes partial sums from 64 tokens a rank (EP4 measured: slower
    below, from the second exchange's latency; faster from 64), 1 always, 0 never."""
    assert tuning.PARTIALS_AUTO_MIN_TOKENS == 64
    assert [tuning.partials_asked("auto", n) for n in (1, 32, 63, 64, 128, 256)] == [False] * 3 + [True] * 3
    assert all(tuning.partials_asked("1", n) for n in (1, 64, 4096))
    assert not any(tuning.partials_asked("0", n) for n in (1, 64, 4096))


def test_dispatch_messages_fill_128_byte_lines_where_the_area_has_room():
    """The dispatch's messages [R][N] take a multiple of 128 bytes from a 128-byte aligned base (each
    512-byte FP8 unit fills whole NVLink lines) where the dispatch area holds them, the index and the
    base's rounding; one BF16 expert per rank with a single token leaves no room: 16, as before."""
    assert low_latency.message_layout(128, 7168, 4, 288, True, False) == (7424, 128)
    assert low_latency.message_layout(128, 7168, 8, 288, False, False) == (14336, 128)
    assert low_latency.message_layout(16, 512, 4, 16, True, True) == (640, 128)
    assert low_latency.message_layout(1, 512, 2, 2, False, False) == (1024, 16)
    assert low_latency.message_layout(4, 1000, 2, 2, False, False) == (2000, 16)


def test_error_tables_name_the_protocol_codes():
    """Every error and op the host's tables name is defined once, in common/protocol.cuh, with a value of its own."""
    from epcomm.backends.cuda.errors import HIERARCHICAL, INTRANODE, LOW_LATENCY, device_codes

    codes = device_codes()
    errors = {name: value for name, value in codes.items() if name.startswith("kErr")}
    assert len(errors) >= 11 and len(set(errors.values())) == len(errors), errors
    for family in (INTRANODE, LOW_LATENCY, HIERARCHICAL):
        for name in [e.name for e in family.errors] + list(family.ops):
            assert name in codes, (family.name, name)
