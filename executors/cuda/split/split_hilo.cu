// The `fast` split of fp32 operands into bf16 hi + lo parts (split.h): x per call, W' once
// per weight version. A CTA per row (grid-stride over rows), so that the row can be marked
// when it holds a value the split cannot carry; a thread takes 8 columns per step (one
// 16-byte store per segment of the row). Memory bound: the common case (K % 8 == 0, src
// 16-byte aligned, no scale) is compiled apart, without the bounds checks and the scale.
#include <cuda_bf16.h>

#include <algorithm>
#include <stdexcept>

#include "cuda_check.h"
#include "device_info.h"
#include "programmatic_launch.h"
#include "split.h"

namespace gemmfuse::cuda {
namespace {

// kWhole: K == Kh and src 16-byte aligned (two 16-byte loads, no bounds); else a 16-byte
// load per 4-column half when `vec` (K % 4 == 0 and aligned), scalar loads otherwise.
template <bool kWhole, bool kScaled>
__global__ void __launch_bounds__(256)
    split_hilo_kernel(const float* __restrict__ src, const float* __restrict__ scale,
                      int64_t rows, int64_t K, int64_t Kh, bool lo_first, bool vec,
                      __nv_bfloat16* __restrict__ out, RowMarks marks) {
  wait_for_previous_grid();  // launched programmatically
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row = src + r * K;
    const float s = kScaled ? scale[r] : 1.f;
    __nv_bfloat16* dst = out + r * kFastSplitSegments * Kh;  // [lo | hi | hi] or [hi | lo | hi]
    bool exceptional = false, nan = false;
    for (int64_t c = 8 * static_cast<int64_t>(threadIdx.x); c < Kh; c += 8 * blockDim.x) {
      float v[8];
      if (kWhole || vec) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // each 4-column half wholly inside or outside [0, K)
          float4 q = make_float4(0.f, 0.f, 0.f, 0.f);
          if (kWhole || c + 4 * h < K) q = __ldg(reinterpret_cast<const float4*>(row + c + 4 * h));
          v[4 * h + 0] = q.x; v[4 * h + 1] = q.y; v[4 * h + 2] = q.z; v[4 * h + 3] = q.w;
        }
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = c + j < K ? __ldg(row + c + j) : 0.f;
      }
      __nv_bfloat16 hi[8], lo[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        // the padding stays zero whatever the scale
        const float u = kScaled ? (kWhole || c + j < K ? v[j] * s : 0.f) : v[j];
        exceptional |= !split_bf16(u, hi[j], lo[j]);
        nan |= u != u;
      }
      const uint4 h = pack_bf16x8(hi), l = pack_bf16x8(lo);  // packed before the choice: the
      *reinterpret_cast<uint4*>(dst + c) = lo_first ? l : h;    // arrays stay in registers
      *reinterpret_cast<uint4*>(dst + Kh + c) = lo_first ? h : l;
      *reinterpret_cast<uint4*>(dst + 2 * Kh + c) = h;
    }
    mark_row(nan, exceptional, r, marks);
  }
}

}  // namespace

void launch_split_hilo(const float* src, const float* scale, int64_t rows, int64_t K, int64_t Kh,
                       HiLoOrder order, __nv_bfloat16* out, RowMarks marks, cudaStream_t stream) {
  if (Kh % 8 != 0 || Kh < K) throw std::logic_error("CUDA split: Kh must be a multiple of 8, >= K");
  if (reinterpret_cast<uintptr_t>(out) % 16 != 0)
    throw std::logic_error("CUDA split: split buffer not 16-byte aligned");
  if (rows <= 0 || Kh == 0) return;
  const bool aligned = reinterpret_cast<uintptr_t>(src) % 16 == 0;
  const bool whole = K == Kh && aligned, vec = K % 4 == 0 && aligned;
  const bool lo_first = order == HiLoOrder::LoHiHi;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, int64_t(sm_count()) * 8));
  auto kernel = whole ? (scale ? split_hilo_kernel<true, true> : split_hilo_kernel<true, false>)
                      : (scale ? split_hilo_kernel<false, true> : split_hilo_kernel<false, false>);
  launch_programmatic(kernel, dim3(grid), dim3(256), 0, stream, src, scale, rows, K, Kh, lo_first,
                      vec, out, marks);
}

}  // namespace gemmfuse::cuda
