// The CPU kernel of neuron_lmi::decode_attention (see decode_attention.py): one query per token
// against its cache row's keys and values, the query heads of a group sharing each K/V read.
//
// Query i reads cache row rows[i] and attends to positions [first, positions[i]] of it (first = 0,
// or the sliding window's start), so a short row reads only its own length, whatever the slice's.
// Queries may share a row (the tokens of a prompt chunk, each at its own position: causal by
// construction). Work items are (query, KV head) pairs, split over the ATen thread pool; each reads
// its K block once (scores for the G query heads), takes a softmax in fp32, then reads its V block
// once. With AVX-512 (the build uses -march=native) the dot products, the exponentials and the bf16
// conversions are vectorised by hand; elsewhere plain loops run (the compiler vectorises what it can).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <optional>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using neuron_lmi_math::exp_nonpositive;

// What one (query, KV head) item reads and writes; strides in elements.
template <typename T>
struct Item {
  const T* q;          // first query head of the group
  int64_t q_stride;    // between query heads
  const T* k;          // position 0 of this row and head
  const T* v;
  int64_t k_stride;    // between positions
  int64_t v_stride;
  T* out;              // first output head of the group
  int64_t out_stride;  // between output heads
  int64_t first, last; // attended positions: first..last inclusive
  const T* next_k;     // the first attended key of the item this thread runs next (or null)
  int64_t next_n;      // how many keys it attends
};

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// A prompt chunk's work item (the AVX-512 chunk path below): sizes the driver splits chunks by.
constexpr int kChunkKeys = 32;     // keys per block
constexpr int kChunkLanes = 96;    // lanes per item (before rounding up to whole tokens)

inline int64_t chunk_tokens_per_item(int64_t groups) { return std::max<int64_t>(1, kChunkLanes / groups); }
inline int64_t chunk_tiles(int64_t groups) { return (chunk_tokens_per_item(groups) * groups + 15) / 16; }

// Portable path: any head dim, any CPU. The ``omp simd`` loops let the compiler vectorise the sums
// (a float reduction is not reordered otherwise) and the exponentials.
template <typename T>
void attend_plain(const Item<T>& it, int64_t groups, int64_t dim, float scale, float* scratch) {
  const int64_t n = it.last - it.first + 1;
  float* qf = scratch;                 // [groups, dim]
  float* acc = qf + groups * dim;      // [groups, dim]
  float* scores = acc + groups * dim;  // [groups, n]
  float* row = scores + groups * n;    // [dim]
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = to_float(it.q[g * it.q_stride + d]) * scale;
  for (int64_t j = 0; j < n; ++j) {
    const T* key = it.k + (it.first + j) * it.k_stride;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) row[d] = to_float(key[d]);
    for (int64_t g = 0; g < groups; ++g) {
      const float* qg = qf + g * dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < dim; ++d) s += qg[d] * row[d];
      scores[g * n + j] = s;
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    float* sg = scores + g * n;
    const float top = *std::max_element(sg, sg + n);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < n; ++j) {
      sg[j] = exp_nonpositive(sg[j] - top);
      total += sg[j];
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
  }
  std::fill(acc, acc + groups * dim, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const T* value = it.v + (it.first + j) * it.v_stride;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) row[d] = to_float(value[d]);
    for (int64_t g = 0; g < groups; ++g) {
      const float w = scores[g * n + j];
      float* ag = acc + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) ag[d] += w * row[d];
    }
  }
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t d = 0; d < dim; ++d) it.out[g * it.out_stride + d] = static_cast<T>(acc[g * dim + d]);
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is fp32's top half: widen and shift
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {  // round to nearest even, as static_cast does
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i out = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(out, 16)));
}

// The four horizontal sums of a..d, as [sum a, sum b, sum c, sum d] (13 instructions, not 4 x 8).
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 lanes = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                     _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(lanes),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// 2^t for t <= 0: 2^n * 2^f with n = round(t), |f| <= 1/2, 2^f by a degree-6 polynomial in f ln 2
// (relative error about 2e-7); scalef applies 2^n and gives 0 far below the smallest float. The
// chunk path keeps its scores in base 2 (log2 e folded into the softmax scale, once per score);
// exp16 is exp(x) = 2^(x log2 e) for the rest.
constexpr float kLog2E = 1.44269504088896341f;
inline __m512 exp2_16(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
inline __m512 exp16(__m512 x) { return exp2_16(_mm512_mul_ps(x, _mm512_set1_ps(kLog2E))); }

// One key row against one query head: a 16-lane vector whose lanes sum to the dot product (to be
// reduced with others). fp32 keys: kChunks fused multiply-adds on the fp32 query. bf16 keys with
// AVX512-BF16: kChunks / 2 dot-product instructions straight on the bf16 query and key, products
// exact and summed in fp32; without it, widened to fp32 first.
template <typename T, int kChunks>
struct KeyDot {
  __m512 q[kChunks];  // the query in fp32
  explicit KeyDot(const T* query) {
    for (int c = 0; c < kChunks; ++c) q[c] = load16(query + 16 * c);
  }
  __m512 operator()(const T* key) const {
    __m512 a = _mm512_mul_ps(q[0], load16(key));
    for (int c = 1; c < kChunks; ++c) a = _mm512_fmadd_ps(q[c], load16(key + 16 * c), a);
    return a;
  }
};

#if defined(__AVX512BF16__)
template <int kChunks>
struct KeyDot<c10::BFloat16, kChunks> {
  __m512bh q[kChunks / 2];  // 32 bf16 each
  explicit KeyDot(const c10::BFloat16* query) {
    for (int c = 0; c < kChunks / 2; ++c) q[c] = (__m512bh)_mm512_loadu_si512(query + 32 * c);
  }
  __m512 operator()(const c10::BFloat16* key) const {
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < kChunks / 2; ++c) a = _mm512_dpbf16_ps(a, q[c], (__m512bh)_mm512_loadu_si512(key + 32 * c));
    return a;
  }
};
#endif

