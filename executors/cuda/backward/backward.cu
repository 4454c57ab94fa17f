// The CUDA executor's backward (backward.h): the row backward by segments (row_backward.cu),
// the column sums of operand and BatchNorm gradients, then db = Σ_rows dV, and dx = dV W and
// dW = dVᵀ x in the chain's precision, on the kernels the Selection chose (selection.h's
// BackwardChoice): fp32 dW on the f16x3 kernel where its cost rule takes the shape
// (dW = dVᵀ (xᵀ)ᵀ: both operands transposed so that M is their reduced dimension, then split
// as the forward splits x and W), fp32 dx on it too (dV split by rows as x is, W split by
// columns and read MN-major where it lies, its parts in the weight scratch), else cuBLAS
// (fp32: SGEMM, no TF32; `tf32`: TF32; 16-bit models: their own type with fp32
// accumulation). Stream-ordered, no host sync.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <vector>

#include "blas_handles.h"
#include "cuda_check.h"
#include "cuda_executor.h"
#include "fp32_gemm_f16x3.h"
#include "gemm_f16x3.h"
#include "plan_state.h"
#include "row_backward.h"

namespace gemmfuse {
namespace cuda {
namespace {

// The scratch of one backward, laid out once per call in the order below (256-byte aligned).
struct BackwardLayout {
  size_t total = 0;
  size_t dv = 0, dv16 = 0, g = 0;
  std::map<int, size_t> vals, acc, bn_g, bn_gx, bn_sums, eval_stats, sinks;
  std::map<int, int64_t> sink_cols;  // operand index -> sink columns (1: a Scalar's row sums)
  size_t gemv_row = 0;
  // dW on the f16x3 kernel (the Selection's): after the row backward, over its scratch.
  bool dw_f16x3 = false;
  size_t dvt = 0, xt = 0, x_parts = 0, x_exps = 0, x_flags = 0, x_tiny = 0, w_parts = 0,
         w_exps = 0, w_flags = 0, w_list = 0, gemm_ws = 0, gemm_ws_bytes = 0;
  // dx on the f16x3 kernel (the Selection's): after dW, over the same scratch; W's column
  // split's parts in the weight scratch (CudaExecutor::backward_weight_bytes). With dV's
  // second level (softmax-like gradients hold many values ~2^-30 below their row's largest).
  bool dx_f16x3 = false;
  size_t dv_parts = 0, dv_exps = 0, dv_flags = 0, dv_tiny = 0, wc_exps = 0, wc_flags = 0, wc_list = 0,
         wc_stats = 0, dx_ws = 0, dx_ws_bytes = 0, second_rows = 0, slot_row = 0, slot_tiny = 0,
         slot_exps = 0, slot_parts = 0, slot_y = 0;

  size_t add(size_t bytes) {
    const size_t at = total;
    total += (bytes + 255) / 256 * 256;
    return at;
  }

  int64_t slots = 0;  // the row backward's CTAs: vals, g and sinks hold a row per slot

