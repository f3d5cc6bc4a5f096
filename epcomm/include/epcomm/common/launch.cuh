// Host-side launch helpers shared by the libraries' launchers (csrc/). Never includes torch.
#pragma once

#include <cuda_runtime.h>

namespace epcomm {

// A launch whose blocks all run at once (or is refused): blocks that wait for one another, through
// a grid barrier or each other's signals, would otherwise wait for blocks not yet scheduled.
template <class Args>
cudaError_t launch_cooperative(void (*kernel)(Args), int blocks, int threads, size_t shared, cudaStream_t stream,
                               const Args& a) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(blocks);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = shared;
    config.stream = stream;
    cudaLaunchAttribute cooperative = {};
    cooperative.id = cudaLaunchAttributeCooperative;
    cooperative.val.cooperative = 1;
    config.attrs = &cooperative;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, a);
}

}  // namespace epcomm
