"""Fully sharded data parallelism (ZeRO stage 3, FSDP): ``fully_shard(module, ...)``.

Every rank keeps only 1/n of every parameter, gradient and optimizer state. The model is
cut into *units*: the root module plus the submodules chosen by ``wrap`` (or sharded
before it, bottom-up). A unit owns the parameters of its subtree that no child unit owns;
they are flattened, in registration order, into one buffer of P_u elements padded to a
multiple of n, and group rank r keeps elements [r P_u/n, (r+1) P_u/n) as one fp32
``nn.Parameter`` (``module._flat_shard``), the only parameter ``module.parameters()``
returns for that unit. An optimizer built afterwards therefore updates shards only, which
is exact for element-wise optimizers (SGD, momentum, Adam, AdamW).

Communication contract, on ``group`` (n ranks), with ``algorithm``:

- wrap: each new unit's flat buffer is broadcast from group rank 0 before it is cut
  (replicas start equal), and so are the module's buffers;
- forward: before each unit runs, an all-gather of its shards (n x P_u/n elements in
  ``param_dtype``) rebuilds the full flat buffer; the module's parameters are set to views
  of it, so ``forward`` runs unchanged. Afterwards the buffer is freed (its storage is
  resized to 0) when ``reshard_after_forward`` is True, except for the root unit and,
  once the order is known (from the second forward on), the units backward needs first:
  the last unit to start forward and, with ``prefetch``, the one before it (backward's
  first prefetch would gather it again at once). Keeping them saves their all-gathers
  and costs holding them through the loss (one unit more than a prefetch would hold
  during the last unit's backward);
- backward: when the first gradient of a unit's outputs arrives, a freed unit is
  all-gathered again into the same storage (autograd's saved views see it). When the
  unit's full flat gradient is complete, it is reduce-scattered (average over the group,
  in ``reduce_dtype``) into this rank's shard gradient, asynchronously, and the full
  parameters and gradient are freed. Everything is waited for before ``backward()``
  returns;
- with ``prefetch``, the all-gather of the next unit that needs one (in the order units
  ran in the first forward, and in backward in the order they started in the first
  backward; units still gathered are skipped) is issued asynchronously when unit i
  starts, so it overlaps unit i's compute. At most one prefetch is in flight.

Bytes per rank per step, with ring collectives and B bytes per parameter element: an
all-gather sends (n-1)/n P_u B for each unit in forward, again in backward for each
resharded unit (all but the root and the kept ones), and a reduce-scatter sends (n-1)/n P_u B'
(B' of ``reduce_dtype``): about 3 (n-1)/n P B in all (2 (n-1)/n P B without
``reshard_after_forward``, as DDP's all-reduce), for 1/n of the parameter, gradient and
optimizer memory. Every rank issues the same collectives in the same order (hooks fire
in an order fixed by the model), each bounded by the group's timeout.

Between gathers each original parameter attribute is a meta tensor of its shape (no
memory; ``repr`` and shape queries work, computing with it raises
:class:`UngatheredParameterError`). Gradient accumulation
works (several backwards without ``zero_grad``, or several forwards then one backward).
A unit's parameters are gathered only around its own ``forward``, so a module whose
parent reads its parameters without calling it cannot be a unit. ``fully_shard`` refuses
such a unit up front (``ValueError`` naming its path, e.g.
``layers.0.self_attn.out_proj``) where it knows the parent does this: every child of
``nn.MultiheadAttention``, which uses ``out_proj.weight`` directly, so ``wrap={nn.Linear}``
on a transformer is refused; make the enclosing block the unit
(``wrap={nn.TransformerEncoderLayer}``) instead. Other such parents are caught when they
compute with the placeholder: :class:`UngatheredParameterError` names the parameter and
its unit (a device error on "meta" inside a unit's forward is re-raised as one too, the
original as ``__cause__``).

Not supported: a second backward through one graph (``retain_graph``), re-running forward
inside backward (activation checkpointing), units whose parameters differ in dtype or
``requires_grad`` (refused with a message), and the units above.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from plait import comm, runtime
from plait.comm.group import Group, Handle
from plait.strategies.ddp import broadcast_tensors
from plait.strategies.policies import MixedPrecisionPolicy, OffloadPolicy
from plait.trace import Tracer

SHARD_NAME = "_flat_shard"  # the shard parameter's name on each unit's module
UNIT_ATTR = "_plait_fsdp_unit"  # the unit object, on its module
NAMES_ATTR = "_plait_fsdp_names"  # a module's original parameters: (name, unit, index)

Wrap = set[type[nn.Module]] | frozenset[type[nn.Module]] | tuple[type[nn.Module], ...] | int

# Modules whose forward reads their children's parameters without calling the children
# (nn.MultiheadAttention passes out_proj.weight and .bias to F.multi_head_attention_forward):
# a child of one of these can never be a unit, its parameters would never be gathered.
READS_CHILD_PARAMETERS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


class UngatheredParameterError(RuntimeError):
    """Code computed with a unit's parameter while the unit was not gathered (outside the
    unit's own forward and backward), so the parameter was a placeholder."""


