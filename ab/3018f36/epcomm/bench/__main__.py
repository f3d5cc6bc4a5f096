"""``python -m epcomm.bench``: see ``epcomm.bench.driver`` (and ``--help``)."""

from __future__ import annotations

import sys

from .driver import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
