"""Why does python -m hattn.bench time some decoding shapes 2-2.6x slower than hattn-bench?

At a604ff6, D = 64 (4 x 4k and 1 x 16k keys, 32 heads) and D = 256 (4 x 4k keys, 8 heads) with
one query per sequence read 142-206 us in python -m hattn.bench and 57-91 us in hattn-bench;
D = 128 matched. This times one such shape several ways, each the median of CUDA-event times
with the L2 flushed before every call, to find the layer that adds the time:

  1. _C.forward with prebuilt arguments (the C++ path alone)
  2. hattn.attention (the Python op)
  3. hattn.attention with num_splits=1 (no split-KV, so no combine and no dependent launch)
  4. hattn.attention on a stream of its own instead of torch's default stream
  5. the benchmark's own Timer with hattn alone, then with the SDPA anchors interleaved

    python3 tools/decode_timing.py [--dim 64] [--batch 4] [--seqlen-k 4096]
"""

import argparse
import statistics

import torch


def main() -> None:
    import hattn
    from hattn import _C
    from hattn.bench import Timer, anchor_fn
    from hattn.ops.runner import _problem, _problem_kwargs

    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqlen-k", type=int, default=4096)
    p.add_argument("--reps", type=int, default=50)
    a = p.parse_args()
    heads = 2048 // a.dim
    q = torch.randn(a.batch, 1, heads, a.dim, device="cuda", dtype=torch.bfloat16) + 0.5
    k, v = (torch.randn(a.batch, a.seqlen_k, heads, a.dim, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(2))
    out = torch.empty_like(q)
    problem, kernel = _problem(_problem_kwargs(q, k, v, out, None, False, None, "auto"))
    stream = torch.cuda.current_stream().cuda_stream
    needed = _C.workspace_size(problem, kernel)
    workspace = torch.empty(max(needed, 1), dtype=torch.uint8, device="cuda")
    if needed:
        problem.workspace, problem.workspace_bytes = workspace.data_ptr(), needed
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def median_us(fn) -> float:
        for _ in range(5):
            fn()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(a.reps)]
        for start, end in events:
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3

    print(f"D={a.dim} B={a.batch} Sk={a.seqlen_k} H={heads}, workspace {needed} bytes")
    print(f"  _C.forward, prebuilt arguments   {median_us(lambda: _C.forward(problem, kernel, stream)):8.1f} us")
    print(f"  hattn.attention                  {median_us(lambda: hattn.attention(q, k, v)):8.1f} us")
    print(f"  hattn.attention, num_splits=1    {median_us(lambda: hattn.attention(q, k, v, num_splits=1)):8.1f} us")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        print(f"  hattn.attention, own stream      {median_us(lambda: hattn.attention(q, k, v)):8.1f} us")
    torch.cuda.current_stream().wait_stream(side)
    timer = Timer(256, 5, a.reps, 2.0)
    alone = timer.interleaved([lambda: hattn.attention(q, k, v)])
    print(f"  bench Timer, hattn alone         {alone[0][0] * 1e3:8.1f} us")
    bhsd = tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))
    names = ("sdpa_cudnn", "sdpa_cudnn_bshd", "sdpa_flash")
    fns = [anchor_fn(n, q, k, v, False, bhsd) for n in names] + [lambda: hattn.attention(q, k, v)]
    for name, (ms, _) in zip((*names, "hattn"), timer.interleaved(fns)):
        print(f"  bench Timer, interleaved: {name:16s} {ms * 1e3:8.1f} us")


if __name__ == "__main__":
    main()
