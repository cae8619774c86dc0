// Encoding on the CPU: block quantization (q4_0, q4_1, q8_0, the 16-wide variants and our q3_0), the delta codec's
// closed-loop inter/intra step, and the adaptive keys' group coding (depths, clipped ranges, bit planes). Specifications:
// hf_deltakv.quant.quantize and hf_deltakv.kernels.reference; the bytes must be identical (tested), so this file keeps
// IEEE single-precision arithmetic in the reference's order, with no fused multiply-adds (but where a product is exact).
#pragma GCC optimize("fp-contract=off")
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "lanes.h"
#include "planes.h"

namespace {

#if !defined(HFD_KIND_Q4_SYM)
#error "build through hf_deltakv.kernels.cpu: the format ids come from hf_deltakv.kernels.layout.constants()"
#endif
enum Format : int64_t {
  Q4_SYM = HFD_KIND_Q4_SYM,
  Q4_ASYM = HFD_KIND_Q4_ASYM,
  Q8 = HFD_KIND_Q8,
  Q3_SYM = HFD_KIND_Q3_SYM
};

// Bytes of one block's codes: 8-bit, 4-bit pairs, or q3_0's 12 bytes per 32 (quant/packing.py: pack_3bit).
inline int64_t block_bytes(int64_t format, int64_t bs) {
  return format == Q8 ? bs : format == Q3_SYM ? bs * 3 / 8 : bs / 2;
}

// The symmetric formats' code offset (quant/blocks.py: codes trunc(x / scale + offset + 0.5) in 0..2 * offset - 1).
inline float symmetric_offset(int64_t format) { return format == Q3_SYM ? 4.f : 8.f; }

// Codes of one symmetric block into its bytes: 4-bit pairs (element j low, j + bs/2 high), or q3_0's layout (byte j
// of 0-7: the low 2 bits of codes j, 8 + j, 16 + j, 24 + j at bits 0, 2, 4, 6; byte 8 + i: the high bits of codes
// 8i..8i + 7).
template <typename T>
void pack_symmetric(const T* q, int64_t bs, int64_t format, uint8_t* codes) {
  if (format == Q3_SYM) {
    for (int j = 0; j < 8; ++j) {
      int byte = 0;
      for (int i = 0; i < 4; ++i) byte |= (static_cast<int>(q[8 * i + j]) & 3) << (2 * i);
      codes[j] = static_cast<uint8_t>(byte);
    }
    for (int i = 0; i < 4; ++i) {
      int byte = 0;
      for (int k = 0; k < 8; ++k) byte |= ((static_cast<int>(q[8 * i + k]) >> 2) & 1) << k;
      codes[8 + i] = static_cast<uint8_t>(byte);
    }
    return;
  }
  const int64_t half = bs / 2;
  for (int64_t j = 0; j < half; ++j)
    codes[j] = static_cast<uint8_t>(static_cast<int>(q[j]) | (static_cast<int>(q[j + half]) << 4));
}
// fp16's largest finite value, where scales saturate (quant/blocks.py: FP16_MAX).
const float FP16_MAX = static_cast<float>(std::numeric_limits<c10::Half>::max());

inline float clampf(float x, float lo, float hi) { return std::isnan(x) ? x : std::min(std::max(x, lo), hi); }
inline float reciprocal(float d) { return d == 0.f ? 0.f : 1.0f / d; }
inline float finite_or_zero(float x) { return std::isfinite(x) ? x : 0.f; }

struct Coded {
  int64_t bytes, n_blocks;
};

// Quantize one block of `bs` values into `codes` (packed), its fp16 scale (and min); mirrors quant/blocks.py.
void quantize_block(const float* x, int64_t bs, int64_t format, uint8_t* codes, at::Half* scale, at::Half* min) {
  bool finite = true, has_nan = false;  // a block holding NaN codes zeros (the reference's NaN scale turns every
  for (int64_t j = 0; j < bs; ++j) {    // scaled value NaN, then 0); std::max and the comparisons would skip it
    finite = finite && std::isfinite(x[j]);
    has_nan = has_nan || std::isnan(x[j]);
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (format == Q8) {
    float amax = 0.f;
    for (int64_t j = 0; j < bs; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = std::min(amax / 127.0f, FP16_MAX);
    const float inv = reciprocal(d);
    for (int64_t j = 0; j < bs; ++j) {
      const float v = x[j] * inv;
      const float r = finite_or_zero(std::copysign(std::floor(std::fabs(v) + 0.5f), v) * (v == 0.f ? 0.f : 1.f));
      codes[j] = has_nan ? 0 : static_cast<uint8_t>(static_cast<int8_t>(clampf(r, -127.f, 127.f)));
    }
    *scale = at::Half(finite ? d : nan);
    return;
  }
  const int64_t half = bs / 2;
  std::vector<uint8_t> q(bs);
  if (format == Q4_SYM || format == Q3_SYM) {
    const float offset = symmetric_offset(format);
    int64_t imax = 0;
    for (int64_t j = 1; j < bs; ++j)
      if (std::fabs(x[j]) > std::fabs(x[imax])) imax = j;
    const float d = clampf(x[imax] / -offset, -FP16_MAX, FP16_MAX);
    const float inv = reciprocal(d);
    for (int64_t j = 0; j < bs; ++j) {
      const float v = x[j] * inv;
      q[j] = has_nan ? 0 : static_cast<uint8_t>(clampf(finite_or_zero(std::trunc(v + (offset + 0.5f))), 0.f,
                                                        2.f * offset - 1.f));
    }
    *scale = at::Half(finite ? d : nan);
    return pack_symmetric(q.data(), bs, format, codes);
  } else {
    float hi = x[0], lo = x[0];
    for (int64_t j = 1; j < bs; ++j) {
      hi = std::max(hi, x[j]);
      lo = std::min(lo, x[j]);
    }
    lo = clampf(lo, -FP16_MAX, FP16_MAX);
    const float d = clampf((hi - lo) / 15.0f, -FP16_MAX, FP16_MAX);
    const float inv = reciprocal(d);
    for (int64_t j = 0; j < bs; ++j) {
      const float v = (x[j] - lo) * inv;
      q[j] = has_nan ? 0 : static_cast<uint8_t>(clampf(finite_or_zero(std::trunc(v + 0.5f)), 0.f, 15.f));
    }
    *scale = at::Half(finite ? d : nan);
    *min = at::Half(finite ? lo : nan);
  }
  for (int64_t j = 0; j < half; ++j) codes[j] = q[j] | static_cast<uint8_t>(q[j + half] << 4);
}

// Dequantize one block (reference: quant/blocks.py dequantize).
void dequantize_block(const uint8_t* codes, float scale, float min, int64_t bs, int64_t format, float* out) {
  if (format == Q8) {
    for (int64_t j = 0; j < bs; ++j) out[j] = static_cast<float>(static_cast<int8_t>(codes[j])) * scale;
    return;
  }
  const int64_t half = bs / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float lo = static_cast<float>(codes[j] & 0x0F), hi = static_cast<float>(codes[j] >> 4);
    if (format == Q4_SYM) {
      out[j] = (lo - 8.f) * scale;
      out[j + half] = (hi - 8.f) * scale;
    } else {
      out[j] = lo * scale + min;
      out[j + half] = hi * scale + min;
    }
  }
}

std::vector<at::Tensor> allocate(int64_t rows, int64_t dim, int64_t bs, int64_t format, const at::Tensor& like) {
  const int64_t n_blocks = dim / bs, bytes = block_bytes(format, bs);
  auto codes = at::empty({rows, n_blocks, bytes}, like.options().dtype(at::kByte));
  auto scales = at::empty({rows, n_blocks}, like.options().dtype(at::kHalf));
  auto mins = format == Q4_ASYM ? at::empty({rows, n_blocks}, like.options().dtype(at::kHalf))
                                : at::empty({0}, like.options().dtype(at::kHalf));
  return {codes, scales, mins};
}

// q4_0 (or q3_0) with the scale searched over `divisors` of the signed absmax (quant/blocks.py: quantize_q4_0 with
// search_scale): the first divisor whose decoded block, with the stored fp16 scale, has the least squared error.
void quantize_block_searched(const float* x, int64_t bs, int64_t format, const std::vector<double>& divisors,
                             uint8_t* codes, at::Half* scale) {
  const float offset = symmetric_offset(format), top = 2.f * offset - 1.f;
  bool finite = true, has_nan = false;
  int64_t imax = 0;
  for (int64_t j = 0; j < bs; ++j) {
    finite = finite && std::isfinite(x[j]);
    has_nan = has_nan || std::isnan(x[j]);  // (codes zeros, as in quantize_block)
    if (j && std::fabs(x[j]) > std::fabs(x[imax])) imax = j;
  }
#if defined(__AVX512F__)
  if (bs == 16 || bs == 32) {  // the same steps in 16 lanes; the squared errors summed in float64 lanes (each square
                               // exact in float64; the reference sums them in torch's order, not in index order)
    const int vectors = static_cast<int>(bs / 16);
    __m512 xs[2], best[2];
    for (int v = 0; v < vectors; ++v) xs[v] = _mm512_loadu_ps(x + 16 * v);
    const __m512 half_up = _mm512_set1_ps(offset + 0.5f), vo = _mm512_set1_ps(offset), vtop = _mm512_set1_ps(top);
    const __m512 zero = _mm512_setzero_ps(), most = _mm512_set1_ps(std::numeric_limits<float>::max());
    float best_d = 0.f;
    double best_err = 0.0;
    for (size_t k = 0; k < divisors.size(); ++k) {
      const float d = clampf(x[imax] / -static_cast<float>(divisors[k]), -FP16_MAX, FP16_MAX);
      const float inv = reciprocal(d), stored = static_cast<float>(at::Half(d));
      __m512d sum = _mm512_setzero_pd();
      __m512 q[2];
      for (int v = 0; v < vectors; ++v) {
        __m512 c = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(xs[v], _mm512_set1_ps(inv)), half_up),
                                        _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        c = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_abs_ps(c), most, _CMP_LE_OQ), c);  // finite_or_zero
        q[v] = _mm512_min_ps(_mm512_max_ps(c, zero), vtop);
        const __m512 e = _mm512_sub_ps(_mm512_mul_ps(_mm512_sub_ps(q[v], vo), _mm512_set1_ps(stored)), xs[v]);
        const __m512d e0 = _mm512_cvtps_pd(_mm512_castps512_ps256(e));
        const __m512d e1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
        sum = _mm512_fmadd_pd(e1, e1, _mm512_fmadd_pd(e0, e0, sum));  // exact squares: as a multiply, then an add
      }
      const double err = _mm512_reduce_add_pd(sum);
      if (k == 0 || err < best_err) {
        best_err = err, best_d = d;
        for (int v = 0; v < vectors; ++v) best[v] = q[v];
      }
    }
    alignas(64) int32_t codes32[32];
    for (int v = 0; v < vectors; ++v)
      _mm512_store_si512(codes32 + 16 * v, has_nan ? _mm512_setzero_si512() : _mm512_cvttps_epi32(best[v]));
    pack_symmetric(codes32, bs, format, codes);
    *scale = at::Half(finite ? best_d : std::numeric_limits<float>::quiet_NaN());
    return;
  }
