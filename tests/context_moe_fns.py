"""Rank functions for tests/test_context_moe.py: Hugging Face MoE models (Mixtral, Qwen2-MoE
with a shared expert, Qwen3-MoE with a dense first layer) under
``plait.prepare(strategy="cp")`` with their load-balancing loss on, against one process on
the whole sequences (float64, 3 AdamW steps with two parameter groups).

The model is called with ``labels=`` and ``shift_labels=`` (this rank's shard of the
next-token targets: cp refuses ``labels=`` alone) and ``output_router_logits`` on, so it
records its routers' logits (under cp: gathered by plait) and computes its own loss in
float32. Training backpropagates the same total in float64: ``mean CE + COEF * aux``, with
``aux`` Hugging Face's load-balancing formula over the recorded logits (:func:`aux64`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import plait
from plait import comm
from plait.strategies.context import shard_sequence
from tests.hf_moe_layouts_fns import _refusal

STEPS, BATCH, SEQ, VOCAB, COEF = 3, 2, 16, 37, 0.5
ROUTER = {  # a router weight whose gradient is checked by name
    "mixtral": "model.layers.0.mlp.gate.weight",
    "qwen2_moe": "model.layers.0.mlp.gate.weight",
    "qwen3_moe": "model.layers.1.mlp.gate.weight",
}


def build(family: str) -> nn.Module:
    """A tiny random-init model of ``family``: 2 layers, 4 experts, top-2, float64, the
    load-balancing loss on (the same on every rank)."""
    import transformers as tf

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "num_experts_per_tok": 2,
        "output_router_logits": True,
        "router_aux_loss_coef": COEF,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
    }
    if family == "mixtral":
        cfg: Any = tf.MixtralConfig(**common, num_local_experts=4, router_jitter_noise=0.0)
        cls: Any = tf.MixtralForCausalLM
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(
            **common, moe_intermediate_size=24, shared_expert_intermediate_size=40,
            num_experts=4, norm_topk_prob=False, decoder_sparse_step=1,
        )  # fmt: skip
        cls = tf.Qwen2MoeForCausalLM
    else:
        cfg = tf.Qwen3MoeConfig(
            **common, head_dim=8, moe_intermediate_size=24, num_experts=4,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
        )  # fmt: skip
        cls = tf.Qwen3MoeForCausalLM
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"  # the loop over experts: float64 works
    torch.manual_seed(0)
    model: nn.Module = cls(cfg).to(torch.float64)
    model.train()
    return model


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-2,
    )


def tokens(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[rows, SEQ]`` and their next-token targets (skewed towards a few ids so
    that the routers are unbalanced and the auxiliary loss's gradient is not small)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g) % (VOCAB // 3 + 1 + step)
    return ids[:, :-1], ids[:, 1:]


def aux64(router_logits: tuple[torch.Tensor, ...], top_k: int = 2) -> torch.Tensor:
    """Hugging Face's load-balancing loss (``load_balancing_loss_func`` without a mask) in
    float64: the model's own runs in float32, whose rounding depends on the rows' order."""
    logits = torch.cat(router_logits)
    p = torch.softmax(logits, dim=-1)
    chosen = torch.topk(p, top_k, dim=-1).indices
    counts = F.one_hot(chosen, p.shape[-1]).sum((0, 1)).to(p.dtype)
    n = p.shape[0]
    return p.shape[-1] * torch.sum((counts / n) * (p.sum(0) / n))


def _forward(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor, pos: Any) -> Any:
    """The model's own loss (float32: Hugging Face upcasts) and the float64 total trained
    on: ``mean CE + COEF * aux`` from the router logits the model recorded."""
    targets = targets.contiguous()
    out = model(input_ids=ids, position_ids=pos, labels=targets, shift_labels=targets)
    ce = F.cross_entropy(out.logits.reshape(-1, VOCAB), targets.reshape(-1))
    aux = aux64(out.router_logits)
    return out, ce + COEF * aux, aux


def oracle(family: str, dp: int = 1) -> dict[str, Any]:
    """One process on the whole sequences of the global batch (``dp`` slices of BATCH)."""
    model = build(family)
    opt = optimizer(model)
    losses, aux, hf, grads = [], [], [], {}
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH * dp, -1)
    for step in range(STEPS):
        ids, targets = tokens(step, BATCH * dp)
        opt.zero_grad()
        out, total, a = _forward(model, ids, targets, pos)
        total.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(float(total.detach()))
        aux.append(float(a.detach()))
        hf.append(float(out.loss.detach()))
        opt.step()
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    return {"losses": losses, "aux": aux, "hf": hf, "grads": grads, "state": state}


def train(
    family: str, context: str, dp: int = 1, tp: int = 1, sequence_parallel: bool = False
) -> dict[str, Any]:
    """plait.prepare(strategy='cp') on Mesh(cp=world/(dp*tp)[, dp][, tp]): STEPS AdamW
    steps, each rank on its dp slice of the batch and its chunks of every sequence; the
    reported loss is the mean over the cp x dp ranks (the global mean)."""
    w = plait.world().size
    shape = {"cp": w // (dp * tp)} | ({"dp": dp} if dp > 1 else {}) | ({"tp": tp} if tp > 1 else {})
    mesh = plait.Mesh(**shape)
    model = build(family)
    opt = optimizer(model)
    sp = {"sequence_parallel": True} if sequence_parallel else {}
    runner, opt = plait.prepare(model, opt, strategy="cp", mesh=mesh, context=context, **sp)
    assert opt is not None
    d = mesh.rank("dp") if dp > 1 else 0
    sub = mesh.submesh("cp", "dp") if dp > 1 else mesh.submesh("cp")
    avg = sub.group(*sub.names)  # the ranks with their own tokens
    losses, aux, hf, grads = [], [], [], {}
    for step in range(STEPS):
        ids, targets = tokens(step, BATCH * dp)
        rows = slice(d * BATCH, (d + 1) * BATCH)
        ids, pos = shard_sequence(ids[rows], mesh)
        targets, _ = shard_sequence(targets[rows], mesh)
        opt.zero_grad()
        out, total, a = _forward(runner, ids, targets, pos.expand(ids.shape[0], -1))
        total.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        mean = torch.stack([total.detach(), out.loss.detach().double()])
        comm.all_reduce(mean, "avg", group=avg)  # the mean over every rank's tokens
        losses.append(float(mean[0]))
        hf.append(float(mean[1]))
        aux.append(float(a.detach()))
        opt.step()
    if tp > 1:
        from plait import checkpoint

        state = dict(checkpoint.full_state_dict(model))
        router = ROUTER[family]  # the sparse blocks are whole on every tp rank
        grads = {router: grads[router]}  # the rest are tp shards: the parameters compare
    else:
        state = {k: v.detach().clone() for k, v in model.named_parameters()}
    return {"losses": losses, "aux": aux, "hf": hf, "grads": grads, "state": state}


def refusals() -> dict[str, str]:
    """Every rank's error for what cp does not make exact, each raised before any step."""
    from plait.models.gpt import GPT, GPTConfig, MoEConfig
    from plait.strategies.context import prepare_cp

    n = plait.world().size
    mesh = plait.Mesh(cp=n)
    ids, targets = tokens(0, BATCH)
    ids, pos = shard_sequence(ids, mesh)
    targets, _ = shard_sequence(targets, mesh)
    pos = pos.expand(BATCH, -1)

    def own_moe() -> None:  # plait's GShard layer: groups and capacity per call
        cfg = GPTConfig(vocab=23, layers=2, heads=4, width=16, seq_len=SEQ, moe=MoEConfig(4))
        plait.prepare(GPT(cfg), None, strategy="cp", mesh=mesh)

    def ep_mesh() -> None:  # expert parallelism is strategy 'ep' (or 'ptdp')
        plait.prepare(build("mixtral"), None, strategy="cp", mesh=plait.Mesh(cp=n, ep=1))

    def no_plan() -> None:  # prepare_cp called directly, without the family's MoE plan
        prepare_cp(build("mixtral"), None, mesh=mesh)

    runner, _ = plait.prepare(build("mixtral"), None, strategy="cp", mesh=mesh)

    def labels_alone() -> None:  # the model would shift them inside this rank's chunks
        runner(input_ids=ids, position_ids=pos, labels=targets.contiguous())

    def mask_with_aux() -> None:  # an all-ones mask: the load-balancing loss would read it
        runner(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids))

    return {
        "own_moe": _refusal(own_moe),
        "ep_mesh": _refusal(ep_mesh),
        "no_plan": _refusal(no_plan),
        "labels_alone": _refusal(labels_alone),
        "mask_with_aux": _refusal(mask_with_aux),
    }
