"""Which backend and device a Buffer takes: backend='auto' (the CUDA kernels for each mode every rank
can run them for), the device rule (DeepEP works on the current GPU whatever group it is given: vLLM
passes its gloo group), and the refusals when ranks disagree. The GPU cases are skipped without GPUs.
"""

from __future__ import annotations

import contextlib
import os
import time
import types

import pytest
import torch
import torch.distributed as dist
from conftest import BACKEND, EpcommLog, cluster, env_var, fresh_cluster, nvshmem_found, poison_allocator
from routing import make_inputs

from epcomm import Buffer, Config, backend_choice
from epcomm.backends.cuda.availability import LOW_LATENCY, NORMAL, mode_blockers
from epcomm.bench.checks import same_bits
from epcomm.planner.topology import PRESET_DIR
from epcomm.utils.launch import group_device

HIDDEN, EXPERTS, TOPK, N = 512, 16, 4, 32
gpu_only = pytest.mark.skipif(BACKEND != "nccl", reason="CUDA kernels: run with EPCOMM_TEST_BACKEND=nccl on GPUs")


def _buffers_kwargs(num_ranks: int) -> dict:
    return dict(num_nvl_bytes=Config().get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks),
                num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(N, HIDDEN, num_ranks, EXPERTS),
                low_latency_mode=True)


