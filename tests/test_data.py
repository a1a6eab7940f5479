"""plait.data: the sampler against torch's, mid-epoch resume across world sizes, batch splits.

No processes: ranks are simulated with explicit ``num_replicas``/``rank``.
"""

from __future__ import annotations

import json
from collections import Counter, OrderedDict
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import plait
from plait.comm.group import Group
from plait.data import BatchShard, DistributedSampler, split_batch


def samplers(n: int, w: int, **kwargs: Any) -> list[DistributedSampler]:
    return [DistributedSampler(range(n), num_replicas=w, rank=r, **kwargs) for r in range(w)]


def interleave(per_rank: list[list[int]]) -> list[int]:
    """Per-rank yields back in global-position order (rank r of W holds positions r, r+W..)."""
    assert len({len(p) for p in per_rank}) <= 1, "ranks must yield equally many"
    return [idx for step in zip(*per_rank, strict=True) for idx in step]


def order_of(n: int, *, shuffle: bool = True, seed: int = 0, epoch: int = 0) -> list[int]:
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


# --- a fresh epoch --------------------------------------------------------------------------
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_indices_as_torch(shuffle: bool, drop_last: bool) -> None:
    for n in (1, 2, 3, 10, 17, 64):
        for w in (1, 2, 3, 4, 7):
            for seed, epoch in ((0, 0), (5, 0), (3, 2)):
                for r in range(w):
                    kw: dict[str, Any] = dict(
                        num_replicas=w, rank=r, shuffle=shuffle, drop_last=drop_last, seed=seed
                    )
                    ours = DistributedSampler(range(n), **kw)
                    ref: TorchSampler[int] = TorchSampler(range(n), **kw)  # type: ignore[arg-type]
                    ours.set_epoch(epoch)
                    ref.set_epoch(epoch)
                    assert list(ours) == list(ref), (n, w, r, seed, epoch)
                    assert len(ours) == len(ref)


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_cover_the_dataset_disjointly(drop_last: bool) -> None:
    for n in range(1, 30):
        for w in range(1, 10):
            per_rank = [list(s) for s in samplers(n, w, drop_last=drop_last)]
            joined = interleave(per_rank)
            order = order_of(n)
            if drop_last:
                assert joined == order[: n // w * w]
                assert len(set(joined)) == len(joined)  # disjoint
            else:
                total = -(-n // w) * w
                assert set(joined) == set(range(n))  # covers
                assert joined == [order[p % n] for p in range(total)]  # repeats: padding only
                assert sum(c - 1 for c in Counter(joined).values()) == total - n


def test_deterministic_per_seed_and_epoch() -> None:
    a, b = samplers(50, 1)[0], samplers(50, 1)[0]
    assert list(a) == list(b) == list(a)  # same seed and epoch, same order, every pass
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    b.set_epoch(1)
    assert list(a) == list(b)
    assert list(samplers(50, 1, seed=1)[0]) != first
    assert list(samplers(50, 1, shuffle=False)[0]) == list(range(50))


def test_len_and_dataloader_count() -> None:
    s = DistributedSampler(range(10), num_replicas=4, rank=3, shuffle=False)
    assert len(s) == 3
    dataset: Any = list(range(10))  # a plain list: DataLoader indexes it
    loader: DataLoader[int] = DataLoader(dataset, batch_size=2, sampler=s)
    it = iter(loader)
    assert next(it).tolist() == [3, 7]
    assert s.state_dict()["consumed"] == 2 * 4
    assert [b.tolist() for b in it] == [[1]]  # position 11 pads with index 1
    assert s.state_dict()["consumed"] == 12


# --- resume -----------------------------------------------------------------------------------
def resume_case(n: int, w: int, k: int, w2: int, drop_last: bool, shuffle: bool) -> None:
    """k lockstep steps on w ranks, save, resume on w2 ranks: nothing lost or repeated."""
    old = samplers(n, w, drop_last=drop_last, shuffle=shuffle, seed=7)
    for s in old:
        s.set_epoch(3)
    iters = [iter(s) for s in old]
    before = [[next(it) for _ in range(k)] for it in iters]
    states = [s.state_dict() for s in old]
    assert all(st == states[0] for st in states)
    assert states[0]["consumed"] == k * w

    new = samplers(n, w2)  # default seed, epoch, shuffle, drop_last: the state replaces them
    for s in new:
        s.load_state_dict(states[0])
    remaining = max(0, n - k * w)
    steps = remaining // w2 if drop_last else -(-remaining // w2)
    assert all(len(s) == steps for s in new)
    after = interleave([list(s) for s in new])

    order = order_of(n, shuffle=shuffle, seed=7, epoch=3)
    assert interleave(before) == [order[p % n] for p in range(k * w)]
    assert after == [order[p % n] for p in range(k * w, k * w + steps * w2)]
    seen = Counter(interleave(before) + after)
    if drop_last:
        assert all(c == 1 for c in seen.values())  # none repeated
        assert len(seen) >= n - w2 + 1  # at most w2 - 1 of the tail dropped
    else:
        assert set(seen) == set(range(n))  # none lost


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_mid_epoch_on_any_world_size(drop_last: bool, shuffle: bool) -> None:
    for n in (1, 5, 10, 13, 24):
        for w in (1, 2, 3, 4):
            steps = len(samplers(n, w, drop_last=drop_last)[0])
            for k in range(steps + 1):
                for w2 in (1, 2, 3, 4, 5, 8):
                    resume_case(n, w, k, w2, drop_last, shuffle)


def test_resume_twice_across_growing_and_shrinking_worlds() -> None:
    n, taken = 23, []
    state: dict[str, Any] | None = None
    for w, k in ((4, 2), (2, 3), (5, 1), (3, 100)):
        group = samplers(n, w)
        for s in group:
            if state is not None:
                s.load_state_dict(state)
        iters = [iter(s) for s in group]
        per_rank = [[x for _, x in zip(range(k), it, strict=False)] for it in iters]
        taken += interleave(per_rank)
        state = group[0].state_dict()
    order = order_of(n)
    assert taken == [order[p % n] for p in range(len(taken))]
    assert set(taken) == set(range(n)) and len(taken) - n < 3  # padding: under one step of W=3


def test_state_dict_json_round_trip() -> None:
    s = samplers(11, 3, seed=4, drop_last=True)[1]
    s.set_epoch(2)
    it = iter(s)
    next(it)
    state = s.state_dict()
    assert all(type(v) in (int, bool) for v in state.values())
    loaded = json.loads(json.dumps(state))
    assert loaded == state
    t = samplers(11, 3)[1]
    t.load_state_dict(loaded)
    assert t.state_dict() == state
    assert list(t) == list(it)


def test_iteration_after_resume_and_epochs() -> None:
    s = samplers(10, 2)[0]
    full = list(s)
    it = iter(s)
    next(it), next(it)
    state = s.state_dict()

    t = samplers(10, 2)[0]
    t.load_state_dict(state)
    t.set_epoch(0)  # the saved epoch: the loaded position stays
    assert list(t) == full[2:] and len(t) == 5  # resumed pass; then the next one is whole
    assert list(t) == full

    t.load_state_dict(state)
    t.set_epoch(1)  # another epoch: the loaded position is dropped
    assert len(t) == 5 and t.state_dict()["consumed"] == 0
    t.set_epoch(0)
    assert list(t) == full

    it = iter(s)
    next(it)
    fresh = iter(s)  # a new pass; the abandoned one no longer counts
    next(it), next(it)
    assert s.state_dict()["consumed"] == 0
    assert next(fresh) == full[0] and s.state_dict()["consumed"] == 2


def test_state_after_a_finished_pass_resumes_empty() -> None:
    s = samplers(10, 2)[0]
    list(s)
    assert s.state_dict()["consumed"] == 10
    t = samplers(10, 2)[0]
    t.load_state_dict(s.state_dict())
    assert len(t) == 0 and list(t) == []
    assert len(t) == 5 and len(list(t)) == 5


def test_load_refuses_bad_states() -> None:
    state = samplers(10, 2)[0].state_dict()
    with pytest.raises(ValueError, match="dataset of 10 samples but this sampler's has 12"):
        samplers(12, 2)[0].load_state_dict(state)
    with pytest.raises(ValueError, match="lacks \\['consumed'\\]"):
        samplers(10, 2)[0].load_state_dict({k: v for k, v in state.items() if k != "consumed"})
    with pytest.raises(ValueError, match="consumed must be an int >= 0"):
        samplers(10, 2)[0].load_state_dict({**state, "consumed": -2})


# --- configuration ----------------------------------------------------------------------------
def test_replicas_from_a_group_and_validation() -> None:
    g = Group(pg=None, ranks=range(3), global_rank=1, name="data", backend="gloo", timeout=1)
    try:
        s = DistributedSampler(range(9), group=g, shuffle=False)
        assert (s.num_replicas, s.rank, list(s)) == (3, 1, [1, 4, 7])
        assert split_batch(torch.arange(9), group=g).data.tolist() == [3, 4, 5]
        with pytest.raises(ValueError, match="either group or num_replicas"):
            DistributedSampler(range(9), group=g, num_replicas=3, rank=1)
    finally:
        g.shutdown()
    with pytest.raises(TypeError, match="plait.comm.Group"):
        DistributedSampler(range(9), group="world")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank=4 is out of range.*0..3"):
        DistributedSampler(range(9), num_replicas=4, rank=4)
    with pytest.raises(ValueError, match="num_replicas must be at least 1"):
        DistributedSampler(range(9), num_replicas=0, rank=0)
    with pytest.raises(ValueError, match="both num_replicas and rank"):
        DistributedSampler(range(9), num_replicas=2)
    with pytest.raises(ValueError, match="dataset is empty"):
        DistributedSampler([], num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="non-negative int"):
        samplers(9, 1)[0].set_epoch(-1)


def test_without_init_says_to_call_init() -> None:
    if plait.is_initialized():
        pytest.skip("plait is initialized in this process")
    with pytest.raises(RuntimeError, match="plait.init"):
        DistributedSampler(range(9))
    with pytest.raises(RuntimeError, match="plait.init"):
        split_batch(torch.zeros(4))


# --- split_batch ------------------------------------------------------------------------------
class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def make_batch(rows: int) -> dict[str, Any]:
    x = torch.arange(rows * 3.0).reshape(rows, 3)
    return OrderedDict(
        x=x,
        y=[torch.arange(rows), (torch.ones(rows, 2, 2), "tag")],
        p=Pair(x + 1, torch.zeros(rows, dtype=torch.int64)),
        step=7,
    )


def flatten(batch: Any) -> list[Any]:
    if isinstance(batch, dict):
        return [x for v in batch.values() for x in flatten(v)]
    if isinstance(batch, (list, tuple)):
        return [x for v in batch for x in flatten(v)]
    return [batch]


def test_split_preserves_structure_and_concatenates_back() -> None:
    for rows in (0, 1, 3, 10, 12):
        batch = make_batch(rows)
        for w in range(1, 7):
            shards = [split_batch(batch, num_replicas=w, rank=r) for r in range(w)]
            sizes = [s.data["x"].shape[0] for s in shards]
            assert sizes == [rows // w + (r < rows % w) for r in range(w)]
            for s in shards:
                assert isinstance(s, BatchShard) and type(s.data) is OrderedDict
                assert isinstance(s.data["p"], Pair) and isinstance(s.data["y"], list)
                assert s.data["step"] == 7 and s.data["y"][1][1] == "tag"
            for i, leaf in enumerate(flatten(batch)):
                parts = [flatten(s.data)[i] for s in shards]
                if isinstance(leaf, torch.Tensor):
                    assert torch.equal(torch.cat(parts), leaf)
                else:
                    assert all(p == leaf for p in parts)
            if rows:
                assert sum(s.weight for s in shards) == pytest.approx(w)
            assert all(s.weight == 0 for s, n in zip(shards, sizes, strict=True) if n == 0)


def test_split_weights_and_empty_shards() -> None:
    weights = [split_batch(torch.zeros(10), num_replicas=4, rank=r).weight for r in range(4)]
    assert weights == pytest.approx([1.2, 1.2, 0.8, 0.8])
    empty = split_batch(torch.zeros(2, 5), num_replicas=4, rank=3)
    assert empty.data.shape == (0, 5) and empty.weight == 0


@pytest.mark.parametrize("rows,w", [(10, 4), (7, 3), (12, 4), (3, 5), (1, 4), (5, 1)])
def test_weighted_shard_gradients_average_to_the_global_gradient(rows: int, w: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).double()
    x, y = torch.randn(rows, 4, dtype=torch.float64), torch.randn(rows, 2, dtype=torch.float64)

    def grads(inputs: torch.Tensor, targets: torch.Tensor, weight: float) -> list[torch.Tensor]:
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        (loss * weight).backward()
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    expected = grads(x, y, 1.0)
    total = [torch.zeros_like(g) for g in expected]
    for r in range(w):
        (xs, ys), weight = split_batch((x, y), num_replicas=w, rank=r)
        for t, g in zip(total, grads(xs, ys, weight), strict=True):
            t += g / w  # what an all-reduce with op="avg" computes
    for t, g in zip(total, expected, strict=True):
        torch.testing.assert_close(t, g, rtol=1e-12, atol=1e-12)


def test_split_errors_name_the_path() -> None:
    bad = {"x": torch.zeros(4, 2), "y": [torch.zeros(4), torch.zeros(3)]}
    with pytest.raises(ValueError, match=r"batch\['y'\]\[1\] has 3 rows .* batch\['x'\] has 4"):
        split_batch(bad, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match=r"batch\['s'\] is a 0-dim tensor"):
        split_batch({"x": torch.zeros(4), "s": torch.tensor(1.0)}, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="holds no tensor"):
        split_batch({"n": 3}, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="rank=2 is out of range"):
        split_batch(torch.zeros(4), num_replicas=2, rank=2)
