"""Sequence-parallel attention over several GPUs: Ulysses, ring attention, and the two combined.

A sequence too long for one GPU (a 720p video's 75,600 tokens, a 128k-token prefill) is cut
along its length, one piece per rank; every rank holds q, k and v of its piece ([B, S/W, H, D],
BSHD) and gets its piece of the output. Three ways to compute the attention of the whole:

* ulysses_attention (DeepSpeed-Ulysses): an all-to-all turns the sequence shards into head
  shards (every rank: the whole sequence, H/W heads), each rank runs ordinary attention on its
  heads, and an all-to-all turns the result back. Any mask, window or softcap works, since every
  rank sees whole rows; the world size must divide the query heads (and the K/V heads, or be
  a multiple of them: K/V heads are then replicated).
* ring_attention: query shards stay put; K/V shards travel around the ring of ranks by
  point-to-point sends, each rank attending to each K/V block as it passes while the next one
  is in flight, and the partial results merge by their log-sum-exp. Any number of heads; for a
  causal mask the sequence is sharded "zigzag" so that every rank has the same work.
* usp_attention (Unified Sequence Parallelism, Fang and Zhao 2024): Ulysses inside a group of
  ranks, the ring across the groups.

Sharding (the helpers shard and unshard a full tensor; `dim` is the sequence dim, 1 in BSHD):

* "contiguous": rank r holds tokens [r S/W, (r+1) S/W). Ulysses needs it (the all-to-all
  concatenates the shards in rank order); ring attention without a causal mask may use it (any
  sharding works there, the same for q and k/v), and with a causal mask it is correct but
  unbalanced (rank W-1 does W times the work of rank 0).
* "zigzag" (ring attention, causal): the sequence is cut into 2W chunks and rank r holds chunks
  r and 2W-1-r, concatenated: zigzag_shard / zigzag_unshard.
* usp: ring rank j holds the ring piece that layout gives it (zigzag or contiguous over the
  ring's R ranks), and Ulysses rank i of that ring group holds the i-th contiguous U-th of it:
  usp_shard / usp_unshard, with the groups from make_usp_groups (Ulysses groups are runs of
  consecutive ranks, the ring groups strided across them).

Every rank holds the same number of tokens (the collectives exchange equal pieces).

The attention each rank runs is pluggable (LocalAttention): by default hattn's kernels
(torch.ops.hattn.attention_fwd, returning the LSE, and torch.ops.hattn.attention_bwd, which
takes the forward's out and LSE); tests pass a CPU reference with the same signatures.

Limits: ring attention (and usp) refuse a sliding window; softcap works everywhere (it acts on
each score alone). Ring attention with a causal mask needs q and k/v of the same length on each
rank (self-attention); without one, k/v may be longer or shorter than q (cross-attention).
No variable-length (cu_seqlens) batches: the sequences of a batch have one length.
There is no gradient through the returned LSE.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import ops

__all__ = [
    "LocalAttention",
    "hattn_local_attention",
    "make_usp_groups",
    "merge_attention",
    "ring_attention",
    "ulysses_attention",
    "usp_attention",
    "usp_shard",
    "usp_unshard",
    "zigzag_shard",
    "zigzag_unshard",
]

LAYOUTS = ("zigzag", "contiguous")


# ---------------------------------------------------------------------------------------------
# The attention each rank runs
# ---------------------------------------------------------------------------------------------


class LocalAttention(NamedTuple):
    """The attention one rank runs on its tensors (BSHD), forward and backward.

    forward(q, k, v, causal, softmax_scale, window_left, window_right, softcap) -> (out, lse):
        out [B, Sq, Hq, D] in q's dtype, lse [B, Hq, Sq] (fp32, natural log; -inf and out 0 for
        a row that sees no key); causal and the window aligned bottom-right; GQA by h // (Hq // Hkv).
    backward(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, softcap)
        -> (dq, dk, dv), like q, k, v. It must use the out and lse it is given (P = exp(s - lse),
        delta = rowsum(dout * out)), not recompute them: ring attention passes the merged
        (global) out and lse with one K/V block, which makes each block's gradients exact.

    torch.ops.hattn.attention_bwd has the backward's signature; hattn_local_attention() is the default.
    """

    forward: Callable[..., Tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _hattn_forward(q, k, v, causal, softmax_scale, window_left, window_right, softcap):
    return ops.attention_fwd(
        q, k, v, causal, softmax_scale, "auto", True, window_left, window_right, None, 0, None, None, softcap
    )  # fmt: skip


def _hattn_backward(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, softcap):
    return ops.attention_bwd(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, softcap)


def hattn_local_attention() -> LocalAttention:
    """hattn's kernels: the production forward (with its LSE) and backward, on a Hopper GPU."""
    return LocalAttention(_hattn_forward, _hattn_backward)


