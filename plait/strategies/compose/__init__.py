"""Strategies composed on one mesh.

- ``ptdp``: :func:`compose` / :class:`PTDP`, tensor (+ sequence) parallelism over ``tp``,
  pipeline stages over ``pp``, data parallelism (plain or ZeRO-1/2) over ``dp``;
  :func:`prepare_ptdp` is ``plait.prepare(..., strategy="ptdp")``.
- ``check``: the layouts refused up front, naming the constraint.
- ``agreement``: settings, structure and weights agreed by every rank before the first
  collective.
- ``gradients``: the gradients between backward and the optimizer step: averaged over the
  replicas, checked for non-finite values on the whole mesh, clipped by the global norm.
- ``dense``: which rank counts which element of the dense gradient; the dense state dict
  assembled from any layout.
- ``experts``: MoE blocks, experts split over the mesh's ``ep`` dimension (carved out of
  data parallelism), the micro-batch bookkeeping that keeps them equal to one process.
- ``reproducible``: ``reproducible=True`` for dp x pp (tp = 1): what is refused by name
  and the tree-ordered reduction over dp that keeps one process's bits.
- ``scaling``: loss scaling with :class:`plait.amp.DynamicLossScaler`, the found-inf flag
  agreed over the mesh.
- ``state``: the dense model and optimizer state of any layout, checkpoints through
  :mod:`plait.checkpoint`, loaded into any layout.
"""

from plait.strategies.compose.check import Sizes, check_batch, check_layout
from plait.strategies.compose.dense import DenseIndex
from plait.strategies.compose.ptdp import PTDP, compose, prepare_ptdp

__all__ = ["PTDP", "DenseIndex", "Sizes", "check_batch", "check_layout", "compose", "prepare_ptdp"]
