"""What ``benchmarks/gpu.py`` runs on the ranks: correctness against one process, the
checkpoint round trip, the overhead race at one rank and the memory measurement.

Every function here runs on every rank of a :class:`plait.RankPool` (the process group
joined) and returns plain data for the parent. ``device`` is ``"cuda"`` or ``"cpu"``; on
CUDA every rank of a pool uses GPU ``LOCAL_RANK % device_count`` (so several ranks share
the one GPU of a lent machine; their groups use gloo, which stages CUDA tensors through
host memory, because NCCL refuses two ranks on one device).

The one-process oracle is the same GPT, built from the same seed, trained in this process
on every step's whole global batch in float64 (decision 5 of the design); each rank
compares the parameters it holds with it and says which keys it covered, so the parent can
check that the ranks together covered the whole model.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import plait
from plait import checkpoint
from plait.models import GPT, GPTConfig, MoEConfig
from plait.models.gpt import loss as gpt_loss
from plait.models.plans import plan_for

STEPS = 2  # optimizer steps compared with the oracle
LR = 1e-2
GLOBAL_BATCH = 8


# --- shared pieces ----------------------------------------------------------------------------
def rank_device(device: str) -> torch.device:
    """This rank's device: the CPU, or GPU ``LOCAL_RANK % device_count`` (made current)."""
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"rank {dist.get_rank()}: device {device!r} asked for, but torch.cuda.is_available() "
            f"is False on this machine; run with --device cpu"
        )
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def small_config(world: int, *, moe: bool = False, dtype: torch.dtype = torch.float64) -> GPTConfig:
    """A GPT small enough to train in float64 in a second, with one block per pipeline
    stage at least and ``2 * world`` experts when ``moe``."""
    return GPTConfig(
        vocab=64,
        layers=max(2, world),
        heads=4,
        width=32,
        seq_len=16,
        dtype=dtype,
        moe=MoEConfig(num_experts=2 * world) if moe else None,
    )


