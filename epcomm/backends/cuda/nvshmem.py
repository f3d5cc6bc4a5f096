"""NVSHMEM on the ranks of a torch.distributed group, bootstrapped without MPI.

Rank 0 makes an NVSHMEM unique id, the group broadcasts it, and every rank initializes NVSHMEM with
it and its rank (so NVSHMEM PE == rank in the group). The symmetric heap then gives every rank
memory that GPU kernels on other ranks can put into and signal (csrc/nvshmem/transport.cu): over
RDMA between nodes, over NVLink inside one. One team per process (NVSHMEM is initialized once).

This is the foundation of the transports to peers that CUDA IPC cannot reach; the low-latency and
hierarchical kernels do not use it yet. Note: NVSHMEM ends the process itself when its
initialization fails (its inline nvshmemx_init_attr exits), so such a failure shows as a rank
process that died, with NVSHMEM's message on stderr.
"""

from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

from .build import load_nvshmem_library
from .capi import stream_ptr


class _SymmetricArray:
    """A view of symmetric-heap memory that torch can alias (``__cuda_array_interface__``)."""

    def __init__(self, address: int, num_words: int) -> None:
        self.__cuda_array_interface__ = {"shape": (num_words,), "typestr": "<i8", "data": (address, False),
                                         "version": 3, "strides": None}


class NvshmemTeam:
    _active = False  # NVSHMEM is initialized once per process

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        if NvshmemTeam._active:
            raise RuntimeError("epcomm: NVSHMEM is already initialized in this process (one team per process)")
        self.lib = load_nvshmem_library()
        self.group, self.device = group, device
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        uid = torch.zeros(self.lib.epcomm_nvshmem_uid_bytes(), dtype=torch.uint8)
        if self.rank == 0:
            self._check(self.lib.epcomm_nvshmem_get_uid(ctypes.c_void_p(uid.data_ptr())), "nvshmemx_get_uniqueid")
        shared = uid.to(device)
        dist.broadcast(shared, src=dist.get_global_rank(group, 0), group=group)
        uid = shared.cpu()
        self._check(self.lib.epcomm_nvshmem_init(ctypes.c_void_p(uid.data_ptr()), self.rank, self.num_ranks),
                    "nvshmemx_init_attr (unique id)")
        NvshmemTeam._active = True
        self._allocations: list[int] = []

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"epcomm: NVSHMEM {what} failed with status {code}")

    def alloc_words(self, num_words: int) -> torch.Tensor:
        """Collective: ``num_words`` 8-byte words of the symmetric heap on every rank, zeroed, as an
        int64 tensor aliasing them (valid until ``close``)."""
        address = self.lib.epcomm_nvshmem_malloc(num_words * 8)
        if not address:
            raise RuntimeError(f"epcomm: nvshmem_malloc of {num_words * 8} bytes failed (NVSHMEM_SYMMETRIC_SIZE "
                               "sets the heap)")
        self._allocations.append(address)
        words = torch.as_tensor(_SymmetricArray(address, num_words), device=self.device)
        words.zero_()
        torch.cuda.synchronize(self.device)
        self.lib.epcomm_nvshmem_barrier_all()
        return words

    def is_p2p(self, words: torch.Tensor, rank: int) -> bool:
        """Whether ``rank``'s copy of this symmetric memory is reachable by loads and stores (NVLink)."""
        return bool(self.lib.epcomm_nvshmem_is_p2p(ctypes.c_void_p(words.data_ptr()), rank))

    def probe_ring(self, dst: torch.Tensor, src: torch.Tensor, signal: torch.Tensor, round_: int,
                   timeout_s: float) -> bool:
        """Each rank puts ``src`` into the next rank's ``dst`` with a signal, then waits for the previous
        rank's; returns False if that signal did not come within ``timeout_s``."""
        timed_out = torch.zeros(1, dtype=torch.int32, device=self.device)
        code = self.lib.epcomm_nvshmem_probe_ring(
            ctypes.c_void_p(dst.data_ptr()), ctypes.c_void_p(src.data_ptr()), ctypes.c_void_p(signal.data_ptr()),
            src.numel(), ctypes.c_uint64(round_), ctypes.c_uint64(int(timeout_s * 1e9)),
            ctypes.c_void_p(timed_out.data_ptr()), stream_ptr(self.device))
        self._check(code, "probe launch")
        return int(timed_out.item()) == 0

    def close(self) -> None:
        """Free the symmetric allocations and finalize NVSHMEM (collective)."""
        torch.cuda.synchronize(self.device)
        self.lib.epcomm_nvshmem_barrier_all()
        for address in reversed(self._allocations):
            self.lib.epcomm_nvshmem_free(ctypes.c_void_p(address))
        self._allocations.clear()
        self.lib.epcomm_nvshmem_finalize()
        NvshmemTeam._active = False
