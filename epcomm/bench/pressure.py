"""The pressure test (``python -m epcomm.bench --pressure N``): many random shapes and routings.

Each of the N cases draws (the same on every rank, from the shared seed) token counts per rank,
hidden size, top-k, experts, a routing pattern (random, one expert, imbalanced, an empty rank, all
dropped), BF16 or FP8 with row- or column-major scales, ``num_worst_tokens`` or not, and zero to
two biases. A case then:

* runs **back to back** dispatch, dispatch, combine, combine (two handles alive at once) and
  compares every output with the reference backend (bitwise; the reference is the oracle);
* **replays** the same sequence ``replays`` times and requires bitwise identical outputs each time,
  on GPUs while a **compute stream** runs matrix products beside it;
* on the CUDA backend with ``num_worst_tokens``, captures dispatch + combine in a **CUDA graph**
  and replays it, again bitwise identical to the first result;
* **reuses** the previous case's Buffer or **recreates** it, alternately;
* on the CUDA backend with NVSHMEM, the same with ``strategy="hierarchical"`` (every split of the
  ranks into domains in turn, 2x1 and 1x2 on two GPUs; its oracle is the reference backend's
  hierarchical strategy), replays and CUDA-graph replays included;
* then the same in **low-latency mode** (an LL Buffer of its own, sized once for the largest draw):
  dispatch, dispatch, combine, combine of the case's tokens (N = the largest count), FP8 (plain,
  rounded scales, or UE8M0) or BF16, with or without receive hooks; the valid rows of every
  dispatch output and the combined tokens compared bitwise with the reference backend, replayed
  beside the compute stream, and replayed from a CUDA graph on the CUDA backend.

Every rank makes the same calls in the same order whatever its checks find; failures are reported,
never a hang. The result is one record per run (the slowest rank's wall time, and the failures).
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import torch
import torch.distributed as dist

from .. import Buffer, per_token_cast_to_fp8
from ..utils.launch import group_device
from .checks import poison_, same_bits
from .workloads import ROUTINGS, make_pattern_topk_idx

HIDDENS = (256, 512, 1024, 2048, 7168)
GiB = 1 << 30


def _draw(rng: random.Random, num_ranks: int) -> dict[str, Any]:
    """One case's shapes; ``rng`` is seeded alike on every rank, so every rank draws the same case."""
    num_topk = rng.randint(1, 8)
    num_experts = num_ranks * rng.choice((1, 2, 4, 8, 16))
    while num_experts < num_topk:
        num_experts *= 2
    return {
        "tokens": [rng.choice((0, 1, rng.randint(2, 40), rng.randint(41, 300))) for _ in range(num_ranks)],
        "hidden": rng.choice(HIDDENS), "num_topk": num_topk, "num_experts": num_experts,
        "routing": rng.choice(ROUTINGS), "fp8": rng.random() < 0.5, "col_major": rng.random() < 0.5,
        "worst": rng.random() < 0.3, "num_biases": rng.randint(0, 2), "seed": rng.randrange(1 << 30),
        "ll_format": rng.choice(("bf16", "fp8", "fp8-round", "fp8-ue8m0")), "ll_hook": rng.random() < 0.5,
    }


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    return []


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested outputs (tensors by their bytes, other leaves by ==)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and same_bits(a, b)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class _Sequence:
    """dispatch, dispatch, combine, combine of one case on one Buffer; ``run()`` returns every output."""

    def __init__(self, buf: Buffer, draw: dict, rank: int, num_ranks: int, dev: torch.device) -> None:
        gen = torch.Generator(device="cpu").manual_seed(draw["seed"] * 1000 + rank)
        num_tokens, hidden = draw["tokens"][rank], draw["hidden"]
        self.buf, self.draw = buf, draw
        x = (torch.randn((num_tokens, hidden), generator=gen, dtype=torch.float32, device="cpu") * 2).to(torch.bfloat16)
        topk_idx = make_pattern_topk_idx(gen, num_tokens, draw["num_experts"], draw["num_topk"], num_ranks,
                                         draw["routing"])
        weights = torch.rand(topk_idx.shape, generator=gen, dtype=torch.float32, device="cpu")
        self.x, self.topk_idx, self.weights = x.to(dev), topk_idx.to(dev), weights.to(dev)
        if draw["fp8"]:
            data, scales = per_token_cast_to_fp8(self.x)
            self.x_in = (data, scales.t().contiguous().t() if draw["col_major"] else scales)
        else:
            self.x_in = self.x
        self.biases = tuple((torch.randn((num_tokens, hidden), generator=gen, dtype=torch.float32, device="cpu") * 0.5)
                            .to(torch.bfloat16).to(dev)
                            for _ in range(draw["num_biases"])) or None
        self.worst = max(draw["tokens"]) * num_ranks if draw["worst"] else 0
        self.expert_scale = 1.0 + rank  # stands in for the experts: y = x * scale, per rank

    def _expert(self, recv_x) -> torch.Tensor:
        data = recv_x[0].float() if isinstance(recv_x, tuple) else recv_x.float()
        return (data * self.expert_scale).to(torch.bfloat16)

    def run(self) -> tuple:
        b, n = self.buf, self.draw["num_experts"]
        per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(self.topk_idx, n)
        kwargs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                      topk_idx=self.topk_idx, topk_weights=self.weights, num_worst_tokens=self.worst)
        first = b.dispatch(self.x_in, **kwargs)
        second = b.dispatch(self.x_in, **kwargs)  # back to back: both handles stay alive
        y1, y2 = self._expert(first[0]), self._expert(second[0])
        c1 = b.combine(y1, first[4], topk_weights=first[2], bias=self.biases)
        c2 = b.combine(y2, second[4], topk_weights=second[2], bias=self.biases)
        return first[:4], second[:4], c1[:2], c2[:2]


