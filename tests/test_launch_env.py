"""``plait.init`` under the launchers clusters use, each faked on this machine: ``srun``'s
variables (no RANK/WORLD_SIZE; MASTER_ADDR and MASTER_PORT derived), ``srun
--ntasks-per-node=1 plait run`` (one launcher per "node"), Kubeflow's torch runtime
(``PET_*``, through torchrun and one rank per pod without it) and torchrun's elastic c10d
rendezvous (``plait run --nnodes 1:2``, two agents). The variables' translation is
checked without processes (:mod:`plait.launch.environment`)."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plait import cli
from plait.launch import environment
from plait.launch.environment import LauncherEnvironmentError, detect, expand_nodelist

ROOT = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).parent / "scripts" / "launch_env_probe.py"
LAUNCHER_PREFIXES = ("SLURM", "PET_", "TORCHELASTIC", "GROUP_", "ROLE_")
CONTRACT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# --- the translation, no processes ---------------------------------------------------------


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("gpu-a,big[8-10]-ib", ["gpu-a", "big8-ib", "big9-ib", "big10-ib"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ],
)
def test_node_lists_expand_as_scontrol_does(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


def srun_vars(rank: int, *, ntasks: int = 8, per_node: str = "4(x2)", job: str = "4242") -> dict:
    return {
        "SLURM_JOB_ID": job,
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_LOCALID": str(rank % 4),
        "SLURM_NODEID": str(rank // 4),
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_STEP_TASKS_PER_NODE": per_node,
    }


def test_srun_variables_give_the_torchrun_contract() -> None:
    found = detect(srun_vars(5))
    assert found.source == "slurm"
    assert found.variables == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu07",  # the step's first host: task 0 runs there
        "MASTER_PORT": str(15000 + 4242),
    }
    # exported MASTER_ADDR/MASTER_PORT (the usual batch script) are kept
    kept = detect({**srun_vars(5), "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"})
    assert "MASTER_ADDR" not in kept.variables and "MASTER_PORT" not in kept.variables
    # uneven nodes: the count of this task's node
    assert detect(srun_vars(4, ntasks=5, per_node="4,1")).variables["LOCAL_WORLD_SIZE"] == "1"
    # a launcher that set the contract wins (torchrun or plait run started inside srun)
    assert detect({**srun_vars(5), "RANK": "0", "WORLD_SIZE": "2"}).source == "torchrun"


def test_srun_without_a_port_or_a_batch_script_alone_is_refused_naming_the_fix() -> None:
    env = {**srun_vars(0), "SLURM_JOB_ID": "interactive"}
    with pytest.raises(LauncherEnvironmentError, match="export MASTER_PORT"):
        detect(env)
    batch = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}  # no step
    with pytest.raises(LauncherEnvironmentError, match="batch script.*srun"):
        detect(batch)


def test_kubeflow_pod_without_torchrun() -> None:
    pod = {
        "PET_NNODES": "3",
        "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": "2",
        "PET_MASTER_ADDR": "job-node-0-0.job",
        "PET_MASTER_PORT": "29400",
    }
    found = detect(pod)
    assert found.source == "kubeflow"
    assert found.variables["RANK"] == "2" and found.variables["WORLD_SIZE"] == "3"
    assert found.variables["MASTER_ADDR"] == "job-node-0-0.job"
    with pytest.raises(LauncherEnvironmentError, match="torchrun train.py.*plait run -n 4"):
        detect({**pod, "PET_NPROC_PER_NODE": "4"})


def test_plait_run_takes_its_defaults_from_srun_and_kubeflow(monkeypatch) -> None:
    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES) or name in CONTRACT:
            monkeypatch.delenv(name)
    one_task_per_node = {
        **srun_vars(1, ntasks=2, per_node="1(x2)"),
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NODEID": "1",
    }
    for k, v in one_task_per_node.items():
        monkeypatch.setenv(k, v)
    args = argparse.Namespace(
        nproc=4, nnodes=None, node_rank=None, master_addr=None, master_port=None
    )
    assert cli._launcher_defaults(args)[0] == "from srun:"
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (
        "2",
        1,
        "gpu07",
        15000 + 4242,
    )
    assert args.nproc == 4  # -n is the user's
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")  # 4 tasks a node: each task is a rank
    assert environment.slurm_defaults() == {}
    for k in one_task_per_node:
        monkeypatch.delenv(k)
    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "3", "PET_NODE_RANK": "1"}
    for k, v in {**pet, "PET_MASTER_ADDR": "m0", "PET_MASTER_PORT": "29400"}.items():
        monkeypatch.setenv(k, v)
    args = argparse.Namespace(
        nproc=None, nnodes=None, node_rank=0, master_addr=None, master_port=None
    )
    cli._launcher_defaults(args)
    assert (args.nproc, args.nnodes, args.node_rank, args.master_addr, args.master_port) == (
        3,
        "2",
        0,  # given on the command line: kept
        "m0",
        29400,
    )


# --- real processes ------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(LAUNCHER_PREFIXES) and k not in CONTRACT and k != "PLAIT_LAUNCHER_PID"
    }
    env.update(PYTHONPATH=str(ROOT), PLAIT_HEARTBEAT_TIMEOUT="60", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def free_port(low: int = 20000, high: int = 60000) -> int:
    for _ in range(200):
        port = random.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}..{high}")


def run_all(commands: list[tuple[list[str], dict[str, str]]], timeout: float = 240) -> list[dict]:
    """Start every command at once; wait for all; the RESULT lines they printed, by rank."""
    procs = [
        subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for cmd, env in commands
    ]
    outputs = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = "\n".join(outputs)
    for p in procs:
        assert p.returncode == 0, text
    # ranks under one torchrun share its stdout: two RESULT lines may land on one line
    decoder = json.JSONDecoder()
    results = [decoder.raw_decode(text, m.end())[0] for m in re.finditer(r"RESULT (?=\{)", text)]
    return sorted(results, key=lambda r: r["rank"])


def check_world(results: list[dict], size: int) -> None:
    assert [r["rank"] for r in results] == list(range(size)), results
    for r in results:
        assert r["size"] == size and r["sum"] == size * (size + 1) / 2, r


def test_srun_tasks_join_without_rank_or_master_variables() -> None:
    port = free_port(15000, 24999)  # derived as 15000 + the job id's last 4 digits
    job = f"9{port - 15000:04d}"
    commands = []
    for rank in range(2):
        env = clean_env(
            SLURM_JOB_ID=job,
            SLURM_STEP_ID="0",
            SLURM_PROCID=str(rank),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(rank),
            SLURM_NODEID="0",
            SLURM_STEP_NODELIST="localhost",
            SLURM_STEP_TASKS_PER_NODE="2",
        )
        commands.append(([sys.executable, str(PROBE)], env))
    results = run_all(commands)
    check_world(results, 2)
    for r in results:
        assert r["env"]["RANK"] == str(r["rank"]) and r["env"]["LOCAL_WORLD_SIZE"] == "2"
        assert r["env"]["MASTER_ADDR"] == "localhost" and r["env"]["MASTER_PORT"] == str(port)


def test_srun_one_task_per_node_runs_plait_run_on_each() -> None:
    """What docs/launching.md's sbatch script does: ``srun --ntasks-per-node=1 plait run -n
    1 train.py`` on two "nodes" (two tasks on this machine): each plait run reads its node
    rank and the master from SLURM_* and hands over to torchrun."""
    port = free_port(15000, 24999)
    job = f"8{port - 15000:04d}"
    commands = []
    for node in range(2):
        env = clean_env(
            SLURM_JOB_ID=job,
            SLURM_STEP_ID="0",
            SLURM_PROCID=str(node),
            SLURM_NTASKS="2",
            SLURM_STEP_NUM_TASKS="2",
            SLURM_STEP_NUM_NODES="2",
            SLURM_LOCALID="0",
            SLURM_NODEID=str(node),
            SLURM_STEP_NODELIST="localhost,localhost",
            SLURM_STEP_TASKS_PER_NODE="1(x2)",
        )
        cmd = [sys.executable, "-m", "plait.cli", "run", "-n", "1", "--grace", "2", str(PROBE)]
        commands.append((cmd, env))
    results = run_all(commands)
    check_world(results, 2)
    assert all(r["env"]["MASTER_PORT"] == str(port) for r in results), results


def test_kubeflow_torch_runtime_pet_variables() -> None:
    """The runtime's command is torchrun, which reads PET_*: 2 ranks in one "pod"; then
    one rank per pod started without torchrun (PET_NPROC_PER_NODE=1)."""
    port = free_port()
    pet = dict(PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port))
    env = clean_env(PET_NNODES="1", PET_NPROC_PER_NODE="2", PET_NODE_RANK="0", **pet)
    results = run_all([([sys.executable, "-m", "torch.distributed.run", str(PROBE)], env)])
    check_world(results, 2)
    assert all(r["elastic"] for r in results)
    port = free_port()
    pet = dict(PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port))
    commands = [
        (
            [sys.executable, str(PROBE)],
            clean_env(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(n), **pet),
        )
        for n in range(2)
    ]
    check_world(run_all(commands), 2)


def test_elastic_c10d_rendezvous_through_plait_run() -> None:
    """``plait run --nnodes 1:2``: torchrun's elastic c10d rendezvous; two agents (two
    "nodes" of one rank each) join one job."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "plait.cli",
        "run",
        "-n",
        "1",
        "--nnodes",
        "1:2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--rdzv-conf",
        "last_call_timeout=60",  # max 2 nodes: it completes as soon as both joined
        "--grace",
        "2",
        str(PROBE),
    ]
    results = run_all([(cmd, clean_env()), (cmd, clean_env())])
    check_world(results, 2)
    assert all(r["elastic"] == f"plait-{port}" for r in results), results
