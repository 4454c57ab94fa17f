// Timing of the CUDA executor's row passes, column statistics and whole runs on the seed
// chains at M=1024, K=N=8192 (not a test; not built by CMake). Four configurations in the same
// process (set_mode below): "head" (register rows, one-value rows on the interpreter, two-level
// vector column stats), "new" (the defaults: one-value rows in registers, one-kernel column
// stats), "new again" (the same, for the run-to-run spread), "alt" (new, one-kernel
// column stats with 16 columns per CTA); inputs rotated over 3
// sets, median of the repeats (CUDA events). m84 is also timed as a bf16 model (bf16 output).
// Whole runs: L2 flushed (a 256 MB memset) before each. Steps: timed right after a whole run on
// the same workspace, so Y is as warm in L2 as in a real run (a memset flush leaves ~50 MB of
// dirty lines whose write-back added ~15 us to every step measured after it).
// Build (after building build-perf2):
//   g++ -O2 -std=c++17 tests/cpp/cuda_row_timing.cpp -Icore/include -Iexecutors/cuda \
//     -Iexecutors/common -I/usr/local/cuda/include build-perf2/executors/cuda/libgemmfuse_cuda.a \
//     build-perf2/core/libgemmfuse_core.a -L/usr/local/cuda/lib64 -lcublasLt -lcublas -lcudart \
//     -o build-perf2/tests/cpp/cuda_row_timing
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "column_stats.h"
#include "cuda_executor.h"
#include "gemmfuse/chain.h"
#include "gemmfuse/plan.h"
#include "layout.h"
#include "row_program.h"

using namespace gemmfuse;

#define CK(x)                                                                         \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) throw std::runtime_error(std::string(#x) + ": " + cudaGetErrorString(e_)); \
  } while (0)

struct Buf {
  void* p = nullptr;
  explicit Buf(size_t n) { CK(cudaMalloc(&p, std::max<size_t>(n, 256))); }
  ~Buf() { cudaFree(p); }
};

uint64_t g_rng = 88172645463325252ull;
float urand() {  // [-1, 1)
  g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17;
  return static_cast<float>((g_rng >> 40) * (1.0 / 8388608.0)) - 1.f;
}
void fill(void* d, size_t n, float scale, float offset = 0.f) {
  std::vector<float> h(n);
  for (auto& v : h) v = offset + scale * urand();
  CK(cudaMemcpy(d, h.data(), n * 4, cudaMemcpyHostToDevice));
}

