// Small fused steps of a decoder layer, so a decode step issues a few large calls per layer
// instead of a dozen tiny ones (each tiny ATen op costs more in dispatch and allocation than
// its arithmetic at decode sizes).
//
//   rope_store_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache,
//                 Tensor slot_block, Tensor slot_offset, int num_heads, int num_kv_heads) -> Tensor q
//       qkv (T, (nh + 2 nkv) hd) float32 / bfloat16 / float16 (q | k | v, as the fused
//       projection writes it); cos, sin (T, 1, hd) or (T, hd), same dtype; caches
//       (num_blocks, block_size, nkv, hd) strided views; slot_block, slot_offset (T,) int64.
//       Rotates q and k (rotate-half RoPE), stores the rotated k and v in the cache slots,
//       returns the rotated q (T, nh, hd).
//   silu_mul(Tensor gate_up) -> Tensor
//       gate_up (T, 2 I) bfloat16 -> (T, I) bfloat16 = silu(gate) * up.
//
// Numerics. rope_store_kv computes exactly what transformers' eager ops compute:
// out = round(round(x * cos) + round(rotate_half(x) * sin)), each product and the sum
// rounded to the tensor's dtype, products never fused into an FMA (-ffp-contract=off), so
// float32 stays bitwise equal to transformers. silu_mul rounds silu(gate) to bfloat16 and
// then the product, as F.silu(gate) * up does, with exp_nonpositive (vec_math.h): the
// bits are the same on every machine.
// Both are elementwise per token, so a token's result never depends on its batch.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <cstring>
#include <torch/library.h>

#include "isa.h"
#include "ops.h"
#include "parallel_chunks.h"
#include "vec_math.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

namespace {

using pdserve::exp_nonpositive;
using pdserve::load8_bf16;

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }  // round to nearest even (identity for float)

template <typename T>
void rope_row_scalar(const T* x, const T* c, const T* s, int64_t hd, T* out) {
  const int64_t half = hd / 2;
  for (int64_t d = 0; d < hd; ++d) {
    const float rot = d < half ? -static_cast<float>(x[d + half]) : static_cast<float>(x[d - half]);
    const float a = static_cast<float>(round_to<T>(static_cast<float>(x[d]) * static_cast<float>(c[d])));
    const float b = static_cast<float>(round_to<T>(rot * static_cast<float>(s[d])));
    out[d] = round_to<T>(a + b);
  }
}

// The same three roundings eight lanes at a time, for the dtypes the engine runs (float32:
// rounding is the identity; bfloat16: as c10 rounds). head_dim is a multiple of 16 here, so
// the rotated half is whole vectors.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) { return load8_bf16(p); }
inline __m256 rounded(__m256 v, const float*) { return v; }
inline __m256 rounded(__m256 v, const c10::BFloat16*) { return pdserve::round_bf16_8(v); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) { pdserve::store8_bf16(p, v); }

template <typename T>
void rope_row(const T* x, const T* c, const T* s, int64_t hd, T* out) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    if (hd % 16 == 0) {
      const int64_t half = hd / 2;
      const __m256 sign = _mm256_set1_ps(-0.0f);
      for (int64_t d = 0; d < hd; d += 8) {
        const __m256 rot = d < half ? _mm256_xor_ps(load8(x + d + half), sign) : load8(x + d - half);
        const __m256 a = rounded(_mm256_mul_ps(load8(x + d), load8(c + d)), x);
        const __m256 b = rounded(_mm256_mul_ps(rot, load8(s + d)), x);
        store8(out + d, _mm256_add_ps(a, b));
      }
      return;
    }
  }
  rope_row_scalar(x, c, s, hd, out);
}

