"""One script that proves plait on a GPU: correctness on CUDA, overhead, memory, CPU collectives.

    PYTHONPATH=. python3 benchmarks/gpu.py --out DIR            # the lent GPU machine, <= 8 min
    PYTHONPATH=. python3 benchmarks/gpu.py --device cpu --quick # anywhere, toy sizes, <= 1 min
    PYTHONPATH=. python3 benchmarks/gpu.py --sections correctness,checkpoint

It needs torch and plait only (no pytest, tqdm, transformers, safetensors: a lent machine
has its own PyTorch and nothing else). Writes ``gpu-<device>-<date>.md`` and ``.json`` to
``--out`` (default ``benchmarks/results/``) after **every** check, so a run cut short still
leaves what it measured. Every check records ``pass``, ``fail`` or ``skip`` with its reason;
one failing check never stops the others (a failed pool is replaced), and the exit code is 1
when any correctness check failed (benchmark goals missed are reported, not failed).

The run keeps to a time budget (``--budget-s``, default 480 s, 50 s with ``--quick``, 0 for
none) counted from the start of the process: a check is not started with less than
:data:`MIN_START_S` left (recorded as ``skip``, "not started: ..."), and a check still
running when the budget ends is stopped (its ranks killed) and recorded as ``skip``, "cut at
the time budget". Sections run in order of value (``--sections`` picks some):

- ``environment``: torch, CUDA, NCCL, the device, the cores;
- ``init``: ``plait.init()`` on one rank chooses NCCL where the rank owns a GPU (gloo on the
  CPU), and plait's all-reduce, all-gather, reduce-scatter and broadcast move tensors of
  this device over it, values checked;
- ``one_rank``: every case of ``correctness`` (below) on the one rank a GPU gives NCCL
  (``plait.init()`` chooses the backend: NCCL on CUDA, gloo on the CPU): every tensor a
  strategy hands a NCCL group must be on the GPU, which plait checks even at one rank;
- ``correctness``: on ``--ranks`` ranks (default 4 on CUDA, 2 on the CPU) sharing the
  device, each case of :data:`gpu_ranks.CASES` (DDP, ZeRO-1/2, FSDP, FSDP in bf16 and in
  fp16 with loss scaling, FSDP with CPU offload (pinned on CUDA), 1D tensor parallelism,
  1F1B and ZB-H1 pipelines, MoE with expert parallelism, PTD-P) trains the reference GPT
  and is compared with the same GPT trained in one process on the global batch in
  float64: parameters within 1e-9 after two Adam steps; the 16-bit cases' SGD update
  within 5% (bf16) or 1% (fp16) of the oracle's. The ranks share the one GPU over gloo
  (CUDA tensors staged through host memory): NCCL refuses two ranks on one device;
- ``overhead``: one rank, GPT-2 small's shape (124M, sequence 1024, bf16 autocast, AdamW),
  the largest micro-batch whose bare step fits in 60% of the card: the bare model against
  plait DDP, ZeRO-1, FSDP, TP and a pipeline at size 1 and PyTorch DDP and FSDP2, step
  times interleaved; model FLOPs utilisation against the card's bf16 peak. Goals: every
  plait wrapper within 3% of bare and no slower than PyTorch's counterpart. The timed
  rounds stop early when the check's share of the budget runs out (at least one each);
- ``memory``: on the ranks, DDP, ZeRO-1/2 and FSDP in fp32 (two Adam steps, micro-batch 1):
  ``torch.cuda.max_memory_allocated`` against ``plait.plan``'s model states plus
  activations for that layout. Goal: within 5%;
- ``checkpoint``: FSDP on the ranks saves with ``plait.checkpoint.save``; DDP at the same
  world size and a plain model on one rank load it (reshard) bitwise, parameters on the
  device;
- ``healing``: healing jobs (``benchmarks/gpu_heal.py``) of 2 fresh processes with the model
  on the device: without a fault within 1e-9 of one process on the CPU, then under
  ``zero=0``, ``1`` and ``3`` with slot 1 killed mid-step and replaced: every final
  parameter equal (``torch.equal``) to the job without the fault; then ReplicaTrainer (2
  replicas of 2 pipeline stages, 4 processes) with rank 3 killed and its replica replaced,
  bitwise to the same job without the fault. NCCL where each rank has a GPU, else gloo
  with CUDA tensors (staged through host);
- ``shared_gpu``: whether NCCL accepts several ranks on the one GPU (NCCL 2.5+ refuses:
  "Duplicate GPU detected"), which is why the multi-rank checks use gloo there;
- ``comm``: plait's collectives (``plait.bench.measure_rank``, what ``benchmarks/comm.py``
  runs) at 2, 4, 8 and 16 CPU ranks (those the cores allow), over gloo and over shared
  memory;
- ``cuda_tests``: the test suite's CUDA tests (``pytest -k cuda`` on the test files that
  use ``torch.cuda``; skipped where pytest is not installed); skipped tests are reported
  with their reasons.

The JSON holds ``facts`` (versions, device, cores, command, commit, the multi-rank
backend), ``date``, ``seconds`` and ``results``: one object per check with ``section``,
``name``, ``status``, ``reason``, ``seconds`` and ``data`` (the figures, or the failing
rank and its traceback). The Markdown file is the same as a table, followed by the
overhead table (step ms, ratio to bare, tokens/s, MFU, goals met or missed) and the
collective tables.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # the budget counts from here, before torch is imported

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import gpu_ranks as ranks  # noqa: E402
from plait import RankError, RankPool, RankTimeout, bench  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
SECTIONS = (  # in order of value: what a cut run must have measured first
    "environment",
    "init",
    "one_rank",
    "correctness",
    "overhead",
    "memory",
    "checkpoint",
    "healing",
    "shared_gpu",
    "comm",
    "cuda_tests",
)
BUDGET_S = 480.0  # the default budget: a lent GPU for 15 minutes, 1-2 of them to start it
QUICK_BUDGET_S = 50.0  # under a minute with the start and the exit
MIN_START_S = 20.0  # a check is not started with less than this left (12 s with --quick)
# a running check is stopped this long before the budget ends: killing its ranks, closing
# the other pools and writing the files take a few seconds on a loaded machine
CUT_MARGIN_S = 8.0
CLOCK: Callable[[], float] = time.perf_counter  # the budget's clock (a test's fake one)
FLOAT64_TOL = 1e-9  # float64 parameters after two Adam steps
UPDATE_TOL = {"fsdp_bf16": 0.05, "fsdp_fp16_scaled": 0.01}  # relative SGD update error
OVERHEAD_GOAL = 1.03  # plait wrapper step time / bare model's
MEMORY_GOAL = 0.05  # |measured / planned - 1|


@dataclass
class Result:
    section: str
    name: str
    status: str  # "pass", "fail" or "skip"
    reason: str = ""
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


class Outcome(Exception):
    """Raised inside a check to end it with a status other than an error's ``fail``."""

    def __init__(self, status: str, reason: str, data: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.data = status, reason, data or {}


class Budget:
    """The run's time budget: ``seconds`` from ``started`` (0: none), on ``clock``."""

    def __init__(
        self,
        seconds: float,
        *,
        started: float | None = None,
        clock: Callable[[], float] | None = None,
        min_start: float = MIN_START_S,
    ) -> None:
        self.seconds = seconds
        self.clock = clock or CLOCK
        self.started = clock() if started is None else started
        self.min_start = min_start

    def elapsed(self) -> float:
        return self.clock() - self.started

    def left(self) -> float:
        """Seconds left (infinite without a budget)."""
        return self.seconds - self.elapsed() if self.seconds > 0 else float("inf")

    def fits(self) -> bool:
        """Enough is left to start a check."""
        return self.left() >= self.min_start

    def limit(self, cap: float) -> tuple[float, bool]:
        """The timeout for a blocking step that may take up to ``cap`` seconds, and whether
        the budget (not ``cap``) set it."""
        left = self.left() - CUT_MARGIN_S
        return (max(1.0, left), True) if left < cap else (cap, False)


class Run:
    """The run's settings, its pools of ranks and its results."""

    def __init__(self, args: argparse.Namespace, started: float | None = None) -> None:
        self.args = args
        self.device: str = args.device
        self.quick: bool = args.quick
        self.world: int = args.ranks or (4 if self.device == "cuda" and not self.quick else 2)
        self.results: list[Result] = []
        self.facts: dict[str, Any] = {}
        self.started = CLOCK() if started is None else started
        self.budget = Budget(
            args.budget_s, started=self.started, min_start=12.0 if self.quick else MIN_START_S
        )
        self.finished = False  # every wanted section ran (or was skipped)
        self.cut = False  # set when the budget, not the check's own timeout, ended a wait
        self.date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        self._pools: dict[tuple[int, str | None], RankPool] = {}

    def limit(self, cap: float | None = None) -> float:
        """The timeout of the next blocking step of a check (at most ``--check-timeout``)."""
        timeout, by_budget = self.budget.limit(cap or self.args.check_timeout)
        self.cut = self.cut or by_budget
        return timeout

    @property
    def multi_backend(self) -> str:
        """The backend of the multi-rank checks: NCCL wants a GPU per rank, so with fewer
        GPUs than ranks gloo carries the CUDA tensors (staged through host memory)."""
        enough = self.device == "cuda" and torch.cuda.device_count() >= self.world
        return "nccl" if enough else "gloo"

    # --- pools ------------------------------------------------------------------------------
    def pool(self, world: int, backend: str | None = "gloo") -> RankPool:
        """A kept pool of ``world`` ranks (``backend=None``: ``plait.init`` chooses); a pool
        closed by a failure is replaced."""
        key = (world, backend)
        pool = self._pools.get(key)
        if pool is None or pool.closed:
            pool = RankPool(
                world,
                backend=backend,
                timeout=self.args.collective_timeout,
                start_timeout=self.limit(120.0),
            )
            self._pools[key] = pool
        return pool

    def close_pools(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def on_ranks(
        self, world: int, fn: Callable[..., Any], *args: Any, backend: str | None = "gloo"
    ) -> list[Any]:
        pool = self.pool(world, backend)
        return pool.run(fn, *args, timeout=self.limit())

    # --- checks -----------------------------------------------------------------------------
    def check(self, section: str, name: str, body: Callable[[], dict[str, Any]]) -> Result:
        """Run ``body``; it returns data (pass) or raises :class:`Outcome` or an error
        (fail, with the error). A check the budget has no room for is skipped, and one the
        budget ended is recorded as cut (skip), not failed."""
        if not self.budget.fits():
            left = max(0.0, self.budget.left())
            reason = (
                f"not started: {left:.0f} s of the {self.budget.seconds:g} s time budget left "
                f"(a check needs {self.budget.min_start:g} s)"
            )
            return self._record(Result(section, name, "skip", reason))
        self.cut = False
        t0 = time.perf_counter()
        try:
            result = Result(section, name, "pass", data=body())
        except Outcome as o:
            result = Result(section, name, o.status, o.reason, data=o.data)
        except (RankTimeout, subprocess.TimeoutExpired) as exc:
            if self.cut and not self.budget.fits():
                reason = (
                    f"cut at the time budget ({self.budget.seconds:g} s) after "
                    f"{time.perf_counter() - t0:.0f} s: {_error_text(exc)[:200]}"
                )
                result = Result(section, name, "skip", reason, data=_error_data(exc))
            else:
                result = Result(section, name, "fail", _error_text(exc), data=_error_data(exc))
        except Exception as exc:
            result = Result(section, name, "fail", _error_text(exc), data=_error_data(exc))
        result.seconds = time.perf_counter() - t0
        return self._record(result)

    def _record(self, result: Result) -> Result:
        """Keep ``result``, print it, and rewrite the Markdown and JSON files with it."""
        self.results.append(result)
        line = f"[{result.status:>4}] {result.section}/{result.name} ({result.seconds:.1f} s)"
        print(line + (f": {result.reason}" if result.reason else ""), flush=True)
        write(self, self.args.out)
        return result

    def skip(self, section: str, name: str, reason: str) -> None:
        self._record(Result(section, name, "skip", reason))


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 600 else text[:600] + " ..."


def _error_data(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, RankError):
        return {"rank": exc.rank, "traceback": exc.remote_traceback[-4000:]}
    if isinstance(exc, RankTimeout):
        return {"ranks": exc.ranks}
    return {"traceback": traceback.format_exc()[-4000:]}


# --- sections -------------------------------------------------------------------------------------
def collect_facts(run: Run) -> None:
    """What the results file's header says: versions, the device, the command."""
    facts: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cuda_available": torch.cuda.is_available(),
        "device": run.device,
        "ranks": run.world,
        "quick": run.quick,
        "command": " ".join(["python benchmarks/gpu.py", *run.args.argv]),
        "commit": _commit(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(
            cuda=torch.version.cuda,
            nccl=".".join(str(v) for v in torch.cuda.nccl.version()),
            gpu=props.name,
            gpu_memory_bytes=props.total_memory,
            gpus=torch.cuda.device_count(),
        )
    run.facts.update(facts)


def environment(run: Run) -> None:
    def body() -> dict[str, Any]:
        if run.device == "cuda" and not torch.cuda.is_available():
            raise Outcome("fail", "--device cuda, but torch.cuda.is_available() is False")
        return dict(run.facts)

    run.check("environment", "versions and device", body)


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def init_section(run: Run) -> None:
    def body() -> dict[str, Any]:
        facts = run.on_ranks(1, ranks.init_facts, run.device, backend=None)[0]
        expected = "nccl" if run.device == "cuda" else "gloo"
        bad = [k for k, ok in facts["collectives_ok"].items() if not ok]
        if facts["backend"] != expected:
            raise Outcome(
                "fail", f"plait.init() chose {facts['backend']!r}, expected {expected!r}", facts
            )
        if bad or facts["result_device"] != run.device:
            raise Outcome("fail", f"wrong values from {bad} on {facts['device']}", facts)
        return facts

    run.check("init", f"plait.init() chooses the backend; collectives on {run.device}", body)


def healing_section(run: Run) -> None:
    """Healing jobs on the device: a clean one against the CPU oracle, then one with a
    rank killed and replaced per ``zero``, bitwise to the clean one (benchmarks/gpu_heal.py)."""
    from benchmarks import gpu_heal

    enough = run.device == "cuda" and torch.cuda.device_count() >= gpu_heal.WORLD
    backend = "nccl" if enough else "gloo"
    clean: dict[str, Any] = {}

    def devices(records: dict[str, dict[str, Any]]) -> list[str]:
        found = sorted(set().union(*(r["devices"] for r in records.values())))
        if found != [run.device]:
            raise Outcome("fail", f"parameters on {found}, expected {run.device}")
        return found

    def clean_job() -> dict[str, Any]:
        records = gpu_heal.run_job(
            device=run.device, backend=backend, zero=0, kill=None, timeout=run.limit(90.0)
        )
        ref = gpu_heal.reference()
        diff = gpu_heal.max_diff(records, ref)
        data = {
            "devices": devices(records),
            "backend": backend,
            "max_abs_diff": diff,
            "tolerance": FLOAT64_TOL,
            "bitwise_to_cpu": gpu_heal.bitwise(records, ref),
        }
        if diff > FLOAT64_TOL:
            raise Outcome("fail", f"parameters differ from one process by {diff:.3g}", data)
        clean["records"] = records
        return data

    where = f"{gpu_heal.WORLD} slots, {backend}, {run.device}"
    run.check("healing", f"no fault ({where}) against one process", clean_job)
    slot, step, index = gpu_heal.KILL
    for zero in gpu_heal.ZEROS:
        name = f"zero={zero}: slot {slot} killed at step {step}, replaced ({where})"
        if "records" not in clean:
            run.skip("healing", name, "the job without a fault did not pass: nothing to compare")
            continue

        def fault_job(zero: int = zero) -> dict[str, Any]:
            records = gpu_heal.run_job(
                device=run.device,
                backend=backend,
                zero=zero,
                kill=gpu_heal.KILL,
                timeout=run.limit(90.0),
            )
            ref = clean["records"]["slot0"]["params"]
            data = {
                "devices": devices(records),
                "heals": {k: r["heals"] for k, r in records.items()},
                "members": {k: r["members"] for k, r in records.items()},
                "max_abs_diff": gpu_heal.max_diff(records, ref),
            }
            survivor = records["slot0"]["heals"]
            if survivor[:1] != ["shrink"] or "grow" not in survivor:
                raise Outcome("fail", f"slot 0 healed {survivor}, expected shrink then grow", data)
            if not gpu_heal.bitwise(records, ref):
                raise Outcome(
                    "fail", f"differs from the job without a fault by {data['max_abs_diff']:.3g}",
                    data,
                )  # fmt: skip
            return data

        run.check("healing", name, fault_job)
    ptdp_section(run, backend)


def ptdp_section(run: Run, backend: str) -> None:
    """Whole replicas (ReplicaTrainer, 2 replicas of 2 pipeline stages) on the device: the
    job with rank 3 killed and its replica replaced, bitwise to the job without it."""
    from benchmarks import gpu_heal

    rank, step, _ = gpu_heal.REPLICA_KILL
    where = f"{gpu_heal.REPLICAS} replicas x pp={gpu_heal.PP}, {backend}, {run.device}"

    def body() -> dict[str, Any]:
        kwargs = dict(device=run.device, backend=backend)
        clean = gpu_heal.run_replica_job(kill=None, timeout=run.limit(90.0), **kwargs)
        hurt = gpu_heal.run_replica_job(
            kill=gpu_heal.REPLICA_KILL, timeout=run.limit(90.0), **kwargs
        )
        ref = clean["rank0"]["params"]
        found = sorted(set().union(*(r["devices"] for r in [*clean.values(), *hurt.values()])))
        data = {
            "devices": found,
            "heals": {k: r["heals"] for k, r in hurt.items()},
            "max_abs_diff": gpu_heal.max_diff(hurt, ref),
            "clean_agree": gpu_heal.bitwise(clean, ref),
        }
        if found != [run.device]:
            raise Outcome("fail", f"parameters on {found}, expected {run.device}", data)
        if not data["clean_agree"]:
            raise Outcome("fail", "the replicas of the job without a fault disagree", data)
        if hurt["rank0"]["heals"][:1] != ["shrink"] or "grow" not in hurt["rank0"]["heals"]:
            raise Outcome("fail", f"rank 0 healed {hurt['rank0']['heals']}", data)
        if not gpu_heal.bitwise(hurt, ref):
            raise Outcome(
                "fail", f"differs from the job without a fault by {data['max_abs_diff']:.3g}",
                data,
            )  # fmt: skip
        return data

    name = f"ReplicaTrainer: rank {rank} killed at step {step}, its replica replaced ({where})"
    run.check("healing", name, body)


def shared_gpu(run: Run) -> None:
    name = f"NCCL with {run.world} ranks on one GPU"
    if run.device != "cuda":
        run.facts["multi_rank_backend"] = "gloo (CPU tensors)"
        run.skip("shared_gpu", name, "no CUDA device: the multi-rank checks use gloo on the CPU")
        return

    run.facts["multi_rank_backend"] = (
        "nccl" if run.multi_backend == "nccl" else "gloo with CUDA tensors (staged through host)"
    )

    def body() -> dict[str, Any]:
        # a pool of its own: a refused NCCL communicator may leave its ranks unusable
        try:
            with RankPool(run.world, timeout=60, start_timeout=run.limit(120.0)) as pool:
                probe = pool.run(ranks.nccl_shared_probe, timeout=run.limit(120.0))
        except (RankError, RankTimeout) as exc:  # a crash or a hang is a refusal too
            probe = [{"allowed": False, "error": _error_text(exc)}]
        allowed = all(p["allowed"] for p in probe)
        data = {"allowed": allowed, "ranks": probe, "multi_rank_backend": run.multi_backend}
        verdict = "NCCL allowed it" if allowed else f"NCCL refused ({probe[0]['error'][:200]})"
        raise Outcome("pass", f"{verdict}; the multi-rank checks use {run.multi_backend}", data)

    run.check("shared_gpu", name, body)


def one_rank(run: Run) -> None:
    """Every correctness case at one rank, the backend ``plait.init()`` picks (NCCL on a
    GPU): a CPU tensor reaching a NCCL group is refused even where nothing is sent."""
    for case in ranks.CASES:
        if case == "ptdp":
            run.skip("one_rank", case, "PTD-P here needs two pipeline stages (two ranks)")
            continue

        def body(case: str = case) -> dict[str, Any]:
            per_rank = run.on_ranks(1, ranks.check_case, case, run.device, backend=None)
            data = judge(case, per_rank, run.device)
            data["backend"] = per_rank[0]["backend"]
            return data

        run.check("one_rank", f"{case} (1 rank, backend plait.init() chose)", body)


def correctness(run: Run) -> None:
    backend = run.multi_backend
    for case in ranks.CASES:
        if case == "ptdp" and run.world % 2:
            run.skip("correctness", case, f"PTD-P here needs an even rank count, not {run.world}")
            continue

        def body(case: str = case) -> dict[str, Any]:
            per_rank = run.on_ranks(run.world, ranks.check_case, case, run.device, backend=backend)
            return judge(case, per_rank, run.device)

        run.check("correctness", f"{case} ({run.world} ranks, {backend})", body)


def judge(case: str, per_rank: list[dict[str, Any]], device: str) -> dict[str, Any]:
    """Pass or fail one correctness case from every rank's comparison with the oracle."""
    covered = set().union(*(r["keys"] for r in per_rank))
    missing = sorted(set(per_rank[0]["all_keys"]) - covered)
    devices = set().union(*(r["devices"] for r in per_rank))
    data: dict[str, Any] = {"devices": sorted(devices)}
    if missing:
        raise Outcome("fail", f"no rank returned {missing[:5]} ({len(missing)} keys)", data)
    if devices != {device}:
        raise Outcome("fail", f"parameters on {sorted(devices)}, expected {device}", data)
    if case in UPDATE_TOL:
        err = max(r["relative_update_error"] for r in per_rank)
        data.update(
            relative_update_error=err,
            tolerance=UPDATE_TOL[case],
            computed_in=per_rank[0]["computed_in"],
            stepped=[r["stepped"] for r in per_rank],
        )
        if not all(data["stepped"]):
            raise Outcome("fail", "the loss scaler skipped the step (inf/NaN found)", data)
        if err > UPDATE_TOL[case]:
            raise Outcome("fail", f"update differs from the oracle's by {err:.3g}", data)
        return data
    diff = max(r["max_abs_diff"] for r in per_rank)
    data.update(max_abs_diff=diff, tolerance=FLOAT64_TOL)
    if case == "fsdp_offload":
        data["shard_devices"] = sorted(set().union(*(r["shard_devices"] for r in per_rank)))
        data["pinned"] = [r["pinned"] for r in per_rank]
        if data["shard_devices"] != ["cpu"]:
            raise Outcome("fail", f"offloaded shards on {data['shard_devices']}", data)
        if device == "cuda" and not all(data["pinned"]):
            raise Outcome("fail", "offloaded shards are not in pinned host memory", data)
    if diff > FLOAT64_TOL:
        raise Outcome("fail", f"parameters differ from the oracle by {diff:.3g}", data)
    return data


def checkpoint_section(run: Run) -> None:
    root = tempfile.mkdtemp(prefix="plait-gpu-ckpt-")
    saved: dict[str, Any] = {}

    def save() -> dict[str, Any]:
        import importlib.util

        if importlib.util.find_spec("safetensors") is None:
            raise Outcome("skip", "plait.checkpoint writes safetensors files: not installed here")
        saved.update(
            run.on_ranks(
                run.world, ranks.checkpoint_save, root, run.device, backend=run.multi_backend
            )[0]
        )
        return {"root": root, "tensors": len(saved)}

    def load(world: int, strategy: str) -> Callable[[], dict[str, Any]]:
        def body() -> dict[str, Any]:
            if not saved:
                raise Outcome("skip", "nothing saved (the save check failed)")
            per_rank = run.on_ranks(
                world,
                ranks.checkpoint_load,
                root,
                run.device,
                strategy,
                run.world,
                backend=run.multi_backend if world > 1 else None,
            )
            diff = max(
                float((r["state"][k] - v).abs().max()) for r in per_rank for k, v in saved.items()
            )
            devices = sorted(set().union(*(r["devices"] for r in per_rank)))
            data = {"max_abs_diff": diff, "devices": devices, "step": per_rank[0]["step"]}
            if diff != 0.0:
                raise Outcome(
                    "fail", f"loaded state differs from the saved one by {diff:.3g}", data
                )
            if devices != [run.device]:
                raise Outcome("fail", f"loaded parameters on {devices}, not {run.device}", data)
            return data

        return body

    run.check("checkpoint", f"save FSDP on {run.world} ranks ({run.device})", save)
    run.check("checkpoint", f"load into DDP on {run.world} ranks (bitwise)", load(run.world, "ddp"))
    run.check("checkpoint", "load into one rank, plain model (reshard, bitwise)", load(1, "none"))


def overhead_section(run: Run) -> None:
    backend = None  # plait.init() chooses: NCCL for the one rank on its GPU
    chosen: dict[str, Any] = {}

    def pick() -> dict[str, Any]:
        candidates = [1, 2, 4, 8, 16, 32]
        chosen.update(
            run.on_ranks(
                1, ranks.largest_microbatch, run.device, run.quick, candidates, backend=backend
            )[0]
        )
        if not chosen["microbatch"]:
            raise Outcome("fail", "no micro-batch of 1 or more fits", chosen)
        return chosen

    def race() -> dict[str, Any]:
        if not chosen.get("microbatch"):
            raise Outcome("skip", "no micro-batch chosen")
        warmup, steps = (1, 1) if run.quick else (3, 20)
        # the timed rounds get 60% of what this check may take; the rest builds the variants
        seconds = 0.6 * min(run.budget.left(), run.args.check_timeout)
        res = run.on_ranks(
            1,
            ranks.overhead,
            run.device,
            run.quick,
            chosen["microbatch"],
            warmup,
            steps,
            seconds,
            backend=backend,
        )[0]
        return judge_overhead(res, run)

    run.check("overhead", "largest micro-batch that fits", pick)
    run.check("overhead", "bare model vs plait and PyTorch wrappers at one rank", race)


def judge_overhead(res: dict[str, Any], run: Run) -> dict[str, Any]:
    from plait.plan import from_gpt_config

    config = ranks.big_config(run.quick)
    flops = from_gpt_config(config).flops_per_iteration(batch=res["microbatch"], seq=config.seq_len)
    peak = card_peak(str(run.facts.get("gpu", ""))) if run.device == "cuda" else None
    bare = res["median_ms"].get("bare")
    rows = {}
    for name, ms in res["median_ms"].items():
        rows[name] = {
            "median_ms": ms,
            "vs_bare": ms / bare if bare else None,
            "tokens_per_s": res["microbatch"] * config.seq_len / (ms / 1e3),
            "mfu": flops / (ms / 1e3) / peak if peak else None,
        }
    goals = {}
    for name, counterpart in (("plait ddp", "torch ddp"), ("plait fsdp", "torch fsdp2")):
        if name in rows and counterpart in rows:
            goals[f"{name} <= {counterpart}"] = (
                rows[name]["median_ms"] <= rows[counterpart]["median_ms"]
            )
    for name, row in rows.items():
        if name.startswith("plait") and row["vs_bare"] is not None:
            goals[f"{name} within 3% of bare"] = row["vs_bare"] <= OVERHEAD_GOAL
    data = {**res, "rows": rows, "goals": goals, "flops_per_step": flops, "peak_flops": peak}
    if res["errors"]:
        raise Outcome("fail", f"variants failed: {sorted(res['errors'])}", data)
    return data


def card_peak(gpu_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of the card, from plait's cluster presets (H200 has the
    H100's compute); None for a card without a preset (MFU then not reported)."""
    from plait.plan import a100, h100

    if "H100" in gpu_name or "H200" in gpu_name:
        return h100().peak_flops
    if "A100" in gpu_name:
        return a100().peak_flops
    return None


def memory_section(run: Run) -> None:
    from plait.plan import Job, Layout, activation_memory, from_gpt_config, model_states

    config = ranks.big_config(run.quick)
    spec = from_gpt_config(config)
    mb = 1
    for strategy in ranks.MEMORY_STRATEGIES:

        def body(strategy: str = strategy) -> dict[str, Any]:
            stage = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}[strategy]
            job = Job(
                global_batch=mb * run.world, seq=config.seq_len, precision="fp32", dropout=False
            )
            layout = Layout(dp=run.world, microbatch=mb, zero=stage)
            states = model_states(spec, job, layout).total_bytes
            acts = activation_memory(spec, job, layout).total
            per_rank = run.on_ranks(
                run.world,
                ranks.memory,
                run.device,
                run.quick,
                strategy,
                mb,
                backend=run.multi_backend,
            )
            data: dict[str, Any] = {
                "planned_states_bytes": states,
                "planned_activation_bytes": acts,
                "planned_bytes": states + acts,
                "measured_states_bytes": max(r["states_bytes"] for r in per_rank),
            }
            if run.device != "cuda":
                raise Outcome("skip", "torch.cuda memory counters need CUDA (planned only)", data)
            peak = max(r["peak_bytes"] for r in per_rank)
            data.update(measured_peak_bytes=peak, ratio=peak / (states + acts))
            data["goal_within_5%"] = abs(data["ratio"] - 1) <= MEMORY_GOAL
            return data

        run.check("memory", f"{strategy} on {run.world} ranks, measured vs planned", body)


def comm_section(run: Run) -> None:
    cores = os.cpu_count() or 1
    worlds = [2] if run.quick else [w for w in (2, 4, 8, 16) if w <= cores]
    if run.quick:
        collectives, sizes, budget = ["all_reduce"], [4096], 0.05
    else:
        collectives = ["all_reduce", "reduce_scatter", "all_gather"]
        sizes, budget = bench.size_range(4096, 16 << 20, factor=16), 0.3
    for transport in ("gloo", "shm"):
        algorithms = ["native", "ring", "auto"] + (["shm"] if transport == "shm" else [])
        for world in worlds:

            def body(
                world: int = world, transport: str = transport, algorithms: list[str] = algorithms
            ) -> dict[str, Any]:
                env = {"PLAIT_TRANSPORT": transport}
                start = run.limit(120.0)
                with RankPool(world, env=env, timeout=120, start_timeout=start) as pool:
                    rows = pool.run(
                        bench.measure_rank,
                        collectives,
                        algorithms,
                        sizes,
                        max_iters=10,
                        budget_s=budget,
                        timeout=run.limit(),
                    )[0]
                return {"rows": bench.as_json(rows), "table": bench.format_rows(rows)}

            run.check("comm", f"world {world}, {transport}", body)


def cuda_tests(run: Run) -> None:
    def body() -> dict[str, Any]:
        import importlib.util

        if importlib.util.find_spec("pytest") is None:
            raise Outcome("skip", "pytest is not installed here (a lent GPU has torch only)")
        if not torch.cuda.is_available():  # what -k cuda selects may also pass on a CPU
            raise Outcome("skip", "the suite's CUDA tests: needs a CUDA device")
        files = sorted(
            str(p.relative_to(ROOT))
            for p in (ROOT / "tests").glob("test_*.py")
            if "torch.cuda" in p.read_text()
        )
        if not files:
            raise Outcome("skip", "no test file uses torch.cuda")
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", "cuda"]
        proc = subprocess.run(
            cmd + files,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=run.limit(),
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        tail = proc.stdout[-3000:]
        counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
        data = {"files": files, "returncode": proc.returncode, "counts": counts, "output": tail}
        if proc.returncode not in (0, 5):
            raise Outcome("fail", f"pytest exit code {proc.returncode}: {counts}", data)
        if not counts.get("passed"):
            reasons = sorted(set(re.findall(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", tail)))
            raise Outcome("skip", f"{counts}: {'; '.join(reasons) or 'none selected'}", data)
        return data

    run.check("cuda_tests", "pytest -k cuda", body)


RUNNERS: dict[str, Callable[[Run], None]] = {
    "environment": environment,
    "init": init_section,
    "one_rank": one_rank,
    "correctness": correctness,
    "overhead": overhead_section,
    "memory": memory_section,
    "checkpoint": checkpoint_section,
    "healing": healing_section,
    "shared_gpu": shared_gpu,
    "comm": comm_section,
    "cuda_tests": cuda_tests,
}
assert tuple(RUNNERS) == SECTIONS


# --- the results file -----------------------------------------------------------------------------
def device_slug(run: Run) -> str:
    name = str(run.facts.get("gpu", "")) if run.device == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", (name or run.device).lower()).strip("-")


def markdown(run: Run, date: str) -> str:
    f = run.facts
    lines = [
        f"# plait on {f.get('gpu', run.device)}: {date}",
        "",
        f"Command: `{f.get('command', '')}` (commit {f.get('commit', '?')}); torch "
        f"{f.get('torch')}, CUDA {f.get('cuda', '-')}, NCCL {f.get('nccl', '-')}, "
        f"{f.get('cpu_count')} CPU cores; {run.world} ranks for the multi-rank checks over "
        f"{f.get('multi_rank_backend', 'gloo')}.",
        "",
        "| section | check | status | seconds | reason / figures |",
        "|---|---|---|---|---|",
    ]
    for r in run.results:
        lines.append(
            f"| {r.section} | {r.name} | {r.status} | {r.seconds:.1f} | "
            f"{(r.reason or _figures(r)).replace('|', '/')} |"
        )
    for r in run.results:
        if r.section == "overhead" and "rows" in r.data:
            lines += ["", _overhead_table(r.data)]
        if r.section == "comm" and "table" in r.data:
            lines += ["", f"{r.name}:", "", "```", r.data["table"], "```"]
    counts = {s: sum(r.status == s for r in run.results) for s in ("pass", "fail", "skip")}
    lines += ["", f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped."]
    budget = f"{run.budget.seconds:g} s" if run.budget.seconds > 0 else "none"
    state = "finished" if run.finished else "still running or stopped (a partial record)"
    lines += [f"Time budget {budget}; {run.budget.elapsed():.0f} s spent; {state}."]
    return "\n".join(lines) + "\n"


def _figures(r: Result) -> str:
    d = r.data
    if "max_abs_diff" in d:
        return f"max abs diff {d['max_abs_diff']:.2g} (tolerance {d.get('tolerance', 0):g})"
    if "relative_update_error" in d:
        return (
            f"update error {d['relative_update_error']:.3g} (tolerance {d['tolerance']:g}), "
            f"computed in {d['computed_in']}"
        )
    if "ratio" in d:
        return (
            f"measured {d['measured_peak_bytes'] / 2**20:.0f} MiB, planned "
            f"{d['planned_bytes'] / 2**20:.0f} MiB ({d['ratio']:.2f}x)"
        )
    if "microbatch" in d and "rows" not in d:
        return f"micro-batch {d['microbatch']}"
    if "backend" in d:
        return f"backend {d['backend']} on {d['device']}"
    return ""


def _overhead_table(d: dict[str, Any]) -> str:
    lines = [
        f"Overhead at one rank: {d['params'] / 1e6:.0f}M parameters, micro-batch "
        f"{d['microbatch']}, sequence {d['seq']}"
        + (", bf16 autocast" if d.get("autocast_bf16") else ", fp32")
        + f"; medians of {d.get('rounds', '?')} rounds of interleaved steps"
        + (
            f" ({d['rounds_asked']} asked; the budget stopped the rest)."
            if d.get("rounds", 0) < d.get("rounds_asked", 0)
            else "."
        ),
        "",
        "| variant | step ms | vs bare | tokens/s | MFU |",
        "|---|---|---|---|---|",
    ]
    for name, row in d["rows"].items():
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a (no peak known)"
        vs = f"{row['vs_bare']:.3f}" if row["vs_bare"] is not None else "-"
        lines.append(
            f"| {name} | {row['median_ms']:.2f} | {vs} | {row['tokens_per_s']:,.0f} | {mfu} |"
        )
    goals = ", ".join(f"{k}: {'met' if v else 'missed'}" for k, v in d["goals"].items())
    return "\n".join(lines) + f"\n\nGoals: {goals}."


def write(run: Run, out: Path) -> tuple[Path, Path]:
    """Write (rewrite) the Markdown and JSON of what the run has measured so far; each
    file is written whole to a temporary name and renamed, so a reader never sees half."""
    date = run.date
    stem = f"gpu-{device_slug(run)}-{date}"
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "facts": run.facts,
        "date": date,
        "seconds": time.perf_counter() - run.started,
        "budget_s": run.budget.seconds,
        "finished": run.finished,
        "results": [asdict(r) for r in run.results],
    }
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    for path, text in (
        (json_path, json.dumps(payload, indent=1, default=str)),
        (md_path, markdown(run, date)),
    ):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return md_path, json_path


# --- main -----------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--quick", action="store_true", help="toy sizes: a smoke test")
    parser.add_argument("--ranks", type=int, default=0, help="ranks of the multi-rank checks")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"seconds for the whole run, from its start (default {BUDGET_S:g}, "
        f"{QUICK_BUDGET_S:g} with --quick; 0: no budget)",
    )
    parser.add_argument("--check-timeout", type=float, default=600.0, help="seconds per check")
    parser.add_argument("--collective-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.budget_s is None:
        args.budget_s = QUICK_BUDGET_S if args.quick else BUDGET_S
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    unknown = sorted(set(args.sections.split(",")) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; use some of {','.join(SECTIONS)}")
    if args.ranks < 0 or args.ranks == 1:
        parser.error(f"--ranks {args.ranks}: the multi-rank checks need at least 2 ranks")
    return args


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """Run the wanted sections; ``started``: when the budget began (default: now)."""
    args = parse(argv)
    run = Run(args, started)
    collect_facts(run)
    wanted = set(args.sections.split(","))
    try:
        for section in SECTIONS:
            if section in wanted:
                RUNNERS[section](run)
            if section == "shared_gpu":
                run.close_pools()  # the comm section starts pools of its own
        run.finished = True
    finally:
        run.close_pools()
        md_path, json_path = write(run, args.out)
    failed = [r for r in run.results if r.status == "fail"]
    print(f"wrote {md_path} and {json_path}; {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(started=STARTED))