  BackwardLayout(const Plan& plan, const BackwardPlan& bp, const BackwardChoice& choice) {
    const Chain& ch = plan.chain;
    const int n = static_cast<int>(ch.nodes.size());
    const int64_t M = plan.M, wv = ch.row_width(bp.start);
    slots = choice.slots;
    const int64_t S = slots;
    int64_t wmax = wv;
    dv = add(4 * M * wv);
    if (plan.dtype != DType::F32) dv16 = add(2 * M * wv);
    const size_t scratch = total;  // the row backward's buffers, then dW's over them
    for (int j = bp.start + 1; j <= n; ++j) {
      vals[j] = add(4 * S * ch.row_width(j));
      wmax = std::max(wmax, ch.row_width(j));
    }
    g = add(4 * 2 * S * wmax);
    for (int i = bp.start; i < n; ++i) {
      const Node& nd = ch.nodes[i];
      const Instr& in = bp.program[i - bp.start];
      if (family(nd.op) == OpFamily::Binary && nd.b.kind == Operand::Kind::Value && !acc.count(nd.b.index))
        acc[nd.b.index] = add(4 * M * ch.row_width(nd.b.index));
      auto sink = [&](int index, int64_t cols) {
        if (index >= 0 && !sinks.count(index)) {
          sinks[index] = add(4 * S * cols);
          sink_cols[index] = cols;
        }
      };
      if (in.kind == Instr::Kind::Pointwise && in.b.kind == OperandRef::Kind::Col) sink(in.b.index, in.width_in);
      if (in.kind == Instr::Kind::Pointwise && in.b.kind == OperandRef::Kind::Scalar) sink(in.b.index, 1);
      const bool eval_bn = in.kind == Instr::Kind::BatchNormApply &&
                           !bp.saved.batch_stats.count(i);
      if (in.kind == Instr::Kind::GroupNorm || eval_bn) {
        if (in.weight.kind == OperandRef::Kind::Col) sink(in.weight.index, in.width_in);
        if (in.bias.kind == OperandRef::Kind::Col) sink(in.bias.index, in.width_in);
      }
      if (eval_bn) eval_stats[i] = add(4 * 3 * in.width_in);
    }
    for (int b : bp.batch_norms) {
      const int64_t w = ch.row_width(b);
      bn_g[b] = add(4 * M * w);
      bn_gx[b] = add(4 * M * w);
      bn_sums[b] = add(4 * 2 * w);
    }
    if (bp.gemv) gemv_row = add(4 * plan.K);
    const size_t row_end = total;
    dw_f16x3 = choice.dw == GemmKind::F16x3;
    if (dw_f16x3) {
      const int64_t N = plan.N, K = plan.K;
      total = scratch;
      dvt = add(4 * N * M);
      xt = add(4 * K * M);
      x_parts = add(2 * 2 * N * M);
      x_exps = add(4 * N);
      x_flags = add(4 * N);
      x_tiny = add(4 * N);
      w_parts = add(2 * 2 * K * M);
      w_exps = add(4 * K);
      w_flags = add(4 * K);
      w_list = add(4 * (1 + K));
      gemm_ws_bytes = sm90::f16x3_workspace_bytes(N, K, M, false, choice.dw_splits);
      gemm_ws = add(gemm_ws_bytes);
    }
    const size_t dw_end = total;
    dx_f16x3 = choice.dx == GemmKind::F16x3;
    if (dx_f16x3) {
      const int64_t N = plan.N, K = plan.K;
      total = scratch;
      dv_parts = add(std::max(2 * 2 * M * N, 4 * M * K));  // the slots' products (slot_y) after
      slot_y = dv_parts;                                     // the parts are read
      dv_exps = add(4 * M);
      dv_flags = add(4 * M);
      dv_tiny = add(4 * M);
      wc_exps = add(4 * K);
      wc_flags = add(4 * K);
      wc_list = add(4 * (1 + K));
      wc_stats = add(split_f16x2_columns_scratch_bytes(K));
      second_rows = add(4);
      slot_row = add(4 * M);
      slot_tiny = add(4 * M);
      slot_exps = add(4 * M);
      slot_parts = add(2 * 2 * M * N);
      dx_ws_bytes = sm90::f16x3_workspace_bytes(M, K, N, /*w_mn_major=*/true, choice.dx_splits);
      dx_ws = add(dx_ws_bytes);
    }
    total = std::max({total, dw_end, row_end});
  }
};

// dW[N, K] = dVᵀ x on the f16x3 kernel: dVᵀ [N, M] and xᵀ [K, M] transposed by cuBLAS, xᵀ split
// as the forward splits W (its rows marked for the fix-up's column recompute), dVᵀ as x;
// no second level (rows with many tiny values are recomputed by the fix-up instead).
void dw_on_f16x3(const Plan& plan, const BackwardLayout& L, int splits, char* ws, const float* dv,
                 const float* x, float* gw, cublasHandle_t h, cudaStream_t stream) {
  const int64_t M = plan.M, N = plan.N, K = plan.K;
  auto f32 = [&](size_t off) { return reinterpret_cast<float*>(ws + off); };
  auto i32 = [&](size_t off) { return reinterpret_cast<int*>(ws + off); };
  auto f16 = [&](size_t off) { return reinterpret_cast<__half*>(ws + off); };
  const float one = 1.f, zero = 0.f;
  // Row-major A [r, c] is column-major [c, r]: C = Aᵀ (column-major [r, c], ld r) is row-major Aᵀ.
  GF_CUBLAS_CHECK(cublasSgeam(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(M), static_cast<int>(N), &one, dv,
                              static_cast<int>(N), &zero, f32(L.dvt), static_cast<int>(M), f32(L.dvt),
                              static_cast<int>(M)));
  GF_CUBLAS_CHECK(cublasSgeam(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(M), static_cast<int>(K), &one, x,
                              static_cast<int>(K), &zero, f32(L.xt), static_cast<int>(M), f32(L.xt),
                              static_cast<int>(M)));
  GF_CUDA_CHECK(cudaMemsetAsync(i32(L.w_list), 0, sizeof(int), stream));
  launch_split_f16x2(f32(L.xt), K, M, f16(L.w_parts), f32(L.w_exps), RowMarks{i32(L.w_flags), i32(L.w_list)},
                     stream);
  Fp32GemmF16x3 g;
  g.M = N;
  g.N = K;
  g.K = M;
  g.x = f32(L.dvt);
  g.w = f32(L.xt);
  g.w_parts = f16(L.w_parts);
  g.w_exps = f32(L.w_exps);
  g.w_list = i32(L.w_list);
  g.w_flags = i32(L.w_flags);
  g.y = gw;
  g.scratch.x_parts = f16(L.x_parts);
  g.scratch.x_exps = f32(L.x_exps);
  g.scratch.x_flags = i32(L.x_flags);
  g.scratch.x_tiny = i32(L.x_tiny);
  g.gemm_workspace = ws + L.gemm_ws;
  g.gemm_workspace_bytes = L.gemm_ws_bytes;
  g.splits = splits;
  launch_fp32_gemm_f16x3(g, stream);
}

// dx[M, K] = dV W on the f16x3 kernel: dV split by rows as the forward's x (with its second
// level), W [N, K] by columns (its parts into `w_parts`: N K fp16 pairs) and read MN-major.
void dx_on_f16x3(const Plan& plan, const BackwardLayout& L, int splits, char* ws, void* w_parts,
                 const float* dv, const float* w, float* gx, cudaStream_t stream) {
  const int64_t M = plan.M, N = plan.N, K = plan.K;
  auto f32 = [&](size_t off) { return reinterpret_cast<float*>(ws + off); };
  auto i32 = [&](size_t off) { return reinterpret_cast<int*>(ws + off); };
  auto f16 = [&](size_t off) { return reinterpret_cast<__half*>(ws + off); };
  GF_CUDA_CHECK(cudaMemsetAsync(i32(L.wc_list), 0, sizeof(int), stream));
  launch_split_f16x2_columns(w, N, K, static_cast<__half*>(w_parts), f32(L.wc_exps),
                             RowMarks{i32(L.wc_flags), i32(L.wc_list)}, ws + L.wc_stats, stream);
  Fp32GemmF16x3 g;
  g.M = M;
  g.N = K;
  g.K = N;
  g.x = dv;
  g.w = w;
  g.w_parts = static_cast<const __half*>(w_parts);
  g.w_exps = f32(L.wc_exps);
  g.w_list = i32(L.wc_list);
  g.w_flags = i32(L.wc_flags);
  g.w_transposed = true;
  g.y = gx;
  g.scratch.x_parts = f16(L.dv_parts);
  g.scratch.x_exps = f32(L.dv_exps);
  g.scratch.x_flags = i32(L.dv_flags);
  g.scratch.x_tiny = i32(L.dv_tiny);
  g.scratch.second.rows = i32(L.second_rows);
  g.scratch.second.slot_row = i32(L.slot_row);
  g.scratch.second.slot_tiny = i32(L.slot_tiny);
  g.scratch.second.exps = f32(L.slot_exps);
  g.scratch.second.parts = f16(L.slot_parts);
  g.scratch.second.y = f32(L.slot_y);
  g.gemm_workspace = ws + L.dx_ws;
  g.gemm_workspace_bytes = L.dx_ws_bytes;
  g.splits = splits;
  launch_fp32_gemm_f16x3(g, stream);
}

__global__ void running_to_stats_kernel(const float* rm, const float* rv, int64_t w, float eps,
                                        float* stats) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= w) return;
  stats[c] = rm[c];
  stats[w + c] = static_cast<float>(1.0 / sqrt(static_cast<double>(rv[c]) + eps));
  stats[2 * w + c] = rv[c];
}

template <typename T>
__global__ void to_16bit_kernel(const float* in, int64_t n, T* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = static_cast<T>(in[i]);
}

// The GEMV's backward: dx[m, k] = s dv[m] colsum(W)[k]; row[k] = s sum_m dv[m] x[m, k];
// dW[n, k] = row[k]; db[n] = s sum(dv).
__global__ void gemv_dx_kernel(const float* dv, const float* colsum, int64_t M, int64_t K,
                               float s, float* dx) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < M * K) dx[i] = s * dv[i / K] * colsum[i % K];
}
__global__ void gemv_row_kernel(const float* dv, const float* x, int64_t M, int64_t K, float s,
                                float* row) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= K) return;
  float t = 0.f;
  for (int64_t m = 0; m < M; ++m) t += dv[m] * x[m * K + k];
  row[k] = s * t;
}
__global__ void broadcast_rows_kernel(const float* row, int64_t N, int64_t K, float* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < N * K) out[i] = row[i % K];
}

