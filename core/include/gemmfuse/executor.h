// The executor interface: one plan, two executors (CPU is the reference and the fallback,
// CUDA the product). Executors allocate nothing: the caller (bindings) owns the memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "gemmfuse/backward.h"
#include "gemmfuse/plan.h"

namespace gemmfuse {

// The tensors of one call, all contiguous. On the CPU executor every float tensor is fp32;
// on CUDA x, weight, bias and out are in plan.dtype and everything else is fp32.
struct RunArgs {
  const void* x = nullptr;       // [M, K]
  const void* weight = nullptr;  // [N, K]
  const void* bias = nullptr;    // [N] or nullptr
  std::vector<const float*> operands;  // t<i>, fp32, contiguous
  std::vector<void*> state;            // s<i>: running_mean/var (float*), num_batches (int64_t*)
  // CUDA only: the dtype of each running-statistics tensor in `state` (fp32, bf16 or fp16;
  // missing entries are fp32). The CPU executor takes fp32 running statistics only.
  std::vector<DType> state_dtypes;
  void* out = nullptr;           // [M, plan.out_width]
  void* stream = nullptr;        // cudaStream_t for CUDA; unused on the CPU

  // CPU only: y[M,N] = x[M,K] W[N,K]^T in fp32. The bindings pass PyTorch's BLAS; when empty
  // the CPU executor uses its own blocked loop (enough for tests).
  std::function<void(int64_t M, int64_t N, int64_t K, const float* x, const float* w, float* y)>
      cpu_gemm;

  // Training (gemmfuse::train_forward): where the forward writes what its backward needs
  // (backward->saved says what, fp32), and whether it updates the running statistics in
  // `state` itself (a differentiable forward leaves that to gemmfuse::update_running_stats).
  float* saved = nullptr;
  const struct BackwardPlan* backward = nullptr;  // given with `saved`
  bool update_state = true;
};

// CPU only: C[M,N] = op(A) op(B) in fp32, op(A) [M,K] and op(B) [K,N]; A is stored [M,K] (or
// [K,M] when ta) and B [K,N] (or [N,K] when tb), row-major.
using CpuMatmul = std::function<void(int64_t M, int64_t N, int64_t K, const float* a, bool ta,
                                     const float* b, bool tb, float* c)>;

// The tensors of one backward call (gemmfuse::train_backward). A gradient that is not wanted
// is nullptr. grad_out, operands, state and the gradients are fp32; x, weight and bias are
// fp32 on the CPU and for a GEMV's backward, else in plan.dtype on CUDA.
struct BackwardArgs {
  const void* grad_out = nullptr;      // [M, plan.out_width]
  const void* x = nullptr;             // [M, K]
  const void* weight = nullptr;        // [N, K]
  const void* bias = nullptr;          // [N] or nullptr
  std::vector<const float*> operands;  // t<i>, fp32, contiguous
  std::vector<int64_t> operand_numel;  // their sizes (the shape of their gradients)
  std::vector<void*> state;            // s<i>, fp32 (eval BatchNorm reads its running stats)
  const float* saved = nullptr;        // what the forward saved (BackwardPlan::saved)
  void* grad_x = nullptr;              // [M, K], fp32
  void* grad_w = nullptr;              // [N, K], fp32
  void* grad_b = nullptr;              // [N], fp32
  std::vector<float*> grad_operands;   // fp32, operand_numel[i] values each, or nullptr
  void* stream = nullptr;
  void* workspace = nullptr;           // CUDA: Executor::backward_workspace_bytes of scratch
  void* weight_scratch = nullptr;      // Executor::backward_weight_bytes for what the backward
                                       // builds from W (dx's split of it), or null when none
  CpuMatmul cpu_matmul;                // CPU only; when empty a plain loop
};

class Executor {
 public:
  virtual ~Executor() = default;
  // Bytes of the per-weight-version preparation (column sums, folded or split weights).
  virtual size_t prepared_bytes(const Plan& plan) const = 0;
  // Bytes of scratch one run needs (plan.buffers_bytes() plus the executor's own).
  virtual size_t workspace_bytes(const Plan& plan) const = 0;
  // Fill `prepared` from args.weight / args.bias / operands; called once per weight version.
  virtual void prepare(const Plan& plan, const RunArgs& args, void* prepared) = 0;
  // Run the plan. Asynchronous on CUDA (stream-ordered, no host sync).
  virtual void run(const Plan& plan, const RunArgs& args, const void* prepared,
                   void* workspace) = 0;
  // The gradients of a plan made for training (backward.h), from what run() saved.
  virtual void backward(const Plan& plan, const BackwardPlan& bp, const BackwardArgs& args) = 0;
  // Bytes of scratch backward() needs in BackwardArgs::workspace.
  virtual size_t backward_workspace_bytes(const Plan&, const BackwardPlan&) const { return 0; }
  // Bytes backward() needs in BackwardArgs::weight_scratch for data it builds from W to compute
  // dx (callers not asking for dx give none). They may be the forward's prepared bytes for
  // this weight (as large at least), which the caller then marks stale: so the backward adds
  // no weight-sized memory of its own.
  virtual size_t backward_weight_bytes(const Plan&, const BackwardPlan&) const { return 0; }
};

}  // namespace gemmfuse
