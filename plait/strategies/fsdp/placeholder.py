"""Between gathers a unit's parameters are placeholders: meta tensors of their shape.

Shape, dtype and ``repr`` work; computing with one (mixed with real tensors) raises
:class:`UngatheredParameterError` naming the parameter and its unit. No communication.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten


class UngatheredParameterError(RuntimeError):
    """Code computed with a unit's parameter while the unit was not gathered (outside the
    unit's own forward and backward), so the parameter was a placeholder."""


class _Placeholder(torch.Tensor):
    """A parameter between gathers: a meta tensor (no memory) whose metadata queries work
    (shape, dtype, repr). An operation mixing it with real tensors raises
    UngatheredParameterError naming it: PyTorch would not always refuse it, a CPU
    ``F.linear(x, meta_weight)`` returns uninitialized memory without an error."""

    parameter_name = "?"  # set per instance by fully_shard: where the parameter lives
    unit_path = "?"

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        with torch._C.DisableTorchFunctionSubclass():
            mixed = any(isinstance(t, torch.Tensor) and not t.is_meta for t in flat)
        if mixed:
            raise UngatheredParameterError(_placeholder_message(func, flat))
        out = super().__torch_function__(func, types, args, kwargs)
        source = next(t for t in flat if isinstance(t, _Placeholder))
        for t in tree_flatten(out)[0]:  # a view or cast of a placeholder keeps its names
            if isinstance(t, _Placeholder) and t is not source:
                t.parameter_name, t.unit_path = source.parameter_name, source.unit_path
        return out


def _placeholder_message(func: Any, flat: list[Any]) -> str:
    used = [t for t in flat if isinstance(t, _Placeholder)]
    names = ", ".join(repr(t.parameter_name) for t in used)
    unit_paths = list(dict.fromkeys(t.unit_path for t in used))
    units = ", ".join(repr(u) for u in unit_paths)
    what = getattr(func, "__name__", None) or repr(func)
    return (
        f"fully_shard: {what} computed with parameter{'s' * (len(used) > 1)} {names} while "
        f"unit{'s' * (len(unit_paths) > 1)} {units} {'were' if len(unit_paths) > 1 else 'was'} "
        f"not gathered (the value is a 'meta' placeholder). A unit's parameters are gathered "
        f"only while its own forward (and its backward) runs; if its parent reads them "
        f"without calling it (as nn.MultiheadAttention reads out_proj.weight), do not make "
        f"{units} a unit: make a module enclosing it and its reader the unit instead (e.g. "
        f"wrap={{nn.TransformerEncoderLayer}} rather than wrap={{nn.Linear}})"
    )
