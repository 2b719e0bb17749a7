// One decoder layer of a Llama or Qwen2 model over a few new tokens after cached ones, in one call: the draft's
// step (specdec/cpu/decoder.py). The draft's grouped linear layers read about 60% of its step's time; the rest
// was some thirty small operations per layer (norms, rotary embedding, cache writes, attention, activation), each a
// Python call and a dispatch. Here they are loops over the few rows, and the linear layers are the grouped operator
// (specdec_grouped::grouped_linear, through the dispatcher).
//
//   x = rmsnorm(h) * w_in;  q, k, v = x W_qkv (+ bias);  q, k rotated (rotate_half, the model's cos and sin)
//   keys[pos], values[pos] = k, v;  a = softmax(q k^T * scaling) v  over positions 0 .. pos (grouped heads)
//   h += a W_o;  x = rmsnorm(h) * w_post;  h += (silu(x W_gate) * x W_up) W_down
//
// The operations are the library's, summed in another order, so the values are the library forward's to float
// rounding, not bitwise: only a draft takes this path, whose proposals may come from anything (the rejection rule
// uses the probabilities it proposed with). Each row is computed alone (the norms, the attention of its query over
// the keys up to its own position, the grouped operator's rows), so a row's values do not depend on the other
// rows of the call.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int kLanes = 16;  // partial sums per dot product: one 512-bit register (GCC vectorizes the lanes)
constexpr int kTensorsPerProjection = 6;  // q, scale, scale_unit, minimum, minimum_unit, bias

using Weights = c10::List<std::optional<at::Tensor>>;
using GroupedLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                 const std::optional<at::Tensor>&, int64_t, int64_t);

float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[k + l] * b[k + l];
  float sum = 0.f;
  for (; k < n; ++k) sum += a[k] * b[k];
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

// rows of x (n, H) normalized by their root mean square, times the norm's weight
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t n = x.size(0), H = x.size(1);
  at::Tensor out = at::empty({n, H}, x.options());
  const float* w = weight.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float* row = x.data_ptr<float>() + i * H;
    float* dst = out.data_ptr<float>() + i * H;
    const float r = 1.f / std::sqrt(dot(row, row, H) / H + static_cast<float>(eps));
    for (int64_t k = 0; k < H; ++k) dst[k] = w[k] * (row[k] * r);
  }
  return out;
}

struct Projection {
  at::Tensor q, scale;
  std::optional<at::Tensor> scale_unit, minimum, minimum_unit, bias;
  int64_t bits, group, out;
};

// x (n, K) times one projection's grouped weight, its out columns (plus bias) written from `column` on in dst
void project(const Projection& p, const at::Tensor& x, at::Tensor& dst, int64_t column) {
  static auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("specdec_grouped::grouped_linear", "").typed<GroupedLinear>();
  const at::Tensor y = op.call(x, p.q, p.scale, p.scale_unit, p.minimum, p.minimum_unit, p.bits, p.group);
  const int64_t n = x.size(0), width = y.size(1), columns = dst.size(1);
  const float* bias = p.bias ? p.bias->data_ptr<float>() : nullptr;
  for (int64_t i = 0; i < n; ++i) {
    const float* src = y.data_ptr<float>() + i * width;
    float* out = dst.data_ptr<float>() + i * columns + column;
    for (int64_t c = 0; c < p.out; ++c) out[c] = bias ? src[c] + bias[c] : src[c];
  }
}

at::Tensor project_all(const std::vector<Projection>& parts, const at::Tensor& x) {
  int64_t columns = 0;
  for (const auto& p : parts) columns += p.out;
  at::Tensor out = at::empty({x.size(0), columns}, x.options());
  int64_t column = 0;
  for (const auto& p : parts) {
    project(p, x, out, column);
    column += p.out;
  }
  return out;
}

// the rotation of one head's values at one position (the modeling files' rotate_half form)
void rotate(float* x, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) {
    const float a = x[d], b = x[d + half];
    x[d] = a * cos[d] - b * sin[d];
    x[d + half] = b * cos[d + half] + a * sin[d + half];
  }
}

