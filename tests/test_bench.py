"""The benchmark: its byte counts, its reference checks, its options, and one tiny run end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
from types import SimpleNamespace

import pytest
import torch

import epcomm
from epcomm.bench import checks, metrics, report
from epcomm.bench.__main__ import main
from epcomm.bench.options import parse_int_list
from epcomm.bench.workloads import make_rank_inputs, plan_cases
from epcomm.cli import main as cli_main


def needs_bench_ranks(num_ranks: int) -> None:
    """The bench runs one rank per GPU where there are GPUs: skip a run that asks for more."""
    if torch.cuda.is_available() and num_ranks > torch.cuda.device_count():
        pytest.skip(f"the bench runs one rank per GPU: {num_ranks} ranks, {torch.cuda.device_count()} GPU(s)")


def test_byte_counts_by_hand():
    # DeepSeek-V3 hidden: 7168 channels = 56 scale groups.
    assert metrics.row_bytes(7168, "bf16") == 14336
    assert metrics.row_bytes(7168, "fp8") == 7168 + 56 * 4
    assert metrics.normal_dispatch_bytes(10, 7168, "bf16") == 143360
    assert metrics.normal_dispatch_bytes(10, 7168, "fp8") == 73920
    assert metrics.normal_combine_bytes(10, 7168) == 143360  # combine is BF16 whatever dispatch was
    assert metrics.ll_dispatch_bytes(3, 7168) == 3 * (7168 + 224 + 16)
    assert metrics.ll_dispatch_bytes(3, 7168, "bf16") == 3 * 14336
    assert metrics.ll_combine_bytes(3, 7168) == 3 * 14336
    assert metrics.row_bytes(200, "fp8") == 200 + 2 * 4  # a partial group still has a scale
    with pytest.raises(ValueError, match="dtype"):
        metrics.row_bytes(128, "fp16")


def test_slowest_rank_reports_its_own_bytes():
    us, gbps, rank = metrics.slowest_rank([1e-3, 2e-3, 1.5e-3], [10**6, 3 * 10**6, 10**9])
    assert rank == 1
    assert us == pytest.approx(2000.0)
    assert gbps == pytest.approx(1.5)  # 3 MB / 2 ms
    with pytest.raises(ValueError, match="one time and one byte count per rank"):
        metrics.slowest_rank([1.0], [1, 2])


def test_parse_int_list():
    assert parse_int_list("128..1024") == [128, 256, 512, 1024]
    assert parse_int_list("16,48, 64..128") == [16, 48, 64, 128]


def _two_rank_inputs(tokens=24, hidden=256, experts=8, topk=4):
    return [make_rank_inputs(3, r, tokens, hidden, experts, topk) for r in range(2)]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_normal_checks_catch_a_wrong_row(dtype):
    inputs = _two_rank_inputs()
    want = checks.Expected(inputs, 0, 8)
    recv_x = want.x.clone() if dtype == "bf16" else epcomm.per_token_cast_to_fp8(want.x)
    ok = checks.check_normal_dispatch("t", recv_x, want.topk_idx, want.topk_weights, want.expert_counts, want,
                                      dtype)
    assert ok == [], ok
    data = recv_x if dtype == "bf16" else recv_x[0]
    data.view(torch.uint8)[1, 3] ^= 1  # one flipped bit in one row
    bad = checks.check_normal_dispatch("t", recv_x, want.topk_idx, want.topk_weights, None, want, dtype)
    assert len(bad) == 1 and "recv_x" in bad[0], bad

    # Combine: every token comes back once per destination rank.
    mine = inputs[0]
    base = mine.x if dtype == "bf16" else epcomm.per_token_cast_back(*epcomm.per_token_cast_to_fp8(mine.x))
    combined = (base.double() * want.in_rank.sum(1, keepdim=True)).to(torch.bfloat16)
    assert checks.check_normal_combine("t", combined, mine, want, dtype) == []
    combined[5, 7] = combined[5, 7] * 1.1 + 0.1
    assert checks.check_normal_combine("t", combined, mine, want, dtype), "a 10% error must fail"


def test_low_latency_checks_catch_a_wrong_row():
    inputs = _two_rank_inputs(tokens=16)
    rank, num_ranks, experts, n = 0, 2, 8, 16
    e_local, hidden = experts // num_ranks, inputs[0].x.shape[1]
    data = torch.zeros((e_local, n * num_ranks, hidden), dtype=torch.float8_e4m3fn)
    scales = torch.zeros((e_local, hidden // 128, n * num_ranks)).transpose(1, 2)
    src_info = torch.full((e_local, n * num_ranks), -1, dtype=torch.int32)
    layout = torch.zeros((e_local, num_ranks), dtype=torch.int64)
    counts = torch.zeros(e_local, dtype=torch.int32)
    for e in range(e_local):
        begin = 0
        for j in reversed(range(num_ranks)):  # blocks may come in any order
            tokens = torch.nonzero((inputs[j].topk_idx == rank * e_local + e).any(1)).flatten().flip(0)
            q, s = epcomm.per_token_cast_to_fp8(inputs[j].x[tokens])
            c = tokens.numel()
            data[e, begin:begin + c], scales[e, begin:begin + c] = q, s
            src_info[e, begin:begin + c] = tokens.to(torch.int32)
            layout[e, j] = (begin << 32) | c
            begin += c
        counts[e] = begin
    handle = SimpleNamespace(layout_range=layout, src_info=src_info)
    assert checks.check_ll_dispatch("t", (data, scales), counts, handle, inputs, rank, experts) == []
    data.view(torch.uint8)[1, 0, 5] ^= 1
    bad = checks.check_ll_dispatch("t", (data, scales), counts, handle, inputs, rank, experts)
    assert len(bad) == 1 and "expert 1" in bad[0], bad

    y = checks.ll_combine_input((data, scales), counts, n, num_ranks)
    assert y.dtype == torch.bfloat16 and bool((y[:, int(counts.max()):] == 0).all())
    mine = inputs[rank]
    weight = mine.topk_weights.double().sum(1, keepdim=True)
    base = epcomm.per_token_cast_back(*epcomm.per_token_cast_to_fp8(mine.x)).double()
    combined = (base * weight).to(torch.bfloat16)
    assert checks.check_ll_combine("t", combined, mine) == []
    combined[0, 0] = -combined[0, 0] - 1
    assert checks.check_ll_combine("t", combined, mine)


def test_low_latency_combine_check_allows_the_rounding_of_partial_sums():
    """A combine by partial sums (EPCOMM_LL_COMBINE_PARTIALS) rounds each rank's partial to bf16:
    the check for it allows that rounding, the default one does not, and neither takes a wrong row."""
    mine = _two_rank_inputs(tokens=64)[0]
    valid = mine.topk_idx >= 0
    w = torch.where(valid, mine.topk_weights, 0.0).double()
    base = epcomm.per_token_cast_back(*epcomm.per_token_cast_to_fp8(mine.x)).double()
    # Two ranks' partials (the first half of the top-k slots, the second), each rounded to bf16.
    k = w.shape[1] // 2
    partial = [(base * w[:, :k].sum(1, keepdim=True)).to(torch.bfloat16),
               (base * w[:, k:].sum(1, keepdim=True)).to(torch.bfloat16)]
    combined = (partial[0].double() + partial[1].double()).to(torch.bfloat16)
    assert checks.check_ll_combine("t", combined, mine, partials=True) == []
    assert checks.check_ll_combine("t", combined, mine)  # two roundings are more than one allows
    combined[3, 7] = -combined[3, 7] - 1
    assert checks.check_ll_combine("t", combined, mine, partials=True)


@pytest.mark.parametrize("argv, option", [
    (["--num-ranks", "2", "--experts", "7"], "--experts"),
    (["--num-ranks", "2", "--hidden", "200"], "--hidden"),
    (["--num-sms", "3"], "--num-sms"),
    (["--tokens", "abc"], "--tokens"),
    (["--dtype", "fp16"], "--dtype"),
    (["--iters", "0"], "--iters"),
    (["--ranks", "2"], "--ranks"),  # no abbreviations: it must not pass for --ranks-per-domain
])
def test_bad_options_name_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err


def test_cli_dispatches_and_rejects_unknown_commands(capsys):
    assert cli_main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "--topk", "0"])
    assert exit_info.value.code == 2
    assert "--topk" in capsys.readouterr().err


def test_tiny_run_end_to_end(tmp_path, capsys, monkeypatch):
    needs_bench_ranks(2)
    out = tmp_path / "results.json"
    png = tmp_path / "bw.png"
    argv = ["--num-ranks", "2", "--tokens", "16,32", "--hidden", "256", "--topk", "4", "--experts", "8",
            "--ll-tokens", "8", "--ll-experts", "8", "--num-sms", "8", "--warmup", "1", "--iters", "3",
            "--backend", "reference", "--json", str(out)]
    monkeypatch.setenv("EPCOMM_COMBINE_SEND_SMS_PCT", "40")  # not read by the reference backend: recorded only
    try:
        import matplotlib  # noqa: F401
        argv += ["--plot", str(png)]
    except ImportError:
        png = None
    assert main(argv) == 0
    captured = capsys.readouterr()
    records = json.loads(out.read_text())
    # normal: 2 token counts x (a2a + megatron-a2a + bf16 + fp8); low-latency: a2a + fp8.
    assert len(records) == 10, [(r["mode"], r["impl"], r["num_tokens"]) for r in records]
    pg = "gloo" if records[0]["device"] == "cpu-gloo-x2" else "nccl"
    a2a, megatron = f"{pg}-a2a", f"{pg}-megatron-a2a"
    assert {(r["mode"], r["impl"], r["dispatch_dtype"]) for r in records} == {
        ("normal", a2a, "bf16"), ("normal", megatron, "bf16"), ("normal", "epcomm-reference", "bf16"),
        ("normal", "epcomm-reference", "fp8"), ("low_latency", a2a, "bf16"), ("low_latency", "epcomm-reference", "fp8")}
    for r in records:
        tag = f"{r['mode']} {r['impl']} {r['dispatch_dtype']} T={r['num_tokens']}"
        assert set(report.RECORD_KEYS) <= set(r), tag
        assert r["checked"] is True, (tag, r.get("failures"))
        for key in ("dispatch_us", "dispatch_gbps", "combine_us", "combine_gbps"):
            assert r[key] > 0, (tag, key, r[key])
        assert r["num_ranks"] == 2 and r["hidden"] == 256 and r["num_topk"] == 4, tag
        assert r["num_sms"] == (None if r["baseline"] else 8), tag
        assert (r["buffer_bytes"] == 0) == (r["impl"] == megatron), tag  # Megatron's sequence holds no buffer
        assert r["inter_domain_gbps"] is None, tag
        # Peak memory beside the times, per operation; the epcomm calls and Megatron's allocate their outputs.
        ops = {"dispatch", "combine"} | ({"cached_dispatch"} if "cached_dispatch_us" in r else set())
        assert set(r["peak_memory_bytes_per_op"]) == ops, tag
        assert r["peak_memory_bytes"] == max(r["peak_memory_bytes_per_op"].values()), tag
        assert r["peak_memory_bytes"] > 0 or r["impl"] == a2a, tag
        assert r["peak_memory_method"], tag
        if r["impl"] == megatron:  # one row per (token, selected expert): more than the dispatch's rows
            assert sum(r["sent_rows_per_rank"]) > sum(r["dispatch_bytes_per_rank"]) // (2 * r["hidden"]), tag
        assert re.fullmatch(r"[0-9a-f]{40}(\+modified)?|unknown", r["commit"]), tag
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", r["date"]), tag
        assert len(r["dispatch_us_per_rank"]) == 2 and max(r["dispatch_us_per_rank"]) == r["dispatch_us"], tag
        assert r["env"].get("EPCOMM_COMBINE_SEND_SMS_PCT") == "40", (tag, r["env"])
    # One progress line per configuration on stderr; the table on stdout.
    assert len(re.findall(r"^\[\d+/10\] ", captured.err, flags=re.M)) == 10, captured.err
    assert "epcomm-reference" in captured.out and "a2a/disp" in captured.out and "peak MB" in captured.out
    if png is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_rank_runs_the_device_copy_beside(tmp_path):
    """At one rank the normal-mode cases begin with a plain device copy of x, checked, in the same run."""
    out = tmp_path / "results.json"
    assert main(["--num-ranks", "1", "--modes", "normal", "--tokens", "16", "--hidden", "256", "--topk", "4",
                 "--experts", "8", "--dtype", "bf16", "--warmup", "1", "--iters", "3", "--backend", "reference",
                 "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    copies = [r for r in records if r["impl"].endswith("-copy")]
    assert len(copies) == 1 and copies[0]["baseline"] and copies[0]["checked"] is True, copies
    assert copies[0]["dispatch_bytes_per_rank"] == [16 * 256 * 2] and copies[0]["dispatch_us"] > 0, copies[0]
    assert not any(c.kind == "copy" for c in plan_cases(["normal"], [16], [8], [256], 4, 8, 8, [8], ["bf16"], 1, 2, 0,
                                                        "reference", num_ranks=2))


def test_hierarchical_run_reports_each_tier(tmp_path):
    """--strategies hierarchical on virtual domains, with node-limited routing: per-tier bytes and the
    check that no token crossed the slow tier twice for one domain, next to the flat strategy."""
    needs_bench_ranks(4)
    out = tmp_path / "tiers.json"
    assert main(["--num-ranks", "4", "--modes", "normal", "--tokens", "24", "--hidden", "128", "--topk", "4",
                 "--experts", "16", "--num-sms", "8", "--dtype", "bf16", "--warmup", "1", "--iters", "2",
                 "--backend", "reference", "--strategies", "alltoall,hierarchical", "--ranks-per-domain", "2",
                 "--groups", "1", "--json", str(out)]) == 0
    records = {r["impl"]: r for r in json.loads(out.read_text())}
    tiered = records["epcomm-reference-hierarchical"]
    assert tiered["checked"] is True and records["epcomm-reference"]["checked"] is True
    assert tiered["num_domains"] == 2 and tiered["each_token_crosses_once_per_domain"] is True
    # One group per token: a token crosses to the other domain at most once, so at most T rows.
    assert all(0 <= n <= 24 for n in tiered["dispatch_inter_domain_rows_per_rank"])
    assert tiered["dispatch_inter_domain_rows_per_rank"] == tiered["inter_domain_rows_expected_per_rank"]
    assert sum(tiered["dispatch_inter_domain_rows_per_rank"]) == sum(tiered["combine_inter_domain_rows_per_rank"])
    assert tiered["inter_domain_gbps"] > 0 and tiered["intra_domain_gbps"] > 0


@pytest.mark.parametrize("argv, option", [
    (["--num-ranks", "4", "--ranks-per-domain", "3"], "--ranks-per-domain"),
    (["--groups", "0"], "--groups"),
    (["--backend", "cuda", "--strategies", "allgather"], "--strategies"),
])
def test_bad_domain_options_name_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err


def test_pressure_comparison_is_bitwise():
    from epcomm.bench.pressure import _same

    a = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    assert _same((a, [1, 2], None), (a.clone(), [1, 2], None))
    assert not _same(a, torch.tensor([-0.0, 1.0], dtype=torch.bfloat16))  # equal values, other bits
    assert not _same(a, a.float())
    assert not _same((a, [1, 2]), (a, [1, 3]))  # the expert-count lists count too
    assert not _same((a,), (a, a))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU job; on GPUs, tools/ci/gpu_check.sh PRESSURE=N")
def test_pressure_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "pressure.json"
    assert main(["--pressure", "8", "--pressure-replays", "2", "--num-ranks", "3", "--json", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    assert record["mode"] == "pressure" and record["checked"] and record["failures"] == []
    assert record["cases"] == 8 and record["replays"] == 16
    assert record["ll_cases"] == 8 and record["ll_replays"] == 16
    assert record["buffers_created"] == 8  # normal and low-latency Buffers, recreated every other case
    assert "every output bitwise equal" in capsys.readouterr().out


def rank_deep_ep_case(case):
    """Run a DeepEP case with epcomm's reference Buffer standing in for deep_ep (DeepEP has the same API and
    cannot run on CPU): checks that the peer goes through the same calls, checks and record."""
    import sys
    import types

    from epcomm.bench import runner

    sys.modules["deep_ep"] = types.SimpleNamespace(Buffer=epcomm.Buffer)
    try:
        return runner.run_case(case)
    finally:
        del sys.modules["deep_ep"]


def test_deep_ep_cases_run_beside_epcomm():
    from conftest import cluster

    from epcomm.bench.workloads import DEEP_EP, plan_cases

    cases = plan_cases(["normal", "low_latency"], [32], [16], [256], 4, 8, 8, [8], ["bf16", "fp8"], 1, 2, 0,
                       "reference", with_deep_ep=True)
    peers = [c for c in cases if c.kind == DEEP_EP]
    assert [(c.mode, c.dtype) for c in peers] == [("normal", "bf16"), ("normal", "fp8")]  # normal mode only
    assert not any(c.kind == DEEP_EP for c in plan_cases(["normal"], [32], [16], [256], 4, 8, 8, [8], ["bf16"], 1, 2,
                                                          0, "reference"))
    results = cluster(2).run(rank_deep_ep_case, peers[1])
    assert all(r["impl"] == DEEP_EP and not r["failures"] for r in results), results


def test_git_commit_marks_a_modified_tree(tmp_path):
    """A result recorded from edited sources must not pass for the commit's: "+modified"."""
    git_commit = report.git_commit
    assert git_commit(str(tmp_path)) == "unknown"  # not a checkout
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "kernel.cu").write_text("a\n")
    subprocess.run([*git, "add", "kernel.cu"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / "notes.txt").write_text("untracked files do not count\n")
    assert git_commit(str(tmp_path)) == sha
    (tmp_path / "kernel.cu").write_text("b\n")
    assert git_commit(str(tmp_path)) == sha + "+modified"


def test_compare_flags_slower_times_of_the_same_configurations(tmp_path, capsys):
    """epcomm.bench.compare: a combine 10% slower fails the check, a faster dispatch does not; records
    of other shapes are listed, not compared; files of other devices are refused."""
    from epcomm.bench import compare

    def record(tokens: int, dispatch_us: float, combine_us: float, device: str = "nvidia-h200-x2") -> dict:
        return {"mode": "normal", "impl": "epcomm-cuda", "num_ranks": 2, "num_domains": 1, "num_tokens": tokens,
                "hidden": 7168, "num_topk": 8, "num_experts": 256, "num_sms": 24, "dispatch_dtype": "bf16",
                "dispatch_us": dispatch_us, "combine_us": combine_us, "checked": True, "device": device,
                "_samples_us": {"combine": [[1.0]]}}

    old = [record(4096, 240.0, 280.0), record(512, 50.0, 60.0)]
    new = [record(4096, 230.0, 308.0), record(8192, 480.0, 560.0)]
    deltas, missing, only_old, only_new = compare.compare(old, new)
    assert {(d.time, round(d.pct, 1)) for d in deltas} == {("dispatch_us", -4.2), ("combine_us", 10.0)}
    assert missing == [] and [c[5] for c in only_old] == [512] and [c[5] for c in only_new] == [8192]
    cached = [dict(old[0], cached_dispatch_us=200.0)]
    unchecked = [dict(new[0], checked=False)]
    paths = {}
    for name, records in (("old", old), ("new", new), ("other", [record(4096, 1, 1, "h100")]), ("cached", cached),
                          ("unchecked", unchecked), ("no_common", [record(1024, 1, 1)])):
        paths[name] = str(tmp_path / f"{name}.json")
        (tmp_path / f"{name}.json").write_text(json.dumps(records))
    assert compare.main([paths["old"], paths["new"]]) == 1
    assert "combine_us" in capsys.readouterr().out
    assert compare.main([paths["old"], paths["new"], "--threshold-pct", "12"]) == 0
    assert compare.main([paths["old"], paths["new"], "--min-us", "30"]) == 0  # 28 us slower
    assert compare.main([paths["old"], paths["new"], "--times", "dispatch_us"]) == 0  # the combine not compared
    assert compare.main([paths["old"], paths["old"]]) == 0
    assert compare.main([paths["old"], paths["other"]]) == 2  # another device kind
    assert compare.main([paths["old"], paths["no_common"]]) == 2  # nothing compared
    assert compare.main([paths["cached"], paths["new"], "--threshold-pct", "12"]) == 1  # cached time gone
    assert "missing" in capsys.readouterr().out
    assert compare.main([paths["old"], paths["unchecked"]]) == 2  # a record that did not match is not compared


def test_ab_commits_builds_and_runs_every_tree_in_both_orders(tmp_path):
    """tools/dev/ab_commits.sh in a scratch repository: `prepare` archives each commit's tree under ab/,
    `run` (with a stand-in python3 that records its arguments) runs the bench per tree of those (not
    another left under ab/) and per AB_ENV_SETS entry, A..Z then Z..A, and packs every JSON into
    $OUT/ab.tgz."""
    import shutil
    import tarfile

    repo = tmp_path / "repo"
    (repo / "tools" / "dev").mkdir(parents=True)
    (repo / "epcomm").mkdir()
    shutil.copy(os.path.join(os.path.dirname(__file__), "..", "tools", "dev", "ab_commits.sh"),
                repo / "tools" / "dev" / "ab_commits.sh")
    (repo / "tools" / "ci").mkdir()
    shutil.copy(os.path.join(os.path.dirname(__file__), "..", "tools", "ci", "gpu_env.sh"),
                repo / "tools" / "ci" / "gpu_env.sh")
    (repo / "pyproject.toml").write_text("")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    shas = []
    for version in ("1", "2"):
        (repo / "epcomm" / "version.txt").write_text(version)
        if version == "2":  # the second tree has tests of its own (AB_TEST_K below)
            (repo / "tests").mkdir()
            (repo / "tests" / "test_x.py").write_text("")
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-q", "-m", version], check=True)
        shas.append(subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                   check=True).stdout.strip())
    script = str(repo / "tools" / "dev" / "ab_commits.sh")
    subprocess.run(["bash", script, "prepare", *shas], check=True, capture_output=True)
    assert sorted(os.listdir(repo / "ab")) == sorted([*shas, "TREES"])
    assert (repo / "ab" / shas[0] / "epcomm" / "version.txt").read_text() == "1"
    # a tree an earlier prepare left under ab/: not one of this prepare's, not run
    shutil.copytree(repo / "ab" / shas[0], repo / "ab" / "0stale")
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python3").write_text(
        '#!/bin/bash\n[ "$1" = "-c" ] && exit 0\n[ "$2" = "pytest" ] && { echo "ran pytest ${*: -2}"; exit 0; }\n'
        '[ "$1" = "tools/profile/ll_profile.py" ] && '
        '{ echo "rank 0 dispatch send v=$(cat epcomm/version.txt) $*"; exit 0; }\n'
        'prev=""; for a in "$@"; do [ "$prev" = "--json" ] && j=$a; '
        'prev=$a; done\necho "[]" > "$j"\n'
        'echo "     normal   epcomm-cuda v=$(cat epcomm/version.txt) pct=${EPCOMM_COMBINE_SEND_SMS_PCT:-none} $*"\n')
    (shim / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "AB_ENV_SETS": "s8=EPCOMM_COMBINE_SEND_SMS_PCT=33.4 s10=EPCOMM_COMBINE_SEND_SMS_PCT=41.7"}
    out = subprocess.run(["bash", script, "run", "--", "--modes", "normal"], env=env, capture_output=True, text=True,
                         check=True).stdout
    runs = [line.split(":")[0] for line in out.splitlines() if "epcomm-cuda" in line]
    a, b = sorted(shas)
    assert runs == [f"{a}-s8-1", f"{a}-s10-1", f"{b}-s8-1", f"{b}-s10-1",
                    f"{b}-s8-2", f"{b}-s10-2", f"{a}-s8-2", f"{a}-s10-2"], out
    assert "v=1 pct=33.4" in out and "v=2 pct=41.7" in out and "--modes normal" in out
    with tarfile.open(tmp_path / "out" / "ab.tgz") as tar:
        assert sum(n.endswith(".json") for n in tar.getnames()) == 8
    # AB_TEST_K: each tree's own tests first, where it has them
    out = subprocess.run(["bash", script, "run", "--", "--modes", "normal"], env={**env, "AB_TEST_K": "ll and fast"},
                         capture_output=True, text=True, check=True).stdout
    assert f"ab_commits: {shas[0]} has no tests" in out, out
    assert f"ab_commits: {shas[1]} tests: ran pytest -k ll and fast" in out, out
    # AB_TEST_TREES: the tests of those trees only; AB_PROFILE: each tree's phase timeline after the timing
    out = subprocess.run(["bash", script, "run", "--", "--modes", "normal"],
                         env={**env, "AB_TEST_K": "ll", "AB_TEST_TREES": shas[0], "AB_PROFILE": "--ranks 4"},
                         capture_output=True, text=True, check=True).stdout
    assert f"ab_commits: {shas[0]} has no tests" in out and f"{shas[1]} tests" not in out, out
    for sha in shas:
        assert f"profile {sha}: rank 0 dispatch send v=" in out, out


