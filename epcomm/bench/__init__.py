"""``epcomm.bench``: the benchmark (method in docs/PERFORMANCE.md), checked against a single-process reference.

Run ``python -m epcomm.bench`` (or ``epcomm bench`` / ``epcomm-bench``). Modules by role:
``options`` (command line), ``workloads`` (cases, routing and inputs), ``checks`` (the reference),
``timing`` (per-rank medians), ``metrics`` (byte counts, slowest rank), ``runner`` (rank side),
``report`` (records, table, JSON), ``plot`` (PNG) and ``driver`` (``main``).
"""

from .driver import main

__all__ = ["main"]
