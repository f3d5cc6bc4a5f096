"""Two-tier topologies: domains (scale-up groups such as NVLink nodes or virtual nodes) of GPUs.

Units: bandwidth in GB/s with GB = 1e9 bytes (as DeepEP's tests and the benchmark compute it), per
direction per GPU; latency in microseconds. ``intra`` is the tier inside a domain, ``inter`` the
tier between domains (absent when there is one domain).

``shared_links`` says whether the two tiers draw on the same physical ports. It is true for
*virtual* nodes carved out of one NVSwitch host: traffic "between domains" then still travels over
the GPU's NVLinks, so the two tiers' times add up instead of overlapping.

Topology files are TOML (YAML too when PyYAML is installed), for example::

    name = "h800-cx7"
    num_domains = 2
    gpus_per_domain = 8
    [intra]            # NVLink
    gbps = 160
    latency_us = 3
    [inter]            # one CX7 400 Gb/s NIC per GPU
    gbps = 50
    latency_us = 5

The presets are such files under ``epcomm/planner/presets/``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PRESET_DIR = Path(__file__).resolve().parent / "presets"


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class Tier:
    """One tier of links: bandwidth per direction per GPU (GB/s, 1e9 bytes) and one-hop latency (us)."""

    gbps: float
    latency_us: float = 0.0

    def __post_init__(self) -> None:
        _positive("gbps", self.gbps)
        _non_negative("latency_us", self.latency_us)

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9


def link_gbps_from_logical(logical_gbps: float, num_ranks: int) -> float:
    """Per-link bandwidth that makes a one-domain all-to-all reach ``logical_gbps`` with the
    benchmark's metric (received bytes *including the local 1/R share* / time): ``x (R-1)/R``."""
    _positive("logical_gbps", logical_gbps)
    _positive_int("num_ranks", num_ranks)
    return logical_gbps * (num_ranks - 1) / num_ranks if num_ranks > 1 else logical_gbps


