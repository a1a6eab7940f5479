"""Typed policies for sharded strategies: mixed precision and CPU offload.

Plain frozen dataclasses passed by keyword (``fully_shard(model, mp_policy=...,
offload_policy=...)``), in the manner of FSDP2's ``MixedPrecisionPolicy`` and ``OffloadPolicy``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute and communication; the sharded masters stay in their own dtype.

    ``param_dtype``: gathered parameters are cast to it, so forward and backward compute
    in it (bf16 or fp16), and floating-point inputs of each unit are cast to it.
    ``reduce_dtype``: gradients are reduce-scattered in it (None: ``param_dtype``, or the
    master dtype without ``param_dtype``), then accumulated into the fp32 shard gradient.
    ``buffer_dtype``: floating-point buffers are cast to it once, at wrap time.
    None everywhere means full precision.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            dtype = getattr(self, field)
            if dtype is not None and dtype not in LOW_PRECISION:
                allowed = ", ".join(str(d) for d in LOW_PRECISION)
                raise ValueError(
                    f"MixedPrecisionPolicy: {field}={dtype} is not a floating dtype; use one "
                    f"of {allowed} or None"
                )


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


MIXED_PRECISION_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def resolve_mixed_precision(value: object) -> MixedPrecisionPolicy:
    """A :class:`MixedPrecisionPolicy` from ``value``: a policy, None (full precision), or
    ``"bf16"``/``"fp16"`` (parameters and gradient reduction in that dtype) or ``"fp32"``.
    An object with ``param_dtype`` and ``reduce_dtype`` attributes (PyTorch's own policy)
    is read by those attributes."""
    if value is None:
        return MixedPrecisionPolicy()
    if isinstance(value, MixedPrecisionPolicy):
        return value
    if isinstance(value, str):
        if value not in MIXED_PRECISION_NAMES:
            raise ValueError(
                f"mixed precision {value!r} is not known; use one of "
                f"{sorted(MIXED_PRECISION_NAMES)} or a MixedPrecisionPolicy"
            )
        return MixedPrecisionPolicy(param_dtype=MIXED_PRECISION_NAMES[value])
    if hasattr(value, "param_dtype") and hasattr(value, "reduce_dtype"):
        if getattr(value, "output_dtype", None) is not None:
            raise ValueError(
                f"mixed precision {value!r}: output_dtype is not supported (outputs keep "
                f"param_dtype); cast the model's output yourself and leave output_dtype None"
            )
        if getattr(value, "cast_forward_inputs", True) is False:
            raise ValueError(
                f"mixed precision {value!r}: cast_forward_inputs=False is not supported "
                f"(floating inputs of each unit are always cast to param_dtype)"
            )
        return MixedPrecisionPolicy(param_dtype=value.param_dtype, reduce_dtype=value.reduce_dtype)
    raise TypeError(
        f"mixed precision must be a MixedPrecisionPolicy, 'bf16', 'fp16', 'fp32' or None; "
        f"got {value!r}"
    )


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
