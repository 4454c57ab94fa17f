// Does the order of `fast`'s three bf16 products in one tensor-core accumulator set its error?
// x and W split as the library does (hi = bf16(v), lo = bf16(v - hi)); Y = x W^T at
// M = 1024, N = K = 8192 by cuBLAS (bf16 in, fp32 accumulation and output), as:
//   two GEMMs    xlo.Whi + xhi.Wlo over K' = 2K, then xhi.Whi added with beta = 1
//   small first  one GEMM over [xlo|xhi|xhi] . [Whi|Wlo|Whi]^T (the library's order)
//   large first  one GEMM over [xhi|xhi|xlo] . [Whi|Wlo|Whi]^T
//   library      the CUDA executor's `fast` Linear (small first, its own cuBLASLt call)
//   SGEMM        cuBLAS fp32, no TF32 (eager's error, for scale)
// Error against float64 over 16 rows (all N columns): rel = ||y - ref|| / ||ref||, max abs.
// Two data sets: the seed models' (x uniform [0, 1), W uniform +-1/sqrt(K)) and x, W normal.
// Times: median of 20 launches (CUDA events), for the record.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda_executor.h"
#include "gemmfuse/chain.h"
#include "gemmfuse/plan.h"
#include "probe_check.h"
#include "split.h"

using namespace gemmfuse;

namespace {

constexpr int64_t kM = 1024, kK = 8192, kN = 8192, kRefRows = 16;

#define CHECK_CUBLAS(x)                                                        \
  do {                                                                         \
    cublasStatus_t s_ = (x);                                                   \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                         \
      std::fprintf(stderr, "%s:%d cublas %d\n", __FILE__, __LINE__, int(s_));  \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

struct Buf {
  void* p = nullptr;
  explicit Buf(size_t n) { CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(n, 256))); }
  ~Buf() { cudaFree(p); }
  template <class T> T* as() const { return static_cast<T*>(p); }
};

// dst segment g of each row (3 segments of K) = src segment sg[g] (rows of 3K bf16).
void permute_segments(const Buf& src, const Buf& dst, int64_t rows, const int (&sg)[3], cudaStream_t st) {
  const size_t pitch = 3 * kK * 2, width = kK * 2;
  for (int g = 0; g < 3; ++g)
    CHECK_CUDA(cudaMemcpy2DAsync(dst.as<char>() + g * width, pitch, src.as<char>() + sg[g] * width,
                                 pitch, width, rows, cudaMemcpyDeviceToDevice, st));
}

struct Err {
  double rel, max_abs;
};
Err error_vs_f64(const std::vector<float>& x, const std::vector<float>& w, const Buf& y) {
  std::vector<float> got(kRefRows * kN);
  CHECK_CUDA(cudaMemcpy(got.data(), y.p, got.size() * 4, cudaMemcpyDeviceToHost));
  double num = 0, den = 0, mx = 0;
  for (int64_t i = 0; i < kRefRows * kN; ++i) {
    const int64_t r = i / kN, c = i % kN;
    double ref = 0;
    for (int64_t k = 0; k < kK; ++k) ref += double(x[r * kK + k]) * double(w[c * kK + k]);
    const double d = got[i] - ref;
    num += d * d;
    den += ref * ref;
    mx = std::max(mx, std::fabs(d));
  }
  return {std::sqrt(num / den), mx};
}

}  // namespace