def _round_trip(buf: Buffer, dev: torch.device, seed: int) -> dict:
    """A dispatch, a combine and a low-latency dispatch + combine on ``buf``; the outputs (copies)."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    x, topk_idx, weights = (t.to(dev) for t in make_inputs(seed, rank, 24, HIDDEN, EXPERTS, TOPK, num_ranks,
                                                           "random"))
    if dev.type == "cuda":
        poison_allocator(dev)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, EXPERTS)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=weights)
    combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    buf.clean_low_latency_buffer(N, HIDDEN, EXPERTS)
    ll_x, ll_count, ll_handle, _, _ = buf.low_latency_dispatch(x, topk_idx, N, EXPERTS, use_fp8=False)
    ll_out, _, _ = buf.low_latency_combine(ll_x, topk_idx, weights, ll_handle)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    rows = [ll_x[e, :int(c)].clone() for e, c in enumerate(ll_count.tolist())]
    return dict(recv_x=recv_x.clone(), recv_idx=recv_idx.clone(), recv_w=recv_w.clone(), counts=counts,
                combined=combined.clone(), combined_w=combined_w.clone(), ll_rows=rows, ll_out=ll_out.clone())


def _same(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b if not isinstance(a, torch.Tensor) else a.shape == b.shape and same_bits(a, b)


# ----------------------------------------------------------------------------- on CPU ranks (CI)
@contextlib.contextmanager
def _blockers_on_rank(rank: int, fake):
    """availability.mode_blockers replaced by ``fake`` on ``rank``, by no blocker on the others."""
    import epcomm.lifecycle as lifecycle

    real = lifecycle.mode_blockers
    lifecycle.mode_blockers = fake if dist.get_rank() == rank else (lambda *args, **kwargs: {})
    try:
        yield
    finally:
        lifecycle.mode_blockers = real


def rank_auto_on_cpu():
    """No GPU: 'auto' is the reference backend for both modes, on the CPU, with the CPU as the reason
    and one INFO line per Buffer on rank 0 saying so; a Buffer without low-latency mode reports it on
    the reference too, as unused. With EPCOMM_DEVICE unset, a gloo group without CUDA is on the CPU."""
    with EpcommLog() as records:
        buf = Buffer(dist.group.WORLD, **_buffers_kwargs(dist.get_world_size()), backend="auto")
        normal_only = Buffer(dist.group.WORLD, 1 << 22, backend="auto")
    cpu = "the CUDA kernels cannot run it (every rank: the Buffer's tensors are on the CPU)"
    assert buf.backend_reasons[LOW_LATENCY] == cpu, buf.backend_reasons
    assert buf.backend_reasons[NORMAL].startswith(cpu + "; strategy alltoall: the planner's fastest for 1 domain "
                                                  f"of {dist.get_world_size()} ranks on 1 host"), buf.backend_reasons
    assert normal_only.backend_reasons[LOW_LATENCY].startswith("not used by this Buffer"), normal_only.backend_reasons
    if dist.get_rank() == 0:
        assert len(records.messages) == 2, records.messages
        assert records.messages[0] == (f"epcomm Buffer ({dist.get_world_size()} ranks, cpu): normal mode on "
                                       f"reference: {buf.backend_reasons[NORMAL]}; low-latency mode on reference: "
                                       f"{cpu}"), records.messages
    else:
        assert records.messages == [], records.messages
    assert buf.device.type == "cpu"
    assert buf.backends == {NORMAL: "reference", LOW_LATENCY: "reference"} and buf.backend_name == "reference"
    assert normal_only.backends == {NORMAL: "reference", LOW_LATENCY: "reference"}, normal_only.backends
    out = _round_trip(buf, buf.device, seed=3)
    buf.destroy()
    normal_only.destroy()
    saved = os.environ.pop("EPCOMM_DEVICE", None)  # the CPU clusters' ranks set it (epcomm.utils.launch)
    try:
        assert group_device() == torch.device("cpu")
    finally:
        if saved is not None:
            os.environ["EPCOMM_DEVICE"] = saved
    return int(out["recv_x"].shape[0])


def rank_split_vote(raise_in_check: bool):
    """One rank cannot run the kernels (or its check raises): every rank keeps both modes on the
    reference backend, within the timeout, and the Buffer works."""
    def blocked(*args, **kwargs):
        if raise_in_check:
            raise OSError("no such library")
        return {NORMAL: "test: blocked", LOW_LATENCY: "test: blocked"}

    with _blockers_on_rank(1, blocked):
        start = time.monotonic()
        buf = Buffer(dist.group.WORLD, **_buffers_kwargs(dist.get_world_size()), backend="auto")
        elapsed = time.monotonic() - start
    assert buf.backends == {NORMAL: "reference", LOW_LATENCY: "reference"}, buf.backends
    why = "rank 1: " + ("checking the kernels failed (OSError: no such library)" if raise_in_check else "test: blocked")
    assert buf.backend_reasons[LOW_LATENCY] == f"the CUDA kernels cannot run it ({why})", buf.backend_reasons
    assert elapsed < 10, elapsed
    out = _round_trip(buf, buf.device, seed=4)
    buf.destroy()
    return int(out["recv_x"].shape[0])


@pytest.mark.skipif(BACKEND == "nccl", reason="the CPU rule: the suite runs on GPUs")
@pytest.mark.parametrize("raise_in_check", [False, True], ids=["blocked", "check-raises"])
def test_one_rank_unable_keeps_every_rank_on_the_reference(raise_in_check):
    assert sum(cluster(2).run(rank_split_vote, raise_in_check)) > 0


@contextlib.contextmanager
def _hosts(ranks_per_host: int):
    """Each rank's host name seen by the Buffer: ranks_per_host consecutive ranks per simulated host."""
    import epcomm.lifecycle as lifecycle

    real = lifecycle.socket
    lifecycle.socket = types.SimpleNamespace(gethostname=lambda: f"host{dist.get_rank() // ranks_per_host}")
    try:
        yield
    finally:
        lifecycle.socket = real


