"""A healing PTD-P job end to end: ``R`` replicas of plait's GPT, each a ``pp x tp`` mesh
of its own, one rank killed, its replica replaced (:mod:`plait.heal.replicas`).

``plait demo -n 4 --pp 2 --check --kill-rank 3 --kill-step 2`` runs it: two replicas of
two pipeline stages; rank 3 (replica 1's second stage) kills itself at step 2, rank 2 (its
first stage) finds its replica lost and leaves, replica 0 trains on alone (both blocks of
the global batch), a replacement replica (two new processes) joins at a step boundary and
the job ends at full size. ``--check``
compares the final parameters with the same job run without the fault (``max diff 0
(bitwise)``) and with one process training the dense GPT on the same global batches
(float64: within rounding, the layouts differ).

:func:`train_rank` is what each rank runs (the tests run it too).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from plait.demo.heal import _stopped
from plait.heal.launch import Ranks, start_store
from plait.heal.replicas import ReplicaLost, ReplicaTrainer
from plait.heal.trainer import ARRIVED
from plait.models import GPT, GPTConfig
from plait.models.gpt import MoEConfig
from plait.prepare import prepare
from plait.strategies.reproducible.tree import tree_sum


@dataclass
class ReplicaConfig:
    """One healing PTD-P run: ``replicas`` replicas of ``pp x tp`` ranks; ``faults``:
    ``[rank, step, block, how]`` (``how``: ``"kill"``, ``"raise"`` or ``"stop"``: SIGSTOP,
    frozen past the heartbeat, never replaced, ended by the run; ``block`` -2 with step -1:
    a replacement on arrival); ``rejoin``: start a replacement replica once every
    rank of a lost one is gone (``rejoin_faults``: faults of the replacements)."""

    replicas: int = 2
    pp: int = 2
    tp: int = 1
    ep: int = 1  # > 1: the GPT's second block is a MoE of 4 experts split over ep
    cp: int = 1  # > 1: every sequence split over cp ranks (ring attention)
    steps: int = 5
    batch: int = 8
    microbatches: int = 2  # per block (each replica's share of the global batch)
    lr: float = 1e-2
    faults: list[list[Any]] = field(default_factory=list)
    rejoin: bool = True
    rejoin_faults: list[list[Any]] = field(default_factory=list)
    rejoin_step: int = -1  # the survivors wait for their replacements at this step (-1: no)
    heartbeat_timeout: float = 5.0
    connect_timeout: float = 10.0
    timeout: float = 60.0
    width: int = 16  # the GPT's (benchmarks/heal_replicas.py trains a larger one)
    layers: int = 2
    seq_len: int = 8
    dtype: str = "float64"

    @property
    def size(self) -> int:
        return self.pp * self.tp * self.ep * self.cp

    @property
    def shape(self) -> dict[str, int]:
        """One replica's mesh dimensions."""
        extra = {d: n for d, n in (("ep", self.ep), ("cp", self.cp)) if n > 1}
        return {"pp": self.pp, "tp": self.tp, **extra}

    @property
    def world(self) -> int:
        return self.replicas * self.size


def gpt_config(c: ReplicaConfig) -> GPTConfig:
    """The job's GPT: by default small, in float64 (2 blocks = 4 pipeline layers, 4 heads
    of width 4, vocabulary 13); with ``ep > 1`` its second block a MoE of 4 experts, top-2
    with every second choice kept (no random draw: a block's routing is the same whoever
    computes it) and room for every token."""
    experts = (
        MoEConfig(num_experts=4, top_k=2, capacity_factor=4.0, second_expert="all", seed=7)
        if c.ep > 1
        else None
    )
    return GPTConfig(
        moe=experts,
        vocab=13,
        layers=c.layers,
        heads=4,
        width=c.width,
        seq_len=c.seq_len,
        dtype=getattr(torch, c.dtype),
    )


