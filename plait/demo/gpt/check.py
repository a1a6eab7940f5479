"""``--check`` for the GPT demo: the dense GPT trained in one process on the same batches
(:func:`oracle`, kept per configuration), what float32 in one process shows
(:func:`float32_noise`), :func:`judge` filling a report's check fields, and the verdict
(:func:`check_passed`, :func:`check_lines`). The package docstring says why the bounds hold."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from plait.demo import layouts
from plait.demo.closeness import distance, max_diff, one_thread
from plait.demo.gpt.data import corpus, global_batch
from plait.demo.options import GPTDemoConfig
from plait.models.gpt import loss

if TYPE_CHECKING:  # report.py imports this module to judge its runs
    from plait.demo.gpt.report import GPTDemoReport

#: --check in float64: the largest parameter difference rounding explains on any CPU
FLOAT64_BOUND = 1e-8
#: --check in float32: how many times farther from one process in float64 than float32 in
#: one process lands the run may land, in its parameters and in every step's loss (the
#: measurements that justify it: docs/index.md)
NOISE_FACTOR = 10.0
#: --check in float32: the loss's bound also allows this many float32 steps of the loss
LOSS_ULPS = 4


def _oracle_key(config: GPTDemoConfig) -> tuple[Any, ...]:
    """What the one-process run depends on (the layout does not enter)."""
    c = config
    return (c.model_config(), c.steps, c.batch_size, c.lr, c.seed, c.init, c.first_step)


_ORACLES: dict[tuple[Any, ...], dict[str, torch.Tensor]] = {}
_ORACLE_LOSSES: dict[tuple[Any, ...], list[float]] = {}


def oracle(
    config: GPTDemoConfig, *, pieces: int = 1, dtype: str | None = None
) -> dict[str, torch.Tensor]:
    """The dense GPT trained in one process on every step's whole global batch, from the
    layouts' start (:func:`~plait.demo.layouts.start_model`) converted to ``dtype``
    (default ``config.dtype``); with ``pieces`` > 1 the batch's gradient is accumulated over
    that many equal row blocks (the same mean, summed in another order). Kept per
    configuration for this process (a tour checks four dense layouts against the same run)."""
    dtype = dtype or config.dtype
    key = (*_oracle_key(config), pieces, dtype)
    if key in _ORACLES:
        return _ORACLES[key]
    train_tokens, _ = corpus()
    model = layouts.start_model(config).to(getattr(torch, dtype))
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    losses = []
    with one_thread():
        for step in range(config.steps):
            x, y = global_batch(config, train_tokens, step)
            opt.zero_grad()
            losses.append(0.0)
            for xs, ys in zip(x.chunk(pieces), y.chunk(pieces), strict=True):
                piece = loss(model(xs), ys) * (len(xs) / len(x))
                piece.backward()
                losses[-1] += float(piece.detach())
            opt.step()
    _ORACLES[key] = model.state_dict()
    _ORACLE_LOSSES[key] = losses
    return _ORACLES[key]


def oracle_losses(
    config: GPTDemoConfig, *, pieces: int = 1, dtype: str | None = None
) -> list[float]:
    """Every step's global-batch loss of :func:`oracle` (trained first if it was not)."""
    oracle(config, pieces=pieces, dtype=dtype)
    return _ORACLE_LOSSES[(*_oracle_key(config), pieces, dtype or config.dtype)]


def max_loss_diff(a: list[float], b: list[float]) -> float:
    """The largest difference of two runs' losses at the same step."""
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def summation_orders(config: GPTDemoConfig) -> tuple[int, ...]:
    """The pieces each batch is summed in by the float32 one-process runs that measure
    rounding: whole, and in two halves. Not for a MoE GPT: its experts' capacity is counted
    over the tokens of one forward, so pieces would change the function, not the order."""
    if config.moe:
        return (1,)
    return (1, 2 if config.batch_size % 2 == 0 else config.batch_size)


@dataclass
class Float32Noise:
    """How far float32 in one process lands from float64 in one process (the same start,
    the same batches), over :func:`summation_orders`: the rounding training amplifies, for
    this configuration on this CPU."""

    distance: float  # the parameters' (closeness.distance), the largest over the orders
    loss: float  # every step's loss, the largest difference over the steps and orders
    orders: tuple[int, ...]


