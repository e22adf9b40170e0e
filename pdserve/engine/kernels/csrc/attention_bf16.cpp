// Paged attention on VDPBF16PS for bfloat16 on the avx512_bf16 path (attention_kernels.h), and
// the pairs layout of V that this path and the amx path share.
//
// Scores: K goes into dword-transposed blocks of 16 keys (dword p of a key is its pair of
// head_dim 2p, 2p+1; a block holds dword p of its 16 keys side by side, zero past the last
// key), once per work item. A score is then one float32 lane that VDPBF16PS updates with
// q's pair p broadcast against the block's row p, for p = 0, 1, ... in order.
// Weighted values: out(r, d) is one float32 lane updated with the pair of probabilities of
// keys 2j, 2j+1 (rounded once to bfloat16, as on the amx path) against V's pair in the pairs
// layout, for j = 0, 1, ... in order; a row's probabilities past its own last key are exact
// zeros, so the pairs a longer row of its group adds change nothing.
// Each element's chain reads only its own row and key (or column), so a position's result is the
// same bits in decode, a prefill chunk and a recompute, in any batch, at any thread count.
#include "attention_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

#include "bf16_round.h"

namespace {

constexpr int64_t KEYS = 16;  // keys per transposed block (lanes of a score vector)
constexpr int64_t AHEAD = 32;  // keys between a row's fetch (pdserve::fetch_rows) and its read

inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(a), reinterpret_cast<__m512bh&>(b));
}

