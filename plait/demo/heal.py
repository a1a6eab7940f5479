"""``plait demo -n 4 --reproducible --check --kill-rank 2 --kill-step 3``: training that
heals, shown end to end.

The launching process hosts the store and starts ``n`` ranks (fresh processes). Rank
``--kill-rank`` kills itself with SIGKILL in the middle of step ``--kill-step`` (after its
first micro-batch); the survivors heal and redo the step at ``n - 1``; a replacement
started by this process as soon as the rank is gone joins at a step boundary (unless
``--no-rejoin``), receives the state from a live peer and training ends at full size.
``--check`` trains the same global batches in this process (``strategy="none"`` in
reproducible mode, :class:`~plait.strategies.reproducible.ReproducibleRunner`) and prints
the largest difference of any parameter on any rank: ``max diff 0 (bitwise)``.

:func:`train_rank` is what each rank runs (the fault tests run it too).
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
from torch import nn

from plait.demo.digits import load_digits
from plait.heal.fsdp import ShardedParams
from plait.heal.launch import Ranks, start_store
from plait.heal.trainer import ARRIVED, HealingTrainer
from plait.models.cnn import DigitsCNN
from plait.plan.memory import measure
from plait.strategies.reproducible import ReproducibleRunner


@dataclass
class HealConfig:
    """One healing run. ``faults``: ``[slot, step, index, how]``: slot ``slot`` dies
    (``how``: ``"kill"`` SIGKILL, ``"raise"`` an exception, ``"stop"`` SIGSTOP: frozen
    past the heartbeat; it is never replaced, the run ends it) before micro-batch ``index`` of
    step ``step`` (``index`` -1: when it starts healing; -2 with step -1: a replacement on
    arrival; -3 under zero: before gathering the chunks; -4 under zero=3: in the exchange,
    its chunk summed, before sending it to its mirror); an optional fifth element
    ``[other, at]`` holds the fault until slot ``other`` started step ``at``. ``rejoin``:
    start a replacement for each slot that died, as soon as it is gone (``rejoin_faults``:
    faults of the replacements)."""

    world: int = 4
    steps: int = 6
    batch: int = 32
    microbatch: int = 4
    lr: float = 1e-2
    seed: int = 0
    model: str = "mlp"  # "mlp" (float64, synthetic data) or "cnn" (the digits CNN, float32)
    reproducible: bool = True
    faults: list[list[Any]] = field(default_factory=list)
    rejoin: bool = True
    rejoin_faults: list[list[Any]] = field(default_factory=list)
    heartbeat_timeout: float = 5.0  # plait's default; a local death is seen at once (pid)
    connect_timeout: float = 5.0
    timeout: float = 60.0
    pace: float = 0.0  # seconds of sleep per micro-batch (the benchmark's slower steps)
    rejoin_step: int = -1  # the survivors wait for their replacements at this step (-1: no)
    zero: int = 0  # 1 or 2: sharded optimizer state, mirrored on the ring neighbour; 3: the
    # parameters sharded too (FSDP), freed between steps
    bucket_mb: float = 25.0  # the exchange's bucket size (reproducible mode)
    wrap: str | None = "children"  # zero=3: one unit at a time; None: the whole model


def _model(c: HealConfig) -> nn.Module:
    torch.manual_seed(c.seed)
    if c.model == "cnn":
        return DigitsCNN()
    return nn.Sequential(
        nn.Linear(16, 32, dtype=torch.float64), nn.Tanh(), nn.Linear(32, 4, dtype=torch.float64)
    )


_DIGITS: tuple[torch.Tensor, torch.Tensor] | None = None


def batch(c: HealConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the same on every rank and in the reference)."""
    global _DIGITS
    if c.model == "cnn":
        if _DIGITS is None:
            x, y, _, _ = load_digits(c.seed)
            _DIGITS = (x, y)
        x, y = _DIGITS
        per_epoch = x.shape[0] // c.batch
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(c.seed + epoch))
        rows = order[i * c.batch : (i + 1) * c.batch]
        return x[rows], y[rows]
    g = torch.Generator().manual_seed(1000 * c.seed + step)
    return (
        torch.randn(c.batch, 16, generator=g, dtype=torch.float64),
        torch.randint(0, 4, (c.batch,), generator=g),
    )


def _optimizer(c: HealConfig, model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=c.lr)


def _flat(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()]).numpy()


