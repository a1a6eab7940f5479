"""Sample partitioning: which dataset indices each rank reads, resumable mid-epoch.

Each epoch has one *global order* of the N dataset indices: a permutation drawn from a
``torch.Generator`` seeded with ``seed + epoch`` (``shuffle=True``), else ``0 .. N-1``.
Global position ``p`` holds index ``order[p % N]``, so reading past the end repeats the
order from its start (the padding). A pass over positions ``[start, stop)`` gives rank ``r``
of ``W`` the positions ``start + r, start + r + W, ...``::

    N = 10, W = 4, drop_last=False       position  0 1 2 3 | 4 5 6 7 | 8 9 10 11
                                         rank      0 1 2 3 | 0 1 2 3 | 0 1 2  3
                                         index     o0 .. o9 then o0 o1 (padding)

``stop`` is ``start`` plus the remaining ``N - start`` rounded up to a multiple of ``W``
(``drop_last=False``: every rank yields equally many, a few indices twice) or down
(``drop_last=True``: the tail is dropped). A fresh epoch (``start = 0``) yields exactly what
``torch.utils.data.distributed.DistributedSampler`` yields.

Nothing here communicates: every rank computes the same order from the same seed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from plait import runtime
from plait.comm.group import Group

_STATE_KEYS = ("epoch", "seed", "shuffle", "drop_last", "dataset_len", "num_replicas", "consumed")


def resolve_replicas(
    who: str, group: Group | None, num_replicas: int | None, rank: int | None
) -> tuple[int, int]:
    """``(W, r)`` from explicit ``num_replicas``/``rank``, else ``group``, else the world."""
    if (num_replicas is None) != (rank is None):
        raise ValueError(f"{who}: pass both num_replicas and rank, or neither")
    if num_replicas is not None and rank is not None:
        if group is not None:
            raise ValueError(f"{who}: pass either group or num_replicas and rank, not both")
        for name, value in (("num_replicas", num_replicas), ("rank", rank)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{who}: {name} must be an int, got {type(value).__name__}")
        if num_replicas < 1:
            raise ValueError(f"{who}: num_replicas must be at least 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"{who}: rank={rank} is out of range for num_replicas={num_replicas}; "
                f"pass a rank in 0..{num_replicas - 1}"
            )
        return num_replicas, rank
    if group is None:
        group = runtime.world()  # raises a RuntimeError saying to call plait.init()
    if not isinstance(group, Group):
        raise TypeError(
            f"{who}: group must be a plait.comm.Group (from plait.comm.world() or "
            f"plait.comm.new_group()), got {type(group).__name__}"
        )
    return group.size, group.rank


class DistributedSampler(Sampler[int]):
    """Yield this rank's share of each epoch's global order of dataset indices.

    ``group`` (default: the world of ``plait.init``) gives the number of replicas ``W``
    and this rank ``r``; ``num_replicas`` and ``rank`` (both) replace it, e.g. in tests or
    when ranks of a model-parallel group read the same data. Call :meth:`set_epoch` before
    each epoch to reshuffle. The dataset's length is read once, here.

    Resuming: :meth:`state_dict` records how many positions of the global order all ranks
    together have consumed (``consumed`` = what this rank yielded in this pass x ``W``,
    which holds when ranks step in lockstep, as a DataLoader loop does). After
    :meth:`load_state_dict` the next pass continues the same order at position
    ``consumed``, split among the *current* ``W`` (which may differ from the saved one);
    padding or dropping then applies to what remains. As in torchdata's
    ``StatefulDistributedSampler``, a loaded position is used by the next ``__iter__`` only;
    every other ``__iter__`` starts the current epoch from position 0 (so without
    ``set_epoch`` an epoch repeats, as with torch's sampler), and ``set_epoch`` to another
    epoch discards a loaded position. A state taken after a pass ran to its end says the
    epoch is done: loading it gives one pass that yields what is left (nothing, unless
    ``drop_last`` and a new ``W`` let a dropped tail divide evenly).

    The count is of indices *yielded*: a DataLoader with ``num_workers > 0`` draws
    ``prefetch_factor * num_workers`` batches ahead of the loop, so take the state from a
    loader with ``num_workers=0`` or subtract what was prefetched but not trained on.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        group: Group | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError(
                f"DistributedSampler: dataset must have a length (__len__), got "
                f"{type(dataset).__name__}; an IterableDataset shards itself, not via a sampler"
            )
        if len(dataset) == 0:
            raise ValueError("DistributedSampler: the dataset is empty; pass a non-empty dataset")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"DistributedSampler: seed must be an int, got {type(seed).__name__}")
        self.num_replicas, self.rank = resolve_replicas(
            "DistributedSampler", group, num_replicas, rank
        )
        self.dataset = dataset
        self.dataset_len = len(dataset)
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._start = 0  # global position where the current (or loaded) pass begins
        self._yielded = 0  # indices this rank yielded in that pass
        self._loaded = False  # _start came from load_state_dict; the next pass uses it
        self._live = False  # a pass is under way
        self._pass = 0  # identifies the live iterator; an abandoned one counts nothing

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order (``seed + epoch``) from the next ``__iter__``."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"set_epoch: epoch must be a non-negative int, got {epoch!r}")
        if epoch != self.epoch:
            self._restart(0, loaded=False)
            self.epoch = epoch

    def global_order(self) -> list[int]:
        """This epoch's order of all N indices (the same on every rank)."""
        if not self.shuffle:
            return list(range(self.dataset_len))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=g).tolist()

    def _stop(self, start: int) -> int:
        """End of a pass from ``start``: the remainder rounded to a multiple of W."""
        remaining = max(0, self.dataset_len - start)
        w = self.num_replicas
        rounded = remaining // w if self.drop_last else -(-remaining // w)
        return start + rounded * w

    def _restart(self, start: int, *, loaded: bool) -> None:
        self._start, self._yielded, self._loaded, self._live = start, 0, loaded, False
        self._pass += 1  # an iterator still in flight stops counting

    def __len__(self) -> int:
        """Indices this rank yields in the pass under way, or else in the next one."""
        start = self._start if self._live or self._loaded else 0
        return (self._stop(start) - start) // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        self._restart(self._start if self._loaded else 0, loaded=False)
        self._live = True
        positions = range(self._start + self.rank, self._stop(self._start), self.num_replicas)
        return self._generate(self._pass, positions, self.global_order())

    def _generate(self, token: int, positions: range, order: list[int]) -> Iterator[int]:
        n = len(order)
        for p in positions:
            if token == self._pass:
                self._yielded += 1
            yield order[p % n]
        if token == self._pass:
            self._live = False

    def state_dict(self) -> dict[str, Any]:
        """A JSON-able dict (ints and bools) of where this epoch stands on all ranks."""
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset_len": self.dataset_len,
            "num_replicas": self.num_replicas,
            "consumed": self._start + self._yielded * self.num_replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at position ``state["consumed"]`` of the saved epoch's order.

        The saved epoch, seed, shuffle and drop_last replace this sampler's (they define the
        order being resumed); the saved ``num_replicas`` may differ from the current one.
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(
                f"load_state_dict: state lacks {missing}; pass a dict from "
                f"DistributedSampler.state_dict()"
            )
        if state["dataset_len"] != self.dataset_len:
            raise ValueError(
                f"load_state_dict: the state is for a dataset of {state['dataset_len']} samples "
                f"but this sampler's has {self.dataset_len}; load it into a sampler over the "
                f"same dataset"
            )
        consumed = state["consumed"]
        if not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
            raise ValueError(f"load_state_dict: consumed must be an int >= 0, got {consumed!r}")
        self.epoch = int(state["epoch"])
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.drop_last = bool(state["drop_last"])
        self._restart(consumed, loaded=True)
