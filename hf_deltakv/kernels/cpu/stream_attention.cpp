// Decode attention straight from packed codec storage on the CPU (one fused pass, no full-precision history).
// Specification: hf_deltakv.kernels.reference.stream_attention (chunked reconstruction + online softmax).
//
// Work items are (batch, kv head, token range); token ranges start on keyframes, so each item runs the delta
// codec's closed loop on its own. Per tile of tokens: reconstruct keys (keyframe + deltas or plain blocks), undo the
// Hadamard rotation (fast Walsh-Hadamard transform), re-apply RoPE (angles from the positions, rope.h, filled once
// per token range and shared by the items of every kv head), score every query row that shares the kv head (GQA),
// fold into an online softmax, and accumulate values still in their rotated basis (the rotation is linear, so it is
// undone once on the accumulated rows). Items are merged with log-sum-exp at the end. Inner loops keep their sums in
// registers (lanes.h: AVX-512, AVX2 or one lane, one source): a sum kept in memory is stored and reloaded on every
// add, which the compiler cannot avoid.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>  // py::object and the casters of at::Tensor
#include <ATen/Parallel.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "lanes.h"
#include "planes.h"
#include "rope.h"
#include "softmax.h"

namespace {

using hfd::exp_nonpositive;
using hfd::NEG_INF;

// n floats rounded to fp16 values in place, saturating at fp16's largest finite value, NaN kept (a coded group's
// keys decode to fp16 values: kernels/reference.py decode_groups and decode_channel).
inline void round_to_fp16(float* x, int64_t n) {
  const float most = static_cast<float>(std::numeric_limits<c10::Half>::max());
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
  const __m256 high = _mm256_set1_ps(most), low = _mm256_set1_ps(-most);
  for (; i + 8 <= n; i += 8) {  // min(high, x), max(low, x): NaN in x is what comes out
    const __m256 v = _mm256_max_ps(low, _mm256_min_ps(high, _mm256_loadu_ps(x + i)));
    _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  }
#endif
  for (; i < n; ++i) {
    const float v = std::isnan(x[i]) ? x[i] : std::min(std::max(x[i], -most), most);
    x[i] = static_cast<float>(static_cast<c10::Half>(v));
  }
}

#if !defined(HFD_KIND_F16) || !defined(HFD_STREAM_PLAIN)
#error "build through hf_deltakv.kernels.cpu: the format and stream ids come from hf_deltakv.kernels.layout.constants()"
#endif
enum Format : int64_t {
  F16 = HFD_KIND_F16,
  Q4_SYM = HFD_KIND_Q4_SYM,
  Q4_ASYM = HFD_KIND_Q4_ASYM,
  Q8 = HFD_KIND_Q8,
  Q3_SYM = HFD_KIND_Q3_SYM
};
constexpr int TILE = 64;  // tokens per tile (and the largest adaptive group)

// BIT_TABLE.v[byte][j]: bit j of `byte` as a float, so that a plane byte decodes 8 tokens with one vector add.
struct BitTable {
  alignas(32) float v[256][8];
  BitTable() {
    for (int b = 0; b < 256; ++b)
      for (int j = 0; j < 8; ++j) v[b][j] = static_cast<float>((b >> j) & 1);
  }
};
const BitTable BIT_TABLE;


// Packed rows of one block format (a `quant.QuantizedTensor`): row r of a [B, H, N, ...] tensor is
// (b * H + h) * N + i.
struct Blocks {
  at::Tensor codes_t, scales_t, mins_t;  // contiguous copies when needed: the pointers below stay valid
  const uint8_t* codes = nullptr;
  const at::Half* scales = nullptr;
  const at::Half* mins = nullptr;
  int64_t format = F16, block = 1, n_blocks = 0, rows_per_head = 0;

  Blocks() = default;
  // Packed rows in `format` (kernels/layout.py: StreamKind's formats) with blocks of `block_`: `codes`, `scales_in`
  // and `mins_in` ([B, H, rows, ...]; a scale or min tensor that is 1-D and empty: none).
  Blocks(const at::Tensor& codes_in, const at::Tensor& scales_in, const at::Tensor& mins_in, int64_t format_,
         int64_t block_, int64_t dim)
      : format(format_), block(block_), n_blocks(dim / block_) {
    codes_t = rows_of(codes_in);
    codes = reinterpret_cast<const uint8_t*>(codes_t.data_ptr());
    rows_per_head = codes_t.dim() > 2 ? head_rows(codes_t) : 0;
    if (!none(scales_in)) {
      scales_t = rows_of(scales_in);
      scales = scales_t.data_ptr<at::Half>();
      TORCH_CHECK(head_rows(scales_t) == rows_per_head, "codes and scales of other layouts");
    }
    if (!none(mins_in)) {
      mins_t = rows_of(mins_in);
      mins = mins_t.data_ptr<at::Half>();
      TORCH_CHECK(head_rows(mins_t) == rows_per_head, "codes and mins of other layouts");
    }
  }
  // `q` is a QuantizedTensor or None; its fields are read by name.
  explicit Blocks(const py::object& q, int64_t dim) {
    if (q.is_none()) return;
    const py::object fmt = q.attr("fmt");
    const at::Tensor empty;
    *this = Blocks(q.attr("codes").cast<at::Tensor>(),
                   q.attr("scales").is_none() ? empty : q.attr("scales").cast<at::Tensor>(),
                   q.attr("mins").is_none() ? empty : q.attr("mins").cast<at::Tensor>(),
                   fmt.attr("kind").cast<int64_t>(), fmt.attr("block_size").cast<int64_t>(), dim);
  }

  static bool none(const at::Tensor& t) { return !t.defined() || (t.dim() == 1 && t.numel() == 0); }

  // `t` [B, H, rows, ...] as the row loops read it: contiguous, or the leading rows of a contiguous buffer with
  // room for more (appended storage), read in place; anything else is copied.
  static at::Tensor rows_of(const at::Tensor& t) {
    if (t.dim() < 3) return t.contiguous();
    int64_t row = 1;  // elements of one row, which must be contiguous
    bool ok = true;
    for (int64_t d = t.dim() - 1; d >= 3; --d) {
      ok = ok && (t.size(d) == 1 || t.stride(d) == row);
      row *= t.size(d);
    }
    ok = ok && (t.size(2) <= 1 || t.stride(2) == row) && t.stride(1) % row == 0 && t.stride(1) >= t.size(2) * row;
    ok = ok && (t.size(0) == 1 || t.stride(0) == t.size(1) * t.stride(1));
    return ok ? t : t.contiguous();
  }

  // Rows between one head's first row and the next one's (the buffer's capacity per head).
  static int64_t head_rows(const at::Tensor& t) {
    int64_t row = 1;
    for (int64_t d = 3; d < t.dim(); ++d) row *= t.size(d);
    return t.stride(1) / row;
  }

  int64_t code_bytes() const { return format == Q8 ? block : format == Q3_SYM ? block * 3 / 8 : block / 2; }

  // Dequantize row `row` into out[dim]; returns the address of its scales (for the delta codec's flags).
  const at::Half* row(int64_t row, float* out) const {
    if (format == F16) {
      const at::Half* h = reinterpret_cast<const at::Half*>(codes) + row * n_blocks;
      for (int64_t i = 0; i < n_blocks; ++i) out[i] = static_cast<float>(h[i]);
      return nullptr;
    }
    const int64_t bytes = code_bytes();
    const uint8_t* c = codes + row * n_blocks * bytes;
    const at::Half* s = scales + row * n_blocks;
    const at::Half* m = mins ? mins + row * n_blocks : nullptr;
    if (format == Q8) {
      if (block == 32) return q8<32>(c, s, out);
      return q8<16>(c, s, out);
    }
    if (format == Q3_SYM) return q3(c, s, out);
    if (block == 32) return q4<32>(c, s, m, out);
    return q4<16>(c, s, m, out);
  }

  template <int BS>
  const at::Half* q8(const uint8_t* c, const at::Half* s, float* out) const {
    for (int64_t b = 0; b < n_blocks; ++b) {
      const float scale = static_cast<float>(s[b]);
      const int8_t* q = reinterpret_cast<const int8_t*>(c + b * BS);
#pragma omp simd
      for (int j = 0; j < BS; ++j) out[b * BS + j] = static_cast<float>(q[j]) * scale;
    }
    return s;
  }