template <typename T>
void rope_store_kv_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& slot_block, const at::Tensor& slot_offset,
                        int64_t nh, int64_t nkv, at::Tensor& q_out) {
  const int64_t ntok = qkv.size(0), hd = k_cache.size(3), width = qkv.size(1);
  const T* src = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t* blk = slot_block.data_ptr<int64_t>();
  const int64_t* off = slot_offset.data_ptr<int64_t>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const auto ks = k_cache.strides(), vs = v_cache.strides();
  T* q = q_out.data_ptr<T>();
  at::parallel_for(0, ntok, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* row = src + t * width;
      const T* c = cp + t * hd;
      const T* s = sp + t * hd;
      for (int64_t h = 0; h < nh; ++h) rope_row(row + h * hd, c, s, hd, q + (t * nh + h) * hd);
      T* kdst = kc + blk[t] * ks[0] + off[t] * ks[1];
      T* vdst = vc + blk[t] * vs[0] + off[t] * vs[1];
      for (int64_t h = 0; h < nkv; ++h) {
        rope_row(row + (nh + h) * hd, c, s, hd, kdst + h * ks[2]);
        const T* v = row + (nh + nkv + h) * hd;
        T* vd = vdst + h * vs[2];
        for (int64_t d = 0; d < hd; ++d) vd[d] = v[d];
      }
    }
  });
}

}  // namespace

namespace pdserve {

at::Tensor rope_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                         at::Tensor v_cache, const at::Tensor& slot_block, const at::Tensor& slot_offset,
                         int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "rope_store_kv: qkv must be contiguous (T, width)");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "rope_store_kv: caches must be (blocks, block_size, nkv, hd)");
  const int64_t T = qkv.size(0), hd = k_cache.size(3);
  TORCH_CHECK(hd % 2 == 0 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && k_cache.size(2) == num_kv_heads,
              "rope_store_kv: cache rows must be contiguous, with num_kv_heads heads of an even head_dim");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * hd, "rope_store_kv: qkv width ", qkv.size(1),
              " is not (num_heads + 2 num_kv_heads) * head_dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * hd && sin.numel() == T * hd,
              "rope_store_kv: cos and sin must be contiguous (T, 1, head_dim)");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() &&
                  k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "rope_store_kv: qkv, cos, sin and the caches must share one dtype");
  TORCH_CHECK(slot_block.scalar_type() == at::kLong && slot_offset.scalar_type() == at::kLong &&
                  slot_block.numel() == T && slot_offset.numel() == T && slot_block.is_contiguous() &&
                  slot_offset.is_contiguous(), "rope_store_kv: slot_block and slot_offset must be (T,) int64");
  auto q = at::empty({T, num_heads, hd}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_store_kv", [&] {
    rope_store_kv_impl<scalar_t>(qkv, cos, sin, k_cache, v_cache, slot_block, slot_offset, num_heads,
                                 num_kv_heads, q);
  });
  return q;
}

namespace {

// silu(g) = g / (1 + e^-g); written with e = exp(-|g|) <= 1 so nothing overflows:
// g >= 0: g / (1 + e);  g < 0: g e / (1 + e).
inline __m256 silu8(__m256 g) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 e = exp_nonpositive(_mm256_or_ps(g, sign));  // exp(-|g|)
  const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), e);
  const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), neg);
  return _mm256_div_ps(num, den);
}

inline float bf16_round(float v) { return static_cast<float>(c10::BFloat16(v)); }

void silu_mul_row(const c10::BFloat16* gate, const c10::BFloat16* up, int64_t n, c10::BFloat16* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)  // both roundings in vector form (store8_bf16 rounds as c10 does)
    pdserve::store8_bf16(out + i, _mm256_mul_ps(pdserve::round_bf16_8(silu8(load8_bf16(gate + i))),
                                                load8_bf16(up + i)));
  alignas(32) float buf[8];
  alignas(32) c10::BFloat16 g8[8], u8[8];
  for (; i < n; i += 8) {
    const int64_t w = std::min<int64_t>(8, n - i);
    const c10::BFloat16* gp = gate + i;
    const c10::BFloat16* upp = up + i;
    if (w < 8) {  // the tail: pad with zeros (silu(0) = 0), write back only w lanes
      for (int64_t j = 0; j < 8; ++j) {
        g8[j] = j < w ? gate[i + j] : c10::BFloat16(0.0f);
        u8[j] = j < w ? up[i + j] : c10::BFloat16(0.0f);
      }
      gp = g8;
      upp = u8;
    }
    _mm256_store_ps(buf, silu8(load8_bf16(gp)));
    for (int64_t j = 0; j < w; ++j) out[i + j] = c10::BFloat16(bf16_round(buf[j]) * static_cast<float>(upp[j]));
  }
}

}  // namespace

