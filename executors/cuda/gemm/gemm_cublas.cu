// The Gemm step on the kernel the Selection chose (gemm_cublas.h): cuBLASLt here, the
// small-M kernel (gemm_small_m.cu) or the f16x3 kernel (sm90/gemm_f16x3.cu).
//
// Row-major Y[M,N] = x[M,K] W[N,K]^T is column-major Y^T[N,M] = W . x^T: cuBLASLt's
// D[m=N, n=M] = op(A)[N,K] op(B)[K,M] with A = W stored [K,N] (ld K, transa = T) and
// B = x stored [K,M] (ld K, transb = N), D ld N. The bias is the BIAS epilogue (one value per
// row of D = per column of Y), on the last GEMM of a step.
//
// Handles: the device's cuBLASLt handle (blas_handles.h).
// Algorithms: the heuristic's first choice, cached per (device, shape, types, epilogue,
// pointer alignments). Workspace: ours (WorkspaceLayout::lt), never cuBLAS's own allocation,
// so every call is stream-ordered and graph-capturable.
#include "gemm_cublas.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "blas_handles.h"
#include "cuda_check.h"
#include "fp32_gemm_f16x3.h"
#include "gemm_f16x3.h"
#include "gemm_small_m.h"
#include "layout.h"
#include "split.h"

namespace gemmfuse::cuda {
namespace {

std::mutex g_mutex;  // guards g_algos
struct CachedAlgo {
  bool found = false;
  cublasLtMatmulAlgo_t algo{};
};
std::unordered_map<std::string, CachedAlgo> g_algos;

struct MatmulDesc {
  cublasLtMatmulDesc_t d = nullptr;
  ~MatmulDesc() { if (d) cublasLtMatmulDescDestroy(d); }
};
struct MatrixLayout {
  cublasLtMatrixLayout_t d = nullptr;
  ~MatrixLayout() { if (d) cublasLtMatrixLayoutDestroy(d); }
};
struct Preference {
  cublasLtMatmulPreference_t d = nullptr;
  ~Preference() { if (d) cublasLtMatmulPreferenceDestroy(d); }
};

uint32_t alignment_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && (a % al) != 0) al >>= 1;
  return al;
}

// D[m,n] (col-major, ld ldd) = A^T B (+ beta*D) (+ bias[m]); A stored [k,m] ld lda, B [k,n] ld ldb.
struct LtGemm {
  int64_t m = 0, n = 0, k = 0;
  const void* A = nullptr;
  int64_t lda = 0;
  const void* B = nullptr;
  int64_t ldb = 0;
  void* D = nullptr;
  int64_t ldd = 0;
  cudaDataType_t ab_type = CUDA_R_32F, d_type = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  float beta = 0.f;
  const void* bias = nullptr;  // in d_type
  size_t heuristic_bytes = 0;  // the workspace the heuristic is told of (0: all; GemmChoice)
};

// Returns false (and launches nothing) when no algorithm exists with the bias epilogue.
bool lt_matmul(const LtGemm& g, void* ws, size_t ws_bytes, cudaStream_t stream) {
  int dev = 0;
  GF_CUDA_CHECK(cudaGetDevice(&dev));
  cublasLtHandle_t h = cublaslt_handle();

  MatmulDesc op;
  GF_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op.d, g.compute, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  GF_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  GF_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const cublasLtEpilogue_t epi = g.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  GF_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  if (g.bias) {
    const void* bp = g.bias;
    GF_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)));
  }

  MatrixLayout a, b, d;
  GF_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a.d, g.ab_type, g.k, g.m, g.lda));
  GF_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b.d, g.ab_type, g.k, g.n, g.ldb));
  GF_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.d, g.d_type, g.m, g.n, g.ldd));

  const uint32_t al_a = alignment_of(g.A), al_b = alignment_of(g.B), al_d = alignment_of(g.D);
  char key[320];
  std::snprintf(key, sizeof(key), "%d|%lld,%lld,%lld|%lld,%lld,%lld|%d,%d,%d|%d|%d|%u,%u,%u|%zu",
                dev, static_cast<long long>(g.m), static_cast<long long>(g.n),
                static_cast<long long>(g.k), static_cast<long long>(g.lda),
                static_cast<long long>(g.ldb), static_cast<long long>(g.ldd),
                static_cast<int>(g.ab_type), static_cast<int>(g.d_type),
                static_cast<int>(g.compute), static_cast<int>(epi), g.beta != 0.f ? 1 : 0, al_a,
                al_b, al_d, ws_bytes);

  CachedAlgo ca;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_algos.find(key);
    if (it != g_algos.end()) {
      ca = it->second;
      cached = true;
    }
  }
  if (!cached) {
    Preference pref;
    GF_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref.d));
    const uint64_t wsb = g.heuristic_bytes > 0 ? std::min<uint64_t>(ws_bytes, g.heuristic_bytes) : ws_bytes;
    GF_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.d, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
    GF_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)));
    GF_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)));
    GF_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof(al_d)));
    GF_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d)));
    cublasLtMatmulHeuristicResult_t res{};
    int count = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(h, op.d, a.d, b.d, d.d, d.d, pref.d, 1, &res, &count);
    if (st == CUBLAS_STATUS_SUCCESS && count > 0 && res.state == CUBLAS_STATUS_SUCCESS) {
      ca.found = true;
      ca.algo = res.algo;
    } else if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED) {
      throw_cublas(st, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    g_algos.emplace(key, ca);
  }
  if (!ca.found) {
    if (g.bias) return false;
    throw std::runtime_error(std::string("gemmfuse CUDA: cuBLASLt has no algorithm for GEMM ") + key);
  }
  const float alpha = 1.f, beta = g.beta;
  GF_CUBLAS_CHECK(cublasLtMatmul(h, op.d, &alpha, g.A, a.d, g.B, b.d, &beta, g.D, d.d, g.D, d.d,
                                 &ca.algo, ws, ws_bytes, stream));
  return true;
}