def rank_planned_strategies():
    """backend='auto' off the kernels: normal mode takes the planner's strategy for the group's domains,
    detected from the hosts or set by EPCOMM_RANKS_PER_DOMAIN; strategy= wins; backend='reference' keeps
    the all-to-all. Each Buffer logs one line on rank 0, naming its strategy and why."""
    cases = [  # (ranks per simulated host, EPCOMM_RANKS_PER_DOMAIN, strategy=, backend, strategy got, reason)
        (4, None, None, "auto", "alltoall", "the planner's fastest for 1 domain of 4 ranks on 1 host ("),
        (4, 2, None, "auto", "alltoall", "the planner's fastest for 2 domains of 2 ranks on 1 host "
                                         "(EPCOMM_RANKS_PER_DOMAIN), sharing the host's links ("),
        (2, None, None, "auto", "hierarchical", "the planner's fastest for 2 domains of 2 ranks on 2 hosts ("),
        (2, 4, None, "auto", "alltoall", "the planner's fastest for 1 domain of 4 ranks on 2 hosts "
                                         "(EPCOMM_RANKS_PER_DOMAIN) ("),
        (2, None, "allgather", "auto", "allgather", "given"),
        (2, None, "alltoall", "auto", "alltoall", "given"),
        (2, None, None, "reference", "alltoall", "the default (the planner chooses on backend='auto')"),
    ]
    outs = []
    for per_host, per_domain, strategy, backend, want, why in cases:
        env = env_var("EPCOMM_RANKS_PER_DOMAIN", per_domain) if per_domain else contextlib.nullcontext()
        with _hosts(per_host), env, EpcommLog() as records:
            buf = Buffer(dist.group.WORLD, _buffers_kwargs(dist.get_world_size())["num_nvl_bytes"], backend=backend,
                         strategy=strategy)
        case = (per_host, per_domain, strategy, backend)
        assert buf.strategy == want, (case, buf.strategy)
        assert buf.num_domains == dist.get_world_size() // (per_domain or per_host), (case, buf.num_domains)
        reason = buf.backend_reasons[NORMAL]
        assert f"; strategy {want}: {why}" in reason, (case, reason)
        messages = [m for m in records.messages if m.startswith("epcomm Buffer (")]
        assert len(messages) == (dist.get_rank() == 0), (case, records.messages)
        assert all(f"normal mode on reference: {reason}; low-latency mode on reference: " in m
                   for m in messages), (case, messages)
        if want == "hierarchical":  # the chosen strategy runs
            x, topk_idx, weights = make_inputs(11, dist.get_rank(), 24, HIDDEN, EXPERTS, TOPK,
                                               dist.get_world_size(), "random")
            per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, EXPERTS)
            recv_x, _, recv_w, _, handle, _ = buf.dispatch(
                x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights)
            combined, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
            assert combined.shape == x.shape
        buf.destroy()
        outs.append(reason)
    return outs


@pytest.mark.skipif(BACKEND == "nccl", reason="the CPU rule: the suite runs on GPUs")
def test_auto_takes_the_planners_strategy_for_the_domains():
    reasons = cluster(4).run(rank_planned_strategies)
    assert all(r == reasons[0] for r in reasons), "the ranks' reasons differ"


def test_planned_strategy_follows_the_links(tmp_path):
    """The planner's choice for the domains: the all-to-all in one domain and where domains share one
    host's links; hierarchical forwarding where hosts' links join the domains; the default ranks per
    domain is the same on every rank, even for uneven hosts."""
    def domains(hosts, per_domain=None):
        return backend_choice.detect_domains(hosts, per_domain or backend_choice.default_ranks_per_domain(hosts),
                                             per_domain is not None)
    assert backend_choice.planned_strategy(domains([1] * 8))[0] == "alltoall"
    assert backend_choice.planned_strategy(domains([1] * 8, 4))[0] == "alltoall"
    assert backend_choice.planned_strategy(domains([1] * 8 + [2] * 8))[0] == "hierarchical"
    assert backend_choice.planned_strategy(domains([1] * 4 + [2] * 4, 8))[0] == "alltoall"
    # EPCOMM_LINKS: links as fast between hosts as inside them make the flat all-to-all the fastest.
    assert backend_choice.planned_strategy(domains([1] * 8 + [2] * 8), "8xh200-2x4")[0] == "alltoall"
    assert backend_choice.planned_strategy(domains([1] * 8 + [2] * 8), "8xh200")[0] == "alltoall"
    links_file = tmp_path / "links.toml"  # a topology file is read as the preset it copies
    links_file.write_text((PRESET_DIR / "8xh200-2x4.toml").read_text())
    assert backend_choice.planned_strategy(domains([1] * 8 + [2] * 8), str(links_file))[0] == "alltoall"
    with pytest.raises(ValueError, match=r"EPCOMM_LINKS='nvlink' is neither a planner preset"):
        backend_choice.links_topology("nvlink")
    assert backend_choice.default_ranks_per_domain([1, 1, 2, 2, 2, 2]) == 6
    assert backend_choice.default_ranks_per_domain([1, 1, 2, 2]) == 2
    # The kernels across hosts: the hierarchical kernels when the Buffer reserves their buffer.
    two_hosts = domains([1] * 8 + [2] * 8)
    assert backend_choice.kernel_strategy(two_hosts, 1 << 20, False) == "hierarchical"
    assert backend_choice.kernel_strategy(two_hosts, 0, False) == "alltoall"
    assert backend_choice.kernel_strategy(two_hosts, 1 << 20, True) == "alltoall"
    assert backend_choice.kernel_strategy(domains([1] * 8), 1 << 20, False) == "alltoall"


