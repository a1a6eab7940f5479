"""The zoo: causal LMs plait has no family module for, built from Hugging Face config classes
(random init, float64, eager attention, every dropout 0) and handed whole to
``plait.prepare`` under each strategy, against one process on the global batch.

Nothing here knows a family: :data:`ZOO` is data (the config class, the model class, the
config's own keywords for a tiny model); :func:`run` trains any of them the same way: two
AdamW steps with two parameter groups (matrices decay, vectors do not, at another lr), the
model's own ``labels=`` loss, the dense state compared through
``plait.checkpoint.full_state_dict``. A strategy either trains to within the model's bound
of one process (``exact``), or refuses by name (a ``ValueError``, ``TypeError`` or
``NotImplementedError`` raised by ``prepare``, its first line kept); anything else is
reported as it is (``differs``, ``error``) and fails the test.

Used by tests/test_zoo.py (a subset) and benchmarks/zoo.py (all of it, the table in
docs/status.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import plait
from plait import checkpoint

VOCAB = 96
BATCH, SEQ, STEPS = 4, 8, 2
BOUND = 1e-10  # float64 against one process; a family's float32 router states its own
# the strategies every model runs, and where each runs: 2 ranks, or 4 (pp2 x tp2)
STRATEGIES = ("ddp", "fsdp", "tp", "pipeline", "ptdp", "ep")
FOUR_RANKS = ("ptdp",)


@dataclass(frozen=True)
class Member:
    """One model of the zoo: its transformers classes, its config keywords, whether its
    blocks hold experts (``ep`` is run), and the bound it is held to (a router computing
    in float32 rounds differently when the batch is cut)."""

    config: str
    model: str
    options: dict[str, Any] = field(default_factory=dict)
    moe: bool = False
    bound: float = BOUND
    attention: str = "auto"  # "auto": sdpa where the class supports it (float64 softmax)


SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
LLAMA_LIKE = SMALL | {"intermediate_size": 64, "num_key_value_heads": 2}

ZOO: dict[str, Member] = {
    "gemma3": Member(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        LLAMA_LIKE
        | {
            "num_hidden_layers": 4,
            "head_dim": 8,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "query_pre_attn_scalar": 8,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
        },
        attention="eager",  # as the issue tried it
        bound=1e-6,  # its RMSNorm computes in float32: ddp differs by 5e-8 too
    ),
    "smollm3": Member("SmolLM3Config", "SmolLM3ForCausalLM", LLAMA_LIKE),
    "glm4": Member("Glm4Config", "Glm4ForCausalLM", LLAMA_LIKE | {"head_dim": 8}),
    "starcoder2": Member("Starcoder2Config", "Starcoder2ForCausalLM", LLAMA_LIKE),
    "arcee": Member("ArceeConfig", "ArceeForCausalLM", LLAMA_LIKE),
    "phi": Member("PhiConfig", "PhiForCausalLM", SMALL | {"intermediate_size": 64}),
    "gptj": Member("GPTJConfig", "GPTJForCausalLM", SMALL | {"rotary_dim": 4}),
    "falcon": Member("FalconConfig", "FalconForCausalLM", SMALL),
    "bloom": Member("BloomConfig", "BloomForCausalLM", SMALL),
    "gpt_bigcode": Member("GPTBigCodeConfig", "GPTBigCodeForCausalLM", SMALL),
    "olmoe": Member(
        "OlmoeConfig",
        "OlmoeForCausalLM",
        LLAMA_LIKE | {"intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
        moe=True,
    ),
    "gpt_oss": Member(
        "GptOssConfig",
        "GptOssForCausalLM",
        LLAMA_LIKE
        | {
            "intermediate_size": 32,
            "head_dim": 8,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        moe=True,
    ),
    "deepseek_v3": Member(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        SMALL
        | {
            "num_hidden_layers": 3,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "first_k_dense_replace": 1,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "num_key_value_heads": 4,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4,
            "v_head_dim": 8,
        },
        moe=True,
        bound=1e-6,  # its router computes in float32
    ),
}


def build(name: str) -> nn.Module:
    """The zoo's ``name``: random init (seed 0), float64, sdpa attention where the class
    has it (else eager), eager experts, dropout 0."""
    import transformers

    member = ZOO[name]
    config = getattr(transformers, member.config)(
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        **member.options,
    )  # fmt: skip
    for key, value in list(vars(config).items()):  # every dropout off, whatever its name
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    model_class = getattr(transformers, member.model)
    # eager attention computes its softmax in float32 in most families, which turns the
    # ranks' float64 reordering into 1e-8 noise (AdamW lifts a zero-gradient bias's noise to
    # the learning rate); sdpa stays in float64
    auto = "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
    config._attn_implementation = auto if member.attention == "auto" else member.attention
    config._experts_implementation = "eager"  # the grouped matmul takes no float64
    torch.manual_seed(0)
    model = model_class(config).to(torch.float64)
    return model  # type: ignore[no-any-return]


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 2e-2}],
        lr=1e-2,
    )


def one_process(name: str) -> dict[str, torch.Tensor]:
    """The oracle: the whole batch in one process."""
    model = build(name)
    opt = optimizer(model)
    for step in range(STEPS):
        opt.zero_grad()
        ids = batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(name: str, strategy: str) -> dict[str, torch.Tensor]:
    """``name`` trained under ``strategy`` on this rank's part of each batch."""
    world = plait.world()
    model = build(name)
    opt = optimizer(model)
    mesh = {
        "ddp": None,
        "fsdp": None,
        "tp": plait.Mesh(tp=world.size),
        "pipeline": plait.Mesh(pp=world.size),
        "ep": plait.Mesh(ep=world.size),
        "ptdp": plait.Mesh(pp=2, dp=1, tp=world.size // 2),
    }[strategy]
    options: dict[str, Any] = {} if mesh is None else {"mesh": mesh}
    if strategy in ("pipeline", "ptdp"):
        options["microbatches"] = 2
    runner, popt = plait.prepare(model, opt, strategy=strategy, **options)
    assert popt is not None
    rows = BATCH // world.size
    for step in range(STEPS):
        popt.zero_grad()
        ids = batch(step)
        if strategy in ("pipeline", "ptdp"):
            runner.step(ids, ids)
        else:
            if strategy in ("ddp", "fsdp"):
                ids = ids[world.rank * rows : (world.rank + 1) * rows]
            elif strategy == "ep":
                b = runner.plait_expert_parallel.batch_rank  # type: ignore[union-attr]
                ids = ids.reshape(world.size, rows, SEQ)[b]
            runner(input_ids=ids, labels=ids).loss.backward()
        popt.step()
    return checkpoint.full_state_dict(runner)


def outcome(name: str, strategy: str, want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``{"result": "exact" | "differs" | "refused" | "error", "diff", "why"}``."""
    try:
        got = _train(name, strategy)
    except (ValueError, TypeError, NotImplementedError) as exc:
        return {"result": "refused", "why": f"{type(exc).__name__}: {exc}", "diff": None}
    except Exception as exc:  # noqa: BLE001 - reported, and the test fails on it
        return {"result": "error", "why": f"{type(exc).__name__}: {exc}", "diff": None}
    if set(got) != set(want):
        why = f"keys differ: {sorted(set(got) ^ set(want))[:4]}"
        return {"result": "error", "why": why, "diff": None}
    diffs = {k: float((got[k].double() - want[k].double()).abs().max()) for k in want}
    worst = max(diffs, key=diffs.__getitem__)
    result = "exact" if diffs[worst] <= ZOO[name].bound else "differs"
    why = "" if result == "exact" else f"most in {worst}"
    return {"result": result, "why": why, "diff": diffs[worst]}


def run(names: tuple[str, ...], strategies: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Every ``(name, strategy)`` on this pool of ranks (the ep runs for MoE models only):
    ``{name: {strategy: outcome}}``."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        want = one_process(name)
        out[name] = {}
        for strategy in strategies:
            if strategy == "ep" and not ZOO[name].moe:
                continue
            out[name][strategy] = outcome(name, strategy, want)
    return out
