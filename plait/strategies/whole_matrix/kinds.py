"""Which optimizers read a whole parameter in their step (plain data, no communication).

An element-wise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...) updates each element
from that element's gradient and state alone, so plait may step it on flat 1/n shards
(ZeRO, FSDP) or on tensor-parallel slices. A *whole-matrix* optimizer combines elements
across a parameter: ``torch.optim.Muon`` orthogonalises each 2-D momentum with
Newton-Schulz iterations, ``torch.optim.Adafactor`` keeps row and column statistics,
Shampoo and SOAP keep per-matrix preconditioners. plait steps those on whole parameters
(:mod:`plait.strategies.whole_matrix.owners`).

Nothing is guessed: torch's own are known by name (:data:`KNOWN`); a user's optimizer is
whole-matrix when declared, by ``plait.prepare(..., whole_matrix=[opt])`` or by the class
attribute ``plait_whole_matrix = True``; every other optimizer is taken as element-wise,
as before. ``torch.optim.LBFGS`` is refused by name (:data:`REFUSED`) under every strategy
that does not replicate the whole model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# torch.optim classes whose step reads a whole parameter
KNOWN = ("Muon", "Adafactor")
# torch.optim classes no sharded layout can step exactly, and why
REFUSED = {
    "LBFGS": "its step is a line search that calls the closure (forward and backward of the "
    "whole model) several times and keeps one flat history over all parameters together",
}
# the class (or instance) attribute a user's optimizer sets to declare itself whole-matrix
ATTRIBUTE = "plait_whole_matrix"


def _torch_bases(optimizer: torch.optim.Optimizer) -> set[str]:
    return {c.__name__ for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim")}


def is_whole_matrix(
    optimizer: torch.optim.Optimizer, declared: Sequence[torch.optim.Optimizer] = ()
) -> bool:
    """True if ``optimizer`` is one of torch's whole-matrix optimizers (:data:`KNOWN`), is
    in ``declared`` (``prepare(..., whole_matrix=[...])``) or its class sets
    ``plait_whole_matrix = True``."""
    if any(d is optimizer for d in declared) or getattr(optimizer, ATTRIBUTE, False):
        return True
    return bool(_torch_bases(optimizer) & set(KNOWN))


def is_refused(optimizer: torch.optim.Optimizer) -> bool:
    """True for an optimizer of :data:`REFUSED` (torch's LBFGS)."""
    return bool(_torch_bases(optimizer) & set(REFUSED))


def check_not_refused(optimizer: torch.optim.Optimizer, strategy: str) -> None:
    """Raise ``ValueError`` for an optimizer of :data:`REFUSED` under ``strategy``."""
    for name in sorted(_torch_bases(optimizer) & set(REFUSED)):
        raise ValueError(
            f"strategy {strategy!r} cannot step {type(optimizer).__name__}: {name} combines "
            f"elements across every parameter ({REFUSED[name]}), so no rank holds what one "
            f"step reads. Use strategy 'ddp' (every rank keeps the "
            f"whole model) with it"
        )


def check_declared(
    declared: Sequence[torch.optim.Optimizer], given: Sequence[torch.optim.Optimizer]
) -> None:
    """Every optimizer named by ``whole_matrix=`` must be one of those passed to prepare."""
    for d in declared:
        if not any(d is g for g in given):
            raise ValueError(
                f"plait.prepare: whole_matrix= names a {type(d).__name__} that is not among "
                f"the optimizers passed to prepare; pass the same optimizer objects"
            )