def _valid_ll_outputs(recv_x, recv_count: torch.Tensor, handle) -> tuple:
    """What a low-latency dispatch defines: the counts, each expert's rows [0, count) (data and
    scales), the layout and source of those rows (the rest of the packed tensors is unspecified)."""
    parts = recv_x if isinstance(recv_x, tuple) else (recv_x,)
    counts = recv_count.tolist()
    rows = tuple(t[e, :c].contiguous() for t in parts for e, c in enumerate(counts))
    src = tuple(handle.src_info[e, :c].clone() for e, c in enumerate(counts))
    return recv_count.clone(), rows, handle.layout_range.clone(), src


class _LowLatencySequence:
    """dispatch, dispatch, combine, combine of one case in low-latency mode."""

    def __init__(self, buf: Buffer, draw: dict, normal: _Sequence, num_ranks: int, hook: bool) -> None:
        self.buf, self.x, self.topk_idx, self.weights = buf, normal.x, normal.topk_idx, normal.weights
        self.n = max(1, max(draw["tokens"]))
        self.num_experts = draw["num_experts"]
        self.fp8, self.hook = draw["ll_format"] != "bf16", hook
        self.round_scale = draw["ll_format"] in ("fp8-round", "fp8-ue8m0")
        self.ue8m0 = draw["ll_format"] == "fp8-ue8m0"
        self.expert_scale = normal.expert_scale

    def _dispatch(self):
        recv_x, count, handle, _, hook = self.buf.low_latency_dispatch(
            self.x, self.topk_idx, self.n, self.num_experts, use_fp8=self.fp8, round_scale=self.round_scale,
            use_ue8m0=self.ue8m0, return_recv_hook=self.hook)
        if hook is not None:
            hook()
        return recv_x, count, handle

    def _combine(self, recv_x, handle) -> torch.Tensor:
        data = recv_x[0].float() if isinstance(recv_x, tuple) else recv_x.float()
        y = (torch.nan_to_num(data) * self.expert_scale).to(torch.bfloat16)  # rows past the counts: garbage
        combined, _, hook = self.buf.low_latency_combine(y, self.topk_idx, self.weights, handle,
                                                         return_recv_hook=self.hook)
        if hook is not None:
            hook()
        return combined

    def launch(self) -> tuple:
        """The four calls; their raw results (valid_outputs reads what they define)."""
        first, second = self._dispatch(), self._dispatch()  # two results alive at once
        return first, second, self._combine(first[0], first[2]), self._combine(second[0], second[2])

    @staticmethod
    def valid_outputs(raw: tuple) -> tuple:
        first, second, c1, c2 = raw
        return _valid_ll_outputs(*first), _valid_ll_outputs(*second), c1.clone(), c2.clone()

    def run(self) -> tuple:
        return self.valid_outputs(self.launch())


