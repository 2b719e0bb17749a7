// A linear layer over weights as GGUF ships them, for a few float32 input rows (verification: gamma + 1 tokens,
// up to 16) on CPU: out[m, n] = sum_k x[m, k] * w[n, k], where w is never materialised in float.
//
// The weight is held in groups of G consecutive values along K, each group a scale and (4-bit form) a minimum:
//   w[n, k] = scale[n, g] * v[n, k] - minimum[n, g],   g = k / G
// with v small integers, exactly the GGUF's: 4-bit v in 0..15 (Q4_K, G = 32); 6-bit v in -32..31 (Q6_K, G = 16);
// 5-bit v in -16..15 (Q5_0, G = 32); 8-bit v in -128..127 (Q8_0, G = 32). Each is held in its own number of bits.
//
// Integer dot products, as llama.cpp computes these types: each row of x is quantized per group of G to int8,
//   x[m, k] ~ dx[m, g] * xq[m, k],   dx = max |x| / 127 over the group,  xq = round(x / dx)
// and then, per group, an exact integer sum times two float scales:
//   out[m, n] = sum_g  scale[n, g] * dx[m, g] * (sum_k v[n, k] * xq[m, k])  -  minimum[n, g] * (sum_k x[m, k])
// The minimum's term takes the float sum of x itself. The weights are exactly the GGUF's; the activations' int8
// rounding is the one approximation (bench/README.md gives its effect on the logits).
//
// Scales and minimums come in the smallest form that holds them exactly (grouped.py's `tiled` checks it): float32;
// float16 (Q5_0 and Q8_0 ship their scales so); or a small integer per group times a float32 unit per 256 values
// (Q4_K's d * sc and dmin * m, Q6_K's d * scale), multiplied back here in float32, bitwise the same product.
//
// Layout: 16 weight rows (a tile) interleaved 4 bytes at a time, so that one 512-bit load gives 16 output rows'
// next 4 bytes and one VNNI instruction (vpdpbusd: unsigned bytes times signed bytes, summed in fours into int32)
// adds 4 products to each of 16 outputs; x's 4 bytes are broadcast. The 4-bit form keeps GGUF's nibble order
// (32 bytes: group 2p in the low nibbles, group 2p + 1 in the high ones); the 8-bit form is stored as v + 128
// (unsigned), and 128 * sum(xq) is taken off each group's sum. The 5- and 6-bit forms store u = v + 2^(bits - 1)
// in two planes per 64 values of K (16 chunks of 4): 8 loads of low nibbles (chunks 2i and 2i + 1 in load i's low
// and high nibbles), then the top bits (6-bit: 4 loads, chunks 4h .. 4h + 3 two bits each; 5-bit: 2 loads, chunks
// 8h .. 8h + 7 one bit each); a chunk's bytes are rebuilt as low | top << 4, and 2^(bits - 1) * sum(xq) is taken off
// each group's sum. Their integer sums are those of the 8-bit form, so they give its bits. Each tile's weights are
// read once for up to 8 rows of x (16 by AMX tiles where the CPU has them: below), so a few rows cost little more
// than one, and every output is computed in the same order whatever the number of rows: a row's result is bitwise
// the same alone or with others. Without AVX-512 VNNI, AVX2 computes the same
// integer sums 8 rows at a time (vpmaddubsw and vpmaddwd); without AVX2, lane by lane. Each path has the same
// integer sums and the same float operations in the same order, so the same bits (`isa()` says which was built).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define SPECDEC_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SPECDEC_AVX2 1
#endif

#if defined(SPECDEC_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#define SPECDEC_AMX 1
#endif

namespace {

constexpr int kTile = 16;      // weight rows interleaved: one 512-bit register of int32 sums
constexpr int kChunk = 64;     // bytes per load: 4 bytes of each of 16 rows
#ifdef SPECDEC_AVX2
constexpr int kMaxRows = 4;    // rows of x per pass over a tile (AVX2 has 16 registers)
#else
constexpr int kMaxRows = 8;    // rows of x per pass over a tile
#endif
constexpr int kAmxRows = 16;   // rows of x per pass over a tile with AMX: an A tile's

enum Form { kFloat, kHalf, kUnsigned, kSigned };

struct Scales {          // per group and row: [N / 16, K / G, 16]
  const void* values;    // float32, float16, or uint8 / int8 multiples of `unit`
  const float* unit;     // [N / 16, K / 256, 16] float32, for the integer forms
  Form form;
  int64_t groups, per_unit;  // groups per row, groups per unit

