"""Compose the run's Hydra config from ``conf/`` with the Flower run-config as overrides.

Both apps call :func:`compose_config` with the same run-config, so the server and every
client see the same resolved config. Hydra's global state is per process and Ray actors
live across rounds, so composition happens inside ``initialize_config_dir`` each time
(and the result is cached per run-config).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from common.errors import ConfigError
from common.methods import ROW_KEY, method, method_options, not_private, resolve_method
from common.overrides import (
    hydra_override_parser,
    override_key,
    override_value,
    override_values,
    parse_override,
    run_config_to_overrides,
)
from common.settings import (
    GROUP_KEYS,
    FinetuneSettings,
    PersonalizeSettings,
    PrivacySettings,
    RunKeys,
    Settings,
    TrainSettings,
)
from learning.typed import read_typed, unknown_key_message

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("strategy", "dataset", "model", "experiment")


def models_required(cfg: DictConfig) -> tuple[str, ...]:
    """Models the configured strategy works with (empty = any), from the method's row."""
    return method(str(cfg.strategy.name), cfg.strategy).models


def strategy_overrides(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """The experiment's overrides for the configured strategy (``strategy_overrides``), less
    any key the command line sets itself: one table's experiment can give FDSE its own model
    while the baselines keep theirs, and ``pflower sweep experiment=X strategy=a,b`` runs both."""
    table = cfg.strategy_overrides
    extra = [str(o) for o in table.get(str(cfg.strategy.name), [])]
    given = {override_key(o) for o in overrides}
    return [o for o in extra if override_key(o) not in given]


def group_options(group: str) -> list[str]:
    """Valid names of a config group: the yaml files in ``conf/<group>/``, less the bases the
    presets start from (``_base.yaml``: a leading underscore marks a file that is not a choice)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml") if not p.stem.startswith("_"))


def _check_group_choices(overrides: list[str]) -> None:
    for ov in overrides:
        key = override_key(ov)
        if key.startswith(f"strategy.{ROW_KEY}"):
            raise ConfigError(f"{ov}: strategy.{ROW_KEY} says where the method's code lives and is not an "
                              "option; to change it, edit (or copy into a new method) its conf/strategy/<name>.yaml")
        if key in GROUPS:
            options = group_options(key)
            if parse_override(ov).is_sweep_override():
                raise ConfigError(f"{ov}: one run takes one {key}; `pflower sweep {ov}` runs each")
            value = override_value(ov)
            if value not in options:
                raise ConfigError(
                    f"unknown {key} {value!r}; valid {key} names: {', '.join(options)}"
                )


@dataclass(frozen=True)
class ComposedRun:
    """One composed run configuration and its typed settings, read once, together: what the two
    apps take from composition and hand down (the config's ``dataset``, ``model`` and
    ``strategy`` groups to their typed readers, ``settings`` to everything else).

    ``key`` names the composition (its overrides and node root, or the finished run's folder): a
    process keeps what it builds for a run configuration (a client's trainer) under it."""

    cfg: DictConfig
    settings: Settings
    key: str


def compose_run(run_config: Mapping[str, Any] | None = None,
                overrides: list[str] | None = None, node_root: str = "") -> ComposedRun:
    """Compose ``conf/config.yaml`` with run-config entries and extra Hydra overrides, and read
    its settings (:func:`run_settings`) once.

    ``node_root`` is a SuperNode's own data folder (``--node-config data-root=...``): it is the
    ``dataset.root`` of a dataset read from files, and not used by one that comes with the
    packages (a ``dataset.root`` the user sets on such a dataset is refused instead)."""
    all_overrides = run_config_to_overrides(run_config or {}) + list(overrides or [])
    return _compose_cached(json.dumps(all_overrides), node_root)


def load_finished_run(run_dir: Path) -> ComposedRun:
    """A finished run's composed configuration (its ``config.yaml``, read-only) and its settings,
    for the commands that go on from a run (new clients, the BN-protocol check); a run made
    before the ``personalize`` group existed takes the current defaults for it."""
    if not (run_dir / "config.yaml").exists():
        raise FileNotFoundError(f"{run_dir} has no config.yaml; give the folder of a finished run")
    cfg: DictConfig = OmegaConf.load(run_dir / "config.yaml")  # type: ignore[assignment]
    if not cfg.get("personalize"):
        cfg.personalize = compose_config({}).personalize
    OmegaConf.set_readonly(cfg, True)
    return ComposedRun(cfg, run_settings(cfg), json.dumps(["finished", str(run_dir)]))


def compose_config(run_config: Mapping[str, Any] | None = None,
                   overrides: list[str] | None = None, node_root: str = "") -> DictConfig:
    """The composed configuration alone (:func:`compose_run`), for a command that reads its groups."""
    return compose_run(run_config, overrides, node_root).cfg


@functools.lru_cache(maxsize=16)
def _compose_cached(overrides_json: str, node_root: str = "") -> ComposedRun:
    overrides = json.loads(overrides_json)
    _check_group_choices(overrides)
    # the group choices alone say which strategy runs and what the experiment adds for it; the
    # command line's keys may need those additions (model.pool_size on FDSE's model)
    extra: list[str] = []
    if any(override_key(o).partition(".")[0] in ("experiment", "strategy_overrides") for o in overrides):
        choices = [o for o in overrides if "." not in override_key(o)]
        extra = strategy_overrides(_hydra_compose(choices), overrides)
    cfg = _hydra_compose([*overrides, *extra])
    needs = models_required(cfg)
    user_chose_model = any(override_key(o) == "model" for o in [*overrides, *extra])
    if needs and str(cfg.model.name) not in needs and not user_chose_model:
        # e.g. `strategy=fdse` alone: take the strategy's model instead of the default cnn
        cfg = _hydra_compose([*overrides, f"model={needs[0]}"])
    if node_root:
        from learning.datasets.pools import BUNDLED_SOURCES

        if str(cfg.dataset.source) not in BUNDLED_SOURCES:
            cfg.dataset.root = node_root
    if cfg.dataset.get("synthetic"):
        use_synthetic(cfg)
    validate_config(cfg)
    if cfg.resume:
        # the resumed run *is* the run folder given: same run_name and results_root
        run_dir = Path(str(cfg.resume)).resolve()
        cfg.resume = str(run_dir)
        cfg.run_name, cfg.results_root = run_dir.name, str(run_dir.parent)
    discover_imagefolder(cfg)
    if not cfg.run_name:
        cfg.run_name = default_run_name(cfg, overrides)
    OmegaConf.set_readonly(cfg, True)
    # read once, as the config now stays (resume and run_name set above)
    return ComposedRun(cfg, run_settings(cfg), json.dumps([overrides_json, node_root]))


# overrides that never change what a run computes (or are already in the name)
_NAME_NEUTRAL = ("strategy", "dataset", "model", "experiment", "seed", "run_name", "results_root",
                 "resume", "overwrite", "state_root")


def default_run_name(cfg: DictConfig, overrides: list[str]) -> str:
    """``[<experiment>-]<strategy>-<dataset>-<model>-s<seed>[-<hash>]``.

    Two runs that differ in any other override (``rounds=5``, ``train.lr=0.01``) get
    different folders: an 8-character hash of those overrides is appended, so a run never
    lands in (and is never refused by) the folder of a different configuration."""
    import hashlib

    name = f"{cfg.strategy.name}-{cfg.dataset.name}-{cfg.model.name}-s{cfg.seed}"
    experiment = override_values(overrides, "experiment")
    if experiment and experiment[-1]:
        name = f"{experiment[-1]}-{name}"
    # a group's choice (strategy=fdse) is in the name; its keys (strategy.lam=0) change the run
    extra = sorted(o for o in overrides if override_key(o) not in (*_NAME_NEUTRAL, "dataset.root"))
    if extra:
        name += "-" + hashlib.sha1(" ".join(extra).encode()).hexdigest()[:8]
    return name


def use_synthetic(cfg: DictConfig) -> None:
    """``dataset.synthetic=true`` reads no files (no ``root`` needed) and names itself: the
    dataset is ``<name>-synthetic`` in run folders and tables, never mistaken for the real one."""
    if OmegaConf.is_missing(cfg.dataset, "root"):
        cfg.dataset.root = ""
    if not str(cfg.dataset.name).endswith("-synthetic"):
        cfg.dataset.name = f"{cfg.dataset.name}-synthetic"


def discover_imagefolder(cfg: DictConfig) -> None:
    """An image-folder dataset with no ``domains`` listed takes the sub-folders of ``root``
    (sorted), and the generic ``imagefolder`` preset takes the root folder's name as the
    dataset name (so run folders and tables say ``my-digits``, not ``imagefolder``)."""
    from learning.datasets.sources import subfolders

    ds = cfg.dataset
    if ds.source != "imagefolder" or ds.synthetic or OmegaConf.is_missing(ds, "root") or not ds.root:
        return
    root = Path(str(ds.root))
    if not ds.domains and root.is_dir():
        ds.domains = [p.name for p in subfolders(root)]
    if str(ds.name) == "imagefolder":
        ds.name = root.resolve().name or "imagefolder"


def _hydra_compose(overrides: list[str], explain: bool = True) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        with open_dict(cfg.strategy):   # the method's registry row, not an option (common/methods.py)
            cfg.strategy.pop(ROW_KEY, None)
        return cfg
    except HydraException as err:
        problems = unknown_override_keys(overrides) if explain else []
        if problems:
            raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems)) from None
        raise ConfigError(f"invalid config override: {err}") from err
    finally:
        GlobalHydra.instance().clear()


def _dotted_keys(node: DictConfig, prefix: str = "") -> list[str]:
    keys: list[str] = []
    for k in node:
        path = f"{prefix}{k}"
        keys.append(path)
        child = node._get_node(k)
        if isinstance(child, DictConfig):
            keys += _dotted_keys(child, f"{path}.")
    return keys


def unknown_override_keys(overrides: list[str]) -> list[str]:
    """One message per override that sets a key the configuration lacks (``train.lrr=0.1``),
    with the nearest valid key and the group's valid keys. Hydra refuses such an override with
    advice to add the key (``+train.lrr=0.1``), which pflower's typed groups would refuse in
    turn; the keys are found with Hydra's own override parser, and the configuration they are
    looked up in is composed from the command line's group choices alone."""
    from hydra.errors import HydraException

    try:
        parsed = hydra_override_parser().parse_overrides(overrides)
        base = _hydra_compose([o for o in overrides if override_key(o) in GROUPS],
                              explain=False)
    except (HydraException, ConfigError):
        return []
    everywhere = _dotted_keys(base)
    problems: list[str] = []
    for override in parsed:
        key = override.key_or_group
        if override.is_add() or override.is_force_add() or override.is_delete() or key in GROUPS:
            continue  # '+key' and '~key' are Hydra's own requests; pflower's groups check them
        node, parts = base, key.split(".")
        for depth, part in enumerate(parts):
            if not isinstance(node, DictConfig):
                break
            if part not in node:  # the first level that lacks the key is the one to name
                group, unknown = ".".join(parts[:depth]), ".".join(parts[:depth + 1])
                problems.append(unknown_key_message([unknown], [str(k) for k in node], group, everywhere))
                break
            node = node._get_node(part)
    return problems


def validate_config(cfg: DictConfig) -> None:
    """Fail before any training with one clear message per problem: every group is read into
    its typed class (every key required, none unknown, each in range; ``common/settings.py``,
    ``learning/datasets/config.py: DatasetConfig``, ``learning/models.py: MODELS``, ``common/options.py``)."""
    from learning.datasets.pools import dataset_config
    from learning.datasets.sources import DatasetError
    from learning.models import read_model_config

    problems: list[str] = []
    root_missing = OmegaConf.is_missing(cfg.dataset, "root")
    if root_missing:
        problems.append(
            f"dataset {cfg.dataset.name!r} needs a data folder: `pflower run dataset={cfg.dataset.name} "
            "dataset.root=/path` (with flwr run: --run-config \"overrides='dataset.root=/path'\"); "
            f"the expected layout is in conf/dataset/{cfg.dataset.name}.yaml"
        )
    readers: list[tuple[Any, ...]] = [
        *((read_typed, *args) for args in _typed_groups(cfg).values()),
        (read_model_config, cfg.model),
        (method_options, cfg.strategy),
    ]
    if not root_missing:
        readers.append((dataset_config, cfg.dataset))
    for reader, *args in readers:
        try:
            reader(*args)
        except (ValueError, DatasetError) as err:
            problems.append(str(err))
    # (whether the resume folder and its checkpoint exist is checked where the server runs:
    # `pflower run` before starting anything, and the ServerApp before the first round;
    # SuperNodes compose this config too and do not have the folder)
    if cfg.resume:
        run_dir = Path(str(cfg.resume))
        if cfg.run_name and str(cfg.run_name) != run_dir.resolve().name:
            problems.append(f"run_name={cfg.run_name!r} differs from the resumed run folder "
                            f"{run_dir.resolve().name!r}; leave run_name out when resuming")
    if cfg.model.get("pretrained_required") and not cfg.model.get("pretrained_path") \
            and not cfg.dataset.get("synthetic"):
        problems.append(
            f"model {cfg.model.name!r} must start from ImageNet weights in this setting (as its paper "
            "does): give a local torchvision state_dict file, model.pretrained_path=/path/resnet18.pth "
            "(nothing is downloaded), or train from random weights with model.pretrained_required=false")
    needs = models_required(cfg)
    if needs and str(cfg.model.name) not in needs:
        problems.append(f"strategy {cfg.strategy.name!r} needs model {' or '.join(needs)}, got "
                        f"model={cfg.model.name!r}")
    if not problems:
        problems.extend(privacy_problems(cfg))
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def privacy_problems(cfg: DictConfig) -> list[str]:
    """Why ``privacy.dp=central`` cannot run as configured (empty when it can, or is off): a
    method whose rule needs each client's own upload, checkpoints further apart than a round,
    a Flower without the accountant, rounds that would spend more than ``privacy.max_epsilon``
    (checked here when the clients are known before composition ends, and by the server's
    strategy always)."""
    from common.privacy import budget_problem
    from learning.datasets.config import num_clients

    settings = run_settings(cfg)
    privacy, run = settings.privacy, settings.run
    problems = secure_aggregation_problems(cfg) if privacy.secure else []
    problems += record_dp_problems(cfg) if privacy.dpsgd else []
    if not privacy.enabled:
        return problems
    why = not_private(cfg.strategy)
    if privacy.distributed and not privacy.secure:
        problems.append("privacy.dp=distributed needs privacy.secure_aggregation=secagg+: each client's noise is "
                        "only a share of the noise, private only in a sum the server cannot see into; add it, or use "
                        "privacy.dp=central (the server adds the noise)")
    if why:
        return [f"privacy.dp={privacy.dp} does not apply to {settings.strategy}: {why}; use "
                "privacy.dp=none, or a method whose shared part is a mean (fedavg, fedprox, fedbn, fedbabu, "
                "ditto, partialfed-fix, fedavg-ft, fedprox-ft, fedbasis)"]
    if run.checkpoint_every > 1:
        return [*problems, f"privacy.dp={privacy.dp} needs checkpoint_every=1 (or 0), got {run.checkpoint_every}: a resume redoes "
                "the rounds after its checkpoint, and rounds already released would be released again"]
    population = num_clients(cfg.dataset)
    if population < 1:      # an image folder's domains are discovered after this check
        return problems
    try:
        problem = budget_problem(privacy, population, run.rounds)
    except ImportError as err:
        return [*problems, str(err)]
    except ValueError as err:
        return [*problems, f"privacy: {err}"]
    return [*problems, problem] if problem is not None else problems


def record_dp_problems(cfg: DictConfig) -> list[str]:
    """Why ``privacy.record_dp=dpsgd`` cannot run as configured: a method whose local training
    is not one cross-entropy loss over examples (a proximal term or a loop of its own, which
    Opacus' per-example gradients would drop), a model Opacus cannot train (BatchNorm), mixed
    precision or ``torch.compile``."""
    from learning.dpsgd import model_problems
    from learning.models import build_model

    settings = run_settings(cfg)
    row = method(settings.strategy, cfg.strategy)
    if row.no_record_dp:
        return [f"privacy.record_dp=dpsgd does not apply to {settings.strategy}: {row.no_record_dp}; use "
                "privacy.record_dp=none, or fedavg, fedavg-ft, fedbabu, ditto, partialfed-fix or local"]
    problems = []
    try:
        model = build_model(cfg.model, (3, 32, 32), 10)   # the module types are what Opacus checks
    except Exception:    # a model that needs its data's shape is checked again by the client
        model = None
    try:
        found = model_problems(model) if model is not None else []
    except ImportError as err:
        return [str(err)]
    if found:
        problems.append(f"privacy.record_dp=dpsgd: Opacus cannot train model={cfg.model.name}: {found[0]}; use a "
                        "model without BatchNorm (model=mlp)")
    if settings.train.amp or settings.train.compile:
        problems.append("privacy.record_dp=dpsgd runs without train.amp and train.compile (Opacus' per-example "
                        "gradients); set both to false")
    return problems


def secure_aggregation_problems(cfg: DictConfig) -> list[str]:
    """Why ``privacy.secure_aggregation=secagg+`` cannot run as configured: a method whose rule
    needs each client's own upload, a norm bound (the server never sees one update), a
    threshold or neighbourhood above the clients a round samples."""
    from common.secure_aggregation import threshold_of
    from learning.datasets.config import num_clients

    settings = run_settings(cfg)
    privacy, run = settings.privacy, settings.run
    why = not_private(cfg.strategy)
    if why:
        return [f"privacy.secure_aggregation=secagg+ does not apply to {settings.strategy}: {why}; use "
                "privacy.secure_aggregation=none, or a method whose shared part is a mean (fedavg, fedprox, fedbn, "
                "fedbabu, ditto, partialfed-fix, fedavg-ft, fedprox-ft, fedbasis)"]
    problems = []
    if run.norm_bound > 0:
        problems.append(f"norm_bound={run.norm_bound:g} cannot be checked under secure aggregation (the server "
                        "never sees one client's update); set norm_bound=0")
    population = num_clients(cfg.dataset)
    if population >= 1:     # an image folder's domains are discovered after this check
        sampled = min(population, max(min(run.min_train_clients, population),
                                      int(round(population * run.fraction_train))))
        shares = sampled if not privacy.secagg_shares else min(sampled, privacy.secagg_shares)
        threshold = threshold_of(privacy.secagg_threshold, shares)
        if sampled < 2:
            problems.append(f"secure aggregation needs at least 2 clients a round; this run samples {sampled} "
                            "(raise fraction_train or min_train_clients)")
        elif threshold > shares:
            problems.append(f"privacy.secagg_threshold={privacy.secagg_threshold:g} is above the {shares} clients "
                            f"that share each secret in a round ({sampled} of {population} sampled); use at most "
                            f"{shares}, or a fraction such as 0.5")
    return problems

# Groups added to conf/config.yaml after runs were made, each with its off setting as its
# default: a run folder's config.yaml written before the group existed ran with it off, and
# reads so (pflower personalize, resume, compare and the kept-runs test of tests/test_tables.py).
ADDED_GROUPS: dict[str, dict[str, Any]] = {
    "privacy": {"dp": "none", "clip_norm": 1.0, "noise_multiplier": 1.0, "delta": 1e-5, "max_epsilon": None,
                "noise_seed": None, "secure_aggregation": "none", "secagg_shares": None, "secagg_threshold": 0.5,
                "secagg_clip_range": 4.0, "secagg_bits": 22, "record_dp": "none", "record_noise_multiplier": 1.0,
                "record_clip": 1.0},
}


# method -> the options it gained after runs of it were kept, at the value that gives what
# those runs did (docs/runs/: a kept run is still the configuration its command composes today)
ADDED_STRATEGY_KEYS: dict[str, dict[str, Any]] = {
    "fedora": {"lambda_bn": "stored"},
}


def with_added_groups(config: dict[str, Any]) -> dict[str, Any]:
    """A run folder's composed configuration (plain) with the groups it predates at their off
    setting (:data:`ADDED_GROUPS`) and its method's options it predates at the value it ran
    with (:data:`ADDED_STRATEGY_KEYS`)."""
    out = {**config, **{g: {**v, **dict(config.get(g) or {})} for g, v in ADDED_GROUPS.items()}}
    strategy = out.get("strategy")
    if isinstance(strategy, dict):
        out["strategy"] = {**ADDED_STRATEGY_KEYS.get(str(strategy.get("name")), {}), **strategy}
    return out


def _typed_groups(cfg: DictConfig) -> dict[str, tuple[Any, ...]]:
    """``read_typed``'s arguments for the run keys and the fixed groups of ``conf/config.yaml``."""
    run_keys = {k: v for k, v in cfg.items() if k not in GROUP_KEYS}
    return {"run": (RunKeys, run_keys, "", "conf/config.yaml"),
            **{group: (cls, {**ADDED_GROUPS.get(group, {}), **dict(cfg.get(group) or {})}, group, "conf/config.yaml")
               for group, cls in (("train", TrainSettings), ("finetune", FinetuneSettings),
                                  ("personalize", PersonalizeSettings), ("privacy", PrivacySettings))}}


def run_settings(cfg: DictConfig) -> Settings:
    """The typed settings of a composed config (:class:`common.settings.Settings`), read from it
    now: composition reads them once (:class:`ComposedRun`, :func:`load_finished_run` for a run
    folder's ``config.yaml``). A key or group missing or out of range raises
    :class:`ConfigError` naming it."""
    try:
        typed = {name: read_typed(*args) for name, args in _typed_groups(cfg).items()}
        return Settings(run=typed["run"], train=typed["train"], finetune=typed["finetune"],
                        personalize=typed["personalize"], privacy=typed["privacy"],
                        method=resolve_method(cfg.strategy), dataset=str(cfg.dataset.name),
                        model=str(cfg.model.name))
    except (ValueError, OmegaConfBaseException) as err:   # (a group missing: omegaconf's error)
        raise ConfigError(f"invalid configuration: {err}") from None