def batch(c: ReplicaConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the same on every rank and in the reference)."""
    g = torch.Generator().manual_seed(100 + step)
    cfg = gpt_config(c)
    ids = torch.randint(0, cfg.vocab, (c.batch, cfg.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _build(c: ReplicaConfig) -> Any:
    def build(mesh: Any) -> Any:
        model = GPT(gpt_config(c))  # the config's seed: the same weights on every rank
        optimizer = torch.optim.Adam(model.parameters(), lr=c.lr)
        ptdp, _ = prepare(
            model, optimizer, strategy="ptdp", mesh=mesh, microbatches=c.microbatches
        )  # the plans of the model's family (and cp's position module)
        return ptdp

    return build


def _fault(rank: int, faults: list[list[Any]], out: str) -> Any:
    mine = [(f[1], f[2], f[3]) for f in faults if f[0] == rank]
    if not mine:
        return None

    def fault(step: int, index: int) -> None:
        for at, where, how in mine:
            if (step, index) == (at, where) or (index == ARRIVED and where == ARRIVED):
                (Path(out) / f"fault-{rank}-{step}.txt").write_text(repr(time.time()))
                if how == "raise":
                    raise RuntimeError(f"rank {rank}: the fault asked for at step {step}")
                os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)

    return fault


def train_rank(*, slot: int, address: str, join: bool, config: dict[str, Any], out: str) -> None:
    """One rank of the job: train, then write its final parameters (the dense GPT's state
    as this rank's replica holds it, ``rank<k>[-join].npy``) and its records (``.json``)."""
    c = ReplicaConfig(**config)
    trainer = ReplicaTrainer(
        _build(c),
        replica=c.shape,
        world=c.world,
        address=address,
        rank=slot,
        join=join,
        heartbeat_timeout=c.heartbeat_timeout,
        timeout=c.timeout,
        connect_timeout=c.connect_timeout,
        fault=_fault(slot, c.rejoin_faults if join else c.faults, out),
    )
    started = time.perf_counter()
    losses, seconds = [], []
    try:
        while trainer.steps_done < c.steps:
            if trainer.steps_done == c.rejoin_step and len(trainer.members) < c.world:
                trainer.wait_for_replacements(c.timeout)
            t0 = time.perf_counter()
            losses.append(float(trainer.step(*batch(c, trainer.steps_done))))
            seconds.append(time.perf_counter() - t0)
    except ReplicaLost as exc:  # this rank's replica lost a rank: it leaves (exit 1)
        print(f"rank {slot}: {str(exc)[:160]}...", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    dense = trainer.model.full_state_dict()  # collective over the replica's mesh
    name = f"rank{slot}{'-join' if join else ''}"
    flat = torch.cat([v.reshape(-1).double() for _, v in sorted(dense.items())])
    np.save(Path(out) / f"{name}.npy", flat.numpy())
    record = {
        "rank": slot,
        "join": join,
        "heals": trainer.heals,
        "members": list(trainer.members),
        "losses": losses,
        "step_seconds": seconds,
        "seconds": time.perf_counter() - started,
    }
    (Path(out) / f"{name}.json").write_text(json.dumps(record))
    trainer.close()


def reference(c: ReplicaConfig) -> np.ndarray:
    """One process, the dense GPT: each step the mean over the ``R`` blocks of each
    block's mean-loss gradient (summed along the tree over blocks), then Adam."""
    model = GPT(gpt_config(c))
    optimizer = torch.optim.Adam(model.parameters(), lr=c.lr)
    rows = c.batch // c.replicas
    for step in range(c.steps):
        x, y = batch(c, step)
        parts = []
        for v in range(c.replicas):
            optimizer.zero_grad(set_to_none=True)
            logits = model(x[v * rows : (v + 1) * rows])
            F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y[v * rows : (v + 1) * rows].reshape(-1)
            ).backward()
            parts.append([_grad(p) for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = tree_sum([g[i] for g in parts]) / c.replicas
        optimizer.step()
    state = model.state_dict()
    return torch.cat([v.reshape(-1).double() for _, v in sorted(state.items())]).numpy()


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad.clone() if p.grad is not None else torch.zeros_like(p)


@dataclass
class ReplicaReport:
    finals: dict[str, np.ndarray]
    records: list[dict[str, Any]]
    codes: dict[int, list[int | None]]
    seconds: float


def run(c: ReplicaConfig, out: str, *, deadline: float = 180.0) -> ReplicaReport:
    """Run the job; returns every rank's final parameters and records that trained to the
    end. Every process started is ended before it returns."""
    os.makedirs(out, exist_ok=True)
    store, address = start_store()
    kwargs = {"address": address, "config": asdict(c), "out": out}
    start = time.monotonic()
    with Ranks(preload=(__name__,)) as ranks:
        procs = {s: ranks.spawn(train_rank, slot=s, join=False, **kwargs) for s in range(c.world)}
        replaced: set[int] = set()
        while time.monotonic() - start < deadline:
            if not any(p.is_alive() and not _stopped(p.pid) for _, p in ranks.started):
                break
            if c.rejoin:  # a lost replica whose every rank is gone: start it again, whole
                for r in range(c.replicas):
                    slots = range(r * c.size, (r + 1) * c.size)
                    gone = all(not procs[s].is_alive() or _stopped(procs[s].pid) for s in slots)
                    failed = any(procs[s].exitcode or _stopped(procs[s].pid) for s in slots)
                    if r not in replaced and gone and failed:
                        replaced.add(r)
                        for s in slots:
                            procs[s] = ranks.spawn(train_rank, slot=s, join=True, **kwargs)
            time.sleep(0.05)
        left = [p for _, p in ranks.started if p.is_alive() and not _stopped(p.pid)]
        codes = ranks.wait(max(0.0, deadline - (time.monotonic() - start)) if left else 0.0)
    del store
    finals, records = {}, []
    for f in sorted(Path(out).glob("rank*.npy")):
        finals[f.stem] = np.load(f)
        records.append(json.loads(f.with_suffix(".json").read_text()))
    return ReplicaReport(finals, records, codes, time.monotonic() - start)


def main(args: Any) -> int:
    """``plait demo -n N --pp P [--tp T] --kill-rank R --kill-step S [--check]``: the job
    of the module docstring; 0 when it healed and, with ``--check``, ended bitwise equal to
    the uninterrupted job (and within float64 rounding of one process)."""
    n, pp, tp = args.nproc or 4, args.pp, args.tp or 1
    size = pp * tp
    replicas = n // size if n % size == 0 else 0
    steps = args.steps or 6
    bad = []
    if replicas < 2 or replicas & (replicas - 1):
        bad.append(
            f"-n {n} with --pp {pp} --tp {tp}: {n} ranks in replicas of {size} must make a "
            f"power of two >= 2 replicas (the tree's blocks)"
        )
    if not 0 <= args.kill_rank < n:
        bad.append(f"--kill-rank {args.kill_rank}: must be a rank in 0..{n - 1}")
    if args.kill_step is None or not 0 <= args.kill_step < steps - 1:
        bad.append(f"--kill-step {args.kill_step}: a step in 0..{steps - 2} (--steps {steps})")
    if bad:
        print("plait demo: " + "; ".join(bad), file=sys.stderr)
        return 2
    victim = args.kill_rank // size
    c = ReplicaConfig(
        replicas=replicas,
        pp=pp,
        tp=tp,
        steps=steps,
        batch=4 * replicas,
        faults=[[args.kill_rank, args.kill_step, victim, "kill"]],
        rejoin=not args.no_rejoin,
        rejoin_step=-1 if args.no_rejoin else min(steps - 1, args.kill_step + 2),
    )
    print(
        f"plait demo: {replicas} replicas of plait's GPT, each pp={pp} x tp={tp} "
        f"({n} ranks, float64, {steps} steps); rank {args.kill_rank} (replica {victim}) is "
        f"killed (SIGKILL) in step {args.kill_step}"
        + ("" if args.no_rejoin else "; a replacement replica joins")
    )
    report = run(c, tempfile.mkdtemp(prefix="plait-heal-ptdp-"), deadline=300.0)
    first = min(report.records, key=lambda r: (r["join"], r["rank"])) if report.records else None
    for h in first["heals"] if first else []:
        print(
            f"  {h['kind']}: ranks {h['from']} -> {h['to']} at step {h['at_step']} in "
            f"{h['seconds']:.2f} s" + (f" ({h['cause'][:90]}...)" if h["cause"] else "")
        )
    healed = any(h["kind"] == "shrink" for r in report.records for h in r["heals"])
    sizes = sorted({len(r["members"]) for r in report.records})
    print(
        f"plait demo: {'healed' if healed else 'did NOT heal'}; {len(report.finals)} ranks "
        f"finished at size {sizes} in {report.seconds:.1f} s"
    )
    ok = healed and len(report.finals) >= n - size
    if args.check:
        clean = ReplicaConfig(replicas=replicas, pp=pp, tp=tp, steps=steps, batch=c.batch)
        clean.rejoin = False
        whole = run(clean, tempfile.mkdtemp(prefix="plait-heal-ptdp-clean-"), deadline=300.0)
        base = next(iter(whole.finals.values()), None)
        diff = (
            max(float(np.abs(v - base).max()) for v in report.finals.values())
            if base is not None and report.finals
            else float("inf")
        )
        one = float(np.abs(base - reference(c)).max()) if base is not None else float("inf")
        print(
            f"plait demo: --check against the uninterrupted job: max diff {diff:g} "
            f"({'bitwise' if diff == 0 else 'NOT bitwise'}); that job against one process: "
            f"{one:.1e} (float64, another layout's rounding)"
        )
        ok = ok and diff == 0 and one < 1e-10
    return 0 if ok else 1