class _Attention(torch.autograd.Function):
    """One rank's attention with a LocalAttention's backward: (out, lse), no gradient through lse."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, window, softcap, local):
        out, lse = local.forward(q, k, v, causal, softmax_scale, window[0], window[1], softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, softmax_scale, window[0], window[1], softcap)
        ctx.local = local
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * 8
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.local.backward(dout, q, k, v, out, lse, *ctx.args)
        return (dq, dk, dv) + (None,) * 5


# ---------------------------------------------------------------------------------------------
# Merging partial results by their LSE
# ---------------------------------------------------------------------------------------------


def _merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """In place: (out [B, S, H, D], lse [B, H, S]) becomes the attention over the union of its keys
    and a block's (block_out, block_lse). With lse = logsumexp(lse, block_lse), each part weighs
    exp(its lse - lse). A row that has seen no key yet has lse -inf (and out 0): where both are
    -inf the weights would be exp(-inf - -inf) = NaN, so -inf is subtracted as 0 there (weights 0)."""
    block_lse = block_lse.to(lse.dtype)
    merged = torch.logaddexp(lse, block_lse)  # -inf only where both are
    shift = torch.where(torch.isneginf(merged), torch.zeros_like(merged), merged)
    old_weight = torch.exp(lse - shift).transpose(1, 2).unsqueeze(-1)  # [B, S, H, 1]
    new_weight = torch.exp(block_lse - shift).transpose(1, 2).unsqueeze(-1)
    out.mul_(old_weight).add_(block_out.to(out.dtype) * new_weight)
    lse.copy_(merged)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The merge's and the gradient sums' precision: fp32 (fp64 for fp64 inputs, in tests)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_attention(parts: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of attention over several key blocks from each block's (out [B, S, H, D], lse
    [B, H, S]): lse = logsumexp_i lse_i, out = sum_i exp(lse_i - lse) out_i, in fp32 (fp64 for
    fp64 inputs). Rows that see no key in any block give out 0 and lse -inf (no NaN)."""
    if not parts:
        raise ValueError("merge_attention: parts: need at least one (out, lse) pair")
    out0, lse0 = parts[0]
    dtype = _acc_dtype(out0.dtype)
    out = torch.zeros(out0.shape, dtype=dtype, device=out0.device)
    lse = torch.full(lse0.shape, float("-inf"), dtype=dtype, device=lse0.device)
    for block_out, block_lse in parts:
        _merge_(out, lse, block_out, block_lse)
    return out, lse


