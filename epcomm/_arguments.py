"""The argument checks of Buffer's calls: each names the argument, the value and what was expected,
and every rank raises it before any data moves (Buffer announces a refusal to its peers).

A mixin of Buffer: the checks read the Buffer's state (its device, group size, buffer sizes and the
ops each mode runs on), so they are methods; the calls themselves are in buffer.py.
"""

from __future__ import annotations

import torch

from ._checks import check_int, check_tensor, check_topk_bounds, check_topk_idx, split_x, topk_idx_t
from .backends.base import CombineOverlap
from .config import Config, low_latency_size_hint
from .handle import DispatchHandle, LowLatencyHandle


class ArgumentChecks:
    """Buffer's argument checks (see buffer.py for the attributes they read)."""

    @staticmethod
    def _check_async_args(previous_event: object, async_finish: object, allocate_on_comm_stream: object) -> None:
        # Duck typing, as DeepEP: only .event is read, and a caller's EventOverlap may be another copy of the class.
        if previous_event is not None and not hasattr(previous_event, "event"):
            raise TypeError("previous_event must be an EventOverlap (an object with an .event), got "
                            f"{type(previous_event).__name__}")
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError("allocate_on_comm_stream=True requires previous_event and async_finish=True "
                             "(DeepEP's rule)")

    def _capturing(self) -> bool:
        """Inside a CUDA graph capture: checks that read values on the host are skipped (they would sync)."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _check_handle(self, handle: object, kind: type) -> None:
        if not isinstance(handle, kind):
            raise TypeError(f"handle must be the {kind.__name__} returned by this Buffer, got {type(handle).__name__}")
        scope = getattr(handle, "scope", "")  # normal-mode handles: the Buffers that take them too
        if handle.buffer_uid != self.uid and not (scope and scope == self.handle_scope):  # type: ignore[attr-defined]
            raise ValueError("handle was created by another Buffer, of another group, backend or strategy (or on "
                             "the hierarchical kernels, whose handles serve their own Buffer alone); pass the "
                             "handle of a dispatch of this Buffer")

    def _check_dispatch(self, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                        num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config):
        data, scales = split_x("x", x)
        num_tokens, hidden = data.shape
        check_tensor("x", data, device=self.device, contiguous=True)
        if hidden * data.element_size() % 16:
            raise ValueError(f"x: hidden ({hidden}) * element size ({data.element_size()}) must be a multiple "
                             "of 16 bytes")
        if scales is not None:
            check_tensor("x[1] (scales)", scales, device=self.device)
            if scales.shape[0] != num_tokens:
                raise ValueError(f"x[1] (scales) must have {num_tokens} rows, got {scales.shape[0]}")
            # Any grouping travels (DeepEP's rule): the scales are 4-byte words copied beside their
            # token, and what they mean is the caller's. Every rank must pass the same count and dtype.
            if scales.shape[1] < 1:
                raise ValueError("x[1] (scales) must have at least one column")
            if not (scales.stride(1) == 1 or scales.stride(0) == 1):
                raise ValueError(f"x[1] (scales) must be row- or column-major, got strides {scales.stride()}")
        check_int("expert_alignment", expert_alignment, minimum=1)
        check_int("num_worst_tokens", num_worst_tokens, minimum=0)
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be an epcomm.Config, got {type(config).__name__}")
        r = self.group_size
        if handle is not None:
            self._check_handle(handle, DispatchHandle)
            for name, value in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank",
                                is_token_in_rank), ("num_tokens_per_expert", num_tokens_per_expert),
                                ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
                if value is not None:
                    raise ValueError(f"{name} must be None for a cached dispatch (handle= given)")
            if num_tokens != handle.num_tokens:
                raise ValueError(f"x has {num_tokens} tokens but the handle was made for {handle.num_tokens}")
            num_experts = 0
        else:
            for name, value in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank",
                                is_token_in_rank), ("num_tokens_per_expert", num_tokens_per_expert)):
                if value is None:
                    raise ValueError(f"{name} is required when no handle is given (from get_dispatch_layout)")
            check_tensor("num_tokens_per_rank", num_tokens_per_rank, dtype=torch.int32, shape=(r,),
                         device=self.device)
            check_tensor("is_token_in_rank", is_token_in_rank, dtype=torch.bool, shape=(num_tokens, r),
                         device=self.device)
            check_tensor("num_tokens_per_expert", num_tokens_per_expert, dtype=torch.int32, dim=1,
                         device=self.device)
            num_experts = num_tokens_per_expert.shape[0]
            if num_experts == 0 or num_experts % r:
                raise ValueError(f"num_tokens_per_expert has {num_experts} entries; expected a positive "
                                 f"multiple of the group size {r}")
            if num_tokens_per_rdma_rank is not None:
                check_tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, dtype=torch.int32,
                             shape=(self.num_domains,), device=self.device)
            # Checks of values need the data on the host; the CUDA kernels make them on the device
            # (no host sync, CUDA-graph capturable) and every rank raises the same ValueError.
            if topk_idx is not None:
                check_topk_idx("topk_idx", topk_idx, num_experts, self.device, num_tokens, values=False)
            if not self._normal_ops.on_kernels and not self._capturing():
                _check_routing_values(num_tokens_per_rank, is_token_in_rank, topk_idx, num_experts)
            if topk_weights is not None:
                if topk_idx is None:
                    raise ValueError("topk_weights given without topk_idx")
                check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=tuple(topk_idx.shape),
                             device=self.device, contiguous=True)
        self._check_nvl_bytes(hidden, config or self._default_config(True))
        return data, scales, num_experts

    def _check_nvl_bytes(self, hidden: int, config: Config) -> None:
        """num_nvl_bytes must be at least what a DeepEP caller reserves for this hidden size: the hint for
        H bytes a token (SGLang sizes an FP8 Buffer so, for its BF16 combine too). DeepEP's own rule,
        H * max(element size, 2), gives twice that. A call whose rows do not fit runs in rounds on the
        CUDA backend (same results), so the hint bounds no call's correctness, only its passes."""
        key = (hidden, config)  # Config is frozen: equal configs need equal bytes
        if key in self._nvl_bytes_ok:
            return
        need = config.get_nvl_buffer_size_hint(hidden, self.group_size)
        if self.num_nvl_bytes < need:
            raise ValueError(f"num_nvl_bytes={self.num_nvl_bytes} is too small for hidden {hidden}: reserve "
                             f"Config.get_nvl_buffer_size_hint(hidden * max(element size, 2), {self.group_size}) = "
                             f"{config.get_nvl_buffer_size_hint(hidden * 2, self.group_size)} (at least "
                             f"get_nvl_buffer_size_hint({hidden}, {self.group_size}) = {need})")
        self._nvl_bytes_ok.add(key)

    def _check_combine(self, x, handle, topk_weights, bias, config) -> tuple[torch.Tensor, ...]:
        self._check_handle(handle, DispatchHandle)
        rows = handle.num_recv_rows
        check_tensor("x", x, dtype=torch.bfloat16, dim=2, device=self.device, contiguous=True)
        if x.shape[0] != rows:
            raise ValueError(f"x must have {rows} rows (the rows dispatch returned), got {x.shape[0]}")
        if x.shape[1] * 2 % 16:
            raise ValueError(f"x: hidden ({x.shape[1]}) * 2 bytes must be a multiple of 16")
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, dtype=torch.float32, dim=2, device=self.device,
                         contiguous=True)
            if topk_weights.shape[0] != rows:
                raise ValueError(f"topk_weights must have {rows} rows, got {topk_weights.shape[0]}")
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be an epcomm.Config, got {type(config).__name__}")
        self._check_nvl_bytes(x.shape[1], config or self._default_config(False))
        biases: tuple = () if bias is None else (bias,) if isinstance(bias, torch.Tensor) else tuple(bias)
        if len(biases) > 2:
            raise ValueError(f"bias must be a tensor or a tuple of at most two, got {len(biases)}")
        for i, b in enumerate(biases):
            check_tensor(f"bias[{i}]", b, dtype=torch.bfloat16, shape=(handle.num_tokens, x.shape[1]),
                         device=self.device, contiguous=True)
        return biases

    # ------------------------------------------------------------------ low-latency mode
    def _check_ll_buffer(self, num_max_tokens: int, hidden: int, num_experts: int) -> None:
        if not self.low_latency_mode:
            raise RuntimeError("low-latency calls need Buffer(..., low_latency_mode=True)")
        need = low_latency_size_hint(num_max_tokens, hidden, self.group_size, num_experts)
        if self.num_rdma_bytes < need:
            raise ValueError(f"num_rdma_bytes={self.num_rdma_bytes} is too small: "
                             f"Buffer.get_low_latency_rdma_size_hint({num_max_tokens}, {hidden}, "
                             f"{self.group_size}, {num_experts}) = {need}")

    def _ll_checked_now(self, key: tuple | None) -> None:
        """Remember the argument shapes of a low-latency call that passed the checks (None: not
        keyable): a later call with the same ones has only what can differ between calls of one
        shape checked again (an eager decode step waits on the host time of its calls). At most
        4096 shapes."""
        if key is not None:
            if len(self._ll_checked) >= 4096:
                self._ll_checked.clear()
            self._ll_checked.add(key)

    def _check_ll_dispatch(self, x, topk_idx, num_max_tokens, num_experts, recv_stats, wait_stats, use_fp8,
                           round_scale, use_ue8m0, async_finish, return_recv_hook) -> None:
        key = None
        if self._ll_ops.on_kernels:  # the reference backend reads topk_idx's values: no shortcut
            key = _tensor_keys(x, topk_idx, recv_stats, wait_stats)
            if type(num_max_tokens) is not int or type(num_experts) is not int:
                key = None  # 128.0 == 128 as a key, but only an int passes the checks
            if key is not None:
                key += ("dispatch", num_max_tokens, num_experts, use_fp8, round_scale, use_ue8m0, async_finish,
                        return_recv_hook)
                if (key in self._ll_checked and x.is_contiguous() and topk_idx.is_contiguous()
                        and x.data_ptr() % 16 == 0):
                    return
        self._check_ll_dispatch_fully(x, topk_idx, num_max_tokens, num_experts, recv_stats, wait_stats, use_fp8,
                                      round_scale, use_ue8m0, async_finish, return_recv_hook)
        self._ll_checked_now(key)

    def _check_ll_dispatch_fully(self, x, topk_idx, num_max_tokens, num_experts, recv_stats, wait_stats, use_fp8,
                                 round_scale, use_ue8m0, async_finish, return_recv_hook) -> None:
        check_tensor("x", x, dtype=torch.bfloat16, dim=2, device=self.device, contiguous=True)
        num_tokens, hidden = x.shape
        check_int("num_max_dispatch_tokens_per_rank", num_max_tokens, minimum=1)
        check_int("num_experts", num_experts, minimum=1)
        if num_experts % self.group_size:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the group size "
                             f"({self.group_size})")
        if num_tokens > num_max_tokens:
            raise ValueError(f"x has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank="
                             f"{num_max_tokens}")
        # The CUDA kernels check the values themselves (reading them here would sync the host; a bad id
        # is then reported by the next call); the reference backend checks them here.
        check_topk_idx("topk_idx", topk_idx, num_experts, self.device, num_tokens,
                       values=not self._ll_ops.on_kernels and not self._capturing())
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0=True requires round_scale=True (UE8M0 holds powers of two only)")
        if use_fp8 and hidden % 128:
            raise ValueError(f"x: hidden ({hidden}) must be a multiple of 128 for FP8 (one scale per 128)")
        if use_ue8m0 and hidden % 512:
            raise ValueError(f"x: hidden ({hidden}) must be a multiple of 512 with use_ue8m0 (4 scales per int)")
        if hidden * 2 % 16:
            raise ValueError(f"x: hidden ({hidden}) * 2 bytes must be a multiple of 16")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook are mutually exclusive")
        e_local = num_experts // self.group_size
        if recv_stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", recv_stats, dtype=torch.int32, shape=(e_local,),
                         device=self.device)
        if wait_stats is not None:
            check_tensor("dispatch_wait_recv_cost_stats", wait_stats, dtype=torch.int64,
                         shape=(self.group_size,), device=self.device)
        self._check_ll_buffer(num_max_tokens, hidden, num_experts)
        self._ll_ops.check_dispatch_args(x, topk_idx, num_max_tokens, num_experts)

    def _check_ll_combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                          return_recv_hook, out, wait_stats) -> None:
        key = None
        if self._ll_ops.on_kernels and not zero_copy and type(handle) is LowLatencyHandle:
            key = _tensor_keys(x, topk_idx, topk_weights, out, wait_stats)
            if key is not None:
                key += ("combine", handle.buffer_uid, handle.num_max_dispatch_tokens_per_rank, handle.hidden,
                        handle.num_experts, handle.num_tokens, handle.num_topk, use_logfmt, async_finish,
                        return_recv_hook)
                if (key in self._ll_checked and x.is_contiguous() and x.data_ptr() % 16 == 0
                        and (out is None or (out.is_contiguous() and out.data_ptr() % 16 == 0))
                        and handle.backend_state.get("received")):
                    return
        self._check_ll_combine_fully(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                     return_recv_hook, out, wait_stats)
        self._ll_checked_now(key)

    def _check_ll_combine_fully(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                return_recv_hook, out, wait_stats) -> None:
        if use_logfmt:
            raise NotImplementedError("use_logfmt=True (LogFMT-compressed combine) is not implemented; "
                                      "use the default BF16 combine")
        self._check_handle(handle, LowLatencyHandle)
        e_local = handle.num_experts // self.group_size
        rows = handle.num_max_dispatch_tokens_per_rank * self.group_size
        check_tensor("x", x, dtype=torch.bfloat16, shape=(e_local, rows, handle.hidden), device=self.device,
                     contiguous=True)
        check_tensor("topk_idx", topk_idx, dtype=topk_idx_t, shape=(handle.num_tokens, handle.num_topk),
                     device=self.device)
        if (not self._ll_ops.on_kernels and not self._capturing()
                and not torch.equal(topk_idx, handle.backend_state["topk_idx"])):  # CUDA: compared on the GPU
            raise ValueError("topk_idx differs from the one passed to the low_latency_dispatch of this handle")
        check_tensor("topk_weights", topk_weights, dtype=torch.float32,
                     shape=(handle.num_tokens, handle.num_topk), device=self.device)
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook are mutually exclusive")
        if zero_copy:  # the combine reads that buffer; x gives only the shape (as in DeepEP)
            expected = self._backend.ll_combine_buffers.get(self._ll_counter % 2)
            if expected is None or expected.shape != x.shape:
                raise ValueError("zero_copy=True reads get_next_low_latency_combine_buffer(handle), which was not "
                                 "called for this combine's handle: call it and write the expert outputs into it")
        if out is not None:
            check_tensor("out", out, dtype=torch.bfloat16, shape=(handle.num_tokens, handle.hidden),
                         device=self.device, contiguous=True)
        if wait_stats is not None:
            check_tensor("combine_wait_recv_cost_stats", wait_stats, dtype=torch.int64, shape=(self.group_size,),
                         device=self.device)
        self._check_ll_buffer(handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        self._ll_ops.check_combine_args(x, handle, out)

    def _check_ll_overlap(self, handle, overlap, packed_recv_count, comp_signal, block_m, threshold, num_sms,
                          src_signals, src_signal_expect_value) -> CombineOverlap | None:
        """The single-batch-overlap keywords of low_latency_combine (DeepEP forks': SGLang's Hopper path
        passes comp_signal, its Blackwell path src_signals), gathered; None without overlap. Then the
        others are not used (SGLang passes its block_m, threshold, num_sms and packed_recv_count either
        way), but a signal tensor is refused: the combine would not wait for it."""
        if not isinstance(overlap, bool | int) or overlap not in (0, 1):
            raise TypeError(f"overlap must be a bool, got {type(overlap).__name__} {overlap!r}")
        if not overlap:
            for name, value in (("comp_signal", comp_signal), ("src_signals", src_signals)):
                if value is not None:
                    raise ValueError(f"{name} was given without overlap=True: the combine would not wait for it "
                                     "(pass overlap=True to send each block once its signal is raised)")
            return None
        if (comp_signal is None) == (src_signals is None):
            raise ValueError("overlap=True needs comp_signal (with packed_recv_count, block_m, threshold: a word per "
                             "block_m rows of a local expert) or src_signals (with src_signal_expect_value: a word "
                             "per local expert), " + ("not both" if comp_signal is not None else "got neither"))
        check_int("num_sms", num_sms, minimum=0)
        e_local = handle.num_experts // self.group_size
        rows = handle.num_max_dispatch_tokens_per_rank * self.group_size
        if packed_recv_count is not None:
            check_tensor("packed_recv_count", packed_recv_count, dtype=torch.int32, shape=(e_local,),
                         device=self.device, contiguous=True)
            # The reference backend compares the counts here; the kernels on the GPU (no host sync).
            if (not self._ll_ops.on_kernels and not self._capturing() and not torch.equal(
                    packed_recv_count.cpu().to(torch.int64), (handle.layout_range.cpu() & 0xffffffff).sum(1))):
                raise ValueError("packed_recv_count differs from the recv_count of this handle's dispatch (the "
                                 "rows each local expert received)")
        if comp_signal is not None:
            check_int("block_m", block_m, minimum=1)
            check_int("threshold", threshold, minimum=1, maximum=2**31 - 1)
            if packed_recv_count is None:
                raise ValueError("overlap=True with comp_signal needs packed_recv_count (the recv_count of the "
                                 "dispatch: the rows the expert GEMM computes)")
            per_expert = -(-rows // block_m)
            check_tensor("comp_signal", comp_signal, dtype=torch.int32, device=self.device, contiguous=True)
            if comp_signal.numel() < e_local * per_expert:
                raise ValueError(f"comp_signal must hold a word per block of block_m={block_m} rows of each local "
                                 f"expert: at least {e_local} * ceil({rows} / {block_m}) = {e_local * per_expert} "
                                 f"int32, got {comp_signal.numel()}")
            return CombineOverlap(comp_signal.view(-1), per_expert, block_m, threshold, packed_recv_count, num_sms)
        check_tensor("src_signals", src_signals, dtype=(torch.uint32, torch.int32), shape=(e_local,),
                     device=self.device, contiguous=True)
        check_int("src_signal_expect_value", src_signal_expect_value, minimum=1, maximum=2**32 - 1)
        return CombineOverlap(src_signals, 1, rows, src_signal_expect_value, packed_recv_count, num_sms)


def _tensor_keys(*tensors: torch.Tensor | None) -> tuple | None:
    """(shape, dtype, device) of each tensor (None stays None), or None where one is not exactly a
    torch.Tensor (a subclass may override what the checks look at)."""
    key: tuple = ()
    for t in tensors:
        if t is None:
            key += (None,)
        elif type(t) is torch.Tensor:
            key += (t.shape, t.dtype, t.device)
        else:
            return None
    return key


def _check_routing_values(num_tokens_per_rank: torch.Tensor, is_token_in_rank: torch.Tensor,
                          topk_idx: torch.Tensor | None, num_experts: int) -> None:
    """The routing's values as check_topk_idx and get_dispatch_layout state them, in one host read."""
    probes = [(is_token_in_rank.sum(0, dtype=torch.int32) != num_tokens_per_rank).any().to(torch.int64)]
    if topk_idx is not None and topk_idx.numel():
        probes.extend(torch.aminmax(topk_idx))
    mismatch, *bounds = torch.stack(probes).tolist()
    if mismatch:
        raise ValueError("num_tokens_per_rank does not match is_token_in_rank.sum(0); pass both from "
                         "get_dispatch_layout")
    if bounds:
        check_topk_bounds("topk_idx", *bounds, num_experts)
