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
#include <torch/library.h>

#include "ops.h"
#include "vec_math.h"

#include <algorithm>
#include <cstdint>

namespace {

using pdserve::exp_nonpositive;
using pdserve::load8_bf16;

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }  // round to nearest even (identity for float)

template <typename T>
void rope_row(const T* x, const T* c, const T* s, int64_t hd, T* out) {
  const int64_t half = hd / 2;
  for (int64_t d = 0; d < hd; ++d) {
    const float rot = d < half ? -static_cast<float>(x[d + half]) : static_cast<float>(x[d - half]);
    const float a = static_cast<float>(round_to<T>(static_cast<float>(x[d]) * static_cast<float>(c[d])));
    const float b = static_cast<float>(round_to<T>(rot * static_cast<float>(s[d])));
    out[d] = round_to<T>(a + b);
  }
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
  alignas(32) float buf[8];
  alignas(32) c10::BFloat16 g8[8], u8[8];
  for (int64_t i = 0; i < n; i += 8) {
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

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be (T, 2 I) bfloat16, got ", gate_up.sizes(), " ", gate_up.scalar_type());
  const auto x = gate_up.contiguous();
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = at::empty({T, I}, x.options());
  const auto* xp = x.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) silu_mul_row(xp + t * 2 * I, xp + t * 2 * I + I, I, op + t * I);
  });
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
