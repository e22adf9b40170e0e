// The whole bfloat16 decoder stack with a step's LoRA adapters, in one call (decoder.cpp's
// loop), so a step that mixes adapters pays Python's dispatch once, as a base step does.
//
//   decoder_layers_lora(<decoder_layers' arguments>, Tensor[] lora_shrink, Tensor[] lora_expand,
//                       Tensor[] lora_shrink_slots, Tensor[] lora_expand_slots, int[] lora_parts,
//                       int[] lora_part_sizes, int lora_rank, Tensor lora_mask,
//                       int lora_segment_tokens) -> (Tensor, Tensor)
//       lora_shrink: 4 entries per layer (layer l's q|k|v, o, gate|up, down at 4 l + 0..3),
//       each projection's adapter slots' A stacked, ((S-1) P R, in), packed by linear_pack (a
//       LoRALinear's ``packed_a``); lora_expand: one entry per part, layer by layer (q, k, v,
//       o, gate, up, down for a Llama layer), part q's B^T in ExpandPlan's layout,
//       (out_q, (S-1) W) (``packed_b``); lora_parts: the 4 projections' part counts P;
//       lora_part_sizes: each part's output width; lora_rank: R (max_lora_rank);
//       lora_mask (T, S-1, 1) bfloat16, the step's one-hot of each token's slot (LoRAState.mask);
//       lora_shrink_slots, lora_expand_slots: the same weights slot by slot (``packed_a_slots``,
//       ``packed_b_slots``), for a step of lora_segment_tokens tokens or more (0: never), which
//       runs slot by slot with the same bits (decoder_lora.h). The lists of the form a step
//       does not run may be empty.
//
// Each projection's output y gets, in place, exactly what PackedLoRA.add
// (pdserve/engine/lora/kernels.py) adds on the layer-by-layer path:
//   shrunk = linear(x, A)                          (T, (S-1) P R) bfloat16
//   in_q   = the token's own slot's R columns of part q, placed as ExpandPlan places them
//            ((S-1) W wide, zeros elsewhere: the mask's work, since a masked value is v * 1
//            or a zero)
//   y[:, part q's columns] = bf16(y + bf16(linear(in_q, B_q)))   for each part q
// with the same kernels (so the same kernel path and its bits), and the add rounded as torch
// rounds bfloat16 (float32 arithmetic, then to nearest even), done as the expand writes its
// sums (linear_add_into, no delta tensor between): the result is bitwise the
// layer-by-layer one (tests/engine/test_lora_stack.py), and a token's delta does not depend on
// its batch, as the packed kernels' rows do not.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "decoder_lora.h"
#include "isa.h"
#include "linear_kernels.h"
#include "ops.h"
#include "parallel_chunks.h"
#include "vec_math.h"

#include <cstdint>
#include <cstring>

namespace {

// x (n,) bfloat16 += d (n,) bfloat16, each sum in float32 rounded once to bfloat16 (as torch's
// bfloat16 add_ rounds), eight lanes at a time; the bits of c10's scalar form.
void add_bf16(c10::BFloat16* y, const c10::BFloat16* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) pdserve::store8_bf16(y + i, _mm256_add_ps(pdserve::load8_bf16(y + i),
                                                                       pdserve::load8_bf16(d + i)));
  for (; i < n; ++i) y[i] = c10::BFloat16(static_cast<float>(y[i]) + static_cast<float>(d[i]));
}

// One part's expand input (T, S1 W) from the shrink's output (T, S1 PR): a token's row is its
// slot j's R columns of the part (from j PR + first) at j W + (j PR + first) mod 2, zeros
// elsewhere (a base token's row is all zeros).
void gather_part(const uint16_t* shrunk, const int64_t* token_slot, int64_t T, int64_t S1, int64_t PR,
                 int64_t first, int64_t R, int64_t W, uint16_t* out) {
  for (int64_t t = 0; t < T; ++t) {
    uint16_t* row = out + t * S1 * W;
    std::memset(row, 0, S1 * W * sizeof(uint16_t));
    const int64_t j = token_slot[t];
    if (j < 0) continue;
    const int64_t source = j * PR + first;
    std::memcpy(row + j * W + source % 2, shrunk + t * S1 * PR + source, R * sizeof(uint16_t));
  }
}

// A step of fewer tokens runs its LoRA products on the calling thread alone (SerialKernels):
// served, with two workers' threads on two cores, a mixed decode step of 1-4 rows took 28.2 ms
// with the products split over torch's threads and 22.8 ms without (the base model's: 21.5),
// while one of 15-16 rows took 39.4 ms without against 37.8 with (BENCHMARKS.md, "Where the
// served gap goes"). The threshold lies between the two measured sizes. Bits do not move:
// which thread computes a chunk never changes a result.
constexpr int64_t kSerialTokens = 8;

}  // namespace

