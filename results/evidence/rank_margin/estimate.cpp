#include <cstdio>
#include "kernels/tile_scheduler.cuh"
using namespace hattn;
int main() {
  struct Case { int d, s, bm, bn; };
  for (Case c : {Case{64,512,128,128},{64,1024,128,128},{64,2048,192,128},{64,4096,192,128},{64,8192,192,128},{64,16384,192,128},
                 {128,512,128,128},{128,1024,128,128},{128,2048,128,128},{128,4096,128,128},{128,8192,128,176},{128,16384,128,176},
                 {256,512,128,64},{256,1024,128,64},{256,2048,128,80},{256,4096,128,80},{256,8192,128,80},{256,16384,128,80}}) {
    const int batch = 16384 / c.s, heads = 2048 / c.d;
    TileScheduler s; s.m_blocks = (c.s + c.bm - 1) / c.bm; s.heads_q = heads; s.pairs = batch * heads; s.by_rank = false;
    auto tiles = [&](int m) { KvTileRange r = masked_kv_tiles(m, c.bm, c.bn, c.s, c.s, -1, 0); return r.last - r.first; };
    int ctas = std::min<int64_t>(int64_t(s.m_blocks) * s.pairs, 132);
    long a = max_cta_load(s, ctas, tiles); s.by_rank = true; long b = max_cta_load(s, ctas, tiles);
    printf("D=%3d S=%5d pair %ld rank %ld ratio %.3f %s\n", c.d, c.s, a, b, double(b)/a, b*100<a*95?"RANK(95)":(b*100<a*98?"rank at 98":""));
  }
}
