"""One mixed-precision policy for every strategy.

``plait.prepare(model, optimizer, strategy=..., mixed_precision="bf16" | "fp16" |
MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype))`` means the same under
``none``, ``naive``, ``ddp``, ``zero1``/``zero2``, ``zero3``/``fsdp``, ``tp``, ``ep``,
``cp``, ``pipeline`` and ``ptdp``:

- **masters**: parameters and optimizer state stay float32 (the policy is refused on a
  model with other floating parameters, where autocast would silently do nothing);
- **compute**: the model's forward runs under ``torch.autocast(device, param_dtype)``
  (PyTorch's per-op rule: matmuls and convolutions in the 16-bit type, its fp32-list ops in
  float32); the loss the user computes outside the forward is not autocast. Under
  ``fsdp``/``zero3`` the units are also gathered in ``param_dtype`` (FSDP2's way: half the
  all-gather bytes), so ops outside autocast's list see 16-bit parameters there;
- **reduction**: gradients reach the parameters in float32 and are reduced in
  ``reduce_dtype``; None (the default) means the masters' dtype, float32. A 16-bit
  ``reduce_dtype`` is honoured by ``ddp`` (its bf16/fp16 compression hook), ``fsdp`` and
  ``zero3`` (the reduce-scatter), and refused by name elsewhere;
- **outputs**: with ``output_dtype``, the forward's floating outputs are cast to it (the
  last pipeline stage's, under ``pipeline`` and ``ptdp``);
- **fp16**: a :class:`~plait.amp.DynamicLossScaler` over every rank (its found-inf flag
  all-reduced on the world, so tp, pp, ep, cp and dp ranks skip the same steps), returned
  by :func:`loss_scaler`; the strategies' own non-finite check is then off unless asked.

How torchtitan and FSDP2 do it: torchtitan's DDP-only and single-device runs use autocast,
its FSDP runs FSDP2's ``MixedPrecisionPolicy`` (parameters cast in the all-gather,
reduce-scatter in ``reduce_dtype``; torchtitan defaults it to float32). plait applies the
one policy here, after the strategy has wrapped the model (:func:`apply`), and each
strategy keeps no precision flag of its own. The class keeps FSDP2's field names; one
difference: ``reduce_dtype=None`` reduces in the masters' dtype, where FSDP2 follows
``param_dtype``.

Communication: none of its own, except :class:`~plait.amp.DynamicLossScaler`'s one scalar
all-reduce (max) per optimizer step under fp16, and ``reduce_dtype`` changing the bytes of
the strategy's gradient reduction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.amp import DynamicLossScaler

FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
COMPUTE = (torch.bfloat16, torch.float16)  # what autocast computes in


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute, gradient reduction and outputs; masters keep their own dtype.

    ``param_dtype``: compute dtype (bf16 or fp16): the forward runs under autocast in it,
    and FSDP units are gathered in it. ``reduce_dtype``: gradients are reduced in it (None:
    the masters' dtype, float32). ``output_dtype``: the forward's floating outputs are cast
    to it (None: as computed). ``buffer_dtype``: floating buffers cast to it once at wrap
    time (FSDP only). None everywhere means full precision.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype", "buffer_dtype"):
            dtype = getattr(self, field)
            if dtype is not None and dtype not in FLOATING:
                allowed = ", ".join(str(d) for d in FLOATING)
                raise ValueError(
                    f"MixedPrecisionPolicy: {field}={dtype} is not a floating dtype; use one "
                    f"of {allowed} or None"
                )

    @property
    def computes_low(self) -> bool:
        """Whether the forward computes in a 16-bit type."""
        return self.param_dtype in COMPUTE

    @property
    def is_full(self) -> bool:
        """Nothing to do: every field None or float32."""
        fields = (self.param_dtype, self.reduce_dtype, self.output_dtype, self.buffer_dtype)
        return all(d in (None, torch.float32) for d in fields)


MIXED_PRECISION_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def resolve_mixed_precision(value: object) -> MixedPrecisionPolicy:
    """A :class:`MixedPrecisionPolicy` from ``value``: a policy, None (full precision),
    ``"bf16"``/``"fp16"`` (compute in it, reduce in float32) or ``"fp32"``. An object with
    ``param_dtype`` and ``reduce_dtype`` attributes (PyTorch's own policy) is read by its
    fields."""
    if value is None:
        return MixedPrecisionPolicy()
    if isinstance(value, MixedPrecisionPolicy):
        return value
    if isinstance(value, str):
        if value not in MIXED_PRECISION_NAMES:
            raise ValueError(
                f"mixed precision {value!r} is not known; use one of "
                f"{sorted(MIXED_PRECISION_NAMES)} or a MixedPrecisionPolicy"
            )
        return MixedPrecisionPolicy(param_dtype=MIXED_PRECISION_NAMES[value])
    if hasattr(value, "param_dtype") and hasattr(value, "reduce_dtype"):
        if getattr(value, "cast_forward_inputs", True) is False:
            raise ValueError(
                f"mixed precision {value!r}: cast_forward_inputs=False is not supported "
                f"(floating inputs of each FSDP unit are always cast to param_dtype)"
            )
        return MixedPrecisionPolicy(
            param_dtype=value.param_dtype,
            reduce_dtype=value.reduce_dtype,
            output_dtype=getattr(value, "output_dtype", None),
        )
    raise TypeError(
        f"mixed precision must be a MixedPrecisionPolicy, 'bf16', 'fp16', 'fp32' or None; "
        f"got {value!r}"
    )


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating tensor in it (through tuples, lists and dicts) cast
    to ``dtype``; other values as they are."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(cast_floating(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        out = dict(value) if type(value) is dict else value.__class__(value)  # ModelOutput
        for key in list(out.keys()):
            out[key] = cast_floating(out[key], dtype)
        return out
    return value


# --- the forward under the policy -------------------------------------------------------------
@dataclass(frozen=True)
class _Autocast:
    """What a mixed-precision module's forward does: autocast on ``device_type`` in
    ``dtype`` (None: off), then its outputs cast to ``output_dtype`` (None: as computed)."""

    device_type: str
    dtype: torch.dtype | None
    output_dtype: torch.dtype | None

    def run(self, forward: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        if self.dtype is not None and torch.amp.is_autocast_available(self.device_type):
            with torch.autocast(self.device_type, dtype=self.dtype):
                out = forward(*args, **kwargs)
        else:  # full precision, or a device autocast does not know (meta: nothing computed)
            out = forward(*args, **kwargs)
        return out if self.output_dtype is None else cast_floating(out, self.output_dtype)


_CLASSES: dict[type, type] = {}


def _mixed_class(cls: type[nn.Module]) -> type[nn.Module]:
    """A subclass of ``cls`` whose forward runs under the instance's ``_plait_autocast``
    (FSDP2's way of changing a module's behaviour: a class swap, so a deep copy keeps it)."""
    if cls in _CLASSES:
        return _CLASSES[cls]

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        how: _Autocast = self._plait_autocast  # type: ignore[assignment]
        return how.run(super(mixed, self).forward, args, kwargs)  # type: ignore[arg-type]

    mixed = type(f"MixedPrecision{cls.__name__}", (cls,), {"forward": forward})
    mixed.__module__ = cls.__module__
    mixed.__qualname__ = f"MixedPrecision{cls.__qualname__}"
    _CLASSES[cls] = mixed
    _CLASSES[mixed] = mixed
    return mixed


def autocast_forward(
    module: nn.Module, policy: MixedPrecisionPolicy, *, outputs: bool = True
) -> nn.Module:
    """Run ``module``'s forward under ``policy`` from now on (in place; returned):
    autocast in ``param_dtype`` on its parameters' device type, and (``outputs``) its
    floating outputs cast to ``output_dtype``. On a device without autocast (``meta``:
    nothing is computed) the forward runs as it is."""
    if hasattr(module, "_plait_autocast"):
        raise ValueError(
            f"mixed precision: {type(module).__name__} already runs under a mixed-precision "
            f"policy; apply one policy once (plait.prepare(..., mixed_precision=...))"
        )
    first = next(module.parameters(), None)
    device_type = first.device.type if first is not None else "cpu"
    dtype = policy.param_dtype if policy.computes_low else None
    how = _Autocast(device_type, dtype, policy.output_dtype if outputs else None)
    object.__setattr__(module, "_plait_autocast", how)
    module.__class__ = _mixed_class(type(module))
    return module


def policy_of(module: Any) -> _Autocast | None:
    """How ``module``'s forward runs under a policy (None: it runs as it is)."""
    return getattr(module, "_plait_autocast", None)


# --- one policy for every strategy -----------------------------------------------------------
# strategies whose gradient reduction honours a 16-bit reduce_dtype (and how: see apply)
REDUCE_16 = ("ddp", "fsdp", "zero3", "none")
# strategies that take check_finite= (turned off under fp16 unless the caller set it)
_CHECK_FINITE = ("naive", "ddp", "tp", "ep", "cp", "pipeline", "ptdp")
# strategies whose step scales the loss itself (the scaler passed in as scaler=)
_SCALES_IN_STEP = ("pipeline", "ptdp")
_REFUSED = {
    "ps": "the parameter server's workers push float32 gradients and its servers step; "
    "train it in full precision",
}


def check(strategy: str, policy: MixedPrecisionPolicy, model: Any) -> None:
    """Refuse by name what ``strategy`` cannot honour of ``policy`` for ``model``, before
    anything is wrapped."""
    who = f"plait.prepare(strategy={strategy!r}, mixed_precision=...)"
    if strategy in _REFUSED:
        raise ValueError(f"{who} is refused: {_REFUSED[strategy]}")
    if policy.param_dtype not in (None, torch.float32, *COMPUTE) and strategy not in (
        "fsdp",
        "zero3",
    ):
        raise ValueError(
            f"{who}: param_dtype={policy.param_dtype} is not a compute dtype autocast "
            f"knows; use torch.bfloat16 or torch.float16"
        )
    reduce = policy.reduce_dtype
    if reduce not in (None, torch.float32) and strategy not in REDUCE_16:
        raise ValueError(
            f"{who}: reduce_dtype={reduce} is not honoured by strategy {strategy!r}, "
            f"whose gradients are reduced in float32; leave reduce_dtype None (float32), "
            f"or use one of {list(REDUCE_16[:3])}"
        )
    if strategy == "ddp" and reduce not in (None, torch.float32, *COMPUTE):
        raise ValueError(f"{who}: reduce_dtype={reduce}; use float32, bf16 or fp16")
    if policy.buffer_dtype is not None and strategy not in ("fsdp", "zero3"):
        raise ValueError(
            f"{who}: buffer_dtype is honoured by fsdp and zero3 only; under autocast "
            f"buffers stay float32. Leave buffer_dtype None"
        )
    if not policy.computes_low or strategy in ("fsdp", "zero3") or not isinstance(model, nn.Module):
        return
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            raise ValueError(
                f"{who}: parameter {name!r} is {p.dtype}; the policy keeps float32 masters "
                f"and autocast casts float32 only. Build the model in float32 (model.float())"
            )


def options_for(strategy: str, policy: MixedPrecisionPolicy, options: dict[str, Any]) -> None:
    """The strategy options the policy sets (in place), before the strategy wraps: FSDP's
    units gather in ``param_dtype`` and reduce in ``reduce_dtype``; under fp16 the
    strategies' non-finite checks are off (the scaler skips), unless the caller set them,
    and the pipeline's and PTD-P's steps scale their loss with the scaler."""
    if strategy in ("fsdp", "zero3"):
        for key in ("mp_policy", "mixed_precision"):
            if key in options:
                raise TypeError(
                    f"plait.prepare(strategy={strategy!r}): pass the policy once, as "
                    f"mixed_precision= (not {key}= too)"
                )
        options["mixed_precision"] = policy
    if (
        strategy == "cp"
        and options.get("zero") == 3
        and policy.reduce_dtype
        not in (
            None,
            torch.float32,
        )
    ):
        raise ValueError(
            "plait.prepare(strategy='cp', zero=3, mixed_precision=...): reduce_dtype must "
            "be float32 (the cp x dp FSDP gathers and reduces in float32 under the policy)"
        )
    if policy.param_dtype == torch.float16:
        if strategy in _CHECK_FINITE:
            options.setdefault("check_finite", None)
        if strategy in _SCALES_IN_STEP:
            options.setdefault("scaler", DynamicLossScaler())


def apply(
    strategy: str,
    runner: Any,
    optimizer: torch.optim.Optimizer | None,
    policy: MixedPrecisionPolicy,
    options: dict[str, Any],
) -> None:
    """Apply ``policy`` to what ``strategy`` returned (in place): the forward under
    autocast (the runner's, or each pipeline stage's with the last one's outputs cast), a
    16-bit ``reduce_dtype`` in DDP's reduction, the fp16 loss scaler on the optimizer."""
    pipe = _pipeline(runner)
    if pipe is not None:
        last = pipe.runtime.last
        for s, stage in pipe.runtime.stages.items():
            autocast_forward(stage, policy, outputs=s == last)
    elif isinstance(runner, nn.Module):
        autocast_forward(runner, policy)
    if strategy == "ddp" and policy.reduce_dtype in COMPUTE:
        # deferred: plait.strategies (its fsdp policies) imports this module
        from plait.strategies.data_parallel.hooks import (
            bf16_compress_hook,
            fp16_compress_hook,
        )

        hook = bf16_compress_hook if policy.reduce_dtype == torch.bfloat16 else fp16_compress_hook
        runner.register_comm_hook(None, hook)
    if optimizer is not None and policy.param_dtype == torch.float16:
        scaler = options.get("scaler") if strategy in _SCALES_IN_STEP else None
        object.__setattr__(optimizer, "_plait_loss_scaler", scaler or DynamicLossScaler())


def _pipeline(runner: Any) -> Any:
    """The :class:`~plait.strategies.pipeline.PipelineParallel` a runner trains with
    (``pipeline``: itself; ``ptdp``: its ``pipe``), or None: whatever has a ``runtime``
    holding this rank's ``stages`` by index and the ``last`` stage's index."""
    for candidate in (runner, getattr(runner, "pipe", None)):
        runtime = getattr(candidate, "runtime", None)
        if hasattr(runtime, "stages") and hasattr(runtime, "last"):
            return candidate
    return None


def loss_scaler(optimizer: torch.optim.Optimizer) -> DynamicLossScaler:
    """The :class:`~plait.amp.DynamicLossScaler` of an optimizer prepared with
    ``mixed_precision="fp16"``: ``scaler.scale(loss).backward(); scaler.step(optimizer)``
    (under ``pipeline`` and ``ptdp`` their ``step`` scales the loss itself: call
    ``scaler.step(optimizer)`` only).
    Its found-inf flag is all-reduced over every rank, so all skip the same steps."""
    scaler = getattr(optimizer, "_plait_loss_scaler", None)
    if scaler is None:
        raise ValueError(
            f"{type(optimizer).__name__} has no loss scaler: only plait.prepare(..., "
            f"mixed_precision='fp16') (or a policy with param_dtype=torch.float16) makes one"
        )
    return scaler  # type: ignore[no-any-return]
