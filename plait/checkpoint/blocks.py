"""Per-block checksums of safetensors files, and reading byte ranges of them, verified.

A safetensors file is ``u64 N`` (little endian), ``N`` bytes of JSON header, then the data:
the header gives each tensor's ``dtype``, ``shape`` and ``data_offsets`` ``[begin, end)``
relative to the start of the data, laid out row-major. When a checkpoint file is written,
:func:`describe` records in its manifest entry the header's size and SHA-256 and, per
tensor, a block size ``B`` (:func:`block_size`: ``block_bytes``, 1 MiB by default, or finer
for tensors under 64 MiB, never under 16 KiB) and the SHA-256 of each ``B``-byte block of
its bytes (block ``k`` covers the tensor's bytes ``[kB, (k+1)B)``, the last one shorter).

:class:`RangeReader` then reads only what a rank needs: the header (verified), and for each
wanted element range of a tensor the blocks it touches (so at most one block more on each
side), each verified against its digest before any byte of it is used. A flipped bit is
named by file, writer rank, tensor and block; bytes no rank reads are not checked here
(:func:`plait.checkpoint.verify` checks whole files). The reader counts every byte it
reads (``bytes_read``). Reads use ``os.pread``: nothing is unpickled or memory-mapped.

No communication.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from plait.checkpoint.agree import CheckpointCorrupt
from plait.checkpoint.files import sha256_bytes

BLOCK_BYTES = 1 << 20  # default largest checksum block: 1 MiB
MIN_BLOCK_BYTES = 1 << 10  # the smallest ``block_bytes`` accepted
SMALL_BLOCK_BYTES = 16 << 10  # no finer blocks than this unless block_bytes is smaller
BLOCKS_PER_TENSOR = 64  # a tensor below 64 x block_bytes gets finer blocks (16 KiB or more)

#: safetensors dtype names to torch dtypes (those torch can hold on the CPU)
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

#: element ranges ``[start, stop)`` of a flattened tensor; None: the whole tensor
Ranges = list[tuple[int, int]] | None


def split_header(data: bytes | memoryview) -> tuple[int, dict[str, Any]]:
    """``(N, header)`` of a safetensors file's bytes (the data starts at ``8 + N``)."""
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    return n, json.loads(bytes(data[8 : 8 + n]))


def block_digests(view: memoryview, block_bytes: int) -> list[str]:
    return [sha256_bytes(view[a : a + block_bytes]) for a in range(0, len(view), block_bytes)]


