"""Durable named-array files: atomic writes, SHA-256 checksums, no pickle.

Used for client private state and server checkpoints. A file ``X.npz`` is one
self-contained, atomically replaced file (``np.savez``, read back with
``allow_pickle=False``): the arrays plus a ``__pflower_meta__`` member holding JSON
metadata and the SHA-256 of the arrays' names, dtypes, shapes and bytes. Because the
file is replaced with one ``os.replace``, a process killed while writing leaves either
the old or the new file, never a mix. ``X.json`` beside it is a human-readable copy of
the metadata with the file's SHA-256 (files written before the embedded digest existed
are verified against it). A truncated or modified file is detected and reported
(:class:`StateCorruptError`), never silently loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np


class StateCorruptError(RuntimeError):
    """A state file failed its checksum or could not be parsed."""


class StorageWriteError(OSError):
    """A file could not be written (a full disk, an I/O error): the previous version of the
    file is still in place, whole, and the error says which file and how to go on."""

    def __init__(self, path: Path, err: OSError) -> None:
        self.path = Path(path)
        super().__init__(err.errno, f"could not write {path}: {err.strerror or err}; its previous "
                         "version is kept, whole. Free space on that disk (or fix the I/O error) and go "
                         "on: a run resumes from its last checkpoint (pflower run resume=<run folder>)")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename, so that a reader sees
    the old file or the new one, never part of one. ``durable``: on disk (fsync) before the
    rename, so that the new file survives a machine crash too; a file derived from another
    (a sidecar) skips it, since a process kill keeps what was written either way."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as err:
        raise StorageWriteError(path, err) from err
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and not isinstance(err, StorageWriteError):
            raise StorageWriteError(path, err) from err
        raise


def append_text(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` whole or not at all: a write that fails part-way (a full
    disk) is cut back to the file's previous end, so a line-per-record file (metrics.jsonl)
    never keeps half a record, and :class:`StorageWriteError` says so."""
    data = text.encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as err:
        raise StorageWriteError(path, err) from err
    try:
        end = os.fstat(fd).st_size
        written = 0
        try:
            while written < len(data):
                written += os.write(fd, data[written:])
        except OSError as err:
            os.ftruncate(fd, end)    # frees blocks: works on a full disk
            raise StorageWriteError(path, err) from err
    finally:
        os.close(fd)


META_MEMBER = "__pflower_meta__"


def arrays_digest(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> str:
    """SHA-256 over the sorted names, dtypes, shapes and raw bytes of ``arrays`` and the
    canonical JSON of ``meta``."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    h.update(json.dumps(meta, sort_keys=True).encode())
    return h.hexdigest()


def save_arrays_file(path: Path, arrays: Mapping[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Write arrays + metadata + digest as one atomically replaced npz, then the json copy."""
    path = Path(path)
    if META_MEMBER in arrays:
        raise ValueError(f"{META_MEMBER!r} is a reserved array name")
    plain = {k: np.asarray(v) for k, v in arrays.items()}
    if any(a.dtype == object for a in plain.values()):
        raise TypeError("object arrays cannot be stored (they would need pickle)")
    header = {"meta": meta, "sha256": arrays_digest(plain, meta)}
    buf = io.BytesIO()
    np.savez(buf, **plain, **{META_MEMBER: np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)})
    data = buf.getvalue()
    atomic_write_bytes(path, data)
    # the json copy is derived (the npz carries its own metadata and digest): written, not
    # synced, and not needed: when it cannot be written the save has still happened, whole
    record = {"sha256": hashlib.sha256(data).hexdigest(), "keys": sorted(plain), "meta": meta}
    try:
        atomic_write_bytes(path.with_suffix(".json"), json.dumps(record, indent=1).encode(), durable=False)
    except StorageWriteError as err:
        logging.getLogger(__name__).warning("%s (a readable copy of %s's metadata; the file itself is saved)",
                                            err, path.name)


def _open_npz(path: Path) -> Any:
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
        raise StateCorruptError(f"{path} fails its checksum: truncated or not an array file ({err}); "
                                "delete it or restore it from a backup") from err


def read_meta(path: Path) -> dict[str, Any]:
    """The metadata of a file written by :func:`save_arrays_file`, without verifying the
    arrays (cheap; use :func:`load_arrays_file` before trusting the arrays)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no state at {path}")
    with _open_npz(path) as z:
        if META_MEMBER in z.files:
            try:
                return dict(json.loads(z[META_MEMBER].tobytes().decode())["meta"])
            except Exception as err:
                raise StateCorruptError(f"{path} fails its checksum: unreadable metadata ({err})") from err
    sidecar = path.with_suffix(".json")
    if not sidecar.is_file():
        raise StateCorruptError(f"{path} has no embedded metadata and no {sidecar.name}")
    return dict(json.loads(sidecar.read_text()).get("meta", {}))


def load_arrays_file(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read and verify a file written by :func:`save_arrays_file`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no state at {path}")
    with _open_npz(path) as z:
        try:
            members = {k: z[k] for k in z.files}
        except Exception as err:  # zip CRC errors, truncated members, bad headers
            raise StateCorruptError(f"{path} fails its checksum: truncated or corrupt ({err}); "
                                    "delete it or restore it from a backup") from err
    if META_MEMBER in members:
        try:
            header = json.loads(members.pop(META_MEMBER).tobytes().decode())
            meta, digest = dict(header["meta"]), str(header["sha256"])
        except Exception as err:
            raise StateCorruptError(f"{path} fails its checksum: unreadable metadata ({err})") from err
        if arrays_digest(members, meta) != digest:
            raise StateCorruptError(f"{path} fails its checksum (modified or damaged); delete it or "
                                    "restore it from a backup")
        return members, meta
    # files written before the digest was embedded: verify against the json sidecar
    meta_path = path.with_suffix(".json")
    if not meta_path.is_file():
        raise StateCorruptError(f"{path} has no embedded checksum and no {meta_path.name}")
    try:
        record = json.loads(meta_path.read_text())
    except json.JSONDecodeError as err:
        raise StateCorruptError(f"{meta_path} is not valid JSON ({err}); delete it to start fresh") from err
    if _sha256(path) != record.get("sha256"):
        raise StateCorruptError(f"{path} fails its checksum (truncated or modified); delete it or "
                                "restore it from a backup")
    return members, record.get("meta", {})


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())
