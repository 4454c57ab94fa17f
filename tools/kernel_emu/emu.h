// Host emulation of a CUDA block: threads as fibers (ucontext), __syncthreads and warp collectives
// as cooperative barriers; mma.sync m16n8k16 emulated from the PTX fragment layout.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <ucontext.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <functional>
#include <random>
#include <algorithm>
#include <map>
#include <stdexcept>
using std::isfinite; using std::isnan;

namespace emu {
enum { READY, WAIT_BLOCK, WAIT_WARP, DONE };
struct PendingCopy { void* dst; const void* src; bool valid; };
struct Fiber { ucontext_t ctx; uint3 tid; int lin; int state; std::vector<char> stack; std::vector<PendingCopy> copies; };
struct WarpSlot { uint32_t a[32][4]; uint32_t b[32][2]; double v[32]; int p[32]; const uint16_t* ptr[32]; };
inline Fiber* cur = nullptr;
inline ucontext_t sched_ctx;
inline uint3 cur_block;
inline dim3 cur_blockDim, cur_gridDim;
inline std::function<void()> cur_fn;
inline std::vector<WarpSlot> warps;
inline std::vector<int> block_vals;
alignas(16) inline unsigned char dyn_smem[256 * 1024];
inline std::mt19937 rng(12345);
inline std::map<const void*, int> opted_smem;
inline long warnings = 0;
inline long mma_count = 0;

inline void wait(int st) { cur->state = st; swapcontext(&cur->ctx, &sched_ctx); }
inline int lane() { return cur->lin & 31; }
inline WarpSlot& slot() { return warps[cur->lin / 32]; }

inline float h2f(uint32_t r, int hi) { uint16_t b = hi ? (r >> 16) : (r & 0xffff); __half h; std::memcpy(&h, &b, 2); return __half2float(h); }

inline void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  WarpSlot& s = slot();
  const int l = lane();
  for (int i = 0; i < 4; ++i) s.a[l][i] = a[i];
  s.b[l][0] = b0, s.b[l][1] = b1;
  wait(WAIT_WARP);
  const int g = l / 4, t = l % 4;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    static const int rz = getenv("EMU_RZ") ? atoi(getenv("EMU_RZ")) : 0;
    double prod[16];
    for (int k = 0; k < 16; ++k) {
      const int al = (row % 8) * 4 + (k % 8) / 2, ar = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
      const int bl = col * 4 + (k % 8) / 2, br = k >= 8 ? 1 : 0;
      prod[k] = double(h2f(s.a[al][ar], k & 1)) * double(h2f(s.b[bl][br], k & 1));
    }
    if (!rz) {
      double sum = 0;
      for (int k = 0; k < 16; ++k) sum += prod[k];
      out[i] = float(double(c[i]) + sum);
    } else {
      // model: per group of `rz` products (8 or 16): terms aligned to the largest, truncated to 24 bits, RZ result
      float acc = c[i];
      for (int k0 = 0; k0 < 16; k0 += rz) {
        double terms[17]; int nt = 0; terms[nt++] = acc;
        for (int k = k0; k < k0 + rz; ++k) terms[nt++] = prod[k];
        int E = -100000; for (int j = 0; j < nt; ++j) if (terms[j] != 0) { int e; frexp(terms[j], &e); E = std::max(E, e); }
        if (E == -100000) { acc = 0.f; continue; }
        static const int xb = getenv("EMU_XB") ? atoi(getenv("EMU_XB")) : 0; const double q = ldexp(1.0, E - 24 - xb);
        double sum = 0; for (int j = 0; j < nt; ++j) sum += std::trunc(terms[j] / q) * q;
        float f = float(sum);  // RN; make RZ
        if (std::fabs(double(f)) > std::fabs(sum)) f = std::nextafter(f, 0.f);
        acc = f;
      }
      out[i] = acc;
    }
  }
  wait(WAIT_WARP);
  for (int i = 0; i < 4; ++i) c[i] = out[i];
  ++mma_count;
}

// ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16: lanes 0-15 give the rows' addresses (matrix
// j's row r from lane 8 j + r); each lane gets, of matrix j, rows 2t and 2t + 1 at column g
// (t = lane % 4, g = lane / 4), the lower half from row 2t.
// cp.async 16 bytes (zeros where !valid): queued per thread and done at its wait_all, so a read
// of the destination before the wait and the barrier sees stale data (0xFF at a block's start).
inline void cp_async16(void* dst, const void* src, bool valid) {
  if ((reinterpret_cast<uintptr_t>(dst) | (valid ? reinterpret_cast<uintptr_t>(src) : 0)) & 15) {
    std::fprintf(stderr, "EMU: cp.async address not 16-byte aligned (%p <- %p)\n", dst, src);
    std::abort();
  }
  cur->copies.push_back({dst, src, valid});
}
inline void cp_async_wait_all() {
  for (const PendingCopy& c : cur->copies) {
    if (c.valid) std::memcpy(c.dst, c.src, 16);
    else std::memset(c.dst, 0, 16);
  }
  cur->copies.clear();
}

