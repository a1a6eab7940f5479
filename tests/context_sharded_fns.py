"""Rank functions for tests/test_context_sharded.py: ``plait.prepare(strategy="cp",
zero=1|2|3)`` against one process on the whole sequences of the global batch (float64),
with the models, data and loss of tests/context_fns.py."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import plait
from plait import comm
from plait.strategies.context import shard_sequence
from tests.context_fns import BATCH, SEQ, STEPS, _ce, _gpt, _llama, _logits, _tokens

VOCAB = 23


def _model(family: str) -> nn.Module:
    return _gpt() if family == "gpt" else _llama()  # type: ignore[no-any-return]


def _named_state(names: list[str], state: dict[int, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """``{"<param>.<key>": tensor}`` from a plain optimizer state dict's ``state``."""
    out = {}
    for i, name in enumerate(names):
        for key, value in state.get(i, {}).items():
            out[f"{name}.{key}"] = torch.as_tensor(value).detach().clone()
    return out


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":  # the step is linear in the gradient: its scale shows in the parameters
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def oracle(family: str, dp: int, kind: str = "adam") -> dict[str, Any]:
    """One process on the whole sequences of the global batch (dp slices of BATCH rows):
    losses, parameters and Adam's state after STEPS steps (tests/context_fns.py's
    ``model_oracle`` with the optimizer state kept)."""
    model = _model(family)
    opt = _optimizer(model, kind)
    losses = []
    for step in range(STEPS):
        ids, targets = _tokens(step, VOCAB, BATCH * dp)
        pos = None if family == "gpt" else torch.arange(SEQ).unsqueeze(0)
        opt.zero_grad()
        loss = _ce(_logits(model, ids, pos), targets)
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
    names = [n for n, _ in model.named_parameters()]
    return {
        "losses": losses,
        "params": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": _named_state(names, opt.state_dict()["state"]),
        "numel": sum(p.numel() for p in model.parameters()),
    }


def _mesh(cp: int, dp: int, tp: int) -> plait.Mesh:
    shape = {"tp": tp, "cp": cp, "dp": dp}
    return plait.Mesh(**{k: v for k, v in shape.items() if v > 1 or k == "cp"})


def sharded(
    family: str,
    context: str,
    cp: int,
    dp: int,
    zero: int,
    tp: int = 1,
    kind: str = "adam",
    sequence_parallel: bool = False,
) -> dict[str, Any]:
    """plait.prepare(strategy='cp', zero=zero) on Mesh([tp=tp,] cp=cp[, dp=dp]): STEPS Adam
    steps, each rank on its dp slice of the batch and its chunks of the sequence; the whole
    parameters and optimizer state gathered at the end."""
    from plait import checkpoint
    from plait.strategies import fsdp
    from plait.strategies.tensor import loss_fn

    mesh = _mesh(cp, dp, tp)
    model = _model(family)
    opt = _optimizer(model, kind)
    extra = {"sequence_parallel": True} if sequence_parallel else {}
    runner, opt = plait.prepare(
        model, opt, strategy="cp", mesh=mesh, context=context, zero=zero, **extra
    )
    assert opt is not None
    held = sum(p.numel() for p in model.parameters())  # FSDP: this rank's flat shards
    loss_of = loss_fn(model) if tp > 1 else _ce
    d = mesh.rank("dp") if dp > 1 else 0
    losses = []
    for step in range(STEPS):
        ids, targets = _tokens(step, VOCAB, BATCH * dp)
        rows = slice(d * BATCH, (d + 1) * BATCH)
        ids, pos = shard_sequence(ids[rows], mesh)
        targets, _ = shard_sequence(targets[rows], mesh)
        opt.zero_grad()
        loss = loss_of(_logits(runner, ids, None if family == "gpt" else pos), targets)
        loss.backward()
        mean = loss.detach().clone()
        comm.all_reduce(mean, "avg")  # tp ranks agree: the mean over all ranks' tokens
        losses.append(float(mean))
        opt.step()
    if tp > 1:
        params = checkpoint.full_state_dict(model)
        optim: dict[str, torch.Tensor] = {}  # tp-sharded: the parameters compare
    elif zero == 3:
        params = fsdp.full_state_dict(model)
        names = [n for group in fsdp.full_optimizer_param_names(model, opt) for n in group]
        optim = _named_state(names, fsdp.full_optimizer_state_dict(model, opt)["state"])
    else:
        params = model.state_dict()
        names = [n for n, _ in model.named_parameters()]
        optim = _named_state(names, opt.state_dict()["state"])
    return {
        "losses": losses,
        "params": {k: v.detach().clone() for k, v in params.items()},
        "optim": optim,
        "held": held,
        "units": sum(1 for p in model.parameters() if p.numel()),
        "n": mesh.size("cp") * (mesh.size("dp") if dp > 1 else 1),
    }


def refusals() -> dict[str, str]:
    """Each bad setting's error text (every case raises before any rank trains)."""
    world = plait.world().size
    out: dict[str, str] = {}

    def catch(name: str, **options: Any) -> None:
        model = _gpt()
        opt = options.pop("opt", torch.optim.SGD(model.parameters(), lr=0.1))
        mesh = options.pop("mesh", plait.Mesh(cp=world))
        try:
            plait.prepare(model, opt, strategy="cp", mesh=mesh, **options)
        except ValueError as exc:
            out[name] = str(exc)
        else:
            out[name] = "NOT REFUSED"

    catch("zero4", zero=4)
    catch("zero_bool", zero=True)
    catch("skip", zero=1, check_finite="skip")
    catch("sequence_parallel", mesh=plait.Mesh(tp=2, cp=world // 2), sequence_parallel=True, zero=3)
    catch("wrap", zero=1, wrap={nn.Linear})
    catch("no_optimizer", zero=2, opt=None)
    return out


def nonfinite(zero: int) -> str:
    """A NaN in one rank's loss under zero: every rank raises at the step, naming the ranks
    whose gradient shards hold it."""
    mesh = plait.Mesh(cp=plait.world().size)
    model = _gpt()
    runner, opt = plait.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="cp", mesh=mesh, zero=zero
    )
    assert opt is not None
    ids, targets = _tokens(0, VOCAB)
    ids, _ = shard_sequence(ids, mesh)
    targets, _ = shard_sequence(targets, mesh)
    loss = _ce(runner(ids), targets)
    if mesh.group("cp").rank == 1:
        loss = loss * float("nan")
    loss.backward()
    try:
        opt.step()
    except FloatingPointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "NOT REFUSED"
