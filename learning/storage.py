"""Durable named-array files: atomic writes, SHA-256 checksums, no pickle.

Used for client private state and server checkpoints. A file ``X.npz`` holds the arrays
(``np.savez``, read back with ``allow_pickle=False``) and ``X.json`` beside it holds the
npz's SHA-256 and JSON metadata; a truncated or modified file is detected and reported,
never silently loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


class StateCorruptError(RuntimeError):
    """A state file failed its checksum or could not be parsed."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_arrays_file(path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Write arrays (npz) then metadata with the npz checksum (json), both atomically."""
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})
    atomic_write_bytes(path, buf.getvalue())
    record = {"sha256": _sha256(path), "keys": sorted(arrays), "meta": meta}
    atomic_write_bytes(path.with_suffix(".json"), json.dumps(record, indent=1).encode())


def load_arrays_file(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read and verify a file written by :func:`save_arrays_file`."""
    meta_path = path.with_suffix(".json")
    if not path.is_file() or not meta_path.is_file():
        raise FileNotFoundError(f"no state at {path} (expected {path.name} and {meta_path.name})")
    try:
        record = json.loads(meta_path.read_text())
    except json.JSONDecodeError as err:
        raise StateCorruptError(f"{meta_path} is not valid JSON ({err}); delete it to start fresh") from err
    digest = _sha256(path)
    if digest != record.get("sha256"):
        raise StateCorruptError(
            f"{path} fails its checksum (truncated or modified); delete {path.parent} to start "
            "this client fresh, or restore it from a backup"
        )
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (ValueError, OSError) as err:
        raise StateCorruptError(f"{path} cannot be read as arrays: {err}") from err
    return arrays, record.get("meta", {})


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())
