"""Rank functions for tests/test_hf_tp.py: a Hugging Face LlamaForCausalLM handed whole to
``plait.prepare(strategy="tp")`` against the one-process oracle on the same global batch.

Each run: float64, eager attention, dropout off, 3 AdamW steps with two parameter groups
(decay: matrices; no decay: norms and biases), 2 accumulation micro-steps, the loss from the
model's own ``labels=``, ``plait.clip_grad_norm_(model.parameters(), MAX_NORM)`` active."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import plait
from plait import checkpoint

STEPS, MICRO, BATCH, SEQ = 3, 2, 2, 8
MAX_NORM = 0.5  # the gradients' norms are ~2..5: clipping acts on every step
VOCAB = 99  # not a multiple of 2 or 4: the vocabulary is padded on the split ranks


def _lm_types() -> tuple[type, ...]:
    from transformers import PreTrainedModel

    return (PreTrainedModel,)


LM_TYPES = _lm_types()


def llama(*, tied: bool, kv_heads: int, seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=SEQ,
        pad_token_id=0,
        tie_word_embeddings=tied,
        attention_dropout=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.float64)


def gpt2(*, tied: bool, seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tied,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).to(torch.float64)


def qwen3(*, tied: bool, kv_heads: int, seed: int = 0) -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=8,
        max_position_embeddings=SEQ,
        pad_token_id=0,
        tie_word_embeddings=tied,
        attention_dropout=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).to(torch.float64)


def titan(*, kv_heads: int, seed: int = 0) -> nn.Module:
    from tests.titan_model import Transformer

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # .to(float64) would drop the RoPE's imaginary part
    try:
        return Transformer(vocab=VOCAB, dim=32, layers=2, n_heads=4, n_kv_heads=kv_heads, seq=SEQ)
    finally:
        torch.set_default_dtype(default)


def build(family: str, *, tied: bool, kv_heads: int) -> nn.Module:
    if family in ("mixtral", "qwen2_moe", "qwen3_moe"):  # the load-balancing loss on
        from tests.hf_pipeline_fns import moe

        return moe(family, tied, vocab=VOCAB, aux=True)
    if family == "gpt2":
        return gpt2(tied=tied)
    if family == "qwen3":
        return qwen3(tied=tied, kv_heads=kv_heads)
    if family == "titan":
        return titan(kv_heads=kv_heads)
    return llama(tied=tied, kv_heads=kv_heads)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3}],
        lr=1e-2,
    )


def batch(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _train(model: nn.Module, opt: torch.optim.Optimizer, clip: Any) -> dict[str, Any]:
    losses, norms = [], []
    logits0 = None
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for micro in range(MICRO):
            ids = batch(step, micro)
            if isinstance(model, LM_TYPES):  # the model's own labels= loss
                out = model(input_ids=ids, labels=ids)
                logits, loss = out.logits, out.loss
            else:  # a model returning logits: next-token cross-entropy
                logits = model(ids)
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            if logits0 is None:
                logits0 = logits.detach().clone()
            (loss / MICRO).backward()
            total += loss.item() / MICRO
        norms.append(float(clip(model.parameters(), MAX_NORM)))
        opt.step()
        losses.append(total)
    return {"losses": losses, "norms": norms, "logits0": logits0}


def oracle(*, family: str = "llama", tied: bool, kv_heads: int = 2) -> dict[str, Any]:
    """One process, the dense model, the same batches."""
    model = build(family, tied=tied, kv_heads=kv_heads)
    out = _train(model, optimizer(model), torch.nn.utils.clip_grad_norm_)
    out["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def train(
    *, family: str = "llama", tied: bool, kv_heads: int = 2, sequence_parallel: bool = False
) -> dict[str, Any]:
    """Every rank of the world is one tensor-parallel rank; the model handed over whole."""
    model = build(family, tied=tied, kv_heads=kv_heads)
    dense = {n: p.numel() for n, p in model.named_parameters()}
    model, opt = plait.prepare(
        model,
        optimizer(model),
        strategy="tp",
        mesh=plait.Mesh(tp=plait.world().size),
        sequence_parallel=sequence_parallel,
    )
    assert opt is not None
    groups = [len(g["params"]) for g in opt.param_groups]
    hyper = [(g["lr"], g["weight_decay"]) for g in opt.param_groups]
    out = _train(model, opt, plait.clip_grad_norm_)
    out |= {
        "sequence_parallel": model.plait_tensor_parallel.sequence_parallel,  # type: ignore[union-attr]
        "state": checkpoint.full_state_dict(model),
        "dense_numel": dense,
        "local_numel": {n: p.numel() for n, p in model.named_parameters()},
        "groups": groups,
        "hyper": hyper,
    }
    if family == "gpt2":
        attn = model.transformer.h[0].attn
        out |= {
            "split_size": attn.split_size,
            "tied": model.lm_head.weight is model.transformer.wte.weight,
        }
        return out
    if family == "titan":
        attn = model.layers["0"].attention
        return out | {"kv_groups": attn.n_rep, "k_proj": type(attn.wk).__name__}
    attn = model.model.layers[0].self_attn
    out |= {
        "kv_groups": attn.num_key_value_groups,
        "k_proj": type(attn.k_proj).__name__,
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }
    return out


def seeded_apart() -> str:
    """Rank 1 builds its model from another seed: prepare must refuse, naming both."""
    rank = plait.world().rank
    model = llama(tied=False, kv_heads=2, seed=rank)
    try:
        plait.prepare(model, optimizer(model), strategy="tp", mesh=plait.Mesh(tp=2))
    except ValueError as exc:
        return str(exc)
    return "no error"


def _six_heads_three_kv() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=3,
    )
    return LlamaForCausalLM(config)


def _phi3() -> nn.Module:
    """No family plan, and none inferred: its forward slices the fused qkv_proj by
    config.num_attention_heads, which no per-rank attribute changes."""
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Phi3ForCausalLM(config)


class _ScaledLinear(nn.Linear):
    """A subclass with its own forward: splitting it as an nn.Linear would drop that."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * super().forward(x)


