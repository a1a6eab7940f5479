"""One unit's flat parameter: this rank's shard, and the full buffer while gathered.

Communication (on the unit's group): :meth:`ShardedUnit.unshard` all-gathers the shards
(``padded`` elements in ``param_dtype``; blocks unless ``async_op``); when the unit's full
gradient is complete, it is reduce-scattered (average, ``reduce_dtype``) asynchronously;
:class:`~plait.strategies.fsdp.schedule._RootState` waits for it at the end of backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from plait import comm
from plait.comm import ops
from plait.comm.device import moved
from plait.comm.group import Group, Handle
from plait.strategies.fsdp import streams
from plait.strategies.fsdp.grads import guard_grad
from plait.strategies.fsdp.placeholder import _Placeholder
from plait.strategies.placement import place
from plait.strategies.reproducible.collectives import tree_reduce_scatter
from plait.strategies.reproducible.tree import Microbatches
from plait.trace import Tracer

if TYPE_CHECKING:
    from plait.strategies.fsdp.schedule import _RootState

SHARD_NAME = "_flat_shard"  # the shard parameter's name on each unit's module
UNIT_ATTR = "_plait_fsdp_unit"  # the module's first unit object, on its module
UNITS_ATTR = "_plait_fsdp_units"  # all units of a module (one per parameter group)
NAMES_ATTR = "_plait_fsdp_names"  # a module's original parameters: (name, unit, index)


@dataclass
class _Config:
    """What one ``fully_shard`` call was asked for, shared by the units it creates."""

    group: Group | None  # None: one process without plait.init (no communication)
    algorithm: str
    reshard_after_forward: bool
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    compute_device: torch.device
    shards_on_cpu: bool
    tracer: Tracer | None = None
    # reproducible=True: the step's micro-batch position and the tree sums on the shards
    # (the ReproducibleRunner driving the step replaces it with its own)
    microbatches: Microbatches | None = None
    # FSDP2's all-gather and reduce-scatter streams on CUDA (streams.py); None elsewhere
    side_streams: streams.SideStreams | None = None

    def side(self, stream: Any, collective: str, nbytes: int) -> Any:
        """``stream`` (a side stream) if the collective is the backend's own, started on
        the caller's thread (it then runs after the side stream's work); else None: a
        plait algorithm runs on the group's worker thread, whose stream would not wait
        for the side stream."""
        if self.side_streams is None or self.group is None:
            return None
        algorithm = ops.resolve(collective, self.algorithm, nbytes, self.group)
        return stream if algorithm == "native" else None

    @property
    def rank(self) -> int:
        return self.group.rank if self.group is not None else 0

    @property
    def size(self) -> int:
        return self.group.size if self.group is not None else 1


class ShardedUnit:
    """The flat parameter of one unit: this rank's shard, and the full buffer when gathered.

    ``full_data`` is the gathered buffer collectives write into; ``full`` is an autograd
    leaf on the same storage (a separate tensor, so refilling the storage for backward does
    not bump the version counter that autograd's saved views check). Both live as long as
    the unit; only their storage is freed and re-allocated.
    """

    def __init__(
        self,
        module: nn.Module,
        owned: list[tuple[nn.Module, str, nn.Parameter]],
        config: _Config,
        *,
        shard_name: str = SHARD_NAME,
        group_index: int | None = None,
    ) -> None:
        self.module = module
        self.shard_name = shard_name  # the shard's parameter name on ``module``
        self.group_index = group_index  # the optimizer parameter group (prepare's), if any
        self.forward_prefetch: list[ShardedUnit] | None = None  # explicit (setters)
        self.backward_prefetch: list[ShardedUnit] | None = None
        self.label = type(module).__name__  # before fully_shard renames the class
        self.path = ""  # the module's name under the root of its tree (set by name())
        self.views_installed = False  # parameters are views of the full buffer (else meta)
        self.config = config
        self.state: _RootState | None = None
        self.params: list[nn.Parameter] = []
        self.slots: list[list[tuple[nn.Module, str]]] = []
        index: dict[int, int] = {}
        for m, name, p in owned:  # a parameter tied within the unit gets several slots
            if id(p) not in index:
                index[id(p)] = len(self.params)
                self.params.append(p)
                self.slots.append([])
            self.slots[index[id(p)]].append((m, name))
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.numel = sum(self.numels)
        n = config.size
        self.padded = -(-self.numel // n) * n
        self.shard_numel = self.padded // n
        dtype = self.params[0].dtype if self.params else torch.float32
        self.requires_grad = bool(self.params) and self.params[0].requires_grad
        self.param_dtype = config.param_dtype or dtype
        self.reduce_dtype = config.reduce_dtype or dtype  # None: the masters' (plait.precision)
        self.shard = self._make_shard(dtype)
        # Between gathers each original parameter is a meta tensor of its shape and dtype:
        # no memory; shape queries and repr work, computing with it fails loudly.
        self.placeholders = [
            torch.empty(p.shape, dtype=p.dtype, device="meta").as_subclass(_Placeholder)
            for p in self.params
        ]
        for m, name, _ in owned:
            del m._parameters[name]
        self.remove_views()
        if self.numel:
            module.register_parameter(shard_name, self.shard)
            # each rank holds a distinct slice: a global norm adds them (padding is zero)
            place(self.shard, shard=(config.group,))
        self.full_bytes_per_element = torch.empty(0, dtype=self.param_dtype).element_size()
        self.full_data: torch.Tensor | None = None
        self.full: torch.Tensor | None = None
        # an async gather (its handle, ordered after its side stream on CUDA) and its input
        self._gathering: tuple[Handle | streams.Ordered, torch.Tensor] | None = None

    def name(self, paths: dict[int, str]) -> None:
        """Record where the unit and its parameters live (``paths``: module id to name
        under the root), for error messages."""
        path = paths.get(id(self.module))
        self.path = path or f"(root {self.label})" if path is not None else self.path
        for placeholder, slots in zip(self.placeholders, self.slots, strict=True):
            names = [".".join(filter(None, (paths.get(id(m), "?"), n))) for m, n in slots]
            placeholder.parameter_name = " = ".join(names)
            placeholder.unit_path = self.path

    def _make_shard(self, dtype: torch.dtype) -> nn.Parameter:
        """Flatten, broadcast from group rank 0, keep this rank's slice (a copy)."""
        cfg = self.config
        flat = torch.zeros(self.padded, dtype=dtype, device=cfg.compute_device)
        if self.numel:
            with torch.no_grad():
                torch.cat([p.detach().reshape(-1) for p in self.params], out=flat[: self.numel])
            if cfg.group is not None and cfg.size > 1 and not flat.is_meta:
                comm.broadcast(flat, 0, group=cfg.group, algorithm="auto")
        start = cfg.rank * self.shard_numel
        shard = flat[start : start + self.shard_numel].clone()
        if cfg.shards_on_cpu:
            # a meta model's shard: a host tensor of its size, no values (see moved)
            shard = moved(shard, "cpu")
            if torch.cuda.is_available():
                shard = shard.pin_memory()
        return nn.Parameter(shard, requires_grad=self.requires_grad)

    # --- gather and free ------------------------------------------------------------------
    @property
    def gathered(self) -> bool:
        """The full buffer holds this step's parameters (or is being gathered into)."""
        data = self.full_data
        return data is not None and data.untyped_storage().nbytes() > 0

    def unshard(self, *, async_op: bool = False) -> None:
        """All-gather the full flat parameters (blocks on the group unless ``async_op``)."""
        if self.numel == 0:
            return
        if self._gathering is not None:
            if not async_op:
                self.wait()
            return
        if self.gathered:
            return
        cfg = self.config
        if self.full_data is None:
            self.full_data = torch.empty(
                self.padded, dtype=self.param_dtype, device=cfg.compute_device
            )
            self.full = self.full_data.data  # same storage, its own version counter
            if self.requires_grad:
                self.full.requires_grad_(True)
                self.full.register_post_accumulate_grad_hook(self._grad_ready)
        else:
            data = self.full_data
            data.untyped_storage().resize_(self.padded * data.element_size())
        side = None
        if async_op and cfg.side_streams is not None:  # a prefetch: FSDP2's all-gather stream
            nbytes = self.padded * self.full_bytes_per_element
            side = cfg.side(cfg.side_streams.all_gather, "all_gather", nbytes)
        with streams.issued_on(side) as issued:
            source = self.shard.detach().to(cfg.compute_device, self.param_dtype, non_blocking=True)
            if cfg.group is None:
                self.full_data.copy_(source)
                return
            token = self._trace_begin("all_gather")
            handle = comm.all_gather(
                self.full_data, source, group=cfg.group, algorithm=cfg.algorithm, async_op=async_op
            )
        if async_op:
            assert handle is not None
            self._trace_end_when_done(token, handle)
            self._gathering = (streams.ordered(handle, issued), source)
        else:
            self._trace_end_when_done(token, None)

    def _trace_begin(self, what: str) -> int | None:
        tracer = self.config.tracer
        if tracer is None:
            return None
        label = f"{what} {self.label}"
        return tracer.begin(label, stream="comm", bytes=self.padded * self.full_bytes_per_element)

    def _trace_end_when_done(self, token: int | None, handle: Handle | None) -> None:
        """Close the span now (blocking collective) or when the collective completes."""
        tracer = self.config.tracer
        if tracer is None or token is None:
            return
        if handle is None:
            tracer.end(token)
        else:
            handle.get_future().add_done_callback(lambda _: tracer.end(token))

    def wait(self) -> None:
        """Wait for an asynchronous all-gather of this unit, if one is in flight."""
        if self._gathering is not None:
            self._gathering[0].wait()
            self._gathering = None

    def install_views(self) -> None:
        """Set each original parameter to a view of the gathered buffer."""
        assert self.full is not None
        pieces = self.full.split([*self.numels, self.padded - self.numel])
        for piece, shape, slots in zip(pieces, self.shapes, self.slots, strict=False):
            view = piece.view(shape)
            for m, name in slots:
                setattr(m, name, view)
        self.views_installed = True

    def remove_views(self) -> None:
        for placeholder, slots in zip(self.placeholders, self.slots, strict=True):
            for m, name in slots:
                setattr(m, name, placeholder)
        self.views_installed = False

    def reshard(self) -> None:
        """Free the full parameters (the storage object stays, at size 0)."""
        self.wait()
        self.remove_views()
        if self.full_data is not None:
            self.full_data.untyped_storage().resize_(0)

    # --- gradients ------------------------------------------------------------------------
    def _grad_ready(self, full: torch.Tensor) -> None:
        """The full flat gradient is complete: reduce-scatter it, free params and gradient."""
        grad, full.grad = full.grad, None
        assert grad is not None and self.state is not None
        cfg = self.config
        tree = cfg.microbatches
        side = None
        if tree is None and cfg.side_streams is not None:  # FSDP2's reduce-scatter stream
            nbytes = grad.numel() * self.reduce_dtype.itemsize
            side = cfg.side(cfg.side_streams.reduce_scatter, "reduce_scatter", nbytes)
        if side is not None:
            # made on the compute stream, read on the side stream: not reused before that
            grad.record_stream(side)
        with streams.issued_on(side) as issued:
            self._reduce(grad, issued)
        self.reshard()

    def _reduce(self, grad: torch.Tensor, issued: streams.Issued) -> None:
        """Reduce-scatter (average) the full gradient ``grad`` asynchronously; queue the
        handle, the output and the gradient (kept alive until the wait) on the root."""
        assert self.state is not None
        cfg = self.config
        grad = grad.to(self.reduce_dtype)
        tree = cfg.microbatches
        if tree is not None:
            tree.check_driven("fully_shard")
        out = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=grad.device)
        if cfg.group is None:
            out.copy_(grad)
            handle: Handle | None = None
        elif tree is not None:
            # reproducible: the W ranks hold micro-batches jW .. jW+W-1 (interleaved), one
            # subtree, summed in rank order here; accumulate_grad continues the tree over j
            token = self._trace_begin("reduce_scatter")
            blocks = list(grad.split(self.shard_numel))
            handle = tree_reduce_scatter(
                out, blocks, group=cfg.group, algorithm=cfg.algorithm, async_op=True
            )
            self._trace_end_when_done(token, handle)
        else:
            token = self._trace_begin("reduce_scatter")
            handle = comm.reduce_scatter(
                out, grad, "avg", group=cfg.group, algorithm=cfg.algorithm, async_op=True
            )
            assert handle is not None
            self._trace_end_when_done(token, handle)
        self.state.reductions.append((self, streams.ordered(handle, issued), out, grad))

    def accumulate_grad(self, reduced: torch.Tensor) -> None:
        tree = self.config.microbatches
        if tree is not None:  # reproducible: this micro-batch step's subtree, on the shard
            summed = tree.add(id(self), reduced)
            if summed is None:
                return
            reduced = summed
        grad = moved(reduced, self.shard.device, self.shard.dtype)  # offloaded: to the host
        if self.shard.grad is None:
            self.shard.grad = guard_grad(grad, self)
        else:
            self.shard.grad += grad

    # --- whole-parameter access (no communication) ----------------------------------------
    def shard_range(self) -> tuple[int, int]:
        """This rank's elements of the padded flat buffer: [start, end)."""
        start = self.config.rank * self.shard_numel
        return start, start + self.shard_numel

    def pieces(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a full flat buffer (``padded`` elements), one per parameter, shaped."""
        parts = flat.split([*self.numels, self.padded - self.numel])
        return [part.view(shape) for part, shape in zip(parts, self.shapes, strict=False)]

    def local_slice(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's shard of the flat buffer the full ``tensors`` (one per parameter,
        in unit order) would make: only the overlapping pieces are copied."""
        start, end = self.shard_range()
        out = torch.zeros(
            self.shard_numel,
            dtype=tensors[0].dtype if tensors else torch.float32,
            device=tensors[0].device if tensors else None,
        )
        offset = 0
        for t, n in zip(tensors, self.numels, strict=True):
            lo, hi = max(start, offset), min(end, offset + n)
            if lo < hi:
                out[lo - start : hi - start] = t.reshape(-1)[lo - offset : hi - offset]
            offset += n
        return out

    def write_back(self) -> None:
        """Copy this rank's slice of the gathered (possibly modified) buffer into the shard."""
        if not self.numel or not self.gathered:
            return
        assert self.full_data is not None
        start, end = self.shard_range()
        with torch.no_grad():
            self.shard.copy_(self.full_data[start:end])

    # --- hooks ----------------------------------------------------------------------------
    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        state = self.state
        assert state is not None
        if self is state.first_root:
            state.begin_forward()
        following = state.step(state.forward_order, self, state.forward_recorded, "forward")
        self.unshard()
        if self.numel:
            self.install_views()
        _prefetch(following, self.forward_prefetch)
        dtype = self.config.param_dtype
        if dtype is None:
            return None

        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
                return x.to(dtype)
            return x

        return tree_map(cast, args), tree_map(cast, kwargs)

    def post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        state = self.state
        assert state is not None
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            tensors = [
                t
                for t in tree_flatten(output)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if tensors:
                register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        if not grad_enabled or (self.config.reshard_after_forward and not state.keeps(self)):
            self.reshard()
        if self is state.last_root:
            state.end_forward()

    def _pre_backward(self, grad: torch.Tensor) -> None:
        state = self.state
        assert state is not None
        state.begin_backward()
        following = state.step(state.backward_order, self, state.backward_recorded, "backward")
        self.unshard()
        if self.numel and not self.views_installed:
            # activation checkpointing re-runs the unit's forward inside its backward, reading
            # the parameters by attribute: they must be the gathered views again, made with
            # grad enabled (backward runs without it) so the re-run saves what the first did
            with torch.enable_grad():
                self.install_views()
        _prefetch(following, self.backward_prefetch)


def _prefetch(following: ShardedUnit | None, explicit: list[ShardedUnit] | None) -> None:
    """Issue the asynchronous all-gathers: the units set explicitly (the
    ``set_modules_to_*_prefetch`` setters) if any, else the next unit in recorded order."""
    if explicit is not None:
        for unit in explicit:
            unit.unshard(async_op=True)
    elif following is not None:
        following.unshard(async_op=True)
