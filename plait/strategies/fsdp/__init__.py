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

A unit's parameters of different dtypes, ``requires_grad`` or optimizer parameter groups
go into separate flat shards (one ``ShardedUnit`` each, hooked on the same module).

Activation checkpointing inside a unit (``torch.utils.checkpoint``, Hugging Face's
``gradient_checkpointing_enable``) works: the unit's backward installs the gathered views
before the forward is re-run. Not supported: a second backward through one graph
(``retain_graph``), and the units above.

Package layout: :mod:`.placeholder` (what a parameter is between gathers), :mod:`.unit`
(one flat shard: gather, free, reduce-scatter), :mod:`.schedule` (orders, prefetch, the
end of backward), :mod:`.grads` (shard gradients, global-norm clipping, GradScaler
agreement), :mod:`.module` (``FSDPModule``), :mod:`.wrap` (``fully_shard``: units, tied
weights, parameter groups), :mod:`.state` (full state dicts and optimizer state),
:mod:`.prepare` (``prepare_fsdp``: the optimizer rebuilt over the shards).

Drop-in notes: ``fully_shard`` returns the module itself (no ``.module``);
``model.state_dict()`` gives each parameter as this rank's chunks of it, for
``torch.distributed.checkpoint`` (``plait.checkpoint.dcp``; whole tensors:
:func:`full_state_dict`, collective, and :func:`load_full_state_dict`); clip with
``model.clip_grad_norm_(max_norm)`` (a norm of a shard gradient raises
:class:`ShardedGradNormError`); ``torch.amp.GradScaler`` and
``plait.amp.DynamicLossScaler`` skip or step on every rank together.
"""

from plait.strategies.fsdp.grads import ShardedGradNormError, ShardGrad
from plait.strategies.fsdp.module import FSDPModule
from plait.strategies.fsdp.placeholder import UngatheredParameterError
from plait.strategies.fsdp.prepare import prepare_fsdp
from plait.strategies.fsdp.state import (
    full_optimizer_param_names,
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    materialize,
    shard_param_groups,
)
from plait.strategies.fsdp.unit import NAMES_ATTR, SHARD_NAME, UNIT_ATTR, UNITS_ATTR, ShardedUnit
from plait.strategies.fsdp.wrap import READS_CHILD_PARAMETERS, Wrap, fully_shard

__all__ = [
    "FSDPModule",
    "NAMES_ATTR",
    "READS_CHILD_PARAMETERS",
    "SHARD_NAME",
    "ShardGrad",
    "ShardedGradNormError",
    "ShardedUnit",
    "UNITS_ATTR",
    "UNIT_ATTR",
    "UngatheredParameterError",
    "Wrap",
    "full_optimizer_param_names",
    "full_optimizer_state_dict",
    "full_state_dict",
    "fully_shard",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "materialize",
    "prepare_fsdp",
    "shard_param_groups",
]
