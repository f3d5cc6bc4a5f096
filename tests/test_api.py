"""API details beyond the main paths: dispatch without top-k, one bias, async arguments, FP8 casts, stats."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import cluster, env_var
from routing import device, make_inputs

import epcomm
from epcomm import Buffer, Config, EventOverlap, _env
from epcomm.fp8 import pack_ue8m0, quantize_groups, unpack_ue8m0
from epcomm.utils.launch import SHARED_GPU_BACKEND, backend_on_cuda


def rank_no_topk_one_bias_async(num_tokens, hidden, num_experts):
    """Dispatch without top-k arguments, combine with one bias, through the async arguments."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = device()
    x, topk_idx, _ = (t.to(dev) for t in make_inputs(21, rank, num_tokens, hidden, num_experts, 2, num_ranks,
                                                     "random"))
    buf = Buffer(dist.group.WORLD, Config().get_nvl_buffer_size_hint(hidden * 2, num_ranks), backend="reference")
    before = Buffer.capture()
    assert isinstance(before, EventOverlap)
    per_rank, _, per_expert, in_rank, event = buf.get_dispatch_layout(topk_idx, num_experts, previous_event=before,
                                                                      async_finish=True, allocate_on_comm_stream=True)
    event.current_stream_wait()
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        previous_event=Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)
    with event:  # waits on exit
        pass
    assert recv_idx is None and recv_w is None
    e_local = num_experts // num_ranks
    assert len(counts) == e_local
    bias = torch.randn((num_tokens, hidden), device=dev).to(torch.bfloat16)
    combined, combined_w, event = buf.combine(recv_x, handle, bias=bias, async_finish=True)
    event.current_stream_wait()
    assert combined_w is None
    reach = in_rank.sum(1, keepdim=True).double()
    ref = x.double() * reach + bias.double()
    err = (combined.double() - ref).abs()
    assert bool((err <= ref.abs() * 2 ** -7 + 1e-5).all()), f"rank {rank}: max err {err.max()}"
    return True


def test_dispatch_without_topk_one_bias_async_arguments():
    cluster(2).run(rank_no_topk_one_bias_async, 40, 256, 8)


