#include "cuda_executor.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "column_stats.h"
#include "cuda_check.h"
#include "device_facts.h"
#include "gemm_cublas.h"
#include "gemm_softmax.h"
#include "gemv.h"
#include "layout.h"
#include "plan_state.h"
#include "prepare.h"
#include "row_program.h"
#include "selection.h"

namespace gemmfuse {

using namespace gemmfuse::cuda;

namespace {

// Device memory for one call, allocated and freed in stream order (cudaMallocAsync).
class StreamScratch {
 public:
  StreamScratch(size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes > 0) GF_CUDA_CHECK(cudaMallocAsync(&p_, bytes, stream));
  }
  ~StreamScratch() {
    if (p_ != nullptr) (void)cudaFreeAsync(p_, stream_);
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  char* get() const { return static_cast<char*>(p_); }

 private:
  void* p_ = nullptr;
  cudaStream_t stream_;
};

// Gemm + RowPass as one sm90 kernel, for a plan whose Selection chose it and `ws` its
// workspace; false (nothing enqueued): the call's pointers are misaligned or the driver
// refused the cooperative grid, so the caller runs the steps.
bool run_fused_softmax(const Plan& plan, const FusedSoftmaxChoice& f, const RunArgs& args,
                       const PreparedLayout& P, const char* prep, char* ws, cudaStream_t stream) {
  sm90::GemmSoftmaxProblem p{plan.M, plan.N, plan.K, plan.dtype, args.x};
  p.w = P.w_folded != kAbsent ? prep + P.w_folded : args.weight;
  p.bias = P.bias_f32 != kAbsent ? reinterpret_cast<const float*>(prep + P.bias_f32) : nullptr;
  if (plan.chain.has_bias && p.bias == nullptr)
    throw std::logic_error("CUDA executor: a 16-bit bias without its prepared fp32 copy");
  p.out = args.out;
  p.act = f.gelu ? sm90::Activation::GeluErf : sm90::Activation::Identity;
  p.scale = f.scale;
  p.programmatic = f.programmatic;
  p.defer_epilogues = f.defer_epilogues;
  // TMA and the 16-byte stores need aligned rows (K, N multiples of 8: checked by the selection).
  if (!aligned16(p.x) || !aligned16(p.w) || !aligned16(p.out)) return false;
  return sm90::launch_gemm_softmax(p, ws, stream);
}

// The plan step by step, with the steps' workspace `ws` (layout st.workspace), each on the
// kernel its Selection chose.
void run_steps(const Plan& plan, const PlanState& st, const RunArgs& args, const char* prep, char* ws,
               cudaStream_t stream) {
  const WorkspaceLayout& W = st.workspace;
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    const Step& s = plan.steps[i];
    switch (s.kind) {
      case Step::Kind::Gemm:
        run_gemm(plan, st, s, args, prep, ws, stream);
        break;
      case Step::Kind::Gemv:
        launch_gemv(plan, s, args, prep, ws, stream);
        break;
      case Step::Kind::RowPass:
        launch_row_pass(plan, s, st.sel.rows[i], args, ws,
                        W.row_scratch != kAbsent ? reinterpret_cast<float*>(ws + W.row_scratch) : nullptr,
                        stream);
        break;
      case Step::Kind::ColumnStats:
        launch_column_stats(plan, s, st.sel.colstats[i], args, ws,
                            W.colstats != kAbsent ? reinterpret_cast<double*>(ws + W.colstats) : nullptr,
                            stream);
        break;
    }
  }
}

// What the backward reads, copied out of the workspace (backward.h's SavedLayout): the
// value the GEMM (GEMV) produced, which the first row pass read from buffer 0, and each
// batch-statistics BatchNorm's mean, invstd and var.
void save_for_backward(const Plan& plan, const BackwardPlan& bp, float* saved, char* ws,
                       cudaStream_t stream) {
  if (bp.saved.v >= 0)
    GF_CUDA_CHECK(cudaMemcpyAsync(saved + bp.saved.v, ws + plan.buffer_offset(0),
                                  sizeof(float) * plan.M * bp.saved.v_cols,
                                  cudaMemcpyDeviceToDevice, stream));
  for (const auto& [node, off] : bp.saved.batch_stats) {
    const Instr& in = bp.program[node - bp.start];
    GF_CUDA_CHECK(cudaMemcpyAsync(saved + off, ws + plan.buffer_offset(in.stats),
                                  sizeof(float) * 3 * in.width_in, cudaMemcpyDeviceToDevice,
                                  stream));
  }
}

}  // namespace

int64_t CudaExecutor::fast_min_rows(int64_t M, int64_t N, int64_t K) {
  return cuda::fast_min_rows(M, N, K, device_facts(), current_overrides());
}

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
  check(plan);
  return plan_state(plan)->sel.describe();
}

bool CudaExecutor::gemm_on_split_kernel(const Plan& plan) {
  check(plan);
  const GemmKind k = plan_state(plan)->sel.gemm.kind;
  return k == GemmKind::F16x3 || k == GemmKind::FastSplit;
}

size_t CudaExecutor::prepared_bytes(const Plan& plan) const {
  check(plan);
  return plan_state(plan)->prepared.total;
}

size_t CudaExecutor::workspace_bytes(const Plan& plan) const {
  check(plan);
  const auto st = plan_state(plan);
  return st->fused_workspace > 0 ? st->fused_workspace : st->workspace.total;
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
  const auto st = plan_state(plan);
  char* ws = static_cast<char*>(workspace);
  if (ws == nullptr && (st->fused_workspace > 0 || st->workspace.total > 0))
    throw std::invalid_argument("gemmfuse: no workspace passed");
  if (!aligned16(ws)) throw std::invalid_argument("gemmfuse: workspace must be 16-byte aligned");
  const char* prep = static_cast<const char*>(prepared);
  if (st->prepared.total > 0 && prep == nullptr)
    throw std::invalid_argument("gemmfuse: the plan needs prepared weights (prepare() first)");
  if (!args.x || !args.out) throw std::invalid_argument("gemmfuse: x and out are required");

  if (st->fused_workspace > 0) {  // `workspace` holds the fused kernel's partials only
    if (run_fused_softmax(plan, st->sel.fused, args, st->prepared, prep, ws, stream)) return;
    // Declined by this call's pointers or the driver: the steps get a workspace of their own.
    const StreamScratch scratch(st->workspace.total, stream);
    run_steps(plan, *st, args, prep, scratch.get(), stream);
    return;
  }
  run_steps(plan, *st, args, prep, ws, stream);
  if (args.saved) save_for_backward(plan, *args.backward, args.saved, ws, stream);
}

}  // namespace gemmfuse
