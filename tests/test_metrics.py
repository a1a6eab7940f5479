"""plait.metrics: every record's numbers follow from what was measured (tokens/s = tokens /
step time, MFU = FLOPs per token x tokens/s / the ranks' peaks, bytes per group = what plait
counted), rank 0 writes them as JSON lines and TensorBoard events that read back the same,
W&B offline writes its run directory, and the FLOPs per token are the planner's."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from plait.metrics import Metrics, flops_per_token, scalars
from plait.models import GPT
from plait.models.gpt import GPTConfig
from plait.plan.hf import from_hf_config
from plait.plan.model import from_gpt_config
from tests import metrics_fns

ROOT = Path(__file__).resolve().parent.parent
LLAMA = {
    "model_type": "llama", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}  # fmt: skip


def _events(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_the_flops_per_token_are_the_planners_for_plait_gpt_and_hugging_face_llama():
    config = GPTConfig(vocab=97, layers=2, heads=4, width=32, seq_len=16)
    # by hand (plait.plan.model): 3 x (L (24 h^2 + 4 s h) + 2 h V), forward and backward
    by_hand = 3 * (2 * (24 * 32**2 + 4 * 16 * 32) + 2 * 32 * 97)
    assert flops_per_token(GPT(config)) == by_hand == from_gpt_config(config).flops_per_token(16)

    class Wrapper(torch.nn.Module):  # a strategy's wrapper keeps the model as .module
        def __init__(self) -> None:
            super().__init__()
            self.module = GPT(config)

    assert flops_per_token(Wrapper(), seq_len=8) == from_gpt_config(config).flops_per_token(8)
    assert flops_per_token(LLAMA, seq_len=64) == from_hf_config(LLAMA).flops_per_token(64)
    with pytest.raises(ValueError, match="seq_len="):
        flops_per_token(LLAMA)  # max_position_embeddings is a limit, not the run's length
    with pytest.raises(ValueError, match="flops_per_token="):
        Metrics(model=torch.nn.Linear(2, 2), jsonl=False)


def test_a_cuda_device_the_planners_table_names_gets_its_peak(monkeypatch):
    from plait.metrics import device_peak

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    peak = device_peak(torch.device("cuda", 0))
    assert peak.flops == 989e12 and peak.source == "NVIDIA H200: the planner's table, dense bf16"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert device_peak(torch.device("cuda", 0)).flops == 312e12


def test_a_record_flattens_to_tags_per_rank_and_per_group():
    record = {"step": 3, "time": 1.0, "loss": 2.0, "mfu": None, "memory_peak_bytes": [5, 6],
              "bytes_sent": {"tp": 8.0}}  # fmt: skip
    assert scalars(record) == {
        "loss": 2.0, "memory_peak_bytes/rank0": 5.0, "memory_peak_bytes/rank1": 6.0,
        "bytes_sent/tp": 8.0,
    }  # fmt: skip


@pytest.mark.timeout(120)
def test_two_ranks_reduce_once_a_step_and_rank_0_writes_what_reads_back(ranks, tmp_path: Path):
    steps = 3
    out = ranks(2, metrics_fns.record_steps, str(tmp_path), steps, timeout=90)
    records = out[0]["records"]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["loss"] == 1.5  # the ranks' losses 1 and 2, averaged
        assert r["tokens"] == 64 and r["lr"] == pytest.approx(0.1 * (r["step"] - 1))
        assert r["step_s"] == max(r["step_s_per_rank"]) and r["step_s"] >= r["data_s"] >= 0.01
        assert r["tokens_per_s"] == pytest.approx(64 / r["step_s"])
        assert r["tokens_per_s_per_rank"] == pytest.approx([32 / s for s in r["step_s_per_rank"]])
        assert r["mfu"] == pytest.approx(1e3 * r["tokens_per_s"] / (2 * 1e9))
        assert r["tflops_per_rank"] == pytest.approx(1e3 * r["tokens_per_s"] / 2 / 1e12)
        # the ring all-reduce of 1000 float32 on 2 ranks sends 2 (n-1)/n x 4000 bytes
        assert r["bytes_sent"] == {"dp": 4000.0} and r["bytes_sent_per_rank"] == [4000.0] * 2
        assert len(r["memory_peak_bytes"]) == 2 and min(r["memory_peak_bytes"]) > 0
    # every rank computed the same records; the metrics' own all-reduce is not in plait's
    # byte counters (only the training's is)
    other = out[1]["records"]
    assert [r["tokens_per_s"] for r in other] == [r["tokens_per_s"] for r in records]
    assert all(o["uncounted"] for o in out)
    assert out[0]["info"]["memory_kind"] == "process max RSS"
    assert all("tokens= differs between ranks" in o["refused"] for o in out)
    # rank 0's files: JSON lines equal to the records, TensorBoard events of the same values
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == records
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["summary"]["steps"] == steps and saved["info"]["peak_flops_per_rank"] == [1e9] * 2
    events = _events(tmp_path / "tensorboard")
    for tag in ("loss", "tokens_per_s", "mfu", "step_s", "data_s", "lr", "bytes_sent/dp"):
        want = [(r["step"], r[tag.split("/")[0]]) for r in records]
        if tag == "bytes_sent/dp":
            want = [(s, v["dp"]) for s, v in want]
        assert [s for s, _ in events[tag]] == [s for s, _ in want], tag
        assert [v for _, v in events[tag]] == pytest.approx([v for _, v in want], rel=1e-6), tag
    assert {"memory_peak_bytes/rank1", "tokens_per_s_per_rank/rank0"} <= set(events)


def test_one_process_every_2_steps_the_last_record_at_close_and_a_progress_bar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    config = GPTConfig(vocab=97, layers=2, heads=4, width=32, seq_len=16)
    m = Metrics(model=config, log_dir=tmp_path, every=2, progress=True, total=5)
    assert m.info["peak_source"].startswith("a float32 matmul timed on one thread")
    for _ in range(5):
        m.step(torch.tensor(2.0), tokens=32)
    m.close()
    assert [r["step"] for r in m.records] == [2, 4, 5]
    peak = m.info["peak_flops_per_rank"][0]
    for r in m.records:
        assert r["mfu"] == pytest.approx(flops_per_token(config) * 32 / r["step_s"] / peak)
    assert "training" in capsys.readouterr().err
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    assert m.describe().startswith(f"metrics ({tmp_path}/metrics.jsonl): 5 steps")
    with pytest.raises(ValueError, match="every=0"):
        Metrics(every=0)


def test_missing_tensorboard_or_wandb_names_the_extra(tmp_path: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"plait\[metrics\]"):
        Metrics(log_dir=tmp_path, jsonl=False, tensorboard=True)
    with pytest.raises(ImportError, match=r"plait\[metrics\]"):
        Metrics(log_dir=tmp_path, jsonl=False, wandb=True)


WANDB_RUN = """
import sys
from plait.metrics import Metrics

