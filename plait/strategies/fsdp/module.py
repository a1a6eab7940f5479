"""``FSDPModule``: mixed into the class of every module ``fully_shard`` makes a unit."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.strategies.fsdp.grads import clip_units_grad_norm_
from plait.strategies.fsdp.placeholder import UngatheredParameterError
from plait.strategies.fsdp.unit import UNITS_ATTR, ShardedUnit


def refuse_offloaded_meta(module: nn.Module, who: str) -> None:
    """Refuse to allocate a model sharded with ``offload_policy`` while it was on meta:
    its shards already live on the CPU (no values) and it computes on meta, a step
    without data (the meta harness, docs/devices.md); allocating would move the host
    shards to the compute device and lose the offload without a word."""
    for m in module.modules():
        for unit in m.__dict__.get(UNITS_ATTR, []):
            if unit.config.shards_on_cpu and unit.config.compute_device.type == "meta":
                raise ValueError(
                    f"fully_shard: {who} on a model sharded with offload_policy while on the "
                    f"meta device (unit {unit.path!r}): its shards are on the CPU and it "
                    f"computes on meta, a step without data. To train it, materialize the "
                    f"model on its compute device first, then call fully_shard with "
                    f"offload_policy (or shard it on meta without offload_policy, then "
                    f"materialize)"
                )


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
            for unit in m.__dict__.get(UNITS_ATTR, []):
                seen[id(unit)] = unit
        return list(seen.values())

    # --- drop-in parity with FSDP2's FSDPModule ----------------------------------------------
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the gradients of every unit in this subtree by their *global* norm (over all
        ranks' shards, each element once) and return it, the same on every rank.

        Collective: one all-reduce of one element (float64 for float64 gradients, else
        float32) on the group; every rank must
        call it (after backward, after ``GradScaler.unscale_`` if one is used).
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` raises instead: each
        rank would see only its shard."""
        return clip_units_grad_norm_(
            self.sharded_units(), max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def unshard(self, async_op: bool = False) -> _Done | None:
        """All-gather every unit of this subtree and set the original parameters to views of
        the full buffers (until :meth:`reshard`; the next forward gathers afresh).
        Collective: blocks on the group. With ``async_op`` (FSDP2's spelling) the gathers
        still run synchronously and a handle whose ``wait()`` returns at once comes back.
        The views may be modified (under ``torch.no_grad()``); :meth:`reshard` copies this
        rank's slice back into the shards (e.g. after an init function)."""
        for unit in self.sharded_units():
            unit.wait()
            unit.unshard()
            if unit.numel:
                unit.install_views()
        return _Done() if async_op else None

    def reshard(self) -> None:
        """Free the full parameters of every unit of this subtree, first copying this rank's
        slice of each gathered buffer back into its shard. No communication."""
        for unit in self.sharded_units():
            unit.wait()
            unit.write_back()
            unit.reshard()

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """When this unit's forward starts, all-gather these units asynchronously (instead of
        the next unit in recorded order). Every rank must set the same lists."""
        for unit in self.__dict__[UNITS_ATTR]:
            unit.forward_prefetch = _units_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """When this unit's backward starts, all-gather these units asynchronously (instead
        of the next unit in recorded order). Every rank must set the same lists."""
        for unit in self.__dict__[UNITS_ATTR]:
            unit.backward_prefetch = _units_of(modules, "set_modules_to_backward_prefetch")

    def to_empty(self, *, device: Any, recurse: bool = True) -> FSDPModule:
        """Allocate the shards (and buffers) of a model sharded on the meta device; then call
        :meth:`unshard`, initialize (e.g. ``reset_parameters()``), and :meth:`reshard`, or
        use :func:`~plait.strategies.fsdp.materialize`. No communication. Refused for
        units sharded with ``offload_policy`` on meta (:func:`refuse_offloaded_meta`)."""
        refuse_offloaded_meta(self, "to_empty")
        super().to_empty(device=device, recurse=recurse)
        for m in self.modules():
            for unit in m.__dict__.get(UNITS_ATTR, []):
                if unit.config.compute_device.type == "meta":
                    unit.config.compute_device = torch.device(device)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> FSDPModule:
        """``to()``, ``to_empty()``, ``float()``...: PyTorch may replace a shard parameter
        by a new object (e.g. from the meta device); the units follow it."""
        super()._apply(fn, recurse=recurse)
        for unit in self.__dict__.get(UNITS_ATTR, []):
            if unit.numel:
                unit.shard = self._parameters[unit.shard_name]
        return self

    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> Any:
        """The model's own keys (as before sharding), each parameter's value this rank's
        part of it as ``plait.strategies.dcp_chunks.ShardChunks``: rectangles of the full
        shape, views of the flat shards, that ``torch.distributed.checkpoint`` saves and
        loads (reshards) as it does FSDP2's DTensors; buffers and unsharded parameters
        whole. Not for computing: ``plait.checkpoint.full_state_dict(model)`` gathers the
        whole tensors (collective). No communication."""
        if args:
            raise TypeError(
                f"fully_shard: {type(self).__name__}.state_dict() takes keyword arguments "
                f"only (destination=, prefix=, keep_vars=)"
            )
        from plait.strategies.fsdp import dcp as dcp_fsdp  # deferred: dcp imports this module

        out = destination if destination is not None else {}
        out.update(dcp_fsdp.model_state(self, prefix))
        return out

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Any, strict: bool = True, assign: bool = False
    ) -> Any:
        """Load what :meth:`state_dict` gave (after ``torch.distributed.checkpoint.load``
        filled it, at any saving world size or layout) or whole tensors under the model's
        own keys (the one-process state dict): each rank keeps its slice. With ``strict``,
        missing or unexpected keys and other shapes raise ``ValueError`` before anything
        is copied. No communication."""
        if assign:
            raise NotImplementedError(
                f"fully_shard: {type(self).__name__}.load_state_dict(assign=True) would "
                f"replace the flat shards; load with assign=False (values are copied)"
            )
        from plait.strategies.fsdp import dcp as dcp_fsdp  # deferred: dcp imports this module

        dcp_fsdp.load_model_state(self, dict(state_dict), strict=strict)
        return nn.modules.module._IncompatibleKeys([], [])

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise AttributeError(
                    f"fully_shard returns the module itself ({type(self).__name__}), not a "
                    f"wrapper: there is no .module; use the model directly"
                ) from None
            raise

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
        from plait.strategies.fsdp.state import full_state_dict  # deferred: state imports module

        return full_state_dict(self)


