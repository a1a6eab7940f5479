"""The mixture-of-experts layer: a router, E experts, GShard gating, soft and hard limits.

``MoE(d_model, num_experts=E, ...)`` maps ``x [..., d_model]`` to ``y`` of the same shape:
``y[t] = sum over t's kept choices of weight * expert(x[t])``, 0 for a token whose every
choice overflowed (in a residual block it then rides the residual). One step:

1. tokens split into G groups of S (``groups="sequence"``: one group per sequence of a
   ``[batch, seq, d]`` input, so splitting the batch across ranks never changes a group;
   an int G: the flattened tokens in G equal groups);
2. ``logits = gate(x)`` (``nn.Linear(d, E, bias=False)``), routed by
   :func:`~plait.strategies.moe.gshard_gate.route` with capacity
   ``C = ceil(S * capacity_factor / E)`` (``eval_capacity_factor`` in eval mode, at least
   ``min_capacity``; ``drop_tokens=False``: ``C = S``, nothing is dropped);
3. dispatch, experts, combine (:mod:`~plait.strategies.moe.dispatch`); without expert
   parallelism every expert is local and nothing is sent. ``pad_to_capacity=True``:
   GShard's static ``[E, G*C, d]`` buffers instead (:mod:`~plait.strategies.moe.padded`,
   Megatron-LM's ``moe_pad_expert_input_to_capacity``): equal all-to-all splits, no
   counts all-gather and no host read of the routing (so the layer steps on the ``meta``
   device), at the price of sending and computing the empty slots;
4. the soft limit: ``aux_loss_weight * aux + z_loss_weight * z`` (:mod:`.losses`) is
   attached to ``y``: its gradient is added in backward as if you had added that term to
   your loss (Megatron's ``MoEAuxLossAutoScaler`` idea), so a training loop needs no
   change; the values are in :attr:`last_stats`. With ``bias_update_rate > 0`` the
   auxiliary-loss-free bias steers the choice (:func:`update_expert_bias` after each step);
5. statistics (:class:`~plait.strategies.moe.stats.MoEStats`) in :attr:`last_stats`.

Randomness: the second-expert draws of ``"random"`` (and the Gumbel noise of
``"sampling"``) of group ``g`` in training call ``n`` come from a generator seeded with a
hash of ``(seed, n, global group index)``. The global index is
``batch_index * G + g``: expert parallelism sets ``batch_index`` to this rank's slice of the
global batch, so an expert-parallel run and a one-process run on the global batch make the
same draws token by token. ``seed=`` chooses the stream; the call counter is the buffer
``draw_calls`` (saved with the model). Eval mode draws nothing: every second choice is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from plait import comm
from plait.comm.device import host_list
from plait.comm.group import Group
from plait.strategies.moe import dispatch as moe_dispatch
from plait.strategies.moe import losses, padded
from plait.strategies.moe.gshard_gate import SECOND_EXPERT_POLICIES, Routing, capacity, route
from plait.strategies.moe.stats import MoEStats

_MASK64 = (1 << 64) - 1


def _stream_seed(seed: int, call: int, group: int) -> int:
    """A 63-bit seed for (seed, call, group): splitmix64 over a linear mix."""
    x = seed * 0x9E3779B97F4A7C15 + call * 0xBF58476D1CE4E5B9 + group * 0x94D049BB133111EB + 1
    x &= _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x & ((1 << 63) - 1)


class Expert(nn.Module):
    """The default expert: ``fc2(gelu(fc1(x)))`` with hidden width ``hidden``."""

    def __init__(self, d_model: int, hidden: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden, dtype=dtype)
        self.fc2 = nn.Linear(hidden, d_model, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _AttachLoss(torch.autograd.Function):
    """Forward: ``y`` unchanged. Backward: ``y``'s gradient, and 1 for ``loss``, so the
    loss's parameters get its gradient whenever backward passes through ``y``."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


