// The AVX-512 loops of paged attention's prefill tiles (attention_kernels.h), for every path
// but avx2. They give the AVX2 loops' bits (paged_attention.cpp) with twice the lanes, so the
// kernel may pick either for any work item and a position's result stays the same in decode,
// in a prefill chunk and in a recompute:
//   - a score is ((a0+a4)+(a1+a5)) + ((a2+a6)+(a3+a7)), times the scale, where a_l is the FMA
//     chain q[d] * K[d] over d = l, l+8, l+16, ... in increasing d, from 0: the AVX2 loop's
//     lane l and its reduce8 tree. Here the 16 lanes are 16 keys, so K is read transposed;
//   - out[d] = sum_k p_k * V_k[d], FMA in increasing k from 0: elementwise in d, so the
//     width of the vector changes nothing.
// Two rows at a time share each load of K or V; which rows pair up changes no element's chain.
#include "attention_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")

namespace {

constexpr int64_t LANES = 16;

// Row q's 16 scores against the keys of one transposed block kt (hd, 16), into out.
inline void score_row(const float* q, const float* kt, int64_t hd, __m512 scale, float* out) {
  __m512 a[8];
  for (auto& v : a) v = _mm512_setzero_ps();
  for (int64_t d = 0; d < hd; d += 8)
    for (int l = 0; l < 8; ++l) a[l] = _mm512_fmadd_ps(_mm512_set1_ps(q[d + l]), _mm512_loadu_ps(kt + (d + l) * LANES), a[l]);
  const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[1], a[5])),
                                 _mm512_add_ps(_mm512_add_ps(a[2], a[6]), _mm512_add_ps(a[3], a[7])));
  _mm512_storeu_ps(out, _mm512_mul_ps(s, scale));
}

// Two rows against one block: the same arithmetic per row, each K load used twice.
inline void score_rows2(const float* q0, const float* q1, const float* kt, int64_t hd, __m512 scale, float* out0,
                        float* out1) {
  __m512 a[8], b[8];
  for (int l = 0; l < 8; ++l) a[l] = b[l] = _mm512_setzero_ps();
  for (int64_t d = 0; d < hd; d += 8)
    for (int l = 0; l < 8; ++l) {
      const __m512 k = _mm512_loadu_ps(kt + (d + l) * LANES);
      a[l] = _mm512_fmadd_ps(_mm512_set1_ps(q0[d + l]), k, a[l]);
      b[l] = _mm512_fmadd_ps(_mm512_set1_ps(q1[d + l]), k, b[l]);
    }
  const __m512 s0 = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[1], a[5])),
                                  _mm512_add_ps(_mm512_add_ps(a[2], a[6]), _mm512_add_ps(a[3], a[7])));
  const __m512 s1 = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(b[0], b[4]), _mm512_add_ps(b[1], b[5])),
                                  _mm512_add_ps(_mm512_add_ps(b[2], b[6]), _mm512_add_ps(b[3], b[7])));
  _mm512_storeu_ps(out0, _mm512_mul_ps(s0, scale));
  _mm512_storeu_ps(out1, _mm512_mul_ps(s1, scale));
}

// acc[0, 64) (four vectors of one or two rows) += p[k] * v[k] for k in [k0, k1), in order.
template <int ROWS>
inline void accumulate64(const float* const* p, float* const* acc, const float* v, int64_t hd, int64_t k0, int64_t k1) {
  __m512 a[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm512_loadu_ps(acc[r] + j * LANES);
  for (int64_t k = k0; k < k1; ++k) {
    const float* vr = v + k * hd;
    const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
    const __m512 v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 w = _mm512_set1_ps(p[r][k]);
      a[r][0] = _mm512_fmadd_ps(w, v0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(w, v1, a[r][1]);
      a[r][2] = _mm512_fmadd_ps(w, v2, a[r][2]);
      a[r][3] = _mm512_fmadd_ps(w, v3, a[r][3]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc[r] + j * LANES, a[r][j]);
}

// The same for one vector of 16 columns.
template <int ROWS>
inline void accumulate16(const float* const* p, float* const* acc, const float* v, int64_t hd, int64_t k0, int64_t k1) {
  __m512 a[ROWS];
  for (int r = 0; r < ROWS; ++r) a[r] = _mm512_loadu_ps(acc[r]);
  for (int64_t k = k0; k < k1; ++k) {
    const __m512 vk = _mm512_loadu_ps(v + k * hd);
    for (int r = 0; r < ROWS; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][k]), vk, a[r]);
  }
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(acc[r], a[r]);
}

// Columns [0, hd) of ROWS rows, keys [k0, k1).
template <int ROWS>
inline void accumulate(const float* const* p, float* const* acc, const float* v, int64_t hd, int64_t k0, int64_t k1) {
  int64_t d = 0;
  for (; d + 64 <= hd; d += 64) {
    float* shifted[ROWS];
    for (int r = 0; r < ROWS; ++r) shifted[r] = acc[r] + d;
    accumulate64<ROWS>(p, shifted, v + d, hd, k0, k1);
  }
  for (; d < hd; d += LANES) {
    float* shifted[ROWS];
    for (int r = 0; r < ROWS; ++r) shifted[r] = acc[r] + d;
    accumulate16<ROWS>(p, shifted, v + d, hd, k0, k1);
  }
}

}  // namespace

namespace pdserve::attention512 {

void scores(const float* q, int64_t rows, int64_t hd, const int64_t* first, const int64_t* keys, const float* kt,
            int64_t n_max, int64_t stride, float scale, float* out) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t k0 = first[0] / LANES * LANES; k0 < n_max; k0 += LANES) {
    const float* block = kt + k0 * hd;  // block k0 / 16 of (hd, 16) floats
    auto sees = [&](int64_t r) { return keys[r] > k0 && first[r] < k0 + LANES; };  // a key of this block
    int64_t r = 0;
    while (r < rows) {
      if (!sees(r)) {
        ++r;
      } else if (r + 1 < rows && sees(r + 1)) {
        score_rows2(q + r * hd, q + (r + 1) * hd, block, hd, s, out + r * stride + k0, out + (r + 1) * stride + k0);
        r += 2;
      } else {
        score_row(q + r * hd, block, hd, s, out + r * stride + k0);
        ++r;
      }
    }
  }
}

void weighted_values(const float* p, int64_t stride, int64_t rows, int64_t hd, const int64_t* first,
                     const int64_t* keys, const float* v, float* acc) {
  std::fill(acc, acc + rows * hd, 0.f);
  int64_t r = 0;
  for (; r + 1 < rows; r += 2) {  // keys[r] <= keys[r + 1], first[r] <= first[r + 1]: rows are in query order
    const float* pr[2] = {p + r * stride, p + (r + 1) * stride};
    float* ar[2] = {acc + r * hd, acc + (r + 1) * hd};
    const int64_t both = std::min(keys[r], keys[r + 1]);
    // From row r's first key: row r + 1's weights before its own first are +0 and leave its acc +0.
    accumulate<2>(pr, ar, v, hd, first[r], both);
    const int64_t longer = keys[r] > keys[r + 1] ? 0 : 1;
    accumulate<1>(pr + longer, ar + longer, v, hd, both, keys[r + longer]);
  }
  if (r < rows) {
    const float* pr[1] = {p + r * stride};
    float* ar[1] = {acc + r * hd};
    accumulate<1>(pr, ar, v, hd, first[r], keys[r]);
  }
}

}  // namespace pdserve::attention512

#pragma GCC pop_options
