"""Context parallelism as a style on a model: its attention kernel swapped, the model not
rewritten.

``context_parallel(model, mesh=Mesh(cp=c[, dp=d]), context="ring"|"ulysses")`` (in place):

- Hugging Face models (a ``config`` with ``_attn_implementation``): a ``plait_ring`` or
  ``plait_ulysses`` function is registered in ``transformers.AttentionInterface`` and the
  config switched to it, so every attention layer calls it with its ``query/key/value``
  (rotary already applied from the ``position_ids`` the caller passes: those
  :func:`~plait.strategies.context.shard_sequence` returns; refused when missing). The
  mask interface has no entry for it, so Hugging Face builds no mask: causality is the
  kernel's, on global positions; a padding mask is refused;
- any other model: every module whose ``forward`` calls
  ``torch.nn.functional.scaled_dot_product_attention`` (plait's GPT's ``Attention``) runs
  under a ``TorchFunctionMode`` that routes that call to the kernel (``is_causal`` and
  ``scale`` kept; an explicit mask or dropout refused). Positions: ``positions=`` names the
  module that embeds position ids (plait's GPT: ``"pos"``); its input is replaced by this
  rank's global position ids. Or it names a buffer indexed by position (torchtitan's
  rotary table ``"freqs_cis"``), which holds only this rank's rows around each forward.
  ``plait.prepare`` fills it in from the model's ``"context"`` plan
  (:func:`plait.models.plans.plan_for`). A model without positions says
  ``positions=False``.

Each rank feeds its ``S / c`` tokens (``shard_sequence``); the loss is the mean over the
rank's tokens. :func:`~plait.strategies.context.recipe.prepare_cp` adds gradient averaging
over the ``cp x dp`` ranks (an all-reduce, or ZeRO / FSDP sharding over them with
``zero=``): every parameter's gradient, summed over the cp ranks, is the gradient of the
sum of their local mean losses; averaging over ``c * d`` ranks gives the gradient of the
global mean loss, as one process on the whole sequence. The attention kernel's own
messages run on the ``cp`` group (ring: point-to-point; Ulysses: all-to-all; see those
modules).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from plait.comm.group import Group
from plait.extras import require
from plait.renames import accepts_model
from plait.strategies.context.layout import WHO, cp_group, positions
from plait.strategies.context.ring_attention import ring_attention
from plait.strategies.context.ulysses import ulysses_attention

KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "ring": ring_attention,
    "ulysses": ulysses_attention,
}


@dataclass(frozen=True)
class ContextParallelInfo:
    """What :func:`context_parallel` set up (``model.plait_context_parallel``)."""

    group: Group
    context: str
    balanced: bool
    attention: tuple[str, ...]  # the modules whose kernel was swapped ("" for Hugging Face)
    positions: str | None

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        kernel = KERNELS[self.context]
        return kernel(q, k, v, group=self.group, causal=causal, balanced=self.balanced, scale=scale)


class _SDPARouter(TorchFunctionMode):
    """Routes ``scaled_dot_product_attention`` calls inside one module's forward to the
    context-parallel kernel; every other function runs as it is."""

    def __init__(self, info: ContextParallelInfo, where: str) -> None:
        super().__init__()
        self.info, self.where = info, where

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"]
        bound = dict(zip(names, args, strict=False)) | kwargs
        if bound.get("attn_mask") is not None:
            raise ValueError(
                f"{WHO}: {self.where} calls scaled_dot_product_attention with an explicit "
                f"attn_mask; the {self.info.context} kernel supports causal or no mask only"
            )
        if bound.get("dropout_p", 0.0):
            raise ValueError(
                f"{WHO}: {self.where} uses attention dropout {bound['dropout_p']}; the "
                f"{self.info.context} kernel has none: set the model's dropout to 0"
            )
        return self.info.attend(
            bound["query"],
            bound["key"],
            bound["value"],
            causal=bool(bound.get("is_causal", False)),
            scale=bound.get("scale"),
        )


def _calls_sdpa(module: nn.Module) -> bool:
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return "scaled_dot_product_attention" in source


def _routed(forward: Callable[..., Any], router: _SDPARouter, *args: Any, **kwargs: Any) -> Any:
    with router:
        return forward(*args, **kwargs)


# id(config) of each Hugging Face model under context parallelism -> its setting (the
# registered attention function is one per kernel; a layer finds its model by its config)
_HF_MODELS: dict[int, ContextParallelInfo] = {}


def _hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered with Hugging Face: ``[b, h, s, d]`` in,
    ``([b, s, h, d], None)`` out (their convention)."""
    info = _HF_MODELS.get(id(module.config))
    if info is None:
        raise ValueError(
            f"{WHO}: {type(module).__name__} calls the plait context-parallel attention but its "
            f"model was not prepared with context_parallel"
        )
    if attention_mask is not None:
        raise ValueError(
            f"{WHO}: {type(module).__name__} got an attention mask; the {info.context} kernel "
            f"is causal on global positions only (no padding mask)"
        )
    if dropout:
        raise ValueError(
            f"{WHO}: attention dropout {dropout} in {type(module).__name__}; the "
            f"{info.context} kernel has none: set attention_dropout=0"
        )
    for option in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(option) is not None:
            raise ValueError(
                f"{WHO}: {type(module).__name__} asks for {option}={kwargs[option]!r}; the "
                f"{info.context} kernel computes plain causal attention only: use a model "
                f"without {option} (or config.{option}=None)"
            )
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    out = info.attend(query, key, value, causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register_hf(context: str) -> str:
    interface = require("transformers", why="context parallelism on a Hugging Face model")
    AttentionInterface = interface.AttentionInterface
    name = f"plait_{context}"
    AttentionInterface.register(name, _hf_attention)
    return name


def _check_hf_call(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
    if kwargs.get("position_ids") is None:
        raise ValueError(
            f"{WHO}: {type(module).__name__} under context parallelism needs position_ids (the "
            f"rank's global positions): pass those shard_sequence returns"
        )
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ValueError(
            f"{WHO}: {type(module).__name__} got labels= without shift_labels=; the model "
            f"would shift them inside this rank's chunks (pairing tokens that are not "
            f"neighbours): pass shift_labels= (this rank's shard of the next-token targets "
            f"from shard_sequence), or compute the loss from the logits"
        )
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(torch.all(mask != 0)):
        raise ValueError(
            f"{WHO}: {type(module).__name__} got a padding attention_mask; context parallelism "
            f"takes whole sequences only (no padding): drop the mask"
        )


def _position_hook(info: ContextParallelInfo, name: str) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        ids = args[0]
        local = ids.shape[-1]
        c = info.group.size
        pos = positions(local * c, c, info.group.rank, balanced=info.balanced)
        limit = getattr(module, "num_embeddings", None)
        if limit is not None and local * c > limit:
            raise ValueError(
                f"{WHO}: the whole sequence (cp={c} x {local} tokens = {local * c}) exceeds "
                f"{name!r}'s {limit} positions; feed fewer tokens per rank"
            )
        return (pos.to(ids.device).expand_as(ids), *args[1:])

    return hook


def _swap_rows(model: nn.Module, info: ContextParallelInfo, name: str) -> None:
    """``positions`` names a buffer indexed by position (torchtitan's rotary table
    ``freqs_cis``, whose first ``s`` rows a model reads for ``s`` tokens): around each
    forward of ``model`` the buffer holds only the rows of this rank's global positions,
    in its order, and is put back after (no copy kept between forwards)."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    held: list[torch.Tensor] = []

    def swap(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if ids is None or ids.dim() < 2:
            raise ValueError(
                f"{WHO}: {type(model).__name__} under cp with positions={name!r}: its forward "
                f"got no [batch, tokens] tensor to read this rank's token count from"
            )
        table: torch.Tensor = owner._buffers[attr]  # type: ignore[assignment]
        local, c = ids.shape[1], info.group.size
        if local * c > table.shape[0]:
            raise ValueError(
                f"{WHO}: the whole sequence (cp={c} x {local} tokens = {local * c}) exceeds "
                f"the {table.shape[0]} rows of {name!r}; feed fewer tokens per rank"
            )
        pos = positions(local * c, c, info.group.rank, balanced=info.balanced)
        held.append(table)
        owner._buffers[attr] = table.index_select(0, pos.to(table.device))

    def restore(*_: Any) -> None:
        if held:
            owner._buffers[attr] = held.pop()

    model.register_forward_pre_hook(swap, with_kwargs=True)
    model.register_forward_hook(restore, always_call=True)


@accepts_model()
def context_parallel(
    module: nn.Module,
    *,
    mesh: Any,
    context: str = "ring",
    balanced: bool = True,
    positions: str | bool | None = None,
) -> nn.Module:
    """Swap ``model``'s attention kernel for context parallelism over ``mesh``'s ``cp``
    group (module docstring). In place; returns ``model``. Local (no communication until
    the forward, where the kernel's messages run on the cp group).

    ``context``: ``"ring"`` or ``"ulysses"``. ``balanced``: the causal load-balanced layout
    (must match :func:`~plait.strategies.context.shard_sequence`'s). ``positions``: the
    module that embeds position ids, or a buffer indexed by position whose rows are
    swapped for the rank's around each forward (torchtitan's ``"freqs_cis"``)
    (non-Hugging-Face models; ``False``: none).
    """
    model = module
    if context not in KERNELS:
        raise ValueError(f"{WHO}: context={context!r}; use one of {sorted(KERNELS)}")
    group = cp_group(mesh)
    tp = mesh.size("tp") if "tp" in getattr(mesh, "names", ()) else 1
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "_attn_implementation"):
        info = ContextParallelInfo(group, context, balanced, ("",), None)
        heads = getattr(config, "num_attention_heads", None)
        if context == "ulysses" and isinstance(heads, int) and (heads // tp) % group.size:
            held = f"{heads} attention heads" + (f" ({heads // tp} per tp rank)" if tp > 1 else "")
            raise ValueError(
                f"{WHO}: {type(model).__name__} has {held}, not divisible by cp={group.size}: "
                f"Ulysses splits heads; use context='ring' or a cp dividing {heads // tp}"
            )
        _HF_MODELS[id(config)] = info
        name = _register_hf(context)
        setter = getattr(model, "set_attn_implementation", None)
        if callable(setter):
            setter(name)
        else:
            config._attn_implementation = name
        model.register_forward_pre_hook(_check_hf_call, with_kwargs=True)
        object.__setattr__(model, "plait_context_parallel", info)
        return model
    found = tuple(name for name, m in model.named_modules() if _calls_sdpa(m))
    if not found:
        raise ValueError(
            f"{WHO}: no module of {type(model).__name__} calls "
            f"torch.nn.functional.scaled_dot_product_attention, so plait cannot find its "
            f"attention to swap; route attention through it (or use a Hugging Face model)"
        )
    if positions is None:
        raise ValueError(
            f"{WHO}: {type(model).__name__}: pass positions='<module embedding position ids>' "
            f"(its input is replaced by this rank's global positions), or positions=False if "
            f"the model embeds no positions"
        )
    modules = dict(model.named_modules())
    buffers = {n for n, _ in model.named_buffers()}
    pos_name = positions if isinstance(positions, str) else None
    if pos_name is not None and pos_name not in modules and pos_name not in buffers:
        raise ValueError(
            f"{WHO}: positions={pos_name!r} is neither a module nor a buffer of "
            f"{type(model).__name__}"
        )
    info = ContextParallelInfo(group, context, balanced, found, pos_name)
    heads = [getattr(modules[n], "heads", None) for n in found]
    for name, h in zip(found, heads, strict=True):
        if context == "ulysses" and isinstance(h, int) and (h // tp) % group.size:
            held = f"{h} attention heads" + (f" ({h // tp} per tp rank)" if tp > 1 else "")
            raise ValueError(
                f"{WHO}: {name!r} has {held}, not divisible by cp={group.size}: "
                f"Ulysses splits heads; use context='ring' or a cp dividing {h // tp}"
            )
    for name in found:
        m = modules[name]
        router = _SDPARouter(info, f"{type(model).__name__}.{name}")
        m.forward = functools.partial(_routed, m.forward, router)  # type: ignore[method-assign]
    if pos_name is not None and pos_name in modules:
        # prepended: it must see the whole local positions before a tensor-parallel
        # sequence region slices them (sequence parallelism)
        modules[pos_name].register_forward_pre_hook(_position_hook(info, pos_name), prepend=True)
    elif pos_name is not None:
        _swap_rows(model, info, pos_name)
    object.__setattr__(model, "plait_context_parallel", info)
    return model
