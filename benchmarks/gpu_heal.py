"""The GPU suite's ``healing`` section: healing jobs with the model on the device.

Each job is ``WORLD`` fresh processes (:class:`plait.heal.launch.Ranks`) sharing the
device, a :class:`~plait.heal.trainer.HealingTrainer` each, training a float64 MLP with
Adam on the global batches of :func:`batch` in reproducible mode. The checks:

- ``clean``: the job without a fault, against one process on the CPU on the same global
  batches (:class:`~plait.strategies.reproducible.ReproducibleRunner`): within
  ``FLOAT64_TOL`` (bitwise on the CPU; cuBLAS and the CPU's BLAS may round apart);
- ``zero=Z, slot 1 killed``: slot 1 kills itself (SIGKILL) before its second micro-batch of step
  1; the survivors heal and redo the step; a replacement started by this process as soon
  as slot 1 is gone joins at step 2 (the survivors wait for it there), receives the state
  (the parameters or chunks, the optimizer state, the RNG state of the CPU and of the
  device, the data cursor) on the device, and the job ends at full size: every final
  parameter ``torch.equal`` to the clean job's. ``zero=0`` (replicated optimizer: the
  bucketed exchange during backward, the state transfer), ``zero=1`` (the chunks'
  agreement, gather and re-shard) and ``zero=3`` (FSDP: the parameters freed between
  steps, the reduce-scatter to own + mirror);
- ``ReplicaTrainer``: :data:`REPLICAS` replicas of :data:`PP` pipeline stages of plait's
  GPT (float64) on the device; rank 3 (replica 1's second stage) kills itself in step 1,
  rank 2 leaves with its replica, replica 0 trains on, a replacement replica joins at
  step 2: every rank's dense parameters equal to the job without the fault.

The multi-rank backend is the suite's (``Run.multi_backend``): NCCL where every rank has
a GPU of its own, else gloo carrying CUDA tensors through the host (plait stages a CUDA
message of a gloo group's channel, :mod:`plait.comm.channel`). Every rank reports the
devices of its parameters, which must be the run's device. Only torch and plait are
imported (the lent machine has nothing else).
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

WORLD = 2  # slots of each job (ranks share the one GPU of the lent machine over gloo)
KILL = (1, 1, 5)  # slot, step, micro-batch (global index; slot 1 runs 4-7): the fault
STEPS = 4
BATCH, MICROBATCH = 16, 2  # 8 micro-batches: 4 per slot, a kill in the middle of a block
ZEROS = (0, 1, 3)


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32, dtype=torch.float64), nn.Tanh(), nn.Linear(32, 4, dtype=torch.float64)
    )
    return model.to(device)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (on the CPU; the same for every rank and the oracle)."""
    g = torch.Generator().manual_seed(1000 + step)
    return (
        torch.randn(BATCH, 16, generator=g, dtype=torch.float64),
        torch.randint(0, 4, (BATCH,), generator=g),
    )


