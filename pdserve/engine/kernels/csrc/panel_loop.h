// The loop every linear kernel shares: row tiles x panels, with panels taken in groups sized
// to stay in L2 so that each group is read from memory once and reused by every row tile.
// Header-only and in an anonymous namespace: each kernel file compiles it for its own
// instruction set.
#pragma once

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kGroupBytes = 192 << 10;  // weight bytes reused from L2 across row tiles

// fn(m0, rows, p, panels) for every tile of at most `max_rows` rows and panels_for(rows) panels
// of [p0, p1). panel_bytes: one panel's packed bytes.
template <typename PanelsFor, typename Fn>
inline void for_each_tile(int64_t M, int64_t p0, int64_t p1, int max_rows, PanelsFor panels_for,
                          int64_t panel_bytes, Fn&& fn, int64_t group_bytes = kGroupBytes) {
  const int np_row = panels_for(static_cast<int>(std::min<int64_t>(M, max_rows)));
  const int64_t group = std::max<int64_t>(np_row, group_bytes / panel_bytes / np_row * np_row);
  for (int64_t g0 = p0; g0 < p1; g0 += group) {
    const int64_t g1 = std::min(p1, g0 + group);
    for (int64_t m0 = 0; m0 < M; m0 += max_rows) {
      const int mr = static_cast<int>(std::min<int64_t>(max_rows, M - m0));
      const int np_max = panels_for(mr);
      for (int64_t p = g0; p < g1; p += np_max) fn(m0, mr, p, static_cast<int>(std::min<int64_t>(np_max, g1 - p)));
    }
  }
}

}  // namespace
