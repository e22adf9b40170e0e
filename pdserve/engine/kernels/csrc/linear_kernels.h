// The linear kernels of each instruction-set path, as plain functions over raw pointers
// (linear.cpp checks the tensors and picks one by the path in force, isa.h). Each computes
// output panels [p0, p1) for all M rows and writes them through `Output`.
//
// Two packed layouts of the weight (N, K), both in panels of 16 output columns:
//   single k (avx2, avx512; and float32 weights on every path): (ceil(N/16), K, 16).
//       bfloat16 panel rows interleave their columns (slot 2j: column j, slot 2j+1: column
//       8+j) so AVX2 widens a row into two float32 vectors with two integer ops; float32
//       panel rows hold columns in order.
//   pairs of k (avx512_bf16, amx; bfloat16 weights): (ceil(N/16), ceil(K/2), 32):
//       packed[p][j][c][i] = W[16p + c][2j + i], zero past K. A panel row is one 64-byte
//       VDPBF16PS operand, and 16 consecutive rows are one AMX B tile (16 x 64 bytes).
#pragma once

#include <cstdint>

namespace pdserve {

constexpr int64_t kPanel = 16;  // output columns per panel

struct Output {
  void* data;        // (M, n) float32 or bfloat16
  bool f32;
  int64_t n;         // real columns
  const float* bias; // (n,) float32 or null
  int64_t ld = 0;    // the row stride (0: n)
  // bfloat16 only: add each rounded sum to what the output holds, rounding the sum once more
  // (out = bf16(out + bf16(sum)): the bits of writing the sums out and adding them with torch).
  bool accumulate = false;
  const int64_t* rows = nullptr;  // output row of each x row (null: the same row)
  int64_t at(int64_t m, int64_t col0) const { return (rows ? rows[m] : m) * (ld ? ld : n) + col0; }
};

// Single-k layout, float32 FMA chains over 16 lanes. x: (M, K) float32 (bfloat16 inputs
// widened exactly). The same chain per element as the AVX2 kernels: the same bits.
void avx512_panels_f32(const float* x, int64_t M, int64_t K, const float* w, int64_t p0, int64_t p1,
                       const Output& o);
void avx512_panels_bf16(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t p0, int64_t p1,
                        const Output& o);

// Pairs layout through VDPBF16PS. x: (M, ldx) bfloat16, ldx even, zero at column K when K is odd.
void dpbf16_panels(const uint16_t* x, int64_t ldx, int64_t M, int64_t KP, const uint16_t* w, int64_t p0,
                   int64_t p1, const Output& o);
// The same over a block of k alone: KP pairs of each panel from ``w`` on, a panel being
// ``stride`` pairs long (w points at the block's first pair in panel 0). The sums of the
// block's products, in the same order and pairs as the whole k would add them.
void dpbf16_block(const uint16_t* x, int64_t ldx, int64_t M, int64_t KP, int64_t stride, const uint16_t* w,
                  int64_t p0, int64_t p1, const Output& o);

// x for the AMX kernel: rows of ld = 32 ceil(KP/16) bfloat16, zero past K. An A tile reads
// 16 rows, so the rows from `split` on (the last, partial tile's) come from a copy with
// room for 16: rows past M hold anything, and their sums are never written.
struct AmxRows {
  const uint16_t* head;  // rows [0, split)
  const uint16_t* tail;  // rows [split, split + 16)
  int64_t split, ld;
  const uint16_t* row(int64_t m) const { return m < split ? head + m * ld : tail + (m - split) * ld; }
};

// Pairs layout through AMX.
void amx_panels(const AmxRows& x, int64_t M, int64_t KP, const uint16_t* w, int64_t p0, int64_t p1,
                const Output& o);

}  // namespace pdserve
