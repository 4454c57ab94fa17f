// The CUDA executor against the CPU executor (the reference), on random problems with a
// fresh seed per test (printed; GEMMFUSE_SEED=<n> repeats one). Outputs, workspace and
// prepared memory are poisoned with NaN before every run, so anything a kernel fails to write
// (or reads before writing) shows up. Tests that need a GPU skip themselves without one.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_test_util.h"
#include "cuda_test_util.h"
#include "cuda_executor.h"
#include "column_stats.h"
#include "device_facts.h"
#include "gemm_softmax.h"
#include "row_program.h"
#include "row_stats_buffers.h"
#include "selection.h"
#include "split.h"

namespace {

using namespace gemmfuse;
using gftest::Case;
using gftest::StateTensor;
using gftest::DevMem;
using gftest::gpu_present;

size_t elt(DType d) { return d == DType::F32 ? 4 : 2; }

// "" where the fused GEMM + softmax kernel runs the plan on the current device, else why not.
std::string fused_softmax_unused(const Plan& plan) {
  const cuda::Selection s = cuda::select(plan, nullptr, cuda::device_facts(&plan), cuda::current_overrides());
  return s.fused.used ? "" : s.fused.reason;
}

// fp32 values -> bytes in dtype d.
std::vector<uint8_t> encode(const std::vector<float>& v, DType d) {
  std::vector<uint8_t> out(v.size() * elt(d));
  for (size_t i = 0; i < v.size(); ++i) {
    if (d == DType::F32) {
      std::memcpy(&out[i * 4], &v[i], 4);
    } else if (d == DType::BF16) {
      const __nv_bfloat16 h = __float2bfloat16(v[i]);
      std::memcpy(&out[i * 2], &h, 2);
    } else {
      const __half h = __float2half(v[i]);
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

std::vector<float> decode(const std::vector<uint8_t>& b, DType d) {
  std::vector<float> out(b.size() / elt(d));
  for (size_t i = 0; i < out.size(); ++i) {
    if (d == DType::F32) {
      std::memcpy(&out[i], &b[i * 4], 4);
    } else if (d == DType::BF16) {
      __nv_bfloat16 h;
      std::memcpy(&h, &b[i * 2], 2);
      out[i] = __bfloat162float(h);
    } else {
      __half h;
      std::memcpy(&h, &b[i * 2], 2);
      out[i] = __half2float(h);
    }
  }
  return out;
}

// Round x, W and b to the dtype so that the CPU reference sees the same inputs.
void round_inputs(Case& c, DType d) {
  if (d == DType::F32) return;
  for (auto* v : {&c.x, &c.w, &c.b}) *v = decode(encode(*v, d), d);
}

struct CudaOptions {
  DType dtype = DType::F32;
  Precision precision = Precision::FP32;
  cudaStream_t stream = nullptr;
  bool graph = false;  // capture run() into a CUDA graph and launch that
  int runs = 1;        // run() this many times (state accumulates)
  bool misalign_x = false;  // x one element past a 16-byte boundary (16-bit models)
};

struct CudaResult {
  Plan plan;
  std::vector<float> out;
  std::vector<StateTensor> state;
};

CudaResult run_cuda(const Case& c, const CudaOptions& o) {
  PlanRequest req;
  req.chain = c.chain;
  req.batch_sizes = c.batch;
  req.operand_sizes = c.operand_sizes;
  req.dtype = o.dtype;
  req.precision = o.precision;
  req.fast_min_rows = 0;  // cover the split path at every M and size
  req.fast_min_flops = 0;
  CudaResult r;
  r.plan = make_plan(req);
  const Plan& plan = r.plan;
  CudaExecutor ex;

  auto upload = [](const void* src, size_t bytes, size_t offset = 0) {
    auto m = std::make_unique<DevMem>(bytes + offset);
    if (bytes) CK(cudaMemcpy(static_cast<char*>(m->p) + offset, src, bytes, cudaMemcpyHostToDevice));
    return m;
  };
  const auto xb = encode(c.x, o.dtype), wb = encode(c.w, o.dtype), bb = encode(c.b, o.dtype);
  const size_t x_offset = o.misalign_x ? elt(o.dtype) : 0;
  auto dx = upload(xb.data(), xb.size(), x_offset);
  auto dw = upload(wb.data(), wb.size());
  auto db = upload(bb.data(), bb.size());
  std::vector<std::unique_ptr<DevMem>> dops, dstate;
  RunArgs a;
  a.x = static_cast<char*>(dx->p) + x_offset;
  a.weight = dw->p;
  a.bias = c.chain.has_bias ? db->p : nullptr;
  for (const auto& t : c.operands) {
    dops.push_back(upload(t.data(), t.size() * sizeof(float)));
    a.operands.push_back(static_cast<const float*>(dops.back()->p));
  }
  for (const auto& s : c.state) {
    if (s.is_int) dstate.push_back(upload(&s.i, sizeof(int64_t)));
    else dstate.push_back(upload(s.f.data(), s.f.size() * sizeof(float)));
    a.state.push_back(dstate.back()->p);
  }
  const size_t out_bytes = static_cast<size_t>(c.M * plan.out_width) * elt(o.dtype);
  DevMem dout(out_bytes);
  DevMem prepared(ex.prepared_bytes(plan));
  DevMem workspace(ex.workspace_bytes(plan));
  a.out = dout.p;
  a.stream = o.stream;

  ex.prepare(plan, a, prepared.bytes ? prepared.p : nullptr);
  for (int i = 0; i < o.runs; ++i) {
    if (o.graph) {
      cudaGraph_t g = nullptr;
      cudaGraphExec_t ge = nullptr;
      CK(cudaStreamBeginCapture(o.stream, cudaStreamCaptureModeGlobal));
      try {
        ex.run(plan, a, prepared.p, workspace.p);
      } catch (...) {
        cudaStreamEndCapture(o.stream, &g);
        if (g) cudaGraphDestroy(g);
        throw;
      }
      CK(cudaStreamEndCapture(o.stream, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      CK(cudaGraphLaunch(ge, o.stream));
      CK(cudaStreamSynchronize(o.stream));
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
    } else {
      ex.run(plan, a, prepared.p, workspace.p);
    }
  }
  CK(cudaStreamSynchronize(o.stream));
  CK(cudaGetLastError());

  std::vector<uint8_t> ob(out_bytes);
  CK(cudaMemcpy(ob.data(), dout.p, out_bytes, cudaMemcpyDeviceToHost));
  r.out = decode(ob, o.dtype);
  r.state = c.state;
  for (size_t i = 0; i < r.state.size(); ++i) {
    StateTensor& s = r.state[i];
    if (s.is_int) CK(cudaMemcpy(&s.i, dstate[i]->p, sizeof(int64_t), cudaMemcpyDeviceToHost));
    else CK(cudaMemcpy(s.f.data(), dstate[i]->p, s.f.size() * sizeof(float), cudaMemcpyDeviceToHost));
  }
  return r;
}

// Tolerance of a comparison against the fp32 CPU executor.
double tolerance(const CudaOptions& o) {
  if (o.dtype == DType::BF16) return 1e-2;
  if (o.dtype == DType::F16) return 2e-3;
  switch (o.precision) {
    case Precision::FP32: return 1e-5;
    case Precision::Fast: return 5e-5;
    case Precision::TF32: return 5e-3;
  }
  return 1e-5;
}

// NaN/inf pattern equal; elementwise within 20 tol (|ref| + rms(ref)); and, over at least 16
// finite values, ||got - ref|| <= tol ||ref|| (over fewer, one value's cancellation, e.g. a
// GEMV's single sum, would set the norm).
::testing::AssertionResult close_to(const std::vector<float>& got, const std::vector<float>& ref,
                                    double tol) {
  if (got.size() != ref.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << ref.size();
  double ss_ref = 0, ss_err = 0;
  size_t finite = 0;
  for (size_t i = 0; i < ref.size(); ++i)
    if (std::isfinite(ref[i])) {
      ss_ref += static_cast<double>(ref[i]) * ref[i];
      ++finite;
    }
  const double rms = finite ? std::sqrt(ss_ref / finite) : 0.0;
  int bad = 0;
  std::ostringstream msg;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = got[i], r = ref[i];
    bool ok;
    if (r != r) {
      ok = g != g;
    } else if (std::isinf(r)) {
      ok = g == r;
    } else {
      ok = std::isfinite(g) && std::fabs(g - r) <= 20 * tol * (std::fabs(r) + rms);
      if (std::isfinite(g)) ss_err += (g - r) * (g - r);
    }
    if (!ok && bad++ < 6) msg << " [" << i << "] got " << g << " want " << r << ";";
  }
  if (bad) return ::testing::AssertionFailure() << bad << " elementwise mismatches:" << msg.str();
  if (finite >= 16 && ss_err > tol * tol * ss_ref)
    return ::testing::AssertionFailure() << "normwise rel error " << std::sqrt(ss_err / ss_ref)
                                         << " > " << tol;
  return ::testing::AssertionSuccess();
}

// Build a case, run CPU (fp32) and CUDA, compare outputs and running state.
struct Problem {
  std::string spec;
  std::vector<int64_t> batch;
  std::vector<std::vector<int64_t>> operand_sizes;
  std::string state;  // 'f' float [state_width], 'i' int64
  int64_t state_width = 0;
  float lo = -1.f, hi = 1.f;  // operand value range
};

void check_problem(const Problem& p, const CudaOptions& o, std::mt19937_64& rng,
                   const std::function<void(Case&)>& tweak = nullptr, Plan* plan_out = nullptr) {
  SCOPED_TRACE("spec:\n" + p.spec + "\nM=" + std::to_string(gftest::numel(p.batch)) +
               " dtype=" + dtype_name(o.dtype) + " precision=" + precision_name(o.precision));
  Case c = gftest::make_case(p.spec, p.batch, p.operand_sizes, p.state, rng, p.state_width,
                             p.lo, p.hi);
  if (tweak) tweak(c);
  round_inputs(c, o.dtype);
  const gftest::CpuResult ref = gftest::run_cpu(c);
  const CudaResult got = run_cuda(c, o);
  if (plan_out) *plan_out = got.plan;
  EXPECT_TRUE(close_to(got.out, ref.out, tolerance(o))) << got.plan.describe();
  ASSERT_EQ(got.state.size(), ref.state.size());
  for (size_t i = 0; i < got.state.size(); ++i) {
    if (got.state[i].is_int) {
      EXPECT_EQ(got.state[i].i, ref.state[i].i) << "state s" << i;
    } else {
      // Running statistics come from the GEMM's output: as close as the precision allows.
      EXPECT_TRUE(close_to(got.state[i].f, ref.state[i].f, std::max(1e-5, tolerance(o))))
          << "state s" << i;
    }
  }
}

std::string linear(int64_t K, int64_t N, bool bias = true) {
  return "linear in=" + std::to_string(K) + " out=" + std::to_string(N) + " bias=" +
         (bias ? "1" : "0") + "\n";
}

// The five seed models at a small shape (K, N not multiples of 16; m94 groups of 9).
std::vector<Problem> seed_problems(int64_t M, int64_t K = 50, int64_t N = 72) {
  const std::string L = linear(K, N);
  std::vector<Problem> ps;
  ps.push_back({L + "sum keepdim=1\nmax keepdim=1\nmean keepdim=1\nlogsumexp keepdim=1\n"
                    "logsumexp keepdim=1",
                {M}, {}, "", 0});
  ps.push_back({L + "mul b=2.0\nadd b=v1\nclamp lo=-10 hi=10\nlogsumexp keepdim=1\nmish\nmul b=v4",
                {M}, {}, "", 0});
  if (M > 1)
    ps.push_back({L + "batch_norm training=1 eps=1e-05 momentum=0.1 weight=t0 bias=t1 "
                      "running_mean=s0 running_var=s1 num_batches=s2\nmul b=t2\nsoftmax",
                  {M}, {{N}, {N}, {1}}, "ffi", N});
  ps.push_back({L + "add b=t0\nclamp lo=-1 hi=1\nmish\ngroup_norm groups=8 eps=1e-05 weight=t1 bias=t2",
                {M}, {{N}, {N}, {N}}, "", 0});
  ps.push_back({L + "gelu\nsoftmax", {M}, {}, "", 0});
  return ps;
}

// ---- tests that need no GPU ---------------------------------------------------------------

TEST(CudaExecutorPlan, RefusesTooLongRowPrograms) {
  std::string spec = linear(16, 24);
  for (int i = 0; i < 40; ++i) spec += (i % 2) ? "tanh\n" : "sigmoid\n";
  PlanRequest req;
  req.chain = parse_chain(spec);
  req.batch_sizes = {4};
  const Plan plan = make_plan(req);
  EXPECT_THROW(CudaExecutor::check(plan), Unsupported);
  CudaExecutor ex;
  EXPECT_THROW(ex.workspace_bytes(plan), Unsupported);
}

TEST(CudaExecutorPlan, PreparedLayoutFollowsThePlan) {
  PlanRequest req;
  req.chain = parse_chain(linear(50, 72) + "relu");
  req.batch_sizes = {7};
  req.fast_min_rows = 0;
  req.fast_min_flops = 0;
  CudaExecutor ex;
  req.precision = Precision::FP32;
  EXPECT_EQ(ex.prepared_bytes(make_plan(req)), 0u);
  // W split [N, S * 56] bf16, then its rows' marks int[N] and row list int[1 + N]
  req.precision = Precision::Fast;
  const int S = gemmfuse::cuda::kFastSplitSegments;
  EXPECT_EQ(ex.prepared_bytes(make_plan(req)),
            (72 * S * 56 * 2 + 255) / 256 * 256 + (72 * 4 + 255) / 256 * 256 + ((1 + 72) * 4 + 255) / 256 * 256);
  EXPECT_GT(ex.workspace_bytes(make_plan(req)), ex.workspace_bytes([&] {
    PlanRequest r2 = req;
    r2.precision = Precision::FP32;
    return make_plan(r2);
  }()));
  req.chain = parse_chain(linear(50, 72) + "sum keepdim=1");  // Gemv: colsum, bsum, colsign
  req.precision = Precision::FP32;
  EXPECT_EQ(ex.prepared_bytes(make_plan(req)), 3 * 256u);
}

// ---- against the CPU executor --------------------------------------------------------------

TEST(CudaExecutor, SeedModelsFp32) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  for (int64_t M : {1, 7, 128})
    for (const Problem& p : seed_problems(M)) check_problem(p, {}, rng);
  for (int64_t M : {1, 7, 16})  // K a multiple of 4: the small-M kernel (gemm_small_m.cu)
    for (const Problem& p : seed_problems(M, 64, 72)) check_problem(p, {}, rng);
}

TEST(CudaExecutor, SeedModelsFastAndTf32) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  for (Precision pr : {Precision::Fast, Precision::TF32})
    for (int64_t M : {1, 7, 128}) {
      CudaOptions o;
      o.precision = pr;
      for (const Problem& p : seed_problems(M)) check_problem(p, o, rng);
    }
}

TEST(CudaExecutor, SeedModelsBf16AndFp16) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  for (DType d : {DType::BF16, DType::F16})
    for (int64_t M : {7, 128}) {
      CudaOptions o;
      o.dtype = d;
      for (const Problem& p : seed_problems(M)) check_problem(p, o, rng);
    }
}

TEST(CudaExecutor, SeedModelsLargerShape) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  // Block-mode rows (N = 1000 and 4104: 256 and 512 threads), K with a 16-byte tail.
  for (int64_t N : {1000, 4104}) {
    for (Precision pr : {Precision::FP32, Precision::Fast}) {
      CudaOptions o;
      o.precision = pr;
      for (const Problem& p : seed_problems(33, 260, N)) check_problem(p, o, rng);
    }
  }
}

TEST(CudaExecutor, BatchNormTrainingM1Refused) {
  PlanRequest req;
  req.chain = parse_chain(linear(8, 12) + "batch_norm training=1");
  req.batch_sizes = {1};
  EXPECT_THROW(make_plan(req), std::invalid_argument);
}

TEST(CudaExecutor, UnaryOps) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  const std::string L = linear(50, 72);
  const std::vector<std::string> ops = {
      "neg", "abs", "square", "relu", "sigmoid", "tanh", "silu", "mish", "gelu", "gelu_tanh",
      "softplus beta=2 threshold=1", "softplus", "elu alpha=0.7", "leaky_relu alpha=0.2",
      "clamp lo=-0.1 hi=0.2", "clamp lo=0", "exp", "pow alpha=2", "pow alpha=3"};
  for (int64_t M : {1, 7})
    for (const auto& op : ops) check_problem({L + op, {M}, {}, "", 0}, {}, rng);
  // Ops with a restricted domain, fed |y| + 0.5.
  const std::vector<std::string> pos = {"sqrt", "rsqrt", "log", "reciprocal", "pow alpha=1.7",
                                        "pow alpha=-0.5", "pow alpha=0.5", "pow alpha=-2"};
  for (const auto& op : pos) check_problem({L + "abs\nadd b=0.5\n" + op, {7}, {}, "", 0}, {}, rng);
}

TEST(CudaExecutor, BinaryOpsEveryOperandKind) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  const int64_t M = 7, N = 72;
  const std::string L = linear(50, N);
  const std::vector<std::vector<int64_t>> shapes = {{1}, {N}, {1, N}, {M, 1}, {M, N}};
  // b / x has a pole where the GEMM output crosses 0: feed it |y| + 0.5 there.
  const std::string away = "abs\nadd b=0.5\n";
  for (const std::string op : {"add", "sub", "mul", "div", "minimum", "maximum"})
    for (const auto& s : shapes)
      for (int rev : {0, 1}) {
        const std::string pre = (op == "div" && rev) ? away : "";
        Problem p{L + pre + op + " b=t0 rev=" + std::to_string(rev), {M}, {s}, "", 0, 0.5f, 1.5f};
        check_problem(p, {}, rng);
      }
  for (const std::string op : {"add b=0.25", "sub b=0.25 rev=1", "mul b=-3", "div b=7",
                               "minimum b=0.1", "maximum b=-0.1", "add b=inf", "mul b=nan"})
    check_problem({L + op, {M}, {}, "", 0}, {}, rng);
  check_problem({L + away + "div b=7 rev=1", {M}, {}, "", 0}, {}, rng);
}

