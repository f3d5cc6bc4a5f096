"""Failed-rank masking in normal mode on the kernels (``Buffer(..., enable_shrink=True)``).

While no rank is masked the kernels run every call, and each call's errors are read at its end (a
host sync per call, with enable_shrink only, where the kernels alone would report a failure at a
later call). When a call of theirs times out waiting for peers, the live ranks agree on the failed
ones through the store, as on the portable path (reference/shrink.py: ``agree``), mask them, and
run that call again, and every later one, on the portable path among the live ranks. Its outputs
are the kernels' would be over the live ranks alone: both order a rank's received rows by source
rank, then source token (oracle.py), so a handle the kernels made before the failure serves the
portable calls too. Once the mask is clean on every rank they meet (bounded), each zeroes its
kernels' buffers, they meet again and the kernels run again; a rank missing there is masked anew.
"""

from __future__ import annotations

import torch

from ..handle import DispatchHandle
from .reference import shrink
from .reference.normal import send_order
from .reference.ops import ReferenceNormalOps
from .reference.transport import PeerTimeoutError


class ShrinkingKernels:
    """The normal-mode kernels (intranode or hierarchical) with the portable path behind them."""

    on_kernels = True

    def __init__(self, kernels, portable: ReferenceNormalOps) -> None:
        self.kernels, self.portable = kernels, portable
        self.backend = portable.backend
        self.frees_after_meeting = kernels.frees_after_meeting
        self.handles_outlive_buffer = kernels.handles_outlive_buffer
        # The kernels' buffers may hold a failed call's state (or the mask was set by hand): every call
        # runs on the portable path until the mask is clean and the buffers are zeroed (_restore).
        self.off_kernels = False

    def __getattr__(self, name: str):  # the kernels' own attributes (traffic, per-call state) as they are
        if name == "kernels":  # not set yet
            raise AttributeError(name)
        return getattr(self.kernels, name)

    def get_dispatch_layout(self, topk_idx, num_experts, ranks_per_domain):
        return self.kernels.get_dispatch_layout(topk_idx, num_experts, ranks_per_domain)  # local: no peer

    def dispatch(self, x, scales, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                 topk_weights, expert_alignment, num_worst_tokens, num_experts, buffer_uid, num_sms):
        args = (x, scales, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                topk_weights, expert_alignment, num_worst_tokens, num_experts, buffer_uid, num_sms)
        if self._on_kernels("dispatch"):
            try:
                return self._checked("dispatch", self.kernels.dispatch(*args))
            except RuntimeError as error:
                self._mask_failed("dispatch", error)
        if handle is not None:
            portable_handle(handle, self.backend.rank)
        return self.portable.dispatch(*args)

    def combine(self, x, handle, topk_weights, biases, num_sms):
        if self._on_kernels("combine"):
            try:
                return self._checked("combine", self.kernels.combine(x, handle, topk_weights, biases, num_sms))
            except RuntimeError as error:
                self._mask_failed("combine", error)
        portable_handle(handle, self.backend.rank)
        return self.portable.combine(x, handle, topk_weights, biases, num_sms)

    def barrier(self, op: str) -> None:
        self.kernels.barrier(op)

    def check_errors(self, op: str) -> None:
        if not self.off_kernels:  # after a failure the kernels' records hold what was handled
            self.kernels.check_errors(op)

    def local_memory(self, rdma: bool) -> torch.Tensor | None:
        return self.kernels.local_memory(rdma)

    def close(self) -> None:
        self.kernels.close()

    # ------------------------------------------------------------------ masking
    def _on_kernels(self, op: str) -> bool:
        """Whether this call runs on the kernels: no rank masked, and their buffers in step (zeroed by
        every rank after the mask was cleaned: _restore). Inside a CUDA graph's capture, always: a
        capture cannot wait on the host, so it runs the kernels alone (their errors raise later)."""
        if torch.cuda.is_current_stream_capturing():
            return True
        be = self.backend
        be.seq += 1  # the portable path's call number: the store's keys for this call (agree)
        if bool(be.mask.any()):
            self.off_kernels = True
            return False
        if self.off_kernels:
            return self._restore(op)
        return True

    def _checked(self, op: str, result):
        """``result`` once the kernels of the call have ended without an error (the host waits)."""
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.backend.device).synchronize()
            self.kernels.check_errors(op)
        return result

    def _mask_failed(self, op: str, error: RuntimeError) -> None:
        """After the kernels' ``error``: agree with the live ranks on the failed ones and mask them (this
        call then runs on the portable path), or raise ``error`` where it was no peer's timeout."""
        ranks = getattr(error, "timed_out_ranks", None)
        if ranks is None:
            raise error
        self.off_kernels = True
        try:
            failed = shrink.agree(self.backend, PeerTimeoutError(str(error), self.backend.seq, ranks))
        except PeerTimeoutError:
            raise error from None
        shrink.mask_failed(self.backend, op, failed)

    def _restore(self, op: str) -> bool:
        """The mask was cleaned: every rank meets, zeroes its kernels' buffers and meets again; then the
        kernels run. A rank missing at either meeting is masked (False: this call runs on the portable
        path without it)."""
        be = self.backend
        torch.cuda.synchronize(be.device)  # no kernel of this rank still runs on its buffers
        try:
            shrink.rejoin(be, self.kernels.reset)
        except PeerTimeoutError as error:
            shrink.mask_failed(be, op, shrink.agree(be, error))
            return False
        self.off_kernels = False
        return True


def portable_handle(handle: DispatchHandle, rank: int) -> None:
    """Give a handle the kernels made what the portable path reads of it: the send order, and, where the
    host never read the counts (num_worst_tokens), the rows per rank from the count matrix."""
    state = handle.backend_state
    if "order" in state:
        return
    if not handle.recv_counts and handle.count_matrix is not None:
        matrix = torch.as_tensor(handle.count_matrix).cpu().tolist()
        handle.recv_counts = [row[rank] for row in matrix]
        handle.send_counts = list(matrix[rank])
        handle.num_recv_tokens = sum(handle.recv_counts)
    state["order"] = send_order(handle.is_token_in_rank)
