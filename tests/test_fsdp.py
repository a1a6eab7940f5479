"""fully_shard (ZeRO-3 / FSDP) against the single-process oracle.

Tolerance: ranks reduce-scatter shard gradients (sum, then divide by n) where the oracle
averages over the global batch in one reduction, so float32 results differ by rounding
only: after 4 steps we allow 2e-5 absolute + 2e-4 relative, as for DDP (observed: at
most 1.2e-7). World 1 runs no communication and is bitwise equal to the oracle. Mixed
precision (bf16 or fp16 parameters, activations and gradients, fp32 masters): MIXED_TOL.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait import UngatheredParameterError
from plait.strategies.fsdp import FSDPModule, full_state_dict, fully_shard
from plait.strategies.fsdp.policies import MixedPrecisionPolicy, OffloadPolicy
from tests import fsdp_fns

STEPS = 4
OPTS = ["sgd", "adam"]
TOL = {"rtol": 2e-4, "atol": 2e-5}
# SGD moves by lr x gradient, so rounding errors stay small (observed 5e-4 in bf16, 5e-5
# in fp16); Adam moves every element by about lr (0.01) per step whatever the gradient's
# size, so a rounding that flips a tiny gradient's sign costs up to 2 lr per step
# (observed 2.6e-2 in bf16, 2.0e-2 in fp16 after 4 steps).
MIXED_TOL = {"sgd": 5e-3, "adam": 5e-2}
_oracles: dict[str, dict[str, torch.Tensor]] = {}


def _oracle(opt: str) -> dict[str, torch.Tensor]:
    if opt not in _oracles:
        _oracles[opt] = fsdp_fns.oracle(STEPS, opt)
    return _oracles[opt]


def _check(results: list[dict], world: int, exact: bool = False, **tol: float) -> None:
    """Every rank's full state dict equals the oracle's (keys in order, values)."""
    for opt in results[0]["states"]:
        want = _oracle(opt)
        for r in results:
            got = r["states"][opt]
            assert list(got) == list(want)
            for key in want:
                if exact:
                    assert torch.equal(got[key], want[key]), key
                else:
                    torch.testing.assert_close(got[key], want[key], **(tol or TOL))
        for r in results[1:]:  # identical on every rank
            for key, value in r["states"][opt].items():
                assert torch.equal(value, results[0]["states"][opt][key]), key


def _check_sharded_sizes(results: list[dict], world: int) -> None:
    """Each rank holds 1/n of every unit's padded flat buffer, and nothing else."""
    total = fsdp_fns.num_params()
    assert sum(numel for numel, _ in results[0]["units"]) == total
    padded = sum(p for _, p in results[0]["units"])
    assert all(p % world == 0 for _, p in results[0]["units"])
    for r in results:
        assert r["local_numel"] * world == padded
        assert r["local_numel"] <= total // world + len(r["units"])
        assert r["after_step"] == {"params": r["local_numel"], "grads": r["local_numel"]}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("wrap", [None, "linear"])
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("prefetch", [True, False])
def test_matches_single_process_oracle(ranks, world, wrap, reshard, prefetch):
    options = {
        "wrap": {nn.Linear} if wrap == "linear" else None,
        "reshard_after_forward": reshard,
        "prefetch": prefetch,
    }
    results = ranks(world, fsdp_fns.train, STEPS, OPTS, options)
    _check(results, world, exact=world == 1)
    _check_sharded_sizes(results, world)
    units = results[0]["units"]
    # sharded_units() lists the root first, then the units in forward order: head, the
    # last to start forward, last. The root and head stay gathered between forward and
    # backward (from the second step on), and with prefetch so does the last block's fc,
    # which backward would prefetch at once.
    kept = units[0][1]
    if wrap == "linear":
        kept += sum(p for _, p in units[-2 if prefetch else -1 :])
    for r in results:  # what stays gathered between forward and backward
        full_kept = kept if reshard else sum(p for _, p in units)
        assert r["after_forward"] == r["local_numel"] + full_kept


@pytest.mark.parametrize(
    "options",
    [
        {"wrap": 100},  # size-based: inp, and each Block's fc; the root keeps the rest
        {"wrap": {fsdp_fns.Block, nn.Linear}},  # Linear units nested inside Block units
        {"nested": True, "wrap": {nn.Linear}},  # fully_shard on each Block, then the root
        {"wrap": {nn.Linear}, "algorithm": "ring"},
    ],
)
@pytest.mark.parametrize("world", [2, 4])
def test_wrap_variants_match_oracle(ranks, world, options):
    results = ranks(world, fsdp_fns.train, STEPS, ["adam"], options)
    _check(results, world)
    _check_sharded_sizes(results, world)


