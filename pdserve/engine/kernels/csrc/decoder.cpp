// A whole bfloat16 decoder stack in one call, so a step's Python runs once per step, not
// once per operator.
//
//   decoder_layers(Tensor h, Tensor cos, Tensor sin, Tensor[] input_norm, Tensor[] qkv,
//                  Tensor?[] qkv_bias, Tensor[] o, Tensor[] post_norm, Tensor[] gate_up,
//                  Tensor[] down, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches,
//                  Tensor slot_block, Tensor slot_offset, Tensor block_tables,
//                  Tensor cu_query_lens, Tensor context_lens, int[] widths, int num_heads,
//                  int num_kv_heads, float eps, float scale) -> (Tensor, Tensor)
//       h (T, D) bfloat16: the embedded tokens. One entry per layer in every list: the two
//       RMSNorm weights (D,), the packed q|k|v, o, gate|up and down weights (linear_pack),
//       q|k|v's bias (float32) or None, and the layer's K and V cache views. widths = the
//       output widths of q|k|v, o, gate|up and down. The step's RoPE tables and attention
//       context as the model runner builds them. Returns (x, residual): the last layer's MLP
//       output and the residual stream before it, what CausalLM's final norm adds and
//       normalises.
//
// Why: at decode sizes a layer's arithmetic is a few hundred microseconds, and each operator
// called from Python costs several microseconds of dispatch, argument parsing and view
// bookkeeping (about 300 operator calls and 600 views a step for a 30-layer model). Here
// the same operators run in the same order on the same inputs as engine/models/decoder.py's layers
// with pdserve's kernels (DecoderLayer.forward, PackedLinear, PackedRMSNorm,
// PackedSiluAndMul, PagedAttention.attend), called directly: the result is bitwise what
// the layer-by-layer path gives (tests/engine/test_decoder_layers.py), so batch invariance
// carries over unchanged.
//
// decoder_stack runs the loop; decoder_lora.cpp's decoder_layers_lora runs it with a step's
// LoRA adapters added after each projection. Without adapters (this operator) the loop adds
// nothing: the same calls as before LoRA existed.
//
//   decoder_layers_done() -> int
//       Layers this process has computed through decoder_stack since it started (every call,
//       every thread). A worker reports it beside its step count so that a long step shows
//       progress layer by layer (pdserve/engine/progress.py): on a slow core one prefill step
//       of long prompts outlasts the router's no-progress bound (router/liveness.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "decoder_lora.h"
#include "ops.h"

#include <atomic>
#include <cstdint>
#include <tuple>
#include <vector>

namespace pdserve {

namespace {
std::atomic<int64_t> layers_done{0};
}  // namespace

int64_t decoder_layers_done() { return layers_done.load(std::memory_order_relaxed); }

std::tuple<at::Tensor, at::Tensor> decoder_stack(
    const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, at::TensorList input_norm,
    at::TensorList qkv, const c10::List<c10::optional<at::Tensor>>& qkv_bias, at::TensorList o,
    at::TensorList post_norm, at::TensorList gate_up, at::TensorList down, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& slot_block, const at::Tensor& slot_offset,
    const at::Tensor& block_tables, const at::Tensor& cu_query_lens, const at::Tensor& context_lens,
    at::IntArrayRef widths, int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
    const DecoderLoRA* lora) {
  const size_t L = input_norm.size();
  TORCH_CHECK(L > 0, "decoder_layers: no layers");
  for (size_t n : {qkv.size(), qkv_bias.size(), o.size(), post_norm.size(), gate_up.size(), down.size(),
                   k_caches.size(), v_caches.size()})
    TORCH_CHECK(n == L, "decoder_layers: every per-layer list needs ", L, " entries, one has ", n);
  TORCH_CHECK(widths.size() == 4, "decoder_layers: widths must be [qkv, o, gate_up, down], got ", widths.size());
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kBFloat16, "decoder_layers: h must be (T, D) bfloat16");
  const int64_t T = h.size(0);
  // A projection's base linear, then its adapters' delta; while the linear runs, the calling
  // thread prefetches the weights the delta will read (DecoderLoRA::prefetch).
  auto project = [&](const at::Tensor& in, const at::Tensor& w, int64_t n, const c10::optional<at::Tensor>& bias,
                     size_t layer, Projection p) {
    at::Tensor out;
    if (!lora) return linear(in, w, n, bias, false);
    {
      PrefetchPlan plan = lora->prefetch(layer, p, w.size(0));
      const PrefetchScope scope(plan);
      out = linear(in, w, n, bias, false);
    }
    lora->add(layer, p, in, out);
    return out;
  };
  at::Tensor x, residual;
  for (size_t i = 0; i < L; ++i) {
    if (i == 0) {
      residual = h;
      x = rms_norm(h, input_norm[0], eps);
    } else {
      std::tie(x, residual) = add_rms_norm(x, residual, input_norm[i], eps);
    }
    at::Tensor qkv_out = project(x, qkv[i], widths[0], qkv_bias.get(i), i, Projection::kQkv);
    const at::Tensor q = rope_store_kv(qkv_out, cos, sin, k_caches[i], v_caches[i], slot_block, slot_offset,
                                       num_heads, num_kv_heads);
    const at::Tensor attn = paged_attention(q, k_caches[i], v_caches[i], block_tables, cu_query_lens,
                                            context_lens, scale).view({T, -1});
    at::Tensor attn_out = project(attn, o[i], widths[1], c10::nullopt, i, Projection::kO);
    std::tie(x, residual) = add_rms_norm(attn_out, residual, post_norm[i], eps);
    at::Tensor gate_up_out = project(x, gate_up[i], widths[2], c10::nullopt, i, Projection::kGateUp);
    const at::Tensor act = silu_mul(gate_up_out);
    x = project(act, down[i], widths[3], c10::nullopt, i, Projection::kDown);
    layers_done.fetch_add(1, std::memory_order_relaxed);
  }
  return {x, residual};
}

std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, at::TensorList input_norm,
    at::TensorList qkv, const c10::List<c10::optional<at::Tensor>>& qkv_bias, at::TensorList o,
    at::TensorList post_norm, at::TensorList gate_up, at::TensorList down, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& slot_block, const at::Tensor& slot_offset,
    const at::Tensor& block_tables, const at::Tensor& cu_query_lens, const at::Tensor& context_lens,
    at::IntArrayRef widths, int64_t num_heads, int64_t num_kv_heads, double eps, double scale) {
  return decoder_stack(h, cos, sin, input_norm, qkv, qkv_bias, o, post_norm, gate_up, down, k_caches, v_caches,
                       slot_block, slot_offset, block_tables, cu_query_lens, context_lens, widths, num_heads,
                       num_kv_heads, eps, scale, nullptr);
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("decoder_layers(Tensor h, Tensor cos, Tensor sin, Tensor[] input_norm, Tensor[] qkv, Tensor?[] qkv_bias, "
        "Tensor[] o, Tensor[] post_norm, Tensor[] gate_up, Tensor[] down, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor slot_block, Tensor slot_offset, Tensor block_tables, Tensor cu_query_lens, "
        "Tensor context_lens, int[] widths, int num_heads, int num_kv_heads, float eps, float scale) "
        "-> (Tensor, Tensor)");
  m.def("decoder_layers_done() -> int", &pdserve::decoder_layers_done);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("decoder_layers", &pdserve::decoder_layers); }
