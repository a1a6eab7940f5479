"""plait's DistributedDataParallel against torch.nn.parallel.DistributedDataParallel.

    .venv/bin/python benchmarks/ddp.py            # worlds 2 and 4, MLP and transformer, ~2-3 min
    .venv/bin/python benchmarks/ddp.py --quick    # MLP, world 2, few steps: a smoke test

Local ranks (``plait.RankPool``, gloo on loopback), one intra-op thread per rank
(``torch.set_num_threads(1)`` in the rank function, for both sides). Two models:

- ``mlp``: 1024 -> 1024 -> 1024 -> 768 -> 10 (2.9M parameters), batch 64 per rank;
- ``transformer``: embedding (vocabulary 512) + learned positions, 4 ``nn.TransformerEncoder``
  layers (d_model 192, 4 heads, feed-forward 768, no dropout) and an output head (2.0M
  parameters), sequence 32, batch 16 per rank, cross-entropy over the next-token logits.

For each (world size, model, bucket size of 1 and 25 MiB) the variants are built on every
rank from the same seed: ``plait.DistributedDataParallel(model, bucket_mb=B, algorithm=A)``
for each ``A`` of ``--algorithms`` (default ``auto,naive,ring``; in DDP ``auto`` is plait's
shared-memory all-reduce when every rank shares this host, else the backend's own, started
without plait's communication thread), and ``torch
DistributedDataParallel(model, bucket_cap_mb=B)``, each with its own SGD optimizer (lr
0.01). ``naive`` is there because it was plait's fastest Python algorithm in a trial of
every algorithm over all eight configurations (``--algorithms
auto,native,naive,ring,tree,halving_doubling`` repeats it), ``ring`` as the usual reference.

Step time. A few warm-up steps (they include both sides' bucket rebuild after the first
step), then the variants take turns step by step, in a rotating order (A B C, B C A, C A B,
...) so machine noise hits all alike. A timed step is ``zero_grad`` + forward + loss +
``backward`` + ``optimizer.step()``, preceded by ``torch.distributed.barrier()``. The step
time is the slowest rank's (an element-wise all-reduce MAX of the ranks' times at the end),
and the table shows medians. After the first step, every plait variant's parameters are
checked against torch's (``allclose``, rtol = atol = 1e-5) so both train the same model.

Hidden communication. A separate, fresh set of variants runs a few more interleaved steps
with a :class:`plait.trace.Tracer` per variant and rank: forward in ``span("forward")``,
``loss.backward()`` in ``span("backward")``, for both sides alike. Communication spans: plait
gets ``tracer=`` (only its bucket all-reduce spans, stream "comm", are kept); torch gets a
``register_comm_hook`` that opens a "comm" span when a bucket's all-reduce is launched
(divide by the world size, ``dist.all_reduce(buffer, async_op=True).get_future()``) and
closes it in the future's ``.then``. A span thus runs from launch (including any wait behind
earlier buckets) to completion, on both sides. Both DDPs wait for every bucket *inside*
``loss.backward()`` (in autograd's final callback), so "backward" contains all communication
by construction; the figure reported is therefore the share of communication time that
overlaps *backward computation*: from the start of ``loss.backward()`` to the moment the
last parameter's gradient was accumulated (a ``post_accumulate_grad`` hook on every
parameter, the same for both). ``plait.trace.overlap_report`` computes it (span "backward
compute"); the JSON also keeps the fraction against the whole ``loss.backward()`` span.

Writes ``benchmarks/results/ddp.json`` (raw numbers, every step) and
``benchmarks/results/ddp.md`` (the table); ``--chrome DIR`` also writes a Chrome/Perfetto
trace per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402

import plait  # noqa: E402
from plait.trace import Span, Tracer, overlap_report, write_chrome  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
MODELS = ("mlp", "transformer")
BUCKETS_MB = (1.0, 25.0)
LR = 0.01
SEED = 1234
TORCH = "torch"

# --- models and data ---------------------------------------------------------------------
MLP_SIZES = (1024, 1024, 1024, 768, 10)
MLP_BATCH = 64
VOCAB, D_MODEL, HEADS, LAYERS, FF, SEQ, TF_BATCH = 512, 192, 4, 4, 768, 32, 16


def mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(MLP_SIZES, MLP_SIZES[1:], strict=False)):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(MLP_SIZES) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class TinyTransformer(nn.Module):
    """Token embedding + learned positions, a TransformerEncoder, a vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.02)
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.encoder(h))


def build_model(name: str) -> nn.Module:
    torch.manual_seed(SEED)  # the same initial weights for every variant (and rank)
    return mlp() if name == "mlp" else TinyTransformer()


