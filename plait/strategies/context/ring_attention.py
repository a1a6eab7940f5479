"""Ring attention: attention over a sequence split across the cp group, keys and values
travelling around the ring.

Each cp rank holds ``S / c`` tokens (two chunks, see :mod:`.layout`) of ``q``, ``k`` and
``v`` (``[batch, heads, S / c, head_dim]``; ``k`` and ``v`` may have fewer heads: grouped-
query attention, sent compact and repeated only for the arithmetic).

Forward (``c`` steps): at step ``j`` rank ``r`` holds the keys and values of rank
``(r - j) mod c``. The next step's transfer (send to ``r + 1``, receive from ``r - 1``) is
posted *before* this step's arithmetic, so both overlap where the transport allows. Each
chunk pair gives a partial output ``o_i`` and its row-wise log-sum-exp ``l_i``; partials are
merged by the online-softmax rule ``l = log(e^l1 + e^l2)``, ``o = e^(l1-l) o1 + e^(l2-l) o2``.
Under a causal mask, chunk pairs above the diagonal are skipped (:func:`.layout.pair_kinds`).
A chunk pair is computed by PyTorch's fused CPU flash kernel, which returns the log-sum-exp
and never holds the score matrix (``FUSED_CPU_KERNEL``), or by the plain arithmetic
(``_block_forward``/``_block_backward``: the reference, used off CPU).

Backward (recomputed blockwise, nothing but ``q, k, v, out, lse`` saved): the keys and
values go around the ring once more; at step ``j = 1 .. c-1`` rank ``r`` uses the block of
rank ``s = r - j`` (the next block's transfer posted before the compute), adds its share to
the running ``dk_s, dv_s`` received from ``r - 1`` and passes them on; its own block comes
last, while the last running sum travels home (from ``r - 1``), where the owner adds its own
share. So the own ``dk, dv`` is not held through the loop; in flight at most: the K/V block
in use and the next one, the running dK/dV sent and the one arriving, this step's dK/dV
share and one chunk pair's gradients.

Communication, on the cp group only (point-to-point, counted by
``plait.comm.group_stats()``), with ``KV = 2 * batch * kv_heads * (S / c) * head_dim``
elements per rank:

=========  ==============  ===========================  ======================
pass       message         sent per rank per layer      why
=========  ==============  ===========================  ======================
forward    ``cp_kv``       ``(c - 1) * KV``             every other rank's K, V
backward   ``cp_kv_bwd``   ``(c - 1) * KV``             K, V again (recompute)
backward   ``cp_dkv``      ``(c - 1) * KV``             dK, dV back to the owner
=========  ==============  ===========================  ======================
"""

from __future__ import annotations

import math
from typing import Any

import torch

from plait.comm.group import Group
from plait.strategies.context.layout import pair_kinds
from plait.strategies.context.ring import shift

# False: the plain arithmetic on CPU too (the reference the fused kernel is tested against)
FUSED_CPU_KERNEL = True
# chunk pairs computed in forward per (cp size, cp rank): read by tests and the benchmark
WORK: dict[tuple[int, int], int] = {}


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V with ``heads`` heads: kv head ``i`` serves query heads ``i*g .. i*g+g-1``."""
    g = heads // t.shape[1]
    return t if g == 1 else t.repeat_interleave(g, dim=1)


def _fold(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of :func:`_expand`: sum each kv head's ``g`` query heads."""
    b, h, s, d = t.shape
    return t if h == kv_heads else t.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, kind: str, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if kind == "diagonal":
        n = s.shape[-1]
        above = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s


def _fused(q: torch.Tensor) -> bool:
    return FUSED_CPU_KERNEL and q.device.type == "cpu"


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk pair: the partial output and its row-wise log-sum-exp. On CPU, PyTorch's
    fused flash kernel (it returns the log-sum-exp and never holds the scores); elsewhere
    the plain arithmetic below, which is the reference."""
    if _fused(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, kind == "diagonal", scale=scale
        )
        return out, lse
    s = _scores(q, k, kind, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def _block_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kind: str,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one chunk pair, given the *merged* output and log-sum-exp of the query
    rows (so ``P = exp(S - lse)`` is this pair's share of the global softmax)."""
    if _fused(q):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, kind == "diagonal", scale=scale
        )
        return dq, dk, dv
    p = torch.exp(_scores(q, k, kind, scale) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - (do * out).sum(-1, keepdim=True))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


