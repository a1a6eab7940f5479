"""Training that heals: data-parallel ranks (or whole model-parallel replicas) die, the
survivors go on without a restart, replacements join at a step boundary, and in
reproducible mode the parameters are bitwise those of the uninterrupted run
(docs/healing.md).

- :mod:`.membership`: generations of live slots, agreed through the rendezvous store;
- :mod:`.groups`: each generation's process group, built and abandoned without a hang;
- :mod:`.blocks`: which slot computes which block of the tree; the block-ordered exchange;
- :mod:`.state`: the live state a replacement (or a lagging survivor) receives;
- :mod:`.zero`, :mod:`.fsdp`: sharded state (ZeRO-1/2; FSDP, the parameters too) mirrored
  on the ring neighbour;
- :mod:`.trainer`: :class:`HealingTrainer`, the step that heals;
- :mod:`.replicas`, :mod:`.store_mesh`: :class:`ReplicaTrainer`, the dp dimension of PTD-P
  (a replica is a whole pp x tp x cp group, on a mesh of its own made from the store);
- :mod:`.model_checks`: what the trainers read from the model (refusals, warnings, buffers);
- :mod:`.launch`, :mod:`.run`: the store and the rank processes, one launcher per machine.
"""

from plait.heal.membership import Excluded, Generation, Membership
from plait.heal.replicas import ReplicaLost, ReplicaTrainer
from plait.heal.store_mesh import StoreMesh
from plait.heal.trainer import HealingTrainer

__all__ = [
    "Excluded",
    "Generation",
    "HealingTrainer",
    "Membership",
    "ReplicaLost",
    "ReplicaTrainer",
    "StoreMesh",
]