// A value row in fp32, 16 lanes per chunk. For bf16 the 32 values of each pair of chunks come as
// their even- and odd-indexed halves (two instructions instead of four); ``store_values`` puts
// the accumulated sums back in order.
inline void load_values(const float* v, __m512* row, int chunks) {
  for (int c = 0; c < chunks; ++c) row[c] = _mm512_loadu_ps(v + 16 * c);
}
inline void load_values(const c10::BFloat16* v, __m512* row, int chunks) {
  for (int c = 0; c < chunks; c += 2) {
    const __m512i raw = _mm512_loadu_si512(v + 16 * c);
    row[c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));                                   // even
    row[c + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(0xffff0000)));  // odd
  }
}
inline void store_values(float* out, const __m512* acc, int chunks) {
  for (int c = 0; c < chunks; ++c) _mm512_storeu_ps(out + 16 * c, acc[c]);
}
inline void store_values(c10::BFloat16* out, const __m512* acc, int chunks) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int c = 0; c < chunks; c += 2) {
    store16(out + 16 * c, _mm512_permutex2var_ps(acc[c], lo, acc[c + 1]));
    store16(out + 16 * c + 16, _mm512_permutex2var_ps(acc[c], hi, acc[c + 1]));
  }
}

// Ask for ``count`` rows of ``bytes`` each, ``stride`` elements apart, ahead of their use: the KV
// blocks are read once per step, from memory, and the two K and V reads of an item would otherwise
// each start with the hardware prefetcher cold. Into L2, not L1: a whole block ahead (31 KB of fp32
// at 124 positions) would evict the block being read (T1 ran 3-13% faster than T0 over 30 layers).
template <typename T>
inline void prefetch_rows(const T* p, int64_t stride, int64_t count, size_t bytes) {
  for (int64_t r = 0; r < count; ++r)
    for (size_t b = 0; b < bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + r * stride) + b, _MM_HINT_T1);
}

// kChunks = head dim / 16.
template <typename T, int kChunks>
void attend_avx512(const Item<T>& it, int64_t groups, float scale, float* scratch) {
  const int64_t n = it.last - it.first + 1;
  const int64_t padded = (n + 15) / 16 * 16;
  float* scores = scratch;  // [groups, padded]
  const T* keys = it.k + it.first * it.k_stride;
  const int64_t ks = it.k_stride;
  for (int64_t g = 0; g < groups; ++g) {
    const KeyDot<T, kChunks> dot(it.q + g * it.q_stride);
    float* sg = scores + g * padded;
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      const T* key = keys + j * ks;
      if (g == 0) prefetch_rows(it.v + (it.first + j) * it.v_stride, it.v_stride, 4, kChunks * 16 * sizeof(T));
      _mm_storeu_ps(sg + j, reduce4(dot(key), dot(key + ks), dot(key + 2 * ks), dot(key + 3 * ks)));
    }
    for (; j < n; ++j) sg[j] = _mm512_reduce_add_ps(dot(keys + j * ks));
    // Softmax of the scaled scores (the tail of the last vector masked out).
    const __m512 scale16 = _mm512_set1_ps(scale);
    const __mmask16 tail = static_cast<__mmask16>(n % 16 == 0 ? 0xffff : (1u << (n % 16)) - 1);
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < padded; i += 16) {
      const __mmask16 m = i + 16 <= n ? static_cast<__mmask16>(0xffff) : tail;
      top = _mm512_mask_max_ps(top, m, top, _mm512_loadu_ps(sg + i));
    }
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top) * scale);
    __m512 total = _mm512_setzero_ps();
    for (int64_t i = 0; i < padded; i += 16) {
      const __mmask16 m = i + 16 <= n ? static_cast<__mmask16>(0xffff) : tail;
      const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(sg + i), scale16, shift);
      const __m512 e = _mm512_maskz_mov_ps(m, exp16(x));
      _mm512_storeu_ps(sg + i, e);
      total = _mm512_add_ps(total, e);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
    for (int64_t i = 0; i < padded; i += 16) _mm512_storeu_ps(sg + i, _mm512_mul_ps(_mm512_loadu_ps(sg + i), inv));
  }
  // Weighted sum of values: every group's accumulators in registers while V streams once.
  constexpr int kMaxGroups = 8;
  const T* values = it.v + it.first * it.v_stride;
  for (int64_t g0 = 0; g0 < groups; g0 += kMaxGroups) {
    const int64_t gn = std::min<int64_t>(kMaxGroups, groups - g0);
    __m512 acc[kMaxGroups][kChunks];
    for (int64_t g = 0; g < gn; ++g)
      for (int c = 0; c < kChunks; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      __m512 row[kChunks];
      if (it.next_k != nullptr && j < it.next_n) prefetch_rows(it.next_k + j * ks, ks, 1, kChunks * 16 * sizeof(T));
      load_values(values + j * it.v_stride, row, kChunks);
      for (int64_t g = 0; g < gn; ++g) {
        const __m512 w = _mm512_set1_ps(scores[(g0 + g) * padded + j]);
        for (int c = 0; c < kChunks; ++c) acc[g][c] = _mm512_fmadd_ps(w, row[c], acc[g][c]);
      }
    }
    for (int64_t g = 0; g < gn; ++g) store_values(it.out + (g0 + g) * it.out_stride, acc[g], kChunks);
  }
}

