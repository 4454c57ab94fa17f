// Is the fp32 GEMM on fp16 tensor cores (executors/cuda/sm90/gemm_f16x3.cu) as faithful
// as SGEMM, from which K, and from how many rows is it faster? Where its tiles would leave SMs
// idle, is the split-K kernel faster than the wide one? In one process, against cuBLAS's
// SGEMM (what eager PyTorch runs for fp32 without TF32):
// - accuracy over K (M = 1024, N = 8192; K = 8..8192: the parts' fixed rounding against
//   SGEMM's error, which grows with K), at the GPU tests' shape, and on scaled data (x tiny
//   with W huge, x huge with W tiny: the row exponents): rel error against a float64 GEMM;
// - time over M at N = K = 8192 and other shapes: SGEMM against the whole fp32 path (x's
//   split, the kernel, the fix-up launch), alternated in 3 rounds (median of 21 calls each,
//   3 x sets rotated).
// - with GEMMFUSE_PROBE_TINY=1 instead: the seed shape with tiny values planted in x (1e-10
//   beside U[0,1): more than 2^28 below the row's largest), or x's rows softmax outputs, which
//   the split leaves out and the fix-up corrects (a few in all) or the second level carries
//   (many), rows holding a NaN or infinities: error and time per case, and which way each row
//   went. GEMMFUSE_PROBE_ONLY=<label prefix> (e.g. "softmax") runs those cases alone.
//   Built by CMake with -DGEMMFUSE_BUILD_PROBES=ON (target f16x3_probe).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "fp32_gemm_f16x3.h"  // executors/cuda
#include "gemm_f16x3.h"       // executors/cuda/sm90
#include "probe_check.h"
#include "split.h"            // executors/cuda
#include <cuda_fp16.h>

__global__ void fill(float* p, size_t n, unsigned seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = (unsigned(i) ^ seed) * 2654435761u;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    unsigned g = (unsigned(i >> 32) + seed * 7919u) * 2246822519u;
    h ^= g;
    p[i] = lo + (hi - lo) * (h >> 8) * (1.0f / 16777216.0f);
  }
}

// In every `every`-th row of x [M, K], `per_row` values set to 1e-10 (at spread k).
__global__ void plant_tiny(float* x, int M, int K, int every, int per_row) {
  for (int r = blockIdx.x * every; r < M; r += gridDim.x * every)
    for (int j = threadIdx.x; j < per_row; j += blockDim.x)
      x[size_t(r) * K + (size_t(j) * 7919 + r) % K] = 1e-10f * (1 + j % 3);
}

// Every row of x [M, K] replaced by the softmax of logits ~ N(0, sigma^2) (hashed
// Box-Muller): values from ~1 down past 2^-60 of each row's largest as sigma grows.
__global__ void softmax_rows(float* x, int M, int K, float sigma, unsigned seed) {
  __shared__ float part[32];
  for (int r = blockIdx.x; r < M; r += gridDim.x) {
    float* row = x + size_t(r) * K;
    float top = -INFINITY;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
      unsigned h1 = (unsigned(r) * 2654435761u) ^ (unsigned(k) * 2246822519u) ^ seed;
      h1 ^= h1 >> 15; h1 *= 0x2c1b3c6du; h1 ^= h1 >> 12;
      unsigned h2 = h1 * 0x297a2d39u; h2 ^= h2 >> 15;
      const float u1 = ((h1 >> 8) + 1) * (1.0f / 16777217.0f), u2 = (h2 >> 8) * (1.0f / 16777216.0f);
      const float z = sigma * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
      row[k] = z;
      top = fmaxf(top, z);
    }
    for (int o = 16; o; o >>= 1) top = fmaxf(top, __shfl_xor_sync(~0u, top, o));
    if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = top;
    __syncthreads();
    top = part[0];
    for (int i = 1; i < blockDim.x / 32; ++i) top = fmaxf(top, part[i]);
    __syncthreads();
    float sum = 0.f;
    for (int k = threadIdx.x; k < K; k += blockDim.x) sum += (row[k] = expf(row[k] - top));
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(~0u, sum, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = sum;
    __syncthreads();
    sum = 0.f;
    for (int i = 0; i < blockDim.x / 32; ++i) sum += part[i];
    __syncthreads();
    for (int k = threadIdx.x; k < K; k += blockDim.x) row[k] /= sum;
  }
}

