// GPU tests: every registered kernel against the fp64 CPU reference.
//
// Each case poisons the output with NaN, runs the kernel, and checks that every output element
// was written, no gap between strided rows was touched, the error against fp64 is at most
// twice that of a same-precision emulation plus a small atol, and the LSE matches (with -inf
// exactly where a row sees no key). Inputs are fresh random values for every run; the seed is
// printed on failure.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "../src/attention/plan.h"
#include "../src/attention/work_order.h"
#include "../src/common/tile_scheduler.cuh"
#include "../tools/harness.h"
#include "counting_scratch.h"
#include "gpu_env.h"
#include "make_shape.h"
#include "hattn/hattn.h"

namespace hattn {
namespace {

using harness::Layout;
using harness::Shape;

using testing::make;

// Hand-picked edge cases, then seeded random shapes over every (D, dtype, causal) corner.
std::vector<Shape> test_shapes() {
  const DType bf = DType::bf16, fp = DType::fp16;
  std::vector<Shape> shapes = {
      make(1, 1, 1, 1, 1, 64, false, bf, Layout::contiguous),           // a single element
      make(1, 1, 1, 1, 1, 128, true, fp, Layout::contiguous),
      make(1, 128, 128, 2, 2, 128, false, bf, Layout::contiguous),      // exact tile multiples
      make(1, 128, 128, 2, 2, 128, true, bf, Layout::contiguous),
      make(2, 65, 65, 2, 1, 64, true, bf, Layout::padded),              // one past a tile
      make(1, 127, 129, 4, 2, 128, false, fp, Layout::padded),          // tails on both sides
      make(1, 37, 300, 2, 2, 64, true, bf, Layout::contiguous),         // Sq < Sk, causal
      make(1, 300, 37, 2, 1, 128, true, bf, Layout::padded),            // Sq > Sk: fully masked rows
      make(2, 200, 3, 2, 2, 64, true, fp, Layout::contiguous),          // most rows fully masked
      make(1, 3, 200, 8, 1, 256, false, bf, Layout::contiguous),        // MQA, few queries
      make(2, 190, 190, 8, 1, 64, true, fp, Layout::contiguous, false), // GQA 8, no LSE
      make(2, 150, 150, 3, 3, 128, false, bf, Layout::packed_qkv),      // packed qkv strides
      make(1, 257, 257, 2, 2, 256, true, fp, Layout::packed_qkv),
      make(1, 96, 513, 4, 2, 256, false, bf, Layout::padded),
      make(3, 33, 77, 4, 4, 256, true, bf, Layout::contiguous),
      // More query blocks than an H200 has SMs (132), so persistent CTAs run several items
      // each: the K/V ring and Q's phases carry across items.
      make(2, 130, 130, 80, 20, 64, false, bf, Layout::contiguous),    // 320 items, GQA 4
      make(2, 300, 100, 48, 8, 128, true, fp, Layout::padded),         // 288 items, a third without keys
      make(2, 140, 140, 64, 64, 256, true, bf, Layout::contiguous),    // 256 items
      // Without a mask, a few items past whole rounds of 132 CTAs: the production forward cuts the
      // last round's items into parts along the keys (its tail split) and combines them.
      make(1, 1000, 3000, 17, 17, 128, false, bf, Layout::contiguous),  // 136 items, 6 parts each
      make(1, 1000, 2000, 23, 23, 64, false, fp, Layout::padded),       // 138 items of 192 rows
      make(1, 500, 1000, 34, 17, 256, false, bf, Layout::contiguous),   // 136 items, GQA 2
      make(1, 300, 9000, 45, 9, 128, false, bf, Layout::padded),        // 135 items, wide tiles
      // Decoding at D = 64 (at most 64 query rows per block) runs in the run-time bounds kernels,
      // where the tail split cuts the last round too: 160 items (28 past a round), then 140.
      make(5, 1, 1100, 32, 32, 64, false, bf, Layout::padded),
      make(5, 40, 3000, 28, 28, 64, false, fp, Layout::contiguous),
  };
  // Softmax scales other than 1/sqrt(D): a larger positive one, a negative one and 0, which
  // the lineage kernels that take the max on unscaled scores refuse (07 on) and the production
  // forward runs (a sign-flipped copy of q; every weight 1), also strided and softcapped.
  shapes.push_back(make(1, 150, 170, 4, 2, 128, true, bf, Layout::contiguous));
  shapes.back().scale = 0.3f;
  shapes.push_back(make(1, 150, 170, 4, 2, 64, true, fp, Layout::contiguous));
  shapes.back().scale = -0.05f;
  shapes.push_back(make(2, 130, 300, 8, 2, 256, false, bf, Layout::padded));
  shapes.back().scale = -0.2f;
  shapes.push_back(make(1, 200, 200, 4, 4, 128, true, fp, Layout::packed_qkv));
  shapes.back().scale = 0.f;
  shapes.push_back(make(2, 90, 260, 4, 1, 64, false, bf, Layout::padded));
  shapes.back().scale = -0.1f;
  shapes.back().softcap = 2.f;
  shapes.push_back(make(1, 70, 140, 2, 2, 128, true, bf, Layout::contiguous));
  shapes.back().scale = 0.f;
  shapes.back().softcap = 5.f;
  // Long key sweeps, where 13 and 14 take their wide tiles (176 keys at D = 128, 160 at
  // D = 64, 80 at D = 256; the tails are not multiples of any): without a mask, and causal
  // with Sq < Sk.
  shapes.push_back(make(1, 130, 8300, 4, 2, 128, false, bf, Layout::padded));
  shapes.push_back(make(1, 200, 8400, 2, 1, 128, true, fp, Layout::contiguous));
  shapes.push_back(make(1, 150, 8250, 4, 1, 64, true, bf, Layout::padded));
  shapes.push_back(make(1, 150, 1100, 4, 2, 256, false, bf, Layout::padded));
  shapes.push_back(make(1, 200, 2300, 2, 1, 256, true, fp, Layout::contiguous));
  // 144 items of unequal length (causal) on 132 SMs: 14's turn and Q halves cross items, and
  // consumer 1's 64 rows of every second block lie past Sq (a Q box wholly out of bounds).
  shapes.push_back(make(2, 190, 700, 36, 6, 128, true, bf, Layout::contiguous));
  // At D = 64, 15's three consumers on a causal sweep across items: 144 items of 192 rows, and
  // consumers 1 and 2 of every second block wholly past Sq.
  shapes.push_back(make(1, 200, 1300, 72, 8, 64, true, fp, Layout::contiguous));
  // Short causal sweeps with three consumers, where each sweeps only the tiles its own rows
  // see (16): the last tile whole, half or not at all, with the diagonal on and off the tiles' grid.
  shapes.push_back(make(1, 2000, 2000, 4, 4, 64, true, bf, Layout::contiguous));
  shapes.push_back(make(1, 1500, 1900, 4, 2, 64, true, fp, Layout::padded));
  // Sliding windows (the production forward only; the lineage kernels refuse them): both edges, one
  // edge, a window narrower than a tile, windows with causal, Sq != Sk with rows that see no
  // key, and sweeps long enough for the wide tiles (D = 128, 256) and three consumers (D = 64).
  auto windowed = [&](Shape s, int left, int right) {
    s.window_left = left;
    s.window_right = right;
    shapes.push_back(s);
  };
  windowed(make(1, 300, 300, 2, 2, 128, false, bf, Layout::contiguous), 64, 64);
  windowed(make(2, 257, 400, 4, 2, 64, true, fp, Layout::padded), 100, -1);
  windowed(make(1, 200, 130, 2, 1, 256, false, bf, Layout::contiguous), 0, 0);
  windowed(make(1, 150, 1000, 4, 4, 128, false, fp, Layout::padded), -1, 40);
  windowed(make(2, 130, 130, 80, 20, 64, true, bf, Layout::contiguous), 7, -1);
  windowed(make(1, 300, 20000, 2, 1, 128, false, bf, Layout::padded), 6000, 4000);
  windowed(make(1, 200, 4000, 2, 2, 256, true, fp, Layout::contiguous), 1500, 0);
  windowed(make(1, 1500, 1500, 2, 2, 64, false, bf, Layout::contiguous), 800, 800);
  windowed(make(1, 90, 500, 2, 1, 128, false, bf, Layout::contiguous), 20, 0);  // Sq < Sk: no row sees key 0..389
  // Variable-length batches (the production forward only): sequences of unequal lengths packed along
  // the rows, empty sequences (no queries, or no keys), lengths that are not tile multiples,
  // a last K/V tile that runs into the next sequence's keys, causal and windowed masks at each
  // sequence's own corner, many short sequences (most query blocks empty), sweeps long
  // enough for the wide tiles and three consumers, and sequences of whole 64-row boxes (stored
  // by TMA at D = 64 and 128) beside partial ones (stored from registers).
  auto varlen = [&](Shape s, std::vector<int> lens_q, std::vector<int> lens_k) {
    harness::set_varlen(&s, std::move(lens_q), std::move(lens_k));
    shapes.push_back(s);
  };
  varlen(make(1, 1, 1, 4, 2, 128, false, bf, Layout::contiguous), {100, 257, 1, 128}, {100, 257, 1, 128});
  varlen(make(1, 1, 1, 2, 1, 64, true, fp, Layout::padded), {300, 0, 77, 513}, {300, 5, 77, 600});
  varlen(make(1, 1, 1, 2, 2, 256, true, bf, Layout::contiguous), {190, 64, 1}, {190, 64, 1});
  varlen(make(1, 1, 1, 2, 1, 128, true, fp, Layout::contiguous), {700, 33}, {700, 40});
  shapes.back().window_left = 100;
  shapes.back().window_right = 0;
  varlen(make(1, 1, 1, 4, 2, 128, false, bf, Layout::padded), {400, 250}, {400, 500});
  shapes.back().window_left = 64;
  shapes.back().window_right = 32;
  varlen(make(1, 1, 1, 2, 2, 64, true, bf, Layout::contiguous), {50, 60, 40}, {0, 60, 45});
  varlen(make(1, 1, 1, 2, 1, 128, false, bf, Layout::contiguous), {130, 8500}, {9000, 8500});
  varlen(make(1, 1, 1, 2, 2, 256, false, fp, Layout::padded), {150, 40}, {1100, 1500});
  varlen(make(1, 1, 1, 2, 2, 128, false, fp, Layout::contiguous), {256, 320, 64}, {256, 320, 64});
  varlen(make(1, 1, 1, 2, 1, 64, false, bf, Layout::contiguous), {192, 384, 64}, {200, 384, 64});
  {
    std::mt19937 lengths(7);
    std::vector<int> lens_q, lens_k;
    for (int b = 0; b < 40; ++b) {
      lens_q.push_back(std::uniform_int_distribution<int>(1, 200)(lengths));
      lens_k.push_back(std::uniform_int_distribution<int>(1, 200)(lengths));
    }
    varlen(make(1, 1, 1, 8, 8, 64, false, bf, Layout::contiguous), lens_q, lens_k);
    varlen(make(1, 1, 1, 4, 1, 128, true, fp, Layout::padded), lens_q, lens_k);
  }
  // Split-KV (the production forward; the lineage kernels ignore num_splits): decoding shapes with
  // few queries and long sweeps, where it splits by itself, and forced part counts on other
  // masks: causal with a window, rows that see no key, more parts than K/V tiles, a varlen
  // batch, the wide tiles.
  shapes.push_back(make(2, 1, 5000, 8, 2, 128, false, bf, Layout::contiguous));
  shapes.push_back(make(1, 4, 3000, 4, 1, 64, true, fp, Layout::padded));
  shapes.push_back(make(1, 1, 2000, 2, 2, 256, false, bf, Layout::contiguous));
  auto split = [&](Shape s, int parts) {
    s.num_splits = parts;
    shapes.push_back(s);
  };
  split(make(2, 300, 700, 4, 2, 128, false, fp, Layout::padded), 3);
  split(make(1, 257, 900, 2, 1, 64, true, bf, Layout::contiguous), 7);
  shapes.back().window_left = 300;
  split(make(1, 300, 50, 2, 2, 128, true, bf, Layout::contiguous), 4);
  split(make(1, 100, 300, 2, 2, 256, false, fp, Layout::contiguous), 64);
  // Decoding split into parts of one tile, a causal GQA decode of two queries in odd-sized
  // parts, and at D = 64 parts of 1 and 2 tiles and a long automatic split.
  split(make(2, 1, 300, 4, 2, 128, false, bf, Layout::contiguous), 3);
  split(make(1, 2, 1000, 8, 2, 256, true, fp, Layout::padded), 5);
  split(make(2, 1, 300, 4, 4, 64, false, bf, Layout::contiguous), 2);
  shapes.push_back(make(1, 1, 7000, 4, 4, 64, false, fp, Layout::padded));
  varlen(make(1, 1, 1, 4, 1, 128, true, bf, Layout::contiguous), {1, 1, 3}, {4000, 100, 2500});
  varlen(make(1, 1, 1, 2, 2, 64, false, fp, Layout::padded), {130, 0, 70}, {900, 40, 1200});
  shapes.back().num_splits = 5;
  // Keys in use per sequence (seqlens_k) on a dense cache, and paged caches (the production forward
  // only): decoding and short prefill shapes, lengths 0, 1 and not tile multiples, pages of 128
  // and 384 keys in a shuffled order, causal and windowed masks at each sequence's own length,
  // GQA, forced split-KV parts.
  auto used = [&](Shape s, std::vector<int> lengths, int page_size) {
    s.seqlens_k_used = std::move(lengths);
    s.page_size = page_size;
    shapes.push_back(s);
  };
  used(make(3, 1, 1000, 8, 2, 128, false, bf, Layout::contiguous), {1000, 1, 513}, 0);
  used(make(2, 4, 700, 4, 1, 64, true, fp, Layout::padded), {700, 130}, 0);
  used(make(3, 1, 1000, 8, 2, 128, false, bf, Layout::contiguous), {1000, 1, 513}, 128);
  used(make(2, 4, 700, 4, 4, 64, true, fp, Layout::contiguous), {700, 130}, 384);
  used(make(2, 64, 300, 2, 1, 256, false, bf, Layout::padded), {300, 0}, 128);
  used(make(1, 200, 900, 2, 2, 128, true, fp, Layout::contiguous), {777}, 128);
  shapes.back().window_left = 100;
  shapes.back().num_splits = 3;
  used(make(4, 1, 2000, 16, 2, 64, false, bf, Layout::contiguous), {2000, 1999, 129, 128}, 256);
  // Cache entries (kv_batch_idx: a shuffle of batch + 1 dense entries or block table rows) and
  // left padding (leftpad_k: keys from an offset, with or without seqlens_k; an offset at the
  // sequence's end leaves no key), the production forward only.
  auto cache = [&](Shape s, std::vector<int> lengths, int page_size, std::vector<int> leftpad, bool indexed) {
    s.seqlens_k_used = std::move(lengths);
    s.page_size = page_size;
    s.leftpad_k = std::move(leftpad);
    s.kv_batch_idx = indexed;
    shapes.push_back(s);
  };
  cache(make(3, 1, 1000, 8, 2, 128, false, bf, Layout::contiguous), {1000, 1, 513}, 0, {}, true);
  cache(make(2, 4, 700, 4, 1, 64, true, fp, Layout::contiguous), {700, 130}, 128, {}, true);
  cache(make(2, 4, 700, 4, 2, 128, true, bf, Layout::padded), {700, 500}, 0, {100, 500}, false);
  shapes.back().num_splits = 3;
  cache(make(2, 64, 300, 2, 1, 256, false, fp, Layout::contiguous), {}, 0, {0, 257}, false);
  cache(make(3, 1, 2000, 16, 2, 64, false, bf, Layout::contiguous), {2000, 1500, 129}, 0, {7, 1000, 128}, true);
  shapes.back().window_left = 300;
  varlen(make(1, 1, 1, 2, 2, 64, true, bf, Layout::contiguous), {3, 100}, {900, 400});
  shapes.back().leftpad_k = {500, 0};
  // Softcapping (the production forward, in its run-time-bounds kernels): caps well inside and near
  // the scores' range, each head dim, causal, a window, varlen, a paged decode with split-KV.
  auto capped = [&](Shape s, float softcap) {
    s.softcap = softcap;
    shapes.push_back(s);
  };
  capped(make(2, 300, 300, 4, 2, 128, false, bf, Layout::contiguous), 1.5f);
  capped(make(1, 257, 700, 4, 4, 64, true, fp, Layout::padded), 30.f);
  capped(make(1, 200, 500, 2, 1, 256, true, bf, Layout::contiguous), 3.f);
  shapes.back().window_left = 90;
  capped(make(1, 2000, 2000, 2, 2, 128, false, bf, Layout::contiguous), 2.f);  // the wide tiles
  capped(make(1, 1000, 1000, 2, 2, 64, false, bf, Layout::contiguous), 2.f);  // three consumers
  capped(make(1, 2100, 2100, 4, 2, 64, true, fp, Layout::padded), 30.f);      // three, causal, GQA 2
  varlen(make(1, 1, 1, 4, 2, 64, true, bf, Layout::contiguous), {100, 257}, {300, 257});
  shapes.back().softcap = 5.f;
  cache(make(3, 1, 1000, 8, 2, 128, false, bf, Layout::contiguous), {1000, 1, 513}, 128, {}, false);
  shapes.back().softcap = 2.5f;
  shapes.back().num_splits = 3;
  // GQA packing (the production forward; the lineage kernels ignore pack_gqa): a K/V head's query
  // heads as rows of one item. Decoding shapes that pack by themselves (groups of 4 and 8, a
  // paged cache, split parts), and packing forced on other masks: causal with Sq not a multiple
  // of anything, Sq > Sk (rows without keys), a varlen batch with a partial last box (stored by
  // threads), the register store (D = 256, D = 128 wide), three consumers (D = 64), a group of
  // 64; and where it stays off: a window, a group of 3 (not a power of two), forced off.
  auto packed = [&](Shape s, std::optional<bool> pack) {
    s.pack_gqa = pack;
    shapes.push_back(s);
  };
  packed(make(3, 1, 3000, 32, 4, 128, false, bf, Layout::contiguous), {});
  packed(make(2, 2, 900, 16, 4, 64, true, fp, Layout::padded), {});
  packed(make(2, 1, 700, 8, 1, 256, false, bf, Layout::contiguous, false), {});
  used(make(2, 1, 1500, 8, 2, 128, false, bf, Layout::contiguous), {1500, 700}, 256);
  shapes.back().pack_gqa = true;
  packed(make(2, 77, 300, 8, 2, 128, true, bf, Layout::contiguous), true);
  packed(make(1, 300, 100, 4, 1, 64, true, fp, Layout::padded), true);
  packed(make(1, 150, 600, 16, 2, 256, false, bf, Layout::contiguous), true);
  shapes.back().window_left = 90;
  shapes.back().window_right = 30;
  packed(make(1, 20, 9000, 4, 2, 128, false, fp, Layout::padded), true);  // wide tiles, register store
  packed(make(1, 500, 1500, 4, 2, 64, false, bf, Layout::contiguous), true);  // three consumers
  packed(make(1, 3, 400, 64, 1, 64, false, bf, Layout::contiguous), true);
  packed(make(1, 5, 400, 6, 2, 128, false, bf, Layout::contiguous), true);  // a group of 3
  packed(make(2, 1, 2000, 16, 4, 128, false, fp, Layout::contiguous), false);
  varlen(make(1, 1, 1, 8, 2, 128, true, bf, Layout::contiguous), {37, 1, 100, 20}, {300, 9, 100, 700});
  shapes.back().pack_gqa = true;
  varlen(make(1, 1, 1, 4, 1, 256, false, fp, Layout::padded), {3, 60, 1}, {2000, 64, 900});
  shapes.back().pack_gqa = true;
  shapes.back().num_splits = 4;
  // An FP8 KV cache (the production forward; e4m3 k and v with descales beside bf16 or fp16 q):
  // decoding with GQA packing and split-KV, paged (NaN codes in unused rows), cache entries with
  // left padding, MQA at D = 64, D = 256, forced parts, a varlen batch, softcap, and prefill
  // shapes where both consumers have rows (causal, padded, tails, one tile, a long sweep).
  auto fp8_cache = [&](Shape s) {
    s.fp8_cache = true;
    shapes.push_back(s);
  };
  fp8_cache(make(3, 1, 1000, 32, 4, 128, false, bf, Layout::contiguous));
  shapes.back().seqlens_k_used = {1000, 1, 513};
  fp8_cache(make(2, 1, 1500, 8, 2, 128, false, fp, Layout::contiguous));
  shapes.back().seqlens_k_used = {1500, 700};
  shapes.back().page_size = 256;
  fp8_cache(make(3, 1, 2000, 16, 2, 64, false, bf, Layout::contiguous));
  shapes.back().seqlens_k_used = {2000, 1500, 129};
  shapes.back().leftpad_k = {7, 1000, 128};
  shapes.back().kv_batch_idx = true;
  fp8_cache(make(1, 4, 3000, 4, 1, 64, true, fp, Layout::padded));
  fp8_cache(make(2, 1, 777, 8, 1, 256, false, bf, Layout::contiguous));
  fp8_cache(make(2, 2, 1000, 8, 2, 256, true, fp, Layout::padded));
  shapes.back().num_splits = 5;
  fp8_cache(make(1, 300, 300, 4, 4, 128, true, bf, Layout::padded));
  fp8_cache(make(2, 200, 333, 4, 2, 64, false, fp, Layout::contiguous));
  fp8_cache(make(1, 128, 128, 2, 2, 256, false, bf, Layout::contiguous));
  fp8_cache(make(1, 100, 5000, 2, 2, 128, false, bf, Layout::contiguous));
  shapes.back().num_splits = 1;
  shapes.back().softcap = 2.5f;
  varlen(make(1, 1, 1, 8, 2, 128, true, bf, Layout::contiguous), {37, 1, 100, 20}, {300, 9, 100, 700});
  shapes.back().fp8_cache = true;
  // The FP8 forward (the production forward; q, k and v e4m3 with descales, out bf16) through
  // the harness, as hattn-bench --dtype e4m3 times it: causal with Sq > Sk, GQA and padding; a
  // long sweep at D = 64; D = 256 with tails.
  const DType e4m3 = DType::e4m3;
  shapes.push_back(make(1, 300, 257, 4, 2, 128, true, e4m3, Layout::padded));
  shapes.push_back(make(1, 100, 3000, 2, 2, 64, false, e4m3, Layout::contiguous));
  shapes.push_back(make(2, 200, 333, 4, 4, 256, false, e4m3, Layout::contiguous));
  std::mt19937 rng(2026);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int d : {64, 128, 256})
    for (DType dtype : {bf, fp})
      for (bool causal : {false, true}) {
        const int group = std::vector<int>{1, 2, 8}[pick(0, 2)];
        const int hkv = pick(1, 2);
        const int sq = pick(1, 260), sk = pick(1, 260);
        const Layout layout = pick(0, 1) ? Layout::padded : Layout::contiguous;
        shapes.push_back(make(pick(1, 2), sq, sk, hkv * group, hkv, d, causal, dtype, layout, pick(0, 3) != 0));
      }
  return shapes;
}

const std::vector<Shape>& shapes() {
  static const std::vector<Shape> s = test_shapes();
  return s;
}

std::vector<std::string> kernel_names() {
  std::vector<std::string> names;
  for (const auto& k : kernels()) names.push_back(k.name);
  return names;
}

class KernelTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(KernelTest, MatchesFp64Reference) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  const auto& [kernel, index] = GetParam();
  const Shape& shape = shapes()[index];
  const uint64_t seed = std::random_device{}() ^ uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  SCOPED_TRACE(kernel + " " + harness::describe(shape) + " seed=" + std::to_string(seed));

