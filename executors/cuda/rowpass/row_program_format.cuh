// The row program as the kernels read it: each Instr of a RowPass step resolved against one
// run's pointers (DevInstr), the whole program passed by value as a kernel parameter
// (DevProgram). Built on the host by launch_row_pass: program_header, then lower_instr per
// instruction (row_program.cu).
// Part of row_program.cu, included there once (internal linkage: anonymous namespace).
#pragma once

#include <cstdint>

#include "row_attrs.h"
#include "row_program.h"

namespace gemmfuse::cuda {
namespace {

enum : uint8_t { kPointwise, kReduce, kSoftmax, kGroupNorm, kPool, kBnApply, kSave };
enum : uint8_t { kOpNone, kOpImm, kOpScalar, kOpCol, kOpRow, kOpFull };
enum : uint8_t { kFlagBinary = 1, kFlagReversed = 2, kFlagVec = 4 };
enum : uint8_t { kOutF32, kOutBF16, kOutF16 };

// One instruction: its attributes (row_attrs, shared with the backward; widths >= 1),
// resolved against this run's pointers.
struct DevInstr : RowAttrs {
  uint8_t kind, opnd, flags;
  float imm;              // Imm operand
  const float* b;         // binary operand (Scalar/Col/Row/Full)
  const float* p0;        // BatchNormApply: stats [2, win] (mean row, invstd row)
  const float* p1;        // GroupNorm/BatchNormApply: weight [win] or nullptr
  const float* p2;        // GroupNorm/BatchNormApply: bias [win] or nullptr
  float* save;            // Save: destination [M, win]
};

struct DevProgram {
  const float* in;  // [M, win] fp32
  void* out;        // [M, wout] in out_type
  float* scratch;   // global row slots (nullptr: shared memory)
  int64_t M;
  int32_t n, win, wout, capA, capB, rows_per_cta;
  uint8_t out_type, in_vec, out_vec;
  DevInstr ins[kMaxInstrs];
};
static_assert(sizeof(DevProgram) <= 4096, "row program must fit the classic 4 KB parameter limit");

}  // namespace
}  // namespace gemmfuse::cuda
