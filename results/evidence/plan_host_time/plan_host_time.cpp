#include "tile_scheduler.cuh"
#include <chrono>
#include <cstdio>
using namespace hattn;
int main() {
  struct S { int b, h, s, bm, bn; };
  for (S c : {S{16, 16, 1024, 128, 128}, S{8, 16, 2048, 128, 128}, S{4, 16, 4096, 128, 128}, S{16, 32, 1024, 128, 128}, S{64, 16, 256, 128, 128}}) {
    auto t0 = std::chrono::steady_clock::now();
    int reps = 100; long sink = 0;
    for (int r = 0; r < reps; ++r) {
      PersistentLaunch p = plan_persistent_launch(c.b, c.h, c.s, c.s, true, c.bm, c.bn, 132);
      sink += p.sched.by_rank;
    }
    auto t1 = std::chrono::steady_clock::now();
    printf("B%d H%d S%d items %ld: %.1f us per plan (by_rank %ld)\n", c.b, c.h, c.s, (long)work_items(c.b, c.h, c.s, c.bm),
           std::chrono::duration<double, std::micro>(t1 - t0).count() / reps, sink / reps);
  }
}
