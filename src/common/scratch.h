// Scratch memory for one call, from the problem's ScratchAllocator or, without one, the stream's
// pool (cudaMallocAsync / cudaFreeAsync). Both are stream-ordered: memory given back after the
// call's last launch is enqueued is reused only by work later on the stream.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "../device_checks.h"
#include "common.cuh"
#include "hattn/hattn.h"

namespace hattn {

// `bytes` of scratch into *ptr; a failure names `what`, the size and the kernel.
inline Status take_scratch(const ScratchAllocator* allocator, size_t bytes, cudaStream_t stream,
                           const std::string& what, void** ptr) {
  *ptr = nullptr;
  if (allocator == nullptr) {
    const cudaError_t err = cudaMallocAsync(ptr, bytes, stream);
    if (err == cudaSuccess) return Status::Ok();
    cudaGetLastError();  // clears the error the failed call recorded
    const StatusCode code = err == cudaErrorMemoryAllocation ? StatusCode::out_of_memory : StatusCode::cuda_error;
    return {code, what + ": cudaMallocAsync(" + std::to_string(bytes) + " bytes): " + cudaGetErrorString(err)};
  }
  *ptr = allocator->allocate(allocator->context, bytes, stream);
  if (*ptr == nullptr)
    return {StatusCode::out_of_memory, what + ": the scratch allocator had no " + std::to_string(bytes) + " bytes"};
  // A host or misaligned block would fault the kernels (TMA boxes, 16-byte loads) and with them
  // the whole context: refuse it, and give it back.
  int device = 0;
  Status s = cuda_status(cudaGetDevice(&device), what + ": querying the current device");
  if (s.ok()) s = check_device_pointer("scratch", *ptr, device);
  if (s.ok() && reinterpret_cast<uintptr_t>(*ptr) % 16 != 0)
    s = {StatusCode::invalid_argument, "scratch: the allocator's memory must be 16-byte aligned"};
  if (!s.ok()) {
    allocator->release(allocator->context, *ptr, bytes, stream);
    *ptr = nullptr;
    return {s.code(), what + ": " + s.message()};
  }
  return Status::Ok();
}

// Gives back what take_scratch took (null: nothing). A failure names the kernel and `what`
// (plain strings: this runs on every call).
inline Status give_back_scratch(const ScratchAllocator* allocator, void* ptr, size_t bytes, cudaStream_t stream,
                                const char* kernel, const char* what) {
  if (ptr == nullptr) return Status::Ok();
  if (allocator != nullptr) {
    allocator->release(allocator->context, ptr, bytes, stream);
    return Status::Ok();
  }
  const cudaError_t err = cudaFreeAsync(ptr, stream);
  if (err == cudaSuccess) return Status::Ok();
  cudaGetLastError();
  return {StatusCode::cuda_error, std::string(kernel) + ": " + what + ": cudaFreeAsync: " + cudaGetErrorString(err)};
}

}  // namespace hattn
