"""One mixed-precision policy for every strategy (plait/precision.py), on CPU in bf16.

Each strategy trains 2 SGD steps under ``mixed_precision=`` and is compared with one process
applying the same policy (``plait.prepare(strategy="none", mixed_precision=...)``), run on
the same rank (tests/precision_fns.py):

- **exactly** where the order of the arithmetic is the one process's: the data-parallel
  strategies (ddp, naive, zero1, zero2, fsdp) against one process that runs the ranks' row
  blocks one after the other and accumulates their gradients in float32 (each rank's
  bf16 forward and backward is the one process's on the same rows; the average of two
  float32 gradients is the same sum whichever adds it), and pipeline / ptdp against one
  process accumulating the same micro-batches;
- **within a bound** where a strategy splits a reduction that bf16 rounds (tp's row-parallel
  partial sums, ep's expert matmuls over tokens of both ranks, cp's attention over sequence
  chunks): per parameter tensor, |theta - theta_oracle| <= C * u * lr * sum_t max|g_t|,
  u = 2**-8 the unit roundoff of bf16, g_t the one-process gradient of step t (measured),
  C = 16. Why it holds on any CPU: SGD moves a parameter by lr * g, so the distance after
  the steps is lr times the summed gradient differences (plus the second-order effect of
  the different parameters, tiny after 2 steps); each gradient element of this 2-block
  GPT passes through fewer than 16 bf16 roundings (forward and backward matmuls, the
  16-bit all-reduces of tp), and a rounding moves a value by at most u of the magnitude
  it rounds, which the tensor's largest gradient bounds. It depends on bf16's format, not
  on the CPU's kernels. That the policy is applied at all is shown by the dtypes the
  forward produced (bfloat16 present) and by the exact comparisons.

The fp16 loss scaler: one rank plants an inf in a gradient; every rank skips the step,
keeps its parameters and halves the scale, then steps on a clean batch (ddp, naive,
fsdp, tp, pipeline, ptdp). Under ``pipeline`` fp16 is also bitwise the one process that
scales each micro-batch's loss by the same power of two (the scale commutes exactly with
the arithmetic away from overflow and subnormals, which both runs share).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import plait
from plait.precision import (
    MixedPrecisionPolicy,
    autocast_forward,
    loss_scaler,
    resolve_mixed_precision,
)
from tests import precision_fns as P

U_BF16 = 2.0**-8
C = 16


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert list(a) == list(b), what
    for key in a:
        assert torch.equal(a[key], b[key]), (
            f"{what}: {key} differs by {float((a[key] - b[key]).abs().max()):.3g}"
        )


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float((a[k].float() - b[k].float()).abs().max()) for k in b}


def _bound(result: dict, key: str) -> float:
    """C * u * lr * sum over steps of the one-process gradient's largest element."""
    grads = result["global"]["grad_max"]
    return C * U_BF16 * P.LR * sum(g[key] for g in grads if key in g)


def _within_bound(result: dict, strategy: str) -> None:
    distance = _distance(result["plait"], result["global"]["state"])
    bounds = {k: _bound(result, k) for k in distance}
    over = {k: (d, bounds[k]) for k, d in distance.items() if d > bounds[k]}
    assert not over, f"{strategy}: (distance, bound) {over}"
    worst = max(d / bounds[k] for k, d in distance.items() if bounds[k] > 0)
    fp32 = _distance(result["fp32"]["state"], result["global"]["state"])
    policy = max(d / bounds[k] for k, d in fp32.items() if bounds[k] > 0)
    print(f"{strategy}: largest distance / bound = {worst:.3f} (float32 run: {policy:.3f})")


@pytest.mark.parametrize("strategy", ["ddp", "naive", "zero1", "zero2", "fsdp"])
def test_data_parallel_bf16_equals_one_process_on_the_same_rows(ranks, strategy):
    for r in ranks(2, P.data_parallel, strategy):
        assert "bfloat16" in r["dtypes"], r["dtypes"]  # computed in bf16
        assert r["masters"] == ["torch.float32"]  # float32 masters (shards under fsdp)
        assert r["global"]["masters"] == ["torch.float32"]
        _equal(r["plait"], r["chunked"]["state"], strategy)
        _within_bound(r, strategy)  # and so within the bound of the global batch too


def test_ddp_reduces_in_bf16_when_asked(ranks):
    for r in ranks(2, P.ddp_reduce_bf16):
        _equal(r["plait"], r["chunked"]["state"], "ddp reduce_dtype=bf16")


@pytest.mark.parametrize("strategy", ["pipeline", "ptdp"])
def test_pipeline_bf16_equals_one_process_on_the_same_microbatches(ranks, strategy):
    for r in ranks(2, P.model_parallel, strategy):
        assert "bfloat16" in r["dtypes"], r["dtypes"]
        _equal(r["plait"], r["chunked"]["state"], strategy)


def test_pipeline_fp16_equals_one_process_scaling_the_same_microbatches(ranks):
    """The loss scaled inside the pipeline's step, the gradients unscaled by the scaler:
    bitwise the one process that scales each micro-batch's loss by the same power of two."""
    for r in ranks(2, P.pipeline_fp16):
        assert "float16" in r["dtypes"], r["dtypes"]  # computed in fp16
        assert r["stepped"] == r["chunked"]["stepped"] == [True] * P.STEPS, r["stepped"]
        _equal(r["plait"], r["chunked"]["state"], "pipeline fp16")
        moved = [k for k in r["first"] if not torch.equal(r["first"][k], r["plait"][k])]
        assert moved, "pipeline fp16: no parameter moved"
        assert r["losses"] == pytest.approx(r["chunked"]["losses"], rel=1e-6)


