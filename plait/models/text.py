"""Text to train the GPT on without a download: Python's own reference documentation.

The source is ``pydoc_data.topics`` (the pages ``help("topics")`` shows: "The assert
statement", "Augmented assignment statements", ...), which ships with every CPython. It is
tokenised by character: every printable ASCII character and the newline is a token, and any
other character becomes ``"?"``, so the vocabulary is 96 symbols.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))


@dataclass(frozen=True)
class CharTokenizer:
    alphabet: str = ALPHABET

    @property
    def vocab(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> torch.Tensor:
        index = {c: i for i, c in enumerate(self.alphabet)}
        unknown = index["?"]
        return torch.tensor([index.get(c, unknown) for c in text], dtype=torch.int64)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.alphabet[int(i)] for i in ids.reshape(-1))


def python_docs(max_chars: int | None = None) -> str:
    """The text of Python's reference topics, in a fixed order (topic names sorted)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return text if max_chars is None else text[:max_chars]


def token_batches(
    tokens: torch.Tensor, *, batch: int, seq_len: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of ``batch`` random windows: (inputs [batch, seq_len], next tokens)."""
    if tokens.numel() <= seq_len + 1:
        raise ValueError(f"{tokens.numel()} tokens are too few for windows of {seq_len + 1}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch,), generator=g)
    windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]
