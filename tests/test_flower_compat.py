"""The one module that adapts Flower's internals (common/flower_compat.py): nothing else
reaches into them, and another Flower release is refused before anything starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common import flower_compat
from ops import cli

REPO = Path(__file__).resolve().parent.parent
INTERNALS = re.compile(r"flwr\.(superlink|supernode)|__kwdefaults__|_parse_args")


def test_only_the_compat_module_touches_flowers_internals() -> None:
    offenders = [f"{path.relative_to(REPO)}:{n}" for path in sorted(REPO.rglob("*.py"))
                 if ".venv" not in path.parts and path != REPO / "common" / "flower_compat.py"
                 and path != Path(__file__).resolve()
                 for n, line in enumerate(path.read_text().splitlines(), 1) if INTERNALS.search(line)]
    assert offenders == [], "Flower internals used outside common/flower_compat.py: " + ", ".join(offenders)


@pytest.mark.parametrize("version", ["1.38.0", "1.40.0", "2.0.0", "none"])
def test_another_flower_is_refused_by_name(version: str) -> None:
    with pytest.raises(flower_compat.FlowerVersionError, match=rf"needs Flower 1\.39\.x.*installed: flwr {version}"):
        flower_compat.check_flower_version(version)


def test_this_flower_is_accepted() -> None:
    flower_compat.check_flower_version("1.39.0")
    flower_compat.check_flower_version("1.39.7")
    flower_compat.check_flower_version()     # the installed one (the project pins 1.39)


def test_pflower_says_so_before_starting_anything(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    started: list[str] = []
    monkeypatch.setattr(flower_compat, "installed_flower_version", lambda: "1.40.1")
    monkeypatch.setattr(cli, "cmd_run", lambda args: started.append("run") or 0)
    assert cli.main(["run", "rounds=1"]) == 2
    assert started == []
    err = capsys.readouterr().err
    assert "installed: flwr 1.40.1" in err and "pip install 'flwr[simulation]>=1.39,<1.40'" in err
