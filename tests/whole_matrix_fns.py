"""Rank functions for the whole-matrix optimizer tests: a float64 MLP whose hidden 2-D
weights take Muon (or Adafactor, or Shampoo) and the rest AdamW, as Muon is used, and
the one-process oracle on the global batch."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import plait
from plait.strategies.fsdp.state import full_optimizer_state_dict, full_state_dict

GLOBAL_BATCH = 8
STEPS = 3
HIDDEN = ("2.weight", "4.weight")  # the hidden matrices (input and output layers take AdamW)


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.Tanh(),
        nn.Linear(16, 12),
        nn.Tanh(),
        nn.Linear(12, 16),
        nn.Tanh(),
        nn.Linear(16, 3),
    ).double()


def make_optimizers(model: nn.Module, kind: str = "muon") -> list[torch.optim.Optimizer]:
    hidden = [p for n, p in model.named_parameters() if n in HIDDEN]
    rest = [p for n, p in model.named_parameters() if n not in HIDDEN]
    if kind == "muon":
        whole: torch.optim.Optimizer = torch.optim.Muon(
            hidden, lr=0.05, momentum=0.9, weight_decay=0.01
        )
    elif kind == "adafactor":
        whole = torch.optim.Adafactor(hidden, lr=0.02, weight_decay=0.01)
    elif kind == "shampoo":
        from pytorch_optimizer import Shampoo  # a user's optimizer: declared whole-matrix

        whole = Shampoo(hidden, lr=0.05, momentum=0.5)
    else:
        raise ValueError(kind)
    return [whole, torch.optim.AdamW(rest, lr=0.01, weight_decay=0.01)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=torch.float64)
    return x, torch.randn(GLOBAL_BATCH, 3, generator=g, dtype=torch.float64)


def _step(
    model: Any,
    optimizers: list[torch.optim.Optimizer],
    x: torch.Tensor,
    y: torch.Tensor,
    clip: Any = None,
) -> None:
    for o in optimizers:
        o.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    if clip is not None:
        clip(model, optimizers)
    for o in optimizers:
        o.step()


CLIP = 0.05  # below every step's gradient norm here: the clip scales each step


def oracle(kind: str = "muon", clip: bool = False) -> dict[str, Any]:
    """One process on the global batch: parameters and each optimizer's state by name
    (``clip``: torch's clip_grad_norm_ to CLIP before each step, its norms in "norms")."""
    model = make_model()
    optimizers = make_optimizers(model, kind)
    norms: list[float] = []

    def clipped(m: nn.Module, _: Any) -> None:
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)))

    for step in range(STEPS):
        _step(model, optimizers, *batch(step), clip=clipped if clip else None)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {}
    for o in optimizers:
        for p, entry in o.state.items():
            state[names[id(p)]] = {
                k: v.clone()
                for k, v in entry.items()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            }
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "state": state, "norms": norms}


def whole_matrix_state(optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """The state of the parameters this rank owns, by parameter name (full shapes)."""
    out = {}
    for slot, _owner, master in getattr(optimizer, "plait_slots", []):
        if master is not None:
            out[slot.name] = {
                k: v.clone()
                for k, v in optimizer.state[master].items()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            }
    return out


def train(strategy: str, kind: str = "muon", **options: Any) -> dict[str, Any]:
    """Train under ``strategy`` from replicas that start different; each rank's share of
    the global batch. Returns the full parameters, the whole-matrix state this rank owns,
    and the element-wise optimizer's full state by parameter name."""
    world = plait.world()
    clip = options.pop("clip", False)
    norms: list[float] = []

    def clipped(m: nn.Module, opts: Any) -> None:
        norms.append(float(plait.clip_grad_norm_(m, opts, CLIP)))

    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(world.rank)  # construction makes the replicas equal
    names = [n for n, _ in model.named_parameters()]
    optimizers = make_optimizers(model, kind)
    rest_names = [n for n in names if n not in HIDDEN]
    if kind == "shampoo":
        options["whole_matrix"] = [optimizers[0]]
    prepared, optimizers = plait.prepare(model, optimizers, strategy=strategy, **options)
    n = GLOBAL_BATCH // world.size
    for step in range(STEPS):
        x, y = batch(step)
        _step(
            prepared,
            optimizers,
            x[world.rank * n : (world.rank + 1) * n],
            y[world.rank * n : (world.rank + 1) * n],
            clip=clipped if clip else None,
        )
    if strategy in ("zero3", "fsdp"):
        params = full_state_dict(prepared)
        adamw = full_optimizer_state_dict(prepared, optimizers[1])
    else:
        params = {k: v.detach().clone() for k, v in prepared.state_dict().items()}
        adamw = optimizers[1].state_dict()
    state = whole_matrix_state(optimizers[0])
    for index, entry in adamw["state"].items():
        state[rest_names[index]] = {
            k: v.clone() for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() > 0
        }
    plan = optimizers[0].plait_ownership
    return {"params": params, "state": state, "owners": plan.owners, "norms": norms}


def _by_name(state: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """A plain-format optimizer state dict keyed by parameter names (how checkpoints
    travel between layouts)."""
    flat = [n for group in names for n in group]
    return {
        "state": {flat[int(i)]: entry for i, entry in state["state"].items()},
        "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"}, "params": names[j]}
            for j, g in enumerate(state["param_groups"])
        ],
    }


