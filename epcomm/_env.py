"""Every environment variable epcomm reads, with its default, in one place.

The README's table lists the same names and defaults (tests/test_api.py checks them); keep the
descriptions in step by hand.
"""

from __future__ import annotations

import os

# name -> (default, meaning)
ENV_VARS: dict[str, tuple[str, str]] = {
    "EPCOMM_TIMEOUT_S": ("100", "seconds a call waits for its peers before raising RuntimeError"),
    "EPCOMM_FLIGHT_RECORDER_DIR": ("", "where a rank writes the flight record of a timeout (a JSON file its error "
                                       "names: operation, phase, the ranks not arrived, every peer's call "
                                       "counters, the last calls); unset: <temp dir>/epcomm-flight-records; off "
                                       "or 0: no file"),
    "EPCOMM_BACKEND": ("auto", "backend used when Buffer(backend=...) is not given: auto (the CUDA kernels for "
                               "each mode every rank can run them for, else the reference backend with the "
                               "planner's strategy), cuda or reference"),
    "EPCOMM_DEVICE": ("", "where a Buffer's tensors live when Buffer(device=...) is not given: cpu or cuda "
                          "(the current GPU); unset: the current GPU if the group's backend holds CUDA tensors "
                          "(NCCL; plain gloo when CUDA is available), else the CPU"),
    "EPCOMM_RANKS_PER_DOMAIN": ("", "ranks per scale-up domain (default: the ranks of a host, if every host "
                                    "holds as many; else one domain)"),
    "EPCOMM_LINKS": ("h800-cx7", "the links the planner prices when a portable-path Buffer picks its normal-mode "
                                 "strategy (backend='auto', no strategy=): a planner preset name or a topology file "
                                 "(.toml or .json, as `epcomm plan --topology` reads); its tiers' rates and "
                                 "latencies are used, the domains are the group's"),
    "EPCOMM_CACHE_DIR": ("~/.cache/epcomm", "where compiled CUDA kernels are cached"),
    "EPCOMM_DISPATCH_OVERLAP": ("1", "CUDA backend: start a dispatch's sends before the host reads the receive "
                                     "counts (0: one fused kernel after the read)"),
    "EPCOMM_DISPATCH_SEND_SMS_PCT": ("auto", "CUDA backend: percent of a dispatch's SMs that send (the rest "
                                             "receive), or auto: split by the bytes each role moves at the "
                                             "rank count (README)"),
    "EPCOMM_COMBINE_SEND_SMS_PCT": ("auto", "CUDA backend: percent of a combine's SMs that send (the rest "
                                            "reduce), or auto: split by the bytes each role moves at the rank "
                                            "count (README)"),
    "EPCOMM_LL_TRANSPORT": ("auto", "CUDA low-latency mode: ipc (CUDA IPC, one host), nvshmem (NVSHMEM symmetric "
                                    "heap; NVLink peers still get direct stores) or auto (ipc on one host, else "
                                    "nvshmem)"),
    "EPCOMM_HIER_TRANSPORT": ("auto", "CUDA hierarchical mode, between domains: auto (NVSHMEM puts; direct stores "
                                      "to a mate NVSHMEM maps over NVLink) or put (NVSHMEM puts to every mate: the "
                                      "path to other hosts, tested on one)"),
    "EPCOMM_LL_COMBINE_PARTIALS": ("auto", "CUDA low-latency mode, IPC transport, combine without a receive hook: "
                                           "1 = the expert side sums each token's rows of its own experts and "
                                           "returns one row per (token, rank), not one per (token, expert) (bf16 "
                                           "partials: within bf16 rounding of the reference); 0 = a row per "
                                           "(token, expert), the reference's sum bitwise; auto = 1 for "
                                           "num_max_dispatch_tokens_per_rank >= 64, else 0. Read when a Buffer is "
                                           "built; every rank must agree"),
    "EPCOMM_LL_BLOCK_RECEIVE": ("auto", "CUDA low-latency mode, dispatch without a receive hook: 1 = each block "
                                        "waits for the counts of all of its (expert, source) units and its warps "
                                        "share their rows' copies; 0 = a group of warps per unit copies that "
                                        "unit's rows; auto = 1 for a call of at least 2 (token, expert) pairs "
                                        "per expert (tokens * top-k >= 2 * experts), else 0. Read when a Buffer "
                                        "is built"),
    "EPCOMM_LL_ARRIVAL": ("1", "CUDA low-latency mode, IPC transport, FP8 dispatch (fp32 scales) without a "
                               "receive hook or failed-rank masking: 1 = the receivers copy each piece of a message "
                               "as it lands (told by its bits: the area holds a poison no payload word can be) "
                               "and the counts leave before the data; 0 = the counts follow the data (a fence) "
                               "and the receivers copy once they arrive. Read when a Buffer is built; every rank "
                               "must agree"),
    "EPCOMM_LL_DISPATCH_SENDERS": ("auto", "CUDA low-latency mode, a dispatch by arrival: how many blocks (one "
                                           "per SM) store the messages while the others only receive; with more "
                                           "tokens than that, each sender takes every n-th token. auto: 2/3 of "
                                           "the SMs up to that many tokens, else a third of them. Read when a "
                                           "Buffer is built"),
    "EPCOMM_LL_REMOTE_RANKS": ("", "CUDA low-latency mode: ranks (comma-separated, or all) that every rank reaches "
                                   "through NVSHMEM puts even where NVLink could map them, to test the "
                                   "inter-node path on one host; implies the nvshmem transport"),
}


