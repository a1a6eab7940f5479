"""Rank functions for the parameter-server tests.

Group ranks 0..S-1 are servers, the rest workers; worker k of W trains on the k-th of W
contiguous shards of each global batch (tests/ddp_fns.py's data and model).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

import plait
from plait.strategies.ps import ps_of
from tests.ddp_fns import batch, make_model, make_optimizer, shard


def train_ps(
    steps: int,
    opt: str,
    options: dict[str, Any],
    *,
    die_after: dict[int, int] | None = None,
    save_at: int | None = None,
    step_sleep: dict[int, float] | None = None,
    pause: dict[int, tuple[int, float]] | None = None,
    stop_self: dict[int, tuple[int, str]] | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps under strategy 'ps'; returns this rank's role, final
    parameters and statistics. ``die_after={rank: k}`` kills that worker (os._exit) after
    k steps; ``save_at=k`` asks for a checkpoint after step k; ``step_sleep={rank: s}``
    makes that worker sleep s seconds per step (a straggler); ``pause={rank: (k, s)}``
    sleeps s seconds once, before step k; ``stop_self={rank: (k, file)}`` writes
    "<pid> <time>" to file and SIGSTOPs that worker before step k."""
    world = plait.world()
    model = make_model()
    with torch.no_grad():  # replicas start different: wrap must broadcast rank 0's model
        for p in model.parameters():
            p.add_(world.rank)
    wrapped, optimizer = plait.prepare(model, make_optimizer(model, opt), strategy="ps", **options)
    ps = ps_of(wrapped)
    if optimizer is None:  # a server: prepare served until the workers finished
        return {
            "role": "server",
            "params": [p.detach().clone() for p in model.parameters()],
            "stats": ps.stats(),
        }
    w, n_workers = world.rank - ps.servers, world.size - ps.servers
    sleep = (step_sleep or {}).get(world.rank, 0.0)
    start = optimizer.version if options.get("resume") else 0  # sync: version = steps done
    for step in range(start, steps):
        if die_after and die_after.get(world.rank) == step:
            os._exit(17)
        if pause and pause.get(world.rank, (-1, 0.0))[0] == step:
            time.sleep(pause[world.rank][1])
        if stop_self and stop_self.get(world.rank, (-1, ""))[0] == step:
            import signal

            from plait.strategies.ps.liveness import last_beat

            # a rank that never beat is unknown to the heartbeat monitor (left to its
            # connection): stop only once this rank's beat is in the store, as a worker
            # that hangs mid-run would have
            deadline = time.time() + 30
            while last_beat(world.rank) is None and time.time() < deadline:
                time.sleep(0.05)
            with open(stop_self[world.rank][1], "w") as f:
                f.write(f"{os.getpid()} {time.time()}")
            os.kill(os.getpid(), signal.SIGSTOP)
        x, y = batch(step)
        optimizer.zero_grad()
        out = wrapped(shard(x, w, n_workers))
        nn.functional.mse_loss(out, shard(y, w, n_workers)).backward()
        if sleep:
            time.sleep(sleep)
        optimizer.step()
        if save_at is not None and step + 1 == save_at:
            optimizer.request_checkpoint()
    optimizer.finish()
    return {
        "role": "worker",
        "params": [p.detach().clone() for p in model.parameters()],
        "stats": ps.stats(),
        "version": optimizer.version,
    }


