"""Models, data and rank functions for the data-parallel tests.

The oracle (DESIGN decision 5): the same model, seed and data trained in one process on
the global batch. Ranks train on contiguous, equal shards of each global batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import plait

FEATURES, OUT, GLOBAL_BATCH = 8, 4, 24


class Net(nn.Module):
    """A small MLP with a buffer, and an optional branch the forward never uses."""

    def __init__(self, unused_branch: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 16)
        self.fc2 = nn.Linear(16, OUT)
        self.register_buffer("calls", torch.zeros(1))
        self.extra = nn.Linear(3, 3) if unused_branch else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = float(self.calls.item())  # what the forward started from
        self.calls += 1 + plait.world().rank if plait.is_initialized() else 1
        return self.fc2(torch.tanh(self.fc1(x)))


def make_model(seed: int = 0, unused_branch: bool = False) -> Net:
    torch.manual_seed(seed)
    return Net(unused_branch)


def make_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    raise ValueError(name)


def batch(step: int, n: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, FEATURES, generator=g), torch.randn(n, OUT, generator=g)


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def train_one_process(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """The oracle's loop: one process, the whole global batch at every step."""
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def oracle(steps: int, opt: str, seed: int = 0) -> list[torch.Tensor]:
    """One process, the global batch."""
    model = make_model(seed)
    train_one_process(model, make_optimizer(model, opt), steps)
    return [p.detach().clone() for p in model.parameters()]


def train(
    strategy: str,
    steps: int,
    opt: str,
    options: dict[str, Any] | None = None,
    hook: str | None = None,
    perturb: bool = True,
) -> list[torch.Tensor]:
    """Runs on every rank: train under ``strategy``; return the parameters."""
    world = plait.world()
    model = make_model()
    if perturb:  # replicas start different: wrapping must broadcast rank 0's parameters
        with torch.no_grad():
            for p in model.parameters():
                p.add_(world.rank)
    optimizer = make_optimizer(model, opt)
    wrapped, optimizer = plait.prepare(model, optimizer, strategy=strategy, **(options or {}))
    if hook is not None:
        wrapped.register_comm_hook(None, getattr(plait.strategies, hook))
    assert optimizer is not None
    return run_steps(wrapped, model, optimizer, steps)


def run_steps(
    wrapped: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int
) -> list[torch.Tensor]:
    """The training loop every strategy test shares: this rank's shard of each global batch."""
    world = plait.world()
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        out = wrapped(shard(x, world.rank, world.size))
        nn.functional.mse_loss(out, shard(y, world.rank, world.size)).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def train_torch_ddp(steps: int, opt: str) -> list[torch.Tensor]:
    """Runs on every rank: the same training under torch.nn.parallel.DistributedDataParallel."""
    model = make_model()
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    return run_steps(wrapped, model, make_optimizer(model, opt), steps)


