#include "tensor_map.h"

#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <algorithm>
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

// A tiled map of `rank` dimensions (innermost first) over `elem_bytes`-byte elements of
// `type` with swizzled boxes whose rows are box[0] elements: 128 bytes (128-byte swizzle), or 64
// (64-byte swizzle: FP8 rows at D = 64); unswizzled (`swizzled` false), rows of a multiple of
// 16 bytes. `strides` are in elements, rank - 1 of them (dimension 0 is contiguous); a
// dimension of extent 1 gets a stand-in stride (never used, but TMA wants a 16-byte multiple).
Status encode_tiled(CUtensorMap* map, const void* base, CUtensorMapDataType type, int64_t elem_bytes, int rank,
                    const int64_t* dims, const int64_t* strides, const uint32_t* box, bool swizzled = true) {
  const int64_t row_bytes = box[0] * elem_bytes;  // the kernels' swizzled tile layouts: 128- or 64-byte rows
  if (swizzled && row_bytes != 128 && row_bytes != 64)
    return {StatusCode::invalid_argument, "tensor map: box_cols * " + std::to_string(elem_bytes) +
                                              " bytes must be 128 or 64 (got " + std::to_string(box[0]) + " columns)"};
  if (!swizzled && (row_bytes % 16 != 0 || box[0] > 256))
    return {StatusCode::invalid_argument, "tensor map: an unswizzled box's rows must be a multiple of 16 bytes and at "
                                          "most 256 elements (got " + std::to_string(box[0]) + " columns)"};
  PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  Status s = encode_fn(&encode);
  if (!s.ok()) return s;
  // The driver call needs a current context. A thread that has made no runtime call yet has
  // none (PyTorch runs a backward on its own autograd thread: CUresult 201 there);
  // cudaFree(nullptr) makes the current device's primary context current, once per thread.
  thread_local bool context_bound = false;
  if (!context_bound) {
    if (cudaError_t e = cudaFree(nullptr); e != cudaSuccess)
      return {StatusCode::cuda_error, std::string("tensor map: no CUDA context: ") + cudaGetErrorString(e)};
    context_bound = true;
  }
  constexpr int kMaxRank = 5;
  cuuint64_t global_dims[kMaxRank], byte_strides[kMaxRank - 1];
  cuuint32_t box_dims[kMaxRank], element_strides[kMaxRank];
  for (int d = 0; d < rank; ++d) {
    global_dims[d] = cuuint64_t(dims[d]);
    box_dims[d] = box[d];
    element_strides[d] = 1;
    if (d > 0) byte_strides[d - 1] = cuuint64_t(dims[d] == 1 ? 16 : strides[d - 1] * elem_bytes);
  }
  const CUresult r = encode(map, type, cuuint32_t(rank), const_cast<void*>(base), global_dims, byte_strides, box_dims,
                            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            !swizzled          ? CU_TENSOR_MAP_SWIZZLE_NONE
                            : row_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B
                                               : CU_TENSOR_MAP_SWIZZLE_64B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return {StatusCode::cuda_error, "cuTensorMapEncodeTiled (" + std::to_string(rank) + "-D) failed with CUresult " +
                                        std::to_string(int(r))};
  return Status::Ok();
}

CUtensorMapDataType element_type(DType dtype) {
  if (dtype == DType::e4m3) return CU_TENSOR_MAP_DATA_TYPE_UINT8;  // TMA copies bytes; the type is the wgmma's
  return dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

}  // namespace

Status make_bshd_tensor_map(CUtensorMap* map, const void* base, DType dtype, int batch, int seqlen, int heads,
                            int head_dim, const Strides& strides, int box_rows, int box_cols) {
  const int64_t dims[4] = {head_dim, seqlen, heads, batch};
  const int64_t element_strides[3] = {strides.seq, strides.head, strides.batch};
  const uint32_t box[4] = {uint32_t(box_cols), uint32_t(box_rows), 1, 1};
  return encode_tiled(map, base, element_type(dtype), dtype_size(dtype), 4, dims, element_strides, box);
}

Status make_bshd_rows_tensor_map(CUtensorMap* map, const void* base, DType dtype, int batch, int seqlen, int heads,
                                 int head_dim, const Strides& strides, int box_rows) {
  const int64_t dims[4] = {head_dim, seqlen, heads, batch};
  const int64_t element_strides[3] = {strides.seq, strides.head, strides.batch};
  const uint32_t box[4] = {uint32_t(head_dim), uint32_t(box_rows), 1, 1};
  return encode_tiled(map, base, element_type(dtype), dtype_size(dtype), 4, dims, element_strides, box, false);
}

Status make_fp32_bshd_tensor_map(CUtensorMap* map, const float* base, int batch, int seqlen, int heads, int head_dim,
                                 int box_rows) {
  const int64_t dims[4] = {head_dim, seqlen, heads, batch};
  const int64_t element_strides[3] = {int64_t(heads) * head_dim, head_dim, int64_t(seqlen) * heads * head_dim};
  const uint32_t box[4] = {32, uint32_t(box_rows), 1, 1};
  return encode_tiled(map, base, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, 4, dims, element_strides, box);
}

Status make_fp32_tiles_tensor_map(CUtensorMap* map, const float* base, int64_t tiles) {
  const int64_t dims[2] = {128, tiles * 32};
  const int64_t element_strides[1] = {128};
  const uint32_t box[2] = {128, 32};
  return encode_tiled(map, base, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, 2, dims, element_strides, box, false);
}

Status make_grouped_bshd_tensor_map(CUtensorMap* map, const void* base, DType dtype, int batch, int seqlen, int heads,
                                    int head_dim, const Strides& strides, int group, int box_rows, int box_cols) {
  if (group < 1 || box_rows % group != 0 || heads % group != 0)
    return {StatusCode::invalid_argument, "tensor map: a head group of " + std::to_string(group) +
                                              " must divide the box's " + std::to_string(box_rows) + " rows and the " +
                                              std::to_string(heads) + " heads"};
  const int64_t dims[5] = {head_dim, group, heads / group, seqlen, batch};
  const int64_t element_strides[4] = {strides.head, strides.head * group, strides.seq, strides.batch};
  const uint32_t box[5] = {uint32_t(box_cols), uint32_t(group), 1, uint32_t(box_rows / group), 1};
  return encode_tiled(map, base, element_type(dtype), dtype_size(dtype), 5, dims, element_strides, box);
}

Status make_transposed_tensor_map(CUtensorMap* map, const void* base, int batch, int heads, int head_dim, int keys,
                                  int box_keys) {
  const int64_t dims[4] = {keys, head_dim, heads, batch};
  const int64_t element_strides[3] = {keys, int64_t(head_dim) * keys, int64_t(heads) * head_dim * keys};
  const uint32_t box[4] = {uint32_t(box_keys), uint32_t(head_dim), 1, 1};
  return encode_tiled(map, base, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, 4, dims, element_strides, box);
}

Status make_qkv_tensor_maps(const AttentionProblem& p, int q_box_rows, int kv_box_rows, const char* kernel,
                            QkvTensorMaps* maps) {
  // One swizzle row: 128 bytes, or a whole row where that is shorter (e4m3 at D = 64: 64 bytes).
  const int kBoxCols = std::min(128 / dtype_size(p.dtype), p.head_dim);
  // A failure names the kernel and the tensor.
  auto named = [&](const char* tensor, const Status& s) -> Status {
    return s.ok() ? s : Status{s.code(), std::string(kernel) + ": " + tensor + ": " + s.message()};
  };
  Status s = named("q", make_bshd_tensor_map(&maps->q, p.q, p.dtype, p.tensor_batch(), p.tensor_rows_q(), p.heads_q,
                                             p.head_dim, p.q_strides, q_box_rows, kBoxCols));
  if (p.has_fp8_cache()) {  // whole e4m3 rows, unswizzled: the kernel widens them in shared memory
    if (s.ok())
      s = named("k", make_bshd_rows_tensor_map(&maps->k, p.k, DType::e4m3, p.tensor_batch_k(), p.tensor_rows_k(),
                                               p.heads_kv, p.head_dim, p.k_strides, kv_box_rows));
    if (s.ok())
      s = named("v", make_bshd_rows_tensor_map(&maps->v, p.v, DType::e4m3, p.tensor_batch_k(), p.tensor_rows_k(),
                                               p.heads_kv, p.head_dim, p.v_strides, kv_box_rows));
    return s;
  }
  if (s.ok())
    s = named("k", make_bshd_tensor_map(&maps->k, p.k, p.dtype, p.tensor_batch_k(), p.tensor_rows_k(), p.heads_kv,
                                        p.head_dim, p.k_strides, kv_box_rows, kBoxCols));
  if (s.ok())
    s = named("v", make_bshd_tensor_map(&maps->v, p.v, p.dtype, p.tensor_batch_k(), p.tensor_rows_k(), p.heads_kv,
                                        p.head_dim, p.v_strides, kv_box_rows, kBoxCols));
  return s;
}

}  // namespace hattn
