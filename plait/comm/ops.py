"""The public collectives: check the arguments, pick the algorithm, run it on the group.

Every collective takes ``group=`` (default: the world group of ``plait.init``),
``algorithm=`` (``"auto"`` by default; see :data:`SUPPORTED`) and ``async_op=``: with
``async_op=True`` it returns a :class:`~plait.comm.group.Handle` at once and runs on the
group's worker thread, in issue order; otherwise it returns ``None`` when done. Ranks
(``src``, ``dst``) are ranks *within the group*.

Arguments are checked before anything is sent: a wrong type, shape or device raises
``TypeError``/``ValueError`` on the rank that passed it, naming what to change (a tensor
off the group's device names the call that handed it over: ``device.py``). All ranks of
the group must call the same collectives in the same order with matching shapes.

Checked by default (``plait.init(check=...)``, ``PLAIT_CHECK``; see ``watchdog.py``): each
collective's signature (collective, algorithm, op, dtype, byte count or block sizes, root)
and its sequence number on the group are folded into the tags of its messages, so ranks
that disagree never exchange a byte (no abort inside the backend, no wrong result); a
backend (``"native"``) collective first exchanges a one-byte token per peer under that
tag. The stall watchdog then reads the progress board and raises
:class:`~plait.comm.errors.CollectiveMismatch` on every rank involved, naming each rank's
call, within about a second. Limits: the hash has 20 bits and the sequence number 10 (a
disagreement slips through only on a hash collision, about 1 in a million, or when a rank
is exactly a multiple of 1024 collectives ahead); the per-rank sizes of the list form of
``all_to_all`` are not compared (they differ legitimately); and a collective one rank
calls alone that is identical in every respect to the next one the others call pairs
with it. ``PLAIT_DEBUG=1`` compares the full signatures (shapes included) through the
store before every collective. Every call blocks on other ranks for at most the group's
timeout, then raises :class:`~plait.comm.errors.CollectiveTimeout`; a wait on a rank whose
heartbeat stopped raises :class:`~plait.comm.errors.PeerUnresponsive` after the heartbeat
timeout (5 s). After any of these errors the group is closed: make a new one (or restart).

Which plait calls are collective (every rank of the group must make them, in the same
order, or the check above names the first one that differs):

* ``plait.init`` (every rank joins), ``plait.comm.new_group`` and ``plait.Mesh`` (every
  rank of the world, in the same order), every function of this module (``send``/``recv``
  pair two ranks), and ``plait.shutdown`` (it waits for pending collectives).
* wrapping a model: ``DistributedDataParallel``, ``NaiveDataParallel``,
  ``ZeroOptimizer``/``prepare_zero``, ``fully_shard``, ``plait.prepare``, the tensor-
  parallel ``parallelize`` (the parameter lists are compared, parameters broadcast).
* training: DDP/naive backward (gradient all-reduces), ``ZeroOptimizer.step``/``
  clip_grad_norm_``, FSDP forward/backward/``clip_grad_norm_``, tensor-parallel forward/
  backward and cross-entropy.
* state: ``ZeroOptimizer.state_dict()`` and FSDP's full state dicts (all-gathers: call
  them on every rank, not under ``if rank == 0``; save from rank 0 afterwards),
  ``plait.checkpoint`` save/wait/load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

from plait import runtime
from plait.comm import (
    device,
    dissemination,
    halving_doubling,
    hierarchical,
    naive,
    native,
    ring,
    ring_tree,
    shm_collectives,
    tree,
    tuner,
)
from plait.comm.chunks import split
from plait.comm.group import (
    COLLECTIVE_TAG_BIT,
    COMPLETED,
    Call,
    Channel,
    Group,
    Handle,
    Started,
)
from plait.comm.reduce_op import ReduceOp, parse_op, prescaled

ALGORITHMS: dict[str, ModuleType] = {
    "ring": ring,
    "tree": tree,
    "halving_doubling": halving_doubling,
    "naive": naive,
    "hierarchical": hierarchical,
    "ring_tree": ring_tree,
    "shm": shm_collectives,
    "native": native,
}

# Which algorithm implements which collective (plain data, printed in the README).
SUPPORTED: dict[str, tuple[str, ...]] = {
    "all_reduce": (
        "ring",
        "tree",
        "halving_doubling",
        "naive",
        "hierarchical",
        "ring_tree",
        "shm",
        "native",
    ),
    "reduce_scatter": ("ring", "halving_doubling", "naive", "shm", "native"),
    "all_gather": ("ring", "halving_doubling", "naive", "shm", "native"),
    "broadcast": ("ring", "tree", "naive", "hierarchical", "native"),
    "reduce": ("ring", "tree", "naive", "hierarchical", "native"),
    "all_to_all": ("ring", "naive", "native"),
}

DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
)


# --- checks -------------------------------------------------------------------------------
def _group(group: Group | None) -> Group:
    if group is not None:
        if not isinstance(group, Group):
            raise TypeError(
                f"group must be a plait.comm.Group (from plait.comm.world() or "
                f"plait.comm.new_group()), got {type(group).__name__}"
            )
        return group

    return runtime.world()


def _check_tensor(collective: str, name: str, t: Any, group: Group) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{collective}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        allowed = ", ".join(str(d).replace("torch.", "") for d in DTYPES)
        raise TypeError(f"{collective}: {name} has dtype {t.dtype}; supported: {allowed}")
    device.check(collective, name, t, group)


def _check_same(collective: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    (name0, t0), *rest = tensors
    for name, t in rest:
        if t.dtype != t0.dtype:
            raise TypeError(
                f"{collective}: {name} has dtype {t.dtype} but {name0} has {t0.dtype}; "
                f"pass tensors of one dtype"
            )
        if t.device != t0.device:
            raise ValueError(
                f"{collective}: {name} is on {t.device} but {name0} is on {t0.device}; "
                f"put them on one device"
            )


def _check_op(collective: str, op: ReduceOp, t: torch.Tensor) -> None:
    if op is ReduceOp.AVG and not t.dtype.is_floating_point:
        raise TypeError(
            f"{collective}: op 'avg' needs a floating-point tensor, got {t.dtype}; "
            f"use op='sum' and divide"
        )


def _check_root(collective: str, name: str, root: int, group: Group) -> None:
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < group.size:
        raise ValueError(
            f"{collective}: {name}={root!r} is not a rank of group {group.name!r}, which has "
            f"ranks 0..{group.size - 1} (ranks are counted within the group)"
        )


def shared(group: Group) -> bool:
    """Every rank of ``group`` shares memory with this one (algorithm ``"shm"`` works)."""
    return group.shm is not None and group.shm.covers(range(group.size))


def _choose(collective: str, algorithm: str, nbytes: int, group: Group) -> str:
    if algorithm == "auto":
        algorithm = tuner.choose(
            collective, nbytes, group.size, shm=shared(group), backend=group.backend
        )
    elif algorithm == "shm" and not shared(group):
        raise ValueError(
            f"{collective}: algorithm 'shm' needs every rank of group {group.name!r} on this "
            f"host with the shared-memory transport (plait.init(transport='auto' or 'shm'), "
            f"PLAIT_TRANSPORT); this group has "
            + ("no shared-memory link" if group.shm is None else "ranks on other hosts")
            + "; use 'auto'"
        )
    if algorithm not in SUPPORTED[collective]:
        known = "', '".join(SUPPORTED[collective])
        if algorithm in ALGORITHMS:
            raise ValueError(
                f"{collective}: algorithm {algorithm!r} does not implement {collective}; "
                f"use 'auto' or one of '{known}'"
            )
        raise ValueError(f"{collective}: unknown algorithm {algorithm!r}; use 'auto' or '{known}'")
    return algorithm


def resolve(collective: str, algorithm: str, nbytes: int, group: Group) -> str:
    """The algorithm ``collective`` of ``nbytes`` on ``group`` runs under ``algorithm``
    (``"auto"`` resolved; the name checked). ``"native"`` asynchronous on a device backend:
    started on the caller's thread and stream (:func:`_direct`)."""
    return _choose(collective, algorithm, nbytes, group)


