"""Single-process data parallelism: one process, one replica per device, run in threads.

``DataParallel(module)(x)`` cuts the batch ``x`` into one chunk per replica along ``dim``
(scatter), runs every replica on its chunk in its own thread, and concatenates the outputs
on ``output_device`` (gather). The replicas' parameters are differentiable copies of the
module's own (on CPU, the module's parameters themselves), so one ``backward()`` of a loss
on the gathered output sums every replica's gradient into the module's ``.grad``: the
gradients are reduced to the first replica, which is the module itself, and an optimizer
built on ``module.parameters()`` steps as usual.

Why this gives the same gradients as DDP and as one process on the whole batch (the
batch-mean argument): with a mean loss over a global batch of B samples, the loss DataParallel
differentiates *is* the one-process loss, computed on the gathered outputs, so its gradient
is ``(1/B) sum_i grad l_i`` exactly, however the batch was split. DDP instead has each of N
ranks differentiate the mean over its B/N samples, ``(N/B) sum_{i in shard} grad l_i``, and
all-reduces with the average, ``(1/N) sum_ranks (N/B) sum_{i in shard} grad l_i =
(1/B) sum_i grad l_i``: the same gradient, up to floating-point rounding (DDP needs equal
shards for this; DataParallel does not).

No communication library is involved: replicas live in one process and threads share the
address space. Devices: ``device_ids`` lists CUDA devices (default: every visible GPU when
the module is on a GPU); on CPU, ``replicas=k`` runs k replicas on the CPU (default 1:
the module is called as it is). As in PyTorch, buffers updated in forward (BatchNorm's
running statistics) are kept from the first replica only.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from plait.strategies.data_parallel import grad_sync

Device = int | str | torch.device


def _device(d: Device) -> torch.device:
    return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)


def scatter(obj: Any, devices: Sequence[torch.device], dim: int) -> list[Any]:
    """``obj`` cut into ``len(devices)`` pieces: tensors chunked along ``dim`` and moved to
    each device; tuples, lists and dicts recursively; anything else shared by all.

    A batch smaller than the number of devices gives fewer pieces (``torch.chunk``)."""
    if isinstance(obj, torch.Tensor):
        chunks = obj.chunk(len(devices), dim)
        return [c.to(d) for c, d in zip(chunks, devices, strict=False)]
    if isinstance(obj, (tuple, list)) and obj:
        parts = [scatter(o, devices, dim) for o in obj]
        n = min(len(p) for p in parts)
        return [type(obj)(p[i] for p in parts) for i in range(n)]  # type: ignore[call-arg]
    if isinstance(obj, dict) and obj:
        parts_of = {k: scatter(v, devices, dim) for k, v in obj.items()}
        n = min(len(p) for p in parts_of.values())
        return [{k: p[i] for k, p in parts_of.items()} for i in range(n)]
    return [obj for _ in devices]


def gather(outputs: Sequence[Any], device: torch.device, dim: int) -> Any:
    """The replicas' outputs joined along ``dim`` on ``device`` (same structure)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:  # a scalar per replica (a loss): one vector of them
            return torch.stack([o.to(device) for o in outputs])
        return torch.cat([o.to(device) for o in outputs], dim)
    if isinstance(first, (tuple, list)):
        return type(first)(gather([o[i] for o in outputs], device, dim) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: gather([o[k] for o in outputs], device, dim) for k in first}
    return list(outputs)


