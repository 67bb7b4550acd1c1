"""Server checkpoints: everything needed to resume a run, written atomically each round.

``<run>/checkpoint/server.npz`` holds every array group of the strategy (global model,
per-client personal arrays, any method state) as ``<group>|<name>`` entries, plus the
server process's global RNG states (group ``_rng``: torch; numpy and Python ``random`` in
the metadata), and embedded JSON metadata with a SHA-256 over everything: the round, the
strategy, model, dataset, seed and number of clients (a checkpoint from another
configuration is refused), and the strategy's own RNG and scalar state
(``strategy_state``). The file is replaced atomically, so a run killed while writing
keeps the previous checkpoint; ``server.json`` beside it is a readable copy of the
metadata. Nothing is pickled (``np.load(..., allow_pickle=False)``).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np

from learning.params import NDArrays
from learning.storage import StateCorruptError, load_arrays_file, read_meta, save_arrays_file

CHECKPOINT = Path("checkpoint") / "server.npz"
SEP = "|"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or belongs to another run configuration."""


def save_checkpoint(run_dir: Path, server_round: int, groups: dict[str, NDArrays],
                    meta: dict[str, Any]) -> Path:
    flat = {f"{g}{SEP}{k}": v for g, arrays in groups.items() for k, v in arrays.items()}
    path = run_dir / CHECKPOINT
    save_arrays_file(path, flat, {**meta, "round": int(server_round), "groups": sorted(groups)})
    return path


def load_checkpoint(run_dir: Path, expect: dict[str, Any]) -> tuple[int, dict[str, NDArrays], dict[str, Any]]:
    """Load and verify; ``expect`` (e.g. strategy, model, dataset names) must match."""
    flat, meta = _read_verified(Path(run_dir) / CHECKPOINT, expect)
    groups: dict[str, NDArrays] = {g: {} for g in meta.get("groups", [])}
    for name, arr in flat.items():
        g, _, k = name.partition(SEP)
        groups.setdefault(g, {})[k] = arr
    return int(meta["round"]), groups, meta


def _read_verified(path: Path, expect: dict[str, Any]) -> tuple[NDArrays, dict[str, Any]]:
    """Read a checkpoint, verify its checksum and that it belongs to this run (``expect``)."""
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}; was the run started with checkpoint_every > 0?")
    try:
        flat, meta = load_arrays_file(path)
    except StateCorruptError as err:
        raise CheckpointError(f"checkpoint {path} is corrupt: {err}") from err
    _check_identity(path, meta, expect)
    return flat, meta


def _check_identity(path: Path, meta: dict[str, Any], expect: dict[str, Any]) -> None:
    for key, value in expect.items():
        if meta.get(key) != value:
            raise CheckpointError(
                f"checkpoint {path} was written with {key}={meta.get(key)!r}, this run has "
                f"{key}={value!r}; resume with the same {key} or start a new run"
            )


def check_checkpoint(run_dir: Path, expect: dict[str, Any], rounds: int | None = None) -> int:
    """Verify (checksum and identity) the checkpoint of ``run_dir`` before anything starts;
    returns its round. Raises :class:`CheckpointError` with a message for the user."""
    path = Path(run_dir) / CHECKPOINT
    _, meta = _read_verified(path, expect)
    last = int(meta["round"])
    if rounds is not None and last > rounds:
        raise CheckpointError(f"checkpoint {path} is at round {last}, beyond rounds={rounds}; "
                              f"resume with rounds >= {last}")
    return last


def checkpoint_round(run_dir: Path) -> int | None:
    """The round of ``run_dir``'s checkpoint (unverified), or None if there is none."""
    path = Path(run_dir) / CHECKPOINT
    try:
        return int(read_meta(path)["round"])
    except (FileNotFoundError, StateCorruptError, KeyError, ValueError):
        return None


def another_instruction_set(meta: dict[str, Any], here: str) -> str | None:
    """Why a resume here will not match the uninterrupted run to the last bit, or None when
    the checkpoint was written with the same CPU instruction set (or did not record one)."""
    written = meta.get("cpu_capability")
    if written is None or written == here:
        return None
    return (f"this machine's CPU kernels use {here}, the checkpoint's machine used {written}: the run goes "
            f"on correctly, but its numbers from here differ in the last bits from an uninterrupted "
            f"run's (and, over hundreds of rounds, by a few test images)")


def rng_state_groups() -> tuple[NDArrays, dict[str, Any]]:
    """The server process's global RNG states (torch as an array; numpy and Python's
    ``random`` as JSON), so methods that draw from them resume identically."""
    import torch

    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    meta = {"numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "python": [py_version, list(py_internal), py_gauss]}
    return {"torch": torch.get_rng_state().numpy().copy()}, meta


def restore_rng_state(arrays: NDArrays, meta: dict[str, Any]) -> None:
    import torch

    if "torch" in arrays:
        torch.set_rng_state(torch.from_numpy(np.asarray(arrays["torch"], dtype=np.uint8).copy()))
    if "numpy" in meta:
        name, keys, pos, has_gauss, cached = meta["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "python" in meta:
        version, internal, gauss = meta["python"]
        random.setstate((version, tuple(internal), gauss))
