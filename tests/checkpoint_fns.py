"""Rank functions for the checkpoint tests: train a little under a strategy, save, load under
another strategy and world size, and report the dense state (parameters, Adam state by
parameter name, sampler position, scaler and RNG state) so the test can compare bitwise."""

from __future__ import annotations

import os
import random
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import plait
from plait import checkpoint
from plait.amp import DynamicLossScaler
from plait.checkpoint import layout, transaction
from plait.data.sampler import DistributedSampler

N_SAMPLES, FEATURES, OUT, LOCAL_BATCH = 48, 6, 3, 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 10)
        self.fc2 = nn.Linear(10, OUT)
        self.register_buffer("scale", torch.tensor([0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(N_SAMPLES, FEATURES, generator=g), torch.randn(N_SAMPLES, OUT, generator=g)


class Setup:
    """A model, Adam, sampler and loss scaler prepared for ``strategy`` on the world
    (``plait.prepare``'s names, and ``"fsdp_units"``: fully_shard with a unit per Linear)."""

    def __init__(self, strategy: str, seed: int = 0, lr: float = 0.01) -> None:
        torch.manual_seed(seed)
        self.raw = Net()
        optimizer = torch.optim.Adam(self.raw.parameters(), lr=lr)
        if strategy == "fsdp_units":  # one unit per Linear, the root holding the buffer
            self.model, self.optimizer = plait.prepare(
                self.raw, optimizer, strategy="fsdp", wrap={nn.Linear}
            )
        else:
            self.model, self.optimizer = plait.prepare(self.raw, optimizer, strategy=strategy)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.sampler = DistributedSampler(range(N_SAMPLES), shuffle=True, seed=3)
        self.scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2)
        self.consumed: list[int] = []
        self._it = iter(self.sampler)

    def train(self, steps: int) -> None:
        x, y = data()
        for _ in range(steps):
            idx = [next(self._it) for _ in range(LOCAL_BATCH)]
            self.consumed += idx
            self.optimizer.zero_grad()
            loss = nn.functional.mse_loss(self.model(x[idx]), y[idx])
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scheduler.step()

    def rest_of_epoch(self) -> list[int]:
        return list(self._it)

    def save(self, root: str, step: int, **kwargs: Any) -> checkpoint.SaveHandle:
        return checkpoint.save(
            root,
            step=step,
            model=self.model,
            optimizer=self.optimizer,
            sampler=self.sampler,
            scaler=self.scaler,
            scheduler=self.scheduler,
            **kwargs,
        )

    def load(self, root: str, **kwargs: Any) -> checkpoint.Restored:
        restored = checkpoint.load(
            root,
            model=self.model,
            optimizer=self.optimizer,
            sampler=self.sampler,
            scaler=self.scaler,
            scheduler=self.scheduler,
            **kwargs,
        )
        self._it = iter(self.sampler)
        return restored

    def report(self) -> dict[str, Any]:
        """The dense state, the same on every rank (collective for ZeRO and FSDP)."""
        return {
            "model": {k: v.clone() for k, v in checkpoint.full_state_dict(self.model).items()},
            "optimizer": named_optimizer_state(self.model, self.optimizer),
            "lr": self.optimizer.param_groups[0]["lr"],
            "scaler": self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
        }


def named_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{fqn: {key: tensor}}`` of the whole optimizer through the strategy's public API."""
    names = [n for group in layout.optimizer_groups(model, optimizer) for n in group]
    state = layout.optimizer_state(model, optimizer)["state"]
    return {
        names[int(i)]: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for i, s in state.items()
    }


# --- resharding ------------------------------------------------------------------------------
def train_and_save(cases: list[tuple[str, str]], steps: int) -> list[dict[str, Any]]:
    """For each (strategy, root): train ``steps`` steps, save; the state as saved."""
    out = []
    for strategy, root in cases:
        s = Setup(strategy)
        s.train(steps)
        s.save(root, steps, extra={"strategy": strategy})
        report = s.report()
        report["consumed"] = s.consumed
        report["rng"] = torch.get_rng_state()
        out.append(report)
    return out


def load_and_report(cases: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """For each (strategy, root): a differently initialised setup loads the checkpoint;
    its dense state, the rest of the epoch this rank reads, and a further step's loss."""
    out = []
    for strategy, root in cases:
        s = Setup(strategy, seed=1, lr=0.5)
        torch.manual_seed(1234)  # the RNG state before the load
        t0 = time.monotonic()
        restored = s.load(root)
        load_s = time.monotonic() - t0
        report = s.report()
        report["load_s"] = load_s
        report["rng"] = torch.get_rng_state()
        report["rng_restored"] = restored.rng_restored
        report["rng_source"] = restored.rng_source
        report["extra"] = restored.extra
        report["step"] = restored.step
        report["after"] = s.rest_of_epoch()
        x, y = data()
        s.optimizer.zero_grad()
        loss = nn.functional.mse_loss(s.model(x[:4]), y[:4])
        loss.backward()
        s.optimizer.step()
        report["loss_finite"] = bool(torch.isfinite(loss))
        out.append(report)
    return out


def uninterrupted_vs_resumed(strategy: str, root: str, first: int, total: int) -> dict[str, Any]:
    """Train ``total`` steps straight, and ``first`` + save + load into a fresh setup +
    the rest: the final parameters, optimizer state and sample order must be equal."""
    straight = Setup(strategy)
    straight.train(total)
    before = Setup(strategy)
    before.train(first)
    before.save(root, first)
    after = Setup(strategy, seed=5)
    after.load(root)
    after.train(total - first)
    a, b = straight.report(), after.report()
    return {
        "straight": a,
        "resumed": b,
        "straight_ids": straight.consumed,
        "resumed_ids": before.consumed + after.consumed,
    }


# --- transactions --------------------------------------------------------------------------
def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in checkpoint.full_state_dict(model).items()}


def save_steps(root: str, steps: list[int], keep_last: int | None) -> dict[int, Any]:
    """Save after each training step in ``steps``; the dense state saved at each."""
    s = Setup("ddp")
    saved = {}
    for step in steps:
        s.train(1)
        s.save(root, step, keep_last=keep_last)
        saved[step] = params(s.model)
    return saved


def load_params(root: str, **kwargs: Any) -> dict[str, Any]:
    """Load into a fresh DDP setup; the parameters, or the error's type and message."""
    s = Setup("ddp", seed=9)
    try:
        with warnings.catch_warnings(record=True):  # fallback=True warns
            warnings.simplefilter("always")
            restored = s.load(root, **kwargs)
    except Exception as exc:  # reported to the test, which checks every rank raised
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"step": restored.step, "params": params(s.model), "skipped": restored.skipped}


def save_with_arguments(root_by_rank: list[str], step_by_rank: list[int]) -> str:
    """Each rank passes its own root and step; the error message (every rank must raise)."""
    rank = plait.world().rank
    try:
        checkpoint.save(root_by_rank[rank], {"x": torch.ones(1)}, step=step_by_rank[rank])
    except checkpoint.CheckpointMismatch as exc:
        return str(exc)
    return "saved"


def save_big_then_report(root: str, numel: int) -> dict[str, Any]:
    """Save a per-rank tensor of ``numel`` float32 (too big for the disk); what happened."""
    t0 = time.monotonic()
    try:
        checkpoint.save(root, {"big": torch.ones(numel)}, step=2)
    except checkpoint.CheckpointError as exc:
        return {"error": str(exc), "after_s": time.monotonic() - t0}
    return {"error": None, "after_s": time.monotonic() - t0}


def save_small(root: str) -> dict[str, torch.Tensor]:
    rank = plait.world().rank
    state = {"w": torch.arange(10.0) + rank}
    checkpoint.save(root, state, step=1)
    return state


def load_state(root: str) -> dict[str, Any]:
    try:
        restored = checkpoint.load(root)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"step": restored.step, "state": restored.state}


