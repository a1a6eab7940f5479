"""Rank functions for tests/test_precision.py: every strategy under one mixed-precision
policy (``plait.prepare(..., mixed_precision=...)``) against one process applying the same
policy through ``plait.prepare(strategy="none", mixed_precision=...)``.

Each rank also trains the one-process references itself, so plait and its oracle run the
same kernels with the same thread count: a bitwise comparison then depends on nothing but
the order of the arithmetic.

- ``global``: one process, the whole global batch per step (decision 5's oracle);
- ``chunked``: one process, the same global batch as the ranks (or micro-batches) cut it,
  each part's loss divided by the number of parts, gradients accumulated in float32;
- ``fp32``: the global-batch run without the policy (how far the policy itself moves the
  result).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import plait
from plait import checkpoint
from plait.models import GPT, GPTConfig
from plait.models.gpt import MoEConfig
from plait.precision import MixedPrecisionPolicy, loss_scaler

STEPS, LR = 2, 0.1
FEATURES, HIDDEN, OUT, ROWS = 8, 32, 4, 16  # the MLP; ROWS: the global batch
VOCAB, SEQ, GPT_ROWS = 13, 8, 4
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)

State = dict[str, torch.Tensor]


# --- models and data ----------------------------------------------------------------------
def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, OUT),
    )


def mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, FEATURES, generator=g), torch.randn(ROWS, OUT, generator=g)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def gpt(moe: bool = False) -> GPT:
    torch.manual_seed(0)
    experts = None
    if moe:  # capacity 4.0: nothing dropped, so a split batch routes every token the same
        experts = MoEConfig(
            num_experts=4, top_k=2, capacity_factor=4.0, min_capacity=0, second_expert="all"
        )
    cfg = GPTConfig(
        vocab=VOCAB,
        layers=2,
        heads=4,
        width=16,
        seq_len=SEQ,
        tied=False,  # a head tied across pipeline stages adds its two parts in another order
        dtype=torch.float32,
        moe=experts,
    )
    return GPT(cfg)


def gpt_batch(step: int, rows: int = GPT_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _rows(t: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    per = t.shape[0] // parts
    return t[part * per : (part + 1) * per]


def _state(model: nn.Module) -> State:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Dtypes:
    """The dtypes of every floating module output seen while attached."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: set[str] = set()
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules()]

    def _hook(self, module: nn.Module, args: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            self.seen.add(str(out.dtype).replace("torch.", ""))

    def close(self) -> list[str]:
        for h in self.handles:
            h.remove()
        return sorted(self.seen)


# --- one process: the oracles -------------------------------------------------------------
def one_process(
    make: Callable[[], nn.Module],
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    parts: int = 1,
    policy: MixedPrecisionPolicy | None = BF16,
) -> dict[str, Any]:
    """``plait.prepare(strategy="none", mixed_precision=policy)``, STEPS SGD steps, each on
    the global batch cut into ``parts`` equal row blocks (each block's loss / parts)."""
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = plait.prepare(model, opt, strategy="none", mixed_precision=policy)
    assert opt is not None
    grads: list[dict[str, float]] = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        for part in range(parts):
            (loss(model(_rows(x, part, parts)), _rows(y, part, parts)) / parts).backward()
        grads.append(
            {
                n: float(p.grad.abs().max())
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        )
        opt.step()
    masters = sorted({str(p.dtype) for p in model.parameters()})
    return {"state": _state(model), "grad_max": grads, "masters": masters}


def oracles(
    make: Callable[[], nn.Module],
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    parts: int,
    policy: MixedPrecisionPolicy = BF16,
) -> dict[str, Any]:
    out = {
        "global": one_process(make, batch, loss, policy=policy),
        "fp32": one_process(make, batch, loss, policy=None),
    }
    if parts > 1:
        out["chunked"] = one_process(make, batch, loss, parts=parts, policy=policy)
    return out


# --- data-parallel strategies on the MLP --------------------------------------------------
def data_parallel(strategy: str, policy: MixedPrecisionPolicy = BF16) -> dict[str, Any]:
    """``strategy`` on the world's ranks, each on its row block of the global batch."""
    world = plait.world()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    runner, opt = plait.prepare(model, opt, strategy=strategy, mixed_precision=policy)
    assert opt is not None
    seen = Dtypes(runner)
    for step in range(STEPS):
        x, y = mlp_batch(step)
        opt.zero_grad()
        mse(runner(_rows(x, world.rank, world.size)), _rows(y, world.rank, world.size)).backward()
        opt.step()
    state = checkpoint.full_state_dict(runner)
    masters = sorted({str(p.dtype) for p in opt.param_groups[0]["params"]})
    return {
        "plait": state,
        "dtypes": seen.close(),
        "masters": masters,
        **oracles(mlp, mlp_batch, mse, world.size, policy),
    }


def ddp_reduce_bf16() -> dict[str, Any]:
    """DDP with ``reduce_dtype=torch.bfloat16``: its gradients are averaged in bf16 (a
    compression hook); the oracle rounds each rank's averaged-by-2 gradient to bf16 and
    adds the two in bf16, what a two-rank all-reduce does (one addition per element)."""
    world = plait.world()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    runner, opt = plait.prepare(model, opt, strategy="ddp", mixed_precision=policy)
    assert opt is not None
    ref = mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    ref, ref_opt = plait.prepare(ref, ref_opt, strategy="none", mixed_precision=policy)
    assert ref_opt is not None
    for step in range(STEPS):
        x, y = mlp_batch(step)
        opt.zero_grad()
        mse(runner(_rows(x, world.rank, world.size)), _rows(y, world.rank, world.size)).backward()
        opt.step()
        parts: list[list[torch.Tensor]] = []
        for part in range(world.size):
            ref_opt.zero_grad()
            mse(ref(_rows(x, part, world.size)), _rows(y, part, world.size)).backward()
            parts.append([p.grad.clone() for p in ref.parameters()])
        for i, p in enumerate(ref.parameters()):
            total = torch.zeros_like(p, dtype=torch.bfloat16)
            for grads in parts:
                total = total + (grads[i] / world.size).to(torch.bfloat16)
            p.grad = total.float()
        ref_opt.step()
    return {"plait": checkpoint.full_state_dict(runner), "chunked": {"state": _state(ref)}}


# --- model-parallel strategies on the GPT -------------------------------------------------
def model_parallel(strategy: str) -> dict[str, Any]:
    """``strategy`` on 2 ranks with the bf16 policy (outputs in float32): tp over both,
    ep over both (each its row block), cp over both (each its sequence chunks), pipeline
    and ptdp over pp = 2 (2 micro-batches)."""
    from plait.strategies.context.layout import shard_sequence
    from plait.strategies.tensor import loss_fn

    world = plait.world()
    moe = strategy == "ep"
    model = gpt(moe)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    options: dict[str, Any] = {}
    if strategy in ("tp", "ep", "cp"):
        options["mesh"] = plait.Mesh(**{strategy: world.size})
    else:
        options["mesh"] = plait.Mesh(pp=world.size)
        options["microbatches"] = 2
    if strategy == "ptdp":
        options["mesh"] = plait.Mesh(pp=world.size, dp=1, tp=1)
    runner, opt = plait.prepare(model, opt, strategy=strategy, mixed_precision=BF16, **options)
    assert opt is not None
    mesh = options["mesh"]
    parts = {"tp": 1, "ep": world.size, "cp": 1, "pipeline": 2, "ptdp": 2}[strategy]
    seen = Dtypes(runner if isinstance(runner, nn.Module) else runner.pipe)
    for step in range(STEPS):
        x, y = gpt_batch(step)
        opt.zero_grad()
        if strategy in ("pipeline", "ptdp"):
            runner.step(x, y)
        elif strategy == "tp":
            loss_fn(runner)(runner(x), y).backward()
        elif strategy == "ep":
            b = runner.plait_expert_parallel.batch_rank
            ce(runner(_rows(x, b, world.size)), _rows(y, b, world.size)).backward()
        else:  # cp: this rank's chunks of every sequence
            ids, _ = shard_sequence(x, mesh)
            targets, _ = shard_sequence(y, mesh)
            ce(runner(ids), targets).backward()
        opt.step()
    return {
        "plait": checkpoint.full_state_dict(runner),
        "dtypes": seen.close(),
        **oracles(lambda: gpt(moe), gpt_batch, ce, parts),
    }


# --- fp16: the loss scaler's skip, agreed by every rank -----------------------------------
FP16 = MixedPrecisionPolicy(param_dtype=torch.float16, output_dtype=torch.float32)


def fp16_skip(strategy: str, bad_rank: int) -> dict[str, Any]:
    """``strategy`` under fp16; on step 0 rank ``bad_rank`` plants an inf in one of its
    gradients: every rank must skip that step (parameters unchanged) and halve the scale;
    step 1 is clean and every rank steps."""
    world = plait.world()
    model = gpt() if strategy in ("tp", "pipeline", "ptdp") else mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    options: dict[str, Any] = {}
    if strategy == "tp":
        options["mesh"] = plait.Mesh(tp=world.size)
    if strategy == "ptdp":
        options.update(mesh=plait.Mesh(pp=world.size, dp=1, tp=1), microbatches=2)
    if strategy == "pipeline":
        options.update(mesh=plait.Mesh(pp=world.size), microbatches=2)
    runner, opt = plait.prepare(model, opt, strategy=strategy, mixed_precision=FP16, **options)
    assert opt is not None
    scaler = loss_scaler(opt)
    scaler.scale_value = start = 2.0**8  # fp16's range holds these gradients times 256
    params = [p for g in opt.param_groups for p in g["params"]]
    out: dict[str, Any] = {"stepped": [], "changed": [], "scale": []}
    for step in range(2):
        before = [p.detach().clone() for p in params]
        opt.zero_grad()
        if strategy in ("pipeline", "ptdp"):
            x, y = gpt_batch(step)
            runner.step(x, y)
        elif strategy == "tp":
            from plait.strategies.tensor import loss_fn

            x, y = gpt_batch(step)
            scaler.scale(loss_fn(runner)(runner(x), y)).backward()
        else:
            x, y = mlp_batch(step)
            rows = _rows(x, world.rank, world.size), _rows(y, world.rank, world.size)
            scaler.scale(mse(runner(rows[0]), rows[1])).backward()
        if step == 0 and world.rank == bad_rank:
            grad = next(p.grad for p in params if p.grad is not None)
            grad.view(-1)[0] = float("inf")
        out["stepped"].append(scaler.step(opt))
        out["changed"].append(
            any(not torch.equal(a, b) for a, b in zip(before, params, strict=True))
        )
        out["scale"].append(scaler.scale_value / start)
    out["skipped"] = scaler.skipped_steps
    return out


FP16_SCALE = 2.0**8  # fp16's range holds this GPT's gradients times 256: every step steps


def pipeline_fp16() -> dict[str, Any]:
    """``strategy="pipeline"`` under fp16 on pp = world size (2 micro-batches), its loss
    scaled inside the step, against one process under the same policy that scales each
    micro-batch's loss (divided by 2) by the same scale and steps through its own scaler."""
    world = plait.world()
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    runner, opt = plait.prepare(
        model,
        opt,
        strategy="pipeline",
        mesh=plait.Mesh(pp=world.size),
        microbatches=2,
        mixed_precision=FP16,
    )
    assert opt is not None
    scaler = loss_scaler(opt)
    scaler.scale_value = FP16_SCALE
    seen = Dtypes(runner)
    losses, stepped = [], []
    for step in range(STEPS):
        x, y = gpt_batch(step)
        opt.zero_grad()
        losses.append(float(runner.step(x, y)))
        stepped.append(scaler.step(opt))
    ref = gpt()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    ref, ref_opt = plait.prepare(ref, ref_opt, strategy="none", mixed_precision=FP16)
    assert ref_opt is not None
    ref_scaler = loss_scaler(ref_opt)
    ref_scaler.scale_value = FP16_SCALE
    ref_losses, ref_stepped = [], []
    for step in range(STEPS):
        x, y = gpt_batch(step)
        ref_opt.zero_grad()
        total = 0.0
        for part in range(2):
            loss = ce(ref(_rows(x, part, 2)), _rows(y, part, 2)) / 2
            ref_scaler.scale(loss).backward()
            total += float(loss)
        ref_losses.append(total)
        ref_stepped.append(ref_scaler.step(ref_opt))
    return {
        "plait": checkpoint.full_state_dict(runner),
        "dtypes": seen.close(),
        "losses": losses,
        "stepped": stepped,
        "chunked": {"state": _state(ref), "losses": ref_losses, "stepped": ref_stepped},
        "first": _state(gpt()),
    }


def deep_copy_keeps_policy() -> dict[str, Any]:
    """A deep copy of a prepared module computes under the same policy, on its own weights."""
    model, _ = plait.prepare(mlp(), None, strategy="none", mixed_precision="bf16")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[0].weight.zero_()
    x, _ = mlp_batch(0)
    return {
        "dtype": str(twin(x).dtype),
        "differ": not torch.equal(twin(x), model(x)),
        "class": type(twin).__name__,
    }
