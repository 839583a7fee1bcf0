"""The checking mode (HATTN_CHECK=1 or hattn.set_checking): the promises the kernels take on
trust, read back before a launch, and a broken one named. CPU tensors stand in for the GPU's in
the checks themselves; an op's call runs on the GPU."""

import hattn
import pytest
import torch
from hattn.ops import checks as ops
from helpers import requires_hopper


@pytest.fixture
def on():
    before = hattn.checking()
    hattn.set_checking(True)
    yield
    hattn.set_checking(before)


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def test_off_by_default_checks_nothing():
    if hattn.checking():
        pytest.skip("HATTN_CHECK is set in this environment: the mode is on")
    ops._check_promises(varlen=(i32(3, 1), i32(0), 0, 0), totals=(1, 1), block_table=i32(99), num_pages=1)


@pytest.mark.parametrize("cu, rows, longest, message", [
    (i32(1, 5), 8, 8, r"cu_seqlens_q: must start at 0, got 1"),
    (i32(0, 5, 3), 8, 8, r"cu_seqlens_q: must not decrease \(entry 2: 3 after 5\)"),
    (i32(0, 5, 9), 8, 8, r"cu_seqlens_q: ends at 9, past the tensor's 8 rows"),
    (i32(0, 5, 8), 8, 4, r"max_seqlen_q: 4 is below sequence 0's length 5"),
])  # fmt: skip
def test_broken_offsets_are_named(on, cu, rows, longest, message):
    with pytest.raises(ValueError, match=message + r" \(checking mode\)"):
        ops._check_promises(varlen=(cu, i32(0, 1), longest, 8), totals=(rows, 8))


def test_broken_indices_and_descales_are_named(on):
    # Promises kept: nothing raised.
    ops._check_promises(seqlens_k=i32(0, 128), capacity=128, block_table=i32(0, 3), num_pages=4,
                        kv_batch_idx=i32(1), kv_batch=2, leftpad_k=i32(0, 5),
                        descales=(("q_descale", torch.ones(2, 1)), ("k_descale", torch.zeros(2, 1))))  # fmt: skip
    ops._check_promises(seqlens_k=i32(5, 0), capacity=16, page_size=8, num_pages=4,
                        block_table=torch.tensor([[2, -1], [-1, -1]], dtype=torch.int32))  # unused pages: anything
    cases = [
        (dict(seqlens_k=i32(5, 129), capacity=128), r"seqlens_k: entry 1 is 129, outside \[0, 129\)"),
        (dict(seqlens_k=i32(65), capacity=64, seqlens_name="cache_seqlens"), r"cache_seqlens: entry 0 is 65"),
        (dict(block_table=i32(0, 4), num_pages=4), r"block_table: entry 1 is 4, outside \[0, 4\)"),
        # With page_size: the pages in use only (row 1 uses one page of 8 keys; row 0's -1 is unused).
        (dict(block_table=torch.tensor([[2, -1], [9, 3]], dtype=torch.int32), seqlens_k=i32(5, 9), capacity=16,
              page_size=8, num_pages=4), r"block_table: entry \(1, 0\) is 9, outside \[0, 4\) \(.*sequence 1 reads it\)"),
        (dict(kv_batch_idx=i32(-1), kv_batch=2), r"kv_batch_idx: entry 0 is -1, outside \[0, 2\)"),
        (dict(seqlens_k=i32(4, 4), leftpad_k=i32(0, 6), capacity=8), r"leftpad_k: sequence 1 starts at key 6"),
        (dict(descales=(("k_descale", torch.tensor([[1.0, -0.5]])),)), r"k_descale: entry \(0, 1\) is -0.5"),
        (dict(descales=(("v_descale", torch.tensor([[float("nan")]])),)), r"v_descale: entry \(0, 0\) is nan"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            ops._check_promises(**kwargs)


@requires_hopper
def test_varlen_call_with_broken_offsets_raises_in_checking_mode(on):
    q = torch.randn(16, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 10, 6], dtype=torch.int32, device="cuda")  # goes backwards
    with pytest.raises(ValueError, match=r"cu_seqlens_q: must not decrease"):
        hattn.attention_varlen(q, q, q, cu, cu, 10, 10)
