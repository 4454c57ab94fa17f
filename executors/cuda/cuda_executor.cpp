#include "cuda_executor.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "column_stats.h"
#include "cuda_check.h"
#include "device_info.h"
#include "fused_softmax.h"
#include "gemm_cublas.h"
#include "gemm_f16x3.h"
#include "gemv.h"
#include "layout.h"
#include "prepare.h"
#include "row_program.h"

namespace gemmfuse {

using namespace gemmfuse::cuda;

namespace {

// The fused kernel's workspace (its row partials) when run() takes it for this plan on the
// current device, else 0 (the steps' workspace_layout applies). Y and cuBLASLt's workspace
// (64 MiB at the seed shape) are not allocated for a call the kernel computes.
size_t fused_workspace_bytes(const Plan& plan, const FusedSoftmax& f) {
  if (!f.matches || !fused_softmax_unused(plan, f).empty()) return 0;  // no reason string per call
  return sm90::gemm_softmax_workspace_bytes(plan.M, plan.N);           // a multiple of 256 bytes
}

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

// Gemm + RowPass as one sm90 kernel, for a plan fused_workspace_bytes accepted and `ws` its
// workspace; false (nothing enqueued): the pointers are misaligned or the driver refused the
// cooperative grid, so the caller runs the steps.
bool run_fused_softmax(const Plan& plan, const FusedSoftmax& f, const RunArgs& args,
                       const PreparedLayout& P, const char* prep, char* ws, cudaStream_t stream) {
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
  return sm90::launch_gemm_softmax(p, ws, stream);
}

// The plan step by step, with the steps' workspace `ws` (layout W).
void run_steps(const Plan& plan, const RunArgs& args, const char* prep, const WorkspaceLayout& W,
               char* ws, cudaStream_t stream) {
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
  const int64_t rows = cuda::sm90::kF16x3TileMN;
  if (M > rows || M < cuda::sm90::kF16x3MinRows || cuda::sm90::f16x3_declines(M, N, K) != nullptr)
    return PlanRequest{}.fast_min_rows;
  return rows;
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
  const FusedSoftmax f = match_fused_softmax(plan);
  if (f.matches) {
    const std::string why = fused_softmax_unused(plan, f);
    if (why.empty())
      return "cuda: Gemm + RowPass run as one sm90 kernel (TMA/wgmma GEMM, the softmax finished "
             "on chip; Y never goes to memory)";
    return "cuda: the fused sm90 GEMM + softmax kernel is not used: " + why;
  }
  if (fp32_mode_gemm(plan)) {
    const char* why = sm90::f16x3_declines(plan.M, plan.N, plan.K);
    if (why == nullptr) {
      const int splits = sm90::f16x3_splits(plan.M, plan.N, sm_count());
      return "cuda: the fp32 Gemm runs on fp16 tensor cores: each row of x and W scaled by a "
             "power of two and split into two fp16 parts (22 bits), the three part products "
             "that reach fp32's precision, the large one summed in fp32 every 64 of K, each W "
             "part read once" +
             (splits > 1 ? "; each output tile's K cut into " + std::to_string(splits) +
                               " ranges on as many SMs, their sums added in fp32 (split-K: the "
                               "tiles alone would leave most SMs idle)"
                         : std::string()) +
             "; values over 2^28 below their row's largest and infinities left out of the "
             "parts and their products added back (a few in x: in fp32; many tiny ones: a "
             "second split of those rows and a second GEMM pass over them), rows of x with "
             "many infinities and W's rows holding such values recomputed in fp32, rows and "
             "columns with a NaN written NaN (x, W, bias and out 16-byte aligned, else SGEMM)";
    }
    return std::string("cuda: the fp32 Gemm does not use the f16x3 kernel: ") + why;
  }
  if (uses_split(plan))
    return "cuda: the fast Gemm splits x and W into bf16 hi + lo parts, one GEMM summing "
           "xlo.Whi + xhi.Wlo first, then xhi.Whi; rows and columns with infinities or values "
           "past bf16's range recomputed in fp32, with a NaN written NaN";
  return "";
}

size_t CudaExecutor::prepared_bytes(const Plan& plan) const {
  check(plan);
  return prepared_layout(plan).total;
}

size_t CudaExecutor::workspace_bytes(const Plan& plan) const {
  check(plan);
  const size_t fused = fused_workspace_bytes(plan, match_fused_softmax(plan));
  return fused > 0 ? fused : workspace_layout(plan).total;
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
  const FusedSoftmax f = match_fused_softmax(plan);
  const size_t fused_ws = fused_workspace_bytes(plan, f);
  char* ws = static_cast<char*>(workspace);
  if (ws == nullptr && (fused_ws > 0 || workspace_layout(plan).total > 0))
    throw std::invalid_argument("gemmfuse: no workspace passed");
  if (!aligned16(ws)) throw std::invalid_argument("gemmfuse: workspace must be 16-byte aligned");
  const char* prep = static_cast<const char*>(prepared);
  const PreparedLayout P = prepared_layout(plan);
  if (P.total > 0 && prep == nullptr)
    throw std::invalid_argument("gemmfuse: the plan needs prepared weights (prepare() first)");
  if (!args.x || !args.out) throw std::invalid_argument("gemmfuse: x and out are required");

  if (fused_ws > 0) {  // `workspace` holds the fused kernel's partials only
    if (run_fused_softmax(plan, f, args, P, prep, ws, stream)) return;
    // Declined at run time: the steps get a workspace of their own for this call.
    const WorkspaceLayout W = workspace_layout(plan);
    const StreamScratch scratch(W.total, stream);
    run_steps(plan, args, prep, W, scratch.get(), stream);
    return;
  }
  run_steps(plan, args, prep, workspace_layout(plan), ws, stream);
  if (args.saved) save_for_backward(plan, *args.backward, args.saved, ws, stream);
}


}  // namespace gemmfuse
