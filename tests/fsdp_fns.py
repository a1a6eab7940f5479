"""Models and rank functions for the fully-sharded tests.

The oracle (DESIGN decision 5): the same model, seed and data trained in one process on
the global batch; ranks train on contiguous, equal shards of each global batch
(``ddp_fns.batch`` and ``ddp_fns.shard``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import plait
from plait.strategies.fsdp import FSDPModule, full_state_dict, fully_shard
from tests.ddp_fns import FEATURES, OUT, batch, make_optimizer, shard, train_one_process

HIDDEN = 16


class Block(nn.Module):
    """A residual block: its Linear and LayerNorm nest one level below the block."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.fc(x)))


class DeepNet(nn.Module):
    """Linear, two Blocks, Linear (820 parameters) and a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, HIDDEN)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(HIDDEN, OUT)
        self.register_buffer("scale", torch.full((1,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.tanh(self.inp(x)))) * self.scale


class Encoder(nn.Module):
    """The features as 4 tokens of 2, two TransformerEncoderLayers, a head on the mean
    token (1032 parameters). Its MultiheadAttention reads ``out_proj.weight`` directly."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, HIDDEN // 2)
        layer = nn.TransformerEncoderLayer(HIDDEN // 2, 2, HIDDEN, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN // 2, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.view(x.shape[0], FEATURES // 2, 2))
        return self.head(self.encoder(tokens).mean(dim=1))


def make_deep(seed: int = 0) -> DeepNet:
    torch.manual_seed(seed)
    return DeepNet()


def make_encoder(seed: int = 0) -> Encoder:
    torch.manual_seed(seed)
    return Encoder()


MODELS = {"deep": make_deep, "encoder": make_encoder}


def num_params() -> int:
    return sum(p.numel() for p in make_deep().parameters())


def oracle(steps: int, opt: str, model_name: str = "deep") -> dict[str, torch.Tensor]:
    """One process, the global batch: the state dict after ``steps`` steps."""
    model = MODELS[model_name]()
    train_one_process(model, make_optimizer(model, opt), steps)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def shard_model(model: nn.Module, options: dict[str, Any]) -> nn.Module:
    """``fully_shard`` with ``options``; ``nested=True`` shards each Block first."""
    options = dict(options)
    if options.pop("nested", False):
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, **options)
    return fully_shard(model, **options)


def _record_weight_dtype(dtypes: list[torch.dtype]) -> Any:
    """A forward pre-hook noting the dtype of the weight the module computes with."""

    def hook(module: nn.Module, args: Any) -> None:
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        dtypes.append(weight.dtype)

    return hook


def train(
    steps: int, opts: list[str], options: dict[str, Any], world: int | None = None
) -> dict[str, Any]:
    """Runs on every rank (or in one process, ``world`` given and plait not initialized):
    train under ``fully_shard(**options)`` once per optimizer; return the full state dicts,
    this rank's parameter elements, and what ``memory_breakdown`` saw mid-step.
    ``options["model"]``: a name in MODELS (default ``"deep"``)."""
    rank, size = (plait.world().rank, plait.world().size) if world is None else (0, world)
    result: dict[str, Any] = {"states": {}}
    options = dict(options)
    make_model = MODELS[options.pop("model", "deep")]
    for opt in opts:
        model = make_model()
        with torch.no_grad():  # replicas start different: sharding broadcasts rank 0's
            for p in model.parameters():
                p.add_(rank)
        sharded = shard_model(model, options)
        assert isinstance(sharded, FSDPModule) and sharded is model
        optimizer = make_optimizer(sharded, opt)
        result["local_numel"] = sum(p.numel() for p in sharded.parameters())
        result["units"] = [(u.numel, u.padded) for u in sharded.sharded_units()]
        dtypes: list[torch.dtype] = []
        model.head.register_forward_pre_hook(_record_weight_dtype(dtypes))
        after_forward = 0
        for step in range(steps):
            x, y = batch(step)
            optimizer.zero_grad()
            out = sharded(shard(x, rank, size))
            after_forward = sum(t.numel() for t in sharded.memory_breakdown()["params"])
            nn.functional.mse_loss(out.float(), shard(y, rank, size)).backward()
            optimizer.step()
        breakdown = sharded.memory_breakdown()
        result["after_forward"] = after_forward
        result["after_step"] = {k: sum(t.numel() for t in v) for k, v in breakdown.items()}
        result["compute_dtype"] = dtypes[-1] if dtypes else None
        result["states"][opt] = full_state_dict(sharded)
    return result


def gather_pattern(options: dict[str, Any]) -> list[tuple[str, bool]]:
    """Runs on every rank: the collectives ``fully_shard`` issues in the third training
    step, in issue order, as (collective, async_op)."""
    from plait import comm

    world = plait.world()
    sharded = shard_model(make_deep(), options)
    optimizer = make_optimizer(sharded, "sgd")
    issued: list[tuple[str, bool]] = []
    originals = comm.all_gather, comm.reduce_scatter

    def recording(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            issued.append((name, bool(kwargs.get("async_op", False))))
            return fn(*args, **kwargs)

        return call

    for step in range(3):
        if step == 2:
            comm.all_gather = recording("all_gather", originals[0])  # type: ignore[assignment]
            comm.reduce_scatter = recording("reduce_scatter", originals[1])  # type: ignore[assignment]
        try:
            x, y = batch(step)
            optimizer.zero_grad()
            out = sharded(shard(x, world.rank, world.size))
            nn.functional.mse_loss(out, shard(y, world.rank, world.size)).backward()
            optimizer.step()
        finally:
            comm.all_gather, comm.reduce_scatter = originals
    return issued


def accumulate_vs_one_batch(options: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    """Runs on every rank: gradients of two half-batches, (a) two backwards accumulating
    into the shard gradients, (b) one backward of the summed losses after two forwards,
    (c) the whole batch at once; then one SGD step each. Full state dicts."""
    world = plait.world()
    x, y = (shard(t, world.rank, world.size) for t in batch(0))
    half = x.shape[0] // 2
    results = []
    for mode in ("two_backwards", "two_forwards", "one_batch"):
        sharded = shard_model(make_deep(), options)
        optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
        parts = [(x[:half], y[:half]), (x[half:], y[half:])]
        if mode == "two_backwards":
            for xs, ys in parts:
                (0.5 * nn.functional.mse_loss(sharded(xs), ys)).backward()
        elif mode == "two_forwards":
            losses = [0.5 * nn.functional.mse_loss(sharded(xs), ys) for xs, ys in parts]
            (losses[0] + losses[1]).backward()
        else:
            nn.functional.mse_loss(sharded(x), y).backward()
        optimizer.step()
        results.append(full_state_dict(sharded))
    return results
