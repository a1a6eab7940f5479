"""plait.plan.memory: the ZeRO paper's Figure 1, the measurement, and `plait plan memory`."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from plait.cli import main
from plait.plan import MemoryEstimate, compare, estimate
from plait.plan.memory import measure

# ZeRO paper, Figure 1: 7.5B parameters, Adam (K = 12), 64 ranks, mixed precision.
FIGURE_1 = {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}


@pytest.mark.parametrize("strategy", sorted(FIGURE_1))
def test_reproduces_zero_figure_1(strategy: str) -> None:
    e = estimate(num_params=7.5e9, world_size=64, strategy=strategy)
    assert round(e.total_gb, 1) == FIGURE_1[strategy]
    assert f"{e.total_gb:.1f}" == f"{FIGURE_1[strategy]:.1f}"
    assert e.total_bytes == e.params_bytes + e.grads_bytes + e.optimizer_bytes


def test_figure_1_terms() -> None:
    p, n = 7.5e9, 64
    ddp, z1, z2, z3 = compare(num_params=p, world_size=n)
    assert (ddp.params_bytes, ddp.grads_bytes, ddp.optimizer_bytes) == (2 * p, 2 * p, 12 * p)
    assert (z1.params_bytes, z1.grads_bytes, z1.optimizer_bytes) == (2 * p, 2 * p, 12 * p / n)
    assert (z2.params_bytes, z2.grads_bytes, z2.optimizer_bytes) == (2 * p, 2 * p / n, 12 * p / n)
    assert (z3.params_bytes, z3.grads_bytes, z3.optimizer_bytes) == (
        2 * p / n,
        2 * p / n,
        12 * p / n,
    )
    assert [e.formula for e in (ddp, z1, z2, z3)] == [
        "2P + 2P + 12P",
        "2P + 2P + 12P/n",
        "2P + 2P/n + 12P/n",
        "2P/n + 2P/n + 12P/n",
    ]
    assert z3.num_params == 7_500_000_000 and z3.world_size == 64
    assert (z3.strategy, z3.optimizer, z3.precision) == ("zero3", "adam", "mixed")


@pytest.mark.parametrize(
    ("precision", "optimizer", "per_param"),
    [
        ("mixed", "adam", (2, 2, 12)),
        ("mixed", "adamw", (2, 2, 12)),
        ("mixed", "sgd_momentum", (2, 2, 8)),
        ("mixed", "sgd", (2, 2, 4)),
        ("fp32", "adam", (4, 4, 8)),
        ("fp32", "adamw", (4, 4, 8)),
        ("fp32", "sgd_momentum", (4, 4, 4)),
        ("fp32", "sgd", (4, 4, 0)),
    ],
)
def test_bytes_per_parameter(precision: str, optimizer: str, per_param: tuple[int, ...]) -> None:
    e = estimate(
        num_params=1000, world_size=1, strategy="ddp", optimizer=optimizer, precision=precision
    )
    assert (e.params_bytes, e.grads_bytes, e.optimizer_bytes) == tuple(1000 * b for b in per_param)


def test_aliases_and_world_of_one() -> None:
    kw: dict[str, Any] = {"num_params": 10**6, "world_size": 8}
    assert estimate(strategy="none", **kw) == estimate(strategy="ddp", **kw)
    assert estimate(strategy="fsdp", **kw) == estimate(strategy="zero3", **kw)
    assert estimate(strategy="fsdp", **kw).strategy == "zero3"
    one = [e.total_bytes for e in compare(num_params=10**6, world_size=1)]
    assert one == [16e6] * 4


def test_shard_rounding() -> None:
    exact = estimate(num_params=10, world_size=4, strategy="zero3")
    padded = estimate(num_params=10, world_size=4, strategy="zero3", shard_rounding=True)
    assert exact.total_bytes == 16 * 10 / 4  # 40: the average rank
    assert padded.total_bytes == 16 * 3  # 48: ceil(10 / 4) = 3 elements on every rank
    assert padded.formula == "2*ceil(P/n) + 2*ceil(P/n) + 12*ceil(P/n)"
    divisible: dict[str, Any] = dict(num_params=12, world_size=4, strategy="zero2")
    assert estimate(**divisible) == dataclasses.replace(
        estimate(**divisible, shard_rounding=True), formula="2P + 2P/n + 12P/n"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_params": 0}, "num_params must be a whole number above 0"),
        ({"num_params": -5}, "num_params must be a whole number above 0"),
        ({"num_params": 1.5}, "num_params must be a whole number above 0"),
        ({"world_size": 0}, "world_size must be a whole number of ranks, at least 1"),
        ({"world_size": 2.5}, "world_size must be a whole number of ranks, at least 1"),
        ({"strategy": "zero4"}, "unknown strategy 'zero4'; use one of ['ddp', 'zero1'"),
        ({"optimizer": "lion"}, "use one of ['adam', 'adamw', 'sgd', 'sgd_momentum']"),
        ({"precision": "fp8"}, "unknown precision 'fp8'; use one of ['mixed', 'fp32']"),
    ],
)
def test_refuses_bad_input(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, Any] = {"num_params": 1000, "world_size": 2, "strategy": "zero1"}
    args.update(kwargs)
    with pytest.raises(ValueError) as info:
        estimate(**args)
    assert message in str(info.value)


def test_estimate_is_frozen() -> None:
    e = estimate(num_params=1000, world_size=2, strategy="zero1")
    assert isinstance(e, MemoryEstimate) and isinstance(measure(_model()), MemoryEstimate)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.total_bytes = 0  # type: ignore[misc]
    assert "31.4" in str(estimate(num_params=7.5e9, world_size=64, strategy="zero1"))


# --- measure ------------------------------------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()


def test_measure_plain_model_and_adam() -> None:
    model = _model()
    params = list(model.parameters())
    p = sum(t.numel() for t in params)
    optimizer = torch.optim.Adam(params, lr=1e-3)
    _one_step(model, optimizer)
    m = measure(model, optimizer, world_size=1)
    # Adam keeps exp_avg and exp_avg_sq (8P in fp32) and one 'step' tensor per parameter
    # tensor, which measure() counts: a float32 scalar each in PyTorch's Adam.
    steps = [optimizer.state[t]["step"] for t in params]
    assert all(s.dtype == torch.float32 and s.numel() == 1 for s in steps)
    assert (m.params_bytes, m.grads_bytes) == (4 * p, 4 * p)
    assert m.optimizer_bytes == 8 * p + 4 * len(params)
    assert m.total_bytes == 16 * p + 4 * len(params)
    assert (m.strategy, m.num_params, m.precision, m.optimizer) == (
        "measured",
        p,
        "float32",
        "adam",
    )
    # the estimator's fp32 Adam (which leaves the step counters out) agrees on the rest
    e = estimate(num_params=p, world_size=1, strategy="ddp", precision="fp32")
    assert (e.params_bytes, e.grads_bytes) == (m.params_bytes, m.grads_bytes)
    assert e.optimizer_bytes == m.optimizer_bytes - 4 * len(params)


def test_measure_matches_estimate_for_sgd_momentum() -> None:
    model = _model()
    p = sum(t.numel() for t in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _one_step(model, optimizer)
    m = measure(model, optimizer)
    e = estimate(
        num_params=p, world_size=1, strategy="ddp", optimizer="sgd_momentum", precision="fp32"
    )
    assert (m.params_bytes, m.grads_bytes, m.optimizer_bytes) == (
        e.params_bytes,
        e.grads_bytes,
        e.optimizer_bytes,
    )
    assert m.world_size == 1  # torch.distributed is not initialized here


def test_measure_before_backward_and_without_optimizer() -> None:
    model = _model()
    p = sum(t.numel() for t in model.parameters())
    m = measure(model)
    assert (m.params_bytes, m.grads_bytes, m.optimizer_bytes, m.optimizer) == (4 * p, 0, 0, "none")


class _FlatModel(torch.nn.Module):
    """Two parameters that are views of one flat buffer, gradients views of another."""

    def __init__(self, flat_size: int = 10) -> None:
        super().__init__()
        self.flat = torch.zeros(flat_size)
        self.a = torch.nn.Parameter(self.flat[:4])
        self.b = torch.nn.Parameter(self.flat[4:10])
        self.flat_grad = torch.zeros(flat_size)
        self.a.grad = self.flat_grad[:4]
        self.b.grad = self.flat_grad[4:10]


def test_views_of_one_buffer_are_counted_once() -> None:
    model = _FlatModel()
    assert model.a.untyped_storage().data_ptr() == model.flat.untyped_storage().data_ptr()
    m = measure(model)
    assert (m.params_bytes, m.grads_bytes, m.num_params) == (40, 40, 10)


def test_whole_storage_counts_not_only_the_viewed_span() -> None:
    # A shard that is a view into a larger buffer keeps the whole buffer alive.
    model = _FlatModel(flat_size=100)
    m = measure(model)
    assert (m.params_bytes, m.grads_bytes, m.num_params) == (400, 400, 10)


def test_a_storage_in_two_kinds_is_counted_once() -> None:
    model = _FlatModel()

    class Shares:
        state = {model.a: {"alias": model.flat[:2], "master": torch.zeros(10)}}

    m = measure(model, Shares())
    assert (m.params_bytes, m.grads_bytes, m.optimizer_bytes) == (40, 40, 40)


class _Breakdown:
    def __init__(self, **parts: list[torch.Tensor]) -> None:
        self.parts = parts

    def memory_breakdown(self) -> dict[str, list[torch.Tensor]]:
        return self.parts


def test_memory_breakdown_is_honoured() -> None:
    shard = torch.zeros(25)  # 100 B: this rank's parameter shard
    grad = torch.zeros(25, dtype=torch.float16)  # 50 B
    m = measure(_Breakdown(params=[shard], grads=[grad], optimizer_state=[torch.zeros(50)]))
    assert (m.params_bytes, m.grads_bytes, m.optimizer_bytes) == (100, 50, 200)
    assert (m.num_params, m.precision) == (25, "float32")


def test_breakdown_precedence() -> None:
    model = _Breakdown(params=[torch.zeros(10)], grads=[torch.zeros(1000)])
    optimizer = _Breakdown(
        params=[torch.zeros(1000)], grads=[torch.zeros(5)], optimizer_state=[torch.zeros(3)]
    )
    m = measure(model, optimizer)
    # the model's params, the optimizer's grads and optimizer state
    assert (m.params_bytes, m.grads_bytes, m.optimizer_bytes) == (40, 20, 12)
    # one side only: its keys are used; missing keys fall back to the plain sources
    module = _model()
    p = sum(t.numel() for t in module.parameters())
    sharded_opt = _Breakdown(grads=[torch.zeros(5)], optimizer_state=[torch.zeros(7)])
    m = measure(module, sharded_opt)
    assert (m.params_bytes, m.grads_bytes, m.optimizer_bytes) == (4 * p, 20, 28)


def test_measure_refuses_what_it_cannot_read() -> None:
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        measure(object())
    with pytest.raises(ValueError, match="unknown keys \\['activations'\\]"):
        measure(_Breakdown(activations=[torch.zeros(1)]))


# --- plait plan memory --------------------------------------------------------------------
def test_cli_prints_figure_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "memory", "--params", "7.5e9", "-n", "64"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:]}
    assert {s: float(rows[s][4]) for s in FIGURE_1} == FIGURE_1
    for total in ("120.0", "31.4", "16.6", "1.9"):
        assert total in out
    assert "2P/n + 2P/n + 12P/n" in out


def test_cli_options_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "memory", "--params", "7.5B", "-n", "64", "--optimizer", "sgd"]
    assert main([*argv, "--precision", "fp32"]) == 0
    assert "60.0" in capsys.readouterr().out  # 8 bytes per parameter, no optimizer state
    with pytest.raises(SystemExit) as stop:  # refused while parsing, naming the range
        main(["plan", "memory", "--params", "1e9", "-n", "0"])
    assert stop.value.code == 2
    assert "at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "memory", "--params", "lots", "-n", "2"])
    assert "not a parameter count" in capsys.readouterr().err


# --- measured on real runs against the estimate -------------------------------------------
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_measured_bytes_match_the_estimate_within_5_percent(ranks, strategy):
    from tests import memory_fns

    params = 2 * (256 * 256 + 256)
    want = estimate(
        num_params=params, world_size=2, strategy=strategy, optimizer="adam", precision="fp32"
    )
    for got in ranks(2, memory_fns.measured_after_one_step, strategy):
        assert got["total"] == pytest.approx(want.total_bytes, rel=0.05), (got, want)
        assert got["optimizer"] == pytest.approx(want.optimizer_bytes, rel=0.05)