  harness::Workload w;
  ASSERT_TRUE(harness::make_workload(shape, seed, &w).ok());
  ASSERT_TRUE(harness::poison_outputs(&w).ok());
  Options options;
  options.kernel = kernel;
  Status s = forward(w.problem, options);
  if (s.code() == StatusCode::not_supported) GTEST_SKIP() << "kernel refuses this shape: " << s.message();
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << cudaGetErrorString(cudaGetLastError());

  const harness::CheckResult r = harness::check_outputs(w, harness::all_rows(shape));
  EXPECT_TRUE(r.passed) << r.summary();
  EXPECT_EQ(r.nan_outputs, 0) << "NaN/inf or unwritten outputs";
  EXPECT_EQ(r.touched_gaps, 0) << "wrote outside the output tensor's elements";
  EXPECT_LE(r.max_err, r.budget);
  EXPECT_EQ(r.lse_mismatches, 0);
  EXPECT_LE(r.lse_max_err, r.lse_budget);
}

// A second launch on a non-default stream reproduces the first result bit for bit (no
// dependence on leftover state, and the stream argument is honoured).
TEST_P(KernelTest, DeterministicOnAStream) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  const auto& [kernel, index] = GetParam();
  if (index % 7 != 0) GTEST_SKIP() << "checked on every 7th shape only";
  const Shape& shape = shapes()[index];
  harness::Workload w;
  ASSERT_TRUE(harness::make_workload(shape, 99, &w).ok());
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  Options options;
  options.kernel = kernel;
  options.stream = stream;
  std::vector<uint16_t> first(w.output.elements), second(w.output.elements);
  for (auto* result : {&first, &second}) {
    ASSERT_TRUE(harness::poison_outputs(&w).ok());
    Status s = forward(w.problem, options);
    if (s.code() == StatusCode::not_supported) GTEST_SKIP() << s.message();
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(result->data(), w.output.device.get(), result->size() * 2, cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  cudaStreamDestroy(stream);
  EXPECT_TRUE(first == second);
}

std::string case_name(const ::testing::TestParamInfo<KernelTest::ParamType>& info) {
  const Shape& s = shapes()[std::get<1>(info.param)];
  std::string name = std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) + "_D" +
                     std::to_string(s.head_dim) + "_Sq" + std::to_string(s.seqlen_q) + "_Sk" +
                     std::to_string(s.seqlen_k) + (s.causal ? "_causal" : "") + "_" + dtype_name(s.dtype);
  if (s.window_left >= 0 || s.window_right >= 0)
    name += "_window" + std::to_string(s.window_left < 0 ? 0 : s.window_left) + (s.window_left < 0 ? "open" : "") + "x" +
            std::to_string(s.window_right < 0 ? 0 : s.window_right) + (s.window_right < 0 ? "open" : "");
  if (s.varlen()) name += "_varlen" + std::to_string(s.batch);
  if (s.num_splits != 0) name += "_split" + std::to_string(s.num_splits);
  if (s.pack_gqa.has_value()) name += *s.pack_gqa ? "_packgqa" : "_nopackgqa";
  if (!s.seqlens_k_used.empty()) name += "_seqlensk";
  if (s.page_size > 0) name += "_paged" + std::to_string(s.page_size);
  if (s.kv_batch_idx) name += "_entries";
  if (!s.leftpad_k.empty()) name += "_leftpad";
  if (s.softcap > 0.f) name += "_softcap";
  if (s.fp8_cache) name += "_e4m3cache";
  return name;
}

