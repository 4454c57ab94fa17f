// The CPU executor: runs a Plan in fp32 on the host. It is the reference the CUDA executor
// is tested against and the fallback when no GPU is present; clarity beats speed here, but
// it is parallel (OpenMP over rows) so that tests and fallbacks are not slow.
//
// All float tensors of RunArgs are fp32 (`x`, `weight`, `bias`, `out` are float*); state
// tensors are float* (running_mean / running_var) and int64_t* (num_batches).
// Reductions accumulate in double; the pointwise math is executors/common/pointwise.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gemmfuse/executor.h"

namespace gemmfuse {

class CpuExecutor : public Executor {
 public:
  // Layout of `prepared`: [W' (N*K) | b' (N)] when an eval BatchNorm is folded, then
  // [colsum (K) | sum of b (1)] for a Gemv; each part 256-byte aligned. 0 when neither.
  size_t prepared_bytes(const Plan& plan) const override;
  // plan.buffers_bytes(): the CPU executor keeps its per-row scratch on the stack/heap.
  size_t workspace_bytes(const Plan& plan) const override;
  void prepare(const Plan& plan, const RunArgs& args, void* prepared) override;
  // Synchronous. Updates BatchNorm running state in args.state when the plan trains (and
  // args.update_state); writes args.saved when given (BackwardPlan::saved).
  void run(const Plan& plan, const RunArgs& args, const void* prepared, void* workspace) override;
  // The reference backward (cpu_backward.cpp): every row's values recomputed from the saved
  // GEMM output, the stages' derivatives in reverse, then dx, dW, db.
  void backward(const Plan& plan, const BackwardPlan& bp, const BackwardArgs& args) override;
};

// y[M,N] = x[M,K] w[N,K]^T in fp32, cache-blocked, OpenMP over rows (no bias).
void cpu_gemm_blocked(int64_t M, int64_t N, int64_t K, const float* x, const float* w, float* y);

}  // namespace gemmfuse
