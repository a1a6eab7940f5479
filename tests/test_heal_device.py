"""Healing's device discipline, checked without a GPU: every tensor the heal code makes
for a collective is made on the parameters' device (a static check of the source: a
tensor made without ``device=`` lands on the CPU whatever the model's device, which NCCL
refuses and which a CUDA gradient cannot be concatenated with); the random state a
replacement receives; the settings refused up front. What runs on CUDA is checked by the
GPU suite's ``healing`` section (benchmarks/gpu.py)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from plait.heal import state
from plait.heal.trainer import HealingTrainer

HEAL = Path(__file__).resolve().parents[1] / "plait" / "heal"
MAKERS = {"empty", "zeros", "ones", "full", "tensor", "arange", "randn", "rand"}
# (module, line's text) made on the CPU on purpose, each with its reason
ALLOWED = {
    (
        "buckets.py",
        "itemsize = torch.empty((), dtype=self.dtype).element_size()",
    ): "a size read, never sent",
    (
        "groups.py",
        "flag = torch.zeros(1)",
    ): "gloo only: the build's probe, handed to the gloo process group itself",
    (
        "replicas.py",
        'self.last_loss = torch.tensor(float("nan"))',
    ): "the loss before the first step, never sent (the cursor carries it on the device)",
}


def _cpu_made() -> list[tuple[str, int, str]]:
    """Every ``torch.<maker>(...)`` call in plait/heal without a ``device=`` keyword."""
    found = []
    for path in sorted(HEAL.glob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            base = node.func.value
            if not (isinstance(base, ast.Name) and base.id == "torch"):
                continue
            if node.func.attr in MAKERS and not any(k.arg == "device" for k in node.keywords):
                found.append((path.name, node.lineno, lines[node.lineno - 1].strip()))
    return found


def test_every_tensor_the_heal_code_makes_is_made_on_the_parameters_device() -> None:
    stray = [(m, n, text) for m, n, text in _cpu_made() if (m, text) not in ALLOWED]
    assert stray == [], (
        "tensors made on the CPU whatever the model's device (pass device=, the "
        "parameters' device; or add to ALLOWED with the reason it is never sent): "
        f"{stray}"
    )
    # the allowed ones still exist (a stale entry would hide a new stray one)
    assert {(m, text) for m, _, text in _cpu_made()} == set(ALLOWED)


def test_the_random_state_travels_as_bytes_and_is_set_back() -> None:
    torch.manual_seed(3)
    saved = state.rng_state(torch.device("cpu"))
    assert saved.dtype == torch.uint8 and saved.device.type == "cpu"
    expected = torch.rand(4)
    torch.manual_seed(4)  # a replacement's own seed
    state.set_rng_state(saved.clone(), torch.device("cpu"))
    assert torch.equal(torch.rand(4), expected)


def _trainer(model: nn.Module, backend: str) -> None:
    HealingTrainer(
        model,
        torch.optim.SGD([p for p in model.parameters() if p.device.type != "meta"], lr=0.1),
        loss_fn=nn.functional.mse_loss,
        microbatch_size=1,
        world=2,
        address="127.0.0.1:1",  # refused before it connects
        slot=1,
        backend=backend,
    )


def test_nccl_with_a_model_on_the_cpu_is_refused_naming_the_slot_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"slot 1: backend='nccl' moves CUDA tensors only.*cpu"):
        _trainer(nn.Linear(2, 2), "nccl")


def test_parameters_on_two_devices_are_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match=r"slot 1: the trainable parameters are on \['cpu', "):
        _trainer(model, "gloo")


def test_the_exchange_and_state_buffers_follow_the_parameters_device() -> None:
    """The buffers made once per trainer (the bucketed exchange's, the chunks') are on
    the parameters' device: ``meta`` here stands for a GPU (no data needed to build them)."""
    from plait.heal.buckets import OverlappedExchange
    from plait.heal.zero import ShardedState

    model = nn.Linear(3, 2, device="meta")
    params = list(model.parameters())
    exchange = OverlappedExchange(params, bucket_mb=1.0)
    try:
        assert exchange.device.type == "meta"
    finally:
        exchange.close()
    sharded = ShardedState(torch.optim.Adam(params, lr=0.1), params)
    assert sharded.device.type == "meta"


def _through_host_copies() -> list[Any]:
    """The block exchange (two members, one holding two blocks) with every receive of
    the channel staged as a CUDA tensor's is on gloo: into a host buffer, copied into the
    destination at the wait."""
    import plait
    from plait.comm.channel import Channel
    from plait.heal import blocks
    from plait.strategies.reproducible.tree import tree_sum

    w = plait.world()
    g = torch.Generator().manual_seed(5)
    parts = [torch.randn(37, generator=g, dtype=torch.float64) * 1e3 for _ in range(4)]
    owned = {0: [0, 3], 1: [1, 2]}
    staged: list[int] = []
    original = Channel._staged

    def every(self: Channel, tensor: torch.Tensor) -> bool:
        staged.append(tensor.numel())
        return True

    Channel._staged = every  # type: ignore[method-assign]
    link, w.shm = w.shm, None  # the process group's transport (gloo), where staging is
    try:
        mine = {v: parts[v] for v in owned[w.rank]}
        out = blocks.block_tree_all_reduce(mine, owned=owned, world=4, group=w)
    finally:
        Channel._staged = original  # type: ignore[method-assign]
        w.shm = link
    return [torch.equal(out, tree_sum(parts)), len(staged) > 0]


def test_a_staged_receive_lands_in_its_tensor_at_the_wait(ranks: Any) -> None:
    assert ranks(2, _through_host_copies) == [[True, True]] * 2
