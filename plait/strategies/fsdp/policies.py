"""Typed policies for sharded strategies: mixed precision and CPU offload.

Plain frozen dataclasses passed by keyword (``fully_shard(model, mp_policy=...,
offload_policy=...)``), in the manner of FSDP2's ``MixedPrecisionPolicy`` and ``OffloadPolicy``.
The mixed-precision policy is every strategy's (:mod:`plait.precision`), re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.precision import (  # re-exported: their home before plait.precision
    MIXED_PRECISION_NAMES,
    MixedPrecisionPolicy,
    resolve_mixed_precision,
)

__all__ = [
    "MIXED_PRECISION_NAMES",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "resolve_mixed_precision",
    "resolve_offload",
]


@dataclass(frozen=True)
class OffloadPolicy:
    """Keep state in host memory, moving it to the compute device only when needed.

    ``params``: each rank's parameter shard (the fp32 master) and its gradient live in CPU
    memory (pinned when CUDA is present); units are gathered onto the compute device.
    ``optimizer_state``: the optimizer's state lives in CPU memory. Optimizers create
    their state on the parameter's device, so this keeps the shard on the CPU as well
    (the optimizer step then runs on the CPU). Either flag puts the shards on the CPU.
    """

    params: bool = False
    optimizer_state: bool = False

    @property
    def shards_on_cpu(self) -> bool:
        return self.params or self.optimizer_state


def resolve_offload(value: object) -> OffloadPolicy | None:
    """An :class:`OffloadPolicy` from ``value``: a policy, None (no offload), or an object
    of a class named ``CPUOffloadPolicy`` (PyTorch's: parameters and optimizer state on
    the CPU)."""
    if value is None or isinstance(value, OffloadPolicy):
        return value
    if type(value).__name__ == "CPUOffloadPolicy":
        return OffloadPolicy(params=True, optimizer_state=True)
    if type(value).__name__ == "OffloadPolicy":  # PyTorch's base class: no offload
        return None
    raise TypeError(f"offload policy must be an OffloadPolicy or None; got {value!r}")
