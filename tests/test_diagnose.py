"""``epcomm bench --diagnose``: its statistics by hand, its planner comparison, and a gloo run that names
an injected straggler."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from epcomm.bench import diagnose, report
from epcomm.bench.__main__ import main
from epcomm.bench.plot import latency_plot_path, matplotlib_available
from epcomm.bench.runner import _alpha_beta
from epcomm.planner import Workload, estimate


@pytest.mark.parametrize("n", [1, 2, 7, 50])
def test_percentile_matches_numpy(n):
    rng = random.Random(n)
    values = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0, 1, 50, 90, 99, 100):
        assert diagnose.percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12), (n, q)
    with pytest.raises(ValueError, match="q must be in"):
        diagnose.percentile(values, 101)
    with pytest.raises(ValueError, match="no values"):
        diagnose.percentile([], 50)


def test_latency_stats_by_hand():
    samples = [10.0] * 98 + [20.0, 30.0]  # p50 = 10, p99 = 20 + 0.01 * 10, max = 30
    stats = diagnose.latency_stats(samples)
    assert stats["p50"] == 10.0 and stats["max"] == 30.0
    assert stats["p99"] == pytest.approx(20.1)
    assert stats["jitter_pct"] == pytest.approx(101.0)  # (20.1 - 10) / 10


def test_per_source_waits_leave_out_the_own_row():
    observed = [[0.0, 100.0, 5.0],  # rank 0 waited 100 us for rank 1, 5 us for rank 2
                [3.0, 999.0, 1.0],  # rank 1's own column entry (999) must be ignored
                [7.0, 300.0, 0.0]]
    assert diagnose.per_source_waits(observed) == pytest.approx([5.0, 200.0, 3.0])
    assert diagnose.per_source_waits([[42.0]]) == [0.0]


@pytest.mark.parametrize("waits, named", [
    ([0.0, 700.0], [1]),  # two ranks: the other source's median is the other one
    ([10.0, 12.0, 900.0, 11.0], [2]),
    ([10.0, 12.0, 900.0, 800.0], [2, 3]),  # two stragglers among four: the median of the others is 406
    ([400.0, 420.0, 410.0, 430.0], []),  # uniformly slow: nobody stands out
    ([1.0, 1.0, 40.0, 1.0], []),  # 40x the median but only 39 us above it: noise
    ([0.0, 0.0, 60.0], [2]),
])
def test_find_stragglers(waits, named):
    assert diagnose.find_stragglers(waits) == named, waits


def test_alpha_beta_fit():
    us, gbps = _alpha_beta((4 * 2**20, 256 * 2**20), (44e-6, 890e-6))
    assert gbps == pytest.approx((252 * 2**20) / 846e-6 / 1e9)
    assert us == pytest.approx(44 - 4 * 2**20 / (gbps * 1e3))
    assert _alpha_beta((10**6, 2 * 10**6), (1e-6, 10e-6)) == (0.0, pytest.approx(1e6 / 9e-6 / 1e9))  # clamped at 0
    assert _alpha_beta((10**6, 2 * 10**6), (5e-6, 5e-6))[1] == pytest.approx(2e6 / 5e-6 / 1e9)  # flat: mean rate


def _record(strategy, tokens, dispatch_us, combine_us, baseline=True, num_ranks=2):
    return {"mode": "normal", "impl": "nccl-a2a" if strategy == "alltoall" else "nccl-allgather",
            "strategy": strategy, "baseline": baseline, "num_ranks": num_ranks, "num_tokens": tokens,
            "hidden": 7168, "num_topk": 8, "num_experts": 256, "dispatch_dtype": "bf16",
            "dispatch_us": dispatch_us, "combine_us": combine_us}


def test_compare_with_planner_uses_the_planner_and_the_probe():
    probe = {"link_gbps": 300.0, "link_fixed_us": 20.0, "method": "test",
             "collective_gbps": {"all_to_all_single": 280.0, "all_gather_into_tensor": 250.0,
                                 "reduce_scatter_tensor": 240.0},
             "collective_fixed_us": {"all_to_all_single": 30.0, "all_gather_into_tensor": 24.0,
                                     "reduce_scatter_tensor": 18.0}}
    records = [_record("alltoall", 4096, 230.0, 231.0), _record("allgather", 4096, 260.0, 270.0, num_ranks=4)]
    rows = diagnose.compare_with_planner(records, probe)
    assert [(r["planner_strategy"], r["phase"], r["collective"]) for r in rows] == [
        ("flat", "dispatch", "all_to_all_single"), ("flat", "combine", "all_to_all_single"),
        ("allgather", "dispatch", "all_gather_into_tensor"), ("allgather", "combine", "reduce_scatter_tensor")]
    w = Workload(num_tokens=4096, hidden=7168, num_topk=8, num_experts=256, dispatch_dtype="bf16")
    # coll.: the collective's rate; the allgather ring is charged R - 1 hops of fixed_us / (R - 1).
    want = estimate("allgather", diagnose.calibrated_topology(4, 240.0, 18.0, "allgather", True), w).combine.time_us
    assert rows[3]["collective_us"] == pytest.approx(want)
    assert diagnose.calibrated_topology(4, 240.0, 18.0, "allgather", True).intra.latency_us == pytest.approx(6.0)
    assert diagnose.calibrated_topology(4, 300.0, 20.0, "allgather", False).intra.latency_us == 20.0
    assert diagnose.calibrated_topology(4, 280.0, 30.0, "flat", True).intra.latency_us == 30.0
    want = estimate("flat", diagnose.calibrated_topology(2, 300.0, 20.0, "flat", False), w).dispatch.time_us
    assert rows[0]["link_us"] == pytest.approx(want)
    assert rows[0]["link_error_pct"] == pytest.approx((want - 230.0) / 230.0 * 100)
    assert rows[0]["preset_us"] == pytest.approx(
        estimate("flat", diagnose.benchmark_topology(2), w).dispatch.time_us)
    assert records[0]["predicted"]["dispatch_link_us"] == pytest.approx(want, abs=1e-3)
    text = "\n".join(diagnose.format_comparison(rows, probe, "nccl"))
    assert "all_gather_into_tensor" in text and re.search(r"coll\.: allgather\s+\d/2 within 25%", text), text
    assert "no prediction for CPU/gloo" in "\n".join(diagnose.format_comparison(rows, probe, "gloo"))


def test_write_json_leaves_out_in_memory_keys(tmp_path):
    path = tmp_path / "r.json"
    report.write_json([{"mode": "normal", "_samples_us": {"dispatch": [[1.0]]}}], str(path))
    assert json.loads(path.read_text()) == [{"mode": "normal"}]
    assert latency_plot_path("out/bw.png") == "out/bw-latency.png"
    assert latency_plot_path("bw") == "bw-latency.png"


@pytest.mark.parametrize("argv, option", [
    (["--num-ranks", "2", "--straggler", "2"], "--straggler"),
    (["--num-ranks", "2", "--straggler-delay-us", "100"], "--straggler-delay-us needs --straggler"),
    (["--num-ranks", "2", "--straggler", "1", "--straggler-delay-us", "0"], "--straggler-delay-us"),
    (["--strategies", "ring"], "--strategies"),
])
def test_bad_diagnose_options_name_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the CPU job (3 gloo ranks)")
def test_diagnose_names_an_injected_straggler(tmp_path, capsys):
    out = tmp_path / "diag.json"
    argv = ["--num-ranks", "3", "--tokens", "24", "--hidden", "256", "--topk", "4", "--experts", "12",
            "--ll-tokens", "8", "--ll-experts", "12", "--num-sms", "8", "--dtype", "bf16", "--warmup", "1",
            "--iters", "5", "--backend", "reference", "--strategies", "alltoall,allgather", "--diagnose",
            "--straggler", "2", "--straggler-delay-us", "20000", "--json", str(out)]
    png = tmp_path / "bw.png"
    if matplotlib_available():
        argv += ["--plot", str(png)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    records = json.loads(out.read_text())
    # normal: a2a, Megatron's sequence and allgather baselines, the two strategies; low latency: baseline + epcomm.
    assert [(r["mode"], r["impl"]) for r in records] == [
        ("normal", "gloo-a2a"), ("normal", "gloo-megatron-a2a"), ("normal", "gloo-allgather"),
        ("normal", "epcomm-reference"), ("normal", "epcomm-reference-allgather"), ("low_latency", "gloo-a2a"),
        ("low_latency", "epcomm-reference")]
    assert all(r["checked"] for r in records), [r.get("failures") for r in records]
    ll = records[-1]
    assert ll["stragglers"] == [2], ll["wait_us_per_source"]
    assert ll["wait_us_per_source"]["dispatch"][2] > 10000, ll["wait_us_per_source"]
    assert "stragglers: rank 2" in text and "<- straggler" in text, text
    for r in records:
        tag = f"{r['mode']} {r['impl']}"
        assert set(r["latency_us_per_rank"]) >= {"dispatch", "combine"}, tag
        for op, per_rank in r["latency_us_per_rank"].items():
            assert len(per_rank) == 3 and len(r["latency_samples_us"][op][0]) == 5, (tag, op)
            for stats in per_rank:
                assert stats["p50"] <= stats["p99"] <= stats["max"], (tag, op, stats)
        assert r["injected_straggler"] == {"rank": 2, "delay_us": 20000.0}, tag
        assert "_samples_us" not in r, tag
    # The straggler itself arrives last, so its own calls are the short ones.
    normal = records[3]["latency_us_per_rank"]["dispatch"]
    assert normal[2]["p50"] < min(normal[0]["p50"], normal[1]["p50"]), normal
    assert "per-rank latency of the timed calls" in text and "no prediction for CPU/gloo" in text
    if matplotlib_available():
        for path in (png, tmp_path / "bw-latency.png"):
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
