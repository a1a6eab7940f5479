"""The digits CNN of the seeds: conv, conv, pool, fc, fc (8x8 single-channel images)."""

from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """conv(1->16) relu, conv(16->32) relu, max-pool 2, fc(512->64) relu, fc(64->10)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))
