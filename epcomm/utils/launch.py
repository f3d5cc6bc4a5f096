"""Start local ranks the way users do (one process per rank, torch.distributed) and run work on them.

``LocalCluster`` keeps its processes alive between calls, so a test suite pays the start-up cost
(importing torch, creating the process group) once per rank count instead of once per test.
"""

from __future__ import annotations

import datetime
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import _env

_HOST = "127.0.0.1"
_STORE_TIMEOUT = datetime.timedelta(seconds=300)


# More ranks than GPUs: the ranks share the GPUs (rank r on GPU r % count), and the group runs on
# gloo for CPU and CUDA tensors alike, since NCCL refuses two ranks on one GPU. Kernels of different
# processes on one GPU take turns (time slices), so every cross-rank wait still ends; the protocol and
# the results are checked at any rank count, the timings mean nothing.
SHARED_GPU_BACKEND = "cpu:gloo,cuda:gloo"


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"


def backend_on_cuda(backend: object) -> bool:
    """Whether a process group of this backend (a name like "nccl" or "cpu:gloo,cuda:gloo") holds its
    tensors on the rank's GPU."""
    return "nccl" in str(backend) or "cuda:" in str(backend)


def group_device(group: dist.ProcessGroup | None = None, honour_env: bool = True) -> torch.device:
    """Where the tensors of ``group`` (default: the world) live: EPCOMM_DEVICE where set (and
    ``honour_env``); else the rank's current GPU when the group has a CUDA backend, or is a plain gloo
    group (which holds CUDA tensors too) on a machine with CUDA, as DeepEP works on the current GPU
    whatever group it is given (vLLM passes its gloo group); else the CPU."""
    choice = _env.device_choice() if honour_env else ""
    backend = str(dist.get_backend(group))
    on_cuda = backend_on_cuda(backend) or (backend == "gloo" and torch.cuda.is_available())
    if choice == "cuda" or (not choice and on_cuda):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _worker(rank: int, num_ranks: int, port: int, backend: str, env: dict[str, str], tasks, results) -> None:
    os.environ.update(env)
    if not backend_on_cuda(backend):  # a cluster of CPU processes: the Buffers' tensors on the CPU too
        os.environ.setdefault("EPCOMM_DEVICE", "cpu")
    torch.set_num_threads(1)  # ranks share the host's cores
    if backend_on_cuda(backend):
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.TCPStore(_HOST, port, is_master=False, timeout=_STORE_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=num_ranks)
    shared_gpu = backend_on_cuda(backend) and num_ranks > torch.cuda.device_count()
    if backend == "nccl" and not shared_gpu:
        # NCCL makes its communicator at the group's first collective (seconds, more while a
        # restarted cluster's old processes free their GPUs): here, not inside a task whose Buffer
        # waits a short EPCOMM_TIMEOUT_S for it (a reliability test, 2 s: the waiting rank gave up
        # and the other stayed in the collective, 2026-11-28).
        dist.barrier(device_ids=[torch.cuda.current_device()])
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            fn, args, kwargs = task
            try:
                results.put((rank, True, fn(*args, **kwargs)))
            except BaseException as error:  # report every failure to the parent, with its traceback
                results.put((rank, False, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
            if shared_gpu:
                # Several ranks on one GPU: an idle rank's allocator cache would starve the next task's
                # ranks (8 ranks of a large LL case need most of an 80 GB GPU).
                torch.cuda.empty_cache()
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


class RankFailure(RuntimeError):
    """One or more ranks raised; ``errors`` maps rank to the formatted exception."""

    def __init__(self, errors: dict[int, str]) -> None:
        self.errors = errors
        # Show the root cause: a rank whose error is not a timeout caused by a failed peer.
        causes = [r for r in sorted(errors) if "PeerTimeoutError" not in errors[r]] or sorted(errors)
        lines = "\n".join(f"  rank {r}: {errors[r].splitlines()[0][:300]}" for r in sorted(errors))
        super().__init__(f"{len(errors)} rank(s) failed:\n{lines}\nrank {causes[0]} in full:\n{errors[causes[0]]}")


class LocalCluster:
    """``num_ranks`` processes on this host joined in one process group (gloo on CPU, NCCL on GPUs,
    SHARED_GPU_BACKEND for more ranks than GPUs)."""

    def __init__(self, num_ranks: int, backend: str | None = None, env: dict[str, str] | None = None) -> None:
        self.num_ranks = num_ranks
        self.backend = backend or default_backend()
        self.env = dict(env or {})
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(num_ranks)]
        # The parent serves the group's store on a port the system picks, so no rank can lose a race
        # for a port chosen beforehand, and the store outlives any rank that dies.
        self._store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False, timeout=_STORE_TIMEOUT)
        port = self._store.port
        self._procs = [ctx.Process(target=_worker, args=(r, num_ranks, port, self.backend, dict(env or {}),
                                                          self._tasks[r], self._results), daemon=True)
                       for r in range(num_ranks)]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 300, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        ``fn`` must be importable by name (a module-level function). If any rank raises, raises
        RankFailure with every rank's traceback once all ranks have answered.
        """
        if self.broken:
            raise RuntimeError("this LocalCluster is broken by an earlier failure; start a new one")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        import queue
        import time

        deadline = time.monotonic() + timeout_s
        # Peers of a failed or dead rank raise within EPCOMM_TIMEOUT_S; do not wait longer than that.
        grace = float(self.env.get("EPCOMM_TIMEOUT_S", "100")) + 15
        dead: list[int] = []
        while len(results) + len(errors) + len(dead) < self.num_ranks:
            try:
                rank, ok, value = self._results.get(timeout=1.0)
            except queue.Empty:
                newly = [r for r, p in enumerate(self._procs)
                         if not p.is_alive() and r not in dead and r not in results and r not in errors]
                if newly:  # the survivors still answer (their errors name the dead rank): wait for them
                    dead += newly
                    deadline = min(deadline, time.monotonic() + grace)
                if time.monotonic() > deadline:
                    self.broken = True
                    missing = sorted(set(range(self.num_ranks)) - set(results) - set(errors) - set(dead))
                    self.close()
                    raise RankFailure({**errors, **{r: f"no answer after {timeout_s} s" for r in missing},
                                       **{r: f"rank process(es) {dead} died" for r in dead}}) from None
                continue
            (results if ok else errors)[rank] = value
            if not ok:
                deadline = min(deadline, time.monotonic() + grace)
        if dead:
            self.broken = True
            self.close()
            raise RankFailure({**errors, **{r: f"rank process(es) {dead} died" for r in dead}})
        if errors:
            self.broken = True  # peers of a failed rank may hold unfinished collectives
            self.close()
            raise RankFailure(errors)
        return [results[r] for r in range(self.num_ranks)]

    def close(self) -> None:
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:
                    pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.broken = True

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
