// A ScratchAllocator for tests: the stream's pool underneath, counting what it hands out and
// gets back, or handing out nothing (`fail`).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "hattn/hattn.h"

namespace hattn::testing {

struct CountingScratch {
  int taken = 0;
  int given_back = 0;
  size_t bytes_taken = 0;
  size_t bytes_given_back = 0;
  bool fail = false;
  bool poison = false;  // fill each block with 0xFF bytes (NaN as floats): what the call must overwrite
  ScratchAllocator allocator;

  CountingScratch() {
    allocator.context = this;
    allocator.allocate = [](void* context, size_t bytes, cudaStream_t stream) -> void* {
      auto* self = static_cast<CountingScratch*>(context);
      void* ptr = nullptr;
      if (self->fail || cudaMallocAsync(&ptr, bytes, stream) != cudaSuccess) return nullptr;
      if (self->poison && cudaMemsetAsync(ptr, 0xFF, bytes, stream) != cudaSuccess) {
        cudaFreeAsync(ptr, stream);
        return nullptr;
      }
      ++self->taken;
      self->bytes_taken += bytes;
      return ptr;
    };
    allocator.release = [](void* context, void* ptr, size_t bytes, cudaStream_t stream) {
      auto* self = static_cast<CountingScratch*>(context);
      ++self->given_back;
      self->bytes_given_back += bytes;
      cudaFreeAsync(ptr, stream);
    };
  }
  CountingScratch(const CountingScratch&) = delete;  // allocator.context points here
  CountingScratch& operator=(const CountingScratch&) = delete;
};

}  // namespace hattn::testing
