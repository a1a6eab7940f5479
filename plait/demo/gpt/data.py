"""The GPT demo's text: Python's docs by character split 90/10 (:func:`corpus`), every
step's global batch, the same on every rank (:func:`global_batch`), the held-out windows
and the sampling prompt."""

from __future__ import annotations

from typing import Any

import torch

from plait.demo.options import GPTDemoConfig
from plait.models import CharTokenizer, python_docs, token_batches

PROMPT = "The assert statement"


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(training tokens, held-out tokens): Python's docs by character, split 90/10."""
    tokens = CharTokenizer().encode(python_docs())
    cut = int(0.9 * tokens.numel())
    return tokens[:cut], tokens[cut:]


def global_batch(config: GPTDemoConfig, tokens: torch.Tensor, step: int) -> tuple[Any, Any]:
    """Step ``step``'s global batch (inputs, next tokens), the same on every rank; counted
    from ``config.first_step`` (a run continuing a checkpoint draws the batches after it)."""
    seed = config.seed * 100_003 + config.first_step + step
    return token_batches(tokens, batch=config.batch_size, seq_len=config.seq_len, seed=seed)


def held_out_windows(config: GPTDemoConfig, tokens: torch.Tensor) -> tuple[Any, Any]:
    """About 16 held-out windows, a multiple of the global batch (so that it splits into
    micro-batches and over ranks as a training batch does)."""
    rows = config.batch_size * max(1, round(16 / config.batch_size))
    return token_batches(tokens, batch=rows, seq_len=config.seq_len, seed=1)
