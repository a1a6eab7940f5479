"""The one host read per step: every strategy's default non-finite check (and fp16's loss
scaler) finds its flags on the model's device and reads the agreed verdict on the host
once per step, in :func:`plait.comm.device.read_verdict`, the read torch's GradScaler and
Megatron-LM's found-inf check make too. On ``meta`` (tests/meta_device_fns.py: one process
playing rank 0 of a fake world) that read has no values and is refused by name; with the
reads counted (tests/meta_reads.py) a step shows no other host read on its hot path (on a
GPU, no other synchronization)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import plait
import plait.precision
from tests import meta_device_fns as fns
from tests.meta_reads import count_host_reads

pytestmark = pytest.mark.timeout(300)

# check_finite left at its default ("raise") in every case
DEFAULT_CHECK: dict[str, Callable[[], dict[str, Any]]] = {
    "ddp": lambda: fns.data_parallel("ddp"),
    "naive": lambda: fns.data_parallel("naive"),
    "tp-sp": lambda: fns.tensor_parallel(True),
    "pipeline-1f1b": lambda: fns.pipeline("1f1b"),
    "cp-ring": lambda: fns.context_parallel("ring"),
    "ptdp-tp-pp-dp": lambda: fns.ptdp({"tp": 2, "pp": 2, "dp": 2}),
    # the MoE padded to capacity (the dropless dispatch reads its routing: refused on meta);
    # its has-gradient flags are read through host_list, which answers on meta from the
    # flags this rank made (on a GPU a second read per step, docs/devices.md)
    "ep-padded": lambda: fns.expert_parallel(pad_to_capacity=True),
}
WHO = {
    "ddp": "DistributedDataParallel",
    "naive": "NaiveDataParallel",
    "tp-sp": "tensor parallelism (group",
    "pipeline-1f1b": "pipeline (group",
    "cp-ring": "NaiveDataParallel",  # cp averages its gradients with it (over cp x dp)
    "ptdp-tp-pp-dp": "ptdp",
    "ep-padded": "expert_parallel",
}


@pytest.mark.parametrize("case", sorted(DEFAULT_CHECK))
def test_the_default_check_reads_the_host_once_per_step(case, monkeypatch):
    reads = count_host_reads(monkeypatch)
    with fns.fake_world():
        out = DEFAULT_CHECK[case]()
    assert out["off_meta"] == [], out["off_meta"]
    assert reads == ["read_verdict"] * fns.STEPS, f"{case}: host reads {reads}"


# the read is read_verdict's in every case (counted above): its refusal, shown for three
@pytest.mark.parametrize("case", ["cp-ring", "ptdp-tp-pp-dp", "ep-padded"])
def test_on_meta_the_verdict_read_is_refused_naming_the_strategy_and_the_setting(case):
    with fns.fake_world(), pytest.raises(NotImplementedError) as info:
        DEFAULT_CHECK[case]()
    text = str(info.value)
    assert "check_finite reads one agreed flag per step on the host" in text, text
    assert "Pass check_finite=None to step a model on the meta device" in text, text
    assert text.startswith(WHO[case]), text


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_fp16_loss_scaling_reads_its_found_inf_flag_once_per_step(monkeypatch, strategy):
    reads = count_host_reads(monkeypatch)
    with fns.fake_world():
        mesh = plait.Mesh(dp=4, ranks=range(4))
        model = fns.gpt()
        wrapped, opt = plait.prepare(
            model, fns.sgd(model), strategy=strategy, mesh=mesh, mixed_precision="fp16",
            **({"check_finite": None} if strategy == "ddp" else {}),  # the scaler checks
        )  # fmt: skip
        scaler = plait.precision.loss_scaler(opt)
        ids, targets = fns.tokens()
        for _ in range(fns.STEPS):
            opt.zero_grad()
            with fns.no_sync():
                scaler.scale(fns.ce(wrapped(ids), targets)).backward()
                scaler.step(opt)
        off = fns._on_meta(wrapped.parameters())
    assert off == []
    assert reads == ["read_verdict"] * fns.STEPS, reads