def _fault(c: HealConfig, slot: int, faults: list[list[Any]], out: str) -> Any:
    """This slot's fault hook (None: none to strike, nothing to mark). A fault's optional
    fifth element ``[other, at]`` holds it until slot ``other`` has started step ``at``
    (that slot's hook marks it in ``out``): a fault forced after a peer's progress."""
    mine = [(f[1], f[2], f[3], f[4] if len(f) > 4 else None) for f in faults if f[0] == slot]
    marks = {f[4][1] for f in faults if len(f) > 4 and f[4][0] == slot}
    if not mine and not marks:
        return None

    def fault(step: int, index: int) -> None:
        if step in marks and index >= 0:
            (Path(out) / f"started-{slot}-{step}.txt").touch()
        for at, where, how, after in mine:
            if (step, index) == (at, where) or (index == ARRIVED and where == ARRIVED):
                if after is not None:
                    _await(Path(out) / f"started-{after[0]}-{after[1]}.txt", c.timeout)
                # when the fault struck, for the fault-to-training-again time (benchmarks)
                (Path(out) / f"fault-{slot}-{step}.txt").write_text(repr(time.time()))
                if how == "raise":
                    raise RuntimeError(f"slot {slot}: the fault asked for at step {step}")
                os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        if index >= 0 and c.pace:
            time.sleep(c.pace)

    return fault


def _await(mark: Path, timeout: float) -> None:
    start = time.monotonic()
    while not mark.exists():
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"healing demo: {mark.name} did not appear in {timeout:g} s")
        time.sleep(0.01)


def train_rank(
    *, slot: int, world: int, address: str, join: bool, config: dict[str, Any], out: str
) -> None:
    """One rank of a healing run: train ``config.steps`` steps, write its final parameters
    (``slot<k>[-join].npy``) and its healing records (``.json``) under ``out``."""
    c = HealConfig(**config)
    model = _model(c)
    optimizer = _optimizer(c, model)
    faults = c.rejoin_faults if join else c.faults
    fault = _fault(c, slot, faults, out)
    if fault is None and c.pace:

        def fault(step: int, index: int) -> None:  # noqa: ARG001
            if index >= 0:
                time.sleep(c.pace)

    trainer = HealingTrainer(
        model,
        optimizer,
        loss_fn=nn.functional.cross_entropy,
        microbatch_size=c.microbatch,
        world=world,
        address=address,
        slot=slot,
        join=join,
        reproducible=c.reproducible,
        heartbeat_timeout=c.heartbeat_timeout,
        timeout=c.timeout,
        connect_timeout=c.connect_timeout,
        fault=fault,
        zero=c.zero,
        bucket_mb=c.bucket_mb,
        wrap=c.wrap if c.zero == 3 else "children",
    )
    started = time.perf_counter()
    steps: list[float] = []
    peaks: list[int] = []  # zero=3: the most parameter bytes held in each step
    while trainer.steps_done < c.steps:
        if trainer.steps_done == c.rejoin_step and len(trainer.members) < world:
            trainer.wait_for_replacements(c.timeout)
        t0 = time.perf_counter()
        if isinstance(trainer.sharded, ShardedParams):
            trainer.sharded.peak = 0
        trainer.step(*batch(c, trainer.steps_done))
        steps.append(time.perf_counter() - t0)
        peaks.append(getattr(trainer.sharded, "peak", 0))
    held = measure(trainer.sharded or model, optimizer)  # at rest: before unshard
    trainer.unshard()  # zero=3: the full parameters, to save them (collective)
    name = f"slot{slot}{'-join' if join else ''}"
    np.save(Path(out) / f"{name}.npy", _flat(model))
    record = {
        "slot": slot,
        "join": join,
        "heals": trainer.heals,
        "members": list(trainer.members),
        "seconds": time.perf_counter() - started,
        "step_seconds": steps,
        "peaks": peaks,
        "loss": float(trainer.last_loss),
        "returned": trainer.returned,
        "held": {"params": held.params_bytes, "optimizer": held.optimizer_bytes},
        # the last generation's messages to the members on this host: shared memory?
        "shared_memory": trainer.group is not None and trainer.group.shm is not None,
    }
    (Path(out) / f"{name}.json").write_text(json.dumps(record))
    trainer.close()


def reference(c: HealConfig) -> np.ndarray:
    """The same steps in this process: reproducible mode, no strategy (one process)."""
    threads = torch.get_num_threads()
    try:
        model = _model(c)
        optimizer = _optimizer(c, model)
        runner = ReproducibleRunner(
            model, optimizer, loss_fn=nn.functional.cross_entropy, microbatch_size=c.microbatch
        )
        for step in range(c.steps):
            runner.step(*batch(c, step))
            optimizer.step()
        return _flat(model)
    finally:
        torch.set_num_threads(threads)


@dataclass
class HealReport:
    finals: dict[str, np.ndarray]
    records: list[dict[str, Any]]
    codes: dict[int, list[int | None]]
    seconds: float


