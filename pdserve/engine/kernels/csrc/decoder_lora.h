// The whole-stack decoder (decoder.cpp) with LoRA adapters (decoder_lora.cpp): the stack's
// loop, and the step's adapters it adds to each projection's output.
#pragma once

#include <ATen/ATen.h>

#include "prefetch_plan.h"

#include <cstddef>
#include <tuple>
#include <vector>

namespace pdserve {

// The projections of a layer, in the order of the per-layer lists' entries.
enum class Projection : int { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };
constexpr size_t kProjections = 4;

// A step's adapters on every layer's four projections, in the form of
// pdserve/engine/lora/kernels.py's PackedLoRA: shrunk = (x A^T) * mask, every token through every
// adapter slot's A at once, its other slots' columns zeroed by its one-hot mask row; then one
// expand per part of the projection (q, k, v; o; gate, up; down) over that part's own rank
// blocks (ExpandPlan's layout) into the part's own output columns. The same calls and roundings
// as PackedLoRA.add, so a step's bits are those of the layer-by-layer path with LoRALinear.
//
// A step of at least ``segment_tokens`` tokens (a prefill) runs per slot instead: the slot's
// tokens gathered, shrunk by that slot's A alone, expanded by each part's block of that slot
// alone. Each output element sums the same nonzero products in the same order and the same
// pairs of k (only terms that are exactly zero are left out, as the per-part expand already
// leaves them), so its bits are the gather-free form's, at a quarter of the multiply-adds with
// four adapters; at decode sizes the kernel calls it adds (one per slot per part) cost more
// than the multiply-adds it saves. A step of under 8 tokens runs its products on the calling
// thread alone (no fork and join of torch's threads for each of its ~330 small kernels; the
// same bits: a chunk's result never depends on the thread that computed it).
//
// On the avx512_bf16 path, with max_lora_rank a multiple of 16, a gather-free step runs its
// products block by block: each slot's tokens through the panels of the packed shrink that
// hold that slot's A (its P R columns fill whole panels), then each part's expand over that
// slot's pairs of k alone (dpbf16_block), straight on the packed kernel with no tensor made.
// The same weights as the gather-free form, read once a step, at a quarter of its
// multiply-adds with four adapters, and the same bits (only exactly-zero terms are left out,
// in the same pairs of k).
class DecoderLoRA {
 public:
  // shrink: L x 4 packed weights (linear_pack; entry 4 l + p for layer l, projection p): every
  // slot's A, ((S-1) P R, in). expand: L x sum(parts) packed weights, layer l's parts in
  // order (q, k, v, o, gate, up, down for a Llama layer): part q's B^T, (out_q, (S-1) W),
  // W = R rounded up to even. shrink_slots, expand_slots: the same, slot by slot (entry
  // e (S-1) + j for slot j of entry e): slot j's A, (P R, in), and part q's block of it, (out_q,
  // W). parts: the 4 projections' part counts P; part_sizes: every part's output width, in the
  // same order; rank: R, the rank blocks' width; mask (T, S-1) or (T, S-1, 1): 1 where a
  // token's adapter is in that slot, else 0, in the activations' dtype; segment_tokens: the
  // step's size from which it runs slot by slot.
  DecoderLoRA(at::TensorList shrink, at::TensorList expand, at::TensorList shrink_slots, at::TensorList expand_slots,
              at::IntArrayRef parts, at::IntArrayRef part_sizes, int64_t rank, const at::Tensor& mask,
              int64_t segment_tokens, size_t layers, int64_t tokens);
  // y (T, out) += the step's LoRA delta of ``projection`` in ``layer`` for its input x (T, in).
  void add(size_t layer, Projection projection, const at::Tensor& x, at::Tensor& y) const;
  // What ``add`` of a gather-free step will read of ``projection`` in ``layer``'s adapter
  // weights (its shrink's, then each part's expand), for the base linear of ``panels`` output
  // panels to prefetch while it runs (prefetch_plan.h); empty in a step run slot by slot,
  // whose products do far more arithmetic per byte.
  PrefetchPlan prefetch(size_t layer, Projection projection, int64_t panels) const;

 private:
  void add_gather_free(size_t layer, size_t projection, const at::Tensor& x, at::Tensor& y) const;
  void add_by_slot(size_t layer, size_t projection, const at::Tensor& x, at::Tensor& y) const;
  void add_block_by_block(size_t layer, size_t projection, const at::Tensor& x, at::Tensor& y) const;

  at::TensorList shrink_, expand_, shrink_slots_, expand_slots_;
  at::IntArrayRef parts_, part_sizes_;
  int64_t rank_, slots_;
  bool by_slot_ = false;
  bool blocks_ = false;  // a gather-free step on avx512_bf16 whose slots' blocks fill whole panels
  size_t parts_per_layer_ = 0;
  size_t first_part_[kProjections] = {};     // each projection's first entry in part_sizes
  std::vector<int64_t> token_slot_;          // each token's slot 0..S-2 from the mask, -1: the base model
  std::vector<std::vector<int64_t>> rows_;   // each slot's tokens, in order; rows_[S-1]: the base model's
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
