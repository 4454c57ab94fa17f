// Weight preparation (once per weight version, on args.stream): folded eval BatchNorm,
// fp32 bias, column sums, bf16 hi/lo split of W. Layout: PreparedLayout (layout.h).
#pragma once

#include <cuda_runtime.h>

#include "gemmfuse/executor.h"
#include "gemmfuse/plan.h"

namespace gemmfuse::cuda {

void prepare_weights(const Plan& plan, const RunArgs& args, char* prepared, cudaStream_t stream);

// Pointer to the fp32 tensor an Operand names (t<i> -> operands[i], s<i> -> state[i]);
// nullptr for an absent operand. Throws std::invalid_argument for a bad index.
const float* operand_ptr(const Operand& op, const RunArgs& args);

}  // namespace gemmfuse::cuda
