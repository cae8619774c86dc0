// The residual cache's packed latents on the CPU: encoded (specification: hf_deltakv.kernels.reference.quantize_latent),
// decoded to fp32 (reference.dequantize_latent), and attended without decoding the values (reference.latent_attention).
// Each group of HFD_LATENT_GROUP codes is a little-endian bit stream at its depth b (a code spans at most two bytes),
// offset by 2**(b-1) - 1 and multiplied by the group's fp16 scale; groups of depth 0 hold no bytes and decode as
// zeros. One multiply per code, as the reference computes it, so the values are identical.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "rope.h"
#include "softmax.h"

#if !defined(HFD_LATENT_GROUP)
#error "build through hf_deltakv.kernels.cpu: the group size comes from hf_deltakv.kernels.layout.constants()"
#endif

#if defined(__AVX512VBMI__) && defined(__AVX512BW__) && HFD_LATENT_GROUP == 32
#include <immintrin.h>
#define HFD_VECTOR_DECODE 1
#elif defined(__AVX2__) && HFD_LATENT_GROUP == 32
#include <immintrin.h>
#define HFD_VECTOR_DECODE 1
#define HFD_VECTOR_DECODE_AVX2 1
#endif

namespace {

std::atomic<bool> vector_decode{true};  // off: the scalar decoder on every machine (tests compare the two)

#ifdef HFD_VECTOR_DECODE_AVX2
// The scalar decoder's values, 8 codes at a time (AVX2): codes 8i..8i+7 are the B bytes from i * B, read as one
// little-endian word, shifted per 64-bit lane and masked; the same integer minus offset times the same scale, so the
// same floats.
template <int B, typename T>
void decode_group_vector(const uint8_t* row, float d, T* dst) {
  const __m256i low_shifts = _mm256_setr_epi64x(0, B, 2 * B, 3 * B);
  const __m256i high_shifts = _mm256_setr_epi64x(4 * B, 5 * B, 6 * B, 7 * B);
  const __m256i mask = _mm256_set1_epi64x((1 << B) - 1);
  const __m256i in_order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i offset = _mm256_set1_epi32((1 << (B - 1)) - 1);
  const __m256 scale = _mm256_set1_ps(d);
  for (int i = 0; i < 4; ++i) {
    // One 8-byte load within the group's 4 * B bytes (never past the row), shifted down to byte i * B: a copy of
    // exactly B bytes is several narrow stores that the wide load after them waits for.
    uint64_t word;
    if constexpr (4 * B >= 8) {
      const int at = std::min(i * B, 4 * B - 8);
      std::memcpy(&word, row + at, 8);
      word >>= 8 * (i * B - at);
    } else {
      uint32_t bytes;
      std::memcpy(&bytes, row, 4);
      word = bytes >> (8 * i * B);
    }
    const __m256i all = _mm256_set1_epi64x(static_cast<int64_t>(word));
    const __m256i low = _mm256_and_si256(_mm256_srlv_epi64(all, low_shifts), mask);    // codes 0-3, one per lane
    const __m256i high = _mm256_and_si256(_mm256_srlv_epi64(all, high_shifts), mask);  // codes 4-7
    const __m256i codes = _mm256_permutevar8x32_epi32(_mm256_or_si256(low, _mm256_slli_epi64(high, 32)), in_order);
    const __m256 values = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(codes, offset)), scale);
    if constexpr (std::is_same_v<T, float>) {
      _mm256_storeu_ps(dst + 8 * i, values);
    } else {
      alignas(32) float kept[8];
      _mm256_store_ps(kept, values);
      for (int j = 0; j < 8; ++j) dst[8 * i + j] = static_cast<T>(kept[j]);
    }
  }
}
#elif defined(HFD_VECTOR_DECODE)
// Where code j of a group at depth B lies: its two bytes go to 16-bit lane j, which is shifted right by the bit offset.
template <int B>
struct GroupLanes {
  alignas(64) uint8_t bytes[64] = {};
  alignas(64) uint16_t shifts[32] = {};
  constexpr GroupLanes() {
    for (int j = 0; j < 32; ++j) {
      bytes[2 * j] = static_cast<uint8_t>(j * B / 8), bytes[2 * j + 1] = static_cast<uint8_t>(j * B / 8 + 1);
      shifts[j] = static_cast<uint16_t>(j * B % 8);
    }
  }
};
template <int B>
constexpr GroupLanes<B> kLanes{};