def _own_forward() -> nn.Module:
    model = titan(kv_heads=2)
    model.layers["0"].feed_forward.w1 = _ScaledLinear(32, 64, bias=False, dtype=torch.float64)
    return model


def refusals() -> dict[str, str]:
    """3 key/value heads over 2 ranks (2 divides neither 3 nor 3 divides 2), a model family
    with no plan whose plan cannot be inferred, a Linear subclass with its own forward: each
    refused naming what to change."""
    out = {}
    cases = {"kv": _six_heads_three_kv, "no_plan": _phi3, "own_forward": _own_forward}
    for name, build in cases.items():
        try:
            plait.prepare(build(), None, strategy="tp", mesh=plait.Mesh(tp=2))
            out[name] = "no error"
        except (ValueError, TypeError) as exc:
            out[name] = str(exc)
    return out


def nonfinite(policy: str) -> dict[str, Any]:
    """Rank 1 puts a NaN into its slice of one split weight's gradient before the step."""
    model = llama(tied=False, kv_heads=2)
    model, opt = plait.prepare(
        model, optimizer(model), strategy="tp", mesh=plait.Mesh(tp=2), check_finite=policy
    )
    assert opt is not None
    ids = batch(0, 0)
    model(input_ids=ids, labels=ids).loss.backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if plait.world().rank == 1:
        model.model.layers[1].mlp.up_proj.weight.grad[0, 0] = float("nan")
    try:
        opt.step()
    except FloatingPointError as exc:
        return {"error": str(exc)}
    same = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    return {"unchanged": same, "skipped": opt.plait_finite_check.skipped_steps}  # type: ignore[attr-defined]