def run(c: HealConfig, out: str, *, deadline: float = 120.0) -> HealReport:
    """Run the job (module docstring); returns every surviving rank's final parameters and
    records. Every process started is ended before it returns."""
    os.makedirs(out, exist_ok=True)
    store, address = start_store()
    kwargs = {"world": c.world, "address": address, "config": asdict(c), "out": out}
    start = time.monotonic()
    dead: set[int] = set()
    with Ranks(preload=(__name__,)) as ranks:
        procs = {s: ranks.spawn(train_rank, slot=s, join=False, **kwargs) for s in range(c.world)}
        while time.monotonic() - start < deadline:
            running = [p for _, p in ranks.started if p.is_alive() and not _stopped(p.pid)]
            if not running:
                break
            if c.rejoin:
                for s, p in list(procs.items()):
                    if s not in dead and not p.is_alive() and p.exitcode:
                        dead.add(s)
                        procs[s] = ranks.spawn(train_rank, slot=s, join=True, **kwargs)
            time.sleep(0.05)
        left = [p for _, p in ranks.started if p.is_alive() and not _stopped(p.pid)]
        codes = ranks.wait(max(0.0, deadline - (time.monotonic() - start)) if left else 0.0)
    del store
    finals, records = {}, []
    for f in sorted(Path(out).glob("slot*.npy")):
        finals[f.stem] = np.load(f)
        records.append(json.loads(f.with_suffix(".json").read_text()))
    return HealReport(finals, records, codes, time.monotonic() - start)


def _stopped(pid: int | None) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def max_diff(report: HealReport, ref: np.ndarray) -> float:
    return max(float(np.abs(v - ref).max()) for v in report.finals.values())


ZERO = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}  # --strategy -> zero


def main(args: Any) -> int:
    """``plait demo --kill-rank R --kill-step S`` (see the module docstring): the digits
    CNN (float32) on ``-n`` slots under healing DDP (``--strategy zero1/zero2``: sharded
    optimizer state; ``zero3``/``fsdp``: the parameters sharded too); 0 when it healed
    and, with ``--check``, matched one process (bitwise with ``--reproducible``)."""
    if args.pp > 1 or (args.tp or 1) > 1:  # model-parallel replicas (the dp of PTD-P)
        from plait.demo import heal_replicas  # deferred: only this demo needs it

        return heal_replicas.main(args)
    n = args.nproc or 4
    bad = []
    if args.strategy not in ZERO:
        bad.append(
            f"--strategy {args.strategy}: healing runs ddp, zero1, zero2 and zero3/fsdp; "
            f"{args.strategy} is not healed (docs/healing.md)"
        )
    if args.model != "cnn":
        bad.append("--model gpt: the healing demo trains the digits CNN")
    if not 0 <= args.kill_rank < n:
        bad.append(f"--kill-rank {args.kill_rank}: must be a rank in 0..{n - 1}")
    if n < 2 or n & (n - 1):
        bad.append(f"-n {n}: healing splits the tree into n blocks, a power of two >= 2")
    batch = args.batch_size or 64
    m = args.microbatch_size or 8
    steps = (args.epochs or 1) * (1437 // batch)
    if args.kill_step is None or not 0 <= args.kill_step < steps:
        bad.append(f"--kill-step {args.kill_step}: a step in 0..{steps - 1}")
    if bad:
        print("plait demo: " + "; ".join(bad), file=sys.stderr)
        return 2
    per = (batch // m) // n
    c = HealConfig(
        world=n,
        steps=steps,
        batch=batch,
        microbatch=m,
        lr=args.lr or 1e-3,
        seed=args.seed,
        model="cnn",
        reproducible=args.reproducible,
        faults=[[args.kill_rank, args.kill_step, args.kill_rank * per + min(1, per - 1), "kill"]],
        rejoin=not args.no_rejoin,
        rejoin_step=-1 if args.no_rejoin else min(steps - 1, args.kill_step + 2),
        zero=ZERO[args.strategy],
    )
    out = tempfile.mkdtemp(prefix="plait-heal-")
    print(
        f"plait demo: {n} ranks train the digits CNN ({steps} steps of {batch} samples, "
        f"micro-batches of {m}); rank {args.kill_rank} is killed (SIGKILL) in step "
        f"{args.kill_step}" + ("" if args.no_rejoin else "; a replacement joins")
    )
    report = run(c, out, deadline=300.0)
    ok = True
    for r in report.records:
        for h in r["heals"]:
            if r["slot"] == min(x["slot"] for x in report.records):
                print(
                    f"  {h['kind']}: ranks {h['from']} -> {h['to']} at step {h['at_step']} in "
                    f"{h['seconds']:.2f} s" + (f" ({h['cause'][:90]}...)" if h["cause"] else "")
                )
    sizes = sorted({len(r["members"]) for r in report.records})
    healed = any(h["kind"] == "shrink" for r in report.records for h in r["heals"])
    print(
        f"plait demo: {'healed' if healed else 'did NOT heal'}; {len(report.finals)} ranks "
        f"finished at size {sizes} in {report.seconds:.1f} s"
    )
    ok = healed and len(report.finals) >= n - 1
    if args.check:
        ref = reference(c)
        diff = max_diff(report, ref) if report.finals else float("inf")
        if args.reproducible:
            verdict = "bitwise" if diff == 0 else "NOT bitwise"
            ok = ok and diff == 0
        else:
            verdict = "float32 sums in another order: not promised bitwise"
            ok = ok and diff < 1e-3
        print(f"plait demo: --check against one process: max diff {diff:g} ({verdict})")
    return 0 if ok else 1
