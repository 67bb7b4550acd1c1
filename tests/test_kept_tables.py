"""Every table printed from kept runs is what ``pflower compare`` prints of them, and every
ordering a page states about such a table holds in the runs, with the margin it gives.

A page marks a table it prints from the runs kept in ``docs/runs/<name>/`` with

    <!-- compare: <name> -->
    ...the output of `pflower compare docs/runs/<name>/*`, verbatim...
    <!-- /compare -->

and the orderings its sentences state about that table's rows with

    <!-- orderings: <name>
    fedbn > fedavg, own, +14.8, every seed
    fedavg-ft > local, own, +1.2, not every seed
    ditto ~ local, stored, +0.3
    -->

one line per claim: two row labels of the table (as compare prints them), ``>``, ``<`` or ``~``
(level: the gap within one seed standard deviation of either row), the BN protocol the means
are taken under (``own`` or ``stored``; a row with one protocol has the same value under
both), the gap in points (100 x the difference of the two rows' means over seeds, one decimal)
and, for ``>`` and ``<``, whether it holds in every seed (paired by seed; ``one seed`` for a
table of one seed, where that says nothing). A fine-tune curve
(FedBABU's Table 5 form) is marked ``<!-- curve: <name> -->`` ... ``<!-- /curve -->`` and is the
mean over seeds of each row's ``finetune_curve``. New clients' personalisation (``pflower
personalize``, each run's ``new_clients.json``) is marked ``<!-- new-clients: <name> -->`` ...
``<!-- /new-clients -->``: per row, mode and size, each lr's last-epoch and best-by-validation
test accuracy (mean over the new clients), mean ± std over the seeds. The authors' own FEDORA
script's runs (``bench/authors_fedora_run.py``, one JSON a run) beside pflower's kept runs are
marked ``<!-- authors-fedora: <their folder> <our folder> -->`` ... ``<!-- /authors-fedora -->``.
A run removed, a digit changed or an ordering that does not hold fails here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from ops.compare import compare_runs, load_summary, rows_by_configuration

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
KEPT = DOCS / "runs"
COMPARE_BLOCK = re.compile(r"<!-- compare: (\S+) -->\n(.*?)\n<!-- /compare -->", re.S)
ORDERINGS_BLOCK = re.compile(r"<!-- orderings: (\S+)\n(.*?)\n-->", re.S)
# `a > b, own, +1.2, every seed`: the final round's mean accuracy over clients under that BN
# protocol; `own@best` / `stored@best`: at each run's best-validation round (the paper's
# protocol of FDSE's and FEDORA's tables)
CLAIM = re.compile(r"(?P<a>.+?) (?P<op>[<>~]) (?P<b>.+?), (?P<protocol>own|stored)(?P<at_best>@best)?, "
                   r"(?P<gap>[+-]\d+\.\d)"
                   r"(?:, (?P<seeds>every seed|not every seed|one seed))?")
# kept runs whose table is checked by its own test (tests/test_compare_rows.py)
CHECKED_ELSEWHERE = {"fedora-rotated-fashion-mnist"}


def _blocks(pattern: re.Pattern[str]) -> list[tuple[str, str, str]]:
    """(page, name, body) of every block of ``pattern`` in docs/."""
    return [(str(page.relative_to(REPO)), m.group(1), m.group(2))
            for page in sorted(DOCS.rglob("*.md")) for m in pattern.finditer(page.read_text())]


def _runs(name: str) -> list[Path]:
    folder = KEPT / name
    assert folder.is_dir(), f"docs/runs/{name} does not exist: keep the table's runs there"
    return sorted(p for p in folder.iterdir() if p.is_dir())


CURVE_BLOCK = re.compile(r"<!-- curve: (\S+) -->\n(.*?)\n<!-- /curve -->", re.S)
NEW_CLIENTS_BLOCK = re.compile(r"<!-- new-clients: (\S+) -->\n(.*?)\n<!-- /new-clients -->", re.S)
# the authors' own FEDORA script beside pflower's kept runs: `<!-- authors-fedora: <theirs> <ours> -->`,
# the output of `python3 -m bench.authors_fedora_run --compare docs/runs/<theirs>/*.json --ours docs/runs/<ours>`
AUTHORS_BLOCK = re.compile(r"<!-- authors-fedora: (\S+) (\S+) -->\n(.*?)\n<!-- /authors-fedora -->", re.S)
AUTHORS = [(str(page.relative_to(REPO)), m.group(1), m.group(2), m.group(3))
           for page in sorted(DOCS.rglob("*.md")) for m in AUTHORS_BLOCK.finditer(page.read_text())]
COMPARES = _blocks(COMPARE_BLOCK)
ORDERINGS = _blocks(ORDERINGS_BLOCK)
CURVES = _blocks(CURVE_BLOCK)
NEW_CLIENTS = _blocks(NEW_CLIENTS_BLOCK)


def test_every_kept_folder_has_its_table_on_a_page() -> None:
    named = {name for _, name, _ in COMPARES}
    folders = {p.name for p in KEPT.iterdir() if p.is_dir()}
    missing = folders - CHECKED_ELSEWHERE - named - {theirs for _, theirs, _, _ in AUTHORS}
    assert not missing, f"kept runs without a table: {sorted(missing)}"
    assert {name for _, name, _ in ORDERINGS} <= named


@pytest.mark.parametrize(("page", "name", "printed"), COMPARES, ids=[f"{p}:{n}" for p, n, _ in COMPARES])
def test_the_page_prints_what_compare_gives_of_the_kept_runs(page: str, name: str, printed: str) -> None:
    assert f"pflower compare docs/runs/{name}/*" in (REPO / page).read_text(), \
        f"{page} does not print the command that gives its table"
    assert compare_runs(_runs(name)) == printed, \
        f"{page}: the table marked `compare: {name}` is not `pflower compare docs/runs/{name}/*`"


@pytest.mark.parametrize(("page", "theirs", "ours", "printed"), AUTHORS, ids=[f"{p}:{t}" for p, t, _, _ in AUTHORS])
def test_the_authors_script_table_is_their_kept_runs_beside_ours(page: str, theirs: str, ours: str, printed: str) -> None:
    from bench.authors_fedora_run import compare

    command = f"python3 -m bench.authors_fedora_run --compare docs/runs/{theirs}/*.json --ours docs/runs/{ours}"
    assert command in (REPO / page).read_text(), f"{page} does not print the command that gives its table"
    files = sorted((KEPT / theirs).glob("*.json"))
    assert files, f"docs/runs/{theirs} holds no run of the authors' script"
    assert compare(files, KEPT / ours) == printed, f"{page}: the table marked `authors-fedora: {theirs}` is not `{command}`"


def _mean_by_seed(members: list[dict], protocol: str, at_best: bool = False) -> dict[int, float]:
    """A row's per-seed mean accuracy under ``protocol``, at the final round or (``at_best``)
    at the run's best-validation round under that protocol; a run with one protocol (no
    ``bn_protocols``: the server's model, or no BatchNorm) has it under both."""
    key = "best_accuracy_mean" if at_best else "accuracy_mean"
    out = {}
    for r in members:
        measured = r.get("bn_protocols", {protocol: r})
        assert protocol in measured, f"{r['_dir']} did not measure the {protocol} protocol"
        out[int(r["seed"])] = float(measured[protocol][key])
    return out