  // q3_0 (blocks of 32, quant/packing.py: pack_3bit): code 8i + j has its low 2 bits at bits 2i of byte j and its
  // high bit at bit j of byte 8 + i; decoded as (code - 4) * scale.
  const at::Half* q3(const uint8_t* c, const at::Half* s, float* out) const {
    for (int64_t b = 0; b < n_blocks; ++b) {
      const float scale = static_cast<float>(s[b]);
      const uint8_t* cb = c + b * 12;
      float* o = out + b * 32;
#if defined(__AVX2__)
      // Lane j holds byte j (the low bits of codes j, 8 + j, 16 + j, 24 + j); the high bits of the 8 codes of row i
      // come from byte 8 + i, shifted right by the lane's index.
      const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cb)));
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), three = _mm256_set1_epi32(3);
      const __m256 vscale = _mm256_set1_ps(scale);
      for (int i = 0; i < 4; ++i) {
        const __m256i high = _mm256_srlv_epi32(_mm256_set1_epi32(cb[8 + i]), lane);
        const __m256i low_i = _mm256_srlv_epi32(low, _mm256_set1_epi32(2 * i));
        const __m256i code = _mm256_or_si256(_mm256_and_si256(low_i, three),
                                             _mm256_slli_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)), 2));
        const __m256 value = _mm256_cvtepi32_ps(_mm256_sub_epi32(code, _mm256_set1_epi32(4)));
        _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(value, vscale));
      }
#else
      for (int i = 0; i < 4; ++i) {
        const int high = cb[8 + i];
#pragma omp simd
        for (int j = 0; j < 8; ++j) {
          const int code = ((cb[j] >> (2 * i)) & 3) | (((high >> j) & 1) << 2);
          o[8 * i + j] = static_cast<float>(code - 4) * scale;
        }
      }
#endif
    }
    return s;
  }

  template <int BS>
  const at::Half* q4(const uint8_t* c, const at::Half* s, const at::Half* m, float* out) const {
    constexpr int HALF = BS / 2;
#if defined(__AVX512F__)
    if constexpr (BS == 32) {  // 16 bytes: low nibbles are elements 0-15, high nibbles 16-31 (as the AVX2 branch)
      const __m128i nibble = _mm_set1_epi8(0x0F);
      for (int64_t b = 0; b < n_blocks; ++b) {
        const __m512 scale = _mm512_set1_ps(static_cast<float>(s[b]));
        const __m512 offset = m ? _mm512_set1_ps(static_cast<float>(m[b])) : _mm512_set1_ps(-8.0f * static_cast<float>(s[b]));
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * HALF));
        const __m128i low = _mm_and_si128(bytes, nibble), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
        _mm512_storeu_ps(out + b * BS, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low)), scale, offset));
        _mm512_storeu_ps(out + b * BS + HALF,
                         _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high)), scale, offset));
      }
      return s;
    }
#endif
#if defined(__AVX2__)
    if constexpr (BS == 32) {  // 16 bytes: low nibbles are elements 0-15, high nibbles 16-31
      const __m128i nibble = _mm_set1_epi8(0x0F);
      for (int64_t b = 0; b < n_blocks; ++b) {
        const __m256 scale = _mm256_set1_ps(static_cast<float>(s[b]));
        const __m256 offset = m ? _mm256_set1_ps(static_cast<float>(m[b])) : _mm256_set1_ps(-8.0f * static_cast<float>(s[b]));
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * HALF));
        const __m128i low = _mm_and_si128(bytes, nibble), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
        const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
        for (int k = 0; k < 4; ++k) {
          const __m256 code = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[k]));
          _mm256_storeu_ps(out + b * BS + 8 * k, _mm256_fmadd_ps(code, scale, offset));
        }
      }
      return s;
    }
#endif
    for (int64_t b = 0; b < n_blocks; ++b) {
      const float scale = static_cast<float>(s[b]);
      const uint8_t* cb = c + b * HALF;
      float* o = out + b * BS;
      if (m) {
        const float low = static_cast<float>(m[b]);
#pragma omp simd
        for (int j = 0; j < HALF; ++j) {
          o[j] = static_cast<float>(cb[j] & 0x0F) * scale + low;
          o[j + HALF] = static_cast<float>(cb[j] >> 4) * scale + low;
        }
      } else {
#pragma omp simd
        for (int j = 0; j < HALF; ++j) {
          o[j] = static_cast<float>((cb[j] & 0x0F) - 8) * scale;
          o[j + HALF] = static_cast<float>((cb[j] >> 4) - 8) * scale;
        }
      }
    }
    return s;
  }
};

// Position of a token in its keyframe group, advanced token by token.
struct Cursor {
  int64_t group = 0, offset = 0;
  void start(int64_t t, int64_t kf) { group = t / kf, offset = t % kf; }
  void advance(int64_t kf) {
    if (++offset == kf) offset = 0, ++group;
  }
};

// The current mean snapshot of one head in fp32 (snapshots change a handful of times per stream).
struct MeanCache {
  int64_t key = -1;
  std::vector<float> values;
  const float* at(const at::Half* means, int64_t head_row, int64_t snap, int64_t dim) {
    if (!means || snap < 0) return nullptr;
    if (key != head_row + snap) {
      values.resize(dim);
      const at::Half* src = means + (head_row + snap) * dim;
      for (int64_t c = 0; c < dim; ++c) values[c] = static_cast<float>(src[c]);
      key = head_row + snap;
    }
    return values.data();
  }
};

// One stream (keys or values), read from a `kernels.layout` description by field name: plain blocks, or keyframes
// + closed-loop deltas; optionally Hadamard-rotated.
struct Stream {
  bool delta = false, intra = false;
  int64_t kf = 1, rotation = 0, dim = 0, length = 0;
  Blocks plain, keyframes, deltas;
  at::Tensor means_t;
  const at::Half* means = nullptr;
  int64_t snapshot_rows = 0;
  std::vector<int64_t> snapshot_points;
  int64_t snapshot_last = 0, snapshot_interval = 1;
  // Tokens coded a group at a time per channel, then a raw fp16 tail: adaptive per-channel groups (kernels/layout.py:
  // AdaptiveStream: bit planes, packed depths, low, step) or KIVI-style channel blocks (ChannelStream: one block of
  // `group` tokens per channel in a block format).
  bool adaptive = false, channel = false, keyframe_reference = false;
  Blocks channel_blocks;
  int64_t group = 0, pad = 0, n_groups = 0, planes_per_group = 0, coded = 0, tail_rows = 0;
  // Groups between one head's first group and the next one's in each coded tensor: codecs append groups in place
  // into buffers with room (codecs/base.py: GrowingRows), read where they lie rather than copied at every call.
  int64_t planes_head = 0, depths_head = 0, low_head = 0, step_head = 0;
  at::Tensor planes_t, depths_t, low_t, step_t, tail_t;
  const uint8_t* planes = nullptr;
  const uint8_t* depths = nullptr;
  const at::Half* low = nullptr;
  const at::Half* step = nullptr;
  const at::Half* tail = nullptr;

  Stream() = default;

  // A PlainStream of `length` tokens (rows of `blocks`), Hadamard-rotated by blocks of `rotation` (0: not).
  static Stream plain_of(Blocks blocks, int64_t dim, int64_t length, int64_t rotation) {
    Stream s;
    s.dim = dim, s.length = length, s.rotation = rotation, s.plain = std::move(blocks);
    return s;
  }

  // An AdaptiveStream of `length` tokens read from storage with room: the first `groups` coded groups of `planes`,
  // `depths`, `low_in`, `step_in` ([B, H, capacity groups, ...]) and the raw tail after them in `tail_in` ([B, H, rows,
  // D] fp16, the open group's rows), the stream's first group starting `pad_` slots early.
  static Stream adaptive_of(const at::Tensor& planes_in, const at::Tensor& depths_in, const at::Tensor& low_in,
                            const at::Tensor& step_in, const at::Tensor& tail_in, int64_t group_, int64_t pad_,
                            int64_t groups, int64_t dim, int64_t length) {
    Stream s;
    s.dim = dim, s.length = length, s.adaptive = true, s.group = group_, s.pad = pad_;
    s.tail_t = tail_in.contiguous();
    s.tail = s.tail_t.data_ptr<at::Half>();
    s.tail_rows = s.tail_t.size(2);
    if (groups) s.set_groups(planes_in, depths_in, low_in, step_in, groups);
    s.coded = groups ? groups * group_ - pad_ : 0;
    TORCH_CHECK(length >= s.coded && length - s.coded <= s.tail_rows, "the raw tail holds ", s.tail_rows,
                " rows, the stream ", length - s.coded, " past its coded groups");
    return s;
  }

