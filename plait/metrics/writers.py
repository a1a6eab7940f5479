"""Where records go: a JSON-lines file (the default), TensorBoard, W&B, a progress bar.

Rank 0 writes; the other ranks make no writer. Every writer takes the same record (a flat
dict per logging step, :mod:`plait.metrics.meter`) and maps it to its library's calls:
TensorBoard's ``SummaryWriter.add_scalar`` and W&B's ``run.log`` get scalars, a per-rank
list as ``name/rank<i>`` and a per-group dict as ``name/<group>`` (:func:`scalars`).
TensorBoard and W&B are imported when asked for, with an error naming the extra
(``pip install 'plait[metrics]'``) if they are missing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Protocol

from plait.extras import require

EXTRA = "pip install 'plait[metrics]'"
#: per-rank lists longer than this reach TensorBoard and W&B as min / mean / max only
MAX_RANK_TAGS = 64
SKIPPED = ("step", "time")


class Writer(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers by tag: ``loss``, ``tokens_per_s_per_rank/rank1``,
    ``bytes_sent/tp``; ``None`` (not measured) is left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in SKIPPED or value is None or isinstance(value, (bool, str)):
            continue
        if isinstance(value, dict):
            out.update({f"{key}/{k}": float(v) for k, v in value.items() if v is not None})
        elif isinstance(value, (list, tuple)):
            values = [float(v) for v in value if v is not None]
            if len(values) > MAX_RANK_TAGS:
                out.update({
                    f"{key}/min": min(values), f"{key}/max": max(values),
                    f"{key}/mean": sum(values) / len(values),
                })  # fmt: skip
            else:
                out.update({f"{key}/rank{r}": v for r, v in enumerate(values)})
        else:
            out[key] = float(value)
    return out


class JsonLines:
    """One JSON object a line in ``path``, flushed every line (a dashboard may tail it)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("w")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoard:
    """``torch.utils.tensorboard.SummaryWriter`` on ``log_dir``: a scalar per tag and step,
    and the run's description (``info``) as text."""

    def __init__(self, log_dir: Path, info: dict[str, Any]) -> None:
        try:
            from torch.utils.tensorboard import (
                SummaryWriter,  # deferred: an optional extra (plait[metrics])
            )
        except ImportError as exc:
            raise ImportError(
                f"metrics: tensorboard=True needs the tensorboard package ({EXTRA}): {exc}"
            ) from exc
        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir))
        self._writer.add_text("run", "    " + json.dumps(info, indent=1).replace("\n", "\n    "))

    def write(self, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=record["step"])

    def close(self) -> None:
        self._writer.close()


class WandB:
    """A W&B run (``wandb.init``, offline unless ``options`` says ``mode=``) writing under
    ``log_dir``; ``info`` is its config. ``options`` go to ``wandb.init`` as given
    (``project=``, ``name=``, ``mode="online"``...)."""

    def __init__(self, log_dir: Path, info: dict[str, Any], options: dict[str, Any]) -> None:
        try:
            import wandb  # deferred: an optional extra (plait[metrics])
        except ImportError as exc:
            raise ImportError(
                f"metrics: wandb=True needs the wandb package ({EXTRA}): {exc}"
            ) from exc
        log_dir.mkdir(parents=True, exist_ok=True)
        kwargs: dict[str, Any] = {"mode": "offline", "project": "plait", "dir": str(log_dir)}
        kwargs.update(options)
        kwargs["config"] = {**info, **kwargs.get("config", {})}
        self._run = wandb.init(**kwargs)
        self.dir = Path(self._run.dir).parent  # the run's folder (files/ is run.dir)

    def write(self, record: dict[str, Any]) -> None:
        self._run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self._run.finish()


class Progress:
    """A tqdm bar of ``total`` steps on standard error, with the last loss, tokens/s and
    MFU beside it."""

    def __init__(self, total: int | None) -> None:
        tqdm = require("tqdm", why="plait.metrics' progress bar (progress=True)").tqdm
        self._bar = tqdm(total=total, desc="training", unit="step", file=sys.stderr,
                         dynamic_ncols=True)  # fmt: skip
        self._done = 0

    def write(self, record: dict[str, Any]) -> None:
        self._bar.update(record["step"] - self._done)
        self._done = record["step"]
        shown = {}
        if record.get("loss") is not None:
            shown["loss"] = f"{record['loss']:.4g}"
        shown["tokens/s"] = f"{record['tokens_per_s']:,.0f}" if record.get("tokens_per_s") else "-"
        if record.get("mfu") is not None:
            shown["MFU"] = f"{record['mfu']:.1%}"
        self._bar.set_postfix(shown, refresh=False)

    def close(self) -> None:
        self._bar.close()


def to_tensorboard(
    jsonl: str | Path, log_dir: str | Path, info: dict[str, Any] | None = None
) -> int:
    """Write the records of a ``metrics.jsonl`` to TensorBoard events under ``log_dir``
    (the tour gathers its layouts' runs this way, each in a folder of one logdir); returns
    how many records it wrote."""
    lines = Path(jsonl).read_text().splitlines()
    board = TensorBoard(Path(log_dir), info or {"from": str(jsonl)})
    try:
        for line in lines:
            board.write(json.loads(line))
    finally:
        board.close()
    return len(lines)


__all__ = [
    "EXTRA",
    "JsonLines",
    "Progress",
    "TensorBoard",
    "WandB",
    "Writer",
    "scalars",
    "to_tensorboard",
]