def _lowered(op: ReduceOp) -> ReduceOp:
    return ReduceOp.SUM if op is ReduceOp.AVG else op


def _direct(g: Group, algo: str, async_op: bool) -> bool:
    """An asynchronous backend collective on a device backend (NCCL, fake): started on
    the caller's thread, its ``Work`` handed to the :class:`Handle` and waited where the
    caller waits (:meth:`Group.start_native`), so it overlaps the compute issued after it
    as PyTorch's own does. Elsewhere it runs on the group's worker thread."""
    return async_op and algo == "native" and tuner.is_device_backend(g.backend)


# --- buffers ------------------------------------------------------------------------------
class _Flat:
    """A contiguous 1-D host view of ``t`` (a copy when ``t`` is strided or on a GPU
    with gloo), and ``done()`` to write results back into ``t``."""

    __slots__ = ("t", "flat", "copied")

    def __init__(self, t: torch.Tensor, group: Group, *, load: bool = True) -> None:
        self.t = t
        staged = t.device.type == "cuda" and group.backend == "gloo"
        if staged:
            self.flat = (
                t.detach().reshape(-1).cpu() if load else torch.empty(t.numel(), dtype=t.dtype)
            )
        elif t.is_contiguous():
            self.flat = t.detach().view(-1)
        else:
            self.flat = t.detach().reshape(-1).clone() if load else t.new_empty(t.numel())
        self.copied = staged or not t.is_contiguous()

    def done(self) -> None:
        if self.copied:
            with torch.no_grad():
                self.t.copy_(self.flat.view(self.t.shape))


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype)[6:]  # "torch.float32" -> "float32"


