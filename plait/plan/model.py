"""What the planner knows about a model: its shape, its parameters, its FLOPs.

A :class:`ModelSpec` is a decoder-only transformer in the shape of :class:`plait.models.GPT`
(and of GPT-3 / Megatron's GPT): ``layers`` blocks of width ``hidden`` with ``heads``
attention heads, an MLP of ``ffn_mult * hidden``, a token embedding of ``vocab`` rows, a
learned position table of ``seq_len`` rows, a final LayerNorm and an output head (shared
with the token embedding when ``tied``). Optionally every ``moe_every``-th block's MLP is a
mixture of ``experts`` experts with top-``top_k`` routing (GShard).

Parameters, counted the way plait's GPT holds them (biases on every linear but the head)::

    per dense block   (4 + 2 f) h^2 + (9 + f) h      = 12 h^2 + 13 h for f = 4
                      qkv 3h^2+3h, proj h^2+h, fc1 f h^2+f h, fc2 f h^2+h, two LayerNorms 4h
    per MoE block     attention and LayerNorms 4h^2 + 8h, gate h E, E experts (2 f h^2 + (f+1) h)
    embeddings        V h (tokens) + s h (positions); final LayerNorm 2h; head V h unless tied

so P = 12 L h^2 (1 + 13/(12 h) + (V + s)/(12 L h)) for a dense tied model: Narayanan et al.
2021 (PTD-P), section 5.1.

FLOPs (Narayanan et al. 2021, appendix; a multiply-add is 2 FLOPs), per token and per block,
forward: the four linears ``2 (4 + 2 f) h^2`` (``24 h^2`` for f = 4) plus attention's two
``s x s`` products ``4 s h`` (``QK^T`` and ``softmax . V``, causality not discounted, as the
paper counts); the head ``2 h V``. Backward is twice the forward. One iteration on ``B``
sequences of ``s`` tokens, for f = 4 and a dense model::

    model FLOPs     72 B s L h^2 (1 + s/(6h) + V/(12 L h))    forward + backward
    full recompute  96 B s L h^2 (1 + s/(6h) + V/(16 L h))    + one more forward of the blocks
    selective       model FLOPs + 4 B s^2 h L                 attention core recomputed

MFU divides model FLOPs by time x peak; HFU the FLOPs the hardware really ran (with the
recomputation), as Korthikanti et al. 2022 report both. An MoE block's MLP costs ``top_k``
expert MLPs per token (capacity padding not counted).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A GPT's dimensions (module doc). ``seq_len`` is the position table's length."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    ffn_mult: int = 4
    tied: bool = False
    experts: int = 0  # 0: every MLP dense
    top_k: int = 2
    moe_every: int = 2
    name: str = "gpt"
    # The shape of families other than plait's GPT (Hugging Face configs: from_hf_config).
    # The defaults are plait's GPT; 0 means "derived" (ffn_mult * hidden, heads, hidden/heads).
    ffn_hidden: int = 0  # the MLP's inner width (Llama's intermediate_size)
    kv_heads: int = 0  # key/value heads (grouped-query attention)
    head_dim: int = 0
    gated: bool = False  # SwiGLU: gate, up and down projections (three matrices)
    qkv_bias: bool = True  # biases on the q, k, v projections
    bias: bool = True  # biases on the other linears (attention output, MLP)
    norm: str = "layernorm"  # "layernorm" (weight and bias) or "rmsnorm" (weight)
    qk_norm: bool = False  # RMSNorm of queries and keys per head (Qwen3)
    fused_qkv: bool = True  # one q/k/v projection tensor (plait's GPT, GPT-2) or three
    positions: str = "learned"  # "learned" (a table of seq_len rows) or "rope" (none)
    expert_ffn: int = 0  # an expert's inner width (0: ffn_hidden)
    shared_ffn: int = 0  # a shared expert's inner width beside the routed ones (Qwen-MoE)
    dense_at: tuple[int, ...] = ()  # blocks kept dense off the moe_every rule (mlp_only_layers)
    # the router renormalises its top-k weights (Mixtral; Qwen-MoE's norm_topk_prob), which
    # keeps their fp32 values and sum for the backward (plait.plan.activations)
    norm_topk: bool = True
    # What the implementation keeps for backward (plait.plan.activations), not the shape:
    # "gelu_new" is Hugging Face's tanh GeLU written in Python ops (GPT-2's default), which
    # keeps four tensors where a fused kernel ("gelu", "silu", ...) keeps its input only
    activation: str = "gelu"
    softmax_fp32: bool = False  # unfused attention's softmax computed in fp32 (HF's Llama)
    # a Hugging Face model (from_hf_config): its pipeline stages rebuild the rotary
    # embedding and the masks from their input (which sequence parallelism slices), so
    # plait runs it without SP inside a pipeline; its loss shifts its labels itself, which
    # cp inside a pipeline takes for the rope families (their plan's shifted_loss), not GPT-2
    hugging_face: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_at", tuple(sorted(set(self.dense_at))))
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in self.dense_at):
            raise ValueError(f"ModelSpec: dense_at={self.dense_at} must list block indices >= 0")
        for field in ("layers", "hidden", "heads", "vocab", "seq_len", "ffn_mult"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelSpec: {field} must be a whole number >= 1, got {value!r}")
        if self.hidden % self.heads and not self.head_dim:
            raise ValueError(
                f"ModelSpec: hidden={self.hidden} is not a multiple of heads={self.heads} "
                f"(give head_dim)"
            )
        if self.experts < 0 or self.experts == 1:
            raise ValueError(
                f"ModelSpec: experts={self.experts}; use 0 (dense) or at least 2 experts"
            )
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(
                f"ModelSpec: top_k={self.top_k} must be between 1 and experts={self.experts}"
            )
        if self.experts and self.moe_every < 1:
            raise ValueError(f"ModelSpec: moe_every={self.moe_every} must be at least 1")
        for field in ("ffn_hidden", "kv_heads", "head_dim", "expert_ffn", "shared_ffn"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelSpec: {field} must be a whole number >= 0, got {value!r}")
        if self.heads % self.kv:
            raise ValueError(
                f"ModelSpec: heads={self.heads} is not a multiple of kv_heads={self.kv}"
            )
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"ModelSpec: norm={self.norm!r}; use 'layernorm' or 'rmsnorm'")
        if self.positions not in ("learned", "rope"):
            raise ValueError(f"ModelSpec: positions={self.positions!r}; use 'learned' or 'rope'")

    # --- structure ------------------------------------------------------------------------
    def is_moe(self, index: int) -> bool:
        """Whether block ``index`` (from 0) has a mixture of experts: blocks moe_every-1,
        2 moe_every-1, ... unless listed in ``dense_at``."""
        return self.experts > 0 and (index + 1) % self.moe_every == 0 and index not in self.dense_at

    @property
    def moe_layers(self) -> int:
        """How many blocks have a mixture of experts (:meth:`is_moe`)."""
        return sum(self.is_moe(i) for i in range(self.layers)) if self.experts else 0

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    # --- derived shape ----------------------------------------------------------------------
    @property
    def ffn(self) -> int:
        """The MLP's inner width."""
        return self.ffn_hidden or self.ffn_mult * self.hidden

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def hd(self) -> int:
        """One head's width."""
        return self.head_dim or self.hidden // self.heads

    def norm_params(self) -> int:
        """One norm over the hidden size: ``2 h`` (LayerNorm) or ``h`` (RMSNorm)."""
        return (2 if self.norm == "layernorm" else 1) * self.hidden

    def attention_weights(self) -> int:
        """The four projections' weights: ``h (a + 2 k) d + a d h`` (``4 h^2`` without GQA)."""
        h, q, kv = self.hidden, self.heads * self.hd, self.kv * self.hd
        return h * (q + 2 * kv) + q * h

    def _mlp_weights(self, inner: int) -> int:
        return (3 if self.gated else 2) * inner * self.hidden

    def _mlp_biases(self, inner: int) -> tuple[int, int]:
        """(biases split by tensor parallelism, biases kept whole) of one MLP."""
        if not self.bias:
            return 0, 0
        return (2 if self.gated else 1) * inner, self.hidden

    def block_split(self, moe: bool = False) -> tuple[int, int]:
        """One block's parameters as (split by 1D tensor parallelism, kept whole): the
        projections and the q/k/v and up biases are split; the norms and the output biases
        are whole. An MoE block's sparse MLP is whole on every tensor-parallel rank, as
        plait's plans run it (:func:`plait.models.gpt.tp_plan` leaves it out,
        :func:`plait.models.mixtral.moe_tp_plan` keeps each sparse block whole): the router
        and Qwen2-MoE's shared expert and its gate are in the whole part (the routed experts
        are not included: EP splits them, tp does not). plait's GPT: ``((4 + 2 f) h^2 +
        (3 + f) h, 6 h)`` dense."""
        h = self.hidden
        q, kv = self.heads * self.hd, self.kv * self.hd
        split = self.attention_weights() + ((q + 2 * kv) if self.qkv_bias else 0)
        whole = 2 * self.norm_params() + (h if self.bias else 0)
        whole += 2 * self.hd if self.qk_norm else 0
        if not moe:
            up, down = self._mlp_biases(self.ffn)
            return split + self._mlp_weights(self.ffn) + up, whole + down
        # the sparse MLP, whole on every tp rank: the router, the shared expert and its gate
        return split, whole + h * self.experts + self._shared_params()

    def attention_params(self) -> int:
        """The projections, their biases and the block's norms (``4 h^2 + 8 h`` for plait's
        GPT)."""
        split, whole = self.block_split(moe=True)
        return split + whole - self.hidden * self.experts - self._shared_params()

    def _shared_params(self) -> int:
        if not self.shared_ffn:
            return 0
        return (
            self._mlp_weights(self.shared_ffn)
            + sum(self._mlp_biases(self.shared_ffn))
            + self.hidden
        )

    def mlp_params(self) -> int:
        """One routed expert, or the dense MLP when the model has no experts (plait's GPT:
        ``2 f h^2 + (f + 1) h``)."""
        inner = (self.expert_ffn or self.ffn) if self.experts else self.ffn
        return self._mlp_weights(inner) + sum(self._mlp_biases(inner))

    def block_params(self, moe: bool = False) -> int:
        split, whole = self.block_split(moe)
        if not moe:
            return split + whole
        return split + whole + self.experts * self.mlp_params()

    def block_tensors(self, moe: bool = False) -> int:
        """Parameter tensors of one block, routed experts not included (12 for plait's GPT's
        dense block, 9 for its MoE block): what per-tensor state (Adam's step) counts."""
        norm = 2 if self.norm == "layernorm" else 1
        qkv = 1 if self.fused_qkv else 3
        n = qkv + 1 + (qkv if self.qkv_bias else 0) + (1 if self.bias else 0) + 2 * norm
        n += 2 if self.qk_norm else 0
        if not moe:
            return n + self.mlp_tensors()
        return n + 1 + (self.mlp_tensors() + 1 if self.shared_ffn else 0)

    def mlp_tensors(self) -> int:
        """Tensors of one MLP or routed expert (an expert held as its own module)."""
        return (3 if self.gated else 2) * (2 if self.bias else 1)

    def embedding_tensors(self) -> int:
        return 2 if self.positions == "learned" else 1

    def embedding_params(self) -> int:
        table = self.seq_len if self.positions == "learned" else 0
        return (self.vocab + table) * self.hidden

    def head_params(self) -> int:
        """Final norm plus the head (the head counts 0 when tied to the embedding)."""
        return self.norm_params() + (0 if self.tied else self.vocab * self.hidden)

    @property
    def num_params(self) -> int:
        """Every parameter, counted once (module doc)."""
        return (
            self.dense_layers * self.block_params(False)
            + self.moe_layers * self.block_params(True)
            + self.embedding_params()
            + self.head_params()
        )

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (``top_k`` experts per MoE block)."""
        if not self.experts:
            return self.num_params
        inactive = self.moe_layers * (self.experts - self.top_k) * self.mlp_params()
        return self.num_params - inactive

    # --- FLOPs ----------------------------------------------------------------------------
    def flops_per_token(self, seq: int, *, recompute: str = "none") -> float:
        """Forward + backward FLOPs per token on sequences of ``seq`` tokens (module doc);
        ``recompute`` adds what the hardware runs again (HFU, not MFU)."""
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute={recompute!r}; use one of {list(RECOMPUTE)}")
        h = self.hidden
        core = self.attention_core_flops(seq)
        blocks_fwd = self.dense_layers * self.block_flops(seq, moe=False) + (
            self.moe_layers * self.block_flops(seq, moe=True)
        )
        head_fwd = 2 * h * self.vocab
        total = 3.0 * (blocks_fwd + head_fwd)
        if recompute == "full":
            total += blocks_fwd
        elif recompute == "selective":
            total += self.layers * core
        return total

    def attention_core_flops(self, seq: int) -> float:
        """Forward FLOPs per token of attention's two ``s x s`` products: ``4 s a d``."""
        return 4 * seq * self.heads * self.hd

    def block_flops_split(self, seq: int, *, moe: bool) -> tuple[float, float]:
        """:meth:`block_flops` as (split by 1D tensor parallelism, run whole by every tp
        rank): the projections and the attention core are split, so is a dense MLP; an MoE
        block's MLP (router, ``top_k`` experts, shared expert and gate) is whole on every
        tp rank (plait's plans, :meth:`block_split`), on the replicated input."""
        h = self.hidden
        split = 2 * self.attention_weights() + self.attention_core_flops(seq)
        if not moe:
            return split + 2 * self._mlp_weights(self.ffn), 0.0
        inner = self.expert_ffn or self.ffn
        whole = self.top_k * 2 * self._mlp_weights(inner) + 2 * h * self.experts
        if self.shared_ffn:
            whole += 2 * self._mlp_weights(self.shared_ffn) + 2 * h
        return split, whole

    def block_flops(self, seq: int, *, moe: bool) -> float:
        """Forward FLOPs per token of one block: ``2`` per weight of its projections and of
        the MLPs a token passes (``top_k`` experts, a shared one, the router), plus the
        attention core (``24 h^2 + 4 s h`` for plait's GPT, f = 4)."""
        split, whole = self.block_flops_split(seq, moe=moe)
        return split + whole

    def flops_per_iteration(self, *, batch: int, seq: int, recompute: str = "none") -> float:
        """``flops_per_token * batch * seq``: 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) for a
        dense f = 4 model without recomputation."""
        return self.flops_per_token(seq, recompute=recompute) * batch * seq

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"num_params": self.num_params}