// 16 rows of 16 dwords, transposed in registers.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c], lane L: rows 4i..4i+3 at column 4L + c
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c gathers lane L of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), b = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
    const __m512i e = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i f = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
    t[c] = _mm512_shuffle_i32x4(a, e, 0x88);
    t[8 + c] = _mm512_shuffle_i32x4(a, e, 0xdd);
    t[4 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(b, f, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// R rows (q as dwords, hd / 2 each) x the keys of one or two blocks: out rows get 16 scores a block.
template <int R, int B>
inline void score_rows(const uint32_t* const* q, const uint32_t* block, int64_t pairs, __m512 scale,
                       float* const* out) {
  __m512 acc[R][B];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i k[B];
    for (int b = 0; b < B; ++b) k[b] = _mm512_loadu_si512(block + (b * pairs + p) * KEYS);
    for (int r = 0; r < R; ++r) {
      const __m512i qp = _mm512_set1_epi32(static_cast<int>(q[r][p]));
      for (int b = 0; b < B; ++b) acc[r][b] = dot_pairs(acc[r][b], qp, k[b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(out[r] + b * KEYS, _mm512_mul_ps(acc[r][b], scale));
}

template <int R>
inline void score_group(const uint32_t* qrows, int64_t r0, int64_t pairs, const int64_t* first, const int64_t* keys,
                        const uint32_t* kt, int64_t n_max, int64_t stride, __m512 scale, float* out) {
  const uint32_t* q[R];
  for (int r = 0; r < R; ++r) q[r] = qrows + (r0 + r) * pairs;
  const int64_t reach = std::min(n_max, keys[r0 + R - 1]);  // rows are in query order: the last sees the most
  for (int64_t k0 = first[r0] / KEYS * KEYS; k0 < reach; k0 += 2 * KEYS) {  // and the first the earliest
    float* o[R];
    for (int r = 0; r < R; ++r) o[r] = out + (r0 + r) * stride + k0;
    const uint32_t* block = kt + (k0 / KEYS) * pairs * KEYS;
    if (k0 + KEYS < reach)
      score_rows<R, 2>(q, block, pairs, scale, o);
    else
      score_rows<R, 1>(q, block, pairs, scale, o);
  }
}

// R rows' weighted values over columns [d0, d0 + 64) (or fewer: 16 per tile of the pairs layout),
// key pairs [j0, key_pairs).
template <int R, int T>
inline void value_rows(const uint32_t* const* p, int64_t j0, int64_t key_pairs, const uint16_t* pairs, int64_t tiles,
                       int64_t t0, float* const* acc) {
  __m512 a[R][T];
  for (auto& row : a)
    for (auto& v : row) v = _mm512_setzero_ps();
  for (int64_t j = j0; j < key_pairs; ++j) {
    const uint16_t* row = pairs + ((j / 16) * tiles + t0) * 512 + (j % 16) * 32;
    __m512i v[T];
    for (int t = 0; t < T; ++t) v[t] = _mm512_loadu_si512(row + t * 512);
    for (int r = 0; r < R; ++r) {
      const __m512i w = _mm512_set1_epi32(static_cast<int>(p[r][j]));
      for (int t = 0; t < T; ++t) a[r][t] = dot_pairs(a[r][t], w, v[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(acc[r] + (t0 + t) * 16, a[r][t]);
}

template <int R>
inline void value_group(const uint32_t* const* p, int64_t j0, int64_t key_pairs, const uint16_t* pairs, int64_t tiles,
                        float* const* acc) {
  int64_t t0 = 0;
  for (; t0 + 4 <= tiles; t0 += 4) value_rows<R, 4>(p, j0, key_pairs, pairs, tiles, t0, acc);
  for (; t0 + 2 <= tiles; t0 += 2) value_rows<R, 2>(p, j0, key_pairs, pairs, tiles, t0, acc);
}

}  // namespace

namespace pdserve::attention_bf16 {

void transpose_keys(const uint16_t* cache, const int64_t* offsets, int64_t from, int64_t n, int64_t hd,
                    int64_t run_bytes, uint32_t* out) {
  const int64_t pairs = hd / 2;
  pdserve::fetch_rows(cache, offsets, from, std::min(n, from + AHEAD), 2 * hd, run_bytes);
  for (int64_t k0 = from; k0 < n; k0 += KEYS) {
    pdserve::fetch_rows(cache, offsets, std::min(n, k0 + AHEAD), std::min(n, k0 + AHEAD + KEYS), 2 * hd, run_bytes);
    uint32_t* block = out + (k0 / KEYS) * pairs * KEYS;
    for (int64_t h = 0; h < hd / 32; ++h) {  // pairs [16 h, 16 h + 16)
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = k0 + i < n ? _mm512_loadu_si512(cache + offsets[k0 + i] + 32 * h) : _mm512_setzero_si512();
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(block + (16 * h + j) * KEYS, r[j]);
    }
  }
}

void scores(const uint32_t* q, int64_t rows, int64_t hd, const int64_t* first, const int64_t* keys,
            const uint32_t* kt, int64_t n_max, int64_t stride, float scale, float* out) {
  const __m512 s = _mm512_set1_ps(scale);
  const int64_t pairs = hd / 2;
  int64_t r0 = 0;
  for (; r0 + 4 <= rows; r0 += 4) score_group<4>(q, r0, pairs, first, keys, kt, n_max, stride, s, out);
  switch (rows - r0) {
    case 3: score_group<3>(q, r0, pairs, first, keys, kt, n_max, stride, s, out); break;
    case 2: score_group<2>(q, r0, pairs, first, keys, kt, n_max, stride, s, out); break;
    case 1: score_group<1>(q, r0, pairs, first, keys, kt, n_max, stride, s, out); break;
    default: break;
  }
}

void pair_values(const uint16_t* cache, const int64_t* offsets, int64_t from, int64_t n, int64_t hd, uint16_t* out) {
  __m512i lo_idx, hi_idx;  // (a[i], b[i]) for i in [0, 16), and for i in [16, 32)
  {
    alignas(64) uint16_t lo[32], hi[32];
    for (int i = 0; i < 16; ++i) {
      lo[2 * i] = i, lo[2 * i + 1] = 32 + i;
      hi[2 * i] = 16 + i, hi[2 * i + 1] = 48 + i;
    }
    lo_idx = _mm512_load_si512(lo);
    hi_idx = _mm512_load_si512(hi);
  }
  const int64_t tiles = hd / 16;
  pdserve::fetch_rows(cache, offsets, from, std::min(n, from + AHEAD), 2 * hd);
  for (int64_t k0 = from; k0 < n; k0 += 32) {
    pdserve::fetch_rows(cache, offsets, std::min(n, k0 + AHEAD), std::min(n, k0 + AHEAD + 32), 2 * hd);
    uint16_t* block = out + (k0 / 32) * tiles * 512;
    for (int64_t pair = 0; pair < 16; ++pair) {
      const int64_t k = k0 + 2 * pair;
      const uint16_t* v0 = k < n ? cache + offsets[k] : nullptr;
      const uint16_t* v1 = k + 1 < n ? cache + offsets[k + 1] : nullptr;
      for (int64_t h = 0; h < hd / 32; ++h) {
        const __m512i a = v0 ? _mm512_loadu_si512(v0 + 32 * h) : _mm512_setzero_si512();
        const __m512i b = v1 ? _mm512_loadu_si512(v1 + 32 * h) : _mm512_setzero_si512();
        _mm512_storeu_si512(block + (2 * h) * 512 + pair * 32, _mm512_permutex2var_epi16(a, lo_idx, b));
        _mm512_storeu_si512(block + (2 * h + 1) * 512 + pair * 32, _mm512_permutex2var_epi16(a, hi_idx, b));
      }
    }
  }
}

void weighted_values(const float* p, int64_t stride, int64_t rows, int64_t hd, const int64_t* first,
                     const int64_t* keys, const uint16_t* pairs, uint16_t* pb, float* acc) {
  const int64_t tiles = hd / 16, padded = (keys[rows - 1] + 31) / 32 * 32, base = first[0] / 32 * 32;
  for (int64_t r = 0; r < rows; ++r)  // each row in bfloat16, zeros past its own keys (and +0 before its first)
    for (int64_t k0 = base; k0 < padded; k0 += 32)
      pdserve::round_probabilities32(p + r * stride + k0, keys[r] - k0, pb + r * padded + k0);
  int64_t r0 = 0;
  for (; r0 < rows; r0 += 2) {
    const int64_t n = keys[std::min(rows, r0 + 2) - 1];  // the pair's longer row
    const int64_t j0 = first[r0] / 32 * 16;  // the block of the pair's earlier first key, in pairs of keys
    const uint32_t* pr[2] = {reinterpret_cast<const uint32_t*>(pb + r0 * padded),
                             reinterpret_cast<const uint32_t*>(pb + (r0 + 1) * padded)};
    float* ar[2] = {acc + r0 * hd, acc + (r0 + 1) * hd};
    if (r0 + 1 < rows)
      value_group<2>(pr, j0, (n + 1) / 2, pairs, tiles, ar);
    else
      value_group<1>(pr, j0, (n + 1) / 2, pairs, tiles, ar);
  }
}

}  // namespace pdserve::attention_bf16

#pragma GCC pop_options