  void set_groups(const at::Tensor& planes_in, const at::Tensor& depths_in, const at::Tensor& low_in,
                  const at::Tensor& step_in, int64_t groups) {
    planes_t = Blocks::rows_of(planes_in), depths_t = Blocks::rows_of(depths_in);
    low_t = Blocks::rows_of(low_in), step_t = Blocks::rows_of(step_in);
    planes_head = Blocks::head_rows(planes_t), depths_head = Blocks::head_rows(depths_t);
    low_head = Blocks::head_rows(low_t), step_head = Blocks::head_rows(step_t);
    planes = planes_t.data_ptr<uint8_t>();
    depths = depths_t.data_ptr<uint8_t>();
    low = low_t.data_ptr<at::Half>();
    step = step_t.data_ptr<at::Half>();
    n_groups = groups;
    planes_per_group = planes_t.size(3);
    TORCH_CHECK(groups <= planes_t.size(2) && groups <= depths_t.size(2) && groups <= low_t.size(2) &&
                    groups <= step_t.size(2), "more groups coded than the storage holds");
  }

  Stream(const py::object& layout, int64_t dim_) : dim(dim_) {
    const int64_t kind = layout.attr("kind").cast<int64_t>();
    rotation = layout.attr("rotation").cast<int64_t>();
    length = layout.attr("length").cast<int64_t>();
    TORCH_CHECK(layout.attr("dim").cast<int64_t>() == dim, "stream layout of another head dimension");
    if (kind == HFD_STREAM_PLAIN) {
      plain = Blocks(layout.attr("blocks"), dim);
      return;
    }
    if (kind == HFD_STREAM_ADAPTIVE) {
      adaptive = true;
      group = layout.attr("group").cast<int64_t>();
      pad = layout.attr("offset").cast<int64_t>();
      tail_t = layout.attr("tail").cast<at::Tensor>().contiguous();
      tail = tail_t.data_ptr<at::Half>();
      tail_rows = tail_t.size(2);
      if (!layout.attr("planes").is_none()) {
        const at::Tensor p = layout.attr("planes").cast<at::Tensor>();
        set_groups(p, layout.attr("bits").cast<at::Tensor>(), layout.attr("low").cast<at::Tensor>(),
                   layout.attr("step").cast<at::Tensor>(), p.size(2));
      }
      coded = n_groups ? n_groups * group - pad : 0;
      return;
    }
    if (kind == HFD_STREAM_CHANNEL) {
      channel = true;
      group = layout.attr("group").cast<int64_t>();
      tail_t = layout.attr("tail").cast<at::Tensor>().contiguous();
      tail = tail_t.data_ptr<at::Half>();
      tail_rows = tail_t.size(2);
      const py::object groups = layout.attr("groups");
      if (!groups.is_none()) {
        // codes [B, H, G, D, 1, bytes]: a row per (group, channel), one block of `group` tokens each
        channel_blocks = Blocks(groups, group);
        n_groups = groups.attr("codes").cast<at::Tensor>().size(2);
      }
      coded = n_groups * group;
      return;
    }
    TORCH_CHECK(kind == HFD_STREAM_DELTA, "the CPU kernel reads plain, delta, channel and adaptive streams, got ", kind);
    delta = true;
    deltas = Blocks(layout.attr("deltas"), dim);
    keyframes = Blocks(layout.attr("keyframes"), dim);
    kf = layout.attr("kf").cast<int64_t>();
    intra = layout.attr("intra").cast<bool>();
    keyframe_reference = layout.attr("reference").cast<std::string>() == "keyframe";
    const py::object m = layout.attr("means");
    if (intra && !m.is_none()) {
      means_t = m.cast<at::Tensor>().contiguous();
      means = means_t.data_ptr<at::Half>();
      snapshot_rows = means_t.size(2);
    }
    const py::object schedule = layout.attr("snapshots");
    snapshot_points = schedule.attr("points").cast<std::vector<int64_t>>();
    snapshot_last = schedule.attr("last").cast<int64_t>();
    snapshot_interval = schedule.attr("interval").cast<int64_t>();
  }

  // Mean snapshots that exist once the stream holds t tokens (kernels/layout.py: SnapshotSchedule.count).
  int64_t snapshots(int64_t t) const {
    if (t < snapshot_last) {
      int64_t n = 0;
      for (const int64_t p : snapshot_points) n += t >= p;
      return n;
    }
    return static_cast<int64_t>(snapshot_points.size()) + 1 + (t - snapshot_last) / snapshot_interval;
  }

  // Reconstruct token t of head bh into `out`. `running` carries the closed loop (unrotated basis); `cur` is the
  // token's (group, offset) in its keyframe group, advanced by the caller (no divisions per token); `mean` caches
  // the float copy of the current mean snapshot.
  void token(int64_t bh, int64_t t, Cursor& cur, float* running, float* out, float* scratch, MeanCache& mean) const {
    if (adaptive || channel) {  // a raw tail token (coded groups are decoded a group at a time, `group_tile`)
      const at::Half* row = tail + (bh * tail_rows + (t - coded)) * dim;
      for (int64_t c = 0; c < dim; ++c) out[c] = static_cast<float>(row[c]);
      return;
    }
    if (!delta) {
      plain.row(bh * plain.rows_per_head + t, out);
      return;
    }
    if (cur.offset == 0) {
      keyframes.row(bh * keyframes.rows_per_head + cur.group, running);
    } else if (keyframe_reference) {  // delta from the group's keyframe, which `running` keeps
      const int64_t row = bh * deltas.rows_per_head + cur.group * (kf - 1) + cur.offset - 1;
      const float* m = intra ? mean.at(means, bh * snapshot_rows, snapshots(t) - 1, dim) : nullptr;
      const at::Half* s = deltas.row(row, scratch);
      for (int64_t b = 0; b < deltas.n_blocks; ++b) {
        const bool flagged = s && intra && (reinterpret_cast<const uint16_t*>(s)[b] & 1) != 0;
        for (int64_t k = b * deltas.block; k < (b + 1) * deltas.block; ++k)
          out[k] = (flagged ? (m ? m[k] : 0.f) : running[k]) + scratch[k];
      }
      return;
    } else {
      const int64_t row = bh * deltas.rows_per_head + cur.group * (kf - 1) + cur.offset - 1;
      const float* m = intra ? mean.at(means, bh * snapshot_rows, snapshots(t) - 1, dim) : nullptr;
      if (deltas.format == Q4_SYM && deltas.block == 16) {
        delta_q4<16>(row, m, running);
      } else if (deltas.format == Q4_SYM && deltas.block == 32) {
        delta_q4<32>(row, m, running);
      } else {
        const at::Half* s = deltas.row(row, scratch);
        for (int64_t b = 0; b < deltas.n_blocks; ++b) {
          const bool flagged = s && intra && (reinterpret_cast<const uint16_t*>(s)[b] & 1) != 0;
          float* r = running + b * deltas.block;
          const float* d = scratch + b * deltas.block;
          for (int64_t k = 0; k < deltas.block; ++k) r[k] = (flagged ? (m ? m[b * deltas.block + k] : 0.f) : r[k]) + d[k];
        }
      }
    }
    std::copy(running, running + dim, out);
  }

