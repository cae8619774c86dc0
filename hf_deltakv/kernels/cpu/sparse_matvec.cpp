// Decode-time linear layers that read only the weights of the input channels that matter (weight skip).
// Specification: hf_deltakv.kernels.reference.sparse_matvec. The weight is stored input-major (`wt` [in, out], the
// transpose of nn.Linear's [out, in]), so a kept input channel's weights are one contiguous row. The kernel reads the
// activations once, lists the kept channels, and streams only their rows, whole and in order: each thread takes a
// share of the kept rows (long contiguous reads, what the memory prefetchers serve best) and adds ROWS_PER_PASS rows
// at a time into its own partial sums, which stay in L1/L2; the partial sums are added at the end.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t ROWS_PER_PASS = 8;  // kept rows added to the partial sums per pass over them
constexpr int64_t MAX_BATCH = 8;      // sequences served by one pass over the kept rows
constexpr int64_t MIN_ROWS_PER_THREAD = 64;  // fewer rows than this per thread: not worth another thread

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(at::Half v) { return static_cast<float>(v); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {  // bf16 is the top half of an fp32
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
#endif

// y[b, :] += sum_k x[b, rows[k]] * wt[rows[k], :] for k < count (count <= ROWS_PER_PASS), b < batch.
template <typename W>
void add_rows(const float* x, int64_t batch, int64_t in, const int64_t* rows, int64_t count, const W* wt,
              int64_t out, float* y) {
  const W* row[ROWS_PER_PASS];
  for (int64_t k = 0; k < count; ++k) row[k] = wt + rows[k] * out;
  for (int64_t b = 0; b < batch; ++b) {
    float xs[ROWS_PER_PASS];
    for (int64_t k = 0; k < count; ++k) xs[k] = x[b * in + rows[k]];
    float* yb = y + b * out;
#if defined(__AVX512F__)
    __m512 xv[ROWS_PER_PASS];
    for (int64_t k = 0; k < count; ++k) xv[k] = _mm512_set1_ps(xs[k]);
    for (int64_t j = 0; j < out; j += 16) {
      const __mmask16 m = out - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (out - j)) - 1);
      __m512 acc = _mm512_maskz_loadu_ps(m, yb + j);
      for (int64_t k = 0; k < count; ++k) acc = _mm512_fmadd_ps(xv[k], load16(row[k] + j, m), acc);
      _mm512_mask_storeu_ps(yb + j, m, acc);
    }
#else
    for (int64_t k = 0; k < count; ++k) {
      const W* r = row[k];
      const float xk = xs[k];
#pragma omp simd
      for (int64_t j = 0; j < out; ++j) yb[j] += xk * to_float(r[j]);
    }
#endif
  }
}

template <typename W>
void accumulate(const float* x, int64_t batch, int64_t in, const int64_t* rows, int64_t count, const W* wt,
                int64_t out, float* y) {
  for (int64_t k = 0; k < count; k += ROWS_PER_PASS)
    add_rows(x, batch, in, rows + k, std::min(ROWS_PER_PASS, count - k), wt, out, y);
}

}  // namespace

// y [..., out] = x[..., kept] @ wt[kept, :] (+ bias), in x's dtype (sums in fp32). kept = the input channels where
// |x| * scale >= threshold for some sequence (scale: per-channel weights of the score, e.g. the weight's column
// norms; empty: 1); threshold 0 keeps every channel with a nonzero score (exact). wt [in, out] fp32, bf16 or fp16,
// contiguous. Returns {y, number of kept channels}.
std::tuple<at::Tensor, int64_t> sparse_matvec(at::Tensor x, at::Tensor wt, at::Tensor bias,
                                                 at::Tensor scale, double threshold) {
  TORCH_CHECK(wt.dim() == 2 && x.dim() >= 1 && x.size(-1) == wt.size(0), "sparse_matvec: x [..., in], wt [in, out]");
  TORCH_CHECK(wt.is_contiguous(), "sparse_matvec: the weight must be stored input-major and contiguous");
  const auto st = wt.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
              "sparse_matvec: fp32, bf16 or fp16 weights");
  TORCH_CHECK(scale.numel() == 0 || (scale.numel() == wt.size(0) && scale.scalar_type() == at::kFloat &&
                                     scale.is_contiguous()),
              "sparse_matvec: scale is empty or fp32 [in]");
  const int64_t in = wt.size(0), out = wt.size(1);
  auto flat = x.reshape({-1, in}).to(at::kFloat).contiguous();
  const int64_t batch = flat.size(0);
  const float* px = flat.data_ptr<float>();
  const float* ps = scale.numel() ? scale.data_ptr<float>() : nullptr;
  const float limit = static_cast<float>(threshold);
  std::vector<int64_t> kept;
  kept.reserve(in);
  for (int64_t i = 0; i < in; ++i) {
    bool keep = false;
    for (int64_t b = 0; b < batch && !keep; ++b) {
      const float v = std::fabs(px[b * in + i]) * (ps ? ps[i] : 1.f);
      keep = limit > 0.f ? v >= limit : v != 0.f;
    }
    if (keep) kept.push_back(i);
  }
  const int64_t count = static_cast<int64_t>(kept.size());
  const int64_t shares = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), count / MIN_ROWS_PER_THREAD));
  std::vector<float> sums(static_cast<size_t>(shares * batch * out), 0.f);  // each share's partial sums
  float* psums = sums.data();
  const int64_t per = (count + shares - 1) / shares;
  auto share = [&](int64_t s) {  // rows [begin, end) of the kept list
    const int64_t begin = std::min(count, s * per), end = std::min(count, begin + per);
    for (int64_t b0 = 0; b0 < batch; b0 += MAX_BATCH) {
      const int64_t nb = std::min(MAX_BATCH, batch - b0);
      const float* xb = px + b0 * in;
      float* yb = psums + (s * batch + b0) * out;
      if (st == at::kFloat)
        accumulate(xb, nb, in, kept.data() + begin, end - begin, wt.data_ptr<float>(), out, yb);
      else if (st == at::kBFloat16)
        accumulate(xb, nb, in, kept.data() + begin, end - begin, wt.data_ptr<at::BFloat16>(), out, yb);
      else
        accumulate(xb, nb, in, kept.data() + begin, end - begin, wt.data_ptr<at::Half>(), out, yb);
    }
  };
  if (shares == 1)
    share(0);
  else
    at::parallel_for(0, shares, 1, [&](int64_t first, int64_t last) {
      for (int64_t s = first; s < last; ++s) share(s);
    });
  for (int64_t s = 1; s < shares; ++s)
    for (int64_t j = 0; j < batch * out; ++j) psums[j] += psums[s * batch * out + j];
  if (bias.numel()) {
    auto b = bias.to(at::kFloat).contiguous();
    const float* pb = b.data_ptr<float>();
    for (int64_t r = 0; r < batch; ++r)
      for (int64_t j = 0; j < out; ++j) psums[r * out + j] += pb[j];
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  auto y = at::empty(shape, x.options());
  if (y.scalar_type() == at::kFloat) {
    std::copy(psums, psums + batch * out, y.data_ptr<float>());
    return {y, count};
  }
  y.copy_(at::from_blob(psums, shape, at::kFloat));
  return {y, count};
}
