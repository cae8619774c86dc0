// Pieces of the online softmax shared by the CPU attention kernels (stream_attention.cpp, latent.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

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

#if defined(__AVX2__)
// exp_nonpositive on eight lanes, the same arithmetic (the compiler fuses the scalar version's multiply-adds too).
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // a NaN x stays NaN, as std::max(x, -87) keeps it
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 whole = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, whole);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(whole), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

// x[j] = exp(x[j] - top) where kept (else 0) for j < n, top >= every kept x[j]; returns the sum of the x[j].
// `lanes(j)` gives the keep mask of x[j..j+8) as all-ones / zero float lanes, `one(j)` whether x[j] is kept. A scalar
// loop with a condition does not vectorise: eight lanes at a time, masked.
template <typename Lanes, typename One>
inline float exp_masked_sum(float* x, int n, float top, Lanes lanes, One one) {
  float total = 0.f;
  int j = 0;
#if defined(__AVX2__)
  __m256 sum = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(top);
  for (; j + 8 <= n; j += 8) {
    const __m256 p = _mm256_and_ps(exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(x + j), shift)), lanes(j));
    _mm256_storeu_ps(x + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  alignas(32) float partial[8];
  _mm256_store_ps(partial, sum);
  for (const float v : partial) total += v;
#else
  (void)lanes;
#endif
  for (; j < n; ++j) {
    x[j] = one(j) ? exp_nonpositive(x[j] - top) : 0.f;
    total += x[j];
  }
  return total;
}

// exp_masked_sum keeping x[j] where keep[j] != 0.
inline float exp_kept_sum(float* x, const uint8_t* keep, int n, float top) {
  return exp_masked_sum(
      x, n, top,
      [keep](int j) {
#if defined(__AVX2__)
        long long flags;
        std::memcpy(&flags, keep + j, sizeof flags);
        const __m256i lanes = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(flags));
        return _mm256_castsi256_ps(_mm256_cmpgt_epi32(lanes, _mm256_setzero_si256()));
#else
        return j;
#endif
      },
      [keep](int j) { return keep[j] != 0; });
}

// exp_masked_sum keeping the x[j] that are not -inf (masked scores).
inline float exp_unmasked_sum(float* x, int n, float top) {
  return exp_masked_sum(
      x, n, top,
      [x](int j) {
#if defined(__AVX2__)
        return _mm256_cmp_ps(_mm256_loadu_ps(x + j), _mm256_set1_ps(NEG_INF), _CMP_NEQ_UQ);
#else
        return j;
#endif
      },
      [x](int j) { return x[j] != NEG_INF; });
}

}  // namespace hfd
