"""Rank functions for the DCP tests: train a little under a plait layout or under PyTorch's
FSDP2, save with ``torch.distributed.checkpoint``, load under the other at another world
size, and report the whole state (parameters, optimizer state by parameter name) before and
after one more step, in float64, so the test compares bitwise and against one process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.state_dict import StateDictOptions

import plait
from plait import checkpoint
from plait.checkpoint import dcp as plait_dcp
from plait.checkpoint.full import unwrap
from plait.strategies.fsdp import FSDPModule
from tests.checkpoint_fns import named_optimizer_state

FEATURES, HIDDEN, OUT, GLOBAL_BATCH = 6, 10, 3, 12


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT)
        self.register_buffer("scale", torch.tensor([0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


def make_net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net().double()


def make_optimizer(params: Any, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return torch.optim.Adam(params, lr=0.01)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s contiguous share of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, FEATURES, generator=g, dtype=torch.float64)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=g, dtype=torch.float64)
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, *, split: bool = True
) -> None:
    """``split``: each rank takes its share of the global batch (data parallel), else every
    rank the whole batch (tensor parallel)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if not split:
        rank, world = 0, 1
    for step in steps:
        x, y = batch(step, rank, world)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _options(flatten: bool) -> StateDictOptions | None:
    return StateDictOptions(flatten_optimizer_state_dict=True) if flatten else None


class CountingReader(FileSystemReader):
    """DCP's file reader, counting the stored tensor bytes this rank reads (each stored
    chunk it reads from, once; pickled values left out)."""

    bytes_read = 0

    def read_data(self, plan: Any, planner: Any) -> Any:
        seen = set()
        for req in plan.items:
            if req.type != LoadItemType.TENSOR:
                continue
            item = self.storage_data[req.storage_index]
            if (item.relative_path, item.offset) not in seen:
                seen.add((item.relative_path, item.offset))
                self.bytes_read += item.length
        return super().read_data(plan, planner)


def tensor_bytes(directory: str) -> int:
    """The stored bytes of every non-empty tensor chunk in a DCP directory (FSDP2 also
    writes the empty shards of ranks past a tensor's rows, which no load reads)."""
    md = FileSystemReader(directory).read_metadata()
    total = 0
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            continue
        for chunk in entry.chunks:
            if all(chunk.sizes):
                total += md.storage_data[MetadataIndex(fqn, chunk.offsets)].length
    return total


