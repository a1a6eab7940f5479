"""PyTorch DDP's constructor arguments that plait accepts: ``process_group=`` (an alias of
``group=``) and ``device_ids``/``output_device`` (one CUDA device, the module's own)."""

from __future__ import annotations

import torch
from torch import nn

from plait import comm
from plait.comm.group import Group


def pick_group(group: Group | None, process_group: Group | None) -> Group:
    """``group=`` or its PyTorch name ``process_group=`` (not both), default the world."""
    if group is not None and process_group is not None and group is not process_group:
        raise ValueError(
            "DistributedDataParallel: pass group= or its alias process_group=, not both"
        )
    chosen = group if group is not None else process_group
    if chosen is None:
        return comm.world()
    if not isinstance(chosen, Group):
        raise TypeError(
            f"DistributedDataParallel: the group must be a plait.comm.Group (from "
            f"plait.comm.world() or plait.comm.new_group()), got {type(chosen).__name__}"
        )
    return chosen


def check_devices(
    module: nn.Module,
    device_ids: list[int | str | torch.device] | None,
    output_device: int | str | torch.device | None,
) -> None:
    """PyTorch's ``device_ids``/``output_device``: one CUDA device, the module's own."""
    devices = {p.device for p in module.parameters()}
    if device_ids is None and output_device is None:
        return
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        where = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(
            f"DistributedDataParallel: device_ids={device_ids!r}, "
            f"output_device={output_device!r} are for a module on one CUDA device, but its "
            f"parameters are on {where}; leave both None (each rank computes on the devices "
            f"its module is on)"
        )
    (device,) = devices
    ids = list(device_ids or [device]) + ([output_device] if output_device is not None else [])
    if len(list(device_ids or [device])) != 1 or any(_cuda(d) != device for d in ids):
        raise ValueError(
            f"DistributedDataParallel: device_ids={device_ids!r}, "
            f"output_device={output_device!r}: each rank drives one device, and the module is "
            f"on {device}; pass device_ids=[{device.index}] (or None) after module.to({device})"
        )


def _cuda(d: int | str | torch.device) -> torch.device:
    return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