def die_during_save(root: str, victim: int, point: str) -> dict[str, Any]:
    """Save step 1; then save step 2 while rank ``victim`` SIGKILLs itself at the fault
    point ``point`` ("write": inside its file write; "rename": coordinator, manifest
    written, before the rename). Survivors report their error and its delay."""
    s = Setup("ddp")
    s.train(1)
    s.save(root, 1)
    first = params(s.model)
    s.train(1)
    rank = plait.world().rank
    if rank == victim:

        def kill(name: str) -> None:
            if name == point:
                os.kill(os.getpid(), signal.SIGKILL)

        transaction.FAULT_HOOK = kill
    t0 = time.monotonic()
    try:
        s.save(root, 2)
    except Exception as exc:
        return {
            "first": first,
            "error": f"{type(exc).__name__}: {exc}",
            "after_s": time.monotonic() - t0,
        }
    finally:
        transaction.FAULT_HOOK = None
    return {"first": first, "error": None, "after_s": time.monotonic() - t0}


# --- async ---------------------------------------------------------------------------------
def async_save_then_update(root: str) -> dict[str, Any]:
    """Save asynchronously, then update the parameters in place while the writer thread is
    still held at its fault point; the checkpoint must hold the values at the call."""
    s = Setup("ddp")
    s.train(1)
    at_call = params(s.model)
    released = []

    def slow_writer(name: str) -> None:
        if name == "write":
            time.sleep(0.5)
            released.append(True)

    transaction.FAULT_HOOK = slow_writer
    try:
        handle = s.save(root, 1, async_=True)
        writing_when_updated = not handle.done()
        s.train(2)  # in-place updates of the parameters and Adam state
        with torch.no_grad():
            for p in s.raw.parameters():
                p.add_(100.0)
        handle.wait()
    finally:
        transaction.FAULT_HOOK = None
    fresh = Setup("ddp", seed=4)
    fresh.load(root)
    return {
        "at_call": at_call,
        "loaded": params(fresh.model),
        "now": params(s.model),
        "writing_when_updated": writing_when_updated and bool(released),
    }


