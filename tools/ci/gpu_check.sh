#!/usr/bin/env bash
# On a GPU machine: build the kernels, run the test suite on NCCL, then the benchmark; logs and JSON into $OUT.
#
# Usage: [OUT=DIR] bash tools/ci/gpu_check.sh [bench args...]     (OUT defaults to /tmp/epcomm-gpu-check)
#   TESTS=...           test files to run [tests];  TEST_K=...  a pytest -k expression
#   TEST_TIMEOUT_S=...  limit of the test step [420];  BENCH_TIMEOUT_S=... limit of the bench [300]
#   PRESSURE=N          then the pressure test with N random cases on the CUDA backend (bench --pressure)
#   SANITIZE=1          then tools/ci/sanitize.sh (compute-sanitizer memcheck, racecheck, synccheck)
#   BASELINE=FILE       then compare the bench's times with FILE's (one of bench/baselines/ measured on the
#                       same device kind): python -m epcomm.bench.compare, fails on a slowdown above 5%
#   HIER_PUT=1          then the bench again with EPCOMM_HIER_TRANSPORT=put (hierarchical: NVSHMEM puts to
#                       every mate, the inter-node path) into bench-put.json
#   EPCOMM_TEST_SHARE_GPUS=1  the tests at 2, 4 and 8 ranks run on fewer GPUs, ranks sharing them
#                       (tests/conftest.py): protocols and results, not timings
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/ci/gpu_env.sh /tmp/epcomm-gpu-check
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
} 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
status=0
# The commit to record in the pressure run too, when the bench was given one (a tree copied without .git).
COMMIT_ARGS=()
prev=""
for arg in "$@"; do
  [ "$prev" = "--commit" ] && COMMIT_ARGS=(--commit "$arg")
  prev=$arg
done
# Build once here, so a compile error shows plainly instead of inside every rank.
# Nothing else can run without the kernels: stop here, with the compiler's message last.
python3 -m epcomm.backends.cuda.build 2>&1 || { echo "gpu_check: the kernels did not build"; exit 1; }
# -rA: the log names every test that passed, failed or was skipped (the record of what ran).
K_ARGS=()
[ -n "${TEST_K:-}" ] && K_ARGS=(-k "$TEST_K")
# SIGINT at the limit: pytest then still prints what failed so far (SIGTERM would lose it).
EPCOMM_TEST_BACKEND=nccl timeout -s INT -k 30 "${TEST_TIMEOUT_S:-420}" python3 -m pytest -q -rA -p no:cacheprovider ${TESTS:-tests} \
  ${K_ARGS[@]+"${K_ARGS[@]}"} 2>&1 | tee "$OUT/tests-nccl.log" | grep -v "^PASSED\|^SKIPPED" || status=1
timeout "${BENCH_TIMEOUT_S:-300}" python3 -m epcomm.bench --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" \
  || status=1
if [ -n "${BASELINE:-}" ]; then
  python3 -m epcomm.bench.compare "$BASELINE" "$OUT/bench.json" 2>&1 | tee "$OUT/compare.txt" || status=1
fi
if [ "${HIER_PUT:-0}" = 1 ]; then
  EPCOMM_HIER_TRANSPORT=put timeout "${BENCH_TIMEOUT_S:-300}" python3 -m epcomm.bench --json "$OUT/bench-put.json" "$@" \
    2>&1 | tail -8 || status=1
fi
if [ "${PRESSURE:-0}" -gt 0 ]; then
  timeout "${PRESSURE_TIMEOUT_S:-300}" python3 -m epcomm.bench --backend cuda --pressure "$PRESSURE" \
    --json "$OUT/pressure.json" ${COMMIT_ARGS[@]+"${COMMIT_ARGS[@]}"} 2>&1 | tee "$OUT/pressure.log" || status=1
fi
if [ "${SANITIZE:-0}" = 1 ]; then
  bash tools/ci/sanitize.sh || status=1
fi
exit $status