int main() {
  cudaStream_t st;
  CHECK_CUDA(cudaStreamCreate(&st));
  cublasHandle_t h;
  CHECK_CUBLAS(cublasCreate(&h));
  CHECK_CUBLAS(cublasSetStream(h, st));
  CHECK_CUBLAS(cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH));  // SGEMM without TF32
  cudaEvent_t ea, eb;
  CHECK_CUDA(cudaEventCreate(&ea));
  CHECK_CUDA(cudaEventCreate(&eb));

  Buf x(4 * kM * kK), w(4 * kN * kK), y(4 * kM * kN);
  Buf xs(2 * 3 * kM * kK), ws(2 * 3 * kN * kK), xp(2 * 3 * kM * kK), flags(4 * std::max(kM, kN));
  std::vector<float> hx(kM * kK), hw(kN * kK);
  std::mt19937_64 rng(21);

  for (int data = 0; data < 2; ++data) {
    const char* dname = data == 0 ? "seed data (x U[0,1), W U(+-1/sqrt K))" : "x, W normal";
    if (data == 0) {
      std::uniform_real_distribution<float> ux(0.f, 1.f), uw(-1.f / std::sqrt(float(kK)), 1.f / std::sqrt(float(kK)));
      for (auto& v : hx) v = ux(rng);
      for (auto& v : hw) v = uw(rng);
    } else {
      std::normal_distribution<float> n01(0.f, 1.f);
      for (auto& v : hx) v = n01(rng);
      for (auto& v : hw) v = n01(rng);
    }
    CHECK_CUDA(cudaMemcpy(x.p, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(w.p, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));
    // [xlo | xhi | xhi] and [Whi | Wlo | Whi]
    cuda::launch_split_hilo(x.as<float>(), nullptr, kM, kK, kK, cuda::HiLoOrder::LoHiHi,
                            xs.as<__nv_bfloat16>(), cuda::RowMarks{flags.as<int>(), nullptr}, st);
    cuda::launch_split_hilo(w.as<float>(), nullptr, kN, kK, kK, cuda::HiLoOrder::HiLoHi,
                            ws.as<__nv_bfloat16>(), cuda::RowMarks{flags.as<int>(), nullptr}, st);
    CHECK_CUDA(cudaStreamSynchronize(st));
    std::printf("\n%s\n", dname);

    // Y^T[N, M] (column-major) = W . x^T: A = W rows (lda 3K, transposed), B = x rows.
    const float one = 1.f, zero = 0.f;
    auto gemm = [&](const void* A, const void* B, int64_t k, const float* beta) {
      CHECK_CUBLAS(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, kN, kM, k, &one, A, CUDA_R_16BF, 3 * kK,
                                B, CUDA_R_16BF, 3 * kK, beta, y.p, CUDA_R_32F, kN,
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    auto timed = [&](const char* name, auto&& run) {
      CHECK_CUDA(cudaMemsetAsync(y.p, 0xff, 4 * kM * kN, st));  // poison: NaN where unwritten
      run();
      CHECK_CUDA(cudaStreamSynchronize(st));
      const Err e = error_vs_f64(hx, hw, y);
      std::vector<float> t;
      for (int i = 0; i < 23; ++i) {
        CHECK_CUDA(cudaEventRecord(ea, st));
        run();
        CHECK_CUDA(cudaEventRecord(eb, st));
        CHECK_CUDA(cudaEventSynchronize(eb));
        float ms = 0.f;
        CHECK_CUDA(cudaEventElapsedTime(&ms, ea, eb));
        if (i >= 3) t.push_back(ms);
      }
      std::sort(t.begin(), t.end());
      std::printf("  %-14s rel %.3g  max abs %.3g  %.1f us\n", name, e.rel, e.max_abs, 1e3 * t[t.size() / 2]);
    };
    const auto* X = xs.as<__nv_bfloat16>();
    const auto* Wp = ws.as<__nv_bfloat16>();
    timed("two GEMMs", [&] {
      gemm(Wp, X, 2 * kK, &zero);       // xlo.Whi + xhi.Wlo
      gemm(Wp, X + kK, kK, &one);       // + xhi.Whi
    });
    timed("small first", [&] { gemm(Wp, X, 3 * kK, &zero); });
    const int big_first[3] = {2, 1, 0};  // x [xhi | xhi | xlo] pairs with W [Whi | Wlo | Whi]
    permute_segments(xs, xp, kM, big_first, st);
    timed("large first", [&] { gemm(Wp, xp.as<__nv_bfloat16>(), 3 * kK, &zero); });
    timed("SGEMM", [&] {
      CHECK_CUBLAS(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, kN, kM, kK, &one, w.as<float>(), kK,
                               x.as<float>(), kK, &zero, y.as<float>(), kN));
    });
    {  // the library's fast Linear, no bias
      PlanRequest req;
      req.chain = parse_chain("linear in=8192 out=8192 bias=0");
      req.batch_sizes = {kM};
      req.precision = Precision::Fast;
      const Plan plan = make_plan(req);
      CudaExecutor ex;
      Buf prepared(ex.prepared_bytes(plan)), wsp(ex.workspace_bytes(plan));
      RunArgs args;
      args.x = x.p;
      args.weight = w.p;
      args.out = y.p;
      args.stream = st;
      ex.prepare(plan, args, prepared.p);
      timed("library", [&] { ex.run(plan, args, prepared.p, wsp.p); });
    }
  }
  return 0;
}
