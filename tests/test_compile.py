"""torch.compile over plait's strategies: no graph break of plait's making, and compiled
training equal to the one-process oracle in float64 (tests/compile_ranks.py on 2 ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.comm import traceable
from tests import compile_ranks

# ddp with a buffer (its forward broadcasts it); zero1's forward is the model's own
PLAIT = ("ddp_buffers", "zero1", "fsdp", "tp", "pipeline_stage")
TORCH = {"ddp_buffers": "torch_ddp_buffers", "fsdp": "torch_fsdp2"}


def all_graph_breaks() -> dict[str, dict[str, Any]]:
    return {s: compile_ranks.graph_breaks(s) for s in (*PLAIT, *TORCH.values())}


@pytest.mark.timeout(400)
def test_compiled_forward_has_no_graph_break_of_plaits_making(ranks: Any) -> None:
    """``torch._dynamo.explain`` of each wrapped model (for the pipeline: one rank's stage):
    no break whose reason or stack is in plait, no Dynamo warning about plait's code (it
    warned of ``zlib.crc32`` before), one graph, and no more breaks than PyTorch's DDP and
    FSDP2 on the same model."""
    per_rank = ranks(2, all_graph_breaks, timeout=380)
    for r, results in enumerate(per_rank):
        for strategy in PLAIT:
            got = results[strategy]
            assert got["by_plait"] == [], (r, strategy, got["by_plait"])
            assert got["warnings"] == [], (r, strategy, got["warnings"])
            assert got["graphs"] == 1, (r, strategy, got["breaks"])
        for strategy, theirs in TORCH.items():
            assert len(results[strategy]["breaks"]) <= len(results[theirs]["breaks"])
        # the buffer broadcast still ran, outside the graph: rank 0's value everywhere
        assert results["ddp_buffers"]["buffers"] == [1.0], (r, results["ddp_buffers"])


def compiled_training() -> dict[str, float]:
    cases = [
        ("ddp", "aot_eager", "after"),
        ("zero1", "aot_eager", "after"),
        ("zero2", "aot_eager", "after"),
        ("fsdp", "aot_eager", "after"),
        ("tp", "aot_eager", "after"),
        ("ddp", "aot_eager", "before"),
        ("fsdp", "aot_eager", "before"),
        ("tp", "aot_eager", "before"),
    ]
    return {":".join(c): compile_ranks.trains_like_eager(*c) for c in cases}


@pytest.mark.timeout(300)
def test_compiled_before_or_after_prepare_trains_like_one_process(ranks: Any) -> None:
    """Two SGD steps in float64 of a model compiled (AOT autograd, eager kernels) before or
    after each strategy wraps it: the parameters equal the one-process oracle's to 1e-12
    (the reduction order differs from one process, so not bitwise)."""
    for r, diffs in enumerate(ranks(2, compiled_training, timeout=280)):
        assert max(diffs.values()) <= 1e-12, (r, diffs)


@pytest.mark.timeout(600)
def test_tensor_parallel_compiled_with_inductor_trains_like_one_process(ranks: Any) -> None:
    """CPU inductor, float64, 2 steps: tensor parallelism's collectives are graph nodes
    (plait's custom operators) that inductor schedules around its own kernels. Compiling
    takes 35 s with a warm inductor cache and up to ~160 s cold on 2 loaded cores."""
    diffs = ranks(2, compile_ranks.trains_like_eager, "tp", "inductor", timeout=580)
    assert max(diffs) <= 1e-12, diffs


def ptdp_compiled() -> dict[str, dict[str, Any]]:
    return {
        name: compile_ranks.ptdp_compiled_like_eager(dims, "aot_eager")
        for name, dims in (
            ("pp2", {"pp": 2, "dp": 1, "tp": 1}),
            ("tp2", {"tp": 2, "pp": 1, "dp": 1}),
        )
    }


@pytest.mark.timeout(300)
def test_ptdp_with_compiled_stages_equals_eager(ranks: Any) -> None:
    """PTD-P's result is a runner stepped with ``.step()``, not a module: its stage modules
    are compiled in place (``stage.compile()``, torchtitan's per-block way). Two SGD steps
    in float64 over pp 2 and over tp 2 (tensor-parallel layers' collectives as plait's
    custom operators): bitwise the eager PTD-P (the same kernels in the same order under
    AOT autograd with eager kernels); Dynamo traced the stages while training, and
    ``explain`` of a stage finds one graph, no break and no warning of plait's making."""
    for r, results in enumerate(ranks(2, ptdp_compiled, timeout=280)):
        for name, got in results.items():
            assert got["diff"] == 0.0, (r, name, got["diff"])
            assert got["traced"] >= 1, (r, name, "no graph traced: the stages ran eager")
            assert got["by_plait"] == [] and got["warnings"] == [], (r, name, got)
            assert got["graphs"] == 1 and got["breaks"] == [], (r, name, got["breaks"])


def test_the_operators_shape_rules_match_what_they_return() -> None:
    """The fake (shape-only) implementations the compiler plans with, without processes."""
    x = torch.empty(3, 5, device="meta")
    assert torch.ops.plait.all_reduce(x, "sum", "g#0", "auto").shape == (3, 5)
    assert torch.ops.plait.all_gather(x, 4, "g#0", "auto").shape == (4, 3, 5)
    blocks = torch.empty(4, 3, 5, device="meta")
    assert torch.ops.plait.reduce_scatter(blocks, "sum", "g#0", "auto").shape == (3, 5)
    with pytest.raises(RuntimeError, match="no live plait group has key 'gone#7'"):
        traceable._all_reduce_op(torch.ones(2), "sum", "gone#7", "auto")
