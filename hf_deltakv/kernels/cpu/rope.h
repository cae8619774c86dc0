// RoPE angles of stored keys computed from their positions, for the CPU attention kernels (stream_attention.cpp,
// latent.cpp): no cos/sin table of positions is kept anywhere. Pair c (channels c and c + D/2 of the canonical order,
// see hf_deltakv/rope.py) of a token at position p turns by p * freqs[c]. Specification: hf_deltakv.rope.rope_cos_sin.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace hfd {

// How many tokens a run may go on from one exactly computed angle before computing exactly again: each step composes
// one more float rotation (about 1e-7), so the error stays below ~3e-5 (below 2e-6 typically).
constexpr int ROPE_EXACT_EVERY = 256;
// Consecutive positions are turned a span at a time: cos/sin of j * freqs[c] for j <= ROPE_SPAN, one table per
// kernel call (it depends on the frequencies only).
constexpr int ROPE_SPAN = 64;

// cos and sin of j * freqs[c], j = 0..ROPE_SPAN, pair-major (pair c at c * (ROPE_SPAN + 1) + j); built by a rotation
// recurrence in double, so each entry is exact to float rounding.
class RopeSteps {
 public:
  static constexpr int WIDTH = ROPE_SPAN + 1;

  RopeSteps(const double* freqs, int half) : freqs(freqs), half(half), cos_(half * WIDTH), sin_(half * WIDTH) {
    for (int c = 0; c < half; ++c) {
      const double sc = std::cos(freqs[c]), ss = std::sin(freqs[c]);
      double x = 1.0, y = 0.0;
      for (int j = 0; j < WIDTH; ++j) {
        cos_[c * WIDTH + j] = static_cast<float>(x), sin_[c * WIDTH + j] = static_cast<float>(y);
        const double nx = x * sc - y * ss;
        y = y * sc + x * ss, x = nx;
      }
    }
  }
  const float* cos(int c) const { return cos_.data() + c * WIDTH; }
  const float* sin(int c) const { return sin_.data() + c * WIDTH; }

  const double* freqs;
  const int half;

 private:
  std::vector<float> cos_, sin_;
};

// cos/sin of a run of tokens in increasing order (one per thread's work item). A span of consecutive positions (the
// usual case) starts from an angle either computed exactly (in double) or turned from the previous span's start by
// the table, then fills the span vectorised over its tokens; a span with gaps or repeats (left padding) computes
// each token exactly.
class RopeRun {
 public:
  explicit RopeRun(const RopeSteps& steps) : steps_(steps), c_(steps.half), s_(steps.half) {}

  // Tokens j < n at positions pos[j]: cos and sin written channel-major, pair c of token j at out[c * stride + j].
  void fill(const int32_t* pos, int64_t n, float* cos_out, float* sin_out, int64_t stride) {
    const int half = steps_.half;
    for (int64_t j0 = 0; j0 < n; j0 += ROPE_SPAN) {
      const int64_t m = std::min<int64_t>(ROPE_SPAN, n - j0);
      const int32_t* p = pos + j0;
      bool consecutive = true;
      for (int64_t j = 1; j < m; ++j) consecutive &= p[j] == p[0] + j;
      if (!consecutive) {
        for (int64_t j = 0; j < m; ++j) {
          exact(p[j]);
          for (int c = 0; c < half; ++c) cos_out[c * stride + j0 + j] = c_[c], sin_out[c * stride + j0 + j] = s_[c];
        }
        started_ = false;  // the next span starts exactly
        continue;
      }
      const int64_t gap = static_cast<int64_t>(p[0]) - last_;
      if (started_ && gap >= 0 && gap <= ROPE_SPAN && since_exact_ + gap < ROPE_EXACT_EVERY) {
        for (int c = 0; c < half; ++c) {  // turn the previous start by gap steps
          const float x = c_[c], y = s_[c], tc = steps_.cos(c)[gap], ts = steps_.sin(c)[gap];
          c_[c] = x * tc - y * ts, s_[c] = y * tc + x * ts;
        }
        since_exact_ += static_cast<int>(gap);
      } else {
        exact(p[0]);
      }
      started_ = true, last_ = p[0];
      for (int c = 0; c < half; ++c) {
        const float x = c_[c], y = s_[c];
        const float* tc = steps_.cos(c);
        const float* ts = steps_.sin(c);
        float* co = cos_out + c * stride + j0;
        float* so = sin_out + c * stride + j0;
#pragma omp simd
        for (int64_t j = 0; j < m; ++j) co[j] = x * tc[j] - y * ts[j], so[j] = y * tc[j] + x * ts[j];
      }
    }
  }

 private:
  void exact(int64_t p) {
    for (int c = 0; c < steps_.half; ++c) {
      const double angle = static_cast<double>(p) * steps_.freqs[c];
      c_[c] = static_cast<float>(std::cos(angle)), s_[c] = static_cast<float>(std::sin(angle));
    }
    since_exact_ = 0;
  }

  const RopeSteps& steps_;
  std::vector<float> c_, s_;
  bool started_ = false;
  int64_t last_ = 0;
  int since_exact_ = 0;
};

}  // namespace hfd