def heal_rank(
    *,
    slot: int,
    world: int,
    address: str,
    join: bool,
    device: str,
    backend: str,
    zero: int,
    kill: tuple[int, int, int] | None,
    out: str,
) -> None:
    """One rank of a healing job: train :data:`STEPS` steps on ``device``, killing itself
    at ``kill`` (slot, step, micro-batch) unless it is a replacement; writes its final
    parameters (on the CPU) and what it saw to ``out/slot<k>[-join].pt``."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # run-to-run bitwise cuBLAS
    from plait.heal.trainer import HealingTrainer

    if device.startswith("cuda") and backend == "nccl":
        device = f"cuda:{slot % torch.cuda.device_count()}"
    model = _model(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def fault(step: int, index: int) -> None:
        if not join and kill is not None and (slot, step, index) == tuple(kill):
            os.kill(os.getpid(), signal.SIGKILL)

    trainer = HealingTrainer(
        model,
        optimizer,
        loss_fn=nn.functional.cross_entropy,
        microbatch_size=MICROBATCH,
        world=world,
        address=address,
        slot=slot,
        join=join,
        backend=backend,
        heartbeat_timeout=5.0,
        timeout=60.0,
        connect_timeout=20.0,
        fault=fault,
        zero=zero,
    )
    grown_at = None if kill is None else kill[1] + 1
    while trainer.steps_done < STEPS:
        if trainer.steps_done == grown_at and len(trainer.members) < world:
            trainer.wait_for_replacements(60.0)
        x, y = batch(trainer.steps_done)
        trainer.step(x.to(device), y.to(device))
    trainer.unshard()  # zero=3: the full parameters (collective)
    record = {
        "params": [p.detach().cpu() for p in model.parameters()],
        "devices": sorted({str(p.device.type) for p in model.parameters()}),
        "members": list(trainer.members),
        "heals": [h["kind"] for h in trainer.heals],
        "loss": float(trainer.last_loss),
        "backend": backend,
    }
    torch.save(record, Path(out) / f"slot{slot}{'-join' if join else ''}.pt")
    trainer.close()


def run_job(
    *, device: str, backend: str, zero: int, kill: tuple[int, int, int] | None, timeout: float
) -> dict[str, dict[str, Any]]:
    """Run one job (a replacement for a slot that died, as soon as it is gone); every
    surviving rank's record by name. Every process started is ended before it returns."""
    from plait.heal.launch import Ranks, start_store

    out = tempfile.mkdtemp(prefix="plait-gpu-heal-")
    store, address = start_store()
    kwargs = dict(
        world=WORLD, address=address, device=device, backend=backend, zero=zero, kill=kill, out=out
    )
    start = time.monotonic()
    replaced: set[int] = set()
    with Ranks(preload=(__name__,)) as ranks:
        procs = {s: ranks.spawn(heal_rank, slot=s, join=False, **kwargs) for s in range(WORLD)}
        while time.monotonic() - start < timeout:
            if not any(p.is_alive() for _, p in ranks.started):
                break
            for s, p in list(procs.items()):
                if s not in replaced and not p.is_alive() and p.exitcode:
                    replaced.add(s)
                    procs[s] = ranks.spawn(heal_rank, slot=s, join=True, **kwargs)
            time.sleep(0.05)
        codes = ranks.wait(max(0.0, timeout - (time.monotonic() - start)))
    del store
    records = {f.stem: torch.load(f) for f in sorted(Path(out).glob("slot*.pt"))}
    if set(records) != _expected(kill):
        raise RuntimeError(
            f"healing job (zero={zero}, {backend}, {device}): ranks wrote {sorted(records)}, "
            f"expected {sorted(_expected(kill))}; exit codes per slot {codes}"
        )
    return records


def _expected(kill: tuple[int, int, int] | None) -> set[str]:
    names = {f"slot{s}" for s in range(WORLD)}
    if kill is not None:
        names = (names - {f"slot{kill[0]}"}) | {f"slot{kill[0]}-join"}
    return names


def reference() -> list[torch.Tensor]:
    """The same steps in one process on the CPU (reproducible mode, no strategy)."""
    from plait.strategies.reproducible import ReproducibleRunner

    threads = torch.get_num_threads()
    try:
        model = _model("cpu")
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        runner = ReproducibleRunner(
            model, optimizer, loss_fn=nn.functional.cross_entropy, microbatch_size=MICROBATCH
        )
        for step in range(STEPS):
            runner.step(*batch(step))
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]
    finally:
        torch.set_num_threads(threads)


def max_diff(records: dict[str, dict[str, Any]], ref: list[torch.Tensor]) -> float:
    pairs = [(a, b) for r in records.values() for a, b in zip(r["params"], ref, strict=True)]
    return max(float((a - b).abs().max()) for a, b in pairs)


def bitwise(records: dict[str, dict[str, Any]], ref: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(a, b) for r in records.values() for a, b in zip(r["params"], ref, strict=True)
    )


# --- whole replicas: ReplicaTrainer ------------------------------------------------------
REPLICAS, PP = 2, 2  # 2 replicas of 2 pipeline stages: 4 processes
REPLICA_KILL = (3, 1, 1)  # rank 3 (replica 1's second stage), step 1, its block (1)


def _gpt_config() -> Any:
    from plait.models import GPTConfig

    return GPTConfig(vocab=13, layers=2, heads=4, width=16, seq_len=8, dtype=torch.float64)


def gpt_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 13, (8, 9), generator=g)
    return ids[:, :-1], ids[:, 1:]


