// The row-program interpreter. One kernel launch per RowPass step.
//
// Work split: a "team" runs one row at a time: the whole CTA (block mode, wide rows) or one
// warp (warp mode, rows of at most kWarpModeMaxWidth; 4 rows per CTA). The current row lives in
// a row slot: capA floats for the row plus capB floats for a pool's output (the two swap on each
// pool). Slots are in dynamic shared memory, or, for rows too wide for it, in the workspace
// (row_scratch: kScratchCtas slots, the grid then strides over the rows).
//
// The program is a DevProgram passed by value (__grid_constant__: read in place from the
// parameter bank, never copied to local memory). Instructions are either elementwise
// (Pointwise, BatchNormApply, Save: no barrier needed, a thread keeps the same columns) or
// barrier instructions (Reduce, Softmax, GroupNorm, Pool). Each maximal run of elementwise
// instructions is one pass over the row, 4 consecutive columns per thread per iteration
// (16-byte loads/stores where aligned): the first pass reads the input buffer from global
// memory (or, in shared-memory mode with a barrier ahead, the row is first staged with
// cp.async), the last writes the output in its dtype, so a pure-pointwise program touches
// shared memory not at all. The op of a pointwise instruction is dispatched once per
// 4 columns onto apply_unary/apply_binary instantiated with a constant op.
// Launch shape: rows >= 1024 wide 256 threads, narrower 128; warp mode 4 rows per 128.
#include "row_program.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

