// The backward kernels, called by hattn::backward() after validation.
#pragma once

#include <cuda_runtime_api.h>

#include "hattn/hattn.h"

namespace hattn {

// bwd_01_cuda_core.cu: FlashAttention's backward on CUDA cores, fp32 sums; dense batches.
Status backward_cuda_core(const BackwardProblem& problem, cudaStream_t stream);

// bwd_02_mma_sync.cu: the same on tensor cores (mma.sync), a CTA per 64 keys; dense batches.
Status backward_mma_sync(const BackwardProblem& problem, cudaStream_t stream);

// bwd_03_wgmma.cu: the same on TMA and wgmma, a CTA per 128 keys; D <= 128 (not_supported
// otherwise), dense batches.
Status backward_wgmma(const BackwardProblem& problem, cudaStream_t stream);

}  // namespace hattn
