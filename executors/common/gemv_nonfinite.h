// The GEMV rewrite (sum over n of x.W[n] + b[n] == x . colsum(W) + sum(b)) holds for finite x.
// A row with inf/NaN inputs must get what the unrewritten chain gives: each y[n] is then an
// infinity or NaN, and their sum is NaN unless every y[n] is the same infinity, i.e. unless
// for every non-finite x[k] the column W[:,k] has one strict sign and all those signs agree.
// With colsign[k] = +1 (all W[n,k] > 0), -1 (all < 0), NaN otherwise, that result is
// sum over non-finite x[k] of x[k] * colsign[k] (infinities of one sign add up; mixed give NaN).
#pragma once

#include <cmath>

#include "pointwise.h"

namespace gemmfuse {

GF_HD bool gf_isfinite(float x) { return fabsf(x) < HUGE_VALF; }  // false for inf and NaN

GF_HD float gemv_nonfinite_term(float x, float colsign) {
  return gf_isfinite(x) ? 0.f : x * colsign;
}

}  // namespace gemmfuse
