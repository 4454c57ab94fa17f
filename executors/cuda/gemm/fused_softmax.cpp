#include "fused_softmax.h"

#include <atomic>

#include "env_switch.h"

namespace gemmfuse::cuda {

namespace {
// GEMMFUSE_FUSED_SOFTMAX=0 in the environment switches the kernel off from the start.
std::atomic<bool> g_enabled{!env_switched_off("GEMMFUSE_FUSED_SOFTMAX")};
}  // namespace

void set_fused_softmax(bool on) { g_enabled.store(on); }
bool fused_softmax_enabled() { return g_enabled.load(); }

FusedSoftmax match_fused_softmax(const Plan& plan) {
  FusedSoftmax f;
  auto no = [&](const char* why) {
    f.why = why;
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
  if (prog.empty() || prog.back().kind != Instr::Kind::Softmax ||
      prog.back().node.op != OpCode::Softmax)
    return no("the row program does not end in softmax");
  size_t i = 0;
  if (i + 1 < prog.size() && prog[i].kind == Instr::Kind::Pointwise &&
      prog[i].node.op == OpCode::GeluErf) {
    f.act = sm90::Activation::GeluErf;
    ++i;
  }
  if (i + 1 < prog.size() && prog[i].kind == Instr::Kind::Pointwise &&
      prog[i].b.kind == OperandRef::Kind::Imm && prog[i].node.op == OpCode::Mul) {
    f.scale = prog[i].b.imm;
    ++i;
  }
  if (i + 1 != prog.size())
    return no("the row program has stages other than [gelu] [* a number] softmax");
  f.matches = true;
  return f;
}

std::string fused_softmax_unused(const Plan& plan) {
  return fused_softmax_unused(plan, match_fused_softmax(plan));
}

std::string fused_softmax_unused(const Plan& plan, const FusedSoftmax& f) {
  if (!f.matches) return std::string(f.why);
  if (!fused_softmax_enabled()) return "switched off";
  return sm90::gemm_softmax_unfit(plan.M, plan.N, plan.K, plan.dtype);
}

}  // namespace gemmfuse::cuda
