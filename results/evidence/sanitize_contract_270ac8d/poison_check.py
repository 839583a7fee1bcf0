# Does the forward leave any element of out unwritten? Poison the allocator's block with NaN first.
import random
import sys

import torch

sys.path.insert(0, "python/tests")
import test_contract as t
import hattn

bad = 0
same = 0
for i, p in enumerate(t.CASE_PARAMS):
    gen = torch.Generator(device="cuda").manual_seed(p["seed"])
    q = t.make(p["seqlen_q"], p["heads_q"], p, gen)
    k = t.make(p["seqlen_k"], p["heads_kv"], p, gen)
    v = t.make(p["seqlen_k"], p["heads_kv"], p, gen)
    used = None
    if p["seqlens_k"]:
        lens = [random.Random(p["seed"] + b).randint(0, p["seqlen_k"]) for b in range(p["batch"])]
        used = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for trial in range(2):
        x = torch.full((p["batch"], p["seqlen_q"], p["heads_q"], p["head_dim"]), float("nan"), dtype=q.dtype, device="cuda")
        ptr = x.data_ptr(); del x
        out, lse = hattn.attention(q, k, v, causal=p["causal"], window_size=p["window"], softcap=p["softcap"],
                                   return_lse=True, seqlens_k=used, num_splits=p["num_splits"])
        torch.cuda.synchronize()
        n = int(torch.isnan(out).sum())
        same += out.data_ptr() == ptr
        if n:
            bad += 1
            rows = torch.isnan(out).any(dim=3).any(dim=2).nonzero()[:, 1].unique().tolist()
            print(f"case {i} {t.case_id(p)} splits={p['num_splits']} same_block={out.data_ptr()==ptr}: {n} NaN, rows {rows[:5]}..{rows[-3:]} ({len(rows)})")
            break
print(f"{len(t.CASE_PARAMS)} cases, {bad} with unwritten (NaN) elements; out in the poisoned block {same} of {2*len(t.CASE_PARAMS)} calls")
