"""A training job and a parallel layout, and the rules a layout must obey.

A :class:`Layout` places ``world = dp * tp * cp * pp * ep`` ranks on the grid of
:class:`plait.Mesh` (innermost first: ``tp, cp, ep, dp, pp``; PTD-P's and Megatron's order,
tensor ranks adjacent, pipeline stages furthest apart). Each pipeline rank holds ``v`` chunks of
``layers / (pp * v)`` blocks; the global batch of ``global_batch`` sequences is cut into
``dp * ep`` data shards (expert-parallel ranks see different tokens: the dense part of the
model is data-parallel over ``dp * ep``, each expert over ``dp``), each shard into
``m = global_batch / (dp * ep * microbatch)`` micro-batches of ``microbatch`` sequences.
Context parallelism (``cp``, :mod:`plait.strategies.context`) cuts every sequence into
``cp`` pieces of ``seq / cp`` tokens, one per cp rank (``context="ring"``: keys and values
travel around the cp ring; ``"ulysses"``: all-to-alls to split heads instead): the cp ranks
of a data shard see the same sequences, so gradients are averaged over ``dp * ep * cp``
ranks (:attr:`Layout.replicas`), which ZeRO shards over.

:func:`check` refuses a layout the model, the job or the schedule cannot take, naming the
constraint and what to change (``"tp=3 does not divide heads=16"``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from plait.plan.model import RECOMPUTE, ModelSpec
from plait.plan.tensor_costs import grid_of

SCHEDULES = ("none", "gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
TP_MODES = ("1d", "2d", "2.5d", "3d")
PRECISIONS = ("mixed", "fp32")
CONTEXTS = ("ring", "ulysses")


class LayoutError(ValueError):
    """A layout the model, the job or the cluster cannot take; the message names why."""


@dataclass(frozen=True, kw_only=True)
class Job:
    """What is trained: ``global_batch`` sequences of ``seq`` tokens per optimizer step.

    ``precision``: ``"mixed"`` (16-bit parameters, gradients and activations, fp32 master
    copy and Adam state: 16 bytes per parameter) or ``"fp32"``. ``dropout``: whether the
    model keeps dropout masks (1 byte per element, Korthikanti et al.'s count).
    ``pp_scatter_gather``: how pipeline messages cross a tp group (comment below)."""

    global_batch: int
    seq: int
    precision: str = "mixed"
    optimizer: str = "adam"
    # "muon": the blocks' hidden matrices take Muon, stepped by parameter ownership
    # (plait.plan.whole_matrix); None: ``optimizer`` on every parameter
    whole_matrix: str | None = None
    dropout: bool = True
    # pipeline messages cut over tp and all-gathered by the receiver (PTD-P 4.1, Megatron);
    # False: every tp rank sends the whole activation (plait's compose without SP)
    pp_scatter_gather: bool = True
    # fused attention (FlashAttention, PyTorch's SDPA): no s x s tensor kept; the backward
    # recomputes the scores (one more s x s product per head: half selective's extra FLOPs)
    flash_attention: bool = False
    # with flash_attention: the kernel skips the tiles the causal mask hides entirely
    # (FlashAttention-2's causal path, Dao 2023 section 3.1.1; PyTorch's SDPA with
    # is_causal=True on its flash backend), so about half of the attention core's s x s
    # products (QK^T, PV, the backward's and the recomputed scores) run: causal_share.
    # False: a fused kernel that runs the whole square. An unfused attention (Megatron-LM's
    # 2021-2022 baddbmm + fused masked softmax + bmm) runs the whole square whatever this says.
    causal_skip: bool = True

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.seq < 1:
            raise LayoutError(
                f"Job: global_batch={self.global_batch} and seq={self.seq} must be >= 1"
            )
        if self.precision not in PRECISIONS:
            raise LayoutError(f"Job: precision={self.precision!r}; use one of {list(PRECISIONS)}")
        if self.whole_matrix not in (None, "muon"):
            raise LayoutError(f"Job: whole_matrix={self.whole_matrix!r}; use 'muon' or None")

    @property
    def causal_share(self) -> float:
        """Share of the attention core's ``s x s`` FLOPs the kernel runs: 1/2 for a fused
        kernel that skips the causal mask's hidden tiles (the diagonal's tiles, half masked,
        add ``tile / 2s``: under 2% of the core at s >= 4096 with 128-wide tiles, not
        counted), 1 otherwise."""
        return 0.5 if self.flash_attention and self.causal_skip else 1.0

    @property
    def element_bytes(self) -> int:
        """Bytes of one activation or gradient element."""
        return 2 if self.precision == "mixed" else 4

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Degrees of parallelism and the choices that go with them (module doc)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    v: int = 1  # model chunks per pipeline rank (interleaved: >= 2; zbv, dualpipev: 2)
    schedule: str = "none"  # "none" when pp == 1
    microbatch: int = 1  # sequences per micro-batch
    zero: int = 0  # ZeRO stage over the data-parallel group: 0, 1, 2, 3 (3 = FSDP)
    recompute: str = "none"  # "none", "selective" (attention core), "full" (whole blocks)
    sp: bool = False  # sequence parallelism over tp (1D only)
    tp_mode: str = "1d"
    depth: int = 1  # 2.5D only: tp = depth * q * q
    cp: int = 1  # context parallelism: each sequence cut over cp ranks
    context: str = "ring"  # cp's attention: "ring" or "ulysses" (read when cp > 1)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.cp * self.pp * self.ep

    @property
    def replicas(self) -> int:
        """Ranks holding the same dense parameters (outside tp and pp), over which the
        gradients are averaged and ZeRO shards: ``dp * ep * cp``."""
        return self.dp * self.ep * self.cp

    def tokens(self, job: Job) -> int:
        """Tokens of one micro-batch on one rank: ``microbatch * seq / cp``."""
        return self.microbatch * job.seq // self.cp

    @property
    def data_shards(self) -> int:
        """Ranks that see different tokens: ``dp * ep``."""
        return self.dp * self.ep

    def microbatches(self, job: Job) -> int:
        return job.global_batch // (self.data_shards * self.microbatch)

    def label(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}"]
        if self.tp_mode != "1d":
            depth = f",d{self.depth}" if self.tp_mode == "2.5d" else ""
            parts[-1] += f"({self.tp_mode}{depth})"
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        parts.append(f"pp{self.pp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        text = "x".join(parts)
        if self.pp > 1:
            text += f" {self.schedule}" + (f" v{self.v}" if self.v > 1 else "")
        if self.cp > 1:
            text += f" {self.context}"
        text += f" b{self.microbatch}"
        if self.zero:
            text += f" zero{self.zero}"
        if self.sp:
            text += " sp"
        if self.recompute != "none":
            text += f" rc:{self.recompute}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check(model: ModelSpec, job: Job, layout: Layout, *, world: int | None = None) -> None:
    """Raise :class:`LayoutError` naming the first constraint ``layout`` breaks."""
    lay = layout
    for name in ("dp", "tp", "cp", "pp", "ep", "v", "microbatch", "depth"):
        value = getattr(lay, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LayoutError(f"{name}={value!r} must be a whole number >= 1")
    if world is not None and lay.world != world:
        raise LayoutError(
            f"dp*tp*cp*pp*ep = {lay.dp}*{lay.tp}*{lay.cp}*{lay.pp}*{lay.ep} = {lay.world} "
            f"ranks, but the "
            f"cluster has {world}; change a degree so the product is {world}"
        )
    if job.seq > model.seq_len and model.positions == "learned":
        raise LayoutError(
            f"seq={job.seq} exceeds the model's seq_len={model.seq_len} (its position table)"
        )
    _check_cp(model, job, lay)
    if lay.tp_mode not in TP_MODES:
        raise LayoutError(f"tp_mode={lay.tp_mode!r}; use one of {list(TP_MODES)}")
    if lay.tp_mode == "1d":
        if model.heads % lay.tp:
            raise LayoutError(f"tp={lay.tp} does not divide heads={model.heads}")
    else:
        try:
            q, _ = grid_of(lay.tp_mode, lay.tp, lay.depth if lay.tp_mode == "2.5d" else None)
        except ValueError as e:
            raise LayoutError(f"tp={lay.tp} with tp_mode={lay.tp_mode!r}: {e}") from None
        if model.hidden % q or model.heads % q:
            raise LayoutError(
                f"tp_mode={lay.tp_mode!r}: the grid side q={q} must divide hidden="
                f"{model.hidden} and heads={model.heads}"
            )
        if lay.sp:
            raise LayoutError(f"sp=True is 1D's sequence parallelism; tp_mode={lay.tp_mode!r}")
    if lay.depth != 1 and lay.tp_mode != "2.5d":
        raise LayoutError(f"depth={lay.depth} is 2.5D's; tp_mode={lay.tp_mode!r} takes depth=1")
    if lay.sp and lay.tp == 1:
        raise LayoutError("sp=True needs tp >= 2 (sequence parallelism splits over tp)")
    if lay.recompute not in RECOMPUTE:
        raise LayoutError(f"recompute={lay.recompute!r}; use one of {list(RECOMPUTE)}")
    if lay.zero not in (0, 1, 2, 3):
        raise LayoutError(f"zero={lay.zero!r}; use a ZeRO stage 0, 1, 2 or 3")
    if lay.zero >= 2 and lay.pp > 1:
        raise LayoutError(
            f"zero={lay.zero} with pp={lay.pp}: ZeRO-2/3 shard the gradients that the "
            f"micro-batches of a pipeline accumulate (DeepSpeed refuses it too); use zero<=1"
        )
    if lay.ep > 1 and not model.experts:
        raise LayoutError(f"ep={lay.ep} but the model has no experts (experts=0); use ep=1")
    if model.experts and model.experts % lay.ep:
        raise LayoutError(f"ep={lay.ep} does not divide experts={model.experts}")
    if lay.ep > 1 and lay.zero:
        raise LayoutError(
            f"ep={lay.ep} with zero={lay.zero}: plait averages expert gradients over dp and "
            f"the others over dp x ep, which one ZeRO shard over dp cannot; use zero=0"
        )
    if lay.sp and lay.pp > 1 and model.hugging_face:
        raise LayoutError(
            f"sp=True with pp={lay.pp} for a Hugging Face model: each pipeline stage rebuilds "
            f"the rotary embedding and the masks from its input, which sequence parallelism "
            f"slices; plait runs it with sp=False or pp=1"
        )
    if model.experts and lay.sp and (lay.ep > 1 or not model.hugging_face):
        raise LayoutError(
            f"sp=True with MoE blocks{f' split over ep={lay.ep}' if lay.ep > 1 else ''}: "
            f"plait does not run it (each tp rank would route or dispatch its slice of the "
            f"sequence); use sp=False"
        )
    # schedule
    if lay.pp == 1:
        if lay.schedule != "none" or lay.v != 1:
            raise LayoutError(
                f"pp=1 runs no pipeline: use schedule='none' and v=1 "
                f"(got schedule={lay.schedule!r}, v={lay.v})"
            )
    elif lay.schedule not in SCHEDULES[1:]:
        raise LayoutError(
            f"pp={lay.pp} needs a schedule among {list(SCHEDULES[1:])}, got {lay.schedule!r}"
        )
    elif lay.schedule in ("gpipe", "1f1b", "zb-h1") and lay.v != 1:
        raise LayoutError(f"schedule {lay.schedule!r} runs one chunk per rank; v={lay.v}, use v=1")
    elif lay.schedule == "interleaved" and lay.v < 2:
        raise LayoutError(f"schedule 'interleaved' needs v >= 2 chunks per rank, got v={lay.v}")
    elif lay.schedule in ("zbv", "dualpipev") and lay.v != 2:
        raise LayoutError(
            f"schedule {lay.schedule!r} runs v=2 chunks per rank (the V), got v={lay.v}"
        )
    if model.layers % (lay.pp * lay.v):
        raise LayoutError(
            f"pp*v = {lay.pp}*{lay.v} = {lay.pp * lay.v} does not divide layers={model.layers}; "
            f"every chunk holds the same number of blocks"
        )
    per_step = lay.data_shards * lay.microbatch
    if job.global_batch % per_step:
        raise LayoutError(
            f"global_batch={job.global_batch} is not a multiple of dp*ep*microbatch = "
            f"{lay.dp}*{lay.ep}*{lay.microbatch} = {per_step}"
        )
    m = lay.microbatches(job)
    if lay.schedule == "dualpipev" and m < 2 * lay.pp:
        raise LayoutError(
            f"schedule 'dualpipev' needs microbatches m >= 2*pp = {2 * lay.pp}, got m={m}"
        )
    if lay.schedule == "interleaved" and m % lay.pp:
        raise LayoutError(
            f"schedule 'interleaved' needs microbatches m={m} to be a multiple of pp={lay.pp}"
        )


def _check_cp(model: ModelSpec, job: Job, lay: Layout) -> None:
    """The context-parallel constraints (:mod:`plait.strategies.context` refuses the same)."""
    if lay.context not in CONTEXTS:
        raise LayoutError(f"context={lay.context!r}; use one of {list(CONTEXTS)}")
    if lay.cp == 1:
        return
    if lay.tp_mode != "1d":
        raise LayoutError(f"cp={lay.cp} with tp_mode={lay.tp_mode!r}: cp composes with 1D tp")
    if model.experts and not model.hugging_face:
        raise LayoutError(
            f"cp={lay.cp} with MoE blocks in plait's GShard layer, whose groups and capacity "
            f"are the tokens one call sees (under cp a chunk of each sequence); use cp=1 (cp "
            f"runs Hugging Face MoE blocks, with tp, dp, pp and ep)"
        )
    if lay.zero and lay.pp > 1:
        raise LayoutError(
            f"cp={lay.cp} with zero={lay.zero} and pp={lay.pp}: PTD-P's ZeRO reduces over dp "
            f"only, not dp x cp; use zero=0 (strategy 'cp' without a pipeline takes zero=1-3)"
        )
    if lay.sp and lay.zero == 3:
        raise LayoutError(
            f"cp={lay.cp} with sp and zero=3: FSDP's flat shards replace the norms whose "
            f"gradients the sequence regions sum over tp; use zero 0-2 with sp"
        )
    if lay.pp > 1 and model.hugging_face and model.positions != "rope":
        raise LayoutError(
            f"cp={lay.cp} with pp={lay.pp}: the model's loss shifts its labels itself and "
            f"its pipeline plan (GPT-2's) has no shifted_loss, which the sequence chunks of "
            f"cp need inside a pipeline; plait runs cp x pp for the Llama family and plait's "
            f"GPT, this model with cp and pp=1"
        )
    if lay.context == "ring" and job.seq % (2 * lay.cp):
        raise LayoutError(
            f"cp={lay.cp} (ring): seq={job.seq} must divide into 2*cp = {2 * lay.cp} equal "
            f"chunks (the load-balanced causal layout)"
        )
    if lay.context == "ulysses" and (model.heads % (lay.tp * lay.cp) or job.seq % lay.cp):
        raise LayoutError(
            f"cp={lay.cp} (ulysses): tp*cp = {lay.tp * lay.cp} must divide heads="
            f"{model.heads} and cp the seq={job.seq}"
        )


__all__ = [
    "CONTEXTS",
    "PRECISIONS",
    "SCHEDULES",
    "TP_MODES",
    "Job",
    "Layout",
    "LayoutError",
    "check",
]