// An ldmatrix's row addresses, each lane's gathered into the warp's slot (lanes below `lanes`
// give rows: their addresses must be 16-byte aligned); returns the slot after the warp's barrier.
inline WarpSlot& ldsm_rows(const void* row, int lanes) {
  WarpSlot& s = slot();
  const int l = lane();
  s.ptr[l] = static_cast<const uint16_t*>(row);
  if (l < lanes && (reinterpret_cast<uintptr_t>(row) & 15)) {
    std::fprintf(stderr, "EMU: ldmatrix row address %p not 16-byte aligned\n", row);
    std::abort();
  }
  wait(WAIT_WARP);
  return s;
}

// ldmatrix .x2 .trans: lanes 0-15 give rows k0 .. k0 + 15; b_j = values (2t, 2t + 1) of column g.
inline void ldsm_x2_trans(uint32_t& b0, uint32_t& b1, const void* row) {
  WarpSlot& s = ldsm_rows(row, 16);
  const int g = lane() / 4, t = lane() % 4;
  uint32_t r[2];
  for (int j = 0; j < 2; ++j)
    r[j] = uint32_t(s.ptr[8 * j + 2 * t][g]) | (uint32_t(s.ptr[8 * j + 2 * t + 1][g]) << 16);
  wait(WAIT_WARP);
  b0 = r[0], b1 = r[1];
}

// ldmatrix .x4 (not transposed): lanes 8 j .. 8 j + 7 give matrix j's rows; r[j] = row g's
// values 2t, 2t + 1.
inline void ldsm_x4(uint32_t (&r)[4], const void* row) {
  WarpSlot& s = ldsm_rows(row, 32);
  const int g = lane() / 4, t = lane() % 4;
  uint32_t v[4];
  for (int j = 0; j < 4; ++j)
    v[j] = uint32_t(s.ptr[8 * j + g][2 * t]) | (uint32_t(s.ptr[8 * j + g][2 * t + 1]) << 16);
  wait(WAIT_WARP);
  for (int j = 0; j < 4; ++j) r[j] = v[j];
}

template <class T> inline T shfl_xor(T v, int m) {
  WarpSlot& s = slot(); const int l = lane();
  s.v[l] = double(v); wait(WAIT_WARP);
  T r = T(s.v[l ^ m]); wait(WAIT_WARP); return r;
}
inline int any_sync(int p) {
  WarpSlot& s = slot(); const int l = lane();
  s.p[l] = p; wait(WAIT_WARP);
  int r = 0; for (int i = 0; i < 32; ++i) r |= s.p[i] != 0;
  wait(WAIT_WARP); return r;
}
inline void syncthreads() { wait(WAIT_BLOCK); }
inline int syncthreads_or(int p) {
  block_vals[cur->lin] = p; syncthreads();
  int r = 0; for (int v : block_vals) r |= v != 0;
  syncthreads(); return r;
}

inline void tramp() { cur_fn(); }