// A prompt chunk's queries: consecutive tokens of one row at consecutive positions, for one KV
// head. Its lanes are (token, query head of the group) pairs, 16 to a tile. The per-query path
// above reads the row's K/V again for every token and reduces every score horizontally; here each
// block of keys is read once for all the item's lanes, and the scores of a tile come out 16 lanes
// at a time: the queries are transposed once (lane-minor), and each key's elements are broadcast
// (once for up to three tiles). The softmax is taken online, block by block (running max and sum
// per lane, flash-style), in base 2. In bf16 the weighted values run on the dot-product
// instruction too, over pairs of keys, with the probabilities rounded to bf16.
template <typename T>
struct ChunkItem {
  const T* q;             // token t0's first query head of the group
  int64_t q_token_stride;
  int64_t q_head_stride;
  const T* k;             // position 0 of this row and KV head
  const T* v;
  int64_t k_stride, v_stride;
  T* out;                 // token t0's first output head of the group
  int64_t out_token_stride;
  int64_t start;          // token t0's position
  int64_t tokens;
};


// The accumulated dot products of tile_scores, scaled, into st[i][16 * j + lane]; top[i] takes
// their maximum per lane.
template <int kTiles, int kKeysAtOnce>
inline void store_scores(const __m512 (&acc)[kTiles][kKeysAtOnce], float* const* st, __m512 mul, __m512* top) {
  for (int i = 0; i < kTiles; ++i)
    for (int j = 0; j < kKeysAtOnce; ++j) {
      const __m512 s = _mm512_mul_ps(acc[i][j], mul);
      _mm512_storeu_ps(st[i] + 16 * j, s);
      top[i] = _mm512_max_ps(top[i], s);
    }
}

// Scores of keys [0, nk) against kTiles tiles at once (each key element is broadcast once for
// all of them): st[i][16 * j + lane] = q_lane . key_j * mul for tile i; top[i] takes their maximum
// per lane. fp32: qt[i] is [dim][16]; bf16 with AVX512-BF16: qt[i] is [dim / 2][16] pairs of bf16.
template <int kDim, int kTiles, int kKeysAtOnce>
inline void tile_scores(const float* const* qt, const float* keys, int64_t ks, float* const* st, __m512 mul,
                        __m512* top) {
  __m512 acc[kTiles][kKeysAtOnce];
  for (int i = 0; i < kTiles; ++i)
    for (int j = 0; j < kKeysAtOnce; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int d = 0; d < kDim; ++d) {
    __m512 qv[kTiles];
    for (int i = 0; i < kTiles; ++i) qv[i] = _mm512_loadu_ps(qt[i] + 16 * d);
    for (int j = 0; j < kKeysAtOnce; ++j) {
      const __m512 key = _mm512_set1_ps(keys[j * ks + d]);
      for (int i = 0; i < kTiles; ++i) acc[i][j] = _mm512_fmadd_ps(qv[i], key, acc[i][j]);
    }
  }
  store_scores<kTiles, kKeysAtOnce>(acc, st, mul, top);
}

#if defined(__AVX512BF16__)
template <int kDim, int kTiles, int kKeysAtOnce>
inline void tile_scores(const float* const* qt, const c10::BFloat16* keys, int64_t ks, float* const* st,
                        __m512 mul, __m512* top) {
  __m512 acc[kTiles][kKeysAtOnce];
  for (int i = 0; i < kTiles; ++i)
    for (int j = 0; j < kKeysAtOnce; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int p = 0; p < kDim / 2; ++p) {
    __m512bh qv[kTiles];
    for (int i = 0; i < kTiles; ++i) qv[i] = (__m512bh)_mm512_loadu_si512(qt[i] + 16 * p);
    for (int j = 0; j < kKeysAtOnce; ++j) {
      int32_t pair;
      std::memcpy(&pair, keys + j * ks + 2 * p, sizeof pair);
      const __m512bh key = (__m512bh)_mm512_set1_epi32(pair);
      for (int i = 0; i < kTiles; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], qv[i], key);
    }
  }
  store_scores<kTiles, kKeysAtOnce>(acc, st, mul, top);
}
#endif

