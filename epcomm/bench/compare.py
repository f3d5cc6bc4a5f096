"""Compare two benchmark result files (a run's --json output, bench/baselines/*.json): the same
configurations' times side by side, and the ones that got slower by more than a threshold. Two combine
regressions went unseen for a day (one a refactor that changed which loads nvcc kept in flight, one
a helper that read a row 4 bytes at a time), each found only by rerunning old commits: this makes
the check one command.

    python -m epcomm.bench.compare OLD.json NEW.json [--threshold-pct 5]

Exit status 1 when a time of a configuration present in both got slower by more than the threshold
and by more than ``--min-us`` (a configuration is the record's shape: mode, impl, ranks, domains,
tokens, hidden, top-k, experts, SMs, dtype, strategy), or a time the old record has is missing from
the new one. Times compared: every ``*_us`` key of the records (dispatch, cached dispatch, combine,
the low-latency graph and kernel times). Records whose outputs did not match the reference
(``checked`` false) are left out. Exit status 2: nothing to compare (other device kinds, or no
configuration in both files)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

CONFIG_KEYS = ("mode", "impl", "strategy", "num_ranks", "num_domains", "num_tokens", "hidden", "num_topk",
               "num_experts", "num_sms", "dispatch_dtype")


@dataclass(frozen=True)
class Delta:
    config: tuple
    time: str
    old_us: float
    new_us: float

    @property
    def pct(self) -> float:
        return (self.new_us / self.old_us - 1.0) * 100.0


def config_of(record: dict) -> tuple:
    return tuple(record.get(k) for k in CONFIG_KEYS)


def _times(record: dict) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if k.endswith("_us") and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}


def compare(old: list[dict], new: list[dict]) -> tuple[list[Delta], list[tuple], list[tuple], list[tuple]]:
    """The time deltas of the configurations in both lists (the first checked record of a
    configuration counts), the times an old record has and its new one lacks (configuration, key),
    and the configurations found only in the old and only in the new list."""
    def by_config(records: list[dict]) -> dict[tuple, dict]:
        out: dict[tuple, dict] = {}
        for r in records:
            if r.get("checked", True) is not False:
                out.setdefault(config_of(r), r)
        return out

    old_by, new_by = by_config(old), by_config(new)
    deltas, missing = [], []
    for cfg, r_new in new_by.items():
        r_old = old_by.get(cfg)
        if r_old is None:
            continue
        t_old, t_new = _times(r_old), _times(r_new)
        deltas += [Delta(cfg, k, t_old[k], t_new[k]) for k in sorted(t_old.keys() & t_new.keys())]
        missing += [(cfg, k) for k in sorted(t_old.keys() - t_new.keys())]
    return deltas, missing, [c for c in old_by if c not in new_by], [c for c in new_by if c not in old_by]


def _devices(records: list[dict]) -> set:
    return {r.get("device") for r in records}


def _label(cfg: tuple) -> str:
    d = dict(zip(CONFIG_KEYS, cfg))
    parts = [str(d["mode"]), str(d["impl"])]
    if d.get("strategy") not in (None, "alltoall"):
        parts.append(str(d["strategy"]))
    parts += [f"R{d['num_ranks']}", f"T{d['num_tokens']}", f"H{d['hidden']}", f"{d['num_topk']}/{d['num_experts']}",
              f"{d['num_sms']}SM" if d["num_sms"] is not None else "-", str(d["dispatch_dtype"])]
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m epcomm.bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--threshold-pct", type=float, default=5.0, help="slowdown that fails the comparison [5]")
    p.add_argument("--times", metavar="KEY[,KEY...]",
                   help="compare only these times (e.g. cached_dispatch_us,combine_us: a fresh dispatch that reads its "
                        "counts on the host varies by tens of us between runs) [all]")
    p.add_argument("--min-us", type=float, default=1.0,
                   help="a slowdown must also exceed this many microseconds (timer noise of short calls) [1]")
    args = p.parse_args(argv)
    old, new = (json.load(open(path)) for path in (args.old, args.new))
    d_old, d_new = _devices(old), _devices(new)
    if d_old != d_new:
        print(f"compare: the files come from different devices ({sorted(map(str, d_old))} against "
              f"{sorted(map(str, d_new))}): their times do not compare")
        return 2
    deltas, missing, only_old, only_new = compare(old, new)
    if args.times:
        keep = set(args.times.split(","))
        deltas = [d for d in deltas if d.time in keep]
        missing = [m for m in missing if m[1] in keep]
    if not deltas:
        print(f"compare: no configuration of {args.old} is in {args.new} (other shapes, SMs or dtypes): nothing "
              "compared")
        return 2
    worse = [d for d in deltas if d.pct > args.threshold_pct and d.new_us - d.old_us > args.min_us]
    print(f"compare: {args.old} -> {args.new} ({', '.join(map(str, d_new))}); {len(deltas)} times of "
          f"{len({d.config for d in deltas})} configurations in both")
    for d in deltas:
        mark = "  SLOWER" if d in worse else ("  faster" if d.pct < -args.threshold_pct else "")
        print(f"  {_label(d.config):60s} {d.time:28s} {d.old_us:10.1f} -> {d.new_us:10.1f} us {d.pct:+6.1f}%{mark}")
    for cfg, key in missing:
        print(f"  {_label(cfg):60s} {key:28s} missing from the new file")
    for name, cfgs in (("only in the old file", only_old), ("only in the new file", only_new)):
        for cfg in cfgs:
            print(f"  {name}: {_label(cfg)}")
    if worse or missing:
        print(f"compare: {len(worse)} time(s) slower by more than {args.threshold_pct}% (and {args.min_us} us), "
              f"{len(missing)} missing")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
