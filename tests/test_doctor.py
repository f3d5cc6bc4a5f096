"""``epcomm doctor`` on a CPU machine: every check reports, statuses are valid, the multicast
variables and a missing nvcc give the findings a user needs, and nothing waits without bound."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epcomm import doctor
from epcomm.backends.cuda import build
from epcomm.cli import main as cli_main

QUIET_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    status = doctor.main(["--json", *argv])
    return status, json.loads(capsys.readouterr().out)


def by_name(report: dict) -> dict[str, dict]:
    return {f["name"]: f for f in report["findings"]}


def test_json_has_every_check_with_valid_statuses(capsys):
    status, report = run_json(capsys)
    assert {f["name"].split("/")[0] for f in report["findings"]} >= set(doctor.CHECKS)
    for finding in report["findings"]:
        assert set(finding) == {"name", "status", "found", "fix"}
        assert finding["status"] in doctor.STATUSES
        assert finding["found"]
        if finding["status"] in (doctor.WARN, doctor.FAIL):
            assert finding["fix"], finding  # a problem always comes with what to do
    assert report["summary"] == {s: sum(f["status"] == s for f in report["findings"]) for s in doctor.STATUSES}
    assert status == (1 if report["summary"]["fail"] else 0) and report["ok"] == (status == 0)


def test_multicast_set_to_enable_fails_with_a_fix(monkeypatch, capsys):
    for name, value in QUIET_MULTICAST.items():
        monkeypatch.setenv(name, value)
    findings = by_name(run_json(capsys)[1])
    assert all(findings[f"multicast/{name}"]["status"] == doctor.OK for name in QUIET_MULTICAST)

    for name, enabling in (("NCCL_NVLS_ENABLE", "1"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0"),
                           ("NVSHMEM_DISABLE_NVLS", "false")):
        monkeypatch.setenv(name, enabling)
        status, report = run_json(capsys)
        finding = by_name(report)[f"multicast/{name}"]
        assert finding["status"] == doctor.FAIL and status == 1
        assert f"export {name}={QUIET_MULTICAST[name]}" in finding["fix"] and "out of service" in finding["fix"]
        monkeypatch.setenv(name, QUIET_MULTICAST[name])

    monkeypatch.delenv("NCCL_NVLS_ENABLE")
    finding = by_name(run_json(capsys)[1])["multicast/NCCL_NVLS_ENABLE"]
    assert finding["status"] == doctor.WARN and "unset" in finding["found"]


def test_missing_nvcc_is_named_with_the_fix(monkeypatch, capsys):
    def no_nvcc() -> str:
        raise RuntimeError("epcomm: nvcc was not found (looked in $CUDA_HOME, PATH). The CUDA backend compiles ...")

    monkeypatch.setattr(build, "find_nvcc", no_nvcc)
    findings = by_name(run_json(capsys)[1])
    nvcc = findings["nvcc"]
    # Without an sm_90 GPU only the kernels miss it: a warning; with one, a failure (test below).
    assert nvcc["status"] == doctor.WARN
    assert "nvcc was not found" in nvcc["found"] and 'pip install "epcomm[cuda]"' in nvcc["fix"]
    assert "not built" not in findings["kernel_cache"]["found"]  # nothing to look up without a compiler

    hopper = [doctor.Gpu(0, "NVIDIA H100", (9, 0), 80 << 30)]
    [finding] = doctor.check_compiler(hopper)
    assert finding.status == doctor.FAIL and "portable path" in finding.found


def test_a_broken_nvcc_is_bounded(monkeypatch, tmp_path: Path):
    slow = tmp_path / "nvcc"
    slow.write_text("#!/bin/sh\nsleep 30\n")
    slow.chmod(0o755)
    monkeypatch.setattr(build, "find_nvcc", lambda: str(slow))
    monkeypatch.setattr(doctor, "SUBPROCESS_TIMEOUT_S", 0.5)
    monkeypatch.setattr(doctor.run_command, "__defaults__", (0.5,))
    start = time.monotonic()
    [finding] = doctor.check_compiler([])
    assert time.monotonic() - start < 5
    assert finding.status == doctor.WARN and "did not finish" in finding.found


def test_a_shape_no_buffer_takes_fails_and_skips_the_sizes(capsys):
    status, report = run_json(capsys, "--experts", "100", "--ranks", "8")
    findings = by_name(report)
    assert status == 1 and findings["shape"]["status"] == doctor.FAIL and "100 experts" in findings["shape"]["found"]
    assert all(f["status"] == doctor.SKIP for name, f in findings.items() if name.startswith("buffers/"))
    assert doctor.main(["--ranks", "0"]) == 2


def test_buffer_sizes_are_the_size_hints(capsys):
    from epcomm import Buffer

    findings = by_name(run_json(capsys, "--hidden", "4096", "--experts", "64", "--ranks", "4", "--ll-tokens", "64")[1])
    nvl = Buffer.get_dispatch_config(4).get_nvl_buffer_size_hint(4096 * 2, 4)
    assert f"num_nvl_bytes={nvl}" in findings["buffers/normal"]["found"]
    ll = Buffer.get_low_latency_rdma_size_hint(64, 4096, 4, 64)
    assert f"num_rdma_bytes={ll}" in findings["buffers/low_latency"]["found"]
    assert findings["buffers/received"]["status"] == doctor.OK
    # Two nodes: the hierarchical buffer, and NVSHMEM / a NIC become necessary.
    findings = by_name(run_json(capsys, "--ranks", "16", "--nodes", "2")[1])
    assert "buffers/hierarchical" in findings and "backend/hierarchical" in findings


def test_rdma_nics_are_read_from_sysfs(tmp_path: Path):
    one, two = doctor.Shape(nodes=1), doctor.Shape(ranks=16, nodes=2)
    assert doctor.check_rdma([], one, tmp_path / "absent")[0].status == doctor.SKIP
    assert doctor.check_rdma([], two, tmp_path / "absent")[0].status == doctor.FAIL
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("1: DOWN\n")
    (port / "link_layer").write_text("InfiniBand\n")
    assert doctor.check_rdma([], two, tmp_path)[0].status == doctor.FAIL
    (port / "state").write_text("4: ACTIVE\n")
    [finding] = doctor.check_rdma([], two, tmp_path)
    assert finding.status == doctor.OK and "mlx5_0/1 ACTIVE InfiniBand" in finding.found


def test_topology_matrix_is_parsed():
    text = ("\x1b[4m\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
            "GPU0\t X \tNV18\tSYS\tPIX\t0-55\t0\t\tN/A\n"
            "GPU1\tNV18\t X \tNV18\tSYS\t0-55\t0\t\tN/A\n"
            "GPU2\tSYS\tNV18\t X \tSYS\t56-111\t1\t\tN/A\n"
            "NIC0\tPIX\tSYS\tSYS\t X\n\nLegend:\n  X    = Self\n")
    links = doctor.parse_topology(text)
    assert links[(0, 1)] == "NV18" and links[(0, 2)] == "SYS" and links[(2, 1)] == "NV18"
    assert len(links) == 6


def test_cli_and_module_entry_points_run_quickly():
    assert cli_main(["doctor", "--help"]) == 0
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "epcomm.doctor", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode in (0, 1), done.stderr
    assert json.loads(done.stdout)["findings"]
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("text, value", [("1g", 1 << 30), ("512M", 512 << 20), ("4096", 4096), ("x", None)])
def test_nvshmem_sizes_parse(text, value):
    assert doctor._parse_size(text) == value


def test_backends_follow_mode_blockers_on_faked_gpus(monkeypatch):
    """The GPU path without a GPU: eight Hopper GPUs, one of which cannot reach another."""
    import torch

    from epcomm.backends.cuda import availability

    gpus = [doctor.Gpu(i, "NVIDIA H100", (9, 0), 80 << 30) for i in range(8)]
    monkeypatch.setattr(availability, "gpu_id", lambda device: 100 + device.index)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer",
                        lambda a, b: (getattr(a, "index", a), getattr(b, "index", b)) != (5, 2))
    monkeypatch.setattr(build, "find_nvcc", lambda: "nvcc")  # the library check asks only whether it is found
    monkeypatch.delenv("EPCOMM_BACKEND", raising=False)
    sizes = doctor.buffer_sizes(doctor.Shape())
    findings = {f.name: f for f in doctor.check_backends(gpus, doctor.Shape(), sizes, None)}
    assert findings["backend/normal"].status == doctor.WARN
    assert "rank 5" in findings["backend/normal"].found and "peer access" in findings["backend/normal"].found
    [peer] = doctor.check_peer_access(gpus)
    assert peer.status == doctor.FAIL and "5->2" in peer.found
    # Four ranks use GPUs 0-3, which all reach each other.
    findings = doctor.check_backends(gpus, doctor.Shape(ranks=4), doctor.buffer_sizes(doctor.Shape(ranks=4)), None)
    assert all(f.status == doctor.OK for f in findings)
    monkeypatch.setenv("EPCOMM_BACKEND", "cuda")
    findings = {f.name: f for f in doctor.check_backends(gpus, doctor.Shape(), sizes, None)}
    assert findings["backend/low_latency"].status == doctor.FAIL