#endif
  std::vector<uint8_t> q(bs), best_q(bs);
  float best_d = 0.f;
  double best_err = 0.0;
  for (size_t k = 0; k < divisors.size(); ++k) {
    const float d = clampf(x[imax] / -static_cast<float>(divisors[k]), -FP16_MAX, FP16_MAX);
    const float inv = reciprocal(d), stored = static_cast<float>(at::Half(d));
    double err = 0.0;
    for (int64_t j = 0; j < bs; ++j) {
      q[j] = static_cast<uint8_t>(clampf(finite_or_zero(std::trunc(x[j] * inv + (offset + 0.5f))), 0.f, top));
      const double e = static_cast<double>((static_cast<float>(q[j]) - offset) * stored - x[j]);
      err += e * e;
    }
    if (k == 0 || err < best_err) best_err = err, best_d = d, best_q = q;
  }
  if (has_nan) std::fill(best_q.begin(), best_q.end(), uint8_t{0});
  pack_symmetric(best_q.data(), bs, format, codes);
  *scale = at::Half(finite ? best_d : std::numeric_limits<float>::quiet_NaN());
}

}  // namespace

// x: fp32 [rows, dim] contiguous. Returns {codes [rows, blocks, bytes], scales [rows, blocks], mins or empty}. With
// `divisors` (the q4_0 family and q3_0), each block's scale is searched (quantize_block_searched).
std::vector<at::Tensor> quantize_rows(at::Tensor x, int64_t format, int64_t bs, std::vector<double> divisors) {
  const int64_t rows = x.size(0), dim = x.size(1), n_blocks = dim / bs, bytes = block_bytes(format, bs);
  auto out = allocate(rows, dim, bs, format, x);
  const float* px = x.data_ptr<float>();
  uint8_t* pc = out[0].data_ptr<uint8_t>();
  at::Half* ps = out[1].data_ptr<at::Half>();
  at::Half* pm = out[2].numel() ? out[2].data_ptr<at::Half>() : nullptr;
  at::parallel_for(0, rows, 64, [&](int64_t first, int64_t last) {
  for (int64_t r = first; r < last; ++r)
    for (int64_t b = 0; b < n_blocks; ++b) {
      const int64_t i = r * n_blocks + b;
      if (!divisors.empty() && (format == Q4_SYM || format == Q3_SYM))
        quantize_block_searched(px + r * dim + b * bs, bs, format, divisors, pc + i * bytes, ps + i);
      else
        quantize_block(px + r * dim + b * bs, bs, format, pc + i * bytes, ps + i, pm ? pm + i : nullptr);
    }
  });
  return out;
}

