// griddepcontrol: programmatic dependent launch between two kernels of a stream.
//
// PTX ISA: Parallel Synchronization and Communication Instructions: griddepcontrol,
// https://docs.nvidia.com/cuda/parallel-thread-execution/#parallel-synchronization-and-communication-instructions-griddepcontrol
// A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may start before
// the kernel ahead of it in the stream has finished: once every CTA of that kernel has issued
// launch_dependents (or exited). Its wait then blocks until that kernel has completed and its
// memory writes are visible. Without the launch attribute both are no-ops.
#pragma once

namespace hattn::ptx {

// Lets the dependent kernel launch early (its CTAs take SMs as they free up, then wait).
__device__ __forceinline__ void griddepcontrol_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// Blocks until the kernels this one depends on have completed and their writes are visible.
__device__ __forceinline__ void griddepcontrol_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

}  // namespace hattn::ptx
