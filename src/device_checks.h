// Checks that need the CUDA runtime, shared by the entry points (forward, backward, append_kv).
#pragma once

#include "hattn/hattn.h"

namespace hattn {

// The device the calling thread has current, checked to be a Hopper (sm_90) GPU.
Status check_device();

// A host pointer handed to a kernel would fault the whole context: refuse it here. Null is fine.
Status check_device_pointer(const char* name, const void* ptr);

}  // namespace hattn
