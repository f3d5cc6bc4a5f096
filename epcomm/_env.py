"""Every environment variable epcomm reads, with its default, in one place.

The README's table is generated from ``ENV_VARS``; keep them in step.
"""

from __future__ import annotations

import os

# name -> (default, meaning)
ENV_VARS: dict[str, tuple[str, str]] = {
    "EPCOMM_TIMEOUT_S": ("100", "seconds a call waits for its peers before raising RuntimeError"),
    "EPCOMM_BACKEND": ("auto", "backend used when Buffer(backend=...) is not given: auto, cuda or reference"),
    "EPCOMM_RANKS_PER_DOMAIN": ("", "ranks per scale-up domain (default: the ranks of one host)"),
    "EPCOMM_CACHE_DIR": ("~/.cache/epcomm", "where compiled CUDA kernels are cached"),
    "EPCOMM_DISPATCH_OVERLAP": ("1", "CUDA backend: start a dispatch's sends before the host reads the receive "
                                     "counts (0: one fused kernel after the read)"),
    "EPCOMM_DISPATCH_SEND_SMS_PCT": ("50", "CUDA backend: percent of a dispatch's SMs that send (the rest "
                                           "receive)"),
    "EPCOMM_COMBINE_SEND_SMS_PCT": ("33", "CUDA backend: percent of a combine's SMs that send (the rest reduce)"),
}


def env_str(name: str) -> str:
    default, _ = ENV_VARS[name]
    return os.environ.get(name, default)


def send_sms_pct(name: str) -> float:
    raw = env_str(name)
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a percentage, got {raw!r}") from None
    if not 0 < value < 100:
        raise ValueError(f"{name} must lie in (0, 100), got {value}")
    return value


def timeout_s() -> float:
    raw = env_str("EPCOMM_TIMEOUT_S")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"EPCOMM_TIMEOUT_S must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"EPCOMM_TIMEOUT_S must be > 0, got {value}")
    return value
