"""Training that heals: data-parallel ranks die, the survivors go on without a restart,
replacements join at a step boundary, and in reproducible mode the parameters are bitwise
those of the uninterrupted run (docs/healing.md).

- :mod:`.membership`: generations of live slots, agreed through the rendezvous store;
- :mod:`.groups`: each generation's process group, built and abandoned without a hang;
- :mod:`.blocks`: which slot computes which block of the tree; the block-ordered exchange;
- :mod:`.state`: the live state a replacement (or a lagging survivor) receives;
- :mod:`.zero`, :mod:`.fsdp`: sharded state (ZeRO-1/2; FSDP, the parameters too) mirrored
  on the ring neighbour;
- :mod:`.trainer`: :class:`HealingTrainer`, the step that heals;
- :mod:`.launch`: the store and the rank processes on one machine.
"""

from plait.heal.membership import Excluded, Generation, Membership
from plait.heal.trainer import HealingTrainer

__all__ = ["Excluded", "Generation", "HealingTrainer", "Membership"]