  float at(int64_t t, int64_t g, int r) const {  // one row's value, as `load` gives all 16
    const int64_t i = (t * groups + g) * 16 + r;
    switch (form) {
      case kFloat: return static_cast<const float*>(values)[i];
      case kHalf: return static_cast<float>(static_cast<const c10::Half*>(values)[i]);
      case kUnsigned: return unit[units(t, g) + r] * static_cast<float>(static_cast<const uint8_t*>(values)[i]);
      default: return unit[units(t, g) + r] * static_cast<float>(static_cast<const int8_t*>(values)[i]);
    }
  }
  int64_t units(int64_t t, int64_t g) const { return (t * (groups / per_unit) + g / per_unit) * 16; }  // tile t's, g's
};

struct Layer {
  const uint8_t* q;      // [N / 16, K * bits / 8 * 16], tiled
  Scales scale, minimum; // minimum: 4-bit only
  float* out;            // [M, N]
  int64_t M, N, K, G, bits;
  bool amx = false;      // several rows by tile instructions (SPECDEC_AMX builds only)
};

struct Rows {  // x quantized per group of G: xq [M, K], and per group dx, the sum of x and the sum of xq
  std::vector<int8_t> xq;
  std::vector<float> dx, sum;
  std::vector<int32_t> qsum;
};

Rows quantize(const float* x, int64_t M, int64_t K, int64_t G) {
  const int64_t groups = K / G;
  Rows r{std::vector<int8_t>(M * K), std::vector<float>(M * groups), std::vector<float>(M * groups),
         std::vector<int32_t>(M * groups)};
  for (int64_t i = 0; i < M * groups; ++i) {
    const float* v = x + i * G;
    float amax = 0.f, sum = 0.f;
    for (int64_t k = 0; k < G; ++k) {
      amax = std::max(amax, std::fabs(v[k]));
      sum += v[k];
    }
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    int32_t qsum = 0;
    for (int64_t k = 0; k < G; ++k) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(v[k] * inverse));
      r.xq[i * G + k] = static_cast<int8_t>(std::clamp(q, -127, 127));
      qsum += r.xq[i * G + k];
    }
    r.dx[i] = amax / 127.f;
    r.sum[i] = sum;
    r.qsum[i] = qsum;
  }
  return r;
}

inline int32_t word(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#ifdef SPECDEC_VNNI

// Tile t's 16 values for group g.
inline __m512 load(const Scales& S, int64_t t, int64_t g) {
  const int64_t i = (t * S.groups + g) * 16;
  switch (S.form) {
    case kFloat: return _mm512_loadu_ps(static_cast<const float*>(S.values) + i);
    case kHalf:
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(S.values) + i)));
    default: {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(S.values) + i));
      const __m512i wide = S.form == kUnsigned ? _mm512_cvtepu8_epi32(bytes) : _mm512_cvtepi8_epi32(bytes);
      const __m512 unit = _mm512_loadu_ps(S.unit + S.units(t, g));
      return _mm512_mul_ps(unit, _mm512_cvtepi32_ps(wide));
    }
  }
}

