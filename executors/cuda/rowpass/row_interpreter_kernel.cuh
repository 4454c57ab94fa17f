// The row-program interpreter kernel (row_program_kernel): any RowPass step. The register
// kernel (row_register_kernel.cuh) takes the steps it can; this one takes every other.
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
// Part of row_program.cu, included there once (internal linkage: anonymous namespace).
#pragma once

#include "row_device_ops.cuh"
#include "row_program_format.cuh"

namespace gemmfuse::cuda {
namespace {

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

// GroupNorm over the row's in.groups groups (GroupNormOp::forward): one warp a group (warp mode,
// or where the groups are at least the warps), else the CTA a group. (A loop per team type,
// rather than one loop over a team chosen per group, keeps the kernel without spills.)
template <bool kWarp>
__device__ __forceinline__ void group_norm_row(const DevInstr& in, float* cur, int w, int t, int nt,
                                               double* red_d) {
  const int G = in.groups, gs = w / G;
  auto run = [&](auto&& grp, int g) {
    const int c0 = g * gs;
    GroupNormOp::forward(grp, from_col(in.p1, c0), from_col(in.p2, c0), in.eps);
  };
  const int nw = nt >> 5, lane = t & 31;
  if (kWarp || G >= nw) {
    for (int g = kWarp ? 0 : t >> 5; g < G; g += kWarp ? 1 : nw)
      run(warp_group(cur + g * gs, cur + g * gs, gs, lane), g);
  } else {
    for (int g = 0; g < G; ++g) run(cta_group(cur + g * gs, cur + g * gs, gs, t, nt, red_d), g);
  }
}

// avg_pool / max_pool (PoolOp's windows) of cur's w values into oth's in.wout.
__device__ __forceinline__ void pool_row(const DevInstr& in, const float* cur, float* oth, int w,
                                         int t, int nt) {
#pragma unroll 1
  for (int o = t; o < in.wout; o += nt) oth[o] = PoolOp::forward(in.pool, cur, w, o);
}

template <bool kWarp>
__device__ __forceinline__ void barrier_instr(const DevInstr& in, int& w, float*& cur,
                                              float*& oth, int t, int nt, double* red_d,
                                              float* red_f) {
  const OpCode op = static_cast<OpCode>(in.op);
  switch (in.kind) {
    case kReduce: {  // the row's value, left in cur[0]
      TeamRow<kWarp> row{cur, cur, w, t, nt, team_combine<kWarp>(red_d, red_f)};
      const float res = reduce_forward(op, row);
      team_sync<kWarp>();
      if (t == 0) cur[0] = res;
      w = 1;
      break;
    }
    case kSoftmax: {  // in place
      TeamRow<kWarp> row{cur, cur, w, t, nt, team_combine<kWarp>(red_d, red_f)};
      softmax_forward(op, row);
      break;
    }
    case kGroupNorm: group_norm_row<kWarp>(in, cur, w, t, nt, red_d); break;
    case kPool: {
      pool_row(in, cur, oth, w, t, nt);
      float* tmp = cur;
      cur = oth;
      oth = tmp;
      w = in.wout;
      break;
    }
    case kPointwise:
    case kBnApply:
    case kSave:
      break;  // elementwise: run_row runs them in elementwise_pass
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

}  // namespace
}  // namespace gemmfuse::cuda
