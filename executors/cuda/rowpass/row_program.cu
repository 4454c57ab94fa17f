// RowPass steps on the GPU: checks a step, resolves its program against the run's pointers
// (DevProgram) and launches the row kernel the Selection chose (selection.h's RowChoice):
// the register kernel (row_register_kernel.cuh), or the interpreter
// (row_interpreter_kernel.cuh) in the shape RowChoice::config gives.
#include "row_program.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "layout.h"
#include "pointwise.h"
#include "programmatic_launch.h"
#include "row_interpreter_kernel.cuh"
#include "row_program_format.cuh"
#include "row_register_kernel.cuh"

namespace gemmfuse::cuda {
namespace {

// ---- host side ----------------------------------------------------------------------------

// The register kernel for VPT chunks per thread. The variant without bounds checks (`full`:
// every thread's chunks hold row values, i.e. rows of exactly 4096 or 8192 columns, the seed
// models' width) is built for VPT = 4 only: each variant of this kernel adds ~1.5 MB of code
// to the library.
using RegisterKernel = void (*)(DevProgram);
RegisterKernel register_kernel(int vpt, bool full) {
  switch (vpt) {
    case 1: return row_register_kernel<1, false>;
    case 2: return row_register_kernel<2, false>;
    case 4: return full ? row_register_kernel<4, true> : row_register_kernel<4, false>;
    default: return row_register_kernel<8, false>;
  }
}

int64_t eff(int64_t w) { return w > 0 ? w : 1; }

[[noreturn]] void unsupported(const std::string& why) {
  throw Unsupported("CUDA row program: " + why);
}

struct DeviceLimits {
  bool known = false;
  size_t limit = 0;
};
std::mutex g_limits_mutex;
std::vector<DeviceLimits> g_limits;

// The attributes of the two kinds that have them (a GroupNorm's groups, a pool's window), at
// row width w; the other kinds take any row width.
void check_instr_attributes(const Instr& in, int64_t w) {
  if (in.kind == Instr::Kind::GroupNorm && (in.node.groups <= 0 || w % in.node.groups != 0))
    unsupported("group_norm groups do not divide the width");
  if (in.kind == Instr::Kind::Pool && (in.node.kernel <= 0 || in.node.stride <= 0 || in.node.padding < 0))
    unsupported("bad pool window");
}

}  // namespace

void check_row_step(const Step& step) {
  if (step.program.size() > static_cast<size_t>(kMaxInstrs))
    unsupported("the row program has " + std::to_string(step.program.size()) +
                " instructions; at most " + std::to_string(kMaxInstrs) + " are supported");
  int64_t w = eff(step.width_in);
  if (w > INT_MAX / 2) unsupported("row width " + std::to_string(w) + " too large");
  for (const Instr& in : step.program) {
    if (in.width_in > 0 && eff(in.width_in) != w)
      throw std::logic_error("CUDA row program: instruction width " +
                             std::to_string(in.width_in) + " does not follow the row width " +
                             std::to_string(w));
    check_instr_attributes(in, w);
    w = row_width_after(in, w);
    if (w > INT_MAX / 2) unsupported("row width too large");
  }
  if (w != eff(step.width_out))
    throw std::logic_error("CUDA row program: program ends at width " + std::to_string(w) +
                           ", step says " + std::to_string(step.width_out));
}

size_t row_smem_limit() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 47 * 1024;  // no device: the default limit (nothing runs anyway)
  }
  std::lock_guard<std::mutex> lock(g_limits_mutex);
  if (g_limits.size() <= static_cast<size_t>(dev)) g_limits.resize(dev + 1);
  DeviceLimits& d = g_limits[dev];
  if (!d.known) {
    int optin = 0;
    GF_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    cudaFuncAttributes a0{}, a1{};
    GF_CUDA_CHECK(cudaFuncGetAttributes(&a0, row_program_kernel<false, false>));
    GF_CUDA_CHECK(cudaFuncGetAttributes(&a1, row_program_kernel<true, false>));
    const size_t stat = std::max(a0.sharedSizeBytes, a1.sharedSizeBytes);
    d.limit = static_cast<size_t>(optin) > stat ? static_cast<size_t>(optin) - stat : 0;
    // Opt in once per device, for every launch that follows.
    GF_CUDA_CHECK(cudaFuncSetAttribute(row_program_kernel<false, false>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(d.limit)));
    GF_CUDA_CHECK(cudaFuncSetAttribute(row_program_kernel<true, false>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(d.limit)));
    d.known = true;
  }
  return d.limit;
}