// quantize_rows of new tokens, written in place at sequence rows at..at + n - 1 of growing storage: x fp32
// [B, H, n, dim] (rows contiguous); codes uint8 [B, H, rows, blocks, bytes], scales (and mins, or empty) fp16
// [B, H, rows, blocks], each with its blocks contiguous (any strides on the leading dimensions). With `rotation` (a
// Hadamard block size, 0: none) each row is first rotated as hf_deltakv.kernels.hadamard.rotate rotates it: the same
// butterflies in the same order on the row clamped to ±rotation_limit (NaN and ±inf kept), then times `rotation_scale` (both
// handed over from Python, the one definition: hadamard.ROTATION_LIMIT, hadamard.rotation_scale). Threads take rows.
void quantize_rows_at(at::Tensor x, int64_t format, int64_t bs, std::vector<double> divisors, at::Tensor codes,
                      at::Tensor scales, at::Tensor mins, int64_t at, int64_t rotation, double rotation_scale,
                      double rotation_limit) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 4 && x.stride(3) == 1,
              "x must be fp32 [B, H, n, dim] with rows contiguous");
  const int64_t batch = x.size(0), heads = x.size(1), n = x.size(2), dim = x.size(3), n_blocks = dim / bs;
  const int64_t bytes = block_bytes(format, bs);
  TORCH_CHECK(codes.dim() == 5 && codes.size(0) == batch && codes.size(1) == heads && codes.size(3) == n_blocks &&
                  codes.size(4) == bytes && codes.stride(4) == 1 && codes.stride(3) == bytes,
              "codes must be uint8 [B, H, rows, blocks, bytes] with blocks contiguous");
  TORCH_CHECK(scales.dim() == 4 && scales.size(3) == n_blocks && scales.stride(3) == 1, "scales of another shape");
  const bool asym = format == Q4_ASYM;
  TORCH_CHECK(!asym || (mins.dim() == 4 && mins.size(3) == n_blocks && mins.stride(3) == 1), "mins of another shape");
  TORCH_CHECK(0 <= at && at + n <= codes.size(2) && at + n <= scales.size(2) && (!asym || at + n <= mins.size(2)),
              "rows ", at, "..", at + n - 1, " outside the storage");
  TORCH_CHECK(rotation == 0 || (rotation > 1 && dim % rotation == 0 && !(rotation & (rotation - 1))),
              "rotation must be 0 or a power-of-two block dividing the row");
  const float* px = x.data_ptr<float>();
  uint8_t* pc = codes.data_ptr<uint8_t>();
  at::Half* ps = scales.data_ptr<at::Half>();
  at::Half* pm = asym ? mins.data_ptr<at::Half>() : nullptr;
  const float norm = static_cast<float>(rotation_scale), limit = static_cast<float>(rotation_limit);
  at::parallel_for(0, batch * heads * n, 64, [&](int64_t first, int64_t last) {
    std::vector<float> turned(rotation ? dim : 0);
    for (int64_t i = first; i < last; ++i) {
      const int64_t b = i / (heads * n), h = i / n % heads, t = i % n;
      const float* row = px + b * x.stride(0) + h * x.stride(1) + t * x.stride(2);
      if (rotation) {
        for (int64_t c = 0; c < dim; ++c)  // clamped so that the sums stay finite (comparisons are false for NaN)
          turned[c] = std::isinf(row[c]) ? row[c] : (row[c] > limit ? limit : (row[c] < -limit ? -limit : row[c]));
        for (int64_t step = 1; step < rotation; step *= 2)
          for (int64_t base = 0; base < dim; base += 2 * step)
            for (int64_t c = base; c < base + step; ++c) {
              const float u = turned[c], w = turned[c + step];
              turned[c] = u + w;
              turned[c + step] = u - w;
            }
        for (int64_t c = 0; c < dim; ++c) turned[c] *= norm;
        row = turned.data();
      }
      const int64_t r = at + t;
      uint8_t* c = pc + b * codes.stride(0) + h * codes.stride(1) + r * codes.stride(2);
      at::Half* s = ps + b * scales.stride(0) + h * scales.stride(1) + r * scales.stride(2);
      at::Half* m = pm ? pm + b * mins.stride(0) + h * mins.stride(1) + r * mins.stride(2) : nullptr;
      for (int64_t k = 0; k < n_blocks; ++k) {
        if (!divisors.empty() && (format == Q4_SYM || format == Q3_SYM))
          quantize_block_searched(row + k * bs, bs, format, divisors, c + k * bytes, s + k);
        else
          quantize_block(row + k * bs, bs, format, c + k * bytes, s + k, m ? m + k : nullptr);
      }
    }
  });
}

// Keys after RoPE turned back to before it (hf_deltakv.rope.RopeForm.undo, the same IEEE single-precision operations
// in its order): keys fp32 [B, H, n, D] in the model's channel order, positions int64 [B, n], freqs float64 [D / 2],
// order int64 [D] (canonical channel c is the model's order[c]) or empty. Returns the canonical keys, fp32.
at::Tensor undo_rope(at::Tensor keys, at::Tensor positions, at::Tensor freqs, at::Tensor order) {
  TORCH_CHECK(keys.scalar_type() == at::kFloat && keys.dim() == 4, "keys must be fp32 [B, H, n, D]");
  keys = keys.contiguous(), positions = positions.to(at::kLong).contiguous(), freqs = freqs.contiguous();
  const int64_t batch = keys.size(0), heads = keys.size(1), n = keys.size(2), dim = keys.size(3), half = dim / 2;
  TORCH_CHECK(freqs.scalar_type() == at::kDouble && freqs.numel() == half && dim % 2 == 0, "freqs must be f64 [D/2]");
  TORCH_CHECK(positions.dim() == 2 && positions.size(0) == batch && positions.size(1) == n, "positions [B, n]");
  const bool reorder = order.numel() > 0;
  if (reorder) {
    order = order.to(at::kLong).contiguous();
    TORCH_CHECK(order.numel() == dim, "order must be int64 [D]");
  }
  auto out = at::empty_like(keys);
  const float* pk = keys.data_ptr<float>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const double* pf = freqs.data_ptr<double>();
  const int64_t* po = reorder ? order.data_ptr<int64_t>() : nullptr;
  float* pout = out.data_ptr<float>();
  at::parallel_for(0, batch * n, 16, [&](int64_t first, int64_t last) {  // threads take tokens
    std::vector<float> cosv(half), sinv(half);
    for (int64_t i = first; i < last; ++i) {
      const int64_t b = i / n, t = i % n;
      const double p = static_cast<double>(pp[b * n + t]);
      for (int64_t c = 0; c < half; ++c) {
        const double angle = p * pf[c];
        cosv[c] = static_cast<float>(std::cos(angle)), sinv[c] = -static_cast<float>(std::sin(angle));
      }
      for (int64_t h = 0; h < heads; ++h) {
        const float* k = pk + ((b * heads + h) * n + t) * dim;
        float* o = pout + ((b * heads + h) * n + t) * dim;
        for (int64_t c = 0; c < half; ++c) {
          const float lo = k[po ? po[c] : c], hi = k[po ? po[c + half] : c + half];
          const float a = lo * cosv[c], bb = hi * sinv[c], e = hi * cosv[c], f = lo * sinv[c];
          o[c] = a - bb;
          o[c + half] = e + f;
        }
      }
    }
  });
  return out;
}

