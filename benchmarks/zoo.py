"""The zoo: causal LMs plait has no family module for, under every strategy, against one process.

    .venv/bin/python benchmarks/zoo.py                      # all of it, a few minutes
    .venv/bin/python benchmarks/zoo.py --only gemma3 phi   # some models
    .venv/bin/python benchmarks/zoo.py --write-status      # the table into docs/status.md

Each model of ``tests/zoo_fns.py`` (Hugging Face config classes, random init, float64, eager
attention, dropout 0) is handed whole to ``plait.prepare`` under ddp, fsdp, tp, pipeline and
(for MoE models) ep on 2 local ranks, and ptdp (pp 2 x tp 2) on 4, trained 2 AdamW steps with
two parameter groups and compared with one process on the global batch through
``plait.checkpoint.full_state_dict``. A cell is ``exact`` (the largest difference, within
1e-10, or the model's stated bound for a float32 router), ``refused`` (the refusal's reason,
shortened), or ``DIFFERS`` / ``ERROR`` (a failure of plait: tests/test_zoo.py fails on it).
Writes ``benchmarks/results/zoo.json`` and ``.md``; with ``--write-status`` replaces the
table between the ``zoo-table`` markers of docs/status.md.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

import plait
from tests import zoo_fns

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- zoo-table -->", "<!-- /zoo-table -->"


def reason(why: str) -> str:
    """A refusal's reason in a few words: the clause after 'safely:' or the first line."""
    text = why.split("\n")[0]
    for marker in ("inferred safely: ", "plan is known for its family. "):
        if marker in text:
            text = text.split(marker, 1)[1]
    text = re.sub(r"^\w+Error: ", "", text)
    return text if len(text) <= 90 else text[:87] + "..."


def cell(outcome: dict[str, Any] | None) -> str:
    if outcome is None:
        return "-"
    result = outcome["result"]
    if result == "exact":
        return f"exact ({outcome['diff']:.0e})"
    if result == "refused":
        return f"refused: {reason(outcome['why'])}"
    return f"**{result.upper()}**: {reason(outcome['why']) or outcome['diff']}"


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| model | " + " | ".join(zoo_fns.STRATEGIES) + " |",
        "|---" * (len(zoo_fns.STRATEGIES) + 1) + "|",
    ]
    for name, row in results.items():
        cells = [cell(row.get(s)) for s in zoo_fns.STRATEGIES]
        lines.append(f"| {name} ({zoo_fns.ZOO[name].model}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=list(zoo_fns.ZOO))
    parser.add_argument("--write-status", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    names = tuple(args.only)
    two = tuple(s for s in zoo_fns.STRATEGIES if s not in zoo_fns.FOUR_RANKS)
    start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {n: {} for n in names}
    for world, strategies in ((2, two), (4, zoo_fns.FOUR_RANKS)):
        pool = plait.RankPool(world, timeout=120)
        try:
            for name in names:
                t0 = time.perf_counter()
                got = pool.run(zoo_fns.run, (name,), strategies, timeout=900)[0]
                results[name].update(got[name])
                print(f"{name} on {world} ranks: {time.perf_counter() - t0:.1f} s", flush=True)
        finally:
            pool.close()
    seconds = time.perf_counter() - start
    text = table(results)
    print(text)
    print(f"{len(names)} models in {seconds:.0f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "zoo.json").write_text(json.dumps({"seconds": seconds, "results": results}, indent=1))
    (out / "zoo.md").write_text(text + "\n")
    if args.write_status:
        status = ROOT / "docs" / "status.md"
        body = status.read_text()
        block = f"{BEGIN}\n{text}\n{END}"
        if BEGIN in body:
            body = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), block, body, flags=re.S)
        else:
            body = body.rstrip("\n") + "\n\n" + block + "\n"
        status.write_text(body)


if __name__ == "__main__":
    main()
