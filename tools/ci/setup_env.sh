#!/usr/bin/env bash
# Installs what epcomm's build, tests and benchmark need on a fresh machine (run by `make test` and `make bench`).
# With no torch present, the pinned version first (a local wheel cache may hold it), else the newest.
set -euo pipefail
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q torch
fi
missing=""
for mod in numpy pytest hypothesis ruff matplotlib; do
  "$PY" -c "import $mod" >/dev/null 2>&1 || missing="$missing $mod"
done
if [ -n "$missing" ]; then
  "$PY" -m pip install -q $missing
fi
# NVSHMEM (the transport to peers outside the NVLink domain): its headers let CI compile that
# source too; the version the kernels are tested with.
if ! "$PY" -c "import nvidia.nvshmem" >/dev/null 2>&1; then
  "$PY" -m pip install -q "nvidia-nvshmem-cu13==3.4.5" >/dev/null 2>&1 || echo "setup_env: NVSHMEM not installed"
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