@pytest.mark.parametrize("strategy", ["tp", "ep", "cp"])
def test_split_reductions_stay_within_the_bf16_bound(ranks, strategy):
    for r in ranks(2, P.model_parallel, strategy):
        assert "bfloat16" in r["dtypes"], r["dtypes"]
        _within_bound(r, strategy)


def test_reproducible_bf16_is_bitwise_one_process(ranks):
    """reproducible=True under the policy: ddp and fsdp at 2 ranks equal one process
    (the fixed micro-batch tree; each micro-batch computed in bf16 alike)."""
    from tests import reproducible_fns as R

    options = {"mixed_precision": P.BF16}
    want = R.train("none", options, world=False)
    for got in ranks(2, R.cases, [("ddp", options), ("fsdp", options)]):
        for state, name in zip(got, ("ddp", "fsdp"), strict=True):
            _equal(state, want, f"reproducible {name}")


@pytest.mark.parametrize(
    "strategy,bad_rank",
    [("ddp", 1), ("naive", 0), ("fsdp", 1), ("tp", 0), ("pipeline", 0), ("ptdp", 0)],
)
def test_fp16_overflow_on_one_rank_skips_everywhere(ranks, strategy, bad_rank):
    for r in ranks(2, P.fp16_skip, strategy, bad_rank):
        assert r["stepped"] == [False, True] and r["skipped"] == 1, r
        assert r["changed"] == [False, True], r
        assert r["scale"] == [0.5, 0.5], r


def test_policy_names_strings_and_pytorch_objects():
    from plait.strategies import MixedPrecisionPolicy as from_strategies
    from plait.strategies.fsdp import policies

    assert policies.MixedPrecisionPolicy is MixedPrecisionPolicy is from_strategies
    assert plait.MixedPrecisionPolicy is MixedPrecisionPolicy
    bf16 = resolve_mixed_precision("bf16")
    assert bf16 == MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert bf16.reduce_dtype is None  # None: reduced in the masters' dtype, float32
    assert resolve_mixed_precision("fp32").is_full
    from torch.distributed import fsdp as torch_fsdp

    theirs = torch_fsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
    )
    assert resolve_mixed_precision(theirs) == MixedPrecisionPolicy(
        torch.bfloat16, torch.float32, torch.float32
    )
    with pytest.raises(ValueError, match="not a floating dtype"):
        MixedPrecisionPolicy(param_dtype=torch.int8)
    with pytest.raises(ValueError, match="not known"):
        resolve_mixed_precision("half")


def test_one_process_computes_in_bf16_with_float32_masters_and_outputs():
    model = P.mlp()
    model, opt = plait.prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        strategy="none",
        mixed_precision=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, output_dtype=torch.float32
        ),
    )
    seen = P.Dtypes(model)
    x, y = P.mlp_batch(0)
    out = model(x)
    assert out.dtype == torch.float32 and "bfloat16" in seen.close()
    P.mse(out, y).backward()
    assert all(
        p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters()
    )
    plain, _ = plait.prepare(P.mlp(), None, strategy="none", mixed_precision="bf16")
    assert plain(x).dtype == torch.bfloat16  # output_dtype None: as computed
    with pytest.raises(ValueError, match="has no loss scaler"):
        loss_scaler(opt)
    with pytest.raises(ValueError, match="already runs under a mixed-precision policy"):
        autocast_forward(plain, MixedPrecisionPolicy(param_dtype=torch.bfloat16))


def test_deep_copy_keeps_the_policy():
    r = P.deep_copy_keeps_policy()
    assert r == {"dtype": "torch.bfloat16", "differ": True, "class": "MixedPrecisionSequential"}


def test_refused_by_name_before_anything_is_wrapped():
    mesh = object()  # never reached: refused before the strategy builds anything
    cases = {
        "ps": (dict(strategy="ps"), "parameter server"),
        "tp": (
            dict(
                strategy="tp",
                mesh=mesh,
                mixed_precision=MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16
                ),
            ),
            "reduce_dtype=torch.bfloat16 is not honoured by strategy 'tp'",
        ),
        "pipeline": (
            dict(
                strategy="pipeline",
                mesh=mesh,
                microbatches=2,
                mixed_precision="fp16",
                check_finite="raise",
            ),
            "Pass check_finite=None with a loss scaler",
        ),
        "buffers": (
            dict(
                strategy="ddp",
                mixed_precision=MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
                ),
            ),
            "buffer_dtype is honoured by fsdp and zero3 only",
        ),
        "reproducible": (
            dict(
                strategy="ddp",
                reproducible=True,
                microbatch_size=2,
                loss_fn=P.mse,
                mixed_precision="fp16",
            ),
            "fp16 needs a loss scaler, which the reproducible step does not apply",
        ),
    }
    for name, (options, message) in cases.items():
        options.setdefault("mixed_precision", "bf16")
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            plait.prepare(P.mlp(), None, **options)
        del name
    with pytest.raises(ValueError, match="parameter '0.weight' is torch.float64"):
        plait.prepare(P.mlp().double(), None, strategy="ddp", mixed_precision="bf16")
    with pytest.raises(TypeError, match="same setting"):
        plait.prepare(
            nn.Linear(2, 2), None, strategy="fsdp", mp_policy="bf16", mixed_precision="bf16"
        )
