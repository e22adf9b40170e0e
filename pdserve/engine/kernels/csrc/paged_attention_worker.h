// The work item of paged_attention.cpp: its geometry, one thread's buffers, and the
// Worker that computes queries [q_begin, q_end) of one sequence and kv head start to finish.
// Why its results are batch-invariant: paged_attention.cpp's head comment. Included by that
// file alone (its names sit in an anonymous namespace, as they did there).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include "attention_avx2.h"
#include "attention_kernels.h"
#include "isa.h"
#include "ops.h"
#include "paged_attention_checks.h"
#include "parallel_chunks.h"
#include "scratch_buffer.h"
#include "vec_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using pdserve::exp_nonpositive;
using namespace pdserve::attention_avx2;

constexpr int64_t KEYS = 8;        // keys per score vector (one AVX2 register)
constexpr int64_t QUERY_TILE = 32;  // queries of one sequence per work item: they share K/V loads (8: 6.5 ms
                                   // for a 512-token layer here, 16: 5.7, 32: 5.3)
constexpr int64_t PREFETCH_KEYS = 16;  // keys between a row's fetch (pdserve::fetch_rows) and its read
// The AVX-512 loops (attention_avx512.cpp) take work items of at least this many query rows
// (prefill tiles; a decode item's few rows would not repay transposing K), in blocks of 16 keys.
constexpr int64_t WIDE_MIN_ROWS = 8;
constexpr int64_t WIDE_KEYS = 16;

// ---- one work item ---------------------------------------------------------------------------
struct Geometry {
  int64_t nh, nkv, group, hd, block_size, max_blocks;
  int64_t q_tok, q_head;              // strides of q (elements)
  int64_t cache_block, cache_token, cache_head;  // strides of k_cache and v_cache (equal)
};

struct Item {
  int32_t seq, kv_head, q_begin, q_end;  // queries [q_begin, q_end) of the sequence
};

// Which bfloat16 kernels take every work item: none (the float32 FMA loops), VDPBF16PS, AMX.
enum class Pairs { kNone, kDot, kAmx };

// Per-thread buffers, kept between calls (a layer call must not pay for zeroing them).
using pdserve::Buffer;

// Which (cache, call, sequence, kv head) a thread's prepared K or V rows came from, and which
// keys [from, keys) they cover: a thread's next items are usually earlier tiles of the same
// head (with a window, they reach further down and not as far up).
struct Prepared {
  const void* cache = nullptr;
  uint64_t call = 0;
  int64_t seq = -1, head = -1, from = 0, keys = 0;
  bool same(const void* c, uint64_t k, int64_t s, int64_t h, int64_t n) const {
    return cache == c && call == k && seq == s && head == h && keys >= n;
  }
  bool holds(const void* c, uint64_t k, int64_t s, int64_t h, int64_t lo, int64_t n) const {
    return same(c, k, s, h, n) && from <= lo;
  }
  // Keys [lo, n) wanted and not held: [*begin, *end) is what is still to prepare, and from
  // then on held. True when that is all of them (a fresh start: grow the buffers first, which
  // drops their contents), false when only the keys below those held are missing.
  bool extend(const void* c, uint64_t k, int64_t s, int64_t h, int64_t lo, int64_t n, int64_t* begin,
              int64_t* end) {
    *begin = lo;
    if (same(c, k, s, h, n)) {
      *end = from;
      from = lo;
      return false;
    }
    *end = n;
    *this = {c, k, s, h, lo, n};
    return true;
  }
};

struct Scratch {
  // (R, hd), (R, S), (R, hd), (KEYS, hd), (R,); zero: (hd,) the row read for keys past the end.
  Buffer q{0}, scores{16}, acc{32}, kv{48}, denom{13}, zero{29};
  std::vector<int64_t> offsets, keys, first;     // (S,) cache offset of each key; (R,) row r sees keys [first, keys)
  // The wide loops' K (transposed, blocks of 16 keys) and V (rows) of one (sequence, kv head)
  // in float32, kept while the thread's next items are tiles of the same sequence and head.
  Buffer kt{45}, vrows{61};
  Prepared wide;
  // The pairs kernels' q (amx: as tiles of pairs; avx512_bf16: rows), V in the pairs layout,
  // avx512_bf16's K transposed and its probabilities in bfloat16 (attention_kernels.h).
  Buffer qt{7}, vpairs{23}, kpairs{39}, pb{55};
  Prepared pairs, kpaired;
  void reserve(int64_t rows, int64_t max_keys, int64_t hd) {
    q.grow(rows * hd); scores.grow(rows * max_keys); acc.grow(rows * hd); kv.grow(KEYS * hd);
    denom.grow(rows); zero.grow(hd); grow(offsets, max_keys); grow(keys, rows); grow(first, rows);
  }
  template <typename V>
  static void grow(std::vector<V>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n, V(0));
  }
};