// A block's scores for one to three tiles sharing the key broadcasts (one broadcast per kTiles
// vector multiply-adds): 16, 2 x 12 or 3 x 8 accumulators of the 32 registers, then smaller groups
// of keys for the rest of the block. Three tiles at once (an item of 96 lanes is two such runs) ran
// the fp32 chunk 20 % faster than one, six at once slower again.
template <typename T, int kDim, int kTiles>
inline void block_scores(const float* const* qt, const T* keys, int64_t ks, int64_t nk, float* const* st,
                         __m512 mul, __m512* top) {
  constexpr int kWide = kTiles == 1 ? 16 : kTiles == 2 ? 12 : 8;
  for (int i = 0; i < kTiles; ++i) top[i] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  auto at = [&](int64_t j, float* const* base, float** out) {
    for (int i = 0; i < kTiles; ++i) out[i] = base[i] + 16 * j;
  };
  float* sj[kTiles];
  for (; j + kWide <= nk; j += kWide) {
    at(j, st, sj);
    tile_scores<kDim, kTiles, kWide>(qt, keys + j * ks, ks, sj, mul, top);
  }
  for (; j + 4 <= nk; j += 4) {
    at(j, st, sj);
    tile_scores<kDim, kTiles, 4>(qt, keys + j * ks, ks, sj, mul, top);
  }
  for (; j < nk; ++j) {
    at(j, st, sj);
    tile_scores<kDim, kTiles, 1>(qt, keys + j * ks, ks, sj, mul, top);
  }
}

// A group of lanes' outputs so far, [kLanes][kDim] at o, into registers, each lane's scaled by its
// alpha (the online softmax's correction for a new maximum); and back.
template <int kChunks, int kLanes>
inline void rescaled_outputs(const float* o, const float* alpha, __m512 (&acc)[kLanes][kChunks]) {
  for (int l = 0; l < kLanes; ++l) {
    const __m512 a = _mm512_set1_ps(alpha[l]);
    for (int c = 0; c < kChunks; ++c) acc[l][c] = _mm512_mul_ps(_mm512_loadu_ps(o + (l * kChunks + c) * 16), a);
  }
}
template <int kChunks, int kLanes>
inline void store_outputs(const __m512 (&acc)[kLanes][kChunks], float* o) {
  for (int l = 0; l < kLanes; ++l)
    for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(o + (l * kChunks + c) * 16, acc[l][c]);
}

// One group of kLanes lanes of a tile: o[lane] = o[lane] * alpha[lane] + sum_j st[j][lane] v_j.
// Their outputs stay in registers (kLanes * kChunks accumulators) while the block's values stream.
template <typename T, int kChunks, int kLanes>
inline void weigh_values(const T* values, int64_t vs, int64_t nk, const float* st, const float* alpha, float* o) {
  __m512 acc[kLanes][kChunks];
  rescaled_outputs<kChunks, kLanes>(o, alpha, acc);
  for (int64_t j = 0; j < nk; ++j) {
    __m512 row[kChunks];
    load_values(values + j * vs, row, kChunks);
    for (int l = 0; l < kLanes; ++l) {
      const __m512 w = _mm512_set1_ps(st[16 * j + l]);
      for (int c = 0; c < kChunks; ++c) acc[l][c] = _mm512_fmadd_ps(w, row[c], acc[l][c]);
    }
  }
  store_outputs<kChunks, kLanes>(acc, o);
}

#if defined(__AVX512BF16__)
// bf16 values for the dot-product instruction: keys j and j + 1 interleaved, so that each 32-bit
// lane of out[(j / 2) * kChunks + c] holds (v_j[d], v_j+1[d]) for d = 16c + lane. A lone last key
// is paired with zeros. Built once per block, for all the item's lanes.
template <int kChunks>
inline void pair_values(const c10::BFloat16* v, int64_t vs, int64_t nk, __m512i* out) {
  alignas(64) static const uint16_t kLow[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kLow);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < nk; j += 2) {
    for (int c = 0; c < kChunks; c += 2) {
      const __m512i a = _mm512_loadu_si512(v + j * vs + 16 * c);
      const __m512i b = j + 1 < nk ? _mm512_loadu_si512(v + (j + 1) * vs + 16 * c) : _mm512_setzero_si512();
      out[(j / 2) * kChunks + c] = _mm512_permutex2var_epi16(a, low, b);
      out[(j / 2) * kChunks + c + 1] = _mm512_permutex2var_epi16(a, high, b);
    }
  }
}

// weigh_values for bf16 with pairs of keys: w[16 * p + lane] holds the lane's two weights of
// pair p, rounded to bf16 (as a bf16 attention's probabilities are); one dot-product instruction
// does the work of two multiply-adds.
template <int kChunks, int kLanes>
inline void weigh_value_pairs(const __m512i* pairs, int64_t n_pairs, const int32_t* w, const float* alpha, float* o) {
  __m512 acc[kLanes][kChunks];
  rescaled_outputs<kChunks, kLanes>(o, alpha, acc);
  for (int64_t p = 0; p < n_pairs; ++p) {
    __m512i row[kChunks];
    for (int c = 0; c < kChunks; ++c) row[c] = _mm512_loadu_si512(pairs + p * kChunks + c);
    for (int l = 0; l < kLanes; ++l) {
      const __m512bh wl = (__m512bh)_mm512_set1_epi32(w[16 * p + l]);
      for (int c = 0; c < kChunks; ++c) acc[l][c] = _mm512_dpbf16_ps(acc[l][c], (__m512bh)row[c], wl);
    }
  }
  store_outputs<kChunks, kLanes>(acc, o);
}

