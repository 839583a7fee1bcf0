// The dispatch table: every lineage kernel and the production forward register one entry here.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "hattn/hattn.h"

namespace hattn {

// What an entry runs beyond the base contract (dense batches, causal masks, GQA, head dims
// 64/128/256, bf16 and fp16). A problem that uses a feature its entry lacks is refused before the
// entry's supports() is asked, with one message for every entry. In the forward's registry only
// the production forward (fwd_sm90) has any; the backward's entries declare softcap, and their
// supports() say what else they refuse (which of them run a variable-length batch).
struct Features {
  bool window = false;   // a sliding window (window_left / window_right)
  bool varlen = false;   // a variable-length batch (cu_seqlens_q / cu_seqlens_k)
  bool paged = false;    // keys in use, paged caches, cache entries, left padding
  bool fp8 = false;      // e4m3 inputs
  bool fp8_cache = false;  // an e4m3 KV cache beside 16-bit queries (kv_dtype)
  bool softcap = false;  // softcap > 0
  // The backward's BackwardProblem::deterministic: gradients bitwise the same from run to run
  // never, only without GQA (a group's query heads add into dK and dV in no fixed order), or
  // always.
  enum class Deterministic { no, without_gqa, yes };
  Deterministic deterministic = Deterministic::no;
};

// A kernel's own decisions for one problem shape (the production forward's fwd::ForwardPlan),
// which plan() keeps and run() hands back to the same kernel's launch_planned.
struct KernelPlan {
  virtual ~KernelPlan() = default;
  int block_m = 0, block_n = 0;  // query rows and keys per tile
  int splits = 1;                // split-KV parts
  size_t workspace_bytes = 0;    // what the launch needs beside the tensors
};

// A registered kernel. The forward's registry (Problem = AttentionProblem) and the backward's
// (BackwardProblem, common/backward.h) hold this one type and resolve "auto" by one rule
// (resolve_entry below).
template <typename Problem>
struct Entry {
  const char* name;
  const char* description;
  // Ok when the kernel can run `problem` (arguments already validated); otherwise a
  // not_supported status whose message says what it refuses and why.
  Status (*supports)(const Problem& problem);
  // Launches on `stream`; returns the launch status (no synchronization).
  Status (*launch)(const Problem& problem, cudaStream_t stream);
  Features features = {};
  // Bytes of workspace the launch needs for `problem` (AttentionProblem::workspace); null for
  // kernels that never need any.
  Status (*workspace_bytes)(const Problem& problem, size_t* bytes) = nullptr;
  // Optional: the decisions launch() makes for `problem`'s shape, made once (plan()), and the
  // launch that takes them instead of deciding again (run()). Without them, run() calls launch().
  Status (*plan)(const Problem& problem, std::shared_ptr<const KernelPlan>* decisions) = nullptr;
  Status (*launch_planned)(const Problem& problem, const KernelPlan& decisions, cudaStream_t stream) = nullptr;
};
using KernelEntry = Entry<AttentionProblem>;

// One accessor per lineage kernel, defined in its own file under src/lineage/.
const KernelEntry& kernel_01_naive();
const KernelEntry& kernel_02_fused_online_softmax();
const KernelEntry& kernel_03_mma_sync();
const KernelEntry& kernel_04_swizzle();
const KernelEntry& kernel_05_cp_async_pipeline();
const KernelEntry& kernel_06_tma_mbarrier();
const KernelEntry& kernel_07_wgmma();
const KernelEntry& kernel_08_warp_specialization();
const KernelEntry& kernel_09_pingpong();
const KernelEntry& kernel_10_intra_warpgroup_overlap();
const KernelEntry& kernel_11_persistent();
const KernelEntry& kernel_12_epilogue_hot_loop();
const KernelEntry& kernel_13_wide_tiles();
const KernelEntry& kernel_14_seamless_items();
const KernelEntry& kernel_15_three_consumers();
const KernelEntry& kernel_16_coalesced_store();
// The production forward (src/attention/forward.cu), which "auto" runs.
const KernelEntry& kernel_fwd_sm90();

// All entries: the lineage in order, then the production forward.
const std::vector<const KernelEntry*>& registry();

// The one rule of both registries, the forward's (KernelEntry) and the backward's
// (BackwardKernel): `name` "auto" picks the newest entry, the last
// registered, whose `supports(entry)` is ok, and otherwise says why each refused, each reason
// led by the kernel's name; a name picks that entry if it supports the problem.
// `what` names the registry in messages ("kernel", "backward kernel").
template <typename Entry>
Status named_refusal(const Entry& e, const Status& s) {  // the message, led by the kernel's name
  if (s.ok() || s.message().rfind(std::string(e.name) + ":", 0) == 0) return s;
  return {s.code(), std::string(e.name) + ": " + s.message()};
}

template <typename Entry, typename Supports>
Status resolve_entry(const std::vector<const Entry*>& entries, const std::string& name, const char* what,
                     Supports supports, const Entry** out) {
  *out = nullptr;
  if (name == "auto") {
    std::string reasons;
    for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
      const Status s = named_refusal(**it, supports(**it));
      if (s.ok()) {
        *out = *it;
        return s;
      }
      reasons += "\n  " + s.message();
    }
    return {StatusCode::not_supported, std::string("kernel: no ") + what + " supports this problem:" + reasons};
  }
  for (const Entry* e : entries)
    if (name == e->name) *out = e;
  if (*out == nullptr) {
    std::string known = "auto";
    for (const Entry* e : entries) known += std::string(", ") + e->name;
    return {StatusCode::invalid_argument,
            std::string("kernel: unknown ") + what + " '" + name + "' (known: " + known + ")"};
  }
  const Status s = named_refusal(**out, supports(**out));
  if (!s.ok()) *out = nullptr;
  return s;
}

}  // namespace hattn
