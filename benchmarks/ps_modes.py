"""The parameter server's update modes on the demo model: a convergence study to rerun.

    .venv/bin/python benchmarks/ps_modes.py                      # 9 runs, about 3 min
    .venv/bin/python benchmarks/ps_modes.py --epochs 2 --out /tmp/ps   # smoke test

Trains ``plait demo``'s CNN on the scikit-learn digits (``plait.demo.digits.run``, SGD lr 0.05
momentum 0.9, global batch 63, ``--epochs`` epochs, test accuracy measured 4 times per
epoch on the lead worker's current parameters) with 1 server + 3 workers under

- ``sync``: every version averages the three workers' gradients (= DDP on the global batch),
- ``async``: every push applied at once; the demo steps a push with lr 0.05/3 (each push is
  the gradient of 21 samples and becomes an update of its own, so lr/3 keeps the step per
  sample of sync) and the server divides a push of staleness tau > 1 by tau (one extra run
  steps every push with lr 0.05, not divided by its staleness, and shows what happens
  without either),
- ``ssp`` with staleness bound 2 (scaled as async),
- ``sync`` with 1 backup worker (a version goes on after 2 of 3 gradients),

each once as is and once with worker rank 3 slowed 3x (``--slow-worker 3:3``: it sleeps
twice its compute time every step), and next to plait DDP on 3 ranks with the same global
batch. One run each: this is a convergence study, not a timing benchmark; wall times on
this shared 2-core machine vary by 10-20% from run to run.

Writes ``<out>/ps_modes.json`` (every run's history and statistics), ``<out>/ps_modes.md``
(the table: time and updates to 95% test accuracy, final accuracy, when the lead worker
and when all workers were done, server updates, mean staleness, dropped gradients, ssp
waits; accuracy is the lead worker's, rank 1, never the slowed one) and
``<out>/ps_modes.png`` (test accuracy against wall time and against updates). ``--out``
defaults to ``benchmarks/results``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from plait.demo.digits import DemoConfig, run

TARGET = 0.95


def configs(epochs: int) -> list[tuple[str, DemoConfig]]:
    base: dict[str, Any] = {"epochs": epochs, "batch_size": 63, "evals_per_epoch": 4, "name": ""}
    runs = [("ddp", DemoConfig(world_size=3, strategy="ddp", **base))]
    base_lr = DemoConfig().lr
    per_push: dict[str, Any] = {}  # the demo steps a push with lr / 3 (plait.demo.digits.push_lr)
    modes: list[tuple[str, dict[str, Any]]] = [
        ("sync", {"ps_mode": "sync"}),
        ("async lr/3 /tau", {"ps_mode": "async", **per_push}),
        ("ssp s=2 lr/3 /tau", {"ps_mode": "ssp", "staleness": 2, **per_push}),
        ("sync +1 backup", {"ps_mode": "sync", "backup_workers": 1}),
    ]
    unscaled = DemoConfig(
        world_size=4,
        strategy="ps",
        ps_mode="async",
        lr=3 * base_lr,
        staleness_aware=False,
        **base,
    )  # fmt: skip  (3 x: lr per push = base_lr)
    runs.append((f"async lr {base_lr:g} per push (not scaled)", unscaled))
    for slow in (None, (3, 3.0)):
        for label, extra in modes:
            name = label + (" / rank 3 slowed 3x" if slow else "")
            config = DemoConfig(world_size=4, strategy="ps", slow_worker=slow, **base, **extra)
            runs.append((name, config))
    return runs


def first_reaching(history: list[dict[str, Any]], key: str) -> float | None:
    for h in history:
        if h["test_accuracy"] >= TARGET:
            return float(h[key])
    return None


def summarize(label: str, report: Any) -> dict[str, Any]:
    servers = report.ps.get("servers", []) if report.ps else []
    server = servers[0] if servers else {}
    return {
        "run": label,
        "final_accuracy": report.test_accuracy,
        "seconds_to_95": first_reaching(report.history, "elapsed_s"),
        "updates_to_95": first_reaching(report.history, "updates"),
        "train_seconds": report.history[-1]["elapsed_s"],
        "job_seconds": server.get("seconds", report.history[-1]["elapsed_s"]),
        "updates": server.get("updates", report.history[-1]["updates"]),
        "mean_staleness": server.get("mean_staleness", 0.0),
        "dropped": server.get("dropped", 0),
        "ssp_waits": server.get("ssp_waits", 0),
        "history": report.history,
        "ps": report.ps,
    }


def table(rows: list[dict[str, Any]], epochs: int) -> str:
    def fmt(v: float | None, spec: str) -> str:
        return "not reached" if v is None else format(v, spec)

    lines = [
        f"1 server + 3 workers (DDP: 3 ranks), global batch 63, {epochs} epochs, "
        f"time and updates until test accuracy first reached {TARGET:.0%}.",
        "",
        "| run | time to 95% (s) | updates to 95% | final accuracy | lead worker done (s) "
        "| all done (s) | updates | mean staleness | dropped | ssp waits |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['run']} | {fmt(r['seconds_to_95'], '.1f')} | "
            f"{fmt(r['updates_to_95'], '.0f')} | {r['final_accuracy']:.1%} | "
            f"{r['train_seconds']:.1f} | {r['job_seconds']:.1f} | {r['updates']} | "
            f"{r['mean_staleness']:.2f} | "
            f"{r['dropped']} | {r['ssp_waits']} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_updates) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for r in rows:
        style = "--" if "slowed" in r["run"] else "-"
        if r["run"] == "ddp":
            style = ":"
        h = r["history"]
        acc = [p["test_accuracy"] for p in h]
        (line,) = by_time.plot([p["elapsed_s"] for p in h], acc, style, label=r["run"])
        by_updates.plot([p["updates"] for p in h], acc, style, color=line.get_color())
    for ax, xlabel in ((by_time, "wall time (s)"), (by_updates, "parameter updates")):
        ax.axhline(TARGET, color="grey", lw=0.5)
        ax.set_xlabel(xlabel)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    by_time.set_ylabel("test accuracy")
    by_time.legend(fontsize=7, loc="lower right")
    fig.suptitle("plait parameter server: 1 server + 3 workers, digits CNN")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as runs:  # each run's trace and curves, not kept
        for label, config in configs(args.epochs):
            print(f"\n=== {label} ===", flush=True)
            report = run(config, out_dir=Path(runs))
            rows.append(summarize(label, report))
    (out / "ps_modes.json").write_text(
        json.dumps({"epochs": args.epochs, "runs": rows}, indent=1, default=str)
    )
    text = table(rows, args.epochs)
    (out / "ps_modes.md").write_text(text)
    plot(rows, out / "ps_modes.png")
    print("\n" + text, file=sys.stderr)
    print(f"wrote {out}/ps_modes.json, ps_modes.md, ps_modes.png", file=sys.stderr)


if __name__ == "__main__":
    main()
