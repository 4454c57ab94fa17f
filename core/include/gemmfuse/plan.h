// Plan: a chain cut into steps that both executors (CPU, CUDA) run.
//
// The shape of every plan (see docs/design.md for why):
//   [prepare weights once per weight version]  column sums (GEMV), folded eval BatchNorm,
//                                              split precision parts (executor-specific)
//   Gemm | Gemv                                 Linear -> buffer Y (fp32 [M,N] or [M,1])
//   (RowPass | ColumnStats)*                    row programs: every row-local stage of the chain
//                                               run per row in one kernel; a training-mode
//                                               BatchNorm cuts the chain where its column
//                                               statistics (over all rows) must be complete.
// The last step writes the output tensor (buffer id kOutput).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gemmfuse/chain.h"

namespace gemmfuse {

enum class DType : uint8_t { F32, BF16, F16 };
enum class Device : uint8_t { CPU, CUDA };
enum class Precision : uint8_t { FP32, Fast, TF32 };

const char* dtype_name(DType d);
const char* precision_name(Precision p);
bool precision_from_name(const std::string& s, Precision* out);
bool dtype_from_name(const std::string& s, DType* out);

// The chain cannot be fused (an op or a shape gemmfuse does not take). The message says why;
// the Python front runs the region in PyTorch and `explain` shows the message.
struct Unsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// How a row program reads an operand, resolved against the shape of the value it meets.
struct OperandRef {
  enum class Kind : uint8_t {
    None,
    Imm,     // `imm`
    Scalar,  // operand tensor `index` with one element
    Col,     // operand tensor `index`, one value per column: t[col]
    Row,     // operand tensor `index`, one value per row: t[row]
    Full,    // operand tensor `index`, [M, width]: t[row * width + col]
    Buffer,  // workspace buffer `index` (a saved value), [M, cols] with cols == width or 1
  };
  Kind kind = Kind::None;
  float imm = 0.f;
  int index = -1;
  int64_t cols = 0;  // Buffer: the saved value's width (1 broadcasts over the row)
};

// One instruction of a row program. Plain data (trivially copyable) so that the CUDA
// executor can copy a program to the device as it is.
struct Instr {
  enum class Kind : uint8_t {
    Pointwise,       // node.op unary or binary; `b` resolved
    Reduce,          // node.op in {Sum, Mean, Max, Min, LogSumExp}: width -> 1
    Softmax,         // node.op in {Softmax, LogSoftmax}
    GroupNorm,       // node.groups groups of width/groups contiguous columns; weight/bias Col
    Pool,            // node.op in {AvgPool, MaxPool}: width_in -> width_out
    BatchNormApply,  // (x - mean[c]) * invstd[c] * weight[c] + bias[c]; stats in buffer `stats`
    Save,            // store the current row into buffer `buffer` (read back by Buffer operands)
  };
  Kind kind = Kind::Pointwise;
  Node node;                 // the stage (attributes: eps, groups, kernel, ...)
  OperandRef b;              // Pointwise binary operand
  OperandRef weight, bias;   // GroupNorm / BatchNormApply affine (Col or None)
  int stats = -1;            // BatchNormApply: buffer holding [3, width] = mean, invstd, var rows
  int buffer = -1;           // Save: destination buffer
  int64_t width_in = 0, width_out = 0;
};

// Buffers are fp32 [rows, cols] arrays in the workspace; kOutput is the output tensor.
constexpr int kOutput = -2;
struct BufferSpec {
  std::string name;
  int64_t rows = 0, cols = 0;
};

struct Step {
  enum class Kind : uint8_t {
    Gemm,         // output[M,N] = x W^T (+ b)  (bias added here; fp32 output buffer)
    Gemv,         // output[M,1] = x . colsum(W) + sum(b)   (scaled by 1/N for a mean)
    RowPass,      // output = program(input), row by row
    ColumnStats,  // buffer `output` [3,width] = mean, invstd, biased var over the M rows of `input`
                  // for BatchNorm node `node`; updates its running state when training
                  // (node.training and running stats present: running_mean/var, and
                  // num_batches += 1 when present; momentum < 0 means 1/num_batches).
                  // input == -1: an eval BatchNorm that was not folded into W: the stats
                  // come from the running state (mean = running_mean,
                  // invstd = 1/sqrt(running_var + eps)); no rows are read, nothing updated,
                  // and the row pass is not cut (the step comes before the pass using it).
  };
  // Conventions of planner-made plans:
  //  - Gemm/Gemv write buffer 0 ("Y", fp32) when a row pass follows, else kOutput directly
  //    (then in the model dtype, and the plan has no buffers).
  //  - Gemv: node.op Sum or Mean (node.keepdim says the output shape); it replaces the
  //    Linear and plan.chain.nodes[0].
  //  - A value that a later stage reads through `v<i>` is read back with an OperandRef
  //    Buffer: from the buffer that holds it intact (Y, a pass's intermediate output) or
  //    from a buffer a Save instruction wrote when the value was current.
  //  - RowPasses never write their input buffer; a value without a feature dim is width 1.
  Kind kind = Kind::RowPass;
  int input = -1;   // buffer id (RowPass, ColumnStats)
  int output = -1;  // buffer id or kOutput
  int64_t width_in = 0, width_out = 0;
  std::vector<Instr> program;  // RowPass
  Node node;                   // Gemv: Sum or Mean; ColumnStats: the BatchNorm node
  std::string summary;         // one line for describe()
  double bytes = 0, flops = 0; // the minimum this step must move and compute
};

struct WeightPrep {
  bool column_sums = false;          // Gemv: colsum(W)[K], sum(b)
  bool fold_batchnorm = false;       // eval BatchNorm folded into W and b
  Node batchnorm;                    // the folded BatchNorm (operands refer to the run's tensors)
};

// What an executor derives from a plan once and keeps with it (the CUDA executor's kernel
// selection and memory layouts, per device), in slots by key; the core does not know its
// type. Thread-safe. A copy of the plan starts with none: the copy may be changed before it
// runs.
class PlanMemo {
 public:
  PlanMemo() = default;
  PlanMemo(const PlanMemo&) {}
  PlanMemo& operator=(const PlanMemo&) {
    std::lock_guard<std::mutex> lock(mu_);
    slots_.clear();
    return *this;
  }
  // The value in slot `key` where fresh(value) holds, else make()'s, kept in the slot.
  template <class T, class Fresh, class Make>
  std::shared_ptr<const T> get(uint64_t key, Fresh fresh, Make make) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [k, v] : slots_) {
      if (k != key) continue;
      auto t = std::static_pointer_cast<const T>(v);
      if (fresh(*t)) return t;
      t = std::make_shared<const T>(make());
      v = t;
      return t;
    }
    auto t = std::make_shared<const T>(make());
    slots_.emplace_back(key, t);
    return t;
  }

 private:
  mutable std::mutex mu_;
  mutable std::vector<std::pair<uint64_t, std::shared_ptr<const void>>> slots_;
};