// Rows m0 .. m0 + M of x against tile t.
template <int M>
void four_bit(const Layer& L, const Rows& X, int64_t t, int64_t m0) {
  const int64_t K = L.K, groups = K / 32;
  const uint8_t* q = L.q + t * (K / 2) * kTile;
  const __m512i nibble = _mm512_set1_epi8(15);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t s = 0; s < K / 64; ++s) {  // two groups: 512 bytes of the tile
    const uint8_t* qs = q + s * 8 * kChunk;
    _mm_prefetch(reinterpret_cast<const char*>(qs + 16 * kChunk), _MM_HINT_T0);
    __m512i low[M], high[M];
    for (int m = 0; m < M; ++m) low[m] = high[m] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      const __m512i w = _mm512_loadu_si512(qs + c * kChunk);
      const __m512i lo = _mm512_and_si512(w, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
      for (int m = 0; m < M; ++m) {
        const int8_t* xs = X.xq.data() + (m0 + m) * K + s * 64 + 4 * c;
        low[m] = _mm512_dpbusd_epi32(low[m], lo, _mm512_set1_epi32(word(xs)));
        high[m] = _mm512_dpbusd_epi32(high[m], hi, _mm512_set1_epi32(word(xs + 32)));
      }
    }
    const __m512 s0 = load(L.scale, t, 2 * s), s1 = load(L.scale, t, 2 * s + 1);
    const __m512 n0 = load(L.minimum, t, 2 * s), n1 = load(L.minimum, t, 2 * s + 1);
    for (int m = 0; m < M; ++m) {
      const int64_t g = (m0 + m) * groups + 2 * s;
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low[m]), _mm512_mul_ps(s0, _mm512_set1_ps(X.dx[g])), acc[m]);
      acc[m] = _mm512_fnmadd_ps(n0, _mm512_set1_ps(X.sum[g]), acc[m]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high[m]), _mm512_mul_ps(s1, _mm512_set1_ps(X.dx[g + 1])), acc[m]);
      acc[m] = _mm512_fnmadd_ps(n1, _mm512_set1_ps(X.sum[g + 1]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(L.out + (m0 + m) * L.N + t * kTile, acc[m]);
}

template <int M>
void eight_bit(const Layer& L, const Rows& X, int64_t t, int64_t m0) {
  const int64_t K = L.K, G = L.G, groups = K / G, chunks = G / 4;
  const uint8_t* q = L.q + t * K * kTile;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* qg = q + g * chunks * kChunk;
    _mm_prefetch(reinterpret_cast<const char*>(qg + 16 * kChunk), _MM_HINT_T0);
    __m512i sum[M];
    for (int m = 0; m < M; ++m) sum[m] = _mm512_setzero_si512();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512i w = _mm512_loadu_si512(qg + c * kChunk);
      for (int m = 0; m < M; ++m)
        sum[m] = _mm512_dpbusd_epi32(sum[m], w, _mm512_set1_epi32(word(X.xq.data() + (m0 + m) * K + g * G + 4 * c)));
    }
    const __m512 s = load(L.scale, t, g);
    for (int m = 0; m < M; ++m) {
      const int64_t i = (m0 + m) * groups + g;
      const __m512i exact = _mm512_sub_epi32(sum[m], _mm512_set1_epi32(128 * X.qsum[i]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(s, _mm512_set1_ps(X.dx[i])), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(L.out + (m0 + m) * L.N + t * kTile, acc[m]);
}

// 5- or 6-bit values (B): chunk C (of 16 per 64 values of K) rebuilt from the two planes as 16 x 4 unsigned
// bytes, low nibble and top bits, every shift a constant; then its products added as `eight_bit` adds them.
template <int B, int C>
inline __m512i rebuild(const uint8_t* qs) {
  constexpr int kPerLoad = 8 / (B - 4), kAt = (B - 4) * (C % kPerLoad);  // where C's top bits sit in their byte
  __m512i low = _mm512_loadu_si512(qs + (C >> 1) * kChunk);
  if constexpr ((C & 1) != 0) low = _mm512_srli_epi16(low, 4);
  __m512i high = _mm512_loadu_si512(qs + 8 * kChunk + (C / kPerLoad) * kChunk);
  if constexpr (kAt < 4) high = _mm512_slli_epi16(high, 4 - kAt);
  if constexpr (kAt > 4) high = _mm512_srli_epi16(high, kAt - 4);
  // bits 0-3 from low, 4-7 from high (0xE4: the third operand selects the first), then the value's B bits alone
  return _mm512_and_si512(_mm512_ternarylogic_epi32(low, high, _mm512_set1_epi8(15), 0xE4),
                          _mm512_set1_epi8(static_cast<char>((1 << B) - 1)));
}

template <int M, int B, int C>
inline void add_chunk(const uint8_t* qs, const int8_t* const* xs, __m512i* sum) {
  const __m512i w = rebuild<B, C>(qs);
  for (int m = 0; m < M; ++m) sum[m] = _mm512_dpbusd_epi32(sum[m], w, _mm512_set1_epi32(word(xs[m] + 4 * C)));
}

template <int M, int B, int First, int... I>
inline void add_chunks(const uint8_t* qs, const int8_t* const* xs, __m512i* sum, std::integer_sequence<int, I...>) {
  (add_chunk<M, B, First + I>(qs, xs, sum), ...);
}

template <int M, int B, int G>
void low_bit(const Layer& L, const Rows& X, int64_t t, int64_t m0) {
  constexpr int kOffset = 1 << (B - 1), kGroups = 64 / G;  // u - v; groups per 64 values of K
  const int64_t K = L.K, groups = K / G;
  const uint8_t* q = L.q + t * (K * B / 8) * kTile;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t s = 0; s < K / 64; ++s) {
    const uint8_t* qs = q + s * 128 * B;
    _mm_prefetch(reinterpret_cast<const char*>(qs + 256 * B), _MM_HINT_T0);
    const int8_t* xs[M];
    for (int m = 0; m < M; ++m) xs[m] = X.xq.data() + (m0 + m) * K + s * 64;
    for (int gi = 0; gi < kGroups; ++gi) {
      __m512i sum[M];
      for (int m = 0; m < M; ++m) sum[m] = _mm512_setzero_si512();
      if (gi == 0) add_chunks<M, B, 0>(qs, xs, sum, std::make_integer_sequence<int, G / 4>{});
      else if (gi == 1) add_chunks<M, B, G / 4>(qs, xs, sum, std::make_integer_sequence<int, G / 4>{});
      else if (gi == 2) add_chunks<M, B, (2 * G / 4) % 16>(qs, xs, sum, std::make_integer_sequence<int, G / 4>{});
      else add_chunks<M, B, (3 * G / 4) % 16>(qs, xs, sum, std::make_integer_sequence<int, G / 4>{});
      const int64_t g = s * kGroups + gi;
      const __m512 sc = load(L.scale, t, g);
      for (int m = 0; m < M; ++m) {
        const int64_t i = (m0 + m) * groups + g;
        const __m512i exact = _mm512_sub_epi32(sum[m], _mm512_set1_epi32(kOffset * X.qsum[i]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(sc, _mm512_set1_ps(X.dx[i])), acc[m]);
      }
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(L.out + (m0 + m) * L.N + t * kTile, acc[m]);
}

#ifdef SPECDEC_AMX

// Several rows with AMX (Sapphire Rapids and later): the same integer sums, by tile instructions. A group's weights
// in the VNNI layout above (G / 4 chunks of 16 rows x 4 bytes) are exactly an AMX B tile of G / 4 rows of 64 bytes,
// and the group's bytes of x for M rows an A tile of M rows of G bytes; tdpbsud (signed x times unsigned weights)
// gives the M x 16 int32 sums that M rows of vpdpbusd give, in one instruction whatever M. The sums are stored and
// the float epilogue is the VNNI path's, operation for operation, so a row's bits do not depend on the path either.
// Tiles: 0 and 1 sums, 2 and 3 x, 4 and 5 weights (two groups in flight).

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles(int rows, int group) {
  TileConfig c;
  for (int i = 0; i < 2; ++i) {
    c.rows[i] = static_cast<uint8_t>(rows), c.colsb[i] = 64;                          // sums: rows x 16 int32
    c.rows[2 + i] = static_cast<uint8_t>(rows), c.colsb[2 + i] = static_cast<uint16_t>(group);  // x: rows x G
    c.rows[4 + i] = static_cast<uint8_t>(group / 4), c.colsb[4 + i] = 64;             // weights: G / 4 x 64
  }
  _tile_loadconfig(&c);
}

// A group's sums into sums by tiles c (sums), a (x at xs, rows of stride K) and b (weights at w, G / 4 chunks of
// 64 bytes); the tile numbers are literals (GCC writes them into the instruction's text).
#define SPECDEC_GROUP_SUMS(c, a, b, xs, K, w, sums) \
  do {                                              \
    _tile_zero(c);                                  \
    _tile_loadd(a, xs, K);                          \
    _tile_loadd(b, w, kChunk);                      \
    _tile_dpbsud(c, a, b);                          \
    _tile_stored(c, sums, 64);                      \
  } while (0)

template <int M>
void four_bit_amx(const Layer& L, const Rows& X, int64_t t, int64_t m0) {
  const int64_t K = L.K, groups = K / 32;
  const uint8_t* q = L.q + t * (K / 2) * kTile;
  const __m512i nibble = _mm512_set1_epi8(15);
  alignas(64) uint8_t w[2][8 * kChunk];
  alignas(64) int32_t sums[2][M * 16];
  const int8_t* x = X.xq.data() + m0 * K;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t s = 0; s < K / 64; ++s) {
    const uint8_t* qs = q + s * 8 * kChunk;
    _mm_prefetch(reinterpret_cast<const char*>(qs + 16 * kChunk), _MM_HINT_T0);
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_loadu_si512(qs + c * kChunk);
      _mm512_store_si512(w[0] + c * kChunk, _mm512_and_si512(v, nibble));
      _mm512_store_si512(w[1] + c * kChunk, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
    }
    SPECDEC_GROUP_SUMS(0, 2, 4, x + s * 64, K, w[0], sums[0]);
    SPECDEC_GROUP_SUMS(1, 3, 5, x + s * 64 + 32, K, w[1], sums[1]);
    const __m512 s0 = load(L.scale, t, 2 * s), s1 = load(L.scale, t, 2 * s + 1);
    const __m512 n0 = load(L.minimum, t, 2 * s), n1 = load(L.minimum, t, 2 * s + 1);
    for (int m = 0; m < M; ++m) {
      const int64_t g = (m0 + m) * groups + 2 * s;
      const __m512i low = _mm512_load_si512(sums[0] + 16 * m), high = _mm512_load_si512(sums[1] + 16 * m);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), _mm512_mul_ps(s0, _mm512_set1_ps(X.dx[g])), acc[m]);
      acc[m] = _mm512_fnmadd_ps(n0, _mm512_set1_ps(X.sum[g]), acc[m]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), _mm512_mul_ps(s1, _mm512_set1_ps(X.dx[g + 1])), acc[m]);
      acc[m] = _mm512_fnmadd_ps(n1, _mm512_set1_ps(X.sum[g + 1]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(L.out + (m0 + m) * L.N + t * kTile, acc[m]);
}

// The epilogue of one group g for M rows, from its sums less offset * sum(xq): `eight_bit`'s and `low_bit`'s.
template <int M>
inline void add_group(const Layer& L, const Rows& X, int64_t t, int64_t m0, int64_t g, int offset,
                      const int32_t* sums, __m512* acc) {
  const int64_t groups = L.K / L.G;
  const __m512 sc = load(L.scale, t, g);
  for (int m = 0; m < M; ++m) {
    const int64_t i = (m0 + m) * groups + g;
    const __m512i exact = _mm512_sub_epi32(_mm512_load_si512(sums + 16 * m), _mm512_set1_epi32(offset * X.qsum[i]));
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(sc, _mm512_set1_ps(X.dx[i])), acc[m]);
  }
}

template <int M>
void eight_bit_amx(const Layer& L, const Rows& X, int64_t t, int64_t m0) {
  const int64_t K = L.K, G = L.G, groups = K / G, chunks = G / 4;
  const uint8_t* q = L.q + t * K * kTile;
  const int8_t* x = X.xq.data() + m0 * K;
  alignas(64) int32_t sums[2][M * 16];
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g + 1 < groups; g += 2) {  // the weights are a B tile as they lie
    const uint8_t* qg = q + g * chunks * kChunk;
    _mm_prefetch(reinterpret_cast<const char*>(qg + 2 * chunks * kChunk), _MM_HINT_T0);
    SPECDEC_GROUP_SUMS(0, 2, 4, x + g * G, K, qg, sums[0]);
    SPECDEC_GROUP_SUMS(1, 3, 5, x + (g + 1) * G, K, qg + chunks * kChunk, sums[1]);
    add_group<M>(L, X, t, m0, g, 128, sums[0], acc);
    add_group<M>(L, X, t, m0, g + 1, 128, sums[1], acc);
  }
  if (groups % 2 != 0) {
    SPECDEC_GROUP_SUMS(0, 2, 4, x + (groups - 1) * G, K, q + (groups - 1) * chunks * kChunk, sums[0]);
    add_group<M>(L, X, t, m0, groups - 1, 128, sums[0], acc);
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(L.out + (m0 + m) * L.N + t * kTile, acc[m]);
}

template <int B, int First, int... I>
inline void rebuild_chunks(const uint8_t* qs, uint8_t* w, std::integer_sequence<int, I...>) {
  ((_mm512_store_si512(w + (First + I) * kChunk, rebuild<B, First + I>(qs))), ...);
}

template <int M, int B, int G>
void low_bit_amx(const Layer& L, const Rows& X, int64_t t, int64_t m0) {
  constexpr int kOffset = 1 << (B - 1), kGroups = 64 / G;
  const int64_t K = L.K;
  const uint8_t* q = L.q + t * (K * B / 8) * kTile;
  const int8_t* x = X.xq.data() + m0 * K;
  alignas(64) uint8_t w[16 * kChunk];  // the 16 chunks of 64 values of K, rebuilt as bytes
  alignas(64) int32_t sums[2][M * 16];
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t s = 0; s < K / 64; ++s) {
    const uint8_t* qs = q + s * 128 * B;
    _mm_prefetch(reinterpret_cast<const char*>(qs + 256 * B), _MM_HINT_T0);
    rebuild_chunks<B, 0>(qs, w, std::make_integer_sequence<int, 16>{});
    for (int gi = 0; gi < kGroups; gi += 2) {
      SPECDEC_GROUP_SUMS(0, 2, 4, x + s * 64 + gi * G, K, w + gi * (G / 4) * kChunk, sums[0]);
      SPECDEC_GROUP_SUMS(1, 3, 5, x + s * 64 + (gi + 1) * G, K, w + (gi + 1) * (G / 4) * kChunk, sums[1]);
      add_group<M>(L, X, t, m0, s * kGroups + gi, kOffset, sums[0], acc);
      add_group<M>(L, X, t, m0, s * kGroups + gi + 1, kOffset, sums[1], acc);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(L.out + (m0 + m) * L.N + t * kTile, acc[m]);
}

#undef SPECDEC_GROUP_SUMS

std::atomic<bool> amx_enabled{true};  // amx(False) turns it off, for benchmarks against the VNNI path

bool amx_usable() {  // the build has it and Linux lets this process use the tile registers (asked once)
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

#endif  // SPECDEC_AMX

#elif defined(SPECDEC_AVX2)

// AVX2 without VNNI: the same tiles, as two halves of 8 rows (a 256-bit register of int32 sums each). vpmaddubsw
// multiplies unsigned by signed bytes into 16-bit sums of pairs, which hold every pair of 4-, 5- and 6-bit values
// times x (at most 2 * 63 * 127); vpmaddwd by ones adds the pairs into int32: the four products VNNI adds. The
// 8-bit form's v + 128 would overflow 16 bits, so it multiplies |v| by x with v's sign: the sum of v * x itself,
// which is VNNI's sum less 128 * sum(xq). Integer sums and float operations are VNNI's, so the bits are too.

inline __m256i dot4(__m256i acc, __m256i w, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}

inline __m256i bytes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Rows 8h .. 8h + 7 of tile t's values for group g.
inline __m256 load(const Scales& S, int64_t t, int64_t g, int h) {
  const int64_t i = (t * S.groups + g) * 16 + 8 * h;
  switch (S.form) {
    case kFloat: return _mm256_loadu_ps(static_cast<const float*>(S.values) + i);
    case kHalf:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(S.values) + i)));
    default: {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(S.values) + i));
      const __m256i wide = S.form == kUnsigned ? _mm256_cvtepu8_epi32(b) : _mm256_cvtepi8_epi32(b);
      return _mm256_mul_ps(_mm256_loadu_ps(S.unit + S.units(t, g) + 8 * h), _mm256_cvtepi32_ps(wide));
    }
  }
}

template <int M>
void four_bit(const Layer& L, const Rows& X, int64_t t, int64_t m0) {
  const int64_t K = L.K, groups = K / 32;
  const uint8_t* q = L.q + t * (K / 2) * kTile;
  const __m256i nibble = _mm256_set1_epi8(15);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t s = 0; s < K / 64; ++s) {
      const uint8_t* qs = q + s * 8 * kChunk + 32 * h;
      __m256i low[M], high[M];
      for (int m = 0; m < M; ++m) low[m] = high[m] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i w = bytes(qs + c * kChunk);
        const __m256i lo = _mm256_and_si256(w, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
        for (int m = 0; m < M; ++m) {
          const int8_t* xs = X.xq.data() + (m0 + m) * K + s * 64 + 4 * c;
          low[m] = dot4(low[m], lo, _mm256_set1_epi32(word(xs)));
          high[m] = dot4(high[m], hi, _mm256_set1_epi32(word(xs + 32)));
        }
      }
      const __m256 s0 = load(L.scale, t, 2 * s, h), s1 = load(L.scale, t, 2 * s + 1, h);
      const __m256 n0 = load(L.minimum, t, 2 * s, h), n1 = load(L.minimum, t, 2 * s + 1, h);
      for (int m = 0; m < M; ++m) {
        const int64_t g = (m0 + m) * groups + 2 * s;
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low[m]), _mm256_mul_ps(s0, _mm256_set1_ps(X.dx[g])), acc[m]);
        acc[m] = _mm256_fnmadd_ps(n0, _mm256_set1_ps(X.sum[g]), acc[m]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(high[m]), _mm256_mul_ps(s1, _mm256_set1_ps(X.dx[g + 1])), acc[m]);
        acc[m] = _mm256_fnmadd_ps(n1, _mm256_set1_ps(X.sum[g + 1]), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) _mm256_storeu_ps(L.out + (m0 + m) * L.N + t * kTile + 8 * h, acc[m]);
  }
}

