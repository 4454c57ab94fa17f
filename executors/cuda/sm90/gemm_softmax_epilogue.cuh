// The fused kernel's tile epilogues: bias, activation, scale, the tile's row max and sum of
// exp, and e = exp(v - max) stashed as fp16. tile_epilogue runs a whole tile at once;
// DeferredTile splits it into a prepare and rounds that run between the next tile's k-steps.
// Part of gemm_softmax.cu, included there once, after its tile constants and the CUTLASS
// headers (internal linkage: anonymous namespace).
#pragma once

#include "gemm_softmax_device.cuh"

namespace gemmfuse::cuda::sm90 {
namespace {

using namespace cute;

// The exp2 shift for a reference (row max) ref: exp(v - ref) = 2^(v log2 e - shift). An
// all -inf row part gets 0, so its values give e = 0 and its sum 0 instead of NaN.
__device__ __forceinline__ float exp2_shift(float ref) { return ref == -HUGE_VALF ? 0.f : ref * kLog2e; }

// Whether exp(v - ref) needs v - ref first (tile_epilogue), as PyTorch's softmax computes it,
// rather than one FMA against the shift: for a finite |ref| past 2^22. The FMA form is
// 2^(v log2 e - fl(ref log2 e)), and fl rounds by up to half an ulp of ref log2 e, d, which
// scales every exp of the row part by 2^d; the parts are merged with exact differences of
// their maxima (merge_stats), so d does not cancel. Up to 2^22, |d| <= 1/4 (an error the size
// of the rounding of v itself); past it d grows with ref: the exps leave fp16's range (the
// stash) from ~2^27 and overflow ex2 from ~2^30, and past 2^126 the shift itself overflows.
__device__ __forceinline__ bool needs_exact_shift(float ref) {
  const float a = fabsf(ref);
  return a > 0x1p22f && a <= FLT_MAX;
}

// e = exp(c v - ref) of a value pair (a, b) of one row, mul = c log2 e (c: a scale the
// values have not taken yet, or 1): added to that row's sum and written as an fp16 pair to
// dst (the pair's stash word).
__device__ __forceinline__ void stash_exp_pair(float a, float b, float mul, float shift, float& sum,
                                               void* dst) {
  const float e0 = ex2(fmaf(a, mul, -shift)), e1 = ex2(fmaf(b, mul, -shift));
  sum += e0 + e1;
  *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(e0, e1);
}

// v = act(acc + bias) * scale over one tile's accumulator, in place; columns past N are -inf.
// The epilogue is bound by instruction issue (8 warps, 128 values each, while the tensor
// cores wait), so every operation per value counts.
template <class K, class Acc, class Coord>
__device__ __forceinline__ void tile_values(const typename K::Params& p, Acc& acc, const Coord& coord,
                                            int col0, int j, typename K::SharedStorage& S,
                                            bool bias_added) {
  constexpr int kVals = decltype(size(acc))::value;
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kVals; i += 2) {
    if (!bias_added) {
      const float2 b = *reinterpret_cast<const float2*>(&S.bias[j][get<1>(coord(i))]);
      acc(i) += b.x;
      acc(i + 1) += b.y;
    }
    amax = fmaxf(amax, fmaxf(fabsf(acc(i)), fabsf(acc(i + 1))));
  }
  if (p.act == static_cast<int>(Activation::GeluErf)) {
    // The 12-operation polynomial where the whole warp is in its range (NaN fails the test
    // and takes erff too), else the erff form.
    if (__all_sync(0xffffffffu, amax <= kGeluPolyRange)) {
#pragma unroll
      for (int i = 0; i < kVals; ++i) acc(i) = gelu_erf_poly(acc(i));
    } else {
      const PointwiseParams pp{};
#pragma unroll
      for (int i = 0; i < kVals; ++i) acc(i) = apply_unary(OpCode::GeluErf, acc(i), pp);
    }
  }
  if (p.scale != 1.f) {
#pragma unroll
    for (int i = 0; i < kVals; ++i) acc(i) = acc(i) * p.scale;
  }
  if (col0 + kTileN > p.N) {  // the last column tile of a ragged N: columns past N are -inf
#pragma unroll
    for (int i = 0; i < kVals; ++i)
      if (col0 + get<1>(coord(i)) >= p.N) acc(i) = -HUGE_VALF;
  }
}

// The row max and sum of exp(v - max) over the tile's columns to S.tile_max/tile_sum[j], and
// e = exp(v - max) as fp16 into `stash` [128][kStashStride].
template <class K, class Acc, class Coord>
__device__ __forceinline__ void tile_exp_stats(Acc& acc, const Coord& coord, int j,
                                               typename K::SharedStorage& S, __half* stash) {
  constexpr int kVals = decltype(size(acc))::value;
  // Plain max: a NaN is dropped here but makes the tile's sum NaN, which the row merge
  // propagates to the whole row (as softmax does).
  float mx[2] = {-HUGE_VALF, -HUGE_VALF};
#pragma unroll
  for (int i = 0; i < kVals; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], acc(i));
  float shift[2], sum[2] = {0.f, 0.f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = quad_reduce(mx[h], max_of);
    shift[h] = exp2_shift(mx[h]);
  }
  // A finite row maximum past 2^22 (needs_exact_shift): v - max first, as PyTorch's softmax
  // computes it. Rare (the deferred path sends such warps here), so a branch.
  if (__any_sync(0xffffffffu, needs_exact_shift(mx[0]) || needs_exact_shift(mx[1]))) {
    float off[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      off[h] = needs_exact_shift(mx[h]) ? mx[h] : 0.f;
      shift[h] = exp2_shift(mx[h] - off[h]);
    }
#pragma unroll
    for (int i = 0; i < kVals; ++i) acc(i) -= off[(i >> 1) & 1];
  }
#pragma unroll
  for (int i = 0; i < kVals; i += 2) {
    const int h = (i >> 1) & 1;
    stash_exp_pair(acc(i), acc(i + 1), kLog2e, shift[h], sum[h],
                   stash + get<0>(coord(i)) * kStashStride + get<1>(coord(i)));
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) sum[h] = quad_reduce(sum[h], add);
  if ((threadIdx.x & 3) == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = get<0>(coord(2 * h));
      S.tile_max[j][r] = mx[h];
      S.tile_sum[j][r] = sum[h];
    }
  }
}