def _ungathered_message(module: nn.Module, placeholders: list[ShardedUnit]) -> str:
    shown = ", ".join(repr(u.path) for u in placeholders[:6])
    more = f" and {len(placeholders) - 6} more" if len(placeholders) > 6 else ""
    unit = module.__dict__[UNITS_ATTR][0]
    return (
        f"fully_shard: the forward of unit {unit.path!r} computed "
        f"with a placeholder parameter (device 'meta'): a unit's parameters are gathered only "
        f"while its own forward runs, and these units were not gathered: {shown}{more}. If "
        f"a module reads one of these units' parameters without calling its forward (as "
        f"nn.MultiheadAttention does with out_proj), do not make it a unit: wrap the "
        f"enclosing module instead (e.g. wrap={{nn.TransformerEncoderLayer}} rather than "
        f"wrap={{nn.Linear}})"
    )


class _Done:
    """What ``unshard(async_op=True)`` returns: the gathers are complete already."""

    def wait(self) -> None:
        return None


def _units_of(modules: list[nn.Module], who: str) -> list[ShardedUnit]:
    units: list[ShardedUnit] = []
    for m in modules:
        found = m.__dict__.get(UNITS_ATTR)
        if not found:
            raise ValueError(
                f"fully_shard: {who} got {type(m).__name__}, which is not a unit; pass modules "
                f"that fully_shard (or its wrap=) made units"
            )
        units += [u for u in found if u.numel]
    return units
