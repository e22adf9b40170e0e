// Paged attention's AVX-512 loops (attention_avx512.cpp), called by paged_attention.cpp for
// prefill tiles on every path but avx2. Same bits as its AVX2 loops; see both files.
#pragma once

#include <cstdint>

namespace pdserve::attention512 {

// out[r * stride + k] = score of query row r (q: rows x hd float32) and key k, for the blocks
// of 16 keys below n_max that row r reaches (keys[r] = keys row r sees; the rest of a block
// is computed and left for the caller to ignore). kt holds K transposed in blocks of 16 keys:
// block b is (hd, 16) floats at kt + b * 16 * hd, keys past the end zero. hd % 16 == 0.
void scores(const float* q, int64_t rows, int64_t hd, const int64_t* keys, const float* kt, int64_t n_max,
            int64_t stride, float scale, float* out);

// acc (rows x hd) = sum over k < keys[r] of p[r * stride + k] * v[k] (v: keys x hd float32,
// contiguous), FMA in increasing k. keys must be non-decreasing in r. hd % 16 == 0.
void weighted_values(const float* p, int64_t stride, int64_t rows, int64_t hd, const int64_t* keys, const float* v,
                     float* acc);

}  // namespace pdserve::attention512
