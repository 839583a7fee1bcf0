// Does racecheck follow an mbarrier hand-off between threads (generic stores and loads of a
// shared-memory slot, ordered only by mbarrier.arrive / try_wait)? The protocol of
// src/attention/scheduler.cuh, alone: one writer thread (lane 0 of warp 1) hands out a value a
// round through a ring of two slots; warp 0's lane 0 and warps 2..9 read each. Modes:
//   warp    main's take_position at 1b5fe72: every lane of a reader warp waits and reads, then
//           __syncwarp, and lane 0 arrives for the warp
//   every   the branch wip/item-slot-arrivals': every reading thread waits, reads and arrives
//           itself (the barrier counts 1 + 8 x 32 arrivals)
//   racy    as warp, but the writer never waits for the readers: a true write-after-read
//           race, which racecheck must report
// Prints whether every reader saw every round's value. Build (repository root):
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Isrc -std=c++20 \
//     results/evidence/racecheck_item_slots/probe.cu -o probe
#include <cstdio>
#include <cstring>

#include "ptx/mbarrier.cuh"

struct Slot {  // TakenItem's size: ten words
  int w, a[9];
};

constexpr int kRounds = 64, kReaderWarps = 8;
enum Mode { kWarpReads, kEveryArrives, kRacy };

__global__ void hand_off(int* sums, Mode mode) {
  __shared__ uint64_t full[2], empty[2];
  __shared__ Slot slot[2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int i = 0; i < 2; ++i) {
      hattn::ptx::mbarrier_init(&full[i], 1);
      hattn::ptx::mbarrier_init(&empty[i], 1 + kReaderWarps * (mode == kEveryArrives ? 32 : 1));
    }
    hattn::ptx::fence_mbarrier_init();
  }
  __syncthreads();
  if (warp == 1) {
    if (lane != 0) return;
    for (int round = 0; round < kRounds; ++round) {
      const int s = round % 2;
      if (mode != kRacy && round >= 2) hattn::ptx::mbarrier_wait(&empty[s], (round / 2 - 1) % 2);
      Slot v;
      v.w = round;
      for (int i = 0; i < 9; ++i) v.a[i] = round * 9 + i;
      slot[s] = v;
      hattn::ptx::mbarrier_arrive(&full[s]);
    }
    return;
  }
  if (warp == 0 && lane != 0) return;
  int sum = 0;
  for (int round = 0; round < kRounds; ++round) {
    const int s = round % 2;
    Slot v;
    if (mode == kEveryArrives) {
      hattn::ptx::mbarrier_wait(&full[s], (round / 2) % 2);
      v = slot[s];
      hattn::ptx::mbarrier_arrive(&empty[s]);
    } else {
      hattn::ptx::mbarrier_wait(&full[s], (round / 2) % 2);
      v = slot[s];
      if (warp > 0) __syncwarp();
      if (warp == 0 || lane == 0) hattn::ptx::mbarrier_arrive(&empty[s]);
    }
    sum += v.w + v.a[8];
  }
  sums[threadIdx.x] = sum;
}

int main(int argc, char** argv) {
  const char* name = argc > 1 ? argv[1] : "warp";
  const Mode mode = !std::strcmp(name, "racy") ? kRacy : !std::strcmp(name, "every") ? kEveryArrives : kWarpReads;
  const int threads = 32 * (2 + kReaderWarps);
  int* sums;
  cudaMalloc(&sums, threads * sizeof(int));
  cudaMemset(sums, 0, threads * sizeof(int));
  hand_off<<<1, threads>>>(sums, mode);
  int host[32 * (2 + kReaderWarps)];
  const cudaError_t e = cudaMemcpy(host, sums, sizeof(host), cudaMemcpyDeviceToHost);
  int expect = 0;
  for (int r = 0; r < kRounds; ++r) expect += r + r * 9 + 8;
  int bad = host[0] != expect;
  for (int t = 64; t < threads; ++t) bad += host[t] != expect;
  std::printf("%s: %s, %d of %d readers off the expected sum\n", name, cudaGetErrorString(e), bad,
              1 + 32 * kReaderWarps);
  return e != cudaSuccess;
}
