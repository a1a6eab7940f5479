"""Pipeline plans inferred for causal LMs no family knows, where that is safe.

Many Hugging Face decoder families share the Llama layout that
:func:`plait.models.llama.pipeline_plan` reads::

    model.embed_tokens -> model.layers[i](hidden, attention_mask=, position_embeddings=,
    position_ids=) -> model.norm -> lm_head,   model.rotary_emb,   the causal mask from
    create_causal_mask (create_sliding_window_causal_mask) of the model's own module,
    the loss model.loss_function

Others differ in ways the layout does not show: a scaled embedding (Gemma multiplies it by
``sqrt(h)``), multipliers on the residual or the logits (Granite, Cohere), soft-capped
logits (Gemma 2), an auxiliary loss added in the forward. So the plan is *proven* before
it is used: the plan's layers, run one after the other on a small batch in one process,
must give the model's own logits and its own ``labels=`` loss (in evaluation mode, no
gradient; within ``1e-5`` of the largest logit in float32 or float64, ``1e-2`` in 16-bit
types, where the chain runs the same modules on the same inputs and differs only in
rounding; a model that scales anything the plan does not know differs by far more), and
the logits again with ``lm_head``'s weight scaled so that they reach about 50 (a soft cap
is nearly the identity on a random model's small logits), the weight restored bitwise
after. Otherwise the model is refused naming the difference and the plan to write.

Cost: four forwards of a batch of ``2 x 8`` tokens on one process when the plan is asked
for (before any rank communicates), and a copy of ``lm_head``'s weight; no communication.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from plait.models import llama
from plait.models.infer import PlanInferenceError, repeated_blocks
from plait.models.infer_recorded import recorded_plan
from plait.strategies.pipeline import PipelinePlan

LAYOUT = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")

EXAMPLE = """    from plait.strategies.pipeline import Layer, PipelinePlan
    layers = [Layer("embed", (("model.embed", model.model.embed),), model.model.embed)]
    for i, block in enumerate(model.model.blocks):
        layers.append(Layer(f"model.blocks.{i}", ((f"model.blocks.{i}", block),),
                            lambda x, ctx, b=block: b(x, **ctx), contextual=True))
    layers.append(Layer("head", (("model.norm", model.model.norm), ("lm_head", model.lm_head)),
                        lambda x: model.lm_head(model.model.norm(x))))
    plan = PipelinePlan(layers=tuple(layers), loss=my_loss,
                        context=lambda x: {"position_ids": torch.arange(x.shape[1])[None]})"""


def refuse(model: nn.Module, why: str) -> PlanInferenceError:
    """The refusal: why no pipeline plan was inferred, and the plan to write instead."""
    error = PlanInferenceError(
        f"strategy 'pipeline' needs plan= for a {type(model).__name__}: no pipeline plan is "
        f"known for its family and none can be inferred safely: {why}. Write one "
        f"(plait.strategies.pipeline.plan), e.g.\n{EXAMPLE}\nand pass "
        f"plait.prepare(..., strategy='pipeline', plan=plan)"
    )
    error.why = why  # type: ignore[attr-defined]
    return error


def looks_like_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a decoder LM worth trying: a Hugging Face causal LM (a
    ``config``, a ``loss_function`` and an output embedding), or an ``lm_head`` beside a
    ``model`` holding a ``layers`` list (models without either are left to the strategy's
    refusal)."""
    base = getattr(model, "model", None)
    llama = (
        isinstance(getattr(model, "lm_head", None), nn.Module)
        and isinstance(base, nn.Module)
        and isinstance(getattr(base, "layers", None), nn.ModuleList)
    )
    getter = getattr(model, "get_output_embeddings", None)
    try:
        head = getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        head = None
    hf = getattr(model, "config", None) is not None and callable(
        getattr(model, "loss_function", None)
    )
    return llama or (hf and isinstance(head, nn.Module))


