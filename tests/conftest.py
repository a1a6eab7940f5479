"""Shared fixtures: one pool of ranks per world size, reused across tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from plait import RankPool

_pools: dict[tuple[int, str], RankPool] = {}
_started_with: dict[int, list[int]] = {}  # id(pool) -> each rank's threads once started

# A kept rank's threads after any run: what it started with (its main thread, gloo's three
# for the world group, plait's progress and watch threads, torch's intra-op pool) plus
# THREAD_SLACK for service threads that start on first use and stay (torch's inter-op pool,
# one per core; a test that raises torch.set_num_threads; the world group's worker thread
# after an asynchronous collective). What must not grow is what every group costs: gloo
# keeps three threads (a TCP loop and two run loops) per group until it is destroyed, so
# the suite's ~4,000 groups left alive held ~250 threads per rank. The pool destroys a
# run's groups before it answers (plait/launch/pool.py); this checks it after every run.
THREAD_SLACK = 12


def check_threads(pool: RankPool, what: str) -> None:
    """Fail the test whose run left a kept rank with more threads than the bound."""
    now = pool.threads()
    start = _started_with.setdefault(id(pool), now)
    pairs = enumerate(zip(now, start, strict=True))
    over = [(r, n, s) for r, (n, s) in pairs if n > s + THREAD_SLACK]
    if over:
        pool.close()  # the next test gets a fresh pool
        text = ", ".join(f"rank {r}: {n} threads (started with {s})" for r, n, s in over)
        raise AssertionError(
            f"after {what}, kept ranks hold more than their start + {THREAD_SLACK} "
            f"threads: {text}; something the run made (a group, a thread pool) outlived it"
        )


def _pool(world_size: int, env_key: str = "", env: dict[str, str] | None = None) -> RankPool:
    key = (world_size, env_key)
    pool = _pools.get(key)
    if pool is None or pool.closed:
        pool = RankPool(world_size, timeout=60, env=env)
        _pools[key] = pool
        _started_with[id(pool)] = pool.threads()
    return pool


@pytest.fixture(scope="session")
def pool_of() -> Callable[[int], RankPool]:
    """``pool_of(n)``: the kept pool of n ranks itself, for code that takes a pool (the GPT
    demo's ``run(config, pool=...)``) instead of spawning fresh ranks."""
    return _pool


@pytest.fixture(scope="session")
def ranks() -> Iterator[Callable[..., list[Any]]]:
    """``ranks(n, fn, *args, timeout=...)`` runs ``fn`` on a kept pool of n ranks."""

    def run(
        world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120, **kwargs: Any
    ) -> list[Any]:
        pool = _pool(world_size)
        results = pool.run(fn, *args, timeout=timeout, **kwargs)
        check_threads(pool, getattr(fn, "__qualname__", repr(fn)))
        return results

    yield run
    # close the pools side by side: each waits up to a few seconds for its ranks to leave
    with ThreadPoolExecutor(max_workers=max(1, len(_pools))) as closing:
        list(closing.map(RankPool.close, _pools.values()))
    _pools.clear()


# The end-to-end set: whole jobs (a demo in its own processes, `plait run` through a fault
# and a restart, a chain of launchers) that each take 15 s or more of the two cores. `make
# test` leaves them out (`-m "not slow"` in pyproject's addopts) so the suite fits its 15
# minutes; `make test-slow` runs them alone and CI (`.ci/run`) runs both. Nothing is lost:
# every test here still runs on every CI run; what each exercises piece by piece (the
# strategies, the launcher's parts, the checks) is also tested in the main set. Chosen from
# measured durations (node-id prefixes; a parametrized case by its full id).
SLOW: dict[str, str] = {
    "tests/test_demo_tour.py::test_a_short_tour_learns": "the tour end to end: 6 layouts",
    "tests/test_elastic.py::test_restarted_job_equals_uninterrupted": "plait run, kill, restart",
    "tests/test_ddp_faults.py::test_survivor_backward_names_the_failed_peer": "plait run, kill",
    "tests/test_demo.py::test_a_piped_ps_demo": "the PS demo through a pipe",
    "tests/test_collectives.py::test_grid[8]": "every algorithm on 8 ranks",
    "tests/test_exit.py::test_finished_jobs_exit_zero": "plait run jobs ending every way",
    "tests/test_demo_cp.py::test_cp_demo_matches_one_process": "the cp demo's CLI, 4 ways",
    "tests/test_hf_moe_layouts.py::test_ptdp_matches_one_process[qwen3_moe+aux-pp2xdp1xtp1xep2"
    "xcp2-ring-1f1b]": "the widest HF MoE PTD-P layout",
    "tests/test_quickstart.py::": "the README quickstart under plait run",
    "tests/test_ps.py::test_under_plait_run_an_async_job": "plait run, a worker killed",
    "tests/test_failures.py::test_spawn_names_a_rank_that_hangs": "waits out a hang",
    "tests/test_demo.py::test_demo_ps_with_a_straggler": "the PS demo with a straggler",
    "tests/test_demo.py::test_demo_under_a_parameter_server": "the PS demo",
    "tests/test_gpu_script.py::test_quick_": "the GPU suite's CPU pass",
    "tests/test_heartbeat.py::test_the_rank_hosting_the_store_stopped": "waits for heartbeats",
    "tests/test_launch_env.py::test_srun_tasks_join": "srun's variables, fresh processes",
    "tests/test_launch_env.py::test_srun_one_task_per_node": "two plait run jobs as nodes",
    "tests/test_launch_env.py::test_kubeflow_torch_runtime": "torchrun under PET_ variables",
    "tests/test_launch_env.py::test_elastic_c10d_rendezvous": "two elastic agents",
    "tests/test_readme_snippets.py::test_readme_blocks_run_as_written": "the README's HF blocks",
    "tests/test_metrics.py::test_wandb_offline_writes": "wandb in its own process",
    "tests/test_compile.py::test_compiled_forward_has_no_graph_break": "Dynamo, 6 strategies",
    "tests/test_compile.py::test_tensor_parallel_compiled_with_inductor": "a cold inductor build",
    "tests/test_heal_faults.py::": "healing runs, each 4-5 fresh processes and a fault",
    "tests/test_heal_fsdp.py::test_whole_job_": "healing FSDP runs: 4-5 processes, a fault",
    "tests/test_heal_replicas.py::test_job_": "healing PTD-P: 4-8 processes, a fault, a clean run",
    "tests/test_compile.py::test_ptdp_with_compiled_stages_equals_eager": "Dynamo, 2 meshes",
}


# ... and the slowest tests of the rest, by measured time (7.5 s or more each on a quiet 2-core
# machine), one node id a line after its seconds: together about 14 of the main set's 22 minutes.
MEASURED = Path(__file__).with_name("slow_measured.txt")


def measured_slow() -> dict[str, float]:
    """``tests/slow_measured.txt``: node id -> the seconds it took when measured."""
    out: dict[str, float] = {}
    for line in MEASURED.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            seconds, nodeid = line.split(maxsplit=1)
            out[nodeid] = float(seconds)
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    measured = measured_slow()
    for item in items:
        if item.nodeid in measured or any(item.nodeid.startswith(p) for p in SLOW):
            item.add_marker(pytest.mark.slow)
