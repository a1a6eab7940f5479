"""Zero-bubble split backward: I (input gradient) keeps what W (weight gradient) needs.

``I`` now and ``W`` later together cost what the fused backward (``B``) costs.

While a micro-batch that the schedule backwards as ``I`` + ``W`` runs forward, every
layer plait can split computes its output through a small autograd function that holds
the layer's parameters out of the autograd graph (it returns no gradient for them). ``I``
is then one ordinary ``torch.autograd.backward`` from the stage output: it reaches the
stage input and, at each split layer, computes only the input gradient and keeps what the
weight gradient needs (Zero Bubble, Qi et al. 2024, section 2). ``W`` computes the weight
gradients from what was kept, with no second traversal of the graph and no recomputation:

==============  ===========================================  ================================
layer           ``I`` (per call)                             ``W`` (per call)
==============  ===========================================  ================================
``Linear``      ``dX = dY W`` (one matmul)                    ``dW = dY^T X`` (one matmul over
                                                             the flattened batch dimensions),
                                                             ``db = sum dY``
``LayerNorm``   ``native_layer_norm_backward``, ``dX`` only   the same kernel, ``dw`` and
                                                             ``db`` only (``sum dY x_hat``,
                                                             ``sum dY``)
``RMSNorm``     ``dX`` by its formula from ``x_hat``          ``dw = sum dY x_hat``
``Embedding``   nothing (the indices have no gradient)       ``embedding_dense_backward``
                                                             (an index-add of ``dY``)
==============  ===========================================  ================================

``I`` keeps, per split call, the layer's input (already saved by the forward) and its
output gradient ``dY`` until ``W``: the memory the schedule trades for its smaller bubble.

Everything else keeps its parameters in the graph, so ``I`` computes their gradients as
``B`` would and ``W`` has nothing to do for them (they fall back to the fused backward in
both halves): modules of other types or subclasses that replace ``forward`` (Hugging
Face's ``LlamaRMSNorm``, GPT-2's ``Conv1D``, tensor-parallel layers), custom autograd
functions, a parameter used outside its module's ``forward`` (the second use of a tied
weight), sparse or max-norm embeddings, parameters with gradient hooks (sequence
parallelism's sum over the group, data parallelism's bucketing: W adds into ``.grad``
directly, which would skip them), frozen parameters and autocast regions.
:class:`SplitBackward`'s ``report`` names the modules that fall back and why. A module
called twice contributes twice; a parameter shared by two split modules gets both
contributions; gradients accumulate into ``.grad`` as autograd's do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

aten = torch.ops.aten


class Deferred:
    """One micro-batch's weight-gradient inputs, kept by ``I``; :meth:`apply` is ``W``."""

    def __init__(self) -> None:
        # (rule, module, tensors W needs)
        self.kept: list[tuple[_Rule, nn.Module, tuple[Any, ...]]] = []

    def apply(self) -> None:
        """Compute every kept weight gradient and add it into the parameter's ``.grad``."""
        with torch.no_grad():  # the kept inputs are activations that require grad
            for rule, module, saved in self.kept:
                for param, grad in rule.weight_grads(module, saved):
                    _accumulate(param, grad)
        self.kept = []


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:  # accumulate as autograd does: unrecorded, and a .grad subclass (ZeRO-1's
        # guard over its flat buffer's view) sees no call
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            param.grad.add_(grad)


