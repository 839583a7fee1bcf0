"""What appending to the KV cache (flash_attn_with_kvcache's k, v and rotary) costs a decoding step.

Runs one decoding step these ways, --reps calls back to back as a decoding loop would, and reports the
host's time per call (Python and launches) and the time per call on the stream (CUDA events
around the loop: the host's time when the GPU waits for it, the GPU's when the host runs ahead):

  attend      cache_seqlens + 1 keys already in the cache: the attention alone
  append      k, v of one new token written first (the hattn::append_kv kernel), then the attention
  rotary      append with rotary_cos/sin (the new key and a copy of q rotated first)
  rotary_append_checked
              the rotary step with the append's Python checks and arguments made afresh each
              call (hattn.flash_attn._CHECKED and the append's remembered launch cleared before
              each call), the attention's launch remembered: how the step ran before e8b7757
  rotary_every_check
              the rotary step with every Python check, as the first call of a layout runs (the
              checked layouts and remembered launches cleared before each call)
  graph       the rotary step captured in a CUDA graph and replayed (no launch overhead)

The other steps repeat one layout, so after their first call they skip the Python checks
(hattn.flash_attn._CHECKED) and launch from remembered arguments (hattn.ops.runner._LAUNCHES).

    python3 tools/kvcache_append_timing.py [--dim 128] [--batch 8] [--seqlen-k 4096] [--paged]
"""

import argparse
import time

import torch


def main() -> None:
    import hattn
    from hattn.flash_attn import _CHECKED
    from hattn.ops.runner import _LAUNCHES

    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads-q", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--seqlen-k", type=int, default=4096)
    p.add_argument("--paged", action="store_true", help="a paged cache (pages of 256 keys)")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="also cProfile the rotary step's host time")
    a = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    capacity = a.seqlen_k + 256
    q = torch.randn(a.batch, 1, a.heads_q, a.dim, device=dev, dtype=dt)
    new_k, new_v = (torch.randn(a.batch, 1, a.heads_kv, a.dim, device=dev, dtype=dt) for _ in range(2))
    extra = {}
    if a.paged:
        pages = capacity // 256
        k_cache, v_cache = (
            torch.randn(a.batch * pages, 256, a.heads_kv, a.dim, device=dev, dtype=dt) for _ in range(2)
        )
        table = torch.randperm(a.batch * pages, device=dev).to(torch.int32).view(a.batch, pages)
        extra["block_table"] = table
    else:
        k_cache, v_cache = (torch.randn(a.batch, capacity, a.heads_kv, a.dim, device=dev, dtype=dt) for _ in range(2))
    lens = torch.full((a.batch,), a.seqlen_k - 1, dtype=torch.int32, device=dev)
    lens_after = lens + 1
    angles = torch.rand(capacity, a.dim // 2, device=dev)
    rotary = {"rotary_cos": angles.cos().to(dt), "rotary_sin": angles.sin().to(dt)}

    steps = {
        "attend": lambda: hattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens_after, **extra),
        "append": lambda: hattn.flash_attn_with_kvcache(
            q, k_cache, v_cache, new_k, new_v, cache_seqlens=lens, **extra
        ),
        "rotary": lambda: hattn.flash_attn_with_kvcache(
            q, k_cache, v_cache, new_k, new_v, cache_seqlens=lens, **rotary, **extra
        ),
    }

    def append_checked():
        _CHECKED.clear()
        for key in [key for key in _LAUNCHES if key[0] == "append"]:
            del _LAUNCHES[key]
        steps["rotary"]()

    def every_check():
        _CHECKED.clear()
        _LAUNCHES.clear()
        steps["rotary"]()

    steps["rotary_append_checked"] = append_checked
    steps["rotary_every_check"] = every_check
    steps["rotary"]()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps["rotary"]()
    steps["graph"] = graph.replay

    def loop_us(fn) -> tuple:
        """(host us per call, GPU us per call) over --reps calls back to back, as a decoding loop runs."""
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(a.reps):
            fn()
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
        return host * 1e6 / a.reps, start.elapsed_time(end) * 1e3 / a.reps

    print(
        f"# {torch.cuda.get_device_name()}, D={a.dim} batch={a.batch} heads {a.heads_q}/{a.heads_kv} "
        f"keys {a.seqlen_k} {'paged' if a.paged else 'dense'}; {a.reps} calls back to back, the least of "
        f"{a.rounds} rounds with the steps interleaved"
    )
    best = {name: (float("inf"), float("inf")) for name in steps}
    for _ in range(a.rounds):
        for name, fn in steps.items():
            host, loop = loop_us(fn)
            best[name] = (min(best[name][0], host), min(best[name][1], loop))
    print("step,host_us_per_call,loop_us_per_call")
    for name, (host, loop) in best.items():
        print(f"{name},{host:.1f},{loop:.1f}")
    if a.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(a.reps):
            steps["rotary"]()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)

if __name__ == "__main__":
    main()
