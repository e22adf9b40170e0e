// Writing 16 float32 sums of one output row (AVX-512): + bias, then the one rounding to the
// output dtype. Include after `#pragma GCC target(... avx512f, avx512bw ...)`.
//
// The bfloat16 rounding is c10::BFloat16's, lane by lane: NaN -> 0x7FC0, otherwise round to
// nearest even by adding 0x7FFF + the kept low bit. So these writers give the same bits as
// linear.cpp's scalar writer on the AVX2 path.
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

// Row m, columns col0 .. col0 + 15 (those below o.n) from v, whose lane c is column col0 + c.
inline void write_row16(__m512 v, int64_t m, int64_t col0, const pdserve::Output& o) {
  const int64_t cols = std::min<int64_t>(16, o.n - col0);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  if (o.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, o.bias + col0));
  const int64_t at = m * o.n + col0;
  if (o.f32) _mm512_mask_storeu_ps(static_cast<float*>(o.data) + at, mask, v);
  else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(o.data) + at, mask, round_bf16(v));
}

// The same, for many rows of one 16-column panel: the mask and the bias loaded once.
class RowWriter {
 public:
  RowWriter() = default;
  RowWriter(const pdserve::Output& o, int64_t col0) : o_(&o), col0_(col0) {
    const int64_t cols = std::min<int64_t>(16, o.n - col0);
    mask_ = static_cast<__mmask16>((1u << cols) - 1);
    bias_ = o.bias ? _mm512_maskz_loadu_ps(mask_, o.bias + col0) : _mm512_setzero_ps();
  }

  inline void write(const float* sums, int64_t m) const {
    __m512 v = _mm512_load_ps(sums);
    if (o_->bias) v = _mm512_add_ps(v, bias_);
    const int64_t at = m * o_->n + col0_;
    if (o_->f32) _mm512_mask_storeu_ps(static_cast<float*>(o_->data) + at, mask_, v);
    else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(o_->data) + at, mask_, round_bf16(v));
  }

 private:
  const pdserve::Output* o_ = nullptr;
  int64_t col0_ = 0;
  __mmask16 mask_ = 0;
  __m512 bias_ = _mm512_setzero_ps();
};

}  // namespace