// The scalar decoder's values, 32 codes at once: one masked load of the group's 4 * B bytes, a byte permutation, a
// per-lane shift and mask; the same integer minus offset times the same scale, so the same floats.
template <int B, typename T>
void decode_group_vector(const uint8_t* row, float d, T* dst) {
  const __m512i bytes = _mm512_maskz_loadu_epi8(static_cast<__mmask64>((1ull << (4 * B)) - 1), row);
  __m512i codes = _mm512_permutexvar_epi8(_mm512_load_si512(kLanes<B>.bytes), bytes);
  codes = _mm512_and_si512(_mm512_srlv_epi16(codes, _mm512_load_si512(kLanes<B>.shifts)),
                           _mm512_set1_epi16((1 << B) - 1));
  const __m512i offset = _mm512_set1_epi32((1 << (B - 1)) - 1);
  const __m512 scale = _mm512_set1_ps(d);
  const __m512 lo = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(codes)), offset)), scale);
  const __m512 hi = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(codes, 1)), offset)), scale);
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(dst, lo);
    _mm512_storeu_ps(dst + 16, hi);
  } else {
#ifdef __AVX512BF16__
    // Round to nearest even, as c10::BFloat16 does for these values (never subnormal: fp16 scales >= 2**-24)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(lo));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), (__m256i)_mm512_cvtneps_pbh(hi));
#else
    alignas(64) float values[32];
    _mm512_store_ps(values, lo);
    _mm512_store_ps(values + 16, hi);
    for (int j = 0; j < 32; ++j) dst[j] = static_cast<T>(values[j]);
#endif
  }
}
#endif

// One group at depth B (a constant, so the loop over the group's codes unrolls into shifts and masks), written as T
// (float, or bf16 rounded to nearest even from the float).
template <int B, typename T>
void decode_group(const uint8_t* row, float d, T* dst) {
#ifdef HFD_VECTOR_DECODE
  if (vector_decode.load(std::memory_order_relaxed)) return decode_group_vector<B, T>(row, d, dst);
#endif
  constexpr uint32_t mask = (1u << B) - 1u;
  constexpr int offset = (1 << (B - 1)) - 1;
  for (int j = 0; j < HFD_LATENT_GROUP; ++j) {
    const int bit = j * B, at = bit >> 3, shift = bit & 7;
    uint32_t word = row[at];
    if (shift + B > 8) word |= static_cast<uint32_t>(row[at + 1]) << 8;
    dst[j] = static_cast<T>(static_cast<float>(static_cast<int>((word >> shift) & mask) - offset) * d);
  }
}

// One token's latent: groups of depth 0 hold no bytes and no scale, and decode as zeros.
template <typename T>
void decode_latent_row(const uint8_t* row, const at::Half* scale, const std::vector<int64_t>& bits, T* dst) {
  for (const int64_t b : bits) {
    if (!b) {
      std::fill(dst, dst + HFD_LATENT_GROUP, static_cast<T>(0.f));
      dst += HFD_LATENT_GROUP;
      continue;
    }
    const float d = static_cast<float>(*scale++);
    switch (b) {
      case 1: decode_group<1, T>(row, d, dst); break;
      case 2: decode_group<2, T>(row, d, dst); break;
      case 3: decode_group<3, T>(row, d, dst); break;
      case 4: decode_group<4, T>(row, d, dst); break;
      case 5: decode_group<5, T>(row, d, dst); break;
      case 6: decode_group<6, T>(row, d, dst); break;
      case 7: decode_group<7, T>(row, d, dst); break;
      default: decode_group<8, T>(row, d, dst); break;
    }
    row += HFD_LATENT_GROUP * b / 8;
    dst += HFD_LATENT_GROUP;
  }
}

// Bytes of one token's packed codes and number of fp16 scales (groups of depth > 0) at depths `bits`, checked.
struct LatentSizes {
  int64_t code_bytes = 0, kept = 0;
};

LatentSizes latent_sizes(const std::vector<int64_t>& bits) {
  LatentSizes sizes;
  for (const int64_t b : bits) {
    TORCH_CHECK(b >= 0 && b <= 8, "bit depths must lie in 0..8");
    sizes.code_bytes += HFD_LATENT_GROUP * b / 8, sizes.kept += b > 0;
  }
  return sizes;
}

using hfd::NEG_INF;

constexpr int VALUE_BLOCK = 8;  // tokens whose value latents are added to the accumulators together
constexpr int64_t KEY_TILE = 64;  // tokens transposed together: their rows stay in L1 while every channel is read

