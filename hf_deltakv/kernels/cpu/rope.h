// RoPE angles of stored keys computed from their positions, for the CPU attention kernels (stream_attention.cpp,
// latent.cpp): no cos/sin table is kept anywhere. Pair c (channels c and c + D/2 of the canonical order, see
// hf_deltakv/rope.py) of a token at position p turns by p * freqs[c]. Specification: hf_deltakv.rope.rope_cos_sin.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace hfd {

// How many tokens a run may turn one step at a time before its angles are computed exactly again: the float
// recurrence drifts by about 1e-7 a step, so its error stays below ~3e-5 (below 2e-6 typically).
constexpr int ROPE_EXACT_EVERY = 256;

// cos/sin of a run of tokens in increasing order. A token whose position is the previous one's plus one is turned
// from it by one step (a rotation by freqs[c], in float: vectorised over the pairs); the first token, any other
// position, and every ROPE_EXACT_EVERY-th token are computed exactly (in double).
class RopeRun {
 public:
  RopeRun(const double* freqs, int half) : freqs_(freqs), half_(half), c_(half), s_(half), sc_(half), ss_(half) {
    for (int c = 0; c < half; ++c) sc_[c] = static_cast<float>(std::cos(freqs[c])), ss_[c] = static_cast<float>(std::sin(freqs[c]));
  }

  // Tokens j < n at positions pos[j]: cos and sin written channel-major, pair c of token j at out[c * stride + j].
  void fill(const int32_t* pos, int64_t n, float* cos_out, float* sin_out, int64_t stride) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t p = pos[j];
      if (started_ && p == last_ + 1 && since_exact_ < ROPE_EXACT_EVERY) {
        for (int c = 0; c < half_; ++c) {
          const float x = c_[c], y = s_[c];
          c_[c] = x * sc_[c] - y * ss_[c];
          s_[c] = y * sc_[c] + x * ss_[c];
        }
        ++since_exact_;
      } else {
        for (int c = 0; c < half_; ++c) {
          const double angle = static_cast<double>(p) * freqs_[c];
          c_[c] = static_cast<float>(std::cos(angle)), s_[c] = static_cast<float>(std::sin(angle));
        }
        since_exact_ = 0;
      }
      started_ = true, last_ = p;
      for (int c = 0; c < half_; ++c) cos_out[c * stride + j] = c_[c], sin_out[c * stride + j] = s_[c];
    }
  }

 private:
  const double* freqs_;
  int half_;
  std::vector<float> c_, s_, sc_, ss_;
  bool started_ = false;
  int64_t last_ = 0;
  int since_exact_ = 0;
};

}  // namespace hfd