template <class K, class... Args>
void launch(K kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t, Args... args) {
  const int nt = block.x * block.y * block.z;
  if (nt > 1024 || grid.y > 65535 || grid.z > 65535) { std::fprintf(stderr, "EMU: bad launch config grid %u %u block %d\n", grid.x, grid.y, nt); std::abort(); }
  if (smem > 48 * 1024) {
    auto it = opted_smem.find((const void*)kernel);
    if (it == opted_smem.end() || size_t(it->second) < smem) { std::fprintf(stderr, "EMU: dynamic smem %zu not opted in\n", smem); std::abort(); }
  }
  if (smem > 227 * 1024) { std::fprintf(stderr, "EMU: smem %zu too large\n", smem); std::abort(); }
  cur_gridDim = grid, cur_blockDim = block;
  if (getenv("EMU_TRACE")) std::fprintf(stderr, "EMU launch grid (%u,%u,%u) block (%u,%u,%u) smem %zu\n", grid.x, grid.y, grid.z, block.x, block.y, block.z, smem);
  for (unsigned bz = 0; bz < grid.z; ++bz)
  for (unsigned by = 0; by < grid.y; ++by)
  for (unsigned bx = 0; bx < grid.x; ++bx) {
    cur_block = make_uint3(bx, by, bz);
    std::memset(dyn_smem, 0xFF, sizeof dyn_smem);
    warps.assign((nt + 31) / 32, WarpSlot{});
    block_vals.assign(nt, 0);
    std::vector<Fiber> fibers(nt);
    cur_fn = [&] { kernel(args...); };
    for (int i = 0; i < nt; ++i) {
      Fiber& f = fibers[i];
      f.lin = i;
      f.tid = make_uint3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
      f.state = READY;
      f.stack.resize(128 * 1024);
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.data();
      f.ctx.uc_stack.ss_size = f.stack.size();
      f.ctx.uc_link = &sched_ctx;
      makecontext(&f.ctx, tramp, 0);
    }
    std::vector<int> order(nt);
    for (int i = 0; i < nt; ++i) order[i] = i;
    for (;;) {
      bool ran = false;
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<char> stall(warps.size());
      for (auto& x : stall) x = (rng() % 10) < 7;
      bool any_ready = false;
      for (auto& f : fibers) any_ready |= f.state == READY;
      for (int i : order) {
        Fiber& f = fibers[i];
        if (f.state != READY) continue;
        if (stall[i / 32]) continue;
        ran = true;
        cur = &f;
        f.state = -1;  // running; set by wait()
        swapcontext(&sched_ctx, &f.ctx);
        if (f.state == -1) f.state = DONE;  // returned
      }
      bool released = false, all_done = true;
      for (size_t w = 0; w < warps.size(); ++w) {
        int waiting = 0, alive = 0;
        for (int l = 0; l < 32 && int(w * 32 + l) < nt; ++l) {
          const int s = fibers[w * 32 + l].state;
          if (s != DONE) ++alive;
          if (s == WAIT_WARP) ++waiting;
        }
        if (alive && waiting == alive) {
          if (alive != std::min(32, nt - int(w * 32))) { ++warnings; std::fprintf(stderr, "EMU WARN: warp collective with exited lanes\n"); }
          for (int l = 0; l < 32 && int(w * 32 + l) < nt; ++l)
            if (fibers[w * 32 + l].state == WAIT_WARP) fibers[w * 32 + l].state = READY;
          released = true;
        }
      }
      int waiting = 0, alive = 0;
      for (auto& f : fibers) { if (f.state != DONE) ++alive, all_done = false; if (f.state == WAIT_BLOCK) ++waiting; }
      if (alive && waiting == alive) {
        if (alive != nt) { ++warnings; std::fprintf(stderr, "EMU WARN: __syncthreads with exited threads\n"); }
        for (auto& f : fibers) if (f.state == WAIT_BLOCK) f.state = READY;
        released = true;
      }
      if (all_done) break;
      if (!any_ready && !released) { std::fprintf(stderr, "EMU: deadlock\n"); std::abort(); }
    }
    for (auto& f : fibers)
      if (!f.copies.empty()) { std::fprintf(stderr, "EMU: a thread exited with cp.async copies not waited for\n"); std::abort(); }
  }
}

inline cudaError_t getDevice(int* d) { *d = 0; return cudaSuccess; }
template <class F> cudaError_t funcSetAttribute(F f, cudaFuncAttribute, int v) { opted_smem[(const void*)f] = v; return cudaSuccess; }
inline cudaError_t memsetAsync(void* p, int v, size_t n, cudaStream_t = 0) { std::memset(p, v, n); return cudaSuccess; }
}  // namespace emu

#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __global__
#define __global__
#undef __device__
#define __device__
#define threadIdx (emu::cur->tid)
#define blockIdx (emu::cur_block)
#define blockDim (emu::cur_blockDim)
#define gridDim (emu::cur_gridDim)
#define __syncthreads() emu::syncthreads()
#define __syncthreads_or(p) emu::syncthreads_or(p)
#define __shfl_xor_sync(m, v, o) emu::shfl_xor(v, o)
#define __any_sync(m, p) emu::any_sync(p)
inline float atomicAdd(float* p, float v) { float o = *p; *p = o + v; return o; }
// (fibers switch only at barriers and shuffles: a read-modify-write is atomic here)
inline int atomicMax(int* p, int v) { int o = *p; *p = o > v ? o : v; return o; }
inline int atomicOr(int* p, int v) { int o = *p; *p = o | v; return o; }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
// for the splits' column statistics (column_stats.cuh)
inline unsigned atomicMax(unsigned* p, unsigned v) { unsigned o = *p; *p = o > v ? o : v; return o; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
template <class T> T __ldg(const T* p) { return *p; }
using std::isinf;  // CUDA's global isinf, for split.h's helpers compiled as host code
namespace emu {
// ex2.approx.ftz.f32: 2^x (exactly here), results below 2^-126 flushed to 0
inline float ex2_ftz(float x) { const float y = std::exp2(x); return y < 0x1p-126f ? 0.f : y; }
}
#define cudaGetDevice emu::getDevice
#define cudaFuncSetAttribute emu::funcSetAttribute
#define cudaMemsetAsync emu::memsetAsync
// stubs for host-side device queries (attention_device_unfit): report an sm_90-like device
namespace emu {
inline cudaError_t deviceGetAttribute(int* v, cudaDeviceAttr attr, int) {
  *v = attr == cudaDevAttrComputeCapabilityMajor ? 9 : attr == cudaDevAttrMaxSharedMemoryPerBlockOptin ? 227 * 1024 : 0;
  return cudaSuccess;
}
inline cudaError_t getLastError() { return cudaSuccess; }
}
#define cudaDeviceGetAttribute emu::deviceGetAttribute
#define cudaGetLastError emu::getLastError
