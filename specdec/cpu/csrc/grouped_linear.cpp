// A linear layer over weights as GGUF ships them, for a few float32 input rows (verification: gamma + 1 tokens,
// up to 16) on CPU: out[m, n] = sum_k x[m, k] * w[n, k], where w is never materialised in float.
//
// The weight is held in groups of G consecutive values along K, each group a scale and (4-bit form) a minimum:
//   w[n, k] = scale[n, g] * v[n, k] - minimum[n, g],   g = k / G
// with v small integers. Two forms:
//   - 4-bit (GGUF Q4_K, G = 32): v in 0..15, two groups per 32 bytes, the first group in the low nibbles and the
//     second in the high ones, exactly as Q4_K stores its quants; scale = d * sc and minimum = dmin * m, float32.
//   - 8-bit (Q6_K with G = 16, Q5_0 and Q8_0 with G = 32): v an int8 (q - 32, q - 16, q), scale as above,
//     no minimum.
// Each group is dequantized in registers, in float32, bitwise as GGUF's own dequantization gives it, and
// multiplied by every row of x: the weights are read from memory once for all rows, their unpacking shared by
// all rows, so a few rows cost little more than one. Every output is summed in the same order whatever M is:
// a layer gives bitwise the same values for a verification over gamma tokens as for decoding them one by one.
// GCC vector extensions (GCC 12+ or clang): one source for AVX-512, AVX2 or anything else the compiler targets.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kLanes = 16;
constexpr int kPrefetchBytes = 512;
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint8_t bytes16 __attribute__((vector_size(16)));
typedef int8_t sbytes16 __attribute__((vector_size(16)));
typedef uint32_t u32vec __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}

// Keeps the compiler from fusing a multiply and the subtraction after it into one rounding: the weights are
// then bitwise GGUF's (scale * v, rounded, minus the minimum, rounded).
inline vec rounded(vec v) {
#if defined(__x86_64__)
  asm("" : "+v"(v));
#endif
  return v;
}

inline float hsum(vec v) {  // a fixed pairwise order: lane l plus lane l + 8, then + 4, + 2, + 1
  float a[kLanes];
  std::memcpy(a, &v, sizeof(a));
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) a[i] += a[i + w];
  return a[0];
}

// 4-bit: 32 bytes hold groups 2p (low nibbles) and 2p + 1 (high nibbles), 32 values each, in order.
struct FourBit {
  static constexpr int kGroup = 32;
  static constexpr int kStep = 64;      // values per step: two groups
  static constexpr int kStepBytes = 32;
  static constexpr int kVecs = 4;       // float vectors per step
  static constexpr bool kMinimum = true;
  static void unpack(const uint8_t* p, vec* w) {
    for (int h = 0; h < 2; ++h) {
      bytes16 b;
      std::memcpy(&b, p + 16 * h, 16);
      const u32vec wide = __builtin_convertvector(b, u32vec);
      w[h] = __builtin_convertvector(wide & 15u, vec);      // group 2p, values 16h .. 16h + 15
      w[2 + h] = __builtin_convertvector(wide >> 4, vec);   // group 2p + 1, the same positions
    }
  }
};

// 8-bit, groups of G (16 or 32) int8 values in order; a step is one group.
template <int G>
struct EightBit {
  static constexpr int kGroup = G;
  static constexpr int kStep = G;
  static constexpr int kStepBytes = G;
  static constexpr int kVecs = G / kLanes;
  static constexpr bool kMinimum = false;
  static void unpack(const uint8_t* p, vec* w) {
    for (int h = 0; h < kVecs; ++h) {
      sbytes16 b;
      std::memcpy(&b, p + 16 * h, 16);
      w[h] = __builtin_convertvector(b, vec);
    }
  }
};

struct Layer {
  const float* x;        // [M, K]
  const uint8_t* q;      // [N, K * bits / 8]
  const float* scale;    // [N, K / G]
  const float* minimum;  // [N, K / G] or null
  float* out;            // [M, N]
  int64_t M, N, K;
};

