"""benchmarks/gpu.py, the script for a lent GPU machine, run on the CPU with --quick.

The quick runs are split by section so that each test stays short; together they run
every section of the script. Checks on the verdict logic use no processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import gpu, gpu_ranks
from plait import RankTimeout


def _run(tmp_path: Path, sections: str) -> tuple[int, dict[str, Any], str]:
    # no time budget: these tests check every check's verdict, not the budget
    argv = ["--device", "cpu", "--quick", "--budget-s", "0", "--sections", sections]
    code = gpu.main([*argv, "--out", str(tmp_path)])
    (json_path,) = tmp_path.glob("gpu-cpu-*.json")
    (md_path,) = tmp_path.glob("gpu-cpu-*.md")
    return code, json.loads(json_path.read_text()), md_path.read_text()


def _by_section(payload: dict[str, Any], section: str) -> list[dict[str, Any]]:
    return [r for r in payload["results"] if r["section"] == section]


@pytest.mark.timeout(240)
def test_quick_correctness_and_checkpoint_pass_on_cpu(tmp_path: Path) -> None:
    code, payload, md = _run(tmp_path, "environment,init,shared_gpu,correctness,checkpoint")
    assert code == 0, [r for r in payload["results"] if r["status"] == "fail"]
    checks = _by_section(payload, "correctness")
    assert [c["name"].split(" ")[0] for c in checks] == list(gpu_ranks.CASES)
    assert all(c["status"] == "pass" for c in checks)
    for c in checks:
        if "max_abs_diff" in c["data"]:
            assert c["data"]["max_abs_diff"] <= gpu.FLOAT64_TOL
            assert c["data"]["devices"] == ["cpu"]
        else:  # the 16-bit cases: computed in their dtype, update close to the oracle's
            assert c["data"]["computed_in"] in ("bfloat16", "float16")
            assert c["data"]["relative_update_error"] <= c["data"]["tolerance"]
    (init,) = _by_section(payload, "init")
    assert init["status"] == "pass" and init["data"]["backend"] == "gloo"
    (shared,) = _by_section(payload, "shared_gpu")
    assert shared["status"] == "skip" and "no CUDA device" in shared["reason"]
    loads = _by_section(payload, "checkpoint")
    assert [c["status"] for c in loads] == ["pass", "pass", "pass"]
    assert all(c["data"]["max_abs_diff"] == 0.0 for c in loads[1:])
    assert "| correctness | ddp (2 ranks, gloo) | pass |" in md
    assert payload["facts"]["command"].startswith("python benchmarks/gpu.py --device cpu")


@pytest.mark.timeout(240)
def test_quick_overhead_and_memory_run_on_cpu(tmp_path: Path) -> None:
    code, payload, md = _run(tmp_path, "overhead,memory")
    assert code == 0, [r for r in payload["results"] if r["status"] == "fail"]
    race = _by_section(payload, "overhead")[1]
    assert race["status"] == "pass"
    assert sorted(race["data"]["rows"]) == sorted(gpu_ranks.VARIANTS)
    assert all(row["median_ms"] > 0 and row["mfu"] is None for row in race["data"]["rows"].values())
    assert "plait ddp <= torch ddp" in race["data"]["goals"]
    memory = _by_section(payload, "memory")
    assert [m["name"].split(" ")[0] for m in memory] == list(gpu_ranks.MEMORY_STRATEGIES)
    for m in memory:  # no CUDA counters here: the plan and the model states only
        assert m["status"] == "skip" and "CUDA" in m["reason"]
        assert m["data"]["planned_bytes"] > m["data"]["planned_states_bytes"] > 0
        assert m["data"]["measured_states_bytes"] > 0
    assert "| variant | step ms | vs bare | tokens/s | MFU |" in md


@pytest.mark.timeout(240)
def test_quick_comm_and_cuda_tests_run_on_cpu(tmp_path: Path) -> None:
    code, payload, md = _run(tmp_path, "comm,cuda_tests")
    assert code == 0, [r for r in payload["results"] if r["status"] == "fail"]
    comm = _by_section(payload, "comm")
    assert [c["name"] for c in comm] == ["world 2, gloo", "world 2, shm"]
    for c in comm:
        assert c["status"] == "pass"
        assert {r["algorithm"] for r in c["data"]["rows"]} >= {"native", "ring", "auto"}
        assert all(r["time_us"] > 0 for r in c["data"]["rows"])
    (cuda,) = _by_section(payload, "cuda_tests")
    assert cuda["status"] == "skip" and "needs a CUDA device" in cuda["reason"]


@pytest.mark.timeout(240)
def test_quick_healing_runs_on_cpu(tmp_path: Path) -> None:
    code, payload, md = _run(tmp_path, "healing")
    assert code == 0, [r for r in payload["results"] if r["status"] == "fail"]
    clean, *faults = _by_section(payload, "healing")
    assert clean["status"] == "pass" and clean["data"]["max_abs_diff"] == 0.0  # CPU: bitwise
    *faults, ptdp = faults
    assert [f["name"].split(":")[0] for f in faults] == ["zero=0", "zero=1", "zero=3"]
    assert ptdp["name"].startswith("ReplicaTrainer") and ptdp["status"] == "pass"
    assert ptdp["data"]["max_abs_diff"] == 0.0 and ptdp["data"]["clean_agree"]
    assert sorted(ptdp["data"]["heals"]) == ["rank0", "rank1", "rank2-join", "rank3-join"]
    for f in faults:
        assert f["status"] == "pass" and f["data"]["max_abs_diff"] == 0.0
        assert f["data"]["devices"] == ["cpu"]
        assert f["data"]["heals"]["slot0"] == ["shrink", "grow"]
        assert sorted(f["data"]["members"]) == ["slot0", "slot1-join"]
    assert "| healing | zero=0: slot 1 killed at step 1, replaced" in md


# --- the verdicts, without processes ------------------------------------------------------------
def _rank(diff: float, keys: list[str], devices: list[str]) -> dict[str, Any]:
    return {"max_abs_diff": diff, "keys": keys, "all_keys": ["a", "b"], "devices": devices}


@pytest.mark.parametrize(
    ("per_rank", "reason"),
    [
        ([_rank(0.0, ["a"], ["cpu"]), _rank(0.0, ["a"], ["cpu"])], "no rank returned ['b']"),
        ([_rank(0.0, ["a"], ["cpu"]), _rank(0.0, ["b"], ["cuda"])], "parameters on"),
        ([_rank(0.0, ["a"], ["cpu"]), _rank(1e-6, ["b"], ["cpu"])], "differ from the oracle"),
    ],
)
def test_judge_fails_a_case_that_misses_keys_devices_or_values(
    per_rank: list[dict[str, Any]], reason: str
) -> None:
    with pytest.raises(gpu.Outcome) as caught:
        gpu.judge("ddp", per_rank, "cpu")
    assert caught.value.status == "fail" and reason in caught.value.reason


def test_judge_passes_ranks_that_cover_the_model_together() -> None:
    data = gpu.judge("tp", [_rank(1e-15, ["a"], ["cpu"]), _rank(0.0, ["b"], ["cpu"])], "cpu")
    assert data["max_abs_diff"] == 1e-15


def test_one_failing_check_does_not_stop_the_others_and_fails_the_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(run: gpu.Run) -> None:
        run.check("environment", "broken", lambda: 1 / 0)  # type: ignore[arg-type,return-value]
        run.check("environment", "after it", lambda: {"ran": True})

    monkeypatch.setitem(gpu.RUNNERS, "environment", broken)
    code = gpu.main(["--device", "cpu", "--sections", "environment", "--out", str(tmp_path)])
    assert code == 1
    (json_path,) = tmp_path.glob("gpu-cpu-*.json")
    results = json.loads(json_path.read_text())["results"]
    assert [(r["name"], r["status"]) for r in results] == [("broken", "fail"), ("after it", "pass")]
    assert results[0]["reason"].startswith("ZeroDivisionError")


# --- the time budget and the record written after every check, without processes ---------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_budget_counts_from_its_start_and_limits_waits() -> None:
    clock = FakeClock()
    budget = gpu.Budget(100.0, clock=clock, min_start=10.0)
    assert budget.left() == 100.0 and budget.fits()
    assert budget.limit(600.0) == (100.0 - gpu.CUT_MARGIN_S, True)  # the budget sets it
    assert budget.limit(30.0) == (30.0, False)  # the check's own cap sets it
    clock.now += 91.0
    assert not budget.fits() and budget.left() == 9.0
    assert budget.limit(30.0) == (max(1.0, 9.0 - gpu.CUT_MARGIN_S), True)
    clock.now += 50.0
    assert budget.limit(30.0) == (1.0, True)  # never a zero or negative timeout
    unlimited = gpu.Budget(0.0, clock=clock)
    assert unlimited.left() == float("inf") and unlimited.limit(600.0) == (600.0, False)


def test_a_run_writes_after_every_check_skips_what_does_not_fit_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three checks of 30 (fake) seconds in a 70 s budget: two run, the third is not
    started; a check that the budget cut (a pool timing out at the budget's limit) is a
    skip, not a failure; the files on disk hold every check done before the next began."""
    clock = FakeClock()
    seen_on_disk: list[list[str]] = []

    def on_disk() -> list[str]:
        (path,) = tmp_path.glob("gpu-cpu-*.json")
        return [r["name"] for r in json.loads(path.read_text())["results"]]

    def section(run: gpu.Run) -> None:
        for name in ("first", "second", "third"):

            def body() -> dict[str, Any]:
                if run.results:
                    seen_on_disk.append(on_disk())
                clock.now += 30.0
                return {"at": clock.now}

            run.check("environment", name, body)

    def cut_section(run: gpu.Run) -> None:
        def body() -> dict[str, Any]:
            run.limit()  # the pool's wait would end at the budget
            clock.now += 1000.0
            raise RankTimeout("ranks [0] did not finish within 67 s", [0])

        run.check("init", "cut", body)

    monkeypatch.setitem(gpu.RUNNERS, "environment", section)
    monkeypatch.setitem(gpu.RUNNERS, "init", cut_section)
    monkeypatch.setattr(gpu, "CLOCK", clock)
    argv = ["--device", "cpu", "--sections", "environment", "--budget-s", "70"]
    assert gpu.main([*argv, "--out", str(tmp_path)]) == 0
    assert seen_on_disk == [["first"]]  # the second check began with the first on disk
    (path,) = tmp_path.glob("gpu-cpu-*.json")
    payload = json.loads(path.read_text())
    got = [(r["name"], r["status"]) for r in payload["results"]]
    assert got == [("first", "pass"), ("second", "pass"), ("third", "skip")]
    assert payload["results"][2]["reason"].startswith("not started: 10 s of the 70 s time budget")
    assert payload["finished"] is True and payload["budget_s"] == 70.0
    md = next(tmp_path.glob("gpu-cpu-*.md")).read_text()
    assert "| environment | third | skip |" in md
    assert "Time budget 70 s; 60 s spent; finished." in md

    clock.now = 1000.0
    argv = ["--device", "cpu", "--sections", "init", "--budget-s", "70"]
    assert gpu.main([*argv, "--out", str(tmp_path / "cut")]) == 0  # cut is not failed
    (path,) = (tmp_path / "cut").glob("gpu-cpu-*.json")
    (cut,) = json.loads(path.read_text())["results"]
    assert cut["status"] == "skip" and cut["reason"].startswith("cut at the time budget (70 s)")


