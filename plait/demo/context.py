"""``plait demo --model gpt --cp N [--context ring|ulysses]``: the options, and the bytes the
attention kernel sends over cp, counted and against the formula.

The layout is ``Mesh(dp=n/(cp*tp), cp=cp, tp=tp)`` (:func:`plait.demo.layouts.context`):
each cp rank holds two of the ``2 * cp`` chunks of every window of its dp replica's rows,
attention runs over the cp group (ring: keys and values passed around the ring; Ulysses:
all-to-all to whole sequences of ``heads / cp`` heads and back), tensor parallelism splits
each rank's heads over tp first, and the gradients are averaged over the cp x dp ranks.

The report counts what every rank sent per message kind on its cp group
(``plait.comm.group_stats``, through :func:`plait.demo.gpt.train._dimension_bytes`) and compares
it to :func:`attention_formula`, per rank and per kind; a difference fails the demo.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from plait.demo.options import GPTDemoConfig

CONTEXTS = ("ring", "ulysses")
RING_KINDS = ("cp_kv", "cp_kv_bwd", "cp_dkv")
ULYSSES_KINDS = ("all_to_all",)


def validate_cp(c: GPTDemoConfig) -> None:
    """Raise :class:`~plait.demo.options.GPTDemoOptionError` (one line naming the option and
    what to change) unless ``c``'s context parallelism is usable. Runs before any rank."""
    # deferred: plait.demo.options imports this module (its validate calls this function)
    from plait.demo.options import GPTDemoOptionError as bad

    if not isinstance(c.cp, int) or c.cp < 1:
        raise bad(f"--cp must be at least 1, got {c.cp}")
    if c.context not in CONTEXTS:
        raise bad(f"--context must be one of {', '.join(CONTEXTS)}, got {c.context!r}")
    if c.cp == 1:
        return
    if c.pp > 1:
        raise bad("--cp does not compose with --pp (cp inside pipeline stages): drop one of them")
    if c.moe:
        raise bad("--cp does not compose with --moe in the demo: drop one of them")
    if c.tp_mode != "1d":
        raise bad(f"--cp composes with 1D tensor parallelism only: drop --tp-mode {c.tp_mode}")
    if c.sequence_parallel and (c.seq_len // (2 * c.cp)) % c.tp:
        raise bad(
            f"--sp with --cp {c.cp}: each of a rank's two chunks of --seq-len {c.seq_len} "
            f"tokens ({c.seq_len // (2 * c.cp)}) must split over --tp {c.tp}"
        )
    if c.tp < 1 or c.world_size % (c.cp * c.tp):
        raise bad(
            f"--cp {c.cp} x --tp {c.tp} must divide -n {c.world_size} (the mesh is dp x cp x tp)"
        )
    if c.seq_len % (2 * c.cp):
        raise bad(
            f"--seq-len {c.seq_len} must be divisible by 2 x --cp = {2 * c.cp} (each cp rank "
            f"holds two equal chunks of every window, ring and Ulysses alike)"
        )
    if c.context == "ulysses" and c.heads % (c.tp * c.cp):
        per = f"{c.heads} / --tp {c.tp} = {c.heads // max(1, c.tp)}" if c.tp > 1 else f"{c.heads}"
        raise bad(
            f"--context ulysses splits the heads over cp: --heads {per} must be divisible by "
            f"--cp {c.cp}; change --heads or use --context ring"
        )


def fitted_heads(c: GPTDemoConfig, heads: int) -> int:
    """``heads`` raised to fit Ulysses (a multiple of cp per tp rank) when not given."""
    if c.cp > 1 and c.context == "ulysses":
        return math.lcm(heads, max(1, c.tp) * c.cp)
    return heads


def attention_formula(c: GPTDemoConfig, *, held_out_rows: int) -> dict[str, int]:
    """Bytes one rank sends on its cp group for attention over the whole run, per message
    kind: ``steps`` training steps (forward and backward) of ``batch_size / dp`` rows and
    ``eval_points`` held-out forwards of ``held_out_rows / dp`` rows, ``layers`` layers.

    Per layer and pass, with ``T = rows x heads/tp x seq_len/cp x head_dim`` elements (one
    rank's q, k, v or output; the GPT's K and V have all the heads):

    - ring: ``cp_kv`` ``(cp - 1) x 2T`` forward (K and V of every other rank's chunks);
      backward ``cp_kv_bwd`` the same again (recomputation) and ``cp_dkv`` ``(cp - 1) x 2T``
      (dK and dV travelling home);
    - Ulysses: 4 all-to-alls forward (q, k, v to head-split, the output back) and 4
      backward, each sending all but the rank's own block: ``(cp - 1) / cp x T``.
    """
    elem = torch.empty((), dtype=getattr(torch, c.dtype)).element_size()
    head_dim = c.width // c.heads

    def t(rows: int) -> int:  # one rank's q (or k, v, output) of one layer, in bytes
        return rows * (c.heads // c.tp) * (c.seq_len // c.cp) * head_dim * elem

    train, held = t(c.batch_size // c.dp), t(held_out_rows // c.dp)
    forwards = c.steps * train + c.eval_points * held  # summed over the run's forward passes
    if c.context == "ring":
        return {
            "cp_kv": c.layers * (c.cp - 1) * 2 * forwards,
            "cp_kv_bwd": c.layers * (c.cp - 1) * 2 * c.steps * train,
            "cp_dkv": c.layers * (c.cp - 1) * 2 * c.steps * train,
        }
    per = 4 * (forwards + c.steps * train)  # 4 all-to-alls forward, 4 backward
    return {"all_to_all": c.layers * per * (c.cp - 1) // c.cp}


def counted(bytes_by_dim: dict[str, dict[str, int]], kinds: tuple[str, ...]) -> dict[str, int]:
    """What one rank's cp row of :func:`~plait.demo.gpt.train._dimension_bytes` says it sent, per
    message kind (its keys are ``kind/algorithm``)."""
    row = bytes_by_dim.get("cp", {})
    return {k: sum(v for key, v in row.items() if key.split("/")[0] == k) for k in kinds}


def check(
    c: GPTDemoConfig, per_rank: list[dict[str, Any]], *, held_out_rows: int
) -> dict[str, Any]:
    """Every rank's counted attention bytes on cp against :func:`attention_formula`. A
    ``native`` collective (its bytes not visible to plait) cannot be checked: it disagrees."""
    kinds = RING_KINDS if c.context == "ring" else ULYSSES_KINDS
    want = attention_formula(c, held_out_rows=held_out_rows)
    got = [counted(b, kinds) for b in per_rank]
    native = any("(payload)" in key for b in per_rank for key in b.get("cp", {}))
    return {
        "context": c.context,
        "formula": want,
        "counted": got,
        "agree": not native and all(g == want for g in got),
        "native": native,
    }


def report_lines(c: GPTDemoConfig, cp: dict[str, Any], bytes_by_dim: dict[str, Any]) -> list[str]:
    """The report's lines on cp: the attention bytes (rank 0's, counted and by the formula,
    and whether every rank agrees) and the gradient average's bytes."""
    mib = 2**20
    want, got = cp["formula"], cp["counted"][0]
    how = (
        "K and V of the other ranks' chunks forward; again and dK/dV home backward"
        if c.context == "ring"
        else "4 all-to-alls forward, 4 backward, (cp-1)/cp of q, k, v or the output each"
    )
    verdict = "agree on every rank" if cp["agree"] else "DISAGREE"
    if cp["native"]:
        verdict += " (a native all-to-all: its bytes are not visible to plait)"
    lines = [
        f"cp attention bytes    {sum(got.values()):,} counted, {sum(want.values()):,} by the "
        f"formula ({c.context}: {how}; {c.layers} layers x {c.steps} steps + {c.eval_points} "
        f"held-out forwards): {verdict}",
        "  " + ", ".join(f"{k} {got[k]:,} = {want[k]:,}" for k in want),
    ]
    # the gradient average runs on cp, or on the flattened cp x dp group ("dp+cp")
    grads = next((d for d in bytes_by_dim if set(d.split("+")) == {"cp", "dp"}), "cp")
    row = bytes_by_dim.get(grads, {})
    reduce = {k: v for k, v in row.items() if k.startswith("all_reduce/")}
    total = sum(reduce.values())
    lines.append(
        f"gradients on {grads:<8} {total / mib / c.steps:.3f} MiB per step by rank 0 "
        f"({', '.join(reduce)}: the {c.cp * c.dp} ranks holding the same parameters average "
        f"their gradients, and the losses)"
    )
    return lines