TEST(CudaExecutor, ValueOperandsAndSavedValues) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  const std::string L = linear(50, 72);
  for (const char* body : {
           "tanh\nmul b=v0",                                   // Y read back
           "sigmoid\nexp\nsub b=v1",                           // a saved intermediate
           "relu\nlogsumexp keepdim=1\nsigmoid\nmul b=v2",     // width-1 value
           "gelu\nsoftmax\nadd b=v1\nlog_softmax",              // full-width save + barrier
           "avg_pool kernel=2\nrelu\nadd b=v1",                 // after a pool
           "mul b=3\nmean keepdim=1\nsub b=v2 rev=1\nexp"})     // width-1 value read back
    for (int64_t M : {1, 7}) check_problem({L + body, {M}, {}, "", 0}, {}, rng);
}

TEST(CudaExecutor, Reductions) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  const std::string L = linear(50, 72);
  for (const char* r : {"sum", "mean", "max", "min", "logsumexp"})
    for (int keep : {0, 1})
      for (int64_t M : {1, 7, 128}) {
        // A pointwise stage first keeps the reduction in the row program (sum/mean as the
        // first stage become a Gemv, tested below).
        const std::string body = std::string("tanh\n") + r + " keepdim=" + std::to_string(keep) + "\nexp";
        check_problem({L + body, {M}, {}, "", 0}, {}, rng);
      }
}

