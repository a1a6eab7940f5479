"""Rank functions for tests/test_hf_moe_layouts.py: the refusals of Hugging Face MoE models
under the model-parallel strategies (the training runs reuse the pipeline, tensor and PTD-P
tests' rank functions with the MoE families)."""

from __future__ import annotations

from typing import Any

import plait
from tests.hf_pipeline_fns import batch, moe, optimizer


def _refusal(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "NOT REFUSED"


def refusals() -> dict[str, str]:
    """Every rank's error for: router jitter with the load-balancing loss under the
    pipeline (at wrap time, and when set after wrapping: the statistics pass and the
    training forward then route differently), the model's own experts over ep with sequence
    parallelism in PTD-P, router jitter under tensor parallelism."""
    n = plait.world().size

    def jitter_pipeline() -> None:
        model = moe("mixtral", False, aux=True)
        for layer in model.model.layers:
            layer.mlp.jitter_noise = 0.01
        plait.prepare(model, strategy="pipeline", mesh=plait.Mesh(pp=n), microbatches=2)

    def jitter_after_wrap() -> None:
        model = moe("mixtral", False, aux=True)
        pipe, _ = plait.prepare(model, strategy="pipeline", mesh=plait.Mesh(pp=n), microbatches=2)
        for layer in model.model.layers:
            layer.mlp.jitter_noise = 0.01
        ids, labels = batch(0, 97)
        pipe.step(ids, labels)

    def ep_in_ptdp() -> None:  # experts over ep with sequence parallelism: not composed
        model = moe("mixtral", False)
        opt = optimizer(list(model.named_parameters()))
        plait.prepare(
            model, opt, strategy="ptdp", mesh=plait.Mesh(pp=1, ep=n, dp=1, tp=1),
            sequence_parallel=True,
        )  # fmt: skip

    def jitter_tp() -> None:
        model = moe("mixtral", False)
        for layer in model.model.layers:
            layer.mlp.jitter_noise = 0.01
        plait.prepare(model, strategy="tp", mesh=plait.Mesh(tp=n))

    return {
        "jitter_pipeline": _refusal(jitter_pipeline),
        "jitter_after_wrap": _refusal(jitter_after_wrap),
        "ep_in_ptdp": _refusal(ep_in_ptdp),
        "jitter_tp": _refusal(jitter_tp),
    }