def _hierarchical_case(i: int, splits: list[int], hier: dict, draw: dict, rank: int, num_ranks: int,
                       dev: torch.device, replays: int, counts: dict, failures: list[str], tag: str) -> None:
    """One case on the hierarchical kernels, over the i-th split of the ranks into domains: against
    the reference backend's hierarchical strategy, replayed, and replayed from a CUDA graph."""
    rpd = splits[i % len(splits)]
    if rpd in hier and i % 2 == 0:  # alternately recreate and reuse
        for b in hier.pop(rpd):
            b.destroy()
    if rpd not in hier:
        hier[rpd] = _hierarchical_buffers(num_ranks, rpd)
        counts["buffers_created"] += 1
    h_buf, h_ref = hier[rpd]
    h_want = _Sequence(h_ref, draw, rank, num_ranks, dev).run()
    h_seq = _Sequence(h_buf, draw, rank, num_ranks, dev)
    h_got = h_seq.run()
    h_tag = f"rank {rank} {tag} hierarchical {num_ranks // rpd}x{rpd}"
    if not _same(h_got, h_want):
        failures.append(f"{h_tag}: differs from the reference backend")
    for _ in range(replays):
        counts["hier_replays"] += 1
        if not _same(h_seq.run(), h_got):
            failures.append(f"{h_tag}: a replay differs from the first run")
            break
    if h_seq.worst:
        counts["hier_graph_replays"] += _graph_replays(h_seq, h_got, replays, failures, h_tag, dev)
    counts["hier_cases"] += 1


def _hierarchical_splits(num_ranks: int) -> list[int]:
    """Ranks per domain to cycle through (every divisor up to 8; one domain included), or none
    without NVSHMEM."""
    try:
        from ..backends.cuda.build import find_nvshmem

        find_nvshmem()
    except RuntimeError:
        return []
    return [rpd for rpd in range(1, min(num_ranks, 8) + 1) if num_ranks % rpd == 0]


