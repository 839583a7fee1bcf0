// setmaxnreg: moves registers between the warpgroups of a warp-specialized kernel.
//
// PTX ISA: Miscellaneous Instructions: setmaxnreg,
// https://docs.nvidia.com/cuda/parallel-thread-execution/#miscellaneous-instructions-setmaxnreg
// Takes effect only when the kernel has a register cap at entry (__launch_bounds__(n, 1)) and
// every warp of a warpgroup executes it; otherwise ptxas ignores it with warning C7508.
#pragma once

namespace hattn::ptx {

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegisters % 8 == 0 && kRegisters >= 24 && kRegisters <= 256, "setmaxnreg takes 24..256, step 8");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegisters % 8 == 0 && kRegisters >= 24 && kRegisters <= 256, "setmaxnreg takes 24..256, step 8");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

}  // namespace hattn::ptx