# ---------------------------------------------------------------------------------------------
# Sharding helpers
# ---------------------------------------------------------------------------------------------


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: must be one of {LAYOUTS} (got {layout!r})")


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s zigzag shard of x: x cut into 2*world equal chunks along dim, chunks rank and
    2*world-1-rank concatenated. x.shape[dim] must be a multiple of 2*world."""
    length = x.shape[dim]
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"zigzag_shard: rank {rank} outside a world of {world}")
    if length % (2 * world):
        raise ValueError(f"zigzag_shard: the sequence ({length}, dim {dim}) must be a multiple of 2 * world = {2 * world}")
    chunks = x.chunk(2 * world, dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim)


def zigzag_unshard(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's zigzag shard (parts[r] from rank r): the inverse of zigzag_shard."""
    halves = [p.chunk(2, dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def _ring_piece(x: torch.Tensor, rank: int, world: int, layout: str, dim: int) -> torch.Tensor:
    _check_layout(layout)
    if layout == "zigzag":
        return zigzag_shard(x, rank, world, dim)
    if x.shape[dim] % world:
        raise ValueError(f"usp_shard: the sequence ({x.shape[dim]}, dim {dim}) must be a multiple of the world ({world})")
    return x.chunk(world, dim)[rank]


def usp_shard(
    x: torch.Tensor,
    ulysses_rank: int,
    ulysses_size: int,
    ring_rank: int,
    ring_size: int,
    layout: str = "zigzag",
    dim: int = 1,
) -> torch.Tensor:
    """The shard of the full sequence x that the rank with these Ulysses and ring ranks holds for
    usp_attention: the ring piece of ring rank `ring_rank` (zigzag: chunks ring_rank and
    2*ring_size-1-ring_rank of 2*ring_size; contiguous: the ring_rank-th of ring_size), then its
    ulysses_rank-th contiguous part of ulysses_size. ulysses_size=1 gives ring_attention's shards,
    ring_size=1 Ulysses' (contiguous) ones."""
    piece = _ring_piece(x, ring_rank, ring_size, layout, dim)
    if piece.shape[dim] % ulysses_size:
        raise ValueError(
            f"usp_shard: a ring piece ({piece.shape[dim]} tokens of {x.shape[dim]}) must be a multiple of "
            f"ulysses_size ({ulysses_size})"
        )  # fmt: skip
    return piece.chunk(ulysses_size, dim)[ulysses_rank]


def usp_unshard(
    parts: Sequence[torch.Tensor], ulysses_size: int, ring_size: int, layout: str = "zigzag", dim: int = 1
) -> torch.Tensor:
    """The full tensor from every rank's usp_shard, parts[ring_rank * ulysses_size + ulysses_rank]
    (the global ranks of make_usp_groups)."""
    _check_layout(layout)
    if len(parts) != ulysses_size * ring_size:
        raise ValueError(f"usp_unshard: {len(parts)} parts for {ulysses_size} x {ring_size} ranks")
    pieces = [torch.cat(list(parts[j * ulysses_size : (j + 1) * ulysses_size]), dim) for j in range(ring_size)]
    return zigzag_unshard(pieces, dim) if layout == "zigzag" else torch.cat(pieces, dim)


def make_usp_groups(ulysses_size: int, ring_size: int) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(ulysses_group, ring_group) of this rank for usp_attention, over the default group of
    ulysses_size * ring_size ranks: Ulysses groups are consecutive ranks ([0..U-1], [U..2U-1], ..;
    keep them inside a node, the all-to-all is the heavier traffic), ring groups strided ([j, j+U,
    j+2U, ..]). This rank's ring rank is rank // U, its Ulysses rank rank % U. Every rank must call it
    (it creates every group)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if ulysses_size < 1 or ring_size < 1 or ulysses_size * ring_size != world:
        raise ValueError(f"make_usp_groups: ulysses_size {ulysses_size} x ring_size {ring_size} != world size {world}")
    ulysses_group = ring_group = None
    for j in range(ring_size):
        group = dist.new_group(list(range(j * ulysses_size, (j + 1) * ulysses_size)))
        if rank // ulysses_size == j:
            ulysses_group = group
    for i in range(ulysses_size):
        group = dist.new_group(list(range(i, world, ulysses_size)))
        if rank % ulysses_size == i:
            ring_group = group
    return ulysses_group, ring_group


# ---------------------------------------------------------------------------------------------
# Ulysses: all-to-all between sequence shards and head shards
# ---------------------------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """x cut into W equal parts along scatter_dim, part j sent to rank j; the parts received
    concatenated along gather_dim in rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    shape = list(x.shape)
    part = shape[scatter_dim] // world
    # [.., W*part, ..] -> [W, .., part, ..]: all_to_all_single sends slice j of dim 0 to rank j.
    send = x.reshape(shape[:scatter_dim] + [world, part] + shape[scatter_dim + 1 :]).movedim(scatter_dim, 0)
    send = send.contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv's dim 0 is the source rank: put it in front of gather_dim and merge the two.
    shape[scatter_dim] = part
    shape[gather_dim] *= world
    return recv.movedim(0, gather_dim).reshape(shape)


class _AllToAll(torch.autograd.Function):
    """_all_to_all with autograd: the backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


def _ulysses_kv_repeats(heads_q: int, heads_kv: int, world: int) -> int:
    """How many times Ulysses repeats each K/V head before splitting the heads over `world` ranks
    (1: split them as they are); ValueError when the heads cannot be split."""
    if heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of the K/V heads ({heads_kv})")
    if heads_q % world:
        raise ValueError(
            f"Ulysses: the query heads ({heads_q}) must be a multiple of the Ulysses world size ({world}); "
            "ring_attention has no such limit"
        )  # fmt: skip
    if heads_kv % world == 0:
        return 1
    if world % heads_kv == 0:
        return world // heads_kv
    raise ValueError(
        f"Ulysses: the K/V heads ({heads_kv}) must be a multiple or a divisor of the Ulysses world size ({world}) "
        f"(query heads {heads_q})"
    )  # fmt: skip


def _seq_to_heads(q, k, v, group):
    """Sequence shards [B, S/W, H, D] -> head shards [B, S, H/W, D] (GQA: K/V heads split, or
    replicated first when there are fewer than W; the replicas' gradients sum back)."""
    world = dist.get_world_size(group)
    repeats = _ulysses_kv_repeats(q.shape[2], k.shape[2], world)
    if repeats > 1:  # head g becomes heads g*repeats .. : rank j gets K/V head j // repeats, its query heads'
        k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
    q = _AllToAll.apply(q, group, 2, 1)
    kv = _AllToAll.apply(torch.stack([k, v]), group, 3, 2)  # one exchange for both
    return q, kv[0], kv[1]


def _heads_to_seq(out, lse, group):
    """Head shards out [B, S, H/W, D], lse [B, H/W, S] -> sequence shards [B, S/W, H, D], [B, H, S/W]."""
    out = _AllToAll.apply(out, group, 1, 2)
    if lse is not None:
        lse = _all_to_all(lse.contiguous(), group, 2, 1)
    return out, lse


def _check_qkv(q, k, v, who: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{who}: {name}: must be a 4-D tensor [B, S, H, D] (BSHD)")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{who}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: shapes do not match")


def _window_pair(window_size) -> Tuple[int, int]:
    left, right = (int(x) for x in window_size)
    return left, right


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    local_attention: Optional[LocalAttention] = None,
):
    """DeepSpeed-Ulysses sequence-parallel attention over `group` (default: the world).

    Args:
        q: [B, S/W, Hq, D], this rank's contiguous shard of the sequence (rank r: tokens
            [r S/W, (r+1) S/W)); k, v: [B, Sk/W, Hkv, D] likewise. Every rank holds as many tokens.
        causal, softmax_scale, window_size, softcap: as for hattn.attention, over the whole
            sequence (each rank computes whole rows, so all of them apply unchanged).
        return_lse: also return the LSE of this rank's rows, [B, Hq, S/W] (no gradient through it).
        local_attention: the attention each rank runs (default hattn_local_attention()).

    Hq must be a multiple of W; Hkv a multiple of W (K/V heads split like the query heads, each
    query head stays with its K/V head) or a divisor of W (each K/V head replicated W/Hkv times
    first, gradients summed back). Otherwise ValueError.

    Returns out [B, S/W, Hq, D] (this rank's rows), or (out, lse).
    """
    _check_qkv(q, k, v, "ulysses_attention")
    local = local_attention or hattn_local_attention()
    qh, kh, vh = _seq_to_heads(q, k, v, group)
    out, lse = _Attention.apply(qh, kh, vh, bool(causal), softmax_scale, _window_pair(window_size), float(softcap),
                                local)  # fmt: skip
    out, lse = _heads_to_seq(out, lse if return_lse else None, group)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Ring attention
# ---------------------------------------------------------------------------------------------


def _ring_exchange(sends: List[torch.Tensor], recvs: List[torch.Tensor], group) -> List[dist.Work]:
    """Start sending `sends` to the next rank of the ring and receiving `recvs` from the previous one."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    next_rank = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    prev_rank = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    ops = [dist.P2POp(dist.isend, t, next_rank, group) for t in sends]
    ops += [dist.P2POp(dist.irecv, t, prev_rank, group) for t in recvs]
    return dist.batch_isend_irecv(ops)


def _wait(works: Optional[List[dist.Work]]) -> None:
    for work in works or ():
        work.wait()


class _Block(NamedTuple):
    """The one attention call of a ring step: these local query rows against these rows of the
    received K/V block, with or without the (bottom-right) causal mask."""

    q_rows: slice
    kv_rows: slice
    causal: bool


def _block(layout: str, causal: bool, rank: int, src: int, seqlen_q: int, seqlen_k: int) -> Optional[_Block]:
    """The attention call of ring step "this rank's queries against rank src's K/V block", or
    None when no query sees a key of it.

    Non-causal: everything. Causal, contiguous: src == rank is the causal diagonal block, src < rank
    all of it, src > rank nothing. Causal, zigzag (rank r holds chunks r and 2W-1-r of 2W, each of
    c = S_local/2 tokens): src == r: plain causal on the local concatenation (chunk r's queries see
    chunk r up to the diagonal and not the later chunk 2W-1-r; chunk 2W-1-r's see all of chunk r
    and their own up to the diagonal). src = s < r: chunk s lies before both local chunks and chunk
    2W-1-s after both (2W-1-s > 2W-1-r >= W > r): all local queries against the first half, no mask.
    s > r: chunks s and 2W-1-s both lie after chunk r and before chunk 2W-1-r (s <= W-1 < 2W-1-r,
    2W-1-s < 2W-1-r): the second half of the queries against all of it, no mask. Every step but the
    first is then one c x 2c (or 2c x c) call, the first a causal 2c x 2c one: equal work per rank."""
    everything = slice(0, None)
    if not causal:
        return _Block(everything, everything, False)
    if src == rank:
        return _Block(everything, everything, True)
    if layout == "contiguous":
        return _Block(everything, everything, False) if src < rank else None
    half = seqlen_q // 2
    if src < rank:
        return _Block(everything, slice(0, seqlen_k // 2), False)
    return _Block(slice(half, None), everything, False)


def _check_ring(q, k, v, causal, layout, window_size, who) -> None:
    """The arguments ring attention refuses, checked before any communication."""
    _check_qkv(q, k, v, who)
    _check_layout(layout)
    if tuple(_window_pair(window_size)) != (-1, -1):
        raise NotImplementedError(
            f"{who}: no sliding window (window_size={tuple(window_size)}): a ring step's mask would be the window "
            "shifted by the two blocks' offsets, which the local attention cannot express; use ulysses_attention, "
            "whose ranks compute whole rows"
        )  # fmt: skip


def _check_ring_shards(q, k, causal, layout, who) -> None:
    """The shapes ring attention needs of the tensors it passes around (every rank has the same)."""
    if causal:
        if q.shape[1] != k.shape[1]:
            raise ValueError(
                f"{who}: causal: q and k/v shards must have the same length (self-attention; got {q.shape[1]} "
                f"and {k.shape[1]})"
            )  # fmt: skip
        if layout == "zigzag" and q.shape[1] % 2:
            raise ValueError(f"{who}: zigzag: a shard holds two equal chunks, so its length must be even (got {q.shape[1]})")


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, softmax_scale, layout, softcap, local):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        acc = _acc_dtype(q.dtype)
        k, v = k.contiguous(), v.contiguous()
        batch, seqlen_q, heads_q, _ = q.shape
        out = torch.zeros((batch, seqlen_q, heads_q, v.shape[-1]), dtype=acc, device=q.device)
        lse = torch.full((batch, heads_q, seqlen_q), float("-inf"), dtype=acc, device=q.device)
        k_cur, v_cur = k, v
        for step in range(world):
            works = None
            if step + 1 < world:  # the next block is in flight while this one is computed
                k_next, v_next = torch.empty_like(k), torch.empty_like(v)
                works = _ring_exchange([k_cur, v_cur], [k_next, v_next], group)
            src = (rank - step) % world
            blk = _block(layout, causal, rank, src, seqlen_q, k.shape[1])
            if blk is not None:
                block_out, block_lse = local.forward(
                    q[:, blk.q_rows], k_cur[:, blk.kv_rows], v_cur[:, blk.kv_rows], blk.causal, softmax_scale, -1, -1,
                    softcap,
                )  # fmt: skip
                _merge_(out[:, blk.q_rows], lse[:, :, blk.q_rows], block_out, block_lse)
            _wait(works)
            if works is not None:
                k_cur, v_cur = k_next, v_next
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, softmax_scale, layout, softcap, local)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * 9
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, softmax_scale, layout, softcap, local = ctx.args
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        acc = _acc_dtype(q.dtype)
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        k_cur, v_cur = k, v
        dkv_works = dk_in = dv_in = None
        for step in range(world):
            kv_works = None
            if step + 1 < world:
                k_next, v_next = torch.empty_like(k), torch.empty_like(v)
                kv_works = _ring_exchange([k_cur, v_cur], [k_next, v_next], group)
            src = (rank - step) % world
            blk = _block(layout, causal, rank, src, seqlen_q, seqlen_k)
            if blk is not None:
                # The global out and lse make this block's gradients exact: P = exp(s - lse_global)
                # is the block's share of the full softmax, delta = rowsum(dout * out_global).
                dq_b, dk_b, dv_b = local.backward(
                    dout[:, blk.q_rows], q[:, blk.q_rows], k_cur[:, blk.kv_rows], v_cur[:, blk.kv_rows],
                    out[:, blk.q_rows], lse[:, :, blk.q_rows], blk.causal, softmax_scale, -1, -1, softcap,
                )  # fmt: skip
                dq[:, blk.q_rows] += dq_b
            # The fp32 dK/dV sums of block src: zeros at its owner (step 0), else received from the
            # previous rank, which added its share last step (the wait overlaps the call above).
            if step == 0:
                dk_sum = torch.zeros(k.shape, dtype=acc, device=k.device)
                dv_sum = torch.zeros(v.shape, dtype=acc, device=v.device)
            else:
                _wait(dkv_works)
                dk_sum, dv_sum = dk_in, dv_in
            if blk is not None:
                dk_sum[:, blk.kv_rows] += dk_b
                dv_sum[:, blk.kv_rows] += dv_b
            if world > 1:  # pass them on with their block; after the last step they reach the owner
                dk_in, dv_in = torch.empty_like(dk_sum), torch.empty_like(dv_sum)
                dkv_works = _ring_exchange([dk_sum, dv_sum], [dk_in, dv_in], group)
            else:
                dk_in, dv_in = dk_sum, dv_sum
            _wait(kv_works)
            if kv_works is not None:
                k_cur, v_cur = k_next, v_next
        _wait(dkv_works)
        return dq.to(q.dtype), dk_in.to(k.dtype), dv_in.to(v.dtype), None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    layout: str = "zigzag",
    softcap: float = 0.0,
    return_lse: bool = False,
    local_attention: Optional[LocalAttention] = None,
    window_size: Tuple[int, int] = (-1, -1),
):
    """Ring attention over `group` (default: the world): K/V shards travel around the ring.

    Each of W steps attends this rank's queries to one K/V block (its own first) while the next
    block is sent on by point-to-point ops; partial results merge by their LSE in fp32. The
    backward sends K/V around again, with fp32 dK/dV sums that each rank adds its share to and
    that arrive back at their block's owner after the last step.

    Args:
        q: [B, S/W, Hq, D], this rank's shard; k, v: [B, Sk/W, Hkv, D] (any Hq % Hkv == 0).
            Every rank holds as many tokens.
        layout: how the sequence is sharded, "zigzag" (zigzag_shard: balanced causal work) or
            "contiguous" (rank r holds the r-th W-th). Without causal the layout does not
            matter (any sharding, the same for q and k/v, gives the same rows).
        causal: over the whole sequence; needs q and k/v shards of one length (self-attention).
        softcap: as for hattn.attention.
        window_size: only (-1, -1): a sliding window raises NotImplementedError (use ulysses_attention).
        return_lse: also return the LSE of this rank's rows, [B, Hq, S/W] fp32.
        local_attention: the attention each rank runs (default hattn_local_attention()).

    Returns out [B, S/W, Hq, D], or (out, lse).
    """
    _check_ring(q, k, v, causal, layout, window_size, "ring_attention")
    _check_ring_shards(q, k, causal, layout, "ring_attention")
    local = local_attention or hattn_local_attention()
    out, lse = _RingAttention.apply(q, k, v, group, bool(causal), softmax_scale, layout, float(softcap), local)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Ulysses inside groups, the ring across them
# ---------------------------------------------------------------------------------------------


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ulysses_group: Optional[dist.ProcessGroup],
    ring_group: Optional[dist.ProcessGroup],
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    layout: str = "zigzag",
    softcap: float = 0.0,
    return_lse: bool = False,
    local_attention: Optional[LocalAttention] = None,
    window_size: Tuple[int, int] = (-1, -1),
):
    """Unified sequence parallelism: Ulysses over ulysses_group (U ranks), ring attention over
    ring_group (R ranks); make_usp_groups(U, R) builds the two.

    q, k, v are this rank's usp_shard of the sequence (the ring piece of its ring rank, cut into
    U contiguous parts by its Ulysses rank). The Ulysses all-to-all gives each rank its ring
    piece whole with Hq/U heads (K/V heads split or replicated as in ulysses_attention), ring
    attention runs over the ring group on those, and the all-to-all gives the rows back.
    The heads follow Ulysses' rules for U; the rest (layout, causal, softcap, no window) ring_attention's.

    Returns out [B, S/(U R), Hq, D], or (out, lse [B, Hq, S/(U R)]).
    """
    _check_ring(q, k, v, causal, layout, window_size, "usp_attention")
    local = local_attention or hattn_local_attention()
    qh, kh, vh = _seq_to_heads(q, k, v, ulysses_group)
    _check_ring_shards(qh, kh, causal, layout, "usp_attention (a ring piece)")
    out, lse = _RingAttention.apply(qh, kh, vh, ring_group, bool(causal), softmax_scale, layout, float(softcap), local)
    out, lse = _heads_to_seq(out, lse if return_lse else None, ulysses_group)
    return (out, lse) if return_lse else out

