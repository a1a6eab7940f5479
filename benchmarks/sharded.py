"""plait's ZeRO-1/2 and FSDP against PyTorch's ZeroRedundancyOptimizer and FSDP2, with plait
DDP as the baseline: step time and the model-state bytes each rank holds.

    .venv/bin/python benchmarks/sharded.py                          # worlds 2, 4; about 2 min
    .venv/bin/python benchmarks/sharded.py --quick --out /tmp/sh    # MLP, world 2: smoke test

Local ranks (``plait.RankPool``, gloo on loopback), one intra-op thread per rank
(``torch.set_num_threads(1)`` in the rank function, for every variant alike). The two models
of ``benchmarks/ddp.py`` (imported from it): the 2.9M-parameter MLP (batch 64 per rank) and
the 2.0M-parameter transformer (4 encoder layers, sequence 32, batch 16 per rank). Adam
(lr 1e-3) everywhere, fp32. Variants, all built on every rank from the same seed:

- ``plait ddp``: ``plait.DistributedDataParallel(model)`` (25 MiB buckets, ``auto``) and
  ``torch.optim.Adam``: the baseline;
- ``plait zero1`` / ``plait zero2``: ``plait.ZeroOptimizer(model.parameters(), Adam,
  stage=1 or 2)`` on the unwrapped model (it averages the gradients itself, ``auto``);
- ``torch zero1``: ``torch DistributedDataParallel(model)`` (which averages the gradients)
  and ``torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class=Adam)``
  (which shards the optimizer state and broadcasts the updated parameters), as PyTorch
  documents it;
- ``plait fsdp <algorithm>``: ``plait.fully_shard(model, wrap=..., algorithm=A)`` for each A
  of ``--fsdp-algorithms`` (default ``ring,auto``), with one unit per ``nn.Linear`` (MLP) or
  per ``nn.TransformerEncoderLayer`` (transformer; the root unit keeps embedding, positions
  and head);
- ``torch fsdp2``: ``torch.distributed.fsdp.fully_shard`` on the same submodules, then on the
  root, over ``init_device_mesh("cpu", (world,))``; defaults otherwise (reshard after
  forward, as plait's default);
- ``no communication``: each rank trains its own replica with Adam and talks to no one:
  the step's compute alone, on the same loaded cores: a floor for every variant, less
  the part of Adam's step that sharding divides by n (its replicas diverge, so it is left
  out of the parameter check).

Step time: a few warm-up rounds, then the variants take turns step by step in a rotating
order (A B C, B C A, ...), so machine noise hits all alike. A timed step is ``zero_grad`` +
forward + loss + ``backward`` + ``optimizer.step()``, preceded by ``torch.distributed
.barrier()``; its time is the slowest rank's (all-reduce MAX of the ranks' times at the end);
the tables show medians. Ratios: to the torch counterpart (plait ZeRO-1/2 against
ZeroRedundancyOptimizer, plait FSDP against FSDP2) and to plait DDP.

Fairness check: after the first round (every variant has taken one step) each variant's full
state dict is compared with plait DDP's (``allclose``, rtol = atol = 1e-5): the unwrapped
module's ``state_dict()`` for DDP/ZeRO, ``plait.checkpoint.full_state_dict`` for plait FSDP,
``DTensor.full_tensor()`` of ``model.state_dict()`` for FSDP2. A mismatch aborts the run.

Memory: at the end of the warm-up, right after a step (so gradients are still held),
``plait.plan.memory.measure(model, optimizer)`` on every rank: plait's ZeroOptimizer and
FSDP modules describe their tensors (``memory_breakdown``); for torch's ZeroRedundancyOptimizer
the local optimizer (``.optim``) holds the state of this rank's parameters; FSDP2's
parameters, gradients and Adam state are DTensors, counted by their local shard. Next to it,
``plait.plan.memory.estimate(strategy, precision="fp32", optimizer="adam")``. Residual state
(communication buckets, gathered units during forward/backward) is not counted by either.

Writes ``<out>/sharded.json`` (raw: every step, every rank's bytes) and ``<out>/sharded.md``
(tables); ``--out`` defaults to ``benchmarks/results``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ddp import MODELS, build_model, count_params, loss_of, make_batches  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402

import plait  # noqa: E402
from plait.checkpoint import full_state_dict  # noqa: E402
from plait.plan.memory import estimate, measure  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
LR = 1e-3
DDP = "plait ddp"
TORCH_ZERO = "torch zero1"
TORCH_FSDP = "torch fsdp2"
LOCAL = "no communication"
# the strategy name of plait.plan.memory.estimate for each kind of variant
STRATEGY = {
    "ddp": "ddp",
    "zero1": "zero1",
    "zero2": "zero2",
    "fsdp": "zero3",
    "fsdp2": "zero3",
    "local": "ddp",
}


def variant_names(fsdp_algorithms: list[str]) -> list[str]:
    names = [DDP, "plait zero1", "plait zero2", TORCH_ZERO]
    names += [f"plait fsdp {a}" for a in fsdp_algorithms] + [TORCH_FSDP, LOCAL]
    return names


def kind_of(name: str) -> str:
    """The kind of a variant: ddp, zero1, zero2, fsdp (plait) or fsdp2 (torch)."""
    if name == TORCH_FSDP:
        return "fsdp2"
    if name == LOCAL:
        return "local"
    return name.split()[1]


def counterpart(name: str) -> str | None:
    """The torch variant a plait variant is compared with."""
    kind = kind_of(name)
    if not name.startswith("plait") or kind == "ddp":
        return None
    return TORCH_FSDP if kind == "fsdp" else TORCH_ZERO


def unit_classes(model_name: str) -> tuple[type[nn.Module], ...]:
    """The submodules that become FSDP units of their own (both plait and torch)."""
    # nn.Linear would not do for the transformer: MultiheadAttention reads its out_proj's
    # weight directly, never calling that Linear's forward, so the unit would never gather
    return (nn.Linear,) if model_name == "mlp" else (nn.TransformerEncoderLayer,)


# --- variants ----------------------------------------------------------------------------
class Variant:
    """One replica (or shard) of the model, its optimizer, and how to measure it."""

    def __init__(self, name: str, model_name: str, mesh: Any, zero_algorithm: str) -> None:
        self.name = name
        self.kind = kind_of(name)
        model = build_model(model_name)
        self.wrapped: nn.Module = model
        self.module: nn.Module = model  # what holds the parameters (for state dicts)
        self.optimizer: Any
        self.measured_optimizer: Any
        if name == DDP:
            self.wrapped = plait.DistributedDataParallel(model)
            self.optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        elif name == LOCAL:  # each rank its own replica: the step without communication
            self.optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        elif self.kind in ("zero1", "zero2") and name.startswith("plait"):
            stage = 1 if self.kind == "zero1" else 2
            self.optimizer = plait.ZeroOptimizer(
                model.parameters(), torch.optim.Adam, stage=stage, algorithm=zero_algorithm, lr=LR
            )
        elif name == TORCH_ZERO:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.wrapped = TorchDDP(model)
            self.optimizer = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.Adam, lr=LR
            )
        elif self.kind == "fsdp":
            algorithm = name.removeprefix("plait fsdp ")
            plait.fully_shard(model, wrap=set(unit_classes(model_name)), algorithm=algorithm)
            self.optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        elif name == TORCH_FSDP:
            from torch.distributed.fsdp import fully_shard

            classes = unit_classes(model_name)
            for m in list(model.modules()):
                if m is not model and isinstance(m, classes):
                    fully_shard(m, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        else:
            raise ValueError(f"unknown variant {name!r}")
        # torch's ZeroRedundancyOptimizer keeps the state of this rank's parameters in its
        # local optimizer; every other optimizer is measured as it is
        self.measured_optimizer = self.optimizer.optim if name == TORCH_ZERO else self.optimizer

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        self.optimizer.zero_grad()
        loss_of(self.wrapped(x), y).backward()
        self.optimizer.step()

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole, unsharded state dict (collective for the sharded variants)."""
        if self.kind == "fsdp":
            return full_state_dict(self.module)
        if self.kind == "fsdp2":
            out = {}
            for key, value in self.module.state_dict().items():
                full = getattr(value, "full_tensor", None)
                out[key] = (full() if callable(full) else value).detach()
            return out
        return {k: v.detach() for k, v in self.module.state_dict().items()}

    def memory(self) -> dict[str, Any]:
        m = measure(self.module, self.measured_optimizer)
        return {
            "params": m.params_bytes,
            "grads": m.grads_bytes,
            "optimizer_state": m.optimizer_bytes,
            "total": m.total_bytes,
            "local_params": m.num_params,
        }


