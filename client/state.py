"""Per-client private state: in ``context.state`` during a run, and on disk every round.

``context.state`` survives rounds within one run but not a SuperNode restart nor a new
run, so every save is also written to disk, as one *version per server round*:
``<state_dir>/state-r000007.npz`` (arrays + JSON metadata + SHA-256, written atomically,
read with ``allow_pickle=False``; see ``learning/storage.py``).

Why versions: a server resumed from its checkpoint of round ``c`` re-runs rounds
``c+1...``, but a client may already have saved state for round ``c+1`` (or later) before
the run was killed. Loading that would make the resumed run differ from an uninterrupted
one. So the server sends ``server-round`` and ``resume-round`` (the checkpoint round it
resumed from, 0 for a fresh run) with every message, and the ClientApp asks for the
newest version that
- was saved at a round <= ``max_round`` (``server-round - 1`` for training: the state
  *before* this round; ``server-round`` for evaluation: the state after it), and
- was saved at a round <= ``resume-round`` or by this very run attempt (``attempt``,
  the Flower run id). Versions from an earlier, interrupted attempt after the
  checkpoint, and state left by an unrelated earlier run of the same name, are ignored.

Retention: saving round ``t`` deletes versions after ``t`` (leftovers of an interrupted
attempt) and keeps, below ``t``, everything after the newest server checkpoint that
surely exists (round ``floor((t-1)/k)*k`` for ``checkpoint_every=k``) plus the newest
version at or before it; with ``k=0`` (no checkpoints) the last two versions are kept.
A corrupt or truncated version raises :class:`StateCorruptError` (the client's round
fails and the server records it); it is never silently replaced by an older version.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from learning.storage import StateCorruptError, load_arrays_file, read_meta, save_arrays_file

STATE_FILE = "state.npz"          # legacy single-file name (still read if no versions exist)
VERSION_RE = re.compile(r"^state-r(\d+)\.npz$")
ROUND_KEY, ATTEMPT_KEY = "_state_round", "_state_attempt"   # bookkeeping in the file metadata


def _user_meta(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k not in (ROUND_KEY, ATTEMPT_KEY)}

__all__ = ["ClientStateStore", "StateCorruptError", "STATE_FILE"]


class ClientStateStore:
    """A client's private state: named arrays (models, logits, coefficients) and JSON-able
    metadata, mirrored in ``context.state`` and versioned on disk by server round."""

    def __init__(self, state_dir: str | Path, context_state: Any | None = None, key: str = "pflower",
                 checkpoint_every: int = 1) -> None:
        self.dir = Path(state_dir)
        self.context_state = context_state
        self.key = key
        self.checkpoint_every = int(checkpoint_every)

    # ---------------------------------------------------------------- versions on disk
    def path_for(self, server_round: int) -> Path:
        return self.dir / f"state-r{int(server_round):06d}.npz"

    @property
    def path(self) -> Path:
        """The newest version on disk (or the legacy file name when there is none)."""
        versions = self.versions()
        return versions[max(versions)] if versions else self.dir / STATE_FILE

    def versions(self) -> dict[int, Path]:
        """Saved versions: server round -> file."""
        if not self.dir.is_dir():
            return {}
        out = {}
        for p in self.dir.iterdir():
            m = VERSION_RE.match(p.name)
            if m:
                out[int(m.group(1))] = p
        return out

    def _usable(self, rnd: int, path: Path, resumed_from: int | None, attempt: str | None) -> bool:
        if resumed_from is None or rnd <= resumed_from:
            return True
        return attempt is not None and str(read_meta(path).get(ATTEMPT_KEY)) == str(attempt)

    def load(self, max_round: int | None = None, resumed_from: int | None = None,
             attempt: str | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Return (arrays, meta) of the newest usable version (see the module docstring);
        empty when there is none. ``None`` arguments mean "no restriction"."""
        cached = self._from_context(max_round, attempt)
        if cached is not None:
            return cached
        versions = self.versions()
        for rnd in sorted(versions, reverse=True):
            if max_round is not None and rnd > max_round:
                continue
            if not self._usable(rnd, versions[rnd], resumed_from, attempt):
                continue
            arrays, meta = load_arrays_file(versions[rnd])
            if rnd == max(versions):  # the cache only ever holds the newest version
                self._to_context(arrays, meta)
            return arrays, _user_meta(meta)
        legacy = self.dir / STATE_FILE
        if not versions and resumed_from is None and legacy.exists():
            arrays, meta = load_arrays_file(legacy)
            return arrays, meta
        return {}, {}

    def save(self, arrays: dict[str, np.ndarray], meta: dict[str, Any], server_round: int | None = None,
             attempt: str | None = None) -> Path:
        """Save the state reached after ``server_round`` (default: ``meta['last_round']``, else
        one past the newest version) and prune old versions."""
        if server_round is None:
            server_round = int(meta.get("last_round", max(self.versions(), default=0) + 1))
        meta = {**meta, ROUND_KEY: int(server_round), ATTEMPT_KEY: None if attempt is None else str(attempt)}
        path = self.path_for(server_round)
        save_arrays_file(path, arrays, meta)
        self._to_context(arrays, meta)
        self.prune(int(server_round))
        return path

    def prune(self, server_round: int) -> None:
        """Delete versions after ``server_round`` and the ones no resume can need."""
        versions = self.versions()
        k = self.checkpoint_every
        floor = ((server_round - 1) // k) * k if k > 0 else server_round - 1
        older = [r for r in versions if r <= floor]
        keep = {r for r in versions if floor < r <= server_round}
        if older:
            keep.add(max(older))
        for rnd, path in versions.items():
            if rnd not in keep:
                path.unlink(missing_ok=True)
                path.with_suffix(".json").unlink(missing_ok=True)
        for tmp in self.dir.glob(".state-r*"):  # a write cut short by a killed process
            tmp.unlink(missing_ok=True)

    # context.state mirror ---------------------------------------------------------
    def _from_context(self, max_round: int | None, attempt: str | None
                      ) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        if self.context_state is None:
            return None
        from flwr.app import ArrayRecord, ConfigRecord

        arr_key, meta_key = f"{self.key}.arrays", f"{self.key}.meta"
        if arr_key not in self.context_state.array_records:
            return None
        rec: ArrayRecord = self.context_state.array_records[arr_key]
        meta_rec: ConfigRecord = self.context_state.config_records[meta_key]
        cached = json.loads(str(meta_rec["json"]))
        if cached.get("state_dir") != str(self.dir):  # another run / state dir: use disk
            return None
        meta = cached.get("meta", {})
        rnd = meta.get(ROUND_KEY)
        if max_round is not None and (rnd is None or int(rnd) > max_round):
            return None
        if attempt is not None and meta.get(ATTEMPT_KEY) not in (None, str(attempt)):
            return None
        from common.protocol import from_record

        return from_record(rec), _user_meta(meta)

    def _to_context(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        if self.context_state is None:
            return
        from flwr.app import ArrayRecord, ConfigRecord

        from common.protocol import to_record

        rec: ArrayRecord = to_record(arrays)
        self.context_state[f"{self.key}.arrays"] = rec
        self.context_state[f"{self.key}.meta"] = ConfigRecord(
            {"json": json.dumps({"state_dir": str(self.dir), "meta": meta})}
        )
