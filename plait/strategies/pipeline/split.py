"""Cut a model into pipeline stages: layers, a balanced partition, and stage modules.

:func:`layers_of` lists a model's layers in order: an ``nn.Sequential``'s children, or the
reference GPT's embedding (``tok`` + ``pos``), each block, and the head (``ln_f`` then
``head``). :func:`partition` groups them into contiguous stages, balanced by parameter
count (``by="params"``), by measured forward+backward time (``by="time"``, one
profiling pass on a sample batch), or at given points (``by=[2, 4]``: stages start at
layers 2 and 4). :class:`Stage` holds one group, its parameters under the dense model's
names (``blocks.1.attn.qkv.weight``), so the stages' state dicts together are the dense
model's.

Virtual stages: a schedule with ``v`` chunks per rank asks for ``p * v`` stages; which
rank holds which is the schedule's placement, not the partition's business.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Layer:
    """One unit the partition does not cut: its name, its modules under their dense
    names, and the function from its input to its output."""

    name: str
    modules: tuple[tuple[str, nn.Module], ...]
    run: Callable[[torch.Tensor], torch.Tensor]

    def numel(self) -> int:
        seen: set[int] = set()
        n = 0
        for _, m in self.modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    n += p.numel()
        return n


class _GPTEmbed:
    """Token plus position embedding of the reference GPT (dropout is off in the oracle)."""

    def __init__(self, model: Any) -> None:
        self.tok, self.pos, self.drop = model.tok, model.pos, model.drop

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return self.drop(self.tok(ids) + self.pos(positions))


class _GPTHead:
    def __init__(self, model: Any) -> None:
        self.ln_f, self.head = model.ln_f, model.head

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def layers_of(model: nn.Module) -> list[Layer]:
    """The layers of an ``nn.Sequential`` or of :class:`plait.models.GPT`, in order."""
    from plait.models.gpt import GPT

    if isinstance(model, GPT):
        layers = [Layer("embed", (("tok", model.tok), ("pos", model.pos)), _GPTEmbed(model))]
        for i, block in enumerate(model.blocks):
            layers.append(Layer(f"blocks.{i}", ((f"blocks.{i}", block),), block))
        layers.append(Layer("head", (("ln_f", model.ln_f), ("head", model.head)), _GPTHead(model)))
        return layers
    if isinstance(model, nn.Sequential):
        return [Layer(name, ((name, child),), child) for name, child in model.named_children()]
    raise TypeError(
        f"pipeline: cannot cut a {type(model).__name__} into stages; pass an nn.Sequential "
        f"or a plait.models.GPT (or build the Stage modules yourself)"
    )


@dataclass(frozen=True)
class Partition:
    """Which layers each stage holds, with its share of parameters (and of time)."""

    bounds: tuple[tuple[int, int], ...]  # stage -> [first, last) layer index
    names: tuple[tuple[str, ...], ...]
    params: tuple[int, ...]
    seconds: tuple[float, ...] | None = None
    placement: tuple[int, ...] | None = None

    def __str__(self) -> str:
        total = sum(self.params) or 1
        ttotal = sum(self.seconds) if self.seconds else 0.0
        lines = []
        for s, names in enumerate(self.names):
            where = f" (rank {self.placement[s]})" if self.placement else ""
            line = (
                f"stage {s}{where}: {', '.join(names)} | {self.params[s]:,} params "
                f"({100 * self.params[s] / total:.0f}%)"
            )
            if self.seconds and ttotal:
                line += f", {100 * self.seconds[s] / ttotal:.0f}% of fwd+bwd time"
            lines.append(line)
        return "\n".join(lines)


def _balanced(weights: Sequence[float], k: int) -> list[tuple[int, int]]:
    """Contiguous split of ``weights`` into ``k`` non-empty parts minimising the largest
    part (dynamic programming over split points; ties go to the earliest split)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for c in range(j - 1, i):
                cost = max(best[j - 1][c], prefix[i] - prefix[c])
                if cost < best[j][i]:
                    best[j][i], cut[j][i] = cost, c
    bounds, i = [], n
    for j in range(k, 0, -1):
        c = cut[j][i]
        bounds.append((c, i))
        i = c
    return bounds[::-1]