def check_claim(line: str, rows: dict[str, list[dict]]) -> None:
    """Raise AssertionError naming what fails when ``line`` (one ordering) does not hold in ``rows``."""
    m = CLAIM.fullmatch(line.strip())
    assert m, f"not an ordering line: {line!r} (form: `a > b, own, +1.2, every seed`)"
    for label in (m["a"], m["b"]):
        assert label in rows, f"{line!r}: no row labelled {label!r} (rows: {sorted(rows)})"
    at_best = m["at_best"] is not None
    a, b = _mean_by_seed(rows[m["a"]], m["protocol"], at_best), _mean_by_seed(rows[m["b"]], m["protocol"], at_best)
    seeds = sorted(a)
    assert seeds == sorted(b), f"{line!r}: the rows' seeds differ ({sorted(a)}, {sorted(b)})"
    gap = 100 * (np.mean(list(a.values())) - np.mean(list(b.values())))
    assert f"{gap:+.1f}" == m["gap"], f"{line!r}: the gap is {gap:+.2f} points"
    if m["op"] == "~":
        spread = 100 * max(np.std(list(a.values())), np.std(list(b.values())))
        assert abs(gap) <= spread, f"{line!r}: a gap of {gap:+.2f} is outside one seed std ({spread:.2f})"
        assert m["seeds"] is None, f"{line!r}: a level pair states no seeds"
        return
    sign = 1 if m["op"] == ">" else -1
    assert sign * gap > 0, f"{line!r}: the gap {gap:+.2f} has the other sign"
    if len(seeds) == 1:
        assert m["seeds"] == "one seed", f"{line!r}: one seed holds or fails in every seed; say `one seed`"
        return
    every = all(sign * (a[s] - b[s]) > 0 for s in seeds)
    assert m["seeds"] == ("every seed" if every else "not every seed"), \
        f"{line!r}: by seed {[round(100 * (a[s] - b[s]), 1) for s in seeds]}"