template <typename T>
class Worker {
 public:
  Worker(const Geometry& g, const T* q, const T* k, const T* v, T* out, const int32_t* tables,
         const int32_t* cu_q, const int32_t* ctx, float scale, int64_t window, Scratch& s, bool wide, Pairs pairs,
         uint64_t call)
      : g_(g), q_(q), k_(k), v_(v), out_(out), tables_(tables), cu_q_(cu_q), ctx_(ctx), scale_(scale),
        window_(window), s_(s), wide_(wide), amx_(pairs == Pairs::kAmx), dot_(pairs == Pairs::kDot), call_(call) {}

  void run(const Item& it) {
    const int64_t qlen = cu_q_[it.seq + 1] - cu_q_[it.seq];
    const int64_t pos0 = ctx_[it.seq] - qlen + it.q_begin;  // position of the tile's first query
    // Rows: query-major, then the group's q heads: row = (j - q_begin) * group + h.
    const int64_t nq = it.q_end - it.q_begin, rows = nq * g_.group, hd = g_.hd;
    const int64_t n_max = pos0 + nq;  // keys seen by the tile's last query
    const int64_t stride = (n_max + WIDE_KEYS - 1) / WIDE_KEYS * WIDE_KEYS;
    const int64_t tok0 = cu_q_[it.seq] + it.q_begin;
    for (int64_t r = 0; r < rows; ++r) {
      s_.keys[r] = pos0 + r / g_.group + 1;
      s_.first[r] = window_ > 0 ? std::max<int64_t>(0, s_.keys[r] - window_) : 0;
      if (!amx_ && !dot_) widen_row(q_row(tok0, it, r), s_.q.data() + r * hd, hd);
    }
    // The lowest key any loop of this item reads: its first row's first key (rows are in query
    // order, so it is the least), down to a multiple of 32, which every loop's step divides.
    // 0 without a window.
    base_ = s_.first[0] / 32 * 32;
    key_offsets(tables_ + static_cast<int64_t>(it.seq) * g_.max_blocks, it.kv_head, base_, n_max);
    const bool wide = wide_ && rows >= WIDE_MIN_ROWS;  // tiles of many rows take the AVX-512 loops
    if (amx_) {
      amx_scores(tok0, it, rows, n_max, stride);
    } else if (dot_) {
      dot_scores(tok0, it, rows, n_max, stride);
    } else if (wide) {
      widen_kv(it, n_max);
      pdserve::attention512::scores(s_.q.data(), rows, hd, s_.first.data(), s_.keys.data(), s_.kt.data(), n_max,
                                    stride, scale_, s_.scores.data());
    } else {
      scores(rows, n_max, stride);
    }
    for (int64_t r = 0; r < rows; ++r)
      s_.denom[r] = softmax(s_.scores.data() + r * stride, base_, s_.first[r], s_.keys[r]);
    if (amx_ || dot_) {
      pairs_values(it, rows, n_max, stride);
    } else if (wide) {  // K and V widened above
      pdserve::attention512::weighted_values(s_.scores.data(), stride, rows, hd, s_.first.data(), s_.keys.data(),
                                             s_.vrows.data(), s_.acc.data());
    } else {
      weighted_values(rows, n_max, stride);
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* acc = s_.acc.data() + r * hd;
      const __m256 l = _mm256_set1_ps(s_.denom[r]);
      for (int64_t d = 0; d < hd; d += 8) _mm256_storeu_ps(acc + d, _mm256_div_ps(_mm256_loadu_ps(acc + d), l));
      store_row(acc, out_ + ((tok0 + r / g_.group) * g_.nh + it.kv_head * g_.group + r % g_.group) * hd, hd);
    }
  }