def _merge(
    acc: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: merge a partial ``(out, lse)`` into the running one."""
    if acc is None:
        return out, lse
    o1, l1 = acc
    lse_new = torch.logaddexp(l1, lse)
    merged = (
        torch.exp(l1 - lse_new).unsqueeze(-1) * o1 + torch.exp(lse - lse_new).unsqueeze(-1) * out
    )
    return merged, lse_new


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: Group,
        causal: bool,
        balanced: bool,
        scale: float,
    ) -> torch.Tensor:
        c, r = group.size, group.rank
        heads, n = q.shape[1], q.shape[2] // 2
        qc = q.split(n, dim=2)
        acc: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
        kv = [k, v]
        pairs = 0
        for step in range(c):
            nxt = shift(kv, group, kind="cp_kv", what="pass keys/values") if step < c - 1 else None
            src = (r - step) % c
            ks = _expand(kv[0], heads).split(n, dim=2)
            vs = _expand(kv[1], heads).split(n, dim=2)
            for a, j, kind in pair_kinds(r, src, c, causal=causal, balanced=balanced):
                out, lse = _block_forward(qc[a], ks[j], vs[j], kind, scale)
                acc[a] = _merge(acc[a], out, lse)
                pairs += 1
            if nxt is not None:
                kv = nxt.wait()
                nxt = None
            del ks, vs
        WORK[(c, r)] = pairs
        # every query chunk sees at least its own diagonal chunk, so both are set. The output
        # is laid out [b, tokens, heads, d] in memory (as the fused kernel lays out its own),
        # so a model's ``out.transpose(1, 2).reshape(b, s, -1)`` before its projection is a
        # view: the projection then saves this tensor, not a copy of it
        b, _, _, d = q.shape
        out = q.new_empty(b, 2 * n, heads, d).transpose(1, 2)
        out[:, :, :n].copy_(acc[0][0])  # type: ignore[index]
        out[:, :, n:].copy_(acc[1][0])  # type: ignore[index]
        lse = torch.cat([acc[0][1], acc[1][1]], dim=2)  # type: ignore[index]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.balanced, ctx.scale = group, causal, balanced, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, balanced, scale = ctx.group, ctx.causal, ctx.balanced, ctx.scale
        c, r = group.size, group.rank
        heads, kv_heads, n = q.shape[1], k.shape[1], q.shape[2] // 2
        qc, dos = q.split(n, dim=2), grad_out.split(n, dim=2)
        outs, lses = out.split(n, dim=2), lse.split(n, dim=2)
        dq = torch.zeros_like(q)
        dqc = dq.split(n, dim=2)

        def share(kv: list[torch.Tensor], src: int) -> list[torch.Tensor]:
            """This rank's dK, dV of block ``src`` (its dq share added into ``dq``)."""
            ke, ve = _expand(kv[0], heads), _expand(kv[1], heads)
            ks, vs = ke.split(n, dim=2), ve.split(n, dim=2)
            dk, dv = torch.zeros_like(ke), torch.zeros_like(ve)
            dks, dvs = dk.split(n, dim=2), dv.split(n, dim=2)
            for a, j, kind in pair_kinds(r, src, c, causal=causal, balanced=balanced):
                g = _block_backward(dos[a], qc[a], ks[j], vs[j], outs[a], lses[a], kind, scale)
                dqc[a].add_(g[0])
                dks[j].add_(g[1])
                dvs[j].add_(g[2])
                del g
            return [_fold(dk, kv_heads), _fold(dv, kv_heads)]

        # the other ranks' blocks first (step j: the block of rank r - j, then the running
        # dK/dV of it, received from r - 1, plus this rank's share, passed on to r + 1), the
        # rank's own block last: its dK/dV is computed while the last running sum travels
        # home, not held through the loop
        nxt = None
        if c > 1:
            nxt = shift([k, v], group, kind="cp_kv_bwd", what="pass keys/values (backward)")
        incoming = None
        for step in range(1, c):
            assert nxt is not None
            kv = nxt.wait()
            if step < c - 1:  # posted before the compute: it travels while this block runs
                nxt = shift(kv, group, kind="cp_kv_bwd", what="pass keys/values (backward)")
            else:
                nxt = None
            mine = share(kv, (r - step) % c)
            del kv  # the last block is free before the dK/dV buffers below are posted
            if incoming is not None:
                mine = [a.add_(b) for a, b in zip(incoming.wait(), mine, strict=True)]
            incoming = shift(mine, group, kind="cp_dkv", what="pass dK/dV home")
            del mine
        own = share([k, v], r)
        if incoming is not None:  # the received buffers are this rank's: add in place
            own = [b.add_(a) for a, b in zip(own, incoming.wait(), strict=True)]
        return dq, own[0], own[1], None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group,
    causal: bool = True,
    balanced: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence held by ``group``.

    ``q`` ``[b, heads, S/c, d]``, ``k``/``v`` ``[b, kv_heads, S/c, d]`` (``kv_heads``
    dividing ``heads``), each rank's tokens laid out as :func:`.layout.shard_sequence`
    gives them (``balanced`` must match). ``scale`` defaults to ``1 / sqrt(d)``. Returns
    ``[b, heads, S/c, d]``, equal to this rank's rows of full attention on the whole
    sequence. Collective over ``group`` in forward and backward (module docstring: the
    messages and their bytes).
    """
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(
            f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
            f"[batch, heads, tokens, head_dim] with the same batch, tokens and head_dim"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"ring_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} "
            f"key/value heads"
        )
    if q.shape[2] % 2:
        raise ValueError(
            f"ring_attention: cp rank {group.rank} holds {q.shape[2]} tokens, not two equal "
            f"chunks; shard the sequence with shard_sequence (a length divisible by 2 * cp)"
        )
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out: torch.Tensor = _RingAttention.apply(q, k, v, group, causal, balanced, s)
    return out
