"""Which ``common/flower_compat.py`` items still apply to the next Flower release.

Installs a Flower release (by default the newest ``flwr`` the package index serves) into a
scratch virtual environment that sees this machine's other packages, and there, for each compat
item, imports the Flower files it depends on and applies it (``flower_compat.item_report``); then runs
``tests/test_flower_compat.py``. Prints one line per item (applies / does not: why) and the
failing tests, so an upgrade starts from a list. Non-gating: CI runs it and goes on whatever it
finds (``.ci/run``); it exits 0 when every item applies, 1 when one does not, 2 when the
install failed.

    python3 -m bench.next_flower                          # the newest flwr on the index
    python3 -m bench.next_flower --spec 'flwr[simulation]==1.42.0'
    python3 -m bench.next_flower --venv /tmp/next-flower  # keep (and reuse) the environment
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Run inside the scratch environment: common/flower_compat.py's own report of its items.
PROBE = ("import json; from importlib import metadata; from common.flower_compat import item_report; "
         "print('PROBE ' + json.dumps({'flwr': metadata.version('flwr'), 'rows': item_report()}))")


def make_env(venv: Path, spec: str, pre: bool) -> Path:
    """A venv that sees this Python's packages, with ``spec`` installed over them."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    cmd = [str(python), "-m", "pip", "install", "-q", "--upgrade", spec, *(["--pre"] if pre else [])]
    subprocess.run(cmd, check=True)
    return python


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="flwr[simulation]", help="what pip installs (default: the newest flwr)")
    ap.add_argument("--pre", action="store_true", help="admit pre-releases")
    ap.add_argument("--venv", type=Path, help="the scratch environment (default: a temporary one)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="next-flower-") as tmp:
        venv = args.venv or Path(tmp) / "venv"
        try:
            python = make_env(venv, args.spec, args.pre)
        except subprocess.CalledProcessError as err:
            print(f"next_flower: could not install {args.spec!r} ({err}); nothing checked")
            return 2
        probe = subprocess.run([str(python), "-c", PROBE], cwd=REPO, capture_output=True, text=True)
        line = next((x for x in probe.stdout.splitlines() if x.startswith("PROBE ")), None)
        if line is None:
            print("next_flower: the probe did not finish:\n" + probe.stderr[-3000:])
            return 1
        found = json.loads(line[len("PROBE "):])
        print(f"next_flower: flwr {found['flwr']} (pflower supports {' and '.join(_series())})")
        for name, ok, why in found["rows"]:
            print(f"  item {name}: {'applies' if ok else 'DOES NOT APPLY: ' + why}")
        tests = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
                                "tests/test_flower_compat.py"], cwd=REPO, capture_output=True, text=True)
        failed = [x for x in tests.stdout.splitlines() if x.startswith("FAILED")]
        summary = (tests.stdout.strip().splitlines() or ["(no output)"])[-1]
        print(f"next_flower: tests/test_flower_compat.py: {summary}")
        for x in failed:
            print("  " + x)
        return 0 if all(ok for _, ok, _ in found["rows"]) and not failed else 1


def _series() -> tuple[str, ...]:
    sys.path.insert(0, str(REPO))
    from common.flower_compat import FLOWER_SERIES

    return FLOWER_SERIES


if __name__ == "__main__":
    sys.exit(main())
