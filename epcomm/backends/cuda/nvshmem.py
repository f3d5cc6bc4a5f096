"""NVSHMEM on the ranks of a torch.distributed group, bootstrapped without MPI.

Rank 0 makes an NVSHMEM unique id, the group broadcasts it, and every rank initializes NVSHMEM with
it and its rank (so NVSHMEM PE == rank in the group). The symmetric heap then gives every rank
memory that GPU kernels on other ranks can put into and signal (csrc/nvshmem_bootstrap.cu): over
RDMA between nodes, over NVLink inside one. One team per process (NVSHMEM is initialized once).

It carries the low-latency kernels to peers that CUDA IPC cannot reach (``SymmetricBuffer``; the
hierarchical kernels do not use it yet). NVSHMEM is initialized once per process and kept until
the process ends (``process_team``): Buffers come and go, each allocating its memory from the
heap and freeing it. Note: NVSHMEM ends the process itself when its initialization fails (its
inline nvshmemx_init_attr exits), so such a failure shows as a rank process that died, with
NVSHMEM's message on stderr.
"""

from __future__ import annotations

import ctypes
import os

import torch
import torch.distributed as dist

from .build import load_nvshmem_library
from .capi import stream_ptr
from .ipc import check_same_size


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
        uid = torch.zeros(self.lib.epcomm_nvshmem_uid_bytes(), dtype=torch.uint8, device="cpu")
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
        words = torch.as_tensor(_SymmetricArray(address, num_words), dtype=torch.int64, device=self.device)
        words.zero_()
        torch.cuda.synchronize(self.device)
        self.lib.epcomm_nvshmem_barrier_all()
        return words

    def free(self, words: torch.Tensor) -> None:
        """Collective: return an allocation of ``alloc_words`` to the heap (no kernel may still use it)."""
        address = words.data_ptr()
        torch.cuda.synchronize(self.device)
        self.lib.epcomm_nvshmem_barrier_all()
        self._allocations.remove(address)
        self.lib.epcomm_nvshmem_free(ctypes.c_void_p(address))

    def peer_ptr(self, words: torch.Tensor, rank: int) -> int:
        """``rank``'s copy of this symmetric memory as mapped in this process (NVLink), or 0."""
        return self.lib.epcomm_nvshmem_peer_ptr(ctypes.c_void_p(words.data_ptr()), rank) or 0

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


_HEAP_MARGIN = 256 << 20
_process_team: NvshmemTeam | None = None


def process_team(group: dist.ProcessGroup, device: torch.device, heap_bytes: int) -> NvshmemTeam:
    """The process's NVSHMEM team over ``group`` (collective the first time), created with a heap of
    at least ``heap_bytes`` (NVSHMEM_SYMMETRIC_SIZE, unless the user set it). Kept until the process
    ends; every later caller must pass the same ranks, since NVSHMEM's PEs are fixed at init."""
    global _process_team
    ranks = dist.get_process_group_ranks(group)
    if _process_team is None:
        if "NVSHMEM_SYMMETRIC_SIZE" not in os.environ:
            os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(max(1 << 30, heap_bytes + _HEAP_MARGIN))
        _process_team = NvshmemTeam(group, device)
        _process_team.ranks = ranks
    elif _process_team.ranks != ranks:
        raise RuntimeError(f"epcomm: NVSHMEM was initialized in this process for ranks {_process_team.ranks}; a "
                           f"Buffer over ranks {ranks} cannot use it (one NVSHMEM team per process)")
    return _process_team


class SymmetricBuffer:
    """A rank's communication buffer in the NVSHMEM symmetric heap, with the peer table the kernels
    take (include/epcomm/impls/ll_*.cuh): each peer's copy as mapped here, or 0 for a peer reached by
    NVSHMEM puts (not mapped, or listed in ``remote_ranks``). The same attributes as ipc.SharedBuffer."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, num_bytes: int, remote_ranks: set[int],
                 what: str) -> None:
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        check_same_size(group, num_bytes, what)
        self.team = process_team(group, device, num_bytes)
        self.num_bytes = num_bytes
        self._words = self.team.alloc_words((num_bytes + 7) // 8)
        self.tensor = self._words.view(torch.uint8)[:num_bytes]
        ptrs = [self.tensor.data_ptr() if r == self.rank else
                (0 if r in remote_ranks else self.team.peer_ptr(self._words, r)) for r in range(self.num_ranks)]
        self.remote_ranks = sorted(r for r in range(self.num_ranks) if ptrs[r] == 0)
        self.ptrs = (ctypes.c_uint64 * self.num_ranks)(*ptrs)
        self.device = device

    def close(self) -> None:
        """Collective: free the buffer (the caller makes sure no kernel of any rank still uses it)."""
        if self._words is not None:
            self.team.free(self._words)
            self._words = None