@pytest.mark.parametrize(("page", "name", "claims"), ORDERINGS, ids=[f"{p}:{n}" for p, n, _ in ORDERINGS])
def test_each_ordering_the_page_states_holds_in_the_kept_runs(page: str, name: str, claims: str) -> None:
    groups, _ = rows_by_configuration([load_summary(d) for d in _runs(name)])
    rows = {label: members for (label, _, _), members in groups.items()}
    assert len(rows) == len(groups), f"docs/runs/{name}: two rows share a label (another dataset or model)"
    for line in claims.strip().splitlines():
        check_claim(line, rows)


def curve_table(runs: list[Path]) -> str:
    """The fine-tune curve of each row (summary.json's ``finetune_curve``: test accuracy after
    E fine-tune epochs), the mean over the row's seeds, one column per E."""
    groups, _ = rows_by_configuration([load_summary(d) for d in runs])
    epochs = sorted({int(e) for members in groups.values() for r in members for e in r.get("finetune_curve", {})})
    lines = ["| row | seeds | " + " | ".join(f"e{e}" for e in epochs) + " |", "|" + "---|" * (len(epochs) + 2)]
    for (label, _, _), members in sorted(groups.items()):
        if all("finetune_curve" in r for r in members):
            means = [np.mean([r["finetune_curve"][str(e)] for r in members]) for e in epochs]
            lines.append(f"| {label} | {','.join(str(r['seed']) for r in members)} | "
                         + " | ".join(f"{m:.4f}" for m in means) + " |")
    return "\n".join(lines)


@pytest.mark.parametrize(("page", "name", "printed"), CURVES, ids=[f"{p}:{n}" for p, n, _ in CURVES])
def test_the_fine_tune_curve_is_the_mean_of_the_kept_runs(page: str, name: str, printed: str) -> None:
    assert curve_table(_runs(name)) == printed, f"{page}: the curve marked `curve: {name}` is not its kept runs'"


