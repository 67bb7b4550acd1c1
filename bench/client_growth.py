"""How a simulation round's time and the server's memory grow with the number of clients (not CI).

    python3 -m bench.client_growth                                  # 10, 100, 1000 clients
    python3 -m bench.client_growth --clients 10 100 --strategies fedavg --out growth.md

Each point is ``pflower run`` of the default config (the default CNN) on ``dataset.synthetic``
images of ``digits-shards``' shape (one domain, 8 x 8, shard split) with ``--samples`` per
client (so that the work per client is the same at every size), 4 rounds, for
``fraction_train`` 1.0 and 0.1; round 3 is timed (``bench/paper_scale.py: measure_run``): by
then every client has had a message (with ``fraction_train`` 0.1 most clients first hear from
the server in round 2, when round 1's evaluation reaches them, and pay their first-message
costs there), and round 3 is a middle round (its training and round 2's carried evaluation;
the last round evaluates by separate messages).
The per-client cost is the slope between the two largest sizes: milliseconds of a round and
MB of the server's peak memory per client. FedAvg keeps no per-client state on the server;
FEDORA keeps each client's basis and model and computes a K x K similarity (its math needs it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.paper_scale import measure_run, report


def point(strategy: str, clients: int, fraction: float, samples: int, root: Path) -> dict[str, object]:
    name = f"{strategy}-{clients}-{fraction}"
    overrides = [f"strategy={strategy}", "dataset=digits-shards", "dataset.synthetic=true",
                 f"dataset.clients_per_domain={clients}",
                 f"dataset.synthetic_samples=[{clients * samples}]", f"fraction_train={fraction}",
                 "min_train_clients=1", "rounds=4"]
    m = measure_run(name, overrides, root)
    row: dict[str, object] = {"strategy": strategy, "clients": clients, "fraction_train": fraction,
                              "exit": m.code, "wall_s": round(m.wall_s, 1), "server_peak_mb": round(m.server_mb),
                              "client_peak_mb": round(m.client_mb), "command": " ".join(overrides)}
    if m.code != 0 or len(m.rounds) < 4:
        row["error"] = m.log_tail
    else:
        row["s_per_round"] = round(m.round_seconds(2), 2)
    return row


def slope(rows: list[dict[str, object]], key: str, scale: float) -> float | None:
    ok = sorted((r for r in rows if key in r), key=lambda r: int(r["clients"]))  # type: ignore[arg-type]
    if len(ok) < 2:
        return None
    a, b = ok[-2], ok[-1]
    return scale * (float(b[key]) - float(a[key])) / (int(b["clients"]) - int(a["clients"]))  # type: ignore[arg-type]


def table(rows: list[dict[str, object]]) -> str:
    out = ["| strategy | fraction_train | clients | s / round (round 3) | server peak MB | client peak MB |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['strategy']} | {r['fraction_train']} | {r['clients']} | {r.get('s_per_round', 'failed')} "
                   f"| {r['server_peak_mb']} | {r['client_peak_mb']} |")
    out += ["", "| strategy | fraction_train | ms / round per client (slope) | server MB per client (slope) |",
            "|---|---|---|---|"]
    for key in sorted({(str(r["strategy"]), float(r["fraction_train"])) for r in rows}):  # type: ignore[arg-type]
        group = [r for r in rows if (r["strategy"], r["fraction_train"]) == key]
        ms, mb = slope(group, "s_per_round", 1000.0), slope(group, "server_peak_mb", 1.0)
        out.append(f"| {key[0]} | {key[1]} | {'-' if ms is None else f'{ms:.1f}'} "
                   f"| {'-' if mb is None else f'{mb:.2f}'} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m bench.client_growth", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", nargs="*", type=int, default=[10, 100, 1000])
    parser.add_argument("--fractions", nargs="*", type=float, default=[1.0, 0.1])
    parser.add_argument("--strategies", nargs="*", default=["fedavg", "fedora"])
    parser.add_argument("--samples", type=int, default=20, help="samples per client")
    parser.add_argument("--out", default="", help="append the Markdown tables and the JSON rows here")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="client-growth-") as tmp:
        for strategy in args.strategies:
            for fraction in args.fractions:
                for clients in args.clients:
                    row = point(strategy, clients, fraction, args.samples, Path(tmp))
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    report(table(rows), rows, args.out)


if __name__ == "__main__":
    main()