def test_size_based_wrap_chooses_bottom_up():
    model = fully_shard(fsdp_fns.make_deep(), wrap=100)
    assert isinstance(model, FSDPModule)
    units = {type(u.module).__name__: u.numel for u in model.sharded_units()}
    # inp (144) and both fc (272) reach 100; norms (32), Blocks (32 left) and head (68) do
    # not, and fall to the root with the Sequential (64 left): 132.
    assert sorted(u.numel for u in model.sharded_units()) == [132, 144, 272, 272]
    assert units["FSDPDeepNet"] == 132


def test_world_one_without_init_is_bitwise_equal():
    """No plait.init: one process, no communication, the oracle's exact bits."""
    result = fsdp_fns.train(STEPS, OPTS, {"wrap": {nn.Linear}}, world=1)
    _check([result], 1, exact=True)


def test_full_state_dict_before_training_equals_rank_0_model(ranks):
    for r in ranks(2, fsdp_fns.train, 0, ["sgd"], {"wrap": {nn.Linear}}):
        want = fsdp_fns.make_deep().state_dict()
        assert list(r["states"]["sgd"]) == list(want)
        for key in want:
            assert torch.equal(r["states"]["sgd"][key], want[key])


@pytest.mark.parametrize(
    "dtype,reduce_dtype",
    [(torch.bfloat16, None), (torch.bfloat16, torch.float32), (torch.float16, None)],
)
def test_mixed_precision_stays_close(ranks, dtype, reduce_dtype):
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
    options = {"wrap": {nn.Linear}, "mixed_precision": policy}
    results = ranks(2, fsdp_fns.train, STEPS, OPTS, options)
    for r in results:
        assert r["compute_dtype"] == dtype
        for state in r["states"].values():
            assert all(v.dtype == torch.float32 for v in state.values())  # fp32 masters
    for opt, tol in MIXED_TOL.items():
        _check([{"states": {opt: r["states"][opt]}} for r in results], 2, rtol=tol, atol=tol)


@pytest.mark.parametrize("world", [1, 2])
def test_offload_matches_oracle(ranks, world):
    options = {"wrap": {nn.Linear}, "offload": OffloadPolicy(params=True, optimizer_state=True)}
    results = ranks(world, fsdp_fns.train, STEPS, OPTS, options)
    _check(results, world, exact=world == 1)
    _check_sharded_sizes(results, world)


def test_refuses_sharding_twice_and_bad_wrap():
    model = fully_shard(fsdp_fns.make_deep())
    with pytest.raises(ValueError, match="already sharded"):
        fully_shard(model)
    with pytest.raises(TypeError, match="wrap must be"):
        fully_shard(fsdp_fns.make_deep(), wrap="linear")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        fully_shard(fsdp_fns.make_deep(), wrap=0)


def test_no_grad_forward_frees_everything():
    model = fully_shard(fsdp_fns.make_deep(), wrap={nn.Linear}, reshard_after_forward=False)
    assert isinstance(model, FSDPModule)
    with torch.no_grad():
        model(torch.randn(3, fsdp_fns.FEATURES))
    assert not any(u.gathered for u in model.sharded_units())
    weight = model.inp.weight  # a shape-only placeholder between gathers
    assert weight.device.type == "meta" and weight.shape == (16, fsdp_fns.FEATURES)
    assert list(full_state_dict(model)) == list(fsdp_fns.make_deep().state_dict())


