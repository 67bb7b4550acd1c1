"""The per-client data cache: a ClientApp process reads exactly the split it would build."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import learning.datasets.cache as data_cache
from common.config import compose_config
from learning.datasets.cache import cache_key, load_client_data, resolve_cache_dir, tensor_view
from learning.datasets.federated import build_federated_data
from learning.datasets.sources import CropFlip


def _items(ds) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y of a dataset read item by item (the slow, obvious way)."""
    xs, ys = zip(*(ds[i] for i in range(len(ds))), strict=True)
    return torch.stack(xs), torch.as_tensor([int(y) for y in ys])


def _same_split(a, b) -> None:
    assert a.client_id == b.client_id and a.domain == b.domain
    assert isinstance(a.train, CropFlip) == isinstance(b.train, CropFlip)
    for part in ("train", "val", "test"):
        da, db = getattr(a, part), getattr(b, part)
        da, db = (da.base, db.base) if isinstance(da, CropFlip) else (da, db)
        xa, ya = _items(da)
        xb, yb = _items(db)
        assert torch.equal(xa, xb) and torch.equal(ya, yb), part
        assert np.array_equal(getattr(a, f"{part}_ids"), getattr(b, f"{part}_ids"))
    assert (a.class_weights is None) == (b.class_weights is None)
    if a.class_weights is not None:
        assert np.array_equal(a.class_weights, b.class_weights)


@pytest.mark.parametrize("dataset,overrides", [
    ("digits-domains", []),
    ("digits-domains", ["dataset.augment=crop-flip", "dataset.new_clients_per_domain=1"]),
    ("digits-domains", ["dataset.split=pflbed"]),
])
def test_a_cached_split_is_the_built_one(tmp_path, monkeypatch, dataset, overrides):
    cfg = compose_config({"dataset": dataset}, overrides)
    built = build_federated_data(cfg.dataset, 3)
    ids = [*built.clients, *built.new_clients]
    first = {cid: load_client_data(cfg.dataset, 3, cid, tmp_path) for cid in ids}

    def no_build(*_args, **_kw):
        raise AssertionError("built again although the cache holds this config")

    monkeypatch.setattr(data_cache, "load_federated_data", no_build)
    data_cache._IN_PROCESS.clear()   # read the files, not this process's copies
    for cid in ids:
        split, info = load_client_data(cfg.dataset, 3, cid, tmp_path)
        _same_split(split, built.client(cid))
        _same_split(first[cid][0], built.client(cid))
        assert info.client_ids == tuple(built.clients) and info.new_client_ids == tuple(built.new_clients)
        assert (info.name, info.num_classes, info.input_shape) == \
            (built.name, built.num_classes, tuple(built.input_shape))


def test_the_key_follows_the_config_and_seed():
    a = compose_config({}, []).dataset
    b = compose_config({}, ["dataset.clients_per_domain=3"]).dataset
    assert cache_key(a, 0) == cache_key(a, 0)
    assert len({cache_key(a, 0), cache_key(a, 1), cache_key(b, 0)}) == 3


def test_a_process_keeps_the_splits_it_read_while_they_fit(tmp_path, monkeypatch):
    """A client process reads each split from disk once and keeps it while the kept arrays
    fit in ``IN_PROCESS_BYTES``; past that a split is read each time (clients come back in a
    cycle, so keeping the newest would drop the one needed next), and another dataset's or
    seed's splits make room first."""
    cfg = compose_config({}, []).dataset
    ids = list(build_federated_data(cfg, 0).clients)[:4]
    load_client_data(cfg, 0, ids[0], tmp_path)   # builds the dataset and fills the cache
    reads: list[str] = []
    real_read = data_cache.load_arrays_file
    monkeypatch.setattr(data_cache, "load_arrays_file", lambda path: (reads.append(path.stem), real_read(path))[1])
    data_cache._IN_PROCESS.clear()
    try:
        for cid in ids[:2]:
            load_client_data(cfg, 0, cid, tmp_path)
        sizes = [entry[2] for entry in data_cache._IN_PROCESS.values()]
        assert reads == ids[:2] and len(sizes) == 2 and min(sizes) > 0
        # room for these two only: the other two are read at every use, the two kept never again
        monkeypatch.setattr(data_cache, "IN_PROCESS_BYTES", sum(sizes))
        for _ in range(2):
            for cid in ids:
                load_client_data(cfg, 0, cid, tmp_path)
        assert reads == [*ids[:2], *ids[2:], *ids[2:]]
        assert [k[1] for k in data_cache._IN_PROCESS] == ids[:2]
        # another seed's split: the first seed's make room for it
        load_client_data(cfg, 1, ids[0], tmp_path)   # builds seed 1's cache
        reads.clear()
        load_client_data(cfg, 1, ids[1], tmp_path)
        assert reads == [ids[1]] and [k[1] for k in data_cache._IN_PROCESS] == [ids[1]]
    finally:
        data_cache._IN_PROCESS.clear()


