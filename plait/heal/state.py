"""The training state a live member hands to a replacement (or to a survivor one step
behind): parameters, buffers, optimizer state, RNG and the data cursor, from live memory.

Nothing is read from a checkpoint: every member of a healing job holds the full
replicated state (data-parallel replicas), so any one of them can send it. The tensors
travel point to point on the generation's group (the source sends each receiver every
tensor, in one fixed order: parameters, buffers, the optimizer's state per parameter in
key order, the RNG state, the cursor), each on the parameters' device (a CPU tensor of
the state, as Adam's ``step``, is moved there for the wire and lands on the CPU again).
The RNG state is the CPU generator's, and the current CUDA device's when the model is on
CUDA (:func:`rng_state`: a replacement draws what its peer would). Plain values of the
optimizer state (numbers) and the shapes travel as a JSON manifest in the store, so
nothing is pickled.

A receiver whose optimizer holds no state yet (a fresh process) first materializes it by
one step on zero gradients (every entry exists afterwards, with the right shapes); the
values are then overwritten by what it receives.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from plait.comm.group import Channel, Group

KEY = "plait/heal"


def _opt_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def manifest(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer state's layout: per parameter, each key's shape and dtype (tensors)
    or value (numbers)."""
    out = []
    for p in _opt_params(optimizer):
        entry: dict[str, list[Any]] = {}
        for k, v in sorted(optimizer.state.get(p, {}).items()):
            if torch.is_tensor(v):
                entry[k] = ["tensor", list(v.shape), str(v.dtype)]
            elif isinstance(v, (int, float, bool)) or v is None:
                entry[k] = ["value", v]
            else:
                raise TypeError(
                    f"healing: optimizer state key {k!r} holds a {type(v).__name__}; only "
                    f"tensors and numbers can be sent to a replacement"
                )
        out.append(entry)
    return json.dumps(out)


def _materialize(optimizer: torch.optim.Optimizer) -> None:
    params = _opt_params(optimizer)
    saved = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p, g in zip(params, saved, strict=True):
        p.grad = g


def adopt_manifest(optimizer: torch.optim.Optimizer, text: str) -> None:
    """Give this optimizer the source's state layout (and plain values)."""
    wanted = json.loads(text)
    params = _opt_params(optimizer)
    if len(wanted) != len(params):
        raise ValueError(
            f"healing: the source's optimizer has {len(wanted)} parameters, this one "
            f"{len(params)}: a replacement must build the same model and optimizer"
        )
    if any(w and not optimizer.state.get(p) for w, p in zip(wanted, params, strict=True)):
        _materialize(optimizer)
    for i, (w, p) in enumerate(zip(wanted, params, strict=True)):
        state = optimizer.state[p] if w else {}
        if sorted(state) != sorted(w):
            raise ValueError(
                f"healing: optimizer parameter {i}: the source's state has keys {sorted(w)}, "
                f"this one {sorted(state)}"
            )
        for k, (kind, *rest) in w.items():
            if kind == "value":
                state[k] = rest[0]
            elif list(state[k].shape) != rest[0]:
                raise ValueError(
                    f"healing: optimizer parameter {i} state {k!r}: shape {rest[0]} at the "
                    f"source, {list(state[k].shape)} here"
                )


def tensors(
    module: nn.Module, optimizer: torch.optim.Optimizer, rng: torch.Tensor, cursor: torch.Tensor
) -> list[torch.Tensor]:
    """Every tensor of the state, in the order they travel."""
    return tensors_of(list(module.parameters()), list(module.buffers()), optimizer, rng, cursor)


def tensors_of(
    params: list[torch.Tensor],
    buffers: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    rng: torch.Tensor,
    cursor: torch.Tensor,
) -> list[torch.Tensor]:
    """:func:`tensors` of a model given by its parameters and buffers (a model-parallel
    rank's shards)."""
    out = [p.data for p in params] + [b.data for b in buffers]
    for p in _opt_params(optimizer):
        out += [v for _, v in sorted(optimizer.state.get(p, {}).items()) if torch.is_tensor(v)]
    return out + [rng, cursor]


def rng_state(device: torch.device) -> torch.Tensor:
    """The random state a replacement takes, as bytes on ``device`` (the parameters'): the
    CPU generator's, then, on CUDA, that device's generator's. Local."""
    parts = [torch.get_rng_state()]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device))
    return torch.cat(parts).to(device)


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    """Set the generators from :func:`rng_state`'s bytes (one host copy). Local."""
    host = state.cpu()
    size = torch.get_rng_state().numel()
    torch.set_rng_state(host[:size].clone())
    if device.type == "cuda":
        torch.cuda.set_rng_state(host[size:].clone(), device)


def transfer(
    group: Group,
    items: list[torch.Tensor],
    *,
    source: int,
    receivers: tuple[int, ...],
    apply: bool = True,
) -> list[torch.Tensor] | None:
    """``source`` (a slot) sends ``items`` to every slot of ``receivers``, which receive
    them in place (``apply=False``: into new tensors, returned on a receiver, for the
    caller to apply once every part of its state arrived: :func:`apply_received`; None
    elsewhere). Collective on ``group``: every member calls it (the others only count
    it). Point-to-point sends, ``len(receivers)`` times the state's bytes out of the source.
    Every message is on the device of ``items[0]`` (the parameters'): an item elsewhere (a
    CPU scalar of the optimizer state) is copied there to travel and back where it lives."""
    src = group.ranks.index(source)
    wire = items[0].device
    dst = [group.ranks.index(r) for r in receivers]
    nbytes = sum(t.numel() * t.element_size() for t in items)
    received: list[torch.Tensor] | None = None

    def body(ch: Channel) -> None:
        nonlocal received
        if ch.rank == src:
            out = [t.to(wire).contiguous() for t in items]
            pending = [ch.isend(t, d) for d in dst for t in out]
            ch.wait(*pending)
        elif ch.rank in dst:
            bufs = [torch.empty(t.shape, dtype=t.dtype, device=wire) for t in items]
            ch.wait(*[ch.irecv(b, src) for b in bufs])
            if apply:
                apply_received(items, bufs)
            else:
                received = bufs

    group.run(
        "broadcast",
        "heal/state",
        body,
        async_op=False,
        payload_bytes=nbytes,
        signature=f"state from {source} to {list(receivers)} bytes={nbytes}",
        desc="healing state transfer",
    )
    return received


def apply_received(items: list[torch.Tensor], received: list[torch.Tensor]) -> None:
    """Write what :func:`transfer` received into the state's tensors (local)."""
    for t, b in zip(items, received, strict=True):
        t.copy_(b)
