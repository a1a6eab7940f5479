"""The planner's whole-matrix optimizer state (``Job(whole_matrix="muon")``,
plait/plan/whole_matrix.py): its matrices are the ones plait's Muon tests hand to Muon, its
owned state the ownership plait's ptdp deals, and its bytes replace the job optimizer's for
those matrices."""

from __future__ import annotations

import math

import pytest

from plait.plan import memory, whole_matrix
from plait.plan.layout import Job, Layout, LayoutError
from plait.plan.model import from_gpt_config
from plait.plan.states import model_states, rank_contents
from plait.strategies.whole_matrix import ownership
from tests import whole_matrix_gpt_fns as gpt


def test_block_matrices_are_the_hidden_matrices_muon_takes() -> None:
    model = gpt.make_gpt()
    spec = from_gpt_config(model.config)
    hidden = [p.numel() for n, p in model.named_parameters() if gpt.HIDDEN.fullmatch(n)]
    assert sorted(hidden) == sorted(spec.layers * whole_matrix.block_matrices(spec))


@pytest.mark.parametrize(("tp", "dp", "zero"), [(2, 1, 0), (1, 2, 1), (2, 2, 1)])
def test_owned_state_is_the_nested_ownership_of_ptdp(tp: int, dp: int, zero: int) -> None:
    """tp first, then (ZeRO) dp among the matrices a tp rank owns, as
    plait.strategies.whole_matrix.ptdp deals them."""
    spec = from_gpt_config(gpt.make_gpt().config)
    numels = whole_matrix.block_matrices(spec)
    by_tp = ownership(numels, tp)
    worst = 0
    for t in range(tp):
        mine = [n for n, r in zip(numels, by_tp, strict=True) if r == t]
        by_dp = ownership(mine, dp) if zero else [0] * len(mine)
        for d in range(dp if zero else 1):
            worst = max(worst, sum(n for n, r in zip(mine, by_dp, strict=True) if r == d))
    assert whole_matrix.owned_bytes(numels, tp=tp, replicas=dp, zero=zero, per=4) == 4 * worst


def test_muon_state_replaces_adams_for_the_hidden_matrices() -> None:
    """fp32 under ZeRO-1 over 4 ranks, no tp: Adam's 8 bytes per element over P/4 for the
    rest, plus 4 bytes per element of the largest rank's owned matrices."""
    spec = from_gpt_config(gpt.make_gpt().config)
    layout = Layout(dp=4, zero=1)
    plain = Job(global_batch=8, seq=8, precision="fp32")
    muon = Job(global_batch=8, seq=8, precision="fp32", whole_matrix="muon")
    before, after = model_states(spec, plain, layout), model_states(spec, muon, layout)
    numels = spec.layers * whole_matrix.block_matrices(spec)
    rest = spec.num_params - sum(numels)
    owned = max(memory.owned_state_bytes(numels, 4, state_bytes_per_element=4))
    adam_rest = memory.estimate(
        num_params=rest, world_size=4, strategy="zero1", optimizer="adam", precision="fp32"
    ).optimizer_bytes
    counters = before.optimizer_bytes - 8 * spec.num_params / 4
    assert math.isclose(after.optimizer_bytes, adam_rest + owned + counters)
    assert after.params_bytes == before.params_bytes and after.grads_bytes == before.grads_bytes
    assert f"muon on {len(numels)} hidden matrices" in after.formula
    assert rank_contents(spec, layout) == [(spec.layers, 0, True, True)]


def test_grid_tensor_parallelism_is_refused_by_name() -> None:
    spec = from_gpt_config(gpt.make_gpt().config)
    job = Job(global_batch=8, seq=8, whole_matrix="muon")
    with pytest.raises(LayoutError, match="1D tensor parallelism only"):
        model_states(spec, job, Layout(tp=4, tp_mode="2d"))
    with pytest.raises(LayoutError, match="whole_matrix='shampoo'"):
        Job(global_batch=8, seq=8, whole_matrix="shampoo")
