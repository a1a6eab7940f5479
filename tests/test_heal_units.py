"""Healing FSDP gathered one unit at a time (``HealingTrainer(zero=3, wrap=...)``,
plait/heal/units.py): the order as data, the units chosen, and steps on kept ranks that
drive the trainer's zero=3 path (start gather, blocks, idle rounds, exchange, chunk step)
and must be torch.equal to the whole-model gather path and to one process (float64). The
whole runs with a kill are in tests/test_heal_fsdp.py (slow set)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.heal.units import CHILDREN, gather_order, select

W, M, BATCH, STEPS = 4, 2, 16, 3  # 8 micro-batches of 2: 2 per block


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in [(6, 8), (8, 8), (8, 8), (8, 4)]:
        layers += [nn.Linear(a, b, dtype=torch.float64), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


class _Scaled(nn.Module):
    """A parameter of the root's own (the root unit: gathered for the whole step) and a
    frozen one (replicated, never gathered) around the MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()
        self.scale = nn.Parameter(torch.full((4,), 0.5, dtype=torch.float64))
        self.shift = nn.Parameter(torch.ones(4, dtype=torch.float64), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale + self.shift


MODELS = {"mlp": _model, "scaled": _Scaled}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (
        torch.randn(BATCH, 6, generator=g, dtype=torch.float64),
        torch.randint(0, 4, (BATCH,), generator=g),
    )


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_one_micro_batch_gathers_forward_then_backward_keeping_the_last_unit():
    assert gather_order(4) == [0, 1, 2, 3, 2, 1, 0]
    assert gather_order(1) == [0]


def test_units_are_chosen_in_plaits_fsdp_vocabulary_and_never_nest():
    model = _model()
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert select(model, CHILDREN) == linears  # the Tanh hold nothing
    assert select(model, {nn.Linear}) == linears
    outer = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2))
    assert select(outer, (nn.Sequential,)) == [outer[0]]  # the outermost only
    assert select(model, [linears[2], linears[0]]) == [linears[2], linears[0]]
    with pytest.raises(ValueError, match="units do not nest"):
        select(outer, [outer[0], outer[0][0]])
    with pytest.raises(TypeError, match="a parameter count, plait FSDP's int, would nest"):
        select(model, 100)  # type: ignore[arg-type]


def test_tied_parameters_across_units_and_a_wrap_that_selects_nothing_are_refused():
    from plait.heal.fsdp import ShardedParams
    from plait.heal.units import UnitGathers

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight = model[0].weight
    params = list(model.parameters())
    sharded = ShardedParams(torch.optim.SGD(params, lr=0.1), params)
    with pytest.raises(ValueError, match=r"parameter 1.weight is in units 0 and 1 \(tied"):
        UnitGathers(sharded, model, wrap=CHILDREN, slot=0)
    with pytest.raises(ValueError, match="selects no module holding trainable parameters"):
        UnitGathers(sharded, model, wrap={nn.Conv2d}, slot=0)


def test_wrap_without_zero3_is_refused():
    from plait.heal import HealingTrainer

    model = _model()
    with pytest.raises(ValueError, match="wrap=.* zero=1 keeps the parameters whole"):
        HealingTrainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=nn.functional.cross_entropy,
            microbatch_size=M,
            world=W,
            address="127.0.0.1:1",  # refused before it connects
            slot=0,
            zero=1,
            wrap={nn.Linear},
        )


