"""What healing PTD-P replicas costs: the step when nothing fails, beside plait's PTD-P
without healing, and the seconds from a fault to training again.

    .venv/bin/python benchmarks/heal_replicas.py            # 3 rounds, 12 steps each
    .venv/bin/python benchmarks/heal_replicas.py --quick    # 1 round, 6 steps

Four local ranks: two replicas of two pipeline stages (``pp=2``), plait's GPT (4 blocks,
width 128, 64 tokens, vocabulary 13, float32), Adam, a global batch of 16 sequences, 2
micro-batches per replica. One intra-op thread per rank.

1. **Step when nothing fails**, side by side in the same four processes (under
   ``plait.spawn``), taking turns step by step: ``heal``: :class:`plait.heal.ReplicaTrainer`
   (each replica's pipeline step on its block, then the tree-ordered block exchange per
   position and the replica's agreement all-reduce); ``ptdp``: ``plait.compose`` on the
   world's ``Mesh(pp=2, dp=2)`` (the same model, batch and micro-batches; its dp
   all-reduce of the gradients). The step time is the slowest rank's, median over a
   round's steps after its first two, then the median over rounds.
2. **Fault to training again**: rank 3 (replica 1's second stage) SIGKILLs itself in step
   3; the seconds from the kill (the wall time it wrote just before) to the moment the last
   survivor has agreed on the new membership, built its position group and starts redoing
   the step (``ended`` in its healing record). Then the replacement replica's growth
   (``grow`` records: seconds from the step boundary where it was admitted to training at
   full size again).

Writes ``benchmarks/results/heal_replicas.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import plait  # noqa: E402
from plait.demo.heal_replicas import ReplicaConfig, batch, gpt_config, run  # noqa: E402
from plait.heal import ReplicaTrainer  # noqa: E402
from plait.models import GPT  # noqa: E402
from plait.strategies.compose import compose  # noqa: E402

SHAPE = {"width": 128, "layers": 4, "seq_len": 64, "dtype": "float32", "batch": 16}


def _side_by_side(config: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """One rank: plait's PTD-P on the world's Mesh(pp, dp) and a ReplicaTrainer (its own
    replica meshes, on the same store) in the same process, taking turns step by step
    (so both see the same load); this rank's step times of each."""
    torch.set_num_threads(1)
    c = ReplicaConfig(**config)
    model = GPT(gpt_config(c))
    ptdp = compose(
        model,
        torch.optim.Adam(model.parameters(), lr=c.lr),
        mesh=plait.Mesh(pp=c.pp, dp=c.replicas, tp=c.tp),
        microbatches=c.microbatches,
    )

    def build(mesh: Any) -> Any:
        replica_model = GPT(gpt_config(c))
        return compose(
            replica_model,
            torch.optim.Adam(replica_model.parameters(), lr=c.lr),
            mesh=mesh,
            microbatches=c.microbatches,
        )

    trainer = ReplicaTrainer(
        build,
        replica=c.shape,
        world=c.world,
        address=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=plait.world().rank,
        threads=1,
    )
    times: dict[str, list[float]] = {"heal": [], "ptdp": []}
    for step in range(c.steps * rounds):
        x, y = batch(c, step)
        t0 = time.perf_counter()
        trainer.step(x, y)
        times["heal"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ptdp.optimizer.zero_grad()
        ptdp.step(x, y)
        ptdp.optimizer.step()
        times["ptdp"].append(time.perf_counter() - t0)
    trainer.close()
    return times


def _slowest(per_rank: list[list[float]]) -> float:
    steps = [max(ts) for ts in zip(*per_rank, strict=True)][2:]
    return statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    a = parser.parse_args()
    rounds, steps = (1, 6) if a.quick else (3, 12)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    clean = ReplicaConfig(steps=steps, rejoin=False, **SHAPE)
    per_rank = plait.spawn(
        _side_by_side, world_size=clean.world, args=(vars(clean), rounds), timeout=900
    )
    heal = [
        _slowest([t["heal"][r * steps : (r + 1) * steps] for t in per_rank]) for r in range(rounds)
    ]
    base = [
        _slowest([t["ptdp"][r * steps : (r + 1) * steps] for t in per_rank]) for r in range(rounds)
    ]
    faulted = ReplicaConfig(
        steps=steps,
        faults=[[3, 3, 1, "kill"]],
        rejoin=True,
        rejoin_step=5,
        **SHAPE,
    )
    out = tempfile.mkdtemp(prefix="heal-replicas-fault-")
    report = run(faulted, out, deadline=600)
    killed = float((Path(out) / "fault-3-3.txt").read_text())
    survivors = [r for r in report.records if not r["join"] and r["rank"] in (0, 1)]
    shrink = max(h["ended"] for r in survivors for h in r["heals"] if h["kind"] == "shrink")
    grow = [h["seconds"] for r in survivors for h in r["heals"] if h["kind"] == "grow"]
    result = {
        "shape": SHAPE,
        "replicas": clean.replicas,
        "pp": clean.pp,
        "rounds": rounds,
        "steps": steps,
        "heal_step_s": heal,
        "ptdp_step_s": base,
        "ratio": statistics.median(heal) / statistics.median(base),
        "fault_to_training_s": shrink - killed,
        "grow_s": max(grow) if grow else None,
        "finished_at_full_size": all(r["members"] == list(range(4)) for r in report.records),
        "load": os.getloadavg()[0],
    }
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    (results / "heal_replicas.json").write_text(json.dumps(result, indent=2))
    per_round = ", ".join(f"{h / b:.2f}x" for h, b in zip(heal, base, strict=True))
    lines = [
        "# Healing PTD-P replicas: 2 replicas x pp=2, plait's GPT (width 128, 4 blocks, "
        "float32), 4 ranks on this CPU",
        "",
        "| measure | value |",
        "|---|---|",
        f"| step, ReplicaTrainer (median of rounds, s) | {statistics.median(heal):.4f} |",
        f"| step, plait PTD-P Mesh(pp=2, dp=2) (s) | {statistics.median(base):.4f} |",
        f"| ratio heal / ptdp (of the medians) | {result['ratio']:.2f}x |",
        f"| ratio per round | {per_round} |",
        f"| SIGKILL of rank 3 to training again (s) | {result['fault_to_training_s']:.2f} |",
        f"| replacement replica admitted to full size (s) | {result['grow_s'] or 0:.2f} |",
        f"| load average during the run | {result['load']:.1f} |",
    ]
    (results / "heal_replicas.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
