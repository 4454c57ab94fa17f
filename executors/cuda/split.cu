// x[M,K] fp32 -> [xlo | 0 | xhi | 0] bf16 [M, 2*Kh], once per `fast` GEMM. Memory bound: a
// thread takes 8 columns (two 16-byte loads of x, one 16-byte store per half).
#include "split.h"

#include <algorithm>
#include <stdexcept>

#include "cuda_check.h"

namespace gemmfuse::cuda {
namespace {

__global__ void __launch_bounds__(256)
    split_x_kernel(const float* __restrict__ x, __nv_bfloat16* __restrict__ xs, int64_t M,
                   int64_t K, int64_t Kh, bool vec) {
  const int64_t per_row = Kh / 8;  // 8-column chunks per row
  const int64_t total = M * per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t m = i / per_row, c = (i - m * per_row) * 8;
    const float* xr = x + m * K;
    float v[8];
    if (vec) {  // K % 4 == 0: each 4-column half is wholly inside or outside [0, K)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (c + 4 * h < K) {
          const float4 q = __ldg(reinterpret_cast<const float4*>(xr + c + 4 * h));
          v[4 * h + 0] = q.x; v[4 * h + 1] = q.y; v[4 * h + 2] = q.z; v[4 * h + 3] = q.w;
        } else {
          v[4 * h + 0] = v[4 * h + 1] = v[4 * h + 2] = v[4 * h + 3] = 0.f;
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = (c + j < K) ? __ldg(xr + c + j) : 0.f;
    }
    __nv_bfloat16 hi[8], lo[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) split_bf16(v[j], hi[j], lo[j]);
    uint4 ul, uh;
    ul.x = pack_bf16x2(lo[0], lo[1]); ul.y = pack_bf16x2(lo[2], lo[3]);
    ul.z = pack_bf16x2(lo[4], lo[5]); ul.w = pack_bf16x2(lo[6], lo[7]);
    uh.x = pack_bf16x2(hi[0], hi[1]); uh.y = pack_bf16x2(hi[2], hi[3]);
    uh.z = pack_bf16x2(hi[4], hi[5]); uh.w = pack_bf16x2(hi[6], hi[7]);
    __nv_bfloat16* row = xs + m * 2 * Kh;
    *reinterpret_cast<uint4*>(row + c) = ul;       // lo half first
    *reinterpret_cast<uint4*>(row + Kh + c) = uh;  // then hi
  }
}

}  // namespace

void launch_split_x(const float* x, __nv_bfloat16* xs, int64_t M, int64_t K, int64_t Kh,
                    cudaStream_t stream) {
  if (Kh % 8 != 0) throw std::logic_error("CUDA split: Kh must be a multiple of 8");
  if (reinterpret_cast<uintptr_t>(xs) % 16 != 0)
    throw std::logic_error("CUDA split: split buffer not 16-byte aligned");
  const int64_t total = M * (Kh / 8);
  if (total == 0) return;
  const bool vec = K % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const int64_t blocks = std::min<int64_t>((total + 255) / 256, int64_t(132) * 16);
  split_x_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(x, xs, M, K, Kh, vec);
  GF_LAUNCH_CHECK();
}

}  // namespace gemmfuse::cuda