def layer_seconds(
    layers: Sequence[Layer], sample: torch.Tensor, *, repeats: int = 3
) -> list[float]:
    """Forward + backward seconds of each layer on ``sample`` (median of ``repeats``)."""
    out = []
    x = sample
    for layer in layers:
        times = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            y = layer.run(inp)
            y.float().sum().backward()
            times.append(time.perf_counter() - t0)
        for _, m in layer.modules:
            m.zero_grad(set_to_none=True)
        with torch.no_grad():
            x = layer.run(x)
        out.append(sorted(times)[len(times) // 2])
    return out


def partition(
    layers: Sequence[Layer],
    stages: int,
    *,
    by: str | Sequence[int] = "params",
    sample: torch.Tensor | None = None,
) -> Partition:
    """Group ``layers`` into ``stages`` contiguous stages (see the module docstring)."""
    n = len(layers)
    if stages < 1 or stages > n:
        raise ValueError(
            f"pipeline: {stages} stages from {n} layers; every stage needs at least one "
            f"layer, so use at most {n} stages (ranks x chunks) or a deeper model"
        )
    seconds = None
    if isinstance(by, str):
        if by == "params":
            bounds = _balanced([float(layer.numel()) for layer in layers], stages)
        elif by == "time":
            if sample is None:
                raise ValueError("pipeline: split by='time' needs sample= (one micro-batch)")
            per_layer = layer_seconds(layers, sample)
            bounds = _balanced(per_layer, stages)
            seconds = tuple(sum(per_layer[a:b]) for a, b in bounds)
        else:
            raise ValueError(f"pipeline: by={by!r}; use 'params', 'time' or a list of points")
    else:
        points = list(by)
        if (
            len(points) != stages - 1
            or points != sorted(set(points))
            or (points and (points[0] < 1 or points[-1] > n - 1))
        ):
            raise ValueError(
                f"pipeline: split points {points} must be {stages - 1} increasing layer "
                f"indices in 1..{n - 1} (where stages 1..{stages - 1} start)"
            )
        edges = [0, *points, n]
        bounds = list(zip(edges[:-1], edges[1:], strict=True))
    return Partition(
        tuple(bounds),
        tuple(tuple(layer.name for layer in layers[a:b]) for a, b in bounds),
        tuple(sum(layer.numel() for layer in layers[a:b]) for a, b in bounds),
        seconds,
    )


def split(
    model: nn.Module,
    *,
    stages: int,
    by: str | Sequence[int] = "params",
    sample: torch.Tensor | None = None,
) -> tuple[list[Stage], Partition]:
    """``model`` cut into ``stages`` :class:`Stage` modules and the partition; print the
    partition to see what each stage holds and its share of parameters (and time)."""
    layers = layers_of(model)
    part = partition(layers, stages, by=by, sample=sample)
    return [Stage(layers[a:b], s) for s, (a, b) in enumerate(part.bounds)], part


class Stage(nn.Module):
    """Some consecutive layers, registered under the dense model's module names.

    ``owners`` lists the modules that hold parameters directly (Linear, LayerNorm,
    Embedding, ...): the runtime records their outputs to compute weight gradients
    apart from input gradients (the W of zero-bubble schedules).
    """

    def __init__(self, layers: Sequence[Layer], index: int) -> None:
        super().__init__()
        self.index = index
        self.layer_names = [layer.name for layer in layers]
        self._runs = [layer.run for layer in layers]
        for layer in layers:
            for dotted, module in layer.modules:
                parent: nn.Module = self
                parts = dotted.split(".")
                for part in parts[:-1]:
                    if not hasattr(parent, part):
                        parent.add_module(part, nn.ModuleDict())
                    parent = getattr(parent, part)
                parent.add_module(parts[-1], module)
        self.owners = [m for m in self.modules() if any(True for _ in m.parameters(recurse=False))]
        seen: dict[int, int] = {}
        shared = False
        for m in self.owners:
            for p in m.parameters(recurse=False):
                shared |= id(p) in seen
                seen[id(p)] = 1
        # a parameter used by two modules of one stage (a tied head beside its embedding):
        # its weight gradient cannot be taken module by module, so W runs with I
        self.splittable = not shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for run in self._runs:
            x = run(x)
        return x