template <int M>
void eight_bit(const Layer& L, const Rows& X, int64_t t, int64_t m0) {
  const int64_t K = L.K, G = L.G, groups = K / G, chunks = G / 4;
  const uint8_t* q = L.q + t * K * kTile;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int h = 0; h < 2; ++h) {
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* qg = q + g * chunks * kChunk + 32 * h;
      __m256i sum[M];
      for (int m = 0; m < M; ++m) sum[m] = _mm256_setzero_si256();
      for (int64_t c = 0; c < chunks; ++c) {
        const __m256i v = _mm256_xor_si256(bytes(qg + c * kChunk), flip);  // v itself, signed
        const __m256i magnitude = _mm256_abs_epi8(v);
        for (int m = 0; m < M; ++m) {
          const __m256i x = _mm256_set1_epi32(word(X.xq.data() + (m0 + m) * K + g * G + 4 * c));
          sum[m] = dot4(sum[m], magnitude, _mm256_sign_epi8(x, v));
        }
      }
      const __m256 sc = load(L.scale, t, g, h);
      for (int m = 0; m < M; ++m) {
        const int64_t i = (m0 + m) * groups + g;
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m]), _mm256_mul_ps(sc, _mm256_set1_ps(X.dx[i])), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) _mm256_storeu_ps(L.out + (m0 + m) * L.N + t * kTile + 8 * h, acc[m]);
  }
}