def batch(config: GPTConfig, step: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch (inputs, next tokens), the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, config.vocab, (GLOBAL_BATCH, config.seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous().to(dev), tokens[:, 1:].contiguous().to(dev)


def rows(rank: int, n: int) -> slice:
    per = GLOBAL_BATCH // n
    return slice(rank * per, (rank + 1) * per)


def oracle(
    config: GPTConfig,
    dev: torch.device,
    optimizer: str = "adam",
    steps: int = STEPS,
    initial: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The dense GPT trained in this one process on every step's whole global batch, from
    its seeded weights or from ``initial`` (cast to the config's dtype)."""
    model = GPT(config).to(dev)
    if initial is not None:
        model.load_state_dict({k: v.to(config.dtype) for k, v in initial.items()})
    opt = make_optimizer(optimizer, model.parameters())
    for step in range(steps):
        x, y = batch(config, step, dev)
        opt.zero_grad()
        gpt_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.Adam(params, lr=LR)


def compare(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Largest |difference| over the keys this rank holds, those keys, and where they live."""
    diff = 0.0
    devices = set()
    for key, value in state.items():
        if key not in reference:
            raise KeyError(
                f"rank {dist.get_rank()}: the strategy's state has key {key!r}, which the dense "
                f"GPT does not have"
            )
        devices.add(str(value.device.type))
        ref = reference[key]
        d = (value.detach().to(ref.device, torch.float64) - ref.to(torch.float64)).abs().max()
        diff = max(diff, float(d))
    return {
        "max_abs_diff": diff,
        "keys": sorted(state),
        "all_keys": sorted(reference),
        "devices": sorted(devices),
    }


# --- correctness: one function per case -------------------------------------------------------
CASES = (
    "ddp",
    "zero1",
    "zero2",
    "fsdp",
    "fsdp_bf16",
    "fsdp_fp16_scaled",
    "fsdp_offload",
    "tp",
    "pipeline_1f1b",
    "pipeline_zb-h1",
    "moe_ep",
    "ptdp",
)


def check_case(case: str, device: str) -> dict[str, Any]:
    """Train ``case`` for a few steps on this pool's ranks and compare with the oracle.

    Returns ``max_abs_diff`` (float64 cases: parameters after :data:`STEPS` Adam steps) or
    ``relative_update_error`` (16-bit cases: ``|update - oracle update| / |oracle update|``
    after one SGD step, the oracle in float64), the keys this rank compared, and facts the
    parent checks (``devices`` of the compared tensors; ``pinned`` for the offload case).
    """
    torch.manual_seed(0)
    dev = rank_device(device)
    world = plait.world()
    n, r = world.size, world.rank
    if case in ("fsdp_bf16", "fsdp_fp16_scaled"):
        out = _mixed_precision(case, dev, n, r)
    elif case in ("ddp", "zero1", "zero2", "fsdp", "fsdp_offload"):
        out = _data_parallel(dev, n, r, strategy=case)
    elif case.startswith("pipeline_"):
        out = _pipeline(dev, n, r, schedule=case.removeprefix("pipeline_"))
    elif case == "tp":
        out = _tensor_parallel(dev, n, r)
    elif case == "moe_ep":
        out = _experts(dev, n, r)
    elif case == "ptdp":
        out = _ptdp(dev, n, r)
    else:
        raise ValueError(f"unknown case {case!r}; use one of {CASES}")
    sync(dev)
    out["backend"] = world.backend
    return out


def _data_parallel(dev: torch.device, n: int, r: int, strategy: str = "ddp") -> dict[str, Any]:
    config = small_config(n)
    model = GPT(config).to(dev)
    opt = make_optimizer("adam", model.parameters())
    options: dict[str, Any] = {}
    name = strategy
    if strategy == "fsdp_offload":
        name = "fsdp"
        options["offload_policy"] = plait.OffloadPolicy(params=True, optimizer_state=True)
    wrapped, opt2 = plait.prepare(model, opt, strategy=name, **options)
    assert opt2 is not None
    for step in range(STEPS):
        x, y = batch(config, step, dev)
        opt2.zero_grad()
        gpt_loss(wrapped(x[rows(r, n)]), y[rows(r, n)]).backward()
        opt2.step()
    out = compare(checkpoint.full_state_dict(wrapped), oracle(config, dev))
    if strategy == "fsdp_offload":
        shards = [p for group in opt2.param_groups for p in group["params"]]
        out["shard_devices"] = sorted({p.device.type for p in shards})
        out["pinned"] = all(p.is_pinned() for p in shards) if dev.type == "cuda" else None
    return out


def _mixed_precision(case: str, dev: torch.device, n: int, r: int) -> dict[str, Any]:
    """FSDP computing in bf16 (or fp16 with :class:`plait.amp.DynamicLossScaler`), fp32
    masters, one SGD step: its update against the float64 oracle's."""
    low = torch.bfloat16 if case == "fsdp_bf16" else torch.float16
    config = small_config(n, dtype=torch.float32)
    model = GPT(config).to(dev)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = make_optimizer("sgd", model.parameters())
    policy = plait.MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    wrapped, opt2 = plait.prepare(model, opt, strategy="fsdp", mp_policy=policy)
    assert opt2 is not None
    x, y = batch(config, 0, dev)
    logits = wrapped(x[rows(r, n)])
    computed_in = str(logits.dtype).removeprefix("torch.")
    loss = gpt_loss(logits.float(), y[rows(r, n)])
    stepped = True
    if low is torch.float16:
        scaler = plait.amp.DynamicLossScaler(init_scale=2.0**12)
        scaler.scale(loss).backward()
        stepped = scaler.step(opt2)
    else:
        loss.backward()
        opt2.step()
    after = checkpoint.full_state_dict(wrapped)
    ref_config = small_config(n, dtype=torch.float64)
    ref_after = oracle(ref_config, dev, optimizer="sgd", steps=1, initial=before)
    num = den = 0.0
    for key, ref in ref_after.items():
        start = before[key].to(torch.float64)
        mine = after[key].to(torch.float64) - start
        theirs = ref - start
        num += float((mine - theirs).pow(2).sum())
        den += float(theirs.pow(2).sum())
    return {
        "relative_update_error": (num / den) ** 0.5 if den else float("inf"),
        "keys": sorted(after),
        "all_keys": sorted(ref_after),
        "devices": sorted({v.device.type for v in after.values()}),
        "computed_in": computed_in,
        "stepped": stepped,
    }


def _tensor_parallel(dev: torch.device, n: int, r: int) -> dict[str, Any]:
    from plait.strategies.tensor import loss_fn

    config = small_config(n)
    dense = GPT(config).to(dev)
    model, opt = plait.prepare(
        dense, make_optimizer("adam", dense.parameters()), strategy="tp", mesh=plait.Mesh(tp=n)
    )
    assert opt is not None
    loss_of = loss_fn(model)
    for step in range(STEPS):
        x, y = batch(config, step, dev)
        opt.zero_grad()
        loss_of(model(x), y).backward()
        opt.step()
    return compare(checkpoint.full_state_dict(model), oracle(config, dev))


def _pipeline(dev: torch.device, n: int, r: int, schedule: str = "1f1b") -> dict[str, Any]:
    config = small_config(n)
    dense = GPT(config).to(dev)
    pipe = plait.PipelineParallel(
        dense,
        group=plait.Mesh(pp=n).group("pp"),
        schedule=schedule,
        microbatches=2 * n,
        plan=plan_for(dense, "pipeline"),
    )
    opt = make_optimizer("adam", pipe.parameters())
    for step in range(STEPS):
        x, y = batch(config, step, dev)
        opt.zero_grad()
        pipe.step(x, y)
        opt.step()
    return compare(pipe.dense_state_dict(), oracle(config, dev))


def _experts(dev: torch.device, n: int, r: int) -> dict[str, Any]:
    config = small_config(n, moe=True)
    dense = GPT(config).to(dev)
    model, opt = plait.prepare(
        dense,
        make_optimizer("adam", dense.parameters()),
        strategy="ep",
        mesh=plait.Mesh(ep=n, dp=1),
    )
    assert opt is not None
    b = int(model.plait_expert_parallel.batch_rank)
    for step in range(STEPS):
        x, y = batch(config, step, dev)
        opt.zero_grad()
        gpt_loss(model(x[rows(b, n)]), y[rows(b, n)]).backward()
        opt.step()
    return compare(checkpoint.full_state_dict(model), oracle(config, dev))


def _ptdp(dev: torch.device, n: int, r: int) -> dict[str, Any]:
    """PTD-P on ``Mesh(pp=2, dp=1, tp=n/2)`` (``tp=1`` on two ranks)."""
    if n % 2:
        raise ValueError(f"ptdp needs an even number of ranks (pp=2), got {n}")
    config = small_config(n)
    dense = GPT(config).to(dev)
    ptdp, opt = plait.prepare(
        dense,
        make_optimizer("adam", dense.parameters()),
        strategy="ptdp",
        mesh=plait.Mesh(pp=2, dp=1, tp=n // 2),
        schedule="1f1b",
        microbatches=4,
    )
    assert opt is not None
    for step in range(STEPS):
        x, y = batch(config, step, dev)
        opt.zero_grad()
        ptdp.step(x, y)
        opt.step()
    return compare(ptdp.full_state_dict(), oracle(config, dev))


# --- init and the backend at one rank ---------------------------------------------------------
def init_facts(device: str) -> dict[str, Any]:
    """The backend ``plait.init()`` chose, and plait's collectives on this device over it
    (all-reduce, all-gather, reduce-scatter, broadcast: values checked)."""
    from plait import comm

    dev = rank_device(device)
    world = plait.world()
    n, r = world.size, world.rank
    t = torch.full((4 * n,), float(r + 1), device=dev)
    comm.all_reduce(t)
    expected = n * (n + 1) / 2
    gathered = torch.empty(4 * n, device=dev)
    comm.all_gather(gathered, torch.full((4,), float(r), device=dev))
    part = torch.empty(4, device=dev)
    comm.reduce_scatter(part, torch.ones(4 * n, device=dev))
    b = torch.full((3,), float(r), device=dev)
    comm.broadcast(b, 0)
    sync(dev)
    ok = {
        "all_reduce": bool((t == expected).all()),
        "all_gather": bool((gathered.view(n, 4) == torch.arange(n, device=dev).unsqueeze(1)).all()),
        "reduce_scatter": bool((part == n).all()),
        "broadcast": bool((b == 0).all()),
    }
    return {
        "backend": world.backend,
        "device": str(dev),
        "collectives_ok": ok,
        "result_device": t.device.type,
    }


def nccl_shared_probe() -> dict[str, Any]:
    """Whether NCCL takes this pool's ranks all on GPU 0: a NCCL group beside the world
    group and one all-reduce on it. NCCL 2.5+ refuses ("Duplicate GPU detected"); the
    refusal is returned, not raised."""
    torch.cuda.set_device(0)
    try:
        group = dist.new_group(backend="nccl")
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t, group=group)
        torch.cuda.synchronize()
        return {"allowed": True, "value": float(t[0]), "error": ""}
    except Exception as exc:  # the refusal is the finding
        return {"allowed": False, "error": f"{type(exc).__name__}: {exc}"[:600]}


# --- checkpoints --------------------------------------------------------------------------------
def checkpoint_save(root: str, device: str) -> dict[str, Any]:
    """FSDP over this pool, one Adam step, ``plait.checkpoint.save``; returns the dense state
    (on the CPU, for the parent to compare loads with)."""
    dev = rank_device(device)
    n, r = plait.world().size, plait.world().rank
    config = small_config(n)
    model = GPT(config).to(dev)
    wrapped, opt = plait.prepare(model, make_optimizer("adam", model.parameters()), strategy="fsdp")
    assert opt is not None
    x, y = batch(config, 0, dev)
    opt.zero_grad()
    gpt_loss(wrapped(x[rows(r, n)]), y[rows(r, n)]).backward()
    opt.step()
    checkpoint.save(root, step=1, model=wrapped, optimizer=opt)
    return {k: v.detach().cpu() for k, v in checkpoint.full_state_dict(wrapped).items()}


def checkpoint_load(root: str, device: str, strategy: str, saved_world: int) -> dict[str, Any]:
    """A fresh model under ``strategy`` at this pool's world size loads the checkpoint;
    returns its dense state (CPU) and where the loaded parameters live."""
    dev = rank_device(device)
    config = small_config(saved_world)
    model = GPT(config).to(dev)
    wrapped, opt = plait.prepare(
        model, make_optimizer("adam", model.parameters()), strategy=strategy
    )
    restored = checkpoint.load(root, model=wrapped, optimizer=opt)
    state = checkpoint.full_state_dict(wrapped)
    return {
        "step": restored.step,
        "state": {k: v.detach().cpu() for k, v in state.items()},
        "devices": sorted({p.device.type for p in wrapped.parameters()}),
    }


# --- overhead at one rank -----------------------------------------------------------------------
def big_config(quick: bool) -> GPTConfig:
    """GPT-2 small's shape (124M parameters, vocabulary padded to 50304, sequence 1024), or
    a toy one with ``quick``."""
    if quick:
        return GPTConfig(vocab=64, layers=1, heads=2, width=32, seq_len=32)
    return GPTConfig(vocab=50304, layers=12, heads=12, width=768, seq_len=1024)


class _Runner:
    """One wrapped replica with its optimizer; ``step()`` runs forward, backward and the
    optimizer on the fixed batch and waits for the device."""

    def __init__(self, name: str, config: GPTConfig, dev: torch.device, mb: int) -> None:
        self.name = name
        self.dev = dev
        self.autocast = dev.type == "cuda"
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, config.vocab, (mb, config.seq_len + 1), generator=g)
        self.x, self.y = tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)
        model = GPT(config).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if name == "bare":
            self.model, self.opt = model, opt
        elif name in ("plait ddp", "plait zero1", "plait fsdp"):
            self.model, opt2 = plait.prepare(model, opt, strategy=name.removeprefix("plait "))
            assert opt2 is not None
            self.opt = opt2
        elif name == "plait tp":
            self.model, opt2 = plait.prepare(model, opt, strategy="tp", mesh=plait.Mesh(tp=1))
            assert opt2 is not None
            self.opt = opt2
        elif name == "plait pipeline":
            self.pipe = plait.PipelineParallel(
                model,
                group=plait.Mesh(pp=1).group("pp"),
                schedule="1f1b",
                microbatches=1,
                plan=plan_for(model, "pipeline"),
            )
            self.model, self.opt = self.pipe, torch.optim.AdamW(self.pipe.parameters(), lr=1e-4)
        elif name == "torch ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [dev.index] if dev.type == "cuda" else None
            self.model, self.opt = DistributedDataParallel(model, device_ids=ids), opt
        elif name == "torch fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(dev.type, (plait.world().size,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.model, self.opt = model, torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            raise ValueError(f"unknown overhead variant {name!r}; use one of {VARIANTS}")

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.autocast):
            if self.name == "plait pipeline":
                self.pipe.step(self.x, self.y)
            else:
                gpt_loss(self.model(self.x), self.y).backward()
        self.opt.step()
        sync(self.dev)


VARIANTS = (
    "bare",
    "plait ddp",
    "plait zero1",
    "plait fsdp",
    "plait tp",
    "plait pipeline",
    "torch ddp",
    "torch fsdp2",
)


def largest_microbatch(device: str, quick: bool, candidates: list[int]) -> dict[str, Any]:
    """The largest micro-batch (of ``candidates``) whose bare bf16 step peaks under 60% of
    the GPU's memory, leaving room for the other variants' states; 4 on the CPU."""
    dev = rank_device(device)
    config = big_config(quick)
    if dev.type != "cuda":
        return {"microbatch": 4, "tried": {}}
    total = torch.cuda.get_device_properties(dev).total_memory
    tried: dict[int, Any] = {}
    for mb in sorted(candidates, reverse=True):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        try:
            runner = _Runner("bare", config, dev, mb)
            runner.step()
            runner.step()
            peak = torch.cuda.max_memory_allocated(dev)
        except torch.OutOfMemoryError:
            tried[mb] = "out of memory"
            continue
        finally:
            runner = None  # type: ignore[assignment]
            torch.cuda.empty_cache()
        tried[mb] = peak
        if peak < 0.6 * total:
            return {"microbatch": mb, "tried": tried, "peak_bytes": peak, "total_bytes": total}
    return {"microbatch": 0, "tried": tried, "total_bytes": total}


def overhead(
    device: str, quick: bool, mb: int, warmup: int, steps: int, seconds: float = float("inf")
) -> dict[str, Any]:
    """Every variant of :data:`VARIANTS` at one rank: ``warmup`` steps each, then ``steps``
    rounds in which every variant takes one step, in a rotating order (noise hits all
    alike), fewer if the rounds would pass ``seconds`` from the start (one at least).
    Returns the step times (ms) per variant and the errors of variants that failed (a
    failed variant leaves the race; the others go on)."""
    start = time.perf_counter()
    dev = rank_device(device)
    config = big_config(quick)
    runners: list[_Runner] = []
    errors: dict[str, str] = {}
    for name in VARIANTS:
        try:
            runner = _Runner(name, config, dev, mb)
            for _ in range(warmup):
                runner.step()
            runners.append(runner)
        except Exception as exc:  # recorded per variant; the race goes on without it
            errors[name] = f"{type(exc).__name__}: {exc}"[:400]
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    rounds = 0
    for i in range(steps):
        if i and time.perf_counter() - start > seconds:
            break
        rounds += 1
        shift = i % max(1, len(runners))
        for runner in runners[shift:] + runners[:shift]:
            if runner.name in errors:
                continue
            try:
                t0 = time.perf_counter()
                runner.step()
                times[runner.name].append((time.perf_counter() - t0) * 1e3)
            except Exception as exc:
                errors[runner.name] = f"{type(exc).__name__}: {exc}"[:400]
    params = sum(p.numel() for p in GPT(config).parameters())
    runners.clear()  # give the GPU memory back to the ranks of the next section
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "median_ms": {k: statistics.median(v) for k, v in times.items() if v and k not in errors},
        "steps_ms": times,
        "errors": errors,
        "params": params,
        "microbatch": mb,
        "seq": config.seq_len,
        "autocast_bf16": dev.type == "cuda",
        "rounds": rounds,
        "rounds_asked": steps,
    }


# --- memory: measured against the plan ----------------------------------------------------------
MEMORY_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")


def memory(device: str, quick: bool, strategy: str, mb: int) -> dict[str, Any]:
    """Peak bytes this rank allocated on its GPU while building ``strategy`` over the pool
    and taking two fp32 Adam steps (``torch.cuda.max_memory_allocated`` above what was
    allocated before), beside the model-state bytes :func:`plait.plan.memory.measure`
    counts after them. On the CPU only the latter."""
    dev = rank_device(device)
    config = big_config(quick)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    model = GPT(config).to(dev)
    wrapped, opt = plait.prepare(
        model, torch.optim.Adam(model.parameters(), lr=1e-4), strategy=strategy
    )
    assert opt is not None
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab, (mb, config.seq_len + 1), generator=g).to(dev)
    for _ in range(2):
        opt.zero_grad(set_to_none=False)
        gpt_loss(wrapped(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
    sync(dev)
    from plait.plan import memory as plan_memory

    states = plan_memory.measure(wrapped, opt, world_size=plait.world().size)
    out: dict[str, Any] = {"states_bytes": states.total_bytes}
    if dev.type == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated(dev) - base
    del wrapped, opt, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out
