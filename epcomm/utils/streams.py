"""The current CUDA stream, cheaply: host time spent naming a stream is time eager calls wait on."""

from __future__ import annotations

import torch

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def raw_stream(device: torch.device) -> int:
    """The current CUDA stream of ``device`` as a cudaStream_t: no Stream object (building one costs
    a few microseconds of host time per call, which eager calls wait on)."""
    if _raw_stream is not None:
        return _raw_stream(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


_streams: dict[tuple[int, int], torch.cuda.Stream] = {}


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """torch.cuda.current_stream(device), the Stream object kept per raw stream: building one costs
    ~4 us of host time (H100 host), which a dispatch that reads its counts makes the GPU wait for.
    The object only names the stream, so one kept from an earlier call names the same one."""
    if _raw_stream is None:
        return torch.cuda.current_stream(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, _raw_stream(index))
    stream = _streams.get(key)
    if stream is None:
        if len(_streams) >= 64:  # streams made and dropped by the caller: keep the table small
            _streams.clear()
        stream = _streams[key] = torch.cuda.current_stream(device)
    return stream
