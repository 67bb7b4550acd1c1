"""Every re-measured table is reproducible from its experiment file alone.

The command printed with each table in docs/ is ``pflower sweep experiment=<name>
strategy=<list> seed=0,1,2`` and nothing else (a results folder aside; ``seed=0`` for the two
styled-digit tables measured at one seed, which their page says), and the configuration
each of its runs composes is the one checked in under ``tests/tables/<experiment>.yaml``. A
changed default therefore fails here until the expected file is rewritten on purpose
(``python3 -m tests.test_tables --write``), which is the moment to re-measure the table.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from common.config import compose_config, with_added_groups
from server.run_folder import WHERE_KEYS

REPO = Path(__file__).resolve().parent.parent
EXPECTED = Path(__file__).resolve().parent / "tables"
THREE_SEEDS = "0,1,2"
EVERY_METHOD = ("local", "fedavg", "fedavg-ft", "fedprox", "fedprox-ft", "fedbn", "ditto", "fedbabu", "fdse",
                "fedora", "partialfed-fix", "partialfed-adaptive", "fedbasis")
# experiment -> (the page that prints its table, the strategies of the table, its seeds): the
# tables measured at today's defaults
TABLES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "fdse-digits-sources": ("docs/methods/fdse.md", ("fdse", "fedavg", "fedbn", "ditto"), THREE_SEEDS),
    "partialfed-digits": ("docs/methods/partialfed.md", ("partialfed-fix", "partialfed-adaptive", "fedavg",
                                                         "fedavg-ft", "fedbn", "local"), THREE_SEEDS),
    "fedbasis-digits": ("docs/methods/fedbasis.md", ("fedbasis", "fedavg"), THREE_SEEDS),
    "fedbabu-mnist5k": ("docs/methods/fedbabu.md", ("fedbabu", "fedavg-ft"), THREE_SEEDS),
    "fedora-mnist5k-rotated": ("docs/methods/fedora.md", ("fedora", "local", "fedavg", "fedprox-ft", "ditto"),
                               THREE_SEEDS),
    "baselines-digits-domains": ("docs/results.md", ("fedavg", "fedavg-ft", "fedprox", "fedbn", "ditto", "local"),
                                 THREE_SEEDS),
    "baselines-digits-sources": ("docs/results.md", ("fedavg", "fedavg-ft", "fedprox", "fedbn", "ditto", "local"),
                                 THREE_SEEDS),
    "styled-digits-baselines": ("docs/results.md", ("fedavg", "fedbn", "local"), THREE_SEEDS),
    "styled-digits-personalised": ("docs/results.md", EVERY_METHOD, "0"),
    "fashion-domains-personalised": ("docs/results.md", EVERY_METHOD, "0"),
}


def resolved(experiment: str, strategy: str) -> dict:
    cfg = compose_config({}, [f"experiment={experiment}", f"strategy={strategy}"])
    out = OmegaConf.to_container(cfg, resolve=True)
    return {k: v for k, v in out.items() if k not in WHERE_KEYS}   # type: ignore[union-attr]


@pytest.mark.parametrize("experiment", sorted(TABLES))
def test_the_table_command_is_the_experiment_and_nothing_else(experiment: str) -> None:
    page, strategies, seeds = TABLES[experiment]
    text = (REPO / page).read_text()
    command = f"pflower sweep experiment={experiment} strategy={','.join(strategies)} seed={seeds}"
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith(command)]
    assert lines, f"{page} does not print `{command}`"
    for line in lines:
        rest = re.sub(r"--jobs \d+", "", line[len(command):].split("#")[0]).split()   # how many at once: same runs
        assert all(re.fullmatch(r"results_root=\S+|--out|\S+\.md", word) for word in rest), \
            f"{page}: the table's command has overrides of its own: {rest}"


@pytest.mark.parametrize("experiment", sorted(TABLES))
def test_each_run_of_the_table_composes_the_checked_in_config(experiment: str) -> None:
    _, strategies, _ = TABLES[experiment]
    expected = yaml.safe_load((EXPECTED / f"{experiment}.yaml").read_text())
    assert sorted(expected) == sorted(strategies)
    for strategy in strategies:
        got = resolved(experiment, strategy)
        differs = sorted(k for k in set(got) | set(expected[strategy]) if got.get(k) != expected[strategy].get(k))
        assert not differs, (f"{experiment} strategy={strategy}: {differs} differ from tests/tables/{experiment}.yaml; "
                             "a default changed under a published table: re-measure it, then "
                             "`python3 -m tests.test_tables --write`")


KEPT_RUNS = sorted((REPO / "docs" / "runs").glob("*/*/config.yaml"))


def _what_it_computes(cfg: dict) -> dict:
    """A composed configuration less where its run and its data lie (``dataset.root``: the
    same idx files, checked by MD5 when installed, wherever they are)."""
    out = {k: v for k, v in cfg.items() if k not in WHERE_KEYS}
    out["dataset"] = {k: v for k, v in out["dataset"].items() if k != "root"}
    return out


@pytest.mark.parametrize("config", KEPT_RUNS, ids=[f"{c.parent.parent.name}/{c.parent.name}" for c in KEPT_RUNS])
def test_each_kept_run_is_what_its_command_composes_today(config: Path, tmp_path: Path) -> None:
    """A table that takes days is finished from the runs kept in docs/runs/, which the sweep
    reuses as done. Each must be what its own command line composes today; a default changed
    under them fails here, and the kept runs must be measured again (their folder removed)."""
    overrides = [o for o in yaml.safe_load((config.parent / "overrides.json").read_text())["overrides"]
                 if o.partition("=")[0] not in WHERE_KEYS]
    kept_config = with_added_groups(yaml.safe_load(config.read_text()))   # a run from before privacy existed
    root = ["dataset.root=/data"] if kept_config["dataset"].get("root") else []   # a dataset read from files
    if kept_config["dataset"].get("source") == "imagefolder":
        # a user's own tree names the dataset and its domains by its folders: compose on a tree
        # with the same folder names (the images themselves are the page's command's to make)
        tree = tmp_path / str(kept_config["dataset"]["name"])
        for domain in kept_config["dataset"]["domains"]:
            (tree / domain / "0").mkdir(parents=True)
        root = [f"dataset.root={tree}"]
    today = OmegaConf.to_container(compose_config({}, [*overrides, *root]), resolve=True)
    kept = _what_it_computes(kept_config)
    now = _what_it_computes(today)   # type: ignore[arg-type]
    differs = sorted(k for k in set(kept) | set(now) if kept.get(k) != now.get(k))
    assert not differs, f"{config.parent.name}: {differs} differ from what `{' '.join(overrides)}` composes today"


def test_the_kept_runs_are_there() -> None:
    assert len(KEPT_RUNS) >= 18, "docs/runs/ lost the finished runs of FEDORA's Fashion-MNIST table"


def test_experiment_overrides_per_strategy_and_the_command_line_wins() -> None:
    """``strategy_overrides``: FDSE gets its own model in the FDSE table's experiment while the
    baselines keep AlexNet-BN at the same widths; a key given on the command line wins."""
    fdse = compose_config({}, ["experiment=fdse-digits-sources", "strategy=fdse"])
    fedbn = compose_config({}, ["experiment=fdse-digits-sources", "strategy=fedbn"])
    assert (fdse.model.name, fdse.model.stem, fdse.model.pool_size, fdse.model.width) == \
        ("fdse-alexnet", "alexnet-bn-small", 2, 0.125)
    assert (fedbn.model.name, fedbn.model.width, fedbn.model.hidden) == ("alexnet-bn", 0.125, 4096)
    assert fdse.train == fedbn.train and fdse.dataset == fedbn.dataset
    mine = compose_config({}, ["experiment=fdse-digits-sources", "strategy=fdse", "model.pool_size=3"])
    assert mine.model.pool_size == 3 and mine.model.name == "fdse-alexnet"
    with pytest.raises(ValueError, match="KEY=VALUE"):
        compose_config({}, ["experiment=fdse-digits-sources", "strategy_overrides.fdse=[oops]"])


def write() -> None:
    for experiment in TABLES:
        _, strategies, _ = TABLES[experiment]
        data = {s: resolved(experiment, s) for s in strategies}
        (EXPECTED / f"{experiment}.yaml").write_text(
            f"# the configuration of each run of the {experiment} table (tests/test_tables.py)\n"
            + yaml.safe_dump(data, sort_keys=True))


if __name__ == "__main__" and "--write" in sys.argv:
    write()