namespace gemmfuse::cuda {
namespace {

enum : uint8_t { kPointwise, kReduce, kSoftmax, kGroupNorm, kPool, kBnApply, kSave };
enum : uint8_t { kOpNone, kOpImm, kOpScalar, kOpCol, kOpRow, kOpFull };
enum : uint8_t { kFlagBinary = 1, kFlagReversed = 2, kFlagIncludePad = 4, kFlagVec = 8 };
enum : uint8_t { kOutF32, kOutBF16, kOutF16 };

// One instruction, resolved against this run's pointers (88 bytes).
struct DevInstr {
  uint8_t kind, op, opnd, flags;
  int32_t win, wout;      // widths (>= 1) before and after
  int32_t i0, i1, i2;     // GroupNorm: groups; Pool: kernel, stride, padding
  float imm;              // Imm operand; eps of the norms
  PointwiseParams pp;     // unary attributes
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

// ---- device helpers ---------------------------------------------------------------------

struct SumD {
  __device__ __forceinline__ double operator()(double a, double b) const { return a + b; }
};
struct SumF {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxF {
  __device__ __forceinline__ float operator()(float a, float b) const { return nan_max(a, b); }
};
struct MinF {
  __device__ __forceinline__ float operator()(float a, float b) const { return nan_min(a, b); }
};
// The max that shifts softmax's, log_softmax's and logsumexp's exponents: fmaxf (one
// instruction, NaN dropped) where a Max reduce needs nan_max (four). Dropping NaN here is
// exact: a NaN in the row is also in the sum of exponents, so every output is NaN, as in
// PyTorch; without NaN, fmaxf and nan_max agree (+-inf included).
struct ShiftMaxF {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Softmax's 1 / sum, applied as a product: an IEEE division per element costs ~8
// instructions (reciprocal, Newton steps, range check) on a pass bound by instruction issue;
// the product is within 1.5 ulp of the quotient.
__device__ __forceinline__ float softmax_scale(double sum) {
  return __frcp_rn(static_cast<float>(sum));
}

template <bool kWarp>
__device__ __forceinline__ void team_sync() {
  if (kWarp) __syncwarp(); else __syncthreads();
}

template <class T, class Op>
__device__ __forceinline__ T warp_allreduce(T v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Every thread of the team gets the result; fixed combination order (deterministic).
template <bool kWarp, class T, class Op>
__device__ __forceinline__ T team_allreduce(T v, Op op, T* red) {
  v = warp_allreduce(v, op);
  if (kWarp) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T r = red[0];
  for (int i = 1; i < nw; ++i) r = op(r, red[i]);
  __syncthreads();  // red[] may be reused right away
  return r;
}

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

__device__ __forceinline__ void apply_unary4(OpCode op, float (&v)[4], const PointwiseParams& pp) {
#define GF_UNARY(name) \
  case OpCode::name: unary4<OpCode::name>(v, pp); break;
  switch (op) {
    GF_UNARY(Neg) GF_UNARY(Abs) GF_UNARY(Square) GF_UNARY(Sqrt) GF_UNARY(Rsqrt) GF_UNARY(Exp)
    GF_UNARY(Log) GF_UNARY(Relu) GF_UNARY(Sigmoid) GF_UNARY(Tanh) GF_UNARY(Silu) GF_UNARY(Mish)
    GF_UNARY(GeluErf) GF_UNARY(GeluTanh) GF_UNARY(Softplus) GF_UNARY(Elu) GF_UNARY(LeakyRelu)
    GF_UNARY(Clamp) GF_UNARY(Pow) GF_UNARY(Reciprocal)
    default: break;  // identity (dropout in eval mode)
  }
#undef GF_UNARY
}

__device__ __forceinline__ void apply_binary4(OpCode op, float (&v)[4], const float (&b)[4],
                                              bool rev) {
#define GF_BINARY(name) \
  case OpCode::name: binary4<OpCode::name>(v, b, rev); break;
  switch (op) {
    GF_BINARY(Add) GF_BINARY(Sub) GF_BINARY(Mul) GF_BINARY(Div) GF_BINARY(Minimum)
    GF_BINARY(Maximum)
    default: break;
  }
#undef GF_BINARY
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
    default: break;
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
        if (j < cnt) {
          const int c = c0 + j;
          float y = (v[j] - in.p0[c]) * in.p0[in.win + c];
          if (in.p1) y *= in.p1[c];
          if (in.p2) y += in.p2[c];
          v[j] = y;
        }
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
    default: break;
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

// One pass of the elementwise instructions [pc, e) over the row: source is the input buffer
// (from_global) or the row slot, destination the output (to_global) or the row slot.
__device__ __forceinline__ void elementwise_pass(const DevProgram& P, int pc, int e, int64_t r,
                                                 int w, bool from_global, bool to_global,
                                                 float* cur, int t, int nt) {
  for (int c0 = 4 * t; c0 < w; c0 += 4 * nt) {
    const int cnt = min(4, w - c0);
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (from_global) {
      const float* src = P.in + r * static_cast<int64_t>(P.win) + c0;
      if (P.in_vec && cnt == 4) {
        const float4 q = *reinterpret_cast<const float4*>(src);
        v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (j < cnt) v[j] = src[j];
      }
    } else if (cnt == 4) {
      const float4 q = *reinterpret_cast<const float4*>(cur + c0);
      v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (j < cnt) v[j] = cur[c0 + j];
    }
    for (int i = pc; i < e; ++i) apply_elementwise(P.ins[i], v, cnt, r, c0);
    if (to_global) {
      store_out(P, r, c0, cnt, v);
    } else if (cnt == 4) {
      *reinterpret_cast<float4*>(cur + c0) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (j < cnt) cur[c0 + j] = v[j];
    }
  }
}

// Mean and biased variance of the group x[0, n) (two passes), normalise, apply the affine.
// kBlock: the whole CTA is the team, sums in fp64 (large groups). Otherwise one warp (lane t
// of 32) takes the group with fp32 sums and shuffles: a group per warp is the many-small-groups
// case (m94: 256 groups of 32), where the fp64 version spent most of the row pass's time.
template <bool kBlock>
__device__ __forceinline__ void group_norm_group(float* x, int n, float inv_n, const float* wt,
                                                 const float* bs, int cbase, float eps, int t,
                                                 int nt, double* red) {
  float meanf, rstd;
  if (kBlock) {
    double s = 0.0;
    for (int i = t; i < n; i += nt) s += x[i];
    s = team_allreduce<false>(s, SumD(), red);
    const double mean = s / n;
    double q = 0.0;
    for (int i = t; i < n; i += nt) {
      const double d = static_cast<double>(x[i]) - mean;
      q += d * d;
    }
    q = team_allreduce<false>(q, SumD(), red);
    meanf = static_cast<float>(mean);
    rstd = static_cast<float>(1.0 / sqrt(q / n + static_cast<double>(eps)));
  } else {
    float s = 0.f;
    for (int i = t; i < n; i += nt) s += x[i];
    meanf = warp_allreduce(s, SumF()) * inv_n;
    float q = 0.f;
    for (int i = t; i < n; i += nt) {
      const float d = x[i] - meanf;
      q = fmaf(d, d, q);
    }
    q = warp_allreduce(q, SumF()) * inv_n;
    rstd = 1.0f / sqrtf(q + eps);
  }
  for (int i = t; i < n; i += nt) {
    float y = (x[i] - meanf) * rstd;
    if (wt) y *= wt[cbase + i];
    if (bs) y += bs[cbase + i];
    x[i] = y;
  }
}

template <bool kWarp>
__device__ __forceinline__ void barrier_instr(const DevInstr& in, int& w, float*& cur,
                                              float*& oth, int t, int nt, double* red_d,
                                              float* red_f) {
  const OpCode op = static_cast<OpCode>(in.op);
  switch (in.kind) {
    case kReduce: {
      float res;
      if (op == OpCode::Sum || op == OpCode::Mean) {
        double s = 0.0;
        for (int i = t; i < w; i += nt) s += cur[i];
        s = team_allreduce<kWarp>(s, SumD(), red_d);
        res = op == OpCode::Sum ? static_cast<float>(s) : static_cast<float>(s / w);
      } else if (op == OpCode::Max || op == OpCode::Min) {
        const bool mx = op == OpCode::Max;
        float m = mx ? -HUGE_VALF : HUGE_VALF;
        for (int i = t; i < w; i += nt) m = mx ? nan_max(m, cur[i]) : nan_min(m, cur[i]);
        res = mx ? team_allreduce<kWarp>(m, MaxF(), red_f) : team_allreduce<kWarp>(m, MinF(), red_f);
      } else {  // LogSumExp
        float m = -HUGE_VALF;
        for (int i = t; i < w; i += nt) m = fmaxf(m, cur[i]);
        m = team_allreduce<kWarp>(m, ShiftMaxF(), red_f);
        const float sh = lse_shift(m);
        double s = 0.0;
        for (int i = t; i < w; i += nt) s += expf(cur[i] - sh);
        s = team_allreduce<kWarp>(s, SumD(), red_d);
        res = logf(static_cast<float>(s)) + sh;
      }
      team_sync<kWarp>();
      if (t == 0) cur[0] = res;
      w = 1;
      break;
    }
    case kSoftmax: {
      float m = -HUGE_VALF;
      for (int i = t; i < w; i += nt) m = fmaxf(m, cur[i]);
      m = team_allreduce<kWarp>(m, ShiftMaxF(), red_f);
      double s = 0.0;
      if (op == OpCode::Softmax) {
        for (int i = t; i < w; i += nt) {
          const float ex = expf(cur[i] - m);
          cur[i] = ex;
          s += ex;
        }
        s = team_allreduce<kWarp>(s, SumD(), red_d);
        const float inv = softmax_scale(s);
        for (int i = t; i < w; i += nt) cur[i] *= inv;
      } else {  // LogSoftmax
        for (int i = t; i < w; i += nt) s += expf(cur[i] - m);
        s = team_allreduce<kWarp>(s, SumD(), red_d);
        const float ls = logf(static_cast<float>(s));
        for (int i = t; i < w; i += nt) cur[i] = (cur[i] - m) - ls;
      }
      break;
    }
    case kGroupNorm: {
      const int G = in.i0, gs = w / G;
      const float inv_n = 1.0f / static_cast<float>(gs);
      if (kWarp) {
        for (int g = 0; g < G; ++g)
          group_norm_group<false>(cur + g * gs, gs, inv_n, in.p1, in.p2, g * gs, in.imm, t, 32,
                                  red_d);
      } else {
        const int nw = nt >> 5;
        if (G >= nw) {  // a warp per group
          const int warp = t >> 5, lane = t & 31;
          for (int g = warp; g < G; g += nw)
            group_norm_group<false>(cur + g * gs, gs, inv_n, in.p1, in.p2, g * gs, in.imm, lane,
                                    32, red_d);
        } else {  // the CTA per group
          for (int g = 0; g < G; ++g)
            group_norm_group<true>(cur + g * gs, gs, inv_n, in.p1, in.p2, g * gs, in.imm, t, nt,
                                   red_d);
        }
      }
      break;
    }
    case kPool: {
      const int K = in.i0, S = in.i1, Pd = in.i2, wo = in.wout;
      const bool avg = op == OpCode::AvgPool;
#pragma unroll 1
      for (int o = t; o < wo; o += nt) {
        const int start = o * S - Pd;
        const int end = min(start + K, w + Pd);
        const int s0 = max(start, 0), e0 = min(end, w);
        if (avg) {
          double acc = 0.0;
#pragma unroll 1
          for (int i = s0; i < e0; ++i) acc += cur[i];
          const int div = (in.flags & kFlagIncludePad) ? (end - start) : (e0 - s0);
          oth[o] = static_cast<float>(acc / div);
        } else {
          float m = -HUGE_VALF;
#pragma unroll 1
          for (int i = s0; i < e0; ++i) {
            const float x = cur[i];
            if (x > m || gf_isnan(x)) m = x;
          }
          oth[o] = m;
        }
      }
      float* tmp = cur;
      cur = oth;
      oth = tmp;
      w = wo;
      break;
    }
    default: break;
  }
  team_sync<kWarp>();
}

__device__ __forceinline__ bool is_elementwise(uint8_t kind) {
  return kind == kPointwise || kind == kBnApply || kind == kSave;
}

// 16-byte global -> shared copy that bypasses registers (sm_80+): the whole row is in flight
// at once instead of one load per thread per pass iteration.
__device__ __forceinline__ void cp_async16(float* smem_dst, const float* gmem_src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(gmem_src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// kSmem: the slot is in shared memory (the input row may then be copied in with cp.async).
template <bool kWarp, bool kSmem>
__device__ __forceinline__ void run_row(const DevProgram& P, int64_t r, float* slot, int t,
                                        int nt, double* red_d, float* red_f) {
  float* cur = slot;
  float* oth = slot + P.capA;
  int w = P.win;
  int pc = 0;
  bool loaded = false;  // the input row is in the slot already
  if (kSmem && P.in_vec) {
    int e = 0;
    while (e < P.n && is_elementwise(P.ins[e].kind)) ++e;
    if (e < P.n) {  // a barrier follows: stage the row in shared memory first
      const float* src = P.in + r * static_cast<int64_t>(P.win);
      for (int c0 = 4 * t; c0 < w; c0 += 4 * nt) cp_async16(cur + c0, src + c0);  // w % 4 == 0
      cp_async_wait_all();
      team_sync<kWarp>();
      loaded = true;
    }
  }
  for (;;) {
    int e = pc;
    while (e < P.n && is_elementwise(P.ins[e].kind)) ++e;
    const bool from_global = pc == 0 && !loaded, to_global = e == P.n;
    if ((pc == 0 && !loaded) || to_global || e > pc)
      elementwise_pass(P, pc, e, r, w, from_global, to_global, cur, t, nt);
    if (to_global) break;
    team_sync<kWarp>();
    barrier_instr<kWarp>(P.ins[e], w, cur, oth, t, nt, red_d, red_f);
    pc = e + 1;
  }
}

// kScratch: row slots in global memory (block mode only); otherwise in shared memory, which
// the compiler then addresses with LDS/STS (the slot pointer provably derives from shared).
template <bool kWarp, bool kScratch>
__global__ void __launch_bounds__(kWarp ? kWarpModeThreads : 256)
    row_program_kernel(const __grid_constant__ DevProgram P) {
  static_assert(!(kWarp && kScratch), "warp mode always fits shared memory");
  extern __shared__ float4 gf_row_smem[];
  __shared__ double red_d[32];
  __shared__ float red_f[32];
  const int team = kWarp ? static_cast<int>(threadIdx.x >> 5) : 0;
  const int t = kWarp ? static_cast<int>(threadIdx.x & 31) : static_cast<int>(threadIdx.x);
  const int nt = kWarp ? 32 : static_cast<int>(blockDim.x);
  const int64_t slot_floats = static_cast<int64_t>(P.capA) + P.capB;
  if (kScratch) {  // a slot per CTA; the grid strides over the rows
    float* slot = P.scratch + static_cast<int64_t>(blockIdx.x) * slot_floats;
    for (int64_t r = blockIdx.x; r < P.M; r += gridDim.x) {
      run_row<false, false>(P, r, slot, t, nt, red_d, red_f);
      __syncthreads();  // the slot is reused by the next row
    }
  } else if (kWarp) {  // the grid covers every row: one row per warp, no loop
    float* slot = reinterpret_cast<float*>(gf_row_smem) + team * slot_floats;
    const int64_t r = static_cast<int64_t>(blockIdx.x) * P.rows_per_cta + team;
    if (r < P.M) run_row<true, true>(P, r, slot, t, nt, red_d, red_f);
  } else {
    float* slot = reinterpret_cast<float*>(gf_row_smem);
    for (int64_t r = blockIdx.x; r < P.M; r += gridDim.x) {
      run_row<false, true>(P, r, slot, t, nt, red_d, red_f);
      __syncthreads();
    }
  }
}

// ---- register mode ------------------------------------------------------------------------
// Rows of width w (w % 4 == 0, 256 < w <= kRegMaxWidth) whose program has no Pool and whose
// GroupNorms have groups of 4q columns, q a power of two <= 32: the row never leaves
// registers. Thread t of nt holds the float4 chunks ci = k*nt + t (k < VPT) of its CTA's row:
// the row is read with one coalesced 16-byte load per chunk (all in flight at once, streaming
// cache hint), every instruction is applied in registers, and the row is stored once.
// Barriers: one per team-wide reduction (softmax 2, logsumexp 2, sum/max 1); a GroupNorm has
// none: a group is q consecutive lanes of one warp (chunk ci belongs to group ci / q and nt is a
// multiple of 32), its sums are segmented butterfly shuffles (bitwise equal in every lane).
// After a Reduce the row is one value held by every thread; thread 0 finishes it.

// Every thread gets the reduction of v over the CTA, combined in a fixed order
// (deterministic). red: two slots of 32 used alternately (`parity`), so no trailing barrier
// is needed: a slot is rewritten two reductions later, after a barrier every thread reached
// only once it had read the slot.
template <class T, class Op>
__device__ __forceinline__ T cta_allreduce2(T v, Op op, T* red, int& parity) {
  v = warp_allreduce(v, op);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  T* slot = red + 32 * parity;
  if (lane == 0) slot[warp] = v;
  __syncthreads();
  T r = slot[0];
  for (int i = 1; i < nw; ++i) r = op(r, slot[i]);
  parity ^= 1;
  return r;
}

__device__ __forceinline__ void ld4(const float* p, float (&v)[4]) {
  const float4 q = *reinterpret_cast<const float4*>(p);
  v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}

// Row data is read once: streaming loads (evict-first). Per-column vectors use plain loads.
// (L1 residency hints for those vectors were tried on H100 — m84 row pass 41.5 us with, 40.5
// without — and removed: the pass is bound by bytes in flight per SM, not by L2 traffic.)
__device__ __forceinline__ void ldrow4(const float* p, float (&v)[4]) {
  const float4 q = __ldcs(reinterpret_cast<const float4*>(p));
  v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}

// v = v * weight[c..c+4) + bias[c..c+4); either vector may be absent (nullptr).
__device__ __forceinline__ void affine4(float (&v)[4], const float* weight, const float* bias,
                                        int c) {
  float a[4];
  if (weight) {
    ld4(weight + c, a);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] *= a[j];
  }
  if (bias) {
    ld4(bias + c, a);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] += a[j];
  }
}

// Segmented butterfly over q consecutive lanes (q a power of two <= 32).
__device__ __forceinline__ float seg_sum(float s, int q) {
  for (int o = 1; o < q; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// Chunk k of thread t holds row values: always when the row fills every thread's VPT chunks
// (kFull, checked at launch), else when k * nt + t < nch.
template <bool kFull>
__device__ __forceinline__ bool chunk_valid(int k, int t, int nt, int nch) {
  return kFull || k * nt + t < nch;
}

// The extremum `op` (MaxF, MinF, ShiftMaxF) of the thread's values of valid chunks, starting
// from `init` (op's identity).
template <int VPT, bool kFull, class Op>
__device__ __forceinline__ float thread_extremum(const float (&v)[VPT][4], int t, int nt, int nch,
                                                 float init, Op op) {
  float m = init;
#pragma unroll
  for (int k = 0; k < VPT; ++k)
    if (chunk_valid<kFull>(k, t, nt, nch))
#pragma unroll
      for (int j = 0; j < 4; ++j) m = op(m, v[k][j]);
  return m;
}

// Sum of the thread's values of valid chunks in fp32, pairwise (chunk (a+b)+(c+d), then a tree
// over the chunks): the terms of softmax and logsumexp sums are positive, so this costs at most
// a few ulps on the thread's share; the team-wide sum is then in fp64.
template <int VPT, bool kFull>
__device__ __forceinline__ float thread_tree_sum(const float (&e)[VPT][4], int t, int nt, int nch) {
  float acc[VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k)
    acc[k] = chunk_valid<kFull>(k, t, nt, nch) ? (e[k][0] + e[k][1]) + (e[k][2] + e[k][3]) : 0.f;
#pragma unroll
  for (int s = 1; s < VPT; s <<= 1)
#pragma unroll
    for (int k = 0; k + s < VPT; k += 2 * s) acc[k] += acc[k + s];
  return acc[0];
}

// One row per CTA (grid = M). A persistent variant that prefetched the next row with cp.async
// into shared memory while computing the current one measured slower on H100 (m94 row pass
// +13%), so the row is loaded straight into registers (streaming hint, all loads in flight);
// so did one fed by bulk copies, 3 rows in flight per CTA (+2..6 us on every seed pass). The
// pass is bound by instruction issue (ncu: IPC 1.7-2.1, 16 warp-cycles per issued instruction,
// ~60-80 instructions per element), so what helps is more warps: VPT = 4 (512 threads) is
// capped at 40 registers for 3 CTAs (48 warps) per SM instead of 2 at 59 (24 bytes of
// loop-invariant values spill to L1; m22 30.7 -> 27.5 us, m99 33.4 -> 30.8 us as bf16
// models), and fewer instructions: kFull (no per-chunk bounds) and the exponent shift's
// fmaxf took m99 `fast`'s pass from 19.8M to 17.7M warp instructions (session 22).
// Launched programmatically (programmatic_launch.h): it waits before its first load.
template <int VPT, bool kFull>
__global__ void __launch_bounds__(VPT >= 8 ? 256 : 512, VPT == 4 ? 3 : 1)
    row_register_kernel(const __grid_constant__ DevProgram P) {
  __shared__ double red_d[64];
  __shared__ float red_f[64];
  int par_d = 0, par_f = 0;
  const int t = threadIdx.x, nt = blockDim.x;
  const int64_t r = blockIdx.x;
  int w = P.win;
  const int nch = w >> 2;
  float v[VPT][4];
  wait_for_previous_grid();  // launched programmatically: the row is the previous kernel's
  {
    const float* src = P.in + r * static_cast<int64_t>(P.win);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int ci = k * nt + t;
      if (ci < nch) {
        ldrow4(src + 4 * ci, v[k]);
      } else {
        v[k][0] = v[k][1] = v[k][2] = v[k][3] = 0.f;
      }
    }
  }
  auto valid = [&](int k) { return chunk_valid<kFull>(k, t, nt, nch); };

#pragma unroll 1
  for (int pc = 0; pc < P.n; ++pc) {
    const DevInstr& in = P.ins[pc];
    if (w == 1) {  // after a Reduce (only elementwise instructions follow)
      if (t == 0) apply_elementwise(in, v[0], 1, r, 0);
      continue;
    }
    const OpCode op = static_cast<OpCode>(in.op);
    switch (in.kind) {
      case kPointwise:
        if (in.flags & kFlagBinary) {
          const bool rev = (in.flags & kFlagReversed) != 0;
          if (in.opnd == kOpCol || in.opnd == kOpFull) {
            const float* base = in.b + (in.opnd == kOpFull ? r * static_cast<int64_t>(w) : 0);
#pragma unroll
            for (int k = 0; k < VPT; ++k) {
              if (valid(k)) {
                float b[4];
                if (in.opnd == kOpFull) ldrow4(base + 4 * (k * nt + t), b);
                else ld4(base + 4 * (k * nt + t), b);
                apply_binary4(op, v[k], b, rev);
              }
            }
          } else {
            float b[4];
            load_operand4(in, r, 0, 4, b);  // one value for the row
#pragma unroll
            for (int k = 0; k < VPT; ++k) apply_binary4(op, v[k], b, rev);
          }
        } else {
#pragma unroll
          for (int k = 0; k < VPT; ++k) apply_unary4(op, v[k], in.pp);
        }
        break;
      case kBnApply:
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
          if (valid(k)) {
            const int c = 4 * (k * nt + t);
            float mu[4], is[4];
            ld4(in.p0 + c, mu);
            ld4(in.p0 + in.win + c, is);
#pragma unroll
            for (int j = 0; j < 4; ++j) v[k][j] = (v[k][j] - mu[j]) * is[j];
            affine4(v[k], in.p1, in.p2, c);
          }
        }
        break;
      case kSave:
#pragma unroll
        for (int k = 0; k < VPT; ++k)
          if (valid(k))
            *reinterpret_cast<float4*>(in.save + r * static_cast<int64_t>(w) + 4 * (k * nt + t)) =
                make_float4(v[k][0], v[k][1], v[k][2], v[k][3]);
        break;
      case kReduce: {
        float res;
        if (op == OpCode::Sum || op == OpCode::Mean) {
          double s = 0.0;
#pragma unroll
          for (int k = 0; k < VPT; ++k)
            if (valid(k))
#pragma unroll
              for (int j = 0; j < 4; ++j) s += v[k][j];
          s = cta_allreduce2(s, SumD(), red_d, par_d);
          res = op == OpCode::Sum ? static_cast<float>(s) : static_cast<float>(s / w);
        } else if (op == OpCode::Max || op == OpCode::Min) {
          res = op == OpCode::Max
                    ? cta_allreduce2(thread_extremum<VPT, kFull>(v, t, nt, nch, -HUGE_VALF, MaxF()),
                                     MaxF(), red_f, par_f)
                    : cta_allreduce2(thread_extremum<VPT, kFull>(v, t, nt, nch, HUGE_VALF, MinF()),
                                     MinF(), red_f, par_f);
        } else {  // LogSumExp
          const float m = cta_allreduce2(
              thread_extremum<VPT, kFull>(v, t, nt, nch, -HUGE_VALF, ShiftMaxF()), ShiftMaxF(),
              red_f, par_f);
          const float sh = lse_shift(m);
          // Every exp added in fp64, as the interpreter does (the row's one output value).
          double s = 0.0;
#pragma unroll
          for (int k = 0; k < VPT; ++k)
            if (valid(k))
#pragma unroll
              for (int j = 0; j < 4; ++j) s += static_cast<double>(expf(v[k][j] - sh));
          s = cta_allreduce2(s, SumD(), red_d, par_d);
          res = logf(static_cast<float>(s)) + sh;
        }
        v[0][0] = res;
        w = 1;
        break;
      }
      case kSoftmax: {
        const float m = cta_allreduce2(
            thread_extremum<VPT, kFull>(v, t, nt, nch, -HUGE_VALF, ShiftMaxF()), ShiftMaxF(), red_f,
            par_f);
        double s = 0.0;
        if (op == OpCode::Softmax) {
#pragma unroll
          for (int k = 0; k < VPT; ++k)
#pragma unroll
            for (int j = 0; j < 4; ++j) v[k][j] = expf(v[k][j] - m);
          s = cta_allreduce2(static_cast<double>(thread_tree_sum<VPT, kFull>(v, t, nt, nch)), SumD(),
                             red_d, par_d);
          const float inv = softmax_scale(s);
#pragma unroll
          for (int k = 0; k < VPT; ++k)
#pragma unroll
            for (int j = 0; j < 4; ++j) v[k][j] *= inv;
        } else {  // LogSoftmax
          float e[VPT][4];
#pragma unroll
          for (int k = 0; k < VPT; ++k)
#pragma unroll
            for (int j = 0; j < 4; ++j) e[k][j] = expf(v[k][j] - m);
          s = cta_allreduce2(static_cast<double>(thread_tree_sum<VPT, kFull>(e, t, nt, nch)), SumD(),
                             red_d, par_d);
          const float ls = logf(static_cast<float>(s));
#pragma unroll
          for (int k = 0; k < VPT; ++k)
#pragma unroll
            for (int j = 0; j < 4; ++j) v[k][j] = (v[k][j] - m) - ls;
        }
        break;
      }
      case kGroupNorm: {  // groups of 4q columns: q lanes of one warp
        const int q = (w / in.i0) >> 2;
        const float inv_n = 1.0f / static_cast<float>(4 * q);
        float mean[VPT], rstd[VPT];
#pragma unroll
        for (int k = 0; k < VPT; ++k)
          mean[k] = seg_sum((v[k][0] + v[k][1]) + (v[k][2] + v[k][3]), q) * inv_n;
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
          float s = 0.f;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float d = v[k][j] - mean[k];
            s = fmaf(d, d, s);
          }
          rstd[k] = s;
        }
#pragma unroll
        for (int k = 0; k < VPT; ++k)
          rstd[k] = 1.0f / sqrtf(seg_sum(rstd[k], q) * inv_n + in.imm);
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
          if (valid(k)) {
            const int c = 4 * (k * nt + t);
#pragma unroll
            for (int j = 0; j < 4; ++j) v[k][j] = (v[k][j] - mean[k]) * rstd[k];
            affine4(v[k], in.p1, in.p2, c);
          }
        }
        break;
      }
      default: break;
    }
  }

  if (w == 1) {
    if (t == 0) store_out(P, r, 0, 1, v[0]);
    return;
  }
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    if (valid(k)) {
      const int c = 4 * (k * nt + t);
      if (P.out_type == kOutF32) {
        __stcs(reinterpret_cast<float4*>(static_cast<float*>(P.out) + r * static_cast<int64_t>(P.wout) + c),
               make_float4(v[k][0], v[k][1], v[k][2], v[k][3]));
      } else {
        store_out(P, r, c, 4, v[k]);
      }
    }
  }
}

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
    rc.threads = rc.capA >= 1024 ? 256 : 128;  // 256 beat 512 at width 8192 on H100
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
        } else if (family(in.node.op) != OpFamily::Unary &&
                   family(in.node.op) != OpFamily::Dropout) {
          unsupported(std::string("pointwise instruction for op ") + op_name(in.node.op));
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
