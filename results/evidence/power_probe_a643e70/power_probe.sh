#!/usr/bin/env bash
# Experiment (not committed): SM clock and board power while one call repeats for a few
# seconds. Is the sustained benchmark power-bound?
set -u
out=${1:-/tmp/power}; mkdir -p "$out"
bench=build-gpu/hattn-bench
run_sampled() {  # name, command...
  local name=$1; shift
  nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader,nounits -lms 100 >"$out/smi_$name.csv" &
  local smi=$!
  "$@" >"$out/run_$name.log" 2>&1
  kill $smi; wait $smi 2>/dev/null
  python3 - "$out/smi_$name.csv" "$name" "$out/run_$name.log" <<'PY'
import sys, statistics
rows = []
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    try: rows.append((float(f[0]), float(f[1]), float(f[2]), f[3]))
    except (ValueError, IndexError): pass
busy = [r for r in rows if r[1] > 200] or rows
n = len(busy); mid = busy[n // 5: max(n // 5 + 1, 4 * n // 5)]
reasons = sorted(set(r[3] for r in mid))
tail = [l.rstrip() for l in open(sys.argv[3]) if l.strip()][-3:]
print(f"{sys.argv[2]:28s} samples={n:3d} clock_MHz={statistics.median(r[0] for r in mid):6.0f} "
      f"power_W={statistics.median(r[1] for r in mid):6.1f} temp={statistics.median(r[2] for r in mid):4.0f} "
      f"throttle={reasons}\n    " + "\n    ".join(tail))
PY
}
B="$bench --dims 128 --causal no --reps 3000 --seconds 5 --no-gemm --check-rows 4"
run_sampled hattn14_d128_16k $B --kernels 14_seamless_items --seqlens 16384
run_sampled hattn14_d128_4k $B --kernels 14_seamless_items --seqlens 4096
run_sampled hattn10_d128_16k $B --kernels 10_intra_warpgroup_overlap --seqlens 16384
cat >"$out/torch_loop.py" <<'PY'
import sys, time, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa
what, S = sys.argv[1], int(sys.argv[2])
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
if what == "gemm":
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
    fn = lambda: a @ b; flops = 2 * 8192**3
else:
    B, H, D = 16384 // S, 16, 128
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(3))
    def fn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(q, k, v)
    flops = 4 * B * H * S * S * D
fn(); torch.cuda.synchronize()
times = []; t0 = time.time()
while time.time() - t0 < 5:
    evs = []
    for _ in range(20):
        flush.zero_(); s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); evs.append((s, e))
    torch.cuda.synchronize(); times += [s.elapsed_time(e) for s, e in evs]
times.sort(); ms = times[len(times) // 2]
print(f"{what} S={S}: {len(times)} calls, median {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s")
PY
run_sampled cudnn_d128_16k python3 "$out/torch_loop.py" cudnn 16384
run_sampled cudnn_d128_4k python3 "$out/torch_loop.py" cudnn 4096
run_sampled gemm_8192 python3 "$out/torch_loop.py" gemm 0
