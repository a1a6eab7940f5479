"""Rank functions for tests/test_dcp_hf.py: Hugging Face models (random init from a config
object, float64) under plait's fsdp, tp (a Llama) and ep (a Mixtral, experts stacked in one
tensor per weight) save DCP directories under Hugging Face's own keys that the unwrapped
model loads in one process, and the reverse."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import plait
from plait import checkpoint
from plait.checkpoint import dcp as plait_dcp
from plait.checkpoint.full import unwrap
from tests import hf_ep_fns, hf_tp_fns
from tests.checkpoint_fns import named_optimizer_state

ROWS, SEQ, STEPS = 4, 8, 2
FAMILY = {"fsdp": "llama", "tp": "llama", "ep": "mixtral"}


def build(family: str, seed: int) -> nn.Module:
    """The tiny random-init model; ``seed`` 1 moves every parameter away from seed 0's."""
    if family == "llama":
        model = hf_tp_fns.llama(tied=False, kv_heads=2)
    else:
        model = hf_ep_fns.build("mixtral")
    if seed:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.25)
    return model


def vocab(family: str) -> int:
    return hf_tp_fns.VOCAB if family == "llama" else hf_ep_fns.VOCAB


def ids(family: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randint(0, vocab(family), (ROWS, SEQ), generator=g)


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def layout(name: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build(FAMILY[name], seed)
    mesh = {"fsdp": None, "tp": plait.Mesh(tp=2), "ep": plait.Mesh(ep=2)}[name]
    options = {} if mesh is None else {"mesh": mesh}
    m, o = plait.prepare(model, adam(model), strategy=name, **options)
    assert o is not None
    return m, o


def step(name: str, model: nn.Module, optimizer: torch.optim.Optimizer, k: int) -> None:
    """The model's own ``labels=`` loss: tp on every row, fsdp and ep on this rank's."""
    x = ids(FAMILY[name], k)
    if name != "tp" and dist.is_initialized():
        b = dist.get_rank()
        if name == "ep":
            b = unwrap(model).plait_expert_parallel.batch_rank
        n = ROWS // dist.get_world_size()
        x = x[b * n : (b + 1) * n]
    optimizer.zero_grad()
    model(input_ids=x, labels=x).loss.backward()
    optimizer.step()


def whole(name: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Whole parameters (Hugging Face keys); the optimizer state by name (None under tp,
    whose state plait's layout API does not gather: checked through the next step)."""
    return {
        "model": {k: v.clone() for k, v in checkpoint.full_state_dict(model).items()},
        "optimizer": None if name == "tp" else named_optimizer_state(model, optimizer),
        "lr": optimizer.param_groups[0]["lr"],
    }


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": plait_dcp.get_model_state_dict(model),
        "optimizer": plait_dcp.get_optimizer_state_dict(model, optimizer),
    }


def save(name: str, directory: str) -> dict[str, Any]:
    model, optimizer = layout(name, 0)
    for k in range(STEPS):
        step(name, model, optimizer, k)
    dcp.save(_dcp_state(model, optimizer), checkpoint_id=directory)
    return whole(name, model, optimizer)


def load(name: str, directory: str) -> dict[str, Any]:
    model, optimizer = layout(name, 1)
    state = _dcp_state(model, optimizer)
    dcp.load(state, checkpoint_id=directory)
    plait_dcp.set_model_state_dict(model, state["model"])
    plait_dcp.set_optimizer_state_dict(model, optimizer, state["optimizer"])
    loaded = whole(name, model, optimizer)
    step(name, model, optimizer, STEPS)
    return {"loaded": loaded, "after": whole(name, model, optimizer)}


def one_process(family: str, directory: str, *, train: bool) -> dict[str, Any]:
    """The unwrapped model in this process: trained ``STEPS`` on the global batch and
    saved with ``no_dist=True`` (``train``), or loaded from ``directory`` and stepped once."""
    model = build(family, 0 if train else 1)
    optimizer = adam(model)

    def report() -> dict[str, Any]:
        return {
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": named_optimizer_state(model, optimizer),
            "lr": optimizer.param_groups[0]["lr"],
        }

    if train:
        for k in range(STEPS):
            _one_step(family, model, optimizer, k)
        dcp.save(_dcp_state(model, optimizer), checkpoint_id=directory, no_dist=True)
        return {"loaded": report()}
    state = _dcp_state(model, optimizer)
    dcp.load(state, checkpoint_id=directory, no_dist=True)
    model.load_state_dict(state["model"])
    plait_dcp.set_optimizer_state_dict(model, optimizer, state["optimizer"])
    loaded = report()
    _one_step(family, model, optimizer, STEPS)
    return {"loaded": loaded, "after": report()}


def _one_step(family: str, model: nn.Module, optimizer: torch.optim.Optimizer, k: int) -> None:
    x = ids(family, k)
    optimizer.zero_grad()
    model(input_ids=x, labels=x).loss.backward()
    optimizer.step()


def save_all(names: list[str], root: str) -> dict[str, Any]:
    return {n: save(n, f"{root}/{n}") for n in names}


def load_all(cases: list[tuple[str, str]], root: str) -> dict[str, Any]:
    return {n: load(n, f"{root}/{source}") for n, source in cases}