// NB weight rows n0 .. n0 + NB against rows m0 .. m0 + M of x (M at most 8). Each group's weights are made
// once per block, in float32, exactly as GGUF dequantizes them (scale * v - minimum), and every row of x is
// multiplied by them: per row, the work of a float32 kernel; the weight's bytes, a quarter or a half of it.
template <class F, int M, int NB>
void block(const Layer& L, int64_t n0, int64_t m0) {
  constexpr int kGroupsPerStep = F::kStep / F::kGroup;
  constexpr int kVecsPerGroup = F::kGroup / kLanes;
  const int64_t K = L.K, groups = K / F::kGroup, row_bytes = K / F::kStep * F::kStepBytes;
  vec acc[NB * M];
  for (int i = 0; i < NB * M; ++i) acc[i] = vec{};
  const float* x = L.x + m0 * K;
  for (int64_t s = 0; s < K / F::kStep; ++s) {
    vec w[NB][F::kVecs];
    for (int j = 0; j < NB; ++j) {
      const uint8_t* p = L.q + (n0 + j) * row_bytes + s * F::kStepBytes;
      __builtin_prefetch(p + kPrefetchBytes);
      F::unpack(p, w[j]);
      const int64_t g0 = (n0 + j) * groups + s * kGroupsPerStep;
      for (int g = 0; g < kGroupsPerStep; ++g)
        for (int h = 0; h < kVecsPerGroup; ++h) {
          vec& v = w[j][g * kVecsPerGroup + h];
          v = rounded(L.scale[g0 + g] * v);
          if (F::kMinimum) v -= L.minimum[g0 + g];
        }
    }
    for (int m = 0; m < M; ++m) {
      const float* xs = x + m * K + s * F::kStep;
      for (int i = 0; i < F::kVecs; ++i) {
        const vec xv = load(xs + i * kLanes);
        for (int j = 0; j < NB; ++j) acc[j * M + m] += xv * w[j][i];
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < M; ++m) L.out[(m0 + m) * L.N + n0 + j] = hsum(acc[j * M + m]);
}

template <class F, int NB>
void chunk(const Layer& L, int64_t n0, int64_t m0, int64_t C) {
  switch (C) {
    case 1: block<F, 1, NB>(L, n0, m0); break;
    case 2: block<F, 2, NB>(L, n0, m0); break;
    case 3: block<F, 3, NB>(L, n0, m0); break;
    case 4: block<F, 4, NB>(L, n0, m0); break;
    case 5: block<F, 5, NB>(L, n0, m0); break;
    case 6: block<F, 6, NB>(L, n0, m0); break;
    case 7: block<F, 7, NB>(L, n0, m0); break;
    default: block<F, 8, NB>(L, n0, m0); break;
  }
}

// All M rows against NB weight rows at a time, in equal chunks of at most 8 rows: the first chunk streams the
// block's weight rows from memory, the next find them in cache.
template <class F, int NB>
void rows(const Layer& L) {
  const int64_t blocks = L.N / NB;
  const int64_t chunks = (L.M + 7) / 8;
  const int64_t size = (L.M + chunks - 1) / chunks;
  auto all_chunks = [&](int64_t n0, auto nb) {
    constexpr int B = decltype(nb)::value;
    for (int64_t m0 = 0; m0 < L.M; m0 += size) chunk<F, B>(L, n0, m0, std::min<int64_t>(size, L.M - m0));
  };
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) all_chunks(b * NB, std::integral_constant<int, NB>{});
  });
  for (int64_t n = blocks * NB; n < L.N; ++n) all_chunks(n, std::integral_constant<int, 1>{});
}

template <class F>
void dispatch(const Layer& L) {
  if (L.M <= 2) rows<F, 4>(L); else rows<F, 2>(L);
}

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& minimum, int64_t bits, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_cpu() && x.is_contiguous(),
              "grouped_linear: x must be a contiguous 2-D float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK((bits == 4 && group == 32) || (bits == 8 && (group == 16 || group == 32)),
              "grouped_linear: 4-bit groups of 32, or 8-bit groups of 16 or 32");
  TORCH_CHECK(K % (bits == 4 ? 64 : group) == 0, "grouped_linear: K = ", K, " is not a whole number of steps");
  TORCH_CHECK(q.dim() == 2 && q.size(1) == K * bits / 8 && q.is_contiguous() && q.is_cpu() &&
              (q.scalar_type() == at::kByte || q.scalar_type() == at::kChar), "grouped_linear: q must be [N, ",
              K * bits / 8, "] bytes, got ", q.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N * (K / group),
              "grouped_linear: scale must be [N, K / group] float32");
  const bool has_minimum = minimum.has_value() && minimum->defined();
  TORCH_CHECK(has_minimum == (bits == 4), "grouped_linear: the 4-bit form has minimums, the 8-bit one none");
  Layer L{x.data_ptr<float>(), reinterpret_cast<const uint8_t*>(q.data_ptr()), scale.data_ptr<float>(),
          nullptr, nullptr, M, N, K};
  if (has_minimum) {
    TORCH_CHECK(minimum->scalar_type() == at::kFloat && minimum->is_contiguous() && minimum->numel() == N * (K / group),
                "grouped_linear: minimum must be [N, K / group] float32");
    L.minimum = minimum->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  L.out = out.data_ptr<float>();
  if (bits == 4) dispatch<FourBit>(L);
  else if (group == 16) dispatch<EightBit<16>>(L);
  else dispatch<EightBit<32>>(L);
  return out;
}

}  // namespace

TORCH_LIBRARY(specdec_grouped, m) {
  m.def("grouped_linear(Tensor x, Tensor q, Tensor scale, Tensor? minimum, int bits, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec_grouped, CPU, m) {
  m.impl("grouped_linear", grouped_linear);
}
