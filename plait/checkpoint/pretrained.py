"""Hugging Face-style safetensors checkpoints, read into and written from any layout.

``load_pretrained(model, path)`` loads ``model.safetensors``, or
``model.safetensors.index.json`` and its shards (what ``save_pretrained(...,
safe_serialization=True)`` writes), or one ``.safetensors`` file, into a model already
prepared under any strategy (plain, DDP, ZeRO-1/2, FSDP/ZeRO-3, tensor, pipeline or expert
parallel, PTD-P: the layout ``prepare(strategy="ptdp")`` returns, its ZeRO master copy
refreshed). Each rank reads only the slices it keeps (``safe_open(...).get_slice(key)[...]``:
``kept.py`` says which; under FSDP the rows covering its flat ranges, ``needs.py``), so a
rank of ``tp``, ``ep`` or FSDP over ``W`` reads about ``1/W`` of the split tensors.

Before any tensor is copied, every rank checks its part against the files' headers and the
ranks agree (one :func:`~plait.checkpoint.agree.gather_json` over ``group``, default the
world): a key the model needs that no file holds, a file key no rank loads, or a shape that
differs, raises the same ``ValueError`` on every rank naming the key, both shapes and the
layout. A tied parameter (an output head sharing the embedding) whose second key the file
leaves out (as ``save_pretrained`` does) is read from the key that is there. Hugging Face
stores stacked experts one tensor per expert (``...experts.<e>.w1.weight``, or
``gate_proj``/``up_proj``/``down_proj``; Mixtral's ``block_sparse_moe``): such files are
read into the model's stacked ``gate_up_proj``/``down_proj``, each rank reading only its
experts.

``save_pretrained(model, directory)`` writes what ``transformers``' ``from_pretrained``
reads: :func:`~plait.checkpoint.full_state_dict` (collective over the layout's groups) and,
on rank 0 of ``group`` only, ``model.safetensors`` (or shards of at most
``max_shard_bytes`` and their index) and the model's ``config.json`` when it has a
``config``. Keys and shapes are the model's own.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.checkpoint import agree
from plait.checkpoint.files import write_bytes_atomic
from plait.checkpoint.full import full_state_dict, pipeline_of, unwrap
from plait.checkpoint.kept import Kept, Read, describe, kept
from plait.checkpoint.needs import _fully_sharded_ranges
from plait.comm.group import Group
from plait.strategies.fsdp import FSDPModule, load_full_state_dict
from plait.strategies.fsdp.state import _slots
from plait.strategies.zero import ZeroOptimizer

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class PretrainedFiles:
    """The tensors of a safetensors checkpoint (one file, or an index and its shards),
    opened lazily; :meth:`read` reads only the slice asked for and counts its bytes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from safetensors import safe_open

        self._safe_open = safe_open
        path = Path(path)
        if path.is_file():
            self.directory = path.parent
            self.where = {k: path.name for k in self._handle(path.name).keys()}
        elif (path / INDEX).is_file():
            self.directory = path
            self.where = dict(json.loads((path / INDEX).read_text())["weight_map"])
        elif (path / SINGLE).is_file():
            self.directory = path
            self.where = {k: SINGLE for k in self._handle(SINGLE).keys()}
        else:
            raise FileNotFoundError(
                f"load_pretrained: {str(path)!r} holds neither {SINGLE} nor {INDEX}, and is "
                f"not a .safetensors file"
            )
        self.bytes_read = 0

    def _handle(self, name: str) -> Any:
        handles = self.__dict__.setdefault("_handles", {})
        if name not in handles:
            handles[name] = self._safe_open(str(self.directory / name), "pt")
        return handles[name]

    def keys(self) -> list[str]:
        return list(self.where)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(self.where[key]).get_slice(key).get_shape())

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        handle = self._handle(self.where[key])
        t = handle.get_tensor(key) if not index else handle.get_slice(key)[index]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def tensor_bytes(self) -> int:
        """The bytes of every tensor in the files (for comparison with :attr:`bytes_read`)."""
        total = 0
        for key, name in self.where.items():
            s = self._handle(name).get_slice(key)
            total += math.prod(s.get_shape()) * _itemsize(s.get_dtype())
        return total


def _itemsize(dtype: str) -> int:
    sizes = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2}
    return sizes.get(dtype, 1 if dtype in ("I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2") else 2)


# --- where a model key's tensor is in the files ---------------------------------------------
@dataclass(frozen=True)
class _Source:
    """A model tensor stored as one file tensor."""

    files: PretrainedFiles
    name: str
    shape: tuple[int, ...]

    @property
    def file_keys(self) -> list[str]:
        return [self.name]

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self.files.read(self.name, index)


