// The fused kernel's tail: the CTAs of one m-block exchange their row statistics (published
// with the launch's epoch, read without a barrier), then each CTA scales its stashed tiles
// and stores the output.
// Part of gemm_softmax.cu, included there once, after its tile constants and the CUTLASS
// headers (internal linkage: anonymous namespace).
#pragma once

#include "gemm_softmax_device.cuh"

namespace gemmfuse::cuda::sm90 {
namespace {

using namespace cute;

// out = e * exp(m_tile - m_row) / s_row for one stashed tile, 16-byte stores along rows.
// Each thread keeps one 8-column chunk and walks down the tile's rows, 8 apart (a warp
// writes 512 contiguous bytes of a row per store). Address arithmetic stays out of the loop
// (pointer steps, no per-element bounds checks for whole tiles): ~28 instructions per chunk.
// The phase is exposed after the row merge and bound by memory: it takes as long with ~48
// instructions per chunk as with 28 (16 MB at the seed shape; docs/measurements.md, "The
// fused softmax kernel").
template <class K>
__device__ __forceinline__ void store_tile(const typename K::Params& p, const __half* stash,
                                           const float* row_scale, TileCoord t, int ctid) {
  using T = typename K::Element;
  constexpr int kChunks = kTileN / 8;                 // 16-byte chunks per tile row
  constexpr int kRowStep = kConsumers / kChunks;      // rows between a thread's chunks
  const int row0 = t.m_blk * kTileM;
  const int c8 = ctid % kChunks, r = ctid / kChunks;
  const int col = t.n_blk * kTileN + 8 * c8;
  if (col >= p.N) return;  // N is a multiple of 8: a chunk is wholly inside or outside
  auto* out = static_cast<uint4*>(p.out) + (static_cast<size_t>(row0 + r) * p.N + col) / 8;
  const size_t out_step = static_cast<size_t>(kRowStep) * p.N / 8;
  const __half* src = stash + r * kStashStride + 8 * c8;
  const float* scale = row_scale + r;
  auto one = [&](int i) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src + i * kRowStep * kStashStride);
    const __half2* e = reinterpret_cast<const __half2*>(&raw);
    const float s = scale[i * kRowStep];
    uint4 o;
    uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = __half22float2(e[k]);
      ow[k] = pack_out<T>(f.x * s, f.y * s);
    }
    out[i * out_step] = o;
  };
  const int rows = min(kTileM, p.M - row0);
  if (rows == kTileM) {
#pragma unroll
    for (int i = 0; i < kTileM / kRowStep; ++i) one(i);
  } else {
#pragma unroll 1
    for (int i = 0; r + i * kRowStep < rows; ++i) one(i);
  }
}

// The CTAs of one m-block exchange their row statistics without a barrier: each word holds
// one value in its low half and the launch's epoch in its high half; each 64-bit element of
// the v2 accesses is single-copy atomic, so a reader that sees the epoch sees the value (no fence, no flag:
// one trip to L2 each way). Every epoch is used once per buffer: a direct launch takes the
// next one of its stream's buffer, a captured graph clears its buffer before each replay.
// Every CTA is resident at once (see launch()), so each wait ends.
template <class P>
__device__ __forceinline__ void publish_row_stats(const P& p, size_t slot, float m, float s) {
  const unsigned long long tag = static_cast<unsigned long long>(p.epoch) << 32;
  asm volatile("st.relaxed.gpu.global.v2.u64 [%0], {%1, %2};" ::"l"(p.row_stats + 2 * slot),
               "l"(tag | __float_as_uint(m)), "l"(tag | __float_as_uint(s))
               : "memory");
}

// (max, sum) of row `row` over column groups g0 .. g0 + 15 (past n_groups: (-inf, 0)),
// waiting until each has this launch's epoch. The pending ones are re-read together.
template <class P>
__device__ __forceinline__ void read_row_stats(const P& p, int row, int g0, float2 (&q)[16]) {
  // Group g0 + k's word of this row: src + k * stride (one 64-bit add each, not a product).
  const unsigned long long* src = p.row_stats + 2 * (static_cast<size_t>(g0) * p.M + row);
  const size_t stride = 2 * static_cast<size_t>(p.M);
  uint32_t pending = (1u << min(16, p.n_groups - g0)) - 1u;
#pragma unroll
  for (int k = 0; k < 16; ++k) q[k] = make_float2(-HUGE_VALF, 0.f);
  unsigned long long w[16][2] = {};  // (read by the selects below even where not loaded)
  do {  // (g0 < n_groups: at least one is pending)
#pragma unroll
    for (int k = 0; k < 16; ++k)
      if (pending & (1u << k))
        asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];"
                     : "+l"(w[k][0]), "+l"(w[k][1])
                     : "l"(src + k * stride)
                     : "memory");
    // Selects, not branches (the tail's code: see exp_from).
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const bool in = ((pending >> k) & 1u) & ((w[k][0] >> 32) == p.epoch) & ((w[k][1] >> 32) == p.epoch);
      q[k].x = in ? __uint_as_float(static_cast<uint32_t>(w[k][0])) : q[k].x;
      q[k].y = in ? __uint_as_float(static_cast<uint32_t>(w[k][1])) : q[k].y;
      pending &= in ? ~(1u << k) : ~0u;
    }
  } while (pending != 0);
}

// Whether the epilogues go through DeferredTile (else tile_epilogue for each tile): the
// reference for exp must come from a row's extremes (see DeferredTile).
template <class P>
__device__ __forceinline__ bool defers_epilogues(const P& p) {
  return p.defer && p.scale >= 0.f;
}

}  // namespace
}  // namespace gemmfuse::cuda::sm90