def rank_megatron_sequence(routing: str):
    """megatron-a2a on a named routing (with unused slots too): its rows, weights and sums against the oracle."""
    import torch.distributed as dist
    from routing import device

    from epcomm.bench import megatron
    from epcomm.bench.workloads import RankInputs, make_pattern_topk_idx

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    tokens, hidden, experts, topk = 40, 256, 4 * num_ranks, 4
    inputs = []
    for r in range(num_ranks):
        gen = torch.Generator().manual_seed(100 + r)
        x = torch.randn((tokens, hidden), generator=gen).to(torch.bfloat16)
        idx = make_pattern_topk_idx(gen, tokens, experts, topk, num_ranks, routing)
        w = torch.rand((tokens, topk), generator=gen)
        inputs.append(RankInputs(x.to(device()), idx.to(device()), w.to(device())))
    want = checks.Expected(inputs, rank, experts)
    got = megatron.dispatch(inputs[rank].x, inputs[rank].topk_idx, inputs[rank].topk_weights, experts)
    failures = megatron.check_dispatch("dispatch", got, want)
    failures += megatron.check_combine("combine", megatron.combine(got.x, got, tokens), inputs[rank])
    return failures, got.sent_tokens.numel(), int((inputs[rank].topk_idx >= 0).sum())


