"""The digits demo's data and model: scikit-learn's 8x8 digits split 80/20
(:func:`load_digits`), the CNN every rank and the oracle build (:func:`build_model`), and
an epoch's global batches, the same on every rank (:func:`global_batches`)."""

from __future__ import annotations

import torch

from plait.data import DistributedSampler
from plait.demo.digits.config import TRAIN_SAMPLES, DemoConfig
from plait.models import DigitsCNN


def load_digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train x, train y, test x, test y): 8x8 images scaled to [0, 1], an 80/20 split."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    if len(train) != TRAIN_SAMPLES:
        raise RuntimeError(
            f"scikit-learn's digits gave {len(train)} training samples, the demo validates "
            f"options against {TRAIN_SAMPLES}: update plait.demo.digits.config.TRAIN_SAMPLES"
        )
    return x[train], y[train], x[test], y[test]


def build_model(seed: int, dtype: str = "float32") -> DigitsCNN:
    torch.manual_seed(seed)
    return DigitsCNN().to(getattr(torch, dtype))


def global_batches(config: DemoConfig, epoch: int) -> list[list[int]]:
    """Epoch ``epoch``'s global batches of training-sample indices: the same shuffled
    order on every rank, cut into ``batch_size`` pieces, the incomplete last one dropped."""
    sampler = DistributedSampler(
        range(TRAIN_SAMPLES), num_replicas=1, rank=0, shuffle=True, seed=config.seed
    )
    sampler.set_epoch(epoch)
    order = sampler.global_order()
    b = config.batch_size
    return [order[i * b : (i + 1) * b] for i in range(len(order) // b)]
