// gemmfuse::run on CPU tensors: the CPU executor (fp32 throughout), with PyTorch's BLAS for
// the GEMM.
#include <ATen/ATen.h>

#include "cpu_executor.h"
#include "run_call.h"

namespace gemmfuse::bindings {
namespace {

void blas_gemm(int64_t M, int64_t N, int64_t K, const float* x, const float* w, float* y) {
  auto opts = at::TensorOptions().dtype(at::kFloat);
  auto X = at::from_blob(const_cast<float*>(x), {M, K}, opts);
  auto W = at::from_blob(const_cast<float*>(w), {N, K}, opts);
  auto Y = at::from_blob(y, {M, N}, opts);
  at::mm_out(Y, X, W.t());
}

}  // namespace

at::Tensor run_on_cpu(const CallInputs& in, float* saved) {
  static CpuExecutor executor;
  RunArgs args;
  args.cpu_gemm = blas_gemm;
  args.saved = saved;
  return execute(executor, in, [&] {
    // The CPU executor computes in fp32 on contiguous tensors.
    auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
    CallTensors t{f32(in.x), f32(in.weight), in.bias ? f32(*in.bias) : at::Tensor(), {}};
    for (const auto& o : in.operands) t.operands.push_back(f32(o));
    return t;
  }, std::move(args), StateViews::Native16Bit::No);
}

}  // namespace gemmfuse::bindings