template <int M, int B, int C>
inline void add_chunk(const uint8_t* qs, const int8_t* const* xs, __m256i* sum) {
  constexpr int kPerLoad = 8 / (B - 4), kAt = (B - 4) * (C % kPerLoad);
  __m256i low = bytes(qs + (C >> 1) * kChunk);
  if constexpr ((C & 1) != 0) low = _mm256_srli_epi16(low, 4);
  __m256i high = bytes(qs + 8 * kChunk + (C / kPerLoad) * kChunk);
  if constexpr (kAt < 4) high = _mm256_slli_epi16(high, 4 - kAt);
  if constexpr (kAt > 4) high = _mm256_srli_epi16(high, kAt - 4);
  const __m256i w = _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi8(15)),
                                    _mm256_and_si256(high, _mm256_set1_epi8(static_cast<char>(((1 << B) - 1) & 0xF0))));
  for (int m = 0; m < M; ++m) sum[m] = dot4(sum[m], w, _mm256_set1_epi32(word(xs[m] + 4 * C)));
}

template <int M, int B, int First, int... I>
inline void add_chunks(const uint8_t* qs, const int8_t* const* xs, __m256i* sum, std::integer_sequence<int, I...>) {
  (add_chunk<M, B, First + I>(qs, xs, sum), ...);
}

