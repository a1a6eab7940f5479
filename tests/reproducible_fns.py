"""Models, data and rank functions for the reproducible-mode tests (tests/test_reproducible.py).

Every case trains the same float32 MLP on the same global batches (B=16, micro-batches of
m=2, so M=8 and world sizes 1, 2, 4 and 8 all split the tree) for a few Adam steps and
returns its full parameters; the test compares them with ``torch.equal``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

import plait
from plait import checkpoint
from plait.models import GPT, GPTConfig, gpt
from plait.models.gpt import MoEConfig
from plait.models.plans import plan_for
from plait.strategies import DistributedDataParallel, ZeroOptimizer
from plait.strategies.fsdp import full_state_dict, fully_shard
from plait.strategies.reproducible import ReproducibleRunner

FEATURES, HIDDEN, OUT = 8, 32, 4
GLOBAL_BATCH, MICROBATCH, STEPS = 16, 2, 5


def make_model(seed: int = 0, depth: int = 8) -> nn.Sequential:
    """``depth`` linears with tanh between: enough layers for 8 pipeline stages."""
    torch.manual_seed(seed)
    widths = [FEATURES] + [HIDDEN] * (depth - 1) + [OUT]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers += [nn.Linear(a, b)] + ([nn.Tanh()] if i < depth - 1 else [])
    return nn.Sequential(*layers)


def batch(step: int, n: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, FEATURES, generator=g), torch.randn(n, OUT, generator=g)


def _state(model: nn.Module, runner: Any, strategy: str) -> dict[str, torch.Tensor]:
    if strategy in ("fsdp", "zero3"):
        return {k: v.clone() for k, v in full_state_dict(runner.module).items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(
    strategy: str,
    options: dict[str, Any] | None = None,
    steps: int = STEPS,
    world: bool = True,
    save: str | None = None,
    resume: str | None = None,
    full: bool = False,
) -> dict[str, torch.Tensor]:
    """Adam steps ``0 .. steps-1`` in reproducible mode; the full parameters afterwards.
    ``world=False``: one process without a group (the oracle). ``save``: commit a
    checkpoint there after the last step; ``resume``: start from the one there (its step).
    ``full``: the parameters as ``plait.checkpoint.full_state_dict(runner)`` returns them."""
    threads = torch.get_num_threads()
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    extra = dict(options or {})
    if world and strategy != "none":
        extra.setdefault("mesh", plait.world())
    runner, optimizer = plait.prepare(
        model,
        optimizer,
        strategy=strategy,
        reproducible=True,
        microbatch_size=MICROBATCH,
        loss_fn=nn.functional.mse_loss,
        **extra,
    )
    assert optimizer is not None
    held = runner.module if strategy in ("fsdp", "zero3") else model
    start = 0
    if resume is not None:
        start = checkpoint.load(resume, model=held, optimizer=optimizer).step
    try:
        for step in range(start, steps):
            x, y = batch(step)
            runner.step(runner.block(x), runner.block(y))
            optimizer.step()
        if save is not None:
            checkpoint.save(save, step=steps, model=held, optimizer=optimizer).wait()
        if full:
            return {k: v.detach().clone() for k, v in checkpoint.full_state_dict(runner).items()}
        return _state(model, runner, strategy)
    finally:
        torch.set_num_threads(threads)


def cases(specs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, torch.Tensor]]:
    """Several cases in one visit of the ranks: ``[(strategy, options), ...]``."""
    return [train(strategy, options) for strategy, options in specs]


def runner_full_states(strategies: list[str]) -> list[dict[str, torch.Tensor]]:
    """``checkpoint.full_state_dict(runner)`` after training each strategy (one visit)."""
    return [train(strategy, full=True) for strategy in strategies]


def train_pipeline(schedule: str, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Every rank one pipeline rank; M=8 micro-batches of m=2 in reproducible mode."""
    threads = torch.get_num_threads()
    model = make_model()
    pipe, optimizer = plait.prepare(
        model,
        torch.optim.Adam(model.parameters(), lr=0.01),
        strategy="pipeline",
        mesh=plait.Mesh(pp=plait.world().size),
        schedule=schedule,
        microbatches=GLOBAL_BATCH // MICROBATCH,
        loss_fn=nn.functional.mse_loss,
        reproducible=True,
    )
    assert optimizer is not None
    try:
        for step in range(steps):
            x, y = batch(step)
            optimizer.zero_grad()
            pipe.step(x, y)
            optimizer.step()
        return {k: v.clone() for k, v in pipe.dense_state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def pipeline_cases(schedules: list[str]) -> list[dict[str, torch.Tensor]]:
    return [train_pipeline(s) for s in schedules]


# --- a Hugging Face Llama (float32, random init, no download) ------------------------------
VOCAB, SEQ = 64, 8


def make_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg)  # float32, dropout 0 by default
    model.train()
    return model