struct Plan {
  Chain chain;                      // after simplification
  std::vector<std::string> rewrites;  // what simplification did, one line each
  int64_t M = 0, K = 0, N = 0;
  DType dtype = DType::F32;
  Precision precision = Precision::FP32;
  WeightPrep prep;
  std::vector<BufferSpec> buffers;
  std::vector<Step> steps;
  int64_t out_width = 0;            // width of the output's last dim
  bool out_has_feature_dim = true;  // false: the output drops the last dim
  Device device = Device::CPU;
  bool for_training = false;        // planned to be differentiated (PlanRequest::for_training)
  // Non-empty where the planner expects PyTorch to run this chain faster than this plan on
  // this device and shape: the reason. The plan still runs when called; the Python front
  // asks (`gemmfuse::route`) and runs such calls in PyTorch, and `explain` shows the reason.
  std::string pytorch_faster;
  PlanMemo memo;  // the executors' (PlanMemo)

  // Byte offset of buffer i in the workspace (256-byte aligned) and the bytes all buffers take.
  size_t buffer_offset(int i) const;
  size_t buffers_bytes() const;
  // Multi-line, human-readable: rewrites, then one line per step with bytes and FLOPs.
  std::string describe() const;
};

// GEMMs of fewer flops (2MNK) take about as long on SGEMM as a call's launches and host work:
// their calls are bound by those, where the tensor-core split paths (`fast`'s split, `fp32`'s
// split-product kernel) do not pay
// (docs/measurements.md, "Planner rules and the measurements they rest on").
constexpr double kHostBoundGemmFlops = 1.35e9;

// `fast`'s bf16 split GEMM (cuBLASLt) sums K products on tensor cores with no promotion to
// fp32 registers, and its error grows with K: on an H100, relative 4.4e-6 up to K = 1024,
// 1.0e-5 at 8192, 1.9e-5 at 16384 and 1.5e-4 at 128256 (the LM head's dx), past fast's 1e-4
// promise. From this K on, fast runs its GEMM in fp32 (the f16x3 kernel, which promotes every
// 64 of K): about a third of the way to the promise at this K
// (docs/measurements.md, "Planner rules and the measurements they rest on").
constexpr int64_t kFastMaxK = 32768;

// What the planner needs to know beyond the chain.
struct PlanRequest {
  Chain chain;                                     // as captured
  std::vector<int64_t> batch_sizes;                // leading dims of x (their product is M)
  std::vector<std::vector<int64_t>> operand_sizes; // shape of each t<i>
  DType dtype = DType::F32;
  Precision precision = Precision::FP32;
  Device device = Device::CPU;
  // false: plan the chain as captured (only identity dropouts are dropped). For tests and
  // for debugging a rewrite; products leave it on.
  bool simplify = true;
  // The plan will be differentiated (gemmfuse::train_forward / train_backward): rewrites
  // whose backward would need what they fold away are left out (passes.h).
  bool for_training = false;
  // `fast` with at most this many rows runs its GEMM in fp32: there the GEMM is bound by
  // reading W, and fp32 is as fast and more accurate. Tests of the split path set 0.
  int64_t fast_min_rows = 16;
  // `fast` with a GEMM of fewer flops (2MNK) runs it in fp32 too: the split, its products and
  // the fix-up are host-bound there (slower than eager), and fp32 is faster and more
  // accurate. Tests of the split path set 0.
  double fast_min_flops = kHostBoundGemmFlops;
};

// Simplify the chain and cut it into steps. Throws Unsupported (cannot fuse: fall back) or
// std::invalid_argument (the call is wrong for PyTorch too, e.g. training BatchNorm with M == 1).
Plan make_plan(const PlanRequest& request);

}  // namespace gemmfuse
