// The whole-stack decoder (decoder.cpp) with LoRA adapters (decoder_lora.cpp): the stack's
// loop, and the step's adapters it adds to each projection's output.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <tuple>

namespace pdserve {

// The projections of a layer, in the order of the per-layer lists' entries.
enum class Projection : int { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };
constexpr size_t kProjections = 4;

// A step's adapters on every layer's four projections, in the gather-free form of
// pdserve/engine/lora/kernels.py's PackedLoRA: y += ((x A^T) * mask) B, every token through every
// adapter slot's A at once, its other slots' columns zeroed by its one-hot mask row, then through
// every slot's B at once. The same calls and roundings as PackedLoRA.add, so a step's bits are
// those of the layer-by-layer path with LoRALinear.
class DecoderLoRA {
 public:
  // shrink, expand: L x 4 packed weights (linear_pack; entry 4 l + p for layer l, projection p):
  // every slot's A, ((S-1) PR, in), and every slot's B, (out, (S-1) PR); shrink_widths: the
  // four projections' (S-1) PR; mask (T, S-1) or (T, S-1, 1): 1 where a token's adapter is in
  // that slot, else 0, in the activations' dtype.
  DecoderLoRA(at::TensorList shrink, at::TensorList expand, at::IntArrayRef shrink_widths, const at::Tensor& mask,
              size_t layers, int64_t tokens);
  // y (T, out) += the step's LoRA delta of ``projection`` in ``layer`` for its input x (T, in).
  void add(size_t layer, Projection projection, const at::Tensor& x, at::Tensor& y) const;

 private:
  at::TensorList shrink_, expand_;
  at::IntArrayRef shrink_widths_;
  at::Tensor mask_;  // (T, S-1), contiguous
};

// decoder_layers (decoder.cpp), with ``lora``'s deltas added after each projection when it is
// not null.
std::tuple<at::Tensor, at::Tensor> decoder_stack(
    const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, at::TensorList input_norm,
    at::TensorList qkv, const c10::List<c10::optional<at::Tensor>>& qkv_bias, at::TensorList o,
    at::TensorList post_norm, at::TensorList gate_up, at::TensorList down, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& slot_block, const at::Tensor& slot_offset,
    const at::Tensor& block_tables, const at::Tensor& cu_query_lens, const at::Tensor& context_lens,
    at::IntArrayRef widths, int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
    const DecoderLoRA* lora);

}  // namespace pdserve