@pytest.mark.parametrize("routing", ["random", "imbalanced", "empty_rank", "all_dropped"])
def test_megatron_sequence_matches_the_oracle(routing):
    from conftest import cluster

    for failures, sent, selections in cluster(2).run(rank_megatron_sequence, routing):
        assert failures == []
        assert sent == selections  # one row per (token, selected expert): Megatron's layout, not per rank


def test_megatron_checks_catch_a_wrong_row():
    from epcomm.bench import megatron

    inputs = _two_rank_inputs()
    want = checks.Expected(inputs, 0, 8)
    rows, probs, counts = megatron.expected(want)
    assert sum(counts) == int((want.topk_idx >= 0).sum()) > want.num_rows  # a token goes once per expert
    got = megatron.Dispatched(rows.clone(), probs.clone(), list(counts), *([None] * 4))
    assert megatron.check_dispatch("t", got, want) == []
    got.x.view(torch.uint8)[2, 5] ^= 1
    got.tokens_per_expert[0] += 1
    bad = megatron.check_dispatch("t", got, want)
    assert len(bad) == 2 and "tokens per local expert" in bad[0] and "rows by expert" in bad[1], bad
    got.probs[0] += 1
    assert len(megatron.check_dispatch("t", got, want)) == 3

    mine = inputs[0]
    n = (mine.topk_idx >= 0).sum(1, keepdim=True)
    combined = (mine.x.double() * n).to(torch.bfloat16)
    assert megatron.check_combine("t", combined, mine) == []
    combined[4] -= mine.x[4]  # one expert's output missing
    assert megatron.check_combine("t", combined, mine)