@dataclass(frozen=True)
class _PerExpert:
    """A stacked expert weight ``[E, ...]`` stored one tensor per expert, each the
    concatenation of ``parts`` on its dimension 0 (Hugging Face's file layout)."""

    files: PretrainedFiles
    prefix: str  # "model.layers.0.mlp.experts"
    parts: tuple[str, ...]  # ("w1", "w3")
    experts: int
    shape: tuple[int, ...]

    @property
    def file_keys(self) -> list[str]:
        return [self._key(e, p) for e in range(self.experts) for p in self.parts]

    def _key(self, e: int, part: str) -> str:
        return f"{self.prefix}.{e}.{part}.weight"

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        rows = index[0] if index else slice(None)
        if any(s != slice(None) for s in index[1:]):
            raise ValueError(f"{self.prefix}: per-expert files are read by whole experts")
        picked = range(self.experts)[rows]
        return torch.stack(
            [torch.cat([self.files.read(self._key(e, p), ()) for p in self.parts]) for e in picked]
        )


# stacked name -> the per-expert parts Hugging Face writes, in concatenation order
PER_EXPERT = {
    "gate_up_proj": (("w1", "w3"), ("gate_proj", "up_proj")),
    "down_proj": (("w2",), ("down_proj",)),
}
# module names a family's files use instead of the model's (Mixtral's sparse block)
FILE_NAMES = ((".mlp.", ".block_sparse_moe."),)


def source(files: PretrainedFiles, key: str) -> _Source | _PerExpert | None:
    """Where ``key`` (the model's) is in ``files``, or None: under its own name, a family's
    file name (:data:`FILE_NAMES`), or one tensor per expert (:data:`PER_EXPERT`)."""
    names = [key] + [key.replace(a, b) for a, b in FILE_NAMES if a in key]
    for name in names:
        if name in files.where:
            return _Source(files, name, files.shape(name))
    for name in names:
        prefix, _, stacked = name.rpartition(".")
        for parts in PER_EXPERT.get(stacked, ()):
            if all(f"{prefix}.0.{p}.weight" in files.where for p in parts):
                e = 0
                while f"{prefix}.{e}.{parts[0]}.weight" in files.where:
                    e += 1
                one = [files.shape(f"{prefix}.0.{p}.weight") for p in parts]
                rows = sum(s[0] for s in one)
                return _PerExpert(files, prefix, parts, e, (e, rows, *one[0][1:]))
    return None


# --- loading ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PretrainedLoad:
    """What :func:`load_pretrained` did on this rank."""

    bytes_read: int  # tensor bytes read from the files by this rank
    file_bytes: int  # tensor bytes in the files
    layout: str  # the model's layout in words


def _fully_sharded_kept(model: nn.Module) -> list[Kept]:
    """A fully sharded model's tensors as :class:`Kept` entries whose values are full-size
    tensors holding only this rank's flat ranges (zeros elsewhere), for
    ``load_full_state_dict``; ``tensor`` is one placeholder per original parameter (so tied
    keys share it)."""

    ranges = _fully_sharded_ranges(model)
    placeholders: dict[tuple[int, int], torch.Tensor] = {}
    out = []
    for key, unit, i in _slots(model):
        shape = tuple(unit.shapes[i])
        ph = placeholders.setdefault((id(unit), i), torch.empty(0, dtype=unit.shard.dtype))
        out.append(Kept(key, ph, shape, _flat_ranges(shape, ranges.get(key) or [], ph.dtype)))
    for prefix, m in model.named_modules():
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                key = f"{prefix}.{name}" if prefix else name
                out.append(Kept(key, b, tuple(b.shape), lambda read: read(())))
    return out


def _flat_ranges(shape: tuple[int, ...], ranges: list[tuple[int, int]], dtype: torch.dtype) -> Any:
    """Build a full-size tensor with the elements ``ranges`` of its flat form read (the
    rows covering each range), zeros elsewhere."""

    def build(read: Read) -> torch.Tensor:
        full = torch.zeros(shape, dtype=dtype)
        flat = full.view(-1)
        width = math.prod(shape[1:]) if len(shape) > 1 else 1
        for a, b in ranges:
            if b <= a:
                continue
            if not shape:
                return read(()).to(dtype)
            r0, r1 = a // width, -(-b // width)
            rows = read((slice(r0, r1),)).reshape(-1)
            flat[a:b] = rows[a - r0 * width : b - r0 * width]
        return full

    return build