def replicate(module: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``module`` whose parameters are differentiable ``.to(device)`` copies of
    the original's (gradients flow back into the original's ``.grad``) and whose buffers
    are copies (their in-place updates are dropped)."""
    originals = dict(module.named_modules())
    copies = {name: copy.copy(m) for name, m in originals.items()}
    for name, m in copies.items():
        m._modules = {
            k: copies[f"{name}.{k}" if name else k] if c is not None else None
            for k, c in originals[name]._modules.items()
        }
        m._parameters = {
            k: (p.to(device) if p is not None else None)
            for k, p in originals[name]._parameters.items()
        }
        m._buffers = {
            k: (b.to(device, copy=True) if b is not None else None)
            for k, b in originals[name]._buffers.items()
        }
    return copies[""]


class DataParallel(nn.Module):
    """``DataParallel(module, device_ids=None, output_device=None, dim=0, *, replicas=None)``.

    Forward: scatter the inputs (tensors chunked along ``dim``), run replica ``k`` on piece
    ``k`` in thread ``k`` (the first replica is ``module`` itself), gather the outputs on
    ``output_device`` (default: the first device). Backward: autograd sums the replicas'
    gradients into ``module``'s parameters. No inter-process communication; nothing blocks
    on other processes. ``.module`` is the wrapped module. See the module docstring for why
    the gradients equal one process on the whole batch and DDP.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[Device] | None = None,
        output_device: Device | None = None,
        dim: int = 0,
        *,
        replicas: int | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.dim = dim
        home = next(iter(module.parameters()), torch.empty(0)).device
        if replicas is not None and (not isinstance(replicas, int) or replicas < 1):
            raise ValueError(f"DataParallel: replicas must be a positive integer, got {replicas!r}")
        if device_ids is None:
            if home.type == "cuda":
                if replicas is not None:
                    raise ValueError(
                        "DataParallel: replicas= is for CPU modules; on GPUs pass device_ids"
                    )
                device_ids = list(range(torch.cuda.device_count()))
            else:
                device_ids = ["cpu"] * (replicas or 1)
        elif replicas is not None:
            raise ValueError("DataParallel: pass device_ids or replicas, not both")
        self.devices = [_device(d) for d in device_ids]
        if not self.devices:
            raise ValueError("DataParallel: device_ids is empty")
        if self.devices[0] != home and not (home.type == "cpu" and self.devices[0].type == "cpu"):
            raise ValueError(
                f"DataParallel: the module's parameters are on {home}, but the first device "
                f"is {self.devices[0]}; move the module there first (module.to(device_ids[0]))"
            )
        self.device_ids = list(device_ids)
        self.output_device = _device(output_device) if output_device is not None else home

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` on the module's parameters."""
        return grad_sync.clip_grad_norm_(
            self.module.parameters(),
            max_norm,
            norm_type,
            error_if_nonfinite=error_if_nonfinite,
            foreach=foreach,
        )

    def _replica(self, k: int) -> nn.Module:
        # on CPU, p.to("cpu") is p itself: the replicas share the module's parameters
        return self.module if k == 0 else replicate(self.module, self.devices[k])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if len(self.devices) == 1:
            return self.module(*args, **kwargs)
        pieces = scatter((args, kwargs), self.devices, self.dim)
        if len(pieces) == 1:
            a, kw = pieces[0]
            return self.module(*a, **kw)
        replicas = [self._replica(k) for k in range(len(pieces))]
        outputs: list[Any] = [None] * len(pieces)
        errors: list[BaseException | None] = [None] * len(pieces)
        grad_enabled = torch.is_grad_enabled()

        def run(k: int) -> None:
            try:
                with torch.set_grad_enabled(grad_enabled):
                    a, kw = pieces[k]
                    outputs[k] = replicas[k](*a, **kw)
            except BaseException as exc:  # re-raised below, naming the replica
                errors[k] = exc

        threads = [
            threading.Thread(target=run, args=(k,), name=f"plait-dp-replica{k}")
            for k in range(1, len(pieces))
        ]
        for t in threads:
            t.start()
        run(0)  # the first replica on the calling thread
        for t in threads:
            t.join()
        for k, exc in enumerate(errors):
            if exc is not None:
                raise RuntimeError(
                    f"DataParallel: replica {k} (on {self.devices[k]}) failed in forward: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        return gather(outputs, self.output_device, self.dim)
