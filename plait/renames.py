"""Earlier names that keep working for one release, with a ``DeprecationWarning``.

plait names the module a strategy wraps ``module`` everywhere (PyTorch's word); the
strategies that called it ``model`` accept ``model=`` through :func:`accepts_model`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])


def accepts_model(*, method: bool = False) -> Callable[[F], F]:
    """Let ``fn``'s first argument ``module`` also be passed as ``model=`` (warned).
    ``method``: ``fn`` takes ``self`` first."""

    def decorate(fn: F) -> F:
        given = 2 if method else 1

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if "model" in kwargs:
                if "module" in kwargs or len(args) >= given:
                    raise TypeError(f"{fn.__qualname__}: pass the module once (module=)")
                warnings.warn(
                    f"{fn.__qualname__}: model= is deprecated; pass the module first (or module=)",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs["module"] = kwargs.pop("model")
            return fn(*args, **kwargs)

        return cast(F, wrapper)

    return decorate
