"""Rank functions for tests/test_demo_check.py: the demos' training with a bug injected."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import plait
from plait.demo import digits, gpt, layouts
from plait.demo.digits import train as digits_train

#: the layout builders gpt.train_rank looks up on plait.demo.layouts when it runs
BUILDERS = ("tensor_parallel", "pipeline", "composed", "experts", "context")


def scale_gradients(model: Any, factor: float) -> None:
    """Multiply every gradient of ``model``'s parameters by ``factor`` as backward makes it:
    a tensor hook runs before the gradient accumulates into ``.grad``, so before any
    average over ranks (plait's DDP starts its buckets in post-accumulate hooks)."""
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(lambda g: g * factor)


@contextmanager
def scaled_builders(rank: int, factor: float) -> Iterator[None]:
    """While open, every GPT-demo layout built on ``rank`` scales its gradients by
    ``factor``; the builders are put back after (a test's pool of ranks is reused)."""
    kept = {name: getattr(layouts, name) for name in BUILDERS}

    def scaled(build: Callable[..., layouts.Trainer]) -> Callable[..., layouts.Trainer]:
        def builder(*args: Any) -> layouts.Trainer:
            trainer = build(*args)
            if plait.world().rank == rank:
                scale_gradients(trainer.model, factor)
            return trainer

        return builder

    try:
        for name, build in kept.items():
            setattr(layouts, name, scaled(build))
        yield
    finally:
        for name, build in kept.items():
            setattr(layouts, name, build)


def gpt_with_scaled_gradient(config: Any, rank: int, factor: float) -> dict[str, Any]:
    """:func:`plait.demo.gpt.train_rank`, with ``rank``'s gradients scaled by ``factor``
    before the average (``factor`` 1: the demo as it is)."""
    with scaled_builders(rank, factor):
        return gpt.train_rank(config)


def digits_with_scaled_gradient(config: Any, rank: int, factor: float) -> dict[str, Any]:
    """:func:`plait.demo.digits.train_rank` as ``--check`` runs it, with ``rank``'s
    gradients scaled by ``factor`` before the average (the CNN is built by
    ``plait.demo.digits.train.build_model``, hooked here)."""
    build = digits_train.build_model

    def model(*args: Any) -> Any:
        m = build(*args)
        if plait.world().rank == rank:
            scale_gradients(m, factor)
        return m

    digits_train.build_model = model  # type: ignore[assignment]
    try:
        return digits.train_rank(config, check=True)
    finally:
        digits_train.build_model = build  # type: ignore[assignment]