def single_worker(steps: int, opt: str, mode: str) -> list[torch.Tensor]:
    """Plain training of the whole global batch in one process (for one-worker runs)."""
    model = make_model()
    optimizer = make_optimizer(model, opt)
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def guarded(fn_name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run a function of this module and return its error text instead of raising."""
    try:
        return globals()[fn_name](*args, **kwargs)  # type: ignore[no-any-return]
    except Exception as exc:
        return {"role": "error", "error": f"{type(exc).__name__}: {exc}"}


def rogue(steps: int, options: dict[str, Any], rogue_rank: int) -> dict[str, Any]:
    """Rank ``rogue_rank`` sends server 0 a header with a wrong magic number instead of
    training; the other workers train ``steps`` steps."""
    from plait.strategies.ps.protocol import Link

    world = plait.world()
    if world.rank != rogue_rank:
        return guarded("train_ps", steps, "sgd", options)
    model = make_model()
    _, optimizer = plait.prepare(model, make_optimizer(model, "sgd"), strategy="ps", **options)
    assert optimizer is not None
    bad = torch.tensor([0x1234, 1, 0, 0, 0, 0, 0, 0], dtype=torch.int64)
    Link(world, 0).send(bad)
    return {"role": "rogue"}


def validation_error(options: dict[str, Any]) -> str:
    model = make_model()
    try:
        plait.prepare(model, make_optimizer(model, "sgd"), strategy="ps", **options)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return "no error"


def stall_worker(
    steps: int, options: dict[str, Any], *, slow_rank: int, pause_s: float, at_step: int
) -> dict[str, Any]:
    """A worker alive but slow: ``slow_rank`` sleeps ``pause_s`` seconds (longer than the
    heartbeat timeout in ``options``) before step ``at_step``; heartbeats keep beating."""
    from plait.comm import progress
    from plait.strategies.ps.liveness import last_beat, may_exit_key

    result = train_ps(steps, "sgd", options, pause={slow_rank: (at_step, pause_s)})
    world = plait.world()
    if world.rank == 0:  # the heartbeat the server judged by was really there
        result["beat"] = last_beat(slow_rank)
    else:  # an asynchronous worker told `plait run` it may die without ending the job
        client = progress.store()
        key = may_exit_key(world.rank)
        result["may_exit"] = client is not None and client.check([key]) and client.get(key)
    return result


def hung_worker(steps: int, options: dict[str, Any], *, hung_rank: int, pid_file: str) -> Any:
    """``hung_rank`` stops itself (SIGSTOP: alive, silent, heartbeat frozen) after 2 steps;
    the server, once it has served, kills it (SIGKILL, then SIGCONT so it can die)."""
    import signal

    world = plait.world()
    if world.rank == hung_rank:
        return train_ps(steps, "sgd", options, stop_self={hung_rank: (2, pid_file)})
    result = guarded("train_ps", steps, "sgd", options)
    if world.rank == 0:
        with open(pid_file) as f:
            pid, stopped_at = f.read().split()
        os.kill(int(pid), signal.SIGKILL)
        os.kill(int(pid), signal.SIGCONT)
        result["stopped_at"] = float(stopped_at)
    return result


def killed_server(
    steps: int, opt: str, options: dict[str, Any], *, kill_at_version: int, kill_file: str
) -> dict[str, Any]:
    """Rank 0 (the one server) exits hard (os._exit) once its checkpoint holds version
    ``kill_at_version`` and writes the time to ``kill_file`` first; the workers return
    what they raised and when."""
    import threading
    from pathlib import Path

    world = plait.world()
    if world.rank == 0:
        ckpt = Path(options["checkpoint_dir"]) / "server-0.pt"

        def killer() -> None:
            while True:
                time.sleep(0.005)
                try:
                    version = torch.load(ckpt, weights_only=True)["version"]
                except Exception:  # not written yet
                    continue
                if version >= kill_at_version:
                    Path(kill_file).write_text(f"{time.time()} {version}")
                    os._exit(17)

        threading.Thread(target=killer, daemon=True).start()
        return train_ps(steps, opt, options)
    try:
        return train_ps(steps, opt, options, step_sleep={world.rank: 0.05})
    except Exception as exc:
        return {
            "role": "error",
            "error": f"{type(exc).__name__}: {exc}",
            "at": time.time(),
            "server": getattr(exc, "rank", None),
        }


def different_model(options: dict[str, Any], odd_rank: int) -> str:
    """``odd_rank`` builds the model with an extra branch; every rank returns what wrap
    raised."""
    world = plait.world()
    model = make_model(unused_branch=world.rank == odd_rank)
    try:
        plait.prepare(model, make_optimizer(model, "sgd"), strategy="ps", **options)
    except ValueError as exc:
        return str(exc)
    return "no error"


def hung_server(steps: int, options: dict[str, Any], *, stop_after_s: float, pid_file: str) -> Any:
    """Rank 0 (the one server) stops itself (SIGSTOP: every thread, heartbeat included)
    ``stop_after_s`` seconds into serving; each worker returns what it raised and when,
    then kills the stopped server (SIGKILL, SIGCONT)."""
    import signal
    import threading

    world = plait.world()
    if world.rank == 0:

        def stopper() -> None:
            time.sleep(stop_after_s)
            with open(pid_file, "w") as f:
                f.write(f"{os.getpid()} {time.time()}")
            os.kill(os.getpid(), signal.SIGSTOP)

        threading.Thread(target=stopper, daemon=True).start()
        return train_ps(steps, "sgd", options)
    try:
        result = train_ps(steps, "sgd", options, step_sleep={world.rank: 0.05})
    except Exception as exc:
        result = {
            "role": "error",
            "error": f"{type(exc).__name__}: {exc}",
            "at": time.time(),
            "server": getattr(exc, "rank", None),
        }
    with open(pid_file) as f:
        pid, stopped_at = f.read().split()
    result["stopped_at"] = float(stopped_at)
    for sig in (signal.SIGKILL, signal.SIGCONT):
        try:
            os.kill(int(pid), sig)
        except ProcessLookupError:
            pass
    return result
