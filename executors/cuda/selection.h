// The CUDA executor's kernel selection: every choice of kernel for a plan, forward and
// backward, made in one place (select) from the plan, what the device is (DeviceFacts) and
// the environment's switches (Overrides), each choice with its reason for explain. Plain
// C++ (no CUDA runtime calls): it builds and is tested without a GPU
// (tests/cpp/cuda_selection_test.cpp). The executor fills DeviceFacts once per device, runs
// select once per plan and device (plan_state.h) and launches what the Selection says; what
// it still checks per call is what depends on the call's pointers, and each choice names
// what runs then (`fallback`). docs/design.md, "Kernel selection".
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gemmfuse/backward.h"
#include "gemmfuse/plan.h"

namespace gemmfuse::cuda {

// What select needs to know of the device, read once per device (device_facts.h).
struct DeviceFacts {
  int compute_capability = 0;   // major * 10 + minor (90: H100/H200); 0 unknown
  int sms = 132;                // streaming multiprocessors
  size_t row_smem_limit = 47 * 1024;  // dynamic shared memory a row-program CTA may use
  bool sm90_kernels = false;    // this build has the CUTLASS sm90 kernels
  // Clusters of the fused GEMM + softmax kernel the device holds at once, per 16-bit type
  // (0: the kernel does not fit, or no sm_90 GPU).
  int softmax_clusters_bf16 = 0, softmax_clusters_f16 = 0;
};

// Every switch that changes a choice: the environment's, read in from_environment, and the
// process-wide setters tests and timing use (set_*). An input to select; explain prints
// those that are set.
struct Overrides {
  bool f16x3 = true;              // GEMMFUSE_F16X3=0: fp32 GEMMs stay off the f16x3 kernel
  bool fused_softmax = true;      // GEMMFUSE_FUSED_SOFTMAX=0 or set_fused_softmax(false)
  bool sm90_programmatic = true;  // GEMMFUSE_SM90_PDL=0: the fused kernel launched cooperative
  bool sm90_defer = true;         // GEMMFUSE_SM90_DEFER=0: its epilogues not deferred
  bool register_rows = true;      // set_register_rows(false): every row pass interpreted
  int register_wide_threads = 512;  // set_register_wide_threads: rows wider than 4096
  bool register_one_value = true;   // set_register_one_value(false)
  int fused_colstats = 1;         // set_fused_colstats: 0 off, 1 auto, 4 or 8 forced
  bool vector_colstats = true;    // set_vector_colstats(false)
  // GEMMFUSE_F16X3_PADDED_N=1 or set_f16x3_padded_n(true): an fp32 forward GEMM whose N is not
  // a multiple of 4 (an LM head's 50257) may run on the f16x3 kernel, into a Y with padded
  // rows in the workspace, then copied into place (GemmChoice::ldy). Off by default until
  // the GPU tests have covered it (tests/cpp/cuda_executor_test.cpp, F16x3PaddedRows).
  bool f16x3_padded_n = false;
  // GEMMFUSE_GN_LANES8=1 or set_group_norm_lanes8(true): the row backward takes GroupNorm groups
  // of at most 64 columns by 8 lanes, four groups a warp at once, rather than a warp a group
  // (BackwardChoice::group_norm_lanes). Off by default until timed on a GPU.
  bool group_norm_lanes8 = false;

