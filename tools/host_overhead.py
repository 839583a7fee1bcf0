"""Where a decoding step's host time goes in hattn's Python path, layer by layer (GQA decoding,
then MLA decoding of the same batch and lengths).

Each line is the host's time per call (time.perf_counter over --reps calls back to back, no
synchronization inside the loop; the least of --rounds rounds, the layers interleaved) of one
layer with the layers below it, for one decoding shape. "every check" clears the launches the
ops remember (hattn.ops.runner._LAUNCHES) before each call, as the first call of a layout runs:

    python3 tools/host_overhead.py [--dim 128] [--batch 8] [--seqlen-k 4096]
"""

import argparse
import copy
import time

import torch


def main() -> None:
    import hattn
    from hattn import _C
    from hattn.ops.dense import _attention_fwd
    from hattn.ops.runner import _LAUNCHES, _problem, _problem_kwargs

    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads-q", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--seqlen-k", type=int, default=4096)
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    dt = torch.bfloat16
    q = torch.randn(a.batch, 1, a.heads_q, a.dim, device="cuda", dtype=dt)
    k, v = (torch.randn(a.batch, a.seqlen_k, a.heads_kv, a.dim, device="cuda", dtype=dt) for _ in range(2))
    lens = torch.full((a.batch,), a.seqlen_k - 10, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    kwargs = _problem_kwargs(q, k, v, out, None, False, None, "auto", seqlens_k=lens)
    problem, kernel = _problem(kwargs)
    stream = torch.cuda.current_stream().cuda_stream
    needed = _C.workspace_size(problem, kernel)
    workspace = torch.empty(max(needed, 1), dtype=torch.uint8, device="cuda")
    launch = copy.copy(problem)
    if needed:
        launch.workspace, launch.workspace_bytes = workspace.data_ptr(), needed
    plan = _C.plan(problem, kernel)
    buffers = _C.buffers_of(launch)

    def host_us(fn) -> float:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.reps):
            fn()
        elapsed = time.perf_counter() - t0
        torch.cuda.synchronize()
        return elapsed * 1e6 / a.reps

    def device_context():
        with torch.cuda.device(q.device):
            pass

    def every_check():
        _LAUNCHES.clear()
        hattn.attention(q, k, v, seqlens_k=lens)

    # MLA decoding of the same batch and keys (128 heads, one latent K/V head of 576 features, 64-row pages).
    from hattn.ops.mla import _mla_decode_fwd

    pages = -(-a.seqlen_k // 64)
    mla_q = torch.randn(a.batch, 1, 128, 576, device="cuda", dtype=dt)
    mla_cache = torch.randn(a.batch * pages, 64, 1, 576, device="cuda", dtype=dt)
    mla_table = torch.arange(a.batch * pages, device="cuda", dtype=torch.int32).view(a.batch, pages)
    schedule = hattn.mla_schedule(lens, seqlen_q=1, heads_q=128)

    def mla_op():
        torch.ops.hattn.mla_decode_fwd(mla_q, mla_cache, mla_table, lens, schedule, None, True, False)

    layers = [
        ("torch.empty (one small tensor)", lambda: torch.empty(16, device="cuda")),
        ("with torch.cuda.device(q.device)", device_context),
        ("torch.cuda.current_stream().cuda_stream", lambda: torch.cuda.current_stream(q.device).cuda_stream),
        ("_problem_kwargs", lambda: _problem_kwargs(q, k, v, out, None, False, None, "auto", seqlens_k=lens)),
        ("_problem (the AttentionProblem from them)", lambda: _problem(kwargs)),
        ("_C.resolve_kernel (argument checks, dispatch)", lambda: _C.resolve_kernel(problem, kernel)),
        ("_C.workspace_size (+ device and pointer checks)", lambda: _C.workspace_size(problem, kernel)),
        ("_C.forward, prebuilt problem (+ launch)", lambda: _C.forward(launch, kernel, stream)),
        ("_C.plan (checks, dispatch, the kernel's decisions)", lambda: _C.plan(problem, kernel)),
        ("_C.run, prebuilt plan and buffers (+ launch)", lambda: _C.run(plan, buffers, stream)),
        ("_attention_fwd (the op's body)", lambda: _attention_fwd(q, k, v, False, None, "auto", False, -1, -1, lens)),
        ("hattn.attention(seqlens_k=...), every check", every_check),
        ("hattn.attention(seqlens_k=...)", lambda: hattn.attention(q, k, v, seqlens_k=lens)),
        ("hattn.flash_attn_with_kvcache", lambda: hattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)),
        ("MLA: hattn.mla_schedule", lambda: hattn.mla_schedule(lens, seqlen_q=1, heads_q=128)),
        ("MLA: _mla_decode_fwd (the op's body)",
         lambda: _mla_decode_fwd(mla_q, mla_cache, mla_table, lens, schedule, None, True, False)),
        ("MLA: torch.ops.hattn.mla_decode_fwd (the dispatcher)", mla_op),
        ("MLA: hattn.mla_with_kvcache(schedule=...)",
         lambda: hattn.mla_with_kvcache(mla_q, mla_cache, mla_table, lens, schedule=schedule, causal=True)),
    ]
    print(f"# {torch.cuda.get_device_name()}, D={a.dim} batch={a.batch} heads {a.heads_q}/{a.heads_kv} "
          f"keys {a.seqlen_k}; host us per call over {a.reps} calls")  # fmt: skip
    best = {name: host_us(fn) for name, fn in layers}
    for _ in range(a.rounds - 1):
        for name, fn in layers:
            best[name] = min(best[name], host_us(fn))
    for name, _ in layers:
        print(f"{name:50s} {best[name]:8.1f}")


if __name__ == "__main__":
    main()