def rank_sizes_disagree():
    """Ranks building different Buffers (here num_nvl_bytes) raise ValueError on every rank."""
    with pytest.raises(ValueError, match=r"different num_nvl_bytes values .*rank 0: 1048576, rank 1: 2097152"):
        Buffer(dist.group.WORLD, (1 + dist.get_rank()) << 20)
    return True


def test_ranks_building_different_buffers_all_raise():
    cluster(2).run(rank_sizes_disagree)


@pytest.mark.skipif(BACKEND == "nccl", reason="the CPU rule: the suite runs on GPUs")
def test_auto_without_gpus_is_the_reference_backend():
    assert sum(cluster(2).run(rank_auto_on_cpu)) > 0


def rank_backends_disagree():
    """Ranks asking for different backends raise ValueError on every rank (else they would wait on
    each other in different protocols)."""
    with pytest.raises(ValueError, match=r"different backend values .*rank 0: auto, rank 1: reference"):
        Buffer(dist.group.WORLD, 1 << 20, backend="auto" if dist.get_rank() == 0 else "reference")
    return True


def test_ranks_asking_for_different_backends_all_raise():
    cluster(2).run(rank_backends_disagree)


def rank_domains_or_strategy_disagree():
    """A strategy passed on one rank only, or EPCOMM_RANKS_PER_DOMAIN set on one rank only: every rank
    raises ValueError naming it (the planner's choice and the domains must be the same everywhere)."""
    first = dist.get_rank() == 0
    with pytest.raises(ValueError, match=r"different strategy values .*rank 0: unset, rank 1: alltoall"):
        Buffer(dist.group.WORLD, 1 << 20, backend="auto", strategy=None if first else "alltoall")
    env = env_var("EPCOMM_RANKS_PER_DOMAIN", 1) if not first else contextlib.nullcontext()
    with env, pytest.raises(ValueError, match=r"different EPCOMM_RANKS_PER_DOMAIN values .*rank 0: unset, rank 1: 1"):
        Buffer(dist.group.WORLD, 1 << 20, backend="auto")
    env = env_var("EPCOMM_LINKS", "8xh200-2x4") if not first else contextlib.nullcontext()
    with env, pytest.raises(ValueError, match=r"different EPCOMM_LINKS values"):
        Buffer(dist.group.WORLD, 1 << 20, backend="auto")
    with env_var("EPCOMM_LINKS", "no-such-links"), pytest.raises(ValueError, match=r"EPCOMM_LINKS='no-such-links'"):
        Buffer(dist.group.WORLD, 1 << 20, backend="auto")
    return True


def test_ranks_disagreeing_on_strategy_or_domains_all_raise():
    cluster(2).run(rank_domains_or_strategy_disagree)


