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

Per-micro-batch inputs (a padded batch's ``attention_mask``): a plan that names them in
``inputs=("attention_mask",)`` lets ``step(ids, labels, attention_mask=mask)`` pass them
through; its ``context`` then takes them as keywords, ``context(x, attention_mask=m_j)``,
with ``m_j`` micro-batch ``j``'s rows, on every stage, in every forward of that micro-batch
(the schedule's, a recomputation's before its backward, the shape probe's and a batch
loss's statistics pass). Communication: **none**. Every rank holds the whole global batch
(``step``'s contract), so each stage slices micro-batch ``j``'s rows locally, as the last
stage slices the targets; nothing more crosses between stages. A plan without ``inputs``
(plait's GPT, an ``nn.Sequential``, a list of stages) is called ``context(x)`` as before,
and ``step`` refuses such keywords, naming the plan. A plan with a ``batch_loss`` refuses
an ``attention_mask``: the batch loss's statistics see every position of the batch, masked
or not (other inputs, such as context parallelism's ``position_ids``, pass).

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
from collections.abc import Callable, Mapping, Sequence
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
    stage that computes it, so ``.to(device)`` moves them. ``inputs``: the names of the
    per-micro-batch inputs ``context`` takes as keywords besides ``x`` (module docstring;
    ``("attention_mask",)``). ``loss`` / ``reduction`` /
    ``items``: the model's own loss (module docstring). ``shifts_labels``: ``loss`` shifts
    its labels itself (Hugging Face's causal-LM loss: label ``t + 1`` is position ``t``'s
    target); ``shifted_loss``: then the same loss on labels the caller already shifted (the
    last ``-100``). Context parallelism needs it, since a rank's chunks of the sequence end
    where another rank's begin (:mod:`plait.strategies.compose.context`). ``batch_loss``: a
    term added to it that reads the whole batch at once (an MoE load-balancing loss;
    :mod:`~plait.strategies.pipeline.batch_loss`). ``name``: the family, for messages.
    """

    layers: tuple[Layer, ...]
    loss: Callable[..., torch.Tensor] | None = None
    reduction: str = "mean"
    items: Callable[[torch.Tensor], torch.Tensor] | None = None
    context: Callable[..., Any] | None = None
    context_modules: tuple[tuple[str, nn.Module], ...] = ()
    inputs: tuple[str, ...] = ()
    shifts_labels: bool = False
    shifted_loss: Callable[..., torch.Tensor] | None = None
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

        if self.inputs and self.context is None:
            raise ValueError(
                f"pipeline plan {self.name!r}: inputs={self.inputs} are read by the context, "
                f"but the plan has no context= (input activation, **inputs -> the state the "
                f"contextual layers read)"
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


# --- per-micro-batch inputs (module docstring): checked and cut by every rank, no message
def given(batch_inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The keywords that carry a value (``attention_mask=None`` is no input)."""
    return {k: v for k, v in batch_inputs.items() if v is not None}


def check_rows(batch_inputs: Mapping[str, Any], rows: int, *, where: str) -> None:
    """Each input is a tensor of ``rows`` rows (the batch's), or ``where`` refuses it."""
    for name, value in batch_inputs.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != rows:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"{where}: {name}= is {shape}; pass a tensor with the batch's {rows} rows "
                f"first (the attention mask of input_ids: [batch, seq])"
            )


def per_microbatch(
    plan: PipelinePlan | None,
    batch_inputs: Mapping[str, torch.Tensor | None],
    *,
    rows: int,
    m: int,
    name: str,
) -> list[dict[str, torch.Tensor]] | None:
    """``batch_inputs`` (those not None) cut into ``m`` micro-batches (None without any),
    after checking that the batch's ``rows`` split into ``m`` equal micro-batches, that
    ``plan`` (None: an ``nn.Sequential``; ``name`` for messages) takes them and that each
    has the batch's ``rows``."""
    if rows % m:
        raise ValueError(
            f"pipeline: a batch of {rows} does not split into microbatches={m} equal "
            f"micro-batches; use a batch size that is a multiple of {m}"
        )
    batch_inputs = given(batch_inputs)
    if not batch_inputs:
        return None
    accepted: tuple[str, ...] = () if plan is None else plan.inputs
    unknown = [k for k in batch_inputs if k not in accepted]
    if unknown:
        takes = f"it takes {list(accepted)}" if accepted else "it takes none"
        raise ValueError(
            f"pipeline: {unknown[0]}= given, but the pipeline plan of {name} has no such "
            f"per-micro-batch input ({takes}); pass the batch without it (unpadded token ids), "
            f"or give the plan inputs=({unknown[0]!r},) and a context(x, {unknown[0]}=...) "
            f"that reads it (see plait.strategies.pipeline.plan)"
        )
    spec = None if plan is None else plan.batch_loss
    if spec is not None and "attention_mask" in batch_inputs:
        raise ValueError(
            f"pipeline: attention_mask= with {spec.name}: the pipeline computes "
            f"that batch loss from statistics of every position of the batch, masked or not; "
            f"pass unpadded batches without it, or turn the batch loss off (a Hugging Face "
            f"MoE model: config.output_router_logits=False)"
        )
    check_rows(batch_inputs, rows, where="pipeline")
    pieces = {k: v.chunk(m) for k, v in batch_inputs.items()}
    return [{k: p[j] for k, p in pieces.items()} for j in range(m)]