namespace pdserve {

DecoderLoRA::DecoderLoRA(at::TensorList shrink, at::TensorList expand, at::TensorList shrink_slots,
                         at::TensorList expand_slots, at::IntArrayRef parts, at::IntArrayRef part_sizes, int64_t rank,
                         const at::Tensor& mask, int64_t segment_tokens, size_t layers, int64_t tokens)
    : shrink_(shrink), expand_(expand), shrink_slots_(shrink_slots), expand_slots_(expand_slots), parts_(parts),
      part_sizes_(part_sizes), rank_(rank) {
  TORCH_CHECK(parts.size() == kProjections, "decoder_layers_lora: lora_parts must be the 4 projections' part "
              "counts, got ", parts.size(), " entries");
  for (size_t p = 0; p < kProjections; ++p) {
    TORCH_CHECK(parts[p] >= 1, "decoder_layers_lora: lora_parts[", p, "]=", parts[p], " must be at least 1");
    first_part_[p] = parts_per_layer_;
    parts_per_layer_ += static_cast<size_t>(parts[p]);
  }
  TORCH_CHECK(part_sizes.size() == parts_per_layer_, "decoder_layers_lora: lora_part_sizes needs one width per "
              "part (", parts_per_layer_, "), got ", part_sizes.size());
  TORCH_CHECK(rank >= 1, "decoder_layers_lora: lora_rank must be at least 1, got ", rank);
  TORCH_CHECK(mask.scalar_type() == at::kBFloat16 && mask.dim() >= 2 && mask.size(0) == tokens &&
                  mask.numel() == tokens * mask.size(1) && mask.size(1) > 0,
              "decoder_layers_lora: lora_mask must be (T, S-1) or (T, S-1, 1) bfloat16 with T=", tokens,
              ", got ", mask.sizes(), " ", mask.scalar_type());
  slots_ = mask.size(1);
  const size_t S1 = static_cast<size_t>(slots_);
  by_slot_ = segment_tokens > 0 && tokens >= segment_tokens;
  // Only the form the step runs needs its weights; the other's lists may come empty (LoRAStack
  // passes them so: some 1,300 tensors a decode step less for Python to hand over).
  const size_t shrinks = layers * kProjections, expands = layers * parts_per_layer_;
  TORCH_CHECK((by_slot_ && shrink.empty() && expand.empty()) || (shrink.size() == shrinks &&
                  expand.size() == expands),
              "decoder_layers_lora: lora_shrink needs 4 entries per layer (", shrinks, ") and lora_expand one per "
              "part (", expands, "), or both empty in a step run slot by slot; got ", shrink.size(), " and ",
              expand.size());
  TORCH_CHECK((!by_slot_ && shrink_slots.empty() && expand_slots.empty()) ||
                  (shrink_slots.size() == shrinks * S1 && expand_slots.size() == expands * S1),
              "decoder_layers_lora: lora_shrink_slots and lora_expand_slots need ", S1, " entries (one per slot) for "
              "each of lora_shrink's and lora_expand's (", shrinks * S1, " and ", expands * S1, "), or both empty "
              "in a step run gather-free; got ", shrink_slots.size(), " and ", expand_slots.size());
  blocks_ = !by_slot_ && current_isa() == Isa::kAvx512Bf16 && rank % kPanel == 0;
  const at::Tensor flat = mask.reshape({tokens, slots_}).contiguous();
  const auto* m = flat.data_ptr<at::BFloat16>();
  token_slot_.assign(static_cast<size_t>(tokens), -1);
  rows_.assign(S1 + 1, {});
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < slots_; ++j) {
      const float v = static_cast<float>(m[t * slots_ + j]);
      TORCH_CHECK(v == 0.0f || (v == 1.0f && token_slot_[t] < 0), "decoder_layers_lora: lora_mask row ", t,
                  " must be one-hot (a 1 in at most one slot, else 0), got ", v, " in slot ", j);
      if (v == 1.0f) token_slot_[t] = j;
    }
    rows_[token_slot_[t] < 0 ? S1 : static_cast<size_t>(token_slot_[t])].push_back(t);
  }
}