unsigned blocks(int64_t n) { return static_cast<unsigned>((n + 255) / 256); }

}  // namespace
}  // namespace cuda

std::string CudaExecutor::describe_backward(const Plan& plan, const BackwardPlan& bp) {
  check(plan);
  return cuda::plan_state(plan, &bp)->sel.describe_backward();
}

size_t CudaExecutor::backward_workspace_bytes(const Plan& plan, const BackwardPlan& bp) const {
  return cuda::BackwardLayout(plan, bp, cuda::plan_state(plan, &bp)->sel.backward).total;
}

size_t CudaExecutor::backward_weight_bytes(const Plan& plan, const BackwardPlan& bp) const {
  return cuda::plan_state(plan, &bp)->sel.backward.dx == cuda::GemmKind::F16x3 ? size_t(4) * plan.N * plan.K
                                                                                : 0;
}

void CudaExecutor::backward(const Plan& plan, const BackwardPlan& bp, const BackwardArgs& a) {
  using namespace cuda;
  const cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  const Chain& ch = plan.chain;
  const int n = static_cast<int>(ch.nodes.size());
  const int64_t M = plan.M, N = plan.N, K = plan.K;
  const auto st = plan_state(plan, &bp);
  const BackwardChoice& choice = st->sel.backward;
  const BackwardLayout L(plan, bp, choice);
  char* ws = static_cast<char*>(a.workspace);
  if (L.total > 0 && ws == nullptr) throw std::invalid_argument("gemmfuse: no backward workspace");
  auto at = [&](size_t off) { return reinterpret_cast<float*>(ws + off); };
  for (size_t t = 0; t < a.grad_operands.size(); ++t)
    if (a.grad_operands[t])
      GF_CUDA_CHECK(cudaMemsetAsync(a.grad_operands[t], 0, 4 * a.operand_numel[t], stream));
  const int64_t wv = ch.row_width(bp.start);
  float* dv = at(L.dv);

  if (choice.rows == RowBackwardMode::CopyGradient && M > 0) {
    GF_CUDA_CHECK(cudaMemcpyAsync(dv, a.grad_out, 4 * M * wv, cudaMemcpyDeviceToDevice, stream));
  } else if (choice.rows == RowBackwardMode::Segments) {
    for (const auto& [j, off] : L.acc)
      GF_CUDA_CHECK(cudaMemsetAsync(at(off), 0, 4 * M * ch.row_width(j), stream));
    for (const auto& [t, off] : L.sinks)
      GF_CUDA_CHECK(cudaMemsetAsync(at(off), 0, 4 * L.slots * L.sink_cols.at(t), stream));
    // The instructions, shared by every segment.
    std::vector<BwInstr> ins(n - bp.start);
    for (int i = bp.start; i < n; ++i) {
      const Instr& in = bp.program[i - bp.start];
      const Node& nd = in.node;
      BwInstr& d = ins[i - bp.start];
      d.op = static_cast<uint8_t>(nd.op);
      d.pp = pointwise_params(nd);
      d.win = static_cast<int32_t>(in.width_in);
      d.wout = static_cast<int32_t>(in.width_out);
      d.eps = static_cast<float>(nd.eps);
      auto operand = [&](const OperandRef& o) {
        return o.kind == OperandRef::Kind::None ? nullptr : a.operands.at(o.index);
      };
      auto sink = [&](const OperandRef& o) -> float* {
        if (o.kind == OperandRef::Kind::None || !a.grad_operands.at(o.index)) return nullptr;
        auto it = L.sinks.find(o.index);
        return it != L.sinks.end() ? at(it->second) : a.grad_operands[o.index];
      };
      switch (in.kind) {
        case Instr::Kind::Pointwise:
          d.kind = kBwPointwise;
          if (family(nd.op) != OpFamily::Binary) break;
          d.flags |= kBwBinary | (nd.reversed ? kBwReversed : 0);
          if (nd.b.kind == Operand::Kind::Value) {
            d.opnd = kBwValue;
            d.value = nd.b.index - bp.start;
            if (d.value < 0) throw Unsupported("CUDA backward: a stage reads a value before the GEMM's");
            break;
          }
          switch (in.b.kind) {
            case OperandRef::Kind::Imm: d.opnd = kBwImm; d.imm = in.b.imm; break;
            case OperandRef::Kind::Scalar: d.opnd = kBwScalar; break;
            case OperandRef::Kind::Col: d.opnd = kBwCol; break;
            case OperandRef::Kind::Row: d.opnd = kBwRow; break;
            case OperandRef::Kind::Full: d.opnd = kBwFull; break;
            default: throw Unsupported("CUDA backward: operand kind");
          }
          if (d.opnd != kBwImm) {
            d.b = operand(in.b);
            d.b_grad = sink(in.b);
          }
          break;
        case Instr::Kind::Reduce:
          d.kind = kBwReduce;
          if (nd.first_index) d.flags |= kBwFirstIndex;
          break;
        case Instr::Kind::Softmax: d.kind = kBwSoftmax; break;
        case Instr::Kind::GroupNorm:
          d.kind = kBwGroupNorm;
          d.groups = static_cast<int32_t>(nd.groups);
          d.weight = operand(in.weight);
          d.bias = operand(in.bias);
          d.weight_grad = sink(in.weight);
          d.bias_grad = sink(in.bias);
          break;
        case Instr::Kind::Pool:
          d.kind = kBwPool;
          d.kernel = static_cast<int32_t>(nd.kernel);
          d.stride = static_cast<int32_t>(nd.stride);
          d.padding = static_cast<int32_t>(nd.padding);
          if (nd.ceil_mode) d.flags |= kBwCeil;
          if (nd.count_include_pad) d.flags |= kBwIncludePad;
          break;
        case Instr::Kind::BatchNormApply: {
          d.kind = kBwBatchNorm;
          d.weight = operand(in.weight);
          d.bias = operand(in.bias);
          auto it = bp.saved.batch_stats.find(i);
          if (it != bp.saved.batch_stats.end()) {
            d.flags |= kBwBatchStats;
            d.stats = a.saved + it->second;
          } else {  // eval: the running statistics as [3, w]
            const float* rm = static_cast<const float*>(a.state.at(nd.running_mean.index));
            const float* rv = static_cast<const float*>(a.state.at(nd.running_var.index));
            float* st = at(L.eval_stats.at(i));
            running_to_stats_kernel<<<blocks(in.width_in), 256, 0, stream>>>(rm, rv, in.width_in,
                                                                            static_cast<float>(nd.eps), st);
            GF_LAUNCH_CHECK();
            d.stats = st;
            d.weight_grad = sink(in.weight);
            d.bias_grad = sink(in.bias);
          }
          break;
        }
        case Instr::Kind::Save: throw std::logic_error("CUDA backward: a Save among the stages");
      }
    }
    // The segments, top down (cut at batch-statistics BatchNorms).
    auto segment = [&](int lo, int hi) {
      BwSegment s;
      s.n = hi - bp.start;
      s.lo = lo - bp.start;
      if (s.n + 1 > kMaxBackwardInstrs) throw Unsupported("CUDA backward: the chain is too long");
      for (int i = 0; i < s.n; ++i) s.ins[i] = ins[i];
      s.M = M;
      s.slots = L.slots;
      s.v0 = a.saved + bp.saved.v;
      s.w0 = static_cast<int32_t>(wv);
      s.vals = reinterpret_cast<float*>(ws);
      for (int j = bp.start + 1; j <= hi; ++j) s.val_off[j - bp.start] = static_cast<int64_t>(L.vals.at(j) / 4);
      for (const auto& [j, off] : L.acc)
        if (j - bp.start <= s.n) s.acc[j - bp.start] = at(off);
      int64_t wmax = wv;  // the g rows' pitch, as BackwardLayout sized them
      for (int j = bp.start + 1; j <= n; ++j) wmax = std::max(wmax, ch.row_width(j));
      s.w_max = static_cast<int32_t>(wmax);
      s.g_scratch = at(L.g);
      if (hi == n) {
        s.g_top = static_cast<const float*>(a.grad_out);
      } else {  // hi is a batch-statistics BatchNorm
        s.bn_top = s.n;
        s.ins[s.n] = ins[hi - bp.start];
        s.g_top = at(L.bn_g.at(hi));
        s.bn_sum_g = at(L.bn_sums.at(hi));
        s.bn_sum_gx = s.bn_sum_g + ch.row_width(hi);
      }
      if (lo > bp.start) {
        const int b = lo - 1;
        s.bn_below = b - bp.start;
        s.out = at(L.bn_g.at(b));
        s.out_gx = at(L.bn_gx.at(b));
      } else {
        s.out = dv;
      }
      plan_pointwise_runs(s);
      launch_row_backward(s, stream);
      if (lo > bp.start) {  // the column sums the segment below needs, and the affine grads
        const int b = lo - 1;
        const int64_t w = ch.row_width(b);
        float* sums = at(L.bn_sums.at(b));
        launch_column_sums(at(L.bn_g.at(b)), M, w, sums, 1.f, false, stream);
        launch_column_sums(at(L.bn_gx.at(b)), M, w, sums + w, 1.f, false, stream);
        const Instr& in = bp.program[b - bp.start];
        auto add_to = [&](const OperandRef& o, const float* src) {  // gamma: sum g x-hat; beta: sum g
          if (o.kind == OperandRef::Kind::Col && a.grad_operands.at(o.index))
            launch_column_sums(src, 1, w, a.grad_operands[o.index], 1.f, true, stream);
        };
        add_to(in.weight, sums + w);
        add_to(in.bias, sums);
      }
    };
    int hi = n;
    for (auto it = bp.batch_norms.rbegin(); it != bp.batch_norms.rend(); ++it) {
      segment(*it + 1, hi);
      hi = *it;
    }
    segment(bp.start, hi);
    // Operand sinks: sums over the rows (the batch BatchNorms' affine grads were added above,
    // into gradients these do not touch).
    for (const auto& [t, off] : L.sinks)
      if (a.grad_operands.at(t))
        launch_column_sums(at(off), L.slots, L.sink_cols.at(t), a.grad_operands[t], 1.f, true, stream);
  }

  float* gx = static_cast<float*>(a.grad_x);
  float* gw = static_cast<float*>(a.grad_w);
  float* gb = static_cast<float*>(a.grad_b);
  if (choice.dw == GemmKind::Gemv) {  // the GEMV's backward
    const float s = static_cast<float>(bp.gemv_scale);
    const float* x = static_cast<const float*>(a.x);
    const float* w = static_cast<const float*>(a.weight);
    float* row = at(L.gemv_row);
    if (gx) {
      launch_column_sums(w, N, K, row, 1.f, false, stream);  // colsum(W)
      gemv_dx_kernel<<<blocks(M * K), 256, 0, stream>>>(dv, row, M, K, s, gx);
      GF_LAUNCH_CHECK();
    }
    if (gw) {
      gemv_row_kernel<<<blocks(K), 256, 0, stream>>>(dv, x, M, K, s, row);
      GF_LAUNCH_CHECK();
      broadcast_rows_kernel<<<blocks(N * K), 256, 0, stream>>>(row, N, K, gw);
      GF_LAUNCH_CHECK();
    }
    if (gb) {
      launch_column_sums(dv, M, 1, row, s, false, stream);
      broadcast_rows_kernel<<<blocks(N), 256, 0, stream>>>(row, N, 1, gb);
      GF_LAUNCH_CHECK();
    }
    return;
  }
  if (gb) launch_column_sums(dv, M, N, gb, 1.f, false, stream);
  if (!gx && !gw) return;
  if (M == 0) {
    if (gw) GF_CUDA_CHECK(cudaMemsetAsync(gw, 0, 4 * N * K, stream));
    return;
  }
  // Row-major dx[M,K] = dV[M,N] W[N,K] is column-major dxᵀ = Wᵀ dVᵀ: A = W (col-major [K,N],
  // ld K), B = dV (col-major [N,M], ld N). dW[N,K] = dVᵀ x is column-major dWᵀ = xᵀ dV:
  // A = x (col-major [K,M], ld K), B = dV transposed (stored col-major [N,M], ld N).
  cublasHandle_t h = cublas_handle(stream);
  const void* dvp = dv;
  cudaDataType_t ab = CUDA_R_32F;
  const GemmKind blas = choice.dx != GemmKind::F16x3 ? choice.dx : choice.dw;  // what cuBLAS runs
  const cublasComputeType_t compute = blas == GemmKind::Tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  if (plan.dtype != DType::F32) {  // a 16-bit model: its gradient of Y in its own type, as eager's
    ab = plan.dtype == DType::BF16 ? CUDA_R_16BF : CUDA_R_16F;
    void* d16 = ws + L.dv16;
    if (plan.dtype == DType::BF16)
      to_16bit_kernel<<<blocks(M * N), 256, 0, stream>>>(dv, M * N, static_cast<__nv_bfloat16*>(d16));
    else
      to_16bit_kernel<<<blocks(M * N), 256, 0, stream>>>(dv, M * N, static_cast<__half*>(d16));
    GF_LAUNCH_CHECK();
    dvp = d16;
  }
  if (gw && L.dw_f16x3) {
    dw_on_f16x3(plan, L, choice.dw_splits, ws, dv, static_cast<const float*>(a.x), gw, h, stream);
    gw = nullptr;
  }
  if (gx && L.dx_f16x3) {
    if (a.weight_scratch == nullptr) throw std::invalid_argument("gemmfuse: no backward weight scratch");
    dx_on_f16x3(plan, L, choice.dx_splits, ws, a.weight_scratch, dv, static_cast<const float*>(a.weight), gx,
                stream);
    gx = nullptr;
  }
  const float one = 1.f, zero = 0.f;
  if (gx)
    GF_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, K, M, N, &one, a.weight, ab, K, dvp,
                                 ab, N, &zero, gx, CUDA_R_32F, K, compute, CUBLAS_GEMM_DEFAULT));
  if (gw)
    GF_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, K, N, M, &one, a.x, ab, K, dvp, ab,
                                 N, &zero, gw, CUDA_R_32F, K, compute, CUBLAS_GEMM_DEFAULT));
}

}  // namespace gemmfuse
