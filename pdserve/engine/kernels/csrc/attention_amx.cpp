// Paged attention on AMX tiles for bfloat16 on the amx path (attention_kernels.h): the scores
// (q . K) with K read straight from the cache, and the weighted sum of V.
//
// Scores.
// A tile step computes S^T = K Q^T for 16 keys and 16 query rows:
//   - A: 16 keys x 32 bfloat16 of head_dim, loaded from the cache in place. The keys of one
//     block of the cache are one row stride apart, so a group of 16 keys that starts at a
//     multiple of 16 and lies in one block (block_size % 16 == 0) is one strided tile load:
//     no copy, no widening and no transposing of K at all, in decode or in prefill.
//   - B: the 16 rows of q, as pairs of head_dim (the layout TDPBF16PS asks of B), built once
//     per work item by the caller (a few dozen bytes a row).
//   - C: 16 x 16 float32 sums, stored, then each row's 16 scores gathered out of its column and
//     multiplied by the scale.
// Bits: score(k, r) is one float32 accumulator that TDPBF16PS updates with the pairs of
// head_dim in order (block 0-31, then 32-63, ...), from key k's row of A and row r's column
// of B alone. Which keys or rows share a tile (a decode row is one real column of 16), how
// many tiles a call makes and which thread runs it change nothing of it. So a position's scores
// are the same bits in decode, a prefill chunk and a recompute, at any thread count. They are
// not the bits of the float32 FMA chain the other paths use (that one widens q and K and
// multiplies them one head_dim element at a time). Keys of the last group past the sequence's
// end read whatever the cache holds there; their scores are computed and never used.
//
// Weighted values. out = P V on tiles as well, which asks P in bfloat16: each probability is
// rounded once to bfloat16 (round to nearest even) on its way into the tile, as flash
// attention does on GPUs and torch's CPU attention does, while the softmax's sum that divides
// the result stays the float32 sum of the unrounded ones. V goes into the pairs layout (two
// keys' values side by side per column, attention_bf16.cpp's pair_values) once per work item,
// with zeros past the item's last key. out(r, d) is one float32 accumulator updated block of
// 32 keys after block, in order, from row r of P and column d of V alone; a row's
// probabilities past its own last key are exact zeros, so the blocks a longer row of its tile
// adds change nothing.
#include "attention_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")

#include "amx_tiles.h"
#include "bf16_round.h"

namespace {

constexpr int64_t KEYS = 16;      // keys per tile (rows of A)
constexpr int64_t ROWS = 16;      // query rows per tile (columns of B and C)
constexpr int64_t DIMS = 32;      // bfloat16 of head_dim per tile step
constexpr int64_t MAX_STEPS = 4;  // head_dim <= 128: K of 16 keys fits tmm4-7

// Loads K's steps for keys [k0, k0 + 16) into tmm4.. (one tile per 32 of head_dim).
template <int STEPS>
inline void load_keys(const uint16_t* first, int64_t key_bytes) {
  _tile_loadd(4, first, key_bytes);
  if constexpr (STEPS > 1) _tile_loadd(5, first + DIMS, key_bytes);
  if constexpr (STEPS > 2) _tile_loadd(6, first + 2 * DIMS, key_bytes);
  if constexpr (STEPS > 3) _tile_loadd(7, first + 3 * DIMS, key_bytes);
}

// tmm0 = sums of 16 keys (tmm4..) x the 16 rows of one group (its B tiles at qt, 1 KB each).
template <int STEPS>
inline void group_sums(const uint32_t* qt) {
  _tile_zero(0);
  _tile_loadd(1, qt, 64);
  _tile_dpbf16ps(0, 4, 1);
  if constexpr (STEPS > 1) {
    _tile_loadd(2, qt + 256, 64);
    _tile_dpbf16ps(0, 5, 2);
  }
  if constexpr (STEPS > 2) {
    _tile_loadd(1, qt + 512, 64);
    _tile_dpbf16ps(0, 6, 1);
  }
  if constexpr (STEPS > 3) {
    _tile_loadd(2, qt + 768, 64);
    _tile_dpbf16ps(0, 7, 2);
  }
}

template <int STEPS>
void scores_steps(const uint32_t* qt, int64_t rows, const uint16_t* cache, const int64_t* offsets, int64_t key_bytes,
                  const int64_t* first, const int64_t* keys, int64_t n_max, int64_t stride, float scale, float* out) {
  const int64_t groups = (rows + ROWS - 1) / ROWS;
  const __m512 s = _mm512_set1_ps(scale);
  const __m512i column = _mm512_mullo_epi32(_mm512_set1_epi32(ROWS), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                                       10, 11, 12, 13, 14, 15));
  alignas(64) float c[KEYS * ROWS];
  pdserve::configure_tiles();
  for (int64_t k0 = first[0] / KEYS * KEYS; k0 < n_max && keys[rows - 1] > k0; k0 += KEYS) {
    pdserve::fetch_rows(cache, offsets, k0 + KEYS, std::min(k0 + 2 * KEYS, n_max), STEPS * DIMS * 2);  // the next group's
    load_keys<STEPS>(cache + offsets[k0], key_bytes);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r0 = g * ROWS, r1 = std::min(rows, r0 + ROWS);
      // Rows are in query order: the group's last sees the most keys, its first the earliest.
      if (keys[r1 - 1] <= k0 || first[r0] >= k0 + KEYS) continue;
      group_sums<STEPS>(qt + g * STEPS * 256);
      _tile_stored(0, c, 64);
      for (int64_t r = r0; r < r1; ++r) {
        if (keys[r] <= k0 || first[r] >= k0 + KEYS) continue;
        const __m512 col = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(static_cast<int>(r - r0))),
                                               c, 4);
        _mm512_storeu_ps(out + r * stride + k0, _mm512_mul_ps(col, s));
      }
    }
  }
  _tile_release();
}

