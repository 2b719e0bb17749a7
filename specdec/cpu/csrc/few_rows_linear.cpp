// Float32 or bfloat16 linear layer for a few input rows (speculative verification: gamma + 1 tokens, up to 16) on CPU.
//
// out[m, n] = x[m, :] . weight[n, :] + bias[n], weight in nn.Linear's own row-major layout (no copy, no repacking).
// Bfloat16 inputs and weights are multiplied and summed in float32, the bias added in float32, and each output
// rounded to bfloat16 once (round to nearest even).
// Each weight row is read from memory once for all rows of x, so up to 8 rows cost little more than one: the
// product is bound by memory bandwidth. Beyond 8 rows the arithmetic shows (12 rows about 1.6x one row, measured
// with bench.linear), but the weight is still read from memory once. Every output is summed in the same order
// whatever M is, so a layer gives bitwise the same values for a verification over gamma tokens as for decoding them
// one by one. Written with GCC vector extensions (GCC 12+ or clang): one source for AVX-512, AVX2 or anything else
// the compiler targets.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;     // partial sums per output: one 512-bit register, two 256-bit ones
constexpr int kPrefetchBytes = 1024;  // ahead in each weight row: measured best on our CPUs
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}

// Sixteen sums at once: lane i of the result is the sum of v[i]'s lanes, in a fixed pairwise order (lane l plus
// lane l + 8, then + 4, + 2, + 1), the same for every output whatever M and NB are. One shuffle-and-add tree for
// sixteen accumulators instead of sixteen scalar ones: at M = 5 the scalar sums were a tenth of a block's time.
inline vec reduce16(const vec* v) {
  vec a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// The sums of `count` accumulators into out[0 .. count), sixteen at a time (the last group padded with zeros).
inline void reduce(const vec* acc, int count, float* out) {
  for (int i = 0; i < count; i += kLanes) {
    vec group[kLanes];
    for (int t = 0; t < kLanes; ++t) group[t] = i + t < count ? acc[i + t] : vec{};
    const vec sums = reduce16(group);
    std::memcpy(out + i, &sums, std::min(count - i, kLanes) * sizeof(float));
  }
}

// How one step of K is read (`V`, the same for inputs and weights) and multiplied: Float32 takes 16 floats per
// step; BFloat16 32 bfloat16 values, each pair of neighbours multiplied into one float32 lane (AVX-512 BF16's dot
// product where the CPU has it, else the bfloat16 values widened to float32: a bfloat16 is the top half of a
// float32). Either way the sums are float32.
struct Float32 {
  using T = float;
  static constexpr int kStep = kLanes;
  using V = vec;
  static V read(const T* p) { return load(p); }
  static void mac(vec& acc, const V& w, const V& x) { acc += w * x; }
  static float value(T v) { return v; }
  static T store(float v) { return v; }
};

struct BFloat16 {
  using T = uint16_t;
  static constexpr int kStep = 2 * kLanes;
  static float value(T v) {
    const uint32_t bits = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  static T store(float v) { return c10::BFloat16(v).x; }  // round to nearest even, as torch converts
#if defined(__AVX512BF16__)
  using V = __m512bh;
  static V read(const T* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static void mac(vec& acc, const V& w, const V& x) { acc = (vec)_mm512_dpbf16_ps((__m512)acc, w, x); }
#else
  typedef uint32_t pairs __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  struct V { vec even, odd; };
  static V read(const T* p) {
    pairs v;
    std::memcpy(&v, p, sizeof(v));  // little-endian: the even value is each pair's low half
    return {(vec)(v << 16), (vec)(v & 0xFFFF0000u)};
  }
  static void mac(vec& acc, const V& w, const V& x) { acc += w.even * x.even; acc += w.odd * x.odd; }
#endif
};

// NB output features times M rows; x: [M, K], w: rows n0 .. n0 + NB of [N, K], out: [M, N].
template <class P, int M, int NB>
void block(const typename P::T* x, const typename P::T* w, const float* bias, typename P::T* out, int64_t N,
           int64_t K, int64_t n0) {
  using T = typename P::T;
  constexpr int64_t ahead_elements = kPrefetchBytes / sizeof(T);
  vec acc[NB * M];
  for (int i = 0; i < NB * M; ++i) acc[i] = vec{};
  const T* rows = w + n0 * K;
  // Prefetching runs on past each row's end into the same row of the next block, so a block never starts on cold
  // rows (the last block re-prefetches its own rows: no address outside the weight)
  const T* next = n0 + 2 * NB <= N ? rows + NB * K : rows;
  const int64_t body = K - K % P::kStep;
  for (int64_t k = 0; k < body; k += P::kStep) {
    typename P::V xv[M];
    for (int m = 0; m < M; ++m) xv[m] = P::read(x + m * K + k);
    const T* ahead = k + ahead_elements < K ? rows + k + ahead_elements : next + (k + ahead_elements - K);
    for (int j = 0; j < NB; ++j) __builtin_prefetch(ahead + j * K);
    for (int j = 0; j < NB; ++j) {
      const typename P::V wv = P::read(rows + j * K + k);
      for (int m = 0; m < M; ++m) P::mac(acc[j * M + m], wv, xv[m]);
    }
  }
  float sums[NB * M];
  reduce(acc, NB * M, sums);
  for (int j = 0; j < NB; ++j) {
    const T* row = rows + j * K;
    for (int m = 0; m < M; ++m) {
      float sum = sums[j * M + m];
      for (int64_t k = body; k < K; ++k) sum += P::value(row[k]) * P::value(x[m * K + k]);
      out[m * N + n0 + j] = P::store(bias ? sum + bias[n0 + j] : sum);
    }
  }
}

// Rows m0 .. m0 + C of x against one block of weight rows: C is a compile-time row count of at most 8.
template <class P, int NB>
void chunk(const typename P::T* x, const typename P::T* w, const float* bias, typename P::T* out, int64_t N,
           int64_t K, int64_t n0, int64_t C) {
  switch (C) {
    case 1: block<P, 1, NB>(x, w, bias, out, N, K, n0); break;
    case 2: block<P, 2, NB>(x, w, bias, out, N, K, n0); break;
    case 3: block<P, 3, NB>(x, w, bias, out, N, K, n0); break;
    case 4: block<P, 4, NB>(x, w, bias, out, N, K, n0); break;
    case 5: block<P, 5, NB>(x, w, bias, out, N, K, n0); break;
    case 6: block<P, 6, NB>(x, w, bias, out, N, K, n0); break;
    case 7: block<P, 7, NB>(x, w, bias, out, N, K, n0); break;
    default: block<P, 8, NB>(x, w, bias, out, N, K, n0); break;
  }
}

// All M rows against NB weight rows at a time, in chunks of at most 8 rows: the first chunk streams the block's
// weight rows from memory, the next ones find them in cache (NB rows of K floats: 24-140 KiB, within L2), so the
// weight is read from memory once for any M. Sixteen rows cost a few times the arithmetic of one, not 2 passes.
template <class P, int NB>
void rows(const typename P::T* x, const typename P::T* w, const float* bias, typename P::T* out, int64_t M,
          int64_t N, int64_t K) {
  const int64_t blocks = N / NB;
  const int64_t chunks = (M + 7) / 8;
  const int64_t size = (M + chunks - 1) / chunks;  // equal chunks: 12 rows as 6 + 6, not 8 + 4
  auto all_chunks = [&](int64_t n0, auto nb) {
    constexpr int B = decltype(nb)::value;
    for (int64_t m0 = 0; m0 < M; m0 += size)
      chunk<P, B>(x + m0 * K, w, bias, out + m0 * N, N, K, n0, std::min<int64_t>(size, M - m0));
  };
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) all_chunks(b * NB, std::integral_constant<int, NB>{});
  });
  for (int64_t n = blocks * NB; n < N; ++n) all_chunks(n, std::integral_constant<int, 1>{});
}

