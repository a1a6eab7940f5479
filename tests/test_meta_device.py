"""Device discipline without a GPU: every strategy steps a model on ``meta`` in one process
playing rank 0 of a fake world (``tests/meta_device_fns.py``), and a tensor off the group's
device handed to a collective is refused naming the call and the tensor."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import plait
from plait import comm
from plait.comm import device
from plait.strategies.fsdp.policies import MixedPrecisionPolicy, OffloadPolicy
from tests import meta_device_fns as fns

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def fake() -> Iterator[plait.comm.Group]:
    with fns.fake_world() as world:
        yield world


NO_CHECK = {"check_finite": None}  # the non-finite checks read a flag on the host: see below
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
OFFLOAD = OffloadPolicy(params=True)

# every case: one process, rank 0 of the fake world, a model on meta, STEPS steps
CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "ddp": lambda: fns.data_parallel("ddp", **NO_CHECK),
    "ddp-unused": lambda: fns.data_parallel("ddp", find_unused_parameters=True, **NO_CHECK),
    "ddp-bf16": lambda: fns.data_parallel("ddp", mixed_precision="bf16", **NO_CHECK),
    "naive": lambda: fns.data_parallel("naive", **NO_CHECK),
    "zero1": lambda: fns.data_parallel("zero1"),
    "zero2": lambda: fns.data_parallel("zero2"),
    "zero2-bf16": lambda: fns.data_parallel("zero2", mixed_precision="bf16"),
    "fsdp": lambda: fns.data_parallel("fsdp"),
    "fsdp-bf16": lambda: fns.data_parallel("fsdp", mp_policy=BF16),
    # offload: the shards on the host (off_meta lists those not there), compute on meta
    "fsdp-offload": lambda: fns.data_parallel("fsdp", offload_policy=OFFLOAD),
    "fsdp-offload-bf16": lambda: fns.data_parallel("fsdp", offload_policy=OFFLOAD, mp_policy=BF16),
    "tp": lambda: fns.tensor_parallel(False, **NO_CHECK),
    "tp-sp": lambda: fns.tensor_parallel(True, **NO_CHECK),
    **{f"pipeline-{s}": (lambda s=s: fns.pipeline(s, **NO_CHECK)) for s in fns.FLAT_SCHEDULES},
    **{
        f"pipeline-{s}": (lambda s=s: fns.pipeline(s, microbatches=8, **NO_CHECK))
        for s in fns.LOOPED_SCHEDULES
    },
    "cp-ring": lambda: fns.context_parallel("ring", **NO_CHECK),
    "cp-ulysses": lambda: fns.context_parallel("ulysses", **NO_CHECK),
    "ptdp-tp-pp-dp": lambda: fns.ptdp({"tp": 2, "pp": 2, "dp": 2}, **NO_CHECK),
    "ptdp-tp-pp-dp-cp": lambda: fns.ptdp({"tp": 2, "pp": 2, "dp": 2, "cp": 2}, **NO_CHECK),
    # expert parallelism with GShard's static capacity: equal all-to-all splits, no host read
    "ep-padded": lambda: fns.expert_parallel(pad_to_capacity=True, **NO_CHECK),
    "ptdp-pp-ep-padded": lambda: fns.ptdp(
        {"pp": 2, "dp": 1, "tp": 1, "ep": 2}, pad_to_capacity=True, **NO_CHECK
    ),
    # (plait's MoE layer refuses cp: its groups are whole sequences)
    "ptdp-tp-pp-dp-ep-padded": lambda: fns.ptdp(
        {"tp": 2, "pp": 2, "dp": 2, "ep": 2}, pad_to_capacity=True, **NO_CHECK
    ),
    # rank 0 also holds stage 2: its input shape (sequence-parallel: the sequence split
    # over tp) derived on meta from the earlier stages
    "ptdp-tp-pp-dp-interleaved-sp": lambda: fns.ptdp(
        {"tp": 2, "pp": 2, "dp": 2}, schedule="interleaved", sequence_parallel=True, **NO_CHECK
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_strategy_steps_a_meta_model_on_the_fake_backend(fake, case):
    comm.reset_stats()
    out = CASES[case]()
    where = "the host" if "offload" in case else "the meta device"
    assert out["off_meta"] == [], f"{case}: parameters left {where}: {out['off_meta']}"
    # the step did communicate: every tensor those collectives and messages took was on meta
    calls = {key: s.calls for key, s in comm.stats().items() if s.calls}
    assert sum(calls.values()) >= 2, f"{case}: no collective ran ({calls})"


def test_plait_init_creates_the_fake_world():
    with fns.fake_world(8, adopt=False) as world:
        assert (world.backend, world.size, world.rank) == ("fake", 8, 0)
        assert world.device == torch.device("meta")
        mesh = plait.Mesh(tp=2, dp=4)
        assert mesh.group("tp").device.type == "meta"
        flags = torch.zeros(3, device="meta")
        comm.all_reduce(flags, "sum", group=mesh.group("dp"), algorithm="ring")
        comm.all_reduce(flags, "sum", group=mesh.group("dp"), algorithm="native")


def test_a_cpu_tensor_handed_to_a_collective_is_refused_naming_the_call(fake):
    with pytest.raises(ValueError) as info:
        comm.all_reduce(torch.zeros(3), "max", group=fake)
    text = str(info.value)
    assert "all_reduce: tensor (shape (3,), torch.float32) is on cpu" in text
    assert "moves meta tensors only" in text
    assert "test_meta_device.py" in text and "test_a_cpu_tensor_handed" in text


def test_a_cpu_flag_planted_in_ddp_is_refused_naming_ddp_and_the_flag(fake, monkeypatch):
    """DDP's used-parameter flags, made on the CPU (as before this check), are refused
    with the strategy's file, method and the flags' shape."""
    from plait.strategies.data_parallel.ddp import DistributedDataParallel

    monkeypatch.setattr(
        DistributedDataParallel, "_control_device", lambda self: torch.device("cpu")
    )
    with pytest.raises(ValueError) as info:
        fns.data_parallel("ddp", check_finite=None, find_unused_parameters=True)
    text = str(info.value)
    assert "is on cpu but group" in text and "moves meta tensors only" in text
    assert "data_parallel/ddp.py" in text and "DistributedDataParallel._reduce_unused" in text
    assert "torch.int32" in text


def test_a_cpu_message_on_the_pipeline_path_is_refused(fake, monkeypatch):
    """The pipeline's point-to-point messages go through the same check (``Channel``)."""
    from plait.strategies.pipeline import messages

    real = messages.Link.irecv

    def on_cpu(self: Any, shape: Any, dtype: Any, peer: int, tag: int, verb: str, what: str,
               device: Any = None) -> Any:  # fmt: skip
        return real(self, shape, dtype, peer, tag, verb, what, device=torch.device("cpu"))

    monkeypatch.setattr(messages.Link, "irecv", on_cpu)
    with pytest.raises(Exception) as info:
        fns.pipeline("1f1b", **NO_CHECK)
    text = str(info.value)
    assert "a message's buffer" in text and "is on cpu" in text and "pipeline" in text


