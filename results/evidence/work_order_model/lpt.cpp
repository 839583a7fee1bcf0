#include <cstdio>
#include <vector>
#include <algorithm>
#include <queue>
#include "kernels/tile_scheduler.cuh"
using namespace hattn;
int main() {
  const int sms = 132; const double fixed = 1.0;
  struct Case { int d, s, bm, bn; };
  for (Case c : {Case{64,512,128,128},{64,1024,128,128},{64,2048,192,128},{64,4096,192,128},
                 {128,512,128,128},{128,1024,128,128},{128,2048,128,128},{128,4096,128,128},{128,8192,128,176},
                 {256,512,128,64},{256,1024,128,64},{256,2048,128,80},{256,4096,128,80}}) {
    const int batch = 16384 / c.s, heads = 2048 / c.d, pairs = batch * heads, mb = (c.s + c.bm - 1) / c.bm;
    auto tiles = [&](int m) { KvTileRange r = masked_kv_tiles(m, c.bm, c.bn, c.s, c.s, -1, 0); return r.last - r.first; };
    std::vector<int> bypair; for (int p = 0; p < pairs; ++p) for (int m = 0; m < mb; ++m) bypair.push_back(m);
    const int G = std::min<int>(sms, bypair.size());
    auto stat = [&](const std::vector<int>& L) { double busiest = 0, total = 0;
      for (int cta = 0; cta < G; ++cta) { double load = 0;
        for (int round = 0, w = TileScheduler::position(0, cta, G); w < (int)L.size(); w = TileScheduler::position(++round, cta, G))
          load += tiles(L[w]) + fixed;
        busiest = std::max(busiest, load); total += load; }
      return busiest / (total / G); };
    // (2) cheapest `left` items moved to the end
    const int left = bypair.size() % G;
    std::vector<int> idx(bypair.size()); for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b){ return tiles(bypair[a]) < tiles(bypair[b]); });
    std::vector<char> cheap(bypair.size(), 0); for (int i = 0; i < left; ++i) cheap[idx[i]] = 1;
    std::vector<int> L2; for (size_t i = 0; i < bypair.size(); ++i) if (!cheap[i]) L2.push_back(bypair[i]);
    for (size_t i = 0; i < bypair.size(); ++i) if (cheap[i]) L2.push_back(bypair[i]);
    // (3) ideal LPT lower-ish bound: greedy over items sorted descending
    std::vector<double> costs; for (int m : bypair) costs.push_back(tiles(m) + fixed);
    std::sort(costs.rbegin(), costs.rend());
    std::priority_queue<double, std::vector<double>, std::greater<double>> q; for (int i = 0; i < G; ++i) q.push(0);
    double mx = 0, tot = 0; for (double x : costs) { double t = q.top(); q.pop(); t += x; tot += x; mx = std::max(mx, t); q.push(t); }
    printf("D=%3d S=%5d items=%5d rounds=%.2f | pair %.3f | cheap-last %.3f | LPT %.3f\n", c.d, c.s, (int)bypair.size(),
           double(bypair.size()) / G, stat(bypair), stat(L2), mx / (tot / G));
  }
}
