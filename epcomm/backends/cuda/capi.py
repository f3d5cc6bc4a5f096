"""How the Python side calls the kernel library's C ABI (ctypes): tensor and stream pointers,
call records (ctypes.Structure mirrors of C structs, checked against the library), return codes,
and the alignment every kernel relies on. One place for both CUDA backends."""

from __future__ import annotations

import ctypes
import itertools
import types

import torch

# The stream helpers, re-exported: the backends take everything of the C ABI from here.
from ...utils.streams import current_stream as current_stream
from ...utils.streams import raw_stream


def addr(t: torch.Tensor | None) -> int:
    """A tensor's device address as an integer, for a call record's uint64 field (0 for None or an
    empty tensor)."""
    return t.data_ptr() if t is not None else 0


def ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    """A tensor's device address (NULL for None or an empty tensor)."""
    return ctypes.c_void_p(addr(t))


def stream_ptr(device: torch.device) -> ctypes.c_void_p:
    """The current CUDA stream of ``device``, where the kernels are launched."""
    return ctypes.c_void_p(raw_stream(device))


def check(code: int, what: str) -> None:
    """Raise on a nonzero return code of a library call (a cudaError_t, or -1)."""
    if code != 0:
        raise RuntimeError(f"epcomm {what}: CUDA call failed with error {code}")


def check_aligned(name: str, t: torch.Tensor) -> None:
    """The kernels move 16-byte words: a tensor must start on a 16-byte boundary."""
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address (the kernels move 16-byte words; a view "
                         "with an odd storage offset is not aligned); pass a fresh or .clone()d tensor")


_SCALARS = {"uint64_t": ctypes.c_uint64, "int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32,
            "uint32_t": ctypes.c_uint32, "float": ctypes.c_float}


# Built once per library: its entry points' argtypes name these classes, so every Buffer of the
# process must fill the same ones (a second set would be refused by the first Buffer's calls).
_RECORDS: dict[tuple[ctypes.CDLL, str], type[ctypes.Structure]] = {}


def load_records(lib: ctypes.CDLL, names: str, exports: str = "epcomm_struct") -> types.SimpleNamespace:
    """The library's call records ``names`` as ctypes structures, built from the field tables it exports
    (``<exports>_layout``, ``_field_name``, ``_field_type``: each record is declared once, in C), then
    checked field by field against the library (ctypes and nvcc must lay them out alike). The same
    classes for every call with the same library."""
    field_name, field_type = getattr(lib, exports + "_field_name"), getattr(lib, exports + "_field_type")
    field_name.restype = field_type.restype = ctypes.c_char_p

    def build(name: str) -> type[ctypes.Structure]:
        if (lib, name) not in _RECORDS:
            fields = []
            for i in itertools.count():
                field = field_name(name.encode(), i)
                if field is None:
                    break
                ctype = field_type(name.encode(), i).decode()
                fields.append((field.decode(), _SCALARS.get(ctype) or build(ctype)))
            if not fields:
                raise RuntimeError(f"epcomm: the kernel library has no call record {name}; rebuild it")
            record = type(name, (ctypes.Structure,), {"_fields_": fields})
            check_struct_layout(lib, record, exports)
            _RECORDS[(lib, name)] = record
        return _RECORDS[(lib, name)]

    return types.SimpleNamespace(**{name: build(name) for name in names.split()})


def check_struct_layout(lib: ctypes.CDLL, structure: type[ctypes.Structure], exports: str = "epcomm_struct") -> None:
    """Raise unless the library's struct of the same name has this mirror's size and, field by
    field in order, its names, offsets and sizes (the library's ``<exports>_layout`` and
    ``<exports>_field_name`` say them: the IPC library exports the intranode records as
    epcomm_struct_* and the low-latency ones, which the NVSHMEM library holds too, as
    epcomm_ll_struct_*). A field added, removed, retyped or moved on one side only would make every
    call pass garbage."""
    name = structure.__name__
    struct_layout, field_name = getattr(lib, exports + "_layout"), getattr(lib, exports + "_field_name")
    mirror = [(field, getattr(structure, field).offset, getattr(structure, field).size)
              for field, _ in structure._fields_]
    count = 1 + 2 * len(mirror)
    out = (ctypes.c_int64 * count)()
    n = struct_layout(name.encode(), out, count)
    if n < 0:
        raise RuntimeError(f"epcomm: the kernel library has no struct {name} (its ctypes mirror is "
                           f"{structure.__module__}.{name}); rebuild it from the same sources")
    if n > count:  # more fields in C: read them all to name the first one the mirror lacks
        out = (ctypes.c_int64 * n)()
        struct_layout(name.encode(), out, n)
    field_name.restype = ctypes.c_char_p
    library = [(field_name(name.encode(), i).decode(), out[1 + 2 * i], out[2 + 2 * i])
               for i in range((n - 1) // 2)]
    if out[0] == ctypes.sizeof(structure) and library == mirror:
        return
    i = next((i for i, (a, b) in enumerate(zip(library, mirror)) if a != b), min(len(library), len(mirror)))

    def describe(fields: list[tuple[str, int, int]]) -> str:
        return "nothing" if i >= len(fields) else "{} at offset {} ({} bytes)".format(*fields[i])

    raise RuntimeError(f"epcomm: the kernel library's {name} ({out[0]} bytes) does not match its ctypes mirror "
                       f"{structure.__module__}.{name} ({ctypes.sizeof(structure)} bytes): field {i} is "
                       f"{describe(library)} in the library, {describe(mirror)} in the mirror; the two must "
                       "declare the same fields in the same order")


def library_constants(lib: ctypes.CDLL, exports: str, names: str) -> dict[str, int]:
    """The values of the constants ``names`` (space-separated) the library exports through the
    function ``exports`` (epcomm_constant, epcomm_hierarchical_constant), by name; -1 where absent."""
    lookup = getattr(lib, exports)
    return {name: lookup(name.encode()) for name in names.split()}
