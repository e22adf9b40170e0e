// Writing 16 float32 sums of one output row (AVX-512): + bias, then the one rounding to the
// output dtype. Include after `#pragma GCC target(... avx512f, avx512bw ...)`.
//
// The bfloat16 rounding is c10::BFloat16's, lane by lane: NaN -> 0x7FC0, otherwise round to
// nearest even by adding 0x7FFF + the kept low bit. So these writers give the same bits as
// the AVX2 path's writer (linear_avx2.h, write_tile).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "linear_kernels.h"

namespace {

inline __m256i round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// bfloat16 bits (16 lanes) -> float32, exactly.
inline __m512 widen_bf16x16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Output::accumulate: old + the rounded sums, rounded again (16 lanes; `mask`: the real ones).
inline __m256i accumulate_bf16(__m256i rounded, const uint16_t* dst, __mmask16 mask) {
  const __m512 old = widen_bf16x16(_mm256_maskz_loadu_epi16(mask, dst));
  return round_bf16(_mm512_add_ps(old, widen_bf16x16(rounded)));
}

// Row m, columns col0 .. col0 + 15 (those below o.n) from v, whose lane c is column col0 + c.
inline void write_row16(__m512 v, int64_t m, int64_t col0, const pdserve::Output& o) {
  const int64_t cols = std::min<int64_t>(16, o.n - col0);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  if (o.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, o.bias + col0));
  const int64_t at = o.at(m, col0);
  if (o.f32) {
    _mm512_mask_storeu_ps(static_cast<float*>(o.data) + at, mask, v);
    return;
  }
  uint16_t* dst = static_cast<uint16_t*>(o.data) + at;
  const __m256i rounded = round_bf16(v);
  _mm256_mask_storeu_epi16(dst, mask, o.accumulate ? accumulate_bf16(rounded, dst, mask) : rounded);
}

// Rows of two adjacent panels (32 columns, one 64-byte line of bfloat16) written together:
// one store a row instead of two. The second panel may be absent (an odd panel at the end).
class PanelPairWriter {
 public:
  PanelPairWriter() = default;
  PanelPairWriter(const pdserve::Output& o, int64_t col0, int panels) : o_(&o), col0_(col0) {
    const int64_t cols = std::min<int64_t>(16 * panels, o.n - col0);
    mask32_ = cols >= 32 ? ~0u : (1u << cols) - 1;
    lo_ = static_cast<__mmask16>(mask32_ & 0xFFFF), hi_ = static_cast<__mmask16>(mask32_ >> 16);
    bias_lo_ = o.bias ? _mm512_maskz_loadu_ps(lo_, o.bias + col0) : _mm512_setzero_ps();
    bias_hi_ = o.bias && hi_ ? _mm512_maskz_loadu_ps(hi_, o.bias + col0 + 16) : _mm512_setzero_ps();
  }

  // lo: sums of the first panel's row; hi: the second's (null when there is none).
  inline void write(const float* lo, const float* hi, int64_t m) const {
    __m512 a = _mm512_load_ps(lo);
    __m512 b = hi ? _mm512_load_ps(hi) : _mm512_setzero_ps();
    if (o_->bias) a = _mm512_add_ps(a, bias_lo_), b = _mm512_add_ps(b, bias_hi_);
    const int64_t at = o_->at(m, col0_);
    if (o_->f32) {
      float* dst = static_cast<float*>(o_->data) + at;
      _mm512_mask_storeu_ps(dst, lo_, a);
      if (hi_) _mm512_mask_storeu_ps(dst + 16, hi_, b);
      return;
    }
    uint16_t* dst = static_cast<uint16_t*>(o_->data) + at;
    __m256i ra = round_bf16(a), rb = round_bf16(b);
    if (o_->accumulate) ra = accumulate_bf16(ra, dst, lo_), rb = hi_ ? accumulate_bf16(rb, dst + 16, hi_) : rb;
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(ra), rb, 1);
    _mm512_mask_storeu_epi16(dst, mask32_, both);
  }

 private:
  const pdserve::Output* o_ = nullptr;
  int64_t col0_ = 0;
  __mmask32 mask32_ = 0;
  __mmask16 lo_ = 0, hi_ = 0;
  __m512 bias_lo_ = _mm512_setzero_ps(), bias_hi_ = _mm512_setzero_ps();
};

}  // namespace