// Two lanes' vectors of weights as bf16 pairs: lane l of the result is (a[l], b[l]).
inline __m512i pack_weight_pairs(__m512 a, __m512 b) {
  const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
  const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}
#endif

// Whether the chunk path runs type T: fp32 always; bf16 where the dot-product instruction exists.
template <typename T>
constexpr bool chunk_path_for() {
#if defined(__AVX512BF16__)
  return true;
#else
  return std::is_same<T, float>::value;
#endif
}

template <typename T, int kChunks>
void attend_chunk_avx512(const ChunkItem<T>& it, int64_t groups, float scale, int64_t window, float* scratch) {
  constexpr int kDim = kChunks * 16;
  // Lanes whose accumulators take 24 of the 32 registers (6 at head dim 64, 3 at 128), leaving
  // room for a value row and the weight; kLaneRest is the tile's remainder.
  constexpr int kLaneGroup = 24 / kChunks;
  constexpr int kLaneRest = 16 % kLaneGroup;
  constexpr bool kPairs = !std::is_same<T, float>::value;
  const int64_t lanes = it.tokens * groups;
  const int64_t tiles = (lanes + 15) / 16;
  float* qt = scratch;                           // [tiles][kDim][16] (bf16: [kDim / 2][16] pairs)
  float* o = qt + tiles * kDim * 16;             // [tiles][16][kDim]
  float* st = o + tiles * 16 * kDim;             // [3][kChunkKeys][16]: up to three tiles' scores
  float* run_max = st + 3 * kChunkKeys * 16;     // [tiles][16]
  float* run_sum = run_max + tiles * 16;         // [tiles][16]
  int32_t* lane_last = reinterpret_cast<int32_t*>(run_sum + tiles * 16);  // [tiles][16]
  int32_t* lane_first = lane_last + tiles * 16;                           // [tiles][16]
  // bf16: the block's values in pairs of keys, 64-byte aligned ([kChunkKeys / 2][kChunks] vectors).
  __m512i* value_pairs = reinterpret_cast<__m512i*>(
      (reinterpret_cast<uintptr_t>(lane_first + tiles * 16) + 63) & ~static_cast<uintptr_t>(63));
  float alpha[16];
  for (int64_t lane = 0; lane < tiles * 16; ++lane) {
    const int64_t t = lane / 16, l = lane % 16;
    float* q_tile = qt + t * kDim * 16;
    if (lane < lanes) {
      const int64_t i = lane / groups, g = lane % groups;
      const int64_t pos = it.start + i;
      lane_last[lane] = static_cast<int32_t>(pos);
      lane_first[lane] = static_cast<int32_t>(window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0);
      const T* qv = it.q + i * it.q_token_stride + g * it.q_head_stride;
      if constexpr (kPairs) {
        for (int p = 0; p < kDim / 2; ++p) std::memcpy(q_tile + 16 * p + l, qv + 2 * p, 4);
      } else {
        for (int d = 0; d < kDim; ++d) q_tile[16 * d + l] = to_float(qv[d]);
      }
    } else {  // padding lanes: zero queries, never written out
      lane_last[lane] = lane_last[lanes - 1];
      lane_first[lane] = lane_first[lanes - 1];
      for (int d = 0; d < kDim; ++d) q_tile[16 * d + l] = 0.f;
    }
    run_max[lane] = -std::numeric_limits<float>::infinity();
    run_sum[lane] = 0.f;
  }
  std::fill(o, o + tiles * 16 * kDim, 0.f);
  const __m512 mul16 = _mm512_set1_ps(scale * kLog2E);  // scores in base 2
  const __m512 floor16 = _mm512_set1_ps(-200.f);  // exp2 of it is 0; of -inf it is not defined
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t key_begin = lane_first[0], key_end = lane_last[lanes - 1] + 1;
  for (int64_t kb = key_begin; kb < key_end; kb += kChunkKeys) {
#if defined(__AVX512BF16__)
    if constexpr (kPairs) {
      pair_values<kChunks>(reinterpret_cast<const c10::BFloat16*>(it.v) + kb * it.v_stride, it.v_stride,
                           std::min<int64_t>(kChunkKeys, key_end - kb), value_pairs);
    }
#endif
    // Softmax and weighted values of tile t over the block's first nk keys, scores in sc.
    auto finish = [&](int64_t t, int64_t nk, float* sc, __m512 top) {
      const int32_t* last = lane_last + 16 * t;
      const int32_t* first = lane_first + 16 * t;
      if (kb + nk - 1 > last[0] || kb < first[15]) {  // a block on the diagonal (or the window's edge)
        const __m512i last16 = _mm512_loadu_si512(last), first16 = _mm512_loadu_si512(first);
        top = neg_inf;
        for (int64_t j = 0; j < nk; ++j) {
          const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(kb + j));
          const __mmask16 seen = _mm512_cmp_epi32_mask(key, last16, _MM_CMPINT_LE) &
                                 _mm512_cmp_epi32_mask(key, first16, _MM_CMPINT_NLT);
          const __m512 s = _mm512_mask_mov_ps(neg_inf, seen, _mm512_loadu_ps(sc + 16 * j));
          _mm512_storeu_ps(sc + 16 * j, s);
          top = _mm512_max_ps(top, s);
        }
      }
      const __m512 old_max = _mm512_loadu_ps(run_max + 16 * t);
      const __m512 new_max = _mm512_max_ps(old_max, top);
      // A lane with no key seen yet keeps -inf; it shifts by 0 so that exp2 gives 0, not NaN.
      const __m512 shift = _mm512_mask_mov_ps(new_max, _mm512_cmp_ps_mask(new_max, neg_inf, _CMP_EQ_OQ),
                                              _mm512_setzero_ps());
      const __m512 rescale = exp2_16(_mm512_max_ps(_mm512_sub_ps(old_max, shift), floor16));
      __m512 total = _mm512_setzero_ps();
      auto weight = [&](int64_t j) {
        return exp2_16(_mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(sc + 16 * j), shift), floor16));
      };
      if constexpr (kPairs) {  // pair p's weights overwrite sc[2p], already read
#if defined(__AVX512BF16__)
        int32_t* pairs = reinterpret_cast<int32_t*>(sc);
        for (int64_t j = 0; j < nk; j += 2) {
          const __m512 a = weight(j), b = j + 1 < nk ? weight(j + 1) : _mm512_setzero_ps();
          _mm512_storeu_si512(pairs + 16 * (j / 2), pack_weight_pairs(a, b));
          total = _mm512_add_ps(total, _mm512_add_ps(a, b));
        }
#endif
      } else {
        for (int64_t j = 0; j < nk; ++j) {
          const __m512 e = weight(j);
          _mm512_storeu_ps(sc + 16 * j, e);
          total = _mm512_add_ps(total, e);
        }
      }
      _mm512_storeu_ps(run_max + 16 * t, new_max);
      _mm512_storeu_ps(run_sum + 16 * t,
                       _mm512_fmadd_ps(_mm512_loadu_ps(run_sum + 16 * t), rescale, total));
      _mm512_storeu_ps(alpha, rescale);
      // Weighted values, kLaneGroup lanes at a time, then the tile's remaining lanes.
      const T* values = it.v + kb * it.v_stride;
      float* o_tile = o + t * 16 * kDim;
      auto weigh = [&](auto lanes_tag, int l0) {
        constexpr int kLanes = decltype(lanes_tag)::value;
        if constexpr (kPairs) {
#if defined(__AVX512BF16__)
          weigh_value_pairs<kChunks, kLanes>(value_pairs, (nk + 1) / 2, reinterpret_cast<const int32_t*>(sc) + l0,
                                             alpha + l0, o_tile + l0 * kDim);
#endif
        } else {
          weigh_values<T, kChunks, kLanes>(values, it.v_stride, nk, sc + l0, alpha + l0, o_tile + l0 * kDim);
        }
      };
      int l0 = 0;
      for (; l0 + kLaneGroup <= 16 && t * 16 + l0 < lanes; l0 += kLaneGroup)
        weigh(std::integral_constant<int, kLaneGroup>{}, l0);
      if constexpr (kLaneRest > 0) {
        if (l0 < 16 && t * 16 + l0 < lanes) weigh(std::integral_constant<int, kLaneRest>{}, l0);
      }
    };
    // Lanes go by token, so a tile's lanes' ranges rise with the lane (and tile).
    auto keys_of = [&](int64_t t) -> int64_t {  // 0 where tile t sees none of the block
      const int32_t* last = lane_last + 16 * t;
      const int32_t* first = lane_first + 16 * t;
      if (kb > last[15] || kb + kChunkKeys <= first[0]) return 0;
      return std::min<int64_t>(kChunkKeys, last[15] + 1 - kb);
    };
    const T* keys = it.k + kb * it.k_stride;
    for (int64_t t = 0; t < tiles;) {
      const int64_t nk = keys_of(t);
      if (nk == 0) {
        ++t;
        continue;
      }
      // Tiles t .. t + kTiles - 1, over the same keys, sharing the key broadcasts.
      auto score_and_finish = [&](auto tiles_tag) {
        constexpr int kTiles = decltype(tiles_tag)::value;
        const float* q[kTiles];
        float* sc[kTiles];
        __m512 top[kTiles];
        for (int i = 0; i < kTiles; ++i) q[i] = qt + (t + i) * kDim * 16, sc[i] = st + i * kChunkKeys * 16;
        block_scores<T, kDim, kTiles>(q, keys, it.k_stride, nk, sc, mul16, top);
        for (int i = 0; i < kTiles; ++i) finish(t + i, nk, sc[i], top[i]);
        t += kTiles;
      };
      if (t + 2 < tiles && keys_of(t + 1) == nk && keys_of(t + 2) == nk) {
        score_and_finish(std::integral_constant<int, 3>{});
      } else if (t + 1 < tiles && keys_of(t + 1) == nk) {
        score_and_finish(std::integral_constant<int, 2>{});
      } else {
        score_and_finish(std::integral_constant<int, 1>{});
      }
    }
  }
  for (int64_t lane = 0; lane < lanes; ++lane) {
    const int64_t i = lane / groups, g = lane % groups;
    const __m512 inv = _mm512_set1_ps(1.f / run_sum[lane]);
    __m512 acc[kChunks];
    T* out = it.out + i * it.out_token_stride + g * kDim;
    for (int c = 0; c < kChunks; ++c) store16(out + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(o + lane * kDim + 16 * c), inv));
  }
}
#endif