def from_gpt_config(config: Any, *, name: str = "gpt") -> ModelSpec:
    """The spec of a :class:`plait.models.GPTConfig` (its MoE blocks included)."""
    moe = getattr(config, "moe", None)
    return ModelSpec(
        layers=config.layers,
        hidden=config.width,
        heads=config.heads,
        vocab=config.vocab,
        seq_len=config.seq_len,
        tied=config.tied,
        experts=moe.num_experts if moe is not None else 0,
        top_k=moe.top_k if moe is not None else 2,
        moe_every=config.moe_every,
        name=name,
    )


def from_param_count(
    num_params: float,
    *,
    layers: int | None = None,
    head_dim: int = 128,
    vocab: int = 51200,
    seq_len: int = 2048,
    tied: bool = True,
    name: str | None = None,
) -> ModelSpec:
    """A dense GPT of about ``num_params`` parameters.

    With ``layers`` given, ``hidden`` solves ``12 L h^2 + (13 L + V + s + 2) h = P``; without,
    the shape follows GPT-3's aspect ratio ``h = 128 L`` (175B: L = 96, h = 12288). ``hidden``
    is rounded to a multiple of ``head_dim`` (heads = hidden / head_dim), so the count is
    close to, not exactly, ``num_params`` (see ``.num_params``).
    """
    if num_params <= 0:
        raise ValueError(f"from_param_count: num_params={num_params!r} must be above 0")
    if layers is None:
        # 12 L h^2 with h = 128 L: P ~ 12 * 128^2 L^3
        layers = max(1, round((num_params / (12 * 128 * 128)) ** (1 / 3)))
    a, b, c = 12 * layers, 13 * layers + vocab + seq_len + 2, -float(num_params)
    h = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
    hidden = max(head_dim, round(h / head_dim) * head_dim)
    return ModelSpec(
        layers=layers,
        hidden=hidden,
        heads=hidden // head_dim,
        vocab=vocab,
        seq_len=seq_len,
        tied=tied,
        name=name or f"{num_params / 1e9:g}B",
    )


# Published models (the validation runs): Korthikanti et al. 2022, Table 3; PTD-P Table 1.
# vocab 51200, sequence 2048, tied embeddings (Megatron's GPT).
PUBLISHED: dict[str, dict[str, Any]] = {
    "22B": dict(layers=48, hidden=6144, heads=64),
    "175B": dict(layers=96, hidden=12288, heads=96),
    "530B": dict(layers=105, hidden=20480, heads=128),
    "1T": dict(layers=128, hidden=25600, heads=160),
}


def published(name: str) -> ModelSpec:
    """One of :data:`PUBLISHED` (Megatron's GPT: V = 51200, s = 2048, tied)."""
    if name not in PUBLISHED:
        raise ValueError(f"unknown published model {name!r}; use one of {list(PUBLISHED)}")
    return ModelSpec(vocab=51200, seq_len=2048, tied=True, name=name, **PUBLISHED[name])


__all__ = [
    "PUBLISHED",
    "RECOMPUTE",
    "ModelSpec",
    "from_gpt_config",
    "from_param_count",
    "published",
]
