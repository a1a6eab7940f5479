"""The parameter server: servers own sharded parameters and the optimizer; workers push
gradients and pull parameters, synchronously, asynchronously or with bounded staleness.

Files: ``protocol.py`` (headers on the wire), ``server.py`` (one server rank and its
update rule), ``liveness.py`` (heartbeats: dead or slow?), ``worker.py`` (the worker's
optimizer), ``strategy.py`` (the world split into servers and workers).
"""

from plait.strategies.ps.liveness import Liveness
from plait.strategies.ps.protocol import Header, Kind, MalformedMessage, PeerLost, decode
from plait.strategies.ps.server import MODES, Server, ServerError, ServerStats, WorkerFailed
from plait.strategies.ps.strategy import ParameterServer, ps_of
from plait.strategies.ps.worker import ServerLost, WorkerOptimizer, WorkerStats

__all__ = [
    "MODES",
    "Header",
    "Kind",
    "Liveness",
    "MalformedMessage",
    "ParameterServer",
    "PeerLost",
    "Server",
    "ServerError",
    "ServerLost",
    "ServerStats",
    "WorkerFailed",
    "WorkerOptimizer",
    "WorkerStats",
    "decode",
    "ps_of",
]
