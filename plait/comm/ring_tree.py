"""Ring + tree all-reduce: a ring level inside each host, a tree level across hosts.

Nodes are told apart as in ``hierarchical.py`` (hosts, or blocks of ``node_size``). With
L ranks on every node, the buffer is cut into L shards and:

1. inside each node, a reduce-scatter: local rank i ends with shard i summed over its
   node (the ``"shm"`` collective when every rank of the node shares memory with this one,
   else the ring on the node's transport);
2. across nodes, the ranks holding shard i (local rank i of every node) all-reduce it:
   the double binary tree (``tree.py``) up to ``TREE_MAX_BYTES`` per shard, where its
   log2(nodes) steps win, the ring above, where its bandwidth wins;
3. inside each node, an all-gather of the shards.

Every link between hosts carries S/L per rank instead of the whole buffer through one
leader (``hierarchical.py``), so all L ranks of a node use the network at once, as NCCL
does between nodes. Bytes sent per rank: (L-1)/L S twice inside the node, plus the cross-
node all-reduce of S/L. When nodes differ in size the shards cannot line up, and the
leaders' path of ``hierarchical.all_reduce`` runs instead (same result, documented here).
Each shard is reduced once per node and then once across nodes, then copied, so every
rank ends with bitwise the same result.
"""

from __future__ import annotations

import torch

from plait.comm import hierarchical, ring, shm_collectives, tree
from plait.comm.chunks import even_counts, split
from plait.comm.group import Channel
from plait.comm.reduce_op import ReduceOp

TREE_MAX_BYTES = 1 << 20


def levels(ch: Channel) -> tuple[list[int], list[int]] | None:
    """(channel ranks of this rank's node, channel ranks holding the same shard on every
    node, in node order), or None when the nodes differ in size."""
    nodes = hierarchical.node_ids(ch)
    order: list[int] = []
    for node in nodes:
        if node not in order:
            order.append(node)
    members = [[r for r in range(ch.size) if nodes[r] == node] for node in order]
    if len({len(m) for m in members}) != 1:
        return None
    mine = members[order.index(nodes[ch.rank])]
    index = mine.index(ch.rank)
    return mine, [m[index] for m in members]


def all_reduce(ch: Channel, flat: torch.Tensor, op: ReduceOp) -> None:
    found = levels(ch)
    if found is None:
        hierarchical.all_reduce(ch, flat, op)
        return
    local, across = found
    node = ch.view(local)
    shards = split(flat, even_counts(flat.numel(), node.size))
    mine = shards[node.rank]
    link = ch.group.shm
    shared = link is not None and link.covers(node.members)
    # 1. reduce-scatter inside the node (shard i is read only where it is written)
    if node.size > 1:
        if shared:
            shm_collectives.reduce_scatter(node, shards, mine, op)
        else:
            ring.reduce_scatter(node, shards, mine, op)
    # 2. all-reduce this shard across the nodes
    if len(across) > 1:
        cross = ch.view(across)
        small = mine.numel() * mine.element_size() <= TREE_MAX_BYTES
        (tree.all_reduce if small else ring.all_reduce)(cross, mine, op)
    # 3. all-gather inside the node
    if node.size > 1:
        if shared:
            shm_collectives.all_gather(node, shards)
        else:
            ring.all_gather(node, shards)
