"""Whole-matrix optimizers (Muon, Adafactor, Shampoo, ...) under every strategy.

:mod:`~plait.strategies.whole_matrix.kinds` says which optimizers read a whole parameter
(torch's known by name, a user's declared); :mod:`~plait.strategies.whole_matrix.owners`
steps them by parameter ownership (each rank of the sharding group steps whole
parameters, balanced by size, after their gradients arrive; the result goes back to the
shards), with the communication contract; :mod:`~plait.strategies.whole_matrix.tensor`
maps tensor-parallel slices to the dense matrices; :mod:`~plait.strategies.whole_matrix.state`
gives and loads the whole state in the plain format; :mod:`~plait.strategies.whole_matrix.prepare`
is ``plait.prepare``'s list-of-optimizers path, strategy by strategy (docs/optimizers.md).
"""

from plait.strategies.whole_matrix.kinds import ATTRIBUTE, KNOWN, REFUSED, is_whole_matrix
from plait.strategies.whole_matrix.owners import OwnershipPlan, ownership
from plait.strategies.whole_matrix.prepare import prepare_optimizers
from plait.strategies.whole_matrix.state import (
    full_optimizer_param_names,
    full_optimizer_state_dict,
    load_full_optimizer_state_dict,
)

__all__ = [
    "ATTRIBUTE",
    "KNOWN",
    "REFUSED",
    "OwnershipPlan",
    "full_optimizer_param_names",
    "full_optimizer_state_dict",
    "is_whole_matrix",
    "load_full_optimizer_state_dict",
    "ownership",
    "prepare_optimizers",
]