namespace {

// The run's pointers a row program reads: workspace buffers and operand tensors, checked.
struct RunPointers {
  const Plan& plan;
  const RunArgs& args;
  char* workspace;

  float* buffer(int id) const {
    if (id < 0 || id >= static_cast<int>(plan.buffers.size()))
      throw std::logic_error("CUDA row program: bad buffer id " + std::to_string(id));
    return reinterpret_cast<float*>(workspace + plan.buffer_offset(id));
  }
  const float* tensor(int idx) const {
    if (idx < 0 || idx >= static_cast<int>(args.operands.size()) || !args.operands[idx])
      throw std::invalid_argument("gemmfuse: operand t" + std::to_string(idx) + " missing");
    return args.operands[idx];
  }
  // A norm's weight or bias: a per-column tensor, or none.
  const float* affine(const OperandRef& ref) const {
    switch (ref.kind) {
      case OperandRef::Kind::None: return nullptr;
      case OperandRef::Kind::Col: return tensor(ref.index);
      default: unsupported("a norm's weight/bias must be a per-column tensor");
    }
  }
};

// The program's header: input, output and its type, widths, the RowConfig's capacities and
// rows per CTA, and whether the input and output rows can be read and written as float4s.
// The instructions are left zeroed (lower_instr fills them).
DevProgram program_header(const Step& step, const RowConfig& rc, const RunPointers& run,
                          float* row_scratch) {
  DevProgram P{};
  P.in = run.buffer(step.input);
  P.M = run.plan.M;
  P.n = static_cast<int32_t>(step.program.size());
  P.win = static_cast<int32_t>(eff(step.width_in));
  P.wout = static_cast<int32_t>(eff(step.width_out));
  P.capA = rc.capA;
  P.capB = rc.capB;
  P.rows_per_cta = rc.rows_per_cta;
  P.scratch = rc.scratch ? row_scratch : nullptr;
  if (step.output == kOutput) {
    const DType dt = run.plan.dtype;
    P.out = run.args.out;
    P.out_type = dt == DType::F32 ? kOutF32 : dt == DType::BF16 ? kOutBF16 : kOutF16;
  } else {
    P.out = run.buffer(step.output);
    P.out_type = kOutF32;
  }
  const size_t out_align = P.out_type == kOutF32 ? 16 : 8;
  P.in_vec = (P.win % 4 == 0) && aligned16(P.in);
  P.out_vec = (P.wout % 4 == 0) && (reinterpret_cast<uintptr_t>(P.out) % out_align == 0);
  return P;
}

// A binary pointwise instruction's operand, for a row of width w: an immediate, an operand
// tensor, or a saved value (a workspace buffer read per row or per element).
void lower_binary_operand(const Instr& in, int64_t w, const RunPointers& run, DevInstr& d) {
  const OperandRef& b = in.b;
  switch (b.kind) {
    case OperandRef::Kind::Imm: d.opnd = kOpImm; d.imm = b.imm; break;
    case OperandRef::Kind::Scalar: d.opnd = kOpScalar; d.b = run.tensor(b.index); break;
    case OperandRef::Kind::Col: d.opnd = kOpCol; d.b = run.tensor(b.index); break;
    case OperandRef::Kind::Row: d.opnd = kOpRow; d.b = run.tensor(b.index); break;
    case OperandRef::Kind::Full: d.opnd = kOpFull; d.b = run.tensor(b.index); break;
    case OperandRef::Kind::Buffer:
      d.b = run.buffer(b.index);
      if (eff(b.cols) == 1) {
        d.opnd = kOpRow;
      } else if (eff(b.cols) == w) {
        d.opnd = kOpFull;
      } else {
        throw std::logic_error("CUDA row program: buffer operand of width " +
                               std::to_string(b.cols) + " meets a row of width " +
                               std::to_string(w));
      }
      break;
    default:
      throw std::logic_error(std::string("CUDA row program: binary op ") +
                             op_name(in.node.op) + " without an operand");
  }
}

void lower_pointwise(const Instr& in, int64_t w, const RunPointers& run, DevInstr& d) {
  d.kind = kPointwise;
  if (family(in.node.op) == OpFamily::Binary) {
    d.flags |= kFlagBinary;
    if (in.node.reversed) d.flags |= kFlagReversed;
    lower_binary_operand(in, w, run, d);
  } else if (family(in.node.op) != OpFamily::Unary) {
    // The device's dispatch knows the table's unary and binary rows only.
    throw std::logic_error(std::string("CUDA row program: pointwise instruction for op ") +
                           op_name(in.node.op));
  }
}

// Instruction `in`, meeting a row of width w, resolved against the run's pointers into d (a
// zeroed slot of the program). Returns the row's width after it.
int64_t lower_instr(const Instr& in, int64_t w, const RunPointers& run, DevInstr& d) {
  const int64_t w_after = row_width_after(in, w);
  static_cast<RowAttrs&>(d) = row_attrs(in, w, w_after);
  switch (in.kind) {
    case Instr::Kind::Pointwise: lower_pointwise(in, w, run, d); break;
    case Instr::Kind::Reduce: d.kind = kReduce; break;
    case Instr::Kind::Softmax: d.kind = kSoftmax; break;
    case Instr::Kind::GroupNorm:
      d.kind = kGroupNorm;
      d.p1 = run.affine(in.weight);
      d.p2 = run.affine(in.bias);
      break;
    case Instr::Kind::Pool: d.kind = kPool; break;
    case Instr::Kind::BatchNormApply:
      d.kind = kBnApply;
      d.p0 = run.buffer(in.stats);
      d.p1 = run.affine(in.weight);
      d.p2 = run.affine(in.bias);
      break;
    case Instr::Kind::Save:
      d.kind = kSave;
      d.save = run.buffer(in.buffer);
      if (w % 4 == 0) d.flags |= kFlagVec;  // buffers are 256-byte aligned
      break;
    default: unsupported("unknown instruction kind");
  }
  return w_after;
}

// Whether every vector the register kernel reads or writes as float4s is 16-byte aligned in
// this call: input, output (a row that ends as one value writes no vectors), and each
// instruction's Col/Full operand, norm parameters and Save buffer. The pointers are the
// call's: the one check left to launch time.
bool register_vectors_aligned(const DevProgram& P) {
  const bool one_value = P.wout == 1 && P.win > 1;
  bool ok = P.in_vec && (one_value || P.out_vec);
  for (int i = 0; ok && i < P.n; ++i) {
    const DevInstr& d = P.ins[i];
    if (d.kind == kPointwise && (d.flags & kFlagBinary) && (d.opnd == kOpCol || d.opnd == kOpFull))
      ok = aligned16(d.b);
    if (d.kind == kGroupNorm || d.kind == kBnApply)
      ok = aligned16(d.p0) && aligned16(d.p1) && aligned16(d.p2);
    if (d.kind == kSave) ok = aligned16(d.save);
  }
  return ok;
}

// The interpreter in the shape RowConfig gives: a warp per row, a global scratch row, or the
// row in (large, opted-in) shared memory.
void launch_interpreter(const RowConfig& rc, const DevProgram& P, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(rc.grid);
  if (rc.warp_mode) {
    row_program_kernel<true, false><<<grid, rc.threads, rc.smem_bytes, stream>>>(P);
  } else if (rc.scratch) {
    row_program_kernel<false, true><<<grid, rc.threads, 0, stream>>>(P);
  } else {
    (void)row_smem_limit();  // the large-shared-memory opt-in is done for this device
    row_program_kernel<false, false><<<grid, rc.threads, rc.smem_bytes, stream>>>(P);
  }
  GF_LAUNCH_CHECK();
}

}  // namespace

void launch_row_pass(const Plan& plan, const Step& step, const RowChoice& choice, const RunArgs& args,
                     char* workspace, float* row_scratch, cudaStream_t stream) {
  const RowConfig& rc = choice.config;
  if (plan.M == 0 || rc.grid == 0) return;
  if (rc.scratch && row_scratch == nullptr)
    throw std::logic_error("CUDA row program: scratch rows needed but none in the workspace");

  const RunPointers run{plan, args, workspace};
  DevProgram P = program_header(step, rc, run, row_scratch);
  int64_t w = P.win;
  for (size_t i = 0; i < step.program.size(); ++i) w = lower_instr(step.program[i], w, run, P.ins[i]);

  // Register mode where the Selection chose it and this call's vectors allow it.
  if (choice.kind == RowKind::Register && register_vectors_aligned(P)) {
    launch_programmatic(register_kernel(rc.reg_vpt, choice.register_full), dim3(static_cast<unsigned>(plan.M)),
                        dim3(choice.register_threads), 0, stream, P);
    return;
  }
  launch_interpreter(rc, P, stream);
}

}  // namespace gemmfuse::cuda
