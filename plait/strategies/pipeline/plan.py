"""The pipeline's model plan: a model as a sequence of layers, what runs around them, its loss.

A pipeline cuts a model between layers, so it needs the model as an ordered list of
:class:`~.split.Layer` (each a function from one activation to the next, with the modules
it owns under their dense names), what every stage must rebuild for itself (rotary
position embeddings, the causal mask: the *context*), and the model's own loss. A model
family writes this once (``pipeline_plan(model)`` in ``plait/models/<family>.py``);
:func:`plait.prepare` looks it up and hands it over as ``plan=``. The strategy never
imports a model.

A plan in a few lines, for a model ``embed -> blocks[i](x, rope) -> norm -> head``::

    from plait.strategies.pipeline import Layer, PipelinePlan

    def pipeline_plan(model):
        layers = [Layer("embed", (("embed", model.embed),), model.embed)]
        for i, block in enumerate(model.blocks):
            layers.append(Layer(f"blocks.{i}", ((f"blocks.{i}", block),),
                                lambda x, ctx, b=block: b(x, ctx), contextual=True))
        layers.append(Layer("head", (("norm", model.norm), ("head", model.head)),
                            lambda x: model.head(model.norm(x))))
        return PipelinePlan(layers=tuple(layers), loss=my_loss,
                            context=lambda x: model.rope(x.shape[1]))

Per-stage state is **recomputed, never sent**: a stage computes ``context(x)`` once per
micro-batch from its input activation ``x`` (its shape, dtype and device; for a language
model the positions ``0..s-1``) before its first contextual layer. Only the activation
crosses between stages, so the bytes per micro-batch stay ``b*s*h``.

Loss reductions:

``"mean"``   ``loss(output, target)`` is a mean over the micro-batch; the pipeline divides
             each by ``m`` and adds them. Equal to the whole batch's mean when every
             micro-batch holds equally many loss items.
``"items"``  ``loss(output, target, num_items=N)`` returns the micro-batch's *sum* divided
             by ``N``, the number of loss items in the whole global batch
             (``items(targets)``, counted once per step before the first forward); the
             pipeline adds them. Equal to one process's mean even when ignored labels
             (``-100``) fall unevenly across micro-batches (Hugging Face's
             ``num_items_in_batch``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.strategies.pipeline.batch_loss import BatchLoss
from plait.strategies.pipeline.split import Layer

REDUCTIONS = ("mean", "items")


@dataclass(frozen=True)
class PipelinePlan:
    """A model as a sequence of pipeline layers (module docstring).

    ``layers``: in forward order; the first takes the model's input (token ids), the last
    returns what ``loss`` reads (logits). ``context``: the per-micro-batch state that layers
    marked ``contextual`` read as their second argument, computed on each stage from its
    input activation (None: no layer needs one). ``context_modules``: modules the context
    uses (a rotary embedding: buffers only), registered under their dense names in every
    stage that computes it, so ``.to(device)`` moves them. ``loss`` / ``reduction`` /
    ``items``: the model's own loss (module docstring). ``batch_loss``: a term added to it
    that reads the whole batch at once (an MoE load-balancing loss;
    :mod:`~plait.strategies.pipeline.batch_loss`). ``name``: the family, for messages.
    """

    layers: tuple[Layer, ...]
    loss: Callable[..., torch.Tensor] | None = None
    reduction: str = "mean"
    items: Callable[[torch.Tensor], torch.Tensor] | None = None
    context: Callable[[torch.Tensor], Any] | None = None
    context_modules: tuple[tuple[str, nn.Module], ...] = ()
    batch_loss: BatchLoss | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"pipeline plan {self.name!r}: no layers")
        if self.reduction not in REDUCTIONS:
            raise ValueError(
                f"pipeline plan {self.name!r}: reduction={self.reduction!r}; use one of "
                f"{REDUCTIONS}"
            )
        if self.reduction == "items" and self.items is None:
            raise ValueError(
                f"pipeline plan {self.name!r}: reduction='items' needs items= (targets -> "
                f"the number of loss items in the batch)"
            )
        if any(layer.contextual for layer in self.layers) and self.context is None:
            first = next(layer.name for layer in self.layers if layer.contextual)
            raise ValueError(
                f"pipeline plan {self.name!r}: layer {first!r} is contextual but the plan "
                f"has no context= (input activation -> the state it reads)"
            )

    def structure(self) -> str:
        """:func:`fingerprint` of the layers."""
        return fingerprint(self.layers)


def fingerprint(layers: Sequence[Layer]) -> str:
    """A digest of the layers: their names, count, parameter names, shapes and dtypes (the
    same on every rank that built the same model), with the layer count readable."""
    h = hashlib.sha256()
    for layer in layers:
        h.update(layer.name.encode())
        for dotted, module in layer.modules:
            for n, p in module.named_parameters():
                h.update(f"{dotted}.{n}{tuple(p.shape)}{p.dtype}".encode())
    return f"{len(layers)} layers, sha256 {h.hexdigest()[:12]}"


def sequential_plan(model: nn.Sequential) -> PipelinePlan:
    """An ``nn.Sequential``: one layer per child, no context, no loss (pass ``loss_fn``)."""
    return PipelinePlan(
        layers=tuple(
            Layer(name, ((name, child),), child) for name, child in model.named_children()
        ),
        name="Sequential",
    )


def stage_list_plan(stages: Sequence[nn.Module]) -> PipelinePlan:
    """Stages cut by the caller: one layer per module, named ``"0"``, ``"1"``, ..."""
    return PipelinePlan(
        layers=tuple(Layer(str(i), ((str(i), mod),), mod) for i, mod in enumerate(stages)),
        name="stage list",
    )


def refusal(model: nn.Module) -> str:
    """What to write for a model no plan describes."""
    return (
        f"pipeline: no pipeline plan for a {type(model).__name__}: plait cannot tell where "
        f"its layers are, what runs before and after them, and what its loss is. For a "
        f"family plait knows (plait's GPT, Hugging Face Llama/Mistral/Qwen2/Qwen3, GPT-2) "
        f"use plait.prepare(model, opt, strategy='pipeline', ...) or pass "
        f"plan=plait.models.plans.plan_for(model, 'pipeline'); otherwise pass "
        f"plan=PipelinePlan(layers=(Layer('embed', (('embed', model.embed),), model.embed), "
        f"Layer('blocks.0', (('blocks.0', model.blocks[0]),), model.blocks[0]), ..., "
        f"Layer('head', (('head', model.head),), model.head)), loss=my_loss) (see "
        f"plait.strategies.pipeline.plan), give the model a method plait_plan(kind, "
        f"**options) returning it for kind 'pipeline', or pass an nn.Sequential or a list "
        f"of stage modules"
    )
