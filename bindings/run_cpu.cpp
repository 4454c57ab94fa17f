// gemmfuse::run on CPU tensors: the CPU executor (fp32 throughout), with PyTorch's BLAS for
// the GEMM.
#include <ATen/ATen.h>
#include <dlfcn.h>

#include <climits>

#include "cpu_executor.h"
#include "run_call.h"

namespace gemmfuse::bindings {
namespace {

// The BLAS that PyTorch links (MKL on x86 builds) exports the Fortran sgemm_; calling it
// directly skips three tensor wrappers and a dispatch, and a GEMM this small runs on one
// thread (MKL would start its thread team for a 8 x 64 x 64 product, a cost larger than the
// product's; docs/measurements.md, "Host cost per fused chain call"). Where the symbols are
// missing (another BLAS), at::mm_out runs.
using Sgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*,
                       const float*, const int*, const float*, const int*, const float*, float*,
                       const int*);
using SetLocalThreads = int (*)(int);
constexpr int64_t kOneThreadFlops = int64_t(1) << 18;  // 2·M·N·K below this: one thread

struct Blas {
  Sgemm sgemm = reinterpret_cast<Sgemm>(dlsym(RTLD_DEFAULT, "sgemm_"));
  SetLocalThreads local_threads =
      reinterpret_cast<SetLocalThreads>(dlsym(RTLD_DEFAULT, "MKL_Set_Num_Threads_Local"));
};

bool fits_int(int64_t v) { return v > 0 && v <= INT_MAX; }

// y[M, N] = x[M, K] · w[N, K]ᵀ, row-major: in column-major terms yᵀ = w · xᵀ, that is
// C[N, M] = op(A)·B with A = wᵀ stored [K, N] (transposed) and B = xᵀ stored [K, M].
void blas_gemm(int64_t M, int64_t N, int64_t K, const float* x, const float* w, float* y) {
  static const Blas blas;
  if (blas.sgemm && fits_int(M) && fits_int(N) && fits_int(K) && fits_int(M * N)) {
    const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
    const float one = 1.f, zero = 0.f;
    const bool one_thread = 2 * M * N * K < kOneThreadFlops && blas.local_threads;
    const int before = one_thread ? blas.local_threads(1) : 0;
    blas.sgemm("T", "N", &m, &n, &k, &one, w, &k, x, &k, &zero, y, &m);
    if (one_thread) blas.local_threads(before);
    return;
  }
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
