"""Planning before spending accelerator hours: memory per rank, step time, and the layout.

- :mod:`plait.plan.memory`: the ZeRO paper's model-state arithmetic (section 3, Figure 1)
  and ``measure`` (here ``measure_memory``: ``plait.plan.measure`` is the subpackage that
  measures this machine), which counts the tensors a rank really holds, to check it against;
- :mod:`plait.plan.model`: a GPT's shape, parameters and FLOPs (Narayanan et al. 2021);
- :mod:`plait.plan.hardware`: clusters (A100, H100, this CPU from ``plait bench calibrate``);
- :mod:`plait.plan.measure.calibrate` (and :mod:`plait.plan.measure.probe`, run on the ranks): this
  machine's collectives per group size on the transport in use, matmul, Adam and dispatch;
- :mod:`plait.plan.layout`: a job and a layout (dp, tp, pp, ep, v, schedule, micro-batch,
  ZeRO, recomputation, SP) and the rules that refuse one, naming the constraint;
- :mod:`plait.plan.activations`: Korthikanti et al.'s activation bytes, with pipelines;
- :mod:`plait.plan.states`: model states per rank under tp/pp/ep and ZeRO;
- :mod:`plait.plan.time`: step time (compute, communication per group, bubble), from the
  pieces of :mod:`plait.plan.costs` (one collective, the dp sync, a simulated pipeline);
- :mod:`plait.plan.search`: every layout, filtered by memory, ranked by time;
- :mod:`plait.plan.report`: table, ``explain``, JSON; :mod:`plait.plan.cli`: ``plait plan``;
- :mod:`plait.plan.tensor_costs`: the bytes of 1D/2D/2.5D/3D tensor parallelism;
- :mod:`plait.plan.measure.execute`: a layout built on real ranks with plait's strategies.
"""

from plait.plan.activations import ActivationMemory, activation_memory, rank_activations
from plait.plan.hardware import Cluster, a100, h100, local_cpu
from plait.plan.layout import Job, Layout, LayoutError, check
from plait.plan.memory import (
    OPTIMIZERS,
    PRECISIONS,
    STRATEGIES,
    MemoryEstimate,
    compare,
    estimate,
    format_table,
)
from plait.plan.memory import measure as measure_memory
from plait.plan.model import ModelSpec, from_gpt_config, from_param_count, published
from plait.plan.report import explain
from plait.plan.search import Plan, SearchResult, SearchSpace, evaluate, search
from plait.plan.states import ModelStates, model_states, rank_states
from plait.plan.time import Overlap, StepTime, step_time

__all__ = [
    "OPTIMIZERS",
    "PRECISIONS",
    "STRATEGIES",
    "ActivationMemory",
    "Cluster",
    "Job",
    "Layout",
    "LayoutError",
    "MemoryEstimate",
    "ModelSpec",
    "ModelStates",
    "Overlap",
    "Plan",
    "SearchResult",
    "SearchSpace",
    "StepTime",
    "a100",
    "activation_memory",
    "check",
    "compare",
    "estimate",
    "evaluate",
    "explain",
    "format_table",
    "from_gpt_config",
    "from_param_count",
    "h100",
    "local_cpu",
    "measure_memory",
    "model_states",
    "published",
    "rank_activations",
    "rank_states",
    "search",
    "step_time",
]
