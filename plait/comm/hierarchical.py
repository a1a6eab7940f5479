"""Hierarchical algorithms: first inside each node, then among one leader per node.

Ranks are grouped into nodes: by host (consecutive blocks of ``LOCAL_WORLD_SIZE`` global
ranks, as torchrun and ``plait.spawn`` number them), or in blocks of ``node_size`` group
ranks when the group was created with one. All-reduce runs in three phases:

1. inside each node, a binomial-tree reduce to the node's leader (its first rank);
2. among the leaders only, a ring all-reduce (the one phase that crosses the slow links);
3. inside each node, a binomial-tree broadcast from the leader.

Across nodes only the leaders talk, once per node instead of once per rank. Reduce and
broadcast use the same two levels, with the root standing in as its node's leader.
"""

from __future__ import annotations

import os

import torch

from plait.comm import ring, tree
from plait.comm.group import Channel
from plait.comm.reduce_op import ReduceOp


def node_ids(ch: Channel) -> list[int]:
    """The node of each channel rank."""
    group = ch.group
    if group.node_size:
        return [group_rank // group.node_size for group_rank in ch.members]
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or group.size
    return [group.ranks[group_rank] // per_host for group_rank in ch.members]


def _levels(ch: Channel, root: int) -> tuple[list[int], list[int]]:
    """Channel ranks of this rank's node, and of the leader of every node (root's leads)."""
    nodes = node_ids(ch)
    order: list[int] = []
    for n in nodes:
        if n not in order:
            order.append(n)
    leaders = []
    for n in order:
        members = [r for r in range(ch.size) if nodes[r] == n]
        leaders.append(root if root in members else members[0])
    local = [r for r in range(ch.size) if nodes[r] == nodes[ch.rank]]
    return local, leaders


def _leader_of(local: list[int], leaders: list[int]) -> int:
    return next(r for r in local if r in leaders)


def all_reduce(ch: Channel, flat: torch.Tensor, op: ReduceOp) -> None:
    local, leaders = _levels(ch, root=0)
    leader = _leader_of(local, leaders)
    node = ch.view(local)
    tree.reduce(node, flat, local.index(leader), op)
    if ch.rank == leader:
        ring.all_reduce(ch.view(leaders), flat, op)
    tree.broadcast(node, flat, local.index(leader))


def reduce(ch: Channel, flat: torch.Tensor, root: int, op: ReduceOp) -> None:
    local, leaders = _levels(ch, root)
    leader = _leader_of(local, leaders)
    # a leader that is not the root must leave the caller's tensor unchanged
    buf = flat.clone() if ch.rank == leader and ch.rank != root else flat
    tree.reduce(ch.view(local), buf, local.index(leader), op)
    if ch.rank == leader:
        tree.reduce(ch.view(leaders), buf, leaders.index(root), op)


def broadcast(ch: Channel, flat: torch.Tensor, root: int) -> None:
    local, leaders = _levels(ch, root)
    leader = _leader_of(local, leaders)
    if ch.rank == leader:
        tree.broadcast(ch.view(leaders), flat, leaders.index(root))
    tree.broadcast(ch.view(local), flat, local.index(leader))