# A lent GPU machine has its own PyTorch and nothing else. The script, and what its ranks
# import, run here in an interpreter without site-packages (``python -S``) that sees only
# torch and the packages torch itself requires (linked into a folder), plus plait.
def _torch_only_folder(folder: Path) -> None:
    import importlib.metadata as md
    import importlib.util
    import re

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    wanted: set[str] = set()

    def add(dist: str) -> None:
        if dist in wanted:
            return
        wanted.add(dist)
        try:
            reqs = md.requires(dist) or []
        except md.PackageNotFoundError:
            return
        for req in reqs:
            if "extra ==" not in req:
                add(norm(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0]))

    add("torch")
    for dist in md.distributions():
        if norm(dist.metadata["Name"]) not in wanted:
            continue
        tops = {str(f).split("/")[0] for f in dist.files or []}
        for top in tops:
            name = top.removesuffix(".py")
            if top.endswith(".dist-info") or (
                name.isidentifier() and importlib.util.find_spec(name)
            ):
                target = Path(str(dist.locate_file(top)))
                if target.exists() and not (folder / top).exists():
                    (folder / top).symlink_to(target)


_IMPORTS = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import benchmarks.gpu, benchmarks.gpu_ranks, benchmarks.gpu_heal
import plait.heal.trainer, plait.heal.launch  # what the healing section's ranks import
import plait.checkpoint, plait.plan, plait.strategies.tensor  # what the ranks import later
import torch.distributed.fsdp, torch.distributed.device_mesh
print("imported", len(sys.modules), "modules")
"""


@pytest.mark.timeout(120)
def test_the_script_imports_nothing_but_torch_and_plait(tmp_path: Path) -> None:
    import subprocess
    import sys

    _torch_only_folder(tmp_path)
    assert (tmp_path / "torch").exists()
    assert not (tmp_path / "numpy").exists() and not (tmp_path / "pytest").exists()
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-S", "-c", _IMPORTS, str(tmp_path), str(root)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=110,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "imported" in proc.stdout


def test_defaults_fit_the_lent_machine() -> None:
    assert gpu.parse([]).budget_s == 480.0  # 8 minutes of a 15-minute lease
    assert gpu.parse(["--quick"]).budget_s == 50.0
    assert gpu.parse(["--budget-s", "0"]).budget_s == 0.0
    assert gpu.SECTIONS[:6] == (
        "environment",
        "init",
        "one_rank",
        "correctness",
        "overhead",
        "memory",
    )


# --- AdamW through the strategies that rebuild the optimizer (found by the overhead race) -------
def adamw_rebuilt(strategy: str) -> tuple[str, float, bool]:
    import torch

    import plait
    from plait.models import GPT

    n = plait.world().size
    dense = GPT(gpu_ranks.small_config(n, moe=strategy == "ep", dtype=torch.float32))
    opt = torch.optim.AdamW(dense.parameters(), lr=1e-3, weight_decay=0.05)
    meshes = {
        "tp": {"mesh": plait.Mesh(tp=n)},
        "ep": {"mesh": plait.Mesh(ep=n, dp=1)},
        "ptdp": {"mesh": plait.Mesh(pp=2, dp=1, tp=n // 2), "microbatches": 2},
    }
    _, rebuilt = plait.prepare(dense, opt, strategy=strategy, **meshes[strategy])
    assert rebuilt is not None
    group = rebuilt.param_groups[0]
    return type(rebuilt).__name__, group["weight_decay"], bool(group["decoupled_weight_decay"])


@pytest.mark.parametrize("strategy", ["tp", "ep", "ptdp"])
def test_strategies_that_rebuild_the_optimizer_take_adamw(ranks: Any, strategy: str) -> None:
    results = ranks(2, adamw_rebuilt, strategy, timeout=120)
    assert results == [("AdamW", 0.05, True)] * 2