def test_a_damaged_cache_file_is_rebuilt(tmp_path):
    cfg = compose_config({}, []).dataset
    load_client_data(cfg, 0, "1", tmp_path)
    (path,) = (tmp_path / cache_key(cfg, 0)).glob("1.npz")
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    split, _ = load_client_data(cfg, 0, "1", tmp_path)
    _same_split(split, build_federated_data(cfg, 0).client("1"))


def test_unknown_client_and_cache_settings(tmp_path):
    cfg = compose_config({}, []).dataset
    with pytest.raises(ValueError, match="not in dataset"):
        load_client_data(cfg, 0, "99", tmp_path)
    assert resolve_cache_dir("off") is None
    assert resolve_cache_dir(str(tmp_path)) == tmp_path
    assert resolve_cache_dir("auto") is not None


def test_image_folders_are_not_cached(tmp_path):
    from PIL import Image

    root = tmp_path / "tree"
    for d in ("a", "b"):
        for c in ("x", "y"):
            (root / d / c).mkdir(parents=True)
            for i in range(6):
                Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(root / d / c / f"{i}.png")
    cfg = compose_config({"dataset": "imagefolder"}, [f"dataset.root={root}", "dataset.image_size=8"]).dataset
    split, info = load_client_data(cfg, 0, "0", tmp_path / "cache")
    assert info.num_classes == 2 and tensor_view(split.train) is None
    assert not (tmp_path / "cache" / cache_key(cfg, 0)).exists()


def test_the_server_reads_a_summary_equal_to_the_built_data_without_any_split(tmp_path):
    """The ServerApp's view of the dataset (ids, classes, input shape, each client's domain and
    training size) comes from info.json alone once the cache holds the config; before, the
    dataset is built (and cached) as before."""
    cfg = compose_config(overrides=["dataset.new_clients_per_domain=1"])
    built = build_federated_data(cfg.dataset, 0)
    first = data_cache.load_data_summary(cfg.dataset, 0, tmp_path)   # no cache yet: built
    assert not isinstance(first, data_cache.DataSummary)
    folder = tmp_path / cache_key(cfg.dataset, 0)
    for split_file in folder.glob("*.npz"):
        split_file.unlink()   # the summary needs none of them
    summary = data_cache.load_data_summary(cfg.dataset, 0, tmp_path)
    assert isinstance(summary, data_cache.DataSummary)
    assert summary.client_ids == built.client_ids and list(summary.new_clients) == list(built.new_clients)
    assert (summary.name, summary.num_classes, tuple(summary.input_shape)) == \
        (built.name, built.num_classes, tuple(built.input_shape))
    for ids, full in ((summary.clients, built.clients), (summary.new_clients, built.new_clients)):
        assert {c: (s.domain, s.num_train) for c, s in ids.items()} == \
            {c: (s.domain, len(s.train)) for c, s in full.items()}
    assert not isinstance(data_cache.load_data_summary(cfg.dataset, 0, None), data_cache.DataSummary)


def test_the_run_check_builds_a_config_once_then_finds_it_in_the_cache(tmp_path, monkeypatch):
    """``pflower run`` checks a config by building its splits; once the cache holds them it
    builds nothing (the build and its imports were 5 s of every run's start-up), and a cache
    missing a client's file is built again."""
    from ops.running import preflight

    built = []
    real = data_cache.fill_cache
    monkeypatch.setattr(data_cache, "fill_cache", lambda *args: built.append(1) or real(*args))
    overrides = [f"data_cache={tmp_path / 'cache'}", f"results_root={tmp_path / 'results'}"]
    composed, *_ = preflight(overrides)
    cfg, seed = composed.cfg, composed.settings.run.seed
    assert built == [1] and data_cache.cache_holds(cfg.dataset, seed, tmp_path / "cache")
    preflight(overrides)
    assert built == [1]
    (tmp_path / "cache" / cache_key(cfg.dataset, seed) / "3.npz").unlink()
    assert not data_cache.cache_holds(cfg.dataset, seed, tmp_path / "cache")
    preflight(overrides)
    assert built == [1, 1] and data_cache.cache_holds(cfg.dataset, seed, tmp_path / "cache")
    assert not data_cache.cache_holds(cfg.dataset, seed, None) and not data_cache.cache_holds(cfg.dataset, seed, tmp_path)
