"""The device a group's tensors live on, and the check that refuses a tensor elsewhere.

A process group moves tensors of one kind of device. NCCL moves CUDA tensors only;
PyTorch's fake backend (``"fake"``, ``torch.testing._internal.distributed.fake_pg``: one
process playing one rank of N, no data moves) is treated by plait as a device backend for
the ``meta`` device, so a training step of any strategy on a model built on ``meta``
proves, on a CPU, that every tensor plait hands to a collective was made on the model's
device (a flag, a mask, a norm, a count, a shape message made on the CPU by accident is
refused here, as NCCL would refuse it on a GPU). gloo moves CPU tensors, and CUDA tensors
that plait stages through the host.

Every control tensor a strategy makes for a collective is made with
``device=group_device(group)`` or on the device of the tensors it describes, never with
torch's default (the CPU).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from plait.comm.group import Group

# backend -> the only device type its collectives take (absent: CPU, or CUDA staged by plait)
DEVICE_OF_BACKEND: dict[str, str] = {"nccl": "cuda", "fake": "meta"}


def device_type(backend: str) -> str | None:
    """The device type every tensor of a collective on ``backend`` must have, or None
    (gloo: CPU tensors, CUDA tensors staged through the host)."""
    return DEVICE_OF_BACKEND.get(backend)


def group_device(group: Group) -> torch.device:
    """Where a control tensor for a collective on ``group`` is made: this rank's GPU on
    NCCL, ``meta`` on the fake backend, the CPU on gloo."""
    kind = device_type(group.backend)
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind or "cpu")


def origin() -> tuple[Any, int] | None:
    """The first frame outside ``plait/comm`` (code object and line): where a collective
    was issued. Cheap (no formatting); :func:`caller` formats it. A collective run on its
    group's worker thread keeps the origin its :class:`~plait.comm.group.Call` recorded."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if "plait/comm/" not in path.replace("\\", "/"):
            return frame.f_code, frame.f_lineno
        frame = frame.f_back
    return None


def caller(where: tuple[Any, int] | None = None) -> str:
    """The strategy (or user) call that handed a tensor over, as
    ``plait/strategies/data_parallel/ddp.py:521 (DistributedDataParallel._reduce_unused)``:
    ``where`` (an :func:`origin`), else the first frame outside ``plait/comm`` now."""
    found = where or origin()
    if found is None:
        return "an unknown caller"
    code, line = found
    path = code.co_filename.replace("\\", "/")
    cut = path.rfind("/plait/")
    name = getattr(code, "co_qualname", code.co_name)
    return f"{path[cut + 1 :] if cut >= 0 else path}:{line} ({name})"


def check(
    collective: str,
    name: str,
    t: torch.Tensor,
    group: Group,
    where: tuple[Any, int] | None = None,
) -> None:
    """Refuse ``t`` (argument ``name`` of ``collective``) unless it is on ``group``'s
    device, naming the call that handed it over (``where``: an :func:`origin`, else the
    current stack) and what to change."""
    want = device_type(group.backend)
    have = t.device.type
    if want is None:
        if have not in ("cpu", "cuda"):
            raise ValueError(
                f"{collective}: {name} (shape {tuple(t.shape)}, {t.dtype}) is on {t.device}, "
                f"handed over by {caller(where)}; group {group.name!r} ({group.backend}) takes "
                f"CPU or CUDA tensors"
            )
        return
    if have != want:
        hint = ".cuda()" if want == "cuda" else f"device={want!r}"
        raise ValueError(
            f"{collective}: {name} (shape {tuple(t.shape)}, {t.dtype}) is on {t.device} "
            f"but group {group.name!r} ({group.backend}) moves {want} tensors only; it was "
            f"handed over by {caller(where)}: make it on the group's device (the model's; "
            f"plait.comm.device.group_device(group), or {hint})"
        )


def host_list(t: torch.Tensor, local: list[Any] | None = None) -> list[Any]:
    """The values of a control tensor after its collective, on the host (``t.tolist()``:
    on a GPU a synchronization, so only where a decision needs them).

    A tensor on ``meta`` holds no values. On the fake backend a collective leaves its
    tensor as it was, so ``local`` (the values this rank made it from) is exactly what
    the collective returned there; without ``local`` this raises naming the caller.
    """
    if t.device.type != "meta":
        return t.tolist()  # type: ignore[no-any-return]
    if local is None:
        raise RuntimeError(
            f"{caller()} reads the values of a meta tensor of shape {tuple(t.shape)}: a "
            f"decision that needs data cannot be taken on the meta device"
        )
    return list(local)


def moved(
    t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``t.to(device, dtype)``, except from ``meta`` to a device that holds data (an
    offloaded shard's gradient coming back to the host, a clipping factor for it): a meta
    tensor holds no values and PyTorch refuses to copy out of one, so the result is an
    uninitialized tensor of ``t``'s shape there. Only a step on the meta device takes that
    branch (tests/test_meta_device.py: FSDP with offload keeps its shards on the CPU while
    every collective sees meta); everywhere else this is ``t.to``."""
    target = torch.device(device)
    if t.is_meta and target.type != "meta":
        return torch.empty(t.shape, dtype=dtype or t.dtype, device=target)
    return t.to(target, dtype)


def read_verdict(
    t: torch.Tensor, *, who: str, setting: str = "check_finite", fix: str | None = None
) -> list[Any]:
    """The values of an agreed verdict (a non-finite flag row, a found-inf flag) on the host:
    ``t.tolist()``, the one host read per step a check makes (torch's GradScaler and
    Megatron-LM's found-inf check make the same one; on a GPU it waits for the step's
    kernels). Every verdict reads zero when all is well. On ``meta`` there are no values
    to decide on: refused naming ``who``, the ``setting`` that asked for the read and
    ``fix`` (default: turn the setting off), after the flag's own collectives ran on meta
    (the meta harness's read counter answers here instead: ``tests/test_meta_device.py``)."""
    try:
        return t.reshape(-1).tolist()  # type: ignore[no-any-return]
    except (RuntimeError, NotImplementedError) as exc:
        if t.device.type != "meta":
            raise
        raise NotImplementedError(
            f"{who}: {setting} reads one agreed flag per step on the host and a meta tensor "
            f"holds no values (the flag was made, and its collectives ran, on meta up to "
            f"here). {fix or f'Pass {setting}=None'} to step a model on the meta device"
        ) from exc


def control_device(like: Any = (), group: Group | None = None) -> torch.device:
    """Where to make a control tensor (a flag, a norm, a count) describing ``like`` (the
    gradients or parameters it is about) for a collective on ``group``: the group's device
    where its backend demands one (NCCL, fake); else (gloo) the device of the first tensor
    in ``like``, so a CUDA model's flags stay on its GPU (plait stages them), else the CPU."""
    if group is not None and device_type(group.backend) is not None:
        return group_device(group)
    for t in like:
        if isinstance(t, torch.Tensor):
            return t.device
    return group_device(group) if group is not None else torch.device("cpu")
