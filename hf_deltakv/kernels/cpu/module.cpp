// The Python module of the CPU kernels (one extension, several sources).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>  // py::object and the casters of at::Tensor

#include <vector>
#include <tuple>

at::Tensor stream_attention(at::Tensor query, at::Tensor sink_k, at::Tensor sink_v, py::object key_layout,
                               py::object value_layout, at::Tensor positions, at::Tensor freqs, at::Tensor mask,
                               int64_t n_queries, int64_t causal_offset, double scale, int64_t split);
void decode_into(py::object layout, at::Tensor out, at::Tensor positions, at::Tensor freqs, at::Tensor order,
                 double rotation_scale, int64_t span);
std::vector<at::Tensor> quantize_rows(at::Tensor x, int64_t format, int64_t bs, std::vector<double> divisors);
void quantize_rows_at(at::Tensor x, int64_t format, int64_t bs, std::vector<double> divisors, at::Tensor codes,
                      at::Tensor scales, at::Tensor mins, int64_t at, int64_t rotation, double rotation_scale,
                      double rotation_limit);
at::Tensor undo_rope(at::Tensor keys, at::Tensor positions, at::Tensor freqs, at::Tensor order);
void append_step(at::Tensor key, at::Tensor value, at::Tensor position, at::Tensor positions, at::Tensor freqs,
                 at::Tensor order, at::Tensor counts, at::Tensor tail, int64_t row, int64_t sinks, int64_t format,
                 int64_t bs, std::vector<double> divisors, at::Tensor codes, at::Tensor scales, at::Tensor mins,
                 int64_t rotation, double rotation_scale, double rotation_limit);
at::Tensor adaptive_step(at::Tensor query, at::Tensor sink_keys, at::Tensor sink_values, at::Tensor planes,
                         at::Tensor depths, at::Tensor low, at::Tensor step, at::Tensor tail, at::Tensor v_codes,
                         at::Tensor v_scales, at::Tensor v_mins, at::Tensor positions, at::Tensor freqs, at::Tensor order,
                         at::Tensor mask, int64_t held, int64_t groups, int64_t pad, int64_t group, int64_t v_format,
                         int64_t v_block, int64_t rotation, int64_t n_queries, double scale, int64_t split);
std::vector<at::Tensor> code_delta_rows(at::Tensor x, at::Tensor base, at::Tensor long_term, int64_t format,
                                           int64_t bs, bool intra);

at::Tensor query_energy(at::Tensor query, at::Tensor order);
void register_step_ops(at::Tensor clips, int64_t most, int64_t steps);
at::Tensor allocate_depths(at::Tensor level, int64_t total, int64_t most, int64_t steps);
at::Tensor pack_planes(at::Tensor codes, at::Tensor depths, int64_t planes);
std::vector<at::Tensor> clipped_codes(at::Tensor x, at::Tensor low, at::Tensor span, at::Tensor levels,
                                      at::Tensor clips);
std::vector<at::Tensor> best_candidate(at::Tensor x, at::Tensor lows, at::Tensor steps, at::Tensor levels);
std::vector<at::Tensor> grid_ranges(at::Tensor low_code, at::Tensor high_code, at::Tensor depths, at::Tensor origin,
                                    at::Tensor unit);
at::Tensor decode_planes(at::Tensor planes, at::Tensor depths, at::Tensor low, at::Tensor step);

at::Tensor dequantize_latent(at::Tensor packed, at::Tensor scales, std::vector<int64_t> bits, at::Tensor out);
std::vector<at::Tensor> quantize_latent(at::Tensor latent, std::vector<int64_t> bits);
bool vector_latent_decode(bool enabled);
std::vector<at::Tensor> latent_attention(at::Tensor rows, at::Tensor keys, at::Tensor key_mean,
                                            at::Tensor positions, at::Tensor freqs, at::Tensor allowed,
                                            at::Tensor codes, at::Tensor scales, std::vector<int64_t> bits,
                                            double scale);

std::tuple<at::Tensor, int64_t> sparse_matvec(at::Tensor x, at::Tensor wt, at::Tensor bias,
                                                 at::Tensor scale, double threshold);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse_matvec", &sparse_matvec, "decode linear reading only kept input rows (weight skip)");
  m.def("query_energy", &query_energy, "the queries' pair energies averaged over the heads of a kv head");
  m.def("allocate_depths", &allocate_depths, "the adaptive keys' depths by reverse water-filling");
  m.def("pack_planes", &pack_planes, "bit planes of per-channel codes (quant/bitplanes.py)");
  m.def("clipped_codes", &clipped_codes, "the adaptive keys' clipped ranges and codes (reference.clipped_codes)");
  m.def("best_candidate", &best_candidate, "the least-error range of given candidates, codes (reference.best_candidate)");
  m.def("grid_ranges", &grid_ranges, "fp16 low and step of grid-coded key ranges (key_grid.ranges)");
  m.def("decode_planes", &decode_planes, "decoded values of whole adaptive groups (reference.decode_adaptive)");
  m.def("dequantize_latent", &dequantize_latent, "the residual cache's packed latent groups to fp32 or bf16");
  m.def("vector_latent_decode", &vector_latent_decode, "switch the vector latent decoder (tests); previous setting");
  m.def("quantize_latent", &quantize_latent, "the residual cache's latent groups packed at their depths");
  m.def("latent_attention", &latent_attention, "softmax statistics over residual-coded tokens, values latent");
  m.def("stream_attention", &stream_attention, "decode attention over packed codec storage");
  m.def("decode_into", &decode_into, "a stored stream decoded into a prefill's history (reference.decode_into)");
  m.def("quantize_rows", &quantize_rows, "block quantization of rows (q4_0, q4_1, q8_0 families)");
  m.def("quantize_rows_at", &quantize_rows_at, "quantize_rows of new tokens (rotated first or not), in place in growing storage");
  m.def("append_step", &append_step, "a decoding step's token into a preallocated DeltaKVCache layer (one call)");
  m.def("adaptive_step", &adaptive_step, "a decoding step's attention over a preallocated DeltaKVCache layer");
  m.def("register_step_ops", &register_step_ops, "the C++ kernels of the ops stream_append_cpu, adaptive_attention_cpu");
  m.def("undo_rope", &undo_rope, "keys after RoPE turned back to before it (rope.RopeForm.undo)");
  m.def("code_delta_rows", &code_delta_rows, "one closed-loop delta step (inter/intra per block)");
}