def llama_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def train_llama(strategy: str, world: bool = True, steps: int = 3) -> dict[str, torch.Tensor]:
    """A few AdamW steps of a tiny Llama on 8 sequences, micro-batches of 2."""
    threads = torch.get_num_threads()
    model = make_llama()
    options: dict[str, Any] = {"mesh": plait.world()} if world and strategy != "none" else {}
    if strategy == "fsdp":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        options["wrap"] = {LlamaDecoderLayer}
    runner, optimizer = plait.prepare(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        strategy=strategy,
        reproducible=True,
        microbatch_size=2,
        loss_fn=llama_loss,
        **options,
    )
    assert optimizer is not None
    try:
        for step in range(steps):
            x = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(step))
            runner.step(runner.block(x), runner.block(x))
            optimizer.step()
        return _state(model, runner, strategy)
    finally:
        torch.set_num_threads(threads)


def llama_cases(strategies: list[str]) -> list[dict[str, torch.Tensor]]:
    return [train_llama(s) for s in strategies]


# --- strategies built by hand with their own reproducible=True ----------------------------
def train_by_hand(strategy: str) -> dict[str, torch.Tensor]:
    """``DistributedDataParallel`` / ``ZeroOptimizer`` / ``fully_shard`` built with
    ``reproducible=True`` and driven by a ``ReproducibleRunner``, without ``plait.prepare``;
    first checks that a forward outside the runner is refused by name."""
    threads = torch.get_num_threads()
    model = make_model()
    group = plait.world()
    module: nn.Module = model
    if strategy == "ddp":
        module = DistributedDataParallel(model, group=group, algorithm="ring", reproducible=True)
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        try:
            module(batch(0)[0])
            raise AssertionError("a forward outside the runner was accepted")
        except RuntimeError as exc:
            assert "DistributedDataParallel(reproducible=True)" in str(exc), exc
    elif strategy == "zero2":
        optimizer = ZeroOptimizer(
            model.parameters(), torch.optim.Adam, stage=2, group=group, lr=0.01, reproducible=True
        )
    else:
        module = fully_shard(model, group=group, reproducible=True)
        optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
    runner = ReproducibleRunner(
        module, optimizer, loss_fn=nn.functional.mse_loss, microbatch_size=MICROBATCH
    )
    try:
        for step in range(STEPS):
            x, y = batch(step)
            runner.step(runner.block(x), runner.block(y))
            optimizer.step()
        return _state(model, runner, "fsdp" if strategy == "fsdp" else strategy)
    finally:
        torch.set_num_threads(threads)


def by_hand_cases(strategies: list[str]) -> list[dict[str, torch.Tensor]]:
    return [train_by_hand(s) for s in strategies]


# --- PTD-P: dp x pp with tp = 1 ---------------------------------------------------------
# M = 8 micro-batches of 2 sequences each step: dp * microbatches = 8 in every layout
SEQS, SEQ_MICROBATCH, PTDP_STEPS = 16, 2, 3


def gpt_config() -> GPTConfig:
    """A float32 GPT of 2 blocks (4 pipeline layers), untied, no dropout."""
    return GPTConfig(vocab=13, layers=2, heads=4, width=16, seq_len=8)


def gpt_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, 13, (SEQS, 9), generator=g)
    return ids[:, :-1], ids[:, 1:]


