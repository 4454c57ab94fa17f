#include "cuda_executor.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "column_stats.h"
#include "cuda_check.h"
#include "gemm_cublas.h"
#include "gemv.h"
#include "layout.h"
#include "prepare.h"
#include "row_program.h"

namespace gemmfuse {

using namespace gemmfuse::cuda;

void CudaExecutor::check(const Plan& plan) {
  if (plan.steps.empty()) throw std::logic_error("CUDA executor: empty plan");
  if (plan.steps.back().output != kOutput)
    throw std::logic_error("CUDA executor: the last step does not write the output");
  for (const Step& s : plan.steps) {
    switch (s.kind) {
      case Step::Kind::Gemm:
      case Step::Kind::Gemv:
        break;
      case Step::Kind::RowPass:
        check_row_step(s);
        break;
      case Step::Kind::ColumnStats:
        if (s.output < 0)
          throw std::logic_error("CUDA executor: ColumnStats must write a buffer");
        break;
    }
  }
}

size_t CudaExecutor::prepared_bytes(const Plan& plan) const {
  check(plan);
  return prepared_layout(plan).total;
}

size_t CudaExecutor::workspace_bytes(const Plan& plan) const {
  check(plan);
  return workspace_layout(plan).total;
}

void CudaExecutor::prepare(const Plan& plan, const RunArgs& args, void* prepared) {
  check(plan);
  prepare_weights(plan, args, static_cast<char*>(prepared), static_cast<cudaStream_t>(args.stream));
}

void CudaExecutor::run(const Plan& plan, const RunArgs& args, const void* prepared,
                       void* workspace) {
  check(plan);
  if (plan.M == 0) return;
  const cudaStream_t stream = static_cast<cudaStream_t>(args.stream);
  const WorkspaceLayout W = workspace_layout(plan);
  char* ws = static_cast<char*>(workspace);
  if (W.total > 0 && ws == nullptr) throw std::invalid_argument("gemmfuse: no workspace passed");
  if (reinterpret_cast<uintptr_t>(ws) % 16 != 0)
    throw std::invalid_argument("gemmfuse: workspace must be 16-byte aligned");
  const char* prep = static_cast<const char*>(prepared);
  if (prepared_layout(plan).total > 0 && prep == nullptr)
    throw std::invalid_argument("gemmfuse: the plan needs prepared weights (prepare() first)");
  if (!args.x || !args.out) throw std::invalid_argument("gemmfuse: x and out are required");

  for (const Step& s : plan.steps) {
    switch (s.kind) {
      case Step::Kind::Gemm:
        run_gemm(plan, s, args, prep, ws, stream);
        break;
      case Step::Kind::Gemv:
        launch_gemv(plan, s, args, prep, ws, stream);
        break;
      case Step::Kind::RowPass:
        launch_row_pass(plan, s, args, ws,
                        W.row_scratch != kAbsent ? reinterpret_cast<float*>(ws + W.row_scratch) : nullptr,
                        stream);
        break;
      case Step::Kind::ColumnStats:
        launch_column_stats(plan, s, args, ws,
                            W.colstats != kAbsent ? reinterpret_cast<double*>(ws + W.colstats) : nullptr,
                            stream);
        break;
    }
  }
}

}  // namespace gemmfuse
