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
  (x ep)   (with ep: over dp x ep x cp)                 (with ep: the dense ones over
                                                        dp x ep x cp, the experts' over
                                                        dp x cp)
=========  ===========================================  ==================================

A loss that counts its items and shifts its labels inside (Hugging Face's causal-LM loss:
a chunk's last label belongs to another rank's chunk) runs when its pipeline plan has a
``shifted_loss`` and takes ``position_ids`` (the Hugging Face Llama family's plan; a loss
on labels the loader shifted, torchtitan's, needs the ``position_ids`` input only):
:meth:`~plait.strategies.compose.PTDP.step` shifts the labels over the whole sequence
(:func:`shift_labels`: label ``t`` is token ``t + 1``, the last ``-100``) before cutting
them, counts the loss items on the whole global batch, and passes each rank's global
position ids (:func:`rank_positions`) as a per-micro-batch input, from which every stage
computes its rotary embedding; the attention builds no mask (the kernel is causal on
global positions). Each rank's loss is its chunks' sum over the global item count, times
the ``dp x cp`` ranks averaged, so the average is one process's mean.

Refused by name (:func:`check_context`): such a loss without a ``shifted_loss`` (GPT-2's
plan), a plan without a ``position_ids`` input when no ``positions=`` module embeds them,
a padding ``attention_mask``, ZeRO, plait's GShard MoE layer (Hugging Face MoE blocks route
each token on their own and pass, their load-balancing statistics summed over dp x ep x
cp; experts split over ``ep`` have their gradients averaged over dp x cp),
``reproducible=True``, a sequence that ``2c`` (``c`` without balancing) does not divide.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.comm.group import Group
from plait.strategies.context import positions, shard_sequence


def check_context(
    *,
    cp: int,
    zero: int,
    reproducible: bool,
    moe: bool,
    plan: Any,
    positions: str | bool | None,
    buffers: tuple[str, ...],
    name: str,
) -> None:
    """Refuse what context parallelism inside PTD-P does not compose with (module
    docstring), before anything is cut. ``plan``: the model's pipeline plan;
    ``positions``: where the model embeds position ids (``compose``'s option);
    ``buffers``: the model's buffer names."""
    if cp == 1:
        return
    why = None
    takes_positions = "position_ids" in plan.inputs
    if plan.shifts_labels and plan.shifted_loss is None:
        why = (
            f"the {name}'s pipeline loss shifts its labels itself and its plan has no "
            f"shifted_loss= (the same loss on labels shifted by the caller): a rank's chunks "
            f"of the sequence end where another rank's begin. Plans that have it: the Hugging "
            f"Face Llama family (Llama, Mistral, Qwen2, Qwen3); or train this model with "
            f"strategy='cp' on dp x tp"
        )
    elif isinstance(positions, str) and positions in buffers and not takes_positions:
        why = (
            f"positions={positions!r} names a buffer, whose rows plait swaps around the "
            f"model's forward, which a pipeline never calls; give the {name}'s pipeline plan "
            f"a 'position_ids' input that its context reads"
        )
    elif positions is None and not takes_positions:
        why = (
            f"the {name}'s pipeline plan takes no 'position_ids' input and no positions= "
            f"names the module embedding them, so every stage would compute positions "
            f"0..s/cp-1 instead of the rank's global ones; give the plan a 'position_ids' "
            f"input its context reads (as the Hugging Face Llama family's does), or pass "
            f"positions='<module>' (positions=False if the model embeds none)"
        )
    elif zero:
        why = f"zero={zero} with cp: ZeRO reduces over dp only; use zero=0"
    elif moe:
        why = (
            "plait's MoE layer with cp: its GShard groups and capacity are over the tokens "
            "one call sees (under cp a chunk of each sequence); use a model whose MoE blocks "
            "route each token on its own (Hugging Face Mixtral, Qwen-MoE) or drop cp"
        )
    elif reproducible:
        why = "reproducible=True with cp: attention sums over the ring in another order"
    if why is not None:
        raise ValueError(f"ptdp: cp={cp}: {why}")


def shift_labels(labels: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
    """``labels`` shifted left by one along the sequence (dimension 1), the last position
    ``ignore_index``: label ``t`` becomes the target of position ``t`` (what a loss that
    shifts inside would compute on the whole sequence)."""
    tail = torch.full_like(labels[:, :1], ignore_index)
    return torch.cat([labels[:, 1:], tail], dim=1)


def rank_positions(ids: torch.Tensor, mesh: Any, *, balanced: bool) -> torch.Tensor:
    """This cp rank's global position ids for the whole-sequence batch ``ids``
    (``[rows, s / c]``, a view expanded over the rows)."""
    rows, s = ids.shape[0], ids.shape[1]
    pos = positions(s, mesh.shape["cp"], mesh.rank("cp"), balanced=balanced)
    return pos.to(ids.device).unsqueeze(0).expand(rows, -1)


def check_unpadded(mask: torch.Tensor | None) -> None:
    """A padding mask under cp is refused: the kernels are causal on global positions."""
    if mask is not None and not bool(torch.all(mask != 0)):
        raise ValueError(
            "ptdp: cp > 1 with a padding attention_mask: the ring and Ulysses kernels attend "
            "causally over whole sequences, without padding; pack the batch without pads or "
            "drop cp"
        )


def cut_sequences(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    batch_inputs: dict[str, torch.Tensor],
    *,
    mesh: Any,
    balanced: bool,
    shifts_labels: bool,
    positions: bool,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """This cp rank's part of a replica's rows: the targets shifted over the whole
    sequence first when the loss shifts its labels itself (``shifts_labels``), then the
    ids and targets cut (:func:`shard`), and with ``positions`` the rank's global
    ``position_ids`` added to the per-micro-batch inputs. A padding mask and caller-given
    ``position_ids`` are refused by name. No communication."""
    check_unpadded(batch_inputs.pop("attention_mask", None))
    if "position_ids" in batch_inputs:
        raise ValueError(
            "ptdp.step: position_ids= with cp > 1: PTD-P gives each rank the global "
            "positions of its chunks itself; drop position_ids"
        )
    if shifts_labels:
        targets = shift_labels(targets)
    if positions:
        batch_inputs["position_ids"] = rank_positions(inputs, mesh, balanced=balanced)
    cut_inputs = shard(inputs, mesh, balanced=balanced)
    return cut_inputs, shard(targets, mesh, balanced=balanced), batch_inputs


def average_group(mesh: Any, *, ep: bool) -> Group:
    """The ranks whose dense gradients and losses are averaged: ``dp x cp`` (and ``ep``)."""
    return replica_group(mesh, ("dp", "ep", "cp") if ep else ("dp", "cp"))


def replica_group(mesh: Any, wanted: tuple[str, ...]) -> Group:
    """The flattened group of the mesh dimensions ``wanted`` (in the mesh's order): with cp,
    ``dp x cp`` holds the same experts split over ep."""
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


__all__ = [
    "average_group",
    "check_context",
    "check_unpadded",
    "cut_sequences",
    "replica_group",
    "rank_positions",
    "shard",
    "shift_labels",
]