def run_rounds(
    variants: list[Variant],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    rounds: int,
    first: int = 0,
) -> dict[str, list[float]]:
    """``rounds`` rounds; in each, every variant takes one step, in a rotating order."""
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for i in range(first, first + rounds):
        shift = i % len(variants)
        for v in variants[shift:] + variants[:shift]:
            batch = batches[i % len(batches)]
            dist.barrier()
            t0 = time.perf_counter()
            v.step(batch)
            times[v.name].append(time.perf_counter() - t0)
    return times


def check_params(variants: list[Variant], model_name: str, steps: int) -> dict[str, dict[str, Any]]:
    """Every variant's full state dict against plait DDP's after ``steps`` steps; raises on
    a mismatch. Also records how far the steps moved plait DDP's parameters."""
    reference = variants[0].full_state()
    assert variants[0].name == DDP
    initial = build_model(model_name).state_dict()
    moved = max((reference[k] - v).abs().max().item() for k, v in initial.items())
    check: dict[str, dict[str, Any]] = {DDP: {"moved_by_step": moved}}
    for v in variants[1:]:
        if v.name == LOCAL:  # nothing averages its gradients: its replicas diverge
            continue
        state = v.full_state()
        if set(state) != set(reference):
            raise AssertionError(
                f"{v.name}: state-dict keys differ from plait DDP's: "
                f"{sorted(set(state) ^ set(reference))[:6]}"
            )
        diff, close = 0.0, True
        for key, ref in reference.items():
            got = state[key].to(ref.dtype)
            diff = max(diff, (got - ref).abs().max().item())
            close = close and torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
        flags = torch.tensor([0.0 if close else 1.0, diff], dtype=torch.float64)
        dist.all_reduce(flags, dist.ReduceOp.MAX)
        check[v.name] = {"max_abs_diff": flags[1].item(), "allclose": flags[0].item() == 0}
        if flags[0].item():
            raise AssertionError(
                f"{v.name} and plait DDP disagree after {steps} step(s) (max |diff| "
                f"{flags[1].item():.3g}): the comparison would not be like for like"
            )
    return check


