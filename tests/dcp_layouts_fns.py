"""Rank functions for tests/test_dcp_layouts.py: plait's GPT (float64) trained under expert
(ep), context (cp) and PTD-P (ptdp) parallelism, saved with ``torch.distributed.checkpoint``
and loaded by one process and by PyTorch FSDP2 at another world size, and the reverse. Each
reports the whole state (parameters by key, optimizer state by parameter name) as loaded
and after one more step on the global batch."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.nn import functional as F

import plait
from plait import checkpoint
from plait.checkpoint import dcp as plait_dcp
from plait.checkpoint.full import unwrap
from plait.models.gpt import GPT, GPTConfig, MoEConfig
from plait.strategies.context import shard_sequence
from tests.checkpoint_fns import named_optimizer_state
from tests.dcp_fns import FLAT, CountingReader, fsdp2_state, tensor_bytes

VOCAB, SEQ, ROWS, STEPS = 13, 8, 4, 2  # a global batch of ROWS sequences of SEQ tokens
# buffers counting what each rank routed (plait.moe.MoE): rank-local under data
# parallelism (FSDP2's ranks each count their own rows), so no layout's to compare
LOCAL_BUFFERS = ("load_since_update",)


def config(family: str, seed: int) -> GPTConfig:
    """``gpt`` (dense) or ``moe`` (every block an MoE of 4 experts, top-1 routing: no
    random draws, so FSDP2's data-parallel step equals one process's)."""
    moe = MoEConfig(num_experts=4, top_k=1, capacity_factor=4.0, seed=3)
    return GPTConfig(
        vocab=VOCAB,
        layers=2,
        heads=4,
        width=16,
        seq_len=SEQ,
        seed=seed,
        dtype=torch.float64,
        moe=moe if family == "moe" else None,
        moe_every=1,
    )


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


# --- plait layouts ---------------------------------------------------------------------------
FAMILY = {
    "ep": "moe",
    "ep2_dp2": "moe",
    "cp": "gpt",
    "pp2_tp2": "gpt",
    "pp2_dp2": "gpt",
    "pp2_dp2_zero1": "gpt",
    "pp2_ep2": "moe",
    "pp2_cp2": "gpt",
    "tp2_dp2_zero1": "gpt",
}
PTDP = ("pp2_tp2", "pp2_dp2", "pp2_dp2_zero1", "pp2_ep2", "pp2_cp2", "tp2_dp2_zero1")


@dataclasses.dataclass
class Layout:
    """A model under one plait layout, the optimizer it steps, and its training step."""

    name: str
    model: Any
    optimizer: torch.optim.Optimizer

    def step(self, step: int) -> None:
        ids, targets = global_batch(step)
        self.optimizer.zero_grad()
        if self.name in PTDP:  # the global batch on every rank
            self.model.step(ids, targets)
        elif self.name.startswith("ep"):  # this rank's slice of the batch
            b = unwrap(self.model).plait_expert_parallel.batch_rank
            n = ROWS // dist.get_world_size()
            rows = slice(b * n, (b + 1) * n)
            _ce(self.model(ids[rows]), targets[rows]).backward()
        else:  # cp: every row, this rank's chunks of the sequence
            mesh = self.mesh
            ids, _ = shard_sequence(ids, mesh, balanced=True)
            targets, _ = shard_sequence(targets, mesh, balanced=True)
            _ce(self.model(ids), targets).backward()
        self.optimizer.step()

    mesh: Any = None


def layout(name: str, seed: int) -> Layout:
    model = GPT(config(FAMILY[name], seed))
    opt = adam(model.parameters())
    if name.startswith("ep"):  # ep2_dp2: each expert on 2 ranks (dp replicas)
        mesh = plait.Mesh(ep=2, dp=2) if name == "ep2_dp2" else plait.Mesh(ep=2)
        m, o = plait.prepare(model, opt, strategy="ep", mesh=mesh)
        return Layout(name, m, o)
    if name == "cp":
        mesh = plait.Mesh(cp=2)
        m, o = plait.prepare(model, opt, strategy="cp", mesh=mesh, context="ring")
        return Layout(name, m, o, mesh)
    shape = {
        "pp2_tp2": {"pp": 2, "tp": 2},
        "pp2_ep2": {"pp": 2, "dp": 1, "ep": 2, "tp": 1},
        "pp2_cp2": {"pp": 2, "dp": 1, "cp": 2, "tp": 1},
        "tp2_dp2_zero1": {"pp": 1, "dp": 2, "tp": 2},
    }.get(name, {"pp": 2, "dp": 2})
    zero = 1 if name.endswith("zero1") else 0
    ptdp, o = plait.prepare(
        model, opt, strategy="ptdp", mesh=plait.Mesh(**shape), microbatches=2, zero=zero
    )
    return Layout(name, ptdp, o)


def whole_state(lay: Layout) -> dict[str, Any]:
    """The whole parameters and optimizer state, through plait's own gathering (collective)."""
    if lay.name in PTDP:
        state = lay.model.state_dict()
        names = lay.model.param_names
        optimizer = {names[int(i)]: dict(s) for i, s in state["optimizer"]["state"].items()}
        model = state["model"]
    else:
        model = checkpoint.full_state_dict(lay.model)
        optimizer = named_optimizer_state(lay.model, lay.optimizer)
    return {
        "model": {k: v.clone() for k, v in model.items()},
        "optimizer": optimizer,
        "lr": lay.optimizer.param_groups[0]["lr"],
    }


