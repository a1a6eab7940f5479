"""What tests/test_compile.py runs on the ranks: graph breaks of a compiled, wrapped model,
and a few compiled training steps against the one-process oracle."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import plait
from plait.models import GPT, MLP, GPTConfig
from plait.models.plans import plan_for

PLAIT_DIR = str(Path(plait.__file__).resolve().parent)
GLOBAL_BATCH = 4


def tiny_gpt(dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=32, layers=2, heads=2, width=16, seq_len=8, dtype=dtype))


def tokens(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    t = torch.randint(0, 32, (GLOBAL_BATCH, 9), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def wrapped(strategy: str) -> tuple[nn.Module, tuple[Any, ...]]:
    """The tiny GPT under ``strategy`` on this pool's ranks (for one pipeline stage: this
    rank's stage) and an input for it."""
    n, r = plait.world().size, plait.world().rank
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, _ = tokens()
    mine = x[r * GLOBAL_BATCH // n : (r + 1) * GLOBAL_BATCH // n]
    if strategy in ("ddp", "zero1", "zero2", "fsdp"):
        module, _ = plait.prepare(model, opt, strategy=strategy)
        return module, (mine,)
    if strategy in ("ddp_buffers", "torch_ddp_buffers"):  # DDP broadcasts buffers in forward
        model.register_buffer("running", torch.ones(16))
        if strategy == "torch_ddp_buffers":
            return torch.nn.parallel.DistributedDataParallel(model), (mine,)
        module, _ = plait.prepare(model, opt, strategy="ddp")
        model.running.fill_(r + 1.0)  # rank 0's value must reach every rank in forward
        return module, (mine,)
    if strategy == "torch_ddp":
        return torch.nn.parallel.DistributedDataParallel(model), (mine,)
    if strategy == "torch_fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (n,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, (mine,)
    if strategy == "tp":
        module, _ = plait.prepare(model, opt, strategy="tp", mesh=plait.Mesh(tp=n))
        return module, (x,)
    if strategy == "pipeline_stage":
        pipe = plait.PipelineParallel(
            model,
            group=plait.Mesh(pp=n).group("pp"),
            schedule="1f1b",
            microbatches=2,
            plan=plan_for(model, "pipeline"),
        )
        (stage,) = pipe.stages.values()
        if r == 0:
            return stage, (x,)
        return stage, (torch.randn(GLOBAL_BATCH, 8, 16),)
    raise ValueError(f"unknown strategy {strategy!r}")


def _frames(reason: Any) -> list[str]:
    return [f"{f.filename}:{f.lineno} in {f.name}" for f in reason.user_stack]


def graph_breaks(strategy: str) -> dict[str, Any]:
    """``torch._dynamo.explain`` of the wrapped model's forward: every break, and those
    whose reason or user stack points into plait (plait made them)."""
    import torch._dynamo

    module, args = wrapped(strategy)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        explained = torch._dynamo.explain(module)(*args)
    caught = [str(w.message) for w in record]
    breaks = [{"reason": str(b.reason)[:600], "stack": _frames(b)} for b in explained.break_reasons]
    by_plait = [
        b for b in breaks if "plait" in b["reason"] or any(PLAIT_DIR in f for f in b["stack"])
    ]
    buffers = [float(b.flatten()[0]) for b in module.buffers()]
    return {
        "buffers": buffers,
        "warnings": [m for m in caught if "crc32" in m or PLAIT_DIR in m],
        "graphs": explained.graph_count,
        "breaks": breaks,
        "by_plait": by_plait,
    }


def trains_like_eager(strategy: str, backend: str, when: str = "after", steps: int = 2) -> float:
    """The largest |difference| from the one-process oracle (eager, the whole batch) of the
    parameters after ``steps`` SGD steps, float64, of a small MLP compiled with ``backend``
    ``when`` ("before" or "after") ``strategy`` wraps it."""
    import torch._dynamo

    from plait import checkpoint

    torch._dynamo.reset()  # kept ranks: start from no cached graph (and its recompile limit)
    if backend == "inductor":
        import torch._inductor.config

        torch._inductor.config.compile_threads = 1  # no pool of compile workers on 2 cores
    n, r = plait.world().size, plait.world().rank

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(10 + step)
        x = torch.randn(GLOBAL_BATCH, 8, generator=g, dtype=torch.float64)
        return x, torch.randn(GLOBAL_BATCH, 8, generator=g, dtype=torch.float64)

    oracle = MLP((8, 16, 8), seed=0, dtype=torch.float64)
    opt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(oracle(x), y).backward()
        opt.step()

    model = MLP((8, 16, 8), seed=0, dtype=torch.float64)
    if when == "before":
        model.compile(backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options: dict[str, Any] = {}
    if strategy == "tp":
        options = {"mesh": plait.Mesh(tp=n), "plan": {"layers.0": "colwise", "layers.1": "rowwise"}}
    module, opt2 = plait.prepare(model, opt, strategy=strategy, **options)
    assert opt2 is not None
    run = torch.compile(module, backend=backend) if when == "after" else module
    rows = slice(0, GLOBAL_BATCH) if strategy == "tp" else slice(r * 2, (r + 1) * 2)
    assert strategy == "tp" or n * 2 == GLOBAL_BATCH
    for step in range(steps):
        x, y = data(step)
        opt2.zero_grad()
        torch.nn.functional.mse_loss(run(x[rows]), y[rows]).backward()
        opt2.step()
    mine = checkpoint.full_state_dict(module)
    want = oracle.state_dict()
    return max(float((v.detach() - want[k]).abs().max()) for k, v in mine.items())


def ptdp_compiled_like_eager(dims: dict[str, int], backend: str, steps: int = 2) -> dict[str, Any]:
    """PTD-P (``plait.prepare(strategy="ptdp")``) on the tiny GPT in float64, eager and with
    every stage module of this rank compiled in place (``stage.compile(backend=...)``, as
    torchtitan compiles per block: the result is a runner stepped with ``.step()``, not a
    module). The largest |difference| of the parameters after ``steps`` SGD steps, and
    ``torch._dynamo.explain`` of this rank's first stage (its breaks, those of plait's
    making, Dynamo's warnings about plait's code)."""
    import torch._dynamo

    from plait import checkpoint

    torch._dynamo.reset()
    if backend == "inductor":
        import torch._inductor.config

        torch._inductor.config.compile_threads = 1

    def train(compiled: bool) -> tuple[dict[str, torch.Tensor], Any]:
        model = tiny_gpt(torch.float64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        runner, opt = plait.prepare(
            model, opt, strategy="ptdp", mesh=plait.Mesh(**dims), microbatches=2
        )
        assert opt is not None
        stages = list(runner.pipe.stages.values())
        if compiled:
            for stage in stages:
                stage.compile(backend=backend)
        for step in range(steps):
            x, y = tokens(step)
            opt.zero_grad()
            runner.step(x, y)
            opt.step()
        return checkpoint.full_state_dict(runner), stages[0]

    from torch._dynamo.utils import counters

    eager, _ = train(False)
    counters.clear()
    compiled, stage = train(True)
    traced = int(counters["stats"]["unique_graphs"])  # graphs Dynamo made while training
    diff = max(float((v - eager[k]).abs().max()) for k, v in compiled.items())
    # the explain of one stage forward, on what the stage takes
    x, _ = tokens()
    arg = x[:2] if stage.index == 0 else torch.randn(2, 8, 16, dtype=torch.float64)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        explained = torch._dynamo.explain(stage.forward)(arg)
    breaks = [{"reason": str(b.reason)[:600], "stack": _frames(b)} for b in explained.break_reasons]
    by_plait = [
        b for b in breaks if "plait" in b["reason"] or any(PLAIT_DIR in f for f in b["stack"])
    ]
    return {
        "diff": diff,
        "traced": traced,
        "graphs": explained.graph_count,
        "breaks": breaks,
        "by_plait": by_plait,
        "warnings": [
            str(w.message)
            for w in record
            if "crc32" in str(w.message) or PLAIT_DIR in str(w.message)
        ],
    }
