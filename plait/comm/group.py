"""Groups of ranks: numbered collectives, the worker thread, and the handles of async calls.

A :class:`Group` wraps one ``torch.distributed`` process group. It numbers the collectives
issued on it (the sequence number every rank agrees on), runs asynchronous collectives on
one worker thread in issue order (or, for a device backend's native collective, starts it
on the caller's thread: :class:`Started`), and hands each collective a
:class:`~plait.comm.channel.Channel` (``channel.py``: group-local ranks, a tag of its own,
a timeout, and byte counters).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from plait.comm import debug, device, progress, recorder
from plait.comm.channel import COLLECTIVE_TAG_BIT as COLLECTIVE_TAG_BIT  # re-exported
from plait.comm.channel import RESERVED_TAG as RESERVED_TAG
from plait.comm.channel import Call, Channel
from plait.comm.channel import CommStat as CommStat
from plait.comm.channel import _Pending as _Pending
from plait.comm.channel import group_stats as group_stats
from plait.comm.channel import reset_stats as reset_stats
from plait.comm.channel import signature_tag as signature_tag
from plait.comm.channel import stats as stats
from plait.comm.errors import CollectiveError

if TYPE_CHECKING:
    from plait.comm.shm import ShmLink

# Groups by key, for the collectives a compiled graph holds (traceable.py): a graph node
# names its group by this string, as PyTorch's functional collectives name theirs.
_by_key: weakref.WeakValueDictionary[str, Group] = weakref.WeakValueDictionary()
_keys = itertools.count()


def group_by_key(key: str) -> Group:
    """The live group whose :attr:`Group.key` is ``key`` (raises naming it if it is gone)."""
    group = _by_key.get(key)
    if group is None or group.destroyed:
        raise RuntimeError(
            f"no live plait group has key {key!r}: a compiled graph runs a collective on a "
            f"group that was destroyed (plait.destroy_group, Mesh.destroy, plait.shutdown); "
            f"compile the model again after making its groups anew"
        )
    return group


class Group:
    """A set of ranks with a process group, a collective counter and a worker thread.

    Build groups with :func:`plait.comm.world` and :func:`plait.comm.new_group`; pass them
    explicitly as ``group=`` to every collective.
    """

    def __init__(
        self,
        *,
        pg: Any,
        ranks: Sequence[int],
        global_rank: int,
        name: str,
        backend: str,
        timeout: float,
        debug: bool = False,
        node_size: int | None = None,
        check: bool = True,
    ) -> None:
        if global_rank not in ranks:
            raise ValueError(f"rank {global_rank} is not in group {name!r} (ranks {list(ranks)})")
        self._pg = pg
        self.destroyed = False
        self.ranks = tuple(ranks)
        self.rank = self.ranks.index(global_rank)
        self.size = len(self.ranks)
        self.name = name
        self.backend = backend
        self.timeout = float(timeout)
        self.timeout_delta = datetime.timedelta(seconds=self.timeout)
        self.debug = debug
        self.check = check
        self.node_size = node_size
        self.seq = 0
        # the last collective this rank entered on the group: (seq, collective, sig, desc)
        self.entered: tuple[int, str, str, str] = (0, "", "", "")
        # set while blocked on one message: (global rank waited on or None, call, since)
        self.waiting: tuple[int | None, Call, float] | None = None
        # set by the watchdog when it ended a wait: raised by every later wait of the call
        self.failure: CollectiveError | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._last: concurrent.futures.Future[Any] | None = None
        # backend collectives started on the caller's thread and not yet waited (start_native)
        self._started: list[Started] = []
        self._node_of: list[str] | None = None
        # this rank's shared-memory link to its ranks on this host (transport.attach)
        self.shm: ShmLink | None = None
        # the process group for messages from higher to lower ranks (runtime.reverse_group)
        self.reverse: Group | None = None
        # unique in this process: how a compiled graph's collective names the group
        self.key = f"{name}#{next(_keys)}"
        _by_key[self.key] = self
        progress.register(self)

    def __repr__(self) -> str:
        return f"Group({self.name!r}, ranks={list(self.ranks)}, rank={self.rank})"

    @property
    def device(self) -> torch.device:
        """Where tensors for this group's collectives are made: this rank's GPU on NCCL,
        ``meta`` on PyTorch's fake backend, the CPU on gloo (``device.py``)."""
        return device.group_device(self)

    @property
    def pg(self) -> Any:
        """The backend process group (raises once the group is destroyed)."""
        if self._pg is None:
            raise RuntimeError(
                f"group {self.name!r} (ranks {list(self.ranks)}) was destroyed on rank "
                f"{self.global_rank} (plait.destroy_group, Mesh.destroy, plait.shutdown or the "
                f"end of the RankPool run that made it): create a new group or mesh"
            )
        return self._pg

    def release(self) -> Any:
        """Forget the backend process group (it is freed once torch drops it too) and
        return it; the group is unusable afterwards. Called by ``plait.destroy_group``."""
        pg, self._pg = self._pg, None
        self.destroyed = True
        return pg

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]

    def run(
        self,
        collective: str,
        algorithm: str,
        body: Callable[[Channel], Any],
        *,
        async_op: bool,
        payload_bytes: int,
        signature: str,
        desc: str = "",
    ) -> Handle | None:
        """Issue one collective: number it, check it (debug), run ``body`` on a channel.

        Sequence numbers are taken here, on the calling thread, so they follow issue order
        on every rank even when the collective runs later on the worker thread.
        ``signature`` is what every rank must agree on (collective arguments that decide
        which messages flow); with ``check`` on it is folded into the messages' tags.
        """
        self.seq += 1
        sig = f"{algorithm} {signature}" if signature else algorithm
        call = Call(self, collective, algorithm, self.seq, payload_bytes, sig, desc)
        call.origin = device.origin()
        if self.debug:
            debug.check_signature(call, f"{sig} {desc}")

        def task() -> Any:
            if self.failure is not None:
                raise self._broken(call)
            self.entered = (call.seq, collective, call.sig, call.desc)
            entry = recorder.start(call)
            try:
                result = body(Channel(call))
                if call.round:  # a message never waited for: its peer would wait forever
                    raise RuntimeError(
                        f"{call.describe()}: the algorithm left {len(call.round)} message(s) "
                        f"not waited for (first: {call.round[0].verb} channel rank "
                        f"{call.round[0].peer}); every isend/irecv must be waited for"
                    )
            except BaseException:
                recorder.end(entry, "failed")
                raise
            recorder.end(entry, "completed")
            call.commit()
            return result

        if async_op:
            return Handle(self._submit(task), call)
        if not self.idle():
            self._submit(task).result()  # keep issue order behind pending async work
        else:
            task()
        return None

    def idle(self) -> bool:
        """No asynchronous collective of this group is still queued or running."""
        return self._last is None or self._last.done()

    def start_native(
        self,
        collective: str,
        payload_bytes: int,
        start: Callable[[], Any],
        *,
        signature: str = "",
        desc: str = "",
    ) -> Handle:
        """Issue a backend collective that is asynchronous by itself on the calling thread,
        without the worker thread, and hand what the backend returns (a :class:`Started`
        ``Work``, or a ``torch.futures.Future``) to the :class:`Handle`: it is waited on the
        thread that calls ``Handle.wait()``, where the result is needed.

        Issue order: backends match collectives by the order they are issued, so when
        asynchronous collectives of plait's own algorithms are still queued on the worker
        thread, this first waits for them (their errors stay with their handles); on a
        device backend ``auto`` picks the backend's collectives, so that happens only
        when a plait algorithm was named.
        """
        if not self.idle():
            self.settle()
        self.seq += 1
        sig = f"native {signature}" if signature else "native"
        call = Call(self, collective, "native", self.seq, payload_bytes, sig, desc)
        call.origin = device.origin()
        if self.debug:
            debug.check_signature(call, f"{sig} {desc}")
        if self.failure is not None:
            raise self._broken(call)
        self.entered = (call.seq, collective, call.sig, call.desc)
        entry = recorder.start(call)
        try:
            future = start()
        except RuntimeError as exc:
            recorder.end(entry, "failed")
            raise Channel(call).failure(None, "start", exc) from exc
        recorder.end(entry, "started")
        call.commit()
        if isinstance(future, Started):
            future.call = call
            self._started = [s for s in self._started if not s.finished] + [future]
        return Handle(future, call)

    def _broken(self, call: Call) -> CollectiveError:
        """The error for a collective issued after the group failed."""
        return CollectiveError(
            f"{call.describe()}: group {self.name!r} failed earlier and cannot be used again "
            f"(its connections are closed): {self.failure}"
        )

    def _submit(self, task: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"plait-{self.name}"
            )
        self._last = self._executor.submit(task)
        return self._last

    def synchronize(self) -> None:
        """Wait for every asynchronous collective issued on this group so far (those on
        the worker thread, and the backend's own started on the caller's thread)."""
        if self._last is not None:
            self._last.result()
        started, self._started = self._started, []
        for s in started:
            if not s.finished:
                Handle(s, s.call).wait()

    def settle(self) -> None:
        """Wait for every asynchronous collective issued so far, failed ones included,
        without raising their errors (their handles do)."""
        if self._last is not None:
            concurrent.futures.wait([self._last])

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        progress.unregister(self)
        if self.shm is not None and self.idle():
            self.shm.close()
            self.shm = None


