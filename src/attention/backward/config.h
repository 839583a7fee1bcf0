// The production backward's shape (namespace hattn::bwd): a CTA per 128 keys of one query head,
// a producer warpgroup and two consumer warpgroups of 64 keys each, 64 queries a step (128 at
// D = 64).
#pragma once

namespace hattn::bwd {

constexpr int kWarpgroups = 2;                     // consumer warpgroups
constexpr int kThreads = 128 * (1 + kWarpgroups);  // and a producer warpgroup
constexpr int kConsumerThreads = 128 * kWarpgroups;
constexpr int kBlockN = 64 * kWarpgroups;  // keys per CTA: 64 per consumer warpgroup
// Query rows per step. At D = 64 a 64-row step's products are too short to hide its fixed
// costs (the stats, the barriers, dQ's reduction), so its blocks have 128 rows, and dQ is split
// between the warpgroups by rows instead of by columns (consumer.cuh).
constexpr int block_m(int head_dim) { return head_dim == 64 ? 128 : 64; }
template <int D>
constexpr int kBlockM = block_m(D);
constexpr int kStages = 2;                 // Q/dO blocks in flight
constexpr int kSwizzleBytes = 128;         // one row of a 64-column block
constexpr int kAtomBytes = 1024;           // 8 rows x 128 bytes: the swizzle pattern's period
constexpr float kLog2e = 1.4426950408889634f;

// Named barriers (0 is __syncthreads); consumer.cuh says who meets at each.
constexpr int kDsBarrier = 1;        // the 256 consumer threads: both dS^T tiles are written
constexpr int kDkDvTileBarrier = 2;  // 2 and 3: a consumer warpgroup's dK and dV tiles are written (the epilogue)
// dQ's hand-off between a consumer warpgroup and its writer warp (128 + 32 threads), one barrier
// per dQ buffer and warpgroup: 4 + 2 buffer + warpgroup.
constexpr int kDqFullBarrier = 4;   // 4-7: the warpgroup's share is in the buffer (consumers arrive, the writer waits)
constexpr int kDqEmptyBarrier = 8;  // 8-11: the writer's reduction has read it (the writer arrives, consumers wait)
constexpr int kDqHandOffThreads = 128 + 32;
// The producer warpgroup's warps: 0 loads Q, dO, K and V (one thread); 1 and 2 add consumer
// warpgroup 0's and 1's dQ into the fp32 sum (dq_writer.cuh); 3 has no work.
constexpr int kDqWriterWarp0 = 1;

// setmaxnreg budgets: 24 + 2 x 240 = 504 = 3 x 168, the CTA's pool under __launch_bounds__(384, 1).
constexpr int kProducerRegisters = 24;
constexpr int kConsumerRegisters = 240;
static_assert(kProducerRegisters + kWarpgroups * kConsumerRegisters <= (1 + kWarpgroups) * (65536 / kThreads / 8 * 8),
              "setmaxnreg budgets exceed the CTA's registers at launch");

}  // namespace hattn::bwd
