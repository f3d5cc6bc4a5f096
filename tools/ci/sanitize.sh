#!/usr/bin/env bash
# Runs a selection of the CUDA-kernel tests under compute-sanitizer (memcheck, racecheck, synccheck).
#
# Each rank is a child process of pytest, so the sanitizer follows all processes. The kernels' own
# waits are bounded, but the sanitizer slows them down by orders of magnitude: the tests run with a
# long EPCOMM_TIMEOUT_S and a small selection of cases from each mode's test file, chosen to reach
# every kernel (fused and split paths, hooks, graph replays, refusals, empty ranks) in ~300 s for
# the three modes and three tools together on 2 GPUs.
# Usage: bash tools/ci/sanitize.sh                     (every mode)
#        SANITIZE_SUITES="intranode" bash tools/ci/sanitize.sh
#        SANITIZE_TESTS=FILE SANITIZE_K=EXPR bash tools/ci/sanitize.sh   (one custom selection)
#        SANITIZE_TOOLS="racecheck synccheck" bash tools/ci/sanitize.sh  (some of the tools)
# Writes a summary line per mode and tool under $OUT (default /tmp/epcomm-sanitize), and the log of
# each run that failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/ci/gpu_env.sh /tmp/epcomm-sanitize
export EPCOMM_TEST_BACKEND=nccl EPCOMM_TEST_TIMEOUT_S=300
declare -A FILES=(
  [intranode]=tests/test_intranode_cuda.py
  [low_latency]=tests/test_low_latency_cuda.py
  [hierarchical]=tests/test_hierarchical_cuda.py
)
declare -A SELECTIONS=(
  [intranode]="T81 or T0- or graph or refused"
  [low_latency]="fp8-T6-H512-imbalanced-2 or bf16-T16-H512-random-2 or test_ll_cuda_hook or (test_ll_cuda_graph_replay and not serving)"
  [hierarchical]="matches_reference and 2x1 and not put"
)
if [ -n "${SANITIZE_TESTS:-}" ]; then
  FILES=([custom]=$SANITIZE_TESTS)
  SELECTIONS=([custom]=${SANITIZE_K:-})
  suites=(custom)
else
  read -r -a suites <<< "${SANITIZE_SUITES:-intranode low_latency hierarchical}"
fi
python3 -m epcomm.backends.cuda.build || exit 1
status=0
for suite in "${suites[@]}"; do
  if [ -z "${FILES[$suite]:-}" ]; then
    echo "sanitize: unknown suite '$suite' (intranode, low_latency, hierarchical)" | tee -a "$OUT/sanitize-summary.txt"
    status=1
    continue
  fi
  K_ARGS=()
  [ -n "${SELECTIONS[$suite]}" ] && K_ARGS=(-k "${SELECTIONS[$suite]}")
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
    log="$OUT/sanitize-$suite-$tool.log"
    # --report-api-errors no: NCCL probes for kernel images of other architectures at init and gets
    # cudaErrorNoKernelImageForDevice (handled inside NCCL); the kernels' own errors are still
    # reported, and epcomm checks every CUDA call it makes itself.
    timeout "${SANITIZE_TIMEOUT_S:-150}" compute-sanitizer --tool "$tool" --target-processes all \
      --report-api-errors no --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider "${FILES[$suite]}" \
      "${K_ARGS[@]}" >"$log" 2>&1
    rc=$?
    summary=$(grep -E "ERROR SUMMARY|passed|failed" "$log" | tail -3 | tr '\n' ' ')
    # A run with no test passed proves nothing: a selection that matches nothing is a failure.
    if [ $rc -eq 0 ] && ! grep -qE "[0-9]+ passed" "$log"; then
      rc=5
      summary="no test passed: $summary"
    fi
    echo "$suite $tool: exit $rc; $summary" | tee -a "$OUT/sanitize-summary.txt"
    # A passing run's log is dropped (the summary holds its result): what is left is what failed.
    if [ $rc -eq 0 ]; then rm -f "$log"; else status=1; fi
  done
done
exit $status
