"""An on-disk cache of each client's data split, so a ClientApp process loads only its own.

Why: in a deployment Flower starts one ``flwr-clientapp`` process per message, and building
the federated dataset (importing scikit-learn / torchvision, transforming every domain,
partitioning) is paid by every one of them (measured in docs/benchmarks.md). The first
process on a machine builds the whole dataset once and writes every client's split; every
later process reads its own split, with no scikit-learn or torchvision import.

Layout: ``<cache_dir>/<key>/info.json`` (name, classes, input shape, client ids) and
``<cache_dir>/<key>/<client id>.npz`` (x/y of train, val, test, the global sample ids,
class weights; written atomically with a checksum by ``learning/storage.py``). ``key``
is the SHA-256 of the resolved dataset config, the seed and the source of the modules
that build the data, so a change to any of them is a new key, never a stale split.

Only in-memory sources are cached (``digits``, ``mnist5k``, ``digit-sources``, the
torchvision sets): an ``imagefolder`` split reads its images from the tree on demand, so
it is built as before. A cache file that fails its checksum is rebuilt (it is derived
data; nothing is lost).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from learning.datasets.federated import (
    ClientSplit,
    FederatedData,
    _freeze,
    _plain,
    load_federated_data,
)
from learning.datasets.sources import CropFlip, tensor_view
from learning.storage import (
    StateCorruptError,
    atomic_write_text,
    load_arrays_file,
    save_arrays_file,
)

log = logging.getLogger(__name__)
_SOURCES = ("config.py", "federated.py", "partition.py", "pools.py", "splits.py", "sources.py", "cache.py",
            "../typed.py")   # the code a split depends on
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class DataInfo:
    """What a client needs to know about the whole dataset besides its own split."""

    name: str
    num_classes: int
    input_shape: tuple[int, int, int]
    client_ids: tuple[str, ...]
    new_client_ids: tuple[str, ...]


def default_cache_dir() -> Path:
    """``$PFLOWER_DATA_CACHE``, else ``$XDG_CACHE_HOME/pflower/data``, else
    ``~/.cache/pflower/data``."""
    if os.environ.get("PFLOWER_DATA_CACHE"):
        return Path(os.environ["PFLOWER_DATA_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "pflower" / "data"


def resolve_cache_dir(setting: str) -> Path | None:
    """The ``data_cache`` config key: ``auto`` (:func:`default_cache_dir`), ``off``, or a path."""
    setting = str(setting or "off").strip()
    if setting.lower() in ("off", "none", "false", "0"):
        return None
    return default_cache_dir() if setting == "auto" else Path(setting).expanduser()


def cache_key(dataset_cfg: Mapping[str, Any], seed: int) -> str:
    h = hashlib.sha256(_freeze(_plain(dataset_cfg)).encode())
    h.update(f"\0seed={int(seed)}\0torch={torch.__version__}\0".encode())
    h.update(_sources_digest())
    return h.hexdigest()[:24]


@functools.cache
def _sources_digest() -> bytes:
    """The code a split depends on, read once per process (a client process asks for its key
    with every message; the code it runs does not change under it)."""
    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in _SOURCES)).digest()


def _split_arrays(split: ClientSplit) -> dict[str, np.ndarray] | None:
    out: dict[str, np.ndarray] = {}
    for part in SPLITS:
        ds = getattr(split, part)
        view = tensor_view(ds.base if isinstance(ds, CropFlip) else ds)
        if view is None:
            return None
        out[f"{part}_x"], out[f"{part}_y"] = view[0].numpy(), view[1].numpy()
        out[f"{part}_ids"] = np.asarray(getattr(split, f"{part}_ids"))
    if split.class_weights is not None:
        out["class_weights"] = np.asarray(split.class_weights)
    return out


def _split_from_arrays(client_id: str, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> ClientSplit:
    sets = {part: TensorDataset(torch.from_numpy(arrays[f"{part}_x"]), torch.from_numpy(arrays[f"{part}_y"]))
            for part in SPLITS}
    train: Dataset = CropFlip(sets["train"]) if meta.get("crop_flip") else sets["train"]
    return ClientSplit(client_id=client_id, domain=str(meta["domain"]), train=train, val=sets["val"],
                       test=sets["test"], train_ids=arrays["train_ids"], val_ids=arrays["val_ids"],
                       test_ids=arrays["test_ids"], class_weights=arrays.get("class_weights"))


def info_of(data: FederatedData) -> DataInfo:
    return DataInfo(data.name, data.num_classes, tuple(data.input_shape),  # type: ignore[arg-type]
                    tuple(data.clients), tuple(data.new_clients))


def write_cache(data: FederatedData, folder: Path) -> bool:
    """Write every client's split and ``info.json``; False (nothing written) when a split is
    not in memory (image folders)."""
    everyone = {**data.clients, **data.new_clients}
    arrays = {cid: _split_arrays(split) for cid, split in everyone.items()}
    if any(a is None for a in arrays.values()):
        return False
    for cid, split in everyone.items():
        save_arrays_file(folder / f"{cid}.npz", arrays[cid],  # type: ignore[arg-type]
                         {"domain": split.domain, "crop_flip": isinstance(split.train, CropFlip)})
    info = info_of(data)
    atomic_write_text(folder / "info.json", json.dumps({
        "name": info.name, "num_classes": info.num_classes, "input_shape": list(info.input_shape),
        "client_ids": list(info.client_ids), "new_client_ids": list(info.new_client_ids),
        # what the server reads (load_data_summary): no split needed
        "summaries": {cid: {"domain": split.domain, "num_train": split.num_train}
                      for cid, split in everyone.items()}}))
    return True


@dataclass(frozen=True)
class ClientSummary:
    domain: str
    num_train: int


@dataclass(frozen=True)
class DataSummary:
    """What the server needs of a dataset (ids, classes, input shape, each client's domain
    and training size), read from the cache's ``info.json`` without loading any split."""

    name: str
    num_classes: int
    input_shape: tuple[int, int, int]
    clients: dict[str, ClientSummary]
    new_clients: dict[str, ClientSummary]

    @property
    def client_ids(self) -> list[str]:
        return list(self.clients)