def async_error_surfaces(root: str, victim: int, at: str) -> str:
    """The writer thread of rank ``victim`` fails; the error must come out of ``wait()``
    (``at="wait"``) or of the next save (``at="next"``) on every rank."""
    rank = plait.world().rank
    if rank == victim:

        def fail(name: str) -> None:
            if name == "write":
                raise OSError(28, "No space left on device (injected)")

        transaction.FAULT_HOOK = fail
    try:
        handle = checkpoint.save(root, {"x": torch.ones(3)}, step=1, async_=True)
        if at == "wait":
            handle.wait()
        else:
            while not handle.done():  # the writer has met (and raised at) the fault point
                time.sleep(0.01)
            transaction.FAULT_HOOK = None
            checkpoint.save(root, {"x": torch.ones(3)}, step=2)
    except checkpoint.CheckpointError as exc:
        return str(exc)
    finally:
        transaction.FAULT_HOOK = None
    return "no error"


def simple_form(directory: str) -> tuple[bool, list[str]]:
    """The simple form: each rank saves its own dict and reads it back."""
    world = plait.world()
    model = Net()
    ddp = plait.DistributedDataParallel(model)
    state = {
        "rank": torch.tensor([world.rank]),
        "weights": model.fc1.weight.detach() * world.rank,
        "meta": {"epoch": 3, "pair": (1, 2)},
    }
    checkpoint.save(directory, state)
    back = checkpoint.load(directory)
    same = (
        torch.equal(back["rank"], state["rank"])
        and torch.equal(back["weights"], state["weights"])
        and back["meta"] == {"epoch": 3, "pair": (1, 2)}
    )
    return same, sorted(checkpoint.full_state_dict(ddp))


def corrupt(path: Path, mode: str) -> None:
    """Damage a checkpoint file: flip one byte, truncate it, or delete it."""
    if mode == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) - 5] ^= 0x01
        path.write_bytes(bytes(data))
    elif mode == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif mode == "delete":
        path.unlink()
    else:
        raise ValueError(mode)