// A decoding step's token of a StaticDeltaKVCache layer past its sinks, in place (reference.append_token's steps, one
// call): `counts[0]` (int64, the tokens held) gives the slot; `position` int64 [B] (or empty: the count held) is
// recorded at it in `positions` int32 [B, max_cache_len]; the key [B, H, 1, D] (any float dtype), turned back by its
// RoPE (undo_rope with `freqs` float64 [D / 2] and `order`; both empty: as given), saturated to fp16 (NaN kept) into row
// `row` of the raw `tail` fp16 [B, H, rows, D]; the value [B, H, 1, D] quantized (quantize_rows_at's arguments) into
// row `held - sinks` of its storage; then counts[0] advances.
void append_step(at::Tensor key, at::Tensor value, at::Tensor position, at::Tensor positions, at::Tensor freqs,
                 at::Tensor order, at::Tensor counts, at::Tensor tail, int64_t row, int64_t sinks, int64_t format,
                 int64_t bs, std::vector<double> divisors, at::Tensor codes, at::Tensor scales, at::Tensor mins,
                 int64_t rotation, double rotation_scale, double rotation_limit) {
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.device().is_cpu() && counts.dim() == 1 &&
                  counts.is_contiguous(), "counts must be int64 on the CPU, contiguous");
  int64_t* count = counts.data_ptr<int64_t>();
  const int64_t held = count[0];
  const int64_t batch = key.size(0), heads = key.size(1), dim = key.size(3);
  TORCH_CHECK(key.dim() == 4 && key.size(2) == 1 && value.dim() == 4 && value.size(2) == 1,
              "one token: key and value [B, H, 1, D]");
  TORCH_CHECK(positions.scalar_type() == at::kInt && positions.dim() == 2 && positions.size(0) == batch &&
                  positions.stride(1) == 1 && sinks <= held && held < positions.size(1),
              "positions must be int32 [B, max_cache_len] with room for the token after the sinks");
  TORCH_CHECK(tail.scalar_type() == at::kHalf && tail.dim() == 4 && tail.size(0) == batch && tail.size(1) == heads &&
                  tail.size(3) == dim && tail.stride(3) == 1 && 0 <= row && row < tail.size(2),
              "tail must be fp16 [B, H, rows, D] with row ", row);
  TORCH_CHECK(!position.numel() || (position.scalar_type() == at::kLong && position.numel() == batch),
              "position must be int64 [B] or empty");
  const at::Tensor given = position.numel() ? position.contiguous() : position;
  int32_t* slot = positions.data_ptr<int32_t>() + held;
  for (int64_t b = 0; b < batch; ++b)
    slot[b * positions.stride(0)] = static_cast<int32_t>(given.numel() ? given.data_ptr<int64_t>()[b] : held);
  at::Tensor k = key.to(at::kFloat);
  if (freqs.numel()) k = undo_rope(k, positions.narrow(1, held, 1), freqs, order);
  k = k.contiguous();
  const float* pk = k.data_ptr<float>();
  at::Half* pt = tail.data_ptr<at::Half>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      const float* src = pk + (b * heads + h) * dim;
      at::Half* dst = pt + b * tail.stride(0) + h * tail.stride(1) + row * tail.stride(2);
      for (int64_t c = 0; c < dim; ++c)  // quant.saturate_fp16: clamped, then rounded to nearest (NaN stays NaN)
        dst[c] = at::Half(std::isnan(src[c]) ? src[c] : std::min(std::max(src[c], -FP16_MAX), FP16_MAX));
    }
  at::Tensor v = value.to(at::kFloat);
  quantize_rows_at(v.stride(3) == 1 ? v : v.contiguous(), format, bs, std::move(divisors), codes, scales, mins,
                   held - sinks, rotation, rotation_scale, rotation_limit);
  count[0] = held + 1;
}

// One closed-loop step for rows of x (fp32 [rows, dim]): code x - base, and with `intra` per block the better of that
// and x - long_term (flag in the scale's lowest bit). Returns {codes, scales, mins or empty, reconstruction}.
std::vector<at::Tensor> code_delta_rows(at::Tensor x, at::Tensor base, at::Tensor long_term, int64_t format,
                                           int64_t bs, bool intra) {
  TORCH_CHECK(format != Q3_SYM, "the delta codec's blocks are q4_0, q4_1 or q8_0 families");
  const int64_t rows = x.size(0), dim = x.size(1), n_blocks = dim / bs, bytes = block_bytes(format, bs);
  auto out = allocate(rows, dim, bs, format, x);
  auto recon = at::empty_like(x);
  const float *px = x.data_ptr<float>(), *pb = base.data_ptr<float>();
  const float* pl = intra ? long_term.data_ptr<float>() : nullptr;
  uint8_t* pc = out[0].data_ptr<uint8_t>();
  at::Half* ps = out[1].data_ptr<at::Half>();
  at::Half* pm = out[2].numel() ? out[2].data_ptr<at::Half>() : nullptr;
  float* pr = recon.data_ptr<float>();
  std::vector<float> residual(bs), values(bs);
  std::vector<uint8_t> intra_codes(bytes);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < n_blocks; ++b) {
      const int64_t i = r * n_blocks + b, o = r * dim + b * bs;
      uint8_t* codes = pc + i * bytes;
      // inter: against the previous reconstruction
      for (int64_t j = 0; j < bs; ++j) residual[j] = px[o + j] - pb[o + j];
      at::Half scale, min;
      quantize_block(residual.data(), bs, format, codes, &scale, &min);
      bool use_intra = false;
      at::Half intra_scale, intra_min;
      if (intra) {
        dequantize_block(codes, static_cast<float>(scale), pm ? static_cast<float>(min) : 0.f, bs, format,
                         values.data());
        double inter_sse = 0.0;
        for (int64_t j = 0; j < bs; ++j) {
          const double e = static_cast<double>((pb[o + j] + values[j]) - px[o + j]);
          inter_sse += e * e;
        }
        for (int64_t j = 0; j < bs; ++j) residual[j] = px[o + j] - pl[o + j];
        quantize_block(residual.data(), bs, format, intra_codes.data(), &intra_scale, &intra_min);
        dequantize_block(intra_codes.data(), static_cast<float>(intra_scale), pm ? static_cast<float>(intra_min) : 0.f,
                         bs, format, values.data());
        double intra_sse = 0.0;
        for (int64_t j = 0; j < bs; ++j) {
          const double e = static_cast<double>((pl[o + j] + values[j]) - px[o + j]);
          intra_sse += e * e;
        }
        use_intra = intra_sse < inter_sse;
        if (use_intra) {
          std::memcpy(codes, intra_codes.data(), bytes);
          scale = intra_scale;
          min = intra_min;
        }
        uint16_t bits;
        std::memcpy(&bits, &scale, sizeof bits);
        bits = static_cast<uint16_t>((bits & ~1u) | (use_intra ? 1u : 0u));
        std::memcpy(&scale, &bits, sizeof bits);
      }
      ps[i] = scale;
      if (pm) pm[i] = min;
      // the reconstruction the decoder computes from what is stored (the flagged scale)
      dequantize_block(codes, static_cast<float>(scale), pm ? static_cast<float>(min) : 0.f, bs, format, values.data());
      const float* ref = use_intra ? pl : pb;
      for (int64_t j = 0; j < bs; ++j) pr[o + j] = ref[o + j] + values[j];
    }
  return {out[0], out[1], out[2], recon};
}