def env_str(name: str) -> str:
    default, _ = ENV_VARS[name]
    return os.environ.get(name, default)


def send_sms_pct(name: str) -> float | None:
    """The percentage set, or None for auto."""
    raw = env_str(name)
    if raw == "auto":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a percentage or auto, got {raw!r}") from None
    if not 0 < value < 100:
        raise ValueError(f"{name} must lie in (0, 100), got {value}")
    return value


def _switch(name: str) -> bool:
    """A 0/1 variable (anything else is an error, not the default)."""
    value = env_str(name)
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def timeout_s() -> float:
    raw = env_str("EPCOMM_TIMEOUT_S")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"EPCOMM_TIMEOUT_S must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"EPCOMM_TIMEOUT_S must be > 0, got {value}")
    return value


def ll_block_receive() -> str:
    value = env_str("EPCOMM_LL_BLOCK_RECEIVE")
    if value not in ("auto", "0", "1"):
        raise ValueError(f"EPCOMM_LL_BLOCK_RECEIVE must be auto, 0 or 1, got {value!r}")
    return value


def ll_arrival() -> bool:
    value = env_str("EPCOMM_LL_ARRIVAL")
    if value not in ("1", "0"):
        raise ValueError(f"EPCOMM_LL_ARRIVAL must be 0 or 1, got {value!r}")
    return value == "1"


def ll_dispatch_senders() -> int:
    """EPCOMM_LL_DISPATCH_SENDERS as a block count, 0 for auto."""
    raw = env_str("EPCOMM_LL_DISPATCH_SENDERS").strip()
    if raw == "auto":
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"EPCOMM_LL_DISPATCH_SENDERS must be auto or a number of blocks, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"EPCOMM_LL_DISPATCH_SENDERS must be >= 1, got {value}")
    return value


def ll_combine_partials() -> str:
    value = env_str("EPCOMM_LL_COMBINE_PARTIALS")
    if value not in ("auto", "0", "1"):
        raise ValueError(f"EPCOMM_LL_COMBINE_PARTIALS must be auto, 0 or 1, got {value!r}")
    return value


def device_choice() -> str:
    value = env_str("EPCOMM_DEVICE")
    if value not in ("", "cpu", "cuda"):
        raise ValueError(f"EPCOMM_DEVICE must be cpu or cuda, got {value!r}")
    return value


def ll_transport() -> str:
    value = env_str("EPCOMM_LL_TRANSPORT")
    if value not in ("auto", "ipc", "nvshmem"):
        raise ValueError(f"EPCOMM_LL_TRANSPORT must be auto, ipc or nvshmem, got {value!r}")
    return value


def hier_transport() -> str:
    value = env_str("EPCOMM_HIER_TRANSPORT")
    if value not in ("auto", "put"):
        raise ValueError(f"EPCOMM_HIER_TRANSPORT must be auto or put, got {value!r}")
    return value


def ll_remote_ranks(num_ranks: int) -> set[int]:
    raw = env_str("EPCOMM_LL_REMOTE_RANKS").strip()
    if not raw:
        return set()
    if raw == "all":
        return set(range(num_ranks))
    try:
        ranks = {int(part) for part in raw.split(",") if part.strip()}
    except ValueError:
        raise ValueError(f"EPCOMM_LL_REMOTE_RANKS must be 'all' or comma-separated ranks, got {raw!r}") from None
    bad = sorted(r for r in ranks if not 0 <= r < num_ranks)
    if bad:
        raise ValueError(f"EPCOMM_LL_REMOTE_RANKS: rank(s) {bad} are not in a group of {num_ranks}")
    return ranks