TEST(CudaExecutor, GemvAndGemmWriteTheOutputDirectly) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  for (DType d : {DType::F32, DType::BF16}) {
    CudaOptions o;
    o.dtype = d;
    for (int64_t M : {1, 7, 128}) {
      check_problem({linear(50, 72) + "sum keepdim=1", {M}, {}, "", 0}, o, rng);
      check_problem({linear(50, 72) + "mean keepdim=0", {M}, {}, "", 0}, o, rng);
      check_problem({linear(2100, 24) + "sum keepdim=1", {M}, {}, "", 0}, o, rng);  // CTA/row
      check_problem({linear(51, 24, false) + "mean keepdim=1", {M}, {}, "", 0}, o, rng);
      check_problem({linear(50, 72), {M}, {}, "", 0}, o, rng);             // Gemm alone
      check_problem({linear(50, 72, false), {M}, {}, "", 0}, o, rng);
    }
  }
  for (Precision pr : {Precision::Fast, Precision::TF32}) {
    CudaOptions o;
    o.precision = pr;
    check_problem({linear(50, 72), {7}, {}, "", 0}, o, rng);
  }
}

TEST(CudaExecutor, SoftmaxAndLogSoftmax) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  for (int64_t N : {1, 3, 72, 300, 5000})
    for (const char* op : {"softmax", "log_softmax", "softmin"})
      check_problem({linear(20, N) + "mul b=4\n" + op, {7}, {}, "", 0}, {}, rng);
}

TEST(CudaExecutor, GroupNorm) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  for (int64_t M : {1, 7})
    for (const auto& [N, G] : std::vector<std::pair<int64_t, int64_t>>{
             {72, 1}, {72, 8}, {72, 72}, {72, 3}, {1024, 2}, {1024, 32}, {4104, 4}})
      for (int affine : {0, 1, 2}) {
        std::string gn = "group_norm groups=" + std::to_string(G) + " eps=1e-05";
        std::vector<std::vector<int64_t>> ops;
        if (affine >= 1) { gn += " weight=t0"; ops.push_back({N}); }
        if (affine == 2) { gn += " bias=t1"; ops.push_back({N}); }
        check_problem({linear(40, N) + "relu\n" + gn, {M}, ops, "", 0}, {}, rng);
      }
}

