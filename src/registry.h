// The dispatch table: every lineage kernel and the production forward register one entry here.
#pragma once

#include <string>
#include <vector>

#include "hattn/hattn.h"

namespace hattn {

struct KernelEntry {
  const char* name;
  const char* description;
  // Ok when the kernel can run `problem` (arguments already validated); otherwise a
  // not_supported status whose message says what it refuses and why.
  Status (*supports)(const AttentionProblem& problem);
  // Launches on `stream`; returns the launch status (no synchronization).
  Status (*launch)(const AttentionProblem& problem, cudaStream_t stream);
  // Runs problems with a sliding window (window_left / window_right); the lineage kernels
  // leave it false and are refused such problems before their supports() is asked. Only the
  // production forward (fwd_sm90) sets this and the flags below.
  bool supports_window = false;
  // Runs variable-length batches (cu_seqlens_q / cu_seqlens_k); likewise.
  bool supports_varlen = false;
  // Runs seqlens_k (keys in use per sequence) and paged KV caches (block_table); likewise.
  bool supports_paged = false;
  // Runs e4m3 (FP8) inputs; likewise.
  bool supports_fp8 = false;
  // Bytes of workspace the launch needs for `problem` (AttentionProblem::workspace); null for
  // kernels that never need any.
  Status (*workspace_bytes)(const AttentionProblem& problem, size_t* bytes) = nullptr;
  // Runs softcapping (softcap > 0); likewise.
  bool supports_softcap = false;
};

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
// (BackwardKernel, common/backward.h): `name` "auto" picks the newest entry, the last
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
