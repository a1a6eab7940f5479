"""Random streams across a change of world size.

A checkpoint holds, per saving rank s < W, the torch CPU generator state (tensor
``rng/torch/<s>``) and Python ``random``'s state (JSON, ``ranks[s]["python_random"]``).
Loaded by W' ranks, rank r gets:

- ``"saved"`` (r < W): saved rank r's two streams, exactly: it draws what rank r would
  have drawn next had the run not stopped;
- ``"derived"`` (r >= W, a rank the saving run did not have): both generators seeded with
  :func:`derived_seed`, the first 8 bytes of a SHA-256 over the checkpoint's step, every
  saved rank's two states and r. Two resumes of one checkpoint at the same W' therefore
  draw the same numbers, ranks draw different ones, and a derived rank never repeats a
  saved rank's stream (it is not a copy of one).

The streams of saved ranks r >= W' are dropped (their ranks are gone). CUDA generators and
NumPy's global stream are not saved, hence never restored. No communication.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import torch

from plait.checkpoint import layout

SAVED, DERIVED, NONE = "saved", "derived", "none"


def python_state() -> Any:
    return layout.encode_tree(random.getstate(), "python_random", {})


def derived_seed(manifest: dict[str, Any], tensors: dict[str, torch.Tensor], rank: int) -> int:
    """The seed of new rank ``rank``: a hash of the step, every saved rank's torch and
    Python states, and ``rank``; 63 bits (a valid torch seed)."""
    digest = hashlib.sha256(b"plait.checkpoint.rng derived v1")
    digest.update(str(int(manifest["step"])).encode())
    for s, entry in enumerate(manifest["ranks"]):
        digest.update(tensors[f"rng/torch/{s}"].numpy().tobytes())
        digest.update(json.dumps(entry["python_random"], sort_keys=True).encode())
    digest.update(f"rank {rank}".encode())
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def has_streams(manifest: dict[str, Any]) -> bool:
    saved_world = int(manifest["world_size"])
    return all(f"rng/torch/{s}" in manifest["tensors"] for s in range(saved_world)) and all(
        "python_random" in entry for entry in manifest["ranks"]
    )


def restore(manifest: dict[str, Any], tensors: dict[str, torch.Tensor], rank: int) -> str:
    """Set this process's torch CPU and Python generators by the rule above; which rule
    applied (``"saved"``, ``"derived"``, or ``"none"`` if the checkpoint has no streams)."""
    if not has_streams(manifest):
        return NONE
    if rank < int(manifest["world_size"]):
        torch.set_rng_state(tensors[f"rng/torch/{rank}"])
        random.setstate(layout.decode_tree(manifest["ranks"][rank]["python_random"], {}))
        return SAVED
    seed = derived_seed(manifest, tensors, rank)
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    return DERIVED
