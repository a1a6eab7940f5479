"""Each rank starts two ``sleep 300`` children, one in its process group and one in a
session of its own (as a daemon would), writes their pids to ``<argv[1]>/child-<rank>-<i>``
and exits 0; with ``argv[2] == "fail"`` rank 1 then raises."""

import os
import subprocess
import sys
from pathlib import Path

rank = int(os.environ["RANK"])
out = Path(sys.argv[1])
kids = [
    subprocess.Popen(["sleep", "300"]),
    subprocess.Popen(["sleep", "300"], start_new_session=True),
]
for i, kid in enumerate(kids):
    (out / f"child-{rank}-{i}.tmp").write_text(str(kid.pid))
    os.replace(out / f"child-{rank}-{i}.tmp", out / f"child-{rank}-{i}")
if sys.argv[2] == "fail" and rank == 1:
    raise RuntimeError("rank 1 fails after starting its children")
