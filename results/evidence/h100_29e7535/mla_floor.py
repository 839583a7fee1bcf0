"""Where one small MLA call's time goes: per-kernel GPU durations and the gaps between them (torch.profiler,
CUPTI), for single requests (the floor of issue 59's memory-bound points). python3 mla_floor.py"""
import sys
sys.path.insert(0, "python/tests")
import torch, hattn
from torch.profiler import profile, ProfilerActivity
from test_mla import mla_inputs

for lens, heads, sq in (([1024], 16, 1), ([16384], 64, 1), ([16384], 16, 1), ([32768], 128, 2), ([4096] * 8, 64, 1)):
    q, cache, table, seqlens = mla_inputs(lens, sq, heads, 64, seed=1)
    schedule = hattn.mla_schedule(seqlens, seqlen_q=sq, heads_q=heads)
    call = lambda: hattn.mla_with_kvcache(q, cache, table, seqlens, schedule=schedule, causal=True)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(20): call()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        flush.zero_(); torch.cuda._sleep(200_000); s.record(); call(); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    times.sort()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            flush.zero_(); torch.cuda._sleep(200_000); call()
        torch.cuda.synchronize()
    evs = sorted([ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA],
                 key=lambda ev: ev.time_range.start)
    # the last call's kernels: after the last sleep
    last = [i for i, ev in enumerate(evs) if "spin" in ev.name.lower() or "sleep" in ev.name.lower()][-1]
    ks = evs[last + 1:]
    t0 = ks[0].time_range.start if ks else 0
    desc = " | ".join(f"{ev.name.split('(')[0][-40:]} +{ev.time_range.start - t0:.1f} {ev.time_range.elapsed_us():.1f}us" for ev in ks)
    print(f"B={len(lens)} L={lens[0]} rows={heads}x{sq}: call {times[len(times)//2]:.1f} us (median, events, cold L2) :: {desc}")
