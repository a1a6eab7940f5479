"""What :func:`~plait.models.infer.infer_tp_plan` reads from a model's structure before the
proof (steps 1-3 of :mod:`plait.models.infer`): the repeated blocks, their linears
classified by name into attention and MLP, the head counts and the attributes holding them
(:func:`find`, :class:`Found`); the refusal naming what could not be read and the plan to
write (:func:`refuse`); the example input the proof runs (:func:`example_input`)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.models.infer_source import plan_source, short_style
from plait.strategies.tensor.checks import computes_linear
from plait.strategies.tensor.plan import AttentionHeads, TensorPlan
from plait.strategies.tensor.style import Style

QUERY = ("q_proj", "q", "query", "wq", "q_lin")
KEY = ("k_proj", "k", "key", "wk", "k_lin")
VALUE = ("v_proj", "v", "value", "wv", "v_lin")
FUSED_QKV = ("qkv_proj", "qkv", "query_key_value", "c_attn", "wqkv", "Wqkv", "W_pack")
ATTN_OUT = ("o_proj", "o", "out_proj", "dense", "c_proj", "wo", "out_lin", "proj", "out")
MLP_IN = (
    "up_proj",
    "gate_proj",
    "gate_up_proj",
    "fc1",
    "c_fc",
    "fc_in",
    "w1",
    "w3",
    "up",
    "gate",
    "dense_h_to_4h",
    "wi",
    "wi_0",
    "wi_1",
    "lin1",
)
MLP_OUT = ("down_proj", "fc2", "c_proj", "fc_out", "w2", "dense_4h_to_h", "down", "wo", "lin2")

# config (or attention) attribute names, in the order they are read
HEADS_NAMES = ("num_attention_heads", "n_head", "num_heads", "n_heads")
KV_NAMES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_head_kv", "kv_heads")
WIDTH_NAMES = ("embed_dim", "hidden_size", "all_head_size", "split_size", "inner_dim")


class PlanInferenceError(ValueError):
    """No plan could be inferred safely; the message names the module and what to write."""


@dataclass(frozen=True)
class Linear:
    """One linear of the first block: its path inside the block, its shape, its layout."""

    path: str
    n_in: int
    n_out: int
    transposed: bool  # Hugging Face's Conv1D: weight [in, out]


@dataclass(frozen=True)
class Found:
    """What the structure says before the proof: the candidates the proof chooses among."""

    blocks: str  # "model.layers"
    attention: str  # path of the attention module inside a block ("self_attn")
    styles: dict[str, Style]  # relative path -> style (fused ones with blocks=1)
    fused: dict[str, tuple[int, ...]]  # relative path -> block counts to try
    heads: int
    kv_heads: int
    head_dim: int
    key_value: tuple[str, ...]
    attributes: dict[str, str]  # candidate attributes -> HEAD_COUNTS kind
    where: str  # the first block's attention module, for messages
    example: str  # the nearest plan, as source, for a refusal

    shared_kv: bool = False  # multi-query: key and value the whole tail of a fused qkv
    head_params: tuple[str, ...] = ()  # the attention's own per-head parameters (sinks)

    @property
    def heads_fields(self) -> dict[str, Any]:
        fields = {"heads": self.heads, "kv_heads": self.kv_heads, "key_value": self.key_value}
        fields |= {"head_params": self.head_params} if self.head_params else {}
        return fields | ({"shared_kv": True} if self.shared_kv else {})


def refuse(model: nn.Module, why: str, *, example: str | None = None) -> PlanInferenceError:
    """The refusal: what could not be inferred and the plan to write instead."""
    return PlanInferenceError(
        f"strategy 'tp' needs plan= for a {type(model).__name__}: no plan is known for its "
        f"family and none can be inferred safely: {why}. Write one (plait.strategies.tensor), "
        f"e.g.\n{example or EXAMPLE}\nand pass plait.prepare(..., strategy='tp', plan=plan)"
    )


EXAMPLE = """    plan = TensorPlan(
        styles={"layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise",
                "layers.*.attn.v": "colwise", "layers.*.attn.o": "rowwise",
                "layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise"},
        attention=(AttentionHeads("layers.*.attn", heads=8, kv_heads=2, key_value=("k", "v"),
                                  attributes={"n_heads": "heads"}),))
    # without attention a mapping is a plan: {"layers.0": "colwise", "layers.1": "rowwise"}"""


