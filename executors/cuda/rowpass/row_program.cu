// RowPass steps on the GPU: checks a step, picks its launch shape (row_config), resolves its
// program against the run's pointers (DevProgram) and launches one of the two row kernels:
// the register kernel (row_register_kernel.cuh) where the row fits registers, else the
// interpreter (row_interpreter_kernel.cuh).
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

bool is_pool(const Instr& in) { return in.kind == Instr::Kind::Pool; }

// Width after the instruction, from the width before it.
int64_t width_after(const Instr& in, int64_t w) {
  switch (in.kind) {
    case Instr::Kind::Reduce: return 1;
    case Instr::Kind::Pool: return eff(in.width_out);
    default: return w;
  }
}

struct DeviceLimits {
  bool known = false;
  size_t limit = 0;
};
std::mutex g_limits_mutex;
std::vector<DeviceLimits> g_limits;
std::atomic<bool> g_register_rows{true};
std::atomic<int> g_register_wide_threads{512};
std::atomic<bool> g_register_one_value{true};

// Register mode's threads per CTA and chunks per thread (0: the step cannot use it). Rows
// wider than 4096: 512 threads x 4 chunks (61 registers, 2 CTAs = 32 warps per SM) by default;
// 256 x 8 takes 111 registers (2 CTAs = 16 warps per SM).
int register_threads(int64_t w) {
  return w > 4096 ? g_register_wide_threads.load() : w >= 1024 ? 256 : 128;
}
int register_vpt(const Step& step) {
  const int64_t w0 = eff(step.width_in);
  if (w0 % 4 != 0 || w0 <= kWarpModeMaxWidth || w0 > kRegMaxWidth) return 0;
  int64_t w = w0;
  for (const Instr& in : step.program) {
    if (w == 1 && in.kind != Instr::Kind::Pointwise && in.kind != Instr::Kind::Save &&
        in.kind != Instr::Kind::BatchNormApply)
      return 0;
    switch (in.kind) {
      case Instr::Kind::Pool: return 0;
      case Instr::Kind::GroupNorm: {
        if (in.node.groups <= 0 || w % in.node.groups != 0) return 0;
        const int64_t gs = w / in.node.groups;
        if (gs % 4 != 0) return 0;
        const int64_t q = gs / 4;
        if (q > 32 || (q & (q - 1)) != 0) return 0;
        break;
      }
      case Instr::Kind::Pointwise:
      case Instr::Kind::Reduce:
      case Instr::Kind::Softmax:
      case Instr::Kind::BatchNormApply:
      case Instr::Kind::Save:
        break;
      default: return 0;
    }
    w = width_after(in, w);
  }
  const int64_t nt = register_threads(w0), nch = w0 / 4;
  const int64_t need = (nch + nt - 1) / nt;
  return need <= 1 ? 1 : need <= 2 ? 2 : need <= 4 ? 4 : need <= 8 ? 8 : 0;
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
    switch (in.kind) {
      case Instr::Kind::GroupNorm:
        if (in.node.groups <= 0 || w % in.node.groups != 0)
          unsupported("group_norm groups do not divide the width");
        break;
      case Instr::Kind::Pool:
        if (in.node.kernel <= 0 || in.node.stride <= 0 || in.node.padding < 0)
          unsupported("bad pool window");
        break;
      default: break;
    }
    w = width_after(in, w);
    if (w > INT_MAX / 2) unsupported("row width too large");
  }
  if (w != eff(step.width_out))
    throw std::logic_error("CUDA row program: program ends at width " + std::to_string(w) +
                           ", step says " + std::to_string(step.width_out));
}

void set_register_rows(bool on) { g_register_rows.store(on); }
void set_register_wide_threads(int threads) {
  g_register_wide_threads.store(threads == 256 ? 256 : 512);
}
bool register_rows() { return g_register_rows.load(); }
void set_register_one_value(bool on) { g_register_one_value.store(on); }

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

RowConfig row_config(const Step& step, int64_t M) {
  check_row_step(step);
  RowConfig rc;
  int64_t w = eff(step.width_in), capA = w, capB = 0;
  for (const Instr& in : step.program) {
    w = width_after(in, w);
    if (is_pool(in)) capB = std::max(capB, w);
    else capA = std::max(capA, w);
  }
  rc.reg_vpt = register_vpt(step);
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
  if (!rc.warp_mode && rc.smem_bytes > row_smem_limit()) {
    rc.scratch = true;
    rc.smem_bytes = 0;
    rc.grid = std::min<int64_t>(M, kScratchCtas);
    rc.scratch_bytes = slot_bytes * static_cast<size_t>(std::max<int64_t>(rc.grid, 1));
  } else {
    rc.grid = (M + rc.rows_per_cta - 1) / rc.rows_per_cta;
    if (rc.grid > INT_MAX) unsupported("too many rows for one launch");
  }
  return rc;
}

