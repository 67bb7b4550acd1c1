"""Command-line overrides are read in one place (common/overrides.py), by Hydra's own parser:
its prefixes, quotes, lists and sweep syntax mean what they mean in Hydra."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.config import ConfigError, compose_config
from common.overrides import expand_grid, override_key, override_values, split_overrides
from ops.tune import GridAxis

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("text", "key"), [
    ("train.lr=0.1", "train.lr"), ("+train.extra=1", "train.extra"), ("++seed=3", "seed"),
    ("~dataset.root", "dataset.root"), ("overrides='a=1 b=2'", "overrides"),
])
def test_an_override_key_is_read_without_its_prefix(text: str, key: str) -> None:
    assert override_key(text) == key


def test_values_are_read_as_hydra_reads_them() -> None:
    assert override_values(["resume='/a b/c'", "seed=1", "resume=/d"], "resume") == ["/a b/c", "/d"]
    assert override_values(["seed=1"], "seed") == [1]


def test_sweeps_expand_as_hydras_basic_sweeper() -> None:
    grid = expand_grid(["strategy=fedavg,fedbn", "seed=range(0,2)", "dataset.domains=[a,b]", "run_name='x,y'"])
    expected = [[f"strategy={s}", f"seed={n}", "dataset.domains=[a,b]", "run_name='x,y'"]
                for s in ("fedavg", "fedbn") for n in (0, 1)]
    assert grid == expected


def test_run_config_keys_are_split_from_the_rest() -> None:
    run_cfg, rest = split_overrides(["strategy=fedbn", "seed=2", "+seed=3", "train.lr=0.1"])
    assert run_cfg == {"strategy": "fedbn", "seed": "2"} and rest == ["+seed=3", "train.lr=0.1"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["strategy"], "is not KEY=VALUE"),
    (["train.lr=("], "cannot be read"),
    (["strategy=fedavg,fedbn"], "pflower sweep strategy=fedavg,fedbn"),
])
def test_a_bad_override_is_refused_by_name(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose_config({}, overrides)


@pytest.mark.parametrize("text", ["strategy=glob(fed*)", "train.lr=interval(0.001,0.1)",
                                  "hydra.job.chdir=true,false"])
def test_a_sweep_that_names_no_list_of_runs_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="pflower sweeps comma lists and range"):
        expand_grid([text, "seed=0,1"])


def test_tune_grid_axes_are_hydra_sweeps() -> None:
    assert GridAxis.parse("fedprox:strategy.mu=0.01,0.1") == GridAxis("strategy.mu", ("0.01", "0.1"), "fedprox")
    assert GridAxis.parse("train.epochs=range(1,3)") == GridAxis("train.epochs", ("1", "2"))
    with pytest.raises(ConfigError, match="--grid"):
        GridAxis.parse("train.lr")


def test_no_module_reads_an_override_by_hand() -> None:
    hand = re.compile(r"""lstrip\(\s*["']\+~?["']\s*\)|\.startswith\(\s*["'][\w.]+=["']""")
    found = [f"{path.relative_to(REPO)}:{n}" for pkg in ("common", "server", "strategies", "client", "ops", "bench")
             for path in sorted((REPO / pkg).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if hand.search(line)]
    assert found == [], "read overrides with common.overrides.override_key / override_values:\n" + "\n".join(found)
