"""Whole-matrix optimizers (Muon, Adafactor) under sharded strategies equal one process
on the global batch in float64: parameters and optimizer state, several steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.plan.memory import owned_state_bytes
from plait.strategies.fsdp.policies import OffloadPolicy
from plait.strategies.whole_matrix import is_whole_matrix, ownership
from tests import whole_matrix_fns as fns

TOL = 1e-10


def _check(results: list[dict[str, Any]], expected: dict[str, Any], rtol: float = 0.0) -> None:
    """Parameters within TOL; optimizer state within TOL, plus ``rtol`` times the largest
    entry for Shampoo, whose
    inverse fourth roots amplify the last-bit differences of a gradient averaged in another
    order by their condition number (measured: 6e-9 on entries of size 32 under tp, a
    relative 2e-10; the parameters still agree within TOL)."""
    for r in results:
        assert set(r["params"]) == set(expected["params"])
        for name, want in expected["params"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=0, atol=TOL, msg=name)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for r in results:  # each rank holds the state it owns (the element-wise one, all of it)
        state.update(r["state"])
    assert set(state) == set(expected["state"])
    for name, entry in expected["state"].items():
        assert set(state[name]) == set(entry), name
        for key, want in entry.items():
            torch.testing.assert_close(
                state[name][key],
                want,
                rtol=0,
                atol=TOL + rtol * float(want.abs().max()),
                msg=name + key,
            )


def test_ownership_balances_by_size_deterministically() -> None:
    assert ownership([100, 10, 60, 50], 2) == [0, 0, 1, 1]  # 100 | 60+50, then 10
    assert ownership([5, 5, 5], 4) == [0, 1, 2]
    plan_free = ownership([], 3)
    assert plan_free == []


def test_known_and_declared_optimizers() -> None:
    p = [torch.nn.Parameter(torch.zeros(2, 2))]
    assert is_whole_matrix(torch.optim.Muon(p))
    assert is_whole_matrix(torch.optim.Adafactor(p))
    adam = torch.optim.Adam(p)
    assert not is_whole_matrix(adam)
    assert is_whole_matrix(adam, declared=[adam])


@pytest.mark.parametrize(
    "strategy,options",
    [
        ("zero1", {}),
        ("zero2", {}),
        ("fsdp", {}),
        ("fsdp", {"offload": OffloadPolicy(params=True, optimizer_state=True)}),
    ],
    ids=["zero1", "zero2", "fsdp", "fsdp-offload"],
)
def test_muon_and_adamw_equal_one_process(
    ranks: Any, strategy: str, options: dict[str, Any]
) -> None:
    results = ranks(2, fns.train, strategy, "muon", **options, timeout=60)
    _check(results, fns.oracle("muon"))
    assert sorted(results[0]["owners"]) == [0, 1]  # one hidden matrix per rank
    # the planner's count of the owned state (Muon: one float64 momentum per element)
    held = [
        sum(t.numel() * 8 for n in fns.HIDDEN if n in r["state"] for t in r["state"][n].values())
        for r in results
    ]
    assert held == owned_state_bytes([16 * 12, 12 * 16], 2, state_bytes_per_element=8)


def _check_gpt(results: list[dict[str, Any]], expected: dict[str, Any], rtol: float = 0.0) -> None:
    for r in results:
        assert set(r["params"]) == set(expected["params"])
        for name, want in expected["params"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=0, atol=TOL, msg=name)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for r in results:
        state.update(r["state"])
    assert set(state) == set(expected["state"]) and state
    for name, entry in expected["state"].items():
        for key, want in entry.items():
            torch.testing.assert_close(
                state[name][key],
                want,
                rtol=0,
                atol=TOL + rtol * float(want.abs().max()),
                msg=name + key,
            )


@pytest.mark.parametrize(
    "strategy,options",
    [
        ("tp", {}),
        ("tp", {"sequence_parallel": True}),
        ("pipeline", {}),
        ("cp", {}),
        ("cp", {"zero": 2}),
        ("ep", {}),
    ],
    ids=["tp", "tp-sp", "pipeline", "cp", "cp-zero2", "ep"],
)
def test_gpt_muon_and_adamw_equal_one_process(
    ranks: Any, strategy: str, options: dict[str, Any]
) -> None:
    from tests import whole_matrix_gpt_fns as gpt

    results = ranks(2, gpt.train, strategy, "muon", **options, timeout=90)
    _check_gpt(results, gpt.oracle("muon", moe=strategy == "ep"))


@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_adafactor_and_adamw_equal_one_process(ranks: Any, strategy: str) -> None:
    results = ranks(2, fns.train, strategy, "adafactor", timeout=60)
    _check(results, fns.oracle("adafactor"))


def test_adafactor_under_tp_equals_one_process(ranks: Any) -> None:
    from tests import whole_matrix_gpt_fns as gpt

    results = ranks(2, gpt.train, "tp", "adafactor", sequence_parallel=True, timeout=90)
    _check_gpt(results, gpt.oracle("adafactor"))


def test_shampoo_from_pytorch_optimizer_under_fsdp_equals_one_process(ranks: Any) -> None:
    pytest.importorskip("pytorch_optimizer")
    results = ranks(2, fns.train, "fsdp", "shampoo", timeout=60)
    _check(results, fns.oracle("shampoo"), rtol=1e-8)


def test_shampoo_from_pytorch_optimizer_under_tp_equals_one_process(ranks: Any) -> None:
    pytest.importorskip("pytorch_optimizer")
    from tests import whole_matrix_gpt_fns as gpt

    results = ranks(2, gpt.train, "tp", "shampoo", timeout=90)
    _check_gpt(results, gpt.oracle("shampoo"), rtol=1e-8)


def test_state_saved_at_4_ranks_under_zero2_loads_at_2_under_fsdp(ranks: Any) -> None:
    saved = ranks(4, fns.save_under_zero2, 2, timeout=60)
    for other in saved[1:]:  # the full state is the same on every rank
        assert other["muon"]["state"].keys() == saved[0]["muon"]["state"].keys()
    assert set(saved[0]["muon"]["state"]) == set(fns.HIDDEN)
    results = ranks(2, fns.load_under_fsdp, saved[0], 2, timeout=60)
    _check(results, fns.oracle("muon"))


def test_cases_that_cannot_be_exact_are_refused_by_name(ranks: Any) -> None:
    out = ranks(2, fns.refusals, timeout=60)[0]
    assert "LBFGS" in out["lbfgs"] and "line search" in out["lbfgs"]
    assert "Muon" in out["cp_zero"] and "zero=3" in out["cp_zero"]
    assert "Muon" in out["ps"] and "not supported" in out["ps"]
    assert "whole_matrix=" in out["declared"] and "SGD" in out["declared"]
    assert "several optimizers" in out["ptdp_skip"] and "'skip'" in out["ptdp_skip"]
    assert "fp16" in out["fp16"] and "use bf16" in out["fp16"]
    assert "Muon" in out["zero_direct"] and "plait.prepare(model, [it" in out["zero_direct"]


@pytest.mark.parametrize("strategy", ["fsdp", "zero1"])
def test_plait_checkpoint_saved_at_4_under_zero2_loads_at_2_and_continues_exactly(
    ranks: Any, tmp_path: Any, strategy: str
) -> None:
    ranks(4, fns.checkpoint_save, str(tmp_path), 2, timeout=60)
    results = ranks(2, fns.checkpoint_load, str(tmp_path), strategy, timeout=60)
    _check(results, fns.oracle("muon"))


def test_one_adafactor_under_ptdp_without_tp_runs_as_it_is(ranks: Any) -> None:
    from tests import whole_matrix_gpt_fns as gpt

    want = gpt.ptdp_adafactor(oracle_only=True)
    for got in ranks(2, gpt.ptdp_adafactor, timeout=90):
        assert set(got) == set(want)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=TOL, msg=name)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
def test_hugging_face_llama_muon_under_tp_equals_one_process(
    ranks: Any, sequence_parallel: bool
) -> None:
    pytest.importorskip("transformers")
    from tests import whole_matrix_gpt_fns as gpt

    want = gpt.llama_muon(False)
    results = ranks(2, gpt.llama_muon, True, sequence_parallel, timeout=90)
    state: dict[str, torch.Tensor] = {}
    for r in results:
        for name, value in want["params"].items():
            torch.testing.assert_close(r["params"][name], value, rtol=0, atol=TOL, msg=name)
        state.update(r["state"])
    assert set(state) == set(want["state"]) and len(state) == 14  # 7 matrices x 2 layers
    for name, value in want["state"].items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=TOL, msg=name)


@pytest.mark.parametrize(
    ("pp", "dp", "tp", "zero"),
    [(2, 1, 2, 0), (2, 2, 1, 1), (1, 2, 2, 1)],
    ids=["pp2xtp2", "pp2xdp2-zero1", "dp2xtp2-zero1"],
)
def test_muon_and_adamw_under_ptdp_equal_one_process(
    ranks: Any, pp: int, dp: int, tp: int, zero: int
) -> None:
    from tests import whole_matrix_gpt_fns as gpt

    results = ranks(4, gpt.ptdp_muon, pp, dp, tp, zero, timeout=120)
    _check(results, gpt.oracle("muon"))


@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_bf16_muon_and_adamw_equal_one_process_under_the_same_policy(
    ranks: Any, strategy: str
) -> None:
    """bf16 compute, float32 masters and state: bitwise the one process that runs the
    ranks' row blocks one after the other (tests/test_precision.py's exact comparison)."""
    for r in ranks(2, fns.bf16, strategy, timeout=60):
        assert "bfloat16" in r["dtypes"], r["dtypes"]
        assert list(r["plait"]) == list(r["chunked"])
        for key, want in r["chunked"].items():
            assert torch.equal(r["plait"][key], want), (
                f"{strategy}: {key} differs by {float((r['plait'][key] - want).abs().max()):.3g}"
            )


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_one_global_clip_over_muon_and_adamw_equals_one_process(ranks: Any, strategy: str) -> None:
    """plait.clip_grad_norm_(model, [muon, adamw], max_norm): the norm over both
    optimizers' averaged gradients, every step clipped, as torch's clip on one process."""
    want = fns.oracle("muon", clip=True)
    assert all(n > fns.CLIP for n in want["norms"])  # the clip acts on every step
    results = ranks(2, fns.train, strategy, "muon", clip=True, timeout=60)
    for r in results:
        for got, norm in zip(r["norms"], want["norms"], strict=True):
            assert abs(got - norm) <= TOL * max(1.0, norm)
    _check(results, want)