  // The environment's switches (a path is on unless its variable is "0"), the setters at
  // their defaults.
  static Overrides from_environment();
  // One line per switch that differs from the default ("GEMMFUSE_F16X3=0"), for explain.
  std::vector<std::string> set() const;
  bool operator==(const Overrides& o) const;
  bool operator!=(const Overrides& o) const { return !(*this == o); }
};

// from_environment (read once per process) with the setters below applied.
Overrides current_overrides();
void set_fused_softmax(bool on);
void set_register_rows(bool on);
void set_register_wide_threads(int threads);  // 256 or 512
void set_register_one_value(bool on);
void set_fused_colstats(int mode);
void set_vector_colstats(bool on);
void set_f16x3_padded_n(bool on);
void set_group_norm_lanes8(bool on);

// ---- the f16x3 kernel's rules (sm90/gemm_f16x3.h) and their constants -------------------

constexpr int kF16x3TileMN = 128;      // its output tiles are 128 x 128
constexpr int64_t kF16x3MinRows = 33;  // up to 32 rows: the small-M kernel
constexpr int64_t kF16x3MinK = 128;    // below: the parts' rounding not well under SGEMM's
constexpr int kF16x3MaxSplits = 8;     // the most ranges the split-K kernel cuts K into
constexpr int64_t kSmallMMaxRows = 32;
constexpr int64_t kSmallMMaxK = (int64_t(1) << 26) - 8;  // the small-M kernel's x offsets are 32-bit

// The cost model of the f16x3 kernel against SGEMM at one shape (seconds), selection.cpp.
struct F16x3Cost {
  int splits = 1;
  double f16x3_s = 0, sgemm_s = 0, flops = 0;
};
int f16x3_splits(int64_t M, int64_t N, int sms);
// ldy > 0: Y written with padded rows, then copied into place (GemmChoice::ldy), that copy
// counted too.
F16x3Cost f16x3_cost(int64_t M, int64_t N, int64_t K, int sms, int64_t ldy = 0);
// nullptr where the kernel is expected to beat SGEMM at this shape, else why not.
const char* f16x3_slower_than_sgemm(int64_t M, int64_t N, int64_t K, int sms, int64_t ldy = 0);
// The same for a cost the caller has (f16x3_cost's).
const char* f16x3_slower_than_sgemm(const F16x3Cost& c);
// nullptr where the kernel can run this shape here, else why not. padded_n: N need not be a
// multiple of 4 (the caller gives the kernel a Y with padded rows).
const char* f16x3_unfit(int64_t M, int64_t N, int64_t K, const DeviceFacts& d, const Overrides& o,
                        bool padded_n = false);
// The padded row stride a forward GEMM of N columns writes on the kernel: N rounded up to 4
// where N is not a multiple of 4 and the override allows it, else 0 (Y itself).
int64_t f16x3_padded_ldy(int64_t N, const Overrides& o);
// nullptr where an fp32-mode GEMM of this shape runs on the kernel (fit and faster).
const char* f16x3_declines(int64_t M, int64_t N, int64_t K, const DeviceFacts& d, const Overrides& o);
// The same with W read MN-major (dx = dV W): N a multiple of 8 too.
const char* f16x3_declines_mn_major(int64_t M, int64_t N, int64_t K, const DeviceFacts& d,
                                    const Overrides& o);
// nullptr where dW [N, K] = dVᵀ x, dV [M, N] and x [M, K] read where they lie, runs on the
// kernel (launch_weight_grad_f16x3: the GEMM N x K x M with x read MN-major, dV's transposed
// split reading its rows as 16-byte vectors, so N a multiple of 4), else why not.
const char* f16x3_weight_grad_declines(int64_t M, int64_t N, int64_t K, const DeviceFacts& d,
                                       const Overrides& o);
// PlanRequest::fast_min_rows for an M x N x K GEMM: where fp32 mode's f16x3 kernel takes the
// shape, up to one row of its tiles (split-K there beats `fast`'s three bf16 products and is
// more accurate); else the planner's default.
int64_t fast_min_rows(int64_t M, int64_t N, int64_t K, const DeviceFacts& d, const Overrides& o);

// ---- the choices ---------------------------------------------------------------------------

enum class GemmKind : uint8_t {
  None,       // no GEMM (or not computed: the backward's dW/dx when nothing asks for them)
  Gemv,       // x . colsum(W) + sum(b) (the sum rewrite, gemv.cu)
  BiasOnly,   // K = 0: Y = bias
  FastSplit,  // `fast`: bf16 hi + lo parts, three products in one cuBLASLt GEMM
  F16x3,      // fp32 on fp16 tensor cores (sm90/gemm_f16x3.h)
  SmallM,     // up to 32 rows of fp32 (gemm_small_m.h)
  Sgemm,      // cuBLAS(Lt) fp32, no TF32
  Tf32,       // cuBLAS(Lt) TF32
  Half,       // cuBLAS(Lt) in the model's 16-bit type, fp32 accumulation
};
const char* gemm_kind_name(GemmKind k);

struct GemmChoice {
  GemmKind kind = GemmKind::None;
  // What runs where a check of the call's pointers declines `kind` (f16x3: 16-byte
  // alignment; small-M: 4-byte alignment and room for x's shifted copies); None: no such check.
  GemmKind fallback = GemmKind::None;
  int splits = 1;             // F16x3: ranges each output tile's K is cut into (1: the wide kernel)
  // F16x3 with N not a multiple of 4: the row stride of the padded Y it writes in the
  // workspace (N rounded up to 4; its TMA store needs 16-byte rows), then copied into Y
  // (WorkspaceLayout::y_padded); 0: it writes Y itself.
  int64_t ldy = 0;
  bool split_parts = false;   // `fast`'s bf16 parts are prepared and in the workspace
  bool f16x3_parts = false;   // the f16x3 kernel's fp16 parts are
  // cuBLASLt: the workspace its heuristic is told of (0: the whole workspace). The limit
  // steers the heuristic's kernel (docs/measurements.md, "Planner rules ...").
  size_t lt_heuristic_bytes = 0;
  F16x3Cost cost;             // where the cost model was asked (fp32 mode): its figures
  std::string reason;
};

struct FusedSoftmaxChoice {
  bool matches = false;       // the plan is Linear -> [gelu] -> [* c] -> softmax in 16 bits
  bool used = false;          // and the fused sm90 kernel runs it here
  bool gelu = false;
  float scale = 1.f;
  int64_t tiles = 0;          // its 128 x 256 output tiles
  bool programmatic = true;   // direct launches programmatic (else cooperative)
  bool defer_epilogues = true;
  std::string reason;
};
// The plan's match, whatever the device (matches, gelu, scale; reason when it does not).
FusedSoftmaxChoice match_fused_softmax(const Plan& plan);

// Row programs (rowpass/row_program.h).
constexpr int kMaxInstrs = 32;          // instructions per row program (kernel parameter)
constexpr int kWarpModeMaxWidth = 256;  // rows at most this wide: one warp per row
constexpr int kWarpModeThreads = 128;   // 4 rows per CTA in warp mode
constexpr int64_t kScratchCtas = 512;   // CTAs (and scratch rows) when rows live in global memory
constexpr int kRegMaxWidth = 8192;      // register mode: rows up to this wide

// The interpreter's launch shape of one RowPass (and register mode's chunks per thread).
struct RowConfig {
  bool warp_mode = false;
  int threads = 0;
  int rows_per_cta = 1;
  int capA = 0, capB = 0;     // floats per row slot: current row, pool output (multiples of 4)
  size_t smem_bytes = 0;      // dynamic shared memory per CTA (0 in scratch mode)
  bool scratch = false;       // rows in the workspace's row_scratch area
  int64_t grid = 0;
  size_t scratch_bytes = 0;   // workspace bytes the scratch rows take
  int reg_vpt = 0;            // register mode possible: float4 chunks per thread (1,2,4,8), else 0
};
// A row's width after the instruction, from the width before it (0 counts as 1).
int64_t row_width_after(const Instr& in, int64_t w);

enum class RowKind : uint8_t { None, Register, Warp, Block, Scratch };
const char* row_kind_name(RowKind k);

struct RowChoice {
  RowKind kind = RowKind::None;      // None: the step is not a RowPass
  RowKind fallback = RowKind::None;  // Register declined by the call's pointers (16-byte alignment)
  RowConfig config;                  // the interpreter's shape (fallback's, under Register)
  int register_threads = 0;
  bool register_full = false;        // every thread's chunks hold row values (no bounds checks)
  std::string reason;
};

enum class ColStatsKind : uint8_t { None, Running, Fused, TwoLevel };
struct ColStatsChoice {
  ColStatsKind kind = ColStatsKind::None;  // None: the step is not a ColumnStats
  int threads_per_segment = 0;  // Fused: 8 (32 columns a CTA) or 4 (16)
  bool vector = false;          // TwoLevel: the 16-byte-vector first level
  // The call's y not 16-byte aligned: the two-level scalar kernel (the plan's buffers are).
  std::string reason;
};

enum class RowBackwardMode : uint8_t { None, CopyGradient, Segments };
struct BackwardChoice {
  bool present = false;
  GemmKind dw = GemmKind::None, dx = GemmKind::None;
  int dw_splits = 1, dx_splits = 1;  // F16x3: as GemmChoice::splits
  std::string dw_reason, dx_reason;
  RowBackwardMode rows = RowBackwardMode::None;
  int segments = 0;                  // Segments: cut at batch-statistics BatchNorms
  int64_t slots = 0;                 // the row backward's CTAs (scratch rows per buffer)
  int group_norm_lanes = 32;         // lanes a GroupNorm group of at most 64 columns (8 or 32)
  std::string rows_reason;
};

struct Selection {
  GemmChoice gemm;
  FusedSoftmaxChoice fused;
  std::vector<RowChoice> rows;            // per step (kind None where not a RowPass)
  std::vector<ColStatsChoice> colstats;   // per step (kind None where not a ColumnStats)
  BackwardChoice backward;                // present when select was given a BackwardPlan
  Overrides overrides;
  // explain's lines: each choice, its reason, and the overrides that are set.
  std::string describe() const;
  std::string describe_backward() const;
};

// Every choice for the plan (and its backward, when bp is given) on a device with `d`.
// The plan is one CudaExecutor::check accepted.
Selection select(const Plan& plan, const BackwardPlan* bp, const DeviceFacts& d, const Overrides& o);

}  // namespace gemmfuse::cuda