// The queries' pair energies averaged over a group (kernels/reference.py: query_energy, the same fp32 operations in
// its order): query fp32 [B, K, M, R, D] contiguous, order int64 [D] (canonical channel c is order[c]) or empty.
// Returns fp32 [B, K, R, D]: for each of the R rows, the mean over the M rows of (x_c^2 + x_{c+D/2}^2) / 2, both halves.
at::Tensor query_energy(at::Tensor query, at::Tensor order) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && query.dim() == 5 && query.is_contiguous(),
              "query must be fp32 [B, K, M, R, D], contiguous");
  const int64_t outer = query.size(0) * query.size(1), groups = query.size(2), rows = query.size(3);
  const int64_t dim = query.size(4), half = dim / 2;
  const bool reorder = order.numel() > 0;
  if (reorder) order = order.to(at::kLong).contiguous();
  TORCH_CHECK(!reorder || order.numel() == dim, "order must be int64 [D]");
  auto out = at::empty({query.size(0), query.size(1), rows, dim}, query.options());
  const float* pq = query.data_ptr<float>();
  const int64_t* po = reorder ? order.data_ptr<int64_t>() : nullptr;
  float* pout = out.data_ptr<float>();
  const float count = static_cast<float>(groups);
  at::parallel_for(0, outer * rows, 64, [&](int64_t first, int64_t last) {  // threads take output rows
    for (int64_t i = first; i < last; ++i) {
      const int64_t o = i / rows, r = i % rows;
      float* dst = pout + (o * rows + r) * dim;
      for (int64_t c = 0; c < half; ++c) {
        const int64_t lo = po ? po[c] : c, hi = po ? po[c + half] : c + half;
        float sum = 0.f;
        for (int64_t m = 0; m < groups; ++m) {
          const float* x = pq + ((o * groups + m) * rows + r) * dim;
          const float a = x[lo] * x[lo], b = x[hi] * x[hi];
          const float pair = (a + b) / 2.0f;
          sum = m == 0 ? pair : sum + pair;
        }
        dst[c] = dst[c + half] = sum / count;
      }
    }
  });
  return out;
}

// Integer depths by reverse water-filling (kernels/reference.py: allocate_depths, the same fp32 steps; each sum of the
// bisection in float64, exact in any order): level fp32 [N, D] (finite). Returns uint8 [N, D], rows summing to total.
at::Tensor allocate_depths(at::Tensor level, int64_t total, int64_t most, int64_t steps) {
  TORCH_CHECK(level.scalar_type() == at::kFloat && level.dim() == 2 && level.is_contiguous(), "level fp32 [N, D]");
  const int64_t n = level.size(0), dim = level.size(1);
  auto out = at::empty({n, dim}, level.options().dtype(at::kByte));
  const float* pl = level.data_ptr<float>();
  uint8_t* po = out.data_ptr<uint8_t>();
  const float top = static_cast<float>(most);
  const double want = static_cast<double>(total);
  at::parallel_for(0, n, 8, [&](int64_t first, int64_t last) {  // threads take rows
    std::vector<float> base(dim), fraction(dim), bits(dim);
    std::vector<int64_t> order(dim);
    for (int64_t r = first; r < last; ++r) {
      const float* row = pl + r * dim;
      float high = row[0], low = row[0];
      for (int64_t c = 1; c < dim; ++c) high = std::max(high, row[c]), low = std::min(low, row[c]);
      float lo = -4.0f * top - high, hi = 4.0f * top - low;
      for (int64_t s = 0; s < steps; ++s) {
        const float middle = (lo + hi) / 2.0f;
        double spent = 0.0;
        for (int64_t c = 0; c < dim; ++c) spent += static_cast<double>(std::min(std::max(row[c] + middle, 1.0f), top));
        if (spent < want) lo = middle;
        else hi = middle;
      }
      float floors = 0.f;  // integers: exact in any order
      for (int64_t c = 0; c < dim; ++c) {
        const float depth = std::min(std::max(row[c] + hi, 1.0f), top);
        base[c] = std::floor(depth);
        fraction[c] = base[c] >= top ? -1.0f : depth - base[c];
        floors += base[c];
      }
      const float left = std::max(static_cast<float>(total) - floors, 0.0f);
      for (int64_t c = 0; c < dim; ++c) order[c] = c;
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return fraction[a] > fraction[b]; });
      float given = 0.f;
      for (int64_t k = 0; k < dim; ++k) bits[order[k]] = base[order[k]] + (static_cast<float>(k) < left ? 1.f : 0.f);
      for (int64_t c = 0; c < dim; ++c) given += bits[c];
      const float excess = given - static_cast<float>(total);  // float edge cases: take bits back from the largest
      if (excess > 0.f) {
        for (int64_t c = 0; c < dim; ++c) order[c] = c;
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return bits[a] > bits[b]; });
        for (int64_t k = 0; k < dim; ++k) bits[order[k]] -= static_cast<float>(k) < excess ? 1.f : 0.f;
      }
      for (int64_t c = 0; c < dim; ++c) po[r * dim + c] = static_cast<uint8_t>(bits[c]);
    }
  });
  return out;
}

