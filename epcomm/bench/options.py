"""Command-line options of ``python -m epcomm.bench``.

Defaults depend on the machine: with CUDA GPUs they are the settings of the benchmark's method
(docs/PERFORMANCE.md: all GPUs, DeepSeek-V3 shapes, 20 warm-ups and 50 timed calls); without, 4
gloo processes on a problem small enough to finish in well under a minute on two cores, so the
same command is a quick smoke test.
Every error names the option at fault.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import torch

from ..config import MAX_TOPK
from . import plot
from .metrics import DTYPES
from .workloads import LOW_LATENCY, MODES, NORMAL, STRATEGIES

BACKENDS = ("auto", "reference", "cuda")

# option -> (GPU default, CPU default)
DEFAULTS = {
    "tokens": ([4096], [256]),
    "hidden": ([7168], [2048]),
    "topk": (8, 8),
    "experts": (256, 64),
    "ll_tokens": ([128], [64]),
    "ll_experts": (288, 64),
    "num_sms": ([24], [24]),
    "warmup": (20, 3),
    "iters": (50, 10),
}
CPU_RANKS = 4


@dataclass
class Options:
    num_ranks: int
    pg_backend: str  # "nccl" or "gloo"
    tokens: list[int]
    hidden: list[int]
    topk: int
    experts: int
    ll_tokens: list[int]
    ll_experts: int
    num_sms: list[int]
    dtypes: list[str]
    modes: list[str]
    warmup: int
    iters: int
    backend: str
    seed: int
    json: str | None
    plot: str | None
    commit: str | None
    strategies: list[str] = dataclasses.field(default_factory=lambda: ["alltoall"])
    diagnose: bool = False
    straggler: int | None = None
    straggler_delay_us: float = 0.0
    ranks_per_domain: int = 0
    groups: int | None = None
    pressure: int = 0  # > 0: run the pressure test (that many random cases) instead of the timed cases
    pressure_replays: int = 20


def parse_int_list(text: str) -> list[int]:
    """"128,256" or a doubling range "128..16384" (128, 256, ..., 16384), or a mix of both."""
    values: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if ".." in item:
            lo_text, hi_text = item.split("..", 1)
            lo, hi = int(lo_text), int(hi_text)
            if lo <= 0 or hi < lo:
                raise argparse.ArgumentTypeError(f"range {item!r} needs 0 < start <= end")
            v = lo
            while v <= hi:
                values.append(v)
                v *= 2
        elif item:
            values.append(int(item))
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}")
    return values


def _int_list(text: str) -> list[int]:
    try:
        return parse_int_list(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like '128,256' or '128..4096', got {text!r}") \
            from None


def _choice_list(choices: tuple[str, ...], aliases: dict[str, str] | None = None):
    def parse(text: str) -> list[str]:
        out = []
        for item in text.split(","):
            item = (aliases or {}).get(item.strip(), item.strip())
            if item not in choices:
                raise argparse.ArgumentTypeError(f"{item!r} is not one of {', '.join(choices)}")
            if item not in out:
                out.append(item)
        return out
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m epcomm.bench",
        allow_abbrev=False,  # --ranks must not silently mean --ranks-per-domain
        description="Benchmark epcomm dispatch/combine (normal and low-latency) on the local GPUs (NCCL) or, "
                    "without GPUs, on CPU processes (gloo); every result is checked against a "
                    "single-process reference and printed beside a plain all_to_all_single of the same "
                    "routing (in normal mode also beside Megatron-LM's layout + permute + all-to-all "
                    "sequence, and at one rank beside a device copy of x), with each implementation's peak "
                    "memory. Times are the slowest rank's median.",
        epilog="Lists take commas or doubling ranges: --tokens 128..16384. Defaults in brackets are "
               "GPU / CPU.")
    def d(name: str) -> str:
        gpu, cpu = (",".join(map(str, v)) if isinstance(v, list) else str(v) for v in DEFAULTS[name])
        return f"[{gpu} / {cpu}]"

    p.add_argument("--num-ranks", type=int, help=f"ranks to spawn [all GPUs / {CPU_RANKS}]")
    p.add_argument("--tokens", type=_int_list, help=f"tokens per rank, normal mode (sweep) {d('tokens')}")
    p.add_argument("--hidden", type=_int_list, help=f"hidden size (sweep) {d('hidden')}")
    p.add_argument("--topk", type=int, help=f"experts per token {d('topk')}")
    p.add_argument("--experts", type=int, help=f"experts, normal mode {d('experts')}")
    p.add_argument("--ll-tokens", type=_int_list,
                   help="tokens per rank = num_max_dispatch_tokens_per_rank, low-latency (sweep) "
                        f"{d('ll_tokens')}")
    p.add_argument("--ll-experts", type=int, help=f"experts, low-latency mode {d('ll_experts')}")
    p.add_argument("--num-sms", type=_int_list,
                   help=f"SM counts (even) passed via Buffer.set_num_sms and Config (sweep) {d('num_sms')}")
    p.add_argument("--dtype", type=_choice_list(DTYPES), default=list(DTYPES),
                   help="normal-mode dispatch dtypes [bf16,fp8]; low-latency dispatch is always FP8")
    p.add_argument("--modes", type=_choice_list(MODES, {"low-latency": LOW_LATENCY, "ll": LOW_LATENCY}),
                   default=list(MODES), help="modes to run [normal,low_latency]")
    p.add_argument("--warmup", type=int, help=f"untimed calls before timing {d('warmup')}")
    p.add_argument("--iters", type=int, help=f"timed calls; the median is reported {d('iters')}")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="epcomm Buffer backend [auto]")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and the routing [0]")
    p.add_argument("--json", metavar="PATH", help="write the records (JSON, keys in docs/PERFORMANCE.md) to PATH")
    p.add_argument("--commit", metavar="SHA",
                   help="commit id to record [git rev-parse HEAD (+modified when tracked files differ), or "
                        "'unknown' outside a checkout]; for runs made from a copy of the tree without .git")
    p.add_argument("--plot", metavar="PATH",
                   help="write a PNG of bandwidth against tokens, and one of the latency histogram per rank "
                        "next to it (PATH with '-latency' before the suffix); needs matplotlib")
    p.add_argument("--strategies", type=_choice_list(STRATEGIES), default=["alltoall"],
                   help="normal-mode Buffer(strategy=...) to measure, with the NCCL collective that moves the "
                        "same data as baseline (allgather: all_gather_into_tensor + reduce_scatter_tensor) "
                        "[alltoall]")
    p.add_argument("--ranks-per-domain", type=int, default=0, metavar="K",
                   help="split the ranks into scale-up domains of K consecutive ranks (virtual nodes; "
                        "EPCOMM_RANKS_PER_DOMAIN of the ranks) [one domain per host]")
    p.add_argument("--groups", type=int, metavar="G",
                   help="node-limited routing: each token picks its experts in at most G domains (DeepSeek-V3's "
                        "group-limited gating) [no limit]")
    p.add_argument("--diagnose", action="store_true",
                   help="also report per-rank latency distributions (p50/p99/max, jitter), per-source waits "
                        "from the low-latency wait-cost statistics (naming straggler ranks), and measured vs "
                        "the planner's predicted times (GPU: calibrated by a short probe of the links)")
    p.add_argument("--pressure", type=int, metavar="N", default=0,
                   help="instead of timing: N random shapes and routings, each checked against the reference "
                        "backend and replayed (bitwise identical), back-to-back calls, Buffers reused and "
                        "recreated, a compute stream beside (GPU) and CUDA-graph replays (CUDA backend)")
    p.add_argument("--pressure-replays", type=int, metavar="R", default=20,
                   help="replays of each pressure case [20]")
    p.add_argument("--straggler", type=int, metavar="RANK",
                   help="inject a straggler: RANK sleeps before every call (to demonstrate --diagnose)")
    p.add_argument("--straggler-delay-us", type=float, metavar="US",
                   help="how long the --straggler rank sleeps before each call [1000]")
    return p


def parse_args(argv: list[str] | None) -> Options:
    """Parse and validate; on a bad value, print usage and the option at fault and exit with status 2."""
    parser = build_parser()
    a = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    pick = 0 if gpu else 1
    for name, defaults in DEFAULTS.items():
        if getattr(a, name) is None:
            setattr(a, name, defaults[pick])
    num_gpus = torch.cuda.device_count() if gpu else 0
    if a.num_ranks is None:
        a.num_ranks = num_gpus if gpu else CPU_RANKS

    def fail(message: str) -> None:
        parser.error(message)  # exits with status 2

    if a.num_ranks < 1:
        fail(f"--num-ranks must be >= 1, got {a.num_ranks}")
    if a.backend == "cuda" and not gpu:
        fail("--backend cuda needs CUDA GPUs; none is visible (use --backend reference or auto)")
    for name in ("tokens", "ll_tokens", "hidden"):
        bad = [v for v in getattr(a, name) if v < 1]
        if bad:
            fail(f"--{name.replace('_', '-')} values must be >= 1, got {bad}")
    if not 1 <= a.topk <= MAX_TOPK:
        fail(f"--topk must be in [1, {MAX_TOPK}], got {a.topk}")
    needs_128 = "fp8" in a.dtype or LOW_LATENCY in a.modes
    for h in a.hidden:
        if needs_128 and h % 128:
            fail(f"--hidden {h} must be a multiple of 128 for FP8 dispatch (one scale per 128 channels)")
        if h % 8:
            fail(f"--hidden {h} must be a multiple of 8 (rows of a multiple of 16 bytes in BF16)")
    for mode, option, experts in ((NORMAL, "--experts", a.experts),
                                  (LOW_LATENCY, "--ll-experts", a.ll_experts)):
        if mode not in a.modes or a.pressure:  # the pressure test draws its own shapes
            continue
        if experts < 1 or experts % a.num_ranks:
            fail(f"{option} ({experts}) must be a positive multiple of --num-ranks ({a.num_ranks})")
        if a.topk > experts:
            fail(f"--topk ({a.topk}) must be <= {option} ({experts})")
    bad_sms = [s for s in a.num_sms if s < 2 or s % 2]
    if bad_sms:
        fail(f"--num-sms values must be even and >= 2 (two SMs per channel), got {bad_sms}")
    if a.warmup < 0:
        fail(f"--warmup must be >= 0, got {a.warmup}")
    if a.iters < 1:
        fail(f"--iters must be >= 1, got {a.iters}")
    if a.plot and not plot.matplotlib_available():
        fail(plot.MISSING_MATPLOTLIB)
    if "allgather" in a.strategies and a.backend == "cuda":
        fail(f"--strategies {','.join(a.strategies)}: allgather runs on the reference backend only; use "
             "--backend reference or auto")
    if a.ranks_per_domain and (a.ranks_per_domain < 0 or a.num_ranks % a.ranks_per_domain):
        fail(f"--ranks-per-domain {a.ranks_per_domain} must divide the rank count {a.num_ranks}")
    if a.groups is not None and a.groups < 1:
        fail(f"--groups must be >= 1, got {a.groups}")
    if a.pressure < 0 or a.pressure_replays < 1:
        fail(f"--pressure must be >= 0 and --pressure-replays >= 1, got {a.pressure} and {a.pressure_replays}")
    if a.straggler_delay_us is not None and a.straggler is None:
        fail("--straggler-delay-us needs --straggler RANK")
    if a.straggler is not None:
        if not 0 <= a.straggler < a.num_ranks:
            fail(f"--straggler must be a rank in [0, {a.num_ranks}), got {a.straggler}")
        if a.straggler_delay_us is None:
            a.straggler_delay_us = 1000.0
        if not a.straggler_delay_us > 0:
            fail(f"--straggler-delay-us must be > 0, got {a.straggler_delay_us}")
    # The machine's limit last: a mistake in the options is named first wherever it is run.
    if gpu and a.num_ranks > num_gpus:
        fail(f"--num-ranks {a.num_ranks} exceeds the {num_gpus} visible GPU(s) (one rank per GPU)")
    return Options(num_ranks=a.num_ranks, pg_backend="nccl" if gpu else "gloo", tokens=a.tokens,
                   hidden=a.hidden, topk=a.topk, experts=a.experts, ll_tokens=a.ll_tokens, ll_experts=a.ll_experts,
                   num_sms=a.num_sms, dtypes=a.dtype, modes=a.modes, warmup=a.warmup, iters=a.iters,
                   backend=a.backend, seed=a.seed, json=a.json, plot=a.plot, commit=a.commit,
                   strategies=a.strategies, diagnose=a.diagnose, straggler=a.straggler,
                   straggler_delay_us=a.straggler_delay_us or 0.0, pressure=a.pressure,
                   pressure_replays=a.pressure_replays, ranks_per_domain=a.ranks_per_domain, groups=a.groups)