# --- the rank function -------------------------------------------------------------------
def bench_rank(
    model_name: str, names: list[str], warmup: int, steps: int, zero_algorithm: str
) -> dict[str, Any]:
    """Runs on every rank; returns this rank's memory and the slowest rank's step times."""
    torch.set_num_threads(1)
    # FSDP2 warns that the root returns a view (the head's output); nothing edits it in place
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    batches = make_batches(model_name, dist.get_rank(), 4)
    variants = [Variant(n, model_name, mesh, zero_algorithm) for n in names]

    # Adam's first update is lr * g / (|g| + eps), about lr * sign(g): it would hide a
    # gradient off by a constant factor, so the parameters are compared after a second step
    # too
    check = {}
    for i in range(2):
        run_rounds(variants, batches, 1, first=i)
        check[f"after {i + 1} steps"] = check_params(variants, model_name, i + 1)
    run_rounds(variants, batches, warmup - 2, first=2)
    memory = {v.name: v.memory() for v in variants}  # right after a step: grads still held
    times = run_rounds(variants, batches, steps, first=warmup)
    slowest: dict[str, list[float]] = {}
    for name, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(t, dist.ReduceOp.MAX)
        slowest[name] = [x * 1e3 for x in t.tolist()]
    return {"steps_ms": slowest, "param_check": check, "memory": memory}