void launch_row_pass(const Plan& plan, const Step& step, const RunArgs& args, char* workspace,
                     float* row_scratch, cudaStream_t stream) {
  const RowConfig rc = row_config(step, plan.M);
  if (plan.M == 0 || rc.grid == 0) return;
  if (rc.scratch && row_scratch == nullptr)
    throw std::logic_error("CUDA row program: scratch rows needed but none in the workspace");

  auto buffer = [&](int id) -> float* {
    if (id < 0 || id >= static_cast<int>(plan.buffers.size()))
      throw std::logic_error("CUDA row program: bad buffer id " + std::to_string(id));
    return reinterpret_cast<float*>(workspace + plan.buffer_offset(id));
  };
  auto tensor = [&](int idx) -> const float* {
    if (idx < 0 || idx >= static_cast<int>(args.operands.size()) || !args.operands[idx])
      throw std::invalid_argument("gemmfuse: operand t" + std::to_string(idx) + " missing");
    return args.operands[idx];
  };
  auto affine = [&](const OperandRef& ref) -> const float* {
    switch (ref.kind) {
      case OperandRef::Kind::None: return nullptr;
      case OperandRef::Kind::Col: return tensor(ref.index);
      default: unsupported("a norm's weight/bias must be a per-column tensor");
    }
  };

  DevProgram P{};
  P.in = buffer(step.input);
  P.M = plan.M;
  P.n = static_cast<int32_t>(step.program.size());
  P.win = static_cast<int32_t>(eff(step.width_in));
  P.wout = static_cast<int32_t>(eff(step.width_out));
  P.capA = rc.capA;
  P.capB = rc.capB;
  P.rows_per_cta = rc.rows_per_cta;
  P.scratch = rc.scratch ? row_scratch : nullptr;
  if (step.output == kOutput) {
    P.out = args.out;
    P.out_type = plan.dtype == DType::F32 ? kOutF32 : plan.dtype == DType::BF16 ? kOutBF16 : kOutF16;
  } else {
    P.out = buffer(step.output);
    P.out_type = kOutF32;
  }
  const size_t out_align = P.out_type == kOutF32 ? 16 : 8;
  P.in_vec = (P.win % 4 == 0) && aligned16(P.in);
  P.out_vec = (P.wout % 4 == 0) && (reinterpret_cast<uintptr_t>(P.out) % out_align == 0);

  int64_t w = P.win;
  for (size_t i = 0; i < step.program.size(); ++i) {
    const Instr& in = step.program[i];
    DevInstr& d = P.ins[i];
    d.op = static_cast<uint8_t>(in.node.op);
    d.win = static_cast<int32_t>(w);
    switch (in.kind) {
      case Instr::Kind::Pointwise: {
        d.kind = kPointwise;
        d.pp = pointwise_params(in.node);
        if (family(in.node.op) == OpFamily::Binary) {
          d.flags |= kFlagBinary;
          if (in.node.reversed) d.flags |= kFlagReversed;
          const OperandRef& b = in.b;
          switch (b.kind) {
            case OperandRef::Kind::Imm: d.opnd = kOpImm; d.imm = b.imm; break;
            case OperandRef::Kind::Scalar: d.opnd = kOpScalar; d.b = tensor(b.index); break;
            case OperandRef::Kind::Col: d.opnd = kOpCol; d.b = tensor(b.index); break;
            case OperandRef::Kind::Row: d.opnd = kOpRow; d.b = tensor(b.index); break;
            case OperandRef::Kind::Full: d.opnd = kOpFull; d.b = tensor(b.index); break;
            case OperandRef::Kind::Buffer:
              d.b = buffer(b.index);
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
        } else if (family(in.node.op) != OpFamily::Unary) {
          // The device's dispatch knows the table's unary and binary rows only.
          throw std::logic_error(std::string("CUDA row program: pointwise instruction for op ") +
                                 op_name(in.node.op));
        }
        break;
      }
      case Instr::Kind::Reduce: d.kind = kReduce; break;
      case Instr::Kind::Softmax: d.kind = kSoftmax; break;
      case Instr::Kind::GroupNorm:
        d.kind = kGroupNorm;
        d.i0 = static_cast<int32_t>(in.node.groups);
        d.imm = static_cast<float>(in.node.eps);
        d.p1 = affine(in.weight);
        d.p2 = affine(in.bias);
        break;
      case Instr::Kind::Pool:
        d.kind = kPool;
        d.i0 = static_cast<int32_t>(in.node.kernel);
        d.i1 = static_cast<int32_t>(in.node.stride);
        d.i2 = static_cast<int32_t>(in.node.padding);
        if (in.node.count_include_pad) d.flags |= kFlagIncludePad;
        break;
      case Instr::Kind::BatchNormApply:
        d.kind = kBnApply;
        d.p0 = buffer(in.stats);
        d.p1 = affine(in.weight);
        d.p2 = affine(in.bias);
        break;
      case Instr::Kind::Save:
        d.kind = kSave;
        d.save = buffer(in.buffer);
        if (w % 4 == 0) d.flags |= kFlagVec;  // buffers are 256-byte aligned
        break;
      default: unsupported("unknown instruction kind");
    }
    w = width_after(in, w);
    d.wout = static_cast<int32_t>(w);
  }

  // Register mode when the step allows it and every vector the kernel reads is 16-byte aligned.
  // A row that ends as one value (m22: logsumexp, then pointwise on the value) too, unless
  // set_register_one_value(false).
  const bool one_value = P.wout == 1 && P.win > 1;
  bool reg = rc.reg_vpt > 0 && !rc.warp_mode && register_rows() && P.in_vec &&
             (one_value ? g_register_one_value.load() : P.out_vec) && plan.M <= INT_MAX;
  for (int i = 0; reg && i < P.n; ++i) {
    const DevInstr& d = P.ins[i];
    if (d.kind == kPointwise && (d.flags & kFlagBinary) && (d.opnd == kOpCol || d.opnd == kOpFull))
      reg = aligned16(d.b);
    if (d.kind == kGroupNorm || d.kind == kBnApply)
      reg = aligned16(d.p0) && aligned16(d.p1) && aligned16(d.p2);
    if (d.kind == kSave) reg = aligned16(d.save);
  }
  if (reg) {
    const int nt = register_threads(P.win);
    launch_programmatic(register_kernel(rc.reg_vpt, P.win / 4 == rc.reg_vpt * nt),
                        dim3(static_cast<unsigned>(plan.M)), dim3(nt), 0, stream, P);
    return;
  }

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

}  // namespace gemmfuse::cuda
