"""Every documented ``plait demo ... --check`` command, run as a user runs it, with its verdict.

The demo's float32 check compares each run with one process in float64 and passes within
``NOISE_FACTOR`` times what float32 itself shows in one process, measured in the same run
(``plait.demo.closeness``). This script runs each command the README and docs/ name, in
float32 (the default) and in float64 where it is quick, and writes one row per command: the
exit status, the largest difference, the bound and the ratio, so the margin on this CPU is on
record. Correctness only: nothing here is timed against anything.

    .venv/bin/python benchmarks/demo_checks.py [--quick] [--out benchmarks/results/demo_checks]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

# (name, arguments after `plait demo`): the --check commands of README.md and docs/.
COMMANDS: list[tuple[str, list[str]]] = [
    ("digits ddp", ["-n", "4", "--check"]),
    ("digits ddp reproducible", ["-n", "4", "--reproducible", "--check"]),
    ("gpt dp", ["--model", "gpt", "-n", "2", "--check"]),
    ("gpt tp 2", ["--model", "gpt", "-n", "2", "--tp", "2", "--check"]),
    ("gpt tp 2 sp", ["--model", "gpt", "-n", "2", "--tp", "2", "--sp", "--check"]),
    ("gpt dp2 x tp2", ["--model", "gpt", "-n", "4", "--tp", "2", "--check"]),
    ("gpt pp 2", ["--model", "gpt", "-n", "2", "--pp", "2", "--check"]),
    ("gpt ptdp pp2 x tp2", ["--model", "gpt", "-n", "4", "--pp", "2", "--tp", "2", "--check"]),
    ("gpt cp 2 ring", ["--model", "gpt", "-n", "2", "--cp", "2", "--context", "ring", "--check"]),
    (
        "gpt cp 2 ulysses",
        ["--model", "gpt", "-n", "2", "--cp", "2", "--context", "ulysses", "--check"],
    ),
    (
        "gpt cp 2 ring, issue's short run",
        [
            "--model",
            "gpt",
            "-n",
            "2",
            "--cp",
            "2",
            "--context",
            "ring",
            "--steps",
            "6",
            "--evals",
            "2",
            "--check",
        ],
    ),
    ("gpt moe ep 2", ["--model", "gpt", "-n", "2", "--moe", "--ep", "2", "--check"]),
]

QUICK = ["--steps", "6", "--evals", "2"]
NUMBER = r"([0-9.]+e[-+][0-9]+)"


def parse(output: str) -> dict[str, object]:
    """The check lines of a demo's output ("<value> (ok: bound <b>)" or "(LARGER THAN EXPECTED:
    bound <b>)"): the one nearest its bound, and the verdict over all of them."""
    row: dict[str, object] = {"verdict": "?", "difference": None, "bound": None, "what": None}
    worst = -1.0
    pattern = r"([^:\n]*): " + NUMBER + r" \((ok|LARGER THAN EXPECTED): bound " + NUMBER + r"\)"
    for what, value, verdict, bound in re.findall(pattern, output):
        ratio = float(value) / float(bound) if float(bound) else float("inf")
        if ratio > worst:
            worst = ratio
            row.update(difference=float(value), bound=float(bound), what=what.strip(" -"))
        if verdict != "ok":
            row["verdict"] = "LARGER THAN EXPECTED"
        elif row["verdict"] == "?":
            row["verdict"] = "ok"
    if "NOT BITWISE" in output:
        row["verdict"] = "NOT BITWISE"
    elif row["verdict"] == "?" and re.search(r"bitwise|max diff 0\b", output):
        row["verdict"] = "ok (bitwise)"
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"add {' '.join(QUICK)} to each")
    parser.add_argument("--out", default="benchmarks/results/demo_checks")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    rows = []
    for name, extra in COMMANDS:
        argv = [sys.executable, "-m", "plait.cli", "demo", *extra]
        if args.quick and "--steps" not in extra and "--model" in extra:
            argv += QUICK
        start = time.perf_counter()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
            rc, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            rc, output = 124, f"timed out after {args.timeout:.0f} s: {e}"
        row = {
            "name": name,
            "command": "plait demo " + " ".join(argv[4:]),
            "rc": rc,
            "seconds": round(time.perf_counter() - start, 1),
            **parse(output),
        }
        if rc != 0:
            row["tail"] = output[-1500:]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tail"}), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "| command | exit | nearest its bound | value | bound | value / bound | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d, b = r["difference"], r["bound"]
        ratio = f"{d / b:.2f}" if isinstance(d, float) and isinstance(b, float) and b else "-"
        fmt = lambda v: f"{v:.1e}" if isinstance(v, float) else "-"  # noqa: E731
        lines.append(
            f"| `{r['command']}` | {r['rc']} | {r['what'] or '-'} | {fmt(d)} | {fmt(b)} "
            f"| {ratio} | "
            f"{r['verdict']} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