// Shape of one head's keys as `channel_major_keys` reads them: n tokens `stride` apart, channels c and c + half
// rotated together by table rows c and c + second (second = 0 when the halves share one row), tables `table_stride`
// apart per row (0: no RoPE).
struct ChannelMajor {
  int64_t n, stride, half, second, table_stride;
};

// One head's keys [n][stride] (plus `mean`, if any) to channel-major out [2 * half][n], rotate-half RoPE applied when
// the tables cos, sin are given. Tiled over tokens, so the strided reads hit L1.
template <typename K>
void channel_major_keys(const K* k, const float* mean, const float* cos, const float* sin, const ChannelMajor& s,
                        float* out) {
  for (int64_t j0 = 0; j0 < s.n; j0 += KEY_TILE) {
    const int64_t j1 = std::min(s.n, j0 + KEY_TILE);
    for (int64_t c = 0; c < s.half; ++c) {
      const float mean_lo = mean ? mean[c] : 0.f, mean_hi = mean ? mean[c + s.half] : 0.f;
      float* lo = out + c * s.n;
      float* hi = out + (c + s.half) * s.n;
      if (cos) {
        const float* cl = cos + c * s.table_stride;
        const float* sl = sin + c * s.table_stride;
        const float* ch = cos + (c + s.second) * s.table_stride;
        const float* sh = sin + (c + s.second) * s.table_stride;
        for (int64_t j = j0; j < j1; ++j) {
          const float x = static_cast<float>(k[j * s.stride + c]) + mean_lo;
          const float y = static_cast<float>(k[j * s.stride + c + s.half]) + mean_hi;
          lo[j] = x * cl[j] - y * sl[j];
          hi[j] = y * ch[j] + x * sh[j];
        }
      } else {
        for (int64_t j = j0; j < j1; ++j) {
          lo[j] = static_cast<float>(k[j * s.stride + c]) + mean_lo;
          hi[j] = static_cast<float>(k[j * s.stride + c + s.half]) + mean_hi;
        }
      }
    }
  }
}

}  // namespace

// Whether the vector decoder (AVX-512 VBMI or AVX2) serves (when the build has one): `enabled` sets it; returns the
// previous setting, or false when the build has only the scalar decoder. For tests, which hold the two to the same
// values.
bool vector_latent_decode(bool enabled) {
#ifdef HFD_VECTOR_DECODE
  return vector_decode.exchange(enabled);
#else
  (void)enabled;
  return false;
#endif
}

// `out`: fp32 or bf16 [rows, len(bits) * GROUP] with contiguous rows (e.g. the first rows of a larger buffer, so that
// a matrix product after it keeps its shape from step to step), or empty: a new fp32 tensor.
at::Tensor dequantize_latent(at::Tensor packed, at::Tensor scales, std::vector<int64_t> bits, at::Tensor out) {
  constexpr int64_t GROUP = HFD_LATENT_GROUP;
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.stride(1) == 1,
              "packed: uint8 [rows, bytes] with contiguous rows");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kHalf && scales.stride(1) == 1,
              "scales: fp16 [rows, kept groups] with contiguous rows");
  const LatentSizes sizes = latent_sizes(bits);
  const int64_t code_bytes = sizes.code_bytes, kept = sizes.kept;  // plain names: lambdas capture them
  const int64_t rows = packed.size(0);
  TORCH_CHECK(packed.size(1) == code_bytes && scales.size(0) == rows && scales.size(1) == kept,
              "packed bytes or scales do not match the bit depths");
  const int64_t width = static_cast<int64_t>(bits.size()) * GROUP;
  if (out.numel() == 0) out = at::empty({rows, width}, scales.options().dtype(at::kFloat));
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == width && out.stride(1) == 1,
              "out must be [rows, latent width] with contiguous rows");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "out: fp32 or bf16");
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const at::Half* ps = scales.data_ptr<at::Half>();
  const int64_t packed_stride = packed.stride(0), scale_stride = scales.stride(0), out_stride = out.stride(0);
  auto decode = [&](auto* po) {
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        decode_latent_row(pp + r * packed_stride, ps + r * scale_stride, bits, po + r * out_stride);
      }
    });
  };
  if (out.scalar_type() == at::kBFloat16) {
    decode(out.data_ptr<at::BFloat16>());
  } else {
    decode(out.data_ptr<float>());
  }
  return out;
}