// Rows wide enough for the register-mode row kernel (rows in registers, GroupNorm groups of
// 4..128 columns as segmented warp shuffles), each problem run on both row kernels.
struct RegisterRowsOff {
  RegisterRowsOff() { cuda::set_register_rows(false); }
  ~RegisterRowsOff() { cuda::set_register_rows(true); }
};

// Register mode, then the interpreter.
void check_both_row_kernels(const Problem& p, std::mt19937_64& rng, const CudaOptions& o = {},
                            const std::function<void(Case&)>& tweak = nullptr) {
  check_problem(p, o, rng, tweak);
  RegisterRowsOff off;
  check_problem(p, o, rng, tweak);
}

TEST(CudaExecutor, RegisterRowsGroupNorm) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  // Group sizes 4..128 (q = 1..32 lanes) and 256 (not register mode), widths of 1, 2, 3 and 4
  // chunks per thread.
  for (const auto& [N, G] : std::vector<std::pair<int64_t, int64_t>>{
           {2048, 512}, {2048, 256}, {2048, 128}, {2048, 64}, {2048, 32}, {2048, 16}, {2048, 8},
           {8192, 256}, {6144, 48}, {1000, 250}, {520, 65}, {3000, 30}})
    for (int affine : {0, 2}) {
      std::string gn = "group_norm groups=" + std::to_string(G) + " eps=1e-05";
      std::vector<std::vector<int64_t>> ops{{N}};
      if (affine == 2) {
        gn += " weight=t1 bias=t2";
        ops.push_back({N});
        ops.push_back({N});
      }
      check_both_row_kernels({linear(40, N) + "add b=t0\nclamp lo=-1 hi=1\nmish\n" + gn, {5},
                              ops, "", 0},
                             rng);
    }
}

TEST(CudaExecutor, RegisterRowsSeedChainsWide) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  for (int64_t N : {8192, 4100, 1024, 300}) {
    const std::string L = linear(30, N);
    check_both_row_kernels({L + "mul b=2.0\nadd b=v1\nclamp lo=-10 hi=10\nlogsumexp keepdim=1\n"
                                "mish\nmul b=v4",
                            {6}, {}, "", 0},
                           rng);
    check_both_row_kernels({L + "batch_norm training=1 eps=1e-05 momentum=0.1 weight=t0 bias=t1 "
                                "running_mean=s0 running_var=s1 num_batches=s2\nmul b=t2\nsoftmax",
                            {33}, {{N}, {N}, {1}}, "ffi", N},
                           rng);
    check_both_row_kernels({L + "batch_norm training=1 momentum=none running_mean=s0 "
                                "running_var=s1 num_batches=s2\ngelu\nlog_softmax",
                            {9}, {}, "ffi", N},
                           rng);
    check_both_row_kernels({L + "gelu\nsoftmax", {4}, {}, "", 0}, rng);
    check_both_row_kernels({L + "tanh\nsum keepdim=1\nsigmoid", {3}, {}, "", 0}, rng);
    check_both_row_kernels({L + "max keepdim=1", {3}, {}, "", 0}, rng);
    check_both_row_kernels({L + "sub b=t0\nmin keepdim=1\nexp", {3}, {{3, N}}, "", 0}, rng);
    check_both_row_kernels({L + "mean keepdim=1\nmul b=t0", {3}, {{3, 1}}, "", 0}, rng);
    CudaOptions bf;
    bf.dtype = DType::BF16;
    check_both_row_kernels({L + "silu\nlog_softmax", {4}, {}, "", 0}, rng, bf);
    CudaOptions h;
    h.dtype = DType::F16;
    check_both_row_kernels({L + "relu\ngroup_norm groups=" + std::to_string(N / 4) + " eps=1e-05",
                            {4}, {}, "", 0},
                           rng, h);
  }
}

// NaN and infinities inside otherwise finite rows, through the row kernels' reductions (the
// exponent shift of softmax, log_softmax and logsumexp drops NaN, which the sum then carries;
// max and min propagate it): rows with one NaN, one +inf, one -inf, +inf and NaN, +inf and
// -inf, all -inf, and finite rows. Widths: 8192 and 4096 fill every thread's chunks, 4100 and
// 1024 do not.
TEST(CudaExecutor, RegisterRowsNonFinite) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t N : {8192, 4096, 4100, 1024}) {
    const int64_t M = 8;
    auto poison = [&](Case& c) {
      std::vector<float>& t = c.operands[0];  // [M, N], added to Y
      t[0 * N + 17] = nan;
      t[1 * N + N - 1] = inf;
      t[2 * N + 3] = -inf;
      t[3 * N + 5] = inf;
      t[3 * N + N / 2] = nan;
      t[4 * N + 0] = inf;
      t[4 * N + N - 2] = -inf;
      for (int64_t j = 0; j < N; ++j) t[5 * N + j] = -inf;
    };
    for (const char* body : {"softmax", "log_softmax", "softmin", "logsumexp keepdim=1", "max keepdim=1",
                             "min keepdim=1", "gelu\nsoftmax"})
      check_both_row_kernels({linear(30, N) + "add b=t0\n" + body, {M}, {{M, N}}, "", 0}, rng, {},
                             poison);
  }
}

TEST(CudaExecutor, Pooling) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  for (int64_t N : {72, 77, 1000})
    for (const char* pool : {"avg_pool kernel=3 stride=2 padding=1 ceil=1 include_pad=0",
                             "avg_pool kernel=3 stride=2 padding=1 ceil=1 include_pad=1",
                             "avg_pool kernel=4", "avg_pool kernel=5 stride=3 ceil=1",
                             "max_pool kernel=3 stride=1 padding=1", "max_pool kernel=2 ceil=1",
                             "max_pool kernel=2 stride=1 padding=1",
                             "max_pool kernel=4 stride=3 padding=2 ceil=1"})
      check_problem({linear(30, N) + std::string(pool) + "\ntanh\n" + pool + "\nsoftmax",
                     {7}, {}, "", 0}, {}, rng);
}

TEST(CudaExecutor, BatchNormVariants) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  const int64_t N = 72;
  const std::string L = linear(50, N);
  const std::string aff = " weight=t0 bias=t1";
  const std::string run = " running_mean=s0 running_var=s1";
  for (int64_t M : {2, 7, 128}) {
    // Training, momentum and cumulative; in the middle of a chain; no running stats.
    check_problem({L + "batch_norm training=1" + aff + run + " num_batches=s2", {M},
                   {{N}, {N}}, "ffi", N}, {}, rng);
    check_problem({L + "batch_norm training=1 momentum=none" + aff + run + " num_batches=s2",
                   {M}, {{N}, {N}}, "ffi", N}, {}, rng);
    check_problem({L + "relu\nbatch_norm training=1 eps=0.001" + run + "\nsigmoid\nmul b=v1",
                   {M}, {}, "ff", N}, {}, rng);
    // Affine weights in [0.5, 1]: with 2 rows the second batch_norm normalises
    // tanh(b + g s) - tanh(b - g s), and a weight g near 0 makes that a difference of two
    // nearly equal fp32 values, which no fp32 order reproduces to 1e-5 (with weights
    // in [-1, 1], 1 run in 15 fails).
    check_problem({L + "batch_norm training=1\ntanh\nbatch_norm training=1" + aff, {M},
                   {{N}, {N}}, "", N, 0.5f, 1.f}, {}, rng);
  }
  for (int64_t M : {1, 7}) {
    // Eval: folded into W (then Gemm or Gemv), or applied from the running stats.
    for (Precision pr : {Precision::FP32, Precision::Fast}) {
      CudaOptions o;
      o.precision = pr;
      check_problem({L + "batch_norm training=0" + aff + run + "\nrelu", {M}, {{N}, {N}}, "ff", N}, o, rng);
    }
    check_problem({L + "batch_norm training=0" + run + "\nsum keepdim=1", {M}, {}, "ff", N}, {}, rng);
    check_problem({L + "tanh\nbatch_norm training=0" + aff + run, {M}, {{N}, {N}}, "ff", N}, {}, rng);
    CudaOptions bf;
    bf.dtype = DType::BF16;
    check_problem({L + "batch_norm training=0" + aff + run, {M}, {{N}, {N}}, "ff", N}, bf, rng);
    check_problem({L + "batch_norm training=0" + aff + run + "\ngelu", {M}, {{N}, {N}}, "ff", N}, bf, rng);
  }
}

