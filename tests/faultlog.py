"""One row of the fault table: what a fault-injection test measured.

Fault tests (marked ``@pytest.mark.faults``) call :func:`record` with the row of the
fact sheet's matrix they cover and what they observed. When ``PLAIT_FAULT_TABLE`` names a
file, each call appends one JSON line to it; ``benchmarks/faults.py`` runs the marked tests
with it set and prints the table. Without the variable nothing is written: the assertions
in the test are what make it pass or fail.
"""

from __future__ import annotations

import json
import os
from typing import Any


def record(
    *,
    row: int,
    fault: str,
    detected_after_s: float | None,
    named_correctly: bool | None,
    recovered_after_s: float | None = None,
    state_equal: bool | None = None,
    **extra: Any,
) -> None:
    """Append one measured row to the fault table (if ``PLAIT_FAULT_TABLE`` is set)."""
    path = os.environ.get("PLAIT_FAULT_TABLE")
    if not path:
        return
    entry = {
        "row": row,
        "fault": fault,
        "detected_after_s": detected_after_s,
        "named_correctly": named_correctly,
        "recovered_after_s": recovered_after_s,
        "state_equal": state_equal,
        **extra,
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
