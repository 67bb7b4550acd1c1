"""Server checkpoints: everything needed to resume a run, written atomically each round.

``<run>/checkpoint/server.npz`` holds every array group of the strategy (global model,
per-client personal arrays, any method state) as ``<group>|<name>`` entries;
``server.json`` beside it holds the npz's SHA-256 plus JSON metadata: the round, the
strategy and model names (a checkpoint from another strategy or model is refused), and
the strategy's RNG and scalar state. Nothing is pickled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from learning.params import NDArrays
from learning.storage import StateCorruptError, load_arrays_file, save_arrays_file

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
    path = Path(run_dir) / CHECKPOINT
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}; was the run started with checkpoint_every > 0?")
    try:
        flat, meta = load_arrays_file(path)
    except StateCorruptError as err:
        raise CheckpointError(f"checkpoint {path} is corrupt: {err}") from err
    for key, value in expect.items():
        if meta.get(key) != value:
            raise CheckpointError(
                f"checkpoint {path} was written with {key}={meta.get(key)!r}, this run has "
                f"{key}={value!r}; resume with the same {key} or start a new run"
            )
    groups: dict[str, NDArrays] = {g: {} for g in meta.get("groups", [])}
    for name, arr in flat.items():
        g, _, k = name.partition(SEP)
        groups.setdefault(g, {})[k] = arr
    return int(meta["round"]), groups, meta
