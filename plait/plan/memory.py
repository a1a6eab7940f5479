"""Model-state memory per rank: the ZeRO paper's arithmetic, and a measurement to check it.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", section 3 and Figure 1. Training a model of P parameters with mixed precision and
Adam keeps, on every data-parallel rank,

    2P   fp16/bf16 parameters
    2P   fp16/bf16 gradients
    KP   optimizer state in fp32, K = 12 for Adam: master copy 4 + m 4 + v 4

that is 16P bytes: 120 GB for 7.5B parameters. ZeRO partitions this state over the n ranks
of the data-parallel group, one more kind of state per stage:

    strategy           params   grads   optimizer   7.5B, Adam, n = 64
    ddp                2P       2P      KP          120.0 GB
    zero1  (P_os)      2P       2P      KP/n         31.4 GB
    zero2  (P_os+g)    2P       2P/n    KP/n         16.6 GB
    zero3  (P_os+g+p)  2P/n     2P/n    KP/n          1.9 GB   (fsdp is zero3)

``estimate`` computes these numbers; ``measure`` adds up the tensors a rank really holds, so
the two can be compared on a running job. Neither counts activations, temporary buffers
(ZeRO-3's all-gathered layer, communication buckets) or the allocator's fragmentation: the
paper calls those residual states, and they come on top.

    >>> estimate(num_params=7.5e9, world_size=64, strategy="zero2").total_gb
    16.640625
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

GB = 1e9  # the paper's gigabyte (Figure 1: 7.5B x 16 bytes = 120 GB)

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
ALIASES = {"none": "ddp", "fsdp": "zero3"}
OPTIMIZERS = ("adam", "adamw", "sgd", "sgd_momentum")
PRECISIONS = ("mixed", "fp32")
BREAKDOWN_KEYS = ("params", "grads", "optimizer_state")

# Bytes per parameter: (params, grads, optimizer state K), per precision and optimizer.
# mixed: 16-bit params and grads; the optimizer keeps an fp32 master copy of the params.
#   adam/adamw:   16 = 2 params + 2 grads + 12 optimizer (4 master + 4 m + 4 v)
#   sgd_momentum: 12 = 2 params + 2 grads +  8 optimizer (4 master + 4 momentum)
#   sgd:           8 = 2 params + 2 grads +  4 optimizer (4 master)
# fp32: the params are the master copy, so the optimizer keeps only its own state.
#   adam/adamw:   16 = 4 params + 4 grads +  8 optimizer (4 m + 4 v)
#   sgd_momentum: 12 = 4 params + 4 grads +  4 optimizer (4 momentum)
#   sgd:           8 = 4 params + 4 grads +  0 optimizer
BYTES_PER_PARAM: dict[str, dict[str, tuple[int, int, int]]] = {
    "mixed": {"adam": (2, 2, 12), "adamw": (2, 2, 12), "sgd_momentum": (2, 2, 8), "sgd": (2, 2, 4)},
    "fp32": {"adam": (4, 4, 8), "adamw": (4, 4, 8), "sgd_momentum": (4, 4, 4), "sgd": (4, 4, 0)},
}

# Which of (params, grads, optimizer state) each strategy divides by the world size.
SHARDED: dict[str, tuple[bool, bool, bool]] = {
    "ddp": (False, False, False),  # every rank holds everything: (2 + 2 + K) P
    "zero1": (False, False, True),  # P_os: 2P + 2P + KP/n
    "zero2": (False, True, True),  # P_os+g: 2P + (2 + K) P/n
    "zero3": (True, True, True),  # P_os+g+p: (2 + 2 + K) P/n
}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of model state on one rank: parameters, gradients and optimizer state.

    From ``estimate``: ``strategy`` is one of ``STRATEGIES`` (aliases resolved), ``precision``
    and ``optimizer`` are as passed, and the byte fields may be fractional (P/n is taken
    exactly, as the paper does, unless ``shard_rounding``). From ``measure``: ``strategy`` is
    ``"measured"``, see there for the other fields.
    """

    strategy: str
    world_size: int
    num_params: int
    precision: str
    optimizer: str
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    total_bytes: float
    formula: str = ""  # bytes per rank in terms of P and n, e.g. "2P + 2P + 12P/n"

    @property
    def params_gb(self) -> float:
        return self.params_bytes / GB

    @property
    def grads_gb(self) -> float:
        return self.grads_bytes / GB

    @property
    def optimizer_gb(self) -> float:
        return self.optimizer_bytes / GB

    @property
    def total_gb(self) -> float:
        return self.total_bytes / GB

    def __str__(self) -> str:
        return (
            f"{self.strategy}: {self.total_gb:.1f} GB per rank (params {self.params_gb:.1f}, "
            f"grads {self.grads_gb:.1f}, optimizer {self.optimizer_gb:.1f}; "
            f"P={self.num_params:,}, n={self.world_size}, {self.optimizer}, {self.precision})"
        )