def float32_noise(config: GPTDemoConfig) -> Float32Noise:
    """Measure :class:`Float32Noise` (trains the float64 one-process run and the float32
    ones, kept for this process)."""
    exact = oracle(config, dtype="float64")
    exact_losses = oracle_losses(config, dtype="float64")
    start = layouts.start_model(config).state_dict()
    orders = summation_orders(config)
    return Float32Noise(
        distance=max(distance(oracle(config, pieces=p), exact, start) for p in orders),
        loss=max(max_loss_diff(oracle_losses(config, pieces=p), exact_losses) for p in orders),
        orders=orders,
    )


def loss_floor(losses: list[float]) -> float:
    """:data:`LOSS_ULPS` float32 steps of the largest loss: its own float32 resolution."""
    return LOSS_ULPS * torch.finfo(torch.float32).eps * max(abs(x) for x in losses)


def judge(report: GPTDemoReport, state: dict[str, torch.Tensor]) -> None:
    """Fill ``report``'s ``--check`` fields: the run (``state``, ``report.losses``) against
    the dense GPT trained in one process in float64 from the same start on the same batches.
    float64: the largest parameter difference, within :data:`FLOAT64_BOUND`. float32: the
    parameters' :func:`~plait.demo.closeness.distance` and the largest per-step loss
    difference, each within :data:`NOISE_FACTOR` times what float32 in one process shows
    (:func:`float32_noise`; the loss's bound also :func:`loss_floor`)."""
    config = report.config
    exact = oracle(config, dtype="float64")
    exact_losses = oracle_losses(config, dtype="float64")
    report.max_param_diff = max_diff(state, exact)
    report.max_loss_diff = max_loss_diff(report.losses, exact_losses)
    if config.dtype == "float64":
        report.check_bound = FLOAT64_BOUND
        return
    noise = float32_noise(config)
    report.float32_noise = asdict(noise)
    report.param_distance = distance(state, exact, layouts.start_model(config).state_dict())
    report.check_bound = NOISE_FACTOR * noise.distance
    report.loss_bound = NOISE_FACTOR * noise.loss + loss_floor(exact_losses)


def check_passed(report: GPTDemoReport) -> bool:
    """False when ``--check`` found the run farther from one process than rounding explains
    (:func:`judge`), or when cp's counted attention bytes differ from the formula
    (``report.cp_bytes``)."""
    if report.cp_bytes and not report.cp_bytes["agree"]:
        return False
    if report.param_distance is not None:  # float32: both statistics within their bounds
        return _within(report.param_distance, report.check_bound) and _within(
            report.max_loss_diff, report.loss_bound
        )
    if report.max_param_diff is None:
        return True
    bound = report.check_bound if report.check_bound is not None else FLOAT64_BOUND
    return report.max_param_diff <= bound


def judged_value(report: GPTDemoReport) -> float | None:
    """The parameters' statistic ``--check`` judged against ``report.check_bound``: the
    distance in float32, the largest difference in float64 (None: not checked)."""
    return report.param_distance if report.param_distance is not None else report.max_param_diff


def _within(value: float | None, bound: float | None) -> bool:
    return value is not None and bound is not None and value <= bound


def check_lines(report: GPTDemoReport) -> list[str]:
    """What ``--check`` prints: each statistic against its bound, and what the bounds are."""
    if report.param_distance is None:  # float64
        return [
            f"--check: largest parameter difference to one process on the global batch: "
            f"{report.max_param_diff:.2e} {_verdict(report.max_param_diff, report.check_bound)}",
            f"  largest per-step loss difference to one process: {report.max_loss_diff:.2e}",
        ]
    noise = report.float32_noise
    orders = " and in ".join("whole" if p == 1 else f"{p} pieces" for p in noise["orders"])
    return [
        "--check: against one process in float64, from the same start on the same batches",
        f"  parameter distance, relative to how far training moved them: "
        f"{report.param_distance:.2e} {_verdict(report.param_distance, report.check_bound)}",
        f"  largest per-step loss difference: {report.max_loss_diff:.2e} "
        f"{_verdict(report.max_loss_diff, report.loss_bound)}",
        f"  bounds: {NOISE_FACTOR:g} x how far float32 in one process lands from float64 "
        f"(parameters {noise['distance']:.2e}, loss {noise['loss']:.2e}; each batch summed "
        f"{orders}), the rounding training amplifies, measured here for this run; the "
        f"loss's + {LOSS_ULPS} float32 steps of it. --dtype float64 checks to {FLOAT64_BOUND:g}",
    ]


def _verdict(value: float | None, bound: float | None) -> str:
    said = "ok" if _within(value, bound) else "LARGER THAN EXPECTED"
    return f"({said}: bound {bound if bound is not None else math.nan:.1e})"
