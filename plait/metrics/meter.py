"""The one call a training loop makes each step: :meth:`Metrics.step`.

Each rank times its steps (the wall time between two calls, less the metrics' own
reduction and writes), the time it spent loading
data (:meth:`Metrics.data`, :meth:`Metrics.batches`), and reads its peak memory and the
bytes plait sent on each of its groups (:mod:`plait.metrics.probes`). Every ``every``
steps the ranks put what they measured in one table and reduce it together, one row per
rank; every rank then computes the same record, and rank 0 writes it::

    loss            the mean of the losses the ranks passed (ranks passing none, e.g. a
                    pipeline's first stages, are left out)
    step_s          the slowest rank's mean step time over the window (step_s_per_rank:
                    each rank's)
    tokens_per_s    tokens / step_s (``tokens``: the global batch's, every rank the same)
    tokens_per_s_per_rank   tokens / ranks / that rank's own step time
    tflops_per_rank flops_per_token x tokens_per_s / ranks / 1e12
    mfu             flops_per_token x tokens_per_s / the sum of the ranks' peaks
    memory_peak_bytes       per rank (``memory_kind`` in the run's info says how measured)
    bytes_sent      per group this rank's bytes per step (rank 0's in the files);
    bytes_sent_per_rank     every group together, per rank
    data_s          the slowest rank's data-loading time per step

Communication: one ``all_reduce`` (sum) of a ``ranks x 9`` float64 table (``72 x ranks``
bytes) on the group's device, every ``every`` steps and at :meth:`Metrics.close` if steps
are pending; it goes to the backend directly (``torch.distributed.all_reduce`` on the
group's process group, under its timeout), not through plait's algorithms, so plait's byte
counters keep the training's bytes only. Every rank of the group must call :meth:`step`
the same number of times and :meth:`close` once. In one process (plait not initialized)
nothing is communicated.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from plait import runtime
from plait.metrics import flops, probes, writers

if TYPE_CHECKING:
    from plait.comm.group import Group
    from plait.mesh import Mesh

# the columns of the table the ranks reduce (one row each)
STEPS, STEP_S, DATA_S, LOSS, LOSSES, TOKENS, MEMORY, SENT, PEAK = range(9)
COLUMNS = 9


class Metrics:
    """Training metrics of every rank, reduced and written by rank 0 (module doc).

    ``group``: the ranks that train together (default the world; in one process, none).
    ``mesh``: names the groups in ``bytes_sent`` by dimension (``"tp"``, ``"dp"``).
    ``model`` (plait's GPT, a Hugging Face model or config of a family the planner knows,
    or a :class:`~plait.plan.ModelSpec`) and ``seq_len`` give the FLOPs per token for MFU,
    or ``flops_per_token`` does; ``peak_flops`` overrides the device's peak
    (:func:`plait.metrics.flops.device_peak`). ``log_dir``: where rank 0 writes
    ``metrics.jsonl`` (``jsonl=False``: not), ``metrics.json`` (the run's info and summary
    at :meth:`close`), ``tensorboard/`` (``tensorboard=True``) and ``wandb/`` (``wandb=True``
    or a dict of ``wandb.init`` options; offline unless it says ``mode=``); default
    ``runs/metrics-<time>``. ``progress``: a tqdm bar on rank 0 (default: when standard
    error is a terminal) over ``total`` steps. ``every``: steps per record.
    """

    # the window since the last record (_window): steps, seconds, sums (floats, or tensors
    # on the loss's device until the record), rank 0's latest scalars
    _n: int
    _step_s: float
    _data_s: float
    _loss: Any
    _losses: int
    _tokens: Any
    _scalars: dict[str, Any]
    _mine: dict[str, int]  # this rank's bytes per group in the window

    def __init__(
        self,
        *,
        group: Group | None = None,
        mesh: Mesh | None = None,
        model: Any = None,
        seq_len: int | None = None,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        log_dir: str | Path | None = None,
        jsonl: bool = True,
        tensorboard: bool = False,
        wandb: bool | dict[str, Any] = False,
        progress: bool | None = None,
        total: int | None = None,
        every: int = 1,
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"Metrics: every={every!r} must be a whole number of steps >= 1")
        self.group = group if group is not None else runtime.world_or_none()
        self.size = self.group.size if self.group is not None else 1
        self.rank = self.group.rank if self.group is not None else 0
        self.every = every
        nccl = self.group is not None and self.group.backend == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        self.flops_per_token, flops_source = self._flops(model, seq_len, flops_per_token)
        self.peak: flops.Peak | None = None
        if peak_flops is not None:
            self.peak = flops.Peak(float(peak_flops), "given (peak_flops=)")
        elif self.flops_per_token is not None:
            self.peak = flops.device_peak(self.device or _compute_device())
        self.memory_kind = probes.memory_kind()
        self._bytes = probes.BytesSent(mesh)
        self.log_dir = Path(log_dir) if log_dir is not None else _default_dir()
        self.info: dict[str, Any] = {
            "ranks": self.size,
            "group": self.group.name if self.group is not None else None,
            "flops_per_token": self.flops_per_token,
            "flops_source": flops_source,
            "peak_flops": self.peak.flops if self.peak else None,  # rank 0's
            "peak_source": self.peak.source if self.peak else None,
            "memory_kind": self.memory_kind,
            "every": every,
            "jsonl": jsonl,
        }
        self._writers: list[writers.Writer] = []
        if self.rank == 0:
            self._open(jsonl, tensorboard, wandb, progress, total)
        self.records: list[dict[str, Any]] = []  # every record so far (on every rank)
        self.steps = 0
        self._totals = {"steps": 0.0, "tokens": 0.0, "step_s": 0.0, "data_s": 0.0}
        self._sent: dict[str, float] = {}
        self._memory_max = 0
        self._closed = False
        self._window()
        self.start()

    # --- the loop's calls ------------------------------------------------------------------
    def start(self) -> None:
        """Start the clock of the next step (done at construction; call it right before
        the loop if the model is built or compiled after the metrics)."""
        self._clock = time.perf_counter()

    @contextlib.contextmanager
    def data(self) -> Iterator[None]:
        """``with metrics.data(): batch = next(it)``: the block's time counts as this step's
        data loading."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._data_s += time.perf_counter() - start

    def batches(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """``for batch in metrics.batches(loader)``: each ``next`` timed as :meth:`data`."""
        it = iter(iterable)
        while True:
            with self.data():
                try:
                    item = next(it)
                except StopIteration:
                    return
            yield item

    def step(
        self, loss: Any = None, *, tokens: Any = None, **scalars: float
    ) -> dict[str, Any] | None:
        """End one training step: ``loss`` (a float or a tensor, or None on a rank without
        one) and ``tokens`` (the global batch's tokens this step, the same on every rank);
        ``scalars`` (a learning rate, a gradient norm) are written as rank 0 passes them.
        Collective every ``every`` steps (module doc); returns the record then, else None.
        """
        now = time.perf_counter()
        self._step_s += now - self._clock
        self._clock = now
        self._n += 1
        self.steps += 1
        if loss is not None:
            self._loss = self._loss + (loss.detach().double() if torch.is_tensor(loss) else loss)
            self._losses += 1
        if tokens is not None:
            self._tokens = self._tokens + (tokens.double() if torch.is_tensor(tokens) else tokens)
        self._scalars.update(scalars)  # read (.item()) at the record, not every step
        if self._n < self.every:
            return None
        return self._reduce()

    def close(self) -> None:
        """Write the pending steps (collective when there are any), the summary into
        ``metrics.json``, and close the writers."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._n:
                self._reduce()
        finally:
            self._shut()

    def __enter__(self) -> Metrics:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is not None:  # a failed step: no collective the other ranks may not join
            self._closed = True
            self._shut()
        else:
            self.close()

    # --- what was measured -----------------------------------------------------------------
    @property
    def last(self) -> dict[str, Any] | None:
        """The latest record (every rank has it)."""
        return self.records[-1] if self.records else None

    def summary(self) -> dict[str, Any]:
        """The run so far: steps, tokens/s and MFU over all recorded steps (the first step's
        warm-up included), the mean step and data time, the largest peak memory of any rank,
        this rank's bytes sent per group and step."""
        t = self._totals
        rate = t["tokens"] / t["step_s"] if t["step_s"] > 0 else None
        steps = int(t["steps"])
        out: dict[str, Any] = {
            "steps": steps,
            "tokens_per_s": rate,
            "step_s": t["step_s"] / steps if steps else None,
            "data_s": t["data_s"] / steps if steps else None,
            "tflops_per_rank": None,
            "mfu": None,
            "memory_peak_bytes": self._memory_max,
            "memory_kind": self.memory_kind,
            "bytes_sent": {k: v / steps for k, v in self._sent.items()} if steps else {},
        }
        if rate is not None and self.flops_per_token is not None:
            achieved = self.flops_per_token * rate
            out["tflops_per_rank"] = achieved / self.size / 1e12
            peaks = self.info.get("peak_flops_per_rank")
            if peaks and sum(peaks) > 0:
                out["mfu"] = achieved / sum(peaks)
        return out

    def describe(self) -> str:
        """The run so far in one line: where the records are, tokens/s, MFU, peak memory
        per rank and what this rank sent per step on each group."""
        s = self.summary()
        where = f"{self.log_dir}/metrics.jsonl" if self.info.get("jsonl") else "not written"
        parts = [f"{s['steps']} steps"]
        if s["tokens_per_s"] is not None:
            parts.append(f"{s['tokens_per_s']:,.0f} tokens/s")
        if s["mfu"] is not None:
            parts.append(f"MFU {s['mfu']:.2%} ({s['tflops_per_rank']:.3g} TFLOP/s per rank)")
        mib = s["memory_peak_bytes"] / 2**20
        parts.append(f"peak memory {mib:,.0f} MiB per rank ({self.memory_kind})")
        sent = ", ".join(f"{k} {_size(v)}" for k, v in s["bytes_sent"].items())
        if sent:
            parts.append(f"sent per step by rank {self.rank}: {sent}")
        return f"metrics ({where}): " + "; ".join(parts)

    # --- inside ----------------------------------------------------------------------------
    def _flops(
        self, model: Any, seq_len: int | None, given: float | None
    ) -> tuple[float | None, str | None]:
        if given is not None:
            return float(given), "given (flops_per_token=)"
        if model is None:
            return None, None
        spec = flops.model_spec(model)
        return flops.flops_per_token(spec, seq_len=seq_len), f"plait.plan: {spec.name}"

    def _open(
        self,
        jsonl: bool,
        tensorboard: bool,
        wandb: bool | dict[str, Any],
        progress: bool | None,
        total: int | None,
    ) -> None:
        if jsonl:
            self._writers.append(writers.JsonLines(self.log_dir / "metrics.jsonl"))
        if tensorboard:
            self._writers.append(writers.TensorBoard(self.log_dir / "tensorboard", self.info))
        if wandb:
            options = wandb if isinstance(wandb, dict) else {}
            self._writers.append(writers.WandB(self.log_dir, self.info, options))
        if progress or (progress is None and sys.stderr.isatty()):
            self._writers.append(writers.Progress(total))

    def _window(self) -> None:
        self._n = 0
        self._step_s = self._data_s = 0.0
        self._loss = 0.0
        self._losses = 0
        self._tokens = 0.0
        self._scalars = {}

    def _row(self, device: torch.device) -> torch.Tensor:
        table = torch.zeros(self.size, COLUMNS, dtype=torch.float64, device=device)
        row = table[self.rank]
        sent = self._bytes.read()
        self._mine = sent
        row[STEPS], row[STEP_S], row[DATA_S] = self._n, self._step_s, self._data_s
        row[LOSS], row[LOSSES], row[TOKENS] = self._loss, self._losses, self._tokens
        row[MEMORY] = probes.peak_memory(self.memory_kind)
        row[SENT] = sum(sent.values())
        row[PEAK] = self.peak.flops if self.peak else 0.0
        return table

    def _reduce(self) -> dict[str, Any]:
        table = self._row(self.device or torch.device("cpu"))
        if self.group is not None and self.size > 1:
            try:
                dist.all_reduce(table, group=self.group.pg)
            except RuntimeError as exc:
                line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                raise RuntimeError(
                    f"metrics: rank {self.group.global_rank}: the all-reduce of step "
                    f"{self.steps}'s metrics over group {self.group.name!r} failed ({line}); "
                    f"every rank of the group must call Metrics.step the same number of "
                    f"times (every={self.every}) and Metrics.close once"
                ) from exc
        rows = table.tolist()
        record = self._record(rows)
        self._window()
        self.records.append(record)
        for w in self._writers:
            w.write(record)
        self._clock = time.perf_counter()  # the reduction and the writes are no step's time
        return record

    def _record(self, rows: list[list[float]]) -> dict[str, Any]:
        n = rows[0][STEPS]
        if any(r[STEPS] != n for r in rows):
            counts = {i: int(r[STEPS]) for i, r in enumerate(rows)}
            raise RuntimeError(
                f"metrics: the ranks recorded different numbers of steps since the last "
                f"record {counts}: every rank must call Metrics.step once a step"
            )
        step_s = [r[STEP_S] / n for r in rows]
        slowest = max(step_s)
        passed = {i: r[TOKENS] for i, r in enumerate(rows) if r[TOKENS] > 0}
        if len(set(passed.values())) > 1:
            said = ", ".join(f"rank {i}: {v:g}" for i, v in passed.items())
            raise ValueError(
                f"metrics: tokens= differs between ranks over the last {int(n)} steps "
                f"({said}); pass the global batch's tokens, the same number on every rank"
            )
        tokens = max(passed.values(), default=0.0) / n
        losses = sum(r[LOSSES] for r in rows)
        peaks = [r[PEAK] for r in rows]
        if self.peak is not None and "peak_flops_per_rank" not in self.info:
            self.info["peak_flops_per_rank"] = peaks
        rate = tokens / slowest if tokens and slowest > 0 else None
        achieved = self.flops_per_token * rate if rate and self.flops_per_token else None
        memory = [int(r[MEMORY]) for r in rows]
        record: dict[str, Any] = {
            "step": self.steps,
            "time": time.time(),
            "loss": sum(r[LOSS] for r in rows) / losses if losses else None,
            "tokens": tokens or None,
            "step_s": slowest,
            "step_s_per_rank": step_s,
            "data_s": max(r[DATA_S] for r in rows) / n,
            "tokens_per_s": rate,
            "tokens_per_s_per_rank": [
                tokens / self.size / s if tokens and s > 0 else None for s in step_s
            ],
            "tflops_per_rank": achieved / self.size / 1e12 if achieved else None,
            "mfu": achieved / sum(peaks) if achieved and sum(peaks) > 0 else None,
            "memory_peak_bytes": memory,
            "bytes_sent": {k: v / n for k, v in self._mine.items()},
            "bytes_sent_per_rank": [r[SENT] / n for r in rows],
            **{k: _number(v) for k, v in self._scalars.items()},
        }
        t = self._totals
        t["steps"] += n
        t["tokens"] += tokens * n
        t["step_s"] += slowest * n
        t["data_s"] += record["data_s"] * n
        for k, v in self._mine.items():
            self._sent[k] = self._sent.get(k, 0.0) + v
        self._memory_max = max(self._memory_max, *memory)
        return record

    def _shut(self) -> None:
        if self.rank == 0 and any(isinstance(w, writers.JsonLines) for w in self._writers):
            text = json.dumps({"info": self.info, "summary": self.summary()}, indent=1)
            (self.log_dir / "metrics.json").write_text(text)
        for w in self._writers:
            w.close()
        self._writers = []


def _compute_device() -> torch.device:
    """The device this process computes on: CUDA's current one once CUDA is in use."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _default_dir() -> Path:
    return Path("runs") / f"metrics-{time.strftime('%Y%m%d-%H%M%S')}"


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    return f"{n / 1024:.1f} KiB" if n < 2**20 else f"{n / 2**20:.2f} MiB"


def _number(value: Any) -> float:
    return float(value.item() if torch.is_tensor(value) else value)


__all__ = ["COLUMNS", "Metrics"]
