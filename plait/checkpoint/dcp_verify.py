"""Is a ``torch.distributed.checkpoint`` (DCP) directory complete?

DCP stores no checksums, so what can be checked is completeness, from ``.metadata`` and the
files' sizes: every tensor's chunks lie inside its shape, do not overlap and cover it;
every stored item (a tensor chunk or a pickled value) has an entry naming its file, and
that file exists and is long enough. ``plait.checkpoint.verify(directory)`` calls
:func:`verify_dcp` for a directory holding ``.metadata``. No communication; no tensor is
read.
"""

from __future__ import annotations

import math
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)

METADATA = ".metadata"


def is_dcp(directory: str | Path) -> bool:
    """``directory`` holds DCP's ``.metadata`` file."""
    return (Path(directory) / METADATA).is_file()


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return all(
        oa < ob + sb and ob < oa + sa
        for oa, sa, ob, sb in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
    )


def _tensor_problems(fqn: str, md: TensorStorageMetadata) -> list[str]:
    size = tuple(md.size)
    problems = []
    covered = 0
    for c in md.chunks:
        if len(c.offsets) != len(size) or any(
            o < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, size, strict=True)
        ):
            problems.append(
                f"{fqn!r}: chunk at {tuple(c.offsets)} of {tuple(c.sizes)} lies outside its "
                f"shape {size}"
            )
        covered += math.prod(c.sizes)
    chunks = sorted(md.chunks, key=lambda c: tuple(c.offsets))
    for i, a in enumerate(chunks):
        for b in chunks[i + 1 :]:
            if _overlap(a, b):
                problems.append(
                    f"{fqn!r}: chunks at {tuple(a.offsets)} and {tuple(b.offsets)} overlap"
                )
    if covered != math.prod(size) and not problems:
        problems.append(
            f"{fqn!r}: its chunks hold {covered} of its {math.prod(size)} elements "
            f"(shape {size}): a rank's part is missing"
        )
    return problems


def verify_dcp(directory: str | Path) -> list[str]:
    """The problems of the DCP checkpoint in ``directory`` (module docstring); empty if it
    is complete. Any single process may call it."""
    path = Path(directory)
    try:
        md = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # unreadable or missing .metadata: say so, do not raise
        return [f"{path / METADATA}: cannot be read ({type(exc).__name__}: {exc})"]
    problems: list[str] = []
    stored = md.storage_data or {}
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            problems += _tensor_problems(fqn, entry)
            indices = [MetadataIndex(fqn, c.offsets) for c in entry.chunks]
        else:
            indices = [MetadataIndex(fqn)]
        problems += [
            f"{fqn!r}: no stored item for the chunk at {tuple(i.offset or ())}"
            for i in indices
            if i not in stored
        ]
    sizes: dict[str, int | None] = {}
    truncated: set[str] = set()
    for index, info in stored.items():
        name = str(info.relative_path)
        if name not in sizes:
            file = path / name
            sizes[name] = file.stat().st_size if file.is_file() else None
            if sizes[name] is None:
                problems.append(f"{file}: missing (it holds {index.fqn!r} and maybe more)")
        have = sizes[name]
        if have is not None and info.offset + info.length > have and name not in truncated:
            truncated.add(name)
            problems.append(
                f"{path / name}: {have} bytes, but {index.fqn!r} is stored at bytes "
                f"{info.offset} to {info.offset + info.length}: the file is truncated"
            )
    return problems