# --- plait layouts ---------------------------------------------------------------------------
def plait_model(strategy: str, seed: int, opt: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    raw = make_net(seed)
    optimizer = make_optimizer(raw.parameters(), opt)
    if strategy == "fsdp_units":  # one unit per Linear, the root holding the buffer
        return plait.prepare(raw, optimizer, strategy="fsdp", wrap={nn.Linear})
    if strategy == "tp":
        plan = {"fc1": "colwise", "fc2": "rowwise"}
        mesh = plait.Mesh(tp=dist.get_world_size())
        return plait.prepare(raw, optimizer, strategy="tp", mesh=mesh, plan=plan)
    return plait.prepare(raw, optimizer, strategy=strategy)


def plait_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole parameters; the whole optimizer state where plait's layout API gives it
    (not under tensor parallelism: None there, checked through a DCP round trip)."""
    tp = getattr(unwrap(model), "plait_tensor_parallel", None) is not None
    return {
        "model": {k: v.clone() for k, v in checkpoint.full_state_dict(model).items()},
        "optimizer": None if tp else named_optimizer_state(model, optimizer),
        "lr": optimizer.param_groups[0]["lr"],
    }


def _plait_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, flatten: bool
) -> dict[str, Any]:
    # on FSDP the FSDP2 user's own call; on DDP the helper drops the "module." prefix
    sharded = isinstance(unwrap(model), FSDPModule)
    return {
        "model": model.state_dict() if sharded else plait_dcp.get_model_state_dict(model),
        "optimizer": plait_dcp.get_optimizer_state_dict(
            model, optimizer, options=_options(flatten)
        ),
    }


def plait_save(
    strategy: str, directory: str, steps: int, opt: str, flatten: bool
) -> dict[str, Any]:
    model, optimizer = plait_model(strategy, 0, opt)
    train(model, optimizer, range(steps), split=strategy != "tp")
    dcp.save(_plait_dict(model, optimizer, flatten), checkpoint_id=directory)
    return plait_state(model, optimizer)


def plait_load(
    strategy: str, directory: str, start: int, opt: str, flatten: bool
) -> dict[str, Any]:
    """Load into a differently initialised model, report, then take one more step."""
    model, optimizer = plait_model(strategy, 1, opt)
    state = _plait_dict(model, optimizer, flatten)
    reader = CountingReader(directory)
    dcp.load(state, storage_reader=reader)
    if isinstance(unwrap(model), FSDPModule):
        model.load_state_dict(state["model"])
    else:
        plait_dcp.set_model_state_dict(model, state["model"])
    plait_dcp.set_optimizer_state_dict(
        model, optimizer, state["optimizer"], options=_options(flatten)
    )
    loaded = plait_state(model, optimizer)
    train(model, optimizer, range(start, start + 1), split=strategy != "tp")
    return {
        "loaded": loaded,
        "after": plait_state(model, optimizer),
        "read": reader.bytes_read,
        "total": tensor_bytes(directory),
    }


# --- PyTorch FSDP2 ----------------------------------------------------------------------------
def fsdp2_model(seed: int, opt: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_net(seed)
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, make_optimizer(model.parameters(), opt)


def _whole(value: Any) -> Any:
    if hasattr(value, "full_tensor"):
        return value.full_tensor().clone()
    return value.clone() if isinstance(value, torch.Tensor) else value


def fsdp2_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Whole parameters and optimizer state (collective: all-gathers)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizer)
    return {
        "model": {k: _whole(v) for k, v in model.state_dict().items()},
        "optimizer": {
            fqn: {k: _whole(v) for k, v in entry.items()} for fqn, entry in osd["state"].items()
        },
        "lr": optimizer.param_groups[0]["lr"],
    }


def fsdp2_save(directory: str, steps: int, opt: str, flatten: bool) -> dict[str, Any]:
    """torchtitan's layout: model and optimizer under their keys."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model, optimizer = fsdp2_model(0, opt)
    train(model, optimizer, range(steps))
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=_options(flatten)),
    }
    dcp.save(state, checkpoint_id=directory)
    return fsdp2_state(model, optimizer)


def fsdp2_load(directory: str, start: int, opt: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, optimizer = fsdp2_model(1, opt)
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    loaded = fsdp2_state(model, optimizer)
    train(model, optimizer, range(start, start + 1))
    return {"loaded": loaded, "after": fsdp2_state(model, optimizer)}


# --- one process ------------------------------------------------------------------------------
def oracle(steps: int, opt: str) -> dict[str, Any]:
    """The plain model trained ``steps`` steps on the global batches in this process."""
    model = make_net(0)
    optimizer = make_optimizer(model.parameters(), opt)
    train(model, optimizer, range(steps))
    return plait_state(model, optimizer)


def one_process_load(directory: str, start: int, opt: str, flatten: bool) -> dict[str, Any]:
    """``dcp.load(..., no_dist=True)`` into the plain model and optimizer (this process,
    no process group), then one step on the whole global batch: the oracle."""
    model = make_net(1)
    optimizer = make_optimizer(model.parameters(), opt)
    state = {
        "model": plait_dcp.get_model_state_dict(model),
        "optimizer": plait_dcp.get_optimizer_state_dict(
            model, optimizer, options=_options(flatten)
        ),
    }
    dcp.load(state, checkpoint_id=directory, no_dist=True)
    model.load_state_dict(state["model"])
    plait_dcp.set_optimizer_state_dict(
        model, optimizer, state["optimizer"], options=_options(flatten)
    )
    loaded = plait_state(model, optimizer)
    train(model, optimizer, range(start, start + 1))
    return {"loaded": loaded, "after": plait_state(model, optimizer)}


# --- pipeline ---------------------------------------------------------------------------------
def make_seq(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 8), nn.Tanh(), nn.Linear(8, OUT)
    ).double()


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


# torchtitan's flattened optimizer format (a pipeline's nested one lists every rank's names)
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def pipeline(seed: int) -> tuple[Any, torch.optim.Optimizer]:
    model = make_seq(seed)
    pipe, optimizer = plait.prepare(
        model,
        make_optimizer(model.parameters(), "adam"),
        strategy="pipeline",
        mesh=plait.Mesh(pp=dist.get_world_size()),
        microbatches=2,
        loss_fn=_mse,
    )
    return pipe, optimizer