def load_pretrained(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    group: Group | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> PretrainedLoad:
    """Load the safetensors checkpoint at ``path`` into ``model`` under its layout, each
    rank reading only what it keeps (module docstring).

    ``group``: every rank of the model (default: the world). ``optimizer``: a ZeRO-1/2
    optimizer built already, whose wider master copy (parameters below float32) is
    refreshed from the loaded parameters. Collective over ``group``: one
    :func:`~plait.checkpoint.agree.gather_json` (the checks) and nothing else; the data
    moves only from the files.
    """

    ptdp = not isinstance(model, nn.Module) and hasattr(model, "pipe")
    if not isinstance(model, nn.Module) and not ptdp:
        raise TypeError(f"load_pretrained: a {type(model).__name__} is not a module")
    if ptdp and optimizer is None:  # PTD-P's own optimizer: a ZeRO master copy refreshed
        optimizer = getattr(model, "optimizer", None)
    files = PretrainedFiles(path)
    layout = describe(model)
    sharded = isinstance(unwrap(model), FSDPModule)
    entries = _fully_sharded_kept(unwrap(model)) if sharded else kept(model)
    by_tensor: dict[int, list[Kept]] = {}
    for k in entries:
        by_tensor.setdefault(id(k.tensor), []).append(k)
    # a shared parameter's other key, when this rank holds it under one only (a tied head
    # on the last pipeline stage, the embedding on the first)
    pipe = pipeline_of(model if ptdp else unwrap(model))
    aliases: dict[str, str] = dict(getattr(pipe, "aliases", {}))
    problems: list[str] = []
    consumed: set[str] = set()
    plan: list[tuple[Kept, Any]] = []
    for k in entries:
        src = source(files, k.key)
        if src is None:  # a tied parameter's other key may be in the files
            src = next(
                (s for t in by_tensor[id(k.tensor)] if (s := source(files, t.key)) is not None),
                None,
            )
        if src is None and k.key in aliases:
            src = source(files, aliases[k.key])
        if src is None:
            problems.append(f"{k.key!r}: model {k.full_shape}, not in the files")
            continue
        consumed.update(src.file_keys)
        if tuple(src.shape) != tuple(k.full_shape):
            problems.append(f"{k.key!r}: file {tuple(src.shape)}, model {k.full_shape}")
            continue
        plan.append((k, src))
    g = agree.resolve(group)
    verdicts = agree.gather_json({"problems": problems, "consumed": sorted(consumed)}, g)
    every = sorted({p for v in verdicts for p in v["problems"]})
    used = {c for v in verdicts for c in v["consumed"]}
    unexpected = [
        f"{key!r}: file {files.shape(key)}, not in the model"
        for key in files.keys()
        if key not in used
    ]
    if every or unexpected:
        wrong = every + unexpected
        raise ValueError(
            f"load_pretrained: {str(path)!r} does not match the model (layout: {layout}); "
            f"nothing was loaded. {len(wrong)} key(s): {'; '.join(wrong[:8])}"
            f"{' ...' if len(wrong) > 8 else ''}. Build the model from the same config as "
            f"the checkpoint (keys as in the model's state_dict())"
        )
    values = {}
    done: set[int] = set()
    with torch.no_grad():
        for k, src in plan:
            if id(k.tensor) in done and not sharded:
                continue  # a tied parameter, loaded under its first key
            done.add(id(k.tensor))
            value = k.build(src.read)
            if sharded:
                values[k.key] = value
            else:
                k.tensor.copy_(value.to(k.tensor.dtype))
        if sharded:
            load_full_state_dict(unwrap(model), values)
    _refresh_zero(optimizer)
    return PretrainedLoad(files.bytes_read, files.tensor_bytes(), layout)


def _refresh_zero(optimizer: Any) -> None:

    if isinstance(optimizer, ZeroOptimizer) and optimizer.shard.dtype != optimizer.dtype:
        with torch.no_grad():
            optimizer.shard.copy_(optimizer._read_shard())


# --- writing ----------------------------------------------------------------------------------
def save_pretrained(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    group: Group | None = None,
    max_shard_bytes: int | None = None,
    config: Any = None,
) -> Path | None:
    """Write ``model``'s whole state as a Hugging Face-style safetensors checkpoint in
    ``directory`` from any layout (module docstring); returns the file written (the index
    when sharded) on rank 0 of ``group`` (default: the world), None elsewhere.

    Collective: :func:`~plait.checkpoint.full_state_dict` over the layout's groups; only
    rank 0 writes. ``max_shard_bytes``: shards of at most that many tensor bytes (a tensor
    larger than it gets a shard of its own) and ``model.safetensors.index.json``.
    ``config``: what ``config.json`` holds (a ``transformers`` config; default the
    model's ``config``, which a pipeline no longer has: pass it).
    """
    from safetensors.torch import save

    state = full_state_dict(model)
    g = agree.resolve(group)
    if agree.rank_of(g) != 0:
        return None
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
    config = config if config is not None else getattr(unwrap(model), "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        write_bytes_atomic(out / "config.json", config.to_json_string().encode())
    if max_shard_bytes is None:
        write_bytes_atomic(out / SINGLE, save(tensors, metadata={"format": "pt"}))
        return out / SINGLE
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += n
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_bytes_atomic(out / name, save(shard, metadata={"format": "pt"}))
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_bytes_atomic(out / INDEX, json.dumps(index, indent=2).encode())
    return out / INDEX
