"""Fails when a kernel's PTX reads BF16 rows two bf16 at a time instead of 16 bytes per load.

``ld.*.v2.u16`` is what nvcc emits when a helper that views a 16-byte word as bf16 pairs (the row
sums' add_bf16x8) is bound to global memory instead of a loaded register: a quarter of the bytes per
load instruction, and a combine that slows down without any test failing. compile_kernels.sh runs
this on the PTX of the kernels that sum rows.
Usage: python3 tools/ci/check_ptx_loads.py FILE.ptx KERNEL_SUBSTRING..."""

from __future__ import annotations

import re
import sys

# ld[.space][.qualifiers].v2/.v4 of 16-bit elements (u16 or b16), whatever qualifiers come between.
NARROW_ROW_LOAD = re.compile(r"\bld(?:\.[A-Za-z0-9_:]+)*\.v[24]\.[ub]16\b")


def kernel_bodies(ptx: str) -> dict[str, str]:
    """Each .entry's and .func's name and text up to the next one (a device function nvcc did not
    inline is checked under its own name)."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"\.(?:entry|func)\s+(?:\([^)]*\)\s*)?(\S+?)\s*\(", ptx)]
    return {name: ptx[at:(starts[i + 1][0] if i + 1 < len(starts) else len(ptx))]
            for i, (at, name) in enumerate(starts)}


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__)
        return 2
    bodies = kernel_bodies(open(argv[1]).read())
    status = 0
    for want in argv[2:]:
        names = [n for n in bodies if want in n]
        if not names:
            print(f"check_ptx_loads: no kernel matching {want!r} in {argv[1]}")
            status = 1
        for name in names:
            hits = NARROW_ROW_LOAD.findall(bodies[name])
            if hits:
                print(f"check_ptx_loads: {name} loads bf16 pairs from memory ({len(hits)} x {hits[0]}): pass the "
                      "helper a loaded int4, not a reference to the row")
                status = 1
    if status == 0:
        print(f"check_ptx_loads: {argv[1]}: no bf16-pair loads in {', '.join(argv[2:])}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
