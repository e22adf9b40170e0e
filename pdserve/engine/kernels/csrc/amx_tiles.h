// The one AMX tile shape pdserve's kernels use (linear_amx.cpp, attention_amx.cpp): every tile
// 16 rows x 64 bytes. Include inside a GCC target region that enables amx-tile.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace pdserve {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads the shape into tmm0-7. The config is per thread, so every thread a kernel runs on
// loads it before its first tile instruction.
inline void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

}  // namespace pdserve