def load_data_summary(dataset_cfg: Mapping[str, Any], seed: int,
                      cache_dir: Path | None) -> DataSummary | FederatedData:
    """The dataset's summary from the cache in milliseconds; without a cache entry (or with
    ``data_cache=off``) the whole dataset, built (and cached) as before: 3 s of a ServerApp's
    start on the digits sets."""
    if cache_dir is not None:
        try:
            raw = json.loads((Path(cache_dir) / cache_key(dataset_cfg, seed) / "info.json").read_text())
            summaries = raw["summaries"]

            def pick(ids: list[str]) -> dict[str, ClientSummary]:
                return {c: ClientSummary(str(summaries[c]["domain"]), int(summaries[c]["num_train"])) for c in ids}

            return DataSummary(str(raw["name"]), int(raw["num_classes"]),
                               tuple(raw["input_shape"]),  # type: ignore[arg-type]
                               pick(raw["client_ids"]), pick(raw["new_client_ids"]))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
            pass
    return fill_cache(dataset_cfg, seed, cache_dir)


# the splits a simulation actor has read, up to IN_PROCESS_BYTES of arrays: an actor serves its
# clients in turn, round after round, and reads each from disk once. Past the bound a split is
# not kept (the clients come back in a cycle, so dropping the oldest would drop the one needed
# next and keep none useful), except that the splits of another dataset or seed go first.
_IN_PROCESS: OrderedDict[tuple[str, str], tuple[ClientSplit, DataInfo, int]] = OrderedDict()
IN_PROCESS_BYTES = 512 << 20


