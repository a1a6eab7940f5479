"""plait.prepare speaks one vocabulary: mesh=, plan=, mode=, microbatches=, bucket_mb=;
PyTorch's spellings accepted; plait's earlier names warn and still work."""

from __future__ import annotations

import warnings

import pytest

from plait.prepare import vocabulary
from tests import prepare_fns


def test_pytorch_spellings_are_aliases():
    out = vocabulary("pipeline", {"n_microbatches": 4, "device_mesh": "M"})
    assert out == {"microbatches": 4, "mesh": "M"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PyTorch's own names never warn
        assert vocabulary("ddp", {"bucket_cap_mb": 5.0}) == {"bucket_mb": 5.0}


def test_earlier_names_warn_and_name_the_new_one():
    with pytest.warns(DeprecationWarning, match="tp_plan= is deprecated; use plan="):
        out = vocabulary("tp", {"tp_plan": {"a": "colwise"}})
    assert out == {"plan": {"a": "colwise"}}
    with pytest.warns(DeprecationWarning) as caught:
        out = vocabulary("ptdp", {"tp_mode": "1d", "tp_plan": None})
    said = {str(w.message) for w in caught}
    assert "plait.prepare: tp_mode= is deprecated; use mode=" in said
    assert "plait.prepare: tp_plan= is deprecated; use plan=" in said
    assert out == {"tp_mode": "1d", "tp_plan": None}  # compose's own names


def test_one_idea_under_two_names_is_refused():
    with pytest.raises(TypeError, match="bucket_mb= and bucket_cap_mb= name the same setting"):
        vocabulary("ddp", {"bucket_mb": 1.0, "bucket_cap_mb": 2.0})


def test_mesh_reaches_data_parallel_strategies_as_their_group(ranks):
    for out in ranks(2, prepare_fns.prepare_ddp_with_mesh):
        assert out == "dp ok"


def test_the_first_argument_is_module_everywhere():
    import inspect

    import plait
    from plait.strategies.context import context_parallel
    from plait.strategies.moe import expert_parallel

    entries = [
        plait.prepare,
        plait.compose,
        plait.parallelize,
        plait.fully_shard,
        expert_parallel,
        context_parallel,
        plait.PipelineParallel.__init__,
        plait.DistributedDataParallel.__init__,
        plait.NaiveDataParallel.__init__,
    ]
    for fn in entries:
        names = [p for p in inspect.signature(fn).parameters if p != "self"]
        assert names[0] == "module", (fn, names[:2])


def test_model_keyword_still_works_with_a_warning():
    from plait.renames import accepts_model

    @accepts_model()
    def wrap(module, *, size=1):
        return module, size

    with pytest.warns(DeprecationWarning, match="model= is deprecated; pass the module first"):
        assert wrap(model="m", size=2) == ("m", 2)
    with pytest.raises(TypeError, match="pass the module once"):
        wrap("m", model="n")


def test_strategies_built_by_hand_take_mesh(ranks):
    for out in ranks(2, prepare_fns.constructors_take_mesh):
        assert out == ["ddp", "naive", "fsdp", "zero", "refused"]
