// paged_attention's argument checks (paged_attention.cpp): shapes, dtypes and strides of the
// tensors, then the lengths and block ids against the cache, each failure naming the field.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace pdserve::paged_attention_checks {

inline void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
                  const at::Tensor& cu_q, const at::Tensor& ctx) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: q must be on the CPU, got ", q.device());
  TORCH_CHECK(q.dim() == 3, "paged_attention: q must be (T, nh, hd), got ", q.sizes());
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes(),
              "paged_attention: k_cache and v_cache must both be (num_blocks, block_size, nkv, hd), got ",
              k.sizes(), " and ", v.sizes());
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "paged_attention: dtype must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt, "paged_attention: k_cache/v_cache dtype ",
              k.scalar_type(), "/", v.scalar_type(), " differs from q's ", dt);
  const int64_t nh = q.size(1), hd = q.size(2), nkv = k.size(2);
  TORCH_CHECK(k.size(3) == hd, "paged_attention: cache head_dim ", k.size(3), " differs from q's ", hd);
  TORCH_CHECK(hd % 8 == 0 && hd > 0, "paged_attention: head_dim must be a positive multiple of 8, got ", hd);
  TORCH_CHECK(nkv > 0 && nh % nkv == 0, "paged_attention: num_heads ", nh, " is not a multiple of num_kv_heads ", nkv);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "paged_attention: q, k_cache and v_cache need a contiguous last dimension");
  TORCH_CHECK(k.strides() == v.strides(), "paged_attention: k_cache and v_cache must have equal strides "
              "(views of one cache), got ", k.strides(), " and ", v.strides());
  for (const auto* t : {&tables, &cu_q, &ctx})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "paged_attention: block_tables, cu_query_lens and context_lens must be contiguous int32");
  TORCH_CHECK(tables.dim() == 2, "paged_attention: block_tables must be (B, M), got ", tables.sizes());
  const int64_t b = tables.size(0);
  TORCH_CHECK(cu_q.dim() == 1 && cu_q.numel() == b + 1, "paged_attention: cu_query_lens must have B+1 = ", b + 1,
              " entries, got ", cu_q.numel());
  TORCH_CHECK(ctx.dim() == 1 && ctx.numel() == b, "paged_attention: context_lens must have B = ", b,
              " entries, got ", ctx.numel());
}

inline void check_lengths(const int32_t* tables, const int32_t* cu_q, const int32_t* ctx, int64_t b, int64_t m,
                   int64_t block_size, int64_t num_blocks, int64_t tokens) {
  TORCH_CHECK(cu_q[0] == 0 && cu_q[b] == tokens, "paged_attention: cu_query_lens must run from 0 to T = ", tokens,
              ", got ", cu_q[0], "..", cu_q[b]);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t qlen = cu_q[i + 1] - cu_q[i];
    TORCH_CHECK(qlen >= 0 && qlen <= ctx[i], "paged_attention: sequence ", i, " has query_len ", qlen,
                " outside [0, context_len = ", ctx[i], "]");
    const int64_t used = (ctx[i] + block_size - 1) / block_size;
    TORCH_CHECK(used <= m, "paged_attention: sequence ", i, " needs ", used, " blocks, block_tables has ", m);
    for (int64_t j = 0; j < used; ++j) {
      const int32_t blk = tables[i * m + j];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_attention: block_tables[", i, "][", j, "] = ", blk,
                  " outside [0, num_blocks = ", num_blocks, ")");
    }
  }
}

}  // namespace pdserve::paged_attention_checks
