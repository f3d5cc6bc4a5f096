"""The `deep_ep` shim (shim/, the epcomm-deep-ep distribution) installed as pip installs it: found by
find_spec in spawned processes, its names epcomm's own objects, previous_event taken by duck typing, and
never standing in for a real DeepEP. Each check runs in a fresh interpreter with the install on its path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The shim installed by pip into a folder of its own (built from a copy: a build writes beside its
    sources). No build isolation, so no index is needed."""
    tmp = tmp_path_factory.mktemp("shim")
    source = tmp / "src"
    shutil.copytree(ROOT / "shim", source)
    target = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "--target", str(target), str(source)],
                   check=True, capture_output=True, text=True, timeout=300)
    return target


def _python(code: str, path: list[Path], tmp_path: Path) -> subprocess.CompletedProcess:
    """Run ``code`` as a script in a fresh interpreter whose sys.path starts with ``path`` then epcomm's
    checkout; from a folder of its own, so nothing else named deep_ep is near."""
    script = tmp_path / "script" / "main.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*path, ROOT])), "EPCOMM_BACKEND": "reference"}
    return subprocess.run([sys.executable, str(script)], env=env, cwd=script.parent, capture_output=True,
                          text=True, timeout=120)


def _fake_deep_ep(folder: Path) -> Path:
    """A stand-in for a real DeepEP package in ``folder`` (a site directory)."""
    (folder / "deep_ep").mkdir(parents=True)
    (folder / "deep_ep" / "__init__.py").write_text("REAL = True\n")
    return folder


def test_found_everywhere_and_epcomm_objects(site, tmp_path):
    result = _python("""
        import importlib.util, json, multiprocessing


        def origin(name):
            return importlib.util.find_spec(name).origin


        if __name__ == "__main__":
            import importlib.metadata
            import torch
            import torch.distributed as dist

            import deep_ep
            import epcomm
            import epcomm.event
            from deep_ep import Buffer, Config, EventOverlap, topk_idx_t
            from deep_ep.buffer import Buffer as ModuleBuffer, EventHandle as ModuleEventHandle
            from deep_ep.utils import EventHandle, EventOverlap as UtilsEventOverlap

            same = {"Buffer": Buffer is epcomm.Buffer, "Config": Config is epcomm.Config,
                    "EventOverlap": EventOverlap is UtilsEventOverlap is epcomm.EventOverlap,
                    "topk_idx_t": topk_idx_t is epcomm.topk_idx_t,
                    "EventHandle": EventHandle is ModuleEventHandle is epcomm.event.EventHandle,
                    "buffer.Buffer": ModuleBuffer is epcomm.Buffer, "utils": deep_ep.utils.EventHandle is EventHandle}
            # vLLM's workers are spawned and look for DeepEP with find_spec.
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                spawned = pool.apply(origin, ("deep_ep",))

            # A caller's EventOverlap of another class (an alias import loads a second copy): only .event counts.
            class CallersEventOverlap:
                event = None

            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            buffer = deep_ep.Buffer(dist.group.WORLD, 1 << 20)
            topk_idx = torch.tensor([[0, 1], [2, 3]], dtype=topk_idx_t)
            per_rank = buffer.get_dispatch_layout(topk_idx, 4, previous_event=CallersEventOverlap())[0]
            try:
                buffer.get_dispatch_layout(topk_idx, 4, previous_event="event")
                refused = ""
            except TypeError as e:
                refused = str(e)
            buffer.destroy()
            dist.destroy_process_group()
            print(json.dumps({"same": same, "spawned": spawned, "here": origin("deep_ep"),
                              "version": deep_ep.__version__, "tokens": per_rank.tolist(), "refused": refused,
                              "dist": importlib.metadata.distribution("epcomm-deep-ep").version}))
    """, [site], tmp_path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(out["same"].values()), out["same"]
    assert out["spawned"] == out["here"] == str(site / "deep_ep" / "__init__.py")
    assert out["version"].startswith("1.2.1+epcomm.") and out["dist"] == "0.1.0"
    assert out["tokens"] == [2]
    assert out["refused"].startswith("previous_event must be an EventOverlap")


def test_never_stands_in_for_a_real_deep_ep(site, tmp_path):
    """A real DeepEP earlier on the path is the one imported; later on the path, or its extension
    deep_ep_cpp, or its distribution's metadata: the shim refuses to load (RuntimeError naming it),
    before importing epcomm."""
    probe = """
        import sys
        try:
            import deep_ep
            print("imported", deep_ep.__file__, getattr(deep_ep, "REAL", False))
        except RuntimeError as e:
            print("refused", "epcomm" in sys.modules, e)
    """
    real = _fake_deep_ep(tmp_path / "real")
    ahead = _python(probe, [real, site], tmp_path)
    assert ahead.stdout.startswith(f"imported {real / 'deep_ep' / '__init__.py'} True"), ahead.stdout + ahead.stderr

    later = _python(probe, [site, real], tmp_path)
    assert later.stdout.startswith("refused False"), later.stdout + later.stderr
    assert f"another deep_ep package at {real / 'deep_ep'}" in later.stdout
    assert "pip uninstall epcomm-deep-ep" in later.stdout

    extension = tmp_path / "extension"
    extension.mkdir()
    (extension / "deep_ep_cpp.py").write_text("")
    refused = _python(probe, [site, extension], tmp_path)
    assert refused.stdout.startswith("refused False") and "deep_ep_cpp" in refused.stdout, refused.stdout

    metadata = tmp_path / "metadata"
    (metadata / "deep_ep-1.2.1.dist-info").mkdir(parents=True)
    (metadata / "deep_ep-1.2.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: deep_ep\n"
                                                                   "Version: 1.2.1\n")
    refused = _python(probe, [site, metadata], tmp_path)
    assert refused.stdout.startswith("refused False") and "deep_ep 1.2.1" in refused.stdout, refused.stdout

    # A second copy of the shim itself (its source tree beside the install) is not DeepEP.
    copy = tmp_path / "copy"
    shutil.copytree(site / "deep_ep", copy / "deep_ep")
    both = _python("import deep_ep, epcomm\nprint(deep_ep.Buffer is epcomm.Buffer)", [site, copy], tmp_path)
    assert both.stdout.strip() == "True", both.stdout + both.stderr
