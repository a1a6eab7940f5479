"""``plait demo``: train a small CNN on handwritten digits with N local ranks.

The data are the 8x8 digits that ship inside scikit-learn (1797 images, no download),
split 80/20 into train and test with a fixed seed. The model is the CNN of the seeds
(conv, conv, pool, fc, fc). Every epoch all ranks shuffle the training set the same way
(:meth:`plait.data.DistributedSampler.global_order`) and cut it into global batches of
``batch_size`` samples (the incomplete last one is dropped); each training rank keeps its
rows of every global batch through :func:`plait.data.split_batch` and scales its mean
loss by the returned weight, so the batch need not divide evenly among the ranks. Each
rank trains under the chosen strategy through :func:`plait.prepare` and records a
timeline. The leading rank shows a tqdm progress bar when its output is a terminal (one
line per epoch otherwise, so logs hold no carriage returns) and per-epoch loss,
throughput and test accuracy. At the end the parent writes ``runs/<name>/``:
``report.json``, ``trace.json`` (chrome://tracing or Perfetto) and ``curves.png`` (loss and
accuracy against time).

Options are checked by :func:`validate` before any rank starts; a bad one raises
:class:`DemoOptionError`, one line naming the option and its valid range.

``--reproducible`` trains in layout-invariant mode (:mod:`plait.strategies.reproducible`):
each global batch is cut into micro-batches of ``--microbatch-size`` samples whose
gradients are summed along one fixed tree, so ``--check`` (one process on the same
micro-batches) must find a largest difference of exactly 0, for any ``-n``, strategy
(ddp, zero1, zero2, zero3/fsdp), algorithm and transport.

Without it, ``--check`` also trains the same model in this process in float64 on the
global batches and compares the run with it, against a bound that holds on any CPU: with
``dtype="float64"`` rounding stays far below :data:`FLOAT64_BOUND` (the largest parameter
difference at the end) over any run. In float32 the training amplifies rounding
chaotically (a ReLU or a max-pool tie that flips kicks the trajectory): after 10 epochs one
process summed in another order lands up to 13% of the way training moved from float64,
as far as a run whose one rank scales its gradient by 1.01; after the first epoch it lands
within 1.4e-6 and that run at 1.6e-2. So float32 compares the parameters after the first
epoch (:func:`judge`): their L2 distance to float64, relative to how far training moved
them (:mod:`plait.demo.closeness`), within :data:`NOISE_FACTOR` times the distance
float32 in one process lands at (:func:`float32_noise`, measured in the run).

The parts: :mod:`~plait.demo.digits.config` (options, their checks, the bounds),
:mod:`~plait.demo.digits.data` (the digits, the CNN, the global batches),
:mod:`~plait.demo.digits.train` (:func:`train_rank`, on every rank),
:mod:`~plait.demo.digits.check` (the oracle and :func:`judge`),
:mod:`~plait.demo.digits.report` (:func:`run`, :func:`summarize`, :class:`DemoReport`).
"""

from __future__ import annotations

from plait.demo.digits.check import float32_noise, judge, oracle
from plait.demo.digits.config import (
    DTYPES,
    FLOAT64_BOUND,
    NOISE_FACTOR,
    PS_MODES,
    REPRODUCIBLE,
    STRATEGIES,
    TRAIN_SAMPLES,
    DemoConfig,
    DemoOptionError,
    judged_after_epoch_1,
    push_lr,
    reproducible_options,
    validate,
)
from plait.demo.digits.data import build_model, global_batches, load_digits
from plait.demo.digits.report import DemoReport, check_passed, comm_traced, run, summarize
from plait.demo.digits.train import EpochStats, train_rank

__all__ = [
    "DTYPES",
    "DemoConfig",
    "DemoOptionError",
    "DemoReport",
    "EpochStats",
    "FLOAT64_BOUND",
    "NOISE_FACTOR",
    "PS_MODES",
    "REPRODUCIBLE",
    "STRATEGIES",
    "TRAIN_SAMPLES",
    "build_model",
    "check_passed",
    "comm_traced",
    "float32_noise",
    "global_batches",
    "judge",
    "judged_after_epoch_1",
    "load_digits",
    "oracle",
    "push_lr",
    "reproducible_options",
    "run",
    "summarize",
    "train_rank",
    "validate",
]
