"""Which launcher started this process, and the torchrun variables it implies.

``plait.init`` joins through the torchrun contract (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). Launchers that
set other variables are translated here, before ``init`` reads them, so one script runs
under every launcher unchanged:

* ``torchrun`` (any rendezvous: static, or elastic ``--nnodes MIN:MAX --rdzv-backend
  c10d``), ``plait run``, ``plait.spawn`` and Kubeflow's ``PyTorchJob`` (v1) set the
  contract themselves: nothing to translate (an explicit ``RANK`` always wins).
* ``srun`` (SLURM) sets ``SLURM_PROCID`` (the rank), ``SLURM_NTASKS`` (the world size),
  ``SLURM_LOCALID`` (the rank on its node), ``SLURM_STEP_TASKS_PER_NODE`` (``"4(x2)"``)
  and ``SLURM_STEP_NODELIST`` (``"node[01-02]"``), but no ``RANK`` or ``WORLD_SIZE``.
  ``MASTER_ADDR`` is kept when the batch script exported it, else it is the first host of
  the step's node list (task 0 runs there); ``MASTER_PORT`` is kept when exported, else
  ``15000 +`` the last four digits of ``SLURM_JOB_ID`` (the rule Lightning uses, so every
  task of a step derives the same port without talking; two jobs on one node whose ids
  end in the same four digits collide: export ``MASTER_PORT`` then). Variables of a
  batch script itself (a job but no step: ``SLURM_JOB_ID`` without ``SLURM_STEP_ID``) are
  not a rank's: ``init`` refuses there, saying to start the ranks with ``srun`` or
  ``plait run``.
* Kubeflow Trainer's ``torch-distributed`` runtime sets ``PET_NNODES``,
  ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``
  and runs ``torchrun``, which reads them as its defaults (``plait run`` reads them too:
  :func:`kubeflow_defaults`). A script started without torchrun in such a pod is
  translated when ``PET_NPROC_PER_NODE`` is 1 (one rank per pod: ``RANK`` is the pod's
  ``PET_NODE_RANK``), and refused otherwise, naming torchrun and ``plait run``.

Local: no communication, nothing but environment variables read (and, in :func:`apply`,
written).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

CONTRACT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_PORT_BASE = 15000  # + the job id's last four digits (Lightning's rule)


class LauncherEnvironmentError(RuntimeError):
    """The environment names a launcher but not enough to join: says what to set."""


@dataclass(frozen=True)
class Launch:
    """What :func:`detect` found: ``source`` names the launcher (``"torchrun"`` for any
    launcher that sets the torchrun contract itself, ``"slurm"``, ``"kubeflow"``, or
    ``"none"``); ``variables`` the contract variables to set (empty when the environment
    already has them); ``derived`` says, per variable, where its value came from."""

    source: str
    variables: dict[str, str] = field(default_factory=dict)
    derived: dict[str, str] = field(default_factory=dict)


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name, "")
    try:
        return int(raw)
    except ValueError:
        raise LauncherEnvironmentError(
            f"plait.init: {name}={raw!r} is not a whole number (set by the launcher)"
        ) from None


# --- SLURM's compressed lists ------------------------------------------------------------


def _split_top(text: str) -> list[str]:
    """``"a[1-2],b"`` -> ``["a[1-2]", "b"]``: commas outside brackets."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (s.strip() for s in parts) if p]


def _range(spec: str, whole: str) -> list[str]:
    """``"01-03,7"`` -> ``["01", "02", "03", "7"]``, keeping the zero padding."""
    out = []
    for item in spec.split(","):
        lo, _, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise LauncherEnvironmentError(f"plait.init: cannot read the SLURM node list {whole!r}")
        if not hi:
            out.append(lo)
            continue
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list, expanded as ``scontrol show hostnames`` does:
    ``"node[01-03,07],gpu-a"`` -> ``node01, node02, node03, node07, gpu-a``; several
    bracket groups in one name expand in order (``"r[1-2]n[1-2]"`` -> r1n1, r1n2, r2n1,
    r2n2)."""
    hosts: list[str] = []
    for part in _split_top(text):
        m = re.search(r"\[([^\]]*)\]", part)
        if m is None:
            hosts.append(part)
            continue
        head, tail = part[: m.start()], part[m.end() :]
        for value in _range(m.group(1), text):
            hosts.extend(expand_nodelist(head + value + tail))
    return hosts


def expand_counts(text: str) -> list[int]:
    """SLURM's compressed counts per node: ``"4(x2),3"`` -> ``[4, 4, 3]``."""
    counts: list[int] = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise LauncherEnvironmentError(
                f"plait.init: cannot read the SLURM task counts {text!r}"
            )
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


