# Sourced by the GPU machine's scripts (gpu_check.sh, sanitize.sh, variants.sh): one place for the
# settings every run there needs. NVLink multicast stays off (it can take the shared host down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/epcomm-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export EPCOMM_CACHE_DIR=${EPCOMM_CACHE_DIR:-/tmp/epcomm-cache}
