"""Rank 1 kills itself (SIGKILL) inside the shared-memory set-up of ``plait.init``: after
every rank made and published its segment, before any rank unlinked its own."""

import os
import signal

from plait.comm import transport

if os.environ["RANK"] == "1":

    def die(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    transport._open_peers = die  # type: ignore[assignment]

import plait  # noqa: E402

plait.init()
plait.shutdown()
