// The operators of the other sources, callable from C++ (decoder.cpp runs a whole decoder
// stack through them in one call). Each is documented, and registered with torch, in its
// own file: linear.cpp, fused.cpp, paged_attention.cpp.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace pdserve {

at::Tensor linear_pack(const at::Tensor& weight);
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                  bool f32_out);
// y[:, column : column + n] (bfloat16, contiguous) = bf16(y + bf16(x @ W^T)) in place: linear's
// sums rounded, then added as torch adds bfloat16, without the (M, n) tensor between. rows: the
// row of y each row of x adds to (null: the same row).
void linear_add_into(const at::Tensor& x, const at::Tensor& packed, int64_t n, at::Tensor& y, int64_t column,
                     const int64_t* rows = nullptr);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor rope_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                         at::Tensor v_cache, const at::Tensor& slot_block, const at::Tensor& slot_offset,
                         int64_t num_heads, int64_t num_kv_heads);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
                           const at::Tensor& cu_q, const at::Tensor& ctx, double scale, int64_t window = 0);

}  // namespace pdserve