def make_batches(name: str, rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` fixed batches for this rank (each rank its own share of the data)."""
    g = torch.Generator().manual_seed(SEED + 1 + rank)
    batches = []
    for _ in range(count):
        if name == "mlp":
            x = torch.randn(MLP_BATCH, MLP_SIZES[0], generator=g)
            batches.append((x, torch.randint(0, MLP_SIZES[-1], (MLP_BATCH,), generator=g)))
            continue
        tokens = torch.randint(0, VOCAB, (TF_BATCH, SEQ + 1), generator=g)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def count_params(name: str) -> int:
    return sum(p.numel() for p in build_model(name).parameters())


# --- variants ----------------------------------------------------------------------------
class GradProbe:
    """When the last parameter's gradient was accumulated: the end of backward compute."""

    def __init__(self, module: nn.Module) -> None:
        self.last_ns = 0
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p: torch.Tensor) -> None:
        self.last_ns = time.perf_counter_ns()


class Variant:
    """One wrapped replica, its optimizer and (when tracing) its tracer."""

    def __init__(
        self, name: str, model_name: str, bucket_mb: float, tracer: Tracer | None = None
    ) -> None:
        self.name = name
        self.tracer = tracer
        self.comm_tracer: Tracer | None = None
        inner = build_model(model_name)
        # before wrapping, so that on both sides it fires before the DDP marks the gradient
        # ready (plait's hook is a later post-accumulate-grad hook, torch's a node post-hook)
        self.probe = GradProbe(inner) if tracer is not None else None
        self.wrapped: nn.Module
        if name == TORCH:
            ddp = TorchDDP(inner, bucket_cap_mb=bucket_mb)
            if tracer is not None:
                self.comm_tracer = tracer
                ddp.register_comm_hook(tracer, traced_allreduce_hook)
            self.wrapped = ddp
        else:
            algorithm = name.removeprefix("plait ")
            # "<algorithm>+nocheck": without the non-finite gradient check (its cost)
            check = None if algorithm.endswith("+nocheck") else "raise"
            algorithm = algorithm.removesuffix("+nocheck")
            if tracer is not None:  # a tracer of its own: keep only its bucket spans
                self.comm_tracer = Tracer(rank=tracer.rank)
            self.wrapped = plait.DistributedDataParallel(
                inner,
                bucket_mb=bucket_mb,
                algorithm=algorithm,
                check_finite=check,
                tracer=self.comm_tracer,
            )
        self.inner = inner
        self.optimizer = torch.optim.SGD(inner.parameters(), lr=LR)
        self.extra_spans: list[Span] = []

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        tracer = self.tracer
        if tracer is None:
            self.optimizer.zero_grad()
            loss = loss_of(self.wrapped(x), y)
            loss.backward()
            self.optimizer.step()
            return
        assert self.probe is not None
        self.optimizer.zero_grad()
        with tracer.span("forward"):
            loss = loss_of(self.wrapped(x), y)
        start = time.perf_counter_ns()
        with tracer.span("backward"):
            loss.backward()
        self.extra_spans.append(
            Span("backward compute", "compute", start, self.probe.last_ns, tracer.rank)
        )
        with tracer.span("optimizer"):
            self.optimizer.step()

    def spans(self) -> list[Span]:
        """This rank's spans: compute spans of the step, comm spans of the buckets."""
        assert self.tracer is not None and self.comm_tracer is not None
        ours = [s for s in self.tracer.spans() if s.stream != "comm"]
        comm = [s for s in self.comm_tracer.spans() if s.stream == "comm"]
        return sorted(ours + comm + self.extra_spans, key=lambda s: s.start_ns)

    def clear_trace(self) -> None:
        assert self.tracer is not None and self.comm_tracer is not None
        self.tracer.clear()
        self.comm_tracer.clear()
        self.extra_spans.clear()


def traced_allreduce_hook(
    tracer: Tracer, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch DDP's default all-reduce (divide, then sum), with a "comm" span around it."""
    buf = bucket.buffer()
    token = tracer.begin(
        f"all_reduce bucket {bucket.index()}",
        stream="comm",
        bytes=buf.numel() * buf.element_size(),
    )
    buf.div_(dist.get_world_size())
    future = dist.all_reduce(buf, async_op=True).get_future()

    def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        tracer.end(token)
        return f.value()[0]

    return future.then(done)


# torch checks the hook's annotations as objects; `from __future__ import annotations` made
# them strings, so give them back as objects
traced_allreduce_hook.__annotations__.update(
    bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]}
)


def run_interleaved(
    variants: list[Variant],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    first: int = 0,
    on_step: Callable[[int], None] | None = None,
) -> dict[str, list[float]]:
    """``steps`` rounds; in each, every variant takes one step, in a rotating order."""
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for i in range(first, first + steps):
        shift = i % len(variants)
        for v in variants[shift:] + variants[:shift]:
            batch = batches[i % len(batches)]
            dist.barrier()
            t0 = time.perf_counter()
            v.step(batch)
            times[v.name].append(time.perf_counter() - t0)
        if on_step is not None:
            on_step(i)
    return times


def max_param_diff(a: nn.Module, b: nn.Module) -> tuple[float, bool]:
    diff, close = 0.0, True
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        diff = max(diff, (p.detach() - q.detach()).abs().max().item())
        close = close and torch.allclose(p, q, rtol=1e-5, atol=1e-5)
    return diff, close


# --- the rank function -------------------------------------------------------------------
def bench_rank(
    model_name: str,
    bucket_mb: float,
    algorithms: list[str],
    warmup: int,
    steps: int,
    trace_steps: int,
) -> dict[str, Any]:
    """Runs on every rank: timed steps, then traced steps; rank 0's result is used."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    names = [f"plait {a}" for a in algorithms] + [TORCH]
    batches = make_batches(model_name, rank, 4)

    # timed steps
    variants = [Variant(n, model_name, bucket_mb) for n in names]
    check: dict[str, dict[str, Any]] = {}

    def after_step(i: int) -> None:
        if i != 0:
            return
        reference = variants[-1].inner
        for v in variants[:-1]:
            diff, close = max_param_diff(v.inner, reference)
            flags = torch.tensor([0.0 if close else 1.0, diff])
            dist.all_reduce(flags, dist.ReduceOp.MAX)
            check[v.name] = {"max_abs_diff": flags[1].item(), "allclose": flags[0].item() == 0}
            if flags[0].item():
                raise AssertionError(
                    f"{v.name} and torch DDP disagree after one step (max |diff| "
                    f"{flags[1].item():.3g}): the comparison would not be like for like"
                )

    run_interleaved(variants, batches, warmup, on_step=after_step)
    times = run_interleaved(variants, batches, steps, first=warmup)
    slowest: dict[str, list[float]] = {}
    for name, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(t, dist.ReduceOp.MAX)
        slowest[name] = [x * 1e3 for x in t.tolist()]

    # traced steps, on fresh replicas
    traced = [Variant(n, model_name, bucket_mb, tracer=Tracer(rank=rank)) for n in names]
    run_interleaved(traced, batches, 2)
    for v in traced:
        v.clear_trace()
    run_interleaved(traced, batches, trace_steps, first=2)
    return {
        "steps_ms": slowest,
        "param_check": check,
        "spans": {v.name: v.spans() for v in traced},
    }


# --- the parent --------------------------------------------------------------------------
def summarize(
    world: int, model_name: str, bucket_mb: float, per_rank: list[dict[str, Any]]
) -> dict[str, Any]:
    first = per_rank[0]
    variants: dict[str, Any] = {}
    for name, steps_ms in first["steps_ms"].items():
        spans = [s for r in per_rank for s in r["spans"][name]]
        compute = overlap_report(spans, compute_names=("backward compute",))
        whole = overlap_report(spans, compute_names=("backward",))
        n_steps = max(1, sum(1 for s in spans if s.name == "backward") // world)
        variants[name] = {
            "median_ms": statistics.median(steps_ms),
            "steps_ms": steps_ms,
            "bucket_bytes": _bucket_bytes(first["spans"][name]),
            "hidden_fraction": compute.hidden_fraction,
            "hidden_fraction_whole_backward": whole.hidden_fraction,
            "comm_ms_per_step": compute.comm_s * 1e3 / n_steps,
            "exposed_ms_per_step": compute.exposed_s * 1e3 / n_steps,
            "backward_compute_ms_per_step": _mean_ms(spans, "backward compute", world),
            "backward_ms_per_step": _mean_ms(spans, "backward", world),
            "forward_ms_per_step": _mean_ms(spans, "forward", world),
            "optimizer_ms_per_step": _mean_ms(spans, "optimizer", world),
        }
    return {
        "world": world,
        "model": model_name,
        "params": count_params(model_name),
        "bucket_mb": bucket_mb,
        "param_check": first["param_check"],
        "variants": variants,
    }


def _bucket_bytes(spans: list[Span]) -> list[int]:
    """Sizes of the buckets all-reduced in one traced step (between two backward spans)."""
    starts = [s.start_ns for s in spans if s.name == "backward"]
    end = starts[1] if len(starts) > 1 else None
    return [
        int(str(s.args.get("bytes", 0)))
        for s in spans
        if s.stream == "comm" and s.start_ns >= starts[0] and (end is None or s.start_ns < end)
    ]


def _mean_ms(spans: list[Span], name: str, world: int) -> float:
    durations = [s.duration_ns for s in spans if s.name == name]
    return statistics.mean(durations) / 1e6 if durations else 0.0


def labelled_spans(per_rank: list[dict[str, Any]]) -> list[Span]:
    """Every rank's spans of every variant, named "variant: span" for the viewer."""
    return [
        Span(f"{name}: {s.name}", s.stream, s.start_ns, s.end_ns, s.rank, s.args)
        for r in per_rank
        for name, spans in r["spans"].items()
        for s in spans
    ]


def progress_line(res: dict[str, Any]) -> str:
    v = res["variants"]
    torch_ms = v[TORCH]["median_ms"]
    parts = []
    for name, r in v.items():
        ratio = "" if name == TORCH else f" ({r['median_ms'] / torch_ms:.2f}x)"
        parts.append(
            f"{name} {r['median_ms']:.1f} ms{ratio} hidden {r['hidden_fraction']:.0%} "
            f"[{len(r['bucket_bytes'])} buckets]"
        )
    return (
        f"world {res['world']} {res['model']:<11} {res['params'] / 1e6:.1f}M "
        f"bucket {res['bucket_mb']:g} MB: " + "; ".join(parts)
    )


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "| world | model | params | bucket MB | plait algorithm | plait step ms | torch step ms "
        "| ratio plait/torch | plait hidden % | torch hidden % |",
        "|---" * 10 + "|",
    ]
    for res in results["configs"]:
        v = res["variants"]
        t = v[TORCH]
        for name, r in v.items():
            if name == TORCH:
                continue
            lines.append(
                f"| {res['world']} | {res['model']} | {res['params'] / 1e6:.2f}M "
                f"| {res['bucket_mb']:g} | {name.removeprefix('plait ')} "
                f"| {r['median_ms']:.1f} | {t['median_ms']:.1f} "
                f"| {r['median_ms'] / t['median_ms']:.2f}x "
                f"| {r['hidden_fraction']:.0%} | {t['hidden_fraction']:.0%} |"
            )
    a = results["args"]
    steps = {res["world"]: len(res["variants"][TORCH]["steps_ms"]) for res in results["configs"]}
    diff = max(
        (c["max_abs_diff"] for res in results["configs"] for c in res["param_check"].values()),
        default=0.0,
    )
    per_world = ", ".join(f"{n} at world {w}" for w, n in steps.items())
    lines.append(
        f"\nMedians of the slowest rank's step time over interleaved steps ({per_world}) "
        f"after {a['warmup']} warm-up steps; gloo on loopback, {results['cores']} cores, "
        f"1 intra-op thread per rank, torch {results['torch']}. Hidden % = share of the "
        f"bucket all-reduce time that overlaps backward computation (until the last gradient "
        f"is accumulated), over {a['trace_steps']} traced steps. After one step every plait "
        f"variant's parameters match torch's (largest difference {diff:.2g}). Raw numbers: "
        f"`benchmarks/results/ddp.json`."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--buckets", default=",".join(f"{b:g}" for b in BUCKETS_MB))
    parser.add_argument(
        "--algorithms", default="auto,naive,ring", help="plait all-reduce algorithms to compare"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--steps-world4", type=int, default=20)
    parser.add_argument("--trace-steps", type=int, default=5)
    parser.add_argument("--chrome", type=Path, help="write a Chrome trace per configuration")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--quick", action="store_true", help="MLP, world 2, few steps")
    args = parser.parse_args()
    if args.quick:
        args.worlds, args.models = "2", "mlp"
        args.warmup, args.steps, args.trace_steps = 2, 4, 2
    algorithms = args.algorithms.split(",")
    env = {"PLAIT_TUNE_FILE": str(Path(tempfile.mkdtemp()) / "none.json")}  # auto: the rule
    results: dict[str, Any] = {
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "args": {
            "warmup": args.warmup,
            "steps": args.steps,
            "steps_world4": args.steps_world4,
            "trace_steps": args.trace_steps,
            "algorithms": algorithms,
            "quick": args.quick,
        },
        "configs": [],
    }
    started = time.perf_counter()
    for world in [int(w) for w in args.worlds.split(",")]:
        steps = args.steps if world < 4 or args.quick else args.steps_world4
        with plait.RankPool(world, env=env) as pool:
            for model_name in args.models.split(","):
                for bucket_mb in [float(b) for b in args.buckets.split(",")]:
                    per_rank = pool.run(
                        bench_rank,
                        model_name,
                        bucket_mb,
                        algorithms,
                        args.warmup,
                        steps,
                        args.trace_steps,
                        timeout=1200,
                    )
                    res = summarize(world, model_name, bucket_mb, per_rank)
                    results["configs"].append(res)
                    print(progress_line(res), flush=True)
                    if args.chrome is not None:
                        path = args.chrome / f"ddp_w{world}_{model_name}_b{bucket_mb:g}.json"
                        write_chrome(path, [labelled_spans(per_rank)])
    results["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ddp.json").write_text(json.dumps(results, indent=1))
    md = markdown(results)
    (args.out / "ddp.md").write_text(md)
    print(md)
    print(f"{results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
