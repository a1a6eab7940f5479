"""plait: distributed training strategies in readable Python on PyTorch."""

from plait import amp, comm, models, moe, precision
from plait.clip import clip_grad_norm_
from plait.launch.pool import RankError, RankPool, RankTimeout, spawn
from plait.mesh import Mesh
from plait.prepare import prepare
from plait.runtime import destroy_group, init, is_initialized, new_group, shutdown, world
from plait.strategies import (
    DataParallel,
    DistributedDataParallel,
    MixedPrecisionPolicy,
    NaiveDataParallel,
    OffloadPolicy,
    ParameterServer,
    UngatheredParameterError,
    ZeroOptimizer,
    fully_shard,
    pipeline,
)
from plait.strategies.compose import PTDP, compose
from plait.strategies.pipeline import PipelineParallel
from plait.strategies.tensor import parallelize

__version__ = "0.1.0"

__all__ = [
    "DataParallel",
    "DistributedDataParallel",
    "Mesh",
    "MixedPrecisionPolicy",
    "NaiveDataParallel",
    "OffloadPolicy",
    "ParameterServer",
    "PTDP",
    "PipelineParallel",
    "UngatheredParameterError",
    "ZeroOptimizer",
    "prepare",
    "RankError",
    "RankPool",
    "RankTimeout",
    "amp",
    "clip_grad_norm_",
    "comm",
    "compose",
    "destroy_group",
    "fully_shard",
    "models",
    "moe",
    "parallelize",
    "pipeline",
    "precision",
    "init",
    "is_initialized",
    "new_group",
    "shutdown",
    "spawn",
    "world",
]