def test_call_memory_measures_the_peak_and_the_growth():
    """bench/memory.call_memory on CPU: a call's temporaries show as its peak, what it keeps as growth."""
    from epcomm.bench import memory

    cpu = torch.device("cpu")
    x = torch.ones(1 << 18)  # 1 MiB
    steady = memory.call_memory(lambda: (x * 2 + 1).sum(), 3, cpu)
    assert steady is not None, "torch.profiler recorded no CPU allocations"
    assert all(m.peak_bytes >= 2 * x.nbytes for m in steady)  # x * 2 and its + 1 are alive together
    assert steady[2].level_bytes == steady[1].level_bytes and steady[2].peak_bytes == steady[1].peak_bytes
    kept: list[torch.Tensor] = []
    leaking = memory.call_memory(lambda: kept.append(x * 2), 3, cpu)
    assert [m.level_bytes for m in leaking] == [0, x.nbytes, 2 * x.nbytes]
    assert memory.live_tensor_bytes(cpu) >= 3 * x.nbytes  # x and the two kept
    assert memory.call_memory(lambda: None, 2, cpu)[1].peak_bytes == 0


def rank_portable_memory_per_call(mode: str, calls: int):
    """Each call's peak memory rise and the allocation when it started, over ``calls`` dispatch + combine
    steps of the portable path (the reference backend) with the same inputs."""
    import torch.distributed as dist
    from routing import device

    from epcomm.bench import memory

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    tokens, hidden, experts, topk = 64, 512, 4 * num_ranks, 4
    inp = make_rank_inputs(5, rank, tokens, hidden, experts, topk)
    x, idx, w = inp.x.to(device()), inp.topk_idx.to(device()), inp.topk_weights.to(device())
    if mode == "normal":
        buf = epcomm.Buffer(dist.group.WORLD, 1 << 26, backend="reference")
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)

        def step():
            recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
            return buf.combine(recv_x, handle)[0]
    else:
        buf = epcomm.Buffer(dist.group.WORLD, 0,
                            epcomm.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, num_ranks, experts),
                            low_latency_mode=True, backend="reference")

        def step():
            recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, tokens, experts, use_fp8=False)
            return buf.low_latency_combine(recv_x, idx, w, handle)[0]

    measured = memory.call_memory(step, calls, device())
    buf.destroy()
    return None if measured is None else [(m.peak_bytes, m.level_bytes) for m in measured]


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_portable_path_temporaries_do_not_grow(mode):
    """The peak of calls 7-10 equals that of calls 2-4 and nothing is kept from call to call (the first call
    may fill caches). Both are the least of a few calls: on CPU a free made on a gloo thread goes
    unrecorded and can only inflate a call's peak, and a collective in flight can hold a tensor for a
    moment (bench/memory.py)."""
    from conftest import cluster

    for rank, calls in enumerate(cluster(2).run(rank_portable_memory_per_call, mode, 10)):
        assert calls is not None, "no allocation statistics on this device"
        peaks, levels = [p for p, _ in calls], [lv for _, lv in calls]
        early, late = min(peaks[1:4]), min(peaks[6:10])
        assert early > 0, (rank, peaks)
        tolerance = 4096 + early // 100
        assert abs(late - early) <= tolerance, (rank, mode, peaks)
        assert abs(min(levels[6:10]) - min(levels[1:4])) <= tolerance, (rank, mode, levels)
