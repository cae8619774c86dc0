// A preallocated DeltaKVCache layer's decoding step as C++ kernels of PyTorch ops (kernels/ops.py: the ops
// `hf_deltakv::stream_append_cpu` and `hf_deltakv::adaptive_attention_cpu`, whose schemas are those of
// `stream_append` and `adaptive_attention` with the kernel's arguments after them). The dispatcher calls these
// directly on CPU tensors: no Python runs in a step that codes no group. A step they do not serve (a token into the
// sinks, the step that completes a key group, a mask whose rows are not contiguous) is handed, arguments unchanged, to
// the op of the same schema without the suffix: kernels/ops.py's Python body, the specification of both.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/where.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/bitwise_or.h>
#include <ATen/ops/bitwise_left_shift.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/div.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

void append_step(at::Tensor key, at::Tensor value, at::Tensor position, at::Tensor positions, at::Tensor freqs,
                 at::Tensor order, at::Tensor counts, at::Tensor tail, int64_t row, int64_t sinks, int64_t format,
                 int64_t bs, std::vector<double> divisors, at::Tensor codes, at::Tensor scales, at::Tensor mins,
                 int64_t rotation, double rotation_scale, double rotation_limit);
at::Tensor adaptive_step(at::Tensor query, at::Tensor sink_keys, at::Tensor sink_values, at::Tensor planes,
                         at::Tensor depths, at::Tensor low, at::Tensor step, at::Tensor tail, at::Tensor v_codes,
                         at::Tensor v_scales, at::Tensor v_mins, at::Tensor positions, at::Tensor freqs, at::Tensor order,
                         at::Tensor mask, int64_t held, int64_t groups, int64_t pad, int64_t group, int64_t v_format,
                         int64_t v_block, int64_t rotation, int64_t n_queries, double scale, int64_t split);
at::Tensor query_energy(at::Tensor query, at::Tensor order);
at::Tensor allocate_depths(at::Tensor level, int64_t total, int64_t most, int64_t steps);
at::Tensor pack_planes(at::Tensor codes, at::Tensor depths, int64_t planes);
std::vector<at::Tensor> clipped_codes(at::Tensor x, at::Tensor low, at::Tensor span, at::Tensor levels,
                                      at::Tensor clips);

namespace {

// The host counters' slots (kernels/ops.py: TOKENS, CODED, OBSERVED, BEFORE).
constexpr int TOKENS = 0, CODED = 1, OBSERVED = 2, BEFORE = 3;

// Arguments of the op without the suffix (the first ones of ours), the kernel's after them.
constexpr size_t APPEND_ARGS = 18, APPEND_KERNEL_ARGS = 5;
constexpr size_t ATTENTION_ARGS = 25, ATTENTION_KERNEL_ARGS = 3;

// An optional tensor argument, or an empty tensor of `empty_type` (made once) where it is None.
at::Tensor optional(const c10::IValue& v, at::ScalarType empty_type) {
  if (!v.isNone()) return v.toTensor();
  static const at::Tensor empties[] = {at::empty({0}, at::kLong), at::empty({0}, at::kDouble),
                                       at::empty({0}, at::kHalf), at::empty({0}, at::kBool)};
  for (const at::Tensor& empty : empties)
    if (empty.scalar_type() == empty_type) return empty;
  return at::empty({0}, at::TensorOptions().dtype(empty_type));
}

int64_t integer(const c10::IValue& v) { return v.isInt() ? v.toInt() : v.toSymInt().expect_int(); }

int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }

// The op `name` (our schema without the kernel's arguments), looked up once.
const c10::OperatorHandle& op_named(const char* name) {
  static const auto append = c10::Dispatcher::singleton().findSchemaOrThrow("hf_deltakv::stream_append", "");
  static const auto attention = c10::Dispatcher::singleton().findSchemaOrThrow("hf_deltakv::adaptive_attention", "");
  return std::string(name) == "stream_append" ? append : attention;
}

// The op `name` run on our arguments (the first `args`), its results left in their place.
void hand_over(const char* name, torch::jit::Stack* stack, size_t args, size_t kernel_args) {
  const c10::OperatorHandle& op = op_named(name);
  const size_t ours = args + kernel_args;
  torch::jit::Stack inner(stack->end() - ours, stack->end() - kernel_args);
  op.callBoxed(&inner);
  torch::jit::drop(*stack, ours);
  for (auto& result : inner) stack->push_back(std::move(result));
}

