"""plait's collective-communication layer.

Collectives (``broadcast``, ``reduce``, ``all_reduce``, ``reduce_scatter``, ``all_gather``,
``all_to_all``, ``barrier``) and point-to-point ``send``/``recv`` on explicit groups, with
plait's own algorithms (``comm/ring.py``, ``tree.py``, ``halving_doubling.py``,
``naive.py``, ``hierarchical.py``, ``ring_tree.py``) built on point-to-point messages,
the shared-memory collectives (``shm_collectives.py``), the backend's ``"native"`` ones,
and ``"auto"`` choosing between them (``tuner.py``). Point-to-point messages between
ranks of one host go through shared memory (``shm.py``, chosen per peer in
``transport.py``), the others through the process group.
"""

from plait.comm.errors import (
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    PeerUnresponsive,
)
from plait.comm.group import CommStat, Group, Handle, group_stats, reset_stats, stats
from plait.comm.ops import (
    ALGORITHMS,
    SUPPORTED,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    recv,
    reduce,
    reduce_scatter,
    send,
)
from plait.comm.reduce_op import ReduceOp
from plait.runtime import destroy_group, new_group, world, world_or_none

__all__ = [
    "ALGORITHMS",
    "SUPPORTED",
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "CommStat",
    "Group",
    "Handle",
    "PeerUnresponsive",
    "ReduceOp",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "destroy_group",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "group_stats",
    "reset_stats",
    "send",
    "stats",
    "world",
    "world_or_none",
]