def rank_bad_device():
    """A device that is not the CPU or a GPU, on one rank: every rank raises, none waits."""
    if dist.get_rank() == 1:
        with pytest.raises(ValueError, match="device must be the CPU or a CUDA device"):
            Buffer(dist.group.WORLD, 1 << 20, device="meta")
        with env_var("EPCOMM_DEVICE", "gpu"), pytest.raises(ValueError, match="EPCOMM_DEVICE must be cpu or cuda"):
            Buffer(dist.group.WORLD, 1 << 20)
    else:
        for _ in range(2):
            with pytest.raises(ValueError, match=r"rank\(s\) \[1\] refused"):
                Buffer(dist.group.WORLD, 1 << 20)
    return True


def test_bad_device_raises_on_every_rank():
    cluster(2).run(rank_bad_device)


def test_mode_blockers_name_what_stops_the_kernels():
    cpu = torch.device("cpu")
    kwargs = dict(num_nvl_bytes=1 << 20, num_rdma_bytes=1 << 20, low_latency_mode=True, strategy="alltoall",
                  ll_nvshmem=False)
    blockers = mode_blockers(0, cpu, [1, 1], [0, 0], **kwargs)
    assert set(blockers) == {NORMAL, LOW_LATENCY} and "CPU" in blockers[NORMAL]
    # A mode the Buffer does not use is not voted on.
    assert set(mode_blockers(0, cpu, [1], [0], **{**kwargs, "low_latency_mode": False})) == {NORMAL}
    assert mode_blockers(0, cpu, [1], [0], **{**kwargs, "num_nvl_bytes": 0, "low_latency_mode": False}) == {}


# ----------------------------------------------------------------------------- on GPUs
def rank_auto_on_gpus(group_backend: str | None):
    """'auto' on GPUs runs both modes on the kernels, bitwise equal to the reference backend. With
    ``group_backend='gloo'`` the Buffers get a plain gloo group, as vLLM passes its CPU group: the
    tensors are on the current GPU all the same (DeepEP's rule), for both backends."""
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.new_group(backend=group_backend) if group_backend else dist.group.WORLD
    kwargs = _buffers_kwargs(dist.get_world_size())
    outs = {}
    for backend in ("reference", "auto"):
        buf = Buffer(group, **kwargs, backend=backend)
        assert buf.device == dev, (backend, buf.device)
        want = "cuda" if backend == "auto" else "reference"
        assert buf.backends == {NORMAL: want, LOW_LATENCY: want}, (backend, buf.backends)
        assert buf.strategy == "alltoall", (backend, buf.strategy)
        if backend == "auto":
            assert buf.backend_reasons == {
                NORMAL: "every rank can run the CUDA kernels; strategy alltoall: the kernels' default for 1 domain "
                        f"of {dist.get_world_size()} rank{'s' if dist.get_world_size() > 1 else ''} on 1 host",
                LOW_LATENCY: "every rank can run the CUDA kernels"}, buf.backend_reasons
        outs[backend] = _round_trip(buf, dev, seed=5)
        buf.destroy()
    for key, ref in outs["reference"].items():
        assert _same(outs["auto"][key], ref), f"rank {dist.get_rank()}: {key} differs from the reference backend"
    return True


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("group_backend", [None, "gloo"], ids=["world", "gloo-group"])
def test_auto_on_gpus_runs_the_kernels(ranks, group_backend):
    cluster(ranks).run(rank_auto_on_gpus, group_backend)


def rank_auto_falls_back():
    """A mode the kernels cannot run stays on the reference backend, with the reason, in one line that
    rank 0 logs: here the allgather strategy (normal mode), while low-latency mode still runs on the
    kernels."""
    with EpcommLog() as records:
        buf = Buffer(dist.group.WORLD, **_buffers_kwargs(dist.get_world_size()), backend="auto", strategy="allgather")
    assert buf.backends == {NORMAL: "reference", LOW_LATENCY: "cuda"}, buf.backends
    assert buf.backend_reasons[NORMAL] == ("the CUDA kernels cannot run it (every rank: strategy='allgather' is "
                                           "implemented by the reference backend only); strategy allgather: given")
    if dist.get_rank() == 0:
        lines = [m for m in records.messages if m.startswith("epcomm Buffer (")]
        assert lines == [
            f"epcomm Buffer ({dist.get_world_size()} ranks, cuda): normal mode on reference: "
            f"{buf.backend_reasons[NORMAL]}; low-latency mode on cuda: every rank can run the CUDA kernels"], \
            records.messages
    else:
        assert not [m for m in records.messages if m.startswith("epcomm Buffer (")], records.messages
    out = _round_trip(buf, buf.device, seed=9)
    buf.destroy()
    return int(out["recv_x"].shape[0])


