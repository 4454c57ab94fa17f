// gemmfuse::run on CUDA tensors: the CUDA executor on the current stream, no host sync.
#ifdef GEMMFUSE_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda_executor.h"
#include "operand_cache.h"
#include "run_call.h"

namespace gemmfuse::bindings {

at::Tensor run_on_cuda(const CallInputs& in, float* saved) {
  static CudaExecutor executor;
  c10::cuda::CUDAGuard guard(in.x.device());
  RunArgs args;
  args.stream = c10::cuda::getCurrentCUDAStream(in.x.device().index()).stream();
  args.saved = saved;
  return execute(executor, in, [&] {
    // x, W, b and the output in the model's dtype; operands fp32 (a no-op for fp32 params,
    // converted once per version for 16-bit ones); running statistics as the module keeps them.
    CallTensors t{in.x.contiguous(), in.weight.contiguous(),
                  in.bias ? in.bias->contiguous() : at::Tensor(), {}};
    for (const auto& o : in.operands) t.operands.push_back(fp32_operand(o));
    return t;
  }, std::move(args), StateViews::Native16Bit::Yes);
}

}  // namespace gemmfuse::bindings
#endif  // GEMMFUSE_WITH_CUDA
