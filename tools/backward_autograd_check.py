"""Does a backward kernel give the same gradients through autograd as when called directly?

Written when python -m hattn.bench_backward seemed to find bwd_03_wgmma's dv far off through
autograd. The benchmark had freed out and lse under a named kernel
(results/evidence/backward_wgmma/README.md). This runs, per shape:

  1. the kernel through autograd (hattn.attention, with _C.backward forced to --kernel)
  2. the kernel through hattn._C directly (hattn.bench_backward.kernel_backward_fn)
  3. bwd_02_mma_sync directly, and torch SDPA's cuDNN backward

and prints max |difference| of dq, dk and dv against 3's bwd_02 and against cuDNN.

    cd /tmp && python3 /path/to/tools/backward_autograd_check.py [--kernel bwd_04_dq_per_cta]

(from outside python/, so that `import hattn` finds the installed package with its _C).
"""

import argparse

import torch


def main() -> None:
    from hattn import _C
    from hattn.ops import runner
    from hattn.bench_backward import backward_fn, kernel_backward_fn

    p = argparse.ArgumentParser()
    p.add_argument("--kernel", default="bwd_04_dq_per_cta")
    args = p.parse_args()

    direct_backward = _C.backward

    def forced_backward(problem, _kernel, stream, scratch):
        return direct_backward(problem, args.kernel, stream, scratch)

    shapes = [(2, 256, 32, 64, True), (2, 256, 32, 64, False), (2, 256, 4, 64, True), (1, 256, 4, 128, True),
              (16, 1024, 32, 64, False)]  # fmt: skip
    for batch, seqlen, heads, dim, causal in shapes:
        gen = torch.Generator(device="cuda").manual_seed(seqlen + dim)
        q, k, v, dout = (torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5
                         for _ in range(4))  # fmt: skip
        runner._C.backward = forced_backward  # the op's backward now runs --kernel
        try:
            through_autograd = [g.clone() for g in backward_fn("hattn", q, k, v, dout, causal)()]
        finally:
            runner._C.backward = direct_backward
        direct = [g.clone() for g in kernel_backward_fn(args.kernel, q, k, v, dout, causal)()]
        bwd02 = [g.clone() for g in kernel_backward_fn("bwd_02_mma_sync", q, k, v, dout, causal)()]
        cudnn = [g.contiguous() for g in backward_fn("sdpa_cudnn", q, k, v, dout, causal)()]
        torch.cuda.synchronize()
        print(f"B={batch} S={seqlen} H={heads} D={dim} {'causal' if causal else 'full'}")
        for i, name in enumerate(("dq", "dk", "dv")):
            def diff(a, b):
                return (a.float() - b.float()).abs().max().item()

            print(f"  {name}: max|cuDNN| {cudnn[i].float().abs().max().item():8.3f}   "
                  f"autograd-vs-bwd02 {diff(through_autograd[i], bwd02[i]):9.3g}   "
                  f"direct-vs-bwd02 {diff(direct[i], bwd02[i]):9.3g}   "
                  f"bwd02-vs-cuDNN {diff(bwd02[i], cudnn[i]):9.3g}   "
                  f"autograd-vs-cuDNN {diff(through_autograd[i], cudnn[i]):9.3g}")  # fmt: skip


if __name__ == "__main__":
    main()