def _example(found_blocks: str, attention: str | None) -> str:
    """:data:`EXAMPLE` with the model's own block path and attention module."""
    text = EXAMPLE.replace("layers.*", f"{found_blocks}.*")
    return text if attention is None else text.replace(".attn", f".{attention}")


def _is_linear(module: nn.Module) -> bool | None:
    """True: a plain linear; False: a transposed one (Conv1D); None: not a linear."""
    if isinstance(module, nn.Linear):
        return True
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return False
    return None


def _matrix(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2


def repeated_blocks(model: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """The longest list of same-class modules holding linears, outermost first (the
    decoder's blocks), or None."""
    best: tuple[str, list[nn.Module]] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.ModuleDict) or not len(module):
            continue
        kids = list(module.children())
        if len({type(k) for k in kids}) != 1:
            continue
        # a block holds linear pairs (or their tensor-parallel forms: 2-D weights); a list of
        # bare linears is no block
        if sum(_is_linear(m) is not None or _matrix(m) for m in kids[0].modules()) < 2:
            continue
        if best is not None and name.startswith(f"{best[0]}."):
            continue  # a list inside a block (experts): the blocks come first
        if best is None or len(kids) > len(best[1]):
            best = (name, kids)
    return best


def _blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    best = repeated_blocks(model)
    if best is None:
        raise refuse(model, "it has no nn.ModuleList of repeated blocks holding linears")
    return best


def _linears(block: nn.Module, model: nn.Module, where: str) -> list[Linear]:
    out = []
    for path, module in block.named_modules():
        kind = _is_linear(module)
        if kind is None:
            continue
        if kind and not computes_linear(module):
            raise refuse(
                model,
                f"linear '{where}.{path}' is a {type(module).__name__}, a subclass of nn.Linear "
                f"whose own forward computes something else than x @ W.T + b (checked on a "
                f"random input), which a split would replace",
            )
        weight = module.weight
        n_out, n_in = weight.shape if kind else weight.shape[::-1]
        out.append(Linear(path, int(n_in), int(n_out), not kind))
    return out


def _read(sources: list[Any], names: tuple[str, ...]) -> int | None:
    for source in sources:
        for name in names:
            value = getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _classify(
    model: nn.Module, where: str, linears: list[Linear], *, sparse: bool = False
) -> dict[str, Any]:
    """Parent path -> its role and children by role; refuses a linear no rule classifies.
    ``sparse``: the block holds stacked experts, so it may have no MLP of linears."""
    parents: dict[str, dict[str, Linear]] = {}
    for lin in linears:
        parent, _, leaf = lin.path.rpartition(".")
        parents.setdefault(parent, {})[leaf] = lin
    attention: dict[str, Any] | None = None
    mlp: dict[str, Any] | None = None
    for parent, kids in parents.items():
        names = set(kids)
        inside = f"'{where}.{parent}'" if parent else f"'{where}'"
        qkv = [n for n in kids if n in FUSED_QKV]
        q, k, v = ([n for n in kids if n in group] for group in (QUERY, KEY, VALUE))
        if qkv or q or k or v:
            out = [n for n in kids if n in ATTN_OUT]
            ok = (len(qkv) == 1 and not (q or k or v)) or (len(q) == len(k) == len(v) == 1)
            if not ok or len(out) != 1 or attention is not None:
                raise refuse(
                    model,
                    f"attention {inside} has linears {sorted(names)}: expected q/k/v (or one "
                    f"fused qkv) and one output projection, in one attention module per block",
                    example=_example(where.rpartition(".")[0], parent or None),
                )
            roles = {"qkv": qkv, "q": q, "k": k, "v": v, "out": out}
            attention = {"path": parent, **{r: [kids[n] for n in ns] for r, ns in roles.items()}}
            names -= set(qkv + q + k + v + out)
        else:
            ins = [n for n in kids if n in MLP_IN]
            out = [n for n in kids if n in MLP_OUT]
            if ins and len(out) == 1 and len(ins) <= 2 and mlp is None:
                mlp = {"path": parent, "in": [kids[n] for n in ins], "out": kids[out[0]]}
                names -= set(ins + out)
        for leaf in sorted(names):
            raise refuse(
                model,
                f"linear '{where}.{parent + '.' if parent else ''}{leaf}' (in {inside}) is "
                f"neither an attention projection (q/k/v/o, query/key/value/dense, one fused "
                f"qkv) nor an MLP one (up/gate/fc1/c_fc, then down/fc2/c_proj)",
                example=_example(where.rpartition(".")[0], None),
            )
    if attention is None or (mlp is None and not sparse):
        missing = "an attention module" if attention is None else "an MLP"
        raise refuse(model, f"block '{where}' has no {missing} the rules recognise")
    return {"attention": attention, "mlp": mlp}


def find(model: nn.Module) -> Found:
    """The structure :func:`infer_tp_plan` reads, before the proof (module doc, steps 1-3)."""
    blocks_path, blocks = _blocks(model)
    first_name = next(iter(model.get_submodule(blocks_path)._modules))
    first = f"{blocks_path}.{first_name}" if blocks_path else first_name
    linears = _linears(blocks[0], model, first)
    shape = [(lin.path, lin.n_in, lin.n_out, lin.transposed) for lin in linears]
    for i, block in enumerate(blocks[1:], 1):
        other = [(x.path, x.n_in, x.n_out, x.transposed) for x in _linears(block, model, "")]
        if other != shape:
            raise refuse(
                model,
                f"block {i} of '{blocks_path}' holds other linears than block 0 "
                f"({sorted(set(other) ^ set(shape))[:3]}): the blocks differ, so one pattern "
                f"does not fit them all",
            )
    # stacked experts (3-D weights: a sparse block) stay whole on every rank
    sparse = any(p.dim() == 3 for p in blocks[0].parameters())
    roles = _classify(model, first, linears, sparse=sparse)
    attn, mlp = roles["attention"], roles["mlp"]
    attn_module = blocks[0].get_submodule(attn["path"]) if attn["path"] else blocks[0]
    # the model's config, else the one its attention holds (a model of one's own wrapping
    # Hugging Face layers), else the attention module's own attributes
    config = getattr(model, "config", None) or getattr(attn_module, "config", None)
    sources = [s for s in (config, attn_module) if s is not None]
    heads = _read(sources, HEADS_NAMES)
    where = f"attention '{first}.{attn['path']}'"
    example = _example(blocks_path, attn["path"] or None)
    if heads is None:
        raise refuse(
            model,
            f"{where}: its head count is not in the config nor the module "
            f"({', '.join(HEADS_NAMES)})",
            example=example,
        )
    kv = _read(sources, KV_NAMES) or (1 if getattr(config, "multi_query", False) else heads)
    (out,) = attn["out"]
    styles: dict[str, Style] = {}
    fused: dict[str, tuple[int, ...]] = {}
    key_value: tuple[str, ...] = ()
    shared_kv = False

    def rel(lin: Linear) -> str:
        return lin.path[len(attn["path"]) + 1 :] if attn["path"] else lin.path

    if attn["qkv"]:
        (qkv,) = attn["qkv"]
        head_dim = _read(sources, ("head_dim", "head_size")) or out.n_in // heads
        if qkv.n_out != (heads + 2 * kv) * head_dim and qkv.n_out == (heads + 2) * head_dim:
            kv = 1  # the shapes say multi-query, whatever the config's key/value count
        if qkv.n_out != (heads + 2 * kv) * head_dim:
            raise refuse(
                model,
                f"{where}: fused '{qkv.path}' has {qkv.n_out} outputs, not (heads {heads} + 2 x "
                f"kv heads {kv}) x head_dim {head_dim}, so its split is unclear",
                example=example,
            )
        if kv == 1 < heads and not qkv.transposed:
            # multi-query: the query rows split, the one key and value head whole on every rank
            styles[qkv.path] = Style("colwise", tail=2 * head_dim)
            shared_kv = True
        else:
            styles[qkv.path] = Style("colwise", transposed=qkv.transposed)
            fused[qkv.path] = (1, 3) if kv == heads else (1,)
    else:
        (q,), (k,), (v,) = attn["q"], attn["k"], attn["v"]
        head_dim = q.n_out // heads
        if q.n_out % heads or k.n_out != kv * head_dim or v.n_out != k.n_out:
            raise refuse(
                model,
                f"{where}: '{q.path}' has {q.n_out} outputs and '{k.path}' {k.n_out}, which "
                f"{heads} query and {kv} key/value heads of one width do not give",
                example=example,
            )
        for lin in (q, k, v):
            styles[lin.path] = Style("colwise", transposed=lin.transposed)
        key_value = (rel(k), rel(v))
    styles[out.path] = Style("rowwise", transposed=out.transposed)
    for lin in mlp["in"] if mlp else ():
        styles[lin.path] = Style("colwise", transposed=lin.transposed)
        if len(mlp["in"]) == 1:
            fused[lin.path] = (1, 2)  # fc1, or gate and up fused: the proof says which
    if mlp:
        styles[mlp["out"].path] = Style("rowwise", transposed=mlp["out"].transposed)
    attributes = _head_attributes(attn_module, heads, kv, head_dim)
    pattern = f"{blocks_path}.*" + (f".{attn['path']}" if attn["path"] else "")
    nearest = TensorPlan(
        styles={f"{blocks_path}.*.{p}": short_style(s) for p, s in styles.items()},
        attention=(
            AttentionHeads(
                pattern,
                heads=heads,
                kv_heads=kv,
                key_value=key_value,
                attributes=attributes or {"num_heads": "heads"},
                head_dim=head_dim,
            ),
        ),
    )
    return Found(
        blocks=blocks_path,
        attention=attn["path"],
        styles=styles,
        fused=fused,
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        key_value=key_value,
        attributes=attributes,
        shared_kv=shared_kv,
        head_params=tuple(
            n
            for n, p in attn_module.named_parameters(recurse=False)
            if p.dim() >= 1 and p.shape[0] == heads
        ),
        where=f"{first}.{attn['path']}" if attn["path"] else first,
        example="    plan = " + plan_source(nearest).replace("\n", "\n    "),
    )


def _head_attributes(module: nn.Module, heads: int, kv: int, head_dim: int) -> dict[str, str]:
    """The module's integer attributes that hold a head count or the query width, by name
    and value: the candidates the proof chooses among."""
    out = {}
    for name, value in vars(module).items():
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        low = name.lower()
        if ("kv" in low or "key_value" in low) and "group" not in low and value == kv:
            out[name] = "kv_heads"
        elif "group" in low and value == heads // kv:
            out[name] = "groups"
        elif "head" in low and "dim" not in low and "size" not in low and value == heads:
            out[name] = "heads"
        elif name in WIDTH_NAMES and value == heads * head_dim:
            out[name] = "width"
    return out


def example_input(model: nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Token ids ``(2, 5)`` below the input embedding's vocabulary; ``use_cache=False``
    where the forward takes it (no cache grows while the block is run again)."""
    embed = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embed is None:
        raise refuse(model, "it has no nn.Embedding to feed token ids to; pass example=")
    ids = torch.arange(10, device=embed.weight.device).reshape(2, 5) % embed.num_embeddings
    params = inspect.signature(model.forward).parameters
    return (ids,), ({"use_cache": False} if "use_cache" in params else {})
