// The CUDA executor: runs a Plan on one GPU, asynchronously on args.stream.
//
//   Gemm         cuBLASLt (gemm_cublas.cu): fp32 SGEMM / TF32 / bf16 hi + lo split (`fast`) /
//                the model's 16-bit type; bias as the GEMM epilogue. fp32 on sm90 where its
//                cost rule says so: three fp16 part products of row-scaled operands with fp32
//                promotion (sm90/gemm_f16x3.cu); up to 32 rows: gemm_small_m.cu
//   Gemv         gemv.cu: x . colsum(W) + sum(b)
//   RowPass      row_program.cu: the register kernel or the row-program interpreter
//   ColumnStats  column_stats.cu: BatchNorm statistics (batch: two-level reduction, running
//                stats updated on device; eval: from the running stats)
//   prepare()    prepare.cu: folded eval BatchNorm, fp32 bias, column sums, W splits
//   Gemm + RowPass of a 16-bit Linear -> [gelu] -> [scalar] -> softmax: one sm90 kernel
//                (sm90/gemm_softmax.cu) when the device and shape allow
//
// Which kernel runs each step (and the backward's GEMMs) is chosen once per plan and device
// by the kernel selection (selection.h), kept with the plan (plan_state.h); run() and
// backward() launch what it chose.
//
// Contract (executor.h): x, weight, bias and out in plan.dtype, operands and running stats
// fp32, num_batches int64, all device pointers on the current device. run() never
// synchronises the host and is CUDA-graph capturable. It allocates nothing, except when the
// fused kernel, which the plan's workspace was sized for, declines at run time (misaligned
// pointers, or the driver refuses the cooperative grid): that call's steps then get their
// workspace in stream order (cudaMallocAsync/cudaFreeAsync); errors throw
// std::runtime_error (CUDA/cuBLAS failures), Unsupported (a plan this executor does not
// take: check() says so up front) or std::invalid_argument (missing tensors).
// Thread-safe: one instance may serve several threads and devices (the cuBLAS and cuBLASLt
// handles, gemm/blas_handles.h, and cuBLASLt's algorithm choices are cached per device
// behind mutexes).
#pragma once

#include <string>

#include "gemmfuse/executor.h"

namespace gemmfuse {

class CudaExecutor : public Executor {
 public:
  CudaExecutor() = default;

  // Throws Unsupported when the plan exceeds this executor's limits (e.g. a row program of
  // more than 32 instructions). prepared_bytes/workspace_bytes/run call it too.
  static void check(const Plan& plan);
  // PlanRequest::fast_min_rows on the current device for an M x N x K GEMM: the kernel
  // selection's rule (selection.h's fast_min_rows) with this device's facts.
  static int64_t fast_min_rows(int64_t M, int64_t N, int64_t K);

  // The kernel selection for this plan on the current device, one line per choice with its
  // reason and the overrides that are set, for explain.
  static std::string describe_kernels(const Plan& plan);
  // Whether the kernel selection runs the plan's forward GEMM on a split kernel (f16x3 or
  // `fast`'s bf16 parts) on the current device, rather than cuBLAS's fp32/TF32 GEMM or the
  // small-M kernel: gemmfuse::bmm_route's rule for which batches gemmfuse runs.
  static bool gemm_on_split_kernel(const Plan& plan);

  size_t prepared_bytes(const Plan& plan) const override;
  size_t workspace_bytes(const Plan& plan) const override;
  void prepare(const Plan& plan, const RunArgs& args, void* prepared) override;
  void run(const Plan& plan, const RunArgs& args, const void* prepared, void* workspace) override;
  // What backward() runs for dx, dW and the row backward on the current device, and why
  // (the Selection's), for explain.
  static std::string describe_backward(const Plan& plan, const BackwardPlan& bp);
  // backward.cu: the row backward by segments (backward_rows.cu), then db, dW and dx on
  // cuBLAS or f16x3.
  void backward(const Plan& plan, const BackwardPlan& bp, const BackwardArgs& args) override;
  size_t backward_workspace_bytes(const Plan& plan, const BackwardPlan& bp) const override;
  size_t backward_weight_bytes(const Plan& plan, const BackwardPlan& bp) const override;
};

}  // namespace gemmfuse
