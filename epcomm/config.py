"""Launch configuration of the normal-mode kernels and the buffer sizes they need."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Upper bounds that size the per-token metadata slots of the communication buffer.
MAX_TOPK = 16
SCALE_GROUP = 128  # channels sharing one FP8 scale


@dataclass(frozen=True)
class Config:
    """Tuning knobs of normal-mode dispatch and combine (DeepEP's ``Config``).

    ``num_sms`` SMs are used, split into ``num_sms // 2`` channels. The chunk sizes describe the
    receive queue of each (channel, peer) pair: how many token slots it holds and how many a sender
    moves at a time. A backend may ignore knobs that do not apply to its design, but accepts them.
    """

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self) -> None:
        for name in ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                     "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Config.{name} must be a positive int, got {value!r}")
        if self.num_sms % 2:
            raise ValueError(f"Config.num_sms must be even (two SMs per channel), got {self.num_sms}")
        if self.num_max_nvl_chunked_send_tokens > self.num_max_nvl_chunked_recv_tokens:
            raise ValueError("Config.num_max_nvl_chunked_send_tokens must be <= "
                             "num_max_nvl_chunked_recv_tokens")
        if self.num_max_rdma_chunked_send_tokens > self.num_max_rdma_chunked_recv_tokens:
            raise ValueError("Config.num_max_rdma_chunked_send_tokens must be <= "
                             "num_max_rdma_chunked_recv_tokens")

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    @staticmethod
    def token_slot_bytes(hidden_bytes: int) -> int:
        """Bytes of one queued token: data, FP8 scales, top-k ids (int64) and weights (f32), source index."""
        num_scales = math.ceil(hidden_bytes / SCALE_GROUP)
        raw = hidden_bytes + num_scales * 4 + MAX_TOPK * (8 + 4) + 4
        return (raw + 15) // 16 * 16

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the NVLink (intra-domain) buffer each rank must reserve.

        ``hidden_bytes`` is ``H * max(element_size, 2)``, as DeepEP's callers compute it.
        """
        _check_hint_args(hidden_bytes, num_ranks)
        queues = self.num_channels * num_ranks * self.num_max_nvl_chunked_recv_tokens
        # Queue heads/tails per (channel, peer) and the rank-by-rank count matrices.
        metadata = self.num_channels * num_ranks * 4 * 4 + num_ranks * num_ranks * 4 * 2 + 1024
        total = queues * self.token_slot_bytes(hidden_bytes) + metadata
        return (total + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, ranks_per_domain: int = 8) -> int:
        """Bytes of the inter-domain (NVSHMEM) buffer; 0 when all ranks fit in one domain."""
        _check_hint_args(hidden_bytes, num_ranks)
        if num_ranks <= ranks_per_domain:
            return 0
        num_domains = math.ceil(num_ranks / ranks_per_domain)
        queues = self.num_channels * num_domains * self.num_max_rdma_chunked_recv_tokens * 2  # send + recv
        metadata = self.num_channels * num_domains * 4 * 8 + 1024
        total = queues * self.token_slot_bytes(hidden_bytes) + metadata
        return (total + 127) // 128 * 128


def _check_hint_args(hidden_bytes: int, num_ranks: int) -> None:
    if not isinstance(hidden_bytes, int) or hidden_bytes <= 0:
        raise ValueError(f"hidden_bytes must be a positive int, got {hidden_bytes!r}")
    if not isinstance(num_ranks, int) or num_ranks <= 0:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")


def low_latency_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                          num_experts: int) -> int:
    """Bytes of the low-latency buffer: two slots (double buffering), each a send and a receive area.

    One message carries a token's data (the larger of BF16 and FP8 + scales) and 16 bytes of
    metadata; each rank may receive up to N tokens for each of its experts from each rank.
    """
    n, h = num_max_dispatch_tokens_per_rank, hidden
    for name, value in (("num_max_dispatch_tokens_per_rank", n), ("hidden", h), ("num_ranks", num_ranks),
                        ("num_experts", num_experts)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    msg_bytes = 16 + max(h * 2, h + math.ceil(h / SCALE_GROUP) * 4)
    send_bytes = num_experts * n * msg_bytes  # the combine send area is the largest user
    recv_bytes = num_experts * n * msg_bytes
    signal_bytes = num_experts * 4 * 2
    per_slot = (send_bytes + recv_bytes + signal_bytes + 127) // 128 * 128
    return 2 * per_slot


# Configs used when the caller passes none, by rank count (tuned on H200 NVLink; see docs/TUNING.md).
_DISPATCH_CONFIGS = {r: Config(20, 6, 256, 6, 128) for r in (2, 4, 8)}
_COMBINE_CONFIGS = {r: Config(20, 6, 256, 6, 128) for r in (2, 4, 8)}


def default_dispatch_config(num_ranks: int, num_sms: int) -> Config:
    base = _DISPATCH_CONFIGS.get(num_ranks, Config())
    return Config(num_sms, base.num_max_nvl_chunked_send_tokens, base.num_max_nvl_chunked_recv_tokens,
                  base.num_max_rdma_chunked_send_tokens, base.num_max_rdma_chunked_recv_tokens)


def default_combine_config(num_ranks: int, num_sms: int) -> Config:
    base = _COMBINE_CONFIGS.get(num_ranks, Config())
    return Config(num_sms, base.num_max_nvl_chunked_send_tokens, base.num_max_nvl_chunked_recv_tokens,
                  base.num_max_rdma_chunked_send_tokens, base.num_max_rdma_chunked_recv_tokens)