// stream_append's arguments, then v_kind, v_block (the value format's kind and block), divisors (its scale search),
// rotation_scale and rotation_limit (kernels/cpu/encode.py append_token's).
void stream_append_cpu(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const auto a = torch::jit::last(*stack, APPEND_ARGS + APPEND_KERNEL_ARGS);
  const at::Tensor counts = a[12].toTensor();
  const int64_t* state = counts.data_ptr<int64_t>();
  const at::Tensor sink_keys = a[3].toTensor();
  const int64_t held = state[TOKENS], coded = state[CODED], sinks = sink_keys.size(2);
  if (held < sinks) return hand_over("stream_append", stack, APPEND_ARGS, APPEND_KERNEL_ARGS);
  const int64_t group = integer(a[13]), pad = integer(a[14]), rotation = integer(a[17]);
  const int64_t row = held - sinks - (coded ? coded * group - pad : 0);
  const at::Tensor ids = a[2].isNone() ? optional(a[2], at::kLong) : a[2].toTensor().select(1, 0).to(at::kLong);
  const at::Tensor freqs = a[10].isNone() ? optional(a[10], at::kDouble) : a[10].toTensor().to(at::kDouble);
  append_step(a[0].toTensor(), a[1].toTensor(), ids, a[9].toTensor(), freqs, optional(a[11], at::kLong), counts,
              a[5].toTensor(), row, sinks, a[18].toInt(), a[19].toInt(), a[20].toDoubleVector(), a[6].toTensor(),
              optional(a[7], at::kHalf), optional(a[8], at::kHalf), rotation, a[21].toDouble(), a[22].toDouble());
  torch::jit::drop(*stack, APPEND_ARGS + APPEND_KERNEL_ARGS);
}

// The adaptive keys' coding constants, given once by register_step_ops: reference.CLIPS (fp32 [C, 2]), MAX_BITS and
// WATER_LEVEL_STEPS.
struct Coding {
  at::Tensor clips;
  int64_t most = 0, steps = 0;
};
Coding& coding() {
  static Coding constants;
  return constants;
}

// The open key group, complete, coded into row `at` of planes, depths, low and step [B, H, rows, ...]: reference.py
// code_groups(tail[:, :, :group - first], first, 1, weights, total, clip_range, out, at) with the dispatched CPU
// kernels, the same ATen operations on tensors of the same shapes in the same order (so the same floats); `clips`
// fp32 [C, 2] (reference.CLIPS, or its first row without clip_range), `most` its MAX_BITS, `steps` its
// WATER_LEVEL_STEPS; `weights` fp32 [B, H, 1, D] or undefined.
void code_group(const at::Tensor& tail, int64_t first, const at::Tensor& weights, int64_t total, const at::Tensor& clips,
                int64_t most, int64_t steps, const at::Tensor& planes, const at::Tensor& depths, const at::Tensor& low,
                const at::Tensor& step, int64_t at) {
  const int64_t group = planes.size(-1) * 8, batch = tail.size(0), heads = tail.size(1), dim = tail.size(3);
  TORCH_CHECK(dim <= total && total <= most * dim, total, " bits cannot be spread over ", dim, " channels at 1 to ",
              most, " bits each");
  at::Tensor x = tail.narrow(2, 0, group - first).to(at::kFloat);
  if (first) x = at::cat({x.narrow(2, 0, 1).expand({batch, heads, first, dim}), x}, 2);
  x = x.view({batch, heads, 1, group, dim});
  // encode_groups: each channel's range; allocate_bits: depths by the range squared (times the query weights)
  const at::Tensor lowest_value = x.amin(3), span = x.amax(3) - lowest_value;
  const at::Tensor score = weights.defined() ? span.pow(2) * weights : span.pow(2);
  const at::Tensor finite = at::isfinite(score) & (score > 0);
  at::Tensor level = at::where(finite, score, at::ones_like(score)).log2() * 0.5;
  const at::Tensor floor = level.masked_fill(~finite, std::numeric_limits<float>::infinity())
                               .amin(-1, true)
                               .clamp(std::nullopt, 0) -
                           2 * most;
  level = at::where(finite, level, floor.expand_as(level));
  const at::Tensor bits = allocate_depths(level.reshape({-1, dim}).contiguous(), total, most, steps);  // [B*H, D]
  const at::Tensor levels = (at::pow(2, bits.to(at::kLong)) - 1).to(at::kFloat);  // 2^depth - 1, exact
  const auto coded = clipped_codes(x.reshape({-1, group, dim}), lowest_value.reshape({-1, dim}),
                                   span.reshape({-1, dim}), levels, clips);
  const at::Tensor packed = pack_planes(coded[0], bits, bits[0].to(at::kLong).sum().item<int64_t>());
  const at::Tensor nibbles =  // quant/packing.py pack_4bit
      at::bitwise_or(bits.narrow(1, 0, dim / 2), at::bitwise_left_shift(bits.narrow(1, dim / 2, dim / 2), 4));
  planes.select(2, at).copy_(packed.view({batch, heads, -1, group / 8}));
  depths.select(2, at).copy_(nibbles.view({batch, heads, dim / 2}));
  low.select(2, at).copy_(coded[1].view({batch, heads, dim}));
  step.select(2, at).copy_(coded[2].view({batch, heads, dim}));
}