def _run(
    group: Group,
    collective: str,
    algorithm: str,
    body: Callable[[Channel], None],
    async_op: bool,
    nbytes: int,
    signature: str,
    desc: str,
) -> Handle | None:
    return group.run(
        collective,
        algorithm,
        body,
        async_op=async_op,
        payload_bytes=nbytes,
        signature=signature,
        desc=desc,
    )


# --- collectives --------------------------------------------------------------------------
def all_reduce(
    tensor: torch.Tensor,
    op: Any = "sum",
    *,
    group: Group | None = None,
    algorithm: str = "auto",
    async_op: bool = False,
) -> Handle | None:
    """Reduce ``tensor`` over the group, in place, on every rank.

    Every rank ends with bitwise the same result. ``"avg"`` of float16 divides each
    rank's contribution by the group size before the sum (a sum of finite float16 values
    overflows long before their mean does); other dtypes divide the sum.
    """
    g = _group(group)
    rop = parse_op(op)
    _check_tensor("all_reduce", "tensor", tensor, g)
    _check_op("all_reduce", rop, tensor)
    if g.size == 1:
        return COMPLETED if async_op else None
    nbytes = tensor.numel() * tensor.element_size()
    algo = _choose("all_reduce", algorithm, nbytes, g)
    sig = f"{rop.value} {_dtype(tensor)} bytes={nbytes}"
    desc = f"shape={tuple(tensor.shape)}"

    def start() -> Started:
        buf = _Flat(tensor, g)
        before = prescaled(rop, tensor.dtype)
        if before:
            buf.flat.div_(g.size)

        def finish() -> None:
            if rop is ReduceOp.AVG and not before:
                buf.flat.div_(g.size)
            buf.done()

        if tensor.numel() == 0:
            return Started(None, None, tensor)
        started = native.start_all_reduce(buf.flat, _lowered(rop), g)
        started.finish, started.result = finish, tensor
        return started

    if _direct(g, algo, async_op):
        return g.start_native("all_reduce", nbytes, start, signature=sig, desc=desc)
    fast = not g.debug and not g.check and g.idle() and tensor.is_contiguous()
    if algo == "native" and async_op and fast:
        return g.start_native("all_reduce", nbytes, lambda: native.all_reduce_async(tensor, rop, g))
    impl = ALGORITHMS[algo].all_reduce

    def body(ch: Channel) -> None:
        if tensor.numel() == 0:
            return
        buf = _Flat(tensor, g)
        before = prescaled(rop, tensor.dtype)
        if before:
            buf.flat.div_(g.size)
        impl(ch, buf.flat, _lowered(rop))
        if rop is ReduceOp.AVG and not before:
            buf.flat.div_(g.size)
        buf.done()

    return _run(g, "all_reduce", algo, body, async_op, nbytes, sig, desc)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    *,
    group: Group | None = None,
    algorithm: str = "auto",
    async_op: bool = False,
) -> Handle | None:
    """Copy ``tensor`` from group rank ``src`` into ``tensor`` on every rank."""
    g = _group(group)
    _check_tensor("broadcast", "tensor", tensor, g)
    _check_root("broadcast", "src", src, g)
    if g.size == 1:
        return COMPLETED if async_op else None
    nbytes = tensor.numel() * tensor.element_size()
    algo = _choose("broadcast", algorithm, nbytes, g)
    impl = ALGORITHMS[algo].broadcast
    sig = f"src={src} {_dtype(tensor)} bytes={nbytes}"
    desc = f"shape={tuple(tensor.shape)}"
    if _direct(g, algo, async_op):

        def start() -> Started:
            if tensor.numel() == 0:
                return Started(None)
            buf = _Flat(tensor, g, load=g.rank == src)
            started = native.start_broadcast(buf.flat, src, g)
            started.finish = buf.done
            return started

        return g.start_native("broadcast", nbytes, start, signature=sig, desc=desc)

    def body(ch: Channel) -> None:
        if tensor.numel() == 0:
            return
        buf = _Flat(tensor, g, load=ch.rank == src)
        impl(ch, buf.flat, src)
        buf.done()

    return _run(g, "broadcast", algo, body, async_op, nbytes, sig, desc)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = "sum",
    *,
    group: Group | None = None,
    algorithm: str = "auto",
    async_op: bool = False,
) -> Handle | None:
    """Reduce ``tensor`` over the group into ``tensor`` on group rank ``dst``.

    ``tensor`` is left unchanged on the other ranks.
    """
    g = _group(group)
    rop = parse_op(op)
    _check_tensor("reduce", "tensor", tensor, g)
    _check_root("reduce", "dst", dst, g)
    _check_op("reduce", rop, tensor)
    if g.size == 1:
        return COMPLETED if async_op else None
    nbytes = tensor.numel() * tensor.element_size()
    algo = _choose("reduce", algorithm, nbytes, g)
    impl = ALGORITHMS[algo].reduce

    def body(ch: Channel) -> None:
        if tensor.numel() == 0:
            return
        buf = _Flat(tensor, g)
        before = prescaled(rop, tensor.dtype)
        # a prescaled contribution is a new tensor: the other ranks' tensor stays unchanged
        work = buf.flat / g.size if before else buf.flat
        impl(ch, work, dst, _lowered(rop))
        if ch.rank == dst:
            if before:
                buf.flat.copy_(work)
            elif rop is ReduceOp.AVG:
                buf.flat.div_(g.size)
            buf.done()

    sig = f"{rop.value} dst={dst} {_dtype(tensor)} bytes={nbytes}"
    return _run(g, "reduce", algo, body, async_op, nbytes, sig, f"shape={tuple(tensor.shape)}")


