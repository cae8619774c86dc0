// Pieces of the online softmax shared by the CPU attention kernels (stream_attention.cpp, latent.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "lanes.h"

namespace hfd {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (Cephes-style: 2^(x log2 e) split into integer and fraction, degree-6 polynomial; relative
// error below 2e-7), written so that loops over it vectorise; std::exp does not.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float whole = std::floor(t);
  const float f = t - whole;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(whole) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// exp_nonpositive on every lane (lanes.h), the same arithmetic (the compiler fuses the scalar version's multiply-adds
// too).
inline lanes::F exp_nonpositive_lanes(lanes::F x) {
  using namespace lanes;
  x = max(set1(-87.0f), x);  // a NaN x stays NaN, as std::max(x, -87) keeps it
  const F t = mul(x, set1(1.44269504088896341f));
  const F whole = floor(t);
  const F f = sub(t, whole);
  F p = set1(1.535336188319500e-4f);
  p = fmadd(p, f, set1(1.339887440266574e-3f));
  p = fmadd(p, f, set1(9.618437357674640e-3f));
  p = fmadd(p, f, set1(5.550332471162809e-2f));
  p = fmadd(p, f, set1(2.402264791363012e-1f));
  p = fmadd(p, f, set1(6.931472028550421e-1f));
  p = fmadd(p, f, set1(1.0f));
  return mul(p, pow2(whole));
}

// x[j] = exp(x[j] - top) where kept (else 0) for j < n, top >= every kept x[j]; returns the sum of the x[j].
// `mask(j)` gives the keep mask of x[j..j + W) (lanes.h), `one(j)` whether x[j] is kept. A scalar loop with a
// condition does not vectorise: W lanes at a time, masked, then one at a time.
template <typename Mask, typename One>
inline float exp_masked_sum(float* x, int n, float top, Mask mask, One one) {
  using namespace lanes;
  int j = 0;
  F acc = zero();
  const F shift = set1(top);
  for (; j + W <= n; j += W) {
    const F p = keep(mask(j), exp_nonpositive_lanes(sub(load(x + j), shift)));
    store(x + j, p);
    acc = add(acc, p);
  }
  float total = sum(acc);
  for (; j < n; ++j) {
    x[j] = one(j) ? exp_nonpositive(x[j] - top) : 0.f;
    total += x[j];
  }
  return total;
}

// The largest x[j] with keep[j] != 0 for j < n (NEG_INF if none), a NaN x[j] passed over as std::max(top, x[j])
// passes it: W lanes at a time (a scalar loop with a condition does not vectorise), then one at a time.
inline float kept_max(const float* x, const uint8_t* keep, int n) {
  using namespace lanes;
  int j = 0;
  F acc = set1(NEG_INF);
  for (; j + W <= n; j += W) acc = max(select(nonzero_bytes(keep + j), load(x + j), set1(NEG_INF)), acc);
  alignas(64) float part[W];
  store(part, acc);
  float top = NEG_INF;
  for (const float v : part) top = std::max(top, v);
  for (; j < n; ++j)
    if (keep[j]) top = std::max(top, x[j]);
  return top;
}

// exp_masked_sum keeping x[j] where keep[j] != 0.
inline float exp_kept_sum(float* x, const uint8_t* keep, int n, float top) {
  return exp_masked_sum(
      x, n, top, [keep](int j) { return lanes::nonzero_bytes(keep + j); }, [keep](int j) { return keep[j] != 0; });
}

// exp_masked_sum keeping the x[j] that are not -inf (masked scores).
inline float exp_unmasked_sum(float* x, int n, float top) {
  return exp_masked_sum(
      x, n, top, [x](int j) { return lanes::not_equal(lanes::load(x + j), lanes::set1(NEG_INF)); },
      [x](int j) { return x[j] != NEG_INF; });
}

}  // namespace hfd
