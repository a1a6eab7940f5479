"""Argument types for the command line: numbers out of range are refused by argparse
(exit 2, naming the option and the range) before any work starts, instead of printing
negative byte counts or spinning on a model of 1e30 parameters."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def whole(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in ``[low, high]`` (no upper end when None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low or (high is not None and value > high):
            span = f"at least {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"expected a whole number {span}, got {value}")
        return value

    parse.__name__ = "whole number"
    return parse


def real(low: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number at least ``low`` (above it when ``above``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (above and value == low):
            span = f"above {low:g}" if above else f"at least {low:g}"
            raise argparse.ArgumentTypeError(f"expected a finite number {span}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


POSITIVE = whole(1)
NONNEGATIVE = whole(0)