def no_sync_vs_one_batch() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two micro-batches, the first under no_sync, against both in one backward."""
    world = plait.world()
    results = []
    for accumulate in (True, False):
        model = make_model()
        optimizer = make_optimizer(model, "sgd")
        ddp = plait.DistributedDataParallel(model, bucket_mb=0.0005)
        (xa, ya), (xb, yb) = batch(0), batch(1)
        xa, ya, xb, yb = (shard(t, world.rank, world.size) for t in (xa, ya, xb, yb))
        if accumulate:
            with ddp.no_sync():
                nn.functional.mse_loss(ddp(xa), ya).backward()
            nn.functional.mse_loss(ddp(xb), yb).backward()
        else:
            loss = nn.functional.mse_loss(ddp(xa), ya) + nn.functional.mse_loss(ddp(xb), yb)
            loss.backward()
        optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    return results[0], results[1]


def unused_parameter(find_unused: bool) -> str | list[torch.Tensor]:
    world = plait.world()
    model = make_model(unused_branch=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = plait.DistributedDataParallel(model, find_unused_parameters=find_unused)
    for step in range(2):
        x, y = batch(step)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(
            ddp(shard(x, world.rank, world.size)), shard(y, world.rank, world.size)
        )
        try:
            loss.backward()
        except RuntimeError as exc:
            if "find_unused_parameters" not in str(exc):
                raise
            return str(exc)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def buffers_after(broadcast_buffers: bool) -> float:
    """The buffer value the third forward started from."""
    model = make_model()
    ddp = plait.DistributedDataParallel(model, broadcast_buffers=broadcast_buffers)
    for step in range(3):
        ddp(batch(step)[0])
    return model.seen


def train_full(strategy: str, steps: int, opt: str) -> dict[str, torch.Tensor]:
    """Train under a sharding strategy through plait.prepare; the full state dict after."""
    from plait import checkpoint

    model = make_model()
    wrapped, optimizer = plait.prepare(model, make_optimizer(model, opt), strategy=strategy)
    assert optimizer is not None
    run_steps(wrapped, wrapped, optimizer, steps)
    return checkpoint.full_state_dict(wrapped)


# --- PyTorch DDP attributes, unused parameters, non-finite gradients, scalers -------------
def no_grad_sync_attribute(steps: int = 2, micro: int = 2) -> tuple[list[int], list[torch.Tensor]]:
    """nanoGPT's accumulation: ``require_backward_grad_sync = (micro_step == last)``.

    Returns the all-reduce calls issued in each micro-step and the parameters after."""
    from plait import comm

    world = plait.world()
    model = make_model()
    optimizer = make_optimizer(model, "sgd")
    ddp = plait.DistributedDataParallel(model, broadcast_buffers=False)
    calls = []
    for step in range(steps):
        x, y = batch(step, GLOBAL_BATCH * micro)
        optimizer.zero_grad()
        for m in range(micro):
            ddp.require_backward_grad_sync = m == micro - 1
            sl = slice(m * GLOBAL_BATCH, (m + 1) * GLOBAL_BATCH)
            xs, ys = x[sl], y[sl]
            comm.reset_stats()
            loss = nn.functional.mse_loss(
                ddp(shard(xs, world.rank, world.size)), shard(ys, world.rank, world.size)
            )
            (loss / micro).backward()
            calls.append(sum(s.calls for (c, _), s in comm.stats().items() if c == "all_reduce"))
        optimizer.step()
    return calls, [p.detach().clone() for p in model.parameters()]


def accumulation_oracle(steps: int = 2, micro: int = 2) -> list[torch.Tensor]:
    model = make_model()
    optimizer = make_optimizer(model, "sgd")
    for step in range(steps):
        x, y = batch(step, GLOBAL_BATCH * micro)
        optimizer.zero_grad()
        for m in range(micro):
            sl = slice(m * GLOBAL_BATCH, (m + 1) * GLOBAL_BATCH)
            (nn.functional.mse_loss(model(x[sl]), y[sl]) / micro).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


class BranchNet(nn.Module):
    """An MLP whose ``branch`` layer runs only when the forward is told to."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 16)
        self.branch = nn.Linear(16, OUT)
        self.fc2 = nn.Linear(16, OUT)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        out = self.fc2(h)
        return out + self.branch(h) if use_branch else out


# (step, rank) pairs where the branch runs: all ranks, none, rank 0 only, none, rank 1 only
BRANCH_SCHEDULE = {0: (0, 1), 1: (), 2: (0,), 3: (), 4: (1,), 5: (0, 1)}


def unused_vs_torch_ddp(opt: str) -> tuple[list[torch.Tensor], list[torch.Tensor], list[bool]]:
    """The same branchy training under torch's DDP and plait's (find_unused_parameters)."""
    world = plait.world()
    results = []
    grad_none = []
    for side in ("torch", "plait"):
        torch.manual_seed(0)
        model = BranchNet()
        optimizer = make_optimizer(model, opt)
        if side == "torch":
            wrapped: nn.Module = torch.nn.parallel.DistributedDataParallel(
                model, find_unused_parameters=True
            )
        else:
            wrapped = plait.DistributedDataParallel(model, find_unused_parameters=True)
        for step, users in BRANCH_SCHEDULE.items():
            x, y = batch(step)
            optimizer.zero_grad()
            out = wrapped(shard(x, world.rank, world.size), world.rank in users)
            nn.functional.mse_loss(out, shard(y, world.rank, world.size)).backward()
            if step == 1:
                grad_none.append(model.branch.weight.grad is None)
            optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    return results[0], results[1], grad_none


def nonfinite(
    policy: str,
    bad_rank: int,
    options: dict[str, Any] | None = None,
    strategy: str = "ddp",
    flags_on_device: bool = False,
) -> dict[str, Any]:
    """Step 1: rank ``bad_rank`` feeds a NaN; what the wrapper with ``check_finite=policy``
    does. ``flags_on_device``: DDP keeps its per-bucket flags on the device, as it does on
    a device backend (here the CPU: the same code)."""
    import time
    import warnings

    world = plait.world()
    model = make_model()
    optimizer = make_optimizer(model, "adam")
    wrapper = plait.DistributedDataParallel if strategy == "ddp" else plait.NaiveDataParallel
    ddp = wrapper(model, check_finite=policy, **(options or {}))
    if flags_on_device:
        ddp.flags_on_device = True
    out: dict[str, Any] = {"skipped": []}
    for step in range(3):
        x, y = batch(step)
        x = shard(x, world.rank, world.size).clone()
        if step == 1 and world.rank == bad_rank:
            x[0, 0] = float("nan")
        optimizer.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        loss = nn.functional.mse_loss(ddp(x), shard(y, world.rank, world.size))
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss.backward()
        except plait.strategies.NonFiniteGradientError as exc:
            out.update(error=str(exc), culprits=exc.culprits, after_s=time.perf_counter() - t0)
            return out
        if step == 1:
            out["after_s"] = time.perf_counter() - t0  # backward that found the NaN
        optimizer.step()
        after = [p.detach().clone() for p in model.parameters()]
        out["skipped"].append(all(torch.equal(a, b) for a, b in zip(before, after, strict=True)))
        if caught:
            out["warning"] = str(caught[0].message)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["skipped_steps"] = ddp.skipped_steps
    return out


