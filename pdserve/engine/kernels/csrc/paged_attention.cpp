// Paged attention on CPU: one call per layer for a whole step (decode, prefill, chunked
// prefill, or a mix of them), reading K/V in place through the block tables.
//
//   torch.ops.pdserve.paged_attention(q (T, nh, hd), k_cache, v_cache (num_blocks, block_size,
//       nkv, hd) strided views, block_tables (B, M) int32, cu_query_lens (B+1) int32,
//       context_lens (B) int32, scale float, window int = 0) -> out (T, nh, hd), the dtype of q
//
// Query j of sequence b (token cu_query_lens[b] + j) sits at position
// context_lens[b] - query_len + j and attends to cache positions [0, pos]: its own K/V is
// already in the cache (the caller writes the new tokens' K/V first). With a sliding window
// (window > 0, a layer of Gemma 3's) it attends to (pos - window, pos] instead: the last
// `window` positions, its own included.
//
// Why the result is batch-invariant (bitwise, in every dtype, at any thread count):
// a query row's output is computed by one fixed sequence of float32 operations that reads
// only its own q and the K/V rows of positions 0..pos, and nothing about the batch, the
// chunking or the thread can change that sequence:
//   - score s_k = reduce8(lane sums) * scale, where lane l accumulates q[d] * K_k[d] for
//     d = l, l+8, l+16, ... by FMA in increasing d, and reduce8 adds the 8 lanes in one fixed
//     tree. Scores are always produced 8 keys at a time at absolute key indices (8i..8i+7),
//     keys past the row's end read a zero row and are discarded; no key's arithmetic depends
//     on its neighbours.
//   - m = max_k s_k (exact, order-free); p_k = exp(s_k - m) by the vectorised polynomial
//     exp below (FMA only, no libm, so no CPU dispatch); l = fixed tree over 8 lane sums,
//     lane i summing p_k for k = i mod 8 in increasing k; past-the-end lanes add an exact 0.
//   - out[d] = (sum_k p_k * V_k[d], FMA in increasing k, keys past pos never touched) / l.
//   - a window: the row's first key f = max(0, pos + 1 - window) plays the part 0 plays above.
//     Keys below f get p_k = +0 exactly and are left out of m. A loop may start below f, at
//     an aligned key that depends on the work item (its lowest row's f), but what it adds
//     there changes no bit: lane sums and accumulators start at +0 and stay +0 through any
//     number of +0 terms (+0 + +0 = +0, and fma(+0, v, +0) = +0 for every finite v). So the
//     row's bits depend on its own f and pos only. Without a window f = 0 and every loop
//     runs exactly as it did before windows existed.
// Parallelism is over (sequence, kv head, tile of queries) work items, each computed by one
// thread start to finish, with no reduction across threads; a tile only shares loads of
// K/V rows between its rows, never partial results. bf16/f16 inputs are widened exactly
// to float32 on load; the output is rounded once at the end. The build flags
// (engine/kernels/cpu_kernels.py) pin AVX2 + FMA and -ffp-contract=off, so the same bits come out
// on every x86 machine. Decode, a prefill chunk and a preemption recompute of the same
// position therefore produce identical bits.
//
// bfloat16 on the avx512_bf16 and amx paths is the exception: every work item's scores and
// weighted values run on VDPBF16PS (attention_bf16.cpp) or AMX tiles (attention_amx.cpp), with
// a fixed sequence of their own per element (and each probability rounded to bfloat16 before
// it weighs V). The same argument holds for them on one processor; they are not the bits above.
#include "paged_attention_worker.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

// One call's work items as chunks (parallel_chunks.h). It holds references on q and the
// caches and, with a borrowing pool, its own copy of the index arrays: a helper that was
// stolen from may still run it after the call returned (borrow_pool.h), and must never
// index the cache with values changed since.
template <typename T>
struct AttentionChunks final : pdserve::ChunkKernel {
  Geometry g{};
  at::Tensor q, k, v;
  std::vector<int32_t> owned;  // tables, cu_q, ctx back to back (with a pool)
  const int32_t *tables = nullptr, *cu_q = nullptr, *ctx = nullptr;
  std::vector<Item> items;
  float scale = 0;
  int64_t window = 0, max_keys = 0, tokens = 0;
  bool wide = false;
  Pairs pairs = Pairs::kNone;
  uint64_t call = 0;

  void compute(int64_t b, int64_t e, void* out) const override {
    thread_local Scratch scratch;
    scratch.reserve(QUERY_TILE * g.group, max_keys, g.hd);
    Worker<T> w(g, q.const_data_ptr<T>(), k.const_data_ptr<T>(), v.const_data_ptr<T>(), static_cast<T*>(out),
                tables, cu_q, ctx, scale, window, scratch, wide, pairs, call);
    for (int64_t i = b; i < e; ++i) w.run(items[i]);
  }
  // Item i writes, for each of its queries, its kv head's group of q heads: group x hd
  // consecutive values of the (T, nh, hd) output.
  void copy(int64_t b, int64_t e, const void* from, void* to) const override {
    const int64_t row = g.group * g.hd;
    for (int64_t i = b; i < e; ++i)
      for (int64_t j = items[i].q_begin; j < items[i].q_end; ++j) {
        const int64_t at = ((cu_q[items[i].seq] + j) * g.nh + items[i].kv_head * g.group) * g.hd;
        std::memcpy(static_cast<T*>(to) + at, static_cast<const T*>(from) + at, row * sizeof(T));
      }
  }
  int64_t out_bytes() const override { return tokens * g.nh * g.hd * static_cast<int64_t>(sizeof(T)); }
};

