"""Rank functions for tests/test_hf_pipeline.py: Hugging Face models handed whole to
``plait.prepare(strategy="pipeline")`` against one process on the global batch, the
wrap-time agreement and the non-finite check."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import plait

STEPS = 3
ACCUMULATE = 2  # micro-steps (step() calls) per optimizer step
BATCH, SEQ = 4, 8
MAX_NORM = 0.05  # below every step's gradient norm: clipping is active


def llama(tied: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch.float64)


def gpt2(tied: bool) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=97,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).to(torch.float64)


def same_layout(family: str) -> nn.Module:
    """Mistral (sliding window on every layer), Qwen2 (full and sliding layers by
    ``layer_types``), Qwen3 (q/k norms): the families read by the Llama plan."""
    import transformers as hf

    common: dict[str, Any] = {
        "vocab_size": 97,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "attn_implementation": "eager",
    }
    cfg, cls = {
        "mistral": (hf.MistralConfig(**common, sliding_window=4), hf.MistralForCausalLM),
        "qwen2": (
            hf.Qwen2Config(
                **common, use_sliding_window=True, sliding_window=4, max_window_layers=1
            ),
            hf.Qwen2ForCausalLM,
        ),
        "qwen3": (hf.Qwen3Config(**common, head_dim=8), hf.Qwen3ForCausalLM),
    }[family]
    torch.manual_seed(0)
    return cls(cfg).to(torch.float64)  # type: ignore[no-any-return]


def moe(family: str, tied: bool, *, vocab: int = 97, aux: bool = False) -> nn.Module:
    """A tiny Mixtral, Qwen2-MoE (shared expert; layer 1 a dense MLP) or Qwen3-MoE (q/k
    norms), 4 experts, top-2; the load-balancing loss on with ``aux`` (the pipeline
    refuses it)."""
    import transformers as hf

    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "num_experts_per_tok": 2,
        "output_router_logits": aux,
        "router_aux_loss_coef": 0.1,
        "tie_word_embeddings": tied,
    }
    if family == "mixtral":
        cfg: Any = hf.MixtralConfig(**common, num_local_experts=4, router_jitter_noise=0.0)
        cls: Any = hf.MixtralForCausalLM
    elif family == "qwen2_moe":
        cfg = hf.Qwen2MoeConfig(
            **common, moe_intermediate_size=24, shared_expert_intermediate_size=40,
            num_experts=4, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
        )  # fmt: skip
        cls = hf.Qwen2MoeForCausalLM
    else:
        cfg = hf.Qwen3MoeConfig(
            **common, head_dim=8, moe_intermediate_size=24, num_experts=4,
            norm_topk_prob=True, decoder_sparse_step=1,
        )  # fmt: skip
        cls = hf.Qwen3MoeForCausalLM
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # the loop over experts: float64 works
    torch.manual_seed(0)
    return cls(cfg).to(torch.float64)  # type: ignore[no-any-return]


MODELS = {
    "llama": llama,
    "gpt2": gpt2,
    "mixtral": lambda tied: moe("mixtral", tied),
    "qwen2_moe": lambda tied: moe("qwen2_moe", tied),
    "qwen3_moe": lambda tied: moe("qwen3_moe", tied),
    # the load-balancing loss on (kept under the pipeline by a statistics pass)
    "mixtral+aux": lambda tied: moe("mixtral", tied, aux=True),
    "qwen2_moe+aux": lambda tied: moe("qwen2_moe", tied, aux=True),
    "qwen3_moe+aux": lambda tied: moe("qwen3_moe", tied, aux=True),
}
EMBEDDING = {"llama": "model.embed_tokens.weight", "gpt2": "transformer.wte.weight"}


def batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and Hugging Face labels (unshifted), with ignored labels (-100) spread
    unevenly over the micro-batches."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 2:6] = -100
    labels[3, 5] = -100
    return ids, labels


def optimizer(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """AdamW with two groups: matrices decay, vectors (norms, biases) do not, at another lr."""
    decay = [p for _, p in named if p.dim() >= 2]
    rest = [p for _, p in named if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1},
            {"params": rest, "weight_decay": 0.0, "lr": 2e-2},
        ],
        lr=1e-2,
    )


def oracle(family: str, tied: bool) -> dict[str, Any]:
    """One process on the global batch: the model's own labels= loss, ACCUMULATE backward
    passes per step, torch's clipping, AdamW with two groups."""
    return one_process(MODELS[family](tied))