// The one-kernel column statistics forced on narrow widths (a partly filled last column slice),
// with 32 and 16 columns per CTA, M from 2 to above the 8-loads-in-flight stride; momentum and
// momentum=None (num_batches_tracked read, then counted); a width not a multiple of 4 falls back.
struct FusedColstats {
  explicit FusedColstats(int mode) { cuda::set_fused_colstats(mode); }
  ~FusedColstats() { cuda::set_fused_colstats(1); }
};

TEST(CudaExecutor, FusedColumnStats) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  const std::string aff = " weight=t0 bias=t1";
  const std::string run = " running_mean=s0 running_var=s1";
  for (int mode : {8, 4}) {
    FusedColstats f(mode);
    for (int64_t N : {72, 40, 7})
      for (int64_t M : {2, 7, 300}) {
        const std::string L = linear(20, N);
        check_problem({L + "batch_norm training=1" + aff + run + " num_batches=s2\nmul b=t2\nsoftmax",
                       {M}, {{N}, {N}, {1}}, "ffi", N}, {}, rng);
        check_problem({L + "batch_norm training=1 momentum=none" + aff + run + " num_batches=s2",
                       {M}, {{N}, {N}}, "ffi", N}, {}, rng);
        check_problem({L + "relu\nbatch_norm training=1 eps=0.001" + run + "\nsigmoid", {M}, {},
                       "ff", N}, {}, rng);
        check_problem({L + "batch_norm training=1\ntanh", {M}, {}, "", N}, {}, rng);
      }
  }
}

TEST(CudaExecutor, DropoutEvalAndBatchDims) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  check_problem({linear(50, 72) + "dropout p=0.3 training=0\nsilu", {3, 5}, {}, "", 0}, {}, rng);
  check_problem({linear(50, 72) + "dropout p=0 training=1\nsoftmax", {2, 2, 3}, {}, "", 0}, {}, rng);
}

TEST(CudaExecutor, WideRowsUseGlobalScratch) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  // 60000 floats (+ a pool output) exceed any GPU's shared memory per block.
  check_problem({linear(8, 60000) + "softmax", {3}, {}, "", 0}, {}, rng);
  check_problem({linear(8, 60000) + "gelu\navg_pool kernel=3 stride=2 padding=1\nlog_softmax\n"
                 "max_pool kernel=2\ngroup_norm groups=5",
                 {3}, {}, "", 0}, {}, rng);
}

TEST(CudaExecutor, NaNAndInfPropagate) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  auto poison = [](Case& c) {
    const int64_t K = c.chain.in_features;
    c.x[2 * K + 3] = std::numeric_limits<float>::quiet_NaN();
  };
  for (Precision pr : {Precision::FP32, Precision::Fast}) {
    CudaOptions o;
    o.precision = pr;
    for (const char* body : {"clamp lo=-1 hi=1\nmax keepdim=1", "softmax", "relu\nlogsumexp keepdim=1",
                             "maximum b=0.5\nsum keepdim=0", "max_pool kernel=3", "sum keepdim=1"})
      check_problem({linear(50, 72) + body, {7}, {}, "", 0}, o, rng, poison);
  }
}

// fp32 GEMMs whose N is not a multiple of 4 on the f16x3 kernel (set_f16x3_padded_n): Y written
// with padded rows in the workspace, then copied into place, the fix-up's writes at the padded
// stride. Into the output and into a buffer a row pass reads; with an infinity, a NaN row, a
// few tiny values (corrected) and many (the second level) in x. Each plan must take the kernel.
TEST(CudaExecutor, F16x3PaddedRows) {
  SKIP_WITHOUT_GPU();
  if (!gftest::is_sm90()) GTEST_SKIP() << "the f16x3 kernel needs an sm_90 GPU";
  std::mt19937_64 rng(gftest::test_seed());
  cuda::set_f16x3_padded_n(true);
  auto expect_padded = [](const Plan& plan) {
    const cuda::Selection s = cuda::select(plan, nullptr, cuda::device_facts(&plan), cuda::current_overrides());
    EXPECT_EQ(s.gemm.kind, cuda::GemmKind::F16x3) << s.gemm.reason;
    EXPECT_EQ(s.gemm.ldy, (plan.N + 3) / 4 * 4) << s.gemm.reason;
  };
  // Tiny values (~2^-40 of their rows' largest: left out of the parts): 16 in one row (the
  // fix-up corrects them), or 48 in each of 64 rows (the second level takes them).
  auto exceptional = [](int tiny_rows, int per_row) {
    return [tiny_rows, per_row](Case& c) {
      const int64_t K = c.chain.in_features;
      c.x[3 * K + 5] = std::numeric_limits<float>::infinity();
      c.x[7 * K + 1] = std::numeric_limits<float>::quiet_NaN();
      for (int r = 0; r < tiny_rows; ++r)
        for (int k = 0; k < per_row; ++k) c.x[(20 + r) * K + 3 * k] = 1e-12f;
    };
  };
  CudaOptions o;
  struct Shape {
    int64_t M, N;
  };
  for (const Shape& sh : {Shape{256, 4099} /* split-K */, Shape{1024, 4097} /* wide */}) {
    for (const char* body : {"", "relu\n"}) {
      const Problem p{linear(1024, sh.N) + body, {sh.M}};
      Plan plan;
      check_problem(p, o, rng, nullptr, &plan);
      expect_padded(plan);
      check_problem(p, o, rng, exceptional(1, 16), &plan);
      check_problem(p, o, rng, exceptional(64, 48), &plan);
      expect_padded(plan);
    }
  }
  cuda::set_f16x3_padded_n(false);
}

