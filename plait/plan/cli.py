"""``plait plan``: ``memory`` (the ZeRO paper's model-state table) and ``layouts`` (the
layout search: ranked table, ``--json``, ``--explain``).

``plait/cli.py`` adds these to its ``plan`` subcommand with :func:`add_subcommands`::

    plait plan memory --params 7.5B -n 64
    plait plan layouts --model 1T --cluster a100 --nodes 384 --batch 3072 --explain
    plait plan layouts --model gpt --layers 4 --hidden 128 --heads 4 --cluster cpu --ranks 4 \\
        --batch 16 --seq 64 --precision fp32 --json -
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from plait.cli_args import NONNEGATIVE, POSITIVE, real
from plait.models.gpt import GPTConfig
from plait.plan import hardware, hf, memory
from plait.plan import model as spec
from plait.plan.fit import breakdown, format_fit, plot
from plait.plan.layout import Job
from plait.plan.report import explain, format_header, format_table, result_dict
from plait.plan.search import SearchSpace, search
from plait.plan.time import Overlap

LAYOUTS_HELP = """\
Rank every layout (dp x tp x pp x ep, schedule and chunks, micro-batch size, ZeRO stage,
recomputation, sequence parallelism) of a GPT on a cluster by predicted step time, keeping
those whose memory per rank fits. The model: --model 22B/175B/530B/1T (Korthikanti et al.'s
runs), --model gpt with --layers/--hidden/--heads/--vocab/--seq-len (plait's reference GPT
shape), or --params 7.5B (a GPT-3-shaped model of that size). The cluster: a100, h100
(nodes of 8 GPUs) or cpu (this machine: `plait bench calibrate -n <ranks>`'s measured
collectives, matmul and Adam rates on the transport the ranks use, else `plait bench comm`
results), each field overridable.
"""


FIT_HELP = """\
Will the model fit, and with which layout: for the fastest layouts that fit (and the
closest that do not), yes/no, the headroom per rank, and the breakdown (parameters,
gradients, optimizer states, activations, communication buffers; usable memory is the
device's less the fragmentation margin). Same arguments as `plait plan layouts`.
"""

DEFAULT_MAX_SEQ = 8192  # the default --seq for models with long position tables
MAX_PARAMS = 2e14  # a GPT-3-shaped model of this size has about 1000 layers
MAX_LAYERS = 1024


def parameter_count(text: str) -> float:
    """'7.5e9', '7500000000', '7.5B', '350M', '1.2T' -> a number of parameters."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(text[-1:].upper(), 1.0)
    try:
        value = float(text[:-1] if scale != 1.0 else text) * scale
        whole = round(value)  # 1.1B is 1100000000.0000002 in floating point
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(
            f"not a parameter count: {text!r} (write 7.5e9, 7500000000 or 7.5B)"
        ) from None
    if not 1 <= value <= MAX_PARAMS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is outside 1 to {MAX_PARAMS:.0e} parameters; the layout search "
            f"grows with the layer count a size implies (a GPT-3 shape of 2e14 has ~1000)"
        )
    return whole if abs(value - whole) < 1e-6 * max(1.0, value) else value


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers, got {text!r}"
        ) from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 0, got {text!r}")
    return values