 private:
  // Query row r of the item: its token's q for one head of the group.
  const T* q_row(int64_t tok0, const Item& it, int64_t r) const {
    return q_ + (tok0 + r / g_.group) * g_.q_tok + (it.kv_head * g_.group + r % g_.group) * g_.q_head;
  }

  // The amx path's scores (attention_amx.cpp): q as tiles of pairs of head_dim, K read in place.
  void amx_scores(int64_t tok0, const Item& it, int64_t rows, int64_t n_max, int64_t stride) {
    const int64_t hd = g_.hd, steps = hd / 32, groups = (rows + 15) / 16;
    s_.qt.grow(groups * steps * 256);
    uint32_t* qt = reinterpret_cast<uint32_t*>(s_.qt.data());
    std::fill(qt, qt + groups * steps * 256, 0u);
    for (int64_t r = 0; r < rows; ++r) {
      const T* q = q_row(tok0, it, r);
      uint32_t* group = qt + (r / 16) * steps * 256 + r % 16;
      for (int64_t pair = 0; pair < hd / 2; ++pair)  // [step][pair within the step][row]
        std::memcpy(group + (pair / 16) * 256 + (pair % 16) * 16, q + 2 * pair, 4);
    }
    pdserve::attention_amx::scores(qt, rows, hd, reinterpret_cast<const uint16_t*>(k_), s_.offsets.data(),
                                   g_.cache_token, s_.first.data(), s_.keys.data(), n_max, stride, scale_,
                                   s_.scores.data());
  }

  // The avx512_bf16 path's scores (attention_bf16.cpp): q's rows as bfloat16, K transposed into
  // blocks of 16 keys, kept across the thread's items of one sequence and kv head.
  void dot_scores(int64_t tok0, const Item& it, int64_t rows, int64_t n_max, int64_t stride) {
    const int64_t hd = g_.hd, padded = (n_max + 15) / 16 * 16;
    s_.qt.grow(rows * hd / 2);
    uint16_t* q = reinterpret_cast<uint16_t*>(s_.qt.data());
    for (int64_t r = 0; r < rows; ++r) std::memcpy(q + r * hd, q_row(tok0, it, r), hd * 2);
    if (!s_.kpaired.holds(k_, call_, it.seq, it.kv_head, base_, n_max)) {
      int64_t begin, end;
      if (s_.kpaired.extend(k_, call_, it.seq, it.kv_head, base_, n_max, &begin, &end)) s_.kpairs.grow(padded * hd / 2);
      // The first kv head's item fetches each key's whole run (every head's K and V, bfloat16) into
      // L2 while it fits there (attention_kernels.h, transpose_keys). Moves no value.
      const int64_t run = 4 * g_.nkv * hd;
      const bool whole = it.kv_head == 0 && g_.cache_head == hd && v_ == k_ + g_.nkv * hd && (end - begin) * run <= (512 << 10);
      pdserve::attention_bf16::transpose_keys(reinterpret_cast<const uint16_t*>(k_), s_.offsets.data(), begin, end,
                                              hd, whole ? run : 0, reinterpret_cast<uint32_t*>(s_.kpairs.data()));
    }
    pdserve::attention_bf16::scores(reinterpret_cast<const uint32_t*>(q), rows, hd, s_.first.data(), s_.keys.data(),
                                    reinterpret_cast<const uint32_t*>(s_.kpairs.data()), n_max, stride, scale_,
                                    s_.scores.data());
  }

  // Weighted values of the pairs kernels (amx and avx512_bf16): V in the pairs layout, kept
  // across the thread's items of one sequence and kv head as the wide loops' rows are.
  void pairs_values(const Item& it, int64_t rows, int64_t n_max, int64_t stride) {
    const int64_t hd = g_.hd, padded = (n_max + 31) / 32 * 32;
    if (!s_.pairs.holds(k_, call_, it.seq, it.kv_head, base_, n_max)) {
      int64_t begin, end;
      if (s_.pairs.extend(k_, call_, it.seq, it.kv_head, base_, n_max, &begin, &end))
        s_.vpairs.grow(padded * hd / 2);  // bfloat16, two to a float
      pdserve::attention_bf16::pair_values(reinterpret_cast<const uint16_t*>(v_), s_.offsets.data(), begin, end, hd,
                                          reinterpret_cast<uint16_t*>(s_.vpairs.data()));
    }
    const uint16_t* pairs = reinterpret_cast<const uint16_t*>(s_.vpairs.data());
    if (dot_) {
      s_.pb.grow(rows * padded / 2);
      pdserve::attention_bf16::weighted_values(s_.scores.data(), stride, rows, hd, s_.first.data(), s_.keys.data(),
                                               pairs, reinterpret_cast<uint16_t*>(s_.pb.data()), s_.acc.data());
      return;
    }
    s_.acc.grow((rows + 15) / 16 * 16 * hd);  // whole tiles of rows
    pdserve::attention_amx::weighted_values(s_.scores.data(), stride, rows, hd, s_.first.data(), s_.keys.data(), pairs,
                                            s_.acc.data());
  }