def replica_rank(
    *,
    slot: int,
    address: str,
    join: bool,
    device: str,
    backend: str,
    kill: tuple[int, int, int] | None,
    out: str,
) -> None:
    """One rank of a healing PTD-P job with the GPT on ``device``: a replica's rank killed
    at ``kill`` (rank, step, block) leaves its replica to be replaced; writes the dense
    parameters as its replica holds them (``out/rank<k>[-join].pt``)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from plait.heal.replicas import ReplicaLost, ReplicaTrainer
    from plait.models import GPT
    from plait.strategies.compose import compose

    if device.startswith("cuda") and backend == "nccl":
        device = f"cuda:{slot % torch.cuda.device_count()}"

    def build(mesh: Any) -> Any:
        model = GPT(_gpt_config()).to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        return compose(model, optimizer, mesh=mesh, microbatches=2)

    def fault(step: int, index: int) -> None:
        if not join and kill is not None and (slot, step, index) == tuple(kill):
            os.kill(os.getpid(), signal.SIGKILL)

    trainer = ReplicaTrainer(
        build,
        replica={"pp": PP},
        world=REPLICAS * PP,
        address=address,
        rank=slot,
        join=join,
        backend=backend,
        heartbeat_timeout=5.0,
        timeout=60.0,
        connect_timeout=20.0,
        fault=fault,
    )
    grown_at = None if kill is None else kill[1] + 1
    try:
        while trainer.steps_done < STEPS:
            if trainer.steps_done == grown_at and len(trainer.members) < REPLICAS * PP:
                trainer.wait_for_replacements(60.0)
            x, y = gpt_batch(trainer.steps_done)
            trainer.step(x.to(device), y.to(device))
    except ReplicaLost:  # this rank's replica lost a rank: it leaves (exit 1)
        raise SystemExit(1) from None
    dense = trainer.model.full_state_dict()  # collective over the replica's mesh
    record = {
        "params": [v.detach().cpu() for _, v in sorted(dense.items())],
        "devices": sorted({p.device.type for p in trainer.params}),
        "members": list(trainer.members),
        "heals": [h["kind"] for h in trainer.heals],
    }
    torch.save(record, Path(out) / f"rank{slot}{'-join' if join else ''}.pt")
    trainer.close()


def run_replica_job(
    *, device: str, backend: str, kill: tuple[int, int, int] | None, timeout: float
) -> dict[str, dict[str, Any]]:
    """Run one PTD-P job (a lost replica restarted whole, as soon as every rank of it is
    gone); every rank's record that trained to the end, by name."""
    from plait.heal.launch import Ranks, start_store

    out = tempfile.mkdtemp(prefix="plait-gpu-heal-ptdp-")
    store, address = start_store()
    kwargs = dict(address=address, device=device, backend=backend, kill=kill, out=out)
    start = time.monotonic()
    replaced: set[int] = set()
    with Ranks(preload=(__name__,)) as ranks:
        world = REPLICAS * PP
        procs = {s: ranks.spawn(replica_rank, slot=s, join=False, **kwargs) for s in range(world)}
        while time.monotonic() - start < timeout:
            if not any(p.is_alive() for _, p in ranks.started):
                break
            for r in range(REPLICAS):
                slots = range(r * PP, (r + 1) * PP)
                gone = all(not procs[s].is_alive() for s in slots)
                if r not in replaced and gone and any(procs[s].exitcode for s in slots):
                    replaced.add(r)
                    for s in slots:
                        procs[s] = ranks.spawn(replica_rank, slot=s, join=True, **kwargs)
            time.sleep(0.05)
        codes = ranks.wait(max(0.0, timeout - (time.monotonic() - start)))
    del store
    records = {f.stem: torch.load(f) for f in sorted(Path(out).glob("rank*.pt"))}
    lost = set() if kill is None else set(range(kill[0] // PP * PP, (kill[0] // PP + 1) * PP))
    expected = {f"rank{s}{'-join' if s in lost else ''}" for s in range(REPLICAS * PP)}
    if set(records) != expected:
        raise RuntimeError(
            f"healing PTD-P job ({backend}, {device}): ranks wrote {sorted(records)}, "
            f"expected {sorted(expected)}; exit codes per rank {codes}"
        )
    return records
