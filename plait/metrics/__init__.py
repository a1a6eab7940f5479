"""Metrics every run can show: one call a step, one small all-reduce, rank 0 writes.

::

    from plait.metrics import Metrics

    metrics = Metrics(model=model, seq_len=64, total=steps, tensorboard=True)
    for step in range(steps):
        with metrics.data():
            x = next(batches)
        loss = train_step(x)
        metrics.step(loss, tokens=x.numel())  # the global batch's tokens
    metrics.close()

- :mod:`plait.metrics.meter`: :class:`Metrics` (timing, the reduction, the record);
- :mod:`plait.metrics.flops`: model FLOPs per token (the planner's count) and the
  device's peak (the planner's hardware table, or measured);
- :mod:`plait.metrics.probes`: peak memory and the bytes sent per group;
- :mod:`plait.metrics.writers`: JSON lines, TensorBoard, W&B (offline), a tqdm bar.
"""

from plait.metrics.flops import device_peak, flops_per_token, model_spec
from plait.metrics.meter import Metrics
from plait.metrics.writers import scalars, to_tensorboard

__all__ = ["Metrics", "device_peak", "flops_per_token", "model_spec", "scalars", "to_tensorboard"]