def _hierarchical_buffers(num_ranks: int, ranks_per_domain: int) -> tuple[Buffer, Buffer]:
    """A CUDA and a reference Buffer of the hierarchical strategy over domains of ``ranks_per_domain``,
    sized for the largest draw (300 tokens of H 7168, top-8, FP8 scales)."""
    from ..backends.cuda.hierarchical import nvl_bytes_needed, rdma_bytes_needed

    hidden, tokens = max(HIDDENS), 300
    hint = Buffer.get_dispatch_config(num_ranks).get_nvl_buffer_size_hint(hidden * 2, num_ranks)
    nvl = max(nvl_bytes_needed(tokens * num_ranks, hidden, 2, 8, hidden // 128), hint)
    rdma = rdma_bytes_needed(tokens, hidden, 2, num_ranks, ranks_per_domain, 8, hidden // 128)
    previous = os.environ.get("EPCOMM_RANKS_PER_DOMAIN")
    os.environ["EPCOMM_RANKS_PER_DOMAIN"] = str(ranks_per_domain)  # read when a Buffer is built
    try:
        return (Buffer(dist.group.WORLD, nvl, rdma, backend="cuda", strategy="hierarchical"),
                Buffer(dist.group.WORLD, GiB, backend="reference", strategy="hierarchical"))
    finally:
        if previous is None:
            del os.environ["EPCOMM_RANKS_PER_DOMAIN"]
        else:
            os.environ["EPCOMM_RANKS_PER_DOMAIN"] = previous


def _ll_buffer_bytes(num_ranks: int) -> int:
    """Room for the largest draw (one size: NVSHMEM's heap is sized by the first Buffer)."""
    return Buffer.get_low_latency_rdma_size_hint(300, max(HIDDENS), num_ranks, 16 * num_ranks)


def _compute_load(dev: torch.device):
    """A stream of matrix products beside the communication (GPU only), to stress overlap."""
    if dev.type != "cuda":
        return None
    stream = torch.cuda.Stream(dev)
    a = torch.randn((4096, 4096), device=dev, dtype=torch.bfloat16)
    return stream, a


def rank_pressure(num_cases: int, seed: int, backend: str, replays: int) -> dict[str, Any]:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    dev = group_device()
    rng = random.Random(seed)
    failures: list[str] = []
    counts = {"cases": 0, "replays": 0, "graph_replays": 0, "buffers_created": 0, "ll_cases": 0, "ll_replays": 0,
              "ll_graph_replays": 0, "hier_cases": 0, "hier_replays": 0, "hier_graph_replays": 0}
    splits = _hierarchical_splits(num_ranks) if backend == "cuda" and dev.type == "cuda" else []
    hier: dict[int, tuple[Buffer, Buffer]] = {}
    load = _compute_load(dev)
    buf = ref = ll_buf = ll_ref = None
    start = time.monotonic()
    for i in range(num_cases):
        draw = _draw(rng, num_ranks)
        tag = f"case {i} {draw}"
        if buf is None or i % 2 == 0:  # alternately recreate the Buffer and reuse it
            if buf is not None:
                buf.destroy()
            buf = Buffer(dist.group.WORLD, GiB, backend=backend)
            counts["buffers_created"] += 1
        if ref is None:
            ref = Buffer(dist.group.WORLD, GiB, backend="reference")
        want = _Sequence(ref, draw, rank, num_ranks, dev).run()
        seq = _Sequence(buf, draw, rank, num_ranks, dev)
        got = seq.run()
        if not _same(got, want):
            failures.append(f"rank {rank} {tag}: differs from the reference backend")
        for _ in range(replays):
            if load is not None:  # matrix products on a compute stream while the calls run
                stream, a = load
                stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        a = (a @ a).clamp_(-1, 1)
                load = (stream, a)
            again = seq.run()
            counts["replays"] += 1
            if not _same(again, got):
                failures.append(f"rank {rank} {tag}: a replay differs from the first run")
                break
        if dev.type == "cuda" and buf.backend_name == "cuda" and seq.worst:
            counts["graph_replays"] += _graph_replays(seq, got, replays, failures, f"rank {rank} {tag}", dev)
        counts["cases"] += 1

        # The hierarchical strategy's kernels, the next split of the ranks into domains. (An error
        # raised here ends the run: the ranks could not agree on what to do next without a hang.)
        if splits:
            _hierarchical_case(i, splits, hier, draw, rank, num_ranks, dev, replays, counts, failures, tag)

        # Low-latency mode, same tokens and routing.
        if draw["ll_format"] == "fp8-ue8m0" and draw["hidden"] % 512:
            draw["ll_format"] = "fp8-round"  # UE8M0 packs 4 scales per int32
        if ll_buf is None or i % 2 == 0:
            if ll_buf is not None:
                ll_buf.destroy()
            ll_buf = Buffer(dist.group.WORLD, 0, _ll_buffer_bytes(num_ranks), low_latency_mode=True, backend=backend)
            counts["buffers_created"] += 1
        if ll_ref is None:
            ll_ref = Buffer(dist.group.WORLD, 0, _ll_buffer_bytes(num_ranks), low_latency_mode=True,
                            backend="reference")
        ll_want = _LowLatencySequence(ll_ref, draw, seq, num_ranks, draw["ll_hook"]).run()
        ll_seq = _LowLatencySequence(ll_buf, draw, seq, num_ranks, draw["ll_hook"])
        ll_got = ll_seq.run()
        if not _same(ll_got, ll_want):
            failures.append(f"rank {rank} {tag}: low latency differs from the reference backend")
        for _ in range(replays):
            if load is not None:
                stream, a = load
                stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream):
                    a = (a @ a).clamp_(-1, 1)
                load = (stream, a)
            counts["ll_replays"] += 1
            if not _same(ll_seq.run(), ll_got):
                failures.append(f"rank {rank} {tag}: a low-latency replay differs from the first run")
                break
        if dev.type == "cuda" and ll_buf.backend_name == "cuda":
            counts["ll_graph_replays"] += _ll_graph_replays(ll_seq, ll_got, replays, failures, f"rank {rank} {tag}",
                                                            dev)
        counts["ll_cases"] += 1
    if load is not None:
        torch.cuda.current_stream(dev).wait_stream(load[0])
    for b in (buf, ref, ll_buf, ll_ref, *(b for pair in hier.values() for b in pair)):
        if b is not None:
            b.destroy()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return {**counts, "seconds": time.monotonic() - start, "failures": failures}


def _graph_replays(seq: _Sequence, want: tuple, replays: int, failures: list[str], tag: str,
                   dev: torch.device) -> int:
    """Capture the sequence once (no CPU sync with num_worst_tokens) and replay it."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        seq.run()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = seq.run()
    return _replay(graph, outputs, lambda: outputs, want, replays, failures, f"{tag}: a CUDA-graph replay", dev)


def _ll_graph_replays(seq: _LowLatencySequence, want: tuple, replays: int, failures: list[str], tag: str,
                      dev: torch.device) -> int:
    """Capture the low-latency sequence once (no hooks: a decode step) and replay it."""
    hook, seq.hook = seq.hook, False
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        raw = seq.launch()
    seq.hook = hook
    handles = tuple(t for dispatched in raw[:2] for t in (dispatched[2].src_info, dispatched[2].layout_range))
    return _replay(graph, (raw, handles), lambda: seq.valid_outputs(raw), want, replays, failures,
                   f"{tag}: a low-latency CUDA-graph replay", dev)


def _replay(graph: torch.cuda.CUDAGraph, outputs: Any, read: Any, want: tuple, replays: int, failures: list[str],
            what: str, dev: torch.device) -> int:
    """Replay ``graph`` with its ``outputs`` poisoned before each replay; ``read()`` must equal ``want``."""
    done = 0
    for _ in range(replays):
        for t in _tensors(outputs):
            poison_(t)
        graph.replay()
        torch.cuda.synchronize(dev)
        done += 1
        if not _same(read(), want):
            failures.append(f"{what} differs from the first run")
            break
    return done
