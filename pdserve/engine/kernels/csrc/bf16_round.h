// Rounding float32 probabilities to bfloat16 for the pairs kernels (attention_bf16.cpp,
// attention_amx.cpp). Include inside a GCC target region that enables avx512bf16.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace pdserve {

// 32 bfloat16 at out: p[0, n) rounded to nearest even, exact zeros from n on (n clamped to
// [0, 32]); nothing at or past p + n is read.
inline void round_probabilities32(const float* p, int64_t n, uint16_t* out) {
  n = std::clamp<int64_t>(n, 0, 32);
  const __mmask16 lo = n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1);
  const __mmask16 hi = n >= 32 ? 0xffff : n > 16 ? static_cast<__mmask16>((1u << (n - 16)) - 1) : 0;
  const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, p + 16), _mm512_maskz_loadu_ps(lo, p));
  _mm512_storeu_si512(out, reinterpret_cast<const __m512i&>(both));
}

}  // namespace pdserve
