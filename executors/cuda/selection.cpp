// select (selection.h): the forward GEMM, the fused GEMM + softmax, and the backward's GEMMs
// and row backward; row passes and column statistics in selection_rows.cpp.
#include "selection.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

namespace gemmfuse::cuda {

namespace {

// cuBLASLt's workspace (NVIDIA recommends 32 MiB on Hopper), and the smaller limit its
// heuristic is told of for fp32 SGEMMs with M in [512, 2048]: there the 4 MiB choice is
// eager's kernel, faster than the 32 MiB one; small batches need the large limit for their
// split-K kernels (docs/measurements.md, "Planner rules and the measurements they rest on").
constexpr size_t kSgemmMidRowsHeuristicBytes = size_t(4) << 20;
constexpr int64_t kSgemmMidRowsLo = 512, kSgemmMidRowsHi = 2048;

const Step* find_step(const Plan& plan, Step::Kind kind) {
  for (const Step& s : plan.steps)
    if (s.kind == kind) return &s;
  return nullptr;
}

std::string us(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f us", seconds * 1e6);
  return buf;
}

// The cuBLAS(Lt) GEMM of the plan's type and precision.
GemmKind blas_kind(const Plan& plan) {
  if (plan.dtype != DType::F32) return GemmKind::Half;
  return plan.precision == Precision::TF32 ? GemmKind::Tf32 : GemmKind::Sgemm;
}

std::string f16x3_reason(const F16x3Cost& c) {
  return "the fp32 Gemm runs on fp16 tensor cores: each row of x and W scaled by a power of two "
         "and split into two fp16 parts (22 bits), the three part products that reach fp32's "
         "precision, the large one summed in fp32 every 64 of K, each W part read once" +
         (c.splits > 1 ? "; each output tile's K cut into " + std::to_string(c.splits) +
                             " ranges on as many SMs, their sums added in fp32 (split-K: the "
                             "tiles alone would leave most SMs idle)"
                       : std::string()) +
         "; values over 2^28 below their row's largest and infinities left out of the parts and "
         "their products added back (a few in x: in fp32; many tiny ones: a second split of "
         "those rows and a second GEMM pass over them), rows of x with many infinities and W's "
         "rows holding such values recomputed in fp32, rows and columns with a NaN written NaN "
         "(x, W, bias and out 16-byte aligned, else SGEMM); the cost model expects " +
         us(c.f16x3_s) + " against SGEMM's " + us(c.sgemm_s);
}

// fp32 mode: the f16x3 kernel where it takes the shape; else `why` says why not.
bool choose_f16x3(const Plan& plan, const DeviceFacts& d, const Overrides& o, GemmChoice& g,
                  std::string& why) {
  const int64_t ldy = f16x3_padded_ldy(plan.N, o);
  const char* no = f16x3_unfit(plan.M, plan.N, plan.K, d, o, ldy > 0);
  if (no == nullptr) {
    g.cost = f16x3_cost(plan.M, plan.N, plan.K, d.sms, ldy);
    no = f16x3_slower_than_sgemm(g.cost);
  }
  if (no != nullptr) {
    why = std::string("the fp32 Gemm does not use the f16x3 kernel: ") + no;
    if (g.cost.sgemm_s > 0)
      why += " (the cost model: " + us(g.cost.f16x3_s) + " against SGEMM's " + us(g.cost.sgemm_s) + ")";
    return false;
  }
  g.kind = GemmKind::F16x3;
  g.fallback = GemmKind::Sgemm;  // M >= 33: beyond the small-M kernel
  g.splits = g.cost.splits;
  g.f16x3_parts = true;
  g.ldy = ldy;
  g.reason = f16x3_reason(g.cost);
  if (ldy > 0)
    g.reason += "; N = " + std::to_string(plan.N) + " is not a multiple of 4 (the output's 16-byte "
                "TMA rows): it writes rows of " + std::to_string(ldy) +
                " in the workspace, then copies them into place (counted in the cost model)";
  return true;
}

// The kinds that run on cuBLASLt, and the small-M kernel for a few fp32 rows.
void choose_blas(const Plan& plan, GemmChoice& g, const std::string& why_not_f16x3) {
  const std::string prefix = why_not_f16x3.empty() ? std::string() : why_not_f16x3 + "; ";
  const bool exact_f32 = plan.dtype == DType::F32 && plan.precision != Precision::TF32;
  if (exact_f32 && plan.M >= 1 && plan.M <= kSmallMMaxRows && plan.N >= 1 && plan.K >= 1 &&
      plan.K <= kSmallMMaxK) {
    g.kind = GemmKind::SmallM;
    g.fallback = GemmKind::Sgemm;
    g.reason = prefix + "at most 32 rows of fp32: the small-M kernel, bound by reading W once, "
               "with a shorter summation than SGEMM's (x and W 4-byte aligned and room for x's "
               "shifted copies, else SGEMM)";
    return;
  }
  g.kind = blas_kind(plan);
  g.reason = prefix + (g.kind == GemmKind::Half ? "cuBLASLt in the model's 16-bit type, fp32 accumulation"
                       : g.kind == GemmKind::Tf32 ? "cuBLASLt on TF32 tensor cores (tf32 precision)"
                                                  : "cuBLASLt SGEMM (fp32, no TF32)");
}

GemmChoice select_gemm(const Plan& plan, const DeviceFacts& d, const Overrides& o) {
  GemmChoice g;
  const Step* step = find_step(plan, Step::Kind::Gemm);
  if (step == nullptr) {
    if (find_step(plan, Step::Kind::Gemv) != nullptr) {
      g.kind = GemmKind::Gemv;
      g.reason = "a sum over the Linear's output: x . colsum(W) + sum(b) (the GEMV rewrite)";
    }
    return g;
  }
  const bool fp32_mode = plan.dtype == DType::F32 && plan.precision == Precision::FP32;
  g.split_parts = plan.dtype == DType::F32 && plan.precision == Precision::Fast;
  std::string why_not_f16x3;
  if (g.split_parts) {
    g.kind = GemmKind::FastSplit;
    g.reason = "the fast Gemm splits x and W into bf16 hi + lo parts, one GEMM summing xlo.Whi + "
               "xhi.Wlo first, then xhi.Whi; rows and columns with infinities or values past "
               "bf16's range recomputed in fp32, with a NaN written NaN";
  } else if (!fp32_mode || !choose_f16x3(plan, d, o, g, why_not_f16x3)) {
    choose_blas(plan, g, why_not_f16x3);
  }
  const bool sgemm = g.kind == GemmKind::Sgemm || g.fallback == GemmKind::Sgemm;
  if (sgemm && plan.M >= kSgemmMidRowsLo && plan.M <= kSgemmMidRowsHi)
    g.lt_heuristic_bytes = kSgemmMidRowsHeuristicBytes;
  if (plan.K == 0) {  // the parts above are still laid out (empty), as the kinds expect
    g.kind = GemmKind::BiasOnly;
    g.fallback = GemmKind::None;
    g.reason = "K = 0: x Wᵀ is zero, so Y = bias (cuBLASLt rejects k = 0)";
  }
  return g;
}

// The fused kernel's tiles and residency (sm90/gemm_softmax.h).
constexpr int64_t kSoftmaxTileM = 128, kSoftmaxTileN = 256, kSoftmaxClusterM = 2,
                  kSoftmaxMaxTilesPerCta = 2;
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Why the fused kernel cannot run this matching plan here ("" when it can).
std::string softmax_unfit(const Plan& plan, const DeviceFacts& d, int64_t tiles) {
  if (!d.sm90_kernels) return "built without the sm90 kernels (the nvidia-cutlass package was not found)";
  if (plan.K % 8 != 0 || plan.N % 8 != 0) return "K and N must be multiples of 8 (16-byte TMA rows)";
  if (plan.M <= 0 || plan.K <= 0) return "empty problem";
  if (d.compute_capability != 90)
    return "needs an sm_90 GPU (this is sm_" + std::to_string(d.compute_capability) + ")";
  const int clusters = plan.dtype == DType::F16 ? d.softmax_clusters_f16 : d.softmax_clusters_bf16;
  if (clusters == 0) return "the kernel does not fit on this GPU's SMs";
  if (2 * tiles < d.sms)  // fewer tiles than half the SMs: cuBLAS does better
    return "too few 128x256 tiles (" + std::to_string(tiles) + ") to fill the GPU";
  const int64_t m_pairs = ceil_div(ceil_div(plan.M, kSoftmaxTileM), kSoftmaxClusterM);
  const int64_t n_tiles = ceil_div(plan.N, kSoftmaxTileN);
  if (m_pairs * ceil_div(n_tiles, kSoftmaxMaxTilesPerCta) > clusters)
    return "too many 128x256 tiles (" + std::to_string(tiles) + ") to keep on chip at once (at most " +
           std::to_string(kSoftmaxClusterM * kSoftmaxMaxTilesPerCta * clusters) + ")";
  return "";
}

FusedSoftmaxChoice select_fused(const Plan& plan, const DeviceFacts& d, const Overrides& o) {
  FusedSoftmaxChoice f = match_fused_softmax(plan);
  f.programmatic = o.sm90_programmatic;
  f.defer_epilogues = o.sm90_defer;
  if (!f.matches) return f;
  f.tiles = ceil_div(plan.M, kSoftmaxTileM) * ceil_div(plan.N, kSoftmaxTileN);
  const std::string why = o.fused_softmax ? softmax_unfit(plan, d, f.tiles) : "switched off";
  f.used = why.empty();
  f.reason = f.used ? "Gemm + RowPass run as one sm90 kernel (TMA/wgmma GEMM, the softmax finished "
                      "on chip; Y never goes to memory): " + std::to_string(f.tiles) +
                          " tiles of 128x256 held on chip at once (unless the call's pointers "
                          "are misaligned or the driver refuses the cooperative grid: then step "
                          "by step)"
                    : "the fused sm90 GEMM + softmax kernel is not used: " + why;
  return f;
}

}  // namespace

const char* gemm_kind_name(GemmKind k) {
  switch (k) {
    case GemmKind::None: return "none";
    case GemmKind::Gemv: return "GEMV";
    case GemmKind::BiasOnly: return "bias only";
    case GemmKind::FastSplit: return "fast bf16 split (cuBLASLt)";
    case GemmKind::F16x3: return "f16x3 (sm90)";
    case GemmKind::SmallM: return "small-M";
    case GemmKind::Sgemm: return "SGEMM (cuBLAS)";
    case GemmKind::Tf32: return "TF32 (cuBLAS)";
    case GemmKind::Half: return "16-bit (cuBLAS)";
  }
  return "?";
}

FusedSoftmaxChoice match_fused_softmax(const Plan& plan) {
  FusedSoftmaxChoice f;
  auto no = [&](const char* why) {
    f.reason = why;
    return f;
  };
  if (plan.dtype == DType::F32) return no("fp32 model");
  if (plan.for_training) return no("a training plan: its backward needs the GEMM's output");
  if (plan.steps.size() != 2 || plan.steps[0].kind != Step::Kind::Gemm ||
      plan.steps[1].kind != Step::Kind::RowPass)
    return no("the plan is not one GEMM and one row pass");
  const Step& gemm = plan.steps[0];
  const Step& row = plan.steps[1];
  if (gemm.output < 0 || row.input != gemm.output || row.output != kOutput)
    return no("the row pass does not read the GEMM's output");
  const std::vector<Instr>& prog = row.program;
  if (prog.empty() || prog.back().kind != Instr::Kind::Softmax || prog.back().node.op != OpCode::Softmax)
    return no("the row program does not end in softmax");
  size_t i = 0;
  if (i + 1 < prog.size() && prog[i].kind == Instr::Kind::Pointwise && prog[i].node.op == OpCode::GeluErf) {
    f.gelu = true;
    ++i;
  }
  if (i + 1 < prog.size() && prog[i].kind == Instr::Kind::Pointwise &&
      prog[i].b.kind == OperandRef::Kind::Imm && prog[i].node.op == OpCode::Mul) {
    f.scale = prog[i].b.imm;
    ++i;
  }
  if (i + 1 != prog.size()) return no("the row program has stages other than [gelu] [* a number] softmax");
  f.matches = true;
  return f;
}

// Defined in selection_rows.cpp and selection_backward.cpp.
RowChoice select_row(const Step& step, int64_t M, const DeviceFacts& d, const Overrides& o);
ColStatsChoice select_colstats(const Step& step, const DeviceFacts& d, const Overrides& o);
BackwardChoice select_backward(const Plan& plan, const BackwardPlan& bp, const DeviceFacts& d,
                               const Overrides& o);

Selection select(const Plan& plan, const BackwardPlan* bp, const DeviceFacts& d, const Overrides& o) {
  Selection s;
  s.overrides = o;
  s.gemm = select_gemm(plan, d, o);
  s.fused = select_fused(plan, d, o);
  s.rows.resize(plan.steps.size());
  s.colstats.resize(plan.steps.size());
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    const Step& step = plan.steps[i];
    if (step.kind == Step::Kind::RowPass) s.rows[i] = select_row(step, plan.M, d, o);
    if (step.kind == Step::Kind::ColumnStats) s.colstats[i] = select_colstats(step, d, o);
  }
  if (bp != nullptr) s.backward = select_backward(plan, *bp, d, o);
  return s;
}

}  // namespace gemmfuse::cuda