@pytest.mark.gpu
@gpu_only
def test_auto_keeps_a_mode_the_kernels_cannot_run_on_the_reference():
    cluster(2).run(rank_auto_falls_back)



def rank_auto_hierarchical_across_hosts():
    """A Buffer across (simulated) hosts that reserves num_rdma_bytes and passes no strategy= runs normal
    mode on the hierarchical kernels, as DeepEP's internode Buffer does, with the outputs of the reference
    backend's hierarchical strategy."""
    from epcomm.backends.cuda.hierarchical import rdma_bytes_needed

    rank, num_ranks, num_tokens, num_experts = dist.get_rank(), dist.get_world_size(), 32, 4 * dist.get_world_size()
    rdma = rdma_bytes_needed(num_tokens, HIDDEN, 2, num_ranks, 1, TOPK, HIDDEN // 128)
    with _hosts(1):
        ref = Buffer(dist.group.WORLD, 64 << 20, backend="reference", strategy="hierarchical")
        auto = Buffer(dist.group.WORLD, 64 << 20, rdma, backend="auto")
    assert (auto.backends[NORMAL], auto.strategy) == ("cuda", "hierarchical"), auto.backend_reasons
    assert auto.backend_reasons[NORMAL] == ("every rank can run the CUDA kernels; strategy hierarchical: the kernels' "
                                            f"default for {num_ranks} domains of 1 rank on {num_ranks} hosts")
    dev = auto.device
    x, idx, w = (t.to(dev) for t in make_inputs(21, rank, num_tokens, HIDDEN, num_experts, TOPK, num_ranks, "random"))
    outs = []
    for buf in (ref, auto):
        per_rank, per_domain, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_domain, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        combined = buf.combine((recv_x.float() * 0.5).to(torch.bfloat16), handle, topk_weights=recv_w)[0]
        torch.cuda.synchronize()
        outs.append((recv_x.clone(), combined.clone()))
    assert same_bits(outs[0][0], outs[1][0]) and same_bits(outs[0][1], outs[1][1]), f"rank {rank}: outputs differ"
    ref.destroy()
    auto.destroy()
    return True


@pytest.mark.gpu
@gpu_only
def test_auto_across_hosts_runs_the_hierarchical_kernels():
    if not nvshmem_found():
        pytest.skip("NVSHMEM not installed (pip install nvidia-nvshmem-cu13)")
    with fresh_cluster(2, {"NVSHMEM_SYMMETRIC_SIZE": str(1 << 30)}) as c:
        c.run(rank_auto_hierarchical_across_hosts, timeout_s=300)


def rank_buffer_names_per_group():
    """A Buffer's name in the store (its exchanges' keys) is equal on the ranks of its group, whatever
    other Buffers a rank built on other groups before, and differs between groups: the meetings of two
    expert-parallel groups' Buffers must not satisfy each other."""
    rank = dist.get_rank()
    solo = dist.new_group([0])  # new_group is collective over the world: every rank makes every group
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    if rank == 0:  # a per-process count of Buffers would now differ between ranks 0 and 1
        Buffer(solo, 1 << 22, backend="reference").destroy()
    buf = Buffer(pairs[rank // 2], 1 << 22, backend="reference")
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, buf.uid)
    buf.destroy()
    return names


def test_buffer_names_are_per_group():
    names = cluster(4).run(rank_buffer_names_per_group)[0]
    assert names[0] == names[1] and names[2] == names[3] and names[0] != names[2], names
