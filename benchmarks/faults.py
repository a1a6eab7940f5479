"""The fault table: run the fault-injection tests and tabulate what they measured.

    .venv/bin/python benchmarks/faults.py                 # once
    .venv/bin/python benchmarks/faults.py --repeat 3      # medians of 3 runs
    .venv/bin/python benchmarks/faults.py -k launcher     # a subset (pytest -k)

Runs ``pytest -m faults`` with ``PLAIT_FAULT_TABLE`` naming a temporary file and
``PLAIT_FULL_FAULTS=1`` (the tests too slow for the suite: two hosts in network
namespaces, torchrun restarts); every fault
test appends one JSON row per measurement there (``tests/faultlog.py``). Rows with the same
matrix row and fault are merged: numbers become the median over the repetitions, flags
are "yes" only when every repetition agreed (else "k/n"). The markdown table goes to
stdout and to ``benchmarks/results/faults.md`` (``--out``). The pytest outcome of each run
is reported below the table: a failing fault test is a finding, not a missing row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("detected_after_s", "named_correctly", "recovered_after_s", "state_equal")


def run_once(pytest_args: list[str], table: Path) -> tuple[int, str, float]:
    """One ``pytest -m faults`` run; (exit code, its summary line, seconds)."""
    env = dict(os.environ, PLAIT_FAULT_TABLE=str(table), PLAIT_FULL_FAULTS="1")
    start = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "faults",
            "-p",
            "no:cacheprovider",
            *pytest_args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    took = time.monotonic() - start
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    summary = "; ".join([*failed, lines[-1] if lines else "(no output)"])
    return done.returncode, summary, took


def _number(values: list[Any]) -> str:
    nums = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not nums:
        return "-"
    med = statistics.median(nums)
    if len(nums) == 1:
        return f"{med:.2f}"
    return f"{med:.2f} ({min(nums):.2f}-{max(nums):.2f})"


def _flag(values: list[Any]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    yes = sum(1 for v in known if v)
    if yes == len(known):
        return "yes"
    if yes == 0:
        return "**no**"
    return f"{yes}/{len(known)}"


def tabulate(entries: list[dict[str, Any]]) -> str:
    """Markdown: one line per (row, fault), medians and agreement over repetitions."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for e in entries:
        groups.setdefault((int(e["row"]), str(e["fault"])), []).append(e)
    out = [
        "| row | fault | detected after (s) | named correctly | recovered after (s) "
        "| state equal | runs | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (row, fault), es in sorted(groups.items()):
        notes = sorted({str(e["note"]) for e in es if e.get("note")})
        out.append(
            f"| {row} | {fault} | {_number([e['detected_after_s'] for e in es])} "
            f"| {_flag([e['named_correctly'] for e in es])} "
            f"| {_number([e['recovered_after_s'] for e in es])} "
            f"| {_flag([e['state_equal'] for e in es])} | {len(es)} | {'; '.join(notes)} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs; numbers are medians")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "faults.md"))
    parser.add_argument("-k", default=None, help="pytest -k expression (a subset)")
    parser.add_argument("paths", nargs="*", default=["tests"], help="test files (default all)")
    args = parser.parse_args(argv)
    pytest_args = [*args.paths, *(["-k", args.k] if args.k else [])]
    entries: list[dict[str, Any]] = []
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="plait-faults-") as tmp:
        for i in range(args.repeat):
            table = Path(tmp) / f"run{i}.jsonl"
            code, summary, took = run_once(pytest_args, table)
            outcomes.append(f"run {i + 1}: pytest exit {code} in {took:.0f}s: {summary}")
            print(outcomes[-1], flush=True)
            if table.exists():
                entries += [json.loads(line) for line in table.read_text().splitlines() if line]
    text = (
        f"# plait fault table\n\n{len(entries)} measurements from {args.repeat} run(s) of "
        f"`pytest -m faults {' '.join(pytest_args)}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores). "
        f"Numbers: median (min-max) over runs; flags: yes when every run agreed.\n\n"
        f"{tabulate(entries)}\n\n" + "\n".join(f"- {o}" for o in outcomes) + "\n"
    )
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return 0 if entries else 1


if __name__ == "__main__":
    sys.exit(main())
