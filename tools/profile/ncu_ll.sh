#!/usr/bin/env bash
# Profiles the low-latency kernels with Nsight Compute: each kernel's stall reasons and hottest SASS lines.
#
# One GPU is enough: tools/profile/ll_profile.py at one rank, per token count; the SASS lines come
# with their CUDA source lines (built with -lineinfo), ranked by warp-stall samples.
# Text summaries under $OUT/ncu-ll-T<tokens>.txt (OUT defaults to /tmp/epcomm-ncu; the .ncu-rep
# reports stay in /tmp: too large).
# Usage: bash tools/profile/ncu_ll.sh [tokens...]   (default: 1 128)
#   NCU_KERNELS=regex  kernels to profile [dispatch|combine]
#   NCU_SKIP=N         launches of those to skip first (warm-up) [3]
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/ci/gpu_env.sh /tmp/epcomm-ncu
kernels=${NCU_KERNELS:-dispatch|combine}
status=0
for t in "${@:-1 128}"; do
  for tokens in $t; do
    rep=/tmp/ncu-ll-T$tokens
    # --clock-control none: the clocks stay as they are (the kernels are timed at the clocks they run at).
    timeout 280 ncu --clock-control none --set full --import-source yes --target-processes all \
      -k "regex:$kernels" --launch-skip "${NCU_SKIP:-3}" --launch-count 3 -f -o "$rep" \
      python3 tools/profile/ll_profile.py --ranks 1 --tokens "$tokens" > "/tmp/ncu-ll-T$tokens.log" 2>&1 || status=1
    tail -3 "/tmp/ncu-ll-T$tokens.log"
    python3 tools/profile/ncu_summary.py "$rep.ncu-rep" > "$OUT/ncu-ll-T$tokens.txt" 2>&1 || status=1
    head -c 6000 "$OUT/ncu-ll-T$tokens.txt"
  done
done
exit $status