def reordered_model(strategy: str) -> str:
    """Rank 1 registers fc2 before fc1 (same modules, another order): DDP must refuse."""
    world = plait.world()
    torch.manual_seed(0)
    model = nn.Sequential()
    layers = [("fc1", nn.Linear(FEATURES, 16)), ("fc2", nn.Linear(16, OUT))]
    for name, layer in reversed(layers) if world.rank == 1 else layers:
        model.add_module(name, layer)
    wrapper = plait.DistributedDataParallel if strategy == "ddp" else plait.NaiveDataParallel
    try:
        wrapper(model)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def grad_scaler(strategy: str, inf_rank: int | None, steps: int = 4) -> dict[str, Any]:
    """torch.amp.GradScaler (CPU, float32) under DDP or naive; at step 2 rank ``inf_rank``
    feeds an inf. Returns the parameters, the scale after each step."""
    world = plait.world()
    model = make_model()
    optimizer = make_optimizer(model, "sgd")
    if strategy == "ddp":
        wrapped: nn.Module = plait.DistributedDataParallel(
            model, check_finite=None, broadcast_buffers=False
        )
    else:
        wrapped = plait.NaiveDataParallel(model, check_finite=None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    scales = []
    for step in range(steps):
        x, y = batch(step)
        x = shard(x, world.rank, world.size).clone()
        if step == 2 and world.rank == inf_rank:
            x[0, 0] = float("inf")
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(wrapped(x), shard(y, world.rank, world.size))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"params": [p.detach().clone() for p in model.parameters()], "scales": scales}


def grad_scaler_oracle(inf_at: int | None, steps: int = 4) -> dict[str, Any]:
    """One process on the global batch; sample ``inf_at`` of step 2 holds the inf."""
    model = make_model()
    optimizer = make_optimizer(model, "sgd")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    scales = []
    for step in range(steps):
        x, y = batch(step)
        x = x.clone()
        if step == 2 and inf_at is not None:
            x[inf_at, 0] = float("inf")
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"params": [p.detach().clone() for p in model.parameters()], "scales": scales}


def clip_norm(strategy: str, max_norm: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One backward on this rank's shard, then the wrapper's clip_grad_norm_."""
    world = plait.world()
    model = make_model()
    if strategy == "ddp":
        wrapped: Any = plait.DistributedDataParallel(model)
    else:
        wrapped = plait.NaiveDataParallel(model)
    x, y = batch(0)
    nn.functional.mse_loss(
        wrapped(shard(x, world.rank, world.size)), shard(y, world.rank, world.size)
    ).backward()
    norm = wrapped.clip_grad_norm_(max_norm)
    return norm, [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def pytorch_arguments() -> dict[str, str]:
    """device_ids/output_device on a CPU module, process_group=, .module."""
    out = {}
    model = make_model()
    for kwargs in ({"device_ids": [0]}, {"output_device": 0}):
        try:
            plait.DistributedDataParallel(model, **kwargs)  # type: ignore[arg-type]
            out[str(kwargs)] = "accepted"
        except ValueError as exc:
            out[str(kwargs)] = str(exc)
    ddp = plait.DistributedDataParallel(model, process_group=plait.world())
    out["group"] = ddp.group.name
    out["module"] = str(ddp.module is model)
    try:
        plait.DistributedDataParallel(model, process_group=object())  # type: ignore[arg-type]
    except TypeError as exc:
        out["bad group"] = str(exc)
    return out


def one_backward_grads(strategy: str) -> list[torch.Tensor]:
    """Gradients after one backward of this rank's shard under ``strategy``."""
    world = plait.world()
    model = make_model()
    wrapped: nn.Module = (
        plait.DistributedDataParallel(model, broadcast_buffers=False)
        if strategy == "ddp"
        else plait.NaiveDataParallel(model)
    )
    x, y = batch(0)
    nn.functional.mse_loss(
        wrapped(shard(x, world.rank, world.size)), shard(y, world.rank, world.size)
    ).backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def naive_traced() -> list[tuple[str, str, object]]:
    """NaiveDataParallel with a tracer: the spans one backward records."""
    from plait.trace import Tracer

    world = plait.world()
    tracer = Tracer(rank=world.rank)
    model = make_model()
    wrapped = plait.NaiveDataParallel(model, tracer=tracer)
    x, y = batch(0)
    nn.functional.mse_loss(
        wrapped(shard(x, world.rank, world.size)), shard(y, world.rank, world.size)
    ).backward()
    return [(s.name, s.stream, s.args.get("bytes")) for s in tracer.spans()]
