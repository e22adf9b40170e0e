// paged_attention.cpp's AVX2 building blocks: loads that widen every dtype exactly to float32,
// the one rounding on the way out, and the fixed reduction trees its bits depend on.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "vec_math.h"

namespace pdserve::attention_avx2 {

// ---- loads: every dtype widens exactly to float32 -------------------------------------------
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) { return pdserve::load8_bf16(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <typename T>
inline void widen_row(const T* src, float* dst, int64_t hd) {
  for (int64_t d = 0; d < hd; d += 8) _mm256_storeu_ps(dst + d, load8(src + d));
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t hd) {
  for (int64_t d = 0; d < hd; ++d) dst[d] = static_cast<T>(src[d]);  // round to nearest even
}
template <>
inline void store_row<float>(const float* src, float* dst, int64_t hd) {
  std::copy(src, src + hd, dst);
}

// ---- fixed reductions ------------------------------------------------------------------------
// 8 accumulators (one per key) -> one vector of their 8 lane sums. Every key gets the same
// tree: ((x0+x4)+(x1+x5)) + ((x2+x6)+(x3+x7)).
inline __m256 reduce8(const __m256* a) {
  __m256 u04 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[4], 0x20), _mm256_permute2f128_ps(a[0], a[4], 0x31));
  __m256 u15 = _mm256_add_ps(_mm256_permute2f128_ps(a[1], a[5], 0x20), _mm256_permute2f128_ps(a[1], a[5], 0x31));
  __m256 u26 = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[6], 0x20), _mm256_permute2f128_ps(a[2], a[6], 0x31));
  __m256 u37 = _mm256_add_ps(_mm256_permute2f128_ps(a[3], a[7], 0x20), _mm256_permute2f128_ps(a[3], a[7], 0x31));
  return _mm256_hadd_ps(_mm256_hadd_ps(u04, u15), _mm256_hadd_ps(u26, u37));
}

inline float hsum(__m256 v) {  // (l0+l4)+(l2+l6) + (l1+l5)+(l3+l7), always this tree
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {  // max is exact: the order does not matter
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace pdserve::attention_avx2