// `per_row` copies of v in each of `rows` rows of x [M, K], spread over M: a NaN makes a row
// the fix-up writes NaN; infinities are corrected, or past correctable_tiny_values(K) in a
// row, the row recomputed.
__global__ void plant_value(float* x, int M, int K, int rows, int per_row, float v) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < rows * per_row; i += gridDim.x * blockDim.x) {
    const size_t r = size_t(i / per_row) * M / rows;
    x[r * K + (r * 7919 + size_t(i % per_row) * 131) % K] = v;
  }
}

struct Plant {
  int every = 0, per_row = 0;  // 0: nothing planted
  float softmax_sigma = 0.f;   // > 0: x's rows are softmax outputs instead
  int nan_rows = 0;            // > 0: that many rows hold a NaN
  int inf_rows = 0, infs = 0;  // > 0: that many rows hold `infs` infinities (+inf: x >= 0)
};

__global__ void widen(const float* s, double* d, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    d[i] = s[i];
}

// ||y - ref|| / ||ref|| and max |y - ref| (grid-stride partials, one atomic per block), over
// the finite outputs of ref; a NaN or infinity of ref that y lacks makes the max infinite.
__global__ void error_sums(const float* y, const double* ref, size_t n, double* out) {
  double num = 0, den = 0, mx = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    if (isnan(ref[i])) {
      if (!isnan(y[i])) mx = INFINITY;
      continue;
    }
    if (isinf(ref[i])) {
      if (double(y[i]) != ref[i]) mx = INFINITY;
      continue;
    }
    const double d = double(y[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
    mx = fmax(mx, fabs(d));
  }
  for (int o = 16; o; o >>= 1) {
    num += __shfl_xor_sync(~0u, num, o);
    den += __shfl_xor_sync(~0u, den, o);
    mx = fmax(mx, __shfl_xor_sync(~0u, mx, o));
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(out, num);
    atomicAdd(out + 1, den);
    atomicMax(reinterpret_cast<unsigned long long*>(out + 2), __double_as_longlong(mx));
  }
}

struct Err {
  double rel, max_abs;
};

Err error_of(const float* y, const double* ref, size_t n, double* sums) {
  CHECK_CUDA(cudaMemset(sums, 0, 3 * 8));
  error_sums<<<1024, 256>>>(y, ref, n, sums);
  double h[3];
  CHECK_CUDA(cudaMemcpy(h, sums, 3 * 8, cudaMemcpyDeviceToHost));
  return {std::sqrt(h[0] / h[1]), h[2]};
}

template <class F>
float median_ms(F&& f, int sets) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> t;
  for (int r = 0; r < 5 + 21; ++r) {
    cudaEventRecord(e0);
    f(r % sets);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    if (r >= 5) t.push_back(ms);
  }
  CHECK_CUDA(cudaGetLastError());
  std::sort(t.begin(), t.end());
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return t[t.size() / 2];
}

// The kernel's variants compared, by F16x3Problem::splits (0: the shape's choice, 1: the
// wide kernel, more: the split-K kernel).
struct Variant {
  const char* name;
  int splits;
};
const Variant kVariants[] = {
    {"chosen", 0},
};
const Variant kFewRowsVariants[] = {
    {"chosen", 0},
    {"wide", 1},
};

// One shape: x [M,K] (kSets copies, rotated), W [N,K], both as torch.rand / nn.Linear's
// init scaled by xs/ws; with `errors`, the float64 reference of set 0 and each variant's error.
template <size_t kN>
void run_shape(cublasHandle_t h, const Variant (&variants)[kN], int M, int N, int K, bool errors,
               bool timing, float xscale = 1.f, float wscale = 1.f, const char* label = "",
               Plant plant = {}) {
  constexpr int kSets = 3;
  const size_t xn = size_t(M) * K, wn = size_t(N) * K, yn = size_t(M) * N;
  std::vector<float*> xs(kSets), ys(kSets);
  for (int s = 0; s < kSets; ++s) {
    CHECK_CUDA(cudaMalloc(&xs[s], xn * 4));
    CHECK_CUDA(cudaMalloc(&ys[s], yn * 4));
    fill<<<1024, 256>>>(xs[s], xn, 17u + s, 0.f, xscale);
    if (plant.every > 0) plant_tiny<<<1024, 256>>>(xs[s], M, K, plant.every, plant.per_row);
    if (plant.softmax_sigma > 0) softmax_rows<<<1024, 256>>>(xs[s], M, K, plant.softmax_sigma, 17u + s);
    if (plant.nan_rows > 0) plant_value<<<8, 256>>>(xs[s], M, K, plant.nan_rows, 1, NAN);
    if (plant.inf_rows > 0) plant_value<<<8, 256>>>(xs[s], M, K, plant.inf_rows, plant.infs, INFINITY);
  }
  const float bound = wscale / std::sqrt(float(K));
  float* w;
  __half *x_parts, *w_parts;
  float *x_exps, *w_exps;
  int *x_flags, *x_tiny, *w_list, *w_flags;
  CHECK_CUDA(cudaMalloc(&w, wn * 4));
  CHECK_CUDA(cudaMalloc(&w_parts, wn * 4));
  CHECK_CUDA(cudaMalloc(&x_parts, std::max(xn, yn) * 4));  // also the second level's products
  CHECK_CUDA(cudaMalloc(&x_exps, M * 4));
  CHECK_CUDA(cudaMalloc(&w_exps, N * 4));
  CHECK_CUDA(cudaMalloc(&x_flags, M * 4));
  CHECK_CUDA(cudaMalloc(&x_tiny, M * 4));
  CHECK_CUDA(cudaMalloc(&w_list, (N + 1) * 4));
  CHECK_CUDA(cudaMalloc(&w_flags, N * 4));
  gemmfuse::cuda::SecondLevel second;
  CHECK_CUDA(cudaMalloc(&second.rows, 4));
  CHECK_CUDA(cudaMalloc(&second.slot_row, M * 4));
  CHECK_CUDA(cudaMalloc(&second.slot_tiny, M * 4));
  CHECK_CUDA(cudaMalloc(&second.exps, M * 4));
  CHECK_CUDA(cudaMalloc(&second.parts, xn * 4));
  second.y = reinterpret_cast<float*>(x_parts);
  fill<<<1024, 256>>>(w, wn, 99u, -bound, bound);
  CHECK_CUDA(cudaMemset(w_list, 0, 4));
  gemmfuse::cuda::launch_split_f16x2(w, N, K, w_parts, w_exps, {w_flags, w_list}, nullptr);
  void* ws;
  const size_t ws_bytes = std::max(size_t(32) << 20, gemmfuse::cuda::sm90::f16x3_workspace_bytes(M, N, K));
  CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  const float one = 1.f, zero = 0.f;
  auto sgemm = [&](int s) {
    cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_32F, K, xs[s], CUDA_R_32F, K,
                 &zero, ys[s], CUDA_R_32F, N, CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT);
  };
  // As the executor runs it (fp32_gemm_f16x3.h).
  auto ours = [&](const Variant& v, int s) {
    gemmfuse::cuda::Fp32GemmF16x3 g;
    g.M = M; g.N = N; g.K = K;
    g.x = xs[s]; g.w = w; g.w_parts = w_parts; g.w_exps = w_exps; g.w_list = w_list; g.w_flags = w_flags;
    g.bias = nullptr; g.y = ys[s];
    g.scratch = {x_parts, x_exps, x_flags, x_tiny, second};
    g.gemm_workspace = ws; g.gemm_workspace_bytes = ws_bytes;
    g.splits = v.splits;
    gemmfuse::cuda::launch_fp32_gemm_f16x3(g, nullptr);
  };
  if (errors) {
    double *x64, *w64, *ref, *sums;
    CHECK_CUDA(cudaMalloc(&x64, xn * 8));
    CHECK_CUDA(cudaMalloc(&w64, wn * 8));
    CHECK_CUDA(cudaMalloc(&ref, yn * 8));
    CHECK_CUDA(cudaMalloc(&sums, 3 * 8));
    widen<<<1024, 256>>>(xs[0], x64, xn);
    widen<<<1024, 256>>>(w, w64, wn);
    const double d1 = 1, d0 = 0;
    cublasDgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &d1, w64, K, x64, K, &d0, ref, N);
    CHECK_CUDA(cudaMemset(ys[0], 0xff, yn * 4));
    sgemm(0);
    const Err e_sgemm = error_of(ys[0], ref, yn, sums);
    for (const Variant& v : variants) {
      CHECK_CUDA(cudaMemset(ys[0], 0xff, yn * 4));
      ours(v, 0);
      const Err e_ours = error_of(ys[0], ref, yn, sums);
      std::vector<int> flags(M), tiny(M), slot_tiny(M);
      int slots = 0;
      CHECK_CUDA(cudaMemcpy(flags.data(), x_flags, M * 4, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(tiny.data(), x_tiny, M * 4, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(&slots, second.rows, 4, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(slot_tiny.data(), second.slot_tiny, M * 4, cudaMemcpyDeviceToHost));
      int recomputed = 0, nan_rows = 0, tiny_rows = 0, slots_corrected = 0, slots_recomputed = 0;
      long long values = 0;
      for (int m = 0; m < M; ++m) {
        recomputed += flags[m] == gemmfuse::cuda::kRowRecompute;
        nan_rows += flags[m] == gemmfuse::cuda::kRowNaN;
        tiny_rows += flags[m] == gemmfuse::cuda::kRowTiny;
        values += flags[m] == gemmfuse::cuda::kRowTiny ? tiny[m] : 0;
      }
      for (int i = 0; i < slots; ++i) {
        slots_corrected += slot_tiny[i] > 0 && slot_tiny[i] <= gemmfuse::cuda::correctable_tiny_values(K);
        slots_recomputed += slot_tiny[i] > gemmfuse::cuda::correctable_tiny_values(K);
      }
      std::printf("%-12s M=%5d N=%5d K=%5d  rel: SGEMM %.3e  %-8s %.3e (%.2fx)  max abs: %.2e %.2e  rows: %d "
                  "recomputed, %d NaN, %d with values left out (%lld tiny), %d at the second level (%d "
                  "corrected there, %d recomputed)\n",
                  label, M, N, K, e_sgemm.rel, v.name, e_ours.rel, e_ours.rel / e_sgemm.rel, e_sgemm.max_abs,
                  e_ours.max_abs, recomputed, nan_rows, tiny_rows, values, slots, slots_corrected, slots_recomputed);
    }
    for (void* p : {(void*)x64, (void*)w64, (void*)ref, (void*)sums}) CHECK_CUDA(cudaFree(p));
  }
  // The path without the second level's two launches (its split and its GEMM): what they cost
  // where x has no tiny values (timed with GEMMFUSE_PROBE_TINY=1, on the case with none).
  const bool time_first_level =
      plant.every == 0 && plant.softmax_sigma == 0 && plant.nan_rows == 0 && plant.inf_rows == 0 && label[0];
  auto first_level_only = [&](int s) {
    gemmfuse::cuda::launch_split_f16x2(xs[s], M, K, x_parts, x_exps, {x_flags, nullptr, x_tiny}, nullptr);
    gemmfuse::cuda::sm90::F16x3Problem p;
    p.M = M; p.N = N; p.K = K;
    p.x_parts = x_parts; p.w_parts = w_parts; p.x_exps = x_exps; p.w_exps = w_exps; p.y = ys[s];
    if (!gemmfuse::cuda::sm90::launch_f16x3_gemm(p, ws, ws_bytes, nullptr)) std::abort();
    gemmfuse::cuda::launch_fixup_exceptional(xs[s], w, nullptr, nullptr, ys[s], M, N, K, x_exps, x_flags, w_list,
                                             w_flags, gemmfuse::cuda::SecondLevel{}, nullptr);
  };
  if (timing) {
    // Alternated in rounds so that all see the same clock drift; the median round.
    std::vector<float> t_sgemm, t_split, t_first, t_fixup;
    // the fix-up alone, as the common case meets it (nothing marked): 100 launches back to back
    auto fixup_alone = [&](int s) {
      for (int i = 0; i < 100; ++i)
        gemmfuse::cuda::launch_fixup_exceptional(xs[s], w, nullptr, nullptr, ys[s], M, N, K, x_exps, x_flags, w_list,
                                                 w_flags, second, nullptr);
    };
    std::vector<std::vector<float>> t_ours(kN);
    for (int round = 0; round < 3; ++round) {
      t_sgemm.push_back(median_ms(sgemm, kSets));
      for (size_t i = 0; i < kN; ++i) t_ours[i].push_back(median_ms([&](int s) { ours(variants[i], s); }, kSets));
      t_split.push_back(median_ms([&](int s) { gemmfuse::cuda::launch_split_f16x2(xs[s], M, K, x_parts, x_exps, {x_flags, nullptr, x_tiny}, nullptr); }, kSets));
      if (time_first_level) t_first.push_back(median_ms(first_level_only, kSets));
      if (time_first_level) t_fixup.push_back(median_ms(fixup_alone, kSets) * 10.f);  // us a call
    }
    if (time_first_level) {
      std::sort(t_first.begin(), t_first.end());
      std::printf("             first level only       %.4f ms  (rounds %.4f %.4f %.4f)\n", t_first[1], t_first[0],
                  t_first[1], t_first[2]);
      std::sort(t_fixup.begin(), t_fixup.end());
      std::printf("             fix-up alone, nothing marked: %.2f us a call (100 back to back; rounds %.2f %.2f %.2f)\n",
                  t_fixup[1], t_fixup[0], t_fixup[1], t_fixup[2]);
    }
    std::sort(t_sgemm.begin(), t_sgemm.end());
    std::sort(t_split.begin(), t_split.end());
    const double flop = 2.0 * M * N * K;
    std::printf("time       M=%5d N=%5d K=%5d  SGEMM %.4f ms (%.1f TFLOP/s)  x split alone %.4f; splits chosen %d\n", M, N,
                K, t_sgemm[1], flop / t_sgemm[1] * 1e-9, t_split[1],
                gemmfuse::cuda::sm90::f16x3_splits(M, N, 132));
    for (size_t i = 0; i < kN; ++i) {
      std::sort(t_ours[i].begin(), t_ours[i].end());
      std::printf("             %-22s %.4f ms  -> %.2fx SGEMM  (rounds %.4f %.4f %.4f)\n", variants[i].name,
                  t_ours[i][1], t_sgemm[1] / t_ours[i][1], t_ours[i][0], t_ours[i][1], t_ours[i][2]);
    }
  }
  for (int s = 0; s < kSets; ++s) {
    CHECK_CUDA(cudaFree(xs[s]));
    CHECK_CUDA(cudaFree(ys[s]));
  }
  for (void* p : {(void*)w, (void*)w_parts, (void*)x_parts, (void*)x_exps, (void*)w_exps, (void*)x_flags,
                  (void*)x_tiny, (void*)w_list, (void*)w_flags, ws, (void*)second.rows, (void*)second.slot_row,
                  (void*)second.slot_tiny, (void*)second.exps, (void*)second.parts})
    CHECK_CUDA(cudaFree(p));
}

int main() {
  cublasHandle_t h;
  cublasCreate(&h);
  std::printf("fp32 GEMM: cuBLAS SGEMM against the f16x3 kernel (executors/cuda/sm90/gemm_f16x3.cu)\n");
  std::printf("x ~ U[0,1), W ~ U(-1/sqrt(K), 1/sqrt(K)) unless said; rel = ||y - ref|| / ||ref|| against float64\n");
  if (const char* t = std::getenv("GEMMFUSE_PROBE_TINY"); t && std::string(t) == "1") {
    // (every, per_row): none; 2 rows with 1 tiny value and 256 rows with 1 (at most K/32 = 256
    // values: corrected); 256 rows with 2; 2 and 16 rows with 1025; every row with 36, 256 and
    // 1024 (the second level); then softmax rows of N(0, sigma^2) logits (from sigma = 8, rows
    // recomputed: values still tiny at the second level); then 1 to 1024 rows holding a NaN
    // (written NaN); then rows holding infinities, 1 to 17 a row (corrected; recomputed past
    // correctable_infinities(K) = 16, by tiles).
    const Plant cases[] = {{0, 0},          {512, 1},        {4, 1},          {4, 2},          {512, 1025},
                           {64, 1025},      {1, 36},         {1, 256},        {1, 1024},       {0, 0, 2.f},
                           {0, 0, 4.f},     {0, 0, 5.f},     {0, 0, 6.f},     {0, 0, 7.f},     {0, 0, 8.f},
                           {0, 0, 12.f},    {0, 0, 16.f},    {0, 0, 0.f, 1},
                           {0, 0, 0.f, 2},  {0, 0, 0.f, 3},  {0, 0, 0.f, 8},  {0, 0, 0.f, 64}, {0, 0, 0.f, 1024},
                           {0, 0, 0.f, 0, 1, 1},     {0, 0, 0.f, 0, 64, 1},  {0, 0, 0.f, 0, 1024, 1},
                           {0, 0, 0.f, 0, 1024, 8},  {0, 0, 0.f, 0, 64, 16}, {0, 0, 0.f, 0, 1024, 16},
                           {0, 0, 0.f, 0, 64, 17},   {0, 0, 0.f, 0, 1024, 17}};
    for (const Plant& c : cases) {
      char label[32];
      if (c.nan_rows > 0)
        std::snprintf(label, sizeof label, "nan rows %d", c.nan_rows);
      else if (c.inf_rows > 0)
        std::snprintf(label, sizeof label, "inf rows %dx%d", c.inf_rows, c.infs);
      else if (c.softmax_sigma > 0)
        std::snprintf(label, sizeof label, "softmax %.0f", c.softmax_sigma);
      else
        std::snprintf(label, sizeof label, "tiny %d/%d", c.every, c.per_row);
      const char* only = std::getenv("GEMMFUSE_PROBE_ONLY");  // a label prefix: those cases alone
      if (only && std::strncmp(label, only, std::strlen(only)) != 0) continue;
      run_shape(h, kVariants, 1024, 8192, 8192, true, true, 1.f, 1.f, label, c);
    }
    return 0;
  }
  for (int K : {8, 16, 32, 64, 128, 256, 1024, 4096, 8192})
    run_shape(h, kVariants, 1024, 8192, K, true, false, 1.f, 1.f, "accuracy");
  for (int K : {1000, 1088, 8192}) run_shape(h, kFewRowsVariants, 128, 8192, K, true, false, 1.f, 1.f, "accuracy");
  run_shape(h, kVariants, 256, 1024, 1024, true, false, 1.f, 1.f, "pytest");
  run_shape(h, kVariants, 256, 1024, 1024, true, false, 1e-36f, 1e30f, "tiny x");
  run_shape(h, kVariants, 256, 1024, 1024, true, false, 1e-30f, 1e30f, "small x");
  run_shape(h, kVariants, 256, 1024, 1024, true, false, 1e20f, 1e-20f, "wide");
  for (int M : {32, 64, 96, 128, 192}) run_shape(h, kFewRowsVariants, M, 8192, 8192, false, true);
  for (int M : {128, 256}) run_shape(h, kFewRowsVariants, M, 4096, 4096, false, true);
  run_shape(h, kFewRowsVariants, 100, 16384, 8192, false, true);
  run_shape(h, kFewRowsVariants, 256, 2048, 2048, false, true);
  run_shape(h, kFewRowsVariants, 256, 1024, 1024, false, true);
  run_shape(h, kFewRowsVariants, 1024, 256, 8192, false, true);
  run_shape(h, kFewRowsVariants, 4096, 256, 8192, false, true);
  run_shape(h, kFewRowsVariants, 256, 256, 8192, false, true);
  for (int M : {192, 256, 512, 1024, 2048, 4096}) run_shape(h, kVariants, M, 8192, 8192, false, true);
  return 0;
}
