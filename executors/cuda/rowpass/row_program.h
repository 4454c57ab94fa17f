// RowPass steps: the register kernel, or the row-program interpreter: one CTA per row (a warp
// per row for narrow rows), the row in shared memory (or a global scratch row when too wide),
// the program passed by value as a kernel parameter.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "gemmfuse/executor.h"
#include "gemmfuse/plan.h"
#include "selection.h"

namespace gemmfuse::cuda {

// The row kernels' limits, RowConfig (a RowPass's launch shape) and which kernel runs each
// RowPass are the kernel selection's (selection.h: Selection::rows).

// Throws Unsupported when the step cannot run on this executor (too many instructions, an
// unknown instruction, a width that does not fit int32).
void check_row_step(const Step& step);

// Dynamic shared memory a row slot may use on the current device (opt-in limit less the
// kernel's static shared memory). Cached per device.
size_t row_smem_limit();

// Runs the step as `choice` says (the register kernel, or the interpreter where the call's
// vectors are not 16-byte aligned or the choice is the interpreter).
void launch_row_pass(const Plan& plan, const Step& step, const RowChoice& choice, const RunArgs& args,
                     char* workspace, float* row_scratch, cudaStream_t stream);

}  // namespace gemmfuse::cuda
