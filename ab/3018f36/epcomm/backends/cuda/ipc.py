"""One communication buffer per rank, mapped into every other rank of the node through CUDA IPC.

The buffer is a PyTorch allocation (zeroed once: every flag and counter the kernels keep in it
starts at 0 and only grows). Its IPC handle is exported with the offset of the tensor inside its
allocation (PyTorch's caching allocator may place it inside a larger block), all-gathered over the
group, and each peer's buffer is opened on this rank's GPU with peer access enabled.
"""

from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

from .capi import check


def check_same_size(group: dist.ProcessGroup, num_bytes: int, what: str) -> None:
    """Collective: every rank's buffer has the same size (senders compute places in their peers'
    buffers from their own layout)."""
    sizes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(sizes, num_bytes, group=group)
    if len(set(sizes)) != 1:
        raise ValueError(f"{what} must be the same on every rank (senders write into the peers' buffers), "
                         f"got {sizes}")


class SharedBuffer:
    def __init__(self, lib: ctypes.CDLL, group: dist.ProcessGroup, device: torch.device, num_bytes: int,
                 what: str) -> None:
        self.lib = lib
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        check_same_size(group, num_bytes, what)
        self.num_bytes = num_bytes
        self.tensor = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        handle = ctypes.create_string_buffer(64)
        offset = ctypes.c_int64(0)
        check(lib.epcomm_ipc_export(device.index, ctypes.c_void_p(self.tensor.data_ptr()), handle,
                                     ctypes.byref(offset)), "Buffer() IPC export")
        exported: list = [None] * self.num_ranks
        dist.all_gather_object(exported, (handle.raw, offset.value), group=group)
        self._peer_bases: list[ctypes.c_void_p] = []
        ptrs = []
        for r, (raw, off) in enumerate(exported):
            if r == self.rank:
                ptrs.append(self.tensor.data_ptr())
                continue
            base, ptr = ctypes.c_void_p(), ctypes.c_void_p()
            check(lib.epcomm_ipc_open(device.index, ctypes.create_string_buffer(raw, 64), ctypes.c_int64(off),
                                       ctypes.byref(base), ctypes.byref(ptr)), f"Buffer() IPC open of rank {r}")
            self._peer_bases.append(base)
            ptrs.append(ptr.value)
        # Every rank's buffer as this process sees it: the kernels' peer table.
        self.ptrs = (ctypes.c_uint64 * self.num_ranks)(*ptrs)
        self.device = device

    def close(self) -> None:
        """Unmap the peers' buffers (the caller makes sure no kernel still uses them)."""
        if not self._peer_bases:
            return
        torch.cuda.synchronize(self.device)
        for base in self._peer_bases:
            self.lib.epcomm_ipc_close(base)
        self._peer_bases = []

