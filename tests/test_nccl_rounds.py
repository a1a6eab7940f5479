"""Every plait algorithm, named on NCCL, completes under NCCL's stream rules.

tests/nccl_streams.py runs each algorithm of ``plait/comm`` on 2, 3 and 4 simulated ranks
with plait's real ``Channel`` over a model of ProcessGroupNCCL's ordering (one stream per
pair for a single send or receive, a send blocking until its receive runs; a
``batch_isend_irecv`` as one group on the rank's stream). With the channel's rounds (a
device backend: each wait starts the round's sends and the receives it waits for as one
batch) every algorithm completes, with the right result on every rank, and every byte the
channel counted was delivered. Started one message at a time, as plait did before rounds
(and still does on gloo, whose pairs match by tag and never block that way), several
deadlock, among them every ring at two ranks (each rank sends to and receives from its
one neighbour on the same pair stream).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.comm import dissemination, ops, ring
from plait.comm.chunks import split
from plait.comm.reduce_op import ReduceOp
from plait.strategies.context.ring import shift
from tests import nccl_streams

K = 5  # elements per rank's chunk: segments of 2 elements make several rounds per step
CASES = [
    (collective, algorithm)
    for collective, algorithms in ops.SUPPORTED.items()
    for algorithm in algorithms
    if algorithm not in ("shm", "native")  # not plait's messages: the backend's own
] + [("barrier", "dissemination")]


def _body(collective: str, algorithm: str, n: int) -> Any:
    impl = (
        dissemination.barrier
        if collective == "barrier"
        else getattr(ops.ALGORITHMS[algorithm], collective)
    )
    root = 1 % n
    base = torch.arange(1, n * K + 1, dtype=torch.float64)

    def body(ch: Any) -> Any:
        r = ch.rank
        if collective == "all_reduce":
            flat = base * (r + 1)
            impl(ch, flat, ReduceOp.SUM)
            return flat
        if collective == "reduce_scatter":
            buffer = base * (r + 1)
            out = torch.empty(K, dtype=torch.float64)
            impl(ch, split(buffer, [K] * n), out, ReduceOp.SUM)
            return out
        if collective == "all_gather":
            chunks = split(torch.zeros(n * K, dtype=torch.float64), [K] * n)
            chunks[r].copy_(base[:K] * (r + 1))
            impl(ch, chunks)
            return torch.cat(chunks)
        if collective == "broadcast":
            flat = base * (r + 1)
            impl(ch, flat, root)
            return flat
        if collective == "reduce":
            flat = base * (r + 1)
            impl(ch, flat, root, ReduceOp.SUM)
            return flat
        if collective == "all_to_all":
            inputs = [torch.full((K,), 100.0 * r + j, dtype=torch.float64) for j in range(n)]
            outputs = [torch.empty(K, dtype=torch.float64) for _ in range(n)]
            impl(ch, outputs, inputs)
            return torch.cat(outputs)
        impl(ch)  # barrier
        return None

    return body


def _expected(collective: str, n: int, r: int) -> torch.Tensor | None:
    base = torch.arange(1, n * K + 1, dtype=torch.float64)
    total = base * (n * (n + 1) // 2)
    root = 1 % n
    if collective == "all_reduce":
        return total
    if collective == "reduce_scatter":
        return total[r * K : (r + 1) * K]
    if collective == "all_gather":
        return torch.cat([base[:K] * (i + 1) for i in range(n)])
    if collective == "broadcast":
        return base * (root + 1)
    if collective == "reduce":
        return total if r == root else base * (r + 1)
    if collective == "all_to_all":
        return torch.cat([torch.full((K,), 100.0 * j + r, dtype=torch.float64) for j in range(n)])
    return None


@pytest.fixture
def small_segments(monkeypatch):
    """Segments and broadcast pieces of 2 float64: several rounds per ring step."""
    monkeypatch.setattr(ring, "SEGMENT_BYTES", 16)
    monkeypatch.setattr(ring, "BROADCAST_PIECE_BYTES", 16)


@pytest.mark.parametrize("collective,algorithm", CASES)
def test_rounds_complete_under_nccl_stream_rules(
    collective, algorithm, monkeypatch, small_segments
):
    for n in (2, 3, 4):
        got = nccl_streams.run(
            n, _body(collective, algorithm, n), batched=True, monkeypatch=monkeypatch
        )
        assert got.error is None, f"{algorithm} {collective} at {n} ranks: {got.error}"
        for r in range(n):
            want = _expected(collective, n, r)
            if want is not None:
                assert torch.equal(got.outputs[r], want), f"{algorithm} {collective} n={n} rank {r}"
        # every byte a channel counted as sent was delivered, and received by someone
        assert got.sent == got.moved, (algorithm, collective, n, got.sent, got.moved)
        assert sum(got.sent) == sum(got.received), (algorithm, collective, n)


def test_messages_started_one_at_a_time_deadlock(monkeypatch, small_segments):
    """What the rounds fix: started alone (plait before rounds), these hang on NCCL."""
    hung = []
    for collective, algorithm in CASES:
        for n in (2, 3, 4):
            got = nccl_streams.run(
                n, _body(collective, algorithm, n), batched=False, monkeypatch=monkeypatch
            )
            if got.error is not None:
                assert "no operation can run" in got.error, got.error
                hung.append(f"{algorithm} {collective} n={n}")
    print("deadlock without rounds:", hung)
    for collective in ("all_reduce", "reduce_scatter", "all_gather"):
        assert f"ring {collective} n=2" in hung, hung


def _ring_shift(channel):
    """Ring attention's step: send a block to cp rank + 1, receive rank - 1's."""
    group = channel.group
    group.seq = 0
    block = torch.full((3,), float(group.rank), dtype=torch.float64)
    return shift([block], group, kind="cp_kv", what="move K/V").wait()[0]


def test_ring_attention_shift_is_one_round_on_nccl(monkeypatch):
    """A context-parallel ring shift posts its receive and its send as one round: at 2
    ranks (previous = next) started one at a time they hang on NCCL's pair stream."""
    for n in (2, 3, 4):
        got = nccl_streams.run(n, _ring_shift, batched=True, monkeypatch=monkeypatch)
        assert got.error is None, f"ring shift at {n} ranks: {got.error}"
        for r in range(n):
            assert torch.equal(got.outputs[r], torch.full((3,), float((r - 1) % n)).double())
        assert got.moved == [24] * n  # each rank delivered its one block
    alone = nccl_streams.run(2, _ring_shift, batched=False, monkeypatch=monkeypatch)
    assert alone.error is not None and "no operation can run" in alone.error, alone.error