class MoE(nn.Module):
    """A GShard mixture-of-experts layer (module docstring).

    Parameters: ``gate.weight [E, d_model]`` and ``experts.<e>.*`` for each global expert
    index ``e`` (a ``ModuleDict`` keyed by the index, so under expert parallelism a rank's
    parameter names still say which experts it holds). ``expert``: a factory called E times
    (default :class:`Expert` of hidden width ``4 * d_model``). Buffers: ``expert_bias [E]``
    (auxiliary-loss-free balancing), ``draw_calls`` (the randomness counter).

    ``top_k``: 1 (Switch) or 2 (GShard). ``second_expert``: ``"random"`` | ``"sampling"`` |
    ``"all"``. ``aux_loss``: ``"gshard"`` | ``"switch"``. ``pad_to_capacity``: dispatch
    through buffers padded to the capacity (step 3 of the module docstring; output and
    gradients the same to rounding; :attr:`last_stats` then counts this rank's tokens and is
    read on the host only when accessed). Expert parallelism is applied by
    :func:`plait.strategies.moe.expert_parallel` (``expert_group``, ``batch_index``).
    """

    expert_bias: torch.Tensor
    draw_calls: torch.Tensor
    load_since_update: torch.Tensor

    def __init__(
        self,
        d_model: int,
        *,
        num_experts: int,
        expert: Callable[[], nn.Module] | None = None,
        top_k: int = 2,
        capacity_factor: float = 2.0,
        eval_capacity_factor: float = 2.0,
        min_capacity: int = 4,
        drop_tokens: bool = True,
        second_expert: str = "random",
        aux_loss: str = "gshard",
        aux_loss_weight: float = 1e-2,
        z_loss_weight: float = 0.0,
        bias_update_rate: float = 0.0,
        groups: int | str = "sequence",
        seed: int = 0,
        algorithm: str = "auto",
        pad_to_capacity: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"MoE: num_experts must be at least 1, got {num_experts}")
        if top_k not in (1, 2):
            raise ValueError(f"MoE: top_k must be 1 or 2, got {top_k}")
        if top_k > num_experts:
            raise ValueError(
                f"MoE: top_k={top_k} needs at least {top_k} experts, got {num_experts}"
            )
        if second_expert not in SECOND_EXPERT_POLICIES:
            raise ValueError(
                f"MoE: second_expert must be one of {SECOND_EXPERT_POLICIES}, got {second_expert!r}"
            )
        if aux_loss not in losses.AUX_LOSSES:
            raise ValueError(f"MoE: aux_loss must be one of {losses.AUX_LOSSES}, got {aux_loss!r}")
        for name, cf in (
            ("capacity_factor", capacity_factor),
            ("eval_capacity_factor", eval_capacity_factor),
        ):
            if cf <= 0:
                raise ValueError(f"MoE: {name} must be positive, got {cf}")
        if groups != "sequence" and not (isinstance(groups, int) and groups >= 1):
            raise ValueError(f"MoE: groups must be 'sequence' or a positive int, got {groups!r}")
        self.d_model = d_model
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.drop_tokens = drop_tokens
        self.second_expert = second_expert
        self.aux_loss = aux_loss
        self.aux_loss_weight = aux_loss_weight
        self.z_loss_weight = z_loss_weight
        self.bias_update_rate = bias_update_rate
        self.groups = groups
        self.seed = seed
        self.algorithm = algorithm
        self.pad_to_capacity = pad_to_capacity
        self.gate = nn.Linear(d_model, num_experts, bias=False, dtype=dtype)
        make = expert if expert is not None else (lambda: Expert(d_model, 4 * d_model, dtype))
        self.experts = nn.ModuleDict({str(e): make() for e in range(num_experts)})
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float64))
        self.register_buffer("draw_calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("load_since_update", torch.zeros(num_experts, dtype=torch.float64))
        # set by expert_parallel(): the ep group and this rank's slice of the global batch
        self.expert_group: Group | None = None
        self.batch_index = 0
        self._last_stats: MoEStats | None = None
        # padded path: (kept, routed, aux, z) on the device, capacity, rows moved each way
        self._pending_stats: tuple[tuple[torch.Tensor, ...], int, int] | None = None
        self._agreed: set[tuple[int, int]] = set()  # (G, C) the ep group agreed on (padded)

    @property
    def last_stats(self) -> MoEStats | None:
        """The last forward's :class:`MoEStats`. Dropless: made in the forward from the
        counts all-gather. ``pad_to_capacity=True``: kept on the device in the forward and
        read on the host here, on first access (this rank's tokens only: that path
        gathers no counts)."""
        if self._pending_stats is not None:
            (kept, routed, aux, z), capacity, moved = self._pending_stats
            self._last_stats = MoEStats.of(
                kept=host_list(kept),
                routed=host_list(routed),
                capacity=capacity,
                aux_loss=float(aux),
                z_loss=float(z),
                rows_out=moved,
                rows_in=moved,
            )
            self._pending_stats = None
        return self._last_stats

    @last_stats.setter
    def last_stats(self, stats: MoEStats | None) -> None:
        self._last_stats, self._pending_stats = stats, None

    def draw_counter(self) -> int:
        """The value of ``draw_calls`` on the host (on a GPU a read of one int64). On the
        ``meta`` device it holds none, and the draws it seeds carry none either once moved
        there: 0."""
        return 0 if self.draw_calls.is_meta else int(self.draw_calls)

    # --- routing --------------------------------------------------------------------------
    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.d_model:
            raise ValueError(
                f"MoE: input's last dimension is {x.shape[-1]}, expected d_model={self.d_model}"
            )
        if self.groups == "sequence":
            return (
                x.reshape(-1, x.shape[-2], self.d_model)
                if x.dim() >= 3
                else x.reshape(1, -1, self.d_model)
            )
        tokens = x.numel() // self.d_model
        G = int(self.groups)
        if tokens % G:
            raise ValueError(
                f"MoE: {tokens} tokens cannot be split into groups={G} equal groups; choose "
                f"groups dividing {tokens} (or groups='sequence')"
            )
        return x.reshape(G, tokens // G, self.d_model)

    def _draws(
        self, G: int, S: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The uniform draws [G, S] or Gumbel noise [G, S, E] of this training call."""
        if not self.training or self.top_k == 1 or self.second_expert == "all":
            return None, None
        call = self.draw_counter()
        self.draw_calls += 1
        E = self.num_experts
        draws = []
        for g in range(G):
            gen = torch.Generator().manual_seed(
                _stream_seed(self.seed, call, self.batch_index * G + g)
            )
            shape = (S,) if self.second_expert == "random" else (S, E)
            draws.append(torch.rand(shape, generator=gen, dtype=torch.float64))
        u = torch.stack(draws)
        if self.second_expert == "random":
            return u, None
        tiny = torch.finfo(torch.float64).tiny
        return None, (-torch.log(-torch.log(u.clamp_min(tiny)))).to(dtype)

    def _capacity(self, S: int) -> int:
        if not self.drop_tokens:
            return S
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        return capacity(S, self.num_experts, cf, self.min_capacity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.pad_to_capacity:
            moe_dispatch.refuse_meta(x, f"MoE layer ({self.num_experts} experts)")
        grouped = self._grouped(x)
        G, S, d = grouped.shape
        logits = self.gate(grouped)  # [G, S, E]
        uniform, gumbel = self._draws(G, S, logits.dtype)
        # drawn on the CPU (the same streams on every device), used where the logits are
        uniform = None if uniform is None else uniform.to(logits.device)
        gumbel = None if gumbel is None else gumbel.to(logits.device)
        policy = self.second_expert if self.training else "all"
        use_bias = self.bias_update_rate > 0
        routing = route(
            logits,
            top_k=self.top_k,
            capacity=self._capacity(S),
            second_expert=policy if self.top_k == 2 else "all",
            uniform=uniform,
            gumbel=gumbel,
            bias=self.expert_bias.to(logits.dtype) if use_bias else None,
        )
        if self.pad_to_capacity:
            return self._forward_padded(x, grouped, logits, routing)
        plan = moe_dispatch.plan(routing)
        routed = routing.routed_per_expert()
        if self.training and use_bias:
            self.load_since_update += routed.to(torch.float64)
        # one all-gather per layer: kept counts (for the all-to-all sizes) and routed counts
        counts = moe_dispatch.gather_counts(plan.counts + routed.tolist(), self.expert_group)
        self._check_experts()
        y = moe_dispatch.run_experts(
            grouped.reshape(G * S, d),
            plan,
            self.experts,
            counts=counts[:, : self.num_experts],
            group=self.expert_group,
            algorithm=self.algorithm,
        ).reshape(x.shape)
        y, aux, z = self._attach_losses(y, logits, routing)
        kept = counts[:, : self.num_experts]
        p = kept.shape[0]
        r = 0 if self.expert_group is None else self.expert_group.rank
        held = slice(r * self.num_experts // p, (r + 1) * self.num_experts // p)
        self.last_stats = MoEStats.of(
            kept=kept.sum(0).tolist(),
            routed=counts[:, self.num_experts :].sum(0).tolist(),
            capacity=routing.capacity,
            aux_loss=float(aux.detach()),
            z_loss=float(z.detach()),
            rows_out=int(kept[r].sum() - kept[r, held].sum()),
            rows_in=int(kept[:, held].sum() - kept[r, held].sum()),
        )
        return y

    def _attach_losses(
        self, y: torch.Tensor, logits: torch.Tensor, routing: Routing
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The auxiliary (load-balancing) and z losses of this call, their weighted sum
        attached to ``y`` so that backward adds their gradients: ``(y, aux, z)``."""
        aux = losses.aux_loss(self.aux_loss, routing.gates, routing.first)
        z = losses.z_loss(logits)
        total = self.aux_loss_weight * aux + self.z_loss_weight * z
        if torch.is_grad_enabled() and total.requires_grad and y.requires_grad:
            y = _AttachLoss.apply(y, total)
        return y, aux, z

    def _forward_padded(
        self, x: torch.Tensor, grouped: torch.Tensor, logits: torch.Tensor, routing: Routing
    ) -> torch.Tensor:
        """Steps 3-5 through static ``[E, G*C, d]`` buffers (:mod:`.padded`): no counts
        all-gather, no host read; the statistics stay on the device until read."""
        G, S, d = grouped.shape
        E = self.num_experts
        chosen = routing.kept | (routing.position >= routing.capacity)
        routed = padded.per_expert(routing.expert, chosen, E)
        if self.training and self.bias_update_rate > 0:
            self.load_since_update += routed.to(torch.float64)
        self._check_experts()
        group, shape = self.expert_group, (G, routing.capacity)
        if group is not None and group.size > 1 and shape not in self._agreed:
            padded.agree_on_slots(*shape, group, f"MoE layer ({E} experts)")
            self._agreed.add(shape)
        y = padded.run_experts_padded(
            grouped.reshape(G * S, d),
            routing,
            self.experts,
            group=self.expert_group,
            algorithm=self.algorithm,
        ).reshape(x.shape)
        y, aux, z = self._attach_losses(y, logits, routing)
        kept = padded.per_expert(routing.expert, routing.kept, E)
        p = 1 if self.expert_group is None else self.expert_group.size
        moved = (p - 1) * (E // p) * G * routing.capacity  # rows each way, padding included
        found = (kept, routed, aux.detach(), z.detach())
        self._last_stats, self._pending_stats = None, (found, routing.capacity, moved)
        return y

    def _check_experts(self) -> None:
        p = 1 if self.expert_group is None else self.expert_group.size
        if len(self.experts) * p != self.num_experts:
            raise ValueError(
                f"MoE: this rank holds {len(self.experts)} experts but num_experts="
                f"{self.num_experts} over an expert-parallel group of {p}; apply "
                f"expert_parallel() to the whole model (every MoE layer)"
            )

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"capacity_factor={self.capacity_factor}, second_expert={self.second_expert!r}, "
            f"aux_loss={self.aux_loss!r}, drop_tokens={self.drop_tokens}"
            + (", pad_to_capacity=True" if self.pad_to_capacity else "")
        )


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """Every :class:`MoE` in ``model`` by module path."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}


def update_expert_bias(model: nn.Module, *, group: Group | None = None) -> None:
    """Auxiliary-loss-free balancing: for every MoE with ``bias_update_rate > 0``, sum the
    load routed since the last update over ``group`` (an all-reduce, one per layer: pass the
    group of every rank that feeds its own data, so all ranks keep the same bias), then
    ``bias += rate * sign(mean - load)`` and reset the tally. Call after each optimizer step
    (``plait.prepare(strategy="ep")`` registers it as an optimizer step hook)."""

    for moe in moe_layers(model).values():
        if moe.bias_update_rate <= 0:
            continue
        load = moe.load_since_update.clone()
        if group is not None and group.size > 1:
            comm.all_reduce(load, group=group)
        losses.balance_bias_step(moe.expert_bias, load, moe.bias_update_rate)
        moe.load_since_update.zero_()


__all__ = ["Expert", "MoE", "moe_layers", "update_expert_bias"]
