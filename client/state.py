"""Per-client private state: in ``context.state`` during a run, and on disk every round.

``context.state`` survives rounds within one run but not a SuperNode restart nor a new
run, so every save is also written to ``<state_dir>/state.npz`` with a SHA-256 checksum
beside it (``state.json``), atomically (see ``learning/storage.py``). Files are read with
``allow_pickle=False``: state is plain named arrays plus JSON metadata, never a pickle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from learning.storage import StateCorruptError, load_arrays_file, save_arrays_file

STATE_FILE = "state.npz"

__all__ = ["ClientStateStore", "StateCorruptError", "STATE_FILE"]


class ClientStateStore:
    """A client's private state: named arrays (models, logits, coefficients) and JSON-able
    metadata (e.g. last round), mirrored in ``context.state`` and on disk."""

    def __init__(self, state_dir: str | Path, context_state: Any | None = None, key: str = "pflower") -> None:
        self.dir = Path(state_dir)
        self.context_state = context_state
        self.key = key

    @property
    def path(self) -> Path:
        return self.dir / STATE_FILE

    def load(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Return (arrays, meta); empty when this client has no state yet."""
        cached = self._from_context()
        if cached is not None:
            return cached
        if not self.path.exists():
            return {}, {}
        arrays, meta = load_arrays_file(self.path)
        self._to_context(arrays, meta)
        return arrays, meta

    def save(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        save_arrays_file(self.path, arrays, meta)
        self._to_context(arrays, meta)

    # context.state mirror ---------------------------------------------------------
    def _from_context(self) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        if self.context_state is None:
            return None
        from flwr.app import ArrayRecord, ConfigRecord

        arr_key, meta_key = f"{self.key}.arrays", f"{self.key}.meta"
        if arr_key not in self.context_state.array_records:
            return None
        rec: ArrayRecord = self.context_state.array_records[arr_key]
        meta_rec: ConfigRecord = self.context_state.config_records[meta_key]
        meta = json.loads(str(meta_rec["json"]))
        if meta.get("state_dir") != str(self.dir):  # another run / state dir: use disk
            return None
        return {k: v.numpy() for k, v in rec.items()}, meta.get("meta", {})

    def _to_context(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        if self.context_state is None:
            return
        from flwr.app import ArrayRecord, ConfigRecord

        from strategies.protocol import to_record

        rec: ArrayRecord = to_record(arrays)
        self.context_state[f"{self.key}.arrays"] = rec
        self.context_state[f"{self.key}.meta"] = ConfigRecord(
            {"json": json.dumps({"state_dir": str(self.dir), "meta": meta})}
        )
