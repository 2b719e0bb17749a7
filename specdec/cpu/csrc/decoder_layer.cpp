// One decoder layer of a Llama or Qwen2 model with grouped weights over a few new tokens after cached ones, in one
// call (specdec/cpu/decoder.py). What the fused forward does in some thirty small operations per layer, each a
// Python call and a dispatch, with the same arithmetic, so the same bits:
//
//   x = w_in * (h * rsqrt(mean(h^2) + eps))            mean: ATen's reduction; the rest elementwise, as ATen does it
//   q, k, v = x W_qkv (+ bias)                         the grouped operator (through the dispatcher), its rows cut
//   q, k = q cos + rotate_half(q) sin                   elementwise, no fused multiply-add (ATen rounds each step)
//   keys[pos], values[pos] = k, v                       into the request's cache, in place
//   a_i = sdpa(q_i, keys[:pos_i + 1], values[:pos_i + 1])   ATen's SDPA, one call per row with the query heads of a
//                                                       key/value head as its rows (cpu/attention.py's one_query_attention)
//   h += a W_o;  x = w_post * ...;  h += (silu(x W_gate) * x W_up) W_down     silu: ATen's
//
// Elementwise IEEE operations (products, sums, a division, a square root) give the same bits wherever they run;
// the reduction, the exponentials and the attention are ATen's own calls on tensors of the same shapes and strides
// as the fused forward's. So the hidden states, the cache and the logits are bitwise the library forward's
// (tests/test_native_step.py), and each row is computed alone.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

// every product and sum rounded on its own, as ATen's elementwise kernels do (-O3 -march=native would fuse
// a * b + c into one rounding)
#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int kTensorsPerProjection = 6;  // q, scale, scale_unit, minimum, minimum_unit, bias

using Weights = c10::List<std::optional<at::Tensor>>;
using GroupedLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                 const std::optional<at::Tensor>&, int64_t, int64_t);

// rows of x (n, H) normalized as the library's RMSNorm does it: x * rsqrt(mean(x^2) + eps), times the weight
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t n = x.size(0), H = x.size(1);
  const at::Tensor variance = at::mean(at::pow(x, 2), {-1}, true);
  at::Tensor out = at::empty({n, H}, x.options());
  const float* w = weight.data_ptr<float>();
  const float* v = variance.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float* row = x.data_ptr<float>() + i * H;
    float* dst = out.data_ptr<float>() + i * H;
    const float r = 1.f / std::sqrt(v[i] + static_cast<float>(eps));
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

// one head's values at one position rotated into dst, as the modeling files' apply_rotary_pos_emb computes them:
// (x * cos) + (rotate_half(x) * sin), each product and the sum rounded (no fused multiply-add: see the pragma)
void rotate(const float* x, const float* cos, const float* sin, float* dst, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) {
    const float a = x[d] * cos[d], b = -x[d + half] * sin[d];
    dst[d] = a + b;
  }
  for (int64_t d = half; d < D; ++d) {
    const float a = x[d] * cos[d], b = x[d - half] * sin[d];
    dst[d] = a + b;
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
  // q as the library holds it, (1, heads, n, D); k and v straight into the cache at their positions
  at::Tensor query = at::empty({1, heads, n, D}, hidden.options());
  float* q_all = query.data_ptr<float>();
  float* k_cache = keys.data_ptr<float>();
  float* v_cache = values.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float* row = qkv_out.data_ptr<float>() + i * width;
    const float* c = cos.data_ptr<float>() + i * D;
    const float* s = sin.data_ptr<float>() + i * D;
    for (int64_t h = 0; h < heads; ++h) rotate(row + h * D, c, s, q_all + (h * n + i) * D, D);
    for (int64_t g = 0; g < kv_heads; ++g) {
      rotate(row + q_width + g * D, c, s, k_cache + (g * room + held + i) * D, D);
      std::copy_n(row + q_width + (kv_heads + g) * D, D, v_cache + (g * room + held + i) * D);
    }
  }
  // each row its own SDPA call over the keys up to its position, the query heads of a key/value head its rows
  at::Tensor attended = at::empty({n, q_width}, hidden.options());
  const int64_t group = heads / kv_heads;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t seen = held + i + 1;
    const at::Tensor out = at::scaled_dot_product_attention(
        query.narrow(2, i, 1).reshape({1, kv_heads, group, D}), keys.narrow(2, 0, seen),
        values.narrow(2, 0, seen), std::nullopt, 0.0, false, scaling);
    const at::Tensor rows = out.contiguous();
    std::copy_n(rows.data_ptr<float>(), q_width, attended.data_ptr<float>() + i * q_width);
  }

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
  // silu(gate) by ATen on the gate's columns as the library splits them (a view), times up
  at::Tensor activated = at::silu(gate_up_out.narrow(1, 0, inner)).contiguous();
  for (int64_t i = 0; i < n; ++i) {
    const float* up = gate_up_out.data_ptr<float>() + i * 2 * inner + inner;
    float* a = activated.data_ptr<float>() + i * inner;
    for (int64_t c = 0; c < inner; ++c) a[c] = a[c] * up[c];
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