  // The wide loops' inputs: K rows [base, n) transposed into blocks of 16 keys (zero past n),
  // and V rows [base, n), both float32, at their keys' places. Kept across the thread's items
  // of one sequence and kv head (the latest tile comes first and sees the most keys; with a
  // window, an earlier tile widens only the rows below those held), so a prefill widens each
  // row once.
  void widen_kv(const Item& it, int64_t n) {
    if (s_.wide.holds(k_, call_, it.seq, it.kv_head, base_, n)) return;
    const int64_t hd = g_.hd;
    int64_t begin, end;
    if (s_.wide.extend(k_, call_, it.seq, it.kv_head, base_, n, &begin, &end)) {
      const int64_t padded = (n + WIDE_KEYS - 1) / WIDE_KEYS * WIDE_KEYS;
      s_.kt.grow(padded * hd);
      s_.vrows.grow(padded * hd);
    }
    float* row = s_.kv.data();
    for (int64_t k = begin; k < (end + WIDE_KEYS - 1) / WIDE_KEYS * WIDE_KEYS; ++k) {
      float* kt = s_.kt.data() + (k / WIDE_KEYS) * WIDE_KEYS * hd + k % WIDE_KEYS;
      if (k < end) {
        widen_row(k_ + s_.offsets[k], row, hd);
        for (int64_t d = 0; d < hd; ++d) kt[d * WIDE_KEYS] = row[d];
        widen_row(v_ + s_.offsets[k], s_.vrows.data() + k * hd, hd);
      } else {
        for (int64_t d = 0; d < hd; ++d) kt[d * WIDE_KEYS] = 0.f;
      }
    }
  }

  // offsets[k]: where key k's row of this kv head starts, in elements from the cache base, for
  // the keys [from, n) (and the rest of from's block).
  void key_offsets(const int32_t* table, int64_t kv_head, int64_t from, int64_t n) {
    int64_t* off = s_.offsets.data();
    for (int64_t b = from / g_.block_size, k0 = b * g_.block_size; k0 < n; k0 += g_.block_size, ++b) {
      const int64_t base = table[b] * g_.cache_block + kv_head * g_.cache_head;
      for (int64_t t = 0; t < g_.block_size && k0 + t < n; ++t) off[k0 + t] = base + t * g_.cache_token;
    }
  }

  // Rows [k0, k0+8) of K or V as float32 pointers; rows past n read zeros. Prefetches the
  // rows PREFETCH_KEYS further on.
  void key_rows(const T* cache, int64_t k0, int64_t n, const float** out) {
    const int64_t* off = s_.offsets.data();
    pdserve::fetch_rows(cache, off, std::min(n, k0 + PREFETCH_KEYS), std::min(n, k0 + PREFETCH_KEYS + KEYS),
                        g_.hd * static_cast<int64_t>(sizeof(T)));
    for (int64_t i = 0; i < KEYS; ++i) {
      const int64_t k = k0 + i;
      if (k >= n) {
        out[i] = s_.zero.data();
      } else if constexpr (std::is_same_v<T, float>) {
        out[i] = cache + off[k];
      } else {
        float* dst = s_.kv.data() + i * g_.hd;
        widen_row(cache + off[k], dst, g_.hd);
        out[i] = dst;
      }
    }
  }