// Fallback when the bias epilogue is not available: Y[r, c] += bias[c].
template <class T>
__global__ void add_bias_kernel(T* y, const T* __restrict__ bias, int64_t M, int64_t N) {
  const int64_t total = M * N;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = static_cast<float>(y[i]) + static_cast<float>(bias[i % N]);
    y[i] = static_cast<T>(v);
  }
}

void add_bias(void* y, const void* bias, cudaDataType_t t, int64_t M, int64_t N,
              cudaStream_t stream) {
  const int64_t total = M * N;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, 65535 * 8));
  if (grid == 0) return;
  if (t == CUDA_R_32F)
    add_bias_kernel<float><<<grid, 256, 0, stream>>>(static_cast<float*>(y),
                                                     static_cast<const float*>(bias), M, N);
  else if (t == CUDA_R_16BF)
    add_bias_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(
        static_cast<__nv_bfloat16*>(y), static_cast<const __nv_bfloat16*>(bias), M, N);
  else
    add_bias_kernel<__half><<<grid, 256, 0, stream>>>(static_cast<__half*>(y),
                                                      static_cast<const __half*>(bias), M, N);
  GF_LAUNCH_CHECK();
}

// The last GEMM of the step: with the bias epilogue when cuBLASLt has one for this
// configuration and the bias is 16-byte aligned, else plain GEMM + add_bias.
void last_gemm(LtGemm g, void* ws, size_t ws_bytes, cudaStream_t stream) {
  const void* bias = g.bias;
  if (bias && reinterpret_cast<uintptr_t>(bias) % 16 == 0 && lt_matmul(g, ws, ws_bytes, stream))
    return;
  g.bias = nullptr;
  lt_matmul(g, ws, ws_bytes, stream);
  if (bias) add_bias(g.D, bias, g.d_type, g.n, g.m, stream);
}

cudaDataType_t cuda_type(DType d) {
  return d == DType::F32 ? CUDA_R_32F : d == DType::BF16 ? CUDA_R_16BF : CUDA_R_16F;
}

// The f16x3 GEMM's per-call buffers in the workspace (layout.h); the second level's products
// over x's parts, which the GEMM has read by then.
F16x3Scratch f16x3_scratch(const WorkspaceLayout& W, char* workspace) {
  F16x3Scratch s;
  s.x_parts = reinterpret_cast<__half*>(workspace + W.x_parts);
  s.x_exps = reinterpret_cast<float*>(workspace + W.x_exps);
  s.x_flags = reinterpret_cast<int*>(workspace + W.x_flags);
  s.x_tiny = reinterpret_cast<int*>(workspace + W.x_tiny);
  s.second.rows = reinterpret_cast<int*>(workspace + W.second_rows);
  s.second.slot_row = reinterpret_cast<int*>(workspace + W.second_slot_row);
  s.second.slot_tiny = reinterpret_cast<int*>(workspace + W.second_slot_tiny);
  s.second.exps = reinterpret_cast<float*>(workspace + W.second_exps);
  s.second.parts = reinterpret_cast<__half*>(workspace + W.second_parts);
  s.second.y = reinterpret_cast<float*>(workspace + W.x_parts);
  return s;
}

// One Gemm call's operands: where Y goes, in what type, the bias in that type, W (or W').
struct GemmCall {
  const PreparedLayout& P;
  const WorkspaceLayout& W;
  const char* prepared;
  char* workspace;
  void* y = nullptr;
  cudaDataType_t d_type = CUDA_R_32F;
  const void* bias = nullptr;
  const void* w = nullptr;
};

