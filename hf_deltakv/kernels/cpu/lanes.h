// One source per kernel for every vector width: a lane type `F` of `W` floats, a mask type `M`, and the few operations
// the kernels' arithmetic loops use (the attention's tile_scores, tile_values and the online softmax's exponentials;
// the adaptive keys' clipped-range search). Each is one instruction (or a short fixed sequence) applied lane by lane,
// so a loop gives the same floats at every width, and encode.cpp's rule (no fused multiply-adds) holds. The width
// is chosen when the kernels are built on the user's machine (-march=native): AVX-512 (16 lanes, mask registers),
// AVX2 (8 lanes), or one lane (any other CPU: the loops over lanes are plain loops the compiler may vectorise).
// Data-movement code that is specific to an instruction set (transposes, bit-plane and nibble unpacking) keeps its
// own `#if` branches; arithmetic is written once, here.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <c10/util/Half.h>

namespace hfd::lanes {

#if defined(__AVX512F__)
constexpr int W = 16;
using F = __m512;
using M = __mmask16;
inline F zero() { return _mm512_setzero_ps(); }
inline F set1(float x) { return _mm512_set1_ps(x); }
inline F load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, F x) { _mm512_storeu_ps(p, x); }
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F div(F a, F b) { return _mm512_div_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F max(F a, F b) { return _mm512_max_ps(a, b); }  // a NaN in either: b
inline F min(F a, F b) { return _mm512_min_ps(a, b); }  // a NaN in either: b
inline F round_even(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline F floor(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
// 2^k for whole-numbered k in the normal exponent range (the exponent field written directly).
inline F pow2(F k) {
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_castsi512_ps(e);
}
inline F keep(M m, F x) { return _mm512_maskz_mov_ps(m, x); }  // x where m, else 0
inline F select(M m, F a, F b) { return _mm512_mask_mov_ps(b, m, a); }  // a where m, else b
inline M nonzero_bytes(const uint8_t* flags) {  // lane j: flags[j] != 0
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(flags)));
  return _mm512_test_epi32_mask(v, v);
}
inline M not_equal(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_UQ); }
inline M greater(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline float sum(F x) { return _mm512_reduce_add_ps(x); }
// The nearest fp16 of each lane (ties to even, as c10::Half), back in fp32.
inline F round_half(F x) { return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
// W codes (whole numbers in 0..255) as bytes.
inline void store_bytes(uint8_t* p, F x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(x)));
}
#elif defined(__AVX2__)
constexpr int W = 8;
using F = __m256;
using M = __m256;  // all-ones / zero lanes
inline F zero() { return _mm256_setzero_ps(); }
inline F set1(float x) { return _mm256_set1_ps(x); }
inline F load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, F x) { _mm256_storeu_ps(p, x); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F div(F a, F b) { return _mm256_div_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F max(F a, F b) { return _mm256_max_ps(a, b); }  // a NaN in either: b
inline F min(F a, F b) { return _mm256_min_ps(a, b); }  // a NaN in either: b
inline F round_even(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline F floor(F x) { return _mm256_floor_ps(x); }
inline F pow2(F k) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_castsi256_ps(e);
}
inline F keep(M m, F x) { return _mm256_and_ps(m, x); }
inline F select(M m, F a, F b) { return _mm256_blendv_ps(b, a, m); }
inline M nonzero_bytes(const uint8_t* flags) {
  long long bytes;
  std::memcpy(&bytes, flags, sizeof bytes);
  const __m256i v = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(v, _mm256_setzero_si256()));
}
inline M not_equal(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_NEQ_UQ); }
inline M greater(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline float sum(F x) {
  alignas(32) float part[8];
  _mm256_store_ps(part, x);
  float total = 0.f;
  for (const float v : part) total += v;
  return total;
}
inline F round_half(F x) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  alignas(32) float part[8];
  _mm256_store_ps(part, x);
  for (float& v : part) v = static_cast<float>(static_cast<c10::Half>(v));
  return _mm256_load_ps(part);
#endif
}
inline void store_bytes(uint8_t* p, F x) {
  const __m256i k = _mm256_cvtps_epi32(x);  // 8 int32 -> 8 bytes (each in 0..255: the packs cannot saturate)
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(k), _mm256_extracti128_si256(k, 1));
  const __m128i bytes = _mm_packus_epi16(words, words);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), bytes);
}
#else
constexpr int W = 1;
struct F {
  float v;
};
using M = bool;
inline F zero() { return {0.f}; }
inline F set1(float x) { return {x}; }
inline F load(const float* p) { return {*p}; }
inline void store(float* p, F x) { *p = x.v; }
inline F add(F a, F b) { return {a.v + b.v}; }
inline F sub(F a, F b) { return {a.v - b.v}; }
inline F mul(F a, F b) { return {a.v * b.v}; }
inline F div(F a, F b) { return {a.v / b.v}; }
inline F fmadd(F a, F b, F c) { return {a.v * b.v + c.v}; }  // (std::fma is a library call without FMA units)
inline F max(F a, F b) { return {std::isnan(a.v) || std::isnan(b.v) ? b.v : std::max(a.v, b.v)}; }
inline F min(F a, F b) { return {std::isnan(a.v) || std::isnan(b.v) ? b.v : std::min(a.v, b.v)}; }
inline F round_even(F x) { return {std::nearbyint(x.v)}; }  // (the default rounding mode: to nearest, ties even)
inline F floor(F x) { return {std::floor(x.v)}; }
inline F pow2(F k) {
  const int32_t bits = (static_cast<int32_t>(k.v) + 127) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return {out};
}
inline F keep(M m, F x) { return {m ? x.v : 0.f}; }
inline F select(M m, F a, F b) { return {m ? a.v : b.v}; }
inline M nonzero_bytes(const uint8_t* flags) { return *flags != 0; }
inline M not_equal(F a, F b) { return a.v != b.v; }
inline M greater(F a, F b) { return a.v > b.v; }
inline float sum(F x) { return x.v; }
inline F round_half(F x) { return {static_cast<float>(static_cast<c10::Half>(x.v))}; }
inline void store_bytes(uint8_t* p, F x) { *p = static_cast<uint8_t>(x.v); }
#endif

// x within [lo, hi]; a NaN in x stays NaN (max and min return their second operand when either is NaN).
inline F clamp(F x, float lo, float hi) { return min(set1(hi), max(set1(lo), x)); }

}  // namespace hfd::lanes
