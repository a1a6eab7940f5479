"""Training strategies: each wraps a model (and optimizer) for one way of parallelising."""

from plait.strategies.comm_hooks import (
    GradBucket,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from plait.strategies.ddp import DistributedDataParallel
from plait.strategies.naive import NaiveDataParallel
from plait.strategies.zero import ZeroOptimizer, prepare_zero

__all__ = [
    "DistributedDataParallel",
    "GradBucket",
    "NaiveDataParallel",
    "ZeroOptimizer",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "prepare_zero",
]