template <int M, int B, int G>
void low_bit(const Layer& L, const Rows& X, int64_t t, int64_t m0) {
  constexpr int kOffset = 1 << (B - 1), kGroups = 64 / G;
  const int64_t K = L.K, groups = K / G;
  const uint8_t* q = L.q + t * (K * B / 8) * kTile;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t s = 0; s < K / 64; ++s) {
      const uint8_t* qs = q + s * 128 * B + 32 * h;
      const int8_t* xs[M];
      for (int m = 0; m < M; ++m) xs[m] = X.xq.data() + (m0 + m) * K + s * 64;
      for (int gi = 0; gi < kGroups; ++gi) {
        __m256i sum[M];
        for (int m = 0; m < M; ++m) sum[m] = _mm256_setzero_si256();
        if (gi == 0) add_chunks<M, B, 0>(qs, xs, sum, std::make_integer_sequence<int, G / 4>{});
        else if (gi == 1) add_chunks<M, B, G / 4>(qs, xs, sum, std::make_integer_sequence<int, G / 4>{});
        else if (gi == 2) add_chunks<M, B, (2 * G / 4) % 16>(qs, xs, sum, std::make_integer_sequence<int, G / 4>{});
        else add_chunks<M, B, (3 * G / 4) % 16>(qs, xs, sum, std::make_integer_sequence<int, G / 4>{});
        const int64_t g = s * kGroups + gi;
        const __m256 sc = load(L.scale, t, g, h);
        for (int m = 0; m < M; ++m) {
          const int64_t i = (m0 + m) * groups + g;
          const __m256i exact = _mm256_sub_epi32(sum[m], _mm256_set1_epi32(kOffset * X.qsum[i]));
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(sc, _mm256_set1_ps(X.dx[i])), acc[m]);
        }
      }
    }
    for (int m = 0; m < M; ++m) _mm256_storeu_ps(L.out + (m0 + m) * L.N + t * kTile + 8 * h, acc[m]);
  }
}

#else

// Lane by lane: the same integer sums, the same float operations in the same order.
template <int M>
void four_bit(const Layer& L, const Rows& X, int64_t t, int64_t m0) {
  const int64_t K = L.K, groups = K / 32;
  const uint8_t* q = L.q + t * (K / 2) * kTile;
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kTile; ++r) {
      float acc = 0.f;
      for (int64_t s = 0; s < K / 64; ++s) {
        int32_t low = 0, high = 0;
        for (int c = 0; c < 8; ++c)
          for (int j = 0; j < 4; ++j) {
            const uint8_t b = q[s * 8 * kChunk + c * kChunk + 4 * r + j];
            const int8_t* xs = X.xq.data() + (m0 + m) * K + s * 64 + 4 * c + j;
            low += (b & 15) * xs[0];
            high += (b >> 4) * xs[32];
          }
        const int64_t g = (m0 + m) * groups + 2 * s;
        acc = std::fma(static_cast<float>(low), L.scale.at(t, 2 * s, r) * X.dx[g], acc);
        acc = std::fma(-L.minimum.at(t, 2 * s, r), X.sum[g], acc);
        acc = std::fma(static_cast<float>(high), L.scale.at(t, 2 * s + 1, r) * X.dx[g + 1], acc);
        acc = std::fma(-L.minimum.at(t, 2 * s + 1, r), X.sum[g + 1], acc);
      }
      L.out[(m0 + m) * L.N + t * kTile + r] = acc;
    }
}