// out = the 16 (or fewer) rows of P at p, keys [k0, k0 + 32), as bfloat16: a tile of A.
// Probabilities past a row's keys and rows past `rows` are zeros.
inline void probabilities(const float* p, int64_t stride, const int64_t* keys, int64_t r0, int64_t r1, int64_t k0,
                          uint16_t* out) {
  for (int64_t i = 0; i < ROWS; ++i) {
    const int64_t r = r0 + i;
    if (r >= r1 || keys[r] <= k0) {
      _mm512_storeu_si512(out + i * 32, _mm512_setzero_si512());
      continue;
    }
    pdserve::round_probabilities32(p + r * stride + k0, keys[r] - k0, out + i * 32);
  }
}

// acc tiles [0, NT) += P (tmm4) x V for each block of 32 keys of one group of rows, then stored.
template <int NT>
void group_values(const float* p, int64_t stride, const int64_t* first, const int64_t* keys, int64_t r0, int64_t r1,
                  const uint16_t* pairs, int64_t tiles, int64_t dc, float* acc, int64_t hd) {
  alignas(64) uint16_t a[ROWS * 32];
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (NT > 2) _tile_zero(2);
  if constexpr (NT > 3) _tile_zero(3);
  for (int64_t k0 = first[r0] / 32 * 32; k0 < keys[r1 - 1]; k0 += 32) {  // +0 weights before a row's first key
    probabilities(p, stride, keys, r0, r1, k0, a);
    _tile_loadd(4, a, 64);
    const uint16_t* b = pairs + ((k0 / 32) * tiles + dc) * 512;  // 512 bfloat16 = one 1 KB tile
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NT > 1) {
      _tile_loadd(6, b + 512, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NT > 2) {
      _tile_loadd(5, b + 1024, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (NT > 3) {
      _tile_loadd(6, b + 1536, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  float* out = acc + r0 * hd + dc * 16;
  const int64_t bytes = hd * 4;
  _tile_stored(0, out, bytes);
  if constexpr (NT > 1) _tile_stored(1, out + 16, bytes);
  if constexpr (NT > 2) _tile_stored(2, out + 32, bytes);
  if constexpr (NT > 3) _tile_stored(3, out + 48, bytes);
}

}  // namespace

namespace pdserve::attention_amx {

void weighted_values(const float* p, int64_t stride, int64_t rows, int64_t hd, const int64_t* first,
                     const int64_t* keys, const uint16_t* pairs, float* acc) {
  const int64_t tiles = hd / 16;
  pdserve::configure_tiles();
  for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
    const int64_t r1 = std::min(rows, r0 + ROWS);
    for (int64_t dc = 0; dc < tiles; dc += 4) {
      switch (std::min<int64_t>(4, tiles - dc)) {
        case 1: group_values<1>(p, stride, first, keys, r0, r1, pairs, tiles, dc, acc, hd); break;
        case 2: group_values<2>(p, stride, first, keys, r0, r1, pairs, tiles, dc, acc, hd); break;
        case 3: group_values<3>(p, stride, first, keys, r0, r1, pairs, tiles, dc, acc, hd); break;
        default: group_values<4>(p, stride, first, keys, r0, r1, pairs, tiles, dc, acc, hd); break;
      }
    }
  }
  _tile_release();
}

bool supported(int64_t hd, int64_t block_size) {
  return hd % DIMS == 0 && hd / DIMS <= MAX_STEPS && block_size % KEYS == 0;
}

void scores(const uint32_t* qt, int64_t rows, int64_t hd, const uint16_t* k, const int64_t* offsets, int64_t key_stride,
            const int64_t* first, const int64_t* keys, int64_t n_max, int64_t stride, float scale, float* out) {
  const int64_t key_bytes = key_stride * 2;
  switch (hd / DIMS) {
    case 1: scores_steps<1>(qt, rows, k, offsets, key_bytes, first, keys, n_max, stride, scale, out); break;
    case 2: scores_steps<2>(qt, rows, k, offsets, key_bytes, first, keys, n_max, stride, scale, out); break;
    case 3: scores_steps<3>(qt, rows, k, offsets, key_bytes, first, keys, n_max, stride, scale, out); break;
    default: scores_steps<4>(qt, rows, k, offsets, key_bytes, first, keys, n_max, stride, scale, out); break;
  }
}

}  // namespace pdserve::attention_amx

#pragma GCC pop_options