def _accumulate_mm(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``param.grad += a @ b`` in one ``addmm_`` when there is a gradient already (the
    pass over the weight-sized tensor that autograd's separate add makes is saved)."""
    grad = param.grad
    if grad is None or grad.dtype != a.dtype or grad.shape != (a.shape[0], b.shape[1]):
        _accumulate(param, a.mm(b))
        return
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        grad.addmm_(a, b)


# --- the autograd functions: input gradient in backward, weight-gradient inputs kept ------
class _LinearInput(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        module: nn.Module,
        into: Deferred,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.into = module, into
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        ctx.into.kept.append((LINEAR, ctx.module, (x, dy)))
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        return dx, None, None, None, None


class _LayerNormInput(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        module: nn.LayerNorm,
        into: Deferred,
    ) -> torch.Tensor:
        y, mean, rstd = torch.native_layer_norm(
            x, module.normalized_shape, weight, bias, module.eps
        )
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.module, ctx.into = module, into
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, weight, bias, mean, rstd = ctx.saved_tensors
        ctx.into.kept.append((LAYER_NORM, ctx.module, (x, dy, mean, rstd, weight, bias)))
        dx = None
        if ctx.needs_input_grad[0]:
            shape = ctx.module.normalized_shape
            dx = aten.native_layer_norm_backward(
                dy, x, shape, mean, rstd, weight, bias, [True, False, False]
            )[0]
        return dx, None, None, None, None


class _RMSNormInput(torch.autograd.Function):
    """``y = x_hat w``, ``x_hat = x / sqrt(mean(x^2) + eps)`` over the normalised dimensions,
    computed in float32 at least; keeps ``x_hat`` (for both halves) and ``rstd``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        module: nn.RMSNorm,
        into: Deferred,
    ) -> torch.Tensor:
        dims = tuple(range(-len(module.normalized_shape), 0))
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)
        x_hat = xf * rstd
        y = x_hat * weight if weight is not None else x_hat
        ctx.save_for_backward(x_hat, rstd, weight)
        ctx.module, ctx.into, ctx.dims = module, into, dims
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x_hat, rstd, weight = ctx.saved_tensors
        ctx.into.kept.append((RMS_NORM, ctx.module, (x_hat, dy)))
        dx = None
        if ctx.needs_input_grad[0]:
            g = dy.to(x_hat.dtype)
            if weight is not None:
                g = g * weight
            dx = rstd * (g - x_hat * (g * x_hat).mean(ctx.dims, keepdim=True))
            dx = dx.to(dy.dtype)
        return dx, None, None, None


class _EmbeddingInput(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, ids: torch.Tensor, weight: torch.Tensor, module: nn.Embedding, into: Deferred
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.module, ctx.into = module, into
        return F.embedding(ids, weight, module.padding_idx)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        ctx.into.kept.append((EMBEDDING, ctx.module, (ids, dy)))
        return None, None, None, None


# --- what each layer type splits into -----------------------------------------------------
@dataclass(frozen=True)
class _Rule:
    """How one layer type runs split: ``forward(module, x, into)`` and ``weight_grads``."""

    name: str
    base: type[nn.Module]
    forward: Callable[[Any, torch.Tensor, Deferred], torch.Tensor]
    # the weight gradients of one call: returned as (parameter, gradient) pairs, or added
    # into .grad directly (a linear's dW, in one addmm_)
    weight_grads: Callable[[Any, tuple[Any, ...]], list[tuple[torch.Tensor, torch.Tensor]]]
    refuse: Callable[[Any], str | None] = lambda m: None  # why an instance cannot split


def _linear_grads(m: nn.Linear, saved: tuple[Any, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, dy = saved
    dy2 = dy.reshape(-1, dy.shape[-1])
    _accumulate_mm(m.weight, dy2.t(), x.reshape(-1, x.shape[-1]))  # dW = dY^T X
    return [(m.bias, dy2.sum(0))] if m.bias is not None else []


def _layer_norm_grads(
    m: nn.LayerNorm, saved: tuple[Any, ...]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, dy, mean, rstd, weight, bias = saved
    _, dw, db = aten.native_layer_norm_backward(
        dy,
        x,
        m.normalized_shape,
        mean,
        rstd,
        weight,
        bias,
        [False, weight is not None, bias is not None],
    )
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    if m.weight is not None:
        out.append((m.weight, dw))
    if m.bias is not None:
        out.append((m.bias, db))
    return out


def _rms_norm_grads(
    m: nn.RMSNorm, saved: tuple[Any, ...]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x_hat, dy = saved
    if m.weight is None:
        return []
    rows = x_hat.dim() - len(m.normalized_shape)
    dw = (dy.to(x_hat.dtype) * x_hat).sum(tuple(range(rows))) if rows else dy * x_hat
    return [(m.weight, dw.to(m.weight.dtype))]


def _embedding_grads(
    m: nn.Embedding, saved: tuple[Any, ...]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids, dy = saved
    pad = -1 if m.padding_idx is None else m.padding_idx
    return [(m.weight, aten.embedding_dense_backward(dy, ids, m.num_embeddings, pad, False))]


def _embedding_refusal(m: nn.Embedding) -> str | None:
    if m.sparse:
        return "sparse gradients"
    if m.max_norm is not None:
        return "max_norm renormalises the weight in forward"
    if m.scale_grad_by_freq:
        return "scale_grad_by_freq"
    return None


LINEAR = _Rule(
    "Linear",
    nn.Linear,
    lambda m, x, into: _LinearInput.apply(x, m.weight, m.bias, m, into),
    _linear_grads,
)
LAYER_NORM = _Rule(
    "LayerNorm",
    nn.LayerNorm,
    lambda m, x, into: _LayerNormInput.apply(x, m.weight, m.bias, m, into),
    _layer_norm_grads,
)
RMS_NORM = _Rule(
    "RMSNorm",
    nn.RMSNorm,
    lambda m, x, into: _RMSNormInput.apply(x, m.weight, m, into),
    _rms_norm_grads,
)
EMBEDDING = _Rule(
    "Embedding",
    nn.Embedding,
    lambda m, x, into: _EmbeddingInput.apply(x, m.weight, m, into),
    _embedding_grads,
    _embedding_refusal,
)
RULES = (LINEAR, LAYER_NORM, RMS_NORM, EMBEDDING)


@dataclass(frozen=True)
class SplitReport:
    """Which parameter-holding modules of a stage run split (name, layer type) and which
    fall back to the fused backward in both halves (name, why)."""

    split: tuple[tuple[str, str], ...]
    fused: tuple[tuple[str, str], ...]

    def counts(self) -> dict[str, int]:
        """Split modules per layer type."""
        out: dict[str, int] = {}
        for _, kind in self.split:
            out[kind] = out.get(kind, 0) + 1
        return out

    def describe(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in self.counts().items()) or "nothing"
        text = f"split backward: {kinds}"
        if self.fused:
            text += "; fused in I (weight gradient with the input gradient): " + ", ".join(
                f"{name} ({why})" for name, why in self.fused
            )
        return text


def _rule_for(module: nn.Module) -> tuple[_Rule | None, str]:
    """The rule that splits ``module``, or None and why not."""
    if "forward" in module.__dict__:
        return None, "its forward is replaced on the instance"
    for rule in RULES:
        if isinstance(module, rule.base):
            if type(module).forward is not rule.base.forward:
                return None, f"{type(module).__name__} has its own forward"
            why = rule.refuse(module)
            return (None, why) if why else (rule, "")
    return None, f"{type(module).__name__}: plait has no split rule for it"


def _hooked(param: torch.Tensor) -> bool:
    """Whether autograd runs hooks on ``param``'s gradient (sequence parallelism's sum over
    the group, data parallelism's bucketing): W's direct accumulation would skip them."""
    return bool(param._backward_hooks) or bool(getattr(param, "_post_accumulate_grad_hooks", None))


class SplitBackward:
    """The split backward of one module (a pipeline stage): while :meth:`deferring` is
    active, its splittable layers run through the functions above and keep their
    weight-gradient inputs in the given :class:`Deferred`."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._forwards: list[tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]] = []
        self._into: Deferred | None = None
        for _, m in module.named_modules():
            rule, _ = _rule_for(m)
            if rule is not None and any(True for _ in m.parameters(recurse=False)):
                self._forwards.append((m, self._forward_of(m, rule)))

    @property
    def report(self) -> SplitReport:
        """What splits and what falls back, as the modules are now (a strategy applied
        after the pipeline, as data parallelism's gradient hooks, changes it)."""
        split, fused = [], []
        for name, m in self._module.named_modules():
            params = list(m.parameters(recurse=False))
            if not params:
                continue
            rule, why = _rule_for(m)
            if rule is not None and any(_hooked(p) for p in params):
                rule, why = None, "its parameters have gradient hooks"
            if rule is None:
                fused.append((name, why))
            else:
                split.append((name, rule.name))
        return SplitReport(tuple(split), tuple(fused))

    def _forward_of(self, module: nn.Module, rule: _Rule) -> Callable[[torch.Tensor], torch.Tensor]:
        original = type(module).forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            into = self._into
            params = list(module.parameters(recurse=False))
            if (
                into is None
                or not torch.is_grad_enabled()
                or not all(p.requires_grad and not _hooked(p) for p in params)
                or _autocast_on(x.device)
            ):
                return original(module, x)  # type: ignore[no-any-return]
            return rule.forward(module, x, into)

        return forward

    @contextlib.contextmanager
    def deferring(self, into: Deferred) -> Iterator[None]:
        """Run the split layers' forwards keeping their weight-gradient inputs ``into``;
        the stage's forward (and ``I``, in case the model recomputes part of its forward
        in backward, as activation checkpointing does) runs inside."""
        self._into = into
        for m, fwd in self._forwards:
            object.__setattr__(m, "forward", fwd)  # an instance attribute: no Module bookkeeping
        try:
            yield
        finally:
            for m, _ in self._forwards:
                m.__dict__.pop("forward", None)
            self._into = None


def _autocast_on(device: torch.device) -> bool:
    """Autocast is on for ``device``'s type (a type autocast does not know, such as
    ``meta``, never has it on)."""
    try:
        return torch.is_autocast_enabled(device.type)
    except RuntimeError:
        return False
