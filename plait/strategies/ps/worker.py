"""The worker side of the parameter server: an optimizer whose ``step`` pushes and pulls.

A worker's trainable parameters are views into one flat buffer, laid out as the servers
shard it (server i owns ``bounds[i]``). ``step()`` does, per server i:

1. PUSH: a header (the version the gradient was computed on, the worker's step count
   and learning rate) and the gradient slice ``bounds[i]`` (float, ``hi - lo`` elements);
2. PULL: a header with the version last received; the server answers, when its mode
   allows, with PARAMS (header + the slice, received straight into the parameters) or
   ABORT (training stopped because a worker failed: :class:`WorkerFailed` is raised).

Pushes to all servers are started before any is waited for, so the servers receive in
parallel. Construction pulls once (version -1), so the model starts from the servers'
parameters and each server's clock for this worker (pushes are stamped with it; see
``server.py``). ``finish()`` sends DONE; ``request_checkpoint()`` sends SAVE.

A server that dies (its connection fails) or hangs (its heartbeat is older than the
heartbeat timeout; waits are watched, never timed out) raises :class:`ServerLost` naming
the server and its rank, within that timeout.

Time is split into compute (from the end of one pull to the next ``step()``: forward
and backward), waiting (push + pull: transfer, the servers' update, and in ``sync`` /
``ssp`` the wait for other workers) and injected straggler delay (``slowdown`` > 1
sleeps ``(slowdown - 1)`` x the compute time of each step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from plait.comm.group import Group
from plait.strategies.ps.liveness import Liveness
from plait.strategies.ps.protocol import Header, Kind, Link, PeerLost
from plait.strategies.ps.server import WorkerFailed
from plait.trace import Tracer


@dataclass
class WorkerStats:
    rank: int
    steps: int = 0
    seconds: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0
    injected_s: float = 0.0
    versions: list[int] = field(default_factory=list)  # server 0's version, per step

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0


class ServerLost(PeerLost):
    """A parameter server died or hangs; ``rank`` is its global rank, ``index`` its shard."""

    def __init__(self, message: str, rank: int, index: int) -> None:
        super().__init__(message, rank)
        self.index = index


class WorkerOptimizer(torch.optim.Optimizer):
    """Stands in for the optimizer on worker ranks; the servers own the real one.

    ``param_groups[0]["lr"]`` is sent with every push and used by the servers, so
    learning-rate schedulers attached to this optimizer keep working. Other
    hyper-parameters are those the optimizer had at ``prepare`` time.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        defaults: dict[str, Any],
        *,
        group: Group,
        servers: Sequence[int],
        bounds: Sequence[tuple[int, int]],
        flat: torch.Tensor,
        slowdown: float = 1.0,
        timeout: float | None = None,
        tracer: Tracer | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        super().__init__(list(params), defaults)
        self.liveness = liveness if liveness is not None else Liveness(timeout=timeout)
        self.links = [
            Link(
                group,
                s,
                watch=lambda s=s: self.liveness.dead(s),  # type: ignore[misc]
                what=f"parameter server {i} (rank {s})",
            )
            for i, s in enumerate(servers)
        ]
        self.bounds = list(bounds)
        self.flat = flat
        self.flat_grad = torch.zeros_like(flat)
        self.slowdown = float(slowdown)
        self.tracer = tracer
        self.versions = [-1] * len(self.links)
        self.clocks = [0] * len(self.links)  # the stamp of the next push to each server
        self.stats = WorkerStats(rank=group.global_rank)
        self.finished = False
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._start = time.perf_counter()
        self._guarded(self._pull)
        self._ready_at = time.perf_counter()

    @property
    def version(self) -> int:
        """The (first server's) version of the parameters the model now holds."""
        return self.versions[0]

    def _span(self, name: str, stream: str) -> int | None:
        return self.tracer.begin(name, stream=stream) if self.tracer is not None else None

    def _end(self, token: int | None) -> None:
        if token is not None and self.tracer is not None:
            self.tracer.end(token)

    def _flatten_grads(self) -> None:
        offset = 0
        for p in self._params:
            n = p.numel()
            view = self.flat_grad[offset : offset + n]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
            offset += n

    def _guarded(self, fn: Callable[[], None]) -> None:
        """Run ``fn``; a lost server becomes :class:`ServerLost` saying what to do."""
        try:
            fn()
        except ServerLost:
            raise
        except PeerLost as exc:
            self.finished = True
            index = next(i for i, link in enumerate(self.links) if link.peer == exc.rank)
            raise ServerLost(
                f"worker rank {self.stats.rank}: parameter server {index} (rank {exc.rank}) "
                f"is lost, training cannot go on: {exc}. Restart the job; servers started "
                f"with checkpoint_dir=... and resume=True continue from their last "
                f"checkpoint",
                exc.rank,
                index,
            ) from exc

    def _pull(self) -> None:
        for i, link in enumerate(self.links):
            link.send_header(Header(Kind.PULL, version=self.versions[i], shard=i))
        aborted: list[tuple[int, Header]] = []
        for i, link in enumerate(self.links):
            lo, hi = self.bounds[i]
            header = link.recv_header(kinds=(Kind.PARAMS, Kind.ABORT), shard=i, length=hi - lo)
            if header.kind is Kind.ABORT:
                aborted.append((i, header))
                continue
            link.recv(self.flat[lo:hi])
            if self.versions[i] < 0:  # the first pull: continue the server's stamps
                self.clocks[i] = header.clock
            self.versions[i] = header.version
        if aborted:
            # the other servers answered this pull; tell them this worker leaves
            stopped = {i for i, _ in aborted}
            for i, link in enumerate(self.links):
                if i not in stopped:
                    link.send_header(Header(Kind.DONE, shard=i))
            self.finished = True
            i, header = aborted[0]
            raise WorkerFailed(
                f"worker rank {self.stats.rank}: parameter server {i} (rank "
                f"{self.links[i].peer}) stopped training because worker rank {header.extra} "
                f"failed; see that rank's log and the server's error",
                header.extra,
            )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if self.finished:
            raise RuntimeError("this parameter-server worker has called finish(); no more steps")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        now = time.perf_counter()
        compute = now - self._ready_at
        self.stats.compute_s += compute
        if self.slowdown > 1.0:
            token = self._span("straggler delay", "compute")
            time.sleep((self.slowdown - 1.0) * compute)
            self._end(token)
            self.stats.injected_s += time.perf_counter() - now
        self._flatten_grads()
        t0 = time.perf_counter()
        token = self._span("push + pull", "comm")
        self.stats.versions.append(self.versions[0])
        self._guarded(self._push_and_pull)
        self._end(token)
        self.stats.steps += 1
        self._ready_at = time.perf_counter()
        self.stats.wait_s += self._ready_at - t0
        self.stats.seconds = self._ready_at - self._start
        return loss

    def _push_and_pull(self) -> None:
        lr = float(self.param_groups[0]["lr"])
        started = []
        for i, link in enumerate(self.links):
            lo, hi = self.bounds[i]
            clock = self.clocks[i]
            header = Header(Kind.PUSH, self.versions[i], i, hi - lo, clock=clock, lr=lr)
            link.send_header(header)
            started.append(link.start_send(self.flat_grad[lo:hi]))
            self.clocks[i] = clock + 1
        for link, s in zip(self.links, started, strict=True):
            link.finish_send(s)
        self._pull()

    def request_checkpoint(self) -> None:
        """Ask every server to checkpoint its shard now (at its current version)."""
        for i, link in enumerate(self.links):
            link.send_header(Header(Kind.SAVE, shard=i))

    def finish(self) -> None:
        """Tell the servers this worker is done (idempotent). Call after the last step."""
        if self.finished:
            return
        self.finished = True
        for i, link in enumerate(self.links):
            link.send_header(Header(Kind.DONE, shard=i))
            link.close()
        self.stats.seconds = time.perf_counter() - self._start
