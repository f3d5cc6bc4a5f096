"""``deep_ep.buffer``: the module that holds DeepEP's Buffer and the names it imports, epcomm's own."""

from epcomm import Buffer, Config
from epcomm.event import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap"]