def _words(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_parser(sub: Any) -> Any:
    """Add ``plan`` with :func:`add_subcommands` to the ``plait`` subparsers ``sub``;
    return the ``plan`` subparsers (for more subcommands, e.g. ``plait plan tensor``)."""
    plan_p = sub.add_parser("plan", help="plan before running")
    plan_sub = plan_p.add_subparsers(dest="what", required=True)
    add_subcommands(plan_sub)
    return plan_sub


def add_subcommands(plan_sub: Any) -> None:
    """Add ``memory`` and ``layouts`` (alias ``search``) to the ``plan`` subparsers."""
    mem_p = plan_sub.add_parser("memory", help="model-state memory per rank, per strategy")
    mem_p.add_argument("--params", type=parameter_count, required=True, help="e.g. 7.5e9")
    mem_p.add_argument("-n", "--nproc", type=POSITIVE, required=True, help="data-parallel ranks")
    mem_p.add_argument("--optimizer", default="adam", help="adam, adamw, sgd, sgd_momentum")
    mem_p.add_argument("--precision", default="mixed", help="mixed or fp32")
    mem_p.add_argument(
        "--shard-rounding", action="store_true", help="ceil(P/n) per rank instead of P/n"
    )
    mem_p.set_defaults(func=plan_memory)

    lay = plan_sub.add_parser(
        "layouts",
        aliases=["search"],
        help="rank parallel layouts by predicted step time",
        description=LAYOUTS_HELP,
    )
    _add_layout_args(lay)
    lay.set_defaults(func=plan_layouts)
    fit_p = plan_sub.add_parser(
        "fit",
        help="will it fit: yes/no per layout with the headroom and the memory breakdown",
        description=FIT_HELP,
    )
    _add_layout_args(fit_p)
    fit_p.set_defaults(func=plan_fit)


def _add_layout_args(lay: Any) -> None:
    """The model, cluster, job, search-space and output arguments of layouts and fit."""
    m = lay.add_argument_group("model")
    m.add_argument(
        "--model",
        default="gpt",
        help="gpt, 22B, 175B, 530B, 1T, a Hugging Face config.json (or its directory), or a "
        "preset: llama3-8b, llama3-70b, llama3-405b, mistral-7b, qwen2-7b, mixtral-8x7b, "
        "gpt2, gpt2-xl (default gpt)",
    )
    m.add_argument("--params", type=parameter_count, default=None, help="a GPT of this size")
    m.add_argument("--layers", type=POSITIVE, default=None)
    m.add_argument("--hidden", type=POSITIVE, default=None)
    m.add_argument("--heads", type=POSITIVE, default=None)
    m.add_argument("--vocab", type=POSITIVE, default=None)
    m.add_argument("--seq-len", type=POSITIVE, default=None, help="the position table's length")
    m.add_argument("--tied", action="store_true", help="head shares the token embedding")
    m.add_argument("--experts", type=NONNEGATIVE, default=0, help="MoE experts (0: dense)")
    m.add_argument("--top-k", type=POSITIVE, default=2)
    m.add_argument("--moe-every", type=POSITIVE, default=2)
    c = lay.add_argument_group("cluster")
    c.add_argument("--cluster", default="a100", help="a100, h100, h200, b200 or cpu")
    c.add_argument(
        "--gpus",
        default=None,
        metavar="NxKIND",
        help="e.g. 64xH100: N devices of a preset kind, 8 per node (sets --cluster, --nodes)",
    )
    c.add_argument("--nodes", type=POSITIVE, default=1)
    c.add_argument("--ranks", type=POSITIVE, default=4, help="cpu: ranks on this machine")
    c.add_argument("--devices-per-node", type=POSITIVE, default=None)
    c.add_argument("--peak-tflops", type=real(0, above=True), default=None)
    c.add_argument("--memory-gb", type=real(0, above=True), default=None)
    c.add_argument(
        "--efficiency", type=real(0, above=True), default=None, help="share of peak reached"
    )
    c.add_argument(
        "--intra-gbps", type=real(0, above=True), default=None, help="GB/s per device, NVLink"
    )
    c.add_argument(
        "--inter-gbps", type=real(0, above=True), default=None, help="GB/s per device, network"
    )
    c.add_argument("--bench-file", default=None, help="cpu: a `plait bench comm --json` file")
    c.add_argument(
        "--calibration",
        default=None,
        help="cpu: a `plait bench calibrate` file (default runs/plan_calibration_n<ranks>.json)",
    )
    j = lay.add_argument_group("job")
    j.add_argument(
        "--batch",
        type=POSITIVE,
        default=None,
        help="global batch in sequences (default 8 per device)",
    )
    j.add_argument(
        "--seq",
        type=POSITIVE,
        default=None,
        help=f"tokens per sequence (default the model's seq-len, at most {DEFAULT_MAX_SEQ})",
    )
    j.add_argument(
        "--attention",
        choices=["fused", "unfused"],
        default=None,
        help="fused (FlashAttention, SDPA with a causal mask: no s x s tensor kept, the "
        "masked half of the scores skipped; the default) or unfused (Megatron-LM 2021-2022's "
        "whole s x s square, the default for 22B..1T)",
    )
    j.add_argument("--precision", default="mixed", help="mixed or fp32")
    j.add_argument("--optimizer", default="adam")
    j.add_argument(
        "--whole-matrix",
        default=None,
        choices=["muon"],
        help="the blocks' hidden matrices take this whole-matrix optimizer, its state "
        "owned whole (plait.prepare(model, [muon, adamw], ...)); --optimizer the rest",
    )
    j.add_argument("--no-dropout", action="store_true", help="no dropout masks kept")
    s = lay.add_argument_group("search space (comma-separated; default: everything)")
    s.add_argument("--tp", type=_ints, default=None)
    s.add_argument("--pp", type=_ints, default=None)
    s.add_argument("--dp", type=_ints, default=None)
    s.add_argument("--ep", type=_ints, default=None)
    s.add_argument("--cp", type=_ints, default=None, help="context parallelism: ranks per sequence")
    s.add_argument(
        "--context", type=_words, default=("ring", "ulysses"), help="cp's attention: ring,ulysses"
    )
    s.add_argument("--microbatch", type=_ints, default=(1, 2, 4, 8))
    s.add_argument("--schedules", type=_words, default=("1f1b", "interleaved"))
    s.add_argument("--chunks", type=_ints, default=(2, 3, 4), help="v for interleaved")
    s.add_argument("--zero", type=_ints, default=(0, 1))
    s.add_argument("--recompute", type=_words, default=("none", "selective", "full"))
    s.add_argument("--sp", choices=["on", "off", "both"], default="both")
    s.add_argument("--tp-modes", type=_words, default=("1d",), help="1d,2d,2.5d,3d")
    s.add_argument("--dp-overlap", type=real(0), default=0.0, help="share of dp comm hidden")
    o = lay.add_argument_group("output")
    o.add_argument("--top", type=POSITIVE, default=10)
    o.add_argument("--json", default=None, metavar="PATH", help="write JSON ('-': stdout)")
    o.add_argument("--explain", action="store_true", help="every term of the best layout")
    o.add_argument("--plot", default=None, metavar="PNG", help="memory per rank, bar chart")


def plan_memory(args: argparse.Namespace) -> int:
    """Model-state GB per rank for each strategy (ZeRO paper, section 3 and Figure 1)."""

    try:
        estimates = memory.compare(
            num_params=args.params,
            world_size=args.nproc,
            optimizer=args.optimizer,
            precision=args.precision,
            shard_rounding=args.shard_rounding,
        )
    except ValueError as e:
        print(f"plait plan memory: {e}", file=sys.stderr)
        return 2
    print(
        f"plait plan memory: P = {estimates[0].num_params:,} parameters, n = {args.nproc} "
        f"ranks, {args.optimizer}, {args.precision} precision\n"
        "model state per rank (GB = 1e9 bytes, MB = 1e6); activations and buffers come on top"
    )
    print(memory.format_table(estimates))
    return 0


def _model(args: argparse.Namespace) -> Any:

    if args.params is not None:
        return spec.from_param_count(
            args.params,
            layers=args.layers,
            vocab=args.vocab or 51200,
            seq_len=args.seq_len or 2048,
        )
    if args.model in spec.PUBLISHED:
        return spec.published(args.model)
    if args.model != "gpt":
        if args.model in hf.PRESETS or args.model.endswith(".json") or "/" in args.model:
            return hf.load(args.model)
        raise ValueError(
            f"--model {args.model!r}: use gpt, {', '.join(spec.PUBLISHED)}, a preset "
            f"({', '.join(hf.PRESETS)}), a config.json path (or --params)"
        )

    d = GPTConfig()
    return spec.ModelSpec(
        layers=args.layers or d.layers,
        hidden=args.hidden or d.width,
        heads=args.heads or d.heads,
        vocab=args.vocab or d.vocab,
        seq_len=args.seq_len or d.seq_len,
        tied=args.tied,
        experts=args.experts,
        top_k=args.top_k,
        moe_every=args.moe_every,
    )


def _gpus(text: str) -> tuple[str, int]:
    """``"64xH100"`` -> ``("h100", 8)``: a preset kind and its nodes of 8 devices."""

    count, sep, kind = text.lower().partition("x")
    kinds = [k for k in hardware.PRESETS if k != "cpu"]
    if not sep or not count.isdigit() or kind not in kinds:
        raise ValueError(f"--gpus {text!r}: write N x KIND, e.g. 64xH100 (KIND: {kinds})")
    n = int(count)
    if n < 8 or n % 8:
        raise ValueError(f"--gpus {text!r}: presets are nodes of 8 devices; use a multiple of 8")
    return kind, n // 8


def _cluster(args: argparse.Namespace) -> Any:

    if getattr(args, "gpus", None):
        args.cluster, args.nodes = _gpus(args.gpus)
    if args.cluster == "cpu":
        cluster = hardware.local_cpu(
            ranks=args.ranks, bench_file=args.bench_file, calibration=args.calibration
        )
    else:
        cluster = hardware.preset(args.cluster, nodes=args.nodes)
    changes: dict[str, Any] = {}
    if args.devices_per_node is not None:
        changes["devices_per_node"] = args.devices_per_node
    if args.peak_tflops is not None:
        changes["peak_flops"] = args.peak_tflops * 1e12
    if args.memory_gb is not None:
        changes["memory_bytes"] = args.memory_gb * 1e9
    if args.efficiency is not None:
        changes["efficiency"] = args.efficiency
    if args.intra_gbps is not None:
        changes["intra_bandwidth"] = args.intra_gbps * 1e9
    if args.inter_gbps is not None:
        changes["inter_bandwidth"] = args.inter_gbps * 1e9
    return replace(cluster, **changes) if changes else cluster


def _check_size(model: Any) -> None:
    if model.layers > MAX_LAYERS:
        raise ValueError(
            f"the model has {model.layers} layers, more than {MAX_LAYERS} (the layout search "
            f"grows with the layer count); pass fewer --layers or a smaller --params"
        )


def _search(args: argparse.Namespace) -> Any:
    """The model, cluster and job of ``args``, searched; ValueError on bad input."""

    model = _model(args)
    _check_size(model)
    cluster = _cluster(args)
    hf_model = model.positions == "rope" or model.norm == "rmsnorm"
    # fused unless asked: a modern GPU stack's causal FlashAttention (plait's GPT calls SDPA
    # with is_causal=True, as Hugging Face's sdpa attention does); the published 22B..1T
    # presets keep Megatron-LM's unfused kernel of the runs they reproduce
    megatron = args.params is None and args.model in spec.PUBLISHED
    fused = args.attention == "fused" or (args.attention is None and not megatron)
    job = Job(
        global_batch=args.batch or 8 * cluster.devices,
        seq=args.seq or min(model.seq_len, DEFAULT_MAX_SEQ),
        precision=args.precision,
        optimizer=args.optimizer,
        whole_matrix=args.whole_matrix,
        dropout=not args.no_dropout and not hf_model,
        flash_attention=fused,
    )
    space = SearchSpace(
        tp=args.tp,
        pp=args.pp,
        dp=args.dp,
        ep=args.ep,
        cp=args.cp,
        contexts=args.context,
        microbatch=args.microbatch,
        schedules=args.schedules,
        chunks=args.chunks,
        zero=args.zero,
        recompute=args.recompute,
        sp={"on": (True,), "off": (False,), "both": (False, True)}[args.sp],
        tp_modes=args.tp_modes,
    )
    return search(model, job, cluster, space=space, overlap=Overlap(dp=args.dp_overlap))


def _write_json(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    text = json.dumps(payload, indent=1)
    if args.json == "-":
        print(text)
    else:
        with open(args.json, "w") as f:
            f.write(text + "\n")
        print(f"\nwrote {args.json}")


def _plot(args: argparse.Namespace, result: Any) -> None:

    shown = list(result.plans[: args.top]) + list(result.too_big[:2])
    rows = [breakdown(p, result.cluster) for p in shown]
    title = f"{result.model.name} on {result.cluster.name}: memory per rank"
    print(f"wrote {plot(rows, args.plot, title=title)}", file=sys.stderr)


def plan_layouts(args: argparse.Namespace) -> int:
    """``plait plan layouts``: the ranked table, then ``--explain``, ``--json``, ``--plot``."""

    try:
        result = _search(args)
        if args.plot:
            _plot(args, result)
    except ValueError as e:
        print(f"plait plan layouts: {e}", file=sys.stderr)
        return 2
    if args.json != "-":
        print(format_table(result, top=args.top))
        if args.explain and result.best is not None:
            print("\n" + explain(result.best, result.model, result.job, result.cluster))
    if args.json:
        _write_json(args, result_dict(result, top=args.top))
    return 0 if result.plans else 1


def plan_fit(args: argparse.Namespace) -> int:
    """``plait plan fit``: yes/no per layout with the headroom (the fastest that fit, then
    the fastest that do not), the memory breakdown; ``--json``, ``--plot``."""

    try:
        result = _search(args)
        if args.plot:
            _plot(args, result)
    except ValueError as e:
        print(f"plait plan fit: {e}", file=sys.stderr)
        return 2
    rows = [breakdown(p, result.cluster) for p in result.plans[: args.top]]
    rows += [breakdown(p, result.cluster) for p in result.too_big[: max(1, args.top // 3)]]
    if args.json != "-":
        print(format_header(result.model, result.job, result.cluster) + "\n")
        verdict = "yes" if result.plans else "no"
        print(
            f"fits: {verdict} ({len(result.plans)} layouts fit, {len(result.too_big)}+ do not, "
            f"{result.refused} refused)\n"
        )
        print(format_fit(rows))
    if args.json:
        _write_json(
            args,
            {
                "fits": bool(result.plans),
                "fit": len(result.plans),
                "refused": result.refused,
                "layouts": [r.to_dict() for r in rows],
            },
        )
    return 0 if result.plans else 1


def default_subcommand(argv: list[str]) -> list[str]:
    """``plait plan --model X ...`` means ``plait plan layouts --model X ...``."""
    if (
        len(argv) >= 2
        and argv[0] == "plan"
        and argv[1].startswith("-")
        and argv[1]
        not in (
            "-h",
            "--help",
        )
    ):
        return ["plan", "layouts", *argv[1:]]
    return argv


__all__ = [
    "add_parser",
    "add_subcommands",
    "default_subcommand",
    "parameter_count",
    "plan_fit",
    "plan_layouts",
    "plan_memory",
]