// Varlen offsets are the caller's promise, read only on the GPU. Broken ones (past the totals,
// decreasing, negative, sequences longer than the maximum lengths) may give wrong rows, but
// the kernel clamps them and must not write outside out and lse: guard zones around both
// stay poisoned.
TEST(Varlen, BrokenOffsetsStayInsideTheTensors) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  for (int d : {64, 128, 256})
    for (bool window : {false, true}) {
      SCOPED_TRACE("D=" + std::to_string(d) + (window ? " window" : ""));
      Shape shape = make(1, 1, 1, 2, 1, d, false, DType::bf16, Layout::contiguous);
      harness::set_varlen(&shape, {100, 100, 50, 50}, {100, 100, 50, 50});  // 300 rows each
      harness::Workload w;
      ASSERT_TRUE(harness::make_workload(shape, 5, &w).ok());
      const std::vector<int32_t> broken = {0, 250, 90, 100000, 300,     // q: decreasing, past total_q
                                           -50, 400, 10, 20, 99999};  // k: negative, past total_k
      ASSERT_EQ(cudaMemcpy(w.cu_seqlens.get(), broken.data(), broken.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
      AttentionProblem p = w.problem;
      p.seqlen_q = p.seqlen_k = 64;  // shorter than some of the sequences the offsets describe
      if (window) p.window_left = 30;
      constexpr size_t kGuard = 4096;  // elements on each side
      const size_t out_elems = size_t(p.total_q) * p.heads_q * d, lse_elems = size_t(p.heads_q) * p.total_q;
      harness::DeviceBuffer out, lse;
      ASSERT_TRUE(out.allocate((out_elems + 2 * kGuard) * 2).ok());
      ASSERT_TRUE(lse.allocate((lse_elems + 2 * kGuard) * 4).ok());
      ASSERT_EQ(cudaMemset(out.get(), 0xFF, out.bytes()), cudaSuccess);
      ASSERT_EQ(cudaMemset(lse.get(), 0xFF, lse.bytes()), cudaSuccess);
      p.out = static_cast<uint16_t*>(out.get()) + kGuard;
      p.out_strides = contiguous_bshd(p.total_q, p.heads_q, d);
      p.lse = static_cast<float*>(lse.get()) + kGuard;
      const Status s = forward(p);
      ASSERT_TRUE(s.ok()) << s.to_string();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << cudaGetErrorString(cudaGetLastError());
      std::vector<uint16_t> out_host(out_elems + 2 * kGuard);
      std::vector<uint32_t> lse_host(lse_elems + 2 * kGuard);
      ASSERT_EQ(cudaMemcpy(out_host.data(), out.get(), out.bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(lse_host.data(), lse.get(), lse.bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
      int64_t touched = 0;
      for (size_t i = 0; i < kGuard; ++i) {
        touched += out_host[i] != 0xFFFF;
        touched += out_host[kGuard + out_elems + i] != 0xFFFF;
        touched += lse_host[i] != 0xFFFFFFFFu;
        touched += lse_host[kGuard + lse_elems + i] != 0xFFFFFFFFu;
      }
      EXPECT_EQ(touched, 0) << "elements written outside out or lse";
    }
}

// A variable-length batch of more items than SMs runs its work list sorted by cost
// (work_order.cuh), written into the caller's workspace: a stable sort of the items (under the
// causal mask each pair's blocks from its last) by their class, highest first, the empty ones
// last; then the number of items inside their sequences, and the counter the CTAs take their
// positions from (D = 128, or causal), which ends at that number once every CTA has found the
// list used up (and stays 0 where the CTAs take the snake's turns).
// Checked against the same sort on the host, and the outputs against the reference.
TEST(Varlen, WorkOrderIsAStableSortByCost) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  std::mt19937 lengths(11);
  std::vector<int> lens_q, lens_k;
  for (int b = 0; b < 12; ++b) {
    lens_q.push_back(std::uniform_int_distribution<int>(1, 2000)(lengths));
    lens_k.push_back(b % 3 == 0 ? lens_q.back() : std::uniform_int_distribution<int>(1, 2500)(lengths));
  }
  struct Case {
    int d, heads_kv;
    bool causal;
  };
  for (const Case& c : {Case{128, 4, false}, Case{128, 2, false}, Case{256, 4, false}, Case{128, 4, true},
                        Case{256, 2, true}}) {
    SCOPED_TRACE("D=" + std::to_string(c.d) + " Hkv=" + std::to_string(c.heads_kv) + (c.causal ? " causal" : ""));
    Shape shape = make(1, 1, 1, 4, c.heads_kv, c.d, c.causal, DType::bf16, Layout::contiguous);
    harness::set_varlen(&shape, lens_q, lens_k);
    harness::Workload w;
    ASSERT_TRUE(harness::make_workload(shape, 3, &w).ok());
    fwd::ForwardPlan plan;
    ASSERT_TRUE(fwd::make_plan(w.problem, sm_count(), &plan).ok());
    ASSERT_TRUE(plan.sorted_order) << "this batch should sort its work list";
    const bool dynamic = c.causal || c.d == 128;
    ASSERT_EQ(plan.dynamic_order, dynamic) << "the plan's choice of the counter";
    const int heads = plan.params.pack_shift > 0 ? shape.heads_kv : shape.heads_q;
    const fwd::OrderPlan& o = plan.order;
    const int m_blocks = o.m_blocks;
    ASSERT_EQ(o.total, m_blocks * shape.batch * heads);
    ASSERT_EQ(o.causal, c.causal);
    std::vector<int> expected(o.total), cls(o.total);
    int inside = 0;
    for (int v = 0; v < o.total; ++v) {
      const int item = fwd::order_item(o, v), b = item / m_blocks / heads;
      cls[v] = fwd::order_class(o, item % m_blocks, lens_q[b], lens_k[b]);
      inside += cls[v] > 0;
      expected[v] = v;
    }
    std::stable_sort(expected.begin(), expected.end(), [&](int a, int b) { return cls[a] > cls[b]; });

    size_t bytes = 0;
    ASSERT_TRUE(workspace_size(w.problem, &bytes).ok());
    ASSERT_EQ(bytes, size_t(o.total + fwd::kOrderTrailer) * sizeof(int));
    harness::DeviceBuffer workspace;
    ASSERT_TRUE(workspace.allocate(bytes).ok());
    ASSERT_EQ(cudaMemset(workspace.get(), 0xFF, bytes), cudaSuccess);
    w.problem.workspace = workspace.get();
    w.problem.workspace_bytes = bytes;
    ASSERT_TRUE(harness::poison_outputs(&w).ok());
    const Status s = forward(w.problem);
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<int> order(o.total + fwd::kOrderTrailer);
    ASSERT_EQ(cudaMemcpy(order.data(), workspace.get(), bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    int mismatches = 0, first = -1;
    for (int i = 0; i < o.total; ++i)
      if (order[i] != fwd::order_item(o, expected[i]) && mismatches++ == 0) first = i;
    EXPECT_EQ(mismatches, 0) << "first at position " << first << ": " << order[first] << ", expected "
                             << fwd::order_item(o, expected[first]) << " (class " << cls[expected[first]] << ")";
    EXPECT_EQ(order[o.total + fwd::kOrderInside], inside) << "items inside their sequences";
    if (!dynamic || inside >= sm_count())
      EXPECT_EQ(order[o.total + fwd::kOrderCounter], dynamic ? inside : 0) << "the counter after the launch";
    const harness::CheckResult r = harness::check_outputs(w, harness::sample_rows(shape, 2000, 5));
    EXPECT_TRUE(r.passed) << r.summary();
  }
}

// Runs `w` in a caller's workspace of workspace_size() bytes, filled with 0xFF first (and,
// with `refuse_smaller`, checks first that one byte less is refused by name). Then checks
// `rows` of the output against the reference, and that the parts wrote their partial results
// into the workspace.
void check_in_callers_workspace(harness::Workload* w, const std::vector<harness::RowId>& rows, bool refuse_smaller) {
  size_t bytes = 0;
  Status s = workspace_size(w->problem, &bytes);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_GT(bytes, 0u) << "this shape should split its keys";
  harness::DeviceBuffer workspace;
  ASSERT_TRUE(workspace.allocate(bytes).ok());
  ASSERT_EQ(cudaMemset(workspace.get(), 0xFF, bytes), cudaSuccess);
  AttentionProblem p = w->problem;
  p.workspace = workspace.get();
  if (refuse_smaller) {
    p.workspace_bytes = bytes - 1;
    s = forward(p);
    EXPECT_EQ(s.code(), StatusCode::invalid_argument);
    EXPECT_NE(s.message().find("workspace_bytes"), std::string::npos) << s.message();
  }
  p.workspace_bytes = bytes;
  ASSERT_TRUE(harness::poison_outputs(w).ok());
  s = forward(p);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << cudaGetErrorString(cudaGetLastError());
  const harness::CheckResult r = harness::check_outputs(*w, rows);
  EXPECT_TRUE(r.passed) << r.summary();
  std::vector<uint8_t> host(bytes);
  ASSERT_EQ(cudaMemcpy(host.data(), workspace.get(), bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  size_t written = 0;
  for (uint8_t b : host) written += b != 0xFF;
  EXPECT_GT(written, bytes / 4) << "the parts' partial results did not land in the caller's workspace";
}

// A decoding shape with few items splits its keys: workspace_size() says how much memory the
// parts' partial results take, a caller's buffer of that size is used (the parts write into it)
// and one byte less is refused by name.
TEST(SplitKv, UsesTheCallersWorkspace) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  for (int d : {64, 128, 256}) {
    SCOPED_TRACE("D=" + std::to_string(d));
    const Shape shape = make(2, 1, 5000, 8, 2, d, false, DType::bf16, Layout::contiguous);  // 16 items, GQA 4
    harness::Workload w;
    ASSERT_TRUE(harness::make_workload(shape, 11, &w).ok());
    check_in_callers_workspace(&w, harness::sample_rows(shape, 16, 3), /*refuse_smaller=*/true);
    AttentionProblem p = w.problem;
    p.num_splits = 1;  // unsplit: no workspace
    size_t bytes = 1;
    ASSERT_TRUE(workspace_size(p, &bytes).ok());
    EXPECT_EQ(bytes, 0u);
  }
}

// Without a mask, when the items overshoot whole rounds of the persistent grid by a few, the
// production forward cuts each item of the last round into parts along the keys: workspace_size()
// counts their partial results, the parts write them into the caller's buffer, and the
// combined output matches the reference. num_splits = 1 turns it off, and so does the causal
// mask (items of unequal cost).
TEST(SplitKv, CutsTheLastRound) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  int device = 0, sms = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
  for (int d : {64, 128, 256}) {
    SCOPED_TRACE("D=" + std::to_string(d));
    // One query block per sequence, sms + 4 sequences: one round and 4 items more.
    const Shape shape = make(sms + 4, 128, 3000, 1, 1, d, false, DType::bf16, Layout::contiguous);
    harness::Workload w;
    ASSERT_TRUE(harness::make_workload(shape, 13, &w).ok());
    // The last 4 sequences hold the cut items: check their rows beside a sample of the rest
    // (NaN, which the poisoned output holds until written, is checked over all of it).
    std::vector<harness::RowId> rows = harness::sample_rows(shape, 8, 3);
    for (int b = sms; b < sms + 4; ++b)
      for (int i : {0, 1, 8, 63, 64, 100, 127}) rows.push_back({b, 0, i});
    check_in_callers_workspace(&w, rows, /*refuse_smaller=*/false);
    AttentionProblem p = w.problem;
    size_t bytes = 1;
    p.num_splits = 1;
    ASSERT_TRUE(workspace_size(p, &bytes).ok());
    EXPECT_EQ(bytes, 0u);
    p.num_splits = 0;
    p.causal = true;
    bytes = 1;
    ASSERT_TRUE(workspace_size(p, &bytes).ok());
    EXPECT_EQ(bytes, 0u);
  }
}

// Without a workspace, the memory a forward needs beside its tensors (split-KV's partial results,
// the sign-flipped q of a negative scale) comes from the problem's allocator, and all of it goes
// back; an allocator with nothing to give makes the call fail with out_of_memory, naming what.
TEST(Scratch, ComesFromTheProblemsAllocator) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  Shape decoding = make(2, 1, 5000, 8, 2, 128, false, DType::bf16, Layout::contiguous);  // splits its keys
  Shape negative = make(2, 130, 300, 8, 2, 256, false, DType::bf16, Layout::padded);
  negative.scale = -0.2f;
  for (const Shape& shape : {decoding, negative}) {
    SCOPED_TRACE(harness::describe(shape));
    harness::Workload w;
    ASSERT_TRUE(harness::make_workload(shape, 17, &w).ok());
    ASSERT_TRUE(harness::poison_outputs(&w).ok());
    testing::CountingScratch scratch;
    AttentionProblem p = w.problem;
    p.allocator = &scratch.allocator;
    Status s = forward(p);
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << cudaGetErrorString(cudaGetLastError());
    EXPECT_GE(scratch.taken, 1);
    EXPECT_EQ(scratch.given_back, scratch.taken);
    EXPECT_EQ(scratch.bytes_given_back, scratch.bytes_taken);
    const harness::CheckResult r = harness::check_outputs(w, harness::sample_rows(shape, 16, 3));
    EXPECT_TRUE(r.passed) << r.summary();

    testing::CountingScratch empty;
    empty.fail = true;
    p.allocator = &empty.allocator;
    s = forward(p);
    EXPECT_EQ(s.code(), StatusCode::out_of_memory) << s.to_string();
    EXPECT_NE(s.message().find("scratch allocator"), std::string::npos) << s.message();
    EXPECT_EQ(empty.given_back, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(AllKernels, KernelTest,
                         ::testing::Combine(::testing::ValuesIn(kernel_names()),
                                            ::testing::Range(0, int(shapes().size()))),
                         case_name);

}  // namespace
}  // namespace hattn