def new_client_table(runs: list[Path]) -> str:
    """New clients' personalisation of each row (its runs' ``new_clients.json``, written by
    ``pflower personalize``): per mode and size, each lr's test accuracy after the last epoch
    and at the best-validation epoch (each the mean over the run's new clients), mean ± std
    over the row's seeds."""
    groups, _ = rows_by_configuration([load_summary(d) for d in runs])
    folder_of = {(r["run_name"], r["seed"]): d for d in runs for r in [load_summary(d)]}
    lines: list[str] = []
    for (label, _, _), members in sorted(groups.items()):
        found = [json.loads((folder_of[(r["run_name"], r["seed"])] / "new_clients.json").read_text())
                 for r in members]
        lrs = [str(lr) for lr in found[0]["settings"]["lrs"]]
        if not lines:
            lines = ["| row | seeds | mode | size | " + " | ".join(f"lr {lr}: last / best" for lr in lrs) + " |",
                     "|" + "---|" * (len(lrs) + 4)]
        for mode, sizes in found[0]["summary"].items():
            for size in sizes:
                cells = []
                for lr in lrs:
                    last = np.array([f["summary"][mode][size][lr]["last_mean"] for f in found])
                    best = np.array([f["summary"][mode][size][lr]["best_mean"] for f in found])
                    cells.append(f"{last.mean():.4f} ± {last.std():.4f} / {best.mean():.4f} ± {best.std():.4f}")
                lines.append(f"| {label} | {','.join(str(r['seed']) for r in members)} | {mode} | {size} | "
                             + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_every_kept_personalisation_has_its_table_on_a_page() -> None:
    kept = {p.parent.parent.name for p in KEPT.glob("*/*/new_clients.json")}
    assert kept <= {name for _, name, _ in NEW_CLIENTS}, \
        f"kept new_clients.json without a `new-clients` table on a page: {sorted(kept - {n for _, n, _ in NEW_CLIENTS})}"


@pytest.mark.parametrize(("page", "name", "printed"), NEW_CLIENTS, ids=[f"{p}:{n}" for p, n, _ in NEW_CLIENTS])
def test_the_new_client_table_is_the_kept_runs_personalisation(page: str, name: str, printed: str) -> None:
    assert new_client_table(_runs(name)) == printed, \
        f"{page}: the table marked `new-clients: {name}` is not its kept runs' new_clients.json"


def _fake_rows() -> dict[str, list[dict]]:
    def run(seed: int, acc: float, stored: float | None = None) -> dict:
        # at the best-validation round each run is 5 points above its final round, but fedbn's
        # seed 1 is 10 (own) and 0 (stored) above it
        up = {"own": 0.10, "stored": 0.0} if seed == 1 else {"own": 0.05, "stored": 0.05}
        r: dict = {"seed": seed, "accuracy_mean": acc, "best_accuracy_mean": acc + 0.05}
        if stored is not None:
            r["bn_protocols"] = {p: {"accuracy_mean": v, "best_accuracy_mean": v + up[p]}
                                 for p, v in (("own", acc), ("stored", stored))}
        return r
    return {"fedbn": [run(0, 0.90, 0.80), run(1, 0.86, 0.85), run(2, 0.88, 0.84)],
            "fedavg": [run(0, 0.84), run(1, 0.87), run(2, 0.83)],
            "local": [run(0, 0.80, 0.80), run(1, 0.81, 0.81)],             # seeds 0 and 1 only
            "ditto": [run(0, 0.95, 0.95)], "fdse": [run(0, 0.90, 0.90)]}  # one seed


@pytest.mark.parametrize(("line", "fails"), [
    ("fedbn > fedavg, own, +3.3, not every seed", None),
    ("fedbn > fedavg, own, +3.3, every seed", "by seed"),          # seed 1: 0.86 < 0.87
    ("fedbn > fedavg, own, +3.4, not every seed", "the gap is"),   # a digit changed
    ("fedavg > fedbn, own, -3.3, not every seed", "other sign"),
    ("fedbn ~ fedavg, stored, -1.7", None),                        # within fedavg's std (1.70)
    ("fedbn ~ fedavg, own, +3.3", "outside one seed std"),
    ("fedprox > fedavg, own, +3.3, every seed", "no row labelled"),
    ("fedbn beats fedavg", "not an ordering line"),
    ("fedavg < fedbn, own, -3.3, not every seed", None),
    ("fedavg < fedbn, own, -3.3, every seed", "by seed"),
    ("fedbn > fedavg, stored, +-1.7, not every seed", "not an ordering line"),
    ("fedbn < fedavg, stored, -1.7, every seed", "by seed"),               # seed 2: 0.84 > 0.83
    ("fedbn ~ fedavg, stored, -1.7, every seed", "states no seeds"),
    ("fedbn ~ local, own, +6.0", "seeds differ"),
    ("ditto > fdse, own, +5.0, one seed", None),
    ("ditto > fdse, own, +5.0, every seed", "say `one seed`"),
    ("fedbn > fedavg, own@best, +5.0, every seed", None),           # at the best round: 0.95, 0.96, 0.93
    ("fedbn > fedavg, own@best, +3.3, every seed", "the gap is"),   # the final round's gap
    ("fedbn < fedavg, stored@best, -3.3, not every seed", None),   # by seed -4, -7, +1
    ("fedbn < fedavg, stored@best, -3.3, every seed", "by seed"),
    ("fedbn > fedavg, stored@best, -3.3, not every seed", "other sign"),
    ("fedbn > fedavg, own @best, +5.0, every seed", "not an ordering line"),
])
def test_the_ordering_check_fails_on_what_does_not_hold(line: str, fails: str | None) -> None:
    """The check itself, on rows made here: it passes the true claims and names each false one."""
    if fails is None:
        check_claim(line, _fake_rows())
    else:
        with pytest.raises(AssertionError, match=fails):
            check_claim(line, _fake_rows())
