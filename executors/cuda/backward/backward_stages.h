// The stages of one CUDA backward (CudaExecutor::backward), in stream order: the row stage
// (backward_rows.cu: the operands' gradients and dV from the output's gradient), then the
// GEMM stage (backward.cu: db, dW and dx from dV). Each stage reads one BackwardCall.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backward_layout.h"
#include "gemmfuse/executor.h"
#include "selection.h"

namespace gemmfuse::cuda {

// One backward call: the plan and its BackwardPlan, what the Selection chose, the scratch's
// layout, and the call's tensors, scratch and stream.
struct BackwardCall {
  const Plan& plan;
  const BackwardPlan& bp;
  const BackwardChoice& choice;
  const BackwardLayout& L;
  const BackwardArgs& a;
  char* ws;  // the scratch (a.workspace), laid out by L
  cudaStream_t stream;

  float* at(size_t offset) const { return LaidOut{ws}.as<float>(offset); }  // an fp32 buffer of L's
};

// The row stage: zeroes the operands' gradients, then fills dV (at L.dv) as the Selection's
// RowBackwardMode says (the output's gradient copied, or the row backward by segments, which
// adds into the operands' gradients).
void backward_rows(const BackwardCall& c);

// Blocks of 256 threads that cover n elements.
inline unsigned blocks_of_256(int64_t n) { return static_cast<unsigned>((n + 255) / 256); }

}  // namespace gemmfuse::cuda
