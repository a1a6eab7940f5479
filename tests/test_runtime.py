"""plait.init: settings from the environment are checked, a second init with other
settings raises, and a process group initialized by the script is adopted."""

from __future__ import annotations

import socket

import pytest

import plait
from plait import RankPool, runtime
from tests import runtime_fns

BAD_ENV = [
    ("PLAIT_TIMEOUT", "abc", "seconds >= 1"),
    ("PLAIT_TIMEOUT", "0", "seconds >= 1"),
    ("PLAIT_TIMEOUT", "-5", "seconds >= 1"),
    ("PLAIT_TIMEOUT", "inf", "finite"),
    ("PLAIT_TIMEOUT", "0.001", "seconds >= 1"),  # was a raw c10d socket error
    ("PLAIT_NODE_SIZE", "abc", ">= 1"),
    ("PLAIT_NODE_SIZE", "-2", ">= 1"),
    ("PLAIT_NODE_SIZE", "1.5", ">= 1"),
    ("PLAIT_HEARTBEAT_TIMEOUT", "abc", ">= 1"),
    ("PLAIT_HEARTBEAT_TIMEOUT", "0", ">= 1"),
    ("PLAIT_HEARTBEAT_TIMEOUT", "0.2", ">= 1"),
    ("PLAIT_CHECK", "maybe", "1 or 0"),
    ("PLAIT_DEBUG", "yes please", "1 or 0"),
    ("PLAIT_RECORDER_SIZE", "-1", "from 0 to 1000000"),
    ("PLAIT_RECORDER_SIZE", "many", "from 0 to 1000000"),
    ("PLAIT_SHM_SPIN_US", "abc", "microseconds from 0 to"),  # was a float() error at import
    ("PLAIT_SHM_SPIN_US", "-1", "microseconds from 0 to"),
    ("PLAIT_SHM_RING_BYTES", "1000", "a multiple of 4096"),
    ("PLAIT_SHM_WINDOW_BYTES", "0", "a multiple of 4096"),
    ("PLAIT_SHM_WINDOW_BYTES", "2MB", "a multiple of 4096"),
    ("PLAIT_TRANSPORT", "fast", "one of auto, shm, gloo"),
]


@pytest.mark.parametrize("name,value,valid", BAD_ENV)
def test_bad_environment_values_name_the_variable(monkeypatch, name, value, valid):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        plait.init()
    message = str(info.value)
    assert name in message and repr(value) in message and valid in message, message
    assert not runtime.is_initialized()


@pytest.mark.parametrize(
    "kwargs,valid",
    [
        ({"timeout": 0}, ">= 1"),
        ({"timeout": 0.001}, ">= 1"),
        ({"heartbeat_timeout": 0.1}, ">= 1"),
        ({"node_size": 0}, ">= 1"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, valid):
    with pytest.raises(ValueError, match=valid) as info:
        plait.init(**kwargs)
    assert next(iter(kwargs)) in str(info.value)


def test_uninitialized_error_says_what_to_do(monkeypatch):
    with pytest.raises(RuntimeError) as info:
        plait.world()
    message = str(info.value)
    assert "plait.init()" in message and "torch.distributed" in message, message
    assert "`plait run` do it for you" not in message  # plait run does not call init


def test_script_that_initialized_torch_distributed_is_adopted():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with RankPool(2, timeout=60) as pool:
        results = pool.run(runtime_fns.adopt, port, timeout=120)
    for r in results:
        assert r["initialized"] is True
        assert r["sum"] == [3.0, 3.0, 3.0]
        assert r["same_world"] is True
        assert "timeout=7" in r["reinit"] and "plait.shutdown()" in r["reinit"], r["reinit"]
        assert r["board"] is True
    assert results[0]["grad"] == results[1]["grad"]  # DDP averaged over the adopted group
