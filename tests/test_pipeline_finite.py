"""The pipeline's ``check_finite`` with its flags kept on the device (the default on NCCL
and the fake backend, forced here on gloo) decides and words every non-finite step as
the host path does; on ``meta`` a step with the default check reads the host once."""

from __future__ import annotations

import pytest

from tests import pipeline_finite_fns as fns


@pytest.mark.faults
@pytest.mark.parametrize(("where", "policy"), [("forward", "raise"), ("gradient", "skip")])
def test_device_flags_decide_and_name_as_the_host_path(ranks, where, policy):
    host = ranks(2, fns.nonfinite, where, policy, False, timeout=120)
    device = ranks(2, fns.nonfinite, where, policy, True, timeout=120)
    assert not any(r["default"] for r in host + device)  # gloo's default: the host path
    expected = {
        "forward": "rank 1 (pp rank 1) stage 1 produced a non-finite output in micro-batch 0 "
        "from a finite input",
        "gradient": "rank 1 (pp rank 1) has a non-finite gradient in parameter '4.weight' "
        "(stage 1)",
    }[where]
    for r in range(2):
        assert device[r]["message"] == host[r]["message"], (r, device[r], host[r])
        assert device[r]["error"] == host[r]["error"], r
        assert device[r]["culprits"] == host[r]["culprits"], r
        assert expected in device[r]["message"], device[r]["message"]
        if policy == "raise":
            assert device[r]["error"] == device[r]["message"]
        else:
            assert device[r]["skipped"] == host[r]["skipped"] == 1 and device[r]["grads_none"]


def test_a_meta_pipeline_step_with_the_default_check_reads_the_host_once(monkeypatch):
    """On the fake backend (a device backend) the default ``check_finite="raise"`` keeps
    its flags on ``meta``, where any host read raises; reads are counted here instead
    (answered "nothing flagged"): one per step, the verdict of ``_check_finite``."""
    from tests import meta_device_fns as meta
    from tests.meta_reads import count_host_reads

    reads = count_host_reads(monkeypatch)
    with meta.fake_world():
        out = meta.pipeline("1f1b")  # check_finite left at its default, "raise"
    assert out["off_meta"] == []
    assert reads == ["read_verdict"] * meta.STEPS, reads