def _by_index(state: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    flat = [n for group in names for n in group]
    index = {n: i for i, n in enumerate(flat)}
    return {
        "state": {index[n]: entry for n, entry in state["state"].items()},
        "param_groups": [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [index[n] for n in g["params"]],
            }
            for g in state["param_groups"]
        ],
    }


def save_under_zero2(steps: int) -> dict[str, Any]:
    """``steps`` steps under zero2 (Muon by ownership, AdamW as ZeroOptimizer); the full
    model state and both optimizers' full states by parameter name (every rank the same)."""
    from plait.strategies.whole_matrix.state import (
        full_optimizer_param_names,
    )
    from plait.strategies.whole_matrix.state import (
        full_optimizer_state_dict as whole_state,
    )

    world = plait.world()
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    prepared, (muon, adamw) = plait.prepare(model, make_optimizers(model), strategy="zero2")
    n = GLOBAL_BATCH // world.size
    for step in range(steps):
        x, y = batch(step)
        _step(
            prepared,
            [muon, adamw],
            x[world.rank * n : (world.rank + 1) * n],
            y[world.rank * n : (world.rank + 1) * n],
        )
    rest = [[n for n in names if n not in HIDDEN]]
    return {
        "model": {k: v.detach().clone() for k, v in prepared.state_dict().items()},
        "muon": _by_name(whole_state(muon), full_optimizer_param_names(muon)),
        "adamw": _by_name(adamw.state_dict(), rest),
    }


def load_under_fsdp(saved: dict[str, Any], first: int) -> dict[str, Any]:
    """Load ``saved`` (from :func:`save_under_zero2` at another world size) under fsdp,
    train from step ``first`` to STEPS; parameters and owned state as :func:`train`."""
    from plait.strategies.fsdp.state import full_optimizer_param_names as fsdp_names
    from plait.strategies.fsdp.state import load_full_optimizer_state_dict
    from plait.strategies.whole_matrix.state import (
        full_optimizer_param_names,
    )
    from plait.strategies.whole_matrix.state import (
        load_full_optimizer_state_dict as load_whole,
    )

    world = plait.world()
    model = make_model()
    model.load_state_dict(saved["model"])
    names = [n for n, _ in model.named_parameters()]
    prepared, (muon, adamw) = plait.prepare(model, make_optimizers(model), strategy="fsdp")
    load_whole(muon, _by_index(saved["muon"], full_optimizer_param_names(muon)))
    load_full_optimizer_state_dict(
        prepared, adamw, _by_index(saved["adamw"], fsdp_names(prepared, adamw))
    )
    n = GLOBAL_BATCH // world.size
    for step in range(first, STEPS):
        x, y = batch(step)
        _step(
            prepared,
            [muon, adamw],
            x[world.rank * n : (world.rank + 1) * n],
            y[world.rank * n : (world.rank + 1) * n],
        )
    state = whole_matrix_state(muon)
    adam = full_optimizer_state_dict(prepared, adamw)
    for index, entry in adam["state"].items():
        state[[m for m in names if m not in HIDDEN][index]] = {
            k: v.clone() for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() > 0
        }
    return {"params": full_state_dict(prepared), "state": state}