  // scores[r][k] = (q_r . K_k) * scale for every key group that row r reaches.
  void scores(int64_t rows, int64_t n_max, int64_t stride) {
    const float* krow[KEYS];
    const __m256 scale = _mm256_set1_ps(scale_);
    for (int64_t k0 = base_; k0 < n_max; k0 += KEYS) {
      key_rows(k_, k0, n_max, krow);
      for (int64_t r = 0; r < rows; ++r) {
        // No key of this group is visible to row r: past its position, or before its window.
        if (k0 >= s_.keys[r] || k0 + KEYS <= s_.first[r]) continue;
        const float* q = s_.q.data() + r * g_.hd;
        __m256 a[KEYS];
        for (int i = 0; i < KEYS; ++i) a[i] = _mm256_setzero_ps();
        for (int64_t d = 0; d < g_.hd; d += 8) {
          const __m256 qv = _mm256_loadu_ps(q + d);
          for (int i = 0; i < KEYS; ++i) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(krow[i] + d), a[i]);
        }
        _mm256_storeu_ps(s_.scores.data() + r * stride + k0, _mm256_mul_ps(reduce8(a), scale));
      }
    }
  }

  // In place: scores[first, n) -> exp(s - max), and +0 in [base, first) (the keys below the
  // row's window that the item's loops may read); returns the fixed-order sum. Without a
  // window base = first = 0.
  static float softmax(float* s, int64_t base, int64_t first, int64_t n) {
    const int64_t g0 = first / KEYS, groups = (n + KEYS - 1) / KEYS;
    std::fill(s + base, s + g0 * KEYS, 0.f);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    auto valid = [&](int64_t k0) {  // lanes first <= k0 + i < n
      __m256i ok = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - k0)), lane);
      if (first > k0) ok = _mm256_and_si256(ok, _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int>(first - k0 - 1))));
      return _mm256_castsi256_ps(ok);
    };
    const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 mx = ninf;
    for (int64_t g = g0; g < groups; ++g)
      mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + g * KEYS), valid(g * KEYS)));
    const __m256 m = _mm256_set1_ps(hmax(mx));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t g = g0; g < groups; ++g) {
      __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + g * KEYS), m));
      p = _mm256_and_ps(p, valid(g * KEYS));
      _mm256_storeu_ps(s + g * KEYS, p);
      sum = _mm256_add_ps(sum, p);
    }
    return hsum(sum);
  }

  // acc[r] = sum over keys k <= pos_r of p[r][k] * V_k, FMA in increasing k (from the group of
  // the row's first key: the +0 weights before it leave acc at +0).
  void weighted_values(int64_t rows, int64_t n_max, int64_t stride) {
    std::fill(s_.acc.data(), s_.acc.data() + rows * g_.hd, 0.f);
    const float* vrow[KEYS];
    for (int64_t k0 = base_; k0 < n_max; k0 += KEYS) {
      key_rows(v_, k0, n_max, vrow);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t end = std::min<int64_t>(KEYS, s_.keys[r] - k0);  // keys of this group row r sees
        if (end <= 0 || k0 + KEYS <= s_.first[r]) continue;
        const float* p = s_.scores.data() + r * stride + k0;
        float* acc = s_.acc.data() + r * g_.hd;
        int64_t d = 0;
        for (; d + 32 <= g_.hd; d += 32) {  // four registers of the row at a time
          __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
          __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
          for (int64_t i = 0; i < end; ++i) {
            const __m256 w = _mm256_set1_ps(p[i]);
            const float* vr = vrow[i] + d;
            a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr), a0);
            a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8), a1);
            a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 16), a2);
            a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 24), a3);
          }
          _mm256_storeu_ps(acc + d, a0); _mm256_storeu_ps(acc + d + 8, a1);
          _mm256_storeu_ps(acc + d + 16, a2); _mm256_storeu_ps(acc + d + 24, a3);
        }
        for (; d < g_.hd; d += 8) {
          __m256 a = _mm256_loadu_ps(acc + d);
          for (int64_t i = 0; i < end; ++i) a = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), _mm256_loadu_ps(vrow[i] + d), a);
          _mm256_storeu_ps(acc + d, a);
        }
      }
    }
  }

  const Geometry& g_;
  const T *q_, *k_, *v_;
  T* out_;
  const int32_t *tables_, *cu_q_, *ctx_;
  float scale_;
  const int64_t window_;  // keys a query sees, its own included; 0: every key up to it
  Scratch& s_;
  const bool wide_, amx_, dot_;
  const uint64_t call_;
  int64_t base_ = 0;  // the current item's lowest key read (a multiple of 32; run() sets it)
};

}  // namespace
