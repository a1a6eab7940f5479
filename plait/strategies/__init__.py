"""Training strategies: each wraps a model (and optimizer) for one way of parallelising."""

from plait.strategies.data_parallel.ddp import DistributedDataParallel
from plait.strategies.data_parallel.grad_sync import NonFiniteGradientError
from plait.strategies.data_parallel.hooks import (
    GradBucket,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from plait.strategies.data_parallel.naive import NaiveDataParallel
from plait.strategies.data_parallel.threaded import DataParallel
from plait.strategies.fsdp import (
    FSDPModule,
    UngatheredParameterError,
    full_state_dict,
    fully_shard,
)
from plait.strategies.fsdp.policies import MixedPrecisionPolicy, OffloadPolicy
from plait.strategies.ps import ParameterServer, WorkerOptimizer
from plait.strategies.zero import ZeroOptimizer, prepare_zero

__all__ = [
    "DataParallel",
    "DistributedDataParallel",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ParameterServer",
    "UngatheredParameterError",
    "WorkerOptimizer",
    "GradBucket",
    "NaiveDataParallel",
    "NonFiniteGradientError",
    "ZeroOptimizer",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "full_state_dict",
    "fully_shard",
    "prepare_zero",
]
