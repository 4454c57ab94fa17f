// The row-program interpreter (RowPass steps): one CTA per row (a warp per row for narrow
// rows), the row in shared memory (or a global scratch row when too wide), the program
// passed by value as a kernel parameter.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "gemmfuse/executor.h"
#include "gemmfuse/plan.h"

namespace gemmfuse::cuda {

constexpr int kMaxInstrs = 32;          // instructions per row program (kernel parameter)
constexpr int kWarpModeMaxWidth = 256;  // rows at most this wide: one warp per row
constexpr int kWarpModeThreads = 128;   // 4 rows per CTA in warp mode
constexpr int64_t kScratchCtas = 512;   // CTAs (and scratch rows) when rows live in global memory
constexpr int kRegMaxWidth = 8192;      // register mode: rows up to this wide (256 threads x 8 float4)

// The launch shape of one RowPass, a function of the step, M and the device's shared memory.
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

// Throws Unsupported when the step cannot run on this executor (too many instructions, an
// unknown instruction, a width that does not fit int32).
void check_row_step(const Step& step);
RowConfig row_config(const Step& step, int64_t M);

// Dynamic shared memory a row slot may use on the current device (opt-in limit less the
// kernel's static shared memory). Cached per device.
size_t row_smem_limit();

// Register mode (rows kept in registers, see row_register_kernel.cuh) on or off for the whole process
// (default on). Off: every RowPass runs the shared-memory interpreter. For tests and timing.
void set_register_rows(bool on);
bool register_rows();
// Threads per CTA of register mode for rows wider than 4096 (256 or 512; default 512).
void set_register_wide_threads(int threads);
// Register mode for rows that end as one value (default on). For tests and timing.
void set_register_one_value(bool on);

void launch_row_pass(const Plan& plan, const Step& step, const RunArgs& args, char* workspace,
                     float* row_scratch, cudaStream_t stream);

}  // namespace gemmfuse::cuda
