// The production backward ("bwd_sm90", what "auto" runs), host side: supports() says what it
// runs; launch() builds the TMA descriptors and launches the kernels inside run_backward's steps
// (fp32 sums, delta, the conversion: common/backward_common.cuh). At D = 64 and 128 one kernel,
// backward step B15's (src/lineage/bwd_15_tma_sums.cu) split by role (kernel.cuh); at D = 256
// two passes, B12's (two_pass/).
#include <cuda.h>

#include <string>

#include "../../common/backward.h"
#include "../../common/backward_common.cuh"
#include "../../tensor_map.h"
#include "kernel.cuh"
#include "two_pass/dkdv_pass.cuh"
#include "two_pass/dq_pass.cuh"

namespace hattn {
namespace {

constexpr const char* kName = "bwd_sm90";

// Refuses what the kernel cannot run, so that "auto" passes it on to an older kernel.
Status supports(const BackwardProblem& problem) {
  const AttentionProblem& p = problem.forward;
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != bwd::two_pass::kD)
    return {StatusCode::not_supported,
            std::string(kName) + ": head_dim " + std::to_string(p.head_dim) + " is not supported (64, 128, 256)"};
  return Status::Ok();  // keys in use, pages, cache entries, left padding: refused by backward() for every kernel
}

// The deterministic mode's turn counters (BackwardParams::dq_turns, dkdv_turns): per query block
// and head, and with GQA per key block and K/V head, one for each consumer warpgroup. The two
// passes at D = 256 need none: they write dQ once, and dK and dV once without GQA; with GQA a
// deterministic call gives each query head its own rows of the dK and dV sums, each added once,
// and the conversion adds a group's rows in head order (run_backward's dkdv_sums_per_query_head).
TurnCounts deterministic_turns(const AttentionProblem& fwd) {
  TurnCounts turns;
  if (fwd.head_dim == bwd::two_pass::kD) return turns;
  const int block_m = bwd::block_m(fwd.head_dim);
  turns.q_blocks = (fwd.seqlen_q + block_m - 1) / block_m;
  turns.k_blocks = (fwd.seqlen_k + bwd::kBlockN - 1) / bwd::kBlockN;
  turns.dq = int64_t(fwd.batch) * fwd.heads_q * turns.q_blocks * bwd::kWarpgroups;
  if (fwd.heads_q != fwd.heads_kv) turns.dkdv = int64_t(fwd.batch) * fwd.heads_kv * turns.k_blocks * bwd::kWarpgroups;
  return turns;
}

// The TMA descriptors of q, k, v (boxes of q_rows and kv_rows rows) and dout (like q: packed
// rows when varlen).
Status make_input_maps(const BackwardProblem& problem, int q_rows, int kv_rows, QkvTensorMaps* maps,
                       CUtensorMap* dout_map) {
  const AttentionProblem& fwd = problem.forward;
  Status s = make_qkv_tensor_maps(fwd, q_rows, kv_rows, kName, maps);
  if (s.ok())
    s = make_bshd_tensor_map(dout_map, problem.dout, fwd.dtype, fwd.tensor_batch(), fwd.tensor_rows_q(), fwd.heads_q,
                             fwd.head_dim, problem.dout_strides, q_rows, 64);
  if (!s.ok()) return {s.code(), std::string(kName) + ": " + s.message()};
  return s;
}

// D = 256: the dK/dV pass, then the dQ pass (two_pass/). The first writes dK and dV without
// GQA (else adds them into the fp32 sums), the second writes every row of dQ.
Status launch_two_passes(const BackwardProblem& problem, cudaStream_t stream) {
  namespace tp = bwd::two_pass;
  const AttentionProblem& fwd = problem.forward;
  QkvTensorMaps maps;  // boxes of 64 rows: the dK/dV pass's query blocks, the dQ pass's key blocks
  CUtensorMap dout_map;
  Status s = make_input_maps(problem, tp::kDkdvQueries, tp::kDqKeys, &maps, &dout_map);
  if (!s.ok()) return s;
  return run_backward<FeatureParams>(
      problem, stream, kName,
      [&]<typename T, int D>(const BackwardParams& p) -> Status {
        if constexpr (D != tp::kD) {
          return {StatusCode::not_supported, std::string(kName) + ": two passes at D = 256 only"};  // not called
        } else {
          constexpr int kDkdvSmem = tp::storage_bytes<tp::DkdvStorage<T>>();
          constexpr int kDqSmem = tp::storage_bytes<tp::DqStorage<T>>();
          static_assert(kDkdvSmem <= 227 * 1024 && kDqSmem <= 227 * 1024, "shared memory per CTA exceeds sm_90's 227 KB");
          auto both = [&](auto dkdv_kernel, auto dq_kernel) -> Status {
            Status st = launch_per_key_block(dkdv_kernel, tp::kDkdvKeys, bwd::kThreads, kDkdvSmem, p.fwd, stream, kName,
                                             maps.q, maps.k, maps.v, dout_map, p);
            if (!st.ok()) return st;
            // The dQ pass as a programmatic dependent of the dK/dV pass: it reads nothing that
            // pass writes, so its CTAs take SMs as the dK/dV pass's last wave frees them
            // (dq_pass.cuh says how its end waits for that pass).
            return launch_dependent_with_smem(dq_kernel, per_block_grid(p.fwd.seqlen_q, tp::kDqQueries, p.fwd),
                                              dim3(bwd::kThreads), kDqSmem, stream,
                                              std::string(kName) + ": the dQ pass", maps.q, maps.k, maps.v, dout_map, p);
          };
          if (fwd.is_varlen()) return both(tp::dkdv_kernel<T, true>, tp::dq_kernel<T, true>);
          return both(tp::dkdv_kernel<T, false>, tp::dq_kernel<T, false>);
        }
      },
      /*dkdv_written_by_kernel=*/fwd.heads_q == fwd.heads_kv, /*dq_written_by_kernel=*/true, TurnCounts{},
      /*dkdv_sums_per_query_head=*/problem.deterministic && fwd.heads_q != fwd.heads_kv);
}

Status launch(const BackwardProblem& problem, cudaStream_t stream) {
  const AttentionProblem& fwd = problem.forward;
  if (fwd.head_dim == bwd::two_pass::kD) return launch_two_passes(problem, stream);
  QkvTensorMaps maps;  // Q and dO in boxes of a step's query rows, K and V of the CTA's keys
  CUtensorMap dout_map;
  Status s = make_input_maps(problem, bwd::block_m(fwd.head_dim), bwd::kBlockN, &maps, &dout_map);
  if (!s.ok()) return s;
  return run_backward<FeatureParams, /*kDqTiles=*/true>(
      problem, stream, kName,
      [&]<typename T, int D>(const BackwardParams& p) -> Status {
        if constexpr (D > 128) {
          return {StatusCode::not_supported, std::string(kName) + ": one pass at D <= 128 only"};  // not called (two passes)
        } else {
          static_assert(bwd::smem_bytes<T, D, true>() <= 227 * 1024, "shared memory per CTA exceeds sm_90's 227 KB");
          // Over run_backward's fp32 dQ sum in tiles (kDqTiles above), which exists only from here
          // on: a box a tile.
          CUtensorMap dq_map;
          Status st = make_fp32_tiles_tensor_map(&dq_map, p.dq_accum, dq_sum_tiles(fwd));
          if (!st.ok()) return {st.code(), std::string(kName) + ": " + st.message()};
          // 64-row boxes (a warpgroup's keys) over dK and dV where the kernel writes them (a packed
          // batch's over its rows), else over run_backward's fp32 sums of them.
          CUtensorMap dk_map, dv_map;
          if (p.dk_accum == nullptr) {
            st = make_bshd_tensor_map(&dk_map, problem.dk, fwd.dtype, fwd.tensor_batch(), fwd.tensor_rows_k(),
                                      fwd.heads_kv, D, problem.dk_strides, 64, 64);
            if (st.ok())
              st = make_bshd_tensor_map(&dv_map, problem.dv, fwd.dtype, fwd.tensor_batch(), fwd.tensor_rows_k(),
                                        fwd.heads_kv, D, problem.dv_strides, 64, 64);
          } else {
            st = make_fp32_bshd_tensor_map(&dk_map, p.dk_accum, fwd.tensor_batch(), fwd.tensor_rows_k(), fwd.heads_kv,
                                           D, 64);
            if (st.ok())
              st = make_fp32_bshd_tensor_map(&dv_map, p.dv_accum, fwd.tensor_batch(), fwd.tensor_rows_k(), fwd.heads_kv,
                                             D, 64);
          }
          if (!st.ok()) return {st.code(), std::string(kName) + ": " + st.message()};
          if (fwd.is_varlen())
            return launch_per_key_block(bwd::backward_kernel<T, D, true>, bwd::kBlockN, bwd::kThreads,
                                        bwd::smem_bytes<T, D, true>(), p.fwd, stream, kName, maps.q, maps.k, maps.v,
                                        dout_map, dq_map, dk_map, dv_map, p);
          return launch_per_key_block(bwd::backward_kernel<T, D, false>, bwd::kBlockN, bwd::kThreads,
                                      bwd::smem_bytes<T, D, false>(), p.fwd, stream, kName, maps.q, maps.k, maps.v,
                                      dout_map, dq_map, dk_map, dv_map, p);
        }
        // dK and dV written by the kernel without GQA (a packed batch's too, whose rows that no
        // sequence owns run_backward zeroes).
      },
      /*dkdv_written_by_kernel=*/fwd.heads_q == fwd.heads_kv, /*dq_written_by_kernel=*/false,
      deterministic_turns(fwd));
}

}  // namespace

const BackwardKernel& backward_sm90() {
  static const BackwardKernel kernel{
      kName, "the production backward: B15's kernel split by role, B12's two passes at D = 256 (src/attention/backward/)",
      supports, launch,
      Features{.window = true, .varlen = true, .softcap = true, .deterministic = Features::Deterministic::yes}};
  return kernel;
}

}  // namespace hattn