void fill_bf16(void* d, size_t n, float scale, float offset = 0.f) {
  std::vector<uint16_t> h(n);
  for (auto& v : h) {
    const float f = offset + scale * urand();
    uint32_t u;
    std::memcpy(&u, &f, 4);
    v = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  CK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Model {
  const char* name;
  std::string tail;
  int nops;  // operands of width N (last may be 1: m84 scale)
  bool scale1;
  bool bn_state;
  DType dtype = DType::F32;
};

int main(int argc, char** argv) {
  const int64_t M = 1024, K = 8192, N = 8192;
  const int reps = argc > 1 ? std::atoi(argv[1]) : 30;
  std::vector<Model> models = {
      {"m22", "mul b=2.0\nadd b=v1\nclamp lo=-10 hi=10\nlogsumexp keepdim=1\nmish\nmul b=v4", 0, false, false},
      {"m84", "batch_norm training=1 eps=1e-05 momentum=0.1 weight=t0 bias=t1 running_mean=s0 "
              "running_var=s1 num_batches=s2\nmul b=t2\nsoftmax", 3, true, true},
      {"m84-bf16", "batch_norm training=1 eps=1e-05 momentum=0.1 weight=t0 bias=t1 running_mean=s0 "
              "running_var=s1 num_batches=s2\nmul b=t2\nsoftmax", 3, true, true, DType::BF16},
      {"m94", "add b=t0\nclamp lo=-1 hi=1\nmish\ngroup_norm groups=256 eps=1e-05 weight=t1 bias=t2", 3, false, false},
      {"m99", "gelu\nsoftmax", 0, false, false},
  };
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  Buf flush(size_t(256) << 20);
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  auto do_flush = [&] { CK(cudaMemsetAsync(flush.p, 0, size_t(256) << 20, st)); };

  Buf w(sizeof(float) * N * K), bias(sizeof(float) * N);
  fill(w.p, N * K, 1.f / std::sqrt(float(K)));
  fill(bias.p, N, 1.f / std::sqrt(float(K)));
  Buf wb(2 * N * K), biasb(2 * N);
  fill_bf16(wb.p, N * K, 1.f / std::sqrt(float(K)));
  fill_bf16(biasb.p, N, 1.f / std::sqrt(float(K)));
  std::vector<std::unique_ptr<Buf>> xs, xbs;
  for (int i = 0; i < 3; ++i) {
    xs.push_back(std::make_unique<Buf>(sizeof(float) * M * K));
    fill(xs.back()->p, M * K, 1.f);
    xbs.push_back(std::make_unique<Buf>(2 * M * K));
    fill_bf16(xbs.back()->p, M * K, 1.f);
  }

  for (const Model& md : models) {
    const bool bf = md.dtype == DType::BF16;
    for (Precision pr : {Precision::Fast, Precision::TF32}) {
      if (pr == Precision::TF32 && std::string(md.name) != "m84" && std::string(md.name) != "m99")
        continue;
      if (bf && pr != Precision::Fast) continue;
      const std::string spec = "linear in=" + std::to_string(K) + " out=" + std::to_string(N) +
                               " bias=1\n" + md.tail;
      PlanRequest req;
      req.chain = parse_chain(spec);
      req.batch_sizes = {M};
      for (int i = 0; i < md.nops; ++i)
        req.operand_sizes.push_back({(md.scale1 && i == md.nops - 1) ? 1 : N});
      req.precision = pr;
      req.dtype = md.dtype;
      const Plan plan = make_plan(req);
      std::printf("\n=== %s %s\n%s", md.name, precision_name(pr), plan.describe().c_str());
      CudaExecutor ex;
      std::vector<std::unique_ptr<Buf>> ops, state, outs, wss;
      RunArgs args;
      args.weight = bf ? wb.p : w.p;
      args.bias = bf ? biasb.p : bias.p;
      for (int i = 0; i < md.nops; ++i) {
        const int64_t n = (md.scale1 && i == md.nops - 1) ? 1 : N;
        ops.push_back(std::make_unique<Buf>(sizeof(float) * n));
        fill(ops.back()->p, n, 0.5f, 1.f);
        args.operands.push_back(static_cast<const float*>(ops.back()->p));
      }
      if (md.bn_state) {
        for (int i = 0; i < 2; ++i) {
          state.push_back(std::make_unique<Buf>(sizeof(float) * N));
          fill(state.back()->p, N, 0.25f, i == 0 ? 0.f : 1.f);
          args.state.push_back(state.back()->p);
        }
        state.push_back(std::make_unique<Buf>(8));
        CK(cudaMemset(state.back()->p, 0, 8));
        args.state.push_back(state.back()->p);
      }
      args.stream = st;
      Buf prepared(ex.prepared_bytes(plan));
      const size_t wsb = ex.workspace_bytes(plan), outb = (bf ? 2 : 4) * M * plan.out_width;
      for (int i = 0; i < 3; ++i) {
        wss.push_back(std::make_unique<Buf>(wsb));
        outs.push_back(std::make_unique<Buf>(outb));
      }
      auto& X = bf ? xbs : xs;
      args.x = X[0]->p;
      args.out = outs[0]->p;
      ex.prepare(plan, args, prepared.p);
      auto run_set = [&](int i) {
        RunArgs r = args;
        r.x = X[i]->p;
        r.out = outs[i]->p;
        ex.run(plan, r, prepared.p, wss[i]->p);
      };
      // 0 head, 1 new, 2 new again (the run-to-run spread), 3 alt (see the top of the file).
      constexpr int kModes = 4;
      const char* names[kModes] = {"head", "new", "new again", "alt"};  // new twice: the spread
      auto set_mode = [&](int mode) {
        cuda::set_register_rows(true);
        cuda::set_vector_colstats(true);
        cuda::set_register_one_value(mode != 0);
        cuda::set_fused_colstats(mode == 0 ? 0 : mode == 3 ? 4 : 1);
        cuda::set_register_wide_threads(512);
      };
      // Outputs of every mode against head's (same inputs, set 0; running stats advance).
      auto output = [&]() {
        std::vector<float> o(M * plan.out_width);
        if (bf) {
          std::vector<uint16_t> h(o.size());
          CK(cudaMemcpy(h.data(), outs[0]->p, outb, cudaMemcpyDeviceToHost));
          for (size_t i = 0; i < o.size(); ++i) {
            const uint32_t u = static_cast<uint32_t>(h[i]) << 16;
            std::memcpy(&o[i], &u, 4);
          }
        } else {
          CK(cudaMemcpy(o.data(), outs[0]->p, outb, cudaMemcpyDeviceToHost));
        }
        return o;
      };
      set_mode(0);
      run_set(0);
      const std::vector<float> o_old = output();
      double mref = 0;
      for (float v : o_old) mref = std::max(mref, (double)std::fabs(v));
      for (int mode = 1; mode < kModes; ++mode) {
        set_mode(mode);
        run_set(0);
        const std::vector<float> o = output();
        double md_ = 0;
        for (size_t i = 0; i < o_old.size(); ++i)
          md_ = std::max(md_, (double)std::fabs(o_old[i] - o[i]));
        std::printf("head vs %s output: max |diff| %.3g (max |out| %.3g)\n", names[mode], md_, mref);
      }
      for (int i = 0; i < 3; ++i) run_set(i);  // every workspace holds Y and stats
      CK(cudaStreamSynchronize(st));

      // End to end, old and new interleaved.
      std::vector<float> e2e[kModes];
      for (int it = 0; it < reps + 3; ++it)
        for (int mode = 0; mode < kModes; ++mode) {
          set_mode(mode);
          do_flush();
          CK(cudaEventRecord(a, st));
          run_set(it % 3);
          CK(cudaEventRecord(b, st));
          CK(cudaEventSynchronize(b));
          float ms = 0;
          CK(cudaEventElapsedTime(&ms, a, b));
          if (it >= 3) e2e[mode].push_back(ms);
        }
      std::printf("end to end ms:");
      for (int mode = 0; mode < kModes; ++mode) std::printf("  %s %.4f", names[mode], median(e2e[mode]));
      std::printf("\n");

      // Each row pass / column-stat step alone (cold L2).
      const cuda::WorkspaceLayout L = cuda::workspace_layout(plan);
      for (size_t si = 0; si < plan.steps.size(); ++si) {
        const Step& s = plan.steps[si];
        if (s.kind != Step::Kind::RowPass && s.kind != Step::Kind::ColumnStats) continue;
        std::vector<float> t[kModes];
        for (int it = 0; it < reps + 3; ++it)
          for (int mode = 0; mode < kModes; ++mode) {
            set_mode(mode);
            const int i = it % 3;
            char* ws = static_cast<char*>(wss[i]->p);
            RunArgs r = args;
            r.x = X[i]->p;
            r.out = outs[i]->p;
            // As in a run: the whole run first (its GEMM leaves Y partly in L2), then the step.
            run_set(i);
            CK(cudaEventRecord(a, st));
            if (s.kind == Step::Kind::RowPass)
              cuda::launch_row_pass(plan, s, r, ws,
                                    L.row_scratch != cuda::kAbsent ? reinterpret_cast<float*>(ws + L.row_scratch) : nullptr,
                                    st);
            else
              cuda::launch_column_stats(plan, s, r, ws,
                                        reinterpret_cast<double*>(ws + L.colstats), st);
            CK(cudaEventRecord(b, st));
            CK(cudaEventSynchronize(b));
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, a, b));
            if (it >= 3) t[mode].push_back(ms);
          }
        std::printf("step %zu %-11s us:", si + 1,
                    s.kind == Step::Kind::RowPass ? "RowPass" : "ColumnStats");
        for (int mode = 0; mode < kModes; ++mode) std::printf("  %s %.1f", names[mode], 1e3 * median(t[mode]));
        std::printf("\n");
      }
    }
  }
  std::printf("\ndone\n");
  return 0;
}