@dataclass(frozen=True)
class Topology:
    """Domains x GPUs per domain, with an intra- and an inter-domain tier.

    ``sm_copy_gbps`` (bandwidth one SM sustains on copies, ~20 GB/s on H200 NVLink: DeepEP moves
    ~152 GB/s with 8 SMs there) and ``max_comm_sms`` feed the SM-count heuristic; ``hbm_gbps``
    (memory bandwidth) prices the local permute of the allgather strategy, which is skipped when
    it is None.
    """

    num_domains: int
    gpus_per_domain: int
    intra: Tier
    inter: Tier | None = None
    name: str = "custom"
    shared_links: bool = False
    sm_copy_gbps: float = 20.0
    max_comm_sms: int = 32
    hbm_gbps: float | None = None
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        _positive_int("num_domains", self.num_domains)
        _positive_int("gpus_per_domain", self.gpus_per_domain)
        if not isinstance(self.intra, Tier):
            raise TypeError(f"intra must be a Tier, got {self.intra!r}")
        if self.num_domains > 1 and not isinstance(self.inter, Tier):
            raise ValueError(f"inter (the inter-domain tier) is required when num_domains={self.num_domains} > 1, "
                             f"got {self.inter!r}")
        if self.inter is not None and not isinstance(self.inter, Tier):
            raise TypeError(f"inter must be a Tier or None, got {self.inter!r}")
        _positive("sm_copy_gbps", self.sm_copy_gbps)
        _positive_int("max_comm_sms", self.max_comm_sms)
        if self.hbm_gbps is not None:
            _positive("hbm_gbps", self.hbm_gbps)

    @property
    def num_ranks(self) -> int:
        return self.num_domains * self.gpus_per_domain

    def split(self, gpus_per_domain: int, inter: Tier | None = None, shared_links: bool | None = None) -> Topology:
        """Split a one-domain host into virtual nodes of ``gpus_per_domain`` GPUs (8 GPUs as 2x4).

        By default the inter-virtual-node tier is the host's own fabric (``inter = intra``,
        ``shared_links=True``): right for an NVSwitch host, where the split only changes the
        algorithm, not the links. Pass ``inter`` (and ``shared_links=False``) for hosts whose
        groups really are joined by other, slower links (seed 004's die-to-die vs cross-group).
        """
        if self.num_domains != 1:
            raise ValueError(f"split() needs a one-domain topology (two tiers only), "
                             f"got num_domains={self.num_domains}")
        _positive_int("gpus_per_domain", gpus_per_domain)
        if self.gpus_per_domain % gpus_per_domain:
            raise ValueError(f"gpus_per_domain must divide the host's {self.gpus_per_domain} GPUs, "
                             f"got {gpus_per_domain}")
        num_domains = self.gpus_per_domain // gpus_per_domain
        return dataclasses.replace(
            self, name=f"{self.name}-{num_domains}x{gpus_per_domain}", num_domains=num_domains,
            gpus_per_domain=gpus_per_domain, inter=inter if inter is not None else self.intra,
            shared_links=(inter is None) if shared_links is None else shared_links,
            description=f"{self.name} split into {num_domains} virtual nodes of {gpus_per_domain}")

    def describe(self) -> str:
        text = (f"{self.name}: {self.num_domains} domain{'s' if self.num_domains > 1 else ''} x "
                f"{self.gpus_per_domain} GPUs; intra {self.intra.gbps:g} GB/s, {self.intra.latency_us:g} us")
        if self.num_domains > 1 and self.inter is not None:
            text += f"; inter {self.inter.gbps:g} GB/s, {self.inter.latency_us:g} us"
            if self.shared_links:
                text += " (same links as intra: virtual nodes)"
        return text

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["num_ranks"] = self.num_ranks
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Topology:
        """Build from a mapping with the field names of this class (``intra``/``inter`` as tables
        with ``gbps`` and ``latency_us``); unknown keys are an error so typos do not pass silently."""
        if not isinstance(data, dict):
            raise TypeError(f"a topology must be a table/mapping, got {type(data).__name__}")
        data = dict(data)
        data.pop("num_ranks", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown topology key(s) {unknown}; expected some of {sorted(known)}")
        for tier in ("intra", "inter"):
            value = data.get(tier)
            if isinstance(value, dict):
                extra = sorted(set(value) - {"gbps", "latency_us"})
                if extra:
                    raise ValueError(f"unknown key(s) {extra} in [{tier}]; expected gbps, latency_us")
                if "gbps" not in value:
                    raise ValueError(f"[{tier}] needs gbps (GB/s per direction per GPU)")
                data[tier] = Tier(**value)
        for key in ("num_domains", "gpus_per_domain", "intra"):
            if key not in data:
                raise ValueError(f"topology needs {key!r}")
        return cls(**data)


def _parse_text(text: str, suffix: str, origin: str) -> dict[str, Any]:
    if suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as error:
            raise ValueError(f"{origin}: YAML topologies need PyYAML (pip install pyyaml), or use TOML") from error
        return yaml.safe_load(text)
    if suffix == ".json":
        return json.loads(text)
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError as error:
            raise ValueError(f"{origin}: reading TOML needs Python >= 3.11 or the tomli package") from error
    return tomllib.loads(text)


def load_topology(path: str | Path) -> Topology:
    """Read a topology from a .toml (or .yaml/.yml with PyYAML, or .json) file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"cannot read topology file {str(path)!r}: {error}") from error
    try:
        return Topology.from_dict(_parse_text(text, path.suffix.lower(), str(path)))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from error


def preset_names() -> list[str]:
    """Names of the shipped presets (the TOML files under ``epcomm/planner/presets/``)."""
    return sorted(entry.stem for entry in PRESET_DIR.glob("*.toml"))


def preset(name: str) -> Topology:
    """A shipped preset by name, e.g. ``preset("8xh200")``; see :func:`preset_names`."""
    names = preset_names()
    if name not in names:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(names)}")
    text = (PRESET_DIR / f"{name}.toml").read_text()
    return Topology.from_dict(_parse_text(text, ".toml", f"preset {name}"))
