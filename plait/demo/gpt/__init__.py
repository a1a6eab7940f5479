"""``plait demo --model gpt``: the reference GPT on Python's own documentation, on a mesh.

The text is Python's reference topics (``pydoc_data``, no download), tokenised by character
(:mod:`plait.models.text`); the first 90% trains, the last 10% is held out. Every step draws
one global batch of ``batch_size`` random windows (the same on every rank, seeded by the
step), and the world is laid out as ``Mesh(dp=n/tp, tp=tp)``:

- ``tp`` ranks hold one tensor-parallel model (:func:`plait.prepare` with ``strategy="tp"``:
  attention heads and the MLP split, vocabulary-parallel embedding, head and loss; with
  ``sp`` also sequence parallelism) and see the same rows;
- ``dp`` replicas each take ``batch_size / dp`` rows and average their gradients with
  plait's DDP on the ``dp`` group (tp = 1 is plain DDP).

With ``pp`` the world is ``Mesh(pp=n)`` instead: the GPT cut into ``pp`` stages trained by a
pipeline schedule (``schedule``, ``microbatches``; :class:`plait.strategies.pipeline.
PipelineParallel`), and the report adds the measured bubble of the last step beside the
simulated one and the formula. With ``moe`` every second MLP is a GShard mixture of
``experts`` experts, the world is ``Mesh(ep=ep, dp=n/ep)`` (:mod:`plait.moe`, ``strategy="ep"``),
and the report adds the load statistics and ``moe_load.png`` (tokens per expert over training).
With ``cp`` the world is ``Mesh(dp=n/(cp*tp), cp=cp, tp=tp)``: context parallelism
(``context`` ring or Ulysses attention over cp, :mod:`plait.demo.context`), and the report
adds the attention bytes counted on cp against the formula (a difference fails the demo).
Composing pp, tp and ep with each other, or cp with pp or ep, is not supported by the demo
(refused up front).

The leading rank prints progress (a tqdm bar on a terminal, one line per evaluation point
otherwise): training loss, held-out loss and tokens per second. At the end the parent
writes ``runs/<name>/``: ``report.json`` (history, bytes sent per mesh dimension, parameter
bytes per rank, a text sample), ``trace.json`` and ``curves.png`` (training and held-out
loss against time), and prints a paragraph the trained model writes from a prompt.

``--check`` trains the dense GPT in this process in float64 from the same start on the same
global batches and compares the run with it (:func:`judge`; the run's parameters through
:func:`plait.checkpoint.full_state_dict`), against bounds that hold on any CPU. In float64
the largest parameter difference must stay within :data:`FLOAT64_BOUND`. In float32 Adam
amplifies rounding (an element whose gradient is near zero steps by about lr whatever its
sign), so a largest elementwise difference is chaotic; the check takes the parameters' L2
distance relative to how far training moved them (:mod:`plait.demo.closeness`) and every
step's loss, each within :data:`NOISE_FACTOR` times what float32 shows in one process
(:func:`float32_noise`, measured in the run).

The parts: :mod:`~plait.demo.gpt.data` (the text, the batches),
:mod:`~plait.demo.gpt.train` (:func:`train_rank`, on every rank),
:mod:`~plait.demo.gpt.check` (the oracle, :func:`judge`, the verdict),
:mod:`~plait.demo.gpt.report` (:func:`run`, :func:`summarize`, :class:`GPTDemoReport`).
"""

from __future__ import annotations

from plait.demo.gpt.check import (
    FLOAT64_BOUND,
    LOSS_ULPS,
    NOISE_FACTOR,
    Float32Noise,
    check_lines,
    check_passed,
    float32_noise,
    judge,
    judged_value,
    loss_floor,
    max_loss_diff,
    oracle,
    oracle_losses,
    summation_orders,
)
from plait.demo.gpt.data import PROMPT, corpus, global_batch, held_out_windows
from plait.demo.gpt.report import (
    GPTDemoReport,
    describe,
    last_step,
    metrics_line,
    run,
    sample,
    summarize,
)
from plait.demo.gpt.train import Point, train_rank

# the options, read here by earlier callers
from plait.demo.options import GPTDemoConfig, validate

__all__ = [
    "FLOAT64_BOUND",
    "Float32Noise",
    "GPTDemoConfig",
    "GPTDemoReport",
    "LOSS_ULPS",
    "NOISE_FACTOR",
    "PROMPT",
    "Point",
    "check_lines",
    "check_passed",
    "corpus",
    "describe",
    "float32_noise",
    "global_batch",
    "held_out_windows",
    "judge",
    "judged_value",
    "last_step",
    "loss_floor",
    "max_loss_diff",
    "metrics_line",
    "oracle",
    "oracle_losses",
    "run",
    "sample",
    "summarize",
    "summation_orders",
    "train_rank",
    "validate",
]