def estimate(
    *,
    num_params: int | float,
    world_size: int,
    strategy: str,
    optimizer: str = "adam",
    precision: str = "mixed",
    shard_rounding: bool = False,
) -> MemoryEstimate:
    """Model-state bytes per rank for ``num_params`` parameters on ``world_size`` ranks.

    ``strategy``: ``"ddp"`` (or ``"none"``), ``"zero1"``, ``"zero2"``, ``"zero3"`` (or
    ``"fsdp"``). ``optimizer``: ``"adam"``, ``"adamw"``, ``"sgd"``, ``"sgd_momentum"``.
    ``precision``: ``"mixed"`` (16-bit params and grads, fp32 master copy and optimizer
    state) or ``"fp32"``. ``num_params`` must be a whole number; ``7.5e9`` is fine.

    A sharded state takes P/n elements per rank, exactly, as in the paper's Figure 1: the
    average over ranks. With ``shard_rounding=True`` it takes ceil(P/n), what every rank
    holds when the state is one flat buffer padded to a multiple of n (ZeRO's and FSDP's
    flat parameters). Sharding each tensor separately (FSDP2's dim-0 chunks) can hold more,
    up to one row per tensor; ``measure`` sees the real figure.
    """
    strategy = _check_strategy(strategy)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {list(OPTIMIZERS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {list(PRECISIONS)}")
    if isinstance(num_params, bool) or not float(num_params).is_integer() or num_params <= 0:
        raise ValueError(
            f"num_params must be a whole number above 0 (the model's parameter count), "
            f"got {num_params!r}"
        )
    if isinstance(world_size, bool) or int(world_size) != world_size or world_size < 1:
        raise ValueError(
            f"world_size must be a whole number of ranks, at least 1, got {world_size!r}"
        )
    p, n = int(num_params), int(world_size)
    per_param = BYTES_PER_PARAM[precision][optimizer]
    shard = -(-p // n) if shard_rounding else p / n  # ceil in integers, exact for any P
    shard_text = "*ceil(P/n)" if shard_rounding else "P/n"

    sizes: list[float] = []
    terms: list[str] = []
    for nbytes, sharded in zip(per_param, SHARDED[strategy], strict=True):
        sizes.append(nbytes * (shard if sharded else p))
        if nbytes == 0:
            terms.append("0")
        else:
            terms.append(f"{nbytes}{shard_text if sharded else 'P'}")
    params_bytes, grads_bytes, optimizer_bytes = sizes
    return MemoryEstimate(
        strategy=strategy,
        world_size=n,
        num_params=p,
        precision=precision,
        optimizer=optimizer,
        params_bytes=params_bytes,
        grads_bytes=grads_bytes,
        optimizer_bytes=optimizer_bytes,
        total_bytes=params_bytes + grads_bytes + optimizer_bytes,
        formula=" + ".join(terms),
    )


def owned_state_bytes(
    numels: Sequence[int], world_size: int, *, state_bytes_per_element: float
) -> list[float]:
    """Optimizer state bytes on each rank for a whole-matrix optimizer (Muon: 4 bytes per
    element in fp32, its momentum; Shampoo: its preconditioners per element of the matrix)
    stepped by parameter ownership (:mod:`plait.strategies.whole_matrix.owners`): each rank
    holds the state of the parameters it owns, dealt by size, so the largest entry is
    ``max_r sum_{i owned by r} numel_i * bytes`` and not ``P/n``: a matrix is never split.
    No communication."""
    # deferred: the planner imports no strategy at module level
    from plait.strategies.whole_matrix.owners import ownership

    load = [0.0] * world_size
    for n, rank in zip(numels, ownership(list(numels), world_size), strict=True):
        load[rank] += n * state_bytes_per_element
    return load


def compare(
    *,
    num_params: int | float,
    world_size: int,
    optimizer: str = "adam",
    precision: str = "mixed",
    shard_rounding: bool = False,
) -> list[MemoryEstimate]:
    """``estimate`` for every strategy, in ``STRATEGIES`` order (Figure 1's columns)."""
    return [
        estimate(
            num_params=num_params,
            world_size=world_size,
            strategy=s,
            optimizer=optimizer,
            precision=precision,
            shard_rounding=shard_rounding,
        )
        for s in STRATEGIES
    ]


def format_table(estimates: list[MemoryEstimate]) -> str:
    """One row per estimate: params, grads, optimizer state and total in GB per rank (one
    decimal, as the paper prints them; MB when the largest total is under 1 GB)."""
    largest = max((e.total_bytes for e in estimates), default=0.0)
    unit, scale = ("GB", GB) if largest >= GB else ("MB", 1e6)
    header = (
        f"{'strategy':<10}{'params ' + unit:>12}{'grads ' + unit:>12}"
        f"{'optimizer ' + unit:>16}{'total ' + unit:>12}   formula (bytes per rank)"
    )
    lines = [header]
    for e in estimates:
        lines.append(
            f"{e.strategy:<10}{e.params_bytes / scale:>12.1f}{e.grads_bytes / scale:>12.1f}"
            f"{e.optimizer_bytes / scale:>16.1f}{e.total_bytes / scale:>12.1f}   {e.formula}"
        )
    return "\n".join(lines)


def measure(
    model: object, optimizer: object | None = None, *, world_size: int | None = None
) -> MemoryEstimate:
    """Bytes of model state this rank holds now, from its tensors (``strategy="measured"``).

    Where the tensors come from, per kind:

    - an object with ``memory_breakdown() -> dict[str, list[Tensor]]`` (keys ``"params"``,
      ``"grads"``, ``"optimizer_state"``, each optional) is asked first: for ``"params"`` the
      model's breakdown wins over the optimizer's, for ``"grads"`` and ``"optimizer_state"``
      the optimizer's wins over the model's (a sharded optimizer knows which gradient and
      state shards it keeps; a sharded module knows its parameter shards);
    - a kind that neither breakdown has falls back to: params = ``model.parameters()``,
      grads = their ``.grad``, optimizer state = every tensor in ``optimizer.state``'s
      values (none without an optimizer).

    Each storage is counted once, whole: tensors are grouped by (device, storage address),
    and a storage that appears again, as another view or under another kind, is not counted
    again (the first kind in the order params, grads, optimizer state keeps it). The whole
    storage's bytes count, not only the span the views reference, because that is what the
    allocator keeps alive: a shard that is a view into a full-size flat buffer still costs
    the full buffer. Meta tensors count 0 bytes.

    Adam's per-parameter ``step`` counters are tensors in ``optimizer.state`` and are
    counted (a 4-byte float32 scalar each in PyTorch's Adam, so 8P + 4 * number of tensors
    in fp32); ``estimate``'s K leaves them out, as the paper does.

    ``num_params`` is the number of parameter elements this rank holds (a shard's size under
    ZeRO-3/FSDP), ``precision`` the parameters' dtypes joined by "+" (e.g. ``"float32"``),
    ``optimizer`` the optimizer's class name in lower case (``"none"`` without one), and
    ``world_size`` the default group's size when ``torch.distributed`` is initialized, else 1,
    unless given.
    """
    model_parts = _breakdown(model)
    optim_parts = _breakdown(optimizer) if optimizer is not None else {}

    params = model_parts.get("params", optim_parts.get("params"))
    if params is None:
        params = list(_module(model).parameters())
    grads = optim_parts.get("grads", model_parts.get("grads"))
    if grads is None:
        grads = [p.grad for p in _module(model).parameters() if p.grad is not None]
    state = optim_parts.get("optimizer_state", model_parts.get("optimizer_state"))
    if state is None:
        state = _optimizer_state(optimizer) if optimizer is not None else []

    seen: set[tuple[str, int]] = set()
    params_bytes = _storage_bytes(params, seen)
    grads_bytes = _storage_bytes(grads, seen)
    optimizer_bytes = _storage_bytes(state, seen)

    if world_size is None:
        dist = torch.distributed
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    local_params = [_local(p) for p in {id(p): p for p in params}.values()]
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in local_params})
    return MemoryEstimate(
        strategy="measured",
        world_size=world_size,
        num_params=sum(p.numel() for p in local_params),
        precision="+".join(dtypes) or "none",
        optimizer=type(optimizer).__name__.lower() if optimizer is not None else "none",
        params_bytes=float(params_bytes),
        grads_bytes=float(grads_bytes),
        optimizer_bytes=float(optimizer_bytes),
        total_bytes=float(params_bytes + grads_bytes + optimizer_bytes),
        formula="measured",
    )


def _check_strategy(strategy: str) -> str:
    name = ALIASES.get(strategy, strategy)
    if name not in STRATEGIES:
        choices = [*STRATEGIES, *ALIASES]
        raise ValueError(f"unknown strategy {strategy!r}; use one of {choices}")
    return name


def _breakdown(obj: object) -> dict[str, list[torch.Tensor]]:
    method = getattr(obj, "memory_breakdown", None)
    if method is None or not callable(method):
        return {}
    parts = method()
    if not isinstance(parts, Mapping):
        raise TypeError(
            f"{type(obj).__name__}.memory_breakdown() must return a dict with keys among "
            f"{list(BREAKDOWN_KEYS)}, got {type(parts).__name__}"
        )
    unknown = [k for k in parts if k not in BREAKDOWN_KEYS]
    if unknown:
        raise ValueError(
            f"{type(obj).__name__}.memory_breakdown() returned unknown keys {unknown}; "
            f"use keys among {list(BREAKDOWN_KEYS)}"
        )
    out: dict[str, list[torch.Tensor]] = {}
    for key, tensors in parts.items():
        items = list(tensors)
        bad = [type(t).__name__ for t in items if not isinstance(t, torch.Tensor)]
        if bad:
            raise TypeError(
                f"{type(obj).__name__}.memory_breakdown()[{key!r}] must hold tensors only, "
                f"found {bad[:3]}"
            )
        out[key] = items
    return out


def _module(model: object) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"measure() needs a torch.nn.Module, or an object whose memory_breakdown() gives "
            f"'params' and 'grads'; got {type(model).__name__}"
        )
    return model


def _optimizer_state(optimizer: object) -> list[torch.Tensor]:
    state = getattr(optimizer, "state", None)
    if not isinstance(state, Mapping):
        return []
    return list(_tensors(list(state.values())))


def _tensors(value: object) -> Iterable[torch.Tensor]:
    """Every tensor inside nested dicts, lists and tuples (an optimizer's per-param state)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds); any other tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int]]) -> int:
    total = 0
    for t in tensors:
        t = _local(t)
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total
