#include <cstdio>
#include <queue>
#include <vector>
#include <functional>
#include <algorithm>
#include "kernels/tile_scheduler.cuh"
using namespace hattn;
// cost of item = tiles + fixed; orders produce a list of m_blocks (with pair ids); assign by static snake or dynamic.
int main() {
  const int sms = 132; const double fixed = 1.0;
  struct Case { int d, s, bm, bn; };
  for (Case c : {Case{128, 1024, 128, 128}, {128, 2048, 128, 128}, {128, 4096, 128, 128},
                 {128, 8192, 128, 176}, {64, 2048, 192, 128}, {64, 4096, 192, 128}, {256, 4096, 128, 80}, {256, 8192, 128, 80}}) {
    const int batch = 16384 / c.s, heads = 2048 / c.d, pairs = batch * heads;
    const int mb = (c.s + c.bm - 1) / c.bm;
    auto tiles = [&](int m) { KvTileRange r = masked_kv_tiles(m, c.bm, c.bn, c.s, c.s, -1, 0); return r.last - r.first; };
    auto make = [&](int group) {  // group pairs; within group rank desc, pair fastest; group = pairs -> by rank; group=0 -> by pair
      std::vector<std::pair<int,int>> L;  // (m_block, pair)
      if (group == 0) { for (int p = 0; p < pairs; ++p) for (int m = 0; m < mb; ++m) L.push_back({m, p}); return L; }
      for (int g0 = 0; g0 < pairs; g0 += group)
        for (int m = mb - 1; m >= 0; --m)
          for (int p = g0; p < std::min(pairs, g0 + group); ++p) L.push_back({m, p});
      return L;
    };
    auto stat = [&](const std::vector<std::pair<int,int>>& L) {
      const int G = std::min<int>(sms, L.size()); double busiest = 0, total = 0;
      for (int cta = 0; cta < G; ++cta) { double load = 0;
        for (int round = 0, w = TileScheduler::position(0, cta, G); w < (int)L.size(); w = TileScheduler::position(++round, cta, G))
          load += tiles(L[w].first) + fixed;
        busiest = std::max(busiest, load); total += load; }
      return busiest / (total / G); };
    auto dyn = [&](const std::vector<std::pair<int,int>>& L) {
      const int G = std::min<int>(sms, L.size());
      std::priority_queue<double, std::vector<double>, std::greater<double>> q; double total = 0, mx = 0;
      for (int i = 0; i < G; ++i) q.push(0);
      for (auto& it : L) { double t = q.top(); q.pop(); t += tiles(it.first) + fixed; total += tiles(it.first) + fixed; mx = std::max(mx, t); q.push(t); }
      return mx / (total / G); };
    // working set: pairs touched by a round (approx): report K/V MB for group
    printf("D=%3d S=%5d pairs=%3d mb=%2d | pair: st %.3f dy %.3f | rank: st %.3f dy %.3f", c.d, c.s, pairs, mb,
           stat(make(0)), dyn(make(0)), stat(make(pairs)), dyn(make(pairs)));
    for (int g : {2, 4, 8, 16}) if (g < pairs) printf(" | g%d: st %.3f dy %.3f", g, stat(make(g)), dyn(make(g)));
    printf("\n");
  }
}
