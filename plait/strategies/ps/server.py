"""One parameter-server rank: it owns a shard of the parameters and its optimizer.

The server runs one handler thread per worker. A handler receives that worker's
messages in order (PUSH + gradient, PULL, SAVE, DONE) and answers PULLs with the shard's
parameters once the update rule allows. Updates are applied one at a time under the
server's lock, in arrival order (pushes that arrive while an update runs wait in a queue
whose length is recorded). The rule is the mode:

- ``sync``: the gradients pushed for version t are kept until ``needed`` of them arrived
  (every active worker, or n - ``backup_workers``); their average (summed in worker-rank
  order, so the result does not depend on arrival order) is applied once, and the shard
  becomes version t+1. A PULL after pushing version t is answered with version t+1. A
  gradient for an older version (a late worker when backups are on) is dropped and
  counted.
- ``async``: each gradient is applied as it arrives; its staleness tau (the server
  version now minus the version it was computed on) goes into a histogram. PULLs are
  answered at once with the current version. With ``staleness_aware`` (the default) a
  gradient of staleness tau > 1 is divided by tau before the optimizer sees it: Zhang et
  al.'s staleness-aware learning rate lr / tau ("Staleness-aware Async-SGD", IJCAI 2016),
  applied to the gradient so that with momentum the stale gradient also enters the
  momentum buffer damped (scaling only the step's lr would let it act at full weight in
  every later step). An optimizer that normalises the gradient (Adam) undoes a uniform
  scaling. With ``max_staleness`` k a gradient staler than k is refused: not applied,
  counted in ``stats.refused`` and warned about once per worker, naming the worker, its
  staleness and the bound (the worker's next PULL brings it the current version).
- ``ssp``: as ``async``, but a PULL from a worker whose clock (pushes applied) is more
  than ``staleness`` ahead of the slowest active worker waits until it is not; the wait
  is counted and timed, and the clock gap at every answer is recorded.

Liveness: no receive has a timeout (in gloo a timed-out receive fails every connection
of the process). A worker is failed when its connection fails (it died), when it sends a
malformed message, or when a monitor thread finds its heartbeat older than the heartbeat
timeout (it hangs; see ``liveness.py``). A worker that is slow but alive is waited for,
however long. Its rank and the reason go into the stats. In ``async``/``ssp`` the server
goes on with the others. In ``sync`` it goes on only while the remaining workers can still
provide ``needed`` gradients; otherwise every waiting worker is sent ABORT naming the
failed rank and :meth:`Server.serve` raises :class:`WorkerFailed`. A handler thread never
ends silently: an unexpected error fails its worker, is recorded in ``stats.errors`` and
makes :meth:`Server.serve` raise :class:`ServerError` once the others are done.
:meth:`Server.serve` returns only when every worker sent DONE or is named as failed.

Pushes are step-stamped: a PUSH carries the worker's clock on this server (its count of
pushes), and a push whose clock the server has already applied (a retry, or a replay
after a restart) is ignored and counted in ``stats.duplicates``; no update is applied
twice. PARAMS carries the clock the server expects next, so a restarted worker continues
the stamps of a resumed server.

Checkpoints: the shard, its optimizer state, the version and the clocks are written to
``<dir>/server-<index>.pt`` atomically (temporary file, fsync, rename) every
``checkpoint_every`` updates and on a worker's SAVE; ``resume=True`` starts from that file.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from plait.checkpoint.files import save_atomic
from plait.comm.group import Group
from plait.strategies.ps.liveness import Liveness
from plait.strategies.ps.protocol import Header, Kind, Link, MalformedMessage, PeerLost
from plait.trace import Tracer

MODES = ("sync", "async", "ssp")


class WorkerFailed(RuntimeError):
    """Training cannot go on because a worker failed; ``rank`` names it."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class ServerError(RuntimeError):
    """A server's handler thread failed unexpectedly; ``errors`` lists what each raised."""

    def __init__(self, message: str, errors: list[str]) -> None:
        super().__init__(message)
        self.errors = errors


@dataclass
class ServerStats:
    """What one server did; the staleness histogram maps staleness -> updates."""

    index: int
    rank: int
    mode: str
    version: int = 0
    start_version: int = 0
    updates: int = 0
    gradients: int = 0
    dropped: int = 0
    staleness: dict[int, int] = field(default_factory=dict)
    queue_max: int = 0
    queue_mean: float = 0.0
    ssp_waits: int = 0
    ssp_wait_s: float = 0.0
    max_clock_gap: int = 0
    clock_gaps: list[int] = field(default_factory=list)
    failed_workers: dict[int, str] = field(default_factory=dict)
    failed_at: dict[int, float] = field(default_factory=dict)  # time.time() of the verdict
    finished_workers: list[int] = field(default_factory=list)
    duplicates: int = 0  # pushes whose clock was already applied: ignored
    refused: int = 0  # async: gradients staler than max_staleness, not applied
    scaled: int = 0  # async/ssp: gradients divided by their staleness (staleness_aware)
    errors: list[str] = field(default_factory=list)  # unexpected handler-thread errors
    checkpoints: int = 0
    seconds: float = 0.0

    @property
    def mean_staleness(self) -> float:
        total = sum(self.staleness.values())
        return sum(s * c for s, c in self.staleness.items()) / total if total else 0.0