// Where the CPU has AMX tiles for bf16, ATen's scaled_dot_product_attention multiplies a prompt
// chunk's query and key blocks with oneDNN's AMX micro-kernels: about twice the speed of the
// AVX512-BF16 chunk path above from a few dozen tokens on (docs/measurements.md). A run of at least
// kMatrixChunkTokens tokens takes it there, as one call with its causal (and windowed) mask; shorter
// runs and lone queries stay on this file's kernels. fp32 stays here: the chunk path above is the
// faster of the two in fp32 on those hosts too.
constexpr int64_t kMatrixChunkTokens = 32;

template <typename T>
constexpr bool matrix_chunks_for() {
#if defined(__AMX_BF16__)
  return std::is_same<T, c10::BFloat16>::value;
#else
  return false;
#endif
}

// One run of consecutive tokens of one row (queries r .. r + n - 1) through ATen's attention,
// written into out's rows r .. r + n - 1. q [n, H, 1, D]; k, v [R, KVH, L, D].
void attend_chunk_matrix(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t r, int64_t n,
                         int64_t row, int64_t start, double scale, int64_t window, at::Tensor& out) {
  const int64_t last = start + n - 1;
  const int64_t first = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
  const int64_t keys = last - first + 1;
  const at::Tensor query = q.narrow(0, r, n).select(2, 0).transpose(0, 1).unsqueeze(0);  // [1, H, n, D]
  const at::Tensor key = k.select(0, row).narrow(1, first, keys).unsqueeze(0);           // [1, KVH, keys, D]
  const at::Tensor value = v.select(0, row).narrow(1, first, keys).unsqueeze(0);
  std::optional<at::Tensor> visible;  // none: the chunk is the row's first tokens, plain causal attention
  if (start > 0 || window > 0) {
    const auto long_options = at::TensorOptions().dtype(at::kLong);
    const at::Tensor key_pos = at::arange(first, last + 1, long_options).unsqueeze(0);
    const at::Tensor query_pos = at::arange(start, last + 1, long_options).unsqueeze(1);
    at::Tensor mask = key_pos <= query_pos;
    if (window > 0) mask = mask & (key_pos > query_pos - window);
    visible = mask.view({1, 1, n, keys});
  }
  const at::Tensor attended = at::scaled_dot_product_attention(query, key, value, visible, 0.0, !visible.has_value(),
                                                               scale, /*enable_gqa=*/true);
  out.narrow(0, r, n).select(2, 0).copy_(attended.squeeze(0).transpose(0, 1));
}

