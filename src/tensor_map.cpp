#include "tensor_map.h"

#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <string>

namespace hattn {
namespace {

// cuTensorMapEncodeTiled through the runtime's driver entry point: no link-time dependency
// on libcuda, so the library and its tests still load on machines without a driver.
Status encode_fn(PFN_cuTensorMapEncodeTiled_v12000* out) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static cudaError_t err = [] {
    cudaDriverEntryPointQueryResult query{};
    void* ptr = nullptr;
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &query);
    if (e == cudaSuccess && query != cudaDriverEntryPointSuccess) e = cudaErrorSymbolNotFound;
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
    return e;
  }();
  if (err != cudaSuccess)
    return {StatusCode::cuda_error, std::string("cuTensorMapEncodeTiled not available: ") + cudaGetErrorString(err)};
  *out = fn;
  return Status::Ok();
}

}  // namespace

Status make_bshd_tensor_map(CUtensorMap* map, const void* base, DType dtype, int batch, int seqlen, int heads,
                            int head_dim, const Strides& strides, int box_rows, int box_cols) {
  if (box_cols * 2 != 128)  // the kernels' swizzled tile layout assumes 128-byte box rows
    return {StatusCode::invalid_argument, "tensor map: box_cols * 2 bytes must be 128 (got " +
                                              std::to_string(box_cols) + " columns)"};
  PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  Status s = encode_fn(&encode);
  if (!s.ok()) return s;
  constexpr int64_t kElem = 2;
  // Strides of dimensions of extent 1 are never used; TMA still wants them 16-byte multiples.
  auto usable = [](int64_t stride, int extent) { return extent == 1 ? int64_t(8) : stride; };
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(seqlen), cuuint64_t(heads), cuuint64_t(batch)};
  const cuuint64_t byte_strides[3] = {cuuint64_t(usable(strides.seq, seqlen) * kElem),
                                      cuuint64_t(usable(strides.head, heads) * kElem),
                                      cuuint64_t(usable(strides.batch, batch) * kElem)};
  const cuuint32_t box[4] = {cuuint32_t(box_cols), cuuint32_t(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                            4, const_cast<void*>(base), dims, byte_strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return {StatusCode::cuda_error, "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(int(r))};
  return Status::Ok();
}

Status make_grouped_bshd_tensor_map(CUtensorMap* map, const void* base, DType dtype, int batch, int seqlen, int heads,
                                    int head_dim, const Strides& strides, int group, int box_rows, int box_cols) {
  if (box_cols * 2 != 128)
    return {StatusCode::invalid_argument, "tensor map: box_cols * 2 bytes must be 128 (got " +
                                              std::to_string(box_cols) + " columns)"};
  if (group < 1 || box_rows % group != 0 || heads % group != 0)
    return {StatusCode::invalid_argument, "tensor map: a head group of " + std::to_string(group) +
                                              " must divide the box's " + std::to_string(box_rows) + " rows and the " +
                                              std::to_string(heads) + " heads"};
  PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  Status s = encode_fn(&encode);
  if (!s.ok()) return s;
  constexpr int64_t kElem = 2;
  auto usable = [](int64_t stride, int extent) { return extent == 1 ? int64_t(8) : stride; };
  const int groups = heads / group;
  const cuuint64_t dims[5] = {cuuint64_t(head_dim), cuuint64_t(group), cuuint64_t(groups), cuuint64_t(seqlen),
                              cuuint64_t(batch)};
  const cuuint64_t byte_strides[4] = {cuuint64_t(usable(strides.head, group) * kElem),
                                      cuuint64_t(usable(strides.head * group, groups) * kElem),
                                      cuuint64_t(usable(strides.seq, seqlen) * kElem),
                                      cuuint64_t(usable(strides.batch, batch) * kElem)};
  const cuuint32_t box[5] = {cuuint32_t(box_cols), cuuint32_t(group), 1, cuuint32_t(box_rows / group), 1};
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  const CUresult r = encode(map, dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                            5, const_cast<void*>(base), dims, byte_strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return {StatusCode::cuda_error, "cuTensorMapEncodeTiled (5-D) failed with CUresult " + std::to_string(int(r))};
  return Status::Ok();
}

Status make_qkv_tensor_maps(const AttentionProblem& p, int q_box_rows, int kv_box_rows, const char* kernel,
                            QkvTensorMaps* maps) {
  constexpr int kBoxCols = 64;  // 128 bytes: one swizzle row
  Status s = make_bshd_tensor_map(&maps->q, p.q, p.dtype, p.tensor_batch(), p.tensor_rows_q(), p.heads_q, p.head_dim,
                                  p.q_strides, q_box_rows, kBoxCols);
  if (s.ok())
    s = make_bshd_tensor_map(&maps->k, p.k, p.dtype, p.tensor_batch_k(), p.tensor_rows_k(), p.heads_kv, p.head_dim,
                             p.k_strides, kv_box_rows, kBoxCols);
  if (s.ok())
    s = make_bshd_tensor_map(&maps->v, p.v, p.dtype, p.tensor_batch_k(), p.tensor_rows_k(), p.heads_kv, p.head_dim,
                             p.v_strides, kv_box_rows, kBoxCols);
  if (!s.ok()) return {s.code(), std::string(kernel) + ": " + s.message()};
  return Status::Ok();
}

}  // namespace hattn
