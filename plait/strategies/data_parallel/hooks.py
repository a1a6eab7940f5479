"""Communication hooks: what DDP does with a bucket once its gradients are ready.

A hook is ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``: it receives the
bucket (:class:`GradBucket`, whose ``buffer()`` is the flat gradient buffer, summed on this
rank only) and returns a future that completes with the buffer holding the gradient
*averaged* over the group. The future may complete on plait's communication thread. As in
PyTorch DDP, ``register_comm_hook(state, hook)`` installs one; the built-in hooks are:

- :func:`allreduce_hook`: average in the buffer's dtype (what DDP does without a hook);
- :func:`fp16_compress_hook` / :func:`bf16_compress_hook`: divide by the group size, cast
  to float16/bfloat16, all-reduce (sum) half the bytes, cast back into the buffer. The
  average loses precision to the 16-bit format (float16: ~3 significant digits; bfloat16:
  ~2, but float32's range).

A hook's future must fail when its communication fails: every ``.then`` callback here
reads its parent's value first (``fut.value()`` re-raises the error), so a dead or failed
peer reaches ``backward()`` as a :class:`~plait.comm.CollectiveError`. Write your own hooks
the same way: a callback that ignores its argument turns a failed all-reduce into a
"successful" one that leaves this rank's local gradient in the buffer (DDP still finds the
error of a collective run on plait's communication thread, not of a "native" one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from plait import comm
from plait.comm.group import Group


@dataclass
class GradBucket:
    """What a communication hook sees of one bucket."""

    _index: int
    _buffer: torch.Tensor
    _params: list[torch.nn.Parameter]
    _last: bool
    group: Group
    algorithm: str

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def is_last(self) -> bool:
        return self._last


CommHook = Callable[[Any, GradBucket], "torch.futures.Future[torch.Tensor]"]


def allreduce_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over its group (all-reduce, op avg), asynchronously."""
    buf = bucket.buffer()
    handle = comm.all_reduce(
        buf, "avg", group=bucket.group, algorithm=bucket.algorithm, async_op=True
    )
    assert handle is not None

    def averaged(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.value()  # re-raises the all-reduce's error
        return buf

    return handle.get_future().then(averaged)


def _compressed(dtype: torch.dtype) -> CommHook:
    def hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        small = buf.div(bucket.group.size).to(dtype)  # divide first: keeps sums in range
        handle = comm.all_reduce(
            small, "sum", group=bucket.group, algorithm=bucket.algorithm, async_op=True
        )
        assert handle is not None

        def decompress(fut: torch.futures.Future[Any]) -> torch.Tensor:
            fut.value()  # re-raises the all-reduce's error
            buf.copy_(small)
            return buf

        return handle.get_future().then(decompress)

    hook.__name__ = f"{str(dtype).replace('torch.', '')}_compress_hook"
    return hook


fp16_compress_hook = _compressed(torch.float16)
bf16_compress_hook = _compressed(torch.bfloat16)