template <typename T>
void attend(const Item<T>& it, int64_t groups, int64_t dim, float scale, float* scratch) {
#if defined(__AVX512F__)
  if (dim == 64) return attend_avx512<T, 4>(it, groups, scale, scratch);
  if (dim == 128) return attend_avx512<T, 8>(it, groups, scale, scratch);
#endif
  attend_plain<T>(it, groups, dim, scale, scratch);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows,
                            const at::Tensor& positions, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1,
              "decode_attention: q [n, H, 1, D], k and v [R, KVH, L, D]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "decode_attention: q, k and v must all be fp32 or all bf16");
  const int64_t queries = q.size(0), heads = q.size(1), dim = q.size(3);
  const int64_t cache_rows = k.size(0), kv_heads = k.size(1), length = k.size(2);
  TORCH_CHECK(v.size(0) == cache_rows && v.size(1) == kv_heads && v.size(2) == length && k.size(3) == dim &&
                  v.size(3) == dim && heads % kv_heads == 0,
              "decode_attention: q, k and v shapes disagree");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == queries && rows.dim() == 1 && rows.size(0) == queries,
              "decode_attention: one row and one position per query");
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  const at::Tensor kc = k.stride(3) == 1 ? k : k.contiguous();
  const at::Tensor vc = v.stride(3) == 1 ? v : v.contiguous();
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  const at::Tensor row = rows.to(at::kLong).contiguous();
  const int64_t* pos_p = pos.data_ptr<int64_t>();
  const int64_t* row_p = row.data_ptr<int64_t>();
  for (int64_t r = 0; r < queries; ++r) {
    TORCH_CHECK(0 <= pos_p[r] && pos_p[r] < length, "decode_attention: position ", pos_p[r], " outside 0..",
                length - 1);
    TORCH_CHECK(0 <= row_p[r] && row_p[r] < cache_rows, "decode_attention: row ", row_p[r], " outside 0..",
                cache_rows - 1);
  }
  const int64_t groups = heads / kv_heads;
  at::Tensor out = at::empty({queries, heads, 1, dim}, q.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* qp = qc.data_ptr<T>();
    const T* kp = kc.data_ptr<T>();
    const T* vp = vc.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t padded = (length + 15) / 16 * 16;
    auto first_of = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, pos_p[r] - window + 1) : 0; };
    // Work units: (query, KV head) for a lone query (a decode), (run of up to
    // chunk_tokens_per_item tokens, KV head) for a prompt chunk's consecutive tokens.
    struct Unit {
      int64_t query, tokens, head;
    };
    std::vector<Unit> units;
    bool chunked = false;