def _dcp_state(lay: Layout, flatten: bool) -> dict[str, Any]:
    return {
        "model": plait_dcp.get_model_state_dict(lay.model),
        "optimizer": plait_dcp.get_optimizer_state_dict(
            lay.model, lay.optimizer, options=FLAT if flatten else None
        ),
    }


def plait_save(name: str, directory: str) -> dict[str, Any]:
    lay = layout(name, 0)
    for step in range(STEPS):
        lay.step(step)
    dcp.save(_dcp_state(lay, flatten=False), checkpoint_id=directory)
    return whole_state(lay)


def plait_load(name: str, directory: str, flatten: bool) -> dict[str, Any]:
    """A differently initialised layout loads ``directory`` (each rank reading only what
    it holds), reports, takes one more step, reports."""
    lay = layout(name, 1)
    state = _dcp_state(lay, flatten)
    reader = CountingReader(directory)
    dcp.load(state, storage_reader=reader)
    plait_dcp.set_model_state_dict(lay.model, state["model"])
    plait_dcp.set_optimizer_state_dict(
        lay.model, lay.optimizer, state["optimizer"], options=FLAT if flatten else None
    )
    loaded = whole_state(lay)
    lay.step(STEPS)
    return {
        "loaded": loaded,
        "after": whole_state(lay),
        "read": reader.bytes_read,
        "total": tensor_bytes(directory),
    }


def plait_save_all(names: list[str], root: str) -> dict[str, Any]:
    return {n: plait_save(n, f"{root}/{n}") for n in names}


def plait_load_all(cases: list[tuple[str, str, bool]], root: str) -> dict[str, Any]:
    return {f"{n}-{src}": plait_load(n, f"{root}/{src}", flat) for n, src, flat in cases}


# --- PyTorch FSDP2 (4 ranks) -------------------------------------------------------------------
def fsdp2_model(family: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = GPT(config(family, seed))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, adam(model.parameters())


def fsdp2_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    ids, targets = global_batch(step)
    n = ROWS // dist.get_world_size()
    rows = slice(dist.get_rank() * n, (dist.get_rank() + 1) * n)
    optimizer.zero_grad()
    _ce(model(ids[rows]), targets[rows]).backward()
    optimizer.step()


def fsdp2_save(family: str, directory: str, flatten: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model, optimizer = fsdp2_model(family, 0)
    for step in range(STEPS):
        fsdp2_step(model, optimizer, step)
    options = FLAT if flatten else None
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
    }
    dcp.save(state, checkpoint_id=directory)
    return fsdp2_state(model, optimizer)


def fsdp2_load(family: str, directory: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, optimizer = fsdp2_model(family, 1)
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    loaded = fsdp2_state(model, optimizer)
    fsdp2_step(model, optimizer, STEPS)
    return {"loaded": loaded, "after": fsdp2_state(model, optimizer)}


def fsdp2_save_all(cases: list[tuple[str, bool]], root: str) -> dict[str, Any]:
    return {f"{f}-{flat}": fsdp2_save(f, f"{root}/{f}-{flat}", flat) for f, flat in cases}


def fsdp2_load_all(names: list[str], root: str) -> dict[str, Any]:
    return {n: fsdp2_load(FAMILY[n], f"{root}/{n}") for n in names}


# --- one process -------------------------------------------------------------------------------
def one_process_load(family: str, directory: str, flatten: bool) -> dict[str, Any]:
    """``dcp.load(..., no_dist=True)`` into the plain GPT and AdamW, then one step on the
    global batch: the reference."""
    model = GPT(config(family, 1))
    optimizer = adam(model.parameters())
    options = FLAT if flatten else None
    state = {
        "model": plait_dcp.get_model_state_dict(model),
        "optimizer": plait_dcp.get_optimizer_state_dict(model, optimizer, options=options),
    }
    dcp.load(state, checkpoint_id=directory, no_dist=True)
    model.load_state_dict(state["model"])
    plait_dcp.set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)

    def whole() -> dict[str, Any]:
        return {
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": named_optimizer_state(model, optimizer),
            "lr": optimizer.param_groups[0]["lr"],
        }

    loaded = whole()
    ids, targets = global_batch(STEPS)
    optimizer.zero_grad()
    _ce(model(ids), targets).backward()
    optimizer.step()
    return {"loaded": loaded, "after": whole()}


# --- refusals ------------------------------------------------------------------------------------
def refusals() -> dict[str, str]:
    """The error text of each layout DCP state dicts do not map yet (4 ranks)."""
    from plait.strategies.tensor import parallelize
    from plait.strategies.tensor.parallelize_nd import gpt_plan
    from tests import tensor_gpt_fns
    from tests.tensor_nd_fns import make_mesh

    out = {}
    cfg = tensor_gpt_fns.config(tied=False)
    model = GPT(cfg)
    parallelize(model, make_mesh("2d", False), gpt_plan("2d", layers=cfg.layers))
    try:
        plait_dcp.get_model_state_dict(model)
    except NotImplementedError as exc:
        out["2d"] = str(exc)
    from tests.hf_tp_fns import gpt2  # GPT-2's Conv1D: weights stored [in, out]

    hf = gpt2(tied=False)
    ptdp, opt = plait.prepare(
        hf, adam(hf.parameters()), strategy="ptdp", mesh=plait.Mesh(tp=2, dp=2), zero=1
    )
    try:
        plait_dcp.get_optimizer_state_dict(ptdp, opt)
    except NotImplementedError as exc:
        out["conv1d_zero"] = str(exc)
    return out
