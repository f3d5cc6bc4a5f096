"""The order in which the normal-mode kernels walk rows of several peers (row_order.cuh), checked on
the CPU: the header is host code too, compiled here by nvcc (skipped where nvcc is absent)."""

import subprocess
from pathlib import Path

import pytest

from epcomm.backends.cuda.build import find_nvcc

HERE = Path(__file__).resolve().parent


def test_round_robin_row_visits_every_row_once_in_round_robin_order(tmp_path):
    try:
        nvcc = find_nvcc()
    except RuntimeError:
        pytest.skip("nvcc not found")
    exe = tmp_path / "row_order_check"
    subprocess.run([nvcc, "-std=c++17", "-O2", "-o", str(exe), str(HERE / "native" / "row_order_check.cu")],
                   check=True, capture_output=True, text=True)
    result = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr
