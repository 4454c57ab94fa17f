// Where the wide row pass's time goes: m99's gelu -> softmax over fp32 Y [1024, 8192] (64 MB
// moved: 21.5 us at the 2.97 TB/s copy rate) takes ~36 us in `fast`. Times, in one process, the
// library's row pass on real plans (after one whole run, so Y holds the GEMM's values) against
// hand-written kernels of the same job that differ in one thing each: the launch shape (one row
// per CTA, as the library; or persistent CTAs that load their next row while computing the
// current one), and the work (a plain copy; softmax alone; gelu (erff) + softmax). Median of 50
// launches (CUDA events), inputs rotated over 3 Y sets (96 MB against the 50 MB L2). Each
// kernel's output is checked against the library's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda_executor.h"
#include "gemmfuse/chain.h"
#include "gemmfuse/plan.h"
#include "layout.h"
#include "probe_check.h"
#include "row_program.h"
#include "split.h"

using namespace gemmfuse;

namespace {

constexpr int64_t kM = 1024, kK = 8192, kN = 8192;
constexpr int kThreads = 512, kVpt = 4;  // 512 x 4 float4 = one 8192-wide row

struct Buf {
  void* p = nullptr;
  explicit Buf(size_t n) { CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(n, 256))); }
  ~Buf() { cudaFree(p); }
  template <class T> T* as() const { return static_cast<T*>(p); }
};

uint64_t g_rng = 88172645463325252ull;
float urand01() {
  g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
  return static_cast<float>((g_rng >> 40) * (1.0 / 16777216.0));
}
void fill(void* d, size_t n, float lo, float hi) {
  std::vector<float> h(n);
  for (auto& v : h) v = lo + (hi - lo) * urand01();
  CHECK_CUDA(cudaMemcpy(d, h.data(), n * 4, cudaMemcpyHostToDevice));
}

// ---- hand-written kernels ------------------------------------------------------------------
enum class Work { Copy, Softmax, GeluSoftmax };

__device__ __forceinline__ float gelu_erf(float x) {
  return 0.5f * x * (1.0f + erff(x * 0.70710678118654752440f));
}

template <class T>
__device__ __forceinline__ T block_reduce(T v, T* red, bool mx) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const T u = __shfl_xor_sync(0xffffffffu, v, o);
    v = mx ? fmaxf(v, u) : v + u;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T r = red[0];
  for (int i = 1; i < kThreads / 32; ++i) r = mx ? fmaxf(r, red[i]) : r + red[i];
  __syncthreads();
  return r;
}
__device__ __forceinline__ double block_sum_d(double v, double* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  double r = red[0];
  for (int i = 1; i < kThreads / 32; ++i) r += red[i];
  __syncthreads();
  return r;
}

template <Work kWork>
__device__ __forceinline__ void row_work(float4 (&v)[kVpt], float* red_f, double* red_d) {
  if (kWork == Work::Copy) return;
  if (kWork == Work::GeluSoftmax) {
#pragma unroll
    for (int k = 0; k < kVpt; ++k) {
      v[k].x = gelu_erf(v[k].x); v[k].y = gelu_erf(v[k].y);
      v[k].z = gelu_erf(v[k].z); v[k].w = gelu_erf(v[k].w);
    }
  }
  float m = -HUGE_VALF;
#pragma unroll
  for (int k = 0; k < kVpt; ++k) m = fmaxf(fmaxf(m, fmaxf(v[k].x, v[k].y)), fmaxf(v[k].z, v[k].w));
  m = block_reduce(m, red_f, true);
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < kVpt; ++k) {
    v[k].x = expf(v[k].x - m); v[k].y = expf(v[k].y - m);
    v[k].z = expf(v[k].z - m); v[k].w = expf(v[k].w - m);
    s += (v[k].x + v[k].y) + (v[k].z + v[k].w);
  }
  const float inv = __frcp_rn(static_cast<float>(block_sum_d(s, red_d)));
#pragma unroll
  for (int k = 0; k < kVpt; ++k) {
    v[k].x *= inv; v[k].y *= inv; v[k].z *= inv; v[k].w *= inv;
  }
}

// One row per CTA (grid = M), as the library's register kernel.
template <Work kWork>
__global__ void __launch_bounds__(kThreads, 3) row_per_cta(const float* __restrict__ in,
                                                          float* __restrict__ out, int w) {
  __shared__ float red_f[32];
  __shared__ double red_d[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * w;
  float4 v[kVpt];
#pragma unroll
  for (int k = 0; k < kVpt; ++k)
    v[k] = __ldcs(reinterpret_cast<const float4*>(in + base) + k * kThreads + threadIdx.x);
  row_work<kWork>(v, red_f, red_d);
#pragma unroll
  for (int k = 0; k < kVpt; ++k)
    __stcs(reinterpret_cast<float4*>(out + base) + k * kThreads + threadIdx.x, v[k]);
}

// Persistent: CTA b takes rows b, b + grid, ...; the next row's loads are issued before the
// current row's work, so they are in flight while it computes and stores.
template <Work kWork, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) row_persistent(
    const float* __restrict__ in, float* __restrict__ out, int w, int rows) {
  __shared__ float red_f[32];
  __shared__ double red_d[32];
  float4 v[kVpt], nx[kVpt];
  int r = blockIdx.x;
  if (r >= rows) return;
#pragma unroll
  for (int k = 0; k < kVpt; ++k)
    nx[k] = __ldcs(reinterpret_cast<const float4*>(in + static_cast<int64_t>(r) * w) + k * kThreads + threadIdx.x);
  for (; r < rows; r += gridDim.x) {
#pragma unroll
    for (int k = 0; k < kVpt; ++k) v[k] = nx[k];
    const int rn = r + gridDim.x;
    if (rn < rows) {
#pragma unroll
      for (int k = 0; k < kVpt; ++k)
        nx[k] = __ldcs(reinterpret_cast<const float4*>(in + static_cast<int64_t>(rn) * w) + k * kThreads + threadIdx.x);
    }
    row_work<kWork>(v, red_f, red_d);
#pragma unroll
    for (int k = 0; k < kVpt; ++k)
      __stcs(reinterpret_cast<float4*>(out + static_cast<int64_t>(r) * w) + k * kThreads + threadIdx.x, v[k]);
  }
}

// The `fast` x split (split_hilo.cu's common case: K == Kh, no scale, [lo | hi | hi]) with every
// load of the thread's row share issued before any split or store (kChunks 8-column chunks
// per thread), against the library's loop of one 32-byte load, split and store at a time.
template <int kChunks>
__global__ void __launch_bounds__(256) split_hilo_batched(const float* __restrict__ src, int64_t rows,
                                                          int64_t K, __nv_bfloat16* __restrict__ out,
                                                          int* __restrict__ flags) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row = src + r * K;
    __nv_bfloat16* lo_seg = out + r * 3 * K;  // [lo | hi | hi], as the library's x split
    __nv_bfloat16* hi_seg = lo_seg + K;
    bool exceptional = false, nan = false;
    for (int64_t c0 = 8 * static_cast<int64_t>(threadIdx.x); c0 < K; c0 += 8 * blockDim.x * kChunks) {
      float4 q[kChunks][2];
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int64_t c = c0 + static_cast<int64_t>(i) * 8 * blockDim.x;
        q[i][0] = q[i][1] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (c < K) {
          q[i][0] = __ldcs(reinterpret_cast<const float4*>(row + c));
          q[i][1] = __ldcs(reinterpret_cast<const float4*>(row + c + 4));
        }
      }
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int64_t c = c0 + static_cast<int64_t>(i) * 8 * blockDim.x;
        if (c >= K) break;
        const float v[8] = {q[i][0].x, q[i][0].y, q[i][0].z, q[i][0].w,
                            q[i][1].x, q[i][1].y, q[i][1].z, q[i][1].w};
        __nv_bfloat16 hi[8], lo[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          exceptional |= !cuda::split_bf16(v[j], hi[j], lo[j]);
          nan |= v[j] != v[j];
        }
        const uint4 h = cuda::pack_bf16x8(hi);
        *reinterpret_cast<uint4*>(lo_seg + c) = cuda::pack_bf16x8(lo);
        *reinterpret_cast<uint4*>(hi_seg + c) = h;
        *reinterpret_cast<uint4*>(hi_seg + K + c) = h;
      }
    }
    cuda::mark_row(nan, exceptional, r, cuda::RowMarks{flags, nullptr});
  }
}

// ---- harness -------------------------------------------------------------------------------
struct Timer {
  cudaStream_t st;
  cudaEvent_t a, b;
  explicit Timer(cudaStream_t s) : st(s) {
    CHECK_CUDA(cudaEventCreate(&a));
    CHECK_CUDA(cudaEventCreate(&b));
  }
  template <class F>
  float median_us(F&& launch, int reps = 50) {
    for (int i = 0; i < 5; ++i) launch(i);
    std::vector<float> t;
    for (int i = 0; i < reps; ++i) {
      CHECK_CUDA(cudaEventRecord(a, st));
      launch(i);
      CHECK_CUDA(cudaEventRecord(b, st));
      CHECK_CUDA(cudaEventSynchronize(b));
      float ms = 0.f;
      CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
      t.push_back(1e3f * ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};

double max_rel_diff(const float* d_a, const float* d_b, size_t n) {
  std::vector<float> a(n), b(n);
  CHECK_CUDA(cudaMemcpy(a.data(), d_a, n * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(b.data(), d_b, n * 4, cudaMemcpyDeviceToHost));
  double m = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double d = std::fabs(double(a[i]) - b[i]) / std::max(1e-30, std::fabs(double(b[i])));
    if (!(d <= m)) m = d;  // NaN shows as NaN
  }
  return m;
}

}  // namespace

int main() {
  cudaStream_t st;
  CHECK_CUDA(cudaStreamCreate(&st));
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Timer tm(st);
  const size_t n = kM * kN;

  Buf x(4 * kM * kK), w(4 * kN * kK), bias(4 * kN);
  fill(x.p, kM * kK, 0.f, 1.f);
  fill(w.p, kN * kK, -1.f / std::sqrt(float(kK)), 1.f / std::sqrt(float(kK)));
  fill(bias.p, kN, -1.f / std::sqrt(float(kK)), 1.f / std::sqrt(float(kK)));

  // Three workspaces, each filled by a whole run: the library's pass reads Y from its plan's
  // buffer there, and the hand-written kernels read the same three buffers (rotated).
  std::vector<std::unique_ptr<Buf>> outs;
  for (int i = 0; i < 3; ++i) outs.push_back(std::make_unique<Buf>(4 * n));
  std::vector<float*> ys(3, nullptr);

  struct Case {
    const char* name;
    std::string tail;
  };
  const Case cases[] = {{"m99 gelu softmax", "gelu\nsoftmax"}, {"softmax", "softmax"}};
  std::unique_ptr<Buf> ref_gs;  // the library's gelu -> softmax output of set 0
  std::vector<std::unique_ptr<Buf>> keep;  // the gelu -> softmax plan's workspaces (ys)
  for (const Case& c : cases) {
    PlanRequest req;
    req.chain = parse_chain("linear in=8192 out=8192 bias=1\n" + c.tail);
    req.batch_sizes = {kM};
    req.precision = Precision::Fast;
    const Plan plan = make_plan(req);
    CudaExecutor ex;
    Buf prepared(ex.prepared_bytes(plan));
    std::vector<std::unique_ptr<Buf>> wss;
    RunArgs args;
    args.x = x.p;
    args.weight = w.p;
    args.bias = bias.p;
    args.stream = st;
    args.out = outs[0]->p;
    ex.prepare(plan, args, prepared.p);
    for (int i = 0; i < 3; ++i) {
      wss.push_back(std::make_unique<Buf>(ex.workspace_bytes(plan)));
      args.out = outs[i]->p;
      ex.run(plan, args, prepared.p, wss[i]->p);
    }
    CHECK_CUDA(cudaStreamSynchronize(st));
    const Step& row = plan.steps.back();
    const cuda::WorkspaceLayout WL = cuda::workspace_layout(plan);
    auto scratch = [&](int i) {
      return WL.row_scratch != cuda::kAbsent
                 ? reinterpret_cast<float*>(wss[i]->as<char>() + WL.row_scratch) : nullptr;
    };
    const float us = tm.median_us([&](int i) {
      RunArgs r = args;
      r.out = outs[i % 3]->p;
      cuda::launch_row_pass(plan, row, r, wss[i % 3]->as<char>(), scratch(i % 3), st);
    });
    std::printf("%-52s %7.2f us  (%.2f TB/s)\n", (std::string("library row pass, ") + c.name).c_str(),
                us, 64e6 / (us * 1e-6) / 1e12);
    if (c.tail == "gelu\nsoftmax") {
      ref_gs = std::make_unique<Buf>(4 * n);
      RunArgs r = args;
      r.out = ref_gs->p;
      cuda::launch_row_pass(plan, row, r, wss[0]->as<char>(), scratch(0), st);
      CHECK_CUDA(cudaStreamSynchronize(st));
      for (int i = 0; i < 3; ++i) {
        ys[i] = reinterpret_cast<float*>(wss[i]->as<char>() + plan.buffer_offset(row.input));
        keep.push_back(std::move(wss[i]));
      }
    }
  }

  auto report = [&](const char* name, float us) {
    std::printf("%-52s %7.2f us  (%.2f TB/s)\n", name, us, 64e6 / (us * 1e-6) / 1e12);
  };
  auto check = [&](const char* name) {
    std::printf("    %s: max rel diff vs library %.3g\n", name, max_rel_diff(outs[0]->as<float>(), ref_gs->as<float>(), n));
  };
  const int w8 = static_cast<int>(kN), rows = static_cast<int>(kM);
  auto per_cta = [&](auto kern) {
    return tm.median_us([&](int i) {
      kern<<<rows, kThreads, 0, st>>>(ys[i % 3], outs[i % 3]->as<float>(), w8);
    });
  };
  auto persistent = [&](auto kern, int grid) {
    return tm.median_us([&](int i) {
      kern<<<grid, kThreads, 0, st>>>(ys[i % 3], outs[i % 3]->as<float>(), w8, rows);
    });
  };
  report("copy, one row per CTA", per_cta(row_per_cta<Work::Copy>));
  report("softmax, one row per CTA", per_cta(row_per_cta<Work::Softmax>));
  report("gelu softmax, one row per CTA", per_cta(row_per_cta<Work::GeluSoftmax>));
  check("gelu softmax, one row per CTA");
  for (int per_sm : {1, 2}) {
    const int grid = per_sm * sms;
    char name[96];
    std::snprintf(name, sizeof(name), "copy, persistent %d per SM", per_sm);
    report(name, per_sm == 1 ? persistent(row_persistent<Work::Copy, 1>, grid)
                             : persistent(row_persistent<Work::Copy, 2>, grid));
    std::snprintf(name, sizeof(name), "softmax, persistent %d per SM", per_sm);
    report(name, per_sm == 1 ? persistent(row_persistent<Work::Softmax, 1>, grid)
                             : persistent(row_persistent<Work::Softmax, 2>, grid));
    std::snprintf(name, sizeof(name), "gelu softmax, persistent %d per SM", per_sm);
    report(name, per_sm == 1 ? persistent(row_persistent<Work::GeluSoftmax, 1>, grid)
                             : persistent(row_persistent<Work::GeluSoftmax, 2>, grid));
    check(name);
  }

  // The x split: the library's launch against the batched-load variant (x sets rotated).
  {
    std::vector<std::unique_ptr<Buf>> xsets, parts;
    for (int i = 0; i < 3; ++i) {
      xsets.push_back(std::make_unique<Buf>(4 * kM * kK));
      fill(xsets.back()->p, kM * kK, 0.f, 1.f);
      parts.push_back(std::make_unique<Buf>(3 * 2 * kM * kK));
    }
    Buf flags(4 * kM), ref(3 * 2 * kM * kK);
    auto lib = [&](int i, void* dst) {
      cuda::launch_split_hilo(xsets[i % 3]->as<float>(), nullptr, kM, kK, kK, cuda::HiLoOrder::LoHiHi,
                              static_cast<__nv_bfloat16*>(dst), cuda::RowMarks{flags.as<int>(), nullptr}, st);
    };
    lib(0, ref.p);
    report("x split, library", tm.median_us([&](int i) { lib(i, parts[i % 3]->p); }));
    auto batched = [&](auto kern, unsigned grid) {
      return tm.median_us([&](int i) {
        kern<<<grid, 256, 0, st>>>(xsets[i % 3]->as<float>(), kM, kK,
                                   parts[i % 3]->as<__nv_bfloat16>(), flags.as<int>());
      });
    };
    auto same = [&](const char* name) {
      std::vector<uint16_t> a(3 * kM * kK), b(3 * kM * kK);
      CHECK_CUDA(cudaMemcpy(a.data(), parts[0]->p, a.size() * 2, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(b.data(), ref.p, b.size() * 2, cudaMemcpyDeviceToHost));
      std::printf("    %s: %s the library's parts\n", name, a == b ? "equal to" : "DIFFERENT from");
    };
    report("x split, 4 chunks per thread loaded first", batched(split_hilo_batched<4>, kM));
    same("4 chunks");
    report("x split, 2 chunks per thread loaded first", batched(split_hilo_batched<2>, kM));
    same("2 chunks");
    report("x split, 4 chunks, 512 CTAs (2 rows each)", batched(split_hilo_batched<4>, kM / 2));
    same("4 chunks, 512 CTAs");
  }
  CHECK_CUDA(cudaGetLastError());
  return 0;
}
