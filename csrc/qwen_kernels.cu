// nvcc entry point of the CUDA kernels: launches the device code of qwen_kernels.cuh and qwen_gated_delta_kernels.cuh on a stream.
//
// Only CUDA headers are included here (no torch), so this file compiles quickly; qwen_ops.cpp
// turns tensors into the parameter structs of qwen_kernels.h and calls the launchers below.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <utility>

#include "qwen_kernels.cuh"
#include "qwen_gated_delta_kernels.cuh"

namespace qwen_cuda {
namespace {

// launch(kernel, grid, block, args...) -> kernel<<<grid, block, 0, stream>>>(args...)
struct StreamLaunch {
  cudaStream_t stream;
  template <class... P, class... A>
  void operator()(void (*kernel)(P...), dim3 grid, dim3 block, A&&... args) const {
    kernel<<<grid, block, 0, stream>>>(std::forward<A>(args)...);
  }
};

}  // namespace

bool launch_kv_write(const KvWriteParams& p, void* stream) {
  StreamLaunch launch{static_cast<cudaStream_t>(stream)};
  return dispatch_kv_write(p, launch);
}

bool launch_slot_attention(const AttentionParams& p, void* stream) {
  StreamLaunch launch{static_cast<cudaStream_t>(stream)};
  return dispatch_slot_attention(p, launch);
}

bool launch_causal_conv1d(const ConvParams& p, void* stream) {
  StreamLaunch launch{static_cast<cudaStream_t>(stream)};
  return dispatch_causal_conv1d(p, launch);
}

bool launch_gated_delta_rule(const DeltaParams& p, void* stream) {
  StreamLaunch launch{static_cast<cudaStream_t>(stream)};
  return dispatch_gated_delta_rule(p, launch);
}

}  // namespace qwen_cuda
