"""``epcomm plan``: print the planner's table for a topology and a workload (``--json PATH`` saves it).

Examples::

    epcomm plan                                         # 8xh200, DeepSeek-V3 shape, FP8 dispatch
    epcomm plan --preset h800-cx7 --domains 4 --groups 3
    epcomm plan --preset 8xh200 --split 2x4 --dtype bf16
    epcomm plan --domains 2 --gpus-per-domain 8 --intra-gbps 160 --inter-gbps 50 --tokens 128
    python -m epcomm.planner.cli --topology my_cluster.toml --json plan.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from .cost_model import ALL_STRATEGIES, plan
from .topology import Tier, Topology, load_topology, preset, preset_names
from .workload import DTYPES, Workload

DEFAULT_PRESET = "8xh200"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epcomm plan",
        allow_abbrev=False,  # --ranks must not silently mean --ranks-per-domain
        description="Predict bytes per tier, dispatch/combine time, SMs and buffer memory of allgather, flat "
                    "all-to-all and hierarchical forwarding, and recommend one. Bandwidths in GB/s (1e9 bytes) "
                    "per direction per GPU.",
        epilog=f"presets: {', '.join(preset_names())}. Without --preset/--topology/--intra-gbps the "
               f"topology is {DEFAULT_PRESET}.")
    topo = parser.add_argument_group("topology")
    source = topo.add_mutually_exclusive_group()
    source.add_argument("--preset", help="a shipped topology (see --list-presets)")
    source.add_argument("--topology", metavar="FILE", help="a topology file: .toml (or .yaml with PyYAML, .json)")
    topo.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    topo.add_argument("--domains", type=int, help="number of domains (nodes); overrides the preset")
    topo.add_argument("--gpus-per-domain", type=int, help="GPUs per domain; overrides the preset")
    topo.add_argument("--intra-gbps", type=float, help="intra-domain bandwidth, GB/s per direction per GPU")
    topo.add_argument("--inter-gbps", type=float, help="inter-domain bandwidth, GB/s per direction per GPU")
    topo.add_argument("--intra-latency-us", type=float, help="intra-domain one-hop latency, us")
    topo.add_argument("--inter-latency-us", type=float, help="inter-domain one-hop latency, us")
    topo.add_argument("--split", metavar="DxG", help="split a one-domain host into D virtual nodes of G GPUs, e.g. 2x4")
    topo.add_argument("--sm-gbps", type=float, help="copy bandwidth of one SM, GB/s (SM-count heuristic)")
    topo.add_argument("--max-sms", type=int, help="most SMs communication may use")
    topo.add_argument("--hbm-gbps", type=float, help="HBM bandwidth, GB/s (prices the allgather's local permute)")

    work = parser.add_argument_group("workload")
    work.add_argument("--tokens", type=int, default=4096, help="tokens per rank (default 4096)")
    work.add_argument("--hidden", type=int, default=7168, help="hidden size (default 7168)")
    work.add_argument("--topk", type=int, default=8, help="experts per token (default 8)")
    work.add_argument("--experts", type=int, default=256, help="number of experts (default 256)")
    work.add_argument("--dtype", choices=DTYPES, default="fp8", help="dispatch dtype (default fp8; combine is bf16)")
    work.add_argument("--groups", type=int, help="node-limited routing: each token uses at most this many domains")
    work.add_argument("--ranks-per-token", type=float, help="measured mean distinct ranks per token (own included)")
    work.add_argument("--domains-per-token", type=float, help="measured mean distinct domains per token")

    out = parser.add_argument_group("output")
    out.add_argument("--strategies", help=f"comma-separated subset of {','.join(ALL_STRATEGIES)} (default: all but "
                                          "per_expert, the low-latency layout)")
    out.add_argument("--mean-rank", action="store_true", help="predict the mean rank instead of the slowest rank")
    out.add_argument("--json", metavar="PATH", help="also write the full report as JSON ('-' for stdout only)")
    return parser


def _parse_split(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--split must look like DxG (e.g. 2x4), got {text!r}")
    return int(parts[0]), int(parts[1])


def topology_from_args(args: argparse.Namespace) -> Topology:
    """The topology the arguments describe: a file, a preset or explicit sizes, then overrides."""
    custom = args.intra_gbps is not None and args.preset is None and args.topology is None
    if args.topology:
        base = load_topology(args.topology)
    elif args.preset:
        base = preset(args.preset)
    elif custom:
        num_domains = args.domains if args.domains is not None else 1
        inter = Tier(args.inter_gbps, args.inter_latency_us or 0.0) if args.inter_gbps is not None else None
        if args.gpus_per_domain is None:
            raise ValueError("--gpus-per-domain is required when the topology is given by --intra-gbps")
        base = Topology(num_domains=num_domains, gpus_per_domain=args.gpus_per_domain,
                        intra=Tier(args.intra_gbps, args.intra_latency_us or 0.0), inter=inter)
    else:
        base = preset(DEFAULT_PRESET)

    changes: dict[str, object] = {}
    if args.domains is not None:
        changes["num_domains"] = args.domains
    if args.gpus_per_domain is not None:
        changes["gpus_per_domain"] = args.gpus_per_domain
    if args.intra_gbps is not None or args.intra_latency_us is not None:
        changes["intra"] = Tier(args.intra_gbps if args.intra_gbps is not None else base.intra.gbps,
                                args.intra_latency_us if args.intra_latency_us is not None
                                else base.intra.latency_us)
    if args.inter_gbps is not None or args.inter_latency_us is not None:
        if args.inter_gbps is None and base.inter is None:
            raise ValueError("--inter-latency-us needs --inter-gbps: this topology has no inter-domain tier")
        changes["inter"] = Tier(args.inter_gbps if args.inter_gbps is not None else base.inter.gbps,
                                args.inter_latency_us if args.inter_latency_us is not None
                                else base.inter.latency_us)
    if args.sm_gbps is not None:
        changes["sm_copy_gbps"] = args.sm_gbps
    if args.max_sms is not None:
        changes["max_comm_sms"] = args.max_sms
    if args.hbm_gbps is not None:
        changes["hbm_gbps"] = args.hbm_gbps
    if changes and not custom:
        changes.setdefault("name", f"{base.name} (modified)")
    topology = dataclasses.replace(base, **changes) if changes else base
    if args.split:
        num_domains, gpus = _parse_split(args.split)
        if num_domains * gpus != topology.num_ranks:
            raise ValueError(f"--split {args.split} has {num_domains * gpus} GPUs but the topology has "
                             f"{topology.num_ranks}")
        topology = topology.split(gpus)
    return topology


def workload_from_args(args: argparse.Namespace) -> Workload:
    return Workload(num_tokens=args.tokens, hidden=args.hidden, num_topk=args.topk, num_experts=args.experts,
                    dispatch_dtype=args.dtype, num_groups=args.groups, ranks_per_token=args.ranks_per_token,
                    domains_per_token=args.domains_per_token)


def main(argv: list[str] | None = None) -> int:
    """Run ``epcomm plan``; returns 0 on success, 2 on a bad argument (the message names it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exit_:  # argparse exits on --help and on usage errors; callers want a status
        return int(exit_.code or 0)
    if args.list_presets:
        for name in preset_names():
            print(f"{name:12s} {preset(name).describe()}")
        return 0
    try:
        topology = topology_from_args(args)
        workload = workload_from_args(args)
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()] if args.strategies else None
        report = plan(topology, workload, strategies=strategies, slowest_rank=not args.mean_rank)
    except (ValueError, TypeError) as error:
        print(f"epcomm plan: error: {error}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    print(report.format_table())
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        except OSError as error:
            print(f"epcomm plan: error: cannot write --json {args.json!r}: {error}", file=sys.stderr)
            return 1
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
