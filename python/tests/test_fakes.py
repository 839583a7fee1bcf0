"""The fake (meta) implementations refuse what the library refuses (CPU only).

For each forward op and each malformed or unsupported call, the op on meta tensors (what
torch.compile traces) and the C++ library's own checks (hattn._C.resolve_kernel on CPU tensors of the
same shapes: validation and kernel resolution, which need no GPU) agree: both accept, or both
raise the same exception type naming the same argument (or kernel).
"""

import pytest
import torch
from hattn import _C
from hattn.ops.runner import _problem_kwargs
from helpers import binding

BF16, E4M3, I32 = torch.bfloat16, torch.float8_e4m3fn, torch.int32
LINEAGE = "08_warp_specialization"


def tensors(device, op, head_dim):
    """The op's tensor arguments on `device`: a small problem of each kind."""
    def t(*shape, dtype=BF16):
        return torch.zeros(shape, dtype=dtype, device=device)

    if op == "dense":
        return dict(q=t(2, 10, 4, head_dim), k=t(2, 12, 2, head_dim), v=t(2, 12, 2, head_dim))
    if op == "varlen":
        cu = torch.tensor([0, 4, 10], dtype=I32, device=device) if device == "cpu" else t(3, dtype=I32)
        return dict(q=t(10, 4, head_dim), k=t(10, 2, head_dim), v=t(10, 2, head_dim), cu=cu)
    if op == "paged":
        return dict(q=t(2, 3, 4, head_dim), k=t(8, 128, 2, head_dim), v=t(8, 128, 2, head_dim),
                    block_table=t(2, 4, dtype=I32), seqlens_k=t(2, dtype=I32))
    return dict(q=t(2, 10, 4, head_dim, dtype=E4M3), k=t(2, 12, 2, head_dim, dtype=E4M3),
                v=t(2, 12, 2, head_dim, dtype=E4M3))


def fake_call(op, a, kernel, causal, scale, window, softcap, num_splits):
    ops = torch.ops.hattn
    if op == "dense":
        return ops.attention_fwd(a["q"], a["k"], a["v"], causal, scale, kernel, False, *window, None, num_splits,
                                 None, None, softcap)
    if op == "varlen":
        return ops.attention_varlen_fwd(a["q"], a["k"], a["v"], a["cu"], a["cu"], 6, 6, causal, scale, kernel, False,
                                        *window, softcap)
    if op == "paged":
        return ops.attention_paged_fwd(a["q"], a["k"], a["v"], a["block_table"], a["seqlens_k"], causal, scale, kernel,
                                       False, *window, num_splits, None, softcap)
    return ops.attention_fp8_fwd(a["q"], a["k"], a["v"], None, None, None, causal, scale, kernel, False)


def library_call(op, a, kernel, causal, scale, window, softcap, num_splits):
    out = torch.zeros(a["q"].shape, dtype=BF16)
    extra = dict(softcap=softcap, num_splits=num_splits)
    if op == "varlen":
        extra = dict(softcap=softcap)
        varlen = (a["cu"], a["cu"], 6, 6)
    else:
        varlen = None
    if op == "paged":
        extra.update(block_table=a["block_table"], seqlens_k=a["seqlens_k"])
    if op == "fp8":
        extra = {}
    return binding(_C.resolve_kernel, **_problem_kwargs(a["q"], a["k"], a["v"], out, None, causal, scale, kernel, window,
                                                       varlen, **extra))


def outcome(call):
    """None when the call passes, else (exception type, the argument or kernel its message names)."""
    try:
        call()
        return None
    except (ValueError, NotImplementedError, TypeError) as e:
        message = str(e)
        for code in ("invalid_argument: ", "not_supported: "):
            message = message.removeprefix(code)
        return type(e), message.split(":")[0]


CASES = {
    "valid": {},
    "head dim 96": dict(head_dim=96),
    "head dim 256": dict(head_dim=256),
    "window left -2": dict(window=(-2, -1)),
    "causal, window right 3": dict(causal=True, window=(-1, 3)),
    "scale inf": dict(scale=float("inf")),
    "softcap nan": dict(softcap=float("nan")),
    "softcap too small": dict(softcap=1e-40),
    "num_splits 65": dict(num_splits=65),
    "unknown kernel": dict(kernel="no_such_kernel"),
    "lineage kernel": dict(kernel=LINEAGE),
    "lineage kernel, window": dict(kernel=LINEAGE, window=(4, -1)),
    "lineage kernel, softcap": dict(kernel=LINEAGE, softcap=5.0),
    "lineage kernel, scale -1": dict(kernel=LINEAGE, scale=-1.0),
    "production, scale -1": dict(scale=-1.0),
}


@pytest.mark.parametrize("op", ["dense", "varlen", "paged", "fp8"])
@pytest.mark.parametrize("case", list(CASES))
def test_fakes_refuse_what_the_library_refuses(op, case):
    args = dict(kernel="auto", causal=False, scale=None, window=(-1, -1), softcap=0.0, num_splits=0, head_dim=64)
    args.update(CASES[case])
    if op == "fp8" and (args["window"] != (-1, -1) or args["softcap"] or args["num_splits"]):
        pytest.skip("attention_fp8 has no window, softcap or num_splits arguments")
    if op == "varlen" and args["num_splits"]:
        pytest.skip("attention_varlen has no num_splits argument")
    head_dim = args.pop("head_dim")
    fake = outcome(lambda: fake_call(op, tensors("meta", op, head_dim), **args))
    real = outcome(lambda: library_call(op, tensors("cpu", op, head_dim), **args))
    assert fake == real, f"meta: {fake}, library: {real}"
