// The planned tail's estimate beside the snake's on the grid's causal shapes (kernel 16's tiles).
#include <cstdio>
#include "kernels/tile_scheduler.cuh"
using namespace hattn;
int main() {
  struct Case { int d, s, bm, bn; };
  for (Case c : {Case{64,512,128,128},{64,1024,128,128},{64,2048,192,128},{64,4096,192,128},{64,8192,192,128},{64,16384,192,128},
                 {128,512,128,128},{128,1024,128,128},{128,2048,128,128},{128,4096,128,128},{128,8192,128,176},{128,16384,128,176},
                 {256,512,128,64},{256,1024,128,64},{256,2048,128,80},{256,4096,128,80},{256,8192,128,80},{256,16384,128,80}}) {
    const int batch = 16384 / c.s, heads = 2048 / c.d;
    const PersistentLaunch p = compute_persistent_launch(batch, heads, c.s, c.s, true, c.bm, c.bn, 132, -1, 0);
    auto tiles = [&](int m) { KvTileRange r = masked_kv_tiles(m, c.bm, c.bn, c.s, c.s, -1, 0); return r.last - r.first; };
    int64_t sum = 0; for (int w = 0; w < p.sched.total(); ++w) sum += tiles(p.sched.item(w).m_block) + 1;
    const double mean = double(sum) / p.ctas;
    int64_t planned = 0; const int total = p.sched.total();
    for (int cta = 0; cta < p.ctas; ++cta) { int64_t l = 0;
      for (int r = 0, w = p.tail.position(0, cta, p.ctas, total); w < total; w = p.tail.position(++r, cta, p.ctas, total)) l += tiles(p.sched.item(w).m_block) + 1;
      planned = std::max(planned, l); }
    printf("D=%3d S=%5d %s snake %.3f planned %.3f%s\n", c.d, c.s, p.sched.by_rank ? "by rank" : "by pair",
           max_cta_load(p.sched, p.ctas, tiles) / mean, planned / mean, p.tail.start == INT_MAX ? " (no plan)" : "");
  }
}