#if defined(__AVX512F__)
    if constexpr (chunk_path_for<T>()) chunked = dim == 64 || dim == 128;
#endif
    const int64_t per_item = chunk_tokens_per_item(groups);
    std::vector<std::pair<int64_t, int64_t>> matrix_runs;  // (first query, tokens): attend_chunk_matrix
    for (int64_t r = 0; r < queries;) {
      int64_t run = 1;  // the consecutive tokens of row_p[r] from here
      while (r + run < queries && row_p[r + run] == row_p[r] && pos_p[r + run] == pos_p[r] + run) ++run;
      if (matrix_chunks_for<T>() && run >= kMatrixChunkTokens) {
        matrix_runs.emplace_back(r, run);
        r += run;
        continue;
      }
      for (const int64_t end = r + run; r < end;) {
        const int64_t n = chunked ? std::min(per_item, end - r) : 1;
        for (int64_t h = 0; h < kv_heads; ++h) units.push_back({r, n, h});
        r += n;
      }
    }
    for (const auto& [r, n] : matrix_runs)
      attend_chunk_matrix(qc, kc, vc, r, n, row_p[r], pos_p[r], scale, window, out);
    const int64_t items = static_cast<int64_t>(units.size());
    // Units differ in cost: each thread gets a run of units of about equal cost (keys read per
    // lone query, a third of that per chunk token, plus a fixed part), not an equal count, so no
    // thread waits for another at the end. A run keeps a chunk's units together, so their row's K/V
    // is read from cache after the first.
    std::vector<int64_t> bounds{0};
    {
      std::vector<int64_t> cost(items + 1, 0);
      for (int64_t i = 0; i < items; ++i) {
        const Unit& u = units[i];
        const int64_t keys = pos_p[u.query + u.tokens - 1] - first_of(u.query) + 1;
        cost[i + 1] = cost[i] + (u.tokens == 1 ? keys : u.tokens * keys / 3) + 16;
      }
      const int64_t parts = std::min<int64_t>(at::get_num_threads(), items);
      for (int64_t p = 1; p < parts; ++p) {
        const int64_t target = cost[items] * p / parts;
        bounds.push_back(std::lower_bound(cost.begin(), cost.end(), target) - cost.begin());
      }
      bounds.push_back(items);
    }
    const int64_t single_scratch = groups * (2 * dim + padded) + dim;
    const int64_t tiles = chunked ? chunk_tiles(groups) : 0;
    // qt and o; three tiles' scores; the lanes' running max, sum, first and last key; bf16's value pairs
    // and their alignment.
    const int64_t chunk_scratch = tiles * (2 * dim * 16 + 4 * 16) + 3 * kChunkKeys * 16 + kChunkKeys * dim / 2 + 16;
    at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t part_begin, int64_t part_end) {
      std::vector<float> scratch(static_cast<size_t>(std::max(single_scratch, chunk_scratch)));
      const int64_t begin = bounds[part_begin], end = bounds[part_end];
      for (int64_t i = begin; i < end; ++i) {
        const Unit& u = units[i];
        const int64_t r = u.query, h = u.head;
#if defined(__AVX512F__)
        if constexpr (chunk_path_for<T>()) {
          if (u.tokens > 1) {
            const ChunkItem<T> item{qp + r * qc.stride(0) + h * groups * qc.stride(1), qc.stride(0), qc.stride(1),
                                    kp + row_p[r] * kc.stride(0) + h * kc.stride(1),
                                    vp + row_p[r] * vc.stride(0) + h * vc.stride(1), kc.stride(2), vc.stride(2),
                                    op + (r * heads + h * groups) * dim, heads * dim, pos_p[r], u.tokens};
            if (dim == 64) {
              attend_chunk_avx512<T, 4>(item, groups, static_cast<float>(scale), window, scratch.data());
            } else {
              attend_chunk_avx512<T, 8>(item, groups, static_cast<float>(scale), window, scratch.data());
            }
            continue;
          }
        }
#endif
        const int64_t last = pos_p[r], first = first_of(r);
        const T* next_k = nullptr;
        int64_t next_n = 0;
        if (i + 1 < end && units[i + 1].tokens == 1) {
          const int64_t nr = units[i + 1].query, nh = units[i + 1].head;
          next_k = kp + row_p[nr] * kc.stride(0) + nh * kc.stride(1) + first_of(nr) * kc.stride(2);
          next_n = pos_p[nr] - first_of(nr) + 1;
        }
        const Item<T> item{qp + r * qc.stride(0) + h * groups * qc.stride(1), qc.stride(1),
                           kp + row_p[r] * kc.stride(0) + h * kc.stride(1),
                           vp + row_p[r] * vc.stride(0) + h * vc.stride(1), kc.stride(2), vc.stride(2),
                           op + (r * heads + h * groups) * dim, dim, first, last, next_k, next_n};
        attend<T>(item, groups, dim, static_cast<float>(scale), scratch.data());
      }
    });
  };
  if (q.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(c10::BFloat16{});
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(neuron_lmi, CPU, m) { m.impl("decode_attention", &decode_attention); }