def rank_wait_stats_name_the_straggler(straggler, delay_s):
    """A late rank shows up in the others' wait-cost statistics."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = device()
    n, hidden, num_experts = 4, 256, 2 * num_ranks
    buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(n, hidden, num_ranks, num_experts),
                 low_latency_mode=True, backend="reference")
    x, idx, w = (t.to(dev) for t in make_inputs(31, rank, n, hidden, num_experts, 2, num_ranks, "random"))
    stats = torch.zeros(num_ranks, dtype=torch.int64, device=dev)
    dist.barrier()
    if rank == straggler:
        time.sleep(delay_s)
    buf.low_latency_dispatch(x, idx, n, num_experts, dispatch_wait_recv_cost_stats=stats)
    return stats.cpu().tolist()


def test_wait_stats_name_the_straggler():
    stats = cluster(4).run(rank_wait_stats_name_the_straggler, 2, 0.5)
    for rank, row in enumerate(stats):
        if rank == 2:
            continue
        assert row[2] >= 0.3e9, f"rank {rank} waited {row[2]} ns for the straggler (expected >= 0.3 s): {row}"
        others = [v for j, v in enumerate(row) if j != 2]
        assert max(others) < row[2], f"rank {rank}: the straggler is not the largest wait: {row}"


def test_fp8_cast_rule():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn((7, 300), generator=gen) * 5).to(torch.bfloat16)
    x[3] = 0  # an all-zero token: amax clamps to 1e-4
    q, s = epcomm.per_token_cast_to_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (7, 300) and s.shape == (7, 3)
    xf = torch.nn.functional.pad(x.float(), (0, 84)).view(7, 3, 128)
    amax = xf.abs().amax(-1).clamp(min=1e-4)
    assert torch.equal(s, amax * torch.tensor(1 / 448, dtype=torch.float32))
    assert float(q.float().abs().max()) <= 448
    back = epcomm.per_token_cast_back(q, s)
    rel = ((back.float() - x.float()).abs() / x.float().abs().clamp(min=1e-2)).max()
    assert rel < 0.13, f"e4m3 round trip relative error {rel}"
    # Power-of-two scales and UE8M0 packing round-trip exactly.
    q2, s2 = quantize_groups(torch.randn((5, 1024), generator=gen), round_scale=True)
    assert torch.equal(torch.log2(s2), torch.log2(s2).round())
    packed = pack_ue8m0(s2)
    assert packed.dtype == torch.int32 and packed.shape == (5, 2)
    assert torch.equal(unpack_ue8m0(packed), s2)
    assert torch.equal(epcomm.per_token_cast_back(q2, packed), epcomm.per_token_cast_back(q2, s2))


def test_is_sm90_compiled_needs_a_hopper_gpu_and_nvcc():
    import shutil

    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
    if not hopper:
        assert Buffer.is_sm90_compiled() is False
    elif shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc"):
        assert Buffer.is_sm90_compiled() is True


def test_which_groups_hold_tensors_on_gpus():
    """A Buffer's tensors are on the rank's GPU when its group has a CUDA backend: NCCL, a mixed
    group, or the gloo-on-CUDA group of ranks sharing GPUs (the tests' EPCOMM_TEST_SHARE_GPUS)."""
    for name, on_gpu in (("nccl", True), ("cpu:gloo,cuda:nccl", True), (SHARED_GPU_BACKEND, True), ("gloo", False),
                         ("cpu:gloo", False)):
        assert backend_on_cuda(name) is on_gpu, name


def test_low_latency_transport_settings():
    """EPCOMM_LL_TRANSPORT and EPCOMM_LL_REMOTE_RANKS are parsed strictly (a typo is an error, not the
    default)."""
    with env_var("EPCOMM_LL_REMOTE_RANKS", " 1, 3"):
        assert _env.ll_remote_ranks(4) == {1, 3}
    with env_var("EPCOMM_LL_REMOTE_RANKS", "all"):
        assert _env.ll_remote_ranks(3) == {0, 1, 2}
    with env_var("EPCOMM_LL_REMOTE_RANKS", ""):
        assert _env.ll_remote_ranks(3) == set()
    for bad, message in (("4", r"rank\(s\) \[4\] are not in a group of 4"), ("one", "comma-separated ranks")):
        with env_var("EPCOMM_LL_REMOTE_RANKS", bad), pytest.raises(ValueError, match=message):
            _env.ll_remote_ranks(4)
    for good in ("auto", "ipc", "nvshmem"):
        with env_var("EPCOMM_LL_TRANSPORT", good):
            assert _env.ll_transport() == good
    with env_var("EPCOMM_LL_TRANSPORT", "rdma"), pytest.raises(ValueError, match="auto, ipc or nvshmem"):
        _env.ll_transport()
    assert _env.env_str("EPCOMM_LL_TRANSPORT") == "auto"
    assert _env.ll_block_receive() == "auto"
    with env_var("EPCOMM_LL_BLOCK_RECEIVE", "on"), pytest.raises(ValueError, match="auto, 0 or 1"):
        _env.ll_block_receive()
    assert _env.ll_combine_partials() == "auto"
    with env_var("EPCOMM_LL_COMBINE_PARTIALS", "1"):
        assert _env.ll_combine_partials() == "1"
    with env_var("EPCOMM_LL_COMBINE_PARTIALS", "on"), pytest.raises(ValueError, match="auto, 0 or 1"):
        _env.ll_combine_partials()
    assert _env.ll_dispatch_senders() == 0  # auto
    with env_var("EPCOMM_LL_DISPATCH_SENDERS", " 44 "):
        assert _env.ll_dispatch_senders() == 44
    for bad, message in (("0", ">= 1"), ("half", "auto or a number of blocks")):
        with env_var("EPCOMM_LL_DISPATCH_SENDERS", bad), pytest.raises(ValueError, match=message):
            _env.ll_dispatch_senders()


def test_readme_lists_every_environment_variable_with_its_default():
    """The README's table of environment variables is the code's (epcomm/_env.py): the same names,
    and each default as the code has it (an empty default is written as a phrase there)."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    rows = {}
    for line in readme.splitlines():
        match = re.match(r"\| `(EPCOMM_[A-Z0-9_]+)` \| ([^|]*) \|", line)
        if match:
            rows[match.group(1)] = match.group(2).strip()
    assert set(rows) == set(_env.ENV_VARS), set(rows) ^ set(_env.ENV_VARS)
    for name, (default, _) in _env.ENV_VARS.items():
        if default:
            assert rows[name] == default, (name, rows[name], default)


def test_send_sms_split():
    """EPCOMM_{DISPATCH,COMBINE}_SEND_SMS_PCT: a percentage in (0, 100) or auto (the default), which
    splits a call's SMs by the bytes each role moves (send_share): at 2 ranks 1/3 of a dispatch's
    SMs send (fewer for FP8 rows), 2/3 where the senders also write the rank's own rows (a fused
    dispatch at 2 ranks), and 10 of a combine's 24 (its senders' NVLink stores are slower than its
    reducers' sums); at one rank the side with nothing to move keeps one SM."""
    from epcomm.tuning import send_blocks, send_share

    for name in ("EPCOMM_DISPATCH_SEND_SMS_PCT", "EPCOMM_COMBINE_SEND_SMS_PCT"):
        assert _env.send_sms_pct(name) is None
        with env_var(name, "40"):
            assert _env.send_sms_pct(name) == 40.0
        for bad, message in (("half", "a percentage or auto"), ("100", r"must lie in \(0, 100\)")):
            with env_var(name, bad), pytest.raises(ValueError, match=message):
                _env.send_sms_pct(name)
    assert send_share("dispatch", 2) == pytest.approx(1 / 3)
    assert send_share("dispatch_own", 2) == pytest.approx(2 / 3) and send_share("dispatch_own", 1) == 1.0
    assert [send_blocks("dispatch_own", r, 24) for r in (1, 2)] == [23, 16]
    assert round(24 * send_share("combine", 2)) == 10
    assert [round(24 * send_share(w, 8)) for w in ("dispatch", "combine")] == [11, 13]
    assert send_share("dispatch", 1) == 0.0 and send_share("combine", 1) == 0.0
    assert [send_blocks("dispatch", r, 24) for r in (1, 2, 4, 8)] == [1, 8, 10, 11]
    assert [send_blocks("combine", r, 24) for r in (1, 2, 4)] == [1, 10, 12]
    # FP8 rows give the receivers more from 3 ranks (their per-row work weighs more): 8 of 24 at 4
    # ranks; at 2 ranks the BF16 share (measured best there).
    assert send_blocks("dispatch_fp8", 4, 24) == 8
    assert send_blocks("dispatch_fp8", 2, 24) == send_blocks("dispatch", 2, 24) == 8
    assert [send_blocks("dispatch_fp8", r, 16) for r in (1, 2, 4, 8)] == [1, 5, 5, 6]
    # A dispatch that reads its counts (send and receive kernels): the shares measured at 2 and 4 ranks.
    assert [send_blocks("dispatch_split", r, n) for r in (2, 4) for n in (16, 24)] == [6, 9, 6, 10]
    assert send_blocks("dispatch_split", 8, 24) == send_blocks("dispatch", 8, 24)
    assert send_blocks("dispatch", 4, 24, pct=66.7) == 16  # a set share
    assert send_blocks("dispatch", 4, 24, pct=99) == 23  # every role keeps one SM
    with pytest.raises(ValueError, match="unknown work"):
        send_share("gather", 2)


