// The row math of an LM head's cross-entropy on one chunk of logits, in place, in one kernel
// (linear_cross_entropy's CUDA path; its CPU path runs the same formulas as ATen ops). Per row
// r of z [rows, ldz] (the first V columns the classes, the rest padding):
//   m = max_j z_j,  s = Σ_j exp(z_j − m)  (a NaN anywhere makes s, and so everything, NaN)
//   loss[r] = (1−ε)(log s − (z_t − m)) + ε(log s − (mean_j z_j − m)), 0 where the row is not
//             valid (ignored), t = target[r]
//   with grads: z_j = w_r (exp(z_j − m)/s − (1−ε)[j = t] − ε/V) for j < V, 0 for the padding
// which is PyTorch's log_softmax, nll_loss with label smoothing, and their backward for the
// row weight w_r. The sums add in fp64. Two reads of the row (three with smoothing) and one
// write, where the ATen ops took about nine passes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace gemmfuse::cuda {

struct CrossEntropyRows {
  float* z = nullptr;              // [rows, ldz]
  int64_t rows = 0, V = 0, ldz = 0;
  const int64_t* target = nullptr; // [rows], each in [0, V)
  const bool* valid = nullptr;     // [rows]
  float eps = 0.f;                 // label smoothing
  float* loss = nullptr;           // [rows], or null: no losses
  const float* w = nullptr;        // [rows]: the gradients' row weights, or null: no gradients
};

void launch_cross_entropy_rows(const CrossEntropyRows& p, cudaStream_t stream);

}  // namespace gemmfuse::cuda
