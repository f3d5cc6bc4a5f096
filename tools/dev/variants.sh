#!/usr/bin/env bash
# Measures kernel variants, each a set of sed edits of the kernel sources or environment variables, with one benchmark.
#
# Each variant is built (the build cache is keyed by the sources' hash, so each compiles once) and
# measured with the same benchmark arguments; epcomm/csrc and epcomm/include are restored after each.
# Nothing is committed: a variant that wins is then written properly, tested and measured again.
# Usage (on a GPU machine):
#   bash tools/dev/variants.sh 'NAME|FILE|SED-EXPR[|FILE|SED-EXPR...]' ... -- BENCH ARGS
# e.g.
#   bash tools/dev/variants.sh 'base' \
#     'send8|epcomm/include/epcomm/impls/intranode_combine.cuh|s/kCombineSendUnroll = 4;/kCombineSendUnroll = 8;/' \
#     -- --backend cuda --modes normal --num-sms 24
# A pair 'env|VAR=VALUE' sets an environment variable for that variant instead (A/B of a runtime
# switch, e.g. 'partials|env|EPCOMM_LL_COMBINE_PARTIALS=1'). VARIANT_CMD='...' runs that command per
# variant instead of the bench (its output goes to $OUT/variant-NAME.txt), e.g.
#   VARIANT_CMD='python3 tools/profile/ll_profile.py --ranks 1 --tokens 1,128' bash tools/dev/variants.sh ...
# Writes $OUT/variant-NAME.json per variant (OUT defaults to /tmp/epcomm-variants) and prints each
# variant's table rows; a sed edit that changes nothing is reported (a typo must not pass for a
# measured variant).
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/ci/gpu_env.sh /tmp/epcomm-variants
variants=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  variants+=("$1")
  shift
done
[ "${1:-}" = "--" ] && shift
backup=$(mktemp -d)
cp -r epcomm/csrc epcomm/include "$backup/"
status=0
for spec in "${variants[@]}"; do
  IFS='|' read -r -a parts <<< "$spec"
  name=${parts[0]}
  ok=1
  envs=()
  for ((i = 1; i + 1 < ${#parts[@]}; i += 2)); do
    file=${parts[i]}
    expr=${parts[i + 1]}
    if [ "$file" = env ]; then
      envs+=("$expr")
      continue
    fi
    before=$(md5sum "$file" | cut -d' ' -f1)
    sed -i "$expr" "$file"
    if [ "$(md5sum "$file" | cut -d' ' -f1)" = "$before" ]; then
      echo "variant $name: '$expr' changed nothing in $file: skipped"
      ok=0
    fi
  done
  if [ $ok = 1 ]; then
    echo "== variant $name ${envs[*]}"
    if [ -n "${VARIANT_CMD:-}" ]; then
      env ${envs[@]+"${envs[@]}"} timeout "${VARIANT_TIMEOUT_S:-150}" bash -c "$VARIANT_CMD" \
        > "$OUT/variant-$name.txt" 2>&1 || status=1
      grep -E "graph step|median|Error|error" "$OUT/variant-$name.txt" | head -20
    else
      env ${envs[@]+"${envs[@]}"} timeout "${VARIANT_TIMEOUT_S:-150}" python3 -m epcomm.bench \
        --json "$OUT/variant-$name.json" "$@" 2>&1 | grep -E "^ *(normal|low_latency) |Error|error" || status=1
    fi
  else
    status=1
  fi
  rm -rf epcomm/csrc epcomm/include
  cp -r "$backup/csrc" epcomm/csrc
  cp -r "$backup/include" epcomm/include
done
rm -rf "$backup"
exit $status