// Bit planes of per-channel codes (quant/bitplanes.py: pack_planes). codes uint8 [N, G, D] (G a multiple of 8),
// depths uint8 [N, D] (each group's depths sum to `planes`). Returns uint8 [N, planes, G / 8].
at::Tensor pack_planes(at::Tensor codes, at::Tensor depths, int64_t planes) {
  codes = codes.contiguous(), depths = depths.contiguous();
  const int64_t n = codes.size(0), group = codes.size(1), dim = codes.size(2), width = group / 8;
  auto out = at::zeros({n, planes, width}, codes.options());
  const uint8_t* pc = codes.data_ptr<uint8_t>();
  const uint8_t* pd = depths.data_ptr<uint8_t>();
  uint8_t* po = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> column(group + 16, 0);  // one channel's codes, token by token (zero past the group)
    for (int64_t g = begin; g < end; ++g) {
      int64_t plane = 0;
      for (int64_t c = 0; c < dim; ++c) {
        const int bits = pd[g * dim + c];
        TORCH_CHECK(plane + bits <= planes, "depths exceed the planes of a group");
        for (int64_t j = 0; j < group; ++j) column[j] = pc[(g * group + j) * dim + c];
        for (int b = 0; b < bits; ++b, ++plane) {
          uint8_t* row = po + (g * planes + plane) * width;
#if defined(__SSE2__)
          // Bit b of 16 tokens' codes moved to each byte's top bit, gathered by movemask: bit k of the mask is token
          // k's, which is the plane's byte order (token j at bit j % 8 of byte j / 8).
          const __m128i shift = _mm_cvtsi32_si128(7 - b);
          for (int64_t j0 = 0; j0 < group; j0 += 16) {
            const __m128i codes16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(column.data() + j0));
            const uint16_t mask = static_cast<uint16_t>(_mm_movemask_epi8(_mm_sll_epi16(codes16, shift)));
            std::memcpy(row + j0 / 8, &mask, std::min<int64_t>(2, width - j0 / 8));
          }
#else
          for (int64_t j = 0; j < group; ++j) row[j / 8] |= static_cast<uint8_t>(((column[j] >> b) & 1) << (j % 8));
#endif
        }
      }
      TORCH_CHECK(plane == planes, "depths of a group must sum to its planes");
    }
  });
  return out;
}

namespace {

namespace L = hfd::lanes;

// reference._grid_codes: round((x - low) * inverse), NaN to 0, within [0, top]
inline float grid_code(float v, float l, float inverse, float top) {
  float k = std::nearbyint((v - l) * inverse);
  k = k == k ? k : 0.f;
  return std::min(std::max(k, 0.f), top);
}

// `grid_code` on W lanes (max(k, 0) is 0 where k is NaN: lanes.h's max returns its second operand)
inline L::F grid_lanes(L::F x, L::F lo, L::F inv, L::F top) {
  return L::min(L::max(L::round_even(L::mul(L::sub(x, lo), inv)), L::zero()), top);
}

// reference.best_candidate for one group xg fp32 [group, D] at levels `top` [D]: of the `count` candidate ranges
// (lows, steps, inverses fp32 [count, D], fp16 values), each channel's of least squared error (NaN: infinite, then
// the first least, as nan_to_num(inf).argmin); the chosen candidate is moved to row 0, its index to best [D], and the
// group's codes against it written to out uint8 [group, D]. `errors`: room for count * D floats.
void least_error(const float* xg, int64_t group, int64_t dim, int64_t count, const float* top, float* lows,
                 float* steps, float* inverses, float* errors, int64_t* best_index, uint8_t* out) {
  if (count > 1) {
    std::fill(errors, errors + count * dim, 0.f);
    for (int64_t c = 0; c < count; ++c) {
      const float *l = lows + c * dim, *s = steps + c * dim, *inv = inverses + c * dim;
      float* err = errors + c * dim;
      int64_t d0 = 0;  // channels summed W at a time, each channel's sum in a register over the tokens (lanes.h)
      for (; d0 + L::W <= dim; d0 += L::W) {
        const L::F vl = L::load(l + d0), vs = L::load(s + d0), vi = L::load(inv + d0), vt = L::load(top + d0);
        L::F sum = L::zero();
        for (int64_t t = 0; t < group; ++t) {
          const L::F v = L::load(xg + t * dim + d0);
          const L::F k = grid_lanes(v, vl, vi, vt);
          const L::F e = L::sub(L::add(L::mul(k, vs), vl), v);
          sum = L::add(sum, L::mul(e, e));
        }
        L::store(err + d0, sum);
      }
      for (int64_t t = 0; t < group; ++t) {
        const float* v = xg + t * dim;
        for (int64_t d = d0; d < dim; ++d) {
          const float e = (grid_code(v[d], l[d], inv[d], top[d]) * s[d] + l[d]) - v[d];
          err[d] += e * e;
        }
      }
    }
  }
  for (int64_t d = 0; d < dim; ++d) {  // the chosen candidate of each channel, its row moved to candidate 0
    int64_t best = 0;
    float least = 0.f;
    for (int64_t c = 0; c < count && count > 1; ++c) {  // nan_to_num(inf), then the first least (argmin)
      float e = errors[c * dim + d];
      e = e != e ? std::numeric_limits<float>::infinity()
                 : (e == std::numeric_limits<float>::infinity() ? std::numeric_limits<float>::max() : e);
      if (c == 0 || e < least) best = c, least = e;
    }
    lows[d] = lows[best * dim + d], steps[d] = steps[best * dim + d], inverses[d] = inverses[best * dim + d];
    best_index[d] = best;
  }
  for (int64_t t = 0; t < group; ++t) {
    const float* v = xg + t * dim;
    uint8_t* row = out + t * dim;
    int64_t d = 0;
    for (; d + L::W <= dim; d += L::W) {
      L::store_bytes(row + d, grid_lanes(L::load(v + d), L::load(lows + d), L::load(inverses + d), L::load(top + d)));
    }
    for (; d < dim; ++d) row[d] = static_cast<uint8_t>(grid_code(v[d], lows[d], inverses[d], top[d]));
  }
}

}  // namespace