// Epilogue of one tile, by the 256 consumer threads: v = act(acc + bias) * scale (columns
// past N are -inf), the row max and sum of exp(v - max) over the tile's columns to
// S.tile_max/tile_sum[j], and e = exp(v - max) as fp16 into `stash` [128][kStashStride].
template <class K, class Acc, class Coord>
__device__ __forceinline__ void tile_epilogue(const typename K::Params& p, Acc& acc,
                                              const Coord& coord, TileCoord t, int j,
                                              typename K::SharedStorage& S, __half* stash,
                                              bool bias_added = false) {
  static_assert(decltype(size(acc))::value == 128, "64 rows x 256 columns per warpgroup");
  // Value i of the wgmma accumulator sits in row r0 + 8 * ((i >> 1) & 1) and its pairs
  // (i, i + 1) are adjacent columns (CuTe's SM90 64xN accumulator layout).
  tile_values<K>(p, acc, coord, t.n_blk * kTileN, j, S, bias_added);
  tile_exp_stats<K>(acc, coord, j, S, stash);
}

// The epilogue of a CTA's first tile when it has a second, finished under the second tile's
// mainloop (while the tensor cores work) instead of between the two mainloops.
// - Right after the first mainloop, only the cheap part runs (prepare): the bias, each row's
//   largest value u (and, rarely, its smallest), and from them the row's reference for exp;
//   then the even value of each pair (i, i + 1) is parked as fp32 in the stash word where the
//   pair's fp16 result goes, and the odd one stays in a register (keep). The 128
//   accumulators are then free for the second tile.
// - Between the second mainloop's k-steps, step(u) finishes two pairs: act, exp, the row sum,
//   the fp16 pair written over the parked value. Each thread touches only its own words.
//   The steps run in kRounds rounds of kStepsPerRound, a loop, not unrolled: code run once
//   per tile is fetched while the mainloop loads L2 heavily, and 32 unrolled steps (~60 KB of
//   instructions) would slow the mainloop (docs/measurements.md, "The fused softmax
//   kernel"). A register array can only be indexed statically, so each round takes
//   keep[0 .. kPairsPerRound) and shifts the rest down.
// The reference must be the row part's max of v = act(u) * scale, scale >= 0. It comes from
// the extremes: the identity's is at the largest u; gelu falls on (-inf, -0.75] and rises
// after, so over any set of u its largest value is at the smallest or the largest u (at the
// largest when that is >= 0). defers_epilogues() says when; otherwise tile_epilogue runs for
// every tile.
// The gelu form is chosen per warp, the cheapest whose range holds all of its values (Gelu: 7,
// 12 or 15 operations per value); with the full-range form any finite data stays on this path
// (it runs slower on tile_epilogue's erff form; docs/measurements.md, "The fused softmax
// kernel"). A warp with an infinity or a row reference past 2^22 (see needs_exact_shift), and
// a tile with columns past N, run tile_epilogue at once (pending false): the erff form, the
// subtraction and the masking stay out of the loop.
// The last tile, with no next mainloop, takes the same prepare and then run_alone: every
// round at once. Not tile_epilogue: its ~40 KB of unrolled code, run once per launch, is
// fetched from memory then and takes longer than when run a second time; the rounds' loop
// stays in the instruction cache (docs/measurements.md, "The fused softmax kernel").
template <class K>
struct DeferredTile {
  static constexpr int kPairs = 64;          // value pairs per thread (128 values)
  static constexpr int kPairsPerStep = 2;
  static constexpr int kStepsPerRound = 4;
  static constexpr int kPairsPerRound = kPairsPerStep * kStepsPerRound;
  static constexpr int kRounds = kPairs / kPairsPerRound;
  float keep[kPairs];  // the odd value u of each pair not yet finished, in order
  float shift[2];      // reference * log2 e of the thread's two rows
  float mul;           // scale * log2 e: the scale is applied in the exp (stash_exp_pair)
  float sum[2];        // sum of exp(v - reference) over the thread's values of each row
  int round = 0;         // rounds finished
  bool pending = false;  // warp-uniform: this warp's values wait for the steps
  // Warp-uniform: the gelu form, the cheapest whose range holds all of the warp's values:
  // |u| < kGeluNarrowRange, |u| <= kGeluPolyRange, or any finite u (and NaN).
  enum class Gelu : uint8_t { Narrow, Poly, Wide } form = Gelu::Narrow;

