"""Rank functions for tests/test_ptdp_context.py: plait's GPT under PTD-P with a cp
dimension (the sequence split in every pipeline stage) against one process on the whole
sequences, float64."""

from __future__ import annotations

from typing import Any

import torch

import plait
from plait import comm
from tests.context_fns import BATCH, STEPS, _gpt, _tokens


def run(
    mesh: dict[str, int],
    context: str,
    balanced: bool,
    microbatches: int,
    sequence_parallel: bool = False,
) -> dict[str, Any]:
    """``plait.prepare(strategy="ptdp", mesh=Mesh(**mesh), context=...)``: STEPS Adam steps
    on the global batch of ``BATCH * dp`` rows (``ptdp.step`` cuts rows over dp and the
    sequence over cp itself)."""
    model = _gpt()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ptdp, popt = plait.prepare(
        model, opt, strategy="ptdp", mesh=plait.Mesh(**mesh), context=context,
        balanced=balanced, microbatches=microbatches, sequence_parallel=sequence_parallel,
    )  # fmt: skip
    comm.reset_stats()
    losses = []
    for step in range(STEPS):
        ids, targets = _tokens(step, 23, BATCH * mesh["dp"])
        popt.zero_grad()
        losses.append(float(ptdp.step(ids, targets)))
        popt.step()
    cp_group = ptdp.mesh.group("cp").name
    sent = sum(v.bytes_sent for key, v in comm.group_stats().items() if key[0] == cp_group)
    # the micro-batch shapes the pipeline ran: (rows, tokens of this rank)
    shapes = [shape for shape, _ in ptdp.pipe.runtime.shapes]
    return {"losses": losses, "state": ptdp.full_state_dict(), "sent": sent, "shapes": shapes}


def refused(mesh: dict[str, int], **options: Any) -> str:
    model = _gpt()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    try:
        plait.prepare(model, opt, strategy="ptdp", mesh=plait.Mesh(**mesh), **options)
    except ValueError as exc:
        return str(exc)
    return "NOT REFUSED"


def nonfinite(bad_rank: int) -> str:
    """plait's GPT on pp2 x cp2; after one step rank ``bad_rank`` puts a NaN into a weight
    of its stage: every rank's error (the non-finite check sums flags over cp too)."""
    model = _gpt()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ptdp, popt = plait.prepare(
        model, opt, strategy="ptdp", mesh=plait.Mesh(pp=2, dp=1, tp=1, cp=2), microbatches=2
    )
    ids, targets = _tokens(0, 23, BATCH)
    for step in range(2):
        popt.zero_grad()
        if step == 1 and plait.world().rank == bad_rank:
            with torch.no_grad():
                next(iter(ptdp.parameters())).view(-1)[0] = float("nan")
        ptdp.step(ids, targets)
        try:
            popt.step()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return "NO ERROR"


# --- a Hugging Face Llama: its own labels= loss (shifts inside, counts items) ---------------
def _labels(ids: torch.Tensor, step: int) -> torch.Tensor:
    """Hugging Face labels (the ids, unshifted) with about a quarter ignored (-100), so the
    loss items fall unevenly over the cp ranks' chunks."""
    g = torch.Generator().manual_seed(500 + step)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < 0.25] = -100
    return labels


def hf_oracle(dp: int) -> dict[str, Any]:
    """One process: the Llama's own ``labels=`` loss on the whole sequences, STEPS AdamW
    steps with two parameter groups."""
    from tests.context_fns import _llama

    model = _llama()
    opt = _adamw(model)
    losses = []
    for step in range(STEPS):
        ids, _ = _tokens(step, 23, BATCH * dp)
        opt.zero_grad()
        loss = model(input_ids=ids, labels=_labels(ids, step)).loss
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _adamw(model: Any) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-2,
    )


def hf_run(mesh: dict[str, int], context: str, balanced: bool) -> dict[str, Any]:
    """The same Llama under ``prepare(strategy="ptdp", mesh=Mesh(**mesh), context=...)``:
    ``ptdp.step(ids, labels)`` with the Hugging Face labels of the whole sequences."""
    from tests.context_fns import _llama

    model = _llama()
    ptdp, popt = plait.prepare(
        model, _adamw(model), strategy="ptdp", mesh=plait.Mesh(**mesh), context=context,
        balanced=balanced, microbatches=2,
    )  # fmt: skip
    comm.reset_stats()
    losses = []
    for step in range(STEPS):
        ids, _ = _tokens(step, 23, BATCH * mesh["dp"])
        popt.zero_grad()
        losses.append(float(ptdp.step(ids, _labels(ids, step))))
        popt.step()
    cp_group = ptdp.mesh.group("cp").name
    sent = sum(v.bytes_sent for key, v in comm.group_stats().items() if key[0] == cp_group)
    shapes = [shape for shape, _ in ptdp.pipe.runtime.shapes]
    return {"losses": losses, "state": ptdp.full_state_dict(), "sent": sent, "shapes": shapes}


def hf_refused(case: str) -> str:
    """What cp inside PTD-P refuses for Hugging Face models, by name."""
    from tests.context_fns import _llama

    mesh = plait.Mesh(pp=2, dp=1, tp=1, cp=2)
    try:
        if case == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            cfg = GPT2Config(vocab_size=23, n_embd=16, n_layer=2, n_head=4, n_positions=16)
            model = GPT2LMHeadModel(cfg).double()
            plait.prepare(model, _adamw(model), strategy="ptdp", mesh=mesh, microbatches=2)
        else:
            model = _llama()
            ptdp, _ = plait.prepare(model, _adamw(model), strategy="ptdp", mesh=mesh)
            ids, _ = _tokens(0, 23)
            mask = torch.ones_like(ids)
            mask[0, :3] = 0
            extra = {"attention_mask": mask} if case == "padding" else {"position_ids": ids}
            ptdp.step(ids, _labels(ids, 0), **extra)
    except ValueError as exc:
        return str(exc)
    return "NOT REFUSED"
