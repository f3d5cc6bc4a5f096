#!/usr/bin/env bash
# Benchmarks several commits side by side on one GPU machine, each built from its own tree, in A..Z then Z..A order.
#
# Timings from different machines or days do not compare; commits timed in turn on the same GPUs do
# (a bisect of a slowdown works this way). Each commit's tree is built with its own kernel cache and
# run with the same benchmark arguments.
#
# Two steps, so that the GPU machine needs no git history (a copy of the working tree is enough):
#   where git is:  bash tools/dev/ab_commits.sh prepare SHA...   # trees under ab/ (untracked; delete after)
#   GPU machine:   [AB_ENV_SETS='tag=VAR=VALUE ...'] [AB_TEST_K='pytest -k expression' [AB_TEST_FILES=...]]
#                  bash tools/dev/ab_commits.sh run -- BENCH ARGS
# AB_TEST_K: each tree's own GPU tests first (default file tests/test_low_latency_cuda.py), one
# summary line per tree, their logs packed as tests-SHA.log; AB_TEST_TREES='SHA ...' limits the tests
# to those trees, so a bisect's middle commits are only timed. AB_PROFILE='ARGS': after the
# benchmark, each tree's tools/profile/ll_profile.py ARGS, its rank-0 lines packed as profile-SHA.txt,
# the dispatch send's phase timeline printed.
# `run` builds every tree in parallel, then runs `python -m epcomm.bench --backend cuda --commit SHA
# --json ...` with BENCH ARGS per tree and per environment set (AB_ENV_SETS: space-separated
# tag=VAR=VALUE[,VAR=VALUE]; default: one set, no variables), twice in A..Z, Z..A order (drift
# shows), prints each run's table rows and packs every JSON and log into $OUT/ab.tgz (OUT defaults
# to /tmp/epcomm-ab). Compare two of them with python -m epcomm.bench.compare.
set -uo pipefail
cd "$(dirname "$0")/../.."
step=${1:?usage: ab_commits.sh prepare SHA... | run -- BENCH ARGS}
shift
case $step in
  prepare)
    [ $# -ge 1 ] || { echo "ab_commits: prepare needs commits"; exit 2; }
    rm -rf ab && mkdir -p ab
    for sha in "$@"; do
      full=$(git rev-parse --short "$sha^{commit}") || exit 2
      paths=()  # the tests too where the commit has them (a tree's own tests can run against it)
      for p in epcomm tools scripts tests pyproject.toml; do git cat-file -e "$full:$p" 2>/dev/null && paths+=("$p"); done
      mkdir -p "ab/$full" && git archive "$full" "${paths[@]}" | tar -x -C "ab/$full" || exit 1
      echo "$full" >> ab/TREES
      echo "ab_commits: ab/$full"
    done
    echo "ab_commits: run on the GPU machine: bash tools/dev/ab_commits.sh run -- BENCH ARGS; then rm -rf ab"
    ;;
  run)
    [ "${1:-}" = "--" ] && shift
    source tools/ci/gpu_env.sh /tmp/epcomm-ab  # each tree then runs with its own PYTHONPATH and cache
    [ -f ab/TREES ] || { echo "ab_commits: no ab/TREES (run prepare first, here)"; exit 2; }
    res=$(mktemp -d)/ab
    mkdir -p "$res"
    trap 'tar czf "$OUT/ab.tgz" -C "$(dirname "$res")" ab && echo "ab_commits: packed $OUT/ab.tgz"' EXIT
    # Only the trees `prepare` listed (ab/TREES): a tree an earlier prepare left under ab/ is not run.
    trees=$(sort -u ab/TREES)
    in_tree() {  # in_tree SHA CMD...: CMD in that commit's tree, with its own kernel cache
      local t=$1
      shift
      (cd "ab/$t" && EPCOMM_CACHE_DIR=/tmp/ab-cache-$t PYTHONPATH=$PWD "$@")
    }
    for t in $trees; do  # (the -c form, not -m epcomm.backends.cuda.build: older trees lack that entry)
      (in_tree "$t" python3 -c "from epcomm.backends.cuda.build import load_library, load_nvshmem_library; \
load_library(); load_nvshmem_library()" > "$res/build-$t.log" 2>&1 || echo "ab_commits: $t did not build (build-$t.log)") &
    done
    wait
    status=0
    if [ -n "${AB_TEST_K:-}" ]; then  # each tree's own GPU tests first (pytest -k AB_TEST_K), a line each
      for t in ${AB_TEST_TREES:-$trees}; do
        [ -d "ab/$t/tests" ] || { echo "ab_commits: $t has no tests"; continue; }
        in_tree "$t" env EPCOMM_TEST_BACKEND=nccl timeout -s INT "${AB_TEST_TIMEOUT_S:-240}" \
          python3 -m pytest -q -x -p no:cacheprovider ${AB_TEST_FILES:-tests/test_low_latency_cuda.py} \
          -k "$AB_TEST_K" > "$res/tests-$t.log" 2>&1 || status=1
        echo "ab_commits: $t tests: $(tail -1 "$res/tests-$t.log")"
      done
    fi
    read -r -a sets <<< "${AB_ENV_SETS:-base=}"
    for round in 1 2; do
      order=$trees
      [ $round = 2 ] && order=$(echo "$trees" | tac)
      for t in $order; do
        for set in "${sets[@]}"; do
          tag=${set%%=*}
          IFS=',' read -r -a envs <<< "${set#*=}"
          name=$t-$tag-$round
          in_tree "$t" env ${envs[@]+"${envs[@]}"} timeout "${AB_TIMEOUT_S:-120}" python3 -m epcomm.bench \
            --backend cuda --commit "$t" --json "$res/$name.json" "$@" > "$res/$name.log" 2>&1 || status=1
          grep -E "^ *(normal|low_latency) +epcomm" "$res/$name.log" | sed "s/^/$name: /" | tr -s ' '
        done
      done
    done
    if [ -n "${AB_PROFILE:-}" ]; then  # each tree's phase timeline (ll_profile.py), after the timing
      for t in $trees; do
        prof=tools/profile/ll_profile.py  # where the tree has it (commits before tools/: scripts/)
        [ -f "ab/$t/scripts/ll_profile.py" ] && prof=scripts/ll_profile.py
        in_tree "$t" timeout "${AB_PROFILE_TIMEOUT_S:-90}" python3 "$prof" $AB_PROFILE 2>&1 \
          | grep "^rank 0" > "$res/profile-$t.txt" || status=1
        grep -E "dispatch send|_fused" "$res/profile-$t.txt" | sed "s/^/profile $t: /"
      done
    fi
    exit $status
    ;;
  *)
    echo "ab_commits: unknown step $step (prepare, run)"
    exit 2
    ;;
esac
