"""Rank functions for tests/test_hf_pipeline_padded.py: padded batches (an
``attention_mask``, labels ``-100`` on the pads) through the pipeline and PTD-P, against
one process calling the model with the same mask on the global batch."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import plait
from tests.hf_pipeline_fns import MAX_NORM, gpt2, llama, moe, optimizer, same_layout

STEPS = 3
ACCUMULATE = 2  # micro-steps (step() calls) per optimizer step
BATCH, SEQ, VOCAB = 4, 8, 97
PAD = 0


def sdpa(model: nn.Module) -> nn.Module:
    """``model`` on the SDPA attention. The eager attention of these families adds the
    mask's float64 minimum to the scores and takes the softmax in float32, where it is
    ``-inf``: a left-padded row's pads attend to nothing and turn NaN, and so does every
    position after them (zero weight times NaN). SDPA keeps such rows finite."""
    model.config._attn_implementation = "sdpa"  # type: ignore[union-attr]
    return model


MODELS = {
    "llama": lambda: sdpa(llama(False)),
    "gpt2": lambda: sdpa(gpt2(False)),
    "mistral": lambda: sdpa(same_layout("mistral")),  # sliding window (4) on every layer
    "qwen2": lambda: sdpa(same_layout("qwen2")),  # full and sliding-window (4) layers
    "mixtral": lambda: sdpa(moe("mixtral", False)),  # output_router_logits=False
    "mixtral+aux": lambda: sdpa(moe("mixtral", False, aux=True)),
}


def padded_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, attention mask and labels of ``BATCH`` rows of different lengths: row 0
    right-padded, row 1 left-padded, row 2 whole, row 3 left- or right-padded by the step;
    the pads hold ``PAD`` and the label ``-100``. With 2 micro-batches each holds padding."""
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    short = 1 + step % 3
    mask[0, SEQ - 2 - short :] = 0  # right padding
    mask[1, : 1 + short] = 0  # left padding
    if step % 2:
        mask[3, :3] = 0
    else:
        mask[3, SEQ - 1 :] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def oracle(family: str, average: bool = False) -> dict[str, Any]:
    """One process on the global batch: ``model(input_ids=, attention_mask=, labels=)``,
    ACCUMULATE backward passes per step (their gradients summed, as the pipeline's
    ``step`` calls accumulate; ``average``: their mean, as PTD-P's), torch's clipping,
    AdamW with two groups."""
    model = MODELS[family]()
    opt = optimizer(list(model.named_parameters()))
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(ACCUMULATE):
            ids, mask, labels = padded_batch(ACCUMULATE * step + micro)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            (loss / ACCUMULATE if average else loss).backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
    return {"state": dict(model.state_dict()), "losses": losses, "norms": norms}


def _run(step: Any, clip: Any, opt: torch.optim.Optimizer) -> dict[str, Any]:
    losses, norms = [], []
    for s in range(STEPS):
        opt.zero_grad()
        for micro in range(ACCUMULATE):
            ids, mask, labels = padded_batch(ACCUMULATE * s + micro)
            losses.append(step(ids, labels, attention_mask=mask).item())
        norms.append(clip().item())
        opt.step()
    return {"losses": losses, "norms": norms}


def train(family: str, schedule: str, recompute: bool) -> dict[str, Any]:
    """The same run through plait.prepare(strategy="pipeline") on Mesh(pp=world), 2
    micro-batches, ``pipe.step(ids, labels, attention_mask=mask)``."""
    model = MODELS[family]()
    opt = optimizer(list(model.named_parameters()))
    pipe, popt = plait.prepare(
        model, opt, strategy="pipeline", mesh=plait.Mesh(pp=plait.world().size),
        schedule=schedule, microbatches=2, recompute=recompute,
    )  # fmt: skip
    assert popt is not None
    out = _run(pipe.step, lambda: plait.clip_grad_norm_(pipe.parameters(), MAX_NORM), popt)
    return {**out, "state": pipe.dense_state_dict()}


def train_ptdp(pp: int, dp: int, tp: int) -> dict[str, Any]:
    """The Llama under PTD-P on Mesh(pp, dp, tp), 2 micro-batches per replica,
    ``ptdp.step(ids, labels, attention_mask=mask)``; the dense state on every rank."""
    model = MODELS["llama"]()
    opt = optimizer(list(model.named_parameters()))
    ptdp, popt = plait.prepare(
        model, opt, strategy="ptdp", mesh=plait.Mesh(pp=pp, dp=dp, tp=tp), microbatches=2
    )
    out = _run(ptdp.step, lambda: ptdp.clip_grad_norm_(MAX_NORM), popt)
    return {**out, "state": ptdp.full_state_dict()}


def _error(run: Any) -> str:
    try:
        run()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "NOT REFUSED"


def refusals() -> dict[str, str]:
    """``attention_mask=`` where the plan cannot honour it, on pp=world: each rank's error
    (before any message of the step)."""
    from plait.models.gpt import GPT, GPTConfig

    mesh = plait.Mesh(pp=plait.world().size)
    ids, mask, labels = padded_batch(0)
    out: dict[str, str] = {}
    # a batch loss (Mixtral's load-balancing loss) reads every position, padded or not
    aux, _ = plait.prepare(
        MODELS["mixtral+aux"](), None, strategy="pipeline", mesh=mesh, microbatches=2
    )
    out["batch loss"] = _error(lambda: aux.step(ids, labels, attention_mask=mask))
    # plait's GPT: its plan has no per-micro-batch inputs
    cfg = GPTConfig(vocab=VOCAB, layers=2, heads=2, width=16, seq_len=SEQ, dtype=torch.float64)
    gpt, _ = plait.prepare(GPT(cfg), None, strategy="pipeline", mesh=mesh, microbatches=2)
    out["gpt"] = _error(lambda: gpt.step(ids, labels, attention_mask=mask))
    # an nn.Sequential: no plan, no context
    seq = nn.Sequential(*(nn.Linear(SEQ, SEQ, dtype=torch.float64) for _ in range(2)))
    pipe, _ = plait.prepare(
        seq, None, strategy="pipeline", mesh=mesh, microbatches=2, loss_fn=nn.MSELoss()
    )
    x = torch.zeros(BATCH, SEQ, dtype=torch.float64)
    out["sequential"] = _error(lambda: pipe.step(x, x, attention_mask=mask))
    # a mask of other rows than the batch
    plain, _ = plait.prepare(
        MODELS["llama"](), None, strategy="pipeline", mesh=mesh, microbatches=2
    )
    out["rows"] = _error(lambda: plain.step(ids, labels, attention_mask=mask[:2]))
    # the batch loss is not refused without a mask, and None is no mask
    out["aux unpadded"] = f"{aux.step(ids, labels, attention_mask=None).item():.6f}"
    return out