void DecoderLoRA::add(size_t layer, Projection projection, const at::Tensor& x, at::Tensor& y) const {
  const size_t p = static_cast<size_t>(projection);
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == at::kBFloat16 && y.size(0) == x.size(0),
              "decoder_layers_lora: a projection's output must be contiguous bfloat16 with a row per token");
  int64_t width = 0;
  for (int64_t q = 0; q < parts_[p]; ++q) width += part_sizes_[first_part_[p] + q];
  TORCH_CHECK(width == y.size(1), "decoder_layers_lora: lora_part_sizes of projection ", p, " sum to ", width,
              ", its output has ", y.size(1), " columns");
  if (by_slot_) {
    add_by_slot(layer, p, x, y);
  } else {
    const SerialKernels serial(x.size(0) < kSerialTokens);
    if (blocks_ && x.size(1) % 2 == 0) {
      add_block_by_block(layer, p, x, y);
    } else {
      add_gather_free(layer, p, x, y);
    }
  }
}

PrefetchPlan DecoderLoRA::prefetch(size_t layer, Projection projection, int64_t panels) const {
  PrefetchPlan plan;
  if (by_slot_) return plan;
  const size_t p = static_cast<size_t>(projection);
  const at::Tensor& a = shrink_[layer * kProjections + p];
  plan.add(a.const_data_ptr(), static_cast<int64_t>(a.nbytes()));
  for (int64_t q = 0; q < parts_[p]; ++q) {
    const at::Tensor& b = expand_[layer * parts_per_layer_ + first_part_[p] + static_cast<size_t>(q)];
    plan.add(b.const_data_ptr(), static_cast<int64_t>(b.nbytes()));
  }
  plan.panels = panels;
  return plan;
}

void DecoderLoRA::add_gather_free(size_t layer, size_t p, const at::Tensor& x, at::Tensor& y) const {
  const int64_t T = x.size(0), P = parts_[p], R = rank_, PR = P * R, W = R + R % 2, S1 = slots_;
  const at::Tensor shrunk = linear(x, shrink_[layer * kProjections + p], S1 * PR, c10::nullopt, false);
  at::Tensor part_in = at::empty({T, S1 * W}, shrunk.options());
  auto* out = reinterpret_cast<uint16_t*>(part_in.data_ptr<at::BFloat16>());
  const auto* in = reinterpret_cast<const uint16_t*>(shrunk.data_ptr<at::BFloat16>());
  int64_t column = 0;
  for (int64_t q = 0; q < P; ++q) {
    const size_t entry = first_part_[p] + static_cast<size_t>(q);
    const int64_t size = part_sizes_[entry];
    gather_part(in, token_slot_.data(), T, S1, PR, q * R, R, W, out);
    linear_add_into(part_in, expand_[layer * parts_per_layer_ + entry], size, y, column);
    column += size;
  }
}

void DecoderLoRA::add_block_by_block(size_t layer, size_t p, const at::Tensor& x, at::Tensor& y) const {
  const int64_t P = parts_[p], R = rank_, PR = P * R, S1 = slots_, width = y.size(1);
  const at::Tensor xc = x.contiguous();
  const int64_t in = xc.size(1), wide = S1 * PR;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  auto* yp = y.data_ptr<at::BFloat16>();
  const std::vector<c10::BFloat16> zeros(static_cast<size_t>(width), c10::BFloat16(0.0f));
  for (const int64_t t : rows_[S1]) add_bf16(yp + t * width, zeros.data(), width);  // as add_by_slot's
  // Each slot's tokens in a row of their own, and their shrink in a (T, S1 PR) buffer whose
  // row i is the i-th token of the slots in order; only the slot's own P R columns are written.
  std::vector<uint16_t> xs(static_cast<size_t>(xc.size(0) * in)), shrunk(static_cast<size_t>(xc.size(0) * wide));
  const auto* a = reinterpret_cast<const uint16_t*>(shrink_[layer * kProjections + p].const_data_ptr<at::BFloat16>());
  int64_t first = 0;
  for (int64_t j = 0; j < S1; ++j) {
    const std::vector<int64_t>& rows = rows_[j];
    const int64_t n = static_cast<int64_t>(rows.size());
    if (n == 0) continue;
    for (int64_t i = 0; i < n; ++i) std::memcpy(xs.data() + (first + i) * in, xp + rows[i] * in, in * sizeof(uint16_t));
    Output o{shrunk.data() + first * wide, false, wide, nullptr};
    dpbf16_panels(xs.data() + first * in, in, n, in / 2, a, j * PR / kPanel, (j + 1) * PR / kPanel, o);
    int64_t column = 0;
    for (int64_t q = 0; q < P; ++q) {
      const at::Tensor& b = expand_[layer * parts_per_layer_ + first_part_[p] + static_cast<size_t>(q)];
      const int64_t size = part_sizes_[first_part_[p] + static_cast<size_t>(q)], stride = b.size(1);
      // ExpandPlan puts slot j's R columns of part q at j W (their parity is even: R is a
      // multiple of 16), so the block's input is the shrink's columns as they are.
      Output d{yp + column, false, size, nullptr};
      d.ld = width;
      d.accumulate = true;
      d.rows = rows.data();
      const auto* bw = reinterpret_cast<const uint16_t*>(b.const_data_ptr<at::BFloat16>()) + j * (R / 2) * 2 * kPanel;
      dpbf16_block(shrunk.data() + first * wide + j * PR + q * R, wide, n, R / 2, stride, bw, 0, b.size(0), d);
      column += size;
    }
    first += n;
  }
}