# --- the launchers -----------------------------------------------------------------------


def _slurm(env: Mapping[str, str]) -> Launch:
    """The contract of an ``srun`` task (see the module docstring)."""
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    out = {"RANK": str(rank), "WORLD_SIZE": str(world)}
    why = {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS"}
    out["LOCAL_RANK"] = str(_int(env, "SLURM_LOCALID")) if "SLURM_LOCALID" in env else "0"
    why["LOCAL_RANK"] = "SLURM_LOCALID"
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    nodelist = nodelist or env.get("SLURM_NODELIST", "")
    hosts = expand_nodelist(nodelist) if nodelist else []
    counts_text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    if counts_text:
        counts = expand_counts(counts_text)
        node = env.get("SLURMD_NODENAME", "")
        index = hosts.index(node) if node in hosts else _int(env, "SLURM_NODEID")
        if not 0 <= index < len(counts):
            raise LauncherEnvironmentError(
                f"plait.init: rank {rank}: node {index} of the SLURM step has no task count "
                f"in {counts_text!r}; set LOCAL_WORLD_SIZE (ranks on this node)"
            )
        out["LOCAL_WORLD_SIZE"] = str(counts[index])
        why["LOCAL_WORLD_SIZE"] = "SLURM_STEP_TASKS_PER_NODE"
    elif "SLURM_NTASKS_PER_NODE" in env:
        out["LOCAL_WORLD_SIZE"] = str(_int(env, "SLURM_NTASKS_PER_NODE"))
        why["LOCAL_WORLD_SIZE"] = "SLURM_NTASKS_PER_NODE"
    if not env.get("MASTER_ADDR"):
        if not hosts:
            raise LauncherEnvironmentError(
                f"plait.init: rank {rank} of {world} under srun: MASTER_ADDR is not set and "
                f"SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is empty; export MASTER_ADDR (the "
                f"host of rank 0, e.g. $(scontrol show hostnames $SLURM_JOB_NODELIST | head "
                f"-n 1)) in the batch script"
            )
        out["MASTER_ADDR"] = hosts[0]
        why["MASTER_ADDR"] = f"the first host of {nodelist!r}"
    if not env.get("MASTER_PORT"):
        job = env.get("SLURM_JOB_ID", "")
        if not job.isdigit():
            raise LauncherEnvironmentError(
                f"plait.init: rank {rank} of {world} under srun: MASTER_PORT is not set and "
                f"SLURM_JOB_ID={job!r} gives none; export MASTER_PORT (a free port on the "
                f"host of rank 0) in the batch script"
            )
        out["MASTER_PORT"] = str(SLURM_PORT_BASE + int(job[-4:]))
        why["MASTER_PORT"] = f"{SLURM_PORT_BASE} + the last 4 digits of SLURM_JOB_ID={job}"
    return Launch("slurm", out, why)


def _kubeflow(env: Mapping[str, str]) -> Launch:
    """One rank per pod of Kubeflow's torch runtime, started without torchrun."""
    nproc = env.get("PET_NPROC_PER_NODE", "1").strip()
    if nproc != "1":
        raise LauncherEnvironmentError(
            f"plait.init: PET_NPROC_PER_NODE={nproc!r} (Kubeflow's torch runtime) but RANK and "
            f"WORLD_SIZE are not set: this process was started without a launcher. Make the "
            f"container's command `torchrun train.py` (torchrun reads PET_*) or `plait run "
            f"-n {nproc if nproc.isdigit() else 'N'} train.py`, which start "
            f"{nproc if nproc.isdigit() else 'the'} ranks per pod"
        )
    missing = [k for k in ("PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT") if k not in env]
    if missing and not all(env.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")):
        raise LauncherEnvironmentError(
            f"plait.init: Kubeflow's PET_NNODES is set but {missing} are not; start the "
            f"script with torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        )
    out = {
        "RANK": str(_int(env, "PET_NODE_RANK") if "PET_NODE_RANK" in env else 0),
        "WORLD_SIZE": str(_int(env, "PET_NNODES")),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }
    why = {
        "RANK": "PET_NODE_RANK",
        "WORLD_SIZE": "PET_NNODES",
        "LOCAL_RANK": "PET_NPROC_PER_NODE=1",
        "LOCAL_WORLD_SIZE": "PET_NPROC_PER_NODE=1",
    }
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.get(name):
            out[name] = env[f"PET_{name}"]
            why[name] = f"PET_{name}"
    return Launch("kubeflow", out, why)


def detect(environ: Mapping[str, str] | None = None) -> Launch:
    """The launcher of this process and the contract variables it implies (see the
    module docstring). Raises :class:`LauncherEnvironmentError` naming the variable to
    set when a launcher is recognized but its variables do not suffice."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch("torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        return _slurm(env)
    if "PET_NNODES" in env:
        return _kubeflow(env)
    if "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env:
        raise LauncherEnvironmentError(
            f"plait.init: RANK and WORLD_SIZE are not set, and this is SLURM job "
            f"{env['SLURM_JOB_ID']}'s batch script, not one of its tasks: start the ranks "
            f"with `srun python train.py` (one task per rank; plait.init reads SLURM_PROCID, "
            f"SLURM_NTASKS, ...) or `srun --ntasks-per-node=1 plait run -n <ranks per node> "
            f"train.py` (see docs/launching.md)"
        )
    return Launch("none")


def apply(environ: MutableMapping[str, str] | None = None) -> Launch:
    """:func:`detect`, then set the variables it derived in ``environ`` (default
    ``os.environ``), so that the backend's ``env://`` rendezvous and every later reader
    see them; variables already set are kept."""
    env = os.environ if environ is None else environ
    found = detect(env)
    for name, value in found.variables.items():
        env.setdefault(name, value)
    return found


def kubeflow_defaults(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``plait run``'s defaults from Kubeflow's ``PET_*`` variables, as torchrun takes
    them: ``{"nnodes", "nproc", "node_rank", "master_addr", "master_port"}`` (only those
    set; ``PET_NPROC_PER_NODE`` only when a number)."""
    env = os.environ if environ is None else environ
    names = {
        "nnodes": "PET_NNODES",
        "nproc": "PET_NPROC_PER_NODE",
        "node_rank": "PET_NODE_RANK",
        "master_addr": "PET_MASTER_ADDR",
        "master_port": "PET_MASTER_PORT",
    }
    found = {k: env[v].strip() for k, v in names.items() if env.get(v, "").strip()}
    if "nproc" in found and not found["nproc"].isdigit():
        del found["nproc"]  # "auto", "gpu": torchrun's own words; plait run needs -n
    return found


def slurm_defaults(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``plait run``'s defaults inside an ``srun`` step of one task per node (``srun
    --ntasks-per-node=1 plait run -n 4 train.py``): ``{"nnodes", "node_rank",
    "master_addr", "master_port"}`` from ``SLURM_STEP_NUM_NODES`` (or ``SLURM_NNODES``),
    ``SLURM_NODEID`` and the step's first host; empty outside such a step (several tasks
    on a node would each start a launcher)."""
    env = os.environ if environ is None else environ
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return {}
    nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or ""
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or ""
    if not nodes.isdigit() or nodes != tasks:
        return {}
    found = _slurm(env)
    addr = env.get("MASTER_ADDR") or found.variables["MASTER_ADDR"]
    port = env.get("MASTER_PORT") or found.variables["MASTER_PORT"]
    return {
        "nnodes": nodes,
        "node_rank": str(_int(env, "SLURM_PROCID")),  # one task per node: task = node
        "master_addr": addr,
        "master_port": port,
    }


__all__ = [
    "CONTRACT",
    "Launch",
    "LauncherEnvironmentError",
    "apply",
    "detect",
    "expand_counts",
    "expand_nodelist",
    "kubeflow_defaults",
    "slurm_defaults",
]