at::Tensor decoder_layer(const at::Tensor& hidden, const Weights& weights, at::IntArrayRef meta, at::Tensor& keys,
                         at::Tensor& values, int64_t held, const at::Tensor& cos, const at::Tensor& sin,
                         double input_eps, double post_eps, double scaling, int64_t heads) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous() && hidden.is_cpu(),
              "decoder_layer: hidden must be a contiguous (n, H) float32 CPU tensor");
  const int64_t n = hidden.size(0), H = hidden.size(1);
  TORCH_CHECK(keys.dim() == 4 && keys.size(0) == 1 && keys.is_contiguous() && values.is_contiguous() &&
              keys.sizes() == values.sizes() && keys.scalar_type() == at::kFloat &&
              values.scalar_type() == at::kFloat, "decoder_layer: keys and values must be contiguous float32 "
              "[1, kv_heads, room, head_dim] buffers");
  const int64_t kv_heads = keys.size(1), room = keys.size(2), D = keys.size(3);
  TORCH_CHECK(held >= 0 && held + n <= room, "decoder_layer: ", held + n, " positions do not fit in ", room);
  TORCH_CHECK(heads % kv_heads == 0 && D % 2 == 0, "decoder_layer: heads must be a multiple of kv_heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == n * D && sin.numel() == n * D &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "decoder_layer: cos and sin must be contiguous (n, head_dim) float32");
  TORCH_CHECK(meta.size() >= 2, "decoder_layer: meta holds the part counts first");
  const int64_t qkv_parts = meta[0], gate_up_parts = meta[1], projections = qkv_parts + gate_up_parts + 2;
  TORCH_CHECK(static_cast<int64_t>(meta.size()) == 2 + 3 * projections &&
              static_cast<int64_t>(weights.size()) == 2 + kTensorsPerProjection * projections,
              "decoder_layer: weights and meta do not describe ", projections, " projections");
  std::vector<Projection> all;
  for (int64_t j = 0; j < projections; ++j) {
    const int64_t w = 2 + kTensorsPerProjection * j;
    auto need = [&](int64_t i) {
      const std::optional<at::Tensor> t = weights.get(w + i);
      TORCH_CHECK(t.has_value() && t->defined(), "decoder_layer: projection ", j, " lacks its weight");
      return *t;
    };
    all.push_back({need(0), need(1), weights.get(w + 2), weights.get(w + 3), weights.get(w + 4),
                   weights.get(w + 5), meta[2 + 3 * j], meta[3 + 3 * j], meta[4 + 3 * j]});
  }
  const std::vector<Projection> qkv(all.begin(), all.begin() + qkv_parts);
  const Projection& o = all[qkv_parts];
  const std::vector<Projection> gate_up(all.begin() + qkv_parts + 1, all.begin() + qkv_parts + 1 + gate_up_parts);
  const Projection& down = all.back();
  const std::optional<at::Tensor> input_norm = weights.get(0), post_norm = weights.get(1);
  TORCH_CHECK(input_norm && post_norm && input_norm->numel() == H && post_norm->numel() == H,
              "decoder_layer: the norms' weights must have H values");

  // attention: q, k and v of each new row; k rotated and both written at the row's position
  const at::Tensor x = rms_norm(hidden, *input_norm, input_eps);
  at::Tensor qkv_out = project_all(qkv, x);
  const int64_t width = qkv_out.size(1), q_width = heads * D;
  TORCH_CHECK(width == (heads + 2 * kv_heads) * D, "decoder_layer: q, k and v give ", width, " columns, not ",
              (heads + 2 * kv_heads) * D);
  float* k_cache = keys.data_ptr<float>();
  float* v_cache = values.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    float* row = qkv_out.data_ptr<float>() + i * width;
    const float* c = cos.data_ptr<float>() + i * D;
    const float* s = sin.data_ptr<float>() + i * D;
    for (int64_t h = 0; h < heads + kv_heads; ++h) rotate(row + h * D, c, s, D);
    for (int64_t g = 0; g < kv_heads; ++g) {
      std::copy_n(row + q_width + g * D, D, k_cache + (g * room + held + i) * D);
      std::copy_n(row + q_width + (kv_heads + g) * D, D, v_cache + (g * room + held + i) * D);
    }
  }
  at::Tensor attended = at::empty({n, q_width}, hidden.options());
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, n * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weight(held + n);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / heads, h = task % heads, g = h / group, seen = held + i + 1;
      const float* query = qkv_out.data_ptr<float>() + i * width + h * D;
      const float* k = k_cache + g * room * D;
      const float* v = v_cache + g * room * D;
      float top = -INFINITY;
      for (int64_t j = 0; j < seen; ++j) {
        weight[j] = dot(query, k + j * D, D) * static_cast<float>(scaling);
        top = std::max(top, weight[j]);
      }
      float total = 0.f;
      for (int64_t j = 0; j < seen; ++j) total += weight[j] = std::exp(weight[j] - top);
      float* out = attended.data_ptr<float>() + i * q_width + h * D;
      std::fill_n(out, D, 0.f);
      for (int64_t j = 0; j < seen; ++j) {
        const float p = weight[j];
        const float* value = v + j * D;
        for (int64_t d = 0; d < D; ++d) out[d] += p * value[d];
      }
      for (int64_t d = 0; d < D; ++d) out[d] /= total;
    }
  });

  // the residual stream: + attention output, then + the MLP's
  at::Tensor residual = at::empty({n, H}, hidden.options());
  project(o, attended, residual, 0);
  const float* h0 = hidden.data_ptr<float>();
  float* h1 = residual.data_ptr<float>();
  for (int64_t k = 0; k < n * H; ++k) h1[k] += h0[k];
  const at::Tensor x2 = rms_norm(residual, *post_norm, post_eps);
  at::Tensor gate_up_out = project_all(gate_up, x2);
  const int64_t inner = gate_up_out.size(1) / 2;
  TORCH_CHECK(down.out == H && gate_up_out.size(1) == 2 * inner, "decoder_layer: the MLP's widths do not match");
  at::Tensor activated = at::empty({n, inner}, hidden.options());
  for (int64_t i = 0; i < n; ++i) {
    const float* gu = gate_up_out.data_ptr<float>() + i * 2 * inner;
    float* a = activated.data_ptr<float>() + i * inner;
    for (int64_t c = 0; c < inner; ++c) a[c] = gu[c] / (1.f + std::exp(-gu[c])) * gu[inner + c];
  }
  at::Tensor out = at::empty({n, H}, hidden.options());
  project(down, activated, out, 0);
  float* o2 = out.data_ptr<float>();
  for (int64_t k = 0; k < n * H; ++k) o2[k] += h1[k];
  return out;
}

}  // namespace

TORCH_LIBRARY(specdec_decoder, m) {
  m.def("decoder_layer(Tensor hidden, Tensor?[] weights, int[] meta, Tensor(a!) keys, Tensor(b!) values, int held, "
        "Tensor cos, Tensor sin, float input_eps, float post_eps, float scaling, int heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec_decoder, CPU, m) {
  m.impl("decoder_layer", decoder_layer);
}