GemmCall gemm_call(const Plan& plan, const PlanState& st, const Step& step, const RunArgs& args,
                   const char* prepared, char* workspace) {
  GemmCall c{st.prepared, st.workspace, prepared, workspace};
  const PreparedLayout& P = st.prepared;
  const bool to_output = step.output == kOutput;
  c.y = to_output ? args.out : workspace + plan.buffer_offset(step.output);
  c.d_type = to_output ? cuda_type(plan.dtype) : CUDA_R_32F;
  // The bias in D's type: prepared (folded or converted) or the caller's.
  if (c.d_type == CUDA_R_32F && P.bias_f32 != kAbsent) {
    c.bias = prepared + P.bias_f32;
  } else if (c.d_type != CUDA_R_32F && P.bias_dt != kAbsent) {
    c.bias = prepared + P.bias_dt;
  } else if (plan.chain.has_bias) {
    if (!args.bias) throw std::invalid_argument("gemmfuse: the chain's Linear has a bias but none was passed");
    if (c.d_type != cuda_type(plan.dtype))
      throw std::logic_error("CUDA gemm: bias type does not match the output (prepare missing)");
    c.bias = args.bias;
  }
  c.w = P.w_folded != kAbsent ? prepared + P.w_folded : args.weight;
  return c;
}

// fast: xlo.Whi + xhi.Wlo + xhi.Whi on bf16 tensor cores, fp32 accumulation, as one GEMM over
// [xlo|xhi|xhi] . [Whi|Wlo|Whi]^T (K' = 3 Kh). cuBLAS's mainloop runs K in order (split-K:
// each part in order), so the small products are summed first, apart from the large one,
// which then lands on a sum of their size: as accurate as a GEMM of their own added to it,
// without writing and re-reading Y (docs/measurements.md). Rows with a value the split cannot
// carry are recomputed in fp32 after it, or written NaN where they hold one (split.h).
void gemm_fast_split(const Plan& plan, const RunArgs& args, const GemmCall& c, cudaStream_t stream) {
  const int64_t M = plan.M, N = plan.N, K = plan.K;
  const PreparedLayout& P = c.P;
  const WorkspaceLayout& W = c.W;
  if (P.w_split == kAbsent || W.x_split == kAbsent || P.w_list == kAbsent || P.w_flags == kAbsent ||
      W.x_flags == kAbsent)
    throw std::logic_error("CUDA gemm: split precision without split buffers");
  const int64_t Kh = P.Kh;
  const auto* x = static_cast<const float*>(args.x);
  auto* xs = reinterpret_cast<__nv_bfloat16*>(c.workspace + W.x_split);
  auto* x_flags = reinterpret_cast<int*>(c.workspace + W.x_flags);
  launch_split_hilo(x, nullptr, M, K, Kh, HiLoOrder::LoHiHi, xs, RowMarks{x_flags, nullptr}, stream);
  LtGemm g;
  g.m = N;
  g.n = M;
  g.D = c.y;
  g.ldd = N;
  g.d_type = c.d_type;
  g.ab_type = CUDA_R_16BF;
  g.compute = CUBLAS_COMPUTE_32F;
  g.A = c.prepared + P.w_split;
  g.lda = kFastSplitSegments * Kh;
  g.B = xs;
  g.ldb = kFastSplitSegments * Kh;
  g.k = kFastSplitSegments * Kh;
  g.bias = c.bias;
  last_gemm(g, c.workspace + W.lt, W.lt_bytes, stream);
  const float* scale = P.scale != kAbsent ? reinterpret_cast<const float*>(c.prepared + P.scale) : nullptr;
  launch_fixup_exceptional(x, static_cast<const float*>(args.weight), scale,
                           static_cast<const float*>(c.bias), static_cast<float*>(c.y), M, N, K,
                           nullptr, x_flags, reinterpret_cast<const int*>(c.prepared + P.w_list),
                           reinterpret_cast<const int*>(c.prepared + P.w_flags), SecondLevel{}, stream);
}

