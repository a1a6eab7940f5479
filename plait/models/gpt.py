"""A small GPT: the transformer every model-parallel strategy of plait is proven on.

Token + position embedding, ``layers`` pre-LayerNorm blocks (causal self-attention, then an
MLP of width ``4 * width``, each inside a residual), a final LayerNorm and an output head
that may share the token embedding's weight (``tied=True``). Activations are batch-first,
``[batch, sequence, width]``. Dropout is off by default (``dropout=0.0``): the oracle tests
need every strategy to compute the same function.

Module paths (what a tensor-parallel plan names): ``tok``, ``pos``, ``blocks.<i>.ln1``,
``blocks.<i>.attn.{qkv,proj}``, ``blocks.<i>.ln2``, ``blocks.<i>.mlp.{fc1,fc2}``,
``ln_f``, ``head``. The fused ``qkv`` projection stores its output rows head by head
(``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``, each ``head_dim`` wide), so a contiguous split of its
rows hands each tensor-parallel rank whole heads with their queries, keys and values, and
attention infers its local head count from the width it receives. :func:`tp_plan` is the
tensor-parallel plan for :func:`plait.parallelize`.

Mixture of experts: with ``GPTConfig(moe=MoEConfig(num_experts=8), moe_every=2)`` the MLP of
every ``moe_every``-th block (blocks ``moe_every-1, 2*moe_every-1, ...``: GShard's every other
layer) is a :class:`plait.moe.MoE` whose experts are this module's ``FeedForward``; its
parameters are ``blocks.<i>.mlp.gate.weight`` and ``blocks.<i>.mlp.experts.<e>.{fc1,fc2}.*``.
``moe=None`` (the default) is the dense GPT, unchanged (same paths, names and seeded values).
Expert parallelism: ``plait.prepare(model, opt, strategy="ep", mesh=Mesh(ep=..., dp=...))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from plait.strategies.moe.layer import MoE
from plait.strategies.pipeline import Layer, PipelinePlan
from plait.strategies.tensor import loss_fn
from plait.strategies.tensor.parallelize import Style
from plait.strategies.tensor.parallelize_nd import gpt_plan


@dataclass(frozen=True)
class MoEConfig:
    """The MoE blocks of a :class:`GPT` (the options of :class:`plait.moe.MoE`)."""

    num_experts: int = 4
    top_k: int = 2
    capacity_factor: float = 2.0
    eval_capacity_factor: float = 2.0
    min_capacity: int = 4
    drop_tokens: bool = True
    second_expert: str = "random"
    aux_loss: str = "gshard"
    aux_loss_weight: float = 1e-2
    z_loss_weight: float = 0.0
    bias_update_rate: float = 0.0
    seed: int = 0
    algorithm: str = "auto"
    pad_to_capacity: bool = False


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 97
    layers: int = 2
    heads: int = 4
    width: int = 64
    seq_len: int = 32
    tied: bool = False
    dropout: float = 0.0
    seed: int = 0
    dtype: torch.dtype = torch.float32
    moe: MoEConfig | None = None  # None: every block has a dense MLP
    moe_every: int = 2  # with moe: blocks moe_every-1, 2*moe_every-1, ... are MoE blocks

    def __post_init__(self) -> None:
        if self.moe is not None and self.moe_every < 1:
            raise ValueError(f"GPTConfig: moe_every must be at least 1, got {self.moe_every}")
        if self.width % self.heads:
            raise ValueError(
                f"GPTConfig: width {self.width} is not a multiple of heads {self.heads}"
            )


class Attention(nn.Module):
    """Causal multi-head self-attention: a fused ``qkv`` projection (rows head by head) and
    an output projection ``proj``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        w, dt = config.width, config.dtype
        self.heads = config.heads
        self.head_dim = w // config.heads
        self.qkv = nn.Linear(w, 3 * w, dtype=dt)
        self.proj = nn.Linear(w, w, dtype=dt)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # under sequence parallelism x is a slice, qkv the whole sequence
        b, s = qkv.shape[:2]
        # [b, s, heads * 3 * d] -> [3, b, heads, s, d]; heads = however many this rank holds
        qkv = qkv.view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True, dropout_p=drop)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """``fc2(gelu(fc1(x)))`` with hidden width ``4 * width``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.width, 4 * config.width, dtype=config.dtype)
        self.fc2 = nn.Linear(4 * config.width, config.width, dtype=config.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def is_moe_block(config: GPTConfig, index: int) -> bool:
    """Whether block ``index`` has a mixture of experts instead of a dense MLP."""
    return config.moe is not None and (index + 1) % config.moe_every == 0


def _moe(config: GPTConfig) -> nn.Module:

    m = config.moe
    assert m is not None
    return MoE(
        config.width,
        num_experts=m.num_experts,
        expert=lambda: FeedForward(config),
        top_k=m.top_k,
        capacity_factor=m.capacity_factor,
        eval_capacity_factor=m.eval_capacity_factor,
        min_capacity=m.min_capacity,
        drop_tokens=m.drop_tokens,
        second_expert=m.second_expert,
        aux_loss=m.aux_loss,
        aux_loss_weight=m.aux_loss_weight,
        z_loss_weight=m.z_loss_weight,
        bias_update_rate=m.bias_update_rate,
        seed=m.seed,
        algorithm=m.algorithm,
        pad_to_capacity=m.pad_to_capacity,
        dtype=config.dtype,
    )


class Block(nn.Module):
    """``x + attn(ln1(x))``, then ``x + mlp(ln2(x))`` (pre-LayerNorm); ``mlp`` is a
    :class:`plait.moe.MoE` in a mixture-of-experts block (``moe=True``)."""

    def __init__(self, config: GPTConfig, moe: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.width, dtype=config.dtype)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.width, dtype=config.dtype)
        self.mlp = _moe(config) if moe else FeedForward(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """A decoder-only transformer; ``forward(ids [b, s]) -> logits [b, s, vocab]``.

    Built from ``torch.manual_seed(config.seed)``: every rank building the same config holds
    the same weights, which is what :func:`plait.parallelize` slices.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        torch.manual_seed(config.seed)
        self.config = config
        dt = config.dtype
        self.tok = nn.Embedding(config.vocab, config.width, dtype=dt)
        self.pos = nn.Embedding(config.seq_len, config.width, dtype=dt)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            Block(config, is_moe_block(config, i)) for i in range(config.layers)
        )
        self.ln_f = nn.LayerNorm(config.width, dtype=dt)
        self.head = nn.Linear(config.width, config.vocab, bias=False, dtype=dt)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.02)
                    if name.endswith(("proj.weight", "fc2.weight")):
                        p.div_((2 * config.layers) ** 0.5)  # residual-branch scaling
                elif name.endswith(".bias"):
                    p.zero_()
        if config.tied:
            self.head.weight = self.tok.weight

    def plait_plan(self, kind: str, **options: Any) -> Any:
        """This GPT's ``kind`` plan (``"tp"``: :func:`tp_plan`, ``"pipeline"``:
        :func:`pipeline_plan`, ``"context"``: :func:`context_plan`), or None for a kind it
        has none of: the model carries its plans, so a strategy handed it (``compose``,
        ``PipelineParallel``) finds them without importing this module
        (:func:`plait.models.plans.plan_for` reads it too)."""
        plans = {"tp": tp_plan, "pipeline": pipeline_plan, "context": context_plan}
        return plans[kind](self, **options) if kind in plans else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        if s > self.config.seq_len:
            raise ValueError(f"GPT: sequence of {s} tokens exceeds seq_len {self.config.seq_len}")
        positions = torch.arange(s, device=ids.device).unsqueeze(0)  # [1, s]
        x = self.drop(self.tok(ids) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def context_plan(model: GPT) -> str:
    """Context parallelism's plan: the module embedding position ids (``"pos"``), whose
    input :func:`plait.strategies.context.context_parallel` replaces by the rank's global
    positions."""
    return "pos"


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits [b, s, V]`` against ``targets [b, s]``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tp_plan(
    model: GPT | GPTConfig, *, sequence_parallel: bool = False, mode: str = "1d"
) -> dict[str, Any]:
    """The tensor-parallel plan of a :class:`GPT` (or of one built from a ``GPTConfig``).

    Attention heads are split across ranks (``qkv`` column-wise, ``proj`` row-wise), the
    dense MLPs column-then-row (the MLPs of MoE blocks are left whole: expert parallelism
    splits those), the token embedding and the head by vocabulary (the loss is then
    :func:`plait.strategies.tensor.loss_fn`'s vocab-parallel cross-entropy). With
    ``sequence_parallel`` the LayerNorms and the position embedding work on this rank's
    slice of the sequence (``"sequence"``; their gradients are summed over the group).
    ``mode`` ``"2d"``, ``"2.5d"``, ``"3d"``: the plan of
    :func:`plait.strategies.tensor.gpt_plan`. Attention infers its local head count from
    the width it receives, so no attribute needs dividing.
    """

    config = model.config if isinstance(model, GPT) else model
    if mode != "1d":
        return gpt_plan(mode, layers=config.layers)
    plan: dict[str, Any] = {"tok": "vocab", "head": "vocab"}
    for i in range(config.layers):
        b = f"blocks.{i}"
        plan |= {f"{b}.attn.qkv": "colwise", f"{b}.attn.proj": "rowwise"}
        if not is_moe_block(config, i):
            plan |= {f"{b}.mlp.fc1": "colwise", f"{b}.mlp.fc2": "rowwise"}
        if sequence_parallel:
            plan |= {f"{b}.ln1": "sequence", f"{b}.ln2": "sequence"}
    if sequence_parallel:
        plan |= {"ln_f": "sequence", "pos": Style("sequence", input="replicate")}
    return plan


def pipeline_plan(model: GPT) -> Any:
    """The pipeline plan of a :class:`GPT`: the embedding (``tok`` + ``pos``, positions
    ``0..s-1``), each block, the head (``ln_f`` then ``head``, tied or not); the loss is
    :func:`loss` (a mean over the micro-batch's tokens), or, once :func:`tp_plan` has split
    the head by vocabulary (its logits stay split: PTD-P), the vocab-parallel
    cross-entropy of :func:`plait.strategies.tensor.loss_fn`, the same mean. No per-stage
    context: the positions enter only at the embedding. Build it after
    :func:`plait.parallelize` has cut the model: its layers hold the modules it finds."""

    def embed(ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return model.drop(model.tok(ids) + model.pos(positions))  # type: ignore[no-any-return]

    def head(x: torch.Tensor) -> torch.Tensor:
        return model.head(model.ln_f(x))  # type: ignore[no-any-return]

    layers = [Layer("embed", (("tok", model.tok), ("pos", model.pos)), embed)]
    for i, block in enumerate(model.blocks):
        layers.append(Layer(f"blocks.{i}", ((f"blocks.{i}", block),), block))
    layers.append(Layer("head", (("ln_f", model.ln_f), ("head", model.head)), head))
    # loss_fn reads how parallelize left the head: F.cross_entropy on whole logits (as
    # loss above), the vocab-parallel cross-entropy on a vocabulary-split head
    return PipelinePlan(layers=tuple(layers), loss=loss_fn(model), name="GPT")
