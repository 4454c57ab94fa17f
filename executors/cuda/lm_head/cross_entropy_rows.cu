#include "cross_entropy_rows.h"

#include <cmath>

#include "cuda_check.h"
#include "row_team.h"

namespace gemmfuse::cuda {
namespace {

constexpr int kThreads = 512;

// A CTA per row: the row team of the row backward (row_team.h's StridedRow over the CTA).
__global__ void __launch_bounds__(kThreads) cross_entropy_rows_kernel(CrossEntropyRows p) {
  __shared__ double red_d[kThreads / 32];
  __shared__ float red_f[kThreads / 32];
  const int64_t r = blockIdx.x;
  float* z = p.z + r * p.ldz;
  const int V = static_cast<int>(p.V);
  StridedRow<BlockCombine> row{z, z, V, static_cast<int>(threadIdx.x), kThreads, {red_d, red_f}};
  const int64_t t = p.target[r];
  const float z_t = z[t];  // read before any member writes the row
  // fmaxf drops a NaN, which then reaches s through its exponent (row_team.h's ShiftMaxF).
  const float m = row.extremum(-HUGE_VALF, ShiftMaxF());
  const double s = row.sum([m](float v) { return static_cast<double>(expf(v - m)); });
  const double z_sum = p.eps > 0.f ? row.sum([](float v) { return static_cast<double>(v); }) : 0.0;
  if (p.loss != nullptr && threadIdx.x == 0) {
    const double log_s = log(s);
    double loss = log_s - (static_cast<double>(z_t) - m);
    if (p.eps > 0.f) loss = loss * (1.0 - p.eps) + (log_s - (z_sum / p.V - m)) * p.eps;
    p.loss[r] = p.valid[r] ? static_cast<float>(loss) : 0.f;
  }
  if (p.w == nullptr) return;
  const float w = p.w[r];
  const float scale = w / static_cast<float>(s);
  const float smooth = p.eps > 0.f ? w * (p.eps / static_cast<float>(p.V)) : 0.f;
  const float hit = w * -(1.f - p.eps);
  row.each_col([&](int c) {
    float g = expf(z[c] - m) * scale - smooth;
    if (c == t) g += hit;
    z[c] = g;
  });
  for (int64_t c = p.V + threadIdx.x; c < p.ldz; c += kThreads) z[c] = 0.f;
}

}  // namespace

void launch_cross_entropy_rows(const CrossEntropyRows& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  cross_entropy_rows_kernel<<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
  GF_LAUNCH_CHECK();
}

}  // namespace gemmfuse::cuda
