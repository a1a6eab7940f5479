"""Drop-in fidelity of fully_shard: a PyTorch FSDP2 training script must train as it did.

Each test compares with the single-process oracle (same model, seed, global batch):
clipping by the global norm, tied weights, parameter groups through plait.prepare, resume
from full model and optimizer state at another world size, meta-device init, the standard
GradScaler, the refusal of a rank whose model differs, and the refused ``state_dict()``.
Tolerance as in tests/test_fsdp.py (TOL); world 1 runs no communication.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.strategies.fsdp import ShardedGradNormError, fully_shard
from tests import fsdp_fidelity_fns as F
from tests.fsdp_fns import DeepNet, make_deep

TOL = {"rtol": 2e-4, "atol": 2e-5}
STEPS = 3


def _close(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, **TOL, msg=key)


def _run(ranks, world: int, fn, *args):
    if world == 1:
        return [fn(*args, world=1)]
    return ranks(world, fn, *args, timeout=180)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("world", [1, 2])
def test_clip_grad_norm_is_global(ranks, world, norm_type):
    """max_norm 0.05 clips every step (the oracle's norms are 0.14 to 0.87)."""
    want = F.clip_oracle(STEPS, 0.05, norm_type)
    assert min(want["norms"]) > 0.05
    for r in _run(ranks, world, F.clip_train, STEPS, 0.05, norm_type):
        torch.testing.assert_close(r["norms"], want["norms"], rtol=1e-5, atol=1e-6)
        _close(r["state"], want["state"])
        assert r["refused"].startswith("ShardedGradNormError")
        assert "model.clip_grad_norm_(max_norm, norm_type)" in r["refused"]


def test_norm_of_a_shard_gradient_raises():
    model = fully_shard(make_deep())
    x = torch.randn(4, 8)
    model(x).sum().backward()
    (shard,) = model.parameters()
    with pytest.raises(ShardedGradNormError, match="clip_grad_norm_"):
        shard.grad.norm()
    shard.grad.mul_(2.0)  # other operations are those of a plain tensor


@pytest.mark.parametrize("world,nested", [(1, False), (2, False), (2, True)])
def test_tied_embedding_and_head_stay_tied(ranks, world, nested):
    want = F.gpt_oracle(STEPS)
    for r in _run(ranks, world, F.gpt_train, STEPS, nested):
        _close(r["state"], want)
        assert r["same_tensor"]
        units = dict(r["units"])
        assert units["wte"] == 0 and units["lm_head"] == 0  # the tied weight moved up
        home = "gpt" if nested else "(root TinyGPT)"
        assert units[home] == F.VOCAB * F.DIM  # the tied weight, in the common unit
        assert torch.equal(r["state"]["wte.weight"], r["state"]["lm_head.weight"])


def test_tie_into_an_earlier_unit_is_refused():
    model = F.TinyGPT()
    fully_shard(model.lm_head)
    with pytest.raises(ValueError, match="'wte.weight' is tied to a parameter of unit 'lm_head'"):
        fully_shard(model)


@pytest.mark.parametrize("world,strategy", [(1, "fsdp"), (2, "fsdp"), (2, "zero3")])
def test_adamw_parameter_groups_through_prepare(ranks, world, strategy):
    want = F.groups_oracle(STEPS)
    for r in _run(ranks, world, F.groups_train, STEPS, strategy):
        assert r["type"] == "AdamW"
        # wrap={nn.Linear}: each Linear unit has a weight shard (decay) and a bias shard;
        # the root's LayerNorm parameters make one more no-decay shard
        assert [(g["lr"], g["weight_decay"], g["n"]) for g in r["groups"]] == [
            (0.01, 0.1, 4),
            (0.003, 0.0, 5),
        ]
        _close(r["state"], want["state"])
        got, plain = r["opt"], want["opt"]
        assert got["param_groups"] == plain["param_groups"]
        for i, entry in plain["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(got["state"][i][key], value, **TOL)


@pytest.mark.parametrize("saved_world,resumed_world", [(2, 2), (2, 1), (1, 2)])
def test_resume_from_full_state_at_any_world_size(ranks, saved_world, resumed_world):
    want = F.resume_oracle(4)
    saved = _run(ranks, saved_world, F.resume_save, 2)
    for r in saved[1:]:
        for key, value in r["model"].items():
            assert torch.equal(value, saved[0]["model"][key])
    for r in _run(ranks, resumed_world, F.resume_continue, saved[0], 2, 4):
        _close(r["model"], want["model"])
        assert r["opt"]["param_groups"] == want["opt"]["param_groups"]
        for i, entry in want["opt"]["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(r["opt"]["state"][i][key], value, **TOL)


@pytest.mark.parametrize("world", [1, 2])
def test_meta_device_init_equals_dense_init(ranks, world):
    torch.manual_seed(3)
    want = DeepNet().state_dict()
    for got in _run(ranks, world, F.meta_init):
        for key, value in want.items():
            assert torch.equal(got[key], value), key


def test_grad_scaler_skips_on_every_rank_then_steps(ranks):
    for r in ranks(2, F.grad_scaler_skips_together, timeout=180):
        first, second = r["steps"]
        assert first == {"scale": 512.0, "unchanged": True}  # skipped, scale halved
        assert second["scale"] == 512.0 and not second["unchanged"]


def test_rank_with_other_module_order_is_refused(ranks):
    messages = ranks(2, F.refuses_other_order, timeout=180)
    for message in messages:
        assert "fully_shard" in message and "rank 1" in message
        assert "a.weight" in message or "b.weight" in message


def test_state_dict_and_module_say_what_to_use():
    model = fully_shard(make_deep(), wrap={nn.Linear})
    with pytest.raises(RuntimeError, match=r"plait.checkpoint.full_state_dict\(model\)"):
        model.state_dict()
    with pytest.raises(RuntimeError, match="load_full_state_dict"):
        model.load_state_dict({})
    with pytest.raises(AttributeError, match="returns the module itself"):
        model.module  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        model.nothing  # noqa: B018


def test_policies_by_pytorch_names_and_strings():
    from plait.strategies.fsdp.policies import MixedPrecisionPolicy

    model = fully_shard(make_deep(), mp_policy="bf16")
    (unit,) = model.sharded_units()
    assert unit.param_dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"\['bf16', 'fp16', 'fp32'\]"):
        fully_shard(make_deep(), mixed_precision="half")
    with pytest.raises(TypeError, match="not both"):
        fully_shard(make_deep(), mp_policy="bf16", mixed_precision=MixedPrecisionPolicy())
    model = fully_shard(make_deep(), mixed_precision="fp32")
    assert model.sharded_units()[0].param_dtype == torch.float32
    from torch.distributed import fsdp as torch_fsdp  # PyTorch's own policy objects

    model = fully_shard(
        make_deep(),
        mp_policy=torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.float16),
        offload_policy=torch_fsdp.CPUOffloadPolicy(),
    )
    assert model.sharded_units()[0].param_dtype == torch.float16
    assert model.sharded_units()[0].config.shards_on_cpu
    model = fully_shard(  # output_dtype: the root's floating outputs cast (plait.precision)
        make_deep(),
        mp_policy=torch_fsdp.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, output_dtype=torch.float32
        ),
    )
    assert model(torch.randn(2, model.inp.in_features)).dtype == torch.float32