def _steps(
    owned: dict[int, list[int]], wraps: list[object], kind: str = "mlp"
) -> dict[str, object]:
    """``STEPS`` Adam steps of the trainer's zero=3 path on this pool's group, once per
    entry of ``wraps`` (None: the whole model at the step's start), ``owned``: blocks per
    group rank (a pool of 3 ranks plays the survivors of a 4-slot job)."""
    import plait
    from plait.heal.compute import BlockCompute
    from plait.heal.fsdp import ShardedParams
    from plait.heal.units import UnitGathers
    from plait.strategies.reproducible import ReproducibleRunner

    group = plait.world()
    out: dict[str, object] = {}
    for wrap in wraps:
        model = MODELS[kind]()
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        params = [p for p in model.parameters() if p.requires_grad]
        sharded = ShardedParams(opt, params)
        units = None if wrap is None else UnitGathers(sharded, model, wrap=wrap, slot=group.rank)
        compute = BlockCompute(
            model, opt, loss_fn=nn.functional.cross_entropy, microbatch_size=M,
            params=params, world=W, fault=None, exchange=None,
        )  # fmt: skip
        sharded.start(group.ranks, group.rank, 0)
        mine = sorted(owned[group.rank])
        most = max(len(b) for b in owned.values())
        count = BATCH // M
        peaks, sent = [], 0
        for step in range(STEPS):
            x, y = _batch(step)
            plait.comm.stats(reset=True)
            if step == 1:  # a user reading the parameters between steps (every member)
                sharded.unshard(group)
            sharded.peak = 0
            if units is not None:
                units.begin(group, owned=owned, per=count // W)
            else:
                sharded.unshard(group)
            partials = compute.partials(
                x, y, step=step, mine=mine, per=count // W, scale=1 / count, mask=0,
                reproducible=True,
            )  # fmt: skip
            if units is not None:
                units.idle(most - len(mine))
                units.finish()
            if step != 1:  # step 1: the whole path found the model gathered already
                peaks.append(sharded.peak)
            total = sharded.exchange(partials, owned=owned, world=W, group=group)
            sent = sum(
                s.bytes_sent for (c, _), s in plait.comm.stats().items() if c == "all_gather"
            )
            opt.zero_grad(set_to_none=True)
            sharded.step(total, torch.tensor(0.0))
            sharded.free()
        sharded.unshard(group)
        out[repr(wrap)] = {"flat": _flat(model), "peaks": peaks, "sent": sent}
    reference = MODELS[kind]()
    ref_opt = torch.optim.Adam([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    runner = ReproducibleRunner(
        reference, ref_opt, loss_fn=nn.functional.cross_entropy, microbatch_size=M
    )
    for step in range(STEPS):
        runner.step(*_batch(step))
        ref_opt.step()
    out["one process"] = _flat(reference)
    return out


def _unit_bytes() -> list[int]:
    return [
        8 * sum(p.numel() for p in m.parameters()) for m in _model() if isinstance(m, nn.Linear)
    ]


def test_per_unit_equals_the_whole_model_path_and_one_process_holding_one_unit_at_most(ranks):
    """4 members, one block each: the parameters after 3 Adam steps are torch.equal per
    unit, whole-model and in one process; the most parameter bytes held at once in a step
    is one unit's (the largest), where the whole-model path holds the model's twice
    (the parameters and the gather's flat buffer)."""
    out = ranks(W, _steps, {s: [s] for s in range(W)}, [CHILDREN, None])
    sizes = _unit_bytes()
    for r in out:
        per_unit, whole = r[repr(CHILDREN)], r["None"]
        assert torch.equal(per_unit["flat"], whole["flat"])
        assert torch.equal(per_unit["flat"], r["one process"])
        assert whole["peaks"] == [2 * sum(sizes)] * (STEPS - 1)
        assert per_unit["peaks"] == [max(sizes)] * (STEPS - 1)
        assert per_unit["sent"] > whole["sent"] > 0  # per-unit trades bytes for memory


def test_a_member_with_two_blocks_pairs_its_gathers_with_members_idle_in_its_second_round(
    ranks,
):
    """Three members of a 4-slot job (slot 2 dead): rank 0 computes blocks 0 and 2, ranks
    1 and 2 one block each and stay idle through rank 0's second round; no hang, and the
    result is torch.equal to the whole-model path and to one process."""
    owned = {0: [0, 2], 1: [1], 2: [3]}
    out = ranks(3, _steps, owned, [CHILDREN, (nn.Linear,), None], timeout=60)
    for r in out:
        assert torch.equal(r[repr(CHILDREN)]["flat"], r["None"]["flat"])
        assert torch.equal(r[repr((nn.Linear,))]["flat"], r["one process"])
        assert torch.equal(r["None"]["flat"], r["one process"])


def _out_of_order() -> str:
    import plait
    from plait.heal.fsdp import ShardedParams
    from plait.heal.units import UnitGathers

    group = plait.world()
    model = _model()
    params = list(model.parameters())
    sharded = ShardedParams(torch.optim.SGD(params, lr=0.1), params)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    units = UnitGathers(sharded, model, wrap=linears[::-1], slot=group.rank)
    sharded.start(group.ranks, group.rank, 0)
    units.begin(group, owned={r: [r] for r in range(group.size)}, per=1)
    try:
        model(torch.zeros(2, 6, dtype=torch.float64))
    except RuntimeError as exc:
        return str(exc)
    finally:
        units.active = False
    return "no error"


def test_a_forward_that_calls_the_units_out_of_the_listed_order_is_refused_at_once(ranks):
    for message in ranks(2, _out_of_order):
        assert "the forward reached unit 0 where unit 6 was due" in message
        assert "wrap=[...]" in message


def test_a_root_parameter_is_kept_for_the_step_and_a_frozen_one_stays_replicated(ranks):
    """wrap={nn.Linear} inside a module with a trainable parameter of its own (the root
    unit) and a frozen one: torch.equal to the whole-model path and to one process."""
    out = ranks(2, _steps, {0: [0, 1], 1: [2, 3]}, [(nn.Linear,), None], "scaled")
    for r in out:
        assert torch.equal(r[repr((nn.Linear,))]["flat"], r["None"]["flat"])
        assert torch.equal(r["None"]["flat"], r["one process"])