def checkpoint_path(directory: str | Path, index: int) -> Path:
    return Path(directory) / f"server-{index}.pt"


class Server:
    """Serve one shard to ``workers`` (global ranks) until every worker sent DONE or failed.

    ``shard`` is this server's slice of the flat parameters (updated in place);
    ``make_optimizer(params)`` builds the optimizer for it. ``timeout``: seconds without a
    heartbeat after which a worker counts as dead (default: the heartbeat timeout);
    ``liveness`` replaces the heartbeat reader (tests).
    """

    def __init__(
        self,
        *,
        group: Group,
        index: int,
        shard: torch.Tensor,
        make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
        workers: list[int],
        mode: str,
        staleness: int,
        backup_workers: int,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = 0,
        resume: bool = False,
        timeout: float | None = None,
        tracer: Tracer | None = None,
        liveness: Liveness | None = None,
        staleness_aware: bool = True,
        max_staleness: int | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.staleness_aware = staleness_aware
        self.max_staleness = max_staleness
        self._warned_stale: set[int] = set()
        self.group = group
        self.index = index
        self.param = torch.nn.Parameter(shard, requires_grad=False)
        self.optimizer = make_optimizer([self.param])
        self.workers = list(workers)
        self.mode = mode
        self.staleness_bound = staleness
        self.backup_workers = backup_workers
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.tracer = tracer
        self.liveness = liveness if liveness is not None else Liveness(timeout=timeout)
        self.timeout = self.liveness.timeout
        self.version = 0
        self.clocks = {w: 0 for w in self.workers}
        self.active = set(self.workers)  # neither finished nor failed
        self.pending: dict[int, torch.Tensor] = {}  # sync: gradients for the current version
        self.fatal: WorkerFailed | None = None
        self.stats = ServerStats(index=index, rank=group.global_rank, mode=mode)
        self._cv = threading.Condition()
        self._queued = 0
        self._queue_samples: list[int] = []
        if resume:
            if checkpoint_dir is None:
                raise ValueError("resume=True needs checkpoint_dir")
            self._load(checkpoint_path(checkpoint_dir, index))
        self.stats.start_version = self.version

    # --- the rule ------------------------------------------------------------------------
    def needed(self) -> int:
        """Gradients a sync step waits for: n - backups, at most the active workers."""
        return max(1, min(len(self.workers) - self.backup_workers, len(self.active)))

    def _apply(self, grads: list[torch.Tensor], lr: float) -> None:
        """One optimizer step on the average of ``grads`` (caller holds the lock)."""
        token = self.tracer.begin("apply update", stream="compute") if self.tracer else None
        grad = grads[0].clone() if len(grads) > 1 else grads[0]
        for g in grads[1:]:
            grad += g
        if len(grads) > 1:
            grad /= len(grads)
        self.param.grad = grad
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.param.grad = None
        self.version += 1
        self.stats.updates += 1
        self._queue_samples.append(self._queued)
        if self.checkpoint_every and self.version % self.checkpoint_every == 0:
            self._save()
        if token is not None and self.tracer is not None:
            self.tracer.end(token)
        self._cv.notify_all()

    def _push(self, worker: int, header: Header, grad: torch.Tensor) -> None:
        with self._cv:
            self._queued -= 1
            self.stats.gradients += 1
            if self.fatal is not None:
                return
            if worker not in self.active:  # declared failed (or done): not applied
                self.stats.dropped += 1
                return
            if header.clock < self.clocks[worker] or (
                self.mode == "sync" and worker in self.pending
            ):
                self.stats.duplicates += 1  # this stamp was applied (or is pending): once only
                return
            if self.mode == "sync":
                if header.version < self.version:
                    self.stats.dropped += 1  # a late gradient: the step went on without it
                    return
                if header.version > self.version:
                    raise MalformedMessage(
                        f"PUSH from rank {worker} for version {header.version}, but shard "
                        f"{self.index} is at version {self.version}: in sync mode a worker "
                        f"pushes only for the version it pulled",
                        worker,
                    )
                self.pending[worker] = grad
                self._maybe_step(header.lr)
            else:
                stale = self.version - header.version
                self.stats.staleness[stale] = self.stats.staleness.get(stale, 0) + 1
                self.clocks[worker] += 1
                if self.max_staleness is not None and stale > self.max_staleness:
                    self._refuse(worker, stale)
                    return
                if self.staleness_aware and stale > 1:
                    grad.div_(stale)  # lr / tau, and damped in a momentum buffer too
                    self.stats.scaled += 1
                self._apply([grad], header.lr)

    def _refuse(self, worker: int, stale: int) -> None:
        """A gradient staler than ``max_staleness``: counted, warned about once per worker."""
        self.stats.refused += 1
        if worker not in self._warned_stale:
            self._warned_stale.add(worker)
            warnings.warn(
                f"parameter server {self.index} (rank {self.group.global_rank}): refused a "
                f"gradient of worker rank {worker} with staleness {stale} > max_staleness="
                f"{self.max_staleness} (not applied; counted in stats.refused). Raise "
                f"max_staleness, or use mode='ssp' to make fast workers wait instead",
                RuntimeWarning,
                stacklevel=2,
            )

    def _maybe_step(self, lr: float | None = None) -> None:
        if self.mode != "sync" or not self.pending or len(self.pending) < self.needed():
            return
        grads = [self.pending[w] for w in sorted(self.pending)]
        for w in self.pending:
            self.clocks[w] += 1
        self.stats.staleness[0] = self.stats.staleness.get(0, 0) + len(grads)
        self.pending = {}
        self._apply(grads, self._lr if lr is None else lr)

    @property
    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _ready_for(self, worker: int, last: int) -> bool:
        """May ``worker``, which last received version ``last``, get parameters now?"""
        if self.fatal is not None:
            return True
        if self.mode == "sync":
            return last < 0 or self.version > last
        if self.mode == "ssp":
            return self._gap(worker) <= self.staleness_bound
        return True

    def _gap(self, worker: int) -> int:
        others = [self.clocks[w] for w in self.active] or [self.clocks[worker]]
        return self.clocks[worker] - min(others)

    def _pull(self, worker: int, link: Link, header: Header) -> bool:
        """Answer a PULL; False if training was aborted (ABORT sent). Waits as long as the
        rule says, with no deadline: workers that die are failed by their connection or
        by the heartbeat monitor, which wakes this wait."""
        with self._cv:
            if not self._ready_for(worker, header.version):
                self.stats.ssp_waits += self.mode == "ssp"
                t0 = time.perf_counter()
                while not self._ready_for(worker, header.version) and worker in self.active:
                    self._cv.wait(1.0)
                if self.mode == "ssp":
                    self.stats.ssp_wait_s += time.perf_counter() - t0
            fatal = self.fatal
            if fatal is None and worker not in self.active:
                fatal = WorkerFailed(f"worker rank {worker} was declared failed", worker)
            if fatal is None:
                if self.mode == "ssp" and worker in self.active:
                    gap = self._gap(worker)
                    self.stats.clock_gaps.append(gap)
                    self.stats.max_clock_gap = max(self.stats.max_clock_gap, gap)
                version = self.version
                data = self.param.detach().clone()
        if fatal is not None:
            link.send_header(Header(Kind.ABORT, shard=self.index, extra=fatal.rank))
            return False
        clock = self.clocks[worker]
        link.send_header(Header(Kind.PARAMS, version, self.index, data.numel(), clock=clock))
        link.send(data)
        return True

    # --- failures and the end -------------------------------------------------------------
    def _fail_locked(self, worker: int, reason: str) -> None:
        if worker not in self.active:
            return
        self.active.discard(worker)
        self.pending.pop(worker, None)
        self.stats.failed_workers[worker] = reason
        self.stats.failed_at[worker] = time.time()
        if self.mode == "sync" and len(self.active) + self.backup_workers < len(self.workers):
            if self.fatal is None:
                self.fatal = WorkerFailed(
                    f"parameter server {self.index} (rank {self.group.global_rank}): worker "
                    f"rank {worker} failed ({reason}). Synchronous training needs every "
                    f"worker's gradient, or n - backup_workers of them: {len(self.active)} "
                    f"of {len(self.workers)} workers are left with backup_workers="
                    f"{self.backup_workers}. Restart from the last checkpoint, or use "
                    f"backup_workers / mode='async' to tolerate failures",
                    worker,
                )
        else:
            self._maybe_step()
        self._cv.notify_all()

    def _finish(self, worker: int) -> None:
        with self._cv:
            self.active.discard(worker)
            self.stats.finished_workers.append(worker)
            self._maybe_step()
            self._cv.notify_all()

    def _handle(self, worker: int) -> None:
        """One worker's messages, in order, until DONE or failure. Never ends silently:
        an unexpected error fails the worker and is recorded in ``stats.errors``."""
        link = Link(self.group, worker, what=f"worker rank {worker}")
        try:
            self._handle_messages(worker, link)
        except Exception as exc:  # a defect: surfaces in serve(), never lost with the thread
            why = f"{type(exc).__name__}: {exc}"
            with self._cv:
                self.stats.errors.append(f"handler of worker rank {worker}: {why}")
                self._fail_locked(worker, f"the server's handler failed ({why})")
            try:  # the worker may wait for an answer: stop it instead of leaving it hanging
                link.send_header(Header(Kind.ABORT, shard=self.index, extra=worker))
            except Exception:
                pass

    def _handle_messages(self, worker: int, link: Link) -> None:
        n = self.param.numel()
        kinds = (Kind.PUSH, Kind.PULL, Kind.SAVE, Kind.DONE)
        try:
            while True:
                header = link.recv_header(kinds=kinds, shard=self.index, length=n)
                if header.kind is Kind.PUSH:
                    grad = torch.empty_like(self.param)
                    with self._cv:
                        self._queued += 1
                    link.recv(grad)
                    self._push(worker, header, grad)
                elif header.kind is Kind.PULL:
                    if not self._pull(worker, link, header):
                        with self._cv:  # sent ABORT: this worker stops, nothing to wait for
                            self.active.discard(worker)
                            self._cv.notify_all()
                        return
                elif header.kind is Kind.SAVE:
                    with self._cv:
                        self._save()
                else:
                    self._finish(worker)
                    return
        except (PeerLost, MalformedMessage) as exc:
            with self._cv:
                self._fail_locked(worker, str(exc))

    def _monitor(self, stop: threading.Event) -> None:
        """Fail active workers whose heartbeat stopped (hung processes: a dead one's
        connection fails by itself)."""
        period = min(0.5, self.timeout / 4)
        while not stop.wait(period):
            with self._cv:
                active = sorted(self.active)
            for w in active:
                try:
                    why = self.liveness.dead(w)
                except Exception as exc:  # the store went away: no verdict this round
                    why = None
                    self.stats.errors.append(f"heartbeat of worker rank {w}: {exc}")
                if why is not None:
                    with self._cv:
                        self._fail_locked(w, why)

    def serve(self) -> ServerStats:
        """Serve until every worker sent DONE or is named as failed; raises
        :class:`WorkerFailed` when synchronous training could not go on and
        :class:`ServerError` when a handler thread failed."""
        t0 = time.perf_counter()
        threads = [
            threading.Thread(target=self._handle, args=(w,), name=f"plait-ps-w{w}", daemon=True)
            for w in self.workers
        ]
        stop = threading.Event()
        monitor = threading.Thread(
            target=self._monitor, args=(stop,), name="plait-ps-liveness", daemon=True
        )
        for t in threads:
            t.start()
        monitor.start()
        with self._cv:
            while self.active:
                self._cv.wait(1.0)
        stop.set()
        for t in threads:  # a hung worker's handler stays blocked in its receive (daemon)
            t.join(timeout=1.0)
        monitor.join(timeout=2.0)
        self.stats.version = self.version
        self.stats.seconds = time.perf_counter() - t0
        samples = self._queue_samples
        self.stats.queue_max = max(samples, default=0)
        self.stats.queue_mean = sum(samples) / len(samples) if samples else 0.0
        if self.fatal is not None:
            raise self.fatal
        if self.stats.errors:
            raise ServerError(
                f"parameter server {self.index} (rank {self.group.global_rank}): "
                + "; ".join(self.stats.errors),
                list(self.stats.errors),
            )
        return self.stats

    # --- checkpoints ---------------------------------------------------------------------
    def _save(self) -> None:
        if self.checkpoint_dir is None:
            return
        state: dict[str, Any] = {
            "format": "plait.ps.server/1",
            "index": self.index,
            "version": self.version,
            "shard": self.param.detach().clone(),
            "optimizer": self.optimizer.state_dict(),
            "clocks": dict(self.clocks),
            "mode": self.mode,
        }
        save_atomic(state, checkpoint_path(self.checkpoint_dir, self.index))
        self.stats.checkpoints += 1

    def _load(self, path: Path) -> None:
        if not path.exists():
            raise FileNotFoundError(
                f"parameter server {self.index}: no checkpoint at {path} to resume from; "
                f"train with checkpoint_dir={str(path.parent)!r} first, or pass resume=False"
            )
        state = torch.load(path, weights_only=True)
        if state.get("format") != "plait.ps.server/1" or state.get("index") != self.index:
            raise ValueError(f"{path} is not a checkpoint of parameter server {self.index}")
        shard = state["shard"]
        if shard.shape != self.param.shape:
            raise ValueError(
                f"{path} holds a shard of {shard.numel()} elements, but server {self.index} "
                f"now owns {self.param.numel()}: resume with the same model and number of "
                f"servers"
            )
        with torch.no_grad():
            self.param.copy_(shard)
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        saved = {int(k): int(v) for k, v in state["clocks"].items()}
        self.clocks = {w: saved.get(w, 0) for w in self.workers}