void DecoderLoRA::add_by_slot(size_t layer, size_t p, const at::Tensor& x, at::Tensor& y) const {
  const int64_t P = parts_[p], R = rank_, PR = P * R, W = R + R % 2, S1 = slots_, width = y.size(1);
  const at::Tensor xc = x.contiguous();
  const int64_t in = xc.size(1);
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  auto* yp = y.data_ptr<at::BFloat16>();
  // A base token gets the zero delta the gather-free form adds (the same bits: -0 becomes +0).
  const std::vector<c10::BFloat16> zeros(static_cast<size_t>(width), c10::BFloat16(0.0f));
  for (const int64_t t : rows_[S1]) add_bf16(yp + t * width, zeros.data(), width);
  for (int64_t j = 0; j < S1; ++j) {
    const std::vector<int64_t>& rows = rows_[j];
    const int64_t n = static_cast<int64_t>(rows.size());
    if (n == 0) continue;
    at::Tensor xj = at::empty({n, in}, xc.options());
    auto* xjp = reinterpret_cast<uint16_t*>(xj.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < n; ++i) std::memcpy(xjp + i * in, xp + rows[i] * in, in * sizeof(uint16_t));
    const at::Tensor shrunk = linear(xj, shrink_slots_[(layer * kProjections + p) * S1 + j], PR, c10::nullopt, false);
    const auto* sp = reinterpret_cast<const uint16_t*>(shrunk.data_ptr<at::BFloat16>());
    at::Tensor part_in = at::zeros({n, W}, shrunk.options());
    auto* out = reinterpret_cast<uint16_t*>(part_in.data_ptr<at::BFloat16>());
    int64_t column = 0;
    for (int64_t q = 0; q < P; ++q) {
      const size_t entry = first_part_[p] + static_cast<size_t>(q);
      const int64_t size = part_sizes_[entry], place = (j * PR + q * R) % 2;  // ExpandPlan's, in the block
      for (int64_t i = 0; i < n; ++i) std::memcpy(out + i * W + place, sp + i * PR + q * R, R * sizeof(uint16_t));
      linear_add_into(part_in, expand_slots_[(layer * parts_per_layer_ + entry) * S1 + j], size, y, column,
                      rows.data());
      column += size;
    }
  }
}

std::tuple<at::Tensor, at::Tensor> decoder_layers_lora(
    const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, at::TensorList input_norm,
    at::TensorList qkv, const c10::List<c10::optional<at::Tensor>>& qkv_bias, at::TensorList o,
    at::TensorList post_norm, at::TensorList gate_up, at::TensorList down, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& slot_block, const at::Tensor& slot_offset,
    const at::Tensor& block_tables, const at::Tensor& cu_query_lens, const at::Tensor& context_lens,
    at::IntArrayRef widths, int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
    at::TensorList lora_shrink, at::TensorList lora_expand, at::TensorList lora_shrink_slots,
    at::TensorList lora_expand_slots, at::IntArrayRef lora_parts, at::IntArrayRef lora_part_sizes, int64_t lora_rank,
    const at::Tensor& lora_mask, int64_t lora_segment_tokens) {
  const DecoderLoRA lora(lora_shrink, lora_expand, lora_shrink_slots, lora_expand_slots, lora_parts, lora_part_sizes,
                         lora_rank, lora_mask, lora_segment_tokens, input_norm.size(), h.size(0));
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
        "float scale, Tensor[] lora_shrink, Tensor[] lora_expand, Tensor[] lora_shrink_slots, "
        "Tensor[] lora_expand_slots, int[] lora_parts, int[] lora_part_sizes, int lora_rank, Tensor lora_mask, "
        "int lora_segment_tokens) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("decoder_layers_lora", &pdserve::decoder_layers_lora); }
