"""Data partitioning: which samples each rank reads, and how a batch is cut among ranks.

``DistributedSampler`` (``sampler.py``) splits a dataset's indices among ranks, epoch by
epoch, and resumes mid-epoch even on a different number of ranks. ``split_batch``
(``split.py``) cuts one global batch into per-rank row blocks with the loss weight that keeps
gradients exact. Neither communicates: every rank computes its share from the same seed or
the same batch. ``split_features`` (``features.py``) cuts every sample's features among
ranks instead, for a row-parallel first layer.
"""

from plait.data.features import feature_range, split_features
from plait.data.sampler import DistributedSampler
from plait.data.split import BatchShard, split_batch

__all__ = ["BatchShard", "DistributedSampler", "feature_range", "split_batch", "split_features"]