  // Symmetric 4-bit deltas decoded straight into the running reconstruction (flagged blocks restart from `mean`).
  template <int BS>
  void delta_q4(int64_t row, const float* mean, float* running) const {
    constexpr int HALF = BS / 2;
    const uint8_t* c = deltas.codes + row * deltas.n_blocks * HALF;
    const at::Half* s = deltas.scales + row * deltas.n_blocks;
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(s);
    for (int64_t b = 0; b < deltas.n_blocks; ++b) {
      const float scale = static_cast<float>(s[b]);
      const uint8_t* cb = c + b * HALF;
      float* r = running + b * BS;
      const bool flagged = intra && (bits[b] & 1);
      const float* base = flagged ? (mean ? mean + b * BS : nullptr) : r;
      if (base) {
#pragma omp simd
        for (int k = 0; k < HALF; ++k) {
          r[k] = base[k] + static_cast<float>((cb[k] & 0x0F) - 8) * scale;
          r[k + HALF] = base[k + HALF] + static_cast<float>((cb[k] >> 4) - 8) * scale;
        }
      } else {
#pragma omp simd
        for (int k = 0; k < HALF; ++k) {
          r[k] = 0.f + static_cast<float>((cb[k] & 0x0F) - 8) * scale;
          r[k + HALF] = 0.f + static_cast<float>((cb[k] >> 4) - 8) * scale;
        }
      }
    }
  }

  // Tokens at slots [j0, j0 + n) of coded group k of head bh, decoded channel-major into kt (row c holds channel c,
  // `tile` floats apart): per channel, each of its planes adds step * 2^bit where a token's bit is set (one lookup of
  // 8 tokens per plane byte).
  void group_tile(int64_t bh, int64_t k, int64_t j0, int n, float* kt, int tile) const {
    alignas(64) float whole[TILE];  // a group decoded whole when only part of it is asked for
    const bool direct = j0 == 0 && n == group;
    if (channel) {  // one block of `group` tokens per channel, rows ordered (batch, head, group, channel)
      for (int64_t c = 0; c < dim; ++c) {
        float* row = direct ? kt + c * tile : whole;
        channel_blocks.row((bh * channel_blocks.rows_per_head + k) * dim + c, row);
        round_to_fp16(row, group);
        if (!direct) std::copy(whole + j0, whole + j0 + n, kt + c * tile);
      }
      return;
    }
    const int64_t width = group / 8;  // bytes per plane
    const uint8_t* gp = planes + (bh * planes_head + k) * planes_per_group * width;
    const uint8_t* gd = depths + (bh * depths_head + k) * (dim / 2);
    const at::Half* gl = low + (bh * low_head + k) * dim;
    const at::Half* gs = step + (bh * step_head + k) * dim;
    int64_t plane = 0;
    for (int64_t c = 0; c < dim; ++c) {
      // quant.pack_4bit: byte i holds channel i (low nibble) and channel i + dim/2 (high nibble)
      const uint8_t packed = gd[c < dim / 2 ? c : c - dim / 2];
      const int bits = c < dim / 2 ? (packed & 0x0F) : (packed >> 4);
      const float s = static_cast<float>(gs[c]), lo = static_cast<float>(gl[c]);
      float* row = direct ? kt + c * tile : whole;
      decode_channel(gp + plane * width, bits, width, s, lo, row);  // fp16 values
      plane += bits;
      if (!direct) std::copy(whole + j0, whole + j0 + n, kt + c * tile);
    }
  }

#if defined(__AVX2__)
  // Eight tokens per plane byte; the WIDTH sums are kept in registers and advance together, plane by plane (one sum
  // at a time, or a sum kept in `out`, waits on the previous plane's add every plane).
  template <int WIDTH>
  static void decode_channel_avx2(const uint8_t* planes, int bits, float step, float lo, float* out) {
    __m256 acc[WIDTH];
    for (int i = 0; i < WIDTH; ++i) acc[i] = _mm256_set1_ps(lo);
    for (int b = 0; b < bits; ++b) {
      const __m256 weight = _mm256_set1_ps(step * static_cast<float>(1 << b));
      const uint8_t* plane = planes + b * WIDTH;
      for (int i = 0; i < WIDTH; ++i) acc[i] = _mm256_fmadd_ps(_mm256_load_ps(BIT_TABLE.v[plane[i]]), weight, acc[i]);
    }
    for (int i = 0; i < WIDTH; ++i) _mm256_storeu_ps(out + i * 8, acc[i]);
  }
#endif

  // One channel of a group: out[j] = lo + step * code_j rounded to fp16 (saturated, NaN kept), code_j gathered from
  // `bits` planes of `width` bytes.
  static void decode_channel(const uint8_t* planes, int bits, int64_t width, float step, float lo, float* out) {
#if defined(__AVX512F__)
    // 16 tokens at a time, rounded to fp16 in the registers (planes.h).
    for (int64_t chunk = 0; chunk + 2 <= width; chunk += 2)
      _mm512_storeu_ps(out + chunk * 8, hfd::plane_values16(planes, bits, width, chunk, lo, step));
    if (width % 2) {  // a group of 8 tokens: one byte per plane
      const int64_t chunk = width - 1;
      __m256 acc = _mm256_set1_ps(lo);
      for (int b = 0; b < bits; ++b)
        acc = _mm256_mask_add_ps(acc, planes[b * width + chunk], acc, _mm256_set1_ps(step * static_cast<float>(1 << b)));
      _mm256_storeu_ps(out + chunk * 8, acc);
      round_to_fp16(out + chunk * 8, 8);
    }
    return;
#elif defined(__AVX2__)
    switch (width) {
      case 1: decode_channel_avx2<1>(planes, bits, step, lo, out); break;
      case 2: decode_channel_avx2<2>(planes, bits, step, lo, out); break;
      case 4: decode_channel_avx2<4>(planes, bits, step, lo, out); break;
      default: decode_channel_avx2<8>(planes, bits, step, lo, out);
    }
    round_to_fp16(out, width * 8);
#else
    for (int64_t i = 0; i < width; ++i) {
      float a[8];
#pragma omp simd
      for (int j = 0; j < 8; ++j) a[j] = lo;
      for (int b = 0; b < bits; ++b) {
        const float* bit = BIT_TABLE.v[planes[b * width + i]];
        const float weight = step * static_cast<float>(1 << b);
#pragma omp simd
        for (int j = 0; j < 8; ++j) a[j] += bit[j] * weight;
      }
      std::copy(a, a + 8, out + i * 8);
    }
    round_to_fp16(out, width * 8);
#endif
  }
};

// Unnormalised Walsh-Hadamard transform over the channels of a channel-major tile x[D][TILE], in blocks of `block`
// channels: every butterfly is a TILE-wide vector operation. The 1/sqrt(block) factor is folded into the query.
template <int D>
inline void hadamard_tile(float* x, int64_t block) {
  if (!block) return;
  for (int64_t base = 0; base < D; base += block) {
    for (int64_t h = 1; h < block; h *= 2) {
      for (int64_t i = base; i < base + block; i += 2 * h) {
        for (int64_t c = i; c < i + h; ++c) {
          float* u = x + c * TILE;
          float* w = x + (c + h) * TILE;
#pragma omp simd
          for (int j = 0; j < TILE; ++j) {
            const float a = u[j], b = w[j];
            u[j] = a + b;
            w[j] = a - b;
          }
        }
      }
    }
  }
}

// The same transform on one row x[D] (used once per output row for the values).
inline void hadamard_row(float* x, int64_t dim, int64_t block) {
  if (!block) return;
  const float norm = 1.0f / std::sqrt(static_cast<float>(block));
  for (int64_t base = 0; base < dim; base += block) {
    for (int64_t h = 1; h < block; h *= 2)
      for (int64_t i = base; i < base + block; i += 2 * h)
        for (int64_t c = i; c < i + h; ++c) {
          const float a = x[c], b = x[c + h];
          x[c] = a + b;
          x[c + h] = a - b;
        }
  }
  for (int64_t c = 0; c < dim; ++c) x[c] *= norm;
}

