// Pointwise formulas shared by the executors (executors/common/pointwise.h) against
// long-double references.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "pointwise.h"

namespace {

long double gelu_exact(long double x) { return 0.5L * x * (1.0L + std::erf(x / std::sqrt(2.0L))); }

// The polynomial gelu is within 1e-6 of the exact form on its whole range (its fit's bound
// is 6.6e-7), and no worse than 4x the erff form's own error anywhere on a fine grid.
TEST(Pointwise, GeluPolynomialMatchesTheErfFormOnItsRange) {
  using gemmfuse::gelu_erf_poly;
  using gemmfuse::kGeluPolyRange;
  const gemmfuse::PointwiseParams pp{};
  double worst_poly = 0, worst_erff = 0;
  const int n = 200000;
  for (int i = 0; i <= n; ++i) {
    const float x = -kGeluPolyRange + 2.0f * kGeluPolyRange * static_cast<float>(i) / n;
    const long double ref = gelu_exact(x);
    worst_poly = std::max(worst_poly, static_cast<double>(std::fabs(gelu_erf_poly(x) - ref)));
    worst_erff = std::max(
        worst_erff,
        static_cast<double>(std::fabs(gemmfuse::apply_unary(gemmfuse::OpCode::GeluErf, x, pp) - ref)));
  }
  EXPECT_LT(worst_poly, 1e-6);
  EXPECT_LT(worst_poly, 4 * worst_erff + 1e-7) << "erff form: " << worst_erff;
  EXPECT_EQ(gelu_erf_poly(0.f), 0.f);
  EXPECT_FLOAT_EQ(gelu_erf_poly(kGeluPolyRange), static_cast<float>(gelu_exact(kGeluPolyRange)));
}

// The degree-4 form for |x| <= 2 (the fused 16-bit kernel's warps whose values all lie
// there): within 1e-5 of the exact form (its fit's bound is 8.4e-6), 24x below the fp16
// rounding of the values it feeds (exp(v - max) <= 1, stashed as fp16: up to 2.4e-4).
TEST(Pointwise, NarrowGeluPolynomialMatchesTheErfFormOnItsRange) {
  using gemmfuse::kGeluNarrowRange;
  double worst_poly = 0;
  const int n = 200000;
  for (int i = 0; i <= n; ++i) {
    float v[1] = {-kGeluNarrowRange + 2.0f * kGeluNarrowRange * static_cast<float>(i) / n};
    const long double ref = gelu_exact(v[0]);
    gemmfuse::gelu_erf_poly_narrow_n(v);
    worst_poly = std::max(worst_poly, static_cast<double>(std::fabs(v[0] - ref)));
  }
  EXPECT_LT(worst_poly, 1e-5);
  EXPECT_LT(worst_poly, std::ldexp(1.0, -12) / 24);
  float zero[1] = {0.f};
  gemmfuse::gelu_erf_poly_narrow_n(zero);
  EXPECT_EQ(zero[0], 0.f);
}

// The full-range form (the fused 16-bit kernel's warps with values past the narrower forms'
// ranges): within 1e-5 of the exact form up to the largest float below 40 (its fit's bound is
// 8.4e-6), within 2e-7 relative above; NaN stays NaN.
TEST(Pointwise, WideGeluMatchesTheErfFormForEveryFiniteValue) {
  using gemmfuse::gelu_erf_wide;
  double worst_abs = 0, worst_rel = 0;
  const int n = 400000;
  for (int i = 0; i <= n; ++i) {
    const float x = -40.0f + 80.0f * static_cast<float>(i) / n;
    worst_abs = std::max(worst_abs, static_cast<double>(std::fabs(gelu_erf_wide(x) - gelu_exact(x))));
  }
  for (float a = 40.0f; std::isfinite(a); a *= 1.01f) {  // gelu(a) ~ a, gelu(-a) ~ 0
    worst_rel = std::max(worst_rel, static_cast<double>(std::fabs(gelu_erf_wide(a) - gelu_exact(a)) / a));
    worst_abs = std::max(worst_abs, static_cast<double>(std::fabs(gelu_erf_wide(-a) - gelu_exact(-a))));
  }
  EXPECT_LT(worst_abs, 1e-5);
  EXPECT_LT(worst_rel, 2e-7);
  EXPECT_EQ(gelu_erf_wide(std::numeric_limits<float>::max()), std::numeric_limits<float>::max());
  EXPECT_TRUE(std::isnan(gelu_erf_wide(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isnan(gelu_erf_wide(-std::numeric_limits<float>::quiet_NaN())));
}

}  // namespace