# --- the parent --------------------------------------------------------------------------
def summarize(world: int, model_name: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    first = per_rank[0]
    params = count_params(model_name)
    medians = {name: statistics.median(ts) for name, ts in first["steps_ms"].items()}
    variants: dict[str, Any] = {}
    for name, steps_ms in first["steps_ms"].items():
        ranks = [r["memory"][name] for r in per_rank]
        largest = max(ranks, key=lambda m: m["total"])
        est = estimate(
            num_params=params,
            world_size=world,
            strategy=STRATEGY[kind_of(name)],
            optimizer="adam",
            precision="fp32",
        )
        other = counterpart(name)
        variants[name] = {
            "median_ms": medians[name],
            "steps_ms": steps_ms,
            "vs_torch": medians[name] / medians[other] if other else None,
            "torch_counterpart": other,
            "vs_plait_ddp": medians[name] / medians[DDP],
            "memory_per_rank": ranks,
            "memory_largest_rank": largest,
            "memory_smallest_total": min(m["total"] for m in ranks),
            "estimate": {
                "strategy": est.strategy,
                "formula": est.formula,
                "params": est.params_bytes,
                "grads": est.grads_bytes,
                "optimizer_state": est.optimizer_bytes,
                "total": est.total_bytes,
            },
        }
    return {
        "world": world,
        "model": model_name,
        "params": params,
        "param_check": first["param_check"],
        "variants": variants,
    }


def progress_line(res: dict[str, Any]) -> str:
    parts = []
    for name, r in res["variants"].items():
        ratio = f" ({r['vs_torch']:.2f}x torch)" if r["vs_torch"] is not None else ""
        parts.append(f"{name} {r['median_ms']:.1f} ms{ratio}")
    return f"world {res['world']} {res['model']:<11}: " + "; ".join(parts)


def _mb(x: float) -> str:
    return f"{x / 1e6:.1f}"


def markdown(results: dict[str, Any]) -> str:
    a = results["args"]
    lines = [
        "### Step time",
        "",
        "| world | model | variant | step ms | vs torch counterpart | vs plait DDP |",
        "|---" * 6 + "|",
    ]
    for res in results["configs"]:
        for name, r in res["variants"].items():
            vs = "-"
            if r["vs_torch"] is not None:
                vs = f"{r['vs_torch']:.2f}x {r['torch_counterpart']}"
            lines.append(
                f"| {res['world']} | {res['model']} | {name} | {r['median_ms']:.1f} "
                f"| {vs} | {r['vs_plait_ddp']:.2f}x |"
            )
    lines += [
        "",
        "### Targets",
        "",
        "The target in milliseconds next to the same step without any communication "
        f"(`{LOCAL}`: each rank trains its own replica, full Adam): a target below it "
        "would need communication that costs nothing.",
        "",
        "| world | model | target | measured | met | target ms | no-communication ms |",
        "|---" * 7 + "|",
    ]
    for res in results["configs"]:
        v = res["variants"]
        floor = v[LOCAL]["median_ms"] if LOCAL in v else None
        for name, r in v.items():
            kind = kind_of(name)
            if not name.startswith("plait") or kind not in ("zero1", "fsdp"):
                continue
            limit = 1.0 if kind == "zero1" else 0.6
            target_ms = limit * v[r["torch_counterpart"]]["median_ms"]
            lines.append(
                f"| {res['world']} | {res['model']} | {name} <= {limit:g}x "
                f"{r['torch_counterpart']} | {r['vs_torch']:.2f}x "
                f"| {'yes' if r['vs_torch'] <= limit else 'no'} | {target_ms:.1f} "
                f"| {'-' if floor is None else f'{floor:.1f}'} |"
            )
    lines += [
        "",
        "### Model-state memory per rank (MB, 1e6 bytes): measured vs estimated",
        "",
        "| world | model | variant | params | grads | optimizer | total | estimate total "
        "| estimate (params / grads / optimizer) | measured / estimate |",
        "|---" * 10 + "|",
    ]
    for res in results["configs"]:
        for name, r in res["variants"].items():
            m, e = r["memory_largest_rank"], r["estimate"]
            spread = ""
            if r["memory_smallest_total"] != m["total"]:
                spread = f" (ranks {_mb(r['memory_smallest_total'])}-{_mb(m['total'])})"
            lines.append(
                f"| {res['world']} | {res['model']} | {name} | {_mb(m['params'])} "
                f"| {_mb(m['grads'])} | {_mb(m['optimizer_state'])} | {_mb(m['total'])}{spread} "
                f"| {_mb(e['total'])} | {_mb(e['params'])} / {_mb(e['grads'])} / "
                f"{_mb(e['optimizer_state'])} ({e['strategy']}: {e['formula']}) "
                f"| {m['total'] / e['total']:.2f} |"
            )
    steps = {res["world"]: len(res["variants"][DDP]["steps_ms"]) for res in results["configs"]}
    per_world = ", ".join(f"{n} at world {w}" for w, n in steps.items())
    diffs, moved = [], []
    for when in ("after 1 steps", "after 2 steps"):
        checks = [res["param_check"][when] for res in results["configs"]]
        diffs.append(
            max(c["max_abs_diff"] for d in checks for c in d.values() if c.get("allclose"))
        )
        moved.append(min(d[DDP]["moved_by_step"] for d in checks))
    lines.append(
        f"\nHow it was measured: `.venv/bin/python benchmarks/sharded.py`. Local ranks "
        f"(plait.RankPool), gloo on loopback, {results['cores']} cores, 1 intra-op thread per "
        f"rank, torch {results['torch']}; Adam (lr {LR:g}), fp32. Step time = zero_grad + "
        f"forward + loss + backward + optimizer.step(), after a barrier; the slowest rank's "
        f"time, median over interleaved steps in rotating order ({per_world}) after "
        f"{a['warmup']} warm-up rounds. plait ZeRO runs on the unwrapped model (it averages "
        f"gradients itself); torch zero1 is torch DDP + ZeroRedundancyOptimizer(Adam); FSDP "
        f"units are each nn.Linear (MLP) or each TransformerEncoderLayer (transformer) plus the "
        f"root, for plait fully_shard and torch FSDP2 (fully_shard on a 1-D CPU DeviceMesh) "
        f"alike. After one and after two steps every variant's full state dict matches plait "
        f"DDP's (allclose 1e-5; largest differences {diffs[0]:.2g} and {diffs[1]:.2g}, while "
        f"the steps moved the parameters by up to {moved[0]:.2g} and {moved[1]:.2g}; Adam's "
        f"first update is about lr * sign(g), so the second step is the one that would show "
        f"a wrongly scaled gradient). Memory: plait.plan.memory.measure(model, optimizer) "
        f"right after a step (gradients still held) on every rank, the largest rank shown "
        f"(the range where ranks differ); torch ZeroRedundancyOptimizer measured through its "
        f"local optimizer, FSDP2 DTensors by their local shard; estimate = plait.plan.memory"
        f".estimate(strategy, fp32, adam), P/n exact. Neither counts residual buffers (DDP "
        f"buckets, gathered FSDP units). Raw numbers: `sharded.json`."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--fsdp-algorithms", default="ring,auto")
    parser.add_argument("--zero-algorithm", default="auto", help="plait ZeroOptimizer's")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--steps-world4", type=int, default=20)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--quick", action="store_true", help="MLP, world 2, few steps")
    args = parser.parse_args()
    if args.warmup < 2:
        parser.error("--warmup must be at least 2 (the parameter checks take two rounds)")
    if args.quick:
        args.worlds, args.models = "2", "mlp"
        args.warmup, args.steps = 2, 3
        if args.out == OUT:
            parser.error("--quick writes a smoke test: give it another --out directory")
    names = variant_names(args.fsdp_algorithms.split(","))
    env = {"PLAIT_TUNE_FILE": str(Path(tempfile.mkdtemp()) / "none.json")}  # auto: the rule
    results: dict[str, Any] = {
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "args": {
            "warmup": args.warmup,
            "steps": args.steps,
            "steps_world4": args.steps_world4,
            "variants": names,
            "lr": LR,
            "zero_algorithm": args.zero_algorithm,
            "quick": args.quick,
        },
        "configs": [],
    }
    started = time.perf_counter()
    for world in [int(w) for w in args.worlds.split(",")]:
        steps = args.steps if world < 4 or args.quick else args.steps_world4
        with plait.RankPool(world, env=env) as pool:
            for model_name in args.models.split(","):
                per_rank = pool.run(
                    bench_rank,
                    model_name,
                    names,
                    args.warmup,
                    steps,
                    args.zero_algorithm,
                    timeout=1200,
                )
                res = summarize(world, model_name, per_rank)
                results["configs"].append(res)
                print(progress_line(res), flush=True)
    results["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sharded.json").write_text(json.dumps(results, indent=1))
    md = markdown(results)
    (args.out / "sharded.md").write_text(md)
    print(md)
    print(f"{results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
