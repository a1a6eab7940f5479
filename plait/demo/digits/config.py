"""The digits demo's options: :class:`DemoConfig`, their ranges checked by :func:`validate`
before any rank starts (:class:`DemoOptionError`, one line naming the option), the
learning rate of one update (:func:`push_lr`) and the ``--check`` bounds
(:data:`FLOAT64_BOUND`, :data:`NOISE_FACTOR`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from plait import comm
from plait.strategies.reproducible import LayoutError, microbatch_count

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


def push_lr(config: DemoConfig) -> float:
    """The learning rate of one update. ``--lr`` is per global batch; an asynchronous
    parameter server (``async``/``ssp``) applies each worker's push, a 1/W share of the
    global batch, as its own update, so a push steps with lr / W (the linear scaling rule:
    W pushes a global batch move as far as one synchronous step). The server divides a
    stale push further by its staleness (:mod:`plait.strategies.ps.server`)."""
    if config.strategy == "ps" and config.ps_mode != "sync":
        return config.lr / config.trainers
    return config.lr


def reproducible_options(config: DemoConfig) -> dict[str, Any]:
    if not config.reproducible:
        return {}
    return {
        "reproducible": True,
        "microbatch_size": config.microbatch_size,
        "loss_fn": nn.functional.cross_entropy,
    }


def judged_after_epoch_1(config: DemoConfig) -> bool:
    """Does ``--check`` compare the parameters after the first epoch (float32 over several
    epochs, not layout-invariant) rather than at the end?"""
    return config.dtype == "float32" and not config.reproducible and config.epochs > 1
