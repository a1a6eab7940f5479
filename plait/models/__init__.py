"""Reference models the demo, the tests and the benchmarks share (DESIGN decision 7).

- :class:`DigitsCNN`: the seeds' CNN for 8x8 digits.
- :class:`MLP`: Linear layers with GELU between.
- :class:`GPT` / :class:`GPTConfig`: a small decoder-only transformer, seeded, dropout off
  by default, output head optionally tied to the embedding.
- ``text``: Python's reference documentation as character tokens (no download).
"""

from plait.models import text
from plait.models.cnn import DigitsCNN
from plait.models.gpt import GPT, GPTConfig, MoEConfig
from plait.models.mlp import MLP
from plait.models.text import CharTokenizer, python_docs, token_batches

__all__ = [
    "GPT",
    "MLP",
    "MoEConfig",
    "CharTokenizer",
    "DigitsCNN",
    "GPTConfig",
    "python_docs",
    "text",
    "token_batches",
]