def one_process(model: nn.Module) -> dict[str, Any]:
    """:func:`oracle` for a given model."""
    opt = optimizer(list(model.named_parameters()))
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(ACCUMULATE):
            ids, labels = batch(ACCUMULATE * step + micro, model.config.vocab_size)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
    return {"state": dict(model.state_dict()), "losses": losses, "norms": norms}


def train(family: str, tied: bool, schedule: str, m: int) -> dict[str, Any]:
    """The same run through plait.prepare(strategy="pipeline") on Mesh(pp=world)."""
    return run(MODELS[family](tied), schedule, m)


def run(model: nn.Module, schedule: str, m: int) -> dict[str, Any]:
    """``model`` trained as :func:`oracle` trains it, through plait.prepare(strategy=
    "pipeline") on Mesh(pp=world)."""
    opt = optimizer(list(model.named_parameters()))
    pipe, popt = plait.prepare(
        model, opt, strategy="pipeline", mesh=plait.Mesh(pp=plait.world().size),
        schedule=schedule, microbatches=m,
    )  # fmt: skip
    assert popt is not None
    groups = [{k: v for k, v in g.items() if k != "params"} for g in popt.param_groups]
    losses, norms = [], []
    for step in range(STEPS):
        popt.zero_grad()
        for micro in range(ACCUMULATE):
            ids, labels = batch(ACCUMULATE * step + micro, model.config.vocab_size)
            losses.append(pipe.step(ids, labels).item())
        norms.append(plait.clip_grad_norm_(pipe.parameters(), MAX_NORM).item())
        popt.step()
    return {
        "state": pipe.dense_state_dict(),
        "losses": losses,
        "norms": norms,
        "groups": groups,
        "partition": str(pipe.partition),
        "split": {s: r.describe() for s, r in pipe.split_reports.items()},
    }


def disagree(bad_rank: int) -> str:
    """Rank ``bad_rank`` asks for another schedule; every rank's error."""
    world = plait.world()
    model = nn.Sequential(*(nn.Linear(4, 4, dtype=torch.float64) for _ in range(world.size)))
    schedule = "gpipe" if world.rank == bad_rank else "1f1b"
    try:
        plait.prepare(
            model, None, strategy="pipeline", mesh=plait.Mesh(pp=world.size),
            schedule=schedule, microbatches=4, loss_fn=nn.MSELoss(),
        )  # fmt: skip
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "NO ERROR"


def nonfinite(policy: str, bad_rank: int) -> dict[str, Any]:
    """A Llama on pp=world; after one good step, rank ``bad_rank`` puts a NaN into one
    weight of its stage. Every rank raises or skips alike."""
    world = plait.world()
    model = llama(False)
    opt = optimizer(list(model.named_parameters()))
    pipe, popt = plait.prepare(
        model, opt, strategy="pipeline", mesh=plait.Mesh(pp=world.size),
        schedule="1f1b", microbatches=2, check_finite=policy,
    )  # fmt: skip
    assert popt is not None
    ids, labels = batch(0, 97)
    pipe.step(ids, labels)
    popt.step()
    popt.zero_grad()
    if world.rank == bad_rank:
        stage = next(iter(pipe.stages.values()))
        weight = next(p for n, p in stage.named_parameters() if n.endswith("mlp.up_proj.weight"))
        with torch.no_grad():
            weight[0, 0] = float("nan")
    before = {k: v.clone() for k, v in pipe.dense_state_dict().items()}
    out: dict[str, Any] = {"error": None}
    try:
        pipe.step(ids, labels)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    out["grads_none"] = all(p.grad is None for p in pipe.parameters())
    popt.step()
    after = pipe.dense_state_dict()
    out["unchanged"] = all(
        torch.equal(before[k], after[k]) or not torch.isfinite(before[k]).all() for k in before
    )
    out["skipped"] = pipe.skipped_steps
    out["message"] = pipe.last_nonfinite
    # the next step is finite again once the NaN is gone: training goes on, together
    if world.rank == bad_rank:
        with torch.no_grad():
            weight[0, 0] = 0.0
    out["next_loss"] = pipe.step(ids, labels).item()
    return out