def _tensor_list(collective: str, name: str, value: Any, g: Group) -> list[torch.Tensor]:
    """Check a list-of-tensors argument: one tensor per rank of the group."""
    if not isinstance(value, (list, tuple)) or len(value) != g.size:
        raise ValueError(
            f"{collective}: {name} must be a tensor or a list of {g.size} tensors (one per "
            f"rank of group {g.name!r}), got {type(value).__name__}"
            + (f" of length {len(value)}" if isinstance(value, (list, tuple)) else "")
        )
    for i, t in enumerate(value):
        _check_tensor(collective, f"{name}[{i}]", t, g)
    return list(value)


def _chunk_list(
    collective: str, name: str, value: Any, g: Group, mine: torch.Tensor, mine_name: str
) -> list[torch.Tensor] | None:
    """A per-rank list whose own entry must match ``mine``; None if ``value`` is a tensor."""
    if isinstance(value, torch.Tensor):
        return None
    blocks = _tensor_list(collective, name, value, g)
    _check_same(
        collective, [(mine_name, mine)] + [(f"{name}[{i}]", t) for i, t in enumerate(blocks)]
    )
    if blocks[g.rank].numel() != mine.numel():
        raise ValueError(
            f"{collective}: {name}[{g.rank}] has {blocks[g.rank].numel()} elements but "
            f"{mine_name} has {mine.numel()}; they must match on every rank"
        )
    return blocks


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor | Sequence[torch.Tensor],
    op: Any = "sum",
    *,
    group: Group | None = None,
    algorithm: str = "auto",
    async_op: bool = False,
) -> Handle | None:
    """Reduce ``input`` over the group; group rank i receives block i in ``output``.

    ``input`` is either one tensor of ``group.size * output.numel()`` elements (block i is
    the i-th slice of its flattened form) or a list of one tensor per rank, where
    ``input[i]`` may differ in size across i but ``input[rank]`` matches ``output``.
    ``input`` is not modified.
    """
    g = _group(group)
    rop = parse_op(op)
    _check_tensor("reduce_scatter", "output", output, g)
    _check_op("reduce_scatter", rop, output)
    blocks = _chunk_list("reduce_scatter", "input", input, g, output, "output")
    if blocks is None:
        assert isinstance(input, torch.Tensor)
        _check_tensor("reduce_scatter", "input", input, g)
        _check_same("reduce_scatter", [("output", output), ("input", input)])
        if input.numel() != g.size * output.numel():
            raise ValueError(
                f"reduce_scatter: input has {input.numel()} elements but group {g.name!r} "
                f"of {g.size} ranks needs {g.size} x output.numel() = "
                f"{g.size * output.numel()}; pass an output of input.numel() / {g.size} "
                f"elements, or a list of per-rank inputs"
            )
    nbytes = output.element_size() * (
        input.numel() if blocks is None else sum(t.numel() for t in blocks)  # type: ignore[union-attr]
    )
    if g.size == 1:
        with torch.no_grad():
            output.copy_((input if blocks is None else blocks[0]).reshape(output.shape))  # type: ignore[union-attr]
        return COMPLETED if async_op else None
    algo = _choose("reduce_scatter", algorithm, nbytes, g)
    impl = ALGORITHMS[algo].reduce_scatter
    sizes = [output.numel()] * g.size if blocks is None else [b.numel() for b in blocks]
    sig = f"{rop.value} {_dtype(output)} blocks={sizes}"
    desc = f"shape={tuple(output.shape)}"

    def prepare() -> tuple[list[torch.Tensor], _Flat, Callable[[], None]]:
        """The per-rank input blocks, the output buffer, and what to do once reduced."""
        out = _Flat(output, g, load=False)
        if blocks is None:
            whole = _Flat(input, g).flat  # type: ignore[arg-type]
            inputs = split(whole, [output.numel()] * g.size)
        else:
            inputs = [_Flat(b, g).flat for b in blocks]
        before = prescaled(rop, output.dtype)
        if before and any(t.numel() for t in inputs):  # new tensors: ``input`` unchanged
            inputs = [t / g.size for t in inputs]

        def finish() -> None:
            if rop is ReduceOp.AVG and not before:
                out.flat.div_(g.size)
            out.done()

        return inputs, out, finish

    if _direct(g, algo, async_op):

        def start() -> Started:
            inputs, out, finish = prepare()
            if sum(t.numel() for t in inputs) == 0:
                return Started(None)
            return native.start_reduce_scatter(inputs, out.flat, _lowered(rop), g).then_finish(
                finish
            )

        return g.start_native("reduce_scatter", nbytes, start, signature=sig, desc=desc)

    def body(ch: Channel) -> None:
        inputs, out, finish = prepare()
        if sum(t.numel() for t in inputs) == 0:
            return
        impl(ch, inputs, out.flat, _lowered(rop))
        finish()

    return _run(g, "reduce_scatter", algo, body, async_op, nbytes, sig, desc)


