#!/usr/bin/env bash
# The GPU machine's one job: run the test suite on NCCL (same tests as CI, on GPUs) and the benchmark,
# writing logs and JSON under $OUT. Usage on the device machine: bash scripts/gpu_check.sh [bench args...]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/epcomm-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.txt"
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
status=0
EPCOMM_TEST_BACKEND=nccl python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee "$OUT/tests-nccl.log" \
  || status=1
python3 -m epcomm.bench --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" || status=1
exit $status