def _read_cache(folder: Path, client_id: str) -> tuple[ClientSplit, DataInfo] | None:
    key = (str(folder), client_id)
    hit = _IN_PROCESS.get(key)
    if hit is not None:
        return hit[0], hit[1]
    info_path, split_path = folder / "info.json", folder / f"{client_id}.npz"
    if not (info_path.is_file() and split_path.is_file()):
        return None
    try:
        raw = json.loads(info_path.read_text())
        arrays, meta = load_arrays_file(split_path)
    except (StateCorruptError, json.JSONDecodeError, OSError) as err:
        log.warning("data cache %s is damaged (%s); rebuilding it", folder, err)
        return None
    info = DataInfo(str(raw["name"]), int(raw["num_classes"]), tuple(raw["input_shape"]),
                    tuple(raw["client_ids"]), tuple(raw["new_client_ids"]))
    split = _split_from_arrays(client_id, arrays, meta)
    _keep_in_process(key, split, info, sum(a.nbytes for a in arrays.values()))
    return split, info


def _keep_in_process(key: tuple[str, str], split: ClientSplit, info: DataInfo, size: int) -> None:
    """Keep a split read from disk if it fits in ``IN_PROCESS_BYTES`` (see ``_IN_PROCESS``)."""
    kept = sum(entry[2] for entry in _IN_PROCESS.values())
    if kept + size > IN_PROCESS_BYTES:
        for other in [k for k in _IN_PROCESS if k[0] != key[0]]:   # another dataset's or seed's
            kept -= _IN_PROCESS.pop(other)[2]
    if kept + size <= IN_PROCESS_BYTES:
        _IN_PROCESS[key] = (split, info, size)


def load_client_data(dataset_cfg: Mapping[str, Any], seed: int, client_id: str,
                     cache_dir: Path | None) -> tuple[ClientSplit, DataInfo]:
    """One client's split and the dataset's description: from the cache when it holds this
    config, else built (and the cache filled for every client). ``cache_dir=None``: no cache."""
    if cache_dir is not None:
        folder = Path(cache_dir) / cache_key(dataset_cfg, seed)
        cached = _read_cache(folder, client_id)
        if cached is not None:
            return cached
    data = load_federated_data(dataset_cfg, seed)
    split = data.client(client_id)   # an unknown id fails here, naming the valid ones
    if cache_dir is not None:
        try:
            write_cache(data, folder)
        except OSError as err:   # a read-only or full disk costs speed, not the round
            log.warning("cannot write the data cache %s (%s); set data_cache=off to skip it", folder, err)
    return split, info_of(data)


def cache_holds(dataset_cfg: Mapping[str, Any], seed: int, cache_dir: Path | None) -> bool:
    """Whether the cache holds this config's splits (written by :func:`fill_cache`, so the
    config built without error). A client whose file turns out damaged rebuilds the dataset
    itself (:func:`load_client_data`)."""
    if cache_dir is None:
        return False
    folder = Path(cache_dir) / cache_key(dataset_cfg, seed)
    try:
        raw = json.loads((folder / "info.json").read_text())
        client_ids = [*raw["client_ids"], *raw["new_client_ids"]]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all((folder / f"{cid}.npz").is_file() for cid in client_ids)


def fill_cache(dataset_cfg: Mapping[str, Any], seed: int, cache_dir: Path | None) -> FederatedData:
    """Build the dataset (every split: a bad config fails here) and fill the cache unless
    it already holds this config, so that no client process has to build it."""
    data = load_federated_data(dataset_cfg, seed)
    if cache_dir is not None and not cache_holds(dataset_cfg, seed, cache_dir):
        folder = Path(cache_dir) / cache_key(dataset_cfg, seed)
        try:
            write_cache(data, folder)
        except OSError as err:
            log.warning("cannot write the data cache %s (%s); set data_cache=off to skip it", folder, err)
    return data
