// Checks shared by the entry points (forward, backward, append_kv): those that need the CUDA
// runtime, and the cache entries' arguments, which forward and append_kv take alike.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "hattn/hattn.h"

namespace hattn {

// The device the calling thread has current, checked to be a Hopper (sm_90) GPU.
Status check_device();

// GPU memory of `device` (device memory of that GPU, or managed memory); null is fine.
Status check_device_pointer(const char* name, const void* ptr, int device);

// An entry point's last checks before it launches: the device, then each (name, pointer).
Status check_device_and_pointers(std::initializer_list<std::pair<const char*, const void*>> pointers);

// kv_batch_idx (int32, 4-byte aligned) and kv_batch (>= 1 with it, 0 without). Needs no GPU.
Status check_cache_entries(const int32_t* kv_batch_idx, int kv_batch);

// The checking mode (Options::check, or HATTN_CHECK=1 in the environment): the device-side
// promises of `problem`, read back on `stream` (checking.cpp).
bool checking_from_environment();
Status check_promises_on(const AttentionProblem& problem, cudaStream_t stream);
// MLA decoding's (checking.cpp), after its argument and device checks.
Status check_mla_promises_on(const MlaDecodeProblem& problem, cudaStream_t stream);

}  // namespace hattn