template <int M>
void eight_bit(const Layer& L, const Rows& X, int64_t t, int64_t m0) {
  const int64_t K = L.K, G = L.G, groups = K / G, chunks = G / 4;
  const uint8_t* q = L.q + t * K * kTile;
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kTile; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t sum = 0;
        for (int64_t c = 0; c < chunks; ++c)
          for (int j = 0; j < 4; ++j)
            sum += q[(g * chunks + c) * kChunk + 4 * r + j] * X.xq[(m0 + m) * K + g * G + 4 * c + j];
        const int64_t i = (m0 + m) * groups + g;
        acc = std::fma(static_cast<float>(sum - 128 * X.qsum[i]), L.scale.at(t, g, r) * X.dx[i], acc);
      }
      L.out[(m0 + m) * L.N + t * kTile + r] = acc;
    }
}

template <int M, int B, int G>
void low_bit(const Layer& L, const Rows& X, int64_t t, int64_t m0) {
  constexpr int kPerLoad = 8 / (B - 4), kOffset = 1 << (B - 1);
  const int64_t K = L.K, groups = K / G;
  const uint8_t* q = L.q + t * (K * B / 8) * kTile;
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kTile; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t sum = 0;
        for (int64_t k = g * G; k < (g + 1) * G; ++k) {
          const int64_t s = k / 64, c = k % 64 / 4, j = k % 4;
          const uint8_t* qs = q + s * 128 * B;
          const int low = (qs[(c >> 1) * kChunk + 4 * r + j] >> (4 * (c & 1))) & 15;
          const int high = (qs[8 * kChunk + (c / kPerLoad) * kChunk + 4 * r + j] >> ((B - 4) * (c % kPerLoad))) &
                           ((1 << (B - 4)) - 1);
          sum += (low | high << 4) * X.xq[(m0 + m) * K + k];
        }
        const int64_t i = (m0 + m) * groups + g;
        acc = std::fma(static_cast<float>(sum - kOffset * X.qsum[i]), L.scale.at(t, g, r) * X.dx[i], acc);
      }
      L.out[(m0 + m) * L.N + t * kTile + r] = acc;
    }
}

#endif

template <int M>
void tile(const Layer& L, const Rows& X, int64_t t, int64_t m0) {
#ifdef SPECDEC_AMX
  if (L.amx) {
    switch (L.bits) {
      case 4: four_bit_amx<M>(L, X, t, m0); break;
      case 5: L.G == 16 ? low_bit_amx<M, 5, 16>(L, X, t, m0) : low_bit_amx<M, 5, 32>(L, X, t, m0); break;
      case 6: L.G == 16 ? low_bit_amx<M, 6, 16>(L, X, t, m0) : low_bit_amx<M, 6, 32>(L, X, t, m0); break;
      default: eight_bit_amx<M>(L, X, t, m0); break;
    }
    return;
  }
#endif
  if constexpr (M <= kMaxRows) {
    switch (L.bits) {
      case 4: four_bit<M>(L, X, t, m0); break;
      case 5: L.G == 16 ? low_bit<M, 5, 16>(L, X, t, m0) : low_bit<M, 5, 32>(L, X, t, m0); break;
      case 6: L.G == 16 ? low_bit<M, 6, 16>(L, X, t, m0) : low_bit<M, 6, 32>(L, X, t, m0); break;
      default: eight_bit<M>(L, X, t, m0); break;
    }
  }
}

void chunk(const Layer& L, const Rows& X, int64_t t, int64_t m0, int64_t rows) {
  switch (rows) {
    case 1: tile<1>(L, X, t, m0); break;
    case 2: tile<2>(L, X, t, m0); break;
    case 3: tile<3>(L, X, t, m0); break;
    case 4: tile<4>(L, X, t, m0); break;
    case 5: tile<5>(L, X, t, m0); break;
    case 6: tile<6>(L, X, t, m0); break;
    case 7: tile<7>(L, X, t, m0); break;
    case 8: tile<8>(L, X, t, m0); break;
#ifdef SPECDEC_AMX
    case 9: tile<9>(L, X, t, m0); break;
    case 10: tile<10>(L, X, t, m0); break;
    case 11: tile<11>(L, X, t, m0); break;
    case 12: tile<12>(L, X, t, m0); break;
    case 13: tile<13>(L, X, t, m0); break;
    case 14: tile<14>(L, X, t, m0); break;
    case 15: tile<15>(L, X, t, m0); break;
    default: tile<16>(L, X, t, m0); break;
#endif
  }
}

struct Passes {  // how M rows go over each tile: in passes of `size` rows (the last may be smaller), by AMX or not
  int64_t size;
  bool amx;
};

Passes passes(const Layer& L, int64_t M) {
#ifdef SPECDEC_AMX
  // AMX's fixed cost per group (tile loads, stores) pays from 5 rows of the 4-bit form and 8 of the others (an
  // Intel Xeon with AMX, 2 threads, the default pair's layers: bench/README.md, "AMX for verification")
  if (amx_enabled.load() && amx_usable() && M >= (L.bits == 4 ? 5 : 8)) {
    const int64_t chunks = (M + kAmxRows - 1) / kAmxRows;
    return {(M + chunks - 1) / chunks, true};
  }
#endif
  // all M rows in equal passes: the first streams the tile from memory, the next find it in cache
  const int64_t chunks = (M + kMaxRows - 1) / kMaxRows;
  return {(M + chunks - 1) / chunks, false};
}

