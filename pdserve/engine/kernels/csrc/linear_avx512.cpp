// The AVX-512 linear kernels (linear_kernels.h): float32 FMA chains over 16 lanes on the
// single-k layout (paths avx512, and float32 weights on avx512_bf16 and amx), and VDPBF16PS
// on the pairs layout (path avx512_bf16).
//
// Invariance (the contract of linear.cpp). Vectors run across output columns, never across
// k; each output element is one accumulator updated in increasing k and never split:
//   FMA kernels:      acc = fma(x[m][k], W[n][k], acc) for k = 0..K-1, exactly the AVX2
//                     kernels' chain, so these give the AVX2 bits with twice the lanes;
//   VDPBF16PS kernel: acc = dpbf16(acc, x[m][2j..2j+1], W[n][2j..2j+1]) for j = 0..ceil(K/2)-1
//                     (a sum of two products per step: not the FMA chain's bits, but the same
//                     bits for a row alone or in any batch, at any thread count).
// Which rows share a tile, and which panels a thread owns, changes no element's chain.
//
// Tiles: up to 8 rows x up to 8 panels, at most 24 zmm accumulators of the 32 registers.
#include "linear_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

#include "panel_loop.h"
#include "write_avx512.h"

namespace {

using pdserve::kPanel;
using pdserve::Output;

constexpr int kRows = 8;
constexpr int panels_for(int rows) { return rows <= 3 ? 8 : rows == 4 ? 6 : rows <= 6 ? 4 : 3; }

// One single-k panel row (16 columns at one k) as float32 lanes in slot order.
inline __m512 panel_row(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 panel_row(const uint16_t* w) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Lane of each column in a bfloat16 single-k panel row (slot 2j: column j, 2j+1: column 8+j).
inline __m512 in_column_order(__m512 v, const uint16_t*) {
  const __m512i lane = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  return _mm512_permutexvar_ps(lane, v);
}
inline __m512 in_column_order(__m512 v, const float*) { return v; }

template <typename W, int MR, int NP>
void fma_tile(const float* x, int64_t K, const W* w, int64_t m0, int64_t p, const Output& o) {
  __m512 acc[MR * NP];
#pragma GCC unroll 32
  for (int i = 0; i < MR * NP; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
#pragma GCC unroll 8
    for (int q = 0; q < NP; ++q) {
      const __m512 wv = panel_row(w + ((p + q) * K + k) * kPanel);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) acc[r * NP + q] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), wv, acc[r * NP + q]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) write_row16(in_column_order(acc[r * NP + q], w), m0 + r, (p + q) * kPanel, o);
}

inline __m512i pair_of(const uint16_t* x) {  // x[0], x[1] broadcast as one 32-bit lane
  int32_t v;
  std::memcpy(&v, x, sizeof v);
  return _mm512_set1_epi32(v);
}

// stride: a panel's pairs in the packed weight (KP, or more where the k read are a block of it).
template <int MR, int NP>
void dp_tile(const uint16_t* x, int64_t ldx, int64_t KP, int64_t stride, const uint16_t* w, int64_t m0, int64_t p,
             const Output& o) {
  __m512 acc[MR * NP];
#pragma GCC unroll 32
  for (int i = 0; i < MR * NP; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < KP; ++j) {
    __m512i xb[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) xb[r] = pair_of(x + r * ldx + 2 * j);
#pragma GCC unroll 8
    for (int q = 0; q < NP; ++q) {
      const __m512i wv = _mm512_loadu_si512(w + ((p + q) * stride + j) * 2 * kPanel);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
        acc[r * NP + q] = _mm512_dpbf16_ps(acc[r * NP + q], (__m512bh)xb[r], (__m512bh)wv);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) write_row16(acc[r * NP + q], m0 + r, (p + q) * kPanel, o);
}

// Compile-time tile shapes chosen at run time: Kern<MR, NP>::run(args...).
template <template <int, int> class Kern, int MR, int NP, typename... A>
void dispatch_np(int np, A... a) {
  if constexpr (NP > 0) {
    if (np == NP) return Kern<MR, NP>::run(a...);
    dispatch_np<Kern, MR, NP - 1>(np, a...);
  }
}

template <template <int, int> class Kern, int MR, typename... A>
void dispatch(int mr, int np, A... a) {
  if constexpr (MR > 0) {
    if (mr == MR) return dispatch_np<Kern, MR, panels_for(MR)>(np, a...);
    dispatch<Kern, MR - 1>(mr, np, a...);
  }
}

template <typename W>
struct Fma {
  template <int MR, int NP>
  struct K {
    static void run(const float* x, int64_t K_, const W* w, int64_t m0, int64_t p, const Output& o) {
      fma_tile<W, MR, NP>(x, K_, w, m0, p, o);
    }
  };
};

template <int MR, int NP>
struct Dp {
  static void run(const uint16_t* x, int64_t ldx, int64_t KP, int64_t stride, const uint16_t* w, int64_t m0,
                  int64_t p, const Output& o) {
    dp_tile<MR, NP>(x, ldx, KP, stride, w, m0, p, o);
  }
};

template <typename W>
void fma_panels(const float* x, int64_t M, int64_t K, const W* w, int64_t p0, int64_t p1, const Output& o) {
  const int64_t panel_bytes = K * kPanel * static_cast<int64_t>(sizeof(W));
  for_each_tile(M, p0, p1, kRows, panels_for, panel_bytes, [&](int64_t m0, int mr, int64_t p, int np) {
    dispatch<Fma<W>::template K, kRows>(mr, np, x + m0 * K, K, w, m0, p, o);
  });
}

}  // namespace

namespace pdserve {

void avx512_panels_f32(const float* x, int64_t M, int64_t K, const float* w, int64_t p0, int64_t p1,
                       const Output& o) {
  fma_panels(x, M, K, w, p0, p1, o);
}

void avx512_panels_bf16(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t p0, int64_t p1,
                        const Output& o) {
  fma_panels(x, M, K, w, p0, p1, o);
}

void dpbf16_panels(const uint16_t* x, int64_t ldx, int64_t M, int64_t KP, const uint16_t* w, int64_t p0,
                   int64_t p1, const Output& o) {
  dpbf16_block(x, ldx, M, KP, KP, w, p0, p1, o);
}

void dpbf16_block(const uint16_t* x, int64_t ldx, int64_t M, int64_t KP, int64_t stride, const uint16_t* w,
                  int64_t p0, int64_t p1, const Output& o) {
  for_each_tile(M, p0, p1, kRows, panels_for, stride * 2 * kPanel * 2, [&](int64_t m0, int mr, int64_t p, int np) {
    dispatch<Dp, kRows>(mr, np, x + m0 * ldx, ldx, KP, stride, w, m0, p, o);
  });
}

}  // namespace pdserve

#pragma GCC pop_options