def train_gpt_oracle() -> dict[str, torch.Tensor]:
    """One process: the GPT's M micro-batches on the tree (``strategy="none"``)."""
    threads = torch.get_num_threads()
    model = GPT(gpt_config())
    runner, optimizer = plait.prepare(
        model,
        torch.optim.Adam(model.parameters(), lr=0.01),
        strategy="none",
        reproducible=True,
        microbatch_size=SEQ_MICROBATCH,
        loss_fn=gpt.loss,  # the pipeline plan's loss with tp = 1
    )
    assert optimizer is not None
    try:
        for step in range(PTDP_STEPS):
            runner.step(*gpt_batch(step))
            optimizer.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def mean_plans(model: nn.Module, kind: str, **options: Any) -> Any:
    """The family's plans, the pipeline loss made a mean over each micro-batch (a Hugging
    Face causal LM counts its loss items over the global batch: refused by the mode)."""
    plan = plan_for(model, kind, **options)
    if kind != "pipeline":
        return plan
    return replace(plan, loss=llama_logits_loss, reduction="mean", items=None)


def llama_logits_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def llama_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(step))


def train_ptdp(
    model_name: str, pp: int, dp: int, schedule: str = "1f1b"
) -> dict[str, torch.Tensor]:
    """``prepare(strategy="ptdp", reproducible=True)`` on ``Mesh(pp, dp, tp=1)``: the GPT on
    16 sequences (or the Llama on 8) a step, M = 8 (Llama: 4) micro-batches of 2 over the
    replicas; the dense state afterwards."""
    threads = torch.get_num_threads()
    llama = model_name == "llama"
    model = make_llama() if llama else GPT(gpt_config())
    total = 4 if llama else SEQS // SEQ_MICROBATCH
    ptdp, optimizer = plait.prepare(
        model,
        (torch.optim.AdamW if llama else torch.optim.Adam)(model.parameters(), lr=0.01),
        strategy="ptdp",
        reproducible=True,
        mesh=plait.Mesh(pp=pp, dp=dp, tp=1),
        schedule=schedule,
        microbatches=total // dp,
        **({"plans": mean_plans} if llama else {}),
    )
    try:
        for step in range(3 if llama else PTDP_STEPS):
            optimizer.zero_grad()
            if llama:
                x = llama_batch(step)
                ptdp.step(x, x)
            else:
                ptdp.step(*gpt_batch(step))
            optimizer.step()
        return {k: v.clone() for k, v in ptdp.full_state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def ptdp_cases(specs: list[tuple[str, int, int, str]]) -> list[dict[str, torch.Tensor]]:
    """``[(model, pp, dp, schedule), ...]`` in one visit of the ranks."""
    return [train_ptdp(*spec) for spec in specs]


def ptdp_refusals() -> list[str]:
    """On 4 ranks, what ``prepare(strategy="ptdp", reproducible=True)`` refuses: tp=2,
    zero=1, MoE blocks, a tied head on two stages (at construction); then, on a built
    dp2 x pp2, a second step before the optimizer's and ``clip_grad_norm_``. Each error's
    text ('NOT REFUSED' where none came)."""
    layouts: list[dict[str, Any]] = [
        {"mesh": plait.Mesh(pp=1, dp=2, tp=2)},
        {"zero": 1},
        {"config": {"moe": MoEConfig(num_experts=4, top_k=2)}},
        {"config": {"tied": True}},
    ]
    out = []
    threads = torch.get_num_threads()
    try:
        for options in layouts:
            model = GPT(replace(gpt_config(), **options.pop("config", {})))
            options.setdefault("mesh", plait.Mesh(pp=2, dp=2, tp=1))
            try:
                plait.prepare(
                    model,
                    torch.optim.Adam(model.parameters(), lr=0.01),
                    strategy="ptdp",
                    reproducible=True,
                    microbatches=4,
                    **options,
                )
                out.append("NOT REFUSED")
            except ValueError as exc:
                out.append(str(exc))
        model = GPT(gpt_config())
        ptdp, _ = plait.prepare(
            model,
            torch.optim.Adam(model.parameters(), lr=0.01),
            strategy="ptdp",
            reproducible=True,
            mesh=plait.Mesh(pp=2, dp=2, tp=1),
            microbatches=4,
        )
        ptdp.step(*gpt_batch(0))
        for act in (lambda: ptdp.step(*gpt_batch(1)), lambda: ptdp.clip_grad_norm_(1.0)):
            try:
                act()
                out.append("NOT REFUSED")
            except ValueError as exc:
                out.append(str(exc))
        return out
    finally:
        torch.set_num_threads(threads)