// fp32 on fp16 tensor cores (split.h), K cut into the Selection's ranges.
void gemm_f16x3(const Plan& plan, const GemmChoice& choice, const RunArgs& args, const GemmCall& c,
                cudaStream_t stream) {
  const PreparedLayout& P = c.P;
  const WorkspaceLayout& W = c.W;
  if (P.w_parts == kAbsent || W.x_parts == kAbsent || P.w_list == kAbsent || P.w_flags == kAbsent ||
      W.x_flags == kAbsent || W.x_tiny == kAbsent || W.second_parts == kAbsent)
    throw std::logic_error("CUDA gemm: f16x3 without its split buffers");
  Fp32GemmF16x3 f;
  f.M = plan.M;
  f.N = plan.N;
  f.K = plan.K;
  f.x = static_cast<const float*>(args.x);
  f.w = static_cast<const float*>(c.w);
  f.w_parts = reinterpret_cast<const __half*>(c.prepared + P.w_parts);
  f.w_exps = reinterpret_cast<const float*>(c.prepared + P.w_exps);
  f.w_list = reinterpret_cast<const int*>(c.prepared + P.w_list);
  f.w_flags = reinterpret_cast<const int*>(c.prepared + P.w_flags);
  f.bias = static_cast<const float*>(c.bias);
  f.y = static_cast<float*>(c.y);
  if (choice.ldy > 0) {  // N not a multiple of 4: padded rows in the workspace, copied into Y
    if (W.y_padded == kAbsent) throw std::logic_error("CUDA gemm: f16x3 with padded rows but no room for them");
    f.y_padded = reinterpret_cast<float*>(c.workspace + W.y_padded);
    f.ldy = choice.ldy;
  }
  f.scratch = f16x3_scratch(W, c.workspace);
  f.gemm_workspace = c.workspace + W.lt;
  f.gemm_workspace_bytes = W.lt_bytes;
  f.splits = choice.splits;
  launch_fp32_gemm_f16x3(f, stream);
}

// cuBLASLt in the kind's types (SGEMM, TF32, the model's 16-bit type).
void gemm_lt(const Plan& plan, GemmKind kind, const GemmChoice& choice, const RunArgs& args,
             const GemmCall& c, cudaStream_t stream) {
  LtGemm g;
  g.m = plan.N;
  g.n = plan.M;
  g.D = c.y;
  g.ldd = plan.N;
  g.d_type = c.d_type;
  g.A = c.w;
  g.lda = plan.K;
  g.B = args.x;
  g.ldb = plan.K;
  g.k = plan.K;
  g.bias = c.bias;
  g.ab_type = cuda_type(plan.dtype);
  g.compute = kind == GemmKind::Tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  g.heuristic_bytes = kind == GemmKind::Sgemm ? choice.lt_heuristic_bytes : 0;
  last_gemm(g, c.workspace + c.W.lt, c.W.lt_bytes, stream);
}

// Whether the call's pointers let `kind` run (the checks left to the call: alignment, and
// the small-M kernel's room for x's shifted copies); else GemmChoice::fallback runs.
bool call_takes(const GemmChoice& choice, const Plan& plan, const RunArgs& args, const GemmCall& c) {
  switch (choice.kind) {
    case GemmKind::F16x3:  // a padded Y lies in the workspace, aligned
      return aligned16(args.x) && aligned16(c.w) && (choice.ldy > 0 || aligned16(c.y)) &&
             (c.bias == nullptr || aligned16(c.bias));
    case GemmKind::SmallM:
      return small_m_gemm_fits(plan.M, plan.N, plan.K, args.x, c.w, c.W.lt_bytes);
    default: return true;
  }
}

}  // namespace

void run_gemm(const Plan& plan, const PlanState& st, const Step& step, const RunArgs& args,
              const char* prepared, char* workspace, cudaStream_t stream) {
  if (plan.M == 0 || plan.N == 0) return;
  if (st.prepared.total > 0 && prepared == nullptr)
    throw std::logic_error("CUDA gemm: the plan needs prepared weights but none were given");
  const GemmChoice& choice = st.sel.gemm;
  const GemmCall c = gemm_call(plan, st, step, args, prepared, workspace);
  const GemmKind kind = call_takes(choice, plan, args, c) ? choice.kind : choice.fallback;
  switch (kind) {
    case GemmKind::BiasOnly:  // x W^T is zero: Y = bias (cuBLASLt rejects k = 0)
      GF_CUDA_CHECK(cudaMemsetAsync(c.y, 0, static_cast<size_t>(plan.M * plan.N) * (c.d_type == CUDA_R_32F ? 4 : 2),
                                    stream));
      if (c.bias) add_bias(c.y, c.bias, c.d_type, plan.M, plan.N, stream);
      return;
    case GemmKind::FastSplit: return gemm_fast_split(plan, args, c, stream);
    case GemmKind::F16x3: return gemm_f16x3(plan, choice, args, c, stream);
    case GemmKind::SmallM:  // a few rows: bound by reading W
      return launch_small_m_gemm(static_cast<const float*>(args.x), static_cast<const float*>(c.w),
                                 static_cast<const float*>(c.bias), static_cast<float*>(c.y), plan.M, plan.N,
                                 plan.K, workspace + c.W.lt, c.W.lt_bytes, stream);
    case GemmKind::Sgemm:
    case GemmKind::Tf32:
    case GemmKind::Half: return gemm_lt(plan, kind, choice, args, c, stream);
    case GemmKind::None:
    case GemmKind::Gemv: break;
  }
  throw std::logic_error(std::string("CUDA gemm: a Gemm step selected as ") + gemm_kind_name(kind));
}

}  // namespace gemmfuse::cuda
