"""A Griffe extension for plait's API page: reStructuredText roles in docstrings
(``:class:`~plait.mesh.Mesh```, ``:func:`prepare```) shown as code (``Mesh``, ``prepare``),
since plait's docstrings are written for reading in the source and in ``help()``."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj|py:\w+):`~?([^`]+)`")


def _plain(match: re.Match[str]) -> str:
    target = match.group(1)
    shown = target.rsplit(".", 1)[-1] if match.group(0).find("`~") >= 0 else target
    return f"`{shown}`"


class RstRoles(griffe.Extension):  # type: ignore[misc]
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_plain, obj.docstring.value)
