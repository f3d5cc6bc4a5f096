"""Compare the machine code of every kernel between two trees: registers, stack, shared and local
memory per kernel (`cuobjdump -res-usage`) and the SASS with instruction addresses stripped.

A change that only moves code must leave both identical. Needs nvcc, cuobjdump and nvdisasm (no GPU);
`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm` brings the last two.

    python3 tools/ci/compare_sass.py OLD [NEW]    # git revisions, or directories; NEW defaults to the work tree

Every `*.cu` under epcomm/csrc is compiled as the libraries compile it: plainly (the IPC library), or as
relocatable code against NVSHMEM's headers with EPCOMM_NVSHMEM defined (the NVSHMEM library) where its text
names NVSHMEM, or both where it names EPCOMM_NVSHMEM. A kernel is identified by its library and mangled
name, so files may move or merge freely.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

FLAGS = ["-O3", "-std=c++17", "-lineinfo", "-gencode=arch=compute_90,code=sm_90", "-Xcompiler", "-fPIC"]


def tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia  # type: ignore[import-not-found]

        for base in nvidia.__path__:
            for candidate in Path(base).glob(f"*/bin/{name}"):
                return str(candidate)
    except ImportError:
        pass
    sys.exit(f"compare_sass: {name} not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")


def nvshmem_include() -> str | None:
    home = os.environ.get("NVSHMEM_HOME")
    candidates = [Path(home)] if home else []
    try:
        import nvidia.nvshmem as package  # type: ignore[import-not-found]

        candidates += [Path(p) for p in package.__path__]
    except ImportError:
        pass
    return next((str(c / "include") for c in candidates if (c / "include" / "nvshmem.h").exists()), None)


def checkout(spec: str, workdir: Path) -> Path:
    """A directory holding the tree `spec` names (a directory as it is, else a git revision exported)."""
    if Path(spec).is_dir():
        return Path(spec)
    target = workdir / re.sub(r"[^A-Za-z0-9._-]", "_", spec)
    target.mkdir()
    archive = subprocess.run(["git", "archive", spec, "epcomm"], capture_output=True, check=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(target, filter="data")
    return target


def compile_jobs(tree: Path, workdir: Path, nvcc: str, nvshmem: str | None) -> list[tuple[str, list[str], Path]]:
    jobs = []
    for src in sorted((tree / "epcomm" / "csrc").rglob("*.cu")):
        text = src.read_text()
        name = str(src.relative_to(tree)).replace("/", "_")
        # A source naming EPCOMM_NVSHMEM builds into both libraries; one naming NVSHMEM otherwise, into its own.
        uses_nvshmem = "nvshmem" in text.lower()
        if "EPCOMM_NVSHMEM" in text or not uses_nvshmem:
            jobs.append(("ipc", [nvcc, *FLAGS, "-c", str(src), "-o", str(workdir / (name + ".ipc.o"))],
                         workdir / (name + ".ipc.o")))
        if uses_nvshmem:
            if nvshmem is None:
                sys.exit("compare_sass: NVSHMEM headers not found (pip install nvidia-nvshmem-cu13)")
            out = workdir / (name + ".nvshmem.o")
            jobs.append(("nvshmem", [nvcc, *FLAGS, "-rdc=true", f"-I{nvshmem}", "-DEPCOMM_NVSHMEM", "-c", str(src),
                                     "-o", str(out)], out))
    return jobs


def anonymous(text: str) -> str:
    """Names of internal-linkage functions carry a hash of their file's path: drop it, so a moved file matches."""
    text = re.sub(r"__nv_static_\d+__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+_", "__nv_static_", text)
    return re.sub(r"\d*_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+", "_GLOBAL__N_", text)


def kernels(tree: Path, workdir: Path) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(library, mangled name) -> the distinct (resource usage line, SASS without addresses) of every function
    (relocatable objects each carry their own copy of the helpers they call)."""
    nvcc, cuobjdump = tool("nvcc"), tool("cuobjdump")
    os.environ["PATH"] = str(Path(tool("nvdisasm")).parent) + os.pathsep + os.environ["PATH"]
    jobs = compile_jobs(tree, workdir, nvcc, nvshmem_include())
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda job: subprocess.run(job[1], capture_output=True, text=True), jobs))
    for (_, command, _), result in zip(jobs, results):
        if result.returncode != 0:
            sys.exit(f"compare_sass: compile failed:\n{' '.join(command)}\n{result.stderr[-3000:]}")
    found: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for library, _, obj in jobs:
        usage = anonymous(subprocess.run([cuobjdump, "-res-usage", str(obj)], capture_output=True, text=True,
                                         check=True).stdout)
        per_function = dict(re.findall(r"Function (\S+):\n\s*(.*)", usage))
        sass = anonymous(subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True,
                                        check=True).stdout)
        for block in re.split(r"\n\s*Function : ", sass)[1:]:
            name, _, body = block.partition("\n")
            body = re.sub(r"/\*[0-9a-f]{4,}\*/", "", body)  # instruction addresses
            # Whitespace aside: the encodings' column moves with the longest instruction of the object.
            lines = [" ".join(line.split()) for line in body.splitlines() if line.strip() and "..." not in line]
            found.setdefault((library, name.strip()), []).append((per_function.get(name.strip(), ""), "\n".join(lines)))
    return {key: sorted(set(copies)) for key, copies in found.items()}


def kernels_of(spec: str, workdir: Path) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """kernels() of a tree; a git revision's are kept under $TMPDIR, since a commit's machine code never changes."""
    if Path(spec).is_dir():
        return kernels(Path(spec), workdir)
    commit = subprocess.run(["git", "rev-parse", spec], capture_output=True, text=True, check=True).stdout.strip()
    cache = Path(tempfile.gettempdir()) / "epcomm-compare-sass" / f"{commit}.json"
    if cache.exists():
        return {tuple(k.split(" ", 1)): [tuple(c) for c in v] for k, v in json.loads(cache.read_text()).items()}
    found = kernels(checkout(spec, workdir), workdir)
    cache.parent.mkdir(exist_ok=True)
    cache.write_text(json.dumps({" ".join(k): v for k, v in found.items()}))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new", nargs="?", default=".")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old_dir, new_dir = Path(tmp) / "old", Path(tmp) / "new"
        old_dir.mkdir()
        new_dir.mkdir()
        old, new = kernels_of(args.old, old_dir), kernels_of(args.new, new_dir)
    differ = 0
    for key in sorted(set(old) | set(new)):
        if key not in old or key not in new:
            print(f"{'only in ' + ('new' if key in new else 'old'):12} {key[0]:8} {key[1]}")
            differ += 1
        elif old[key] != new[key]:
            old_usage, new_usage = [u for u, _ in old[key]], [u for u, _ in new[key]]
            what = "resources" if old_usage != new_usage else "sass"
            print(f"{what + ' differ':12} {key[0]:8} {key[1]}")
            if what == "resources":
                print(f"    old: {old_usage}\n    new: {new_usage}")
            differ += 1
    print(f"compare_sass: {len(old)} functions in {args.old}, {len(new)} in {args.new}, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
