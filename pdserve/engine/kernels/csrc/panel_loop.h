// The loop every linear kernel shares: row tiles x panels, with panels taken in groups sized
// to stay in L2 so that each group is read from memory once and reused by every row tile;
// after each tile, a slice of the caller's prefetch plan (prefetch_plan.h) when it has one.
// Header-only and in an anonymous namespace: each kernel file compiles it for its own
// instruction set.
#pragma once

#include <algorithm>
#include <cstdint>

#include "prefetch_plan.h"

namespace {

constexpr int64_t kGroupBytes = 192 << 10;  // weight bytes reused from L2 across row tiles

// fn(m0, rows, p, panels) for every tile of at most `max_rows` rows and panels_for(rows) panels
// of [p0, p1). panel_bytes: one panel's packed bytes.
template <typename PanelsFor, typename Fn>
inline void for_each_tile(int64_t M, int64_t p0, int64_t p1, int max_rows, PanelsFor panels_for,
                          int64_t panel_bytes, Fn&& fn, int64_t group_bytes = kGroupBytes) {
  const int np_row = panels_for(static_cast<int>(std::min<int64_t>(M, max_rows)));
  const int64_t group = std::max<int64_t>(np_row, group_bytes / panel_bytes / np_row * np_row);
  // The caller's prefetch plan (prefetch_plan.h), if any: this call's share of its bytes,
  // spread over this call's tiles.
  pdserve::PrefetchPlan* const plan = pdserve::prefetch_plan();
  int64_t per_tile = 0;
  if (plan) {
    const int64_t tiles = (M + max_rows - 1) / max_rows * ((p1 - p0 + np_row - 1) / np_row);
    const int64_t share = plan->total * (p1 - p0) / plan->panels;
    per_tile = (share + tiles - 1) / std::max<int64_t>(tiles, 1);
  }
  for (int64_t g0 = p0; g0 < p1; g0 += group) {
    const int64_t g1 = std::min(p1, g0 + group);
    for (int64_t m0 = 0; m0 < M; m0 += max_rows) {
      const int mr = static_cast<int>(std::min<int64_t>(max_rows, M - m0));
      const int np_max = panels_for(mr);
      for (int64_t p = g0; p < g1; p += np_max) {
        fn(m0, mr, p, static_cast<int>(std::min<int64_t>(np_max, g1 - p)));
        if (per_tile) plan->take(per_tile);
      }
    }
  }
}

}  // namespace