def test_explicit_prefetch_setters_prefetch_and_match_oracle(ranks):
    want = F.resume_oracle(STEPS)["model"]
    for r in ranks(2, F.explicit_prefetch_train, STEPS, timeout=180):
        _close(r["state"], want)
        # prefetch=False issues no asynchronous gather by itself; per step the lists add 2
        # in forward (inp, blocks.0.fc, when the root starts) and 2 in backward (both
        # were freed after forward; when blocks.1.fc's backward starts)
        assert r["async_gathers"] == 4 * STEPS


@pytest.mark.parametrize("world", [1, 2])
def test_unshard_edit_reshard_keeps_the_edit(ranks, world):
    torch.manual_seed(3)
    dense = DeepNet().state_dict()
    for r in _run(ranks, world, F.unshard_edit_reshard):
        assert r["gathered"]
        assert torch.equal(r["edited"], torch.full_like(r["edited"], 0.25))
        for key, value in dense.items():
            assert torch.equal(r["meta"][key], value), key


@pytest.mark.parametrize("world", [1, 2])
def test_frozen_parameter_gets_its_own_shard(ranks, world):
    want = F.frozen_oracle(STEPS)
    for r in _run(ranks, world, F.frozen_train, STEPS):
        _close(r["state"], want)
        assert [k for k, _ in r["kinds"]] == [False, True]


def test_prepare_refuses_an_optimizer_that_is_not_element_wise():
    import plait

    model = make_deep()
    with pytest.raises(ValueError, match="LBFGS combines elements"):
        plait.prepare(model, torch.optim.LBFGS(model.parameters()), strategy="fsdp")


def test_load_full_state_dict_is_strict_and_keeps_ties():
    from plait.strategies.fsdp import full_state_dict, load_full_state_dict

    torch.manual_seed(1)
    dense = F.TinyGPT()
    torch.manual_seed(2)
    model = fully_shard(F.TinyGPT(), wrap={nn.Embedding, nn.Linear})
    load_full_state_dict(model, dense.state_dict())
    for key, value in full_state_dict(model).items():
        assert torch.equal(value, dense.state_dict()[key]), key
    state = dict(dense.state_dict())
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0
    with pytest.raises(ValueError, match="'wte.weight' and 'lm_head.weight' are one tied"):
        load_full_state_dict(model, state)
    del state["lm_head.weight"]
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        load_full_state_dict(model, state)
