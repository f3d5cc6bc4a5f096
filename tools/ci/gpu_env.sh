# Sourced by the scripts that run on a GPU machine, from the repository root: the settings every run
# there needs. Usage: source tools/ci/gpu_env.sh DEFAULT_OUT (OUT, when set, wins).
# NVLink multicast stays off: on a shared host it can take the whole machine down.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export EPCOMM_CACHE_DIR=${EPCOMM_CACHE_DIR:-/tmp/epcomm-cache}
export OUT=${OUT:-$1}
mkdir -p "$OUT"
