#!/usr/bin/env bash
# The CUDA-kernel tests under compute-sanitizer (memcheck, racecheck, synccheck), on the GPU machine.
# Each rank is a child process of pytest, so the sanitizer follows all processes. The kernels' own
# waits are bounded, but the sanitizer slows them down by orders of magnitude: the tests run with a
# long EPCOMM_TIMEOUT_S and a small selection of cases (SANITIZE_TESTS, SANITIZE_K).
# Usage: bash scripts/sanitize.sh   (a summary under $OUT, and the log of each tool that failed)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export EPCOMM_TEST_BACKEND=nccl EPCOMM_TEST_TIMEOUT_S=300
TESTS=${SANITIZE_TESTS:-tests/test_intranode_cuda.py}
SELECT=${SANITIZE_K:-"T81 or T0- or graph or refused"}
python3 -c "from epcomm.backends.cuda.build import load_library; load_library()" || exit 1
status=0
for tool in memcheck racecheck synccheck; do
  log="$OUT/sanitize-$tool.log"
  # --report-api-errors no: NCCL probes for kernel images of other architectures at init and gets
  # cudaErrorNoKernelImageForDevice (handled inside NCCL); the kernels' own errors are still reported,
  # and epcomm checks every CUDA call it makes itself.
  timeout "${SANITIZE_TIMEOUT_S:-180}" compute-sanitizer --tool "$tool" --target-processes all --report-api-errors no \
    --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider $TESTS -k "$SELECT" >"$log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|passed|failed" "$log" | tail -3 | tr '\n' ' ')
  echo "$tool: exit $rc; $summary" | tee -a "$OUT/sanitize-summary.txt"
  # A passing tool's log is dropped (the summary holds its result): the device tool brings back
  # only a few files, and a failing log must be among them.
  if [ $rc -eq 0 ]; then rm -f "$log"; else status=1; fi
done
exit $status
