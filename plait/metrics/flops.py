"""Model FLOPs per token and the peak FLOP/s of this rank's device: the two halves of MFU.

MFU (model FLOPs utilisation, PaLM appendix B) is the FLOP/s a training step achieves by
the model's count, divided by what the devices could do at peak::

    MFU = flops_per_token x tokens per step / step time / sum of the ranks' peaks

The model's count comes from the planner (:meth:`plait.plan.ModelSpec.flops_per_token`:
forward and backward, ``6N``-like plus attention's ``s x s`` products, recomputation not
counted) for the families it knows: plait's GPT and the Hugging Face families of
:mod:`plait.plan.hf` (Llama, Mistral, Qwen2/3, Mixtral, Qwen-MoE, GPT-2); any other model
takes the user's number. The peak is the planner's hardware table
(:mod:`plait.plan.hardware`: A100, H100, H200, B200, dense bf16) for a CUDA device it names,
a bf16 matmul timed on any other CUDA device, and on a CPU a float32 matmul timed on one
thread, times the cores this rank gets (its torch threads, at most the cores over the
local ranks).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from plait.models.gpt import GPTConfig

if TYPE_CHECKING:
    from plait.plan.model import ModelSpec

# plait.plan (the whole planner, imported with its package) is imported when FLOPs or a
# peak are asked for, so a run that logs no MFU does not load it

#: CUDA device names (a substring of ``torch.cuda.get_device_name``) -> the planner's preset
DEVICES = ("H200", "H100", "A100", "B200")


@dataclass(frozen=True)
class Peak:
    """One rank's peak FLOP/s and where the number comes from."""

    flops: float
    source: str


def model_spec(model: Any) -> ModelSpec:
    """The planner's :class:`~plait.plan.ModelSpec` of ``model``: a spec, plait's GPT or its
    ``GPTConfig``, a Hugging Face model or config (or its dict), also inside a wrapper that
    keeps the model as ``.module``, ``._orig_mod`` or ``.model``. Raises ``ValueError``
    naming ``flops_per_token=`` for anything else."""
    from plait.plan.hf import (  # deferred: the planner costs 2 s to import, needed only for FLOPs
        FAMILIES,
        from_hf_config,
    )
    from plait.plan.model import ModelSpec, from_gpt_config  # deferred: as above

    seen = model
    for _ in range(4):  # a compiled model inside a strategy's wrapper, at most
        if isinstance(model, ModelSpec):
            return model
        if isinstance(model, Mapping) and "model_type" in model:
            return from_hf_config(model)
        if hasattr(model, "to_dict") and getattr(model, "model_type", None) is not None:
            return from_hf_config(model)
        if isinstance(model, GPTConfig):
            return from_gpt_config(model)
        config = getattr(model, "config", None)
        if config is not None and config is not model:
            model = config
            continue
        inner = next(
            (getattr(model, a) for a in ("module", "_orig_mod", "model") if hasattr(model, a)),
            None,
        )
        if inner is None:
            break
        model = inner
    raise ValueError(
        f"metrics: the FLOPs of {type(seen).__name__} are not known to plait (it counts "
        f"plait's GPT and Hugging Face {', '.join(FAMILIES)}); pass flops_per_token= "
        f"(forward and backward, e.g. 6 x parameters) or leave model= out to log no MFU"
    )


def flops_per_token(model: Any, *, seq_len: int | None = None) -> float:
    """Forward and backward FLOPs per token of ``model`` (:func:`model_spec`) on sequences
    of ``seq_len`` tokens (default: the spec's own, plait's GPT's ``seq_len``; a Hugging
    Face config's ``max_position_embeddings`` is a limit, not the training length, so
    those need ``seq_len``)."""
    spec = model_spec(model)
    if seq_len is None:
        if spec.hugging_face:
            raise ValueError(
                f"metrics: {spec.name}: pass seq_len= (the tokens per sequence this run "
                f"trains on): attention's FLOPs grow with it"
            )
        seq_len = spec.seq_len
    return float(spec.flops_per_token(seq_len))


def device_peak(device: torch.device, *, local_ranks: int | None = None) -> Peak:
    """The peak FLOP/s of ``device`` for one rank (module doc)."""
    from plait.plan import hardware  # deferred: as above

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key in DEVICES:
            if key in name:
                peak = hardware.preset(key.lower()).peak_flops
                return Peak(peak, f"{name}: the planner's table, dense bf16")
        return Peak(_cuda_matmul(device), f"{name}: a bf16 matmul timed on it")
    local = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = min(float(torch.get_num_threads()), (cores or 1) / max(1, local))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = hardware.matmul_flops()
    finally:
        torch.set_num_threads(threads)
    return Peak(
        one * share,
        f"a float32 matmul timed on one thread ({one / 1e9:.1f} GFLOP/s) x {share:g} of "
        f"{cores} cores ({local} local ranks)",
    )


def _cuda_matmul(device: torch.device, *, size: int = 4096, repeats: int = 5) -> float:
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    a @ b  # warm-up
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize(device)
    return 2.0 * size**3 * repeats / (time.perf_counter() - start)


__all__ = ["DEVICES", "Peak", "device_peak", "flops_per_token", "model_spec"]