def block_size(nbytes: int, block_bytes: int) -> int:
    """The checksum block of a tensor of ``nbytes``: ``block_bytes``, or a smaller power of
    two (not below 16 KiB) so that the tensor has about 64 blocks: a slice of a mid-sized
    tensor then reads little beyond itself, and a large one's manifest entry stays small."""
    target = 1 << max(0, (nbytes // BLOCKS_PER_TENSOR - 1).bit_length())
    return min(block_bytes, max(SMALL_BLOCK_BYTES, target))


def describe(data: bytes, block_bytes: int) -> dict[str, Any]:
    """The manifest fields of a file's bytes: header size and SHA-256, the largest block
    size, and per tensor its block size and block digests."""
    n, header = split_header(data)
    view = memoryview(data)[8 + n :]
    blocks = {}
    for key, entry in header.items():
        if key != "__metadata__":
            begin, end = entry["data_offsets"]
            size = block_size(end - begin, block_bytes)
            blocks[key] = {"bytes": size, "sha256": block_digests(view[begin:end], size)}
    return {
        "header_bytes": 8 + n,
        "header_sha256": sha256_bytes(memoryview(data)[: 8 + n]),
        "block_bytes": block_bytes,
        "blocks": blocks,
    }


def merge(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-empty, non-overlapping ranges (adjacent ones joined)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[0] < r[1]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class RangeReader:
    """Reads tensors, or element ranges of them, out of one committed checkpoint's files,
    verifying each block it reads against the manifest. ``reader``: this rank (named in
    errors). :class:`CheckpointCorrupt` names the file, the rank that wrote it, the rank
    that read it and, for data, the tensor and block."""

    def __init__(self, directory: Path, manifest: dict[str, Any], reader: int) -> None:
        self.directory = directory
        self.files: dict[str, Any] = manifest["files"]
        self.reader = reader
        self.bytes_read = 0
        self._headers: dict[str, tuple[int, dict[str, Any]]] = {}

    def _who(self, name: str) -> str:
        writer = self.files[name]["rank"]
        return f"{self.directory / name} (written by rank {writer}, read by rank {self.reader})"

    def _pread(self, fd: int, length: int, offset: int, name: str) -> bytes:
        data = os.pread(fd, length, offset)
        self.bytes_read += len(data)
        if len(data) != length:
            raise CheckpointCorrupt(
                f"{self._who(name)} ended at byte {offset + len(data)} while reading "
                f"{length} bytes at {offset}: truncated"
            )
        return data

    def _open(self, name: str) -> int:
        entry = self.files[name]
        try:
            fd = os.open(self.directory / name, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{self._who(name)} is missing") from None
        size = os.fstat(fd).st_size
        if size != entry["bytes"]:
            os.close(fd)
            raise CheckpointCorrupt(
                f"{self._who(name)} has {size} bytes, the manifest says {entry['bytes']}: "
                f"truncated or overwritten"
            )
        return fd

    def _header(self, fd: int, name: str) -> tuple[int, dict[str, Any]]:
        if name not in self._headers:
            entry = self.files[name]
            raw = self._pread(fd, entry["header_bytes"], 0, name)
            if sha256_bytes(raw) != entry["header_sha256"]:
                raise CheckpointCorrupt(
                    f"{self._who(name)}: its safetensors header does not match its SHA-256 "
                    f"in the manifest"
                )
            n, header = split_header(raw)
            self._headers[name] = (8 + n, header)
        return self._headers[name]

    def shapes(self, name: str) -> dict[str, list[int]]:
        """The shape of every tensor in file ``name``, from its (verified) header."""
        fd = self._open(name)
        try:
            _, header = self._header(fd, name)
        finally:
            os.close(fd)
        return {k: list(e["shape"]) for k, e in header.items() if k != "__metadata__"}

    def read(self, name: str, wanted: dict[str, Ranges]) -> dict[str, torch.Tensor]:
        """The tensors ``wanted`` of file ``name``, each whole (ranges None) or with only
        the given element ranges filled (the rest zeros). Verifies every block read."""
        fd = self._open(name)
        try:
            start, header = self._header(fd, name)
            return {key: self._tensor(fd, name, start, header, key, r) for key, r in wanted.items()}
        finally:
            os.close(fd)

    def _tensor(
        self, fd: int, name: str, start: int, header: dict[str, Any], key: str, ranges: Ranges
    ) -> torch.Tensor:
        entry = header.get(key)
        recorded = self.files[name]["blocks"].get(key)
        if entry is None or recorded is None or entry["dtype"] not in DTYPES:
            raise CheckpointCorrupt(
                f"{self._who(name)} holds no tensor {key!r} of a known dtype, though the "
                f"manifest places it there"
            )
        dtype, shape = DTYPES[entry["dtype"]], list(entry["shape"])
        begin, end = entry["data_offsets"]
        size = torch.empty(0, dtype=dtype).element_size()
        numel = (end - begin) // size
        block, digests = int(recorded["bytes"]), recorded["sha256"]
        if numel != _numel(shape) or len(digests) != -(-(end - begin) // block):
            raise CheckpointCorrupt(
                f"{self._who(name)}: tensor {key!r} spans {end - begin} bytes for shape "
                f"{shape} ({entry['dtype']}) and {len(digests)} blocks of {block} bytes: the "
                f"header disagrees with the manifest"
            )
        out = torch.zeros(numel, dtype=dtype)
        wanted = [(0, numel)] if ranges is None else merge(ranges)
        if not wanted or numel == 0:
            return out.view(shape)
        target = out.view(torch.uint8)
        # the blocks the element ranges touch, joined into runs read with one pread each
        runs = merge(
            [(a * size // block * block, -(-b * size // block) * block) for a, b in wanted]
        )
        for lo, hi in runs:
            hi = min(hi, end - begin)
            data = memoryview(self._pread(fd, hi - lo, start + begin + lo, name))
            for k in range(lo // block, -(-hi // block)):
                piece = data[k * block - lo : min((k + 1) * block, hi) - lo]
                if sha256_bytes(piece) != digests[k]:
                    a = start + begin + k * block
                    raise CheckpointCorrupt(
                        f"{self._who(name)}: tensor {key!r} block {k} (file bytes {a} to "
                        f"{a + len(piece)}) does not match its SHA-256 in the manifest"
                    )
            for a, b in wanted:
                a, b = max(a * size, lo), min(b * size, hi)
                if a < b:
                    target[a:b] = torch.frombuffer(
                        bytearray(data[a - lo : b - lo]), dtype=torch.uint8
                    )
        return out.view(shape)


def _numel(shape: list[int]) -> int:
    count = 1
    for s in shape:
        count *= s
    return count
