"""Context parallelism inside PTD-P: the sequence split over the mesh's ``cp`` dimension in
every pipeline stage.

On ``Mesh(pp=.., dp=.., tp=.., cp=..)`` the ranks of one cp group hold the same rows of
their batch slice and different parts of the sequence (:func:`shard`: chunks ``i`` and
``2c-1-i`` of ``2c`` when ``balanced``, so a causal mask gives every rank the same work;
one chunk each otherwise). Before the model is cut into stages its attention kernel is
swapped (:func:`~plait.strategies.context.context_parallel`: ring or Ulysses attention over
``mesh.group("cp")``, the module embedding positions fed with the rank's global positions),
so each stage's attention exchanges keys and values with the same stage on the other cp
ranks; the activations sent between stages are the rank's ``b x s/c x h``. Each rank's loss
is the mean over its own tokens, so for gradients the cp ranks are data replicas: the dense
gradients and the reported loss are averaged over ``dp x cp`` (:func:`average_group`)
instead of ``dp``.

=========  ===========================================  ==================================
group      forward                                      backward
=========  ===========================================  ==================================
cp         ring: K and V of every other rank's chunks,  ring: K/V again and dK/dV home;
           point to point; Ulysses: two all-to-alls     Ulysses: two all-to-alls
           per attention                                per attention
dp x cp    one scalar all-reduce of the loss            one all-reduce of the gradients
=========  ===========================================  ==================================

Refused by name (:func:`check_context`): a loss that counts its items or shifts its labels
inside (Hugging Face's: a sequence chunk's last label belongs to the next chunk), sequence
parallelism, ZeRO, MoE blocks, ``reproducible=True``, a sequence that ``2c`` (``c``
without balancing) does not divide.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.comm.group import Group
from plait.strategies.context import shard_sequence


def check_context(
    *,
    cp: int,
    zero: int,
    sequence_parallel: bool,
    reproducible: bool,
    moe: bool,
    reduction: str,
    name: str,
) -> None:
    """Refuse what context parallelism inside PTD-P does not compose with (module
    docstring), before anything is cut."""
    if cp == 1:
        return
    why = None
    if reduction != "mean":
        why = (
            f"the {name}'s pipeline loss counts its items over the whole batch and shifts its "
            f"labels itself (reduction={reduction!r}); a rank's sequence chunk ends where the "
            f"next rank's begins. cp inside PTD-P takes a mean loss on targets shifted by the "
            f"caller (plait's GPT); train this model with strategy='cp' on dp x tp"
        )
    elif sequence_parallel:
        why = "sequence parallelism with cp is not composed; use sequence_parallel=False"
    elif zero:
        why = f"zero={zero} with cp: ZeRO reduces over dp only; use zero=0"
    elif moe:
        why = "MoE blocks with cp: their groups are whole sequences; drop cp or the MoE blocks"
    elif reproducible:
        why = "reproducible=True with cp: attention sums over the ring in another order"
    if why is not None:
        raise ValueError(f"ptdp: cp={cp}: {why}")


def average_group(mesh: Any, *, ep: bool) -> Group:
    """The ranks whose dense gradients and losses are averaged: ``dp x cp`` (and ``ep``)."""
    wanted = ("dp", "ep", "cp") if ep else ("dp", "cp")
    dims = [d for d in mesh.names if d in wanted]  # the mesh's order
    return mesh.submesh(*dims).group(*dims)  # type: ignore[no-any-return]


def shard(t: torch.Tensor, mesh: Any, *, balanced: bool) -> torch.Tensor:
    """This cp rank's part of the sequence (dimension 1) of ``t``."""
    s, c = t.shape[1], mesh.shape["cp"]
    parts = 2 * c if balanced else c
    if s % parts:
        raise ValueError(
            f"ptdp: cp={c}: a sequence of {s} tokens does not split into {parts} equal "
            f"chunks{' (two per rank, balanced)' if balanced else ''}; use a length that is a "
            f"multiple of {parts}"
        )
    return shard_sequence(t, mesh, balanced=balanced, dim=1)[0]


__all__ = ["average_group", "check_context", "shard"]
