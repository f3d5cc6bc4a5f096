#!/usr/bin/env bash
# Where the low-latency kernels' time goes inside them (GPU machine, one GPU is enough): Nsight Compute
# over scripts/ll_profile.py at one rank, per token count: each kernel's stall reasons, and its SASS
# lines (with their CUDA source lines, built with -lineinfo) ranked by warp-stall samples.
# Text summaries under $OUT/ncu-ll-T<tokens>.txt (the .ncu-rep reports stay in /tmp: too large).
# Usage: bash scripts/ncu_ll.sh [tokens...]   (default: 1 128)
#   NCU_KERNELS=regex  kernels to profile [dispatch_fused|combine_send|combine_recv]
#   NCU_SKIP=N         launches of those to skip first (warm-up) [3]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
kernels=${NCU_KERNELS:-dispatch_fused|combine_send|combine_recv}
status=0
for t in "${@:-1 128}"; do
  for tokens in $t; do
    rep=/tmp/ncu-ll-T$tokens
    # --clock-control none: the clocks stay as they are (the device notes ask for it).
    timeout 280 ncu --clock-control none --set full --import-source yes --target-processes all \
      -k "regex:$kernels" --launch-skip "${NCU_SKIP:-3}" --launch-count 3 -f -o "$rep" \
      python3 scripts/ll_profile.py --ranks 1 --tokens "$tokens" > "/tmp/ncu-ll-T$tokens.log" 2>&1 || status=1
    tail -3 "/tmp/ncu-ll-T$tokens.log"
    python3 scripts/ncu_summary.py "$rep.ncu-rep" > "$OUT/ncu-ll-T$tokens.txt" 2>&1 || status=1
    head -c 6000 "$OUT/ncu-ll-T$tokens.txt"
  done
done
exit $status