// adaptive_attention's arguments, then v_kind, v_block and split (kernels/cpu/stream_attention.py adaptive_step's).
void adaptive_attention_cpu(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const auto a = torch::jit::last(*stack, ATTENTION_ARGS + ATTENTION_KERNEL_ARGS);
  const at::Tensor query = a[0].toTensor(), sink_keys = a[2].toTensor(), planes = a[4].toTensor();
  const at::Tensor energy = a[15].toTensor(), before = a[16].toTensor(), counts = a[17].toTensor();
  const at::Tensor mask = optional(a[1], at::kBool);
  int64_t* state = counts.data_ptr<int64_t>();
  const int64_t held = state[TOKENS];
  int64_t coded = state[CODED];
  const int64_t sinks = sink_keys.size(2), kv_heads = sink_keys.size(1), group = planes.size(-1) * 8;
  const int64_t pad = integer(a[18]), stream = std::max<int64_t>(held - sinks, 0);
  if (!stream || (mask.numel() && mask.stride(-1) != 1))
    return hand_over("adaptive_attention", stack, ATTENTION_ARGS, ATTENTION_KERNEL_ARGS);
  if ((pad + stream) % group == 0 && (pad + stream) / group > coded) {  // the group is complete: coded
    const int64_t summed = state[BEFORE];
    const at::Tensor weights = summed ? at::div(before.unsqueeze(2), summed) : at::Tensor();
    const Coding& constants = coding();
    // clip_range: every candidate range, else the whole range only (the first)
    const at::Tensor clips = a[20].toBool() ? constants.clips : constants.clips.narrow(0, 0, 1);
    code_group(a[8].toTensor(), coded ? 0 : pad, weights, integer(a[19]), clips, constants.most, constants.steps,
               planes, a[5].toTensor(), a[6].toTensor(), a[7].toTensor(), coded);
    state[CODED] = ++coded;
  }
  const at::Tensor order = optional(a[14], at::kLong);
  const int64_t batch = query.size(0), heads = query.size(1), n = query.size(2), dim = query.size(3);
  if (a[21].toBool() && held - 1 >= state[OBSERVED]) {  // query_weights: a position's queries observed once
    const at::Tensor grouped = query.to(at::kFloat).reshape({batch, kv_heads, -1, 1, dim}).contiguous();
    const at::Tensor fresh = query_energy(grouped, order).select(2, 0);
    const at::Tensor total = state[OBSERVED] ? at::add(energy, fresh) : fresh;
    energy.copy_(total);
    state[OBSERVED] = held;
    if (held % group == 0 && held / group >= coded + floor_div(sinks - pad, group)) {  // the next group's sum
      before.copy_(total);
      state[BEFORE] = held;
    }
  }
  const at::Tensor rows = query.reshape({batch, kv_heads, heads / kv_heads * n, dim});
  const at::Tensor values = a[9].toTensor();
  at::Tensor out = adaptive_step(rows, sink_keys, a[3].toTensor(), planes, a[5].toTensor(), a[6].toTensor(),
                                 a[7].toTensor(), a[8].toTensor(), values, optional(a[10], at::kHalf),
                                 optional(a[11], at::kHalf), a[12].toTensor(), optional(a[13], at::kDouble), order,
                                 mask, held, coded, pad, group, a[25].toInt(), a[26].toInt(), integer(a[23]), n,
                                 a[24].toDouble(), a[27].toInt());
  const int64_t value_dim = a[3].toTensor().size(3);
  out = out.reshape({batch, heads, n, value_dim});
  torch::jit::drop(*stack, ATTENTION_ARGS + ATTENTION_KERNEL_ARGS);
  stack->push_back(std::move(out));
}

}  // namespace

// Register the two kernels for CPU tensors (once per process: kernels/__init__.py calls it with the extension it
// uses), with the adaptive keys' coding constants (`clips` fp32 [C, 2], `most`, `steps`: see Coding); the ops'
// schemas are defined in Python (kernels/ops.py) before.
void register_step_ops(at::Tensor clips, int64_t most, int64_t steps) {
  static std::unique_ptr<torch::Library> library;
  if (library) return;
  TORCH_CHECK(clips.dim() == 2 && clips.size(1) == 2 && clips.size(0) >= 1, "clips must be [C, 2], C >= 1");
  coding() = Coding{clips.to(at::kFloat).contiguous().clone(), most, steps};
  library = std::make_unique<torch::Library>(torch::Library::IMPL, "hf_deltakv", c10::DispatchKey::CPU, __FILE__,
                                             __LINE__);
  library->impl("stream_append_cpu", torch::CppFunction::makeFromBoxedFunction<&stream_append_cpu>());
  library->impl("adaptive_attention_cpu", torch::CppFunction::makeFromBoxedFunction<&adaptive_attention_cpu>());
}
