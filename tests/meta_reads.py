"""Count the host reads a step makes on the ``meta`` device.

A meta tensor refuses ``.tolist()``, ``.item()`` and ``bool()``: each is the place a GPU
would wait for its kernels. :func:`count_host_reads` lets them answer instead (zeros, the
value every verdict of plait has when all is well) and records which function asked, so a
test can show that a step reads the host exactly where it means to: once per step, in
:func:`plait.comm.device.read_verdict`.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch


def count_host_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Patch the three reads of a meta tensor to answer zeros; returns the list the name
    of each caller is appended to."""
    reads: list[str] = []

    def patched(real: Any, answer: Any) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self.is_meta:
                return real(self, *args, **kwargs)
            reads.append(sys._getframe(1).f_code.co_name)
            return answer(self)

        return read

    zeros = lambda t: torch.zeros(t.shape, dtype=t.dtype).tolist()  # noqa: E731
    monkeypatch.setattr(torch.Tensor, "tolist", patched(torch.Tensor.tolist, zeros))
    monkeypatch.setattr(torch.Tensor, "item", patched(torch.Tensor.item, lambda t: 0))
    monkeypatch.setattr(torch.Tensor, "__bool__", patched(torch.Tensor.__bool__, lambda t: False))
    return reads