// k_tile [TILE][D] (token-major) -> kt [D][TILE] (channel-major), in 8x8 blocks (AVX2 shuffles where available).
template <int D>
inline void transpose_tile(const float* in, float* out) {
#if defined(__AVX2__)
  for (int jb = 0; jb < TILE; jb += 8) {
    for (int cb = 0; cb < D; cb += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(in + (jb + i) * D + cb);
      t[0] = _mm256_unpacklo_ps(r[0], r[1]);
      t[1] = _mm256_unpackhi_ps(r[0], r[1]);
      t[2] = _mm256_unpacklo_ps(r[2], r[3]);
      t[3] = _mm256_unpackhi_ps(r[2], r[3]);
      t[4] = _mm256_unpacklo_ps(r[4], r[5]);
      t[5] = _mm256_unpackhi_ps(r[4], r[5]);
      t[6] = _mm256_unpacklo_ps(r[6], r[7]);
      t[7] = _mm256_unpackhi_ps(r[6], r[7]);
      r[0] = _mm256_shuffle_ps(t[0], t[2], _MM_SHUFFLE(1, 0, 1, 0));
      r[1] = _mm256_shuffle_ps(t[0], t[2], _MM_SHUFFLE(3, 2, 3, 2));
      r[2] = _mm256_shuffle_ps(t[1], t[3], _MM_SHUFFLE(1, 0, 1, 0));
      r[3] = _mm256_shuffle_ps(t[1], t[3], _MM_SHUFFLE(3, 2, 3, 2));
      r[4] = _mm256_shuffle_ps(t[4], t[6], _MM_SHUFFLE(1, 0, 1, 0));
      r[5] = _mm256_shuffle_ps(t[4], t[6], _MM_SHUFFLE(3, 2, 3, 2));
      r[6] = _mm256_shuffle_ps(t[5], t[7], _MM_SHUFFLE(1, 0, 1, 0));
      r[7] = _mm256_shuffle_ps(t[5], t[7], _MM_SHUFFLE(3, 2, 3, 2));
      t[0] = _mm256_permute2f128_ps(r[0], r[4], 0x20);
      t[1] = _mm256_permute2f128_ps(r[1], r[5], 0x20);
      t[2] = _mm256_permute2f128_ps(r[2], r[6], 0x20);
      t[3] = _mm256_permute2f128_ps(r[3], r[7], 0x20);
      t[4] = _mm256_permute2f128_ps(r[0], r[4], 0x31);
      t[5] = _mm256_permute2f128_ps(r[1], r[5], 0x31);
      t[6] = _mm256_permute2f128_ps(r[2], r[6], 0x31);
      t[7] = _mm256_permute2f128_ps(r[3], r[7], 0x31);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + (cb + i) * TILE + jb, t[i]);
    }
  }
#else
  for (int j = 0; j < TILE; ++j)
    for (int c = 0; c < D; ++c) out[c * TILE + j] = in[j * D + c];
#endif
}

// scores[r][j] = sum_c q[r][c] * kt[c][j] for rows r < rows and columns j < cols (a multiple of 32, kt zero past
// the tile's tokens): three rows (a kv head's query heads in most GQA models) and 32 columns at a time, their sums in
// registers (lanes.h: 12 on AVX2, 6 on AVX-512), each key vector loaded once for the three rows.
template <int D>
void tile_scores(const float* kt, const float* q, int64_t rows, int cols, float* scores) {
  using namespace hfd::lanes;
  constexpr int V = 32 / W;  // vectors across 32 columns
  alignas(64) static const float zero_row[D] = {};
  for (int j0 = 0; j0 < cols; j0 += 32) {
    for (int64_t r0 = 0; r0 < rows; r0 += 3) {
      const float* qr[3];
      for (int r = 0; r < 3; ++r) qr[r] = r0 + r < rows ? q + (r0 + r) * D : zero_row;
      F acc[3][V];
      for (int r = 0; r < 3; ++r)
        for (int v = 0; v < V; ++v) acc[r][v] = zero();
      for (int c = 0; c < D; ++c) {
        const float* kc = kt + c * TILE + j0;
        F k[V];
        for (int v = 0; v < V; ++v) k[v] = load(kc + v * W);
        for (int r = 0; r < 3; ++r) {
          const F qc = set1(qr[r][c]);
          for (int v = 0; v < V; ++v) acc[r][v] = fmadd(qc, k[v], acc[r][v]);
        }
      }
      for (int64_t r = 0; r < 3 && r0 + r < rows; ++r)
        for (int v = 0; v < V; ++v) store(scores + (r0 + r) * TILE + j0 + v * W, acc[r][v]);
    }
  }
}

// acc[r][c] += sum_j p[r][j] * v[j][c] for rows r < rows and tokens j < n (p rows TILE apart): two rows and 32
// channels at a time, their sums in registers over the tile (lanes.h: eight of AVX2's sixteen, four on AVX-512), each
// value vector loaded once for both rows.
template <int D>
void tile_values(const float* p, const float* v, int64_t rows, int n, float* acc) {
  using namespace hfd::lanes;
  constexpr int V = 32 / W;  // vectors across 32 channels
  for (int64_t r0 = 0; r0 < rows; r0 += 2) {
    const bool pair = r0 + 1 < rows;
    const float* p0 = p + r0 * TILE;
    const float* p1 = pair ? p0 + TILE : p0;  // a last odd row is computed twice and stored once
    float* a0 = acc + r0 * D;
    float* a1 = pair ? a0 + D : a0;
    for (int c0 = 0; c0 < D; c0 += 32) {
      F s0[V], s1[V];
      for (int k = 0; k < V; ++k) s0[k] = load(a0 + c0 + k * W), s1[k] = load(a1 + c0 + k * W);
      for (int j = 0; j < n; ++j) {
        const float* vj = v + j * D + c0;
        const F w0 = set1(p0[j]), w1 = set1(p1[j]);
        for (int k = 0; k < V; ++k) {
          const F x = load(vj + k * W);
          s0[k] = fmadd(w0, x, s0[k]);
          s1[k] = fmadd(w1, x, s1[k]);
        }
      }
      for (int k = 0; k < V; ++k) {
        store(a0 + c0 + k * W, s0[k]);
        if (pair) store(a1 + c0 + k * W, s1[k]);
      }
    }
  }
}

// The RoPE cos/sin of one token range of one batch row, kept by a thread for the next work item of the same call.
struct RopeRange {
  int64_t call = -1, batch = -1, begin = -1, length = 0;
  std::vector<float> cos, sin;

  void fill(const hfd::RopeSteps& steps, int64_t call_, int64_t batch_, int64_t begin_, const int32_t* pos, int64_t n) {
    if (call == call_ && batch == batch_ && begin == begin_ && length == n) return;
    cos.resize(steps.half * n), sin.resize(steps.half * n);
    hfd::RopeRun(steps).fill(pos, n, cos.data(), sin.data(), n);
    call = call_, batch = batch_, begin = begin_, length = n;
  }
};

struct Args {
  int64_t call = 0;  // this kernel call's serial number (what a thread's RopeRange was filled for)
  const float* q;
  const int32_t* positions;  // of the stream's tokens [B, L] (rows `positions_stride` apart), or null: no RoPE
  const hfd::RopeSteps* rope_steps;  // of the freqs [D / 2] (radians per position of each canonical pair)
  int64_t positions_stride = 0;
  const uint8_t* mask;
  const uint8_t* mask_base;  // mask of all tokens, sinks first
  int64_t heads, rows, n_queries, causal_offset, length, split, splits, sinks;
  int64_t mask_batch, mask_row;  // the mask's strides between batch rows and query rows
  int64_t heads_total = 0;  // batch * heads: items run split-major
  float scale, key_scale;  // key_scale: scale times the Hadamard normalisation of the keys
  float *part_acc, *part_max, *part_sum;
};

// RoPE turned forward on the first n_tok tokens of a channel-major tile kt [D][TILE]: canonical pair c, c + D/2 of
// token j by cos_table[c * stride + j] and sin_table[c * stride + j] (pair-major angle tables, `stride` tokens a pair).
template <int D>
inline void rope_tile(float* kt, const float* cos_table, const float* sin_table, int64_t stride, int n_tok) {
  constexpr int HALF = D / 2;
  using namespace hfd::lanes;
  for (int c = 0; c < HALF; ++c) {
    float* lo = kt + c * TILE;
    float* hi = kt + (c + HALF) * TILE;
    const float* cs = cos_table + c * stride;
    const float* sn = sin_table + c * stride;
    const auto turn = [](float* l, float* h, const float* c_, const float* s_) {
      const F x = load(l), y = load(h), cj = load(c_), sj = load(s_);
      store(l, sub(mul(x, cj), mul(y, sj)));
      store(h, add(mul(y, cj), mul(x, sj)));
    };
    int j = 0;
    for (; j + W <= n_tok; j += W) turn(lo + j, hi + j, cs + j, sn + j);
    if (j < n_tok) {  // the last tokens through the same lanes (padded copies): every token rounds alike, wherever
      // it falls in a tile (a scalar loop would be contracted into other fused multiply-adds)
      alignas(64) float x[W] = {}, y[W] = {}, c_[W] = {}, s_[W] = {};
      const int rest = n_tok - j;
      std::copy(lo + j, lo + n_tok, x), std::copy(hi + j, hi + n_tok, y);
      std::copy(cs + j, cs + n_tok, c_), std::copy(sn + j, sn + n_tok, s_);
      turn(x, y, c_, s_);
      std::copy(x, x + rest, lo + j), std::copy(y, y + rest, hi + j);
    }
  }
}