// The fused sm90 GEMM + softmax kernel (the selection's FusedSoftmaxChoice) on problems it takes: ragged M, N
// and K tails, one and two tiles per CTA, with and without gelu and a scalar, NaN and inf rows, a
// CUDA graph and a side stream. Each plan must actually take the kernel.
TEST(CudaExecutor, FusedGemmSoftmaxSm90) {
  SKIP_WITHOUT_GPU();
  if (!gftest::is_sm90()) GTEST_SKIP() << "the fused kernel needs an sm_90 GPU";
  if (!cuda::sm90::gemm_softmax_built()) GTEST_SKIP() << "built without the sm90 kernels";
  std::mt19937_64 rng(gftest::test_seed());
  struct Shape {
    int64_t M, K, N;
  };
  // 1000 x 4104: 8 x 17 tiles, two per CTA; 500 x 4104: one per CTA; 600 x 4104: 5 m-blocks,
  // so one CTA of each last cluster has no rows (its x tiles are all out of bounds).
  // K = 264, 136, 72: k tails.
  const Shape shapes[] = {{1000, 264, 4104}, {500, 136, 4104}, {600, 72, 4104}};
  // The first tile's epilogue runs under the second tile's mainloop unless the scale is
  // negative (a row's max of v then comes from its smallest u, which the deferred prepare
  // does not track).
  const char* bodies[] = {"gelu\nsoftmax", "softmax", "gelu\nmul b=0.5\nsoftmax", "mul b=3\nsoftmax",
                          "mul b=-1.5\nsoftmax", "gelu\nmul b=-2\nsoftmax"};
  const Problem gelu_softmax{linear(264, 4104) + "gelu\nsoftmax", {1000}};  // two tiles per CTA
  auto expect_fused = [](const Plan& plan) {
    EXPECT_EQ(fused_softmax_unused(plan), "") << plan.describe();
  };
  for (DType d : {DType::BF16, DType::F16}) {
    CudaOptions o;
    o.dtype = d;
    for (const Shape& s : shapes)
      for (const char* body : bodies) {
        Plan plan;
        check_problem({linear(s.K, s.N) + body, {s.M}, {}, "", 0, -1.f, 1.f}, o, rng, nullptr, &plan);
        expect_fused(plan);
      }
  }
  // Small inputs (|x W^T + b| < 2 sqrt 2 everywhere): the epilogue's polynomial gelu; the
  // unscaled cases above mostly take its full-range form (gelu_erf_wide_n).
  auto small = [](Case& c) {
    for (float& v : c.x) v *= 0.02f;
  };
  // Bias bands over the first four column tiles: values in (-1.97, -0.78), inside the narrow
  // polynomial's range, where gelu's largest value is at a row part's smallest u (the
  // prepare looks for it only there: with a scale of 100, a reference from the largest u
  // alone would overflow the fp16 stash), and in (2.38, 2.42), the wider polynomial's range.
  auto banded = [&small](Case& c) {
    small(c);
    for (size_t n = 0; n < 1024 && n < c.b.size(); ++n)
      c.b[n] = n < 512 ? -0.8f - 1.15f * static_cast<float>((n * 37) % 512) / 512 : 2.4f;
  };
  // Bias bands over the first four column tiles in (-12, 6): the full-range form, its clamp
  // (past |u| = 4.75) included, in every warp of those tiles.
  auto wide_banded = [&small](Case& c) {
    small(c);
    for (size_t n = 0; n < 1024 && n < c.b.size(); ++n)
      c.b[n] = -12.0f + 18.0f * static_cast<float>((n * 37) % 1024) / 1024;
  };
  const Problem gelu_scaled_softmax{linear(264, 4104) + "gelu\nmul b=100\nsoftmax", {1000}};
  for (DType d : {DType::BF16, DType::F16}) {
    CudaOptions o;
    o.dtype = d;
    Plan plan;
    check_problem(gelu_softmax, o, rng, small, &plan);
    expect_fused(plan);
    check_problem(gelu_softmax, o, rng, banded, &plan);
    expect_fused(plan);
    check_problem(gelu_scaled_softmax, o, rng, banded, &plan);
    expect_fused(plan);
    check_problem(gelu_softmax, o, rng, wide_banded, &plan);
    expect_fused(plan);
    check_problem(gelu_scaled_softmax, o, rng, wide_banded, &plan);
    expect_fused(plan);
  }
  // Finite values whose shift (max * log2 e) would overflow, 3e38: two columns in different
  // tiles share the row maximum (0.5 each); with a negative scale every value is -3e38
  // (uniform rows).
  auto huge_pair = [&small](Case& c) {
    small(c);
    c.b[7] = c.b[300] = 3e38f;
  };
  auto huge_all = [&small](Case& c) {
    small(c);
    for (float& b : c.b) b = 3e38f;
  };
  // Row maxima past 2^22, where one FMA against the rounded shift would scale a row part's
  // exps by far more than its rounding (out of fp16's range past ~2^27, to inf or 0 past
  // ~2^30: NaN rows): 1e30 and 2^29, each far above the products' part of the two columns.
  auto large_pair = [&small](float v) {
    return [&small, v](Case& c) {
      small(c);
      c.b[7] = c.b[300] = v;
    };
  };
  {  // bf16 only: fp16 cannot hold 3e38 or 1e30
    CudaOptions o;
    o.dtype = DType::BF16;
    Plan plan;
    check_problem(gelu_softmax, o, rng, huge_pair, &plan);
    expect_fused(plan);
    check_problem({linear(264, 4104) + "mul b=-1\nsoftmax", {1000}}, o, rng, huge_all, &plan);
    expect_fused(plan);
    for (float v : {1e30f, 0x1p29f}) {
      check_problem(gelu_softmax, o, rng, large_pair(v), &plan);
      expect_fused(plan);
    }
  }
  // Non-finite rows: a NaN in x makes its row NaN; +inf and -inf inputs give inf products.
  auto poison = [](Case& c) {
    const int64_t K = c.chain.in_features;
    c.x[2 * K + 3] = std::numeric_limits<float>::quiet_NaN();
    c.x[700 * K + 5] = std::numeric_limits<float>::infinity();
    c.x[901 * K + 1] = -std::numeric_limits<float>::infinity();
  };
  CudaOptions o;
  o.dtype = DType::BF16;
  Plan plan;
  check_problem(gelu_softmax, o, rng, poison, &plan);
  expect_fused(plan);
  // The plan's workspace holds the kernel's partials only (no Y, no cuBLASLt workspace).
  // With x misaligned for TMA the kernel declines at run time and the steps run with a
  // stream-ordered workspace of their own; also inside a graph capture.
  EXPECT_LT(CudaExecutor().workspace_bytes(plan), plan.buffers_bytes()) << plan.describe();
  o.misalign_x = true;
  check_problem(gelu_softmax, o, rng, nullptr, &plan);
  expect_fused(plan);
  o.misalign_x = false;
  // Graph capture on a side stream, replayed twice.
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  o.stream = st;
  o.graph = true;
  o.runs = 2;
  check_problem(gelu_softmax, o, rng, nullptr, &plan);
  expect_fused(plan);
  o.misalign_x = true;
  check_problem(gelu_softmax, o, rng, nullptr, &plan);
  CK(cudaStreamDestroy(st));
}

// One bf16 plan that the fused kernel runs, with its device memory: set_x puts new inputs
// in place (and poisons the output, so an unwritten element shows), run enqueues it on a
// stream, expect checks the output against the CPU executor on the inputs last set.
struct FusedRun {
  Case c;
  Plan plan;
  CudaExecutor ex;
  std::unique_ptr<DevMem> x, w, b, out, prepared, ws;
  RunArgs a;
  static constexpr DType d = DType::BF16;