def refusals() -> dict[str, str]:
    """What plait.prepare says to whole-matrix cases it cannot make exact."""
    from plait.strategies.zero import ZeroOptimizer

    out: dict[str, str] = {}

    def catch(name: str, fn: Any) -> None:
        try:
            fn()
        except (ValueError, TypeError) as exc:
            out[name] = str(exc)

    def opts(model: nn.Module) -> list[torch.optim.Optimizer]:
        return make_optimizers(model)

    m = make_model()
    catch("lbfgs", lambda: plait.prepare(m, torch.optim.LBFGS(m.parameters()), strategy="zero2"))
    m = make_model()
    catch(
        "cp_zero",
        lambda: plait.prepare(
            m, opts(m), strategy="cp", mesh=plait.Mesh(cp=plait.world().size), zero=3
        ),
    )
    m = make_model()
    catch("ps", lambda: plait.prepare(m, opts(m), strategy="ps"))
    m = make_model()
    stranger = torch.optim.SGD(make_model().parameters(), lr=0.1)
    catch("declared", lambda: plait.prepare(m, opts(m), strategy="zero2", whole_matrix=[stranger]))
    m = make_model()
    mesh = plait.Mesh(pp=1, dp=1, tp=plait.world().size)
    catch(
        "ptdp_skip",
        lambda: plait.prepare(m, opts(m), strategy="ptdp", mesh=mesh, check_finite="skip"),
    )
    m = make_model().float()
    catch("fp16", lambda: plait.prepare(m, opts(m), strategy="zero2", mixed_precision="fp16"))
    m = make_model()
    catch("zero_direct", lambda: ZeroOptimizer(m.parameters(), torch.optim.Muon))
    return out


def checkpoint_save(root: str, steps: int, strategy: str = "zero2") -> None:
    """``steps`` steps under ``strategy``, then one :mod:`plait.checkpoint` per optimizer
    (``root/muon``, ``root/adamw``: save takes one optimizer)."""
    from plait import checkpoint

    world = plait.world()
    model = make_model()
    prepared, optimizers = plait.prepare(model, make_optimizers(model), strategy=strategy)
    n = GLOBAL_BATCH // world.size
    for step in range(steps):
        x, y = batch(step)
        rows = slice(world.rank * n, (world.rank + 1) * n)
        _step(prepared, optimizers, x[rows], y[rows])
    for name, o in zip(("muon", "adamw"), optimizers, strict=True):
        checkpoint.save(f"{root}/{name}", step=steps, model=prepared, optimizer=o)


def checkpoint_load(root: str, strategy: str) -> dict[str, Any]:
    """Load :func:`checkpoint_save`'s checkpoints under ``strategy`` at this world size and
    train to STEPS; parameters and state as :func:`train`."""
    from plait import checkpoint

    world = plait.world()
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    prepared, (muon, adamw) = plait.prepare(model, make_optimizers(model), strategy=strategy)
    first = checkpoint.load(f"{root}/muon", model=prepared, optimizer=muon).step
    checkpoint.load(f"{root}/adamw", model=prepared, optimizer=adamw)
    n = GLOBAL_BATCH // world.size
    for step in range(first, STEPS):
        x, y = batch(step)
        rows = slice(world.rank * n, (world.rank + 1) * n)
        _step(prepared, [muon, adamw], x[rows], y[rows])
    state = whole_matrix_state(muon)
    sharded = strategy in ("zero3", "fsdp")
    adam = full_optimizer_state_dict(prepared, adamw) if sharded else adamw.state_dict()
    for index, entry in adam["state"].items():
        state[[m for m in names if m not in HIDDEN][index]] = {
            k: v.clone() for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() > 0
        }
    params = (
        full_state_dict(prepared)
        if sharded
        else {k: v.detach().clone() for k, v in prepared.state_dict().items()}
    )
    return {"params": params, "state": state}


def bf16(strategy: str) -> dict[str, Any]:
    """Muon for the MLP's hidden matrix and AdamW for the rest under ``strategy`` with
    ``mixed_precision`` bf16 (float32 masters), each rank its row block; and one process
    under the same policy on the same row blocks, each block's loss / parts, gradients
    accumulated in float32 (tests/precision_fns.py's ``chunked`` oracle)."""
    from tests import precision_fns as P

    world = plait.world()

    def optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
        hidden = [model[2].weight]  # type: ignore[index]
        rest = [p for p in model.parameters() if p is not model[2].weight]  # type: ignore[index]
        return [
            torch.optim.Muon(hidden, lr=0.05, momentum=0.9),
            torch.optim.AdamW(rest, lr=0.01),
        ]

    def run(parts: int, rank: int, strategy: str) -> tuple[dict[str, torch.Tensor], list[str]]:
        model = P.mlp()
        runner, opts = plait.prepare(
            model, optimizers(model), strategy=strategy, mixed_precision=P.BF16
        )
        seen = P.Dtypes(runner)
        for step in range(STEPS):
            x, y = P.mlp_batch(step)
            for o in opts:
                o.zero_grad()
            for part in [rank] if strategy != "none" else range(parts):
                loss = P.mse(runner(P._rows(x, part, parts)), P._rows(y, part, parts))
                (loss if strategy != "none" else loss / parts).backward()
            for o in opts:
                o.step()
        return full_state_dict(runner), seen.close()

    got, dtypes = run(world.size, world.rank, strategy)
    want, _ = run(world.size, 0, "none")
    return {"plait": got, "chunked": want, "dtypes": dtypes}