class Started:
    """A backend collective started on the caller's thread (:meth:`Group.start_native`):
    the backend's ``Work`` (None: nothing to send, an empty tensor), what remains to do
    once it completes (``finish``: copy a staged result back, divide an average), and the
    value its future carries (``result``).

    ``timeout``: what ``Work.wait`` is given. On a device backend it is None: on NCCL,
    ``Work.wait()`` makes the waiting thread's current CUDA stream wait for NCCL's stream
    and returns at once, while ``Work.wait(timeout)`` would block the host until the
    collective ends (PyTorch's ``WorkNCCL::synchronizeInternal``); the group's timeout
    is then the process group's own (plait creates every process group with it),
    enforced by ProcessGroupNCCL's watchdog, which fails the work. ``finish`` runs once,
    after that wait (or in the future's callback, when ``get_future()`` was asked for),
    so on the device it is ordered after the collective.
    """

    __slots__ = ("work", "finish", "result", "timeout", "call", "finished", "_chained", "_lock")

    def __init__(
        self,
        work: Any,
        finish: Callable[[], None] | None = None,
        result: Any = None,
        *,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        self.work = work
        self.finish = finish
        self.result = result
        self.timeout = timeout
        self.call: Call | None = None  # set by Group.start_native
        self.finished = False
        self._chained: torch.futures.Future[Any] | None = None
        # reentrant: a future completed already runs its ``then`` callback at once, inside
        # ``future()``, and the callback completes this one
        self._lock = threading.RLock()

    def then_finish(self, finish: Callable[[], None]) -> Started:
        """Run ``finish`` after this handle's own ``finish`` when it completes (a caller's
        copy-back after the backend's); returns this handle."""
        after = self.finish

        def done() -> None:
            if after is not None:
                after()
            finish()

        self.finish = done
        return self

    def complete(self) -> None:
        """Run ``finish`` (once): the collective has completed (or, on a device, the
        current stream waits for it)."""
        with self._lock:
            if self.finished:
                return
            self.finished = True
        if self.finish is not None:
            self.finish()

    def wait(self) -> None:
        """Wait for the backend's work on this thread (see the class docstring)."""
        if self._chained is not None:
            self._chained.wait()
        elif self.work is not None:
            if self.timeout is None:
                self.work.wait()
            else:
                self.work.wait(self.timeout)
        self.complete()

    def future(self, error: Callable[[BaseException], BaseException]) -> torch.futures.Future[Any]:
        """The work's future, chained with ``finish``; errors become ``error(exc)``."""
        with self._lock:
            if self._chained is None:
                if self.work is None:
                    base: torch.futures.Future[Any] = torch.futures.Future()
                    base.set_result(None)
                else:
                    base = self.work.get_future()

                def checked(f: torch.futures.Future[Any]) -> Any:
                    try:
                        f.value()
                    except Exception as exc:
                        raise error(exc) from exc
                    self.complete()
                    return self.result

                self._chained = base.then(checked)
            return self._chained

    def is_completed(self) -> bool:
        return self.finished or self.work is None or bool(self.work.is_completed())


class Handle:
    """Returned by ``async_op=True``: ``wait()`` blocks until the collective is done.

    It wraps the worker thread's future, or, for a backend collective started directly
    on the caller's thread, the backend's own ``Work`` (:class:`Started`; on a device
    backend every native asynchronous collective) or ``torch.futures.Future``: those are
    waited on the thread that calls ``wait()``, where the result is needed. Every error
    reaches the caller as a :class:`~plait.comm.errors.CollectiveError` naming the
    collective (and the peer where known), through ``wait()`` and through
    ``get_future()`` alike; a future chained from ``get_future()`` with ``.then(...)``
    carries it too, as long as the callback reads ``fut.value()`` (torch runs ``.then``
    callbacks on failed futures as well).
    """

    __slots__ = ("_future", "_call")

    def __init__(
        self,
        future: concurrent.futures.Future[Any] | torch.futures.Future[Any] | Started | None,
        call: Call | None = None,
    ) -> None:
        self._future = future
        self._call = call

    def _error(self, exc: BaseException) -> BaseException:
        if isinstance(exc, CollectiveError) or self._call is None:
            return exc
        return Channel(self._call).failure(None, "finish", exc)

    def wait(self, timeout: float | None = None) -> None:
        """Block until done and re-raise its error; ``timeout`` in seconds (None: no limit).

        The collective itself is bounded by its group's timeout, so this never hangs
        forever even with ``timeout=None``.
        """
        if isinstance(self._future, (torch._C.Future, Started)):
            call = self._call
            if call is not None:
                call.group.waiting = (None, call, time.monotonic())
            try:
                self._future.wait()
            except Exception as exc:
                raise self._error(exc) from exc
            finally:
                if call is not None:
                    call.group.waiting = None
        elif self._future is not None:
            self._future.result(timeout)

    def is_completed(self) -> bool:
        if isinstance(self._future, Started):
            return self._future.is_completed()
        return self._future is None or self._future.done()

    def get_future(self) -> torch.futures.Future[Any]:
        """A ``torch.futures.Future`` completed (or failed) with the collective."""
        if isinstance(self._future, Started):
            return self._future.future(self._error)
        if isinstance(self._future, torch._C.Future):

            def checked(f: torch.futures.Future[Any]) -> Any:
                try:
                    return f.value()
                except Exception as exc:
                    raise self._error(exc) from exc

            return self._future.then(checked)  # type: ignore[no-any-return]
        fut: torch.futures.Future[None] = torch.futures.Future()
        if self._future is None:
            fut.set_result(None)
            return fut

        def done(f: concurrent.futures.Future[Any]) -> None:
            exc = f.exception()
            if exc is not None:
                fut.set_exception(exc)  # type: ignore[arg-type]
            else:
                fut.set_result(None)

        self._future.add_done_callback(done)
        return fut


COMPLETED = Handle(None)