template <typename T>
void run_all(const Geometry& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
             const int32_t* tables, const int32_t* cu_q, const int32_t* ctx, int64_t b, float scale, int64_t window) {
  AttentionChunks<T> c;
  int64_t max_ctx = 0;
  for (int64_t i = 0; i < b; ++i) {
    const int32_t qlen = cu_q[i + 1] - cu_q[i];
    max_ctx = std::max<int64_t>(max_ctx, ctx[i]);
    // Per kv head, latest tiles first: they see the most keys, dynamic scheduling then balances
    // the tail, and a thread's next item usually reuses the K and V the wide loops widened.
    for (int32_t h = 0; h < g.nkv; ++h)
      for (int32_t end = qlen; end > 0; end -= QUERY_TILE)
        c.items.push_back({static_cast<int32_t>(i), h, std::max<int32_t>(0, end - QUERY_TILE), end});
  }
  if (c.items.empty()) return;
  c.max_keys = (max_ctx + WIDE_KEYS - 1) / WIDE_KEYS * WIDE_KEYS;
  const pdserve::Isa isa = pdserve::current_isa();
  c.wide = isa != pdserve::Isa::kAvx2 && g.hd % 16 == 0;
  // bfloat16 on the pairs paths: every item on tiles (amx) or VDPBF16PS (avx512_bf16), decode
  // and prefill alike, where the geometry suits them.
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (isa == pdserve::Isa::kAmx && pdserve::attention_amx::supported(g.hd, g.block_size))
      c.pairs = Pairs::kAmx;
    else if (isa == pdserve::Isa::kAvx512Bf16 && g.hd % 32 == 0)
      c.pairs = Pairs::kDot;
  }
  static std::atomic<uint64_t> calls{0};
  c.call = ++calls;  // a thread's widened K/V is reused only within this call
  c.g = g;
  c.q = q;
  c.k = k;
  c.v = v;
  c.scale = scale;
  c.window = window;
  c.tokens = q.size(0);
  c.tables = tables;
  c.cu_q = cu_q;
  c.ctx = ctx;
  if (pdserve::borrow_pool_active()) {
    c.owned.assign(tables, tables + b * g.max_blocks);
    c.owned.insert(c.owned.end(), cu_q, cu_q + b + 1);
    c.owned.insert(c.owned.end(), ctx, ctx + b);
    c.tables = c.owned.data();
    c.cu_q = c.tables + b * g.max_blocks;
    c.ctx = c.cu_q + b + 1;
  }
  // Which thread runs an item never changes its arithmetic, so a work queue is safe here.
  const int64_t n = static_cast<int64_t>(c.items.size());
  const bool prefill = c.tokens >= 16;  // many query rows: fine chunks at the end pay
  pdserve::parallel_kernel(n, 1, std::move(c), out.mutable_data_ptr<T>(), 4, prefill);
}

}  // namespace

namespace pdserve {

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
                           const at::Tensor& cu_q, const at::Tensor& ctx, double scale, int64_t window) {
  paged_attention_checks::check_inputs(q_in, k, v, tables, cu_q, ctx);
  TORCH_CHECK(window >= 0, "paged_attention: window must be 0 (none) or the keys a query sees, got ", window);
  const at::Tensor q = q_in;
  const int64_t b = tables.size(0), m = tables.size(1);
  const int32_t* tab = tables.const_data_ptr<int32_t>();
  const int32_t* cq = cu_q.const_data_ptr<int32_t>();
  const int32_t* cx = ctx.const_data_ptr<int32_t>();
  paged_attention_checks::check_lengths(tab, cq, cx, b, m, k.size(1), k.size(0), q.size(0));
  Geometry g{q.size(1), k.size(2), q.size(1) / k.size(2), q.size(2), k.size(1), m,
             q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2)};
  at::Tensor out = at::empty(q.sizes(), q.options());  // contiguous (T, nh, hd)
  const float s = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case at::kFloat: run_all<float>(g, q, k, v, out, tab, cq, cx, b, s, window); break;
    case at::kBFloat16: run_all<c10::BFloat16>(g, q, k, v, out, tab, cq, cx, b, s, window); break;
    default: run_all<c10::Half>(g, q, k, v, out, tab, cq, cx, b, s, window); break;
  }
  return out;
}

}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cu_query_lens, "
        "Tensor context_lens, float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("paged_attention", &pdserve::paged_attention); }