  FusedRun(const std::string& spec, int64_t M, std::mt19937_64& rng) {
    c = gftest::make_case(spec, {M}, {}, "", rng);
    round_inputs(c, d);
    PlanRequest req;
    req.chain = c.chain;
    req.batch_sizes = {M};
    req.dtype = d;
    plan = make_plan(req);
    EXPECT_EQ(fused_softmax_unused(plan), "") << plan.describe();
    const auto wb = encode(c.w, d), bb = encode(c.b, d);
    x = std::make_unique<DevMem>(c.x.size() * elt(d));
    w = std::make_unique<DevMem>(wb.size());
    b = std::make_unique<DevMem>(bb.size());
    CK(cudaMemcpy(w->p, wb.data(), wb.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b->p, bb.data(), bb.size(), cudaMemcpyHostToDevice));
    out = std::make_unique<DevMem>(static_cast<size_t>(M * plan.out_width) * elt(d));
    prepared = std::make_unique<DevMem>(ex.prepared_bytes(plan));
    ws = std::make_unique<DevMem>(ex.workspace_bytes(plan));
    a.x = x->p;
    a.weight = w->p;
    a.bias = b->p;
    a.out = out->p;
    ex.prepare(plan, a, prepared->p);
  }
  void set_x(std::mt19937_64& rng) {
    const Case fresh = gftest::make_case(c.spec, c.batch, {}, "", rng);
    c.x = decode(encode(fresh.x, d), d);
    const auto xb = encode(c.x, d);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(x->p, xb.data(), xb.size(), cudaMemcpyHostToDevice));
    CK(cudaMemset(out->p, 0xFF, out->bytes));
  }
  void run(cudaStream_t s) {
    a.stream = s;
    ex.run(plan, a, prepared->p, ws->p);
  }
  std::vector<float> output() const {
    CK(cudaDeviceSynchronize());
    std::vector<uint8_t> ob(out->bytes);
    CK(cudaMemcpy(ob.data(), out->p, ob.size(), cudaMemcpyDeviceToHost));
    return decode(ob, d);
  }
  void expect(const char* what) const {
    SCOPED_TRACE(what);
    EXPECT_TRUE(close_to(output(), gftest::run_cpu(c).out, tolerance(CudaOptions{d})));
  }
};

bool fused_kernel_runs_here() {
  return gpu_present() && gftest::is_sm90() && cuda::sm90::gemm_softmax_built();
}

// The fused kernel's CTAs exchange row statistics through words tagged with a per-launch
// epoch: in a buffer kept per stream for direct launches (grown for a larger problem), in
// the graph's workspace, cleared before each replay, for captured launches. Stale words of
// an earlier launch must never pass for this one's: new inputs between launches on each
// stream and between replays of one graph would then give rows normalized with old sums.
TEST(CudaExecutor, FusedSoftmaxRowStatisticsAreNeverStale) {
  SKIP_WITHOUT_GPU();
  if (!fused_kernel_runs_here()) GTEST_SKIP() << "the fused kernel needs an sm_90 GPU and the sm90 build";
  std::mt19937_64 rng(gftest::test_seed());
  const std::string spec = linear(264, 4104) + "gelu\nsoftmax";
  cudaStream_t s1, s2;
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  FusedRun small(spec, 500, rng), large(spec, 1000, rng);  // one and two tiles per CTA
  // Direct launches: a stream's buffer reused with new inputs, grown for the larger problem,
  // and two streams taking turns.
  for (cudaStream_t s : {s1, s2, s1}) {
    small.set_x(rng);
    small.run(s);
    small.expect("small, direct");
    large.set_x(rng);
    large.run(s);
    large.expect("large, direct");
  }
  // One captured graph replayed with new inputs each time, direct launches on its capture
  // stream in between.
  large.set_x(rng);
  cudaGraph_t g = nullptr;
  CK(cudaStreamBeginCapture(s2, cudaStreamCaptureModeGlobal));
  large.run(s2);
  CK(cudaStreamEndCapture(s2, &g));
  cudaGraphExec_t ge = nullptr;
  CK(cudaGraphInstantiate(&ge, g, 0));
  for (int replay = 0; replay < 3; ++replay) {
    large.set_x(rng);
    CK(cudaGraphLaunch(ge, s2));
    large.expect("large, graph replay");
    small.set_x(rng);
    small.run(s2);
    small.expect("small, direct between replays");
  }
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaStreamDestroy(s1));
  CK(cudaStreamDestroy(s2));
}

// A direct launch keeps a row statistics buffer for its stream (row_stats_buffers.h); a
// program that makes streams by the thousand must not keep one for each: at most
// kMaxRowStatsBuffers per device, the least recently used freed in stream order after its
// last launch. Results stay right across evictions: streams destroyed right after their
// launch, a stream kept throughout, and launches on fresh streams with no host sync between
// them (a buffer freed too early would be reused and cleared under a running launch).
TEST(CudaExecutor, FusedSoftmaxKeepsFewRowStatisticsBuffers) {
  SKIP_WITHOUT_GPU();
  if (!fused_kernel_runs_here()) GTEST_SKIP() << "the fused kernel needs an sm_90 GPU and the sm90 build";
  using cuda::sm90::kMaxRowStatsBuffers;
  using cuda::sm90::row_stats_buffers_kept;
  std::mt19937_64 rng(gftest::test_seed());
  FusedRun run(linear(264, 4104) + "gelu\nsoftmax", 500, rng);
  cudaStream_t kept;
  CK(cudaStreamCreateWithFlags(&kept, cudaStreamNonBlocking));
  for (size_t i = 0; i < 3 * kMaxRowStatsBuffers; ++i) {
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    run.set_x(rng);
    run.run(s);
    CK(cudaStreamDestroy(s));  // its work still runs
    run.expect("a fresh stream, destroyed after its launch");
    EXPECT_LE(row_stats_buffers_kept(), kMaxRowStatsBuffers);
    if (i % 4 == 0) {
      run.set_x(rng);
      run.run(kept);
      run.expect("the kept stream");
    }
  }
  run.set_x(rng);
  std::vector<cudaStream_t> fresh(kMaxRowStatsBuffers + 4);
  for (cudaStream_t& s : fresh) {
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    run.run(s);
  }
  run.run(kept);
  run.expect("fresh streams without a sync between them");
  EXPECT_LE(row_stats_buffers_kept(), kMaxRowStatsBuffers);
  for (cudaStream_t s : fresh) CK(cudaStreamDestroy(s));
  CK(cudaStreamDestroy(kept));
}

// Direct launches of the fused kernel are programmatic (PDL): a launch may start while the
// stream's previous kernel finishes, and must wait for it (griddepcontrol.wait) before it
// reads anything. Here the second launch reads the first's output as its x with no host
// sync in between (the first's output poisoned beforehand: reading too early gives NaN).
// Launches are not cooperative, so two streams must not run the kernel at once (each grid
// waiting for CTAs the other holds): launches alternating between two streams without a
// sync must all finish, each right.
TEST(CudaExecutor, FusedSoftmaxLaunchesWaitForTheirPredecessors) {
  SKIP_WITHOUT_GPU();
  if (!fused_kernel_runs_here()) GTEST_SKIP() << "the fused kernel needs an sm_90 GPU and the sm90 build";
  std::mt19937_64 rng(gftest::test_seed());
  const int64_t M = 1000, K = 264, N1 = 4104, N2 = 2056;  // two and one tiles per CTA
  FusedRun first(linear(K, N1) + "gelu\nsoftmax", M, rng);
  FusedRun second(linear(N1, N2) + "softmax", M, rng);
  cudaStream_t s1, s2;
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  for (cudaStream_t s : {s1, s2}) {
    first.set_x(rng);
    second.set_x(rng);
    second.a.x = first.out->p;  // the first launch's output, poisoned until it runs
    first.run(s);
    second.run(s);
    const std::vector<float> y1 = first.output();
    first.expect("first");
    second.c.x = y1;  // the reference for the second: the first's output as computed
    second.expect("second, reading the first's output");
  }
  second.a.x = second.x->p;
  // Two streams taking turns, no host sync until the end: each plan's output must be its
  // own inputs' (both launches of a plan compute the same, so the last one is checked).
  first.set_x(rng);
  second.set_x(rng);
  for (int i = 0; i < 6; ++i) {
    first.run(i % 2 == 0 ? s1 : s2);
    second.run(i % 2 == 0 ? s2 : s1);
  }
  first.expect("first, streams alternating");
  second.expect("second, streams alternating");
  CK(cudaStreamDestroy(s1));
  CK(cudaStreamDestroy(s2));
}

