// Pieces of the online softmax shared by the CPU attention kernels (stream_attention.cpp, latent.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

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

}  // namespace hfd