  // v = act(u) for n values, one branch for all (so their chains interleave); hook(j, steps)
  // runs between the polynomial's steps (all of it at once for the identity), inside each
  // branch, so that independent work can interleave with the chains. Read from the kernel's
  // parameters (constant memory), not kept in registers.
  template <int n, class Hook = NoHornerHook>
  __device__ __forceinline__ void act(const typename K::Params& p, float (&v)[n], Hook hook = Hook{}) const {
    if (p.act == static_cast<int>(Activation::GeluErf)) {
      if (form == Gelu::Narrow) gelu_erf_poly_narrow_n(v, hook);
      else if (form == Gelu::Poly) gelu_erf_poly_n(v, hook);
      else gelu_erf_wide_n(v, hook);
    } else {
      hook(0, 1);
    }
  }

  // v = act(u) * scale, for the row extremes (the reference must be a value's own max).
  template <int n>
  __device__ __forceinline__ void act_scaled(const typename K::Params& p, float (&v)[n]) const {
    act(p, v);
    if (p.scale != 1.f) {
#pragma unroll
      for (int k = 0; k < n; ++k) v[k] *= p.scale;
    }
  }

  // acc: the tile's accumulators, left with the bias added. A tile with columns past N
  // leaves them all to tile_epilogue (pending false), which masks them.
  template <class Acc, class Coord>
  __device__ void prepare(const typename K::Params& p, Acc& acc, const Coord& coord, TileCoord t,
                          const float* bias, __half* stash, float* tile_max) {
    static_assert(decltype(size(acc))::value == 2 * kPairs, "64 rows x 256 columns per warpgroup");
    const bool gelu = p.act == static_cast<int>(Activation::GeluErf);
    round = 0;
    // Value i sits in row r0 + 8 * ((i >> 1) & 1); pair q = (2q, 2q + 1) in row half q & 1.
    // One pass: the bias, each row's largest u, and the OR of every value's bits (bit 30
    // clear in all of them: |u| < 2, the narrow polynomial's range) - a max and a 3-input OR
    // per pair where a min and a max cost twice the ALU issue (the prepares are exposed).
    float hi[2] = {-HUGE_VALF, -HUGE_VALF};
    uint32_t bits[4] = {0, 0, 0, 0};  // four OR chains, not one 64 deep
#pragma unroll
    for (int q = 0; q < kPairs; ++q) {
      const float2 b = *reinterpret_cast<const float2*>(&bias[get<1>(coord(2 * q))]);
      acc(2 * q) += b.x;
      acc(2 * q + 1) += b.y;
      hi[q & 1] = fmaxf(hi[q & 1], fmaxf(acc(2 * q), acc(2 * q + 1)));
      bits[q & 3] |= __float_as_uint(acc(2 * q)) | __float_as_uint(acc(2 * q + 1));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) hi[h] = quad_reduce(hi[h], max_of);
    const uint32_t all_bits = bits[0] | bits[1] | bits[2] | bits[3];
    // gelu's largest value over a row part is at its largest u when that is >= 0 (gelu(u) < 0
    // for every u < 0), else at its smallest or largest u; a warp out of the narrow range needs
    // max |u| too. Both are rare: the smallest u only then, in a second pass.
    float lo[2] = {hi[0], hi[1]};
    const bool narrow = gelu && __all_sync(0xffffffffu, (all_bits & 0x40000000u) == 0);
    if (gelu && (!narrow || __any_sync(0xffffffffu, hi[0] < 0.f || hi[1] < 0.f))) {
      lo[0] = lo[1] = HUGE_VALF;
#pragma unroll
      for (int q = 0; q < kPairs; ++q) lo[q & 1] = fminf(lo[q & 1], fminf(acc(2 * q), acc(2 * q + 1)));
#pragma unroll
      for (int h = 0; h < 2; ++h) lo[h] = quad_reduce(lo[h], min_of);
    }
    // The cheapest form whose range holds the whole warp's values; a warp with an infinity
    // goes to tile_epilogue (the erff form: gelu(-inf) is NaN there, as in PyTorch). fminf
    // and fmaxf drop NaN from the extremes; every form gives NaN for it.
    const float amax = fmaxf(fmaxf(-lo[0], hi[0]), fmaxf(-lo[1], hi[1]));
    form = narrow ? Gelu::Narrow
                  : __all_sync(0xffffffffu, amax <= kGeluPolyRange) ? Gelu::Poly : Gelu::Wide;
    pending = (t.n_blk + 1) * kTileN <= p.N &&
              (!gelu || form != Gelu::Wide || __all_sync(0xffffffffu, amax <= FLT_MAX));
    if (!pending) return;
    mul = p.scale * kLog2e;
    bool exact = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // An all-NaN row part has hi = -inf (fmaxf drops NaN): its sum is NaN whatever the
      // reference.
      float ends[2] = {lo[h], hi[h]};
      act_scaled(p, ends);
      const float ref = fmaxf(ends[0], ends[1]);
      shift[h] = exp2_shift(ref);
      exact |= needs_exact_shift(ref);
      sum[h] = 0.f;
      if ((threadIdx.x & 3) == 0) tile_max[get<0>(coord(2 * h))] = ref;
    }
    // A reference past 2^22: tile_epilogue, which subtracts it first (it rewrites tile_max).
    pending = !__any_sync(0xffffffffu, exact);
    if (!pending) return;
#pragma unroll
    for (int q = 0; q < kPairs; ++q) {
      *word(coord, stash, q) = acc(2 * q);
      keep[q] = acc(2 * q + 1);
    }
  }

  template <class Coord>
  static __device__ __forceinline__ float* word(const Coord& coord, __half* stash, int q) {
    return reinterpret_cast<float*>(stash + get<0>(coord(2 * q)) * kStashStride + get<1>(coord(2 * q)));
  }

  // Pairs q0 .. q0 + n - 1 of round `rnd` (q0 static): their stash words w and values
  // (u, from the word and keep[q0 + k]; call before that round's shift). Pair q of round r
  // sits r rounds' column stride after pair q of round 0 (same row).
  template <int n, class Coord>
  __device__ __forceinline__ void words(const Coord& coord, __half* stash, int q0, int rnd,
                                        float* (&w)[n]) const {
    const auto round_offset = rnd * (word(coord, stash, kPairsPerRound) - word(coord, stash, 0));
#pragma unroll
    for (int k = 0; k < n; ++k) w[k] = word(coord, stash, q0 + k) + round_offset;
  }
  template <int n>
  __device__ __forceinline__ void load_pairs(float* const (&w)[n], int q0, float (&v)[2 * n]) const {
#pragma unroll
    for (int k = 0; k < n; ++k) {
      v[2 * k] = *w[k];
      v[2 * k + 1] = keep[q0 + k];
    }
  }
  // Pairs k0 .. k1 - 1 of n finished ones (v = act(u)), pair k in row half (q0 + k) & 1: exp,
  // the row sums, the fp16 pairs written over the parked values.
  template <int n>
  __device__ __forceinline__ void exp_pairs(float* const (&w)[n], int q0, const float (&v)[2 * n],
                                            int k0, int k1) {
#pragma unroll
    for (int k = k0; k < k1; ++k) {
      const int h = (q0 + k) & 1;  // kPairsPerRound is even
      stash_exp_pair(v[2 * k], v[2 * k + 1], mul, shift[h], sum[h], w[k]);
    }
  }

  // Pairs q0 .. q0 + n - 1 of the current round (q0 static): act, exp, the row sums, the
  // fp16 pairs written over the parked values. Loads first, so that the n pairs' chains
  // interleave (a store would order later loads after it).
  template <int n, class Coord>
  __device__ __forceinline__ void finish_pairs(const typename K::Params& p, int q0, const Coord& coord,
                                               __half* stash) {
    float* w[n];
    float v[2 * n];
    words(coord, stash, q0, round, w);
    load_pairs(w, q0, v);
    act(p, v);
    exp_pairs(w, q0, v, 0, n);
  }

  // The round is done: the next round's pairs to the front.
  template <int kRoundsDone = 1>
  __device__ __forceinline__ void next_round() {
    constexpr int kShift = kRoundsDone * kPairsPerRound;
#pragma unroll
    for (int q = 0; q + kShift < kPairs; ++q) keep[q] = keep[q + kShift];
    round += kRoundsDone;
  }

  // Step u of the current round (u static), after a k-step of the next mainloop. The shift
  // is unconditional: taken on one branch only, it would keep both versions of keep alive
  // (and spill).
  template <class Coord>
  __device__ __forceinline__ void step(const typename K::Params& p, int u, const Coord& coord,
                                       __half* stash) {
    if (pending) finish_pairs<kPairsPerStep>(p, kPairsPerStep * u, coord, stash);
    if (u == kStepsPerRound - 1) next_round();
  }

  // For the last tile, which has no next mainloop: every round at once, two rounds' pairs
  // per pass (16 chains to interleave, half the shifts of keep; faster than one round per
  // pass: docs/measurements.md, "The fused softmax kernel"), software-pipelined: a pass
  // evaluates its pairs' polynomials with the previous pass's exps placed between the
  // steps, so that the MUFU works while the FMA pipe does (one pass alone issues its 32
  // ex2 after all of its polynomials, with little else to issue beside them).
  template <class Coord>
  __device__ void run_alone(const typename K::Params& p, const Coord& coord, __half* stash) {
    if (!pending) return;
    constexpr int kMerged = 2;  // rounds per pass
    constexpr int n = kMerged * kPairsPerRound;
    float* w[n];
    float v[2 * n];
    words(coord, stash, 0, round, w);
    load_pairs(w, 0, v);
    act(p, v);
    next_round<kMerged>();
#pragma unroll 1
    for (int r = kMerged; r < kRounds; r += kMerged) {
      float* wn[n];
      float vn[2 * n];
      words(coord, stash, 0, round, wn);
      load_pairs(wn, 0, vn);
      act(p, vn, [&](int j, int steps) { exp_pairs(w, 0, v, j * n / steps, (j + 1) * n / steps); });
#pragma unroll
      for (int k = 0; k < n; ++k) {
        w[k] = wn[k];
        v[2 * k] = vn[2 * k];
        v[2 * k + 1] = vn[2 * k + 1];
      }
      next_round<kMerged>();
    }
    exp_pairs(w, 0, v, 0, n);
  }

  // The tile's row sums (prepare wrote the row maxes), once every step has run.
  template <class Coord>
  __device__ void finish(const Coord& coord, float* tile_sum) {
    if (!pending) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) sum[h] = quad_reduce(sum[h], add);
    if ((threadIdx.x & 3) == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) tile_sum[get<0>(coord(2 * h))] = sum[h];
    }
  }
};

}  // namespace
}  // namespace gemmfuse::cuda::sm90