def test_the_parameter_server_keeps_its_model_on_the_cpu(fake):
    assert "keep it on CPU" in fns.parameter_server()


@pytest.mark.parametrize("mp", [None, BF16], ids=["fp32", "bf16"])
def test_fsdp_offload_keeps_shards_on_the_host_and_collectives_on_meta(fake, monkeypatch, mp):
    """Offloaded shards and their gradients live on the CPU; each unit's shard is copied
    to meta (host to device) before its all-gather, its gradient reduce-scattered on meta
    and brought back to the host (on meta: a host tensor of its size, no values to copy,
    ``plait.comm.device.moved``). Every tensor handed to a collective was on meta."""
    seen: list[tuple[str, str]] = []
    real = device.check

    def spy(collective: str, name: str, t: torch.Tensor, group: Any, where: Any = None) -> None:
        seen.append((collective, t.device.type))
        real(collective, name, t, group, where)

    monkeypatch.setattr(device, "check", spy)
    out = fns.data_parallel("fsdp", offload_policy=OFFLOAD, mp_policy=mp)
    assert out["off_meta"] == [] and out["host"], out
    assert all(shard == grad == "cpu" for shard, grad in out["host"]), out["host"]
    collectives = {c for c, _ in seen}
    assert {"all_gather", "reduce_scatter", "all_reduce"} <= collectives, collectives
    assert {d for _, d in seen} == {"meta"}, seen


def test_materializing_a_model_offloaded_on_meta_is_refused_naming_the_order(fake):
    """Sharded with offload while on meta, the model computes on meta; allocating it for
    real would move the host shards to the device: refused, naming what to do instead."""
    from plait.strategies.fsdp import fully_shard, materialize

    model = fns.gpt()
    for block in model.blocks:
        fully_shard(block, offload_policy=OFFLOAD)
    fully_shard(model, offload_policy=OFFLOAD)
    for allocate in (lambda: model.to_empty(device="cpu"), lambda: materialize(model)):
        with pytest.raises(ValueError, match="materialize the model on its compute device"):
            allocate()


