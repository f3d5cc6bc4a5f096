"""epcomm: expert-parallel communication for Mixture-of-Experts models (a drop-in for DeepEP's Buffer)."""

from ._checks import topk_idx_t
from .buffer import Buffer
from .config import Config
from .event import EventOverlap
from .fp8 import per_token_cast_back, per_token_cast_to_fp8
from .handle import DispatchHandle, LowLatencyHandle

__version__ = "0.1.0"

__all__ = [
    "Buffer",
    "Config",
    "DispatchHandle",
    "EventOverlap",
    "LowLatencyHandle",
    "per_token_cast_back",
    "per_token_cast_to_fp8",
    "topk_idx_t",
]