// The adaptive keys' clipped ranges (kernels/reference.py: clipped_codes, the same fp32 operations in its order):
// each channel of a group coded over the candidate range of `clips` with the least squared error, and its codes.
// x fp32 [N, G, D], low and span fp32 [N, D] (the group's whole range), levels fp32 [N, D] (2^depth - 1), clips fp32
// [C, 2] (rows of reference.CLIPS: fractions given up at the low and high ends). Returns codes uint8 [N, G, D], low
// and step fp16 [N, D]. One exception to the same bytes: a candidate's squared errors are added over the tokens in
// order, the reference adds them in torch's order, so a candidate whose error ties another's to the last bit may be
// chosen differently (the same error, another range), as in the Triton kernel (triton/adaptive_code.py).
std::vector<at::Tensor> clipped_codes(at::Tensor x, at::Tensor low, at::Tensor span, at::Tensor levels,
                                      at::Tensor clips) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3, "x must be fp32 [N, G, D]");
  const int64_t n = x.size(0), group = x.size(1), dim = x.size(2);
  for (const at::Tensor* t : {&low, &span, &levels})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == n && t->size(1) == dim,
                "low, span and levels must be fp32 [N, D]");
  TORCH_CHECK(clips.dim() == 2 && clips.size(1) == 2 && clips.size(0) >= 1, "clips must be [C, 2], C >= 1");
  x = x.contiguous(), low = low.contiguous(), span = span.contiguous(), levels = levels.contiguous();
  clips = clips.to(at::kFloat).contiguous();
  const int64_t count = clips.size(0);
  auto codes = at::empty({n, group, dim}, x.options().dtype(at::kByte));
  auto out_low = at::empty({n, dim}, x.options().dtype(at::kHalf));
  auto out_step = at::empty({n, dim}, x.options().dtype(at::kHalf));
  const float *px = x.data_ptr<float>(), *pl = low.data_ptr<float>(), *ps = span.data_ptr<float>();
  const float *pt = levels.data_ptr<float>(), *pc = clips.data_ptr<float>();
  uint8_t* pcodes = codes.data_ptr<uint8_t>();
  at::Half *plow = out_low.data_ptr<at::Half>(), *pstep = out_step.data_ptr<at::Half>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> lows(count * dim), steps(count * dim), inverses(count * dim), errors(count * dim);
    std::vector<int64_t> best(dim);
    for (int64_t g = begin; g < end; ++g) {
      const float *lo = pl + g * dim, *sp = ps + g * dim, *top = pt + g * dim;
      for (int64_t c = 0; c < count; ++c) {  // each candidate's fp16 low and step per channel, W channels at a time
        const float give = pc[2 * c], keep = 1.0f - pc[2 * c + 1];
        float *l = lows.data() + c * dim, *s = steps.data() + c * dim, *inv = inverses.data() + c * dim;
        int64_t d = 0;
        for (; d + L::W <= dim; d += L::W) {
          const L::F vlo = L::load(lo + d), vsp = L::load(sp + d);
          const L::F vl = L::round_half(L::clamp(L::add(vlo, L::mul(L::set1(give), vsp)), -FP16_MAX, FP16_MAX));
          const L::F high = L::add(vlo, L::mul(vsp, L::set1(keep)));
          const L::F vs = L::round_half(L::clamp(L::div(L::sub(high, vl), L::load(top + d)), 0.f, FP16_MAX));
          L::store(l + d, vl), L::store(s + d, vs);
          L::store(inv + d, L::keep(L::greater(vs, L::zero()), L::div(L::set1(1.0f), vs)));
        }
        for (; d < dim; ++d) {
          l[d] = static_cast<float>(static_cast<c10::Half>(clampf(lo[d] + give * sp[d], -FP16_MAX, FP16_MAX)));
          const float high = lo[d] + sp[d] * keep;
          s[d] = static_cast<float>(static_cast<c10::Half>(clampf((high - l[d]) / top[d], 0.f, FP16_MAX)));
          inv[d] = s[d] > 0.f ? 1.0f / s[d] : 0.f;
        }
      }
      least_error(px + g * group * dim, group, dim, count, top, lows.data(), steps.data(), inverses.data(),
                  errors.data(), best.data(), pcodes + g * group * dim);
      for (int64_t d = 0; d < dim; ++d) {
        plow[g * dim + d] = static_cast<c10::Half>(lows[d]), pstep[g * dim + d] = static_cast<c10::Half>(steps[d]);
      }
    }
  });
  return {codes, out_low, out_step};
}

// The search alone (kernels/reference.py: best_candidate): of candidate ranges given as fp16 lows and steps [N, D, C]
// (the grid's, kernels/key_grid.py), each channel's of least squared error over the groups x fp32 [N, G, D] at levels
// fp32 [N, D]. Returns codes uint8 [N, G, D], the chosen low and step fp16 [N, D] and its index int64 [N, D]. The same
// exception as clipped_codes: a tie to the last bit may pick another candidate of the same error.
std::vector<at::Tensor> best_candidate(at::Tensor x, at::Tensor lows, at::Tensor steps, at::Tensor levels) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3, "x must be fp32 [N, G, D]");
  const int64_t n = x.size(0), group = x.size(1), dim = x.size(2);
  TORCH_CHECK(lows.scalar_type() == at::kHalf && steps.scalar_type() == at::kHalf && lows.dim() == 3 &&
                  lows.sizes() == steps.sizes() && lows.size(0) == n && lows.size(1) == dim && lows.size(2) >= 1,
              "lows and steps must be fp16 [N, D, C], C >= 1");
  TORCH_CHECK(levels.scalar_type() == at::kFloat && levels.dim() == 2 && levels.size(0) == n && levels.size(1) == dim,
              "levels must be fp32 [N, D]");
  x = x.contiguous(), levels = levels.contiguous();
  const int64_t count = lows.size(2);
  const auto candidates = [&](const at::Tensor& t) { return t.to(at::kFloat).transpose(1, 2).contiguous(); };
  const at::Tensor all_lows = candidates(lows), all_steps = candidates(steps);  // fp32 [N, C, D]
  auto codes = at::empty({n, group, dim}, x.options().dtype(at::kByte));
  auto out_low = at::empty({n, dim}, x.options().dtype(at::kHalf));
  auto out_step = at::empty({n, dim}, x.options().dtype(at::kHalf));
  auto out_best = at::empty({n, dim}, x.options().dtype(at::kLong));
  const float *px = x.data_ptr<float>(), *pt = levels.data_ptr<float>();
  const float *pl = all_lows.data_ptr<float>(), *ps = all_steps.data_ptr<float>();
  uint8_t* pcodes = codes.data_ptr<uint8_t>();
  at::Half *plow = out_low.data_ptr<at::Half>(), *pstep = out_step.data_ptr<at::Half>();
  int64_t* pbest = out_best.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> l(count * dim), s(count * dim), inverses(count * dim), errors(count * dim);
    for (int64_t g = begin; g < end; ++g) {
      std::copy(pl + g * count * dim, pl + (g + 1) * count * dim, l.begin());
      std::copy(ps + g * count * dim, ps + (g + 1) * count * dim, s.begin());
      for (int64_t i = 0; i < count * dim; ++i) inverses[i] = s[i] > 0.f ? 1.0f / s[i] : 0.f;
      least_error(px + g * group * dim, group, dim, count, pt + g * dim, l.data(), s.data(), inverses.data(),
                  errors.data(), pbest + g * dim, pcodes + g * group * dim);
      for (int64_t d = 0; d < dim; ++d) {
        plow[g * dim + d] = static_cast<c10::Half>(l[d]), pstep[g * dim + d] = static_cast<c10::Half>(s[d]);
      }
    }
  });
  return {codes, out_low, out_step, out_best};
}

