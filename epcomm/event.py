"""EventOverlap: a completion event plus the tensors that must live until it fires; EventHandle: DeepEP's
event of the current stream (``deep_ep.utils``; Megatron passes ``EventOverlap(EventHandle())``)."""

from __future__ import annotations

from typing import Any

import torch


class EventOverlap:
    """Wraps a CUDA event recorded after an asynchronous epcomm call.

    ``extra_tensors`` are kept referenced until the event is waited on, so callers need no
    ``record_stream``. On CPU backends the call has already finished and ``event`` is None.
    """

    def __init__(self, event: torch.cuda.Event | None = None, extra_tensors: Any = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the event (a no-op on CPU)."""
        if self.event is not None and torch.cuda.is_available():
            torch.cuda.current_stream().wait_event(self.event)
        self.extra_tensors = None

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.current_stream_wait()

    def __repr__(self) -> str:
        return f"EventOverlap(event={'cuda' if self.event is not None else None})"


class EventHandle(torch.cuda.Event):
    """A CUDA event recorded on the current stream when it is made, as DeepEP's ``EventHandle()``:
    ``EventOverlap(EventHandle())`` is a ``previous_event`` marking the work queued so far."""

    def __new__(cls) -> EventHandle:
        # Without CUDA (a CPU build's torch.cuda.Event cannot be made) a call has finished before it
        # returns, so the handle marks nothing: callers' EventOverlap(EventHandle()) runs on CPU ranks.
        if not torch.backends.cuda.is_built():
            return object.__new__(cls)
        return super().__new__(cls)  # a CUDA build makes its event lazily: no GPU needed here

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            return
        super().__init__()
        self.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.current_stream().wait_event(self)

    def __repr__(self) -> str:
        return "EventHandle()" if not torch.cuda.is_available() else super().__repr__()
