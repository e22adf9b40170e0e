// The AMX linear kernel (path amx, bfloat16 weights in the pairs layout, linear_kernels.h).
//
// Tiles: tmm0-3 hold float32 sums (16 rows x 16 columns each), tmm4-5 two A tiles of x
// (16 rows x 32 k), tmm6-7 two B tiles of weights (16 pairs of k x 16 columns: 16
// consecutive panel rows). A step of 32 k is up to four TDPBF16PS: 32 rows x 2 panels.
//
// Invariance: each output element is one float32 accumulator that TDPBF16PS updates for the
// k blocks 0, 32, 64, ... in order, and nothing else touches it until it is stored and
// written. The hardware computes each element of a tile from its own row of A and column of
// B alone, so which rows share a tile (a row alone is a tile of 1 real row), and which
// panels a thread owns, changes no element's chain. K past the last full block is padded
// with zeros in both operands (a scratch copy of the weights' last block): the same padding
// for every batch.
#include "linear_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")

#include "amx_tiles.h"
#include "panel_loop.h"
#include "write_avx512.h"

namespace {

using pdserve::kPanel;
using pdserve::Output;

constexpr int64_t kBlockK = 32;                    // bfloat16 k per tile step
constexpr int64_t kTileBytes = 1024;               // 16 rows x 64 bytes
constexpr int64_t kPairRow = 2 * kPanel;           // bfloat16 per panel row of the pairs layout
constexpr int64_t kAmxGroupBytes = 512 << 10;      // weights reused across row tiles (L2 is 2 MB a core)

// The sums of one finished block (up to 2 x 2 tiles) on their way out: written a few rows
// at a time from inside the next block's k loop, so the conversion runs while the tile unit
// works instead of after it (the reorder window is too small to overlap them on its own).
class PendingRows {
 public:
  explicit PendingRows(const Output& o) : o_(o) {}

  void start(const float* c, int64_t m0, int mr, int64_t p, int np) {
    c_ = c, m0_ = m0, np_ = np;
    next_ = 0;
    total_ = mr;
    row_ = PanelPairWriter(o_, p * kPanel, np);
  }

  // Up to `count` more rows (both panels of one row of the block).
  inline void write(int count) {
    for (const int end = std::min(total_, next_ + count); next_ < end; ++next_) {
      const int t = next_ / 16, r = next_ % 16;
      const float* tile = c_ + 2 * t * 256 + 16 * r;  // tile_kernel's order: tmm 2t + i
      row_.write(tile, np_ > 1 ? tile + 256 : nullptr, m0_ + next_);
    }
  }

  void finish() { write(total_); }

 private:
  const Output& o_;
  const float* c_ = nullptr;
  PanelPairWriter row_;
  int64_t m0_ = 0;
  int np_ = 0, next_ = 0, total_ = 0;
};

// MA A tiles (16 rows each, from a0 and a1) x NB panels over KB blocks of k. b[i]: panel i's first block;
// tail[i]: its last block zero-padded (or null when K fills the last block). Sums go to c
// (tile t at c + 256 t); `pending` writes the previous block's rows meanwhile.
template <int MA, int NB>
void tile_kernel(const uint16_t* a0, const uint16_t* a1, int64_t lda, const char* const* b, const char* const* tail, int64_t KB,
                 float* c, PendingRows& pending) {
  const int64_t stride = lda * 2;  // bytes per A row
  const int rows_per_step = static_cast<int>((32 + KB - 1) / KB);
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (MA > 1) _tile_zero(2);
  if constexpr (MA > 1 && NB > 1) _tile_zero(3);
  // Loads interleaved with the products that need them, so a load waits only for the one
  // product that last read its register (tiles are not renamed).
  for (int64_t kb = 0; kb < KB; ++kb) {
    const bool last = kb == KB - 1;
    _tile_loadd(4, a0 + kb * kBlockK, stride);
    _tile_loadd(6, last && tail[0] ? tail[0] : b[0] + kb * kTileBytes, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) {
      _tile_loadd(7, last && tail[1] ? tail[1] : b[1] + kb * kTileBytes, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (MA > 1) {
      _tile_loadd(5, a1 + kb * kBlockK, stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB > 1) _tile_dpbf16ps(3, 5, 7);
    }
    pending.write(rows_per_step);
  }
  pending.finish();
  _tile_stored(0, c, 64);
  if constexpr (NB > 1) _tile_stored(1, c + 256, 64);
  if constexpr (MA > 1) _tile_stored(2, c + 512, 64);
  if constexpr (MA > 1 && NB > 1) _tile_stored(3, c + 768, 64);
}

using KernelFn = void (*)(const uint16_t*, const uint16_t*, int64_t, const char* const*, const char* const*, int64_t, float*,
                          PendingRows&);
KernelFn pick(int ma, int nb) {
  if (ma == 2) return nb == 2 ? &tile_kernel<2, 2> : &tile_kernel<2, 1>;
  return nb == 2 ? &tile_kernel<1, 2> : &tile_kernel<1, 1>;
}

constexpr int panels_for(int) { return 2; }

}  // namespace

namespace pdserve {

void amx_panels(const AmxRows& x, int64_t M, int64_t KP, const uint16_t* w, int64_t p0, int64_t p1,
                const Output& o) {
  const int64_t KB = (KP + 15) / 16, tail_pairs = KP % 16;
  const int64_t panel_bytes = KP * kPairRow * 2;
  // The last k block of each panel, zero-padded to 16 pairs (only when K leaves it short).
  alignas(64) char scratch[2][kTileBytes];
  alignas(64) float sums[2][4 * 256];  // this block's and the previous block's
  int buf = 0;
  PendingRows pending(o);
  pdserve::configure_tiles();
  for_each_tile(M, p0, p1, 32, panels_for, panel_bytes, [&](int64_t m0, int mr, int64_t p, int np) {
    const char* b[2];
    const char* tail[2] = {nullptr, nullptr};
    for (int i = 0; i < np; ++i) {
      b[i] = reinterpret_cast<const char*>(w) + (p + i) * panel_bytes;
      if (tail_pairs) {
        std::memset(scratch[i], 0, kTileBytes);
        std::memcpy(scratch[i], b[i] + (KB - 1) * kTileBytes, tail_pairs * kPairRow * 2);
        tail[i] = scratch[i];
      }
    }
    pick(mr > 16 ? 2 : 1, np)(x.row(m0), x.row(m0 + 16), x.ld, b, tail, KB, sums[buf], pending);
    pending.start(sums[buf], m0, mr, p, np);
    buf ^= 1;
  }, kAmxGroupBytes);
  pending.finish();
  _tile_release();
}

}  // namespace pdserve

#pragma GCC pop_options
