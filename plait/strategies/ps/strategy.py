"""``ParameterServer``: the world split into server ranks and worker ranks.

Group ranks ``0 .. servers-1`` are servers, the rest workers. The trainable parameters
(one dtype, CPU) are laid end to end in registration order and cut into ``servers``
contiguous ranges whose sizes differ by at most one element (a large tensor is split
across servers; :func:`plait.strategies.zero.partition` gives the pieces). Server i owns
range i and runs the user's optimizer (same class and hyper-parameters) on it.

Communication contract, on ``group``:

- ``wrap`` (every rank): :func:`~plait.strategies.consistency.verify_same_parameters`
  (every rank built the same model: names, shapes, dtypes, through the store), then one
  ``broadcast`` of the flat parameters and one per buffer from group rank 0, so every
  server starts from the same model; with more than one server, a subgroup of the
  servers is created (``new_group``, called by every rank; destroyed after the servers'
  final all-gather). In ``async``/``ssp`` mode each
  worker also sets the store key ``plait/launch/may_exit/<global rank>``: under
  ``plait run`` its death does not end the job (the servers go on without it);
- each worker step: per server, PUSH (header + gradient slice) and PULL (header), then
  PARAMS (header + parameter slice) back; point-to-point only (see ``protocol.py``).
  A worker sends and receives S·b bytes per step (S parameters, b bytes each); a server
  receives and sends its range once per worker per step, so with one server its link
  carries W·S·b bytes each way per step: the bottleneck the seeds describe;
- end (servers only): ``all_gather`` of the final ranges among the servers, so every
  server returns the whole trained model.

Buffers (e.g. BatchNorm statistics) are not synchronised after ``wrap``: each worker
keeps its own. Frozen parameters stay on each rank as they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait import comm, runtime
from plait.comm.group import Group
from plait.strategies.consistency import verify_same_parameters
from plait.strategies.ps.liveness import allow_exit
from plait.strategies.ps.server import MODES, Server, ServerStats
from plait.strategies.ps.worker import WorkerOptimizer, WorkerStats
from plait.strategies.zero import shard_bounds
from plait.trace import Tracer


class ParameterServer:
    """A parameter-server strategy: ``model, optimizer = ps.wrap(model, optimizer)``.

    Keyword-only configuration (the same on every rank):

    - ``servers``: how many of the group's ranks are servers (ranks 0..servers-1);
    - ``mode``: ``"sync"`` (average every worker's gradient per version: DDP on the global
      batch), ``"async"`` (apply each gradient as it arrives) or ``"ssp"`` (async, but no
      worker more than ``staleness`` steps ahead of the slowest);
    - ``staleness``: the ssp bound s >= 0 (only for ``"ssp"``);
    - ``staleness_aware`` (``async``/``ssp``, default True): a gradient of staleness tau > 1
      is applied divided by tau (the staleness-aware learning rate lr / tau of Zhang et
      al. 2016; with momentum the stale gradient enters the buffer damped too);
    - ``max_staleness`` (``async`` only): a gradient staler than this is refused (not
      applied, counted in the server's ``stats.refused``, warned about once per worker);
    - ``backup_workers``: sync only; a version is applied once n - b gradients arrived,
      late ones are dropped and counted;
    - ``checkpoint_dir`` / ``checkpoint_every`` / ``resume``: server checkpoints every k
      updates (and on ``optimizer.request_checkpoint()``), and resuming from them;
    - ``slow_workers``: ``{rank: factor}`` straggler injection for experiments;
    - ``timeout``: seconds without a heartbeat after which a peer counts as dead (default:
      the heartbeat timeout, ``PLAIT_HEARTBEAT_TIMEOUT`` or 5 s). No message wait has a
      timeout: a slow worker that still beats is waited for, never dropped;
    - ``group``: the ranks taking part (default: the world).

    On a worker rank ``wrap`` returns the model (its parameters now pulled from the
    servers) and a :class:`WorkerOptimizer`; train as usual and call
    ``optimizer.finish()`` after the last step. On a server rank ``wrap`` serves until
    every worker finished (or failed) and returns the trained model and ``None``.
    """

    def __init__(
        self,
        *,
        servers: int = 1,
        mode: str = "sync",
        staleness: int | None = None,
        backup_workers: int = 0,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = 0,
        resume: bool = False,
        slow_workers: dict[int, float] | None = None,
        timeout: float | None = None,
        group: Group | None = None,
        tracer: Tracer | None = None,
        staleness_aware: bool = True,
        max_staleness: int | None = None,
    ) -> None:
        self.group = group if group is not None else runtime.world()
        n = self.group.size
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(servers, int) or not 1 <= servers < n:
            raise ValueError(
                f"servers={servers!r}: need at least one server and one worker among the "
                f"{n} ranks of group {self.group.name!r}; use 1..{n - 1} servers (or more ranks)"
            )
        workers = n - servers
        if mode == "ssp":
            if not isinstance(staleness, int) or staleness < 0:
                raise ValueError(
                    f"mode='ssp' needs staleness=s, an integer >= 0 (how many steps a worker "
                    f"may run ahead of the slowest), got {staleness!r}"
                )
        elif staleness is not None:
            raise ValueError(f"staleness applies to mode='ssp' only, not mode={mode!r}")
        if max_staleness is not None:
            if mode != "async":
                raise ValueError(
                    f"max_staleness applies to mode='async' only (ssp bounds the workers' "
                    f"clocks with staleness=s), got mode={mode!r}"
                )
            if isinstance(max_staleness, bool) or not isinstance(max_staleness, int):
                raise ValueError(f"max_staleness must be an integer >= 0, got {max_staleness!r}")
            if max_staleness < 0:
                raise ValueError(f"max_staleness must be an integer >= 0, got {max_staleness}")
        if backup_workers and mode != "sync":
            raise ValueError(
                f"backup_workers applies to mode='sync' only (async modes never wait for "
                f"all workers), got backup_workers={backup_workers} with mode={mode!r}"
            )
        if not isinstance(backup_workers, int) or not 0 <= backup_workers < workers:
            raise ValueError(
                f"backup_workers={backup_workers!r} must be in 0..{workers - 1}: a step needs "
                f"at least one of the {workers} workers' gradients"
            )
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        if (checkpoint_every or resume) and checkpoint_dir is None:
            raise ValueError("checkpoint_every/resume need checkpoint_dir=<directory>")
        slow = dict(slow_workers or {})
        for rank, factor in slow.items():
            if rank not in self.group.ranks[servers:] or factor < 1.0:
                raise ValueError(
                    f"slow_workers={slow}: keys must be worker ranks "
                    f"{list(self.group.ranks[servers:])} and factors >= 1"
                )
        self.servers = servers
        self.mode = mode
        self.staleness = staleness if staleness is not None else 0
        self.backup_workers = backup_workers
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.resume = resume
        self.slow_workers = slow
        self.timeout = timeout
        self.tracer = tracer
        self.staleness_aware = staleness_aware
        self.max_staleness = max_staleness
        self.server_ranks = list(self.group.ranks[:servers])
        self.worker_ranks = list(self.group.ranks[servers:])
        self.server: Server | None = None
        self.optimizer: WorkerOptimizer | None = None

    @property
    def is_server(self) -> bool:
        return self.group.rank < self.servers

    def stats(self) -> ServerStats | WorkerStats:
        """This rank's statistics (after ``wrap``)."""
        if self.server is not None:
            return self.server.stats
        if self.optimizer is not None:
            return self.optimizer.stats
        raise RuntimeError("no statistics before wrap()")

    def wrap(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, WorkerOptimizer | None]:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters to serve")
        dtypes = {p.dtype for p in params}
        devices = {p.device.type for p in params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ValueError(
                f"the parameter server needs trainable parameters of one floating dtype, got "
                f"{sorted(map(str, dtypes))}; cast the model (model.float()) first"
            )
        if devices != {"cpu"}:
            raise ValueError(
                f"the parameter server sends CPU tensors point-to-point; the model is on "
                f"{sorted(devices)}: keep it on CPU (model.cpu())"
            )
        if len(optimizer.param_groups) != 1 or optimizer.state:
            raise ValueError(
                "the parameter server rebuilds the optimizer on the servers: pass an optimizer "
                "with one parameter group that has not stepped yet"
            )
        hyper = {k: v for k, v in optimizer.param_groups[0].items() if k in optimizer.defaults}
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        verify_same_parameters(trainable, self.group, who="ParameterServer")
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        total = flat.numel()
        if total < self.servers:
            raise ValueError(f"{total} parameters cannot be split over {self.servers} servers")
        comm.broadcast(flat, 0, group=self.group)
        for b in model.buffers():
            comm.broadcast(b, 0, group=self.group)
        bounds = shard_bounds(total, self.servers)
        server_group = None
        if self.servers > 1:
            server_group = runtime.new_group(self.server_ranks, name="ps-servers")
        if self.is_server:
            return self._serve(model, params, flat, bounds, type(optimizer), hyper, server_group)
        for p, piece in zip(params, _pieces(flat, params), strict=True):
            p.data = piece  # the worker's parameters live in the flat buffer it pulls into
        if self.mode != "sync":  # the servers go on without a dead asynchronous worker
            allow_exit(self.group.global_rank)
        self.optimizer = WorkerOptimizer(
            params,
            hyper,
            group=self.group,
            servers=self.server_ranks,
            bounds=bounds,
            flat=flat,
            slowdown=self.slow_workers.get(self.group.global_rank, 1.0),
            timeout=self.timeout,
            tracer=self.tracer,
        )
        return model, self.optimizer

    def _serve(
        self,
        model: nn.Module,
        params: list[nn.Parameter],
        flat: torch.Tensor,
        bounds: list[tuple[int, int]],
        optimizer_class: type[torch.optim.Optimizer],
        hyper: dict[str, Any],
        server_group: Group | None,
    ) -> tuple[nn.Module, None]:
        index = self.group.rank
        lo, hi = bounds[index]
        self.server = Server(
            group=self.group,
            index=index,
            shard=flat[lo:hi].clone(),
            make_optimizer=lambda ps: optimizer_class(ps, **hyper),
            workers=self.worker_ranks,
            mode=self.mode,
            staleness=self.staleness,
            backup_workers=self.backup_workers,
            checkpoint_dir=self.checkpoint_dir,
            checkpoint_every=self.checkpoint_every,
            resume=self.resume,
            timeout=self.timeout,
            tracer=self.tracer,
            staleness_aware=self.staleness_aware,
            max_staleness=self.max_staleness,
        )
        self.server.serve()
        final = self.server.param.detach()
        if server_group is not None:
            pieces = [flat[a:b] for a, b in bounds]
            comm.all_gather(pieces, final.contiguous(), group=server_group)
            runtime.destroy_group(server_group)  # its one collective is done
        else:
            flat[lo:hi].copy_(final)
        with torch.no_grad():
            for p, piece in zip(params, _pieces(flat, params), strict=True):
                p.copy_(piece)
        return model, None


def _pieces(flat: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as ``params``, laid end to end in order."""
    pieces = torch.split(flat, [p.numel() for p in params])
    return [piece.view_as(p) for piece, p in zip(pieces, params, strict=True)]


def ps_of(model: nn.Module) -> ParameterServer:
    """The :class:`ParameterServer` that ``plait.prepare(strategy="ps")`` wrapped ``model`` with."""
    ps = getattr(model, "_plait_ps", None)
    if ps is None:
        raise ValueError("this model was not prepared with strategy='ps'")
    return ps  # type: ignore[no-any-return]
