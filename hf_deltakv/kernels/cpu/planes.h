// The adaptive keys' bit planes (quant/bitplanes.py) decoded 16 tokens at a time, shared by encode.cpp (a prefill's
// groups, decode_planes) and stream_attention.cpp (the decoding attention's key tiles).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__AVX512F__)
#include <immintrin.h>

namespace hfd {

// Tokens 8 * byte ... 8 * byte + 15 of one channel whose `bits` planes lie `width` bytes apart: bit k of the 16 bits
// at `planes + b * width + byte` is bit b of token 8 * byte + k's code, added to the integer codes as a lane mask.
// Returns lo + code * step (kernels/reference.py decode_groups: a multiply, then an add) rounded to fp16, saturated
// at fp16's largest finite value, NaN kept. `static`: each source compiles its own copy with its own flags (encode.cpp
// forbids fused multiply-adds, for the reference's bytes).
static inline __m512 plane_values16(const uint8_t* planes, int bits, int64_t width, int64_t byte, float lo,
                                    float step) {
  __m512i code = _mm512_setzero_si512();
  for (int b = 0; b < bits; ++b) {
    uint16_t mask;
    std::memcpy(&mask, planes + b * width + byte, sizeof mask);
    code = _mm512_mask_add_epi32(code, mask, code, _mm512_set1_epi32(1 << b));
  }
  const __m512 most = _mm512_set1_ps(static_cast<float>(std::numeric_limits<c10::Half>::max()));
  __m512 value = _mm512_add_ps(_mm512_set1_ps(lo), _mm512_mul_ps(_mm512_cvtepi32_ps(code), _mm512_set1_ps(step)));
  value = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), most), _mm512_min_ps(most, value));  // NaN: 2nd operand
  return _mm512_cvtph_ps(_mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

}  // namespace hfd
#endif
