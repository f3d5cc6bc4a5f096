"""``deep_ep.utils``: the event classes Megatron-LM and torchtitan import from here, epcomm's own."""

from epcomm.event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
