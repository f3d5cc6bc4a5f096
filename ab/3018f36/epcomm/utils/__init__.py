"""Helpers: ``launch`` starts local ranks; ``EventHandle`` and ``EventOverlap`` are here as in DeepEP's
``deep_ep.utils`` (Megatron imports them from there)."""

from ..event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