// One work item: tokens [t_begin, t_end) of head bh, into its own partial statistics.
template <int D>
void run_item(const Args& a, const Stream& keys, const Stream& values, int64_t item) {
  const int64_t bh = item % a.heads_total, split_index = item / a.heads_total, b = bh / a.heads;
  // Items (and, for adaptive keys, tiles) start on group boundaries, which sit `shift` tokens before stream multiples.
  const int64_t shift = keys.adaptive ? keys.pad : 0;
  const bool key_groups = keys.adaptive || keys.channel;
  const int64_t t_begin = std::max<int64_t>(split_index * a.split - shift, 0);
  const int64_t t_end = std::min(a.length, (split_index + 1) * a.split - shift);
  const int64_t rows = a.rows;
  float* acc = a.part_acc + item * rows * D;
  float* m = a.part_max + item * rows;
  float* l = a.part_sum + item * rows;
  const float* qh = a.q + bh * rows * D;
  alignas(64) float k_tile[TILE * D];  // token-major, as decoded
  alignas(64) float kt[D * TILE];      // channel-major: rotation, RoPE and scores vectorise over tokens
  alignas(64) float v_tile[TILE * D];
  alignas(64) float k_run[D], v_run[D], scratch[D];
  // cos/sin of the item's tokens, pair-major (pair c of token t at c * span + t - t_begin): the items of one token
  // range run one after another on a thread for every kv head of a batch row (split-major order), and share them.
  const int64_t span = t_end - t_begin;
  const float* rope_cos = nullptr;
  const float* rope_sin = nullptr;
  if (a.positions && span > 0) {
    thread_local RopeRange range;
    range.fill(*a.rope_steps, a.call, b, t_begin, a.positions + b * a.positions_stride + t_begin, span);
    rope_cos = range.cos.data(), rope_sin = range.sin.data();
  }
  Cursor k_cur, v_cur;
  k_cur.start(t_begin, keys.kf);
  v_cur.start(t_begin, values.kf);
  MeanCache k_mean, v_mean;
  std::vector<float> scores(rows * TILE);
  std::vector<uint8_t> allowed(rows * TILE);
  std::vector<float> q_scaled(rows * D);  // queries times the key scale, once per item
  for (int64_t e = 0; e < rows * D; ++e) q_scaled[e] = qh[e] * a.key_scale;
  for (int64_t t0 = t_begin, t1; t0 < t_end; t0 = t1) {
    t1 = std::min(t_end, t0 + TILE);
    if (key_groups) t1 = std::min(t1, ((t0 + shift) / keys.group + 1) * keys.group - shift);
    const int n_tok = static_cast<int>(t1 - t0);
    const int n_vec = (n_tok + 31) & ~31;  // scored columns: whole blocks of 32 (see tile_scores)
    const bool grouped = key_groups && t0 < keys.coded;  // keys of a coded group: decoded channel-major
    for (int j = 0; j < n_tok; ++j) {
      if (!grouped) keys.token(bh, t0 + j, k_cur, k_run, k_tile + j * D, scratch, k_mean);
      values.token(bh, t0 + j, v_cur, v_run, v_tile + j * D, scratch, v_mean);
      k_cur.advance(keys.kf);
      v_cur.advance(values.kf);
    }
    if (grouped) {
      keys.group_tile(bh, (t0 + shift) / keys.group, (t0 + shift) % keys.group, n_tok, kt, TILE);
      for (int c = 0; c < D; ++c) std::fill(kt + c * TILE + n_tok, kt + c * TILE + n_vec, 0.f);
    } else {
      for (int j = n_tok; j < TILE; ++j) std::fill(k_tile + j * D, k_tile + (j + 1) * D, 0.f);
      transpose_tile<D>(k_tile, kt);
      hadamard_tile<D>(kt, keys.rotation);
    }
    // RoPE re-applied to the canonical pairs c, c + D/2 (rope.h: angles from the positions, none stored).
    if (a.positions) rope_tile<D>(kt, rope_cos + (t0 - t_begin), rope_sin + (t0 - t_begin), span, n_tok);
    tile_scores<D>(kt, q_scaled.data(), rows, n_vec, scores.data());
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r % a.n_queries;
      float* sr = scores.data() + r * TILE;
      uint8_t* ok = allowed.data() + r * TILE;
      if (a.mask) {
        const uint8_t* row_mask = a.mask + b * a.mask_batch + i * a.mask_row + a.sinks + t0;
        for (int j = 0; j < n_tok; ++j) ok[j] = row_mask[j] != 0;
      } else {  // causal: a prefix of the tile
        const int64_t visible = std::clamp<int64_t>(a.causal_offset + i - a.sinks - t0 + 1, 0, n_tok);
        std::fill(ok, ok + visible, uint8_t{1});
        std::fill(ok + visible, ok + n_tok, uint8_t{0});
      }
      const float new_max = std::max(m[r], hfd::kept_max(sr, ok, n_tok));
      if (new_max == NEG_INF) {
        for (int j = 0; j < n_tok; ++j) sr[j] = 0.f;
        continue;
      }
      const float alpha = m[r] == NEG_INF ? 0.f : exp_nonpositive(m[r] - new_max);
      l[r] = l[r] * alpha + hfd::exp_kept_sum(sr, ok, n_tok, new_max);
      float* ar = acc + r * D;
      if (alpha != 1.f) {
#pragma omp simd
        for (int c = 0; c < D; ++c) ar[c] *= alpha;
      }
      m[r] = new_max;
    }
    tile_values<D>(scores.data(), v_tile, rows, n_tok, acc);
  }
}

// --- a stream decoded into the history a prefill's attention reads ---------------------------------------------

// fp32 into the output's dtype as torch converts it: bf16 rounding to nearest even, fp16 saturating at its largest
// finite value (quant.saturate_fp16), NaN kept.
template <typename T>
inline T to_output(float x) {
  if constexpr (std::is_same_v<T, c10::Half>) {
    const float most = static_cast<float>(std::numeric_limits<c10::Half>::max());
    return c10::Half(std::isnan(x) ? x : std::min(std::max(x, -most), most));
  } else {
    return T(x);
  }
}

struct DecodeArgs {
  const int32_t* positions;  // int32 [B, L] rows `positions_stride` apart, or null: no RoPE
  const hfd::RopeSteps* rope_steps;
  int64_t positions_stride = 0;
  const int64_t* order;  // canonical channel c goes to the model's channel order[c]; null: the same
  int64_t heads, heads_total, span;  // span: tokens per work item (a multiple of every group and keyframe interval)
  int64_t stride[4];  // of the output [B, H, L, D] (the last is 1)
  float norm;  // the rotation's 1 / sqrt(block) as Python defines it (hadamard.rotation_scale)
};