Scales scales(const at::Tensor& values, const c10::optional<at::Tensor>& unit, int64_t N, int64_t K,
              int64_t group, const char* name) {
  const int64_t groups = K / group;
  TORCH_CHECK(values.is_contiguous() && values.numel() == N * groups, "grouped_linear: ", name,
              " must be [N / 16, K / group * 16]");
  Scales S{values.data_ptr(), nullptr, kFloat, groups, 256 / group};
  switch (values.scalar_type()) {
    case at::kFloat: S.form = kFloat; break;
    case at::kHalf: S.form = kHalf; break;
    case at::kByte: S.form = kUnsigned; break;
    case at::kChar: S.form = kSigned; break;
    default: TORCH_CHECK(false, "grouped_linear: ", name, " must be float32, float16, uint8 or int8");
  }
  const bool integer = S.form == kUnsigned || S.form == kSigned;
  TORCH_CHECK(integer == (unit.has_value() && unit->defined()), "grouped_linear: ", name,
              " takes a unit exactly when it is an integer form");
  if (integer) {
    TORCH_CHECK(K % 256 == 0 && unit->scalar_type() == at::kFloat && unit->is_contiguous() &&
                unit->numel() == N * (K / 256), "grouped_linear: ", name, "'s unit must be [N / 16, K / 256 * 16] float32");
    S.unit = unit->data_ptr<float>();
  }
  return S;
}

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& scale_unit, const c10::optional<at::Tensor>& minimum,
                          const c10::optional<at::Tensor>& minimum_unit, int64_t bits, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_cpu() && x.is_contiguous(),
              "grouped_linear: x must be a contiguous 2-D float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0) * kTile;
  TORCH_CHECK((bits == 4 && group == 32) || ((bits == 5 || bits == 6 || bits == 8) && (group == 16 || group == 32)),
              "grouped_linear: 4-bit groups of 32, or 5-, 6- or 8-bit groups of 16 or 32");
  TORCH_CHECK(K % (bits == 8 ? group : 64) == 0, "grouped_linear: K = ", K, " is not a whole number of steps");
  TORCH_CHECK(q.dim() == 2 && q.size(1) == K * bits / 8 * kTile && q.is_contiguous() && q.is_cpu() &&
              q.scalar_type() == at::kByte, "grouped_linear: q must be [N / 16, ", K * bits / 8 * kTile,
              "] bytes (tiled), got ", q.sizes());
  const bool has_minimum = minimum.has_value() && minimum->defined();
  TORCH_CHECK(has_minimum == (bits == 4), "grouped_linear: the 4-bit form has minimums, the others none");
  Layer L{q.data_ptr<uint8_t>(), scales(scale, scale_unit, N, K, group, "scale"), {}, nullptr, M, N, K, group, bits};
  if (has_minimum) L.minimum = scales(*minimum, minimum_unit, N, K, group, "minimum");
  at::Tensor out = at::empty({M, N}, x.options());
  L.out = out.data_ptr<float>();
  if (M == 0) return out;
  const Rows X = quantize(x.data_ptr<float>(), M, K, group);
  const auto [size, amx] = passes(L, M);
  L.amx = amx;
  at::parallel_for(0, N / kTile, 4, [&](int64_t t0, int64_t t1) {
#ifdef SPECDEC_AMX
    int configured = 0;  // the rows the tiles are configured for: the config is the thread's, other code sets it too
#endif
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m0 = 0; m0 < M; m0 += size) {
        const int64_t rows = std::min<int64_t>(size, M - m0);
#ifdef SPECDEC_AMX
        if (L.amx && rows != configured) configure_tiles(configured = static_cast<int>(rows), static_cast<int>(L.G));
#endif
        chunk(L, X, t, m0, rows);
      }
#ifdef SPECDEC_AMX
    if (configured != 0) _tile_release();
#endif
  });
  return out;
}

}  // namespace

bool vnni() {
#ifdef SPECDEC_VNNI
  return true;
#else
  return false;
#endif
}

bool amx(c10::optional<bool> enable) {  // whether several rows go by AMX tiles; `enable` turns that on or off
#ifdef SPECDEC_AMX
  if (enable.has_value()) amx_enabled.store(*enable);
  return amx_enabled.load() && amx_usable();
#else
  (void)enable;
  return false;
#endif
}

std::string isa() {
#if defined(SPECDEC_VNNI)
  return "avx512_vnni";
#elif defined(SPECDEC_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

TORCH_LIBRARY(specdec_grouped, m) {
  m.def("vnni() -> bool", &vnni);  // whether this build has the VNNI kernel
  m.def("isa() -> str", &isa);     // the instructions this build computes with: avx512_vnni, avx2 or scalar
  m.def("amx(bool? enable=None) -> bool", &amx);  // whether several rows go by AMX tiles (and turns it on or off)
  m.def("grouped_linear(Tensor x, Tensor q, Tensor scale, Tensor? scale_unit, Tensor? minimum, Tensor? minimum_unit, "
        "int bits, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec_grouped, CPU, m) {
  m.impl("grouped_linear", grouped_linear);
}
