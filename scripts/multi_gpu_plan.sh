#!/usr/bin/env bash
# What the open issues still owe on a machine with several GPUs (every measurement so far since the
# early EP2 runs was made on one GPU), as steps that each fit one device call (600 s). Run them in
# order; each packs its logs and JSON into $OUT/STEP.tgz (the device tool returns 8 files at most)
# and prints the tables.
# Usage (on the device machine): STEP=tests|tests2|tests4|normal|tokens|split|combineshare|fp8share|dispatchshare|probe|flags|flagwarp|profile|ll|llab|llpartials|llbase|hier bash scripts/multi_gpu_plan.sh <local sha>
#   tests   the GPU tests at the machine's real rank counts (CUDA IPC and NVSHMEM across GPUs:
#           cross-GPU memory ordering, which ranks sharing one GPU cannot show): intranode, low
#           latency, reliability                                                       #3 #4 #8
#   tests2  the same for hierarchical, NVSHMEM, the drop-in patterns, backend="auto" on distinct
#           GPUs and the MoE layer's autograd through the kernels                      #3 #5 #8
#   normal  intranode normal mode: 8/16/24 SMs at 4096 tokens, BF16 and FP8, NCCL beside it  #3 #8
#   tokens  the same at 24 SMs, 512-16384 tokens                                       #3 #8
#   split   the SM split at 24 SMs: auto (the default), the fixed 50%/33% of before 2026-11-24,
#           one sending SM more and fewer than auto (cached dispatch and combine), and two more and
#           fewer for the combine (its sender/reducer rate ratio is from 2 ranks), the FP8 fresh
#           dispatch's share (from 4 ranks) against the BF16 one and one sender fewer, and the combine
#           senders' words in flight (kCombineSendUnroll 4 or 8)                       #3 #8
#   ll      low latency, 1-256 tokens: base (the defaults: partial sums from 64 tokens), the
#           combine per expert and by partial sums at every token count, partial sums in two
#           kernels (kFusedPartials off), block receive forced off and on (the auto rules of
#           EPCOMM_LL_COMBINE_PARTIALS and _BLOCK_RECEIVE come from it)                #4 #8
#   llbase  low latency at the defaults only, 1-256 tokens (the issue's table; ll A/Bs all variants)  #4 #8
#   tests4  the GPU tests at 4 ranks only (cases at 1, 2 and 8 ranks deselected: they ran on fewer GPUs):
#           intranode, low latency, reliability, hierarchical, NVSHMEM                 #3 #4 #5
#   combineshare  the combine's senders swept at 24 SMs, BF16: auto -3 .. +3 at 4096 tokens,
#           auto -1 .. +2 at 16384 (the sender/reducer rate of _COMBINE_REDUCE_PER_SEND is from 2 ranks)  #3 #8
#   fp8share  the fresh FP8 dispatch's senders swept at 24 SMs, 4096 tokens: auto -2 .. +4 (its rate is
#           from 4 ranks); dispatchshare the same for SHARE_DTYPE (bf16) at SHARE_SMS (16) #3 #8
#   probe   where a normal-mode call's time goes at this rank count: NVLink rates by SMs (scripts/nvlink_rate.cu:
#           push / push with a flag per row / push a peer per warp / pull, 16- and 128-byte-aligned slots,
#           cudaMemcpyPeer beside) and the kernels' times (scripts/normal_profile.py) (the slot
#           alignment A/B it ran is in flags since 128 became the default)              #3 #8
#   flags   the combine senders' flag batch (kCombineFlagBatch rows published by one fence; 1 = a release
#           per row), the row slots 16-byte aligned against 128, at 24 SMs, BF16, and the hierarchical
#           error-path tests that need ranks on distinct GPUs (a rank that raised early must not hold
#           the others)                                                                 #3 #5
#   flagwarp  how the senders' rows could be published over NVLink: scripts/flag_rate.cu at 8-24 SMs
#           (no flags / a release per row as the dispatch / a fence per two rows as the combine, with
#           an acq_rel or a release fence / a flag warp per block publishing for the other 15, its
#           posts by st.release.cta or by mbarrier arrives, with each row's publish lag). On one GPU
#           (local stores) the flag warps lost (2026-12-06); if they win here, the kernels' version is
#           commit cda2c4d (EPCOMM_SEND_FLAG_WARP, removed since)                        #3 #8
#   profile where the time goes at this rank count: the low-latency phase timeline and kernels at 1 and
#           128 tokens (scripts/ll_profile.py), the normal-mode kernels at 4096 (normal_profile.py)  #3 #4
#   llab    the partial sums' tests (a dead peer in one too) and the LL benchmark at the defaults  #4 #8
#           (the balanced receive and partial-sums A/B it ran before: bench/results/*-llab-d178721*)
#   llpartials  low latency with the combine per expert (EPCOMM_LL_COMBINE_PARTIALS=0) against by
#           partial sums per (token, rank) (=1: fewer bytes over NVLink) at every token count, 1-256
#           (the default, auto, takes partial sums from 64 tokens)                             #4 #8
#   hier    hierarchical normal mode on every split of the machine into domains (2x2 and 4x1 on 4
#           GPUs; 2x4, 4x2 and 8x1 on 8; HIER_SPLITS='k ...' picks some), direct, node-limited to half
#           of the domains, and NVSHMEM-put (HIER_PUT=0: not) transports, per-tier bytes  #5 #8
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
sha=${1:?usage: STEP=... bash scripts/multi_gpu_plan.sh <local commit sha> (the git of the device copy is stale)}
step=${STEP:?set STEP to tests, tests2, tests4, normal, tokens, split, combineshare, fp8share, dispatchshare, probe, flags, flagwarp, profile, ll, llab, llpartials, llbase or hier}
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
out=$(mktemp -d)/$step
mkdir -p "$out"
pack() {  # everything the step wrote, in one file
  tar czf "$OUT/$step.tgz" -C "$(dirname "$out")" "$step" && echo "multi_gpu_plan: packed $OUT/$step.tgz"
}
trap pack EXIT
echo "multi_gpu_plan: step $step, $gpus GPUs, commit $sha"
python3 -m epcomm.backends.cuda.build 2>&1 | tail -3 || exit 1
bench() {  # bench NAME ARGS...: the benchmark at every GPU, JSON and table into $out
  local name=$1
  shift
  timeout "${BENCH_TIMEOUT_S:-200}" python3 -m epcomm.bench --backend cuda --commit "$sha" --json "$out/$name.json" "$@" \
    2>&1 | tee "$out/$name.log" | grep -E "^ *(normal|low_latency) |rror" | grep -v nccl-a2a
}
status=0
case $step in
  tests)
    EPCOMM_TEST_BACKEND=nccl timeout -s INT -k 30 "${TEST_TIMEOUT_S:-540}" python3 -m pytest -q -rf -p no:cacheprovider \
      tests/test_intranode_cuda.py tests/test_low_latency_cuda.py tests/test_reliability_cuda.py -k 'not fuzz' \
      2>&1 | tee "$out/tests.log" | tail -15 || status=1
    ;;
  tests4)
    EPCOMM_TEST_BACKEND=nccl timeout -s INT -k 30 "${TEST_TIMEOUT_S:-540}" python3 -m pytest -q -rf -p no:cacheprovider \
      tests/test_intranode_cuda.py tests/test_low_latency_cuda.py tests/test_reliability_cuda.py \
      tests/test_hierarchical_cuda.py tests/test_nvshmem_cuda.py --durations=15 \
      -k 'not -1] and not -2] and not -8] and not [1] and not [2] and not [8] and not fuzz' \
      2>&1 | tee "$out/tests.log" | tail -40 || status=1
    ;;
  tests2)
    EPCOMM_TEST_BACKEND=nccl timeout -s INT -k 30 "${TEST_TIMEOUT_S:-540}" python3 -m pytest -q -rf -p no:cacheprovider \
      tests/test_hierarchical_cuda.py tests/test_nvshmem_cuda.py tests/test_dropin.py tests/test_backend_choice.py \
      tests/test_autograd.py 2>&1 | tee "$out/tests.log" | tail -15 || status=1
    ;;
  normal)
    bench sms --modes normal --num-sms 8,16,24 || status=1
    ;;
  tokens)
    bench tokens --modes normal --num-sms 24 --tokens 512,1024,2048,4096,8192,16384 || status=1
    ;;
  combineshare)
    # the combine's senders at 24 SMs, BF16, every count from 3 below auto to 3 above at 4096 tokens
    # (COMBINE_ROUNDS rounds in turn, 1 unless set), then auto -1 .. +2 at 16384 (_COMBINE_REDUCE_PER_SEND
    # is from 2 ranks)
    auto=$(python3 -c "from epcomm.backends.cuda.intranode import send_blocks as s; import torch; \
print(s('combine', torch.cuda.device_count(), 24))")
    for round in $(seq "${COMBINE_ROUNDS:-1}"); do
      for k in -3 -2 -1 0 1 2 3; do
        n=$((auto + k))
        EPCOMM_COMBINE_SEND_SMS_PCT=$(python3 -c "print(f'{$n / 24 * 100:.2f}')") \
          bench "combine-senders-$n-r$round" --modes normal --num-sms 24 --dtype bf16 || status=1
      done
    done
    for k in -1 0 1 2; do
      n=$((auto + k))
      EPCOMM_COMBINE_SEND_SMS_PCT=$(python3 -c "print(f'{$n / 24 * 100:.2f}')") \
        bench "combine-senders-$n-16384" --modes normal --num-sms 24 --dtype bf16 --tokens 16384 || status=1
    done
    ;;
  fp8share | dispatchshare)
    # the fresh dispatch's senders: fp8share the FP8 rows' at 24 SMs (_FP8_RECEIVE_PER_SEND, measured at
    # 4 ranks), dispatchshare those of SHARE_DTYPE (bf16) rows at SHARE_SMS (16); 4096 tokens, auto plus
    # the offsets of SHARE_STEPS (the variable moves the fused (cached) dispatch's senders too: read the
    # fresh column)
    if [ "$step" = fp8share ]; then dtype=fp8 sms=24; else dtype=${SHARE_DTYPE:-bf16} sms=${SHARE_SMS:-16}; fi
    work=$([ "$dtype" = fp8 ] && echo dispatch_fp8 || echo dispatch_split)
    auto=$(python3 -c "from epcomm.backends.cuda.intranode import send_blocks as s; import torch; \
print(s('$work', torch.cuda.device_count(), $sms))")
    i=0
    for k in ${SHARE_STEPS:--2 -1 0 1 2 4}; do  # (an offset given twice runs twice: rounds in turn)
      n=$((auto + k)) i=$((i + 1))
      EPCOMM_DISPATCH_SEND_SMS_PCT=$(python3 -c "print(f'{$n / $sms * 100:.2f}')") \
        bench "$dtype-$sms-sms-senders-$n-run$i" --modes normal --num-sms "$sms" --dtype "$dtype" || status=1
    done
    ;;
  split)
    # the SM split: auto (send_blocks, the default) against the fixed 50% / 33% of before 2026-11-24,
    # and one sender more and one fewer than auto gives at this rank count (the fused (cached)
    # dispatch's share: its senders write the own rows at 1-2 ranks, dispatch_own)
    bench split-auto --modes normal --num-sms 24 || status=1
    EPCOMM_DISPATCH_SEND_SMS_PCT=50 EPCOMM_COMBINE_SEND_SMS_PCT=33 bench split-fixed --modes normal --num-sms 24 \
      || status=1
    read -r more fewer < <(python3 -c "from epcomm.backends.cuda.intranode import send_blocks as s; \
import torch; r = torch.cuda.device_count(); d, c = s('dispatch_own' if r <= 2 else 'dispatch', r, 24), \
s('combine', r, 24); p = lambda blocks, k: min(23, max(1, blocks + k)) / 24 * 100; \
print(f'{p(d, 1):.1f},{p(c, 1):.1f}', f'{p(d, -1):.1f},{p(c, -1):.1f}')")
    EPCOMM_DISPATCH_SEND_SMS_PCT=${more%,*} EPCOMM_COMBINE_SEND_SMS_PCT=${more#*,} bench split-more --modes normal \
      --num-sms 24 || status=1
    EPCOMM_DISPATCH_SEND_SMS_PCT=${fewer%,*} EPCOMM_COMBINE_SEND_SMS_PCT=${fewer#*,} bench split-fewer --modes normal \
      --num-sms 24 || status=1
    # the combine's sender rate against its reducers' (_COMBINE_REDUCE_PER_SEND) was measured at 2 ranks only:
    # two senders more and fewer than auto too, BF16 (the combine is the same for both dtypes)
    read -r more2 fewer2 < <(python3 -c "from epcomm.backends.cuda.intranode import send_blocks as s; \
import torch; c = s('combine', torch.cuda.device_count(), 24); \
p = lambda k: min(23, max(1, c + k)) / 24 * 100; print(f'{p(2):.1f}', f'{p(-2):.1f}')")
    EPCOMM_COMBINE_SEND_SMS_PCT=$more2 bench split-combine-more2 --modes normal --num-sms 24 --dtype bf16 || status=1
    EPCOMM_COMBINE_SEND_SMS_PCT=$fewer2 bench split-combine-fewer2 --modes normal --num-sms 24 --dtype bf16 || status=1
    # the FP8 dispatch's share (_FP8_RECEIVE_PER_SEND, measured at 4 ranks): auto against the BF16 share and
    # one sender fewer than auto (fresh and cached dispatch take the same share: read both columns)
    read -r f8bf16 f8fewer < <(python3 -c "from epcomm.backends.cuda.intranode import send_blocks as s; \
import torch; r = torch.cuda.device_count(); b, f = s('dispatch', r, 24), s('dispatch_fp8', r, 24); \
print(f'{b / 24 * 100:.1f}', f'{max(1, f - 1) / 24 * 100:.1f}')")
    EPCOMM_DISPATCH_SEND_SMS_PCT=$f8bf16 bench split-fp8-bf16-share --modes normal --num-sms 24 --dtype fp8 || status=1
    EPCOMM_DISPATCH_SEND_SMS_PCT=$f8fewer bench split-fp8-fewer --modes normal --num-sms 24 --dtype fp8 || status=1
    # the combine senders' words in flight (kCombineSendUnroll 4 against 8), each at auto and two senders fewer
    # (more words in flight per sender may want fewer senders)
    OUT=$out VARIANT_TIMEOUT_S=120 bash scripts/variants.sh 'send4' \
      'send8|epcomm/csrc/kernels/intranode.cu|s/constexpr int kCombineSendUnroll = 4;/constexpr int kCombineSendUnroll = 8;/' \
      'send4-fewer2|env|EPCOMM_COMBINE_SEND_SMS_PCT='"$fewer2" \
      'send8-fewer2|epcomm/csrc/kernels/intranode.cu|s/constexpr int kCombineSendUnroll = 4;/constexpr int kCombineSendUnroll = 8;/|env|EPCOMM_COMBINE_SEND_SMS_PCT='"$fewer2" \
      -- --backend cuda --modes normal --num-sms 24 --dtype bf16 --commit "$sha" || status=1
    ;;
  ll)
    OUT=$out VARIANT_TIMEOUT_S=120 bash scripts/variants.sh base \
      'combine-per-expert|env|EPCOMM_LL_COMBINE_PARTIALS=0' 'partials|env|EPCOMM_LL_COMBINE_PARTIALS=1' \
      'partials-two-kernels|env|EPCOMM_LL_COMBINE_PARTIALS=1|epcomm/csrc/kernels/low_latency.cuh|s/constexpr bool kFusedPartials = true;/constexpr bool kFusedPartials = false;/' \
      'unit|env|EPCOMM_LL_BLOCK_RECEIVE=0' 'block|env|EPCOMM_LL_BLOCK_RECEIVE=1' \
      -- --backend cuda --modes low_latency --ll-tokens 1,32,64,96,128,256 --commit "$sha" || status=1
    ;;
  probe)
    nvcc -O3 -std=c++17 -arch=sm_90 -o "$out/nvlink_rate" scripts/nvlink_rate.cu && timeout 120 "$out/nvlink_rate" \
      | tee "$out/nvlink_rate.jsonl" || status=1
    timeout 150 python3 scripts/normal_profile.py --ranks "$gpus" --tokens 4096 --num-sms 24 > "$out/profile.txt" 2>&1 \
      || status=1
    grep -iE "kernel|us" "$out/profile.txt" | head -40
    ;;
  flags)
    EPCOMM_TEST_BACKEND=nccl timeout -s INT -k 30 "${TEST_TIMEOUT_S:-240}" python3 -m pytest -q -rf -p no:cacheprovider \
      tests/test_hierarchical_cuda.py --durations=8 -k 'mismatched or given_up or refused' \
      2>&1 | tee "$out/tests-hier-errors.log" | tail -15 || status=1
    flag=epcomm/csrc/kernels/intranode.cu
    OUT=$out VARIANT_TIMEOUT_S=120 bash scripts/variants.sh 'combine-batch2' \
      "combine-batch1|$flag|s/constexpr int kCombineFlagBatch = 2;/constexpr int kCombineFlagBatch = 1;/" \
      "combine-batch4|$flag|s/constexpr int kCombineFlagBatch = 2;/constexpr int kCombineFlagBatch = 4;/" \
      -- --backend cuda --modes normal --num-sms 24 --dtype bf16 --commit "$sha" || status=1
    # the row slots 16-byte aligned (before 2026-11-27 session 2) against 128 (the default)
    cp epcomm/backends/cuda/intranode.py "$out/intranode.py.orig"
    sed -i -e 's/^_ROW_ALIGN = 128$/_ROW_ALIGN = 16/' epcomm/backends/cuda/intranode.py
    if grep -q '^_ROW_ALIGN = 16$' epcomm/backends/cuda/intranode.py; then
      bench align16 --modes normal --num-sms 24 --dtype bf16 || status=1
    else
      echo "multi_gpu_plan: the align16 edit did not apply"; status=1
    fi
    cp "$out/intranode.py.orig" epcomm/backends/cuda/intranode.py
    ;;
  flagwarp)
    nvcc -O3 -std=c++17 -arch=sm_90 -o "$out/flag_rate" scripts/flag_rate.cu && timeout 150 "$out/flag_rate" \
      | tee "$out/flag_rate.jsonl" || status=1
    ;;
  profile)
    timeout 200 python3 scripts/ll_profile.py --ranks "$gpus" --tokens 1,128 > "$out/ll_profile.txt" 2>&1 || status=1
    grep -E "graph step|phase|  (dispatch|combine)|_fused|_send|_recv" "$out/ll_profile.txt" | grep "rank 0" | head -70
    timeout 150 python3 scripts/normal_profile.py --ranks "$gpus" --tokens 4096 --num-sms 24 > "$out/normal_profile.txt" \
      2>&1 || status=1
    grep -E "rank 0 .*(us of kernels|median|activity)" "$out/normal_profile.txt" | head -30
    ;;
  llab)
    # the combine by partial sums' tests at every rank count, the reliability test of a dead peer in
    # one, and the low-latency benchmark at the defaults, 1-256 tokens
    EPCOMM_TEST_BACKEND=nccl timeout -s INT -k 30 "${TEST_TIMEOUT_S:-200}" python3 -m pytest -q -rf -p no:cacheprovider \
      tests/test_low_latency_cuda.py tests/test_reliability_cuda.py -k 'partial' 2>&1 | tee "$out/tests-ll.log" \
      | tail -5 || status=1
    bench ll --modes low_latency --ll-tokens 1,32,64,128,256 || status=1
    ;;
  llpartials)
    OUT=$out VARIANT_TIMEOUT_S=150 bash scripts/variants.sh 'per-expert|env|EPCOMM_LL_COMBINE_PARTIALS=0' \
      'partials|env|EPCOMM_LL_COMBINE_PARTIALS=1' \
      -- --backend cuda --modes low_latency --ll-tokens 1,32,64,128,256 --commit "$sha" || status=1
    ;;
  llbase)
    bench ll --modes low_latency --ll-tokens 1,32,64,128,256 || status=1
    ;;
  hier)
    # k ranks a domain: 2x2 on 4 GPUs, 4x2 and 2x4 on 8, 2x1 on 2 (one GPU: nothing to split)
    case $gpus in
      1) echo "multi_gpu_plan: hier needs 2 or more GPUs"; exit 2 ;;
      2 | 3) splits=(1) ;;
      4 | 5 | 6 | 7) splits=(2 1) ;;
      *) splits=(2 4 1) ;;
    esac
    for k in ${HIER_SPLITS:-${splits[@]}}; do
      bench "split-k$k" --modes normal --strategies hierarchical --ranks-per-domain "$k" || status=1
      # node-limited routing (DeepSeek-V3's group-limited gating): each token's experts in half of the domains
      bench "split-k$k-g$((gpus / k / 2))" --modes normal --strategies hierarchical --ranks-per-domain "$k" \
        --groups $((gpus / k / 2)) || status=1
      [ "${HIER_PUT:-1}" = 1 ] && { EPCOMM_HIER_TRANSPORT=put bench "split-k$k-put" --modes normal \
        --strategies hierarchical --ranks-per-domain "$k" || status=1; }
    done
    ;;
  *)
    echo "multi_gpu_plan: unknown step $step (tests, tests2, tests4, normal, tokens, split, combineshare, fp8share, dispatchshare, probe, flags, profile, ll, llab, llpartials, llbase, hier)"
    exit 2
    ;;
esac
exit $status