// The grid's ranges as the kernels read them (kernels/key_grid.py: ranges, the same fp32 operations in its order):
// low_code and high_code uint8 [B, H, G, D] and packed depths uint8 [B, H, G, D / 2] (quant.pack_4bit; the last
// dimension contiguous, the others any stride: views of storage with room), the grid origin and unit fp32 [B, H, D].
// Returns low and step fp16 [B, H, G, D]: low = origin + low_code * unit, step = (origin + high_code * unit - low) /
// (2^depth - 1), each clamped to fp16's range.
std::vector<at::Tensor> grid_ranges(at::Tensor low_code, at::Tensor high_code, at::Tensor depths, at::Tensor origin,
                                    at::Tensor unit) {
  TORCH_CHECK(low_code.dim() == 4 && low_code.scalar_type() == at::kByte && high_code.sizes() == low_code.sizes() &&
                  high_code.scalar_type() == at::kByte,
              "low_code and high_code must be uint8 [B, H, G, D]");
  const int64_t batch = low_code.size(0), heads = low_code.size(1), groups = low_code.size(2), dim = low_code.size(3);
  TORCH_CHECK(dim % 2 == 0 && depths.scalar_type() == at::kByte && depths.dim() == 4 && depths.size(0) == batch &&
                  depths.size(1) == heads && depths.size(2) == groups && depths.size(3) == dim / 2,
              "depths must be packed uint8 [B, H, G, D / 2]");
  for (const at::Tensor* t : {&origin, &unit})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == batch && t->size(1) == heads &&
                    t->size(2) == dim,
                "origin and unit must be fp32 [B, H, D]");
  for (at::Tensor* t : {&low_code, &high_code, &depths})
    if (t->size(3) > 1 && t->stride(3) != 1) *t = t->contiguous();
  origin = origin.contiguous(), unit = unit.contiguous();
  auto low = at::empty({batch, heads, groups, dim}, origin.options().dtype(at::kHalf));
  auto step = at::empty({batch, heads, groups, dim}, origin.options().dtype(at::kHalf));
  const uint8_t *plc = low_code.data_ptr<uint8_t>(), *phc = high_code.data_ptr<uint8_t>();
  const uint8_t* pd = depths.data_ptr<uint8_t>();
  const float *po = origin.data_ptr<float>(), *pu = unit.data_ptr<float>();
  at::Half *pl = low.data_ptr<at::Half>(), *ps = step.data_ptr<at::Half>();
  const int64_t half = dim / 2;
  at::parallel_for(0, batch * heads * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (heads * groups), h = i / groups % heads, g = i % groups;
      const uint8_t* lc = plc + b * low_code.stride(0) + h * low_code.stride(1) + g * low_code.stride(2);
      const uint8_t* hc = phc + b * high_code.stride(0) + h * high_code.stride(1) + g * high_code.stride(2);
      const uint8_t* dp = pd + b * depths.stride(0) + h * depths.stride(1) + g * depths.stride(2);
      const float *o = po + (b * heads + h) * dim, *u = pu + (b * heads + h) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const int depth = d < half ? dp[d] & 0x0F : dp[d - half] >> 4;
        const float levels = static_cast<float>((1 << depth) - 1);
        const at::Half l = static_cast<at::Half>(clampf(o[d] + static_cast<float>(lc[d]) * u[d], -FP16_MAX, FP16_MAX));
        const float high = o[d] + static_cast<float>(hc[d]) * u[d];
        pl[i * dim + d] = l;
        ps[i * dim + d] = static_cast<at::Half>(clampf((high - static_cast<float>(l)) / levels, 0.f, FP16_MAX));
      }
    }
  });
  return {low, step};
}

// Decoded values of whole adaptive groups (kernels/reference.py: decode_adaptive): planes uint8 [N, P, G / 8], packed
// depths uint8 [N, D / 2] (quant.pack_4bit), low and step fp16 [N, D]. Returns fp32 [N, G, D] of fp16 values.
at::Tensor decode_planes(at::Tensor planes, at::Tensor depths, at::Tensor low, at::Tensor step) {
  planes = planes.contiguous(), depths = depths.contiguous(), low = low.contiguous(), step = step.contiguous();
  const int64_t n = planes.size(0), count = planes.size(1), width = planes.size(2), group = width * 8;
  const int64_t dim = low.size(1);
  auto out = at::empty({n, group, dim}, low.options().dtype(at::kFloat));
  const uint8_t* pp = planes.data_ptr<uint8_t>();
  const uint8_t* pd = depths.data_ptr<uint8_t>();
  const at::Half* pl = low.data_ptr<at::Half>();
  const at::Half* ps = step.data_ptr<at::Half>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> code(group);
    for (int64_t g = begin; g < end; ++g) {
      int64_t plane = 0;
      for (int64_t c = 0; c < dim; ++c) {
        const uint8_t packed = pd[g * (dim / 2) + (c < dim / 2 ? c : c - dim / 2)];
        const int bits = c < dim / 2 ? (packed & 0x0F) : (packed >> 4);
        const float lo = static_cast<float>(pl[g * dim + c]), s = static_cast<float>(ps[g * dim + c]);
        const uint8_t* planes_c = pp + (g * count + plane) * width;
        float* out_c = po + g * group * dim + c;
        int64_t j0 = 0;  // tokens decoded by the vector loop
#if defined(__AVX512F__)
        // 16 tokens at a time (planes.h), stored every `dim` floats.
        const __m512i stride = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                  _mm512_set1_epi32(static_cast<int32_t>(dim)));
        for (; j0 + 16 <= group; j0 += 16)
          _mm512_i32scatter_ps(out_c + j0 * dim, stride, hfd::plane_values16(planes_c, bits, width, j0 / 8, lo, s), 4);
#endif
        std::fill(code.begin() + j0, code.end(), 0u);
        for (int b = 0; b < bits; ++b) {
          const uint8_t* row = planes_c + b * width;
          for (int64_t j = j0; j < group; ++j) code[j] |= static_cast<uint32_t>((row[j / 8] >> (j % 8)) & 1) << b;
        }
        for (int64_t j = j0; j < group; ++j) {  // fp16 values (reference: decode_groups), saturated, NaN kept
          const float value = clampf(lo + static_cast<float>(code[j]) * s, -FP16_MAX, FP16_MAX);
          out_c[j * dim] = static_cast<float>(static_cast<c10::Half>(value));
        }
        plane += bits;
      }
    }
  });
  return out;
}