class _Placeholder(torch.Tensor):
    """A parameter between gathers: a meta tensor (no memory) whose metadata queries work
    (shape, dtype, repr). An operation mixing it with real tensors raises
    UngatheredParameterError naming it: PyTorch would not always refuse it, a CPU
    ``F.linear(x, meta_weight)`` returns uninitialized memory without an error."""

    parameter_name = "?"  # set per instance by fully_shard: where the parameter lives
    unit_path = "?"

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        with torch._C.DisableTorchFunctionSubclass():
            mixed = any(isinstance(t, torch.Tensor) and not t.is_meta for t in flat)
        if mixed:
            raise UngatheredParameterError(_placeholder_message(func, flat))
        out = super().__torch_function__(func, types, args, kwargs)
        source = next(t for t in flat if isinstance(t, _Placeholder))
        for t in tree_flatten(out)[0]:  # a view or cast of a placeholder keeps its names
            if isinstance(t, _Placeholder) and t is not source:
                t.parameter_name, t.unit_path = source.parameter_name, source.unit_path
        return out


def _placeholder_message(func: Any, flat: list[Any]) -> str:
    used = [t for t in flat if isinstance(t, _Placeholder)]
    names = ", ".join(repr(t.parameter_name) for t in used)
    unit_paths = list(dict.fromkeys(t.unit_path for t in used))
    units = ", ".join(repr(u) for u in unit_paths)
    what = getattr(func, "__name__", None) or repr(func)
    return (
        f"fully_shard: {what} computed with parameter{'s' * (len(used) > 1)} {names} while "
        f"unit{'s' * (len(unit_paths) > 1)} {units} {'were' if len(unit_paths) > 1 else 'was'} "
        f"not gathered (the value is a 'meta' placeholder). A unit's parameters are gathered "
        f"only while its own forward (and its backward) runs; if its parent reads them "
        f"without calling it (as nn.MultiheadAttention reads out_proj.weight), do not make "
        f"{units} a unit: make a module enclosing it and its reader the unit instead (e.g. "
        f"wrap={{nn.TransformerEncoderLayer}} rather than wrap={{nn.Linear}})"
    )


