// The AVX2 + FMA linear kernels of linear.cpp (the `avx2` path, and every path's float32
// fallback for rows the wide kernels do not take): register tiles of up to 6 rows x 6 panels,
// each output element one FMA chain in increasing k (linear.cpp's head comment says why that
// fixes the bits), and the bfloat16 -> float32 widening of activations. Included by
// linear.cpp alone (its names sit in an anonymous namespace, as they did there).
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "linear_kernels.h"
#include "panel_loop.h"
#include "vec_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

using pdserve::kPanel;
using pdserve::Output;

constexpr int kMaxRows = 6;             // rows per register tile
constexpr int kMaxAcc = 12;             // accumulators (of 16 ymm registers) per tile

// One panel row (16 columns at one k) as two float32 vectors: columns 0..7 and 8..15.
inline void panel_row(const uint16_t* w, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline void panel_row(const float* w, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(w);
  hi = _mm256_loadu_ps(w + 8);
}

// Rows x panels of one register tile; accumulates all of K, then writes float32 sums.
// x: MR rows of K float32 (row stride ldx); w: NP consecutive panels of weight type W
// (uint16_t: bfloat16 bits, or float); out: [MR][NP * 16]. prefetch: fetch the next tile's
// panels while this one computes (run_panels says when).
template <typename W, int MR, int NP>
void tile(const float* x, int64_t ldx, const W* w, int64_t K, float* out, bool prefetch) {
  static_assert(MR * NP * 2 <= kMaxAcc, "tile exceeds the register budget");
  // One flat array, every loop over it unrolled: GCC then keeps it in registers (a 2-D
  // array of __m256 was stored back to the stack on every k).
  __m256 acc[MR * NP * 2];  // acc[2 (r NP + p)] columns 0..7 of panel p, row r; +1: columns 8..15
#pragma GCC unroll 16
  for (int i = 0; i < MR * NP * 2; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      // The same k of the next tile's panels (they follow these in memory) into L2, once a
      // 64-byte line (two k rows of bfloat16, one of float32). A prefetch never faults, so
      // the last tile's, past the weight's end, is harmless.
      if (prefetch && (sizeof(W) == 4 || (k & 1) == 0))
        _mm_prefetch(reinterpret_cast<const char*>(w + ((p + NP) * K + k) * kPanel), _MM_HINT_T1);
      __m256 wl, wh;  // columns 0..7, 8..15
      panel_row(w + (p * K + k) * kPanel, wl, wh);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
        acc[2 * (r * NP + p)] = _mm256_fmadd_ps(xb, wl, acc[2 * (r * NP + p)]);
        acc[2 * (r * NP + p) + 1] = _mm256_fmadd_ps(xb, wh, acc[2 * (r * NP + p) + 1]);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR * NP * 2; ++i) _mm256_storeu_ps(out + 8 * i, acc[i]);
}

template <typename W>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, float*, bool);

// Panels per tile of `rows` rows (2 x rows x panels accumulators, at most kMaxAcc).
constexpr int panels_for(int rows) { return rows == 1 ? 6 : rows == 2 ? 2 : 1; }

template <typename W, int MR, int NP>
TileFn<W> pick_np(int np) {
  if constexpr (NP == 0) {
    return nullptr;
  } else {
    return np == NP ? &tile<W, MR, NP> : pick_np<W, MR, NP - 1>(np);
  }
}

template <typename W, int MR>
TileFn<W> pick_mr(int mr, int np) {
  if constexpr (MR == 0) {
    return nullptr;
  } else {
    return mr == MR ? pick_np<W, MR, panels_for(MR)>(np) : pick_mr<W, MR - 1>(mr, np);
  }
}

// Eight sums -> eight output columns at `at` (+ bias, then the one rounding): the scalar
// writer's bits (vec_math.h's bf16_bits8 rounds as c10::BFloat16 does), eight at a time.
inline void write8(__m256 v, const float* bias, int64_t at, const Output& o) {
  if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
  if (o.f32) return _mm256_storeu_ps(static_cast<float*>(o.data) + at, v);
  uint16_t* dst = static_cast<uint16_t*>(o.data) + at;
  if (o.accumulate) v = _mm256_add_ps(pdserve::load8_bf16(dst), pdserve::round_bf16_8(v));
  pdserve::store8_bf16(dst, v);
}

// Sums -> output rows: + bias, then the single rounding (round-to-nearest-even for bfloat16).
// Columns go eight lanes at a time; the last few (under eight, at the weight's end) one by one.
// A scalar writer here took 10% of a 256-token prefill on the avx2 path (the 6 x 16
// tile's 96 sums, each rounded through c10::BFloat16, against 576 to 1536 k steps of FMAs).
void write_tile(const float* acc, int mr, int np, int64_t m0, int64_t col0, const Output& o) {
  const int64_t cols = std::min<int64_t>(np * kPanel, o.n - col0);
  const int64_t vec_cols = cols / 8 * 8;
  for (int r = 0; r < mr; ++r) {
    const float* src = acc + r * np * kPanel;
    const int64_t base = o.at(m0 + r, col0);
    for (int64_t c = 0; c < vec_cols; c += 8)
      write8(_mm256_loadu_ps(src + c), o.bias ? o.bias + col0 + c : nullptr, base + c, o);
    for (int64_t c = vec_cols; c < cols; ++c) {
      const float v = o.bias ? src[c] + o.bias[col0 + c] : src[c];
      c10::BFloat16* out = static_cast<c10::BFloat16*>(o.data) + base + c;
      if (o.f32) static_cast<float*>(o.data)[base + c] = v;
      else if (o.accumulate) *out = c10::BFloat16(static_cast<float>(*out) + static_cast<float>(c10::BFloat16(v)));
      else *out = c10::BFloat16(v);
    }
  }
}

// Panels [p0, p1) for all M rows (AVX2). The first row tile of each group of panels reads
// them from memory (the later ones from L2). With 2 to 6 rows that tile does enough arithmetic
// on each weight byte that, left to the hardware prefetcher, the reads and the FMAs took turns:
// a speculative decode step's 5-row verify (Zen 3, one thread, the default model's 49152 x 576
// head in bfloat16) took 7.9 ms against 4.0 ms for one row. Fetching the next tile's panels
// while this one computes overlaps them: 5.6 ms, and 2 rows 5.6 -> 4.7 ms. One row (six panels
// at once, bound by the reads alone) gained nothing measurable and is left to the hardware.
template <typename W>
void run_panels(const float* x, int64_t M, int64_t K, const W* w, int64_t p0, int64_t p1,
                const Output& o) {
  alignas(32) float acc[kMaxRows * 6 * kPanel];
  for_each_tile(M, p0, p1, kMaxRows, panels_for, K * kPanel * static_cast<int64_t>(sizeof(W)),
                [&](int64_t m0, int mr, int64_t p, int np) {
                  pick_mr<W, kMaxRows>(mr, np)(x + m0 * K, K, w + p * K * kPanel, K, acc, m0 == 0 && mr >= 2);
                  write_tile(acc, mr, np, m0, p * kPanel, o);
                });
}

// bfloat16 -> float32 (exact: the bits shifted into the high half), 8 at a time.
void widen_bf16(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, pdserve::load8_bf16(src + i));
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}

}  // namespace