template <class P>
void dispatch(const typename P::T* x, const typename P::T* w, const float* bias, typename P::T* out, int64_t M,
              int64_t N, int64_t K) {
#if defined(__AVX512F__)
  // 32 registers; at 7-8 rows, 28-32 accumulators spill a few to L1, which still beats narrower blocks (measured:
  // 8 rows at NB 4 cost 1.15-1.2x one row, at NB 2 1.3-1.4x)
  if (M <= 2) rows<P, 8>(x, w, bias, out, M, N, K); else rows<P, 4>(x, w, bias, out, M, N, K);
#else
  if (M <= 2) rows<P, 4>(x, w, bias, out, M, N, K);
  else if (M <= 4) rows<P, 2>(x, w, bias, out, M, N, K);
  else rows<P, 1>(x, w, bias, out, M, N, K);
#endif
}

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "few_rows_linear: shapes ",
              x.sizes(), " and ", weight.sizes(), " do not match");
  const auto type = weight.scalar_type();
  TORCH_CHECK((type == at::kFloat || type == at::kBFloat16) && x.scalar_type() == type && x.is_cpu() &&
              weight.is_cpu(), "few_rows_linear: float32 or bfloat16 CPU tensors of one type only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "few_rows_linear: contiguous tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  at::Tensor bias_float;  // sums are float32, so is the bias added to them
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == type && bias->is_contiguous() && bias->numel() == N,
                "few_rows_linear: bias must be a contiguous vector of ", N, " of the weight's type");
    bias_float = bias->to(at::kFloat).contiguous();
    bp = bias_float.data_ptr<float>();
  }
  if (type == at::kFloat) {
    dispatch<Float32>(x.data_ptr<float>(), weight.data_ptr<float>(), bp, out.data_ptr<float>(), M, N, K);
  } else {
    auto raw = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    dispatch<BFloat16>(raw(x), raw(weight), bp, raw(out), M, N, K);
  }
  return out;
}

}  // namespace

// the schema alone, and the kernel for CPU tensors: a shape function can then be registered beside it (Python's
// torch.library.register_fake), so that torch.compile traces a model that calls it
TORCH_LIBRARY(specdec, m) {
  m.def("few_rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("few_rows_linear", few_rows_linear);
}
