#include "cuda_executor.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "column_stats.h"
#include "cuda_check.h"
#include "fused_softmax.h"
#include "gemm_cublas.h"
#include "gemv.h"
#include "layout.h"
#include "prepare.h"
#include "row_program.h"

namespace gemmfuse {

using namespace gemmfuse::cuda;

namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Gemm + RowPass as one sm90 kernel when the plan and the device allow (fused_softmax.h);
// false: run the steps.
bool run_fused_softmax(const Plan& plan, const RunArgs& args, const PreparedLayout& P,
                       const char* prep, const WorkspaceLayout& W, char* ws, cudaStream_t stream) {
  const FusedSoftmax f = match_fused_softmax(plan);
  if (!fused_softmax_unused(plan, f).empty()) return false;
  sm90::GemmSoftmaxProblem p;
  p.M = plan.M;
  p.N = plan.N;
  p.K = plan.K;
  p.dtype = plan.dtype;
  p.x = args.x;
  p.w = P.w_folded != kAbsent ? prep + P.w_folded : args.weight;
  p.bias = P.bias_f32 != kAbsent ? reinterpret_cast<const float*>(prep + P.bias_f32) : nullptr;
  if (plan.chain.has_bias && p.bias == nullptr)
    throw std::logic_error("CUDA executor: a 16-bit bias without its prepared fp32 copy");
  p.out = args.out;
  p.act = f.act;
  p.scale = f.scale;
  // TMA and the 16-byte stores need aligned rows (K, N multiples of 8: checked in unfit).
  if (!aligned16(p.x) || !aligned16(p.w) || !aligned16(p.out)) return false;
  return sm90::launch_gemm_softmax(p, ws + W.gemm_softmax, stream);
}

}  // namespace

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

std::string CudaExecutor::describe_kernels(const Plan& plan) {
  const FusedSoftmax f = match_fused_softmax(plan);
  if (!f.matches) return "";
  const std::string why = fused_softmax_unused(plan, f);
  if (why.empty())
    return "cuda: Gemm + RowPass run as one sm90 kernel (TMA/wgmma GEMM, the softmax finished "
           "on chip; Y never goes to memory)";
  return "cuda: the fused sm90 GEMM + softmax kernel is not used: " + why;
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
  const PreparedLayout P = prepared_layout(plan);
  if (P.total > 0 && prep == nullptr)
    throw std::invalid_argument("gemmfuse: the plan needs prepared weights (prepare() first)");
  if (!args.x || !args.out) throw std::invalid_argument("gemmfuse: x and out are required");

  if (run_fused_softmax(plan, args, P, prep, W, ws, stream)) return;
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