def test_an_offloaded_shard_handed_to_a_collective_is_refused(fake, monkeypatch):
    """A unit gathering from its host shard without the copy to the compute device (here
    planted: the compute device set to the CPU) hands a CPU tensor to the all-gather:
    refused naming the call, the tensor and FSDP's unit."""
    from plait.strategies.fsdp.unit import ShardedUnit

    real = ShardedUnit.unshard

    def on_host(self: Any, *, async_op: bool = False) -> None:
        self.config.compute_device = torch.device("cpu")
        real(self, async_op=async_op)

    monkeypatch.setattr(ShardedUnit, "unshard", on_host)
    with pytest.raises(ValueError) as info:
        fns.data_parallel("fsdp", offload_policy=OFFLOAD)
    text = str(info.value)
    assert text.startswith("all_gather: ") and "is on cpu but group" in text, text
    assert "moves meta tensors only" in text and "fsdp/unit.py" in text, text


# What cannot run on meta: a decision that reads values on the host, by design. Each case
# is refused by name where that read would come, with the reason and the way out.
DATA_DEPENDENT = {
    # the dropless dispatch: the routing (tokens per expert, the all-to-all's split sizes)
    # is read on the host, as in every dropless MoE; pad_to_capacity=True steps (CASES)
    "ep": lambda: fns.expert_parallel(**NO_CHECK),
    "ptdp with ep": lambda: fns.ptdp({"pp": 2, "dp": 1, "tp": 1, "ep": 2}, **NO_CHECK),
}


@pytest.mark.parametrize("case", sorted(DATA_DEPENDENT))
def test_dropless_expert_parallelism_on_meta_is_refused_naming_the_way_out(fake, case):
    with pytest.raises(NotImplementedError) as info:
        DATA_DEPENDENT[case]()
    text = str(info.value)
    assert text.startswith("MoE layer (") and "routing tokens on the meta device" in text, text
    assert "split sizes are the tokens each expert receives" in text, text
    assert "pad_to_capacity=True" in text, text


def test_a_models_own_router_on_meta_is_refused_naming_the_dropless_routing():
    """A stacked expert container (Mixtral-style: the model's router decides top-k,
    dropless) has no capacity to pad to: refused on meta before any host read."""
    from plait.strategies.moe.dispatch import refuse_meta

    with pytest.raises(NotImplementedError, match="Mixtral, Qwen-MoE: dropless top-k"):
        refuse_meta(torch.empty(2, 3, device="meta"), "expert parallelism on MixtralExperts")


def test_the_padded_moe_steps_on_meta_reading_nothing_on_the_host(fake):
    """The padded path reads no routing value: its statistics wait on the device, and
    reading them on meta is refused naming the caller (no value to read)."""
    comm.reset_stats()
    out = fns.expert_parallel(pad_to_capacity=True, **NO_CHECK)
    assert out["off_meta"] == []
    calls = {key[0]: s.calls for key, s in comm.stats().items() if s.calls}
    # no counts gathered: one all-gather per MoE layer (2) over both steps, the agreement
    # on (G, C) of its first call; the all-to-alls every step
    assert calls.get("all_gather") == 2 and calls["all_to_all"] >= 16, calls
    layer = out["moe"]
    with pytest.raises(RuntimeError, match="reads the values of a meta tensor"):
        _ = layer.last_stats


@pytest.mark.parametrize("schedule", fns.LOOPED_SCHEDULES)
def test_a_later_stage_on_rank_0_gets_its_input_shape_from_the_earlier_stages(fake, schedule):
    """Rank 0 also holds a later stage, whose input shape arrives in a message that carries
    nothing on the fake backend: on a meta model the runtime runs the earlier stages here
    (on meta) for it; without them it refuses by name instead of failing inside."""
    out = fns.pipeline(schedule, microbatches=8, **NO_CHECK)
    later = [s for s in out["stages"] if s > 0]
    assert later and sorted(out["received"]) == later, out
    rows = max(fns.BATCH, 8) // 8
    for s in later:  # a block's input: (micro-batch rows, sequence, width), float32
        assert out["received"][s] == ((rows, fns.SEQ, out["width"]), torch.float32), out
    with pytest.raises(
        RuntimeError, match="on the meta device a message carries no values"
    ) as info:
        fns.pipeline(schedule, microbatches=8, derive=False, **NO_CHECK)
    assert f"schedule {schedule!r} places stage" in str(info.value)
