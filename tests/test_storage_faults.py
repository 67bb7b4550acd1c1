"""A write that fails (a full disk, an I/O error) keeps the previous version of the file whole
and says which file failed and how to go on; a damaged file is refused by name.

The faults are injected where the bytes go to the disk (``os.write``, ``os.fsync``): the
file objects above them are the ones the run uses. Each test fails if the write it covers
is made in place (not through a temporary file and a rename, or without cutting a failed
append back) or if the checksum is not checked.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
from flwr.app import RecordDict

from client.state import ClientStateStore
from learning.storage import (
    StateCorruptError,
    StorageWriteError,
    append_text,
    atomic_write_text,
    load_arrays_file,
    save_arrays_file,
)
from server.checkpoint import load_checkpoint, save_checkpoint
from server.results import RunRecorder
from server.run_folder import read_rounds


def _full_disk_after(limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on, files write at most ``limit`` more bytes in all, then fail with ENOSPC, as
    a disk that fills up mid-write does (``os.write`` and the file objects ``os.fdopen``
    opens: the two ways learning/storage.py writes)."""
    real_write, real_fdopen, left = os.write, os.fdopen, [limit]

    def write(fd: int, data: bytes) -> int:
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real_write(fd, bytes(data[: left[0]]))
        left[0] -= n
        return n

    class FillingFile:
        def __init__(self, fd: int, *args: object, **kwargs: object) -> None:
            self.file = real_fdopen(fd, *args, **kwargs)   # type: ignore[call-overload]

        def write(self, data: bytes) -> int:
            done = 0
            while done < len(data):
                self.file.flush()
                done += write(self.file.fileno(), bytes(data[done:]))
            return done

        def __getattr__(self, name: str) -> object:
            return getattr(self.file, name)

        def __enter__(self) -> FillingFile:
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.close()

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fdopen", FillingFile)


def test_a_checkpoint_whose_write_hits_a_full_disk_keeps_the_previous_one(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    groups = {"global": {"w": np.arange(4000, dtype=np.float32)}}
    save_checkpoint(tmp_path, 2, groups, {"strategy": "fedavg"})
    _full_disk_after(3000, monkeypatch)      # part of the new file is written, then the disk is full
    with pytest.raises(StorageWriteError) as caught:
        save_checkpoint(tmp_path, 3, {"global": {"w": np.zeros(4000, np.float32)}}, {"strategy": "fedavg"})
    monkeypatch.undo()
    message = str(caught.value)
    assert caught.value.errno == errno.ENOSPC and str(tmp_path / "checkpoint" / "server.npz") in message
    assert "previous version is kept" in message and "pflower run resume=" in message
    rnd, loaded, _ = load_checkpoint(tmp_path, {"strategy": "fedavg"})
    assert rnd == 2 and np.array_equal(loaded["global"]["w"], groups["global"]["w"])
    assert not [p.name for p in (tmp_path / "checkpoint").iterdir() if p.name.startswith(".")]


def test_a_client_state_whose_write_fails_leaves_the_previous_version_on_disk_and_in_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    context = RecordDict()
    store = ClientStateStore(tmp_path / "c1", context)
    store.save({"v": np.full(2000, 1.0)}, {"last_round": 1}, server_round=1, attempt="A")
    _full_disk_after(1000, monkeypatch)
    with pytest.raises(StorageWriteError, match="state-r000002.npz"):
        store.save({"v": np.full(2000, 2.0)}, {"last_round": 2}, server_round=2, attempt="A")
    monkeypatch.undo()
    assert sorted(store.versions()) == [1]
    for cache in (context, None):   # the in-memory copy, then the disk alone
        arrays, meta = ClientStateStore(tmp_path / "c1", cache).load(max_round=2, resumed_from=0, attempt="A")
        assert meta["last_round"] == 1 and arrays["v"][0] == 1.0


def test_an_eio_on_the_rename_keeps_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = tmp_path / "summary.json"
    atomic_write_text(summary, json.dumps({"accuracy_mean": 0.5}))

    def eio(*args: object) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "replace", eio)
    with pytest.raises(StorageWriteError, match="summary.json: Input/output error"):
        atomic_write_text(summary, json.dumps({"accuracy_mean": 0.9}))
    monkeypatch.undo()
    assert json.loads(summary.read_text()) == {"accuracy_mean": 0.5}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_metrics_line_cut_by_a_full_disk_is_removed_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """metrics.jsonl is appended a line per round: a full disk part-way through a line cuts the
    file back to its previous end, and the recorder keeps no record the file does not hold."""
    recorder = object.__new__(RunRecorder)    # the recorder's round log alone (no config, no lock)
    recorder.metrics_path, recorder.rounds, recorder.tensorboard = tmp_path / "metrics.jsonl", [], None
    recorder.cfg, recorder.t0, recorder._last_elapsed = None, 0.0, 0.0
    monkeypatch.setattr(RunRecorder, "_events", lambda self, first_round: None)
    recorder.log_round({"round": 1, "clients": {"0": {"accuracy": 0.5}}})
    before = recorder.metrics_path.read_bytes()
    _full_disk_after(20, monkeypatch)
    with pytest.raises(StorageWriteError, match="metrics.jsonl"):
        recorder.log_round({"round": 2, "clients": {"0": {"accuracy": 0.6}}})
    monkeypatch.undo()
    assert recorder.metrics_path.read_bytes() == before
    assert [r["round"] for r in recorder.rounds] == [r["round"] for r in read_rounds(recorder.metrics_path)] == [1]
    append_text(recorder.metrics_path, json.dumps({"round": 2}) + "\n")   # room again: the next line is whole
    assert [r["round"] for r in read_rounds(recorder.metrics_path)] == [1, 2]


def test_the_metadata_copy_failing_does_not_fail_a_save_that_happened(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The npz holds its own metadata and digest; its json copy is for people. A disk that fills
    between the two leaves a saved, verifiable state and a warning, not a failed round."""
    real = atomic_write_text.__globals__["atomic_write_bytes"]

    def sidecar_fails(path: Path, data: bytes, durable: bool = True) -> None:
        if Path(path).suffix == ".json":
            raise StorageWriteError(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        real(path, data, durable)

    monkeypatch.setitem(save_arrays_file.__globals__, "atomic_write_bytes", sidecar_fails)
    save_arrays_file(tmp_path / "state-r000001.npz", {"w": np.arange(3.0)}, {"last_round": 1})
    assert load_arrays_file(tmp_path / "state-r000001.npz")[0]["w"].tolist() == [0.0, 1.0, 2.0]
    assert "state-r000001.json" in caplog.text and "the file itself is saved" in caplog.text


@pytest.mark.parametrize("damage", ["truncate", "modify"])
def test_a_damaged_client_state_is_refused_by_name_with_the_way_on(tmp_path: Path, damage: str) -> None:
    store = ClientStateStore(tmp_path / "c1")
    store.save({"v": np.arange(4096, dtype=np.float32)}, {"last_round": 1}, server_round=1, attempt="A")
    path = store.path_for(1)
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:    # one bit of one value in an otherwise valid file (zip CRCs too): only the digest finds it
        with np.load(path, allow_pickle=False) as z:
            members = {k: z[k] for k in z.files}
        members["v"][1000] = np.nextafter(members["v"][1000], np.float32(np.inf))
        with path.open("wb") as f:
            np.savez(f, **members)
    with pytest.raises(StateCorruptError) as caught:
        ClientStateStore(tmp_path / "c1").load(max_round=1, resumed_from=0, attempt="A")
    assert str(path) in str(caught.value) and "delete it or restore it" in str(caught.value)
