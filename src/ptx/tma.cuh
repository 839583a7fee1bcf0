// TMA: bulk tensor copies between global and shared memory, described by a tensor map.
//
// PTX ISA: Data Movement and Conversion Instructions: cp.async.bulk.tensor,
// https://docs.nvidia.com/cuda/parallel-thread-execution/#data-movement-and-conversion-instructions-cp-async-bulk-tensor
// The tensor map (a CUtensorMap built on the host by cuTensorMapEncodeTiled) must live in
// param/const/global memory: kernels take it as a `const __grid_constant__` parameter.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "ptx/smem.cuh"

namespace hattn::ptx {

// prefetch.tensormap: pulls the descriptor into the cache ahead of the first copy.
__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// cp.async.bulk.tensor.4d global -> shared, completing on `bar` (its bytes count towards the
// barrier's expect_tx). Coordinates are innermost first; out-of-bounds elements read as 0.
__device__ __forceinline__ void cp_async_bulk_tensor_4d_g2s(void* dst, const CUtensorMap* map, int c0, int c1, int c2,
                                                            int c3, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(cvta_to_shared_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(cvta_to_shared_u32(bar))
      : "memory");
}

// cp.async.bulk.prefetch.tensor.4d: the box at these coordinates from global memory into L2
// only, a hint with no barrier and nothing written to shared memory.
__device__ __forceinline__ void cp_async_bulk_prefetch_tensor_4d_l2(const CUtensorMap* map, int c0, int c1, int c2,
                                                                    int c3) {
  asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

// The same with a 5-D tensor map (the final kernel's Q boxes, which may pack the query heads
// of a K/V head into rows).
__device__ __forceinline__ void cp_async_bulk_tensor_5d_g2s(void* dst, const CUtensorMap* map, int c0, int c1, int c2,
                                                            int c3, int c4, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], "
      "[%7];\n" ::"r"(cvta_to_shared_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(cvta_to_shared_u32(bar))
      : "memory");
}

// cp.async.bulk global -> shared (no tensor map): `bytes` contiguous bytes, a multiple of 16,
// both addresses 16-byte aligned, completing on `bar` like the tensor copies.
__device__ __forceinline__ void cp_async_bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   cvta_to_shared_u32(dst)),
               "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(cvta_to_shared_u32(bar))
               : "memory");
}

// fence.proxy.async.shared::cta: orders this thread's generic-proxy shared-memory writes
// before later async-proxy (TMA, wgmma) accesses of the same memory.
__device__ __forceinline__ void fence_proxy_async_shared_cta() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// cp.async.bulk.tensor.4d shared -> global, tracked by this thread's bulk async-groups (not by
// an mbarrier). Out-of-bounds elements of the box are not written. The shared data must have
// been written before a fence.proxy.async (generic-proxy writes, async-proxy read).
__device__ __forceinline__ void cp_async_bulk_tensor_4d_s2g(const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                                            const void* src) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(cvta_to_shared_u32(src))
               : "memory");
}

// The same with a 5-D tensor map.
__device__ __forceinline__ void cp_async_bulk_tensor_5d_s2g(const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                                            int c4, const void* src) {
  asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4, %5}], [%6];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(cvta_to_shared_u32(src))
               : "memory");
}

// cp.reduce.async.bulk.tensor.4d .add shared -> global: adds the box at coordinates (c0..c3)
// from shared memory into the global tensor, element by element and atomically (the element
// type is the map's: fp32 for the backward's dQ sum). Out-of-bounds elements are skipped.
// Tracked by this thread's bulk async-groups; the shared data must have been written before a
// fence.proxy.async (generic-proxy writes, async-proxy read).
__device__ __forceinline__ void cp_reduce_async_bulk_tensor_4d_add(const CUtensorMap* map, int c0, int c1, int c2,
                                                                   int c3, const void* src) {
  asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(cvta_to_shared_u32(src))
               : "memory");
}

// The same over a 2-D tensor map (the backward's dQ sum in tiles: rows of 128 floats).
__device__ __forceinline__ void cp_reduce_async_bulk_tensor_2d_add(const CUtensorMap* map, int c0, int c1,
                                                                   const void* src) {
  asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(cvta_to_shared_u32(src))
               : "memory");
}

// cp.async.bulk.commit_group: closes this thread's bulk copies issued so far into a group.
__device__ __forceinline__ void cp_async_bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// cp.async.bulk.wait_group.read: waits until at most kPending of this thread's bulk groups
// still read their shared-memory source (the source may then be overwritten; the global
// writes may still be in flight).
template <int kPending>
__device__ __forceinline__ void cp_async_bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

// cp.async.bulk.wait_group: waits until at most kPending of this thread's bulk groups are
// still in flight, writes included.
template <int kPending>
__device__ __forceinline__ void cp_async_bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace hattn::ptx
