"""plait's pipeline against torch.distributed.pipelining on the same Hugging Face Llama.

    .venv/bin/python benchmarks/hf_pipeline.py                  # pp 2, 1f1b, a minute or two
    .venv/bin/python benchmarks/hf_pipeline.py --family mixtral --name hf_pipeline_mixtral
    .venv/bin/python benchmarks/hf_pipeline.py --quick --out /tmp/pp   # smoke test

Local ranks (``plait.RankPool``, gloo on loopback), one intra-op thread per rank. The model
is a ``transformers.LlamaForCausalLM`` built from a config (default 4 layers, hidden 256,
8 heads, 4 key/value heads, MLP 512, vocabulary 512, sequence 128, fp32, eager attention,
random init), a global batch of 16 sequences in m = 8 micro-batches, Adam. Variants:

- ``plait 1f1b``: ``plait.prepare(model, opt, strategy="pipeline", mesh=Mesh(pp=p),
  schedule="1f1b", microbatches=m)``: the model handed over whole, cut by its plan
  (``plait.models.llama.pipeline_plan``), rotary embeddings and the causal mask recomputed on
  every stage, Hugging Face's loss with ``num_items_in_batch``;
- ``torch Schedule1F1B``: ``PipelineStage`` over the *same* stage modules (the plan's
  :class:`~plait.strategies.pipeline.Stage`, same cut), explicit shapes, ``Schedule1F1B``
  with Hugging Face's loss (mean per micro-batch, ``scale_grads=True``);
- with ``--family mixtral`` (a ``MixtralForCausalLM`` of 4 experts, top 2, MLP 512 each,
  no load-balancing loss in the two above) also ``plait 1f1b +aux``: the load-balancing loss
  on, kept exactly by the statistics pass (one forward without autograd per step), the
  cost of that pass read as ``+aux / plait``.

Step time: warm-up steps, then the variants take turns step by step (rotating order); a
step is ``zero_grad`` + the schedule's step + ``optimizer.step()`` after a barrier, its time
the slowest rank's; the table shows medians and plait / torch. Fairness: each variant's
first loss equals a one-process run's (relative 1e-4). Writes ``<out>/<name>.json`` and
``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import plait
from plait import comm


def _model(args: dict[str, Any], aux: bool = False) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    if args["family"] == "mixtral":
        mixtral = MixtralConfig(
            vocab_size=args["vocab"], hidden_size=args["hidden"],
            intermediate_size=2 * args["hidden"], num_hidden_layers=args["layers"],
            num_attention_heads=args["heads"], num_key_value_heads=max(1, args["heads"] // 2),
            max_position_embeddings=args["seq"], num_local_experts=4, num_experts_per_tok=2,
            output_router_logits=aux, attn_implementation="eager",
        )  # fmt: skip
        torch.manual_seed(0)
        return MixtralForCausalLM(mixtral)
    cfg = LlamaConfig(
        vocab_size=args["vocab"],
        hidden_size=args["hidden"],
        intermediate_size=2 * args["hidden"],
        num_hidden_layers=args["layers"],
        num_attention_heads=args["heads"],
        num_key_value_heads=max(1, args["heads"] // 2),
        max_position_embeddings=args["seq"],
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _batch(step: int, args: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, args["vocab"], (args["batch"], args["seq"]), generator=g)
    return ids, ids.clone()


def _plait(args: dict[str, Any], p: int, aux: bool = False) -> Any:
    model = _model(args, aux)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    pipe, popt = plait.prepare(
        model, opt, strategy="pipeline", mesh=plait.Mesh(pp=p),
        schedule="1f1b", microbatches=args["m"],
    )  # fmt: skip
    assert popt is not None

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        popt.zero_grad()
        loss = pipe.step(x, y)
        popt.step()
        return float(loss)

    return step


def _torch(args: dict[str, Any], p: int, rank: int) -> Any:
    from torch.distributed import pipelining as tpp

    from plait.models.plans import plan_for
    from plait.strategies.pipeline import Stage, partition

    model = _model(args)
    plan = plan_for(model, "pipeline")
    layers = list(plan.layers)
    a, b = partition(layers, p).bounds[rank]
    stage = Stage(layers[a:b], rank, context=plan.context, context_modules=plan.context_modules)
    mb, seq, hidden = args["batch"] // args["m"], args["seq"], args["hidden"]
    ids = torch.zeros(mb, seq, dtype=torch.long)
    act = torch.zeros(mb, seq, hidden, requires_grad=True)
    logits = torch.zeros(mb, seq, args["vocab"], requires_grad=True)
    pstage = tpp.PipelineStage(
        stage, rank, p, torch.device("cpu"),
        input_args=(ids if rank == 0 else act,),
        output_args=(logits if rank == p - 1 else act,),
    )  # fmt: skip
    vocab = args["vocab"]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return model.loss_function(logits=out, labels=target, vocab_size=vocab)  # type: ignore[no-any-return]

    sched = tpp.Schedule1F1B(pstage, n_microbatches=args["m"], loss_fn=loss_fn)
    opt = torch.optim.Adam(stage.parameters(), lr=1e-3)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        opt.step()
        value = torch.stack(losses).mean().detach().reshape(1) if losses else torch.zeros(1)
        comm.broadcast(value, p - 1, group=plait.world())
        return float(value)

    return step


def run_rank(args: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    world = plait.world()
    p = world.size
    variants = {"plait 1f1b": _plait(args, p), "torch Schedule1F1B": _torch(args, p, world.rank)}
    if args["family"] == "mixtral":
        variants["plait 1f1b +aux"] = _plait(args, p, aux=True)
    x, y = _batch(0, args)
    want = {}
    with torch.no_grad():
        for aux in (False, True):
            want[aux] = float(_model(args, aux)(input_ids=x, labels=y).loss)
    for name, step in variants.items():
        got = step(x, y)
        want_loss = want["+aux" in name]
        if abs(got - want_loss) > 1e-4 * abs(want_loss):
            raise AssertionError(f"{name}: first loss {got} differs from one process's {want_loss}")
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args["warmup"] + args["steps"]):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            x, y = _batch(i + 1, args)
            comm.barrier(group=world)
            t0 = time.perf_counter()
            variants[name](x, y)
            dt = torch.tensor([time.perf_counter() - t0])
            comm.all_reduce(dt, "max", group=world)
            if i >= args["warmup"]:
                times[name].append(float(dt))
    return {"times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--family", choices=("llama", "mixtral"), default="llama")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="hf_pipeline")
    args = vars(parser.parse_args())
    if args["quick"]:
        args |= {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq": 16, "steps": 2}
    pool = plait.RankPool(args["pp"], timeout=600)
    try:
        results = pool.run(run_rank, args, timeout=3600)
    finally:
        pool.close()
    med = {n: statistics.median(v) for n, v in results[0]["times"].items()}
    ratio = med["plait 1f1b"] / med["torch Schedule1F1B"]
    out = Path(args["out"])
    out.mkdir(parents=True, exist_ok=True)
    row = {"pp": args["pp"], "m": args["m"], **{f"{k} ms": 1e3 * v for k, v in med.items()}}
    row["plait / torch"] = ratio
    head = "| model | pp | m | plait 1f1b (ms) | torch Schedule1F1B (ms) | plait / torch |"
    cells = (
        f"| {args['family']} | {args['pp']} | {args['m']} | {1e3 * med['plait 1f1b']:.1f} | "
        f"{1e3 * med['torch Schedule1F1B']:.1f} | {ratio:.2f} |"
    )
    if "plait 1f1b +aux" in med:
        row["+aux / plait"] = med["plait 1f1b +aux"] / med["plait 1f1b"]
        head += " plait 1f1b +aux (ms) | +aux / plait |"
        cells += f" {1e3 * med['plait 1f1b +aux']:.1f} | {row['+aux / plait']:.2f} |"
    (out / f"{args['name']}.json").write_text(json.dumps({"args": args, "row": row}, indent=1))
    lines = [head, "|" + " --- |" * head.count(" |"), cells]
    (out / f"{args['name']}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
