"""The intranode entry points take call records (structs in csrc/kernels/intranode.cu) that Python
fills through ctypes mirrors; a mirror that drifts from its struct passes garbage to the kernels.
Checked without a GPU: the library is built from intranode.cu alone, as host code and PTX (nothing
is launched), and loaded lazily (the CUDA driver it links against may be absent)."""

from __future__ import annotations

import ctypes
import os
import subprocess

import pytest

from epcomm.backends.cuda import build, intranode
from epcomm.backends.cuda.capi import check_struct_layout


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> ctypes.CDLL:
    try:
        nvcc = build.find_nvcc()
    except RuntimeError:
        pytest.skip("nvcc not found")
    out = tmp_path_factory.mktemp("records") / "libintranode.so"
    source = build.PACKAGE_DIR / "csrc" / "kernels" / "intranode.cu"
    subprocess.run([nvcc, "-std=c++17", "-gencode=arch=compute_90,code=compute_90", "-Xcompiler", "-fPIC", "-shared",
                    "-o", str(out), str(source)], check=True, capture_output=True)
    return ctypes.CDLL(str(out), mode=os.RTLD_LAZY)


def test_call_records_match_the_library(library):
    intranode.bind_calls(library)
    with pytest.raises(ctypes.ArgumentError):  # each entry point takes its own kind of record
        library.epcomm_dispatch(intranode.CombineCall(), None)


def test_a_mirror_with_two_fields_swapped_is_refused(library):
    names = [name for name, _ in intranode.DispatchCall._fields_]
    i, j = names.index("x"), names.index("scales")  # same type, adjacent: the layout alone agrees
    swapped = list(intranode.DispatchCall._fields_)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    mirror = type("DispatchCall", (ctypes.Structure,), {"_fields_": swapped})
    with pytest.raises(RuntimeError, match=r"field 1 is x at offset 32 \(8 bytes\) in the library, scales"):
        check_struct_layout(library, mirror)


def test_a_mirror_missing_a_field_is_refused(library):
    mirror = type("CombineCall", (ctypes.Structure,), {"_fields_": intranode.CombineCall._fields_[:-1]})
    with pytest.raises(RuntimeError, match="pad0 at offset 140 .* nothing in the mirror"):
        check_struct_layout(library, mirror)
