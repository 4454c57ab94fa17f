// select's row passes and column statistics (selection.h): which row kernel runs each
// RowPass and in what shape, and which kernel computes each BatchNorm's batch statistics.
#include <algorithm>
#include <climits>
#include <string>

#include "selection.h"

namespace gemmfuse::cuda {

namespace {

int64_t eff(int64_t w) { return w > 0 ? w : 1; }

// Register mode's threads per CTA. Rows wider than 4096: 512 threads x 4 chunks by default
// (set_register_wide_threads(256): 256 x 8).
int register_threads(int64_t w, const Overrides& o) {
  return w > 4096 ? o.register_wide_threads : w >= 1024 ? 256 : 128;
}

// Why the step's stages keep it off register mode (nullptr: they do not).
const char* register_stage_refusal(const Step& step) {
  int64_t w = eff(step.width_in);
  for (const Instr& in : step.program) {
    if (w == 1 && in.kind != Instr::Kind::Pointwise && in.kind != Instr::Kind::Save &&
        in.kind != Instr::Kind::BatchNormApply)
      return "a row stage after the row became one value";
    switch (in.kind) {
      case Instr::Kind::Pool: return "a pooling stage";
      case Instr::Kind::GroupNorm: {
        if (in.node.groups <= 0 || w % in.node.groups != 0) return "group_norm groups do not divide the row";
        const int64_t gs = w / in.node.groups;
        const int64_t q = gs / 4;
        if (gs % 4 != 0 || q > 32 || (q & (q - 1)) != 0)
          return "GroupNorm groups not of 4-128 columns a power of two of float4s (a warp reduces a group)";
        break;
      }
      case Instr::Kind::Pointwise:
      case Instr::Kind::Reduce:
      case Instr::Kind::Softmax:
      case Instr::Kind::BatchNormApply:
      case Instr::Kind::Save:
        break;
      default: return "a stage the register kernel does not run";
    }
    w = row_width_after(in, w);
  }
  return nullptr;
}

// Register mode's float4 chunks per thread for the step (1, 2, 4, 8), or 0 and why not.
int register_vpt(const Step& step, const Overrides& o, const char** why) {
  const int64_t w0 = eff(step.width_in);
  *why = w0 % 4 != 0 ? "the row's width is not a multiple of 4"
         : w0 <= kWarpModeMaxWidth ? "rows of at most 256 columns run a warp per row"
         : w0 > kRegMaxWidth ? "rows wider than 8192 do not fit registers"
                             : register_stage_refusal(step);
  if (*why != nullptr) return 0;
  const int64_t nt = register_threads(w0, o), nch = w0 / 4;
  const int64_t need = (nch + nt - 1) / nt;
  const int vpt = need <= 1 ? 1 : need <= 2 ? 2 : need <= 4 ? 4 : need <= 8 ? 8 : 0;
  if (vpt == 0) *why = "more than 8 float4 chunks a thread";
  return vpt;
}

// The interpreter's launch shape (and register mode's chunks per thread).
RowConfig row_config(const Step& step, int64_t M, const DeviceFacts& d, const Overrides& o,
                     const char** why_not_register) {
  RowConfig rc;
  int64_t w = eff(step.width_in), capA = w, capB = 0;
  for (const Instr& in : step.program) {
    w = row_width_after(in, w);
    if (in.kind == Instr::Kind::Pool) capB = std::max(capB, w);
    else capA = std::max(capA, w);
  }
  rc.reg_vpt = register_vpt(step, o, why_not_register);
  rc.capA = static_cast<int>((capA + 3) / 4 * 4);
  rc.capB = static_cast<int>((capB + 3) / 4 * 4);
  rc.warp_mode = rc.capA <= kWarpModeMaxWidth && rc.capB <= kWarpModeMaxWidth;
  if (rc.warp_mode) {
    rc.threads = kWarpModeThreads;
    rc.rows_per_cta = kWarpModeThreads / 32;
  } else {
    rc.threads = rc.capA >= 1024 ? 256 : 128;  // 256 beats 512 at width 8192 on H100
    rc.rows_per_cta = 1;
  }
  const size_t slot_bytes = sizeof(float) * (static_cast<size_t>(rc.capA) + rc.capB);
  rc.smem_bytes = slot_bytes * rc.rows_per_cta;
  if (!rc.warp_mode && rc.smem_bytes > d.row_smem_limit) {
    rc.scratch = true;
    rc.smem_bytes = 0;
    rc.grid = std::min<int64_t>(M, kScratchCtas);
    rc.scratch_bytes = slot_bytes * static_cast<size_t>(std::max<int64_t>(rc.grid, 1));
  } else {
    rc.grid = (M + rc.rows_per_cta - 1) / rc.rows_per_cta;
    if (rc.grid > INT_MAX) throw Unsupported("CUDA row program: too many rows for one launch");
  }
  return rc;
}

RowKind interpreter_kind(const RowConfig& rc) {
  return rc.warp_mode ? RowKind::Warp : rc.scratch ? RowKind::Scratch : RowKind::Block;
}

std::string interpreter_reason(const RowConfig& rc) {
  const std::string slot = std::to_string(rc.capA + rc.capB) + " floats a row";
  if (rc.warp_mode) return "the interpreter, a warp per row (" + slot + ")";
  if (rc.scratch)
    return "the interpreter with rows in a global scratch (" + slot + " is more shared memory than "
           "a CTA gets here)";
  return "the interpreter, a CTA of " + std::to_string(rc.threads) + " threads per row in shared memory (" +
         slot + ")";
}

// Why register mode is off for a step whose stages allow it (nullptr: it is on).
const char* register_refusal(const Step& step, int64_t M, const RowConfig& rc, const Overrides& o) {
  const bool one_value = eff(step.width_out) == 1 && eff(step.width_in) > 1;
  if (rc.warp_mode) return "the row is narrow enough for a warp";
  if (!o.register_rows) return "register rows switched off (set_register_rows)";
  if (one_value && !o.register_one_value) return "one-value rows switched off (set_register_one_value)";
  if (!one_value && eff(step.width_out) % 4 != 0) return "the output row's width is not a multiple of 4";
  if (M > INT_MAX) return "more rows than one launch's grid takes";
  return nullptr;
}

}  // namespace

int64_t row_width_after(const Instr& in, int64_t w) {
  switch (in.kind) {
    case Instr::Kind::Reduce: return 1;
    case Instr::Kind::Pool: return eff(in.width_out);
    default: return w;
  }
}

RowChoice select_row(const Step& step, int64_t M, const DeviceFacts& d, const Overrides& o) {
  RowChoice r;
  const char* why = nullptr;
  r.config = row_config(step, M, d, o, &why);
  r.kind = interpreter_kind(r.config);
  if (why == nullptr) why = register_refusal(step, M, r.config, o);
  if (why != nullptr) {
    r.reason = interpreter_reason(r.config) + " (not in registers: " + why + ")";
    return r;
  }
  const int64_t win = eff(step.width_in);
  r.fallback = r.kind;
  r.kind = RowKind::Register;
  r.register_threads = register_threads(win, o);
  r.register_full = win / 4 == int64_t(r.config.reg_vpt) * r.register_threads;
  r.reason = "the register kernel: the row of " + std::to_string(win) + " in registers, " +
             std::to_string(r.register_threads) + " threads x " + std::to_string(r.config.reg_vpt) +
             " float4 chunks (where a vector the call passes is not 16-byte aligned: " +
             interpreter_reason(r.config) + ")";
  return r;
}

ColStatsChoice select_colstats(const Step& step, const DeviceFacts& d, const Overrides& o) {
  ColStatsChoice c;
  if (step.input < 0) {
    c.kind = ColStatsKind::Running;
    c.reason = "an eval BatchNorm's statistics from its running state";
    return c;
  }
  const int64_t W = std::max<int64_t>(step.width_in, 1), sms = d.sms;
  // One fused kernel when the column slices alone give every SM work (a CTA per 32 columns,
  // or per 16 when that is what it takes).
  int tc = 0;
  if (o.fused_colstats != 0 && W % 4 == 0 && (W + 15) / 16 <= 0x7fffffffLL) {
    tc = o.fused_colstats == 8 || o.fused_colstats == 4 ? o.fused_colstats : 0;
    if (o.fused_colstats == 1) tc = (W + 31) / 32 >= sms * 3 / 2 ? 8 : (W + 15) / 16 >= sms ? 4 : 0;
  }
  if (tc != 0) {
    c.kind = ColStatsKind::Fused;
    c.threads_per_segment = tc;
    c.reason = "one kernel, a CTA per " + std::to_string(4 * tc) + " columns streaming every row (" +
               std::to_string((W + 4 * tc - 1) / (4 * tc)) + " CTAs on " + std::to_string(sms) + " SMs)";
    return c;
  }
  c.kind = ColStatsKind::TwoLevel;
  c.vector = W % 4 == 0 && o.vector_colstats;
  const std::string why = o.fused_colstats == 0 ? "the one-kernel path switched off (set_fused_colstats)"
                          : W % 4 != 0          ? "the width is not a multiple of 4"
                                                : std::to_string(W) + " columns give too few CTAs for " +
                                                      std::to_string(sms) + " SMs";
  c.reason = std::string("two levels, row chunks' partial sums then each column's (") +
             (c.vector ? "16-byte vectors" : "scalar loads") + "; not one kernel: " + why + ")";
  return c;
}

}  // namespace gemmfuse::cuda