// The encoder's bytes must match the reference: no fused multiply-adds in it (the attention below may fuse).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// The residual cache's encoding of finite fp32 latents [rows, len(bits) * GROUP] (specification:
// hf_deltakv.kernels.reference.quantize_latent): per group of depth b > 0 an fp16 scale absmax / qmax (qmax = 2**(b-1) - 1,
// saturated to the fp16 range), codes round-half-even(x / scale) in [-qmax, qmax] offset by qmax, packed
// little-endian at b bits. IEEE single precision in the reference's order (x times the reciprocal of the scale).
std::vector<at::Tensor> quantize_latent(at::Tensor latent, std::vector<int64_t> bits) {
  constexpr int64_t GROUP = HFD_LATENT_GROUP;
  latent = latent.contiguous();
  TORCH_CHECK(latent.dim() == 2 && latent.scalar_type() == at::kFloat, "latent: fp32 [rows, components]");
  TORCH_CHECK(latent.size(1) == static_cast<int64_t>(bits.size()) * GROUP, "latent width does not match the depths");
  const LatentSizes sizes = latent_sizes(bits);
  const int64_t code_bytes = sizes.code_bytes, kept = sizes.kept;  // plain names: lambdas capture them
  const int64_t rows = latent.size(0), width = latent.size(1);
  auto packed = at::zeros({rows, code_bytes}, latent.options().dtype(at::kByte));
  auto scales = at::empty({rows, kept}, latent.options().dtype(at::kHalf));
  const float* px = latent.data_ptr<float>();
  uint8_t* pp = packed.data_ptr<uint8_t>();
  at::Half* ps = scales.data_ptr<at::Half>();
  const float fp16_max = static_cast<float>(std::numeric_limits<c10::Half>::max());
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = px + r * width;
      uint8_t* out = pp + r * code_bytes;
      at::Half* scale = ps + r * kept;
      for (const int64_t b : bits) {
        if (!b) {
          x += GROUP;
          continue;
        }
        const float qmax = static_cast<float>((1 << (b - 1)) - 1);
        float top = 0.f;
        for (int64_t j = 0; j < GROUP; ++j) top = std::max(top, std::fabs(x[j]));
        const at::Half half_scale = static_cast<at::Half>(std::min(top / qmax, fp16_max));
        *scale++ = half_scale;
        const float d = static_cast<float>(half_scale);
        const float inverse = d > 0.f ? 1.0f / d : 0.f;
        for (int64_t j = 0; j < GROUP; ++j) {
          const float q = std::min(std::max(std::nearbyint(x[j] * inverse), -qmax), qmax) + qmax;
          const uint32_t code = static_cast<uint32_t>(q);
          const int64_t bit = j * b;
          out[bit >> 3] |= static_cast<uint8_t>(code << (bit & 7));
          if ((bit & 7) + b > 8) out[(bit >> 3) + 1] |= static_cast<uint8_t>(code >> (8 - (bit & 7)));
        }
        x += GROUP;
        out += GROUP * b / 8;
      }
    }
  });
  return {packed, scales};
}
#pragma GCC pop_options