def pipeline_train(pipe: Any, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x, y = batch(step, 0, 1)  # every pipeline rank passes the global batch
        optimizer.zero_grad()
        pipe.step(x, y)
        optimizer.step()


def pipeline_state(pipe: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's stages: parameters and optimizer state under the dense names."""
    names = {id(p): n for st in pipe.stages.values() for n, p in st.named_parameters()}
    return {
        "model": {k: v.clone() for k, v in plait_dcp.get_model_state_dict(pipe).items()},
        "optimizer": {
            names[id(p)]: {k: _whole(v) for k, v in optimizer.state[p].items()}
            for group in optimizer.param_groups
            for p in group["params"]
        },
        "lr": optimizer.param_groups[0]["lr"],
    }


def pipeline_save(directory: str, steps: int, flatten: bool) -> dict[str, Any]:
    pipe, optimizer = pipeline(0)
    pipeline_train(pipe, optimizer, range(steps))
    dcp.save(
        {
            "model": plait_dcp.get_model_state_dict(pipe),
            "optimizer": plait_dcp.get_optimizer_state_dict(
                pipe, optimizer, options=_options(flatten)
            ),
        },
        checkpoint_id=directory,
    )
    return pipeline_state(pipe, optimizer)


def pipeline_load(directory: str, start: int, flatten: bool) -> dict[str, Any]:
    pipe, optimizer = pipeline(1)
    state = {
        "model": plait_dcp.get_model_state_dict(pipe),
        "optimizer": plait_dcp.get_optimizer_state_dict(pipe, optimizer, options=_options(flatten)),
    }
    dcp.load(state, checkpoint_id=directory)
    plait_dcp.set_model_state_dict(pipe, state["model"])
    plait_dcp.set_optimizer_state_dict(
        pipe, optimizer, state["optimizer"], options=_options(flatten)
    )
    loaded = pipeline_state(pipe, optimizer)
    pipeline_train(pipe, optimizer, range(start, start + 1))
    return {"loaded": loaded, "after": pipeline_state(pipe, optimizer)}


def one_process_seq(directory: str, steps: int, save: bool, flatten: bool) -> dict[str, Any]:
    """The plain Sequential in this process: trained ``steps`` and saved with
    ``no_dist=True`` (``save``), or loaded from ``directory`` and stepped once more."""
    model = make_seq(0 if save else 1)
    optimizer = make_optimizer(model.parameters(), "adam")
    if save:
        train(model, optimizer, range(steps))
        state = {
            "model": plait_dcp.get_model_state_dict(model),
            "optimizer": plait_dcp.get_optimizer_state_dict(
                model, optimizer, options=_options(flatten)
            ),
        }
        dcp.save(state, checkpoint_id=directory, no_dist=True)
        return {"loaded": plait_state(model, optimizer)}
    state = {
        "model": plait_dcp.get_model_state_dict(model),
        "optimizer": plait_dcp.get_optimizer_state_dict(
            model, optimizer, options=_options(flatten)
        ),
    }
    dcp.load(state, checkpoint_id=directory, no_dist=True)
    model.load_state_dict(state["model"])
    plait_dcp.set_optimizer_state_dict(
        model, optimizer, state["optimizer"], options=_options(flatten)
    )
    loaded = plait_state(model, optimizer)
    train(model, optimizer, range(steps, steps + 1))
    return {"loaded": loaded, "after": plait_state(model, optimizer)}


# --- several cases per run (one pool run each way keeps the module short) ---------------------
def plait_save_all(cases: list[tuple[str, str]], root: str, steps: int) -> dict[str, Any]:
    return {f"{s}-{o}": plait_save(s, f"{root}/{s}-{o}", steps, o, False) for s, o in cases}


def fsdp2_load_all(cases: list[tuple[str, str]], root: str, start: int) -> dict[str, Any]:
    return {f"{s}-{o}": fsdp2_load(f"{root}/{s}-{o}", start, o) for s, o in cases}


def fsdp2_save_all(cases: list[tuple[str, bool]], root: str, steps: int) -> dict[str, Any]:
    return {f"{o}-{f}": fsdp2_save(f"{root}/{o}-{f}", steps, o, f) for o, f in cases}


def plait_load_all(cases: list[tuple[str, str, bool]], root: str, start: int) -> dict[str, Any]:
    return {f"{s}-{o}-{f}": plait_load(s, f"{root}/{o}-{f}", start, o, f) for s, o, f in cases}
