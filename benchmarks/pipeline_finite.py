"""The pipeline's ``check_finite`` flags on a CPU: read per tensor on the host (gloo's
default) against kept on the device and read once (NCCL's and the fake backend's),
side by side in one run, medians.

    PYTHONPATH=. python benchmarks/pipeline_finite.py [--repeat 30]

Times the per-rank work of one step of a GPT-2-small stage (6 blocks, float32
gradients) with 8 micro-batches watched: the flags, not the all-reduce (the same on both
paths).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from plait.strategies.data_parallel.grad_sync import bucket_is_finite
from plait.strategies.pipeline.finite import Positions, forward_flag, gradient_flag, write_first

D, BLOCKS, MICRO, ROWS = 768, 6, 8, 4 * 1024


def tensors() -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    grads = []
    for _ in range(BLOCKS):
        for shape in [(3 * D, D), (3 * D,), (D, D), (D,), (4 * D, D), (4 * D,), (D, 4 * D)]:
            grads.append(torch.randn(*shape, generator=g))
        grads += [torch.randn(D, generator=g) for _ in range(5)]
    acts = [(torch.randn(ROWS, D, generator=g), torch.randn(ROWS, D, generator=g))] * MICRO
    return grads, acts


def host(grads: list[torch.Tensor], acts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    first = None
    for mb, (x, y) in enumerate(acts):  # the runtime's _watch, per forward
        if first is None and not bucket_is_finite(y) and bucket_is_finite(x):
            first = mb
    next((i for i, t in enumerate(grads) if not bucket_is_finite(t)), None)


def device(grads: list[torch.Tensor], acts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    positions, row = Positions(), torch.zeros(4, dtype=torch.int64)
    flags = [forward_flag(x, y) for x, y in acts]
    write_first(row[0:2], flags, positions.of([(1, mb) for mb in range(MICRO)], 2, row.device))
    grad = [gradient_flag(t) for t in grads]
    write_first(row[2:3], grad, positions.of([(i,) for i in range(len(grads))], 1, row.device))
    bool(row.any())  # the one read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    grads, acts = tensors()
    mb = sum(t.numel() for t in grads) * 4 / 2**20
    times: dict[str, list[float]] = {"host": [], "device": []}
    for _ in range(args.repeat):
        for name, fn in (("host", host), ("device", device)):
            t0 = time.perf_counter()
            fn(grads, acts)
            times[name].append(time.perf_counter() - t0)
    print(f"{len(grads)} gradients ({mb:.0f} MiB float32), {MICRO} forwards of {ROWS}x{D}")
    for name, ts in times.items():
        print(f"{name:>7}: median {statistics.median(ts) * 1e3:.2f} ms")
    ratio = statistics.median(times["device"]) / statistics.median(times["host"])
    print(f"device / host: {ratio:.2f}")


if __name__ == "__main__":
    main()
