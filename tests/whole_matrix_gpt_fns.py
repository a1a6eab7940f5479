"""Rank functions for the whole-matrix optimizer tests on plait's GPT: Muon (or Adafactor)
for the blocks' hidden matrices, AdamW for the rest (embeddings, head, norms, biases), as
Muon is used; under tp (with and without sequence parallelism), pipeline, cp and ep
against one process on the global batch, in float64."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import plait
from plait import checkpoint
from plait.checkpoint.full import pipeline_of, unwrap
from plait.models import GPT, GPTConfig
from plait.models.gpt import MoEConfig

STEPS, BATCH, SEQ, VOCAB = 3, 4, 8, 14
HIDDEN = re.compile(
    r"blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(fc1|fc2)|mlp\.experts\.\d+\.fc[12])\.weight"
)


def make_gpt(moe: bool = False) -> GPT:
    moe_config = (
        MoEConfig(num_experts=4, top_k=1, drop_tokens=False, aux_loss_weight=0.0) if moe else None
    )
    return GPT(
        GPTConfig(
            vocab=VOCAB,
            layers=2,
            heads=4,
            width=16,
            seq_len=SEQ,
            dtype=torch.float64,
            moe=moe_config,
            moe_every=1,
        )
    )


def make_optimizers(model: nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    hidden = [p for n, p in model.named_parameters() if HIDDEN.fullmatch(n)]
    rest = [p for n, p in model.named_parameters() if not HIDDEN.fullmatch(n)]
    if kind == "muon":
        whole: torch.optim.Optimizer = torch.optim.Muon(
            hidden, lr=0.05, momentum=0.9, weight_decay=0.01
        )
    elif kind == "adafactor":
        whole = torch.optim.Adafactor(hidden, lr=0.02, weight_decay=0.01)
    elif kind == "shampoo":
        from pytorch_optimizer import Shampoo  # a user's optimizer: declared whole-matrix

        whole = Shampoo(hidden, lr=0.05, momentum=0.5)
    else:
        raise ValueError(kind)
    return [whole, torch.optim.AdamW(rest, lr=0.01, weight_decay=0.01)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _state(optimizers: list[torch.optim.Optimizer], names: dict[int, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for o in optimizers:
        slots = getattr(o, "plait_slots", None)
        if slots is not None:
            for slot, _, master in slots:
                if master is not None:
                    out[slot.name] = {
                        k: v.clone()
                        for k, v in o.state[master].items()
                        if isinstance(v, torch.Tensor) and v.dim() > 0
                    }
            continue
        for p, entry in o.state.items():
            if id(p) in names and HIDDEN.fullmatch(names[id(p)]):
                out[names[id(p)]] = {
                    k: v.clone()
                    for k, v in entry.items()
                    if isinstance(v, torch.Tensor) and v.dim() > 0
                }
    return out


def oracle(kind: str = "muon", moe: bool = False) -> dict[str, Any]:
    model = make_gpt(moe)
    optimizers = make_optimizers(model, kind)
    for step in range(STEPS):
        x, y = batch(step)
        for o in optimizers:
            o.zero_grad()
        F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        for o in optimizers:
            o.step()
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "params": {k: v.clone() for k, v in model.state_dict().items()},
        "state": _state(optimizers, names),
    }


def train(strategy: str, kind: str = "muon", **options: Any) -> dict[str, Any]:
    """``plait.prepare(gpt, [whole, adamw], strategy=...)`` on the world, STEPS steps."""
    from plait.strategies.context import shard_sequence
    from plait.strategies.tensor import loss_fn

    w = plait.world().size
    moe = strategy == "ep"
    model = make_gpt(moe)
    optimizers = make_optimizers(model, kind)
    if strategy == "tp":
        options["mesh"] = plait.Mesh(tp=w)
    elif strategy == "pipeline":
        options.update(mesh=plait.Mesh(pp=w), microbatches=2)
    elif strategy == "cp":
        options.update(mesh=plait.Mesh(cp=w), context="ring")
    elif strategy == "ep":
        options["mesh"] = plait.Mesh(ep=w)
    if kind == "shampoo":
        options["whole_matrix"] = [optimizers[0]]
    runner, optimizers = plait.prepare(model, optimizers, strategy=strategy, **options)
    loss_of = loss_fn(runner) if strategy == "tp" else None
    for step in range(STEPS):
        x, y = batch(step)
        for o in optimizers:
            o.zero_grad()
        if strategy == "pipeline":
            runner.step(x, y)
        elif strategy == "tp":
            assert loss_of is not None
            loss_of(runner(x), y).backward()
        elif strategy == "cp":
            mesh = options["mesh"]
            ids, _ = shard_sequence(x, mesh)
            targets, _ = shard_sequence(y, mesh)
            F.cross_entropy(runner(ids).reshape(-1, VOCAB), targets.reshape(-1)).backward()
        else:  # ep: each rank its rows of the batch
            n = BATCH // w
            rows = slice(plait.world().rank * n, (plait.world().rank + 1) * n)
            F.cross_entropy(runner(x[rows]).reshape(-1, VOCAB), y[rows].reshape(-1)).backward()
        for o in optimizers:
            o.step()
    inner = unwrap(runner)
    pipe = pipeline_of(inner)
    roots = list(pipe.stages.values()) if pipe is not None else [inner]
    names = {id(p): n for r in roots for n, p in r.named_parameters()}
    return {"params": checkpoint.full_state_dict(runner), "state": _state(optimizers, names)}


def ptdp_adafactor(oracle_only: bool = False) -> dict[str, torch.Tensor]:
    """One Adafactor over every parameter under ptdp with tp=1 and no ZeRO (whole
    parameters on every rank: the optimizer runs as it is), or one process."""
    model = make_gpt()
    # the matrices only: the key bias's gradient is rounding noise (softmax ignores it), and
    # Adafactor's normalised step turns any noise into a step of size lr
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.Adafactor([{"params": matrices}, {"params": rest, "lr": 0.0}], lr=0.02)
    if oracle_only:
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
            opt.step()
        return {k: v.clone() for k, v in model.state_dict().items()}
    mesh = plait.Mesh(pp=plait.world().size, dp=1, tp=1)
    ptdp, opt = plait.prepare(model, opt, strategy="ptdp", mesh=mesh, microbatches=2)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        ptdp.step(x, y)
        opt.step()
    return ptdp.full_state_dict()  # type: ignore[no-any-return]


LLAMA_HIDDEN = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight"
)


def llama_muon(under_tp: bool, sequence_parallel: bool = False) -> dict[str, Any]:
    """A Hugging Face Llama (tests/hf_tp_fns.py's, float64, 2 kv heads), Muon for its
    layers' matrices and AdamW for the rest, its own ``labels=`` loss, 3 steps; under
    ``strategy="tp"`` on the world (its family's plan) or in one process."""
    from tests.hf_tp_fns import batch as llama_batch
    from tests.hf_tp_fns import llama

    model = llama(tied=False, kv_heads=2)
    hidden = [p for n, p in model.named_parameters() if LLAMA_HIDDEN.fullmatch(n)]
    rest = [p for n, p in model.named_parameters() if not LLAMA_HIDDEN.fullmatch(n)]
    optimizers: list[torch.optim.Optimizer] = [
        torch.optim.Muon(hidden, lr=0.05, momentum=0.9, weight_decay=0.01),
        torch.optim.AdamW(rest, lr=0.01),
    ]
    runner: Any = model
    if under_tp:
        mesh = plait.Mesh(tp=plait.world().size)
        runner, optimizers = plait.prepare(
            model, optimizers, strategy="tp", mesh=mesh, sequence_parallel=sequence_parallel
        )
    for step in range(STEPS):
        ids = llama_batch(step, 0)
        for o in optimizers:
            o.zero_grad()
        runner(input_ids=ids, labels=ids).loss.backward()
        for o in optimizers:
            o.step()
    names = {id(p): n for n, p in runner.named_parameters()}
    state: dict[str, Any] = {}
    muon = optimizers[0]
    for slot, _, master in getattr(muon, "plait_slots", []):
        if master is not None:
            state[slot.name] = muon.state[master]["momentum_buffer"].clone()
    if not under_tp:
        state = {names[id(p)]: s["momentum_buffer"].clone() for p, s in muon.state.items()}
    return {"params": checkpoint.full_state_dict(runner), "state": state}


def ptdp_muon(pp: int, dp: int, tp: int, zero: int) -> dict[str, Any]:
    """Muon for the blocks' matrices and AdamW for the rest under ``strategy="ptdp"`` on
    ``Mesh(pp=.., dp=.., tp=..)`` (``zero`` over dp), STEPS steps of the global batch;
    the dense parameters and the Muon momentum this rank owns, by name."""
    model = make_gpt()
    optimizers = make_optimizers(model, "muon")
    mesh = plait.Mesh(pp=pp, dp=dp, tp=tp)
    ptdp, optimizers = plait.prepare(
        model, optimizers, strategy="ptdp", mesh=mesh, microbatches=2, zero=zero
    )
    for step in range(STEPS):
        x, y = batch(step)
        for o in optimizers:
            o.zero_grad()
        ptdp.step(x, y)
        for o in optimizers:
            o.step()
    muon = optimizers[0]
    state: dict[str, Any] = {}
    for slot, _, master in getattr(muon, "plait_slots", []):
        if master is not None and muon.state.get(master):
            state[slot.name] = {"momentum_buffer": muon.state[master]["momentum_buffer"].clone()}
    if not hasattr(muon, "plait_slots"):  # tp=1, no ZeRO: every rank its stage's, whole
        names = {id(c.param): c.name for c in ptdp.counted}
        state = {
            names[id(p)]: {"momentum_buffer": s["momentum_buffer"].clone()}
            for p, s in muon.state.items()
        }
    return {"params": ptdp.full_state_dict(), "state": state}
