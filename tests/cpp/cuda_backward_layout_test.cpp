// The backward's scratch layout (executors/cuda/backward/backward_layout.h) on the CPU, from
// the kernel selection's choices for an H100: what each stage holds over the shared bytes
// after dV, at the seed shape (M = 1024, K = N = 8192). No GPU: the layout is plain C++.
#include <gtest/gtest.h>

#include <algorithm>

#include "backward_layout.h"
#include "gemmfuse/backward.h"
#include "selection_test_util.h"

using namespace gemmfuse;
using namespace gemmfuse::cuda;
using namespace gemmfuse::cuda::test;

namespace {

// dW = dVᵀ x splits dV where it lies: its stage holds two [M, N]-sized fp16 part pairs (dVᵀ's
// and x's) and no fp32 copy of dVᵀ, so the scratch after dV is no larger than dx's stage (dV's
// parts and its second level's), 2 x 32 MB here, plus the marks and the kernels' workspaces.
TEST(CudaBackwardLayout, DwHoldsNoCopyOfDv) {
  const int64_t M = 1024, N = 8192;
  const Plan p = plan_of(linear(N, N) + "relu\nsoftmax", M, DType::F32, Precision::FP32, true);
  const BackwardPlan bp = make_backward_plan(p);
  const Selection s = select(p, &bp, hopper(), Overrides{});
  ASSERT_EQ(s.backward.dw, GemmKind::F16x3);
  ASSERT_EQ(s.backward.dx, GemmKind::F16x3);
  const BackwardLayout L = backward_layout(p, bp, s.backward);
  const size_t dv_end = L.dv + 4 * M * N, parts = 2 * 2 * M * N;
  EXPECT_LE(L.dw_ws_bytes, 2 * parts + (size_t(4) << 20));  // dW's two part pairs and their marks
  EXPECT_LE(L.total - dv_end, 2 * parts + (size_t(8) << 20))
      << "the scratch after dV: " << (L.total - dv_end) / (1 << 20) << " MB";
}

}  // namespace