// Plans outside the fused kernel's shape say why, and still run (step by step).
TEST(CudaExecutorPlan, FusedSoftmaxMatchesOnlyItsChains) {
  PlanRequest req;
  req.batch_sizes = {1000};
  req.dtype = DType::BF16;
  req.chain = parse_chain(linear(264, 4104) + "gelu\nsoftmax");
  EXPECT_TRUE(cuda::match_fused_softmax(make_plan(req)).matches);
  req.chain = parse_chain(linear(264, 4104) + "relu\nsoftmax");
  EXPECT_FALSE(cuda::match_fused_softmax(make_plan(req)).matches);
  req.chain = parse_chain(linear(264, 4104) + "gelu\ndiv b=3\nsoftmax");
  EXPECT_FALSE(cuda::match_fused_softmax(make_plan(req)).matches);
  req.chain = parse_chain(linear(264, 4104) + "gelu\nlog_softmax");
  EXPECT_FALSE(cuda::match_fused_softmax(make_plan(req)).matches);
  req.dtype = DType::F32;
  req.chain = parse_chain(linear(264, 4104) + "gelu\nsoftmax");
  EXPECT_EQ(cuda::match_fused_softmax(make_plan(req)).reason, "fp32 model");
}

TEST(CudaExecutor, GemvRowsWithInfOrNaNFollowTheColumnSigns) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  const float inf = std::numeric_limits<float>::infinity();
  auto tweak = [&](Case& c) {
    const int64_t K = c.chain.in_features, N = c.chain.out_features;
    for (int64_t n = 0; n < N; ++n) {  // column 1 all negative, column 5 all positive
      c.w[n * K + 1] = -std::fabs(c.w[n * K + 1]) - 1e-3f;
      c.w[n * K + 5] = std::fabs(c.w[n * K + 5]) + 1e-3f;
    }
    c.x[2 * K + 3] = inf;                          // mixed-sign column: NaN
    c.x[4 * K + 5] = -inf;                         // positive column: -inf
    c.x[5 * K + 1] = inf;                          // -inf and +inf: NaN
    c.x[5 * K + 5] = inf;
    c.x[6 * K + 1] = inf;                          // negative column: -inf
    c.x[6 * K + 0] = std::numeric_limits<float>::quiet_NaN() * 0.f + 1.f;  // stays finite
  };
  const std::string run = " running_mean=s0 running_var=s1";
  for (DType d : {DType::F32, DType::BF16}) {
    CudaOptions o;
    o.dtype = d;
    for (int64_t K : {50, 2100}) {  // warp per row, CTA per row
      const std::string L = linear(K, 24);
      check_problem({L + "sum keepdim=1", {8}, {}, "", 0}, o, rng, tweak);
      check_problem({L + "mean keepdim=0", {8}, {}, "", 0}, o, rng, tweak);
      check_problem({L + "sum keepdim=1\nexp", {8}, {}, "", 0}, o, rng, tweak);
      check_problem({L + "batch_norm training=0" + run + "\nsum keepdim=1", {8}, {}, "ff", 24}, o,
                    rng, tweak);
    }
  }
}

// ---- stream, graph, determinism ------------------------------------------------------------

TEST(CudaExecutor, NonDefaultStream) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  cudaStream_t s = nullptr;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CudaOptions o;
  o.stream = s;
  for (Precision pr : {Precision::FP32, Precision::Fast}) {
    o.precision = pr;
    for (const Problem& p : seed_problems(128)) check_problem(p, o, rng);
  }
  CK(cudaStreamDestroy(s));
}

TEST(CudaExecutor, GraphCaptureReplayEqualsDirectRun) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  cudaStream_t s = nullptr;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // The seed chains at N = 72 (warp-mode row passes) and two at N = 4096, where the fused
  // column statistics and the register row kernel run (programmatic launches, captured).
  std::vector<Problem> problems = seed_problems(128);
  for (const Problem& p : seed_problems(128, 50, 4096))
    if (p.spec.find("softmax") != std::string::npos) problems.push_back(p);
  for (Precision pr : {Precision::FP32, Precision::Fast, Precision::TF32}) {
    for (const Problem& p : problems) {
      SCOPED_TRACE(p.spec + " precision " + precision_name(pr));
      Case c = gftest::make_case(p.spec, p.batch, p.operand_sizes, p.state, rng, p.state_width);
      CudaOptions o;
      o.precision = pr;
      o.stream = s;
      const CudaResult direct = run_cuda(c, o);
      o.graph = true;
      const CudaResult replay = run_cuda(c, o);
      EXPECT_TRUE(gftest::same_bits(replay.out, direct.out));
      for (size_t i = 0; i < c.state.size(); ++i) {
        if (c.state[i].is_int) EXPECT_EQ(replay.state[i].i, direct.state[i].i);
        else EXPECT_TRUE(gftest::same_bits(replay.state[i].f, direct.state[i].f));
      }
    }
  }
  CK(cudaStreamDestroy(s));
}

TEST(CudaExecutor, RepeatedRunsAreBitwiseEqualAndUpdateStateEachTime) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  const int64_t N = 72;
  const std::string spec = linear(50, N) +
                           "batch_norm training=1 momentum=none weight=t0 bias=t1 "
                           "running_mean=s0 running_var=s1 num_batches=s2\nsoftmax";
  Case c = gftest::make_case(spec, {64}, {{N}, {N}}, "ffi", rng, N);
  CudaOptions once, thrice;
  thrice.runs = 3;
  const CudaResult a = run_cuda(c, once), b = run_cuda(c, thrice);
  EXPECT_TRUE(gftest::same_bits(a.out, b.out));
  EXPECT_EQ(a.state[2].i, c.state[2].i + 1);
  EXPECT_EQ(b.state[2].i, c.state[2].i + 3);
  // Three CPU runs give the same running statistics.
  gftest::CpuResult r1 = gftest::run_cpu(c);
  Case c2 = c;
  c2.state = r1.state;
  gftest::CpuResult r2 = gftest::run_cpu(c2);
  c2.state = r2.state;
  gftest::CpuResult r3 = gftest::run_cpu(c2);
  for (int i = 0; i < 2; ++i)
    EXPECT_TRUE(gftest::all_close(b.state[i].f, r3.state[i].f, 1e-6, 1e-5)) << "state s" << i;
  EXPECT_EQ(b.state[2].i, r3.state[2].i);
}

}  // namespace
