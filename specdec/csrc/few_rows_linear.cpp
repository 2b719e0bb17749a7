// Float32 linear layer for a few input rows (speculative verification: gamma + 1 <= 8 tokens) on CPU.
//
// out[m, n] = x[m, :] . weight[n, :] + bias[n], weight in nn.Linear's own row-major layout (no copy, no repacking).
// Each weight row is read from memory once for all rows of x, so M rows cost little more than one: the product is
// bound by memory bandwidth. Every output is summed in the same order whatever M is, so a layer gives bitwise the
// same values for a verification over gamma tokens as for decoding them one by one. Written with GCC vector extensions: one source for
// AVX-512, AVX2 or anything else the compiler targets.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int kLanes = 16;     // partial sums per output: one 512-bit register, two 256-bit ones
constexpr int kPrefetch = 256;  // floats ahead in each weight row (1 KiB): measured best on our CPUs
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}

inline float reduce(vec v) {  // a fixed pairwise order
  float s[kLanes];
  std::memcpy(s, &v, sizeof(vec));
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) s[i] += s[i + width];
  return s[0];
}

// NB output features times M rows; x: [M, K], w: rows n0 .. n0 + NB of [N, K], out: [M, N].
template <int M, int NB>
void block(const float* x, const float* w, const float* bias, float* out, int64_t N, int64_t K, int64_t n0) {
  vec acc[NB][M];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = vec{};
  const int64_t body = K - K % kLanes;
  for (int64_t k = 0; k < body; k += kLanes) {
    vec xv[M];
    for (int m = 0; m < M; ++m) xv[m] = load(x + m * K + k);
    for (int j = 0; j < NB; ++j) __builtin_prefetch(w + (n0 + j) * K + k + kPrefetch);
    for (int j = 0; j < NB; ++j) {
      const vec wv = load(w + (n0 + j) * K + k);
      for (int m = 0; m < M; ++m) acc[j][m] += wv * xv[m];
    }
  }
  for (int j = 0; j < NB; ++j) {
    const float* wr = w + (n0 + j) * K;
    for (int m = 0; m < M; ++m) {
      float sum = reduce(acc[j][m]);
      for (int64_t k = body; k < K; ++k) sum += wr[k] * x[m * K + k];
      out[m * N + n0 + j] = bias ? sum + bias[n0 + j] : sum;
    }
  }
}

template <int M>
void rows(const float* x, const float* w, const float* bias, float* out, int64_t N, int64_t K) {
#if defined(__AVX512F__)
  constexpr int NB = M <= 2 ? 8 : (M <= 6 ? 4 : 2);  // accumulators within 32 registers
#else
  constexpr int NB = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
#endif
  const int64_t blocks = N / NB;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block<M, NB>(x, w, bias, out, N, K, b * NB);
  });
  for (int64_t n = blocks * NB; n < N; ++n) block<M, 1>(x, w, bias, out, N, K, n);
}

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "few_rows_linear: shapes ",
              x.sizes(), " and ", weight.sizes(), " do not match");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.is_cpu() && weight.is_cpu(),
              "few_rows_linear: float32 CPU tensors only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "few_rows_linear: contiguous tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "few_rows_linear: bias must be a contiguous float32 vector of ", N);
    bp = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += 8) {  // more than 8 rows: one pass over the weight per 8
    const float* xs = xp + m0 * K;
    float* os = op + m0 * N;
    switch (std::min<int64_t>(8, M - m0)) {
      case 1: rows<1>(xs, wp, bp, os, N, K); break;
      case 2: rows<2>(xs, wp, bp, os, N, K); break;
      case 3: rows<3>(xs, wp, bp, os, N, K); break;
      case 4: rows<4>(xs, wp, bp, os, N, K); break;
      case 5: rows<5>(xs, wp, bp, os, N, K); break;
      case 6: rows<6>(xs, wp, bp, os, N, K); break;
      case 7: rows<7>(xs, wp, bp, os, N, K); break;
      default: rows<8>(xs, wp, bp, os, N, K); break;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(specdec, m) {
  m.def("few_rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", few_rows_linear);
}