m = Metrics(log_dir=sys.argv[1], wandb={"name": "plait-test"}, flops_per_token=1e3,
            peak_flops=1e9)
for step in range(3):
    m.step(1.0 / (step + 1), tokens=64)
m.close()
"""


def _wandb_history(path: Path) -> list[dict[str, float]]:
    """The history rows of a W&B run file: a LevelDB-style log (a 7-byte header, then
    32 KiB blocks of records, each a 7-byte header: CRC32, length, type 1 full / 2 first /
    3 middle / 4 last) of ``wandb_internal_pb2.Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    pos, block, data, rows = 7, 32768, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            data = b""
            if rec.WhichOneof("record_type") == "history":
                items = rec.history.item
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
        elif kind == 0:
            break
    return rows


@pytest.mark.timeout(120)
def test_wandb_offline_writes_its_run_directory(tmp_path: Path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(WANDB_RUN))
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_SILENT="true")
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    runs = list((tmp_path / "out" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "out").rglob("*"))
    (run_file,) = runs[0].glob("run-*.wandb")  # the run's records, for `wandb sync`
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    history = _wandb_history(run_file)
    assert [h["_step"] for h in history] == [r["step"] for r in records] == [1, 2, 3]
    for h, r in zip(history, records, strict=True):
        for key in ("loss", "tokens_per_s", "mfu", "step_s"):
            assert h[key] == pytest.approx(r[key], rel=1e-12), key
        assert h["memory_peak_bytes/rank0"] == r["memory_peak_bytes"][0]
