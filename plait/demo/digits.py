"""``plait demo``: train a small CNN on handwritten digits with N local ranks.

The data are the 8x8 digits that ship inside scikit-learn (1797 images, no download),
split 80/20 into train and test with a fixed seed. The model is the CNN of the seeds
(conv, conv, pool, fc, fc). Every epoch all ranks shuffle the training set the same way
(:meth:`plait.data.DistributedSampler.global_order`) and cut it into global batches of
``batch_size`` samples (the incomplete last one is dropped); each training rank keeps its
rows of every global batch through :func:`plait.data.split_batch` and scales its mean
loss by the returned weight, so the batch need not divide evenly among the ranks. Each
rank trains under the chosen strategy through :func:`plait.prepare` and records a
timeline. The leading rank shows a tqdm progress bar when its output is a terminal (one
line per epoch otherwise, so logs hold no carriage returns) and per-epoch loss,
throughput and test accuracy. At the end the parent writes ``runs/<name>/``:
``report.json``, ``trace.json`` (chrome://tracing or Perfetto) and ``curves.png`` (loss and
accuracy against time).

Options are checked by :func:`validate` before any rank starts; a bad one raises
:class:`DemoOptionError`, one line naming the option and its valid range.

``--reproducible`` trains in layout-invariant mode (:mod:`plait.strategies.reproducible`):
each global batch is cut into micro-batches of ``--microbatch-size`` samples whose
gradients are summed along one fixed tree, so ``--check`` (one process on the same
micro-batches) must find a largest difference of exactly 0, for any ``-n``, strategy
(ddp, zero1, zero2, zero3/fsdp), algorithm and transport.

Without it, ``--check`` also trains the same model in this process in float64 on the
global batches and compares the run with it, against a bound that holds on any CPU: with
``dtype="float64"`` rounding stays far below :data:`FLOAT64_BOUND` (the largest parameter
difference at the end) over any run. In float32 the training amplifies rounding
chaotically (a ReLU or a max-pool tie that flips kicks the trajectory): after 10 epochs one
process summed in another order lands up to 13% of the way training moved from float64,
as far as a run whose one rank scales its gradient by 1.01; after the first epoch it lands
within 1.4e-6 and that run at 1.6e-2. So float32 compares the parameters after the first
epoch (:func:`judge`): their L2 distance to float64, relative to how far training moved
them (:mod:`plait.demo.closeness`), within :data:`NOISE_FACTOR` times the distance
float32 in one process lands at (:func:`float32_noise`, measured in the run).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import plait
from plait import checkpoint, comm
from plait.data import DistributedSampler, split_batch
from plait.demo.closeness import distance, max_diff, one_thread
from plait.extras import require
from plait.models import DigitsCNN
from plait.strategies.ps import ps_of
from plait.strategies.reproducible import LayoutError, ReproducibleRunner, microbatch_count
from plait.trace import Span, Tracer, overlap_report, write_chrome

#: Training samples: 80% of scikit-learn's 1797 digits (``load_digits`` checks it).
TRAIN_SAMPLES = 1437
STRATEGIES = ("ddp", "naive", "zero1", "zero2", "zero3", "fsdp", "ps", "none")
PS_MODES = ("sync", "async", "ssp")
DTYPES = ("float32", "float64")
#: ``--check`` in float64: the largest parameter difference rounding explains (observed
#: about 1e-15 after 3 epochs; float32 rounding amplified the same way reaches 1e-1)
FLOAT64_BOUND = 1e-9
#: ``--check`` in float32: how many times farther from one process in float64 than float32
#: in one process lands the run may land (parameters, relative to how far they moved; the
#: measurements that justify it: docs/index.md)
NOISE_FACTOR = 10.0


#: The strategies ``--reproducible`` supports (plait.strategies.reproducible.runner)
REPRODUCIBLE = ("ddp", "zero1", "zero2", "zero3", "fsdp", "none")


class DemoOptionError(ValueError):
    """A demo option outside its valid range; the message is one line naming it."""


@dataclass(frozen=True)
class DemoConfig:
    world_size: int = 4
    strategy: str = "ddp"
    epochs: int = 10
    batch_size: int = 64  # global: every step consumes this many samples in all
    lr: float = 0.05
    algorithm: str = "auto"
    bucket_mb: float = 25.0
    seed: int = 0
    name: str = ""
    # --strategy ps: servers are ranks 0..servers-1, the others workers
    ps_mode: str = "sync"
    servers: int = 1
    staleness: int | None = None
    backup_workers: int = 0
    slow_worker: tuple[int, float] | None = None  # (rank, factor)
    max_staleness: int | None = None  # async: refuse gradients staler than this
    staleness_aware: bool = True  # async/ssp: a push of staleness tau > 1 divided by tau
    evals_per_epoch: int = 1
    dtype: str = "float32"  # of the model and the data; "float64" makes --check exact
    # layout-invariant training: --check against one process must be bitwise equal
    reproducible: bool = False
    microbatch_size: int = 8

    @property
    def trainers(self) -> int:
        """Ranks that compute gradients: all, or the workers under the parameter server."""
        return self.world_size - self.servers if self.strategy == "ps" else self.world_size

    @property
    def lead(self) -> int:
        """The rank that prints progress and whose history is reported."""
        return self.servers if self.strategy == "ps" else 0


@dataclass
class EpochStats:
    epoch: int
    loss: float
    test_accuracy: float
    samples_per_s: float
    seconds: float
    elapsed_s: float
    updates: int = 0  # parameter versions so far (steps, or server updates under ps)


def load_digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train x, train y, test x, test y): 8x8 images scaled to [0, 1], an 80/20 split."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    if len(train) != TRAIN_SAMPLES:
        raise RuntimeError(
            f"scikit-learn's digits gave {len(train)} training samples, the demo validates "
            f"options against {TRAIN_SAMPLES}: update plait.demo.digits.TRAIN_SAMPLES"
        )
    return x[train], y[train], x[test], y[test]


def _model(seed: int, dtype: str = "float32") -> DigitsCNN:
    torch.manual_seed(seed)
    return DigitsCNN().to(getattr(torch, dtype))


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def validate(config: DemoConfig) -> None:
    """Raise :class:`DemoOptionError` (one line: the option, its valid range, the value)
    unless every option of ``config`` is usable. Runs before any rank starts."""

    def bad(message: str) -> DemoOptionError:
        return DemoOptionError(message)

    c = config
    if c.strategy not in STRATEGIES:
        raise bad(f"--strategy must be one of {', '.join(STRATEGIES)}, got {c.strategy!r}")
    if not isinstance(c.world_size, int) or c.world_size < 1:
        raise bad(f"-n/--nproc must be at least 1 (ranks on this machine), got {c.world_size}")
    if c.strategy == "none" and c.world_size != 1:
        raise bad(f"--strategy none trains in one process: use -n 1, got -n {c.world_size}")
    if c.strategy == "ps":
        if c.world_size < 2:
            raise bad(
                f"--strategy ps needs -n of at least 2 (a server and a worker), got "
                f"-n {c.world_size}"
            )
        if not 1 <= c.servers <= c.world_size - 1:
            raise bad(
                f"--servers must be in 1..{c.world_size - 1} with -n {c.world_size} (at least "
                f"one rank must be a worker), got {c.servers}"
            )
        if c.ps_mode not in PS_MODES:
            raise bad(f"--ps-mode must be one of {', '.join(PS_MODES)}, got {c.ps_mode!r}")
        if c.ps_mode == "ssp" and (c.staleness is None or c.staleness < 0):
            raise bad(
                f"--ps-mode ssp needs --staleness S, an integer >= 0 (steps a worker may run "
                f"ahead of the slowest), got {c.staleness}"
            )
        if c.ps_mode != "ssp" and c.staleness is not None:
            raise bad(f"--staleness applies to --ps-mode ssp only, not {c.ps_mode}")
        if c.max_staleness is not None and c.ps_mode != "async":
            raise bad(
                f"--max-staleness applies to --ps-mode async only (ssp bounds the clocks "
                f"with --staleness), not {c.ps_mode}"
            )
        if c.max_staleness is not None and c.max_staleness < 0:
            raise bad(
                f"--max-staleness must be an integer >= 0 (versions a gradient may lag the "
                f"server's), got {c.max_staleness}"
            )
        workers = c.world_size - c.servers
        if c.backup_workers and c.ps_mode != "sync":
            raise bad(f"--backup-workers applies to --ps-mode sync only, not {c.ps_mode}")
        if not 0 <= c.backup_workers <= workers - 1:
            raise bad(
                f"--backup-workers must be in 0..{workers - 1} with {workers} workers (a step "
                f"needs at least one gradient), got {c.backup_workers}"
            )
        if c.slow_worker is not None:
            rank, factor = c.slow_worker
            if not c.servers <= rank <= c.world_size - 1:
                raise bad(
                    f"--slow-worker RANK:FACTOR: RANK must be a worker rank, "
                    f"{c.servers}..{c.world_size - 1}, got {rank}"
                )
            if not (math.isfinite(factor) and factor >= 1.0):
                raise bad(
                    f"--slow-worker RANK:FACTOR: FACTOR must be a finite number >= 1 (how many "
                    f"times as long a step takes), got {factor:g}"
                )
    else:
        given = [
            option
            for option, used in (
                ("--ps-mode", c.ps_mode != "sync"),
                ("--servers", c.servers != 1),
                ("--staleness", c.staleness is not None),
                ("--backup-workers", c.backup_workers != 0),
                ("--slow-worker", c.slow_worker is not None),
                ("--max-staleness", c.max_staleness is not None),
            )
            if used
        ]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise bad(f"{', '.join(given)} {verb} to --strategy ps only, not {c.strategy}")
    if c.epochs < 1:
        raise bad(f"--epochs must be at least 1, got {c.epochs}")
    if not c.trainers <= c.batch_size <= TRAIN_SAMPLES:
        who = f"the {c.trainers} ranks that train" if c.trainers > 1 else "one rank"
        raise bad(
            f"--batch-size (the global batch) must be in {c.trainers}..{TRAIN_SAMPLES}: at "
            f"least one sample for each of {who}, at most the {TRAIN_SAMPLES} training "
            f"samples; got {c.batch_size}"
        )
    if not (math.isfinite(c.lr) and c.lr > 0):
        raise bad(f"--lr must be a finite number > 0, got {c.lr:g}")
    steps = TRAIN_SAMPLES // c.batch_size
    if not 1 <= c.evals_per_epoch <= steps:
        raise bad(
            f"--evals-per-epoch must be in 1..{steps} (the steps of an epoch at --batch-size "
            f"{c.batch_size}), got {c.evals_per_epoch}"
        )
    if not (math.isfinite(c.bucket_mb) and c.bucket_mb > 0):
        raise bad(f"--bucket-mb must be a finite number > 0, got {c.bucket_mb:g}")
    algorithms = ("auto", *comm.ALGORITHMS)
    if c.algorithm not in algorithms:
        raise bad(f"--algorithm must be one of {', '.join(algorithms)}, got {c.algorithm!r}")
    if c.seed < 0:
        raise bad(f"--seed must be >= 0, got {c.seed}")
    if c.dtype not in DTYPES:
        raise bad(f"--dtype must be one of {', '.join(DTYPES)}, got {c.dtype!r}")
    if c.reproducible:
        if c.strategy not in REPRODUCIBLE:
            raise bad(
                f"--reproducible supports --strategy {', '.join(REPRODUCIBLE)}, got {c.strategy!r}"
            )
        try:
            microbatch_count(c.batch_size, c.microbatch_size, c.world_size)
        except LayoutError as e:
            raise bad(f"--reproducible: {e}; set --batch-size, --microbatch-size or -n") from e
    if c.name and (c.name in (".", "..") or "/" in c.name or "\\" in c.name):
        raise bad(f"--name must be a plain folder name (no '/', not '..'), got {c.name!r}")


def global_batches(config: DemoConfig, epoch: int) -> list[list[int]]:
    """Epoch ``epoch``'s global batches of training-sample indices: the same shuffled
    order on every rank, cut into ``batch_size`` pieces, the incomplete last one dropped."""
    sampler = DistributedSampler(
        range(TRAIN_SAMPLES), num_replicas=1, rank=0, shuffle=True, seed=config.seed
    )
    sampler.set_epoch(epoch)
    order = sampler.global_order()
    b = config.batch_size
    return [order[i * b : (i + 1) * b] for i in range(len(order) // b)]


def _progress(config: DemoConfig, epoch: int, steps: int, show: bool) -> Any:
    """A tqdm bar over an epoch's steps; disabled (writes nothing) unless ``show`` and
    stdout is a terminal, so piped output and log files hold no carriage returns."""
    tqdm = require("tqdm", why="plait demo's progress bar").tqdm
    return tqdm(
        total=steps,
        desc=f"epoch {epoch + 1}/{config.epochs}",
        unit="step",
        leave=False,
        file=sys.stdout,
        disable=not (show and sys.stdout.isatty()),
        dynamic_ncols=True,
    )


def _options(config: DemoConfig, tracer: Tracer) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if config.strategy == "ps":
        slow = dict([config.slow_worker]) if config.slow_worker else None
        return {
            "mode": config.ps_mode,
            "servers": config.servers,
            "staleness": config.staleness,
            "backup_workers": config.backup_workers,
            "slow_workers": slow,
            "max_staleness": config.max_staleness,
            "staleness_aware": config.staleness_aware,
        }
    if config.strategy != "none":
        options["algorithm"] = config.algorithm
    if config.strategy in ("ddp", "zero1", "zero2"):
        options["bucket_mb"] = config.bucket_mb
    return options


def push_lr(config: DemoConfig) -> float:
    """The learning rate of one update. ``--lr`` is per global batch; an asynchronous
    parameter server (``async``/``ssp``) applies each worker's push, a 1/W share of the
    global batch, as its own update, so a push steps with lr / W (the linear scaling rule:
    W pushes a global batch move as far as one synchronous step). The server divides a
    stale push further by its staleness (:mod:`plait.strategies.ps.server`)."""
    if config.strategy == "ps" and config.ps_mode != "sync":
        return config.lr / config.trainers
    return config.lr


def _reproducible_options(config: DemoConfig) -> dict[str, Any]:
    if not config.reproducible:
        return {}
    return {
        "reproducible": True,
        "microbatch_size": config.microbatch_size,
        "loss_fn": nn.functional.cross_entropy,
    }


def train_rank(config: DemoConfig, check: bool = False) -> dict[str, Any]:
    """Runs on every rank: the training loop a user would write, under ``plait.prepare``.
    ``check`` in float32: keep the parameters after the first epoch too (:func:`judge`; on
    a sharded strategy one gather more, counted in the bytes)."""
    world = plait.world()
    n, rank = config.trainers, world.rank
    validate(config)
    x_train, y_train, x_test, y_test = load_digits(config.seed)
    dtype = getattr(torch, config.dtype)
    x_train, x_test = x_train.to(dtype), x_test.to(dtype)
    model = _model(config.seed, config.dtype)
    optimizer: torch.optim.Optimizer | None
    optimizer = torch.optim.SGD(model.parameters(), lr=push_lr(config), momentum=0.9)
    tracer = Tracer(rank=rank)
    model_w, optimizer = plait.prepare(
        model,
        optimizer,
        strategy=config.strategy,
        tracer=tracer,
        **_options(config, tracer),
        **_reproducible_options(config),
    )
    runner: ReproducibleRunner | None = None
    if isinstance(model_w, ReproducibleRunner):  # --reproducible: it drives the micro-batches
        runner, model_w = model_w, model_w.module
    ps = config.strategy == "ps"
    if optimizer is None:  # a parameter server: prepare served until the workers finished
        return {
            "role": "server",
            "ps": _stats_dict(ps_of(model_w).stats()),
            "spans": tracer.spans(),
            "state": checkpoint.full_state_dict(model_w),
            "history": [],
        }
    trainer = rank - config.lead
    history: list[EpochStats] = []
    first_epoch: dict[str, torch.Tensor] = {}  # the parameters after the first epoch
    start = time.perf_counter()
    comm.reset_stats()
    evals = config.evals_per_epoch
    steps = 0
    for epoch in range(config.epochs):
        batches = global_batches(config, epoch)
        steps = len(batches)
        marks = {round(steps * (k + 1) / evals) for k in range(evals)}
        t0 = time.perf_counter()
        loss_sum = torch.zeros(1, dtype=torch.float64)
        done, done_loss = 0, 0.0
        model_w.train()
        bar = _progress(config, epoch, steps, show=rank == config.lead)
        for step in range(steps):
            batch = torch.tensor(batches[step])
            if runner is not None:  # the global mean loss, the same on every rank
                xs, ys = x_train[batch], y_train[batch]
                loss, weight = runner.step(runner.block(xs), runner.block(ys)), 1.0
            else:
                (x, y), weight = split_batch(
                    (x_train[batch], y_train[batch]), num_replicas=n, rank=trainer
                )
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model_w(x), y)
                # weight = rows * n / batch: the ranks' average of weighted means is the
                # mean over the global batch, however unevenly it divides
                (loss * weight).backward()
            optimizer.step()
            loss_sum += loss.item() * weight
            bar.update(1)
            if step + 1 in marks and step + 1 < steps:  # a mid-epoch evaluation point
                point = _evaluate(
                    model_w,
                    x_test,
                    y_test,
                    epoch=epoch + 1,
                    loss=(float(loss_sum) - done_loss) / (step + 1 - done),
                    samples=(step + 1) * config.batch_size,
                    t0=t0,
                    start=start,
                    updates=_updates(optimizer, epoch * steps + step + 1),
                )
                history.append(point)
                done, done_loss = step + 1, float(loss_sum)
        seconds = time.perf_counter() - t0
        bar.close()
        if not ps:  # workers under a parameter server report their own loss
            comm.all_reduce(loss_sum, "sum", group=world, algorithm="auto")
        ranks_in_loss = 1 if ps else n
        stats = _evaluate(
            model_w,
            x_test,
            y_test,
            epoch=epoch + 1,
            loss=float(loss_sum) / (steps * ranks_in_loss),
            samples=steps * config.batch_size,
            t0=t0,
            start=start,
            updates=_updates(optimizer, (epoch + 1) * steps),
        )
        history.append(stats)
        if epoch == 0 and check and judged_after_epoch_1(config):
            first_epoch = {k: v.clone() for k, v in checkpoint.full_state_dict(model_w).items()}
        if rank == config.lead:
            print(
                f"epoch {stats.epoch}/{config.epochs}  loss {stats.loss:.4f}  "
                f"test accuracy {stats.test_accuracy:.2%}  "
                f"{stats.samples_per_s:,.0f} samples/s  ({seconds:.1f} s)",
                flush=True,
            )
    result: dict[str, Any] = {"role": "trainer"}
    if ps:
        optimizer.finish()  # type: ignore[attr-defined]
        result = {"role": "worker", "ps": _stats_dict(ps_of(model_w).stats())}
    stats_bytes = {f"{c}/{a}": vars(s) for (c, a), s in comm.stats().items()}
    return {
        **result,
        "history": [asdict(h) for h in history],
        "spans": tracer.spans(),
        "state": checkpoint.full_state_dict(model_w),
        "first_epoch_state": first_epoch,
        "comm": stats_bytes,
        "steps_per_epoch": steps,
    }


def _updates(optimizer: torch.optim.Optimizer, steps: int) -> int:
    version = getattr(optimizer, "version", None)
    return steps if version is None else int(version)


def _evaluate(
    model: nn.Module,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    *,
    epoch: int,
    loss: float,
    samples: int,
    t0: float,
    start: float,
    updates: int,
) -> EpochStats:
    """An evaluation point: test accuracy now, and the loss and throughput since ``t0``."""
    now = time.perf_counter()
    return EpochStats(
        epoch=epoch,
        loss=loss,
        test_accuracy=_accuracy(model, x_test, y_test),
        samples_per_s=samples / max(now - t0, 1e-9),
        seconds=now - t0,
        elapsed_s=now - start,
        updates=updates,
    )


def _stats_dict(stats: Any) -> dict[str, Any]:
    out = asdict(stats)
    out.pop("clock_gaps", None)
    out.pop("versions", None)
    for name in ("mean_staleness", "steps_per_s"):
        if hasattr(stats, name):
            out[name] = getattr(stats, name)
    return out


def oracle(config: DemoConfig, *, pieces: int | None = None) -> dict[str, torch.Tensor]:
    """One process, the global batch of every step (the union of the ranks' batches), in
    ``config.dtype`` from the ranks' start (initialised in float32).

    The mean loss over the global batch is written as ``pieces`` weighted shard means
    averaged (default: one per training rank, the ranks' own summation order); another
    ``pieces`` is the same computation summed in another order (:func:`float32_noise`)."""
    x_train, y_train, _, _ = load_digits(config.seed)
    x_train = x_train.to(getattr(torch, config.dtype))
    model = _model(config.seed, config.dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
    if config.reproducible:
        return _reproducible_oracle(config, model, optimizer, x_train, y_train)
    n = pieces if pieces is not None else config.trainers
    with one_thread():
        for epoch in range(config.epochs):
            for indices in global_batches(config, epoch):
                batch = torch.tensor(indices)
                optimizer.zero_grad()
                loss = torch.zeros((), dtype=x_train.dtype)
                for r in range(n):
                    (x, y), weight = split_batch(
                        (x_train[batch], y_train[batch]), num_replicas=n, rank=r
                    )
                    if weight:
                        loss = loss + nn.functional.cross_entropy(model(x), y) * weight
                (loss / n).backward()
                optimizer.step()
    return model.state_dict()


def _reproducible_oracle(
    config: DemoConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """``--reproducible``: one process on the same micro-batches and the same tree (it pins
    one intra-op thread, as every rank does, for its duration)."""
    threads = torch.get_num_threads()
    try:
        runner, _ = plait.prepare(
            model, optimizer, strategy="none", **_reproducible_options(config)
        )
        assert isinstance(runner, ReproducibleRunner)
        for epoch in range(config.epochs):
            for indices in global_batches(config, epoch):
                batch = torch.tensor(indices)
                runner.step(x_train[batch], y_train[batch])
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return model.state_dict()


def float32_noise(config: DemoConfig, exact: dict[str, torch.Tensor]) -> float:
    """How far float32 in one process lands from ``exact`` (:func:`oracle` of ``config`` in
    float64): the largest :func:`~plait.demo.closeness.distance` over the global batch
    summed in the ranks' pieces and whole (two pieces for one rank). The same arithmetic in
    float32 in another order: the rounding the training amplified, on this CPU."""
    start = _model(config.seed).state_dict()
    orders = sorted({config.trainers, 1 if config.trainers > 1 else 2})
    return max(distance(oracle(config, pieces=m), exact, start) for m in orders)


def judged_after_epoch_1(config: DemoConfig) -> bool:
    """Does ``--check`` compare the parameters after the first epoch (float32 over several
    epochs, not layout-invariant) rather than at the end?"""
    return config.dtype == "float32" and not config.reproducible and config.epochs > 1


def judge(config: DemoConfig, results: list[dict[str, Any]], report: DemoReport) -> None:
    """Fill ``report``'s ``--check`` fields from the ranks' ``results`` (see the module
    docstring). ``--reproducible``: the same micro-batches in the same dtype, bitwise, at
    the end; float64: the largest parameter difference at the end within
    :data:`FLOAT64_BOUND`; float32: after the first epoch, the
    :func:`~plait.demo.closeness.distance` to float64 within :data:`NOISE_FACTOR` times
    :func:`float32_noise`."""
    state = results[0]["state"]
    if config.reproducible:
        report.max_param_diff, report.check_bound = max_diff(state, oracle(config)), 0.0
        return
    if config.dtype == "float64":
        report.max_param_diff, report.check_bound = max_diff(state, oracle(config)), FLOAT64_BOUND
        return
    if judged_after_epoch_1(config):
        state = results[config.lead].get("first_epoch_state")
        if not state:
            raise ValueError("float32 --check compares epoch 1: run train_rank(config, check=True)")
    first = replace(config, epochs=1)
    exact = oracle(replace(first, dtype="float64"))
    report.max_param_diff = max_diff(state, exact)
    report.float32_noise = float32_noise(first, exact)
    report.param_distance = distance(state, exact, _model(config.seed).state_dict())
    report.check_bound = NOISE_FACTOR * report.float32_noise


def _last_of_epoch(history: list[dict[str, Any]], point: dict[str, Any]) -> dict[str, Any]:
    return [h for h in history if h["epoch"] == point["epoch"]][-1]


def _print_ps(ps: dict[str, Any]) -> None:
    for s in ps["servers"]:
        hist = " ".join(f"{k}:{v}" for k, v in sorted(s["staleness"].items()))
        print(
            f"server {s['index']} (rank {s['rank']}): {s['updates']} updates from "
            f"{s['gradients']} gradients, {s['dropped']} dropped, queue max {s['queue_max']}, "
            f"mean staleness {s['mean_staleness']:.2f}, max {max(s['staleness'], default=0)} "
            f"(histogram {hist})"
        )
        if s["mode"] != "sync":
            print(
                f"  asynchronous: {s['scaled']} stale gradients applied divided by their "
                f"staleness (lr / staleness), {s['refused']} refused as too stale"
            )
        if s["ssp_waits"]:
            print(f"  ssp: {s['ssp_waits']} waits, {s['ssp_wait_s']:.2f} s in all")
        for rank, why in s["failed_workers"].items():
            print(f"  worker rank {rank} FAILED: {why}")
    for w in ps["workers"]:
        print(
            f"worker rank {w['rank']}: {w['steps']} steps, {w['steps_per_s']:.1f} steps/s, "
            f"{w['wait_s']:.2f} s waiting for servers, {w['compute_s']:.2f} s computing"
            + (f", {w['injected_s']:.2f} s injected delay" if w["injected_s"] else "")
        )


@dataclass
class DemoReport:
    config: DemoConfig
    test_accuracy: float
    samples_per_s: float
    train_seconds: float
    # None: the strategy's tracer recorded no communication span ("not traced"), which is
    # not the same as no communication
    comm_share: float | None
    hidden_fraction: float | None
    comm_seconds_per_rank: float | None
    history: list[dict[str, Any]] = field(default_factory=list)
    bytes: dict[str, Any] = field(default_factory=dict)
    # --check (judge): against one process (float64, or the same micro-batches)
    max_param_diff: float | None = None  # the largest parameter difference
    param_distance: float | None = None  # float32: relative to how far training moved them
    check_bound: float | None = None  # on param_distance in float32, else max_param_diff
    float32_noise: float | None = None  # float32: the distance of float32 in one process
    ps: dict[str, Any] = field(default_factory=dict)  # servers' and workers' statistics


def _plot(history: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [h["elapsed_s"] for h in history]
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.plot(t, [h["loss"] for h in history], "o-", color="tab:blue", label="train loss")
    ax1.set_xlabel("wall time (s)")
    ax1.set_ylabel("train loss", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(
        t, [h["test_accuracy"] for h in history], "s-", color="tab:green", label="test accuracy"
    )
    ax2.set_ylabel("test accuracy", color="tab:green")
    ax2.set_ylim(0, 1)
    ax1.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def check_passed(report: DemoReport) -> bool:
    """False when ``--check`` found the run farther from one process than rounding explains
    (:func:`judge`)."""
    if report.param_distance is not None:  # float32
        return report.check_bound is not None and report.param_distance <= report.check_bound
    if report.max_param_diff is None:
        return True
    bound = report.check_bound if report.check_bound is not None else FLOAT64_BOUND
    return report.max_param_diff <= bound


def run(config: DemoConfig, *, check: bool = False, out_dir: Path = Path("runs")) -> DemoReport:
    """Validate ``config``, train on ``config.world_size`` spawned ranks, report and write
    ``out_dir/<name>/``. Raises :class:`DemoOptionError` before spawning on a bad option."""
    validate(config)
    label = config.strategy if config.strategy != "ps" else f"ps-{config.ps_mode}"
    name = config.name or f"{label}-n{config.world_size}-{time.strftime('%H%M%S')}"
    run_dir = out_dir / name
    how = f"algorithm {config.algorithm}"
    if config.strategy == "ps":
        how = (
            f"mode {config.ps_mode}, {config.servers} server(s) + {config.trainers} workers"
            + (f", staleness {config.staleness}" if config.staleness is not None else "")
            + (
                f", lr {config.lr:g} per global batch = {push_lr(config):.3g} per push"
                + (" / its staleness" if config.staleness_aware else "")
                if config.ps_mode != "sync"
                else ""
            )
            + (
                f", max staleness {config.max_staleness}"
                if config.max_staleness is not None
                else ""
            )
            + (f", {config.backup_workers} backup" if config.backup_workers else "")
            + (
                f", rank {config.slow_worker[0]} slowed {config.slow_worker[1]:g}x"
                if config.slow_worker
                else ""
            )
        )
    print(
        f"plait demo: CNN on scikit-learn digits, {config.world_size} ranks, strategy "
        f"{config.strategy}, {how}, {config.epochs} epochs, global batch {config.batch_size}"
        + (f", {config.dtype}" if config.dtype != "float32" else "")
        + (
            f", reproducible (micro-batches of {config.microbatch_size})"
            if config.reproducible
            else ""
        ),
        flush=True,
    )
    results = plait.spawn(
        train_rank, world_size=config.world_size, args=(config, check), timeout=3600
    )
    return summarize(config, results, check=check, run_dir=run_dir)


def comm_traced(spans: list[Span]) -> bool:
    """Did any rank's tracer record a communication span?"""
    return any(s.stream == "comm" for s in spans)


def summarize(
    config: DemoConfig, results: list[dict[str, Any]], *, check: bool, run_dir: Path
) -> DemoReport:
    """The report of a finished run (``results``: what :func:`train_rank` returned on each
    rank, in rank order): printed, and written to ``run_dir``."""
    lead = results[config.lead]
    history = lead["history"]
    spans: list[Span] = [s for r in results for s in r["spans"]]
    overlap = overlap_report(spans)
    traced = comm_traced(spans)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_chrome(run_dir / "trace.json", [r["spans"] for r in results])
    epochs = [h for h in history if h["seconds"] > 0 and h is _last_of_epoch(history, h)]
    total = sum(h["seconds"] for h in epochs)
    steps = lead["steps_per_epoch"] * config.epochs
    report = DemoReport(
        config=config,
        test_accuracy=history[-1]["test_accuracy"],
        samples_per_s=steps * config.batch_size / total,
        train_seconds=total,
        comm_share=overlap.comm_share if traced else None,
        hidden_fraction=overlap.hidden_fraction if traced else None,
        comm_seconds_per_rank=overlap.comm_s if traced else None,
        history=history,
        bytes=lead["comm"],
    )
    if config.strategy == "ps":
        report.ps = {
            "servers": [r["ps"] for r in results if r["role"] == "server"],
            "workers": [r["ps"] for r in results if r["role"] == "worker"],
        }
    comparable = config.strategy != "ps" or (config.ps_mode, config.backup_workers) == ("sync", 0)
    if check and comparable:
        judge(config, results, report)
    elif check:
        print("--check: only synchronous training without backup workers equals one process")
    (run_dir / "report.json").write_text(json.dumps(asdict(report), indent=1, default=str))
    _plot(
        history,
        run_dir / "curves.png",
        f"plait {config.strategy}, {config.world_size} ranks: digits CNN",
    )
    print(f"\nfinal test accuracy   {report.test_accuracy:.2%}")
    print(
        f"throughput            {report.samples_per_s:,.0f} samples/s "
        f"({report.train_seconds:.1f} s of training)"
    )
    if traced:
        print(
            f"communication share   {overlap.comm_share:.1%} of traced time exposed, "
            f"{overlap.comm_s:.2f} s of communication per rank"
        )
        print(f"hidden behind backward {overlap.hidden_fraction:.1%}")
    elif config.strategy == "none":
        print("communication share   none (one process, --strategy none)")
    else:
        print(
            f"communication share   not traced (strategy {config.strategy} records no "
            f"communication spans in the timeline)"
        )
    if report.ps:
        _print_ps(report.ps)
    if report.max_param_diff is not None and config.reproducible:
        verdict = "bitwise" if check_passed(report) else "NOT BITWISE: a bug, please report"
        print(
            f"--check: one process on the same micro-batches of {config.microbatch_size}: "
            f"max diff {report.max_param_diff:g} ({verdict})"
        )
    elif report.param_distance is not None:
        verdict = "ok" if check_passed(report) else "LARGER THAN EXPECTED"
        print(
            f"--check: after epoch 1, parameter distance to one process in float64, relative "
            f"to how far training moved them: {report.param_distance:.2e} ({verdict}: bound "
            f"{report.check_bound:.1e})\n  bound = {NOISE_FACTOR:g} x how far float32 in one "
            f"process lands from float64 ({report.float32_noise:.2e}; the global batch summed "
            f"in two orders), the rounding training amplifies, measured here for this run; "
            f"later epochs amplify it chaotically. --dtype float64 checks the end to "
            f"{FLOAT64_BOUND:g}"
        )
    elif report.max_param_diff is not None:
        verdict = "ok" if check_passed(report) else "LARGER THAN EXPECTED"
        print(
            f"--check: largest parameter difference to one process on the global batch: "
            f"{report.max_param_diff:.2e} ({verdict}: bound {report.check_bound:.1e})"
        )
    print(f"wrote {run_dir}/report.json, trace.json, curves.png")
    if not math.isfinite(report.history[-1]["loss"]):
        print("the loss diverged; lower --lr", file=sys.stderr)
    return report