// Work item `item`: tokens [t_begin, t_end) of head bh decoded tile by tile as run_item decodes keys (channel-major,
// rotation undone, RoPE re-applied), then written token-major into `out` in the model's channel order.
template <int D, typename T>
void decode_item(const DecodeArgs& a, const Stream& s, T* out, int64_t item) {
  const int64_t bh = item % a.heads_total, b = bh / a.heads, h = bh % a.heads;
  const int64_t shift = s.adaptive ? s.pad : 0;
  const bool key_groups = s.adaptive || s.channel;
  const int64_t t_begin = std::max<int64_t>(item / a.heads_total * a.span - shift, 0);
  const int64_t t_end = std::min(s.length, (item / a.heads_total + 1) * a.span - shift);
  if (t_begin >= t_end) return;
  const int64_t span = t_end - t_begin;
  std::vector<float> rope_cos, rope_sin;
  if (a.positions) {
    rope_cos.resize(D / 2 * span), rope_sin.resize(D / 2 * span);
    hfd::RopeRun(*a.rope_steps).fill(a.positions + b * a.positions_stride + t_begin, span, rope_cos.data(),
                                     rope_sin.data(), span);
  }
  alignas(64) float tile[TILE * D];  // token-major, as decoded
  alignas(64) float kt[D * TILE];    // channel-major
  alignas(64) float run[D], scratch[D];
  Cursor cur;
  cur.start(t_begin, s.kf);
  MeanCache mean;
  T* head_out = out + b * a.stride[0] + h * a.stride[1];
  for (int64_t t0 = t_begin, t1; t0 < t_end; t0 = t1) {
    t1 = std::min(t_end, t0 + TILE);
    if (key_groups) t1 = std::min(t1, ((t0 + shift) / s.group + 1) * s.group - shift);
    const int n_tok = static_cast<int>(t1 - t0);
    if (key_groups && t0 < s.coded) {
      s.group_tile(bh, (t0 + shift) / s.group, (t0 + shift) % s.group, n_tok, kt, TILE);
    } else {
      for (int j = 0; j < n_tok; ++j) {
        s.token(bh, t0 + j, cur, run, tile + j * D, scratch, mean);
        cur.advance(s.kf);
      }
      for (int j = n_tok; j < TILE; ++j) std::fill(tile + j * D, tile + (j + 1) * D, 0.f);
      transpose_tile<D>(tile, kt);
    }
    if (s.rotation) {  // reference.decode_stream: the butterflies, then times the normalisation
      hadamard_tile<D>(kt, s.rotation);
      for (int c = 0; c < D; ++c) {
        float* row = kt + c * TILE;
#pragma omp simd
        for (int j = 0; j < n_tok; ++j) row[j] *= a.norm;
      }
    }
    if (a.positions)
      rope_tile<D>(kt, rope_cos.data() + (t0 - t_begin), rope_sin.data() + (t0 - t_begin), span, n_tok);
    for (int c = 0; c < D; ++c) {
      const float* row = kt + c * TILE;
      T* dst = head_out + t0 * a.stride[2] + (a.order ? a.order[c] : c);
      for (int j = 0; j < n_tok; ++j) dst[j * a.stride[2]] = to_output<T>(row[j]);
    }
  }
}

// The stored keys' positions (int32 [batch, length], rows contiguous) and RoPE frequencies (float64 [dim / 2]),
// checked; nullptr when both are empty (no RoPE to redo), else the positions with their row stride in *stride.
const int32_t* checked_positions(const at::Tensor& positions, const at::Tensor& freqs, int64_t batch, int64_t length,
                                 int64_t dim, int64_t* stride) {
  if (!positions.numel()) return nullptr;
  TORCH_CHECK(positions.scalar_type() == at::kInt && positions.dim() == 2 && positions.stride(1) == 1 &&
                  positions.size(0) == batch && positions.size(1) == length,
              "positions must be int32 [batch, stream tokens] with contiguous rows");
  TORCH_CHECK(freqs.scalar_type() == at::kDouble && freqs.is_contiguous() && freqs.numel() * 2 == dim,
              "freqs must be float64 [head_dim / 2]");
  *stride = positions.stride(0);
  return positions.data_ptr<int32_t>();
}

}  // namespace

// Every token of a stored stream decoded into `out` [B, H, L, D] (fp32, bf16 or fp16, the last dimension contiguous,
// any other strides): kernels/reference.py decode_into, what a prefill's attention reads. positions int32 [B, L]
// (rows contiguous) and freqs float64 [D / 2] of the stream's RoPE, or both empty; order int64 [D] (canonical channel
// c is the model's order[c]) or empty; rotation_scale: hadamard.rotation_scale of the stream's block (1 if none);
// span: tokens per work item, a multiple of the stream's group or keyframe interval.
void decode_into(py::object layout, at::Tensor out, at::Tensor positions, at::Tensor freqs, at::Tensor order,
                 double rotation_scale, int64_t span) {
  TORCH_CHECK(out.dim() == 4 && out.stride(3) == 1, "out must be [B, H, L, D] with contiguous rows");
  const int64_t batch = out.size(0), heads = out.size(1), dim = out.size(3);
  const Stream s(layout, dim);
  TORCH_CHECK(out.size(2) == s.length, "out holds ", out.size(2), " tokens, the stream ", s.length);
  TORCH_CHECK(span > 0 && span % TILE == 0, "span must be a positive multiple of ", TILE);
  DecodeArgs a;
  a.positions = checked_positions(positions, freqs, batch, s.length, dim, &a.positions_stride);
  const hfd::RopeSteps rope_steps(a.positions ? freqs.data_ptr<double>() : nullptr,
                                  a.positions ? static_cast<int>(dim / 2) : 0);
  a.rope_steps = &rope_steps;
  at::Tensor order_t;
  a.order = nullptr;
  if (order.numel()) {
    order_t = order.to(at::kLong).contiguous();
    TORCH_CHECK(order_t.numel() == dim, "order must be int64 [head_dim]");
    a.order = order_t.data_ptr<int64_t>();
  }
  a.heads = heads, a.heads_total = batch * heads, a.span = span, a.norm = static_cast<float>(rotation_scale);
  for (int d = 0; d < 4; ++d) a.stride[d] = out.stride(d);
  const int64_t shift = s.adaptive ? s.pad : 0;
  const int64_t items = batch * heads * ((s.length + shift + span - 1) / span);
  const auto type = out.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf, "out must be fp32, bf16 or fp16");
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      auto run = [&](auto* typed) {
        using T = std::remove_pointer_t<decltype(typed)>;
        switch (dim) {
          case 32: decode_item<32, T>(a, s, typed, item); break;
          case 64: decode_item<64, T>(a, s, typed, item); break;
          case 128: decode_item<128, T>(a, s, typed, item); break;
          case 256: decode_item<256, T>(a, s, typed, item); break;
          default: TORCH_CHECK(false, "the CPU kernel decodes head_dim 32, 64, 128 or 256, got ", dim);
        }
      };
      if (type == at::kFloat) run(out.data_ptr<float>());
      else if (type == at::kBFloat16) run(out.data_ptr<at::BFloat16>());
      else run(out.data_ptr<at::Half>());
    }
  });
}