def rank_choose_transport() -> dict:
    from epcomm.backends.cuda.low_latency import _choose_transport

    group, num_ranks = dist.group.WORLD, dist.get_world_size()
    seen = {"auto": _choose_transport(group, num_ranks)}  # every rank on this host: CUDA IPC
    with env_var("EPCOMM_LL_REMOTE_RANKS", "1"):
        seen["remote"] = _choose_transport(group, num_ranks)  # a remote peer implies NVSHMEM
        with env_var("EPCOMM_LL_TRANSPORT", "ipc"), pytest.raises(ValueError, match="needs the NVSHMEM transport"):
            _choose_transport(group, num_ranks)
    with env_var("EPCOMM_LL_TRANSPORT", "nvshmem"):
        seen["forced"] = _choose_transport(group, num_ranks)
    return seen


def test_low_latency_transport_choice():
    for seen in cluster(2).run(rank_choose_transport):
        assert seen == {"auto": "ipc", "remote": "nvshmem", "forced": "nvshmem"}, seen


def test_low_latency_block_receive_choice():
    """EPCOMM_LL_BLOCK_RECEIVE=auto takes the block receive from 2 pairs per expert on; 0 and 1 force."""
    from epcomm.tuning import receive_together
    assert receive_together("auto", 128, 8, 288) and receive_together("auto", 72, 8, 288)
    assert not receive_together("auto", 71, 8, 288) and not receive_together("auto", 1, 8, 288)
    assert not receive_together("auto", 0, 8, 288)
    assert receive_together("1", 1, 8, 288) and not receive_together("0", 256, 8, 288)
