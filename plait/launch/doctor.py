"""``plait doctor DIR``: read every rank's flight-recorder dump and say what went wrong.

Each rank that saw a collective fail wrote ``DIR/rank<N>.json`` (``plait/comm/recorder.py``:
its last collectives with group, sequence number, collective, signature and state). The
doctor lines the ranks' entries up by (group, sequence number) and reports the first
collective where they disagree (different collective, op, dtype or size at the same
number), the ranks that never reached a collective the others entered, and collectives
that started but never completed. Ranks without a file are listed: they did not see a
collective fail (they may never have reached it, or exited first).

``plait run`` gives each attempt of a job its folder, ``<tmp>/plait-recorder-<job id>/
attempt-<n>``, and its failure report names the one written; ``plait doctor`` reads either
that folder or the job's (every attempt's folder in turn).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load(directory: str | Path) -> dict[int, dict[str, Any]]:
    """Every rank's dump in ``directory``, by global rank."""
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(
            f"plait doctor: {d} is not a directory; pass the flight-recorder directory "
            f"named in the error message (PLAIT_RECORDER_DIR)"
        )
    dumps = {}
    for f in sorted(d.glob("rank*.json")):
        data = json.loads(f.read_text())
        dumps[int(data["rank"])] = data
    if not dumps:
        raise FileNotFoundError(f"plait doctor: no rank*.json flight-recorder files in {d}")
    return dumps


def _call(e: dict[str, Any]) -> str:
    text = f"{e['collective']} #{e['seq']} [{e['sig']}] {e.get('desc', '')}".rstrip()
    return f"{text} ({e['state']})"


def diagnose(dumps: dict[int, dict[str, Any]]) -> list[str]:
    """Findings, most important first (one line each)."""
    findings: list[str] = []
    groups = sorted({e["group"] for d in dumps.values() for e in d["entries"]})
    for group in groups:
        per_rank: dict[int, dict[int, dict[str, Any]]] = {}
        for r, d in dumps.items():
            entries = {e["seq"]: e for e in d["entries"] if e["group"] == group}
            if entries:
                per_rank[r] = entries
        if not per_rank:
            continue
        first = {r: min(es) for r, es in per_rank.items()}
        last = {r: max(es) for r, es in per_rank.items()}
        start = max(first.values())  # every rank's buffer still covers from here
        for seq in range(start, max(last.values()) + 1):
            present = {r: es[seq] for r, es in per_rank.items() if seq in es}
            absent = sorted(r for r in per_rank if seq not in per_rank[r])
            kinds = {(e["collective"], e["sig"]) for e in present.values()}
            if len(kinds) > 1:
                calls = "; ".join(f"rank {r}: {_call(e)}" for r, e in sorted(present.items()))
                findings.append(
                    f"group {group!r} #{seq}: the ranks disagree: {calls}. Every rank must "
                    f"call the same collectives in the same order."
                )
                break
            if absent:
                where = ", ".join(f"rank {r} (last #{last[r]})" for r in absent)
                e = next(iter(present.values()))
                findings.append(
                    f"group {group!r} #{seq} ({e['collective']} [{e['sig']}]): entered by "
                    f"ranks {sorted(present)}; never reached by {where}."
                )
                break
            stuck = [r for r, e in present.items() if e["state"] != "completed"]
            if stuck and seq == max(last.values()):
                e = present[stuck[0]]
                findings.append(
                    f"group {group!r} #{seq} ({_call(e)}): entered by every rank with a file, "
                    f"not completed on ranks {sorted(stuck)}: a peer stopped answering inside "
                    f"it (see the reasons below)."
                )
    known = sorted(dumps)
    missing = [r for r in range(max(known) + 1) if r not in dumps]
    if missing:
        findings.append(
            f"no file from ranks {missing}: they saw no collective fail (they may never have "
            f"reached it, or exited or were killed first)."
        )
    return findings


def attempts(directory: str | Path) -> list[Path]:
    """The attempt folders (``attempt-<n>``, in order) of a job's recorder folder that
    hold dumps; none when ``directory`` holds dumps itself."""
    d = Path(directory)
    if not d.is_dir() or any(d.glob("rank*.json")):
        return []
    found = [a for a in d.glob("attempt-*") if a.is_dir() and any(a.glob("rank*.json"))]
    return sorted(found, key=_attempt_number)


def _attempt_number(folder: Path) -> int:
    tail = folder.name.removeprefix("attempt-")
    return int(tail) if tail.isdigit() else -1


def report(directory: str | Path) -> str:
    each = attempts(directory)
    if each:
        return "\n".join(_report_one(a) for a in each)
    return _report_one(directory)


def _report_one(directory: str | Path) -> str:
    dumps = load(directory)
    lines = [f"flight recorder {directory}: ranks {sorted(dumps)}"]
    findings = diagnose(dumps)
    lines += [f"  * {f}" for f in findings] or ["  * the ranks' recorded collectives agree"]
    for r, d in sorted(dumps.items()):
        reason = (d.get("reasons") or ["?"])[0]
        lines.append(f"  rank {r} (host {d.get('host')}, pid {d.get('pid')}): {reason[:300]}")
    return "\n".join(lines)
