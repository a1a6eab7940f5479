"""The pipeline's non-finite flags kept on the device (``check_finite`` on device backends).

On a device backend (NCCL, the fake backend) a host read is a synchronization of the
device, so the pipeline's default ``check_finite="raise"`` keeps its flags there: each
watched forward adds one boolean (its output not finite although its input was), each
parameter gradient one boolean (not finite), and the first flagged entry of each list is
found with device operations (``argmax`` of the stacked flags returns the first maximum)
and written into this rank's row of the flag table, which the pipeline all-reduces as on
the host path. The host reads the all-reduced table once per step (whether anything is
flagged: the decision to raise or skip, as ``torch.amp.GradScaler`` reads its found-inf),
and only on a flagged step reads the names. The decisions and the first indices are the
host path's: ``isfinite(...).all()`` is exact, as :func:`~plait.strategies.data_parallel.
grad_sync.bucket_is_finite` is, and both take entries in the same order.

No communication here; the caller's all-reduce carries the row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from plait.strategies.data_parallel.grad_sync import bucket_is_finite


def forward_flag(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
    """A 0-d bool on ``y``'s device: ``y`` holds inf or NaN while ``x`` (the stage's input)
    does not. None when ``y`` is not floating point (nothing to watch)."""
    if not y.is_floating_point():
        return None
    bad = ~torch.isfinite(y.detach()).all()
    if x.is_floating_point():
        bad = bad & torch.isfinite(x.detach()).all()
    return bad


def gradient_flag(grad: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on ``grad``'s device: ``grad`` holds inf or NaN."""
    return ~torch.isfinite(grad).all()


class Positions:
    """Device tensors of the 1-based positions a list of flags stands for, made once per
    distinct list (a schedule's forward order, the parameters that have gradients): a
    copy from host values to the device per new list, none on later steps."""

    def __init__(self) -> None:
        self._made: dict[tuple[tuple[int, ...], ...], torch.Tensor] = {}

    def of(
        self, positions: list[tuple[int, ...]], width: int, device: torch.device
    ) -> torch.Tensor:
        """``positions`` (0-based, ``width`` each) as an int64 ``(n, width)`` tensor + 1."""
        key = tuple(positions)
        made = self._made.get(key)
        if made is None or made.device != device:
            made = torch.tensor(positions, dtype=torch.int64, device=device)
            made = made.reshape(len(positions), width) + 1
            self._made[key] = made
        return made


def write_first(row: torch.Tensor, flags: list[torch.Tensor], positions: torch.Tensor) -> None:
    """Write into ``row`` (int64, on the device, one slot per column of ``positions``) the
    1-based position of the first flagged entry of ``flags``, or leave its zeros: device
    operations only, no host read."""
    if not flags:
        return
    bad = torch.stack(flags).to(row.device)
    first = bad.to(torch.int8).argmax().reshape(1)  # the first maximum: the first flag
    picked = positions.index_select(0, first)[0]
    row.copy_(torch.where(bad.any(), picked, torch.zeros_like(picked)))


Indexed = Sequence[tuple[int, nn.Parameter]]  # (index in the whole model, parameter)


def fill_on_host(row: torch.Tensor, bad_forward: tuple[int, int] | None, indexed: Indexed) -> None:
    """This rank's row ``[stage + 1, micro-batch + 1, gradient + 1, value + 1]`` read on the
    host: a sum per gradient (and per parameter on a flagged step)."""
    if bad_forward is not None:
        row[0], row[1] = bad_forward[0] + 1, bad_forward[1] + 1
    # read as plain tensors: a .grad may be a guarded view (ZeRO-1's local shard)
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        bad_grad = next(
            (
                i
                for i, prm in indexed
                if prm.grad is not None and not bucket_is_finite(prm.grad.reshape(-1))
            ),
            None,
        )
    if bad_grad is not None:
        row[2] = bad_grad + 1
    if bad_forward is not None or bad_grad is not None:
        row[3] = first_bad_value(indexed)


def fill_on_device(
    row: torch.Tensor,
    forward: list[tuple[int, int, torch.Tensor]],
    indexed: Indexed,
    positions: Positions,
) -> None:
    """This rank's row's first three columns from flags kept on the device (``forward``:
    the runtime's ``(stage, micro-batch, flag)`` per watched forward): no host read."""
    at = positions.of([(s, mb) for s, mb, _ in forward], 2, row.device)
    write_first(row[0:2], [flag for _, _, flag in forward], at)
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        held = [(i, prm.grad) for i, prm in indexed if prm.grad is not None]
        at = positions.of([(i,) for i, _ in held], 1, row.device)
        write_first(row[2:3], [gradient_flag(g) for _, g in held], at)


def first_bad_value(indexed: Indexed) -> int:
    """1 + the index of the first parameter whose value is not finite (0: none)."""
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        bad = next((i for i, prm in indexed if not bucket_is_finite(prm.reshape(-1))), None)
    return 0 if bad is None else bad + 1
