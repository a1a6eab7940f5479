"""The options of ``plait demo --model gpt``: :class:`GPTDemoConfig`, their validation
(:func:`validate`: one line naming the option and what to change, before any rank starts)
and the defaults fitted to the layout (:func:`fit_defaults`). No communication."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from plait import comm
from plait.demo import context
from plait.models import CharTokenizer, GPTConfig, MoEConfig
from plait.strategies.pipeline.schedules import build, default_chunks
from plait.strategies.tensor.grid import grid_shape


class GPTDemoOptionError(ValueError):
    """A GPT-demo option outside its valid range; the message is one line naming it."""


@dataclass(frozen=True)
class GPTDemoConfig:
    world_size: int = 2
    tp: int = 2
    tp_mode: str = "1d"  # "2d", "2.5d" (depth tp_depth), "3d": the tp ranks as a grid
    tp_depth: int = 2
    sequence_parallel: bool = False
    steps: int = 150
    batch_size: int = 16  # global: windows per step over all data-parallel replicas
    seq_len: int = 64
    width: int = 64
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    algorithm: str = "auto"
    seed: int = 0
    evals: int | None = None  # held-out evaluation points; default min(10, steps)
    name: str = ""
    # pipeline parallelism: Mesh(pp=n)
    pp: int = 1
    schedule: str = "1f1b"
    microbatches: int | None = None  # default: 2 * pp
    # mixture of experts: Mesh(ep=ep, dp=n/ep)
    moe: bool = False
    ep: int = 1
    experts: int = 4
    dtype: str = "float32"  # of the model; "float64" makes --check exact on any CPU
    # a plait checkpoint root holding the dense GPT to start from (the tour's reference);
    # "" starts from the seeded initialisation. With moe the MoE blocks are upcycled: every
    # expert starts as a copy of the dense MLP it replaces (layouts.start_model)
    init: str = ""
    first_step: int = 0  # the step number of the first step (its batch): after init, its step
    # context parallelism: Mesh(dp=n/(cp*tp), cp=cp, tp=tp), attention "ring" or "ulysses"
    cp: int = 1
    context: str = "ring"

    @property
    def eval_points(self) -> int:
        """Held-out evaluation points: ``evals``, or min(10, steps) when not given."""
        return self.evals if self.evals is not None else min(10, self.steps)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.ep * self.cp)

    @property
    def m(self) -> int:
        return self.microbatches if self.microbatches is not None else 2 * self.pp

    def model_config(self) -> GPTConfig:

        return GPTConfig(
            vocab=CharTokenizer().vocab,
            layers=self.layers,
            heads=self.heads,
            width=self.width,
            seq_len=self.seq_len,
            seed=self.seed,
            dtype=getattr(torch, self.dtype),
            moe=MoEConfig(num_experts=self.experts) if self.moe else None,
        )

    def mesh_shape(self) -> dict[str, int]:
        if self.cp > 1:
            return {"dp": self.dp, "cp": self.cp, "tp": self.tp}
        if self.pp > 1 and (self.tp > 1 or self.dp > 1):
            return {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        if self.pp > 1:
            return {"pp": self.pp}
        if self.moe:
            return {"ep": self.ep, "dp": self.dp}
        return {"dp": self.dp, "tp": self.tp}


def validate(config: GPTDemoConfig) -> None:
    """Raise :class:`GPTDemoOptionError` (one line: the option, its range, the value) unless
    ``config`` is usable. Runs before any rank starts."""
    c = config
    bad = GPTDemoOptionError
    if not isinstance(c.world_size, int) or c.world_size < 1:
        raise bad(f"-n/--nproc must be at least 1, got {c.world_size}")
    if c.ep != 1 and not c.moe:
        raise bad("--ep applies to --moe only")
    context.validate_cp(c)
    if c.pp > 1 or c.moe:
        _validate_pp_moe(c)
    elif c.tp < 1 or c.world_size % c.tp:
        raise bad(
            f"--tp must divide -n (the mesh is dp x tp = n ranks): -n {c.world_size}, "
            f"--tp {c.tp}; valid: {[t for t in range(1, c.world_size + 1) if not c.world_size % t]}"
        )
    if c.heads < 1 or c.width < 1 or c.width % c.heads:
        raise bad(f"--width must be a multiple of --heads: got width {c.width}, heads {c.heads}")
    if c.tp_mode not in ("1d", "2d", "2.5d", "3d"):
        raise bad(f"--tp-mode must be one of 1d, 2d, 2.5d, 3d, got {c.tp_mode!r}")
    if c.tp_mode != "1d":
        try:
            dims = grid_shape(c.tp_mode, c.tp, depth=c.tp_depth if c.tp_mode == "2.5d" else None)
        except ValueError as exc:
            raise bad(f"--tp {c.tp} --tp-mode {c.tp_mode}: {exc}") from None
        q = dims["row"]
        parts = {"2d": q, "2.5d": c.tp_depth * q, "3d": q * q}[c.tp_mode]
        if c.heads % q:
            raise bad(f"--heads must be divisible by the grid side {q} (--tp-mode {c.tp_mode})")
        if c.width % (q * q):
            raise bad(f"--width must be divisible by q^2 = {q * q} (--tp-mode {c.tp_mode})")
        if c.sequence_parallel:
            raise bad(f"--sp is 1D only (--tp-mode {c.tp_mode} splits the batch instead)")
        rows = c.batch_size // max(1, c.dp)
        if rows % parts:
            raise bad(
                f"--tp-mode {c.tp_mode} splits each replica's rows into {parts} blocks: "
                f"--batch-size / dp = {rows} must be a multiple of {parts}"
            )
    elif c.heads % c.tp:
        raise bad(f"--heads must be divisible by --tp (whole heads per rank): {c.heads} % {c.tp}")
    if c.layers < 1:
        raise bad(f"--layers must be at least 1, got {c.layers}")
    if c.sequence_parallel and c.tp == 1:
        raise bad("--sp needs --tp of at least 2 (sequence parallelism splits over tp ranks)")
    if c.sequence_parallel and c.seq_len % c.tp:
        raise bad(f"--sp: --seq-len {c.seq_len} must be divisible by --tp {c.tp}")
    if c.steps < 1:
        raise bad(f"--steps must be at least 1, got {c.steps}")
    rows = c.world_size // (c.tp * c.pp * c.cp)  # ranks that take their own rows of a batch
    if c.batch_size < rows or c.batch_size % rows:
        cp = f" / --cp {c.cp}" if c.cp > 1 else ""
        raise bad(
            f"--batch-size (global) must be a multiple of the {rows} ranks that each take "
            f"their own rows (-n {c.world_size} / --tp {c.tp} / --pp {c.pp}{cp}), got "
            f"{c.batch_size}"
        )
    if c.pp > 1 and c.batch_size % (c.m * c.dp):
        raise bad(
            f"--batch-size {c.batch_size} must be a multiple of --microbatches {c.m} x the "
            f"{c.dp} data-parallel replicas (equal micro-batches on every replica)"
        )
    if not 2 <= c.seq_len <= 512:
        raise bad(f"--seq-len must be in 2..512, got {c.seq_len}")
    if not (math.isfinite(c.lr) and c.lr > 0):
        raise bad(f"--lr must be a finite number > 0, got {c.lr:g}")
    if not 1 <= c.eval_points <= c.steps:
        raise bad(f"--evals must be in 1..{c.steps} (--steps), got {c.evals}")
    if c.dtype not in ("float32", "float64"):
        raise bad(f"--dtype must be float32 or float64, got {c.dtype!r}")
    algorithms = ("auto", *comm.ALGORITHMS)
    if c.algorithm not in algorithms:
        raise bad(f"--algorithm must be one of {', '.join(algorithms)}, got {c.algorithm!r}")
    if c.init and not Path(c.init).is_dir():
        raise bad(f"--init must be a plait checkpoint root (a directory), got {c.init!r}")
    if c.name and (c.name in (".", "..") or "/" in c.name or "\\" in c.name):
        raise bad(f"--name must be a plain folder name (no '/', not '..'), got {c.name!r}")


def fit_defaults(config: GPTDemoConfig, *, given: set[str]) -> GPTDemoConfig:
    """``config`` with the options the user did not give (fields not in ``given``) moved
    to the nearest values that fit those given: heads a multiple of the tensor-parallel
    side, width a multiple of the heads (and of q^2 on a grid), seq_len of tp under
    sequence parallelism, experts of ep, the global batch of the ranks that take their own
    rows (and of micro-batches x replicas, and of a grid's blocks). Only options the user
    gave can contradict each other; :func:`validate` refuses those."""
    c = config
    side, parts = c.tp, 1
    if c.tp_mode != "1d":
        try:
            side = grid_shape(c.tp_mode, c.tp, depth=c.tp_depth if c.tp_mode == "2.5d" else None)[
                "row"
            ]
        except ValueError:  # a tp the grid cannot take: validate names it
            return c
        parts = {"2d": side, "2.5d": c.tp_depth * side, "3d": side * side}[c.tp_mode]
    side = max(1, side)

    def up(value: int, k: int) -> int:
        return -(-value // k) * k

    changes: dict[str, Any] = {}
    heads = c.heads if "heads" in given else context.fitted_heads(c, math.lcm(c.heads, side))
    changes["heads"] = heads
    if "width" not in given:
        changes["width"] = up(c.width, math.lcm(heads, side * side if c.tp_mode != "1d" else 1))
    if "seq_len" not in given and c.sequence_parallel and c.tp > 1:
        changes["seq_len"] = up(c.seq_len, c.tp)
    if "seq_len" not in given and c.cp > 1:
        changes["seq_len"] = up(c.seq_len, 2 * c.cp)
    if "experts" not in given and c.moe and c.ep >= 1:
        changes["experts"] = up(c.experts, c.ep)
    ranks = c.tp * c.pp * c.ep * c.cp
    if "batch_size" not in given and ranks >= 1 and c.world_size % ranks == 0:
        k = max(1, c.world_size // (c.tp * c.pp * c.cp))
        if c.pp > 1 and c.m >= 1:
            k = math.lcm(k, c.m * c.dp)
        if c.tp_mode != "1d":
            k = math.lcm(k, max(1, c.dp) * parts)
        changes["batch_size"] = up(c.batch_size, k)
    return replace(c, **changes)


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")


def _validate_pp_moe(c: GPTDemoConfig) -> None:
    bad = GPTDemoOptionError
    if c.pp > 1 and c.moe:
        raise bad("--pp and --moe do not compose in the demo yet; pick one")
    if c.moe and c.tp != 1:
        raise bad("--moe does not compose with --tp in the demo yet; leave --tp at 1")
    if c.pp > 1:
        if c.tp_mode != "1d":
            raise bad(f"--pp composes with 1D tensor parallelism only, not --tp-mode {c.tp_mode}")
        if c.tp < 1 or c.world_size % (c.pp * c.tp):
            raise bad(
                f"--pp {c.pp} x --tp {c.tp} must divide -n {c.world_size} (the mesh is "
                f"pp x dp x tp)"
            )
        if c.heads % c.tp:
            raise bad(f"--heads must be divisible by --tp: {c.heads} % {c.tp}")
        if c.sequence_parallel and c.seq_len % c.tp:
            raise bad(f"--sp: --seq-len {c.seq_len} must be divisible by --tp {c.tp}")
        if c.schedule not in SCHEDULES:
            raise bad(f"--schedule must be one of {', '.join(SCHEDULES)}, got {c.schedule!r}")
        if c.m < 1:
            raise bad(f"--microbatches must be at least 1, got {c.m}")

        stages = c.pp * default_chunks(c.schedule)
        if c.layers + 2 < stages:
            raise bad(
                f"--schedule {c.schedule} at --pp {c.pp} needs {stages} stages: --layers must "
                f"be at least {stages - 2} (embedding, blocks and head are cut), got {c.layers}"
            )
        try:
            build(c.schedule, p=c.pp, m=c.m)
        except ValueError as e:
            raise bad(f"--schedule {c.schedule} --pp {c.pp} --microbatches {c.m}: {e}") from None
    if c.moe:
        if c.ep < 1 or c.world_size % c.ep:
            raise bad(f"--ep must divide -n: -n {c.world_size}, --ep {c.ep}")
        if c.experts < 1 or c.experts % c.ep:
            raise bad(
                f"--experts {c.experts} must be a multiple of --ep {c.ep} (each rank holds "
                f"experts / ep experts)"
            )
        if c.layers < 2:
            raise bad(
                f"--moe replaces every second MLP: --layers must be at least 2, got {c.layers}"
            )
