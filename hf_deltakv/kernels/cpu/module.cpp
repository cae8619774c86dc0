// The Python module of the CPU kernels (one extension, several sources).
#include <torch/extension.h>

#include <vector>
#include <tuple>

torch::Tensor stream_attention(torch::Tensor query, torch::Tensor sink_k, torch::Tensor sink_v, py::object key_layout,
                               py::object value_layout, torch::Tensor cos, torch::Tensor sin, torch::Tensor mask,
                               int64_t n_queries, int64_t causal_offset, double scale, int64_t split);
std::vector<torch::Tensor> quantize_rows(torch::Tensor x, int64_t format, int64_t bs, std::vector<double> divisors);
std::vector<torch::Tensor> code_delta_rows(torch::Tensor x, torch::Tensor base, torch::Tensor long_term, int64_t format,
                                           int64_t bs, bool intra);

torch::Tensor pack_planes(torch::Tensor codes, torch::Tensor depths, int64_t planes);
torch::Tensor decode_planes(torch::Tensor planes, torch::Tensor depths, torch::Tensor low, torch::Tensor step);

torch::Tensor dequantize_latent(torch::Tensor packed, torch::Tensor scales, std::vector<int64_t> bits, torch::Tensor out);
std::vector<torch::Tensor> quantize_latent(torch::Tensor latent, std::vector<int64_t> bits);
bool vector_latent_decode(bool enabled);
std::vector<torch::Tensor> latent_attention(torch::Tensor rows, torch::Tensor keys, torch::Tensor key_mean,
                                            torch::Tensor cos, torch::Tensor sin, torch::Tensor allowed,
                                            torch::Tensor codes, torch::Tensor scales, std::vector<int64_t> bits,
                                            double scale);

std::tuple<torch::Tensor, int64_t> sparse_matvec(torch::Tensor x, torch::Tensor wt, torch::Tensor bias,
                                                 torch::Tensor scale, double threshold);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse_matvec", &sparse_matvec, "decode linear reading only kept input rows (weight skip)");
  m.def("pack_planes", &pack_planes, "bit planes of per-channel codes (quant/bitplanes.py)");
  m.def("decode_planes", &decode_planes, "decoded values of whole adaptive groups (reference.decode_adaptive)");
  m.def("dequantize_latent", &dequantize_latent, "the residual cache's packed latent groups to fp32 or bf16");
  m.def("vector_latent_decode", &vector_latent_decode, "switch the vector latent decoder (tests); previous setting");
  m.def("quantize_latent", &quantize_latent, "the residual cache's latent groups packed at their depths");
  m.def("latent_attention", &latent_attention, "softmax statistics over residual-coded tokens, values latent");
  m.def("stream_attention", &stream_attention, "decode attention over packed codec storage");
  m.def("quantize_rows", &quantize_rows, "block quantization of rows (q4_0, q4_1, q8_0 families)");
  m.def("code_delta_rows", &code_delta_rows, "one closed-loop delta step (inter/intra per block)");
}
