// Device pieces both row kernels use: the row team of a row in shared memory, pointwise
// math on 4 values with the op dispatched once per 4, operand loads, and the output store in
// the output's dtype.
// Part of row_program.cu, included there once (internal linkage: anonymous namespace).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "batch_norm_op.h"
#include "pointwise.h"
#include "row_ops.h"
#include "row_program_format.cuh"

namespace gemmfuse::cuda {
namespace {

// ---- device helpers ---------------------------------------------------------------------

template <bool kWarp>
__device__ __forceinline__ void team_sync() {
  if (kWarp) __syncwarp(); else __syncthreads();
}

// The team of a row in shared memory: a warp (warp mode) or the CTA (block mode).
template <bool kWarp>
__device__ __forceinline__ auto team_combine(double* red_d, float* red_f) {
  if constexpr (kWarp) return WarpCombine{};
  else return BlockCombine{red_d, red_f};
}
template <bool kWarp>
using TeamRow = StridedRow<decltype(team_combine<kWarp>(nullptr, nullptr))>;

// Pointwise math on 4 values with the op a compile-time constant: apply_unary/apply_binary
// (executors/common/pointwise.h, the CPU executor's math) fold to straight-line code, and the
// runtime dispatch below happens once per 4 elements instead of once per element.
template <OpCode kOp>
__device__ __forceinline__ void unary4(float (&v)[4], const PointwiseParams& pp) {
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = apply_unary(kOp, v[j], pp);
}
template <OpCode kOp>
__device__ __forceinline__ void binary4(float (&v)[4], const float (&b)[4], bool rev) {
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = apply_binary(kOp, v[j], b[j], rev);
}

// The table's unary and binary rows (op_table.h). The host checks every pointwise
// instruction's op against the table when it builds a program (row_program.cu), so no other
// op reaches these switches.
__device__ __forceinline__ void apply_unary4(OpCode op, float (&v)[4], const PointwiseParams& pp) {
  switch (op) {
#define GF_UNARY(code, name, fam, scalar) \
  case OpCode::code: unary4<OpCode::code>(v, pp); break;
    GEMMFUSE_UNARY_OPS(GF_UNARY)
#undef GF_UNARY
    default: __builtin_unreachable();
  }
}

__device__ __forceinline__ void apply_binary4(OpCode op, float (&v)[4], const float (&b)[4],
                                              bool rev) {
  switch (op) {
#define GF_BINARY(code, name, fam, scalar) \
  case OpCode::code: binary4<OpCode::code>(v, b, rev); break;
    GEMMFUSE_BINARY_OPS(GF_BINARY)
#undef GF_BINARY
    default: __builtin_unreachable();
  }
}

// The binary operand for the `cnt` (1..4) columns c0.. of row r.
__device__ __forceinline__ void load_operand4(const DevInstr& in, int64_t r, int c0, int cnt,
                                              float (&b)[4]) {
  float s = 0.f;
  switch (in.opnd) {
    case kOpImm: s = in.imm; break;
    case kOpScalar: s = in.b[0]; break;
    case kOpRow: s = in.b[r]; break;
    case kOpCol:
    case kOpFull: {
      const float* p = in.b + c0 + (in.opnd == kOpFull ? r * static_cast<int64_t>(in.win) : 0);
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = j < cnt ? p[j] : 0.f;
      return;
    }
    case kOpNone: break;  // a binary instruction has an operand (lower_binary_operand)
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) b[j] = s;
}

// Apply one elementwise instruction to the `cnt` (1..4) columns c0.. of row r (values past
// cnt are computed on and never stored).
__device__ __forceinline__ void apply_elementwise(const DevInstr& in, float (&v)[4], int cnt,
                                                  int64_t r, int c0) {
  switch (in.kind) {
    case kPointwise: {
      const OpCode op = static_cast<OpCode>(in.op);
      if (in.flags & kFlagBinary) {
        float b[4];
        load_operand4(in, r, c0, cnt, b);
        apply_binary4(op, v, b, (in.flags & kFlagReversed) != 0);
      } else {
        apply_unary4(op, v, in.pp);
      }
      break;
    }
    case kBnApply: {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (j < cnt) v[j] = BatchNormOp::apply(v[j], in.p0, in.win, in.p1, in.p2, c0 + j);
      }
      break;
    }
    case kSave: {
      float* dst = in.save + r * static_cast<int64_t>(in.win) + c0;
      if ((in.flags & kFlagVec) && cnt == 4) {
        *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (j < cnt) dst[j] = v[j];
      }
      break;
    }
    case kReduce:
    case kSoftmax:
    case kGroupNorm:
    case kPool:
      break;  // row instructions: the kernels pass elementwise ones only
  }
}

// Four values rounded to a 16-bit type (bf16 or fp16): one 8-byte store when `vec`, else
// the first `cnt` one by one.
__device__ __forceinline__ __nv_bfloat162 pack2(__nv_bfloat16*, float a, float b) {
  return __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ __half2 pack2(__half*, float a, float b) { return __floats2half2_rn(a, b); }
__device__ __forceinline__ __nv_bfloat16 round16(__nv_bfloat16*, float a) { return __float2bfloat16_rn(a); }
__device__ __forceinline__ __half round16(__half*, float a) { return __float2half_rn(a); }

template <class T>
__device__ __forceinline__ void store4_16bit(T* dst, const float (&v)[4], int cnt, bool vec) {
  if (vec) {
    auto a = pack2(dst, v[0], v[1]), b = pack2(dst, v[2], v[3]);
    uint2 u;
    u.x = *reinterpret_cast<uint32_t*>(&a);
    u.y = *reinterpret_cast<uint32_t*>(&b);
    *reinterpret_cast<uint2*>(dst) = u;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (j < cnt) dst[j] = round16(dst, v[j]);
  }
}

__device__ __forceinline__ void store_out(const DevProgram& P, int64_t r, int c0, int cnt,
                                          const float (&v)[4]) {
  const int64_t at = r * static_cast<int64_t>(P.wout) + c0;
  const bool vec = P.out_vec && cnt == 4;
  if (P.out_type == kOutF32) {
    float* dst = static_cast<float*>(P.out) + at;
    if (vec) {
      *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (j < cnt) dst[j] = v[j];
    }
  } else if (P.out_type == kOutBF16) {
    store4_16bit(static_cast<__nv_bfloat16*>(P.out) + at, v, cnt, vec);
  } else {
    store4_16bit(static_cast<__half*>(P.out) + at, v, cnt, vec);
  }
}

}  // namespace
}  // namespace gemmfuse::cuda