@dataclass(frozen=True)
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
    ) -> None:
        self.module = module
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
        self._check_uniform(owned)
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.numel = sum(self.numels)
        n = config.size
        self.padded = -(-self.numel // n) * n
        self.shard_numel = self.padded // n
        dtype = self.params[0].dtype if self.params else torch.float32
        self.requires_grad = bool(self.params) and self.params[0].requires_grad
        self.param_dtype = config.param_dtype or dtype
        self.reduce_dtype = config.reduce_dtype or self.param_dtype
        self.shard = self._make_shard(dtype)
        self._record_names(owned, index)
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
            module.register_parameter(SHARD_NAME, self.shard)
        self.full_bytes_per_element = torch.empty(0, dtype=self.param_dtype).element_size()
        self.full_data: torch.Tensor | None = None
        self.full: torch.Tensor | None = None
        self._gathering: tuple[Handle, torch.Tensor] | None = None  # async gather, its input

    def name(self, paths: dict[int, str]) -> None:
        """Record where the unit and its parameters live (``paths``: module id to name
        under the root), for error messages."""
        path = paths.get(id(self.module))
        self.path = path or f"(root {self.label})" if path is not None else self.path
        for placeholder, slots in zip(self.placeholders, self.slots, strict=True):
            names = [".".join(filter(None, (paths.get(id(m), "?"), n))) for m, n in slots]
            placeholder.parameter_name = " = ".join(names)
            placeholder.unit_path = self.path

    def _check_uniform(self, owned: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
        kinds = {(p.dtype, p.requires_grad) for p in self.params}
        if len(kinds) > 1:
            listing = ", ".join(
                f"{n}: {p.dtype}, requires_grad={p.requires_grad}" for _, n, p in owned
            )
            raise ValueError(
                f"fully_shard: the parameters of unit {type(self.module).__name__} differ in "
                f"dtype or requires_grad ({listing}); make the differing submodules units of "
                f"their own with wrap= so each flat buffer is uniform"
            )

    def _make_shard(self, dtype: torch.dtype) -> nn.Parameter:
        """Flatten, broadcast from group rank 0, keep this rank's slice (a copy)."""
        cfg = self.config
        flat = torch.zeros(self.padded, dtype=dtype, device=cfg.compute_device)
        if self.numel:
            with torch.no_grad():
                torch.cat([p.detach().reshape(-1) for p in self.params], out=flat[: self.numel])
            if cfg.group is not None and cfg.size > 1:
                comm.broadcast(flat, 0, group=cfg.group, algorithm="auto")
        start = cfg.rank * self.shard_numel
        shard = flat[start : start + self.shard_numel].clone()
        if cfg.shards_on_cpu:
            shard = shard.cpu()
            if torch.cuda.is_available():
                shard = shard.pin_memory()
        return nn.Parameter(shard, requires_grad=self.requires_grad)

    def _record_names(
        self, owned: list[tuple[nn.Module, str, nn.Parameter]], index: dict[int, int]
    ) -> None:
        """Remember each module's parameter names in registration order (``owned`` lists
        them so), with where each lives: the state-dict keys of :func:`full_state_dict`."""
        for m, name, p in owned:
            m.__dict__.setdefault(NAMES_ATTR, []).append((name, self, index[id(p)]))

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
            self._gathering = (handle, source)
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
        grad = grad.to(self.reduce_dtype)
        out = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=grad.device)
        if cfg.group is None:
            out.copy_(grad)
            handle: Handle | None = None
        else:
            token = self._trace_begin("reduce_scatter")
            handle = comm.reduce_scatter(
                out, grad, "avg", group=cfg.group, algorithm=cfg.algorithm, async_op=True
            )
            assert handle is not None
            self._trace_end_when_done(token, handle)
        self.state.reductions.append((self, handle, out, grad))
        self.reshard()

    def accumulate_grad(self, reduced: torch.Tensor) -> None:
        grad = reduced.to(self.shard.device, self.shard.dtype)
        if self.shard.grad is None:
            self.shard.grad = grad
        else:
            self.shard.grad += grad

    # --- hooks ----------------------------------------------------------------------------
    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        state = self.state
        assert state is not None
        if self is state.root:
            state.begin_forward()
        following = state.step(state.forward_order, self, state.forward_recorded, "forward")
        self.unshard()
        if self.numel:
            self.install_views()
        if following is not None:
            following.unshard(async_op=True)
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
        if self is state.root:
            state.end_forward()

    def _pre_backward(self, grad: torch.Tensor) -> None:
        state = self.state
        assert state is not None
        state.begin_backward()
        following = state.step(state.backward_order, self, state.backward_recorded, "backward")
        self.unshard()
        if following is not None:
            following.unshard(async_op=True)


class _RootState:
    """What the units of one sharded tree share: execution orders and pending reductions."""

    def __init__(self, units: list[ShardedUnit], root: ShardedUnit, prefetch: bool) -> None:
        self.units = units
        self.root = root
        self.prefetch = prefetch
        self.tracer = root.config.tracer
        self._tokens: dict[str, int] = {}
        self.forward_order: list[ShardedUnit] = []
        self.backward_order: list[ShardedUnit] = []
        self.forward_recorded = False
        self.backward_recorded = False
        self.position = {"forward": 0, "backward": 0}
        self.in_backward = False
        self.kept: set[ShardedUnit] = set()  # gathered from forward to backward (keeps())
        self.reductions: list[tuple[ShardedUnit, Handle | None, torch.Tensor, torch.Tensor]] = []

    def step(
        self, order: list[ShardedUnit], unit: ShardedUnit, recorded: bool, phase: str
    ) -> ShardedUnit | None:
        """Record ``unit`` (first pass) or advance along ``order``; the unit to prefetch."""
        if not recorded:
            order.append(unit)
            return None
        i = self.position[phase]
        self.position[phase] = i + 1
        if not self.prefetch:
            return None
        for following in order[i + 1 :]:  # skip units gathered already (kept, or empty)
            if following.numel and (following._gathering is not None or not following.gathered):
                return following
        return None

    def keeps(self, unit: ShardedUnit) -> bool:
        """Whether ``unit`` stays gathered after its forward although units reshard: the
        root, and the units backward needs first (known from the second forward on)."""
        return unit is self.root or unit in self.kept

    def _choose_kept(self) -> None:
        """The last unit with parameters to start forward (its backward runs first) and,
        with prefetch, the one before it (the first unit backward would prefetch): freeing
        them after forward would only mean gathering them again at once."""
        last_first = dict.fromkeys(reversed(self.forward_order))
        tail = [u for u in last_first if u.numel and u is not self.root]
        self.kept = set(tail[: 2 if self.prefetch else 1])

    def begin_forward(self) -> None:
        """Units still gathered from a forward without backward are gathered afresh (the
        shards may have changed since); their pending backward regathers if it comes."""
        self.position["forward"] = 0
        if not self.in_backward:
            for unit in self.units:
                if unit.gathered:
                    unit.reshard()
        self._open("forward")

    def end_forward(self) -> None:
        """After the root's forward: drop prefetches that no unit used; orders are known."""
        for unit in self.units:
            if unit._gathering is not None:
                unit.reshard()
        if not self.forward_recorded and self.forward_order:
            self.forward_recorded = True
            self._choose_kept()
        self._close("forward")

    def begin_backward(self) -> None:
        if self.in_backward:
            return
        self.in_backward = True
        self.position["backward"] = 0
        self._open("backward")
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def _open(self, name: str) -> None:
        if self.tracer is not None and name not in self._tokens:
            self._tokens[name] = self.tracer.begin(name, stream="compute")

    def _close(self, name: str) -> None:
        token = self._tokens.pop(name, None)
        if token is not None and self.tracer is not None:
            self.tracer.end(token)

    def finish_backward(self) -> None:
        """End of backward: wait for every reduce-scatter, write shard grads, free all.

        The trace's backward span ends here, when autograd is done; the wait that follows
        is recorded as ``wait for gradients`` (communication backward did not hide)."""
        self._close("backward")
        self._open("wait for gradients")
        try:
            for unit, handle, out, _ in self.reductions:
                if handle is not None:
                    handle.wait()
                unit.accumulate_grad(out)
        finally:
            self.reductions.clear()
            for unit in self.units:
                unit.reshard()
            self.in_backward = False
            self.backward_recorded = self.backward_recorded or bool(self.backward_order)
            self._close("wait for gradients")


class FSDPModule(nn.Module):
    """Mixed into the class of every module ``fully_shard`` turns into a unit."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own forward; a device error on a placeholder ("meta") is re-raised
        as :class:`UngatheredParameterError` naming the units not gathered at the time."""
        try:
            return super().forward(*args, **kwargs)
        except UngatheredParameterError:
            raise
        except RuntimeError as error:
            if "meta" not in str(error):
                raise
            placeholders = [u for u in self.sharded_units() if u.numel and not u.views_installed]
            if not placeholders:
                raise
            raise UngatheredParameterError(_ungathered_message(self, placeholders)) from error

    def sharded_units(self) -> list[ShardedUnit]:
        """The units in this module's subtree (its own included)."""
        seen: dict[int, ShardedUnit] = {}
        for m in self.modules():
            unit = m.__dict__.get(UNIT_ATTR)
            if unit is not None:
                seen[id(unit)] = unit
        return list(seen.values())

    def memory_breakdown(self) -> dict[str, list[torch.Tensor]]:
        """This rank's tensors for ``plait.plan.memory.measure``: ``"params"`` (shards and
        any full buffers gathered now) and ``"grads"`` (shard gradients). Optimizer state
        is not listed: the optimizer holds it and ``measure`` reads it there."""
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for unit in self.sharded_units():
            if unit.numel == 0:
                continue
            params.append(unit.shard.detach())
            if unit.gathered:
                assert unit.full_data is not None
                params.append(unit.full_data)
            if unit.shard.grad is not None:
                grads.append(unit.shard.grad)
        return {"params": params, "grads": grads}

    def plait_full_state_dict(self) -> dict[str, torch.Tensor]:
        """Used by ``plait.checkpoint.full_state_dict``; see :func:`full_state_dict`."""
        return full_state_dict(self)


_FSDP_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _become_fsdp_module(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    new = _FSDP_CLASSES.get(cls)
    if new is None:
        new = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _FSDP_CLASSES[cls] = new
    module.__class__ = new


def _ungathered_message(module: nn.Module, placeholders: list[ShardedUnit]) -> str:
    shown = ", ".join(repr(u.path) for u in placeholders[:6])
    more = f" and {len(placeholders) - 6} more" if len(placeholders) > 6 else ""
    unit = module.__dict__[UNIT_ATTR]
    return (
        f"fully_shard: the forward of unit {unit.path!r} computed "
        f"with a placeholder parameter (device 'meta'): a unit's parameters are gathered only "
        f"while its own forward runs, and these units were not gathered: {shown}{more}. If "
        f"a module reads one of these units' parameters without calling its forward (as "
        f"nn.MultiheadAttention does with out_proj), do not make it a unit: wrap the "
        f"enclosing module instead (e.g. wrap={{nn.TransformerEncoderLayer}} rather than "
        f"wrap={{nn.Linear}})"
    )


def _check_units_are_called(
    root: nn.Module, earlier: list[nn.Module], targets: list[nn.Module], wrap: Wrap | None
) -> None:
    """Refuse a unit whose parent reads its parameters directly (READS_CHILD_PARAMETERS):
    it would never be gathered. Checked on every rank alike, before any communication."""
    chosen = {id(m): f"wrap={_wrap_repr(wrap)} makes" for m in targets}
    chosen.update({id(m): "an earlier fully_shard call made" for m in earlier})
    for parent_path, parent in root.named_modules():
        if not isinstance(parent, READS_CHILD_PARAMETERS):
            continue
        for name, child in parent.named_children():
            if id(child) not in chosen:
                continue
            path = f"{parent_path}.{name}" if parent_path else name
            enclosing = root.get_submodule(parent_path.rpartition(".")[0]) if parent_path else root
            if enclosing is root:  # the root is a unit already: suggest the parent itself
                enclosing = parent
            raise ValueError(
                f"fully_shard: {chosen[id(child)]} {path!r} ({_class_name(child)}) a unit, "
                f"but its parent {parent_path or '(root)'!r} ({_class_name(parent)}) reads its "
                f"parameters directly without calling its forward, so they would never be "
                f"gathered (the forward would fail on a 'meta' placeholder). Make an enclosing "
                f"module the unit instead (e.g. wrap={{{_class_name(enclosing)}}}), and leave "
                f"{_class_name(child)} out of wrap"
            )


def _class_name(module: nn.Module | type[nn.Module]) -> str:
    """``nn.Linear`` for torch.nn classes, the bare name otherwise; the class before
    ``fully_shard`` mixed FSDPModule into it."""
    given = module if isinstance(module, type) else type(module)
    cls = next(c for c in given.__mro__ if not issubclass(c, FSDPModule))
    return f"nn.{cls.__name__}" if getattr(nn, cls.__name__, None) is cls else cls.__name__


def _wrap_repr(wrap: Wrap | None) -> str:
    if isinstance(wrap, (set, frozenset, tuple)):
        return "{" + ", ".join(sorted(_class_name(c) for c in wrap)) + "}"
    return repr(wrap)


def _is_unit(module: nn.Module) -> bool:
    return UNIT_ATTR in module.__dict__


def _post_order(root: nn.Module, stop: set[int]) -> Iterator[nn.Module]:
    """Modules under ``root`` children first, each once, not entering units in ``stop``."""
    seen: set[int] = set()

    def visit(m: nn.Module) -> Iterator[nn.Module]:
        seen.add(id(m))
        for child in m.children():
            if id(child) not in seen and id(child) not in stop:
                yield from visit(child)
        yield m

    yield from visit(root)


def _wrap_targets(root: nn.Module, wrap: Wrap | None, stop: set[int]) -> list[nn.Module]:
    """The submodules ``wrap`` makes units of, children before parents (root excluded)."""
    if wrap is None:
        return []
    if isinstance(wrap, int) and not isinstance(wrap, bool):
        if wrap <= 0:
            raise ValueError(f"fully_shard: wrap={wrap} must be a positive parameter count")
        claimed: set[int] = set()
        targets = []
        for m in _post_order(root, stop):  # bottom-up: count what no chosen child holds
            if m is root:
                continue
            free = sum(p.numel() for _, _, p in _owned(m, stop | claimed))
            if free >= wrap:
                targets.append(m)
                claimed.add(id(m))
        return targets
    if isinstance(wrap, (set, frozenset, tuple)) and all(isinstance(c, type) for c in wrap):
        classes = tuple(wrap)
        return [m for m in _post_order(root, stop) if m is not root and isinstance(m, classes)]
    raise TypeError(
        f"fully_shard: wrap must be None, a set or tuple of module classes, or an int "
        f"(a parameter count); got {wrap!r}"
    )


def _owned(module: nn.Module, stop: set[int]) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Parameters of ``module``'s subtree outside the units in ``stop``, in module order."""
    found: list[tuple[nn.Module, str, nn.Parameter]] = []
    seen: set[tuple[int, str]] = set()
    for m in _pre_order(module, stop):
        for name, p in m._parameters.items():
            if p is not None and (id(m), name) not in seen:
                seen.add((id(m), name))
                found.append((m, name, p))
    return found


def _pre_order(root: nn.Module, stop: set[int]) -> Iterator[nn.Module]:
    seen: set[int] = set()

    def visit(m: nn.Module) -> Iterator[nn.Module]:
        seen.add(id(m))
        yield m
        for child in m.children():
            if id(child) not in seen and id(child) not in stop:
                yield from visit(child)

    yield from visit(root)


def _default_group(group: Group | None) -> Group | None:
    if group is not None:
        return group
    return runtime.world() if runtime.is_initialized() else None


def fully_shard(
    module: nn.Module,
    *,
    group: Group | None = None,
    reshard_after_forward: bool = True,
    mixed_precision: MixedPrecisionPolicy | None = None,
    offload: OffloadPolicy | None = None,
    wrap: Wrap | None = None,
    prefetch: bool = True,
    algorithm: str = "auto",
    tracer: Tracer | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters over ``group`` (default: the world) in place; return it.

    ``wrap``: which submodules become units of their own (a set or tuple of module
    classes; an int: a submodule whose subtree holds at least that many parameters not in
    a smaller unit, chosen bottom-up; None: the root only). Submodules sharded by earlier
    ``fully_shard`` calls (bottom-up nesting) stay units and join this root. A unit must
    run through its own ``forward``: a ``ValueError`` names any unit whose parent reads its
    parameters directly (any child of ``nn.MultiheadAttention``, so ``wrap={nn.Linear}``
    on a transformer is refused: use ``wrap={nn.TransformerEncoderLayer}``).
    ``reshard_after_forward``: free each unit's full parameters after its forward and
    gather them again for backward, except the root's and those backward needs first:
    the last unit to start forward and, with ``prefetch``, the one before it (False: keep
    all until their backward is done).
    ``mixed_precision``: compute and reduction dtypes (shards stay in their dtype).
    ``offload``: keep shards (and hence optimizer state) in CPU memory. ``prefetch``:
    overlap the next unit's all-gather with this unit's compute. ``algorithm``: the
    all-gather and reduce-scatter algorithm (``plait.comm``'s names). ``tracer``: record
    forward, backward and every all-gather and reduce-scatter (see :mod:`plait.trace`).

    Collective: every rank of ``group`` must call it, with the same module structure; the
    initial broadcasts block on the group. Build the optimizer afterwards, from
    ``module.parameters()`` (the shards). Without ``plait.init`` and ``group``, it runs in
    one process without communication.
    """
    if _is_unit(module):
        raise ValueError(
            f"fully_shard: {type(module).__name__} is already sharded; call fully_shard "
            f"once per module (children first, then the root)"
        )
    g = _default_group(group)
    mp = mixed_precision or MixedPrecisionPolicy()
    first = next(module.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    config = _Config(
        group=g,
        algorithm=algorithm,
        reshard_after_forward=reshard_after_forward,
        param_dtype=mp.param_dtype,
        reduce_dtype=mp.reduce_dtype,
        compute_device=device,
        shards_on_cpu=offload is not None and offload.shards_on_cpu,
        tracer=tracer,
    )
    earlier = [m for m in module.modules() if _is_unit(m)]
    stop = {id(m) for m in earlier}
    targets = _wrap_targets(module, wrap, stop)
    _check_units_are_called(module, earlier, targets, wrap)
    buffers = [b for b in module.buffers()]
    if g is not None and g.size > 1 and buffers:
        broadcast_tensors(buffers, g, "auto")
    if mp.buffer_dtype is not None:
        for m in module.modules():
            for name, b in m._buffers.items():
                if b is not None and b.is_floating_point():
                    m._buffers[name] = b.to(mp.buffer_dtype)
    new_units: list[ShardedUnit] = []
    for m in [*targets, module]:
        unit = ShardedUnit(m, _owned(m, stop), config)
        m.__dict__[UNIT_ATTR] = unit
        m.register_forward_pre_hook(unit.pre_forward, with_kwargs=True)
        m.register_forward_hook(unit.post_forward)
        _become_fsdp_module(m)
        stop.add(id(m))
        new_units.append(unit)
    units: list[ShardedUnit] = []
    for m in earlier:  # earlier roots hand their units (children first) to this root
        earlier_state = m.__dict__[UNIT_ATTR].state
        units += earlier_state.units if earlier_state is not None else []
    units = _unique([*units, *new_units])
    state = _RootState(units, new_units[-1], prefetch)
    paths = {id(m): name for name, m in module.named_modules()}
    for unit in units:
        unit.name(paths)
        if unit.config.group is not g and unit.config.group is not None:
            raise ValueError(
                "fully_shard: a submodule was sharded over another group; nested units "
                "must share the root's group"
            )
        unit.state = state
    return module


def _unique(units: Iterable[ShardedUnit]) -> list[ShardedUnit]:
    return list({id(u): u for u in units}.values())


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict of ``module``, keys as before sharding, on every rank.

    Parameters come back in their master dtype, on the CPU. Collective: all-gathers every
    unit in ``module``'s subtree (blocks on the group); every rank must call it.
    """
    gathered: dict[int, list[torch.Tensor]] = {}

    def params_of(unit: ShardedUnit) -> list[torch.Tensor]:
        if id(unit) not in gathered:
            cfg = unit.config
            shard = unit.shard.detach().to(cfg.compute_device)
            flat = torch.empty(unit.padded, dtype=shard.dtype, device=cfg.compute_device)
            if cfg.group is None:
                flat.copy_(shard)
            else:
                comm.all_gather(flat, shard, group=cfg.group, algorithm=cfg.algorithm)
            pieces = flat.split([*unit.numels, unit.padded - unit.numel])
            gathered[id(unit)] = [
                piece.view(shape).cpu().clone()
                for piece, shape in zip(pieces, unit.shapes, strict=False)
            ]
        return gathered[id(unit)]

    out: dict[str, torch.Tensor] = {}

    def visit(m: nn.Module, prefix: str) -> None:
        for name, p in m._parameters.items():
            if name != SHARD_NAME and p is not None:
                out[prefix + name] = p.detach().cpu().clone()
        for name, unit, i in m.__dict__.get(NAMES_ATTR, []):
            out[prefix + name] = params_of(unit)[i]
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out[prefix + name] = b.detach().cpu().clone()
        for name, child in m._modules.items():
            if child is not None:
                visit(child, prefix + name + ".")

    visit(module, "")
    return out