// Attention of the query rows over the raw sink tokens and the codec-stored stream, normalised: [B, Hkv, R, D].
// query [B, Hkv, R, D] fp32 (row r = g * n + i); sink_k, sink_v fp32 [B, Hkv, S, D] (S may be 0); positions int32
// [B, L] (rows contiguous) and freqs float64 [D / 2] of the stored keys' RoPE, or both empty; mask [B, n, S + L] uint8
// or empty (then causal: token u visible to query i when u <= causal_offset + i, u counting the sinks). A row that
// may attend nothing gets zeros.
namespace {

// stream_attention over streams read already; `mask` uint8 [B, n, >= S + L] (rows contiguous: each row's first
// S + L entries are read) or empty.
at::Tensor attend_streams(const at::Tensor& query, const at::Tensor& sink_k, const at::Tensor& sink_v,
                          const Stream& keys, const Stream& values, const at::Tensor& positions, const at::Tensor& freqs,
                          const at::Tensor& mask, int64_t n_queries, int64_t causal_offset, double scale, int64_t split) {
  const int64_t batch = query.size(0), heads = query.size(1), rows = query.size(2), dim = query.size(3);
  const int64_t sinks = sink_k.size(2);
  const int64_t length = keys.length;
  TORCH_CHECK(values.length == length, "keys and values hold different numbers of tokens");
  static std::atomic<int64_t> calls{0};
  Args a;
  a.call = calls++;
  a.q = query.data_ptr<float>();
  a.positions = checked_positions(positions, freqs, batch, length, dim, &a.positions_stride);
  // The angle table of the frequencies (none without RoPE), one per call, read by every work item.
  const hfd::RopeSteps rope_steps(a.positions ? freqs.data_ptr<double>() : nullptr,
                                  a.positions ? static_cast<int>(dim / 2) : 0);
  a.rope_steps = &rope_steps;
  a.mask_base = mask.numel() ? mask.data_ptr<uint8_t>() : nullptr;
  a.mask = a.mask_base;
  a.mask_batch = a.mask_row = 0;
  if (a.mask_base) {
    TORCH_CHECK(mask.scalar_type() == at::kByte && mask.dim() == 3 && mask.size(0) == batch &&
                    mask.size(1) == n_queries && mask.size(2) >= sinks + length && mask.stride(2) == 1,
                "mask must be uint8 [batch, n_queries, >= sinks + tokens] with contiguous rows");
    a.mask_batch = mask.stride(0), a.mask_row = mask.stride(1);
  }
  a.heads = heads, a.rows = rows, a.n_queries = n_queries, a.causal_offset = causal_offset, a.length = length;
  a.heads_total = batch * heads;
  a.sinks = sinks;
  const int64_t shift = keys.adaptive ? keys.pad : 0;  // adaptive keys: items start on group boundaries
  a.split = split, a.splits = length ? (length + shift + split - 1) / split : 0, a.scale = static_cast<float>(scale);
  a.key_scale = a.scale / (keys.rotation ? std::sqrt(static_cast<float>(keys.rotation)) : 1.0f);
  const int64_t items = batch * heads * a.splits;
  auto opts = query.options();
  auto part_acc = at::zeros({std::max<int64_t>(items, 1), rows, dim}, opts);
  auto part_max = at::full({std::max<int64_t>(items, 1), rows}, NEG_INF, opts);
  auto part_sum = at::zeros({std::max<int64_t>(items, 1), rows}, opts);
  a.part_acc = part_acc.data_ptr<float>(), a.part_max = part_max.data_ptr<float>();
  a.part_sum = part_sum.data_ptr<float>();

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      switch (dim) {
        case 32: run_item<32>(a, keys, values, item); break;
        case 64: run_item<64>(a, keys, values, item); break;
        case 128: run_item<128>(a, keys, values, item); break;
        case 256: run_item<256>(a, keys, values, item); break;
        default: TORCH_CHECK(false, "the CPU kernel serves head_dim 32, 64, 128 or 256, got ", dim);
      }
    }
  });

  // Per row: merge the splits (log-sum-exp), undo the value rotation once on the merged rows, add the sinks,
  // normalise.
  auto out = at::zeros({batch, heads, rows, dim}, opts);
  float* po = out.data_ptr<float>();
  const float* sk = sink_k.data_ptr<float>();
  const float* sv = sink_v.data_ptr<float>();
  std::vector<float> sink_scores(std::max<int64_t>(sinks, 1));
  for (int64_t bh = 0; bh < batch * heads; ++bh) {
    const int64_t b = bh / heads;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r % n_queries;
      const float* qr = a.q + (bh * rows + r) * dim;
      float top = NEG_INF;
      for (int64_t u = 0; u < sinks; ++u) {
        const bool ok = a.mask_base ? a.mask_base[b * a.mask_batch + i * a.mask_row + u] != 0 : u <= causal_offset + i;
        float dot = 0.f;
        for (int64_t c = 0; c < dim; ++c) dot += qr[c] * sk[(bh * sinks + u) * dim + c];
        sink_scores[u] = ok ? dot * a.scale : NEG_INF;
        top = std::max(top, sink_scores[u]);
      }
      for (int64_t s = 0; s < a.splits; ++s) top = std::max(top, a.part_max[(s * a.heads_total + bh) * rows + r]);
      float* o = po + (bh * rows + r) * dim;
      // A query row holding NaN or inf scores NaN, which the maxima skip: its output is NaN, as the reference's.
      if (!std::all_of(qr, qr + dim, [](float x) { return std::isfinite(x); })) {
        std::fill(o, o + dim, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      if (top == NEG_INF) continue;
      float total = 0.f;
      for (int64_t s = 0; s < a.splits; ++s) {
        const int64_t item = s * a.heads_total + bh;
        const float m = a.part_max[item * rows + r];
        if (m == NEG_INF) continue;
        const float w = std::exp(m - top);
        total += a.part_sum[item * rows + r] * w;
        const float* src = a.part_acc + (item * rows + r) * dim;
        for (int64_t c = 0; c < dim; ++c) o[c] += src[c] * w;
      }
      hadamard_row(o, dim, values.rotation);
      for (int64_t u = 0; u < sinks; ++u) {
        if (sink_scores[u] == NEG_INF) continue;
        const float w = std::exp(sink_scores[u] - top);
        total += w;
        for (int64_t c = 0; c < dim; ++c) o[c] += w * sv[(bh * sinks + u) * dim + c];
      }
      for (int64_t c = 0; c < dim; ++c) o[c] /= total;
    }
  }
  return out;
}

}  // namespace

at::Tensor stream_attention(
    at::Tensor query, at::Tensor sink_k, at::Tensor sink_v, py::object key_layout, py::object value_layout,
    at::Tensor positions, at::Tensor freqs, at::Tensor mask, int64_t n_queries, int64_t causal_offset, double scale,
    int64_t split) {
  const int64_t dim = query.size(3);
  const Stream keys(key_layout, dim), values(value_layout, dim);
  return attend_streams(query, sink_k, sink_v, keys, values, positions, freqs, mask, n_queries, causal_offset, scale,
                        split);
}

// A decoding step of a StaticDeltaKVCache layer read from its preallocated storage (kernels/ops.py
// adaptive_attention, after its bookkeeping): `query` [B, Hkv, R, D] (any float dtype: rows r = g * n + i, the
// model's channel order), the layer's raw sinks [B, Hkv, >= S, D] (the first min(held, S) read), its key groups
// (`groups` of them coded, `pad`: slots before the stream in group 0) and raw tail, its values (packed rows in
// `v_format` with blocks of `v_block`, Hadamard-rotated by blocks of `rotation`; scales, mins: 1-D empty when none),
// `positions` int32 [B, max_cache_len] (RoPE re-applied from those of tokens S .. held - 1 with `freqs` float64
// [D / 2]; both empty: none), `order` int64 [D] (canonical channel c is the model's order[c]) or empty, `mask` bool
// [B, n, max_cache_len] (rows contiguous) or empty: causal over the `held` tokens. Returns fp32 [B, Hkv, R, D].
at::Tensor adaptive_step(at::Tensor query, at::Tensor sink_keys, at::Tensor sink_values, at::Tensor planes,
                         at::Tensor depths, at::Tensor low, at::Tensor step, at::Tensor tail, at::Tensor v_codes,
                         at::Tensor v_scales, at::Tensor v_mins, at::Tensor positions, at::Tensor freqs, at::Tensor order,
                         at::Tensor mask, int64_t held, int64_t groups, int64_t pad, int64_t group, int64_t v_format,
                         int64_t v_block, int64_t rotation, int64_t n_queries, double scale, int64_t split) {
  TORCH_CHECK(query.dim() == 4 && sink_keys.dim() == 4 && sink_values.dim() == 4 && v_codes.dim() == 5,
              "query [B, Hkv, R, D], sinks [B, Hkv, S, D], values' codes [B, Hkv, rows, blocks, bytes]");
  const int64_t dim = query.size(3), sinks = sink_keys.size(2), length = held - sinks;
  for (const at::Tensor* t : {&sink_keys, &sink_values, &tail, &v_codes})
    TORCH_CHECK(t->size(0) == query.size(0) && t->size(1) == query.size(1), "storage of another batch or kv heads");
  TORCH_CHECK(length > 0 && length <= v_codes.size(2), "a step over 1 to ", v_codes.size(2),
              " tokens after the sinks, got ", length);
  const Stream keys = Stream::adaptive_of(planes, depths, low, step, tail, group, pad, groups, dim, length);
  const Stream values = Stream::plain_of(Blocks(v_codes, v_scales, v_mins, v_format, v_block, dim), dim, length,
                                         rotation);
  at::Tensor q = query.to(at::kFloat), sink_k = sink_keys.to(at::kFloat);
  if (order.numel()) {  // stored keys are canonical: so are the queries and sinks they meet
    q = q.index_select(3, order), sink_k = sink_k.index_select(3, order);
  }
  const at::Tensor rope_positions = freqs.numel() ? positions.narrow(1, sinks, length) : freqs;  // empty: no RoPE
  const at::Tensor bytes = mask.numel() ? mask.view(at::kByte) : mask;
  return attend_streams(q.contiguous(), sink_k.contiguous(), sink_values.to(at::kFloat).contiguous(), keys, values,
                        rope_positions, freqs, bytes, n_queries, held - n_queries, scale, split);
}