// Softmax statistics of queries over a chunk of residual-coded tokens whose values stay latent (specification:
// hf_deltakv.kernels.reference.latent_attention). rows [B, H, R, D] fp32; keys [B, c, H * D] fp32 or bf16 before RoPE,
// key_mean [H * D] fp32 added to them (or empty); positions int32
// [B, c] (rows contiguous) and freqs float64 [D / 2] of their RoPE (rope.h), or both empty; allowed bool [B, H, R, c] or empty;
// codes uint8 [B, c, bytes] and scales fp16 [B, c, kept] (rows contiguous, any batch and token strides) of the value
// latents at depths `bits` (depth 0: a group of zeros). Returns max, weight [B, H, R] and acc [B, H, R, L]. Work is
// split over batch and token ranges (each decodes a token's latent once for every head), their statistics merged.
std::vector<at::Tensor> latent_attention(at::Tensor rows, at::Tensor keys, at::Tensor key_mean,
                                            at::Tensor positions, at::Tensor freqs, at::Tensor allowed,
                                            at::Tensor codes, at::Tensor scales, std::vector<int64_t> bits,
                                            double scale) {
  rows = rows.contiguous(), keys = keys.contiguous();
  TORCH_CHECK(rows.scalar_type() == at::kFloat, "rows must be fp32");
  TORCH_CHECK(keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16,
              "keys must be fp32 or bf16");
  const int64_t B = rows.size(0), H = rows.size(1), R = rows.size(2), D = rows.size(3), C = keys.size(1);
  const int64_t L = static_cast<int64_t>(bits.size()) * HFD_LATENT_GROUP, HR = H * R;
  TORCH_CHECK(keys.size(0) == B && keys.size(2) == H * D && D % 2 == 0, "keys must be [batch, tokens, heads * dim]");
  const bool centered = key_mean.numel() > 0;
  if (centered) {
    key_mean = key_mean.contiguous();
    TORCH_CHECK(key_mean.scalar_type() == at::kFloat && key_mean.numel() == H * D, "key_mean: fp32 [heads * dim]");
  }
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.stride(2) == 1 && scales.stride(2) == 1,
              "codes and scales need contiguous rows");
  const LatentSizes sizes = latent_sizes(bits);
  const int64_t code_bytes = sizes.code_bytes, kept = sizes.kept;  // plain names: lambdas capture them
  TORCH_CHECK(codes.size(0) == B && codes.size(1) == C && codes.size(2) == code_bytes && scales.size(0) == B &&
                  scales.size(1) == C && scales.size(2) == kept,
              "codes, scales and keys cover different tokens, or codes do not match the bit depths");
  const bool rope = positions.numel() > 0;
  if (rope) {
    TORCH_CHECK(positions.scalar_type() == at::kInt && positions.dim() == 2 && positions.stride(1) == 1 &&
                    positions.size(0) == B && positions.size(1) == C,
                "positions must be int32 [batch, tokens] with contiguous rows");
    TORCH_CHECK(freqs.scalar_type() == at::kDouble && freqs.is_contiguous() && freqs.numel() * 2 == D,
                "freqs must be float64 [head_dim / 2]");
  }
  const bool masked = allowed.numel() > 0;
  if (masked) allowed = allowed.to(at::kBool).contiguous();
  const int64_t half = D / 2;
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>((C + 255) / 256, 2 * at::get_num_threads()));
  const int64_t span = (C + splits - 1) / splits;
  auto part_max = at::full({B, splits, HR}, NEG_INF, rows.options());
  auto part_weight = at::zeros({B, splits, HR}, rows.options());
  auto part_acc = at::zeros({B, splits, HR, L}, rows.options());
  const float* pq = rows.data_ptr<float>();
  const bool bf16_keys = keys.scalar_type() == at::kBFloat16;
  const float* pk32 = bf16_keys ? nullptr : keys.data_ptr<float>();
  const at::BFloat16* pk16 = bf16_keys ? keys.data_ptr<at::BFloat16>() : nullptr;
  const float* pmean = centered ? key_mean.data_ptr<float>() : nullptr;
  const int32_t* ppos = rope ? positions.data_ptr<int32_t>() : nullptr;
  const hfd::RopeSteps rope_steps(rope ? freqs.data_ptr<double>() : nullptr, rope ? static_cast<int>(half) : 0);
  const bool* pa = masked ? allowed.data_ptr<bool>() : nullptr;
  const uint8_t* pcode = codes.data_ptr<uint8_t>();
  const at::Half* pscale = scales.data_ptr<at::Half>();
  float* pm = part_max.data_ptr<float>();
  float* pw = part_weight.data_ptr<float>();
  float* pacc = part_acc.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, B * splits, 1, [&](int64_t begin, int64_t end) {
    // Per-thread working buffers kept between calls: freshly allocated, a quarter-megabyte buffer is new pages (the
    // kernel zeroes them) at every decode step of every layer.
    thread_local std::vector<float> keys_t, latent, scores, rope_cos, rope_sin;
    latent.resize(VALUE_BLOCK * L);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / splits, split = task % splits;
      const int64_t t0 = split * span, t1 = std::min(C, t0 + span), n = t1 - t0;
      if (n <= 0) continue;
      keys_t.resize(D * n);
      scores.assign(HR * n, 0.f);
      if (rope) {  // the task's RoPE angles, channel-major [half][n], shared by its heads
        rope_cos.resize(half * n), rope_sin.resize(half * n);
        hfd::RopeRun(rope_steps).fill(ppos + b * positions.stride(0) + t0, n, rope_cos.data(), rope_sin.data(), n);
      }
      for (int64_t h = 0; h < H; ++h) {
        // This head's keys channel-major [D][n], RoPE re-applied (the tables are channel-major too).
        const int64_t first = (b * C + t0) * H * D + h * D;
        const float* mean = centered ? pmean + h * D : nullptr;
        const float* cl = rope ? rope_cos.data() : nullptr;
        const float* sl = rope ? rope_sin.data() : nullptr;
        const ChannelMajor layout{n, H * D, half, 0, rope ? n : 0};
        if (bf16_keys) {
          channel_major_keys(pk16 + first, mean, cl, sl, layout, keys_t.data());
        } else {
          channel_major_keys(pk32 + first, mean, cl, sl, layout, keys_t.data());
        }
        for (int64_t r = 0; r < R; ++r) {  // scores of each row of this head: one pass per 4 channels
          const float* q = pq + ((b * H + h) * R + r) * D;
          float* s = scores.data() + (h * R + r) * n;
          int64_t c = 0;
          for (; c + 4 <= D; c += 4) {
            const float q0 = q[c] * fscale, q1 = q[c + 1] * fscale, q2 = q[c + 2] * fscale, q3 = q[c + 3] * fscale;
            const float* k0 = keys_t.data() + c * n;
            const float *k1 = k0 + n, *k2 = k1 + n, *k3 = k2 + n;
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) s[j] += q0 * k0[j] + q1 * k1[j] + q2 * k2[j] + q3 * k3[j];
          }
          for (; c < D; ++c) {
            const float qc = q[c] * fscale;
            const float* kc = keys_t.data() + c * n;
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) s[j] += qc * kc[j];
          }
          if (pa) {
            const bool* ok = pa + ((b * H + h) * R + r) * C + t0;
            for (int64_t j = 0; j < n; ++j) s[j] = ok[j] ? s[j] : NEG_INF;
          }
        }
      }
      float* m = pm + task * HR;
      float* w = pw + task * HR;
      for (int64_t hr = 0; hr < HR; ++hr) {  // scores become weights exp(score - max), 0 where masked
        float* s = scores.data() + hr * n;
        float top = NEG_INF;
#pragma omp simd reduction(max : top)
        for (int64_t j = 0; j < n; ++j) top = s[j] > top ? s[j] : top;  // NaN passed over, as std::max(top, s) does
        m[hr] = top;
        w[hr] = hfd::exp_unmasked_sum(s, static_cast<int>(n), top);
      }
      float* acc = pacc + task * HR * L;
      for (int64_t tb = t0; tb < t1; tb += VALUE_BLOCK) {  // latents decoded once per token, a block at a time
        const int64_t count = std::min<int64_t>(VALUE_BLOCK, t1 - tb);
        for (int64_t j = 0; j < count; ++j) {
          const int64_t t = tb + j;
          decode_latent_row(pcode + b * codes.stride(0) + t * codes.stride(1),
                            pscale + b * scales.stride(0) + t * scales.stride(1), bits, latent.data() + j * L);
        }
        for (int64_t j = count; j < VALUE_BLOCK; ++j) std::fill(latent.data() + j * L, latent.data() + (j + 1) * L, 0.f);
        for (int64_t hr = 0; hr < HR; ++hr) {  // each row's accumulator read and written once per block
          float p[VALUE_BLOCK] = {};
          for (int64_t j = 0; j < count; ++j) p[j] = scores[hr * n + (tb - t0) + j];
          float* a = acc + hr * L;
          const float* z = latent.data();
#pragma omp simd
          for (int64_t l = 0; l < L; ++l) {
            float sum = a[l];
            for (int j = 0; j < VALUE_BLOCK; ++j) sum += p[j] * z[j * L + l];
            a[l] = sum;
          }
        }
      }
    }
  });
  // Merge the token ranges: each scaled by exp(its max - the overall max).
  auto maximum = at::empty({B, H, R}, rows.options());
  auto weight = at::zeros({B, H, R}, rows.options());
  auto acc = at::zeros({B, H, R, L}, rows.options());
  float* om = maximum.data_ptr<float>();
  float* ow = weight.data_ptr<float>();
  float* oa = acc.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t hr = 0; hr < HR; ++hr) {
      float top = NEG_INF;
      for (int64_t split = 0; split < splits; ++split) top = std::max(top, pm[(b * splits + split) * HR + hr]);
      om[b * HR + hr] = top;
      if (top == NEG_INF) continue;
      for (int64_t split = 0; split < splits; ++split) {
        const int64_t part = (b * splits + split) * HR + hr;
        if (pm[part] == NEG_INF) continue;
        const float factor = std::exp(pm[part] - top);
        ow[b * HR + hr] += pw[part] * factor;
        const float* a = pacc + part * L;
        float* o = oa + (b * HR + hr) * L;
        for (int64_t l = 0; l < L; ++l) o[l] += a[l] * factor;
      }
    }
  }
  return {maximum, weight, acc};
}
