// The whole bfloat16 decoder stack with a step's LoRA adapters, in one call (decoder.cpp's
// loop), so a step that mixes adapters pays Python's dispatch once, as a base step does.
//
//   decoder_layers_lora(<decoder_layers' arguments>, Tensor[] lora_shrink, Tensor[] lora_expand,
//                       int[] lora_widths, Tensor lora_mask) -> (Tensor, Tensor)
//       lora_shrink, lora_expand: 4 entries per layer (layer l's q|k|v, o, gate|up, down at
//       4 l + 0..3), each projection's adapter slots packed by linear_pack: every slot's A
//       stacked, ((S-1) PR, in), and every slot's B^T, (out, (S-1) PR) (a LoRALinear's
//       ``packed_a`` and ``packed_b``); lora_widths: the four projections' (S-1) PR;
//       lora_mask (T, S-1, 1) bfloat16, the step's one-hot of each token's slot (LoRAState.mask).
//
// Each projection's output y gets, in place, exactly what PackedLoRA.add
// (pdserve/engine/lora/kernels.py) adds on the layer-by-layer path:
//   shrunk = linear(x, A)                  (T, (S-1) PR) bfloat16
//   shrunk = bf16(shrunk * mask)           each token's other slots' columns zeroed
//   y      = bf16(y + linear(shrunk, B))   the expand, rounded to bfloat16, then the add
// with the same kernels (so the same kernel path and its bits), and the mask and the add
// rounded as torch rounds bfloat16 (float32 arithmetic, then to nearest even): the result is
// bitwise the layer-by-layer one (tests/engine/test_lora_stack.py), and a token's delta does
// not depend on its batch, as the packed kernels' rows do not.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "decoder_lora.h"
#include "ops.h"
#include "vec_math.h"

#include <cstdint>

namespace {

// x (n,) bfloat16 += d (n,) bfloat16, each sum in float32 rounded once to bfloat16 (as torch's
// bfloat16 add_ rounds), eight lanes at a time; the bits of c10's scalar form.
void add_bf16(c10::BFloat16* y, const c10::BFloat16* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) pdserve::store8_bf16(y + i, _mm256_add_ps(pdserve::load8_bf16(y + i),
                                                                       pdserve::load8_bf16(d + i)));
  for (; i < n; ++i) y[i] = c10::BFloat16(static_cast<float>(y[i]) + static_cast<float>(d[i]));
}

// shrunk (T, S1 * pr) bfloat16: each slot block of a token's row times its mask entry (1 or 0),
// rounded as torch's bfloat16 multiply rounds (exact here: v * 1 = v, v * 0 = a signed zero).
void mask_slots(c10::BFloat16* shrunk, const c10::BFloat16* mask, int64_t T, int64_t S1, int64_t pr) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < S1; ++j) {
      const float m = static_cast<float>(mask[t * S1 + j]);
      c10::BFloat16* block = shrunk + (t * S1 + j) * pr;
      for (int64_t r = 0; r < pr; ++r) block[r] = c10::BFloat16(static_cast<float>(block[r]) * m);
    }
}

}  // namespace

namespace pdserve {

DecoderLoRA::DecoderLoRA(at::TensorList shrink, at::TensorList expand, at::IntArrayRef shrink_widths,
                         const at::Tensor& mask, size_t layers, int64_t tokens)
    : shrink_(shrink), expand_(expand), shrink_widths_(shrink_widths) {
  TORCH_CHECK(shrink.size() == layers * kProjections && expand.size() == layers * kProjections,
              "decoder_layers_lora: lora_shrink and lora_expand need 4 entries per layer (", layers * kProjections,
              "), got ", shrink.size(), " and ", expand.size());
  TORCH_CHECK(shrink_widths.size() == kProjections, "decoder_layers_lora: lora_widths must be the 4 projections' "
              "(S-1) PR, got ", shrink_widths.size(), " entries");
  TORCH_CHECK(mask.scalar_type() == at::kBFloat16 && mask.dim() >= 2 && mask.size(0) == tokens &&
                  mask.numel() == tokens * mask.size(1),
              "decoder_layers_lora: lora_mask must be (T, S-1) or (T, S-1, 1) bfloat16 with T=", tokens,
              ", got ", mask.sizes(), " ", mask.scalar_type());
  const int64_t slots = mask.size(1);
  for (size_t p = 0; p < kProjections; ++p)
    TORCH_CHECK(slots > 0 && shrink_widths[p] % slots == 0, "decoder_layers_lora: lora_widths[", p, "]=",
                shrink_widths[p], " is not a multiple of the mask's ", slots, " slots");
  mask_ = mask.reshape({tokens, slots}).contiguous();
}

void DecoderLoRA::add(size_t layer, Projection projection, const at::Tensor& x, at::Tensor& y) const {
  const size_t p = static_cast<size_t>(projection), entry = layer * kProjections + p;
  const int64_t T = x.size(0), S1 = mask_.size(1), width = shrink_widths_[p];
  at::Tensor shrunk = linear(x, shrink_[entry], width, c10::nullopt, false);  // (T, (S-1) PR)
  mask_slots(shrunk.data_ptr<at::BFloat16>(), mask_.data_ptr<at::BFloat16>(), T, S1, width / S1);
  const at::Tensor delta = linear(shrunk, expand_[entry], y.size(1), c10::nullopt, false);  // (T, out)
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == at::kBFloat16, "decoder_layers_lora: a projection's output "
              "must be contiguous bfloat16");
  add_bf16(y.data_ptr<at::BFloat16>(), delta.data_ptr<at::BFloat16>(), y.numel());
}

std::tuple<at::Tensor, at::Tensor> decoder_layers_lora(
    const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, at::TensorList input_norm,
    at::TensorList qkv, const c10::List<c10::optional<at::Tensor>>& qkv_bias, at::TensorList o,
    at::TensorList post_norm, at::TensorList gate_up, at::TensorList down, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& slot_block, const at::Tensor& slot_offset,
    const at::Tensor& block_tables, const at::Tensor& cu_query_lens, const at::Tensor& context_lens,
    at::IntArrayRef widths, int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
    at::TensorList lora_shrink, at::TensorList lora_expand, at::IntArrayRef lora_widths, const at::Tensor& lora_mask) {
  const DecoderLoRA lora(lora_shrink, lora_expand, lora_widths, lora_mask, input_norm.size(), h.size(0));
  return decoder_stack(h, cos, sin, input_norm, qkv, qkv_bias, o, post_norm, gate_up, down, k_caches, v_caches,
                       slot_block, slot_offset, block_tables, cu_query_lens, context_lens, widths, num_heads,
                       num_kv_heads, eps, scale, &lora);
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("decoder_layers_lora(Tensor h, Tensor cos, Tensor sin, Tensor[] input_norm, Tensor[] qkv, "
        "Tensor?[] qkv_bias, Tensor[] o, Tensor[] post_norm, Tensor[] gate_up, Tensor[] down, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slot_block, Tensor slot_offset, Tensor block_tables, "
        "Tensor cu_query_lens, Tensor context_lens, int[] widths, int num_heads, int num_kv_heads, float eps, "
        "float scale, Tensor[] lora_shrink, Tensor[] lora_expand, int[] lora_widths, Tensor lora_mask) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("decoder_layers_lora", &pdserve::decoder_layers_lora); }
