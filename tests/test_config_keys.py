"""Every config key has its default in conf/ only, and every group is typed at composition:
an unknown or out-of-range key in any group is refused by name before anything starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from common.config import ConfigError, compose_config, compose_run, load_finished_run, run_settings
from common.settings import FinetuneSettings, PersonalizeSettings, RunKeys, TrainSettings

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("learning", "common", "strategies", "client", "server", "ops")
# a .get("key", default) on a config object (the composed config, a group of it, or a
# mapping of one): the default would restate or invent what conf/ says
CONFIG_GET = re.compile(r"""\b(cfg|config_group|dataset_cfg|model_cfg|strategy|options|train|finetune|ds)"""
                        r"""(\.\w+)*\.get\(\s*["']([\w-]+)["']\s*,""")


def _conf_keys() -> set[str]:
    keys: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k not in ("defaults", "hydra"):
                    keys.add(str(k))
                    walk(v)

    for path in (REPO / "conf").rglob("*.yaml"):
        walk(yaml.safe_load(path.read_text()) or {})
    return keys


def test_no_code_restates_a_default_of_conf() -> None:
    keys = _conf_keys()
    assert {"lr", "image_size", "width", "best_round_by"} <= keys    # the walk finds group keys
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
             for pkg in PACKAGES for path in sorted((REPO / pkg).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             for m in CONFIG_GET.finditer(line) if m.group(3) in keys]
    assert found == [], "defaults restated in code (read the key, conf/ has it):\n" + "\n".join(found)


# a cast of the untyped config (``int(cfg.seed)``, ``float(self.cfg.train.lr)``): code reads
# the typed settings composition made (common/config.py: ComposedRun.settings) instead
CONFIG_CAST = re.compile(r"""\b(int|float|str|bool)\((self\.|rnd\.)?cfg\.""")


def test_no_code_casts_the_config_outside_composition() -> None:
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
             for pkg in (*PACKAGES, "bench") for path in sorted((REPO / pkg).rglob("*.py"))
             if path.relative_to(REPO).as_posix() != "common/config.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if CONFIG_CAST.search(line) and not line.lstrip().startswith(("#", "``"))]
    assert found == [], "casts of the config (read the typed Settings instead):\n" + "\n".join(found)
    assert CONFIG_CAST.search("seed = int(cfg.seed)") and CONFIG_CAST.search("float(self.cfg.train.lr)")


# Where the typed settings are read from a config: composition (which also loads a finished run
# folder's config.yaml for the commands of ops/ and bench/: load_finished_run), and the
# ServerApp's edge, which hands them down (the ClientApp's handlers take them from composition).
# The tests take them from composition too (compose_run, load_finished_run), as the apps do.
SETTINGS_READERS = ("common/config.py", "server/app.py")
RUN_SETTINGS_CALL = re.compile(rf"\b{run_settings.__name__}\(")


def test_below_the_app_edges_code_takes_settings_and_never_reads_them_from_the_config() -> None:
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
             for pkg in ("learning", "common", "strategies", "client", "server", "ops", "bench", "tests")
             for path in sorted((REPO / pkg).rglob("*.py"))
             if path.relative_to(REPO).as_posix() not in SETTINGS_READERS
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if RUN_SETTINGS_CALL.search(line) and not line.lstrip().startswith(("#", "``"))]
    assert found == [], "settings read from the config below the app edges (take Settings as an argument):\n" + \
        "\n".join(found)
    reader = run_settings.__name__
    assert RUN_SETTINGS_CALL.search(f"run = {reader}(cfg).run") and not RUN_SETTINGS_CALL.search("def settings(")


def _finished_run(folder: Path, cfg: object) -> Path:
    """``folder`` as a run folder whose ``config.yaml`` is ``cfg``, written as a run writes it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return folder


def test_run_settings_are_the_composed_groups_typed_and_read_once(tmp_path: Path) -> None:
    composed = compose_run({}, ["train.lr=0.02", "finetune.epochs=3", "rounds=7", "seed=4"])
    cfg, settings = composed.cfg, composed.settings
    # read when composed, and kept with the config: composing it again in this process gives them back
    assert compose_run({}, ["train.lr=0.02", "finetune.epochs=3", "rounds=7", "seed=4"]).settings is settings
    # the run's config.yaml, read again by a command that goes on from the run, gives the same
    assert load_finished_run(_finished_run(tmp_path / "run", cfg)).settings == settings
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(plain, dict)
    assert settings.train == TrainSettings(**{**plain["train"], "lr_milestones": tuple(plain["train"]["lr_milestones"])})
    assert settings.finetune == FinetuneSettings(**{**plain["finetune"],
                                                    "curve_epochs": tuple(plain["finetune"]["curve_epochs"])})
    assert settings.personalize == PersonalizeSettings(**{**plain["personalize"],
                                                          "lrs": tuple(plain["personalize"]["lrs"])})
    assert (settings.run.rounds, settings.run.seed, settings.train.lr, settings.finetune.epochs) == (7, 4, 0.02, 3)
    assert settings.run == RunKeys(**{k: v for k, v in plain.items() if k in RunKeys.__dataclass_fields__})
    assert (settings.strategy, settings.dataset, settings.model) == (cfg.strategy.name, cfg.dataset.name,
                                                                     cfg.model.name)
    assert settings.run.run_dir == Path(cfg.results_root) / cfg.run_name
    opt = settings.train.optim(lr_scale=0.5)
    assert (opt.lr, opt.epochs, opt.batch_size, opt.momentum) == (0.01, cfg.train.local_epochs,
                                                                   cfg.train.batch_size, cfg.train.momentum)
    ft = settings.finetune.optim(settings.train)
    assert (ft.lr, ft.epochs, ft.batch_size, ft.clip, ft.amp) == (cfg.finetune.lr, 1, cfg.finetune.batch_size,
                                                                  cfg.train.clip, False)


def test_settings_of_a_config_that_can_change_are_read_again_and_a_missing_key_is_named(tmp_path: Path) -> None:
    cfg = OmegaConf.create(OmegaConf.to_container(compose_config({}), resolve=True))
    assert load_finished_run(_finished_run(tmp_path / "a", cfg)).settings.run.rounds == compose_config({}).rounds
    cfg.rounds = 9                                      # a run folder's config.yaml, edited since
    assert load_finished_run(_finished_run(tmp_path / "b", cfg)).settings.run.rounds == 9
    del cfg.train["clip"]
    with pytest.raises(ConfigError, match=r"train\.clip"):
        load_finished_run(_finished_run(tmp_path / "c", cfg))


def test_the_check_finds_a_restated_default() -> None:
    line = 'size = int(cfg.dataset.get("image_size", 64))'
    match = CONFIG_GET.search(line)
    assert match is not None and match.group(3) == "image_size"


@pytest.mark.parametrize(("override", "named"), [
    ("+train.lrr=0.1", "train.lrr"),                 # unknown keys, by group
    ("+dataset.clients=3", "dataset.clients"),
    ("+model.depth=3", "model.depth"),
    ("+finetune.steps=3", "finetune.steps"),
    ("+personalize.rounds=2", "personalize.rounds"),
    ("+strategy.muu=0.1", "strategy.muu"),
    ("train.lr=-0.1", "train.lr"),                   # out of range or of the wrong kind
    ("train.lr_schedule=cosine", "train.lr_schedule"),
    ("train.lr_milestones=[0.5,1.5]", "train.lr_milestones"),
    ("train.batch_size=0", "train.batch_size"),
    ("dataset.val_fraction=0.9", "dataset.val_fraction"),
    ("dataset.partition=shards", "dataset.partition"),
    ("dataset.clients_per_domain=two", "dataset.clients_per_domain"),
    ("model.width=0", "model.width"),
    ("model.hidden=big", "model.hidden"),
    ("finetune.part=neck", "finetune.part"),
    ("personalize.sizes={S:1.5}", "personalize.sizes"),
    ("rounds=0", "rounds"),
    ("device=tpu", "device"),
    ("fraction_train=1.5", "fraction_train"),
])
def test_a_bad_key_is_refused_at_composition_by_name(override: str, named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        compose_config({}, [override])


def test_every_experiment_and_group_composes() -> None:
    for group in ("experiment", "dataset", "model", "strategy"):
        for path in sorted((REPO / "conf" / group).glob("[!_]*.yaml")):
            overrides = [f"{group}={path.stem}"]
            try:
                compose_config({}, overrides)
            except ConfigError as err:   # a dataset read from disk names its folder; the bundled read none
                if "needs a data folder" in str(err):
                    overrides.append("dataset.root=/data")
            try:
                compose_config({}, overrides)
            except ConfigError as err:   # a setting that starts from ImageNet weights names their file
                assert "model.pretrained_path=" in str(err) and str(err).count("\n  - ") == 1, str(err)
                compose_config({}, [*overrides, "model.pretrained_path=/w.pth"])


def _dataset_file(name: str) -> dict:
    return yaml.safe_load((REPO / "conf" / "dataset" / f"{name}.yaml").read_text()) or {}


def _dataset_resolved(name: str) -> dict:
    """A preset's keys after its defaults list (a slow, obvious walk of the files, not Hydra)."""
    return {**_dataset_parent(name), **{k: v for k, v in _dataset_file(name).items() if k != "defaults"}}


def _dataset_parent(name: str) -> dict:
    """The keys a preset starts from: the presets in its defaults list, merged in order."""
    merged: dict = {}
    for parent in _dataset_file(name).get("defaults", []):
        if parent != "_self_":
            merged.update(_dataset_resolved(parent))
    return merged


def test_dataset_presets_start_from_the_base_and_hold_only_what_differs() -> None:
    from dataclasses import fields

    from learning.datasets.config import DatasetConfig

    base = _dataset_file("_base")
    assert set(base) == {f.name for f in fields(DatasetConfig)}, "conf/dataset/_base.yaml has every dataset key"
    restated = []
    for path in sorted((REPO / "conf" / "dataset").glob("[!_]*.yaml")):
        own = {k: v for k, v in _dataset_file(path.stem).items() if k != "defaults"}
        parent = _dataset_parent(path.stem)
        assert set(parent) == set(base), f"{path.name} starts from _base (directly or through a preset)"
        restated += [f"{path.name}: {k}: {v!r}" for k, v in own.items() if k in parent and parent[k] == v]
    assert restated == [], "a preset restates its parent's value:\n" + "\n".join(restated)
