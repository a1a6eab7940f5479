"""Refuse, before any group is used, a PTD-P layout the mesh and the model cannot build.

Every check names the constraint and what to change. :func:`check_layout` runs at
construction (mesh, model, schedule, ZeRO stage); :func:`check_batch` at every step (the
global batch against ``dp * microbatches`` and the sequence against ``tp`` under sequence
parallelism). Pure functions: testable without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

DIMS = ("pp", "dp", "tp")
ZERO_STAGES = (0, 1, 2)
# stages per rank a schedule runs by default (PipelineParallel's own rule)
_CHUNKED = ("interleaved", "zbv")


@dataclass(frozen=True)
class Sizes:
    """The mesh's three sizes and the step's options, as :func:`check_layout` saw them."""

    pp: int
    dp: int
    tp: int
    microbatches: int
    zero: int
    sequence_parallel: bool


def mesh_sizes(shape: dict[str, int]) -> tuple[int, int, int]:
    """``(pp, dp, tp)`` of a mesh's ``shape``; every other dimension is refused."""
    extra = [d for d in shape if d not in DIMS]
    missing = [d for d in DIMS if d not in shape]
    if extra or missing:
        raise ValueError(
            f"ptdp: the mesh has dimensions {list(shape)}; build it as "
            f"Mesh(pp=.., dp=.., tp=..) with exactly these three (size 1 where unused)"
            + (f"; {extra} are not composed here" if extra else "")
        )
    return shape["pp"], shape["dp"], shape["tp"]


def check_layout(
    model: nn.Module,
    *,
    shape: dict[str, int],
    microbatches: int,
    zero: int,
    schedule: str,
    chunks: int | None,
    sequence_parallel: bool,
    custom_plan: bool,
) -> Sizes:
    """Refuse what the mesh cannot build from ``model`` (see the module docstring)."""
    from plait.models.gpt import GPT

    pp, dp, tp = mesh_sizes(shape)
    if not isinstance(model, GPT):
        raise ValueError(
            f"ptdp: composes plait.models.GPT (its stages, plan and loss are known); got a "
            f"{type(model).__name__}"
        )
    cfg = model.config
    if cfg.moe is not None:
        raise ValueError(
            "ptdp: the GPT has MoE blocks; expert parallelism is not composed with "
            "tensor and pipeline parallelism yet: use strategy 'ep' (Mesh(ep=.., dp=..)) "
            "or GPTConfig(moe=None)"
        )
    if zero not in ZERO_STAGES:
        raise ValueError(f"ptdp: zero={zero!r}; use 0 (plain averaging over dp), 1 or 2")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"ptdp: microbatches={microbatches!r}; use a positive integer")
    if tp > 1 and not custom_plan:
        for what, n in (("heads", cfg.heads), ("4 * width (the MLP)", 4 * cfg.width)):
            if n % tp:
                raise ValueError(
                    f"ptdp: tp={tp} does not divide the GPT's {what} = {n}; choose a "
                    f"tensor-parallel size that divides {n}"
                )
    if sequence_parallel and cfg.seq_len % tp:
        raise ValueError(
            f"ptdp: sequence parallelism slices the sequence over tp={tp}, but seq_len "
            f"{cfg.seq_len} is not a multiple of {tp}; change seq_len or tp"
        )
    if sequence_parallel and custom_plan:
        raise ValueError("ptdp: with an explicit tp_plan, mark sequence regions in the plan")
    v = chunks if chunks is not None else (2 if schedule in _CHUNKED else 1)
    units = cfg.layers + 2  # the embedding, each block, the head (pipeline/split.py)
    if pp * v > units:
        raise ValueError(
            f"ptdp: pp={pp} ranks x {v} stage(s) each = {pp * v} pipeline stages, but the "
            f"GPT has only {units} layers to cut (embedding, {cfg.layers} blocks, head); "
            f"use pp * chunks <= {units} or more layers"
        )
    if zero == 2 and (pp > 1 or microbatches > 1):
        raise ValueError(
            f"ptdp: zero=2 with pp={pp} and microbatches={microbatches} is not supported: "
            f"ZeRO-2 reduce-scatters the gradients inside every backward, and the pipeline "
            f"runs one backward per micro-batch, so it would send the gradients "
            f"{microbatches} times a step; use zero=1 (Megatron's distributed optimizer) "
            f"with pp > 1, or pp=1 and microbatches=1 for ZeRO-2"
        )
    if zero and pp > 1 and cfg.tied:
        raise ValueError(
            f"ptdp: zero={zero} with pp={pp} and a tied embedding/head: the pipeline sums the "
            f"tied gradient between the first and last stage after backward, which ZeRO's "
            f"gradient guards forbid; use GPTConfig(tied=False), zero=0, or pp=1"
        )
    return Sizes(pp, dp, tp, microbatches, zero, sequence_parallel)


def check_batch(inputs: torch.Tensor, targets: torch.Tensor, sizes: Sizes) -> None:
    """Refuse a global batch the layout cannot split evenly."""
    if inputs.shape[:2] != targets.shape[:2]:
        raise ValueError(
            f"ptdp: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} differ in "
            f"batch or sequence size"
        )
    b = inputs.shape[0]
    rows = sizes.dp * sizes.microbatches
    if b % rows:
        raise ValueError(
            f"ptdp: a global batch of {b} does not split into dp={sizes.dp} replicas x "
            f"microbatches={sizes.microbatches} equal micro-batches; use a batch that is a "
            f"multiple of {rows}"
        )
    if sizes.sequence_parallel and inputs.shape[1] % sizes.tp:
        raise ValueError(
            f"ptdp: sequence parallelism over tp={sizes.tp} needs a sequence length that is a "
            f"multiple of {sizes.tp}; got {inputs.shape[1]}"
        )
