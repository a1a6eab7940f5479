"""Refuse, before any group is used, a PTD-P layout the mesh and the model cannot build.

Every check names the constraint and what to change. :func:`check_layout` runs at
construction (mesh, model, schedule, ZeRO stage, MoE blocks against ``ep``, the tensor-
parallel mode); :func:`check_batch` at every step (the global batch against
``dp * ep * microbatches`` and the sequence against ``tp`` under sequence parallelism).
Pure functions: testable without processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.strategies.pipeline.schedules import default_chunks

DIMS = ("pp", "dp", "tp")
OPTIONAL_DIMS = ("ep",)  # expert parallelism, carved out of data parallelism
ZERO_STAGES = (0, 1, 2)


@dataclass(frozen=True)
class Sizes:
    """The mesh's sizes and the step's options, as :func:`check_layout` saw them. ``ep``:
    the expert-parallel size (1 without an ``ep`` dimension); the batch is split over
    ``dp * ep`` replicas (:attr:`replicas`)."""

    pp: int
    dp: int
    tp: int
    microbatches: int
    zero: int
    sequence_parallel: bool
    ep: int = 1

    @property
    def replicas(self) -> int:
        """How many slices the global batch is cut into: ``dp * ep``."""
        return self.dp * self.ep


def mesh_sizes(shape: dict[str, int]) -> tuple[int, int, int, int]:
    """``(pp, dp, tp, ep)`` of a mesh's ``shape`` (``ep`` 1 when absent); every other
    dimension is refused."""
    extra = [d for d in shape if d not in DIMS + OPTIONAL_DIMS]
    missing = [d for d in DIMS if d not in shape]
    if extra or missing:
        raise ValueError(
            f"ptdp: the mesh has dimensions {list(shape)}; build it as "
            f"Mesh(pp=.., dp=.., tp=..) with these three (size 1 where unused), plus ep=.. "
            f"for MoE blocks" + (f"; {extra} are not composed here" if extra else "")
        )
    return shape["pp"], shape["dp"], shape["tp"], shape.get("ep", 1)


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
    tp_mode: str = "1d",
) -> Sizes:
    """Refuse what the mesh cannot build from ``model`` (see the module docstring)."""
    from plait.models.gpt import GPT

    pp, dp, tp, ep = mesh_sizes(shape)
    if tp_mode != "1d":
        raise ValueError(
            f"ptdp: tp_mode={tp_mode!r} is not composed with pipeline and data parallelism: "
            f"2D/2.5D/3D tensor parallelism needs a row x col (x depth) grid mesh and its "
            f"own layers' gradient and state rules, which PTD-P does not carry yet; use "
            f"tp_mode='1d' here, or strategy='tp' with mode={tp_mode!r} alone"
        )
    if not isinstance(model, GPT):
        raise ValueError(
            f"ptdp: composes plait.models.GPT (its stages, plan and loss are known); got a "
            f"{type(model).__name__}"
        )
    cfg = model.config
    _check_moe(cfg, ep=ep, zero=zero, sequence_parallel=sequence_parallel)
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
    v = chunks if chunks is not None else default_chunks(schedule)
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
    return Sizes(pp, dp, tp, microbatches, zero, sequence_parallel, ep)


def _check_moe(cfg: Any, *, ep: int, zero: int, sequence_parallel: bool) -> None:
    """MoE blocks against the ``ep`` dimension (see :mod:`.experts`)."""
    moe = cfg.moe
    if moe is None:
        if ep > 1:
            raise ValueError(
                f"ptdp: the mesh has ep={ep} but the GPT has no MoE blocks; build it with "
                f"GPTConfig(moe=MoEConfig(...)) or drop ep from the mesh"
            )
        return
    if moe.num_experts % ep:
        raise ValueError(
            f"ptdp: ep={ep} does not divide the MoE blocks' num_experts={moe.num_experts}; "
            f"choose ep dividing {moe.num_experts}"
        )
    if sequence_parallel:
        raise ValueError(
            "ptdp: sequence parallelism with MoE blocks is not supported: the MoE would "
            "route each rank's slice of a sequence as its own group (other capacities than "
            "one process); use sequence_parallel=False"
        )
    if zero and ep > 1:
        raise ValueError(
            f"ptdp: zero={zero} with ep={ep}: ZeRO shards one gradient over the dp group, but "
            f"expert gradients average over dp and the others over dp x ep; use zero=0 with "
            f"expert parallelism, or ep=1"
        )
    if moe.aux_loss != "gshard" and moe.aux_loss_weight:
        raise ValueError(
            f"ptdp: aux_loss={moe.aux_loss!r} is a statistic of the whole batch: summed over "
            f"micro-batches and replicas it is not one process's loss; use aux_loss='gshard' "
            f"(a mean over groups) or aux_loss_weight=0"
        )
    if moe.bias_update_rate > 0:
        raise ValueError(
            "ptdp: auxiliary-loss-free balancing (bias_update_rate > 0) is not composed yet; "
            "use bias_update_rate=0 (the GShard auxiliary loss balances)"
        )


def check_batch(inputs: torch.Tensor, targets: torch.Tensor, sizes: Sizes) -> None:
    """Refuse a global batch the layout cannot split evenly."""
    if inputs.shape[:2] != targets.shape[:2]:
        raise ValueError(
            f"ptdp: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} differ in "
            f"batch or sequence size"
        )
    b = inputs.shape[0]
    rows = sizes.replicas * sizes.microbatches
    if b % rows:
        who = f"dp={sizes.dp}" + (f" x ep={sizes.ep}" if sizes.ep > 1 else "")
        raise ValueError(
            f"ptdp: a global batch of {b} does not split into {who} replicas x "
            f"microbatches={sizes.microbatches} equal micro-batches; use a batch that is a "
            f"multiple of {rows}"
        )
    if sizes.sequence_parallel and inputs.shape[1] % sizes.tp:
        raise ValueError(
            f"ptdp: sequence parallelism over tp={sizes.tp} needs a sequence length that is a "
            f"multiple of {sizes.tp}; got {inputs.shape[1]}"
        )