@pytest.mark.parametrize("reshard", [True, False])
def test_prefetch_issues_the_same_collectives_asynchronously(ranks, reshard):
    """Per step with wrap={Linear}: 5 units (4 Linear; the root keeps the two LayerNorms)
    are gathered in forward; in backward again those freed after forward: 3 without
    prefetch (not the root, nor head, the last to start forward), 2 with it (the last
    block's fc, which backward would prefetch at once, is kept too). Each unit
    reduce-scatters once. Prefetch changes which gathers are asynchronous."""
    base = {"wrap": {nn.Linear}, "reshard_after_forward": reshard}
    plain = ranks(2, fsdp_fns.gather_pattern, {**base, "prefetch": False})
    fetched = ranks(2, fsdp_fns.gather_pattern, {**base, "prefetch": True})
    assert plain[0] == plain[1] and fetched[0] == fetched[1]
    for pattern, regathered in ((plain[0], 3), (fetched[0], 2)):
        names = [name for name, _ in pattern]
        assert names.count("all_gather") == 5 + (regathered if reshard else 0)
        assert names.count("reduce_scatter") == 5
        assert all(is_async for name, is_async in pattern if name == "reduce_scatter")
    assert not any(a for name, a in plain[0] if name == "all_gather")
    prefetched = sum(a for name, a in fetched[0] if name == "all_gather")
    # forward: all but the root's own; backward: both regathers (the root, head and the
    # last block's fc are still gathered, so the root's backward prefetches the first
    # block's fc)
    assert prefetched == 4 + (2 if reshard else 0)


@pytest.mark.parametrize("reshard", [True, False])
def test_gradient_accumulation_equals_one_batch(ranks, reshard):
    options = {"wrap": {nn.Linear}, "reshard_after_forward": reshard}
    for two_backwards, two_forwards, one_batch in ranks(
        2, fsdp_fns.accumulate_vs_one_batch, options
    ):
        for key, value in one_batch.items():
            torch.testing.assert_close(two_backwards[key], value, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(two_forwards[key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [1, 2])
def test_transformer_layers_as_units_match_oracle(ranks, world):
    """MultiheadAttention reads out_proj.weight itself: the whole layer is the unit.
    SGD: the key bias's true gradient is 0 (softmax ignores a constant), so its computed
    gradient is rounding noise, which Adam would scale up to lr-sized steps."""
    want = fsdp_fns.oracle(STEPS, "sgd", "encoder")
    options = {"model": "encoder", "wrap": {nn.TransformerEncoderLayer}}
    if world == 1:
        results = [fsdp_fns.train(STEPS, ["sgd"], options, world=1)]
    else:
        results = ranks(world, fsdp_fns.train, STEPS, ["sgd"], options)
    assert len(results[0]["units"]) == 3  # the root and both layers
    for r in results:
        got = r["states"]["sgd"]
        assert list(got) == list(want)
        for key, value in want.items():
            if world == 1:
                assert torch.equal(got[key], value), key
            else:
                torch.testing.assert_close(got[key], value, **TOL)


def test_refuses_a_unit_its_parent_reads_directly():
    """wrap={nn.Linear} would make MultiheadAttention's out_proj a unit that is never
    gathered; refused before any communication, naming the unit and what to wrap."""
    with pytest.raises(ValueError) as refused:
        fully_shard(fsdp_fns.make_encoder(), wrap={nn.Linear})
    message = str(refused.value)
    assert "'encoder.layers.0.self_attn.out_proj'" in message
    assert "MultiheadAttention" in message and "wrap={nn.TransformerEncoderLayer}" in message
    with pytest.raises(ValueError, match="earlier fully_shard call made 'encoder.layers.1"):
        model = fsdp_fns.make_encoder()
        fully_shard(model.encoder.layers[1].self_attn.out_proj)
        fully_shard(model)


class _ReadsChildWeight(nn.Module):
    """Computes with ``proj``'s weight without calling ``proj``."""

    def __init__(self, bypass_placeholder_check: bool = False) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.proj = nn.Linear(4, 4)
        self.bypass = bypass_placeholder_check

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bypass:  # the placeholder cannot see this: PyTorch's device error does
            with torch._C.DisableTorchFunctionSubclass():
                return self.first(x) + self.proj.bias
        return nn.functional.linear(self.first(x), self.proj.weight)


def test_computing_with_an_ungathered_unit_names_it():
    """A CPU F.linear with a meta weight would return uninitialized memory silently; the
    placeholder refuses it, naming the parameter and its unit."""
    model = fully_shard(_ReadsChildWeight(), wrap={nn.Linear})
    with pytest.raises(UngatheredParameterError, match="'proj.weight' while unit 'proj'"):
        model(torch.randn(3, 4))
    model = fully_shard(_ReadsChildWeight(bypass_placeholder_check=True), wrap={nn.Linear})
    with pytest.raises(UngatheredParameterError, match="not gathered: 'first', 'proj'") as e:
        model(torch.randn(3, 4))
    assert "on device meta" in str(e.value.__cause__)
