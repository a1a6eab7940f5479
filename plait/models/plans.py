"""Model plans: what a strategy needs to know about a model, looked up by its family.

Strategies know no model (DESIGN decision 7). What tensor, pipeline and expert parallelism,
FSDP and activation checkpointing need from a model (which linears are column- or
row-parallel and which attributes hold head counts, the layer sequence and what runs around
it, the MoE blocks and their router, the units) comes from a *plan* that lives with the
model's family, one file per family under ``plait/models/``. Each family module defines
``<kind>_plan(model, **options)`` for the kinds it supports (``tp``, ``pipeline``, ``moe``,
``fsdp``); each returns the plan type of the strategy that reads it (for example
:class:`plait.strategies.tensor.TensorPlan`).

:func:`plan_for` finds the family by the model's class name (walking its base classes), so
Hugging Face models are recognised without importing ``transformers``. A model can also
carry its own: a method ``plait_plan(kind, **options)`` on the model wins over the
registry, and :func:`register` adds a family for a class name at run time.

A model no family knows gets its 1D tensor-parallel plan inferred where that is safe
(:func:`plait.models.infer.infer_tp_plan`: linear pairs inside attention and MLP blocks,
proven on every kind of block, forward and backward, on simulated ranks in float64) or is
refused naming what to write; a causal LM gets its pipeline plan inferred
(:func:`plait.models.infer_pipeline.infer_pipeline_plan`: the Llama plan where it has that
layout, else a plan recorded from its own forward, proven against the model's own logits
and loss) or is refused the same way; a model holding Hugging Face 5.x stacked experts gets
its MoE plan inferred and proven (:func:`plait.models.infer_moe.infer_moe_plan`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from plait.models.infer import infer_tp_plan, refuse
from plait.models.infer_moe import infer_moe_plan
from plait.models.infer_pipeline import infer_pipeline_plan, looks_like_causal_lm

# class name -> module under plait.models that holds the family's plans
FAMILIES: dict[str, str] = {
    "GPT": "plait.models.gpt",
    "LlamaForCausalLM": "plait.models.llama",
    "LlamaModel": "plait.models.llama",
    "MistralForCausalLM": "plait.models.llama",
    "Qwen2ForCausalLM": "plait.models.llama",
    "Qwen3ForCausalLM": "plait.models.llama",
    "GPT2LMHeadModel": "plait.models.gpt2",
    "GPT2Model": "plait.models.gpt2",
    "Transformer": "plait.models.torchtitan_llama",  # torchtitan's Llama 3 (layout checked)
    "MixtralForCausalLM": "plait.models.mixtral",
    "MixtralModel": "plait.models.mixtral",
    "Qwen2MoeForCausalLM": "plait.models.qwen_moe",
    "Qwen2MoeModel": "plait.models.qwen_moe",
    "Qwen3MoeForCausalLM": "plait.models.qwen_moe",
    "Qwen3MoeModel": "plait.models.qwen_moe",
}

_registered: dict[tuple[str, str], Callable[..., Any]] = {}


def register(class_name: str, kind: str, plan: Callable[..., Any]) -> None:
    """Use ``plan(model, **options)`` as the ``kind`` plan of models of class ``class_name``
    (or a subclass)."""
    _registered[(class_name, kind)] = plan


def family(model: nn.Module) -> str | None:
    """The plait.models module holding the plans of ``model``'s family, or None."""
    for cls in type(model).__mro__:
        if cls.__name__ in FAMILIES:
            return FAMILIES[cls.__name__]
    return None


def plan_for(model: nn.Module, kind: str, **options: Any) -> Any | None:
    """The ``kind`` plan of ``model`` (``"tp"``, ``"pipeline"``, ``"moe"``, ``"fsdp"``,
    ``"context"``: where context parallelism finds the positions), or
    None when neither the model, the run-time registry nor its family module has one.

    For ``"tp"`` (1D, no sequence parallelism) a model no family knows gets the plan
    :func:`~plait.models.infer.infer_tp_plan` infers and proves, or its refusal
    (``PlanInferenceError``, a ``ValueError`` naming the module and the plan to write),
    proven at ``options["tp"]`` ranks when given (``plait.prepare`` passes its mesh's); for
    ``"pipeline"`` a causal LM gets
    :func:`~plait.models.infer_pipeline.infer_pipeline_plan`'s, or its refusal; for
    ``"moe"`` a model with stacked experts :func:`~plait.models.infer_moe.infer_moe_plan`'s
    (None without them)."""
    tp = options.pop("tp", None)  # the size an inferred tp plan is proven at
    own = getattr(model, "plait_plan", None)
    if callable(own):
        return own(kind, **options)
    for cls in type(model).__mro__:
        fn = _registered.get((cls.__name__, kind))
        if fn is not None:
            return fn(model, **options)
    name = family(model)
    if name is None:
        if kind == "pipeline" and looks_like_causal_lm(model):
            return infer_pipeline_plan(model)
        if kind == "moe":
            return infer_moe_plan(model)
        return _inferred(model, tp=tp, **options) if kind == "tp" else None
    fn = getattr(importlib.import_module(name), f"{kind}_plan", None)
    return None if fn is None else fn(model, **options)


def _inferred(model: nn.Module, *, tp: int | None = None, **options: Any) -> Any | None:
    """The inferred 1D plan; other modes stay unknown (None), sequence parallelism is refused."""

    if options.get("mode", "1d") != "1d":
        return None
    if options.get("sequence_parallel"):
        raise refuse(
            model,
            "sequence parallelism is not inferred (which norms run on a slice of the sequence, "
            "and where it is gathered, depends on the forward); mark the 'sequence' and "
            "'scatter' entries in a plan of your own",
        )
    return infer_tp_plan(model, tp=tp)
