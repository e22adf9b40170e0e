// Paged attention's wider loops, called by paged_attention.cpp: the AVX-512 ones
// (attention_avx512.cpp) for prefill tiles on every path but avx2, the same bits as its AVX2
// loops; for every bfloat16 work item, VDPBF16PS (attention_bf16.cpp) on the avx512_bf16 path
// and AMX tiles (attention_amx.cpp) on the amx path, each with bits of its own.
//
// Row r of a work item sees keys [first[r], keys[r]): first[r] is 0 without a sliding window,
// and both are non-decreasing in r (rows are in query order). The caller has set the
// probabilities of keys below first[r] to +0, from first[0] rounded down to a multiple of 32
// on; a loop may start there (at its own multiple of 16 or 32 of keys), and the +0 weights it
// adds before a row's first key change none of the row's bits.
#pragma once

#include <xmmintrin.h>

#include <cstdint>

namespace pdserve {

// Keys [k0, k1) of a paged cache (key k's row at cache + offsets[k]) fetched toward the core:
// row_bytes of each row into L1, and the rest of a run_bytes run from the row's start into L2.
// Consecutive keys of one layer lie a whole token's KV apart (23 KB for the default model in
// bfloat16), too far for the hardware prefetcher, so the attention loops fetch rows some keys
// ahead of those they read. A prefetch never faults and moves no value.
template <typename T>
inline void fetch_rows(const T* cache, const int64_t* offsets, int64_t k0, int64_t k1, int64_t row_bytes,
                       int64_t run_bytes = 0) {
  for (int64_t k = k0; k < k1; ++k) {
    const char* row = reinterpret_cast<const char*>(cache + offsets[k]);
    int64_t b = 0;
    for (; b < row_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    for (; b < run_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
  }
}

}  // namespace pdserve

namespace pdserve::attention512 {

// out[r * stride + k] = score of query row r (q: rows x hd float32) and key k, for the blocks
// of 16 keys below n_max that row r reaches (keys [first[r], keys[r]); the rest of a block
// is computed and left for the caller to ignore). kt holds K transposed in blocks of 16 keys:
// block b is (hd, 16) floats at kt + b * 16 * hd, keys past the end zero, from the block of
// first[0] on. hd % 16 == 0.
void scores(const float* q, int64_t rows, int64_t hd, const int64_t* first, const int64_t* keys, const float* kt,
            int64_t n_max, int64_t stride, float scale, float* out);

// acc (rows x hd) = sum over first[r] <= k < keys[r] of p[r * stride + k] * v[k] (v: row k of
// V at v + k * hd, float32, from first[0] on), FMA in increasing k. hd % 16 == 0.
void weighted_values(const float* p, int64_t stride, int64_t rows, int64_t hd, const int64_t* first,
                     const int64_t* keys, const float* v, float* acc);

}  // namespace pdserve::attention512

namespace pdserve::attention_amx {

// The geometry the AMX scores take: head_dim a multiple of 32 up to 128, and blocks of the
// cache a multiple of 16 keys.
bool supported(int64_t hd, int64_t block_size);

// out[r * stride + k] = (q_r . K_k) * scale for the blocks of 16 keys below n_max that row r
// reaches (keys [first[r], keys[r]); the rest of a block is computed and left for the caller
// to ignore). qt: q in groups of 16 rows, each hd / 32 tiles of 16 pairs of head_dim x 16
// rows (dword [g][t][p][n] = q[16 g + n][32 t + 2 p .. + 1], zero past rows). cache +
// offsets[k]: key k's bfloat16 row; keys of one block are key_stride elements apart.
void scores(const uint32_t* qt, int64_t rows, int64_t hd, const uint16_t* cache, const int64_t* offsets,
            int64_t key_stride, const int64_t* first, const int64_t* keys, int64_t n_max, int64_t stride, float scale,
            float* out);


// acc (rows rounded up to 16, x hd) = sum over first[r] <= k < keys[r] of
// bfloat16(p[r * stride + k]) * V_k, with V from pair_values over keys [first[0] rounded down
// to 32, keys[rows - 1]) at least.
void weighted_values(const float* p, int64_t stride, int64_t rows, int64_t hd, const int64_t* first,
                     const int64_t* keys, const uint16_t* pairs, float* acc);

}  // namespace pdserve::attention_amx

namespace pdserve::attention_bf16 {

// out = V of keys [from, n) in the pairs layout (B tiles of AMX, rows of VDPBF16PS), each block
// at its keys' place: per block of 32 keys, hd / 16 tiles of 16 pairs of keys x 16 columns x 2
// (512 bfloat16 each), zeros past n. from % 32 == 0, hd % 32 == 0.
void pair_values(const uint16_t* cache, const int64_t* offsets, int64_t from, int64_t n, int64_t hd, uint16_t* out);

// out = K of keys [from, n) as blocks of 16 keys at their keys' places, each hd / 2 rows of 16
// dwords (row p: the pair 2p, 2p+1 of head_dim of each key), zeros past n. from % 16 == 0,
// hd % 32 == 0. run_bytes: bytes from the start of each key's row fetched into L2 on the way
// (0 or 2 hd: the row alone). A token's K and V of one layer, every kv head, are one run of
// 2 nkv hd elements in the cache (kv_cache.py), and the next token's a whole token's KV further
// on: read one head's row at a time, each key is a separate trip to memory for 128 bytes (hd
// 64). A sequence's items run kv head after kv head, so the first head's passes the whole run,
// and its own V and the next heads' K and V then come from L2 (paged_attention_worker.h).
void transpose_keys(const uint16_t* cache, const int64_t* offsets, int64_t from, int64_t n, int64_t hd,
                    int64_t run_bytes, uint32_t* out);

// out[r * stride + k] = (q_r . K_k) * scale for the blocks of 16 keys below n_max that row r
// reaches (and possibly its neighbours' blocks: the caller ignores keys outside a row's own
// [first[r], keys[r])). q: rows x hd bfloat16 (as hd / 2 dwords a row); kt from
// transpose_keys, from first[0]'s block on.
void scores(const uint32_t* q, int64_t rows, int64_t hd, const int64_t* first, const int64_t* keys,
            const uint32_t* kt, int64_t n_max, int64_t stride, float scale, float* out);

// acc (rows x hd) = sum over first[r] <= k < keys[r] of bfloat16(p[r * stride + k]) * V_k, V
// from pair_values over keys [first[0] rounded down to 32, keys[rows - 1]) at least; pb:
// scratch of rows x keys[rows - 1] rounded up to 32 bfloat16.
void weighted_values(const float* p, int64_t stride, int64_t rows, int64_t hd, const int64_t* first,
                     const int64_t* keys, const uint16_t* pairs, uint16_t* pb, float* acc);

}  // namespace pdserve::attention_bf16