// The same row sixteen lanes at a time (paths with AVX-512): every operation is elementwise
// and the same IEEE operation as above (the exp polynomial, the division, both roundings as
// c10 rounds), so the bits are the AVX2 loop's.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace {

inline __m512 exp_nonpositive16(__m512 x) {  // vec_math.h's exp_nonpositive, 16 lanes
  const __m512 lo = _mm512_set1_ps(-87.33654f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

inline __m512 load16_bf16(const void* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline __m512i bf16_bits16(__m512 v) {  // c10's rounding: NaN -> 0x7FC0, else to nearest even
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

inline __m512 silu16(__m512 g) {  // silu8, 16 lanes
  const __m512 e = exp_nonpositive16(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(g),
                                                                         _mm512_set1_epi32(INT32_MIN))));
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
  const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_div_ps(_mm512_mask_mul_ps(g, neg, g, e), den);
}

// Columns [0, n - n % 16) of one row; returns how many it wrote.
int64_t silu_mul_row16(const c10::BFloat16* gate, const c10::BFloat16* up, int64_t n, c10::BFloat16* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(silu16(load16_bf16(gate + i))), 16));
    const __m512i r = bf16_bits16(_mm512_mul_ps(s, load16_bf16(up + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(r));
  }
  return i;
}

}  // namespace
#pragma GCC pop_options

namespace {

// Rows of silu(gate) * up as chunks (parallel_chunks.h), holding a reference on what they read
// (a stolen helper may still run after the call returned, borrow_pool.h).
struct SiluMulChunks final : ChunkKernel {
  at::Tensor x;
  int64_t I = 0;
  bool wide = false;

  void compute(int64_t b, int64_t e, void* out) const override {
    const auto* xp = x.const_data_ptr<at::BFloat16>();
    auto* op = static_cast<c10::BFloat16*>(out);
    for (int64_t t = b; t < e; ++t) {
      const c10::BFloat16 *gate = xp + t * 2 * I, *up = gate + I;
      const int64_t done = wide ? silu_mul_row16(gate, up, I, op + t * I) : 0;
      silu_mul_row(gate + done, up + done, I - done, op + t * I + done);
    }
  }
  void copy(int64_t b, int64_t e, const void* from, void* to) const override {
    std::memcpy(static_cast<c10::BFloat16*>(to) + b * I, static_cast<const c10::BFloat16*>(from) + b * I,
                (e - b) * I * sizeof(c10::BFloat16));
  }
  int64_t out_bytes() const override { return x.size(0) * I * 2; }
};

}  // namespace

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be (T, 2 I) bfloat16, got ", gate_up.sizes(), " ", gate_up.scalar_type());
  SiluMulChunks c;
  c.x = gate_up.contiguous();
  c.I = c.x.size(1) / 2;
  c.wide = current_isa() != Isa::kAvx2;
  const int64_t T = c.x.size(0);
  auto out = at::empty({T, c.I}, c.x.options());
  parallel_kernel(T, 16, std::move(c), out.data_ptr());
  return out;
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("rope_store_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_block, Tensor slot_offset, int num_heads, int num_kv_heads) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("rope_store_kv", &pdserve::rope_store_kv);
  m.impl("silu_mul", &pdserve::silu_mul);
}
