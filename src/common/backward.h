// The backward kernels, called by hattn::backward() after validation.
#pragma once

#include <cuda_runtime_api.h>

#include "../registry.h"
#include "hattn/hattn.h"

namespace hattn {

// A backward kernel, as hattn::backward() dispatches it: the registry's one entry type. Its
// supports() needs no GPU; softcap is its one declared feature. The lineage's steps (all but
// bwd_sm90) run the base contract: dense batches, causal or not, GQA, no softcap.
using BackwardKernel = Entry<BackwardProblem>;

// bwd_01_cuda_core.cu: FlashAttention's backward on CUDA cores, fp32 sums.
const BackwardKernel& backward_cuda_core();
// bwd_02_mma_sync.cu: the same on tensor cores (mma.sync), a CTA per 64 keys.
const BackwardKernel& backward_mma_sync();
// bwd_03_wgmma.cu: the same on TMA and wgmma, a CTA per 128 keys; D <= 128.
const BackwardKernel& backward_wgmma();
// bwd_04_dq_per_cta.cu: B03 with one dQ sum per CTA (the warpgroups split D, not the keys).
const BackwardKernel& backward_dq_per_cta();
// bwd_05_tma_dq.cu: B04 with dQ added by TMA reductions from shared memory (D <= 128).
const BackwardKernel& backward_tma_dq();
// bwd_06_hot_loop.cu: B05 with its elementwise math lean: no mask where none is needed, shared
// memory read as shared, ex2.approx with the scale folded (D <= 128).
const BackwardKernel& backward_hot_loop();
// bwd_07_dkdv_direct.cu: B06 writing dK and dV once, without fp32 sums, where no other CTA adds
// to them (no GQA).
const BackwardKernel& backward_dkdv_direct();
// bwd_08_dq_overlap.cu: B07 with a block's dQ wgmma issued at the top of the next step and
// sent out while that step's S^T runs (D <= 128).
const BackwardKernel& backward_dq_overlap();
// bwd_09_split_d.cu: D = 256 on wgmma: 64 keys a CTA, D split between the warpgroups for dK, dV
// and dQ, S^T and dP^T by queries through shared memory, dQ by atomics.
const BackwardKernel& backward_split_d();
// bwd_10_dq_pass.cu: B09 without dQ, and dQ in a pass of its own (64 queries a CTA, over the
// keys): no atomics for dQ (D = 256).
const BackwardKernel& backward_dq_pass();
// bwd_11_dq_pipeline.cu: B10 with its dQ pass warp-specialized: 128 queries a CTA, a producer
// streaming K and V, dS kept in registers (D = 256).
const BackwardKernel& backward_dq_pipeline();
// bwd_12_dkdv_pipeline.cu: B11 with its dK/dV pass warp-specialized: a producer loading Q, dO,
// LSE and delta, each block's dV and dK left running under the next block's S^T and dP^T (D = 256).
const BackwardKernel& backward_dkdv_pipeline();
// bwd_13_producer.cu: B08 with a producer warpgroup: Q/dO stages released by mbarriers, no
// CTA-wide barrier a block (D = 64 and 128).
const BackwardKernel& backward_producer();
// bwd_14_tma_dkdv.cu: B13 with dK and dV stored by TMA from shared memory where the kernel
// writes them (no GQA), and the CTAs of a head staggered over the query blocks.
const BackwardKernel& backward_tma_dkdv();
// bwd_15_tma_sums.cu: B14 with the fp32 sums of dK and dV (GQA) added by TMA reductions, and the
// stagger on every path.
const BackwardKernel& backward_tma_sums();

// src/attention/backward/: the production backward ("bwd_sm90"), B15's kernel split by role at
// D = 64 and 128 and B12's two passes at D = 256 (dense and variable-length batches, GQA,
// causal, windows, softcap).
const BackwardKernel& backward_sm90();

}  // namespace hattn
