"""What :func:`~plait.strategies.tensor.parallelize` refuses up front, by name: attention
heads a tensor-parallel size does not divide (or an ``nn.MultiheadAttention``), dropout
(every rank would draw the same mask), and a module a style would replace although it
computes something else than the ``nn.Linear``/``nn.Embedding`` it subclasses
(:func:`computes_linear` checks a linear's own forward on a random input). Nothing here
communicates."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from plait.strategies.tensor.style import Style


def check_heads(model: nn.Module, styles: dict[str, Style], t: int) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention) and any(
            s.startswith(f"{name}.") for s in styles
        ):
            raise ValueError(
                f"module {name!r} is an nn.MultiheadAttention, which reads its projections' "
                f"weights directly; tensor parallelism needs attention written with separate "
                f"nn.Linear projections (see plait.models.gpt.Attention)"
            )
        heads = getattr(module, "heads", getattr(module, "num_heads", None))
        if isinstance(heads, int) and heads % t and any(s.startswith(f"{name}.") for s in styles):
            raise ValueError(
                f"module {name!r} has {heads} attention heads, not divisible by the "
                f"tensor-parallel size {t}; choose a tensor-parallel size that divides {heads}"
            )


def check_dropout(model: nn.Module) -> None:
    """Refuse dropout: every tensor-parallel rank holds the same RNG state, so dropout on a
    rank's heads or sequence slice would draw the same mask as its peers' (correlated
    across ranks, unlike the dense model's); plait has no per-rank RNG streams yet."""
    for name, module in model.named_modules():
        p = module.p if isinstance(module, nn.modules.dropout._DropoutNd) else None
        for attr in ("dropout", "attention_dropout"):
            rate = getattr(module, attr, None)
            if isinstance(rate, float) and not isinstance(module, nn.MultiheadAttention):
                p = max(p or 0.0, rate)
        if p:
            raise ValueError(
                f"module {name or type(model).__name__!r} has dropout {p}: under tensor "
                f"parallelism every rank would draw the same dropout mask for different heads "
                f"or sequence slices (plait has no per-rank RNG streams yet); set dropout to 0"
            )


def computes_linear(module: nn.Module) -> bool:
    """Whether ``module``, an ``nn.Linear`` (or a subclass with its own forward: Falcon's
    ``FalconLinear``), computes ``x @ weight.T + bias``: checked on a random input of
    ``2 x 3`` rows, not assumed. A module on the ``meta`` device cannot be checked (False)."""
    if not isinstance(module, nn.Linear):
        return False
    if type(module).forward is nn.Linear.forward:
        return True
    weight = module.weight
    if weight.device.type == "meta":
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, module.in_features, generator=g, dtype=torch.float64)
    x = x.to(device=weight.device, dtype=weight.dtype)
    try:
        with torch.no_grad():
            got = module(x)
            want = F.linear(x, weight, module.bias)
    except Exception:  # noqa: BLE001 - a forward that cannot take a plain input is no linear
        return False
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return False
    tol = (
        1e-12 if weight.dtype == torch.float64 else 1e-5 if weight.dtype == torch.float32 else 1e-2
    )
    scale = float(want.abs().max()) or 1.0
    return float((got - want).abs().max()) <= tol * scale


def check_plain(name: str, module: nn.Module, base: type[nn.Module], kind: str) -> None:
    """Refuse ``module`` unless it computes what ``base`` computes: ``base`` itself, a
    subclass that keeps ``base.forward`` (torchtitan's and others' own Linear/Embedding
    classes that only change initialisation), or a linear whose own forward is checked to
    be plain (:func:`computes_linear`)."""
    if not isinstance(module, base):
        raise TypeError(
            f"module {name!r} is a {type(module).__name__}; style {kind!r} applies to "
            f"nn.{base.__name__} (or a subclass of it)"
        )
    if type(module).forward is not base.forward and not (
        base is nn.Linear and computes_linear(module)
    ):
        raise TypeError(
            f"module {name!r} is a {type(module).__name__}, a subclass of nn.{base.__name__} "
            f"with its own forward that computes something else than nn.{base.__name__}'s "
            f"(checked on a random input); style {kind!r} would replace it. Give it the style "
            f"'replicate', or split it yourself"
        )