def infer_pipeline_plan(model: nn.Module) -> PipelinePlan:
    """The pipeline plan of a causal LM no family knows, proven on a forward (module
    docstring): the Llama-layout plan where the model has that layout and it proves, else
    the plan recorded from the model's own forward (:mod:`plait.models.infer_recorded`);
    or :class:`PlanInferenceError` naming what differs for each."""
    for attr in ("config", "loss_function"):
        if getattr(model, attr, None) is None:
            raise refuse(model, f"it has no {attr} (a Hugging Face causal LM has one)")
    names = {n for n, _ in model.named_modules()}
    reasons = []
    missing = [n for n in LAYOUT if n not in names]
    if not missing:
        try:
            plan = llama.pipeline_plan(model)
            plan = replace(plan, name=f"{type(model).__name__} (inferred: Llama layout)")
            _prove(model, plan)
            return plan  # type: ignore[no-any-return]
        except (AttributeError, ValueError) as exc:
            reasons.append(f"the Llama layout: {getattr(exc, 'why', exc)}")
    try:
        found = repeated_blocks(model)
        if found is None:
            raise refuse(model, "it has no nn.ModuleList of repeated blocks holding linears")
        plan = recorded_plan(model, found[0], refuse, _ids(model))
        _prove(model, plan)
        return plan
    except (AttributeError, ValueError, TypeError) as exc:
        reasons.append(f"recorded from its forward: {getattr(exc, 'why', exc)}")
    raise refuse(model, "; ".join(reasons))


def _ids(model: nn.Module) -> torch.Tensor:
    config: Any = getattr(model, "config")  # noqa: B009
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 2:
        raise refuse(model, "its config has no vocab_size")
    param = next(model.parameters())
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (2, 8), generator=g).to(param.device)


def _chain(plan: PipelinePlan, ids: torch.Tensor) -> torch.Tensor:
    """The plan's layers one after the other, as the stages run them."""
    x: Any = ids
    ctx = None
    for layer in plan.layers:
        if layer.contextual:
            if ctx is None:
                assert plan.context is not None
                ctx = plan.context(x)
            x = layer.run(x, ctx)
        else:
            x = layer.run(x)
    return x  # type: ignore[no-any-return]


def _prove(model: nn.Module, plan: PipelinePlan) -> None:
    getter = getattr(model, "get_output_embeddings", None)
    out = getter() if callable(getter) else getattr(model, "lm_head", None)
    head: Any = getattr(out, "weight", None)
    param = next(model.parameters())
    ids = _ids(model)
    tol = 1e-2 if param.dtype in (torch.float16, torch.bfloat16) else 1e-5
    was = model.training
    model.eval()
    saved = head.detach().clone() if isinstance(head, torch.Tensor) else None
    try:
        with torch.no_grad():
            want, got = _compare(model, plan, ids, tol, loss=True)
            if saved is not None:
                # the logits of a random model are small, where a soft cap is nearly the
                # identity: again with the head scaled to logits of about 50
                head.mul_(50.0 / max(float(want.abs().max()), 1e-6))
                _compare(model, plan, ids, tol, loss=False)
    finally:
        if saved is not None:
            with torch.no_grad():
                head.copy_(saved)
        model.train(was)


def _compare(
    model: nn.Module, plan: PipelinePlan, ids: torch.Tensor, tol: float, *, loss: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logits (and ``labels=`` loss) against the plan's chain; refuses on a
    difference."""
    try:
        out = model(input_ids=ids, labels=ids)
        want = out.logits
        got = _chain(plan, ids)
        assert plan.loss is not None and plan.items is not None
        got_loss = plan.loss(got, ids, num_items=plan.items(ids))
    except Exception as exc:  # the chain fails where the model's own forward does not
        raise refuse(model, f"its layers do not run as the plan calls them ({exc})") from exc
    if got.shape != want.shape:
        raise refuse(
            model,
            f"the plan's layers give logits of shape {tuple(got.shape)}, the model "
            f"{tuple(want.shape)}",
        )
    scale = max(1.0, float(want.abs().max()))
    diff = float((got.float() - want.float()).abs().max())
    if diff > tol * scale:
        raise refuse(
            model,
            f"the plan's layers give other logits than the model's forward (max difference "
            f"{diff:.3g}, largest logit {scale:.3g}): its forward does more than the plan "
            f"shows (a scaled embedding, multipliers, soft-capping)",
        )
    if loss and abs(float(got_loss) - float(out.loss)) > tol * max(1.0, abs(float(out.loss))):
        raise refuse(
            model,
            f"the plan's loss {float(got_loss):.6g} differs from the model's labels= loss "
            f"{float(out.loss):.6g}: its forward adds to the loss (an auxiliary term)",
        )
    return want, got


__all__ = ["infer_pipeline_plan", "looks_like_causal_lm", "refuse"]