def unsavable_state_on_one_rank(root: str, bad_rank: int) -> str:
    """Rank ``bad_rank`` passes a value JSON cannot hold: it raises TypeError, the others a
    CheckpointError naming it (promptly: no rank is left waiting in a collective)."""
    rank = plait.world().rank
    state: dict[str, Any] = {"x": torch.ones(2)}
    if rank == bad_rank:
        state["bad"] = object()
    try:
        checkpoint.save(root, state, step=1)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def _grouped(strategy: str, seed: int, lrs: tuple[float, float]) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    raw = Net()
    weights = [p for n, p in raw.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in raw.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.Adam(
        [{"params": weights, "lr": lrs[0]}, {"params": biases, "lr": lrs[1], "weight_decay": 0.1}]
    )
    return plait.prepare(raw, optimizer, strategy=strategy)


def _group_report(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": params(model),
        "optimizer": named_optimizer_state(model, optimizer),
        "groups": [(g["lr"], g["weight_decay"], len(g["params"])) for g in optimizer.param_groups],
        "names": layout.optimizer_groups(model, optimizer),
    }


def save_param_groups(strategy: str, root: str) -> dict[str, Any]:
    """Two param groups (weights; biases with their own lr and weight decay), 2 steps."""
    model, optimizer = _grouped(strategy, 0, (0.01, 0.02))
    x, y = data()
    for step in range(2):
        optimizer.zero_grad()
        nn.functional.mse_loss(
            model(x[step * 8 : step * 8 + 8]), y[step * 8 : step * 8 + 8]
        ).backward()
        optimizer.step()
    checkpoint.save(root, step=2, model=model, optimizer=optimizer)
    return _group_report(model, optimizer)


def load_param_groups(strategy: str, root: str) -> dict[str, Any]:
    model, optimizer = _grouped(strategy, 1, (0.5, 0.5))
    checkpoint.load(root, model=model, optimizer=optimizer)
    return _group_report(model, optimizer)


# --- byte-range reads and RNG streams at another world size --------------------------------
WIDTH = 256  # two Linear(256, 256): 256 KiB per weight, so slices span many 4 KiB blocks
SMALL_BLOCK = 4096


def _wide(strategy: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    raw = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    optimizer = torch.optim.Adam(raw.parameters(), lr=0.01)
    if strategy == "fsdp":  # a unit per Linear
        return plait.prepare(raw, optimizer, strategy="fsdp", wrap={nn.Linear})
    return plait.prepare(raw, optimizer, strategy=strategy)


def _draws() -> dict[str, Any]:
    """What this rank's torch CPU and Python generators draw next (their states are put
    back afterwards, so drawing does not change them)."""
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    out = {"torch": torch.rand(6), "python": [random.random() for _ in range(3)]}
    torch.set_rng_state(torch_state)
    random.setstate(python_state)
    return out


def save_wide(cases: list[tuple[str, str]], steps: list[int]) -> list[dict[str, Any]]:
    """For each (strategy, root): train, saving after each of ``steps`` (blocks of 4 KiB);
    the dense state saved at each step and what each rank's generators draw next."""
    out = []
    rank = plait.world().rank
    for strategy, root in cases:
        model, optimizer = _wide(strategy, 0)
        torch.manual_seed(100 + rank)  # distinct streams per rank, as dropout would want
        random.seed(200 + rank)
        saved = {}
        for step in steps:
            optimizer.zero_grad()
            model(torch.randn(8, WIDTH)).square().mean().backward()
            optimizer.step()
            checkpoint.save(
                root, step=step, model=model, optimizer=optimizer, block_bytes=SMALL_BLOCK
            )
            saved[step] = {
                "model": params(model),
                "optimizer": named_optimizer_state(model, optimizer),
                "draws": _draws(),
            }
        out.append(saved)
    return out


def load_wide(cases: list[tuple[str, str]], **kwargs: Any) -> list[dict[str, Any]]:
    """For each (strategy, root): a fresh setup loads it; the dense state, the bytes this
    rank read, how its RNG streams were set and what they draw next (or the error)."""
    out = []
    for strategy, root in cases:
        model, optimizer = _wide(strategy, 1)
        torch.manual_seed(999)
        random.seed(999)
        try:
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                restored = checkpoint.load(root, model=model, optimizer=optimizer, **kwargs)
        except checkpoint.CheckpointCorrupt as exc:
            out.append({"error": str(exc)})
            continue
        draws = _draws()
        out.append(
            {
                "step": restored.step,
                "model": params(model),
                "optimizer": named_optimizer_state(model, optimizer),
                "bytes_read": restored.bytes_read,
                "checkpoint_bytes": restored.checkpoint_bytes,
                "rng_source": restored.rng_source,
                "draws": draws,
            }
        )
    return out
