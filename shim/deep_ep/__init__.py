"""``import deep_ep`` for DeepEP V1 callers that are not edited, served by epcomm.

Every name is epcomm's own object (``deep_ep.Buffer is epcomm.Buffer``), never a copy: a caller mixing
``deep_ep`` and ``epcomm`` names sees one class of each. The modules are those callers import:
``deep_ep`` (Buffer, Config, EventOverlap, topk_idx_t), ``deep_ep.utils`` (EventOverlap, EventHandle) and
``deep_ep.buffer`` (Buffer and the names DeepEP's module holds).

This package must never stand in for a real DeepEP, so before importing epcomm it looks for one and
refuses to load (RuntimeError, not ImportError: callers probe ``import deep_ep`` under ``except
ImportError`` and would silently go on without either).
"""

from __future__ import annotations


def _same_file(a: str, b: str) -> bool:
    try:
        with open(a, "rb") as fa, open(b, "rb") as fb:
            return fa.read() == fb.read()
    except OSError:
        return False


def _real_deep_ep() -> str | None:
    """What a real DeepEP left in this environment, in words, or None.

    A DeepEP earlier on sys.path is the one imported and never reaches here; what is looked for is one
    later on the path, DeepEP V1's extension (the top-level ``deep_ep_cpp``, which this package does not
    have), or DeepEP's distribution (``deep_ep``), whose files this package may have replaced."""
    import importlib.machinery
    import importlib.metadata
    import importlib.util
    import os
    import sys

    here = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    found = []
    for entry in sys.path:
        if not isinstance(entry, str) or os.path.realpath(entry or os.curdir) == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec(__name__, [entry])
        # A folder named deep_ep without __init__.py (a namespace portion, origin None) is not a package,
        # and a second copy of this one (its source tree beside an install) is not DeepEP.
        if spec is None or spec.origin is None or _same_file(spec.origin, __file__):
            continue
        found.append(f"another {__name__} package at {os.path.dirname(spec.origin)}")
        break
    extension = importlib.util.find_spec("deep_ep_cpp")
    if extension is not None:
        found.append(f"DeepEP's extension deep_ep_cpp at {extension.origin}")
    try:
        dist = importlib.metadata.distribution("deep_ep")
        found.append(f"the distribution {dist.metadata['Name']} {dist.version}")
    except importlib.metadata.PackageNotFoundError:
        pass
    return "; ".join(found) or None


_found = _real_deep_ep()
if _found is not None:
    raise RuntimeError(f"deep_ep: this is epcomm's deep_ep (the epcomm-deep-ep package, {__file__}), and a real "
                       f"DeepEP is installed too ({_found}). It will not stand in for DeepEP: keep one of them, "
                       "`pip uninstall epcomm-deep-ep` to use DeepEP (then reinstall DeepEP if both were installed "
                       "into the same site-packages) or `pip uninstall deep_ep` to use epcomm.")
del _found

import epcomm as _epcomm  # noqa: E402  (after the check: nothing of epcomm loads beside a real DeepEP)
from epcomm import Buffer, Config, EventOverlap, topk_idx_t  # noqa: E402

from . import buffer, utils  # noqa: E402,F401  (DeepEP's package imports both on import)

# DeepEP's API level this serves, and epcomm's release beside it (a PEP 440 local label).
__version__ = f"1.2.1+epcomm.{_epcomm.__version__}"
__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]
