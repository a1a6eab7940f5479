"""What the healing trainers read from the model before training: a layer whose rank holds
what no peer at its position holds (refused by :class:`~.trainer.HealingTrainer`, which
names :class:`~.replicas.ReplicaTrainer`), layers that draw random numbers in the forward
(named in a warning: after a fault the survivors draw their own), and a model-parallel
model's buffers (sent to a replacement with the state). Local: no communication.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

# What a healing job cannot hold: a rank of these owns a part of the model no peer has.
_UNHEALABLE = {
    "plait.strategies.tensor": "tensor parallelism (each tp rank holds a slice of the matmuls)",
    "plait.strategies.pipeline": "pipeline parallelism (each pp rank holds its own stages)",
    "plait.strategies.context": "context parallelism (each cp rank holds part of the sequence)",
    "plait.strategies.moe": "expert parallelism (each ep rank holds its own experts)",
    "plait.strategies.data_parallel": "a DistributedDataParallel wrapper (healing does the "
    "data-parallel exchange itself: pass the plain model)",
}


def refuse_sharded(module: nn.Module) -> None:
    """Refuse, naming the layer, a model a rank of which holds what no peer holds: such a
    rank cannot be replaced from a live peer of its own position here; its whole replica
    can (:class:`~plait.heal.replicas.ReplicaTrainer`)."""
    for name, sub in module.named_modules():
        if getattr(sub, "_plait_fsdp_units", None):
            raise ValueError(
                f"healing: {name or 'the model'} is wrapped by plait's FSDP "
                f"({type(sub).__name__}); healing shards the parameters itself: pass the "
                f"plain model with zero=3 (docs/healing.md)"
            )
        owner = type(sub).__module__
        for prefix, what in _UNHEALABLE.items():
            if owner.startswith(prefix):
                if prefix.endswith("data_parallel"):
                    raise ValueError(f"healing: {name or 'the model'} is {what}")
                raise ValueError(
                    f"healing: {name or 'the model'} is a {type(sub).__name__}: {what}. "
                    f"HealingTrainer heals ranks that each hold the whole model; a model cut "
                    f"over ranks heals by whole replicas: build it on the replica's mesh "
                    f"with plait.heal.ReplicaTrainer (docs/healing.md), or without healing "
                    f"`plait run` restarts it from the last checkpoint (--max-restarts)"
                )


def _modules(model: Any) -> list[torch.nn.Module]:
    if isinstance(model, torch.nn.Module):
        return list(model.modules())
    stages = getattr(getattr(model, "pipe", None), "stages", None) or {}
    return [m for stage in stages.values() for m in stage.modules()]


def warn_random(model: Any, rank: int) -> None:
    """Say which layers draw random numbers in the forward: a survivor that computes a
    lost replica's block draws its own, not the ones the lost replica would have drawn,
    so the run is no longer bitwise the uninterrupted one after a fault (it stays a
    correct run with other draws)."""
    drawing = []
    for m in _modules(model):
        if isinstance(m, torch.nn.Dropout) and m.p > 0:
            drawing.append(f"{type(m).__name__}(p={m.p})")
        policy = getattr(m, "second_expert", None)
        if policy in ("random", "sampling") and getattr(m, "top_k", 1) > 1:
            drawing.append(f"{type(m).__name__}(second_expert={policy!r})")
    if drawing and rank == 0:
        warnings.warn(
            f"healing: {sorted(set(drawing))} draw random numbers in the forward: after a "
            f"replica is lost the survivors draw their own for its blocks, so the run is not "
            f"bitwise the uninterrupted one (dropout 0, second_expert='all' keep it)",
            stacklevel=3,
        )


def buffers_of(model: Any) -> list[torch.Tensor]:
    """The model's buffers (a module's, or those of a PTD-P model's stages)."""
    if isinstance(model, torch.nn.Module):
        return list(model.buffers())
    pipe = getattr(model, "pipe", None)
    stages = getattr(pipe, "stages", None)
    if stages is None:
        return []
    return [b for stage in stages.values() for b in stage.buffers()]


def params_device(params: list[nn.Parameter], *, backend: str, who: str) -> torch.device:
    """The parameters' one device; refused (naming ``who``) where they are on several or
    where the backend cannot move their tensors. On NCCL the current CUDA device becomes
    the parameters' (a generation's communicator and the control tensors are made
    there)."""
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(
            f"healing: {who}: the trainable parameters are on "
            f"{sorted(map(str, devices))}; the exchange carries one flat vector on one "
            f"device (move the model with .to(device))"
        )
    device = devices.pop()
    if backend == "nccl":
        if device.type != "cuda":
            raise ValueError(
                f"healing: {who}: backend='nccl' moves CUDA tensors only and "
                f"the parameters are on {device}; move the model to this rank's GPU "
                f"(model.cuda(local_rank)) or use backend='gloo'"
            )
        torch.cuda.set_device(device)
    elif device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"healing: {who}: the parameters are on {device}; backend="
            f"{backend!r} moves CPU and CUDA tensors (CUDA staged through the host)"
        )
    return device