def all_gather(
    output: torch.Tensor | Sequence[torch.Tensor],
    input: torch.Tensor,
    *,
    group: Group | None = None,
    algorithm: str = "auto",
    async_op: bool = False,
) -> Handle | None:
    """Gather every rank's ``input`` into ``output`` on every rank.

    ``output`` is either one tensor of ``group.size * input.numel()`` elements (rank i's
    input lands in the i-th slice of its flattened form) or a list of one tensor per rank
    (sizes may differ across ranks; ``output[rank]`` matches ``input``).
    """
    g = _group(group)
    _check_tensor("all_gather", "input", input, g)
    blocks = _chunk_list("all_gather", "output", output, g, input, "input")
    if blocks is None:
        assert isinstance(output, torch.Tensor)
        _check_tensor("all_gather", "output", output, g)
        _check_same("all_gather", [("input", input), ("output", output)])
        if output.numel() != g.size * input.numel():
            raise ValueError(
                f"all_gather: output has {output.numel()} elements but group {g.name!r} of "
                f"{g.size} ranks needs {g.size} x input.numel() = {g.size * input.numel()}; "
                f"pass an output of that size, or a list of per-rank outputs"
            )
        sizes = [input.numel()] * g.size
    else:
        sizes = [b.numel() for b in blocks]
    nbytes = input.element_size() * sum(sizes)
    if g.size == 1:
        with torch.no_grad():
            target = output if blocks is None else blocks[0]
            target.copy_(input.reshape(target.shape))  # type: ignore[union-attr]
        return COMPLETED if async_op else None
    algo = _choose("all_gather", algorithm, nbytes, g)
    impl = ALGORITHMS[algo].all_gather
    sig = f"{_dtype(input)} blocks={sizes}"
    desc = f"shape={tuple(input.shape)}"

    def prepare() -> tuple[list[torch.Tensor], Callable[[], None]]:
        """The per-rank chunks (this rank's filled) and what to do once gathered."""
        if blocks is None:
            out = _Flat(output, g, load=False)  # type: ignore[arg-type]
            flat = out.flat
        else:
            staged = input.device.type == "cuda" and g.backend == "gloo"
            where = torch.device("cpu") if staged else input.device
            flat = torch.empty(sum(sizes), dtype=input.dtype, device=where)
        chunks = split(flat, sizes)
        chunks[g.rank].copy_(input.detach().reshape(-1))

        def finish() -> None:
            if blocks is None:
                out.done()
            else:
                with torch.no_grad():
                    for b, c in zip(blocks, chunks, strict=True):
                        b.copy_(c.view(b.shape))

        return chunks, finish

    if _direct(g, algo, async_op):

        def start() -> Started:
            chunks, finish = prepare()
            if sum(sizes) == 0:
                return Started(None, finish)
            return native.start_all_gather(chunks, g).then_finish(finish)

        return g.start_native("all_gather", nbytes, start, signature=sig, desc=desc)

    def body(ch: Channel) -> None:
        chunks, finish = prepare()
        if sum(sizes):
            impl(ch, chunks)
        finish()

    return _run(g, "all_gather", algo, body, async_op, nbytes, sig, desc)


