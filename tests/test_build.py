"""Where the JIT looks for nvcc and how it links the driver, on fake directory layouts (no nvcc needed):
a pip-only machine (`pip install "epcomm[cuda]"`) has nvcc only inside the `nvidia` namespace package."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from epcomm.backends.cuda import build


def _nvcc(home: Path) -> str:
    """A fake toolkit-shaped tree at ``home`` with an executable bin/nvcc; its path."""
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    return str(nvcc)


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """No nvcc anywhere: no CUDA_HOME / CUDA_PATH, an empty PATH, no system toolkit, no nvidia package;
    each test adds what its machine has."""
    for name in ("CUDA_HOME", "CUDA_PATH", "LD_LIBRARY_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    monkeypatch.setattr(build, "SYSTEM_CUDA_HOME", str(tmp_path / "usr-local-cuda"))
    monkeypatch.setitem(sys.modules, "nvidia", None)  # import nvidia raises ImportError
    return tmp_path


def _nvidia_package(monkeypatch, *roots: Path) -> None:
    """The `nvidia` namespace package with a portion in each of ``roots`` (site directories)."""
    package = types.ModuleType("nvidia")
    package.__path__ = [str(root / "nvidia") for root in roots]
    monkeypatch.setitem(sys.modules, "nvidia", package)


def test_no_nvcc_names_the_cuda_extra(machine):
    with pytest.raises(RuntimeError, match=r'pip install "epcomm\[cuda\]"'):
        build.find_nvcc()


@pytest.mark.parametrize("layout", ["cu13", "cuda_nvcc"])
def test_nvcc_of_the_pip_package(machine, monkeypatch, layout):
    """CUDA 13's wheel installs nvidia/cu13/bin/nvcc, CUDA 12's nvidia/cuda_nvcc/bin/nvcc; the namespace
    package may be split over site directories (a venv over the system's)."""
    other, site = machine / "system-site", machine / "venv-site"
    (other / "nvidia" / "nvshmem").mkdir(parents=True)  # NVSHMEM's wheel, no nvcc there
    nvcc = _nvcc(site / "nvidia" / layout)
    _nvidia_package(monkeypatch, other, site)
    assert build.find_nvcc() == nvcc


def test_search_order(machine, monkeypatch):
    """$CUDA_HOME, $CUDA_PATH, the package, the system toolkit, then PATH: each found only once those
    before it are gone."""
    on_path = _nvcc(machine / "on-path")
    monkeypatch.setenv("PATH", str(Path(on_path).parent))
    assert build.find_nvcc() == on_path
    system = _nvcc(machine / "usr-local-cuda")
    assert build.find_nvcc() == system
    package = _nvcc(machine / "site" / "nvidia" / "cu13")
    _nvidia_package(monkeypatch, machine / "site")
    assert build.find_nvcc() == package
    cuda_path = _nvcc(machine / "cuda-path")
    monkeypatch.setenv("CUDA_PATH", str(machine / "cuda-path"))
    assert build.find_nvcc() == cuda_path
    cuda_home = _nvcc(machine / "cuda-home")
    monkeypatch.setenv("CUDA_HOME", str(machine / "cuda-home"))
    assert build.find_nvcc() == cuda_home
    monkeypatch.setenv("CUDA_HOME", str(machine / "no-toolkit-here"))  # a home without nvcc is passed over
    assert build.find_nvcc() == cuda_path


def test_runtime_link_flags(machine):
    """The packages keep the runtime's static libraries in lib/, where nvcc looks in lib64/: the build names
    lib/ then; a toolkit's nvcc finds its own."""
    package = _nvcc(machine / "site" / "nvidia" / "cu13")
    (machine / "site" / "nvidia" / "cu13" / "lib").mkdir()
    (machine / "site" / "nvidia" / "cu13" / "lib" / "libcudart_static.a").write_bytes(b"")
    assert build.runtime_link_flags(package) == [f"-L{machine / 'site' / 'nvidia' / 'cu13' / 'lib'}"]
    assert f"-L{machine / 'site' / 'nvidia' / 'cu13' / 'lib'}" in build.compile_command(package, machine / "out.so")
    toolkit = _nvcc(machine / "toolkit")
    (machine / "toolkit" / "lib64").mkdir()
    assert build.runtime_link_flags(toolkit) == []


def test_package_toolkit_of_one_release(machine, monkeypatch):
    """nvcc's packages must match the runtime headers PyTorch pins (nvcc refuses others) and bring CCCL's
    headers: otherwise the error names the packages to install, before any build."""
    from importlib import metadata

    home = machine / "site" / "nvidia" / "cu13"
    _nvcc(home)
    versions = {"nvidia-cuda-nvcc": "13.5.37", "nvidia-cuda-runtime": "13.0.96"}

    def version(name):
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(metadata, "version", version)
    with pytest.raises(RuntimeError, match=r'nvidia-cuda-nvcc==13\.0\.\*'):
        build.check_package_toolkit(home)
    versions["nvidia-cuda-nvcc"] = "13.0.88"
    with pytest.raises(RuntimeError, match=r'nvidia-cuda-cccl==13\.0\.\*'):
        build.check_package_toolkit(home)
    (home / "include" / "nv").mkdir(parents=True)
    (home / "include" / "nv" / "target").write_text("")
    build.check_package_toolkit(home)
    _nvidia_package(monkeypatch, machine / "site")
    assert build.find_nvcc() == str(home / "bin" / "nvcc")
    versions["nvidia-cuda-runtime"] = "13.2.1"
    with pytest.raises(RuntimeError, match="nvidia-cuda-runtime 13.2.1"):
        build.find_nvcc()


def test_driver_link_flags(machine, monkeypatch):
    """A toolkit links its stub libcuda.so; the pip packages have no stub, so the driver's libcuda.so.1 is
    linked by name, from LD_LIBRARY_PATH's folders too (the linker does not search them)."""
    toolkit = _nvcc(machine / "toolkit")
    (machine / "toolkit" / "targets" / "x86_64-linux" / "lib" / "stubs").mkdir(parents=True)
    (machine / "toolkit" / "targets" / "x86_64-linux" / "lib" / "stubs" / "libcuda.so").write_bytes(b"")
    assert build.driver_link_flags(toolkit) == ["-lcuda"]
    package = _nvcc(machine / "site" / "nvidia" / "cu13")
    assert build.driver_link_flags(package) == ["-l:libcuda.so.1"]
    driver = machine / "driver-libs"
    driver.mkdir()
    (driver / "libcuda.so.1").write_bytes(b"")
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{machine / 'elsewhere'}:{driver}")
    assert build.driver_link_flags(package) == [f"-L{driver}", "-l:libcuda.so.1"]
    assert build.compile_command(package, machine / "out.so")[-2:] == [f"-L{driver}", "-l:libcuda.so.1"]
