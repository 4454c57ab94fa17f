// The GEMM stages' workspace sizes, which backward_layout.cpp places only where dW or dx run on
// the f16x3 kernel: the emulated row-stage tests choose neither, so reaching one is a bug here.
#include <cstdio>
#include <cstdlib>

#include "gemm_f16x3.h"
#include "split.h"
#include "weight_grad_f16x3.h"

namespace gemmfuse::cuda {
[[noreturn]] static void not_emulated(const char* what) {
  std::fprintf(stderr, "EMU: %s is not emulated (a row-stage test chose an f16x3 GEMM)\n", what);
  std::abort();
}
size_t split_f16x2_columns_scratch_bytes(int64_t) { not_emulated("split_f16x2_columns_scratch_bytes"); }
size_t weight_grad_f16x3_workspace_bytes(int64_t, int64_t, int64_t, int) { not_emulated("weight_grad_f16x3_workspace_bytes"); }
namespace sm90 {
size_t f16x3_workspace_bytes(int64_t, int64_t, int64_t, bool, int) { not_emulated("f16x3_workspace_bytes"); }
}  // namespace sm90
}  // namespace gemmfuse::cuda