def all_to_all(
    output: torch.Tensor | Sequence[torch.Tensor],
    input: torch.Tensor | Sequence[torch.Tensor],
    *,
    group: Group | None = None,
    algorithm: str = "auto",
    async_op: bool = False,
) -> Handle | None:
    """Rank r sends block i of ``input`` to rank i and receives rank i's block r into
    block i of ``output``.

    Either both are tensors whose element count divides by the group size (equal blocks),
    or both are lists of one tensor per rank (``output[i]`` must match the size rank i
    sends this rank).
    """
    g = _group(group)
    out_list = isinstance(output, (list, tuple))
    in_list = isinstance(input, (list, tuple))
    if out_list != in_list:
        raise TypeError("all_to_all: pass output and input both as tensors or both as lists")
    if in_list:
        ins = _tensor_list("all_to_all", "input", input, g)
        outs = _tensor_list("all_to_all", "output", output, g)
        _check_same(
            "all_to_all",
            [(f"input[{i}]", t) for i, t in enumerate(ins)]
            + [(f"output[{i}]", t) for i, t in enumerate(outs)],
        )
        if outs[g.rank].numel() != ins[g.rank].numel():
            raise ValueError(
                f"all_to_all: output[{g.rank}] has {outs[g.rank].numel()} elements but "
                f"input[{g.rank}] has {ins[g.rank].numel()}; they must match"
            )
        in_sizes, out_sizes = [t.numel() for t in ins], [t.numel() for t in outs]
    else:
        assert isinstance(input, torch.Tensor) and isinstance(output, torch.Tensor)
        _check_tensor("all_to_all", "input", input, g)
        _check_tensor("all_to_all", "output", output, g)
        _check_same("all_to_all", [("input", input), ("output", output)])
        if input.numel() != output.numel() or input.numel() % g.size:
            raise ValueError(
                f"all_to_all: input ({input.numel()} elements) and output "
                f"({output.numel()}) must have the same size, divisible by the group size "
                f"{g.size}; use lists of per-rank tensors for uneven blocks"
            )
        in_sizes = out_sizes = [input.numel() // g.size] * g.size
    elem = (ins[0] if in_list else input).element_size()  # type: ignore[union-attr]
    nbytes = elem * sum(in_sizes)
    if g.size == 1:
        with torch.no_grad():
            if in_list:
                output[0].copy_(input[0])  # type: ignore[index,union-attr,arg-type]
            else:
                output.copy_(input)  # type: ignore[union-attr,arg-type]
        return COMPLETED if async_op else None
    algo = _choose("all_to_all", algorithm, nbytes, g)
    impl = ALGORITHMS[algo].all_to_all

    def body(ch: Channel) -> None:
        if in_list:
            inputs = [_Flat(t, g).flat for t in ins]
            flats = [_Flat(t, g, load=False) for t in outs]
            impl(ch, [f.flat for f in flats], inputs)
            for f in flats:
                f.done()
        else:
            src = _Flat(input, g).flat  # type: ignore[arg-type]
            dst = _Flat(output, g, load=False)  # type: ignore[arg-type]
            impl(ch, split(dst.flat, out_sizes), split(src, in_sizes))
            dst.done()

    # per-rank block sizes may differ legitimately, so only the even form's size is agreed
    dt = _dtype(ins[0] if in_list else input)  # type: ignore[arg-type]
    sig = f"{dt} lists" if in_list else f"{dt} bytes={nbytes}"
    desc = f"send={in_sizes} recv={out_sizes}"
    return _run(g, "all_to_all", algo, body, async_op, nbytes, sig, desc)


def barrier(*, group: Group | None = None, algorithm: str = "auto") -> None:
    """Block until every rank of the group has reached the barrier (at most the timeout).

    ``"native"`` uses the backend's barrier; any other choice the dissemination barrier
    (``barrier.py``), whose timeout names the ranks that did not arrive. ``"auto"`` is the
    dissemination barrier when the group's check is on (its messages carry the checked
    tag; the backend's barrier would need a token round first), else the backend's.
    """
    g = _group(group)
    if g.size == 1:
        return
    if algorithm not in ("auto", *ALGORITHMS):
        raise ValueError(f"barrier: unknown algorithm {algorithm!r}; use 'auto' or 'native'")
    if algorithm == "auto":
        algo = "dissemination" if g.check else "native"
    else:
        algo = algorithm
    impl = native.barrier if algo == "native" else dissemination.barrier
    g.run("barrier", algo, impl, async_op=False, payload_bytes=0, signature="")


# --- point to point -----------------------------------------------------------------------
def _p2p_tag(tag: int) -> int:
    if not 0 <= tag < COLLECTIVE_TAG_BIT:
        raise ValueError(f"tag must be in [0, 2**30), got {tag}")
    return tag


def send(tensor: torch.Tensor, dst: int, *, group: Group | None = None, tag: int = 0) -> None:
    """Send ``tensor`` to group rank ``dst``; blocks until it is received (or the timeout)."""
    g = _group(group)
    _check_tensor("send", "tensor", tensor, g)
    _check_root("send", "dst", dst, g)
    if dst == g.rank:
        raise ValueError(f"send: dst={dst} is this rank; send to another rank")
    _p2p(g, "send", tensor, dst, tag)


def recv(tensor: torch.Tensor, src: int, *, group: Group | None = None, tag: int = 0) -> None:
    """Receive into ``tensor`` from group rank ``src``; blocks at most the group's timeout."""
    g = _group(group)
    _check_tensor("recv", "tensor", tensor, g)
    _check_root("recv", "src", src, g)
    if src == g.rank:
        raise ValueError(f"recv: src={src} is this rank; receive from another rank")
    _p2p(g, "recv", tensor, src, tag)


def _p2p(g: Group, verb: str, tensor: torch.Tensor, peer: int, tag: int) -> None:

    call = Call(g, verb, "p2p", seq=g.seq)
    call.tag = _p2p_tag(tag)
    ch = Channel(call)
    buf = _Flat(tensor, g, load=verb == "send")
    if verb == "send":
        ch.send(buf.flat, peer)
    else:
        ch.recv(buf.flat, peer)
        buf.done()
    call.commit()
