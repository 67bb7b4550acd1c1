"""The floor under a simulated message's hand-off: Flower 1.39's own simulation engine and Ray
with nothing of pflower in the ClientApp and no training, so that what pflower adds per
message (``bench.message_parts``: "outside the handler") can be set beside what the engine
alone costs.

A ServerApp sends every node one message per round, carrying one array of ``--kb`` kilobytes
(pflower packs a message's arrays into one; 436 KB is the MLP of FEDORA's Rotated MNIST),
through the same ``send_and_receive`` pflower's strategies use (``common/flower_compat.py``,
waking on each stored reply), with pflower's indexed message store installed as pflower's
ServerApp installs it; the ClientApp returns the array it got. ``run_simulation`` runs both in
this process with one Ray actor per CPU, as ``pflower run`` does on this machine.

    python -m bench.handoff [--nodes 36] [--kb 436] [--rounds 12] [--flower-loop]

``--flower-loop`` keeps the engine's own pass loop (a 0.1 s sleep after each pass) instead of
pflower's (``engine_waits_for_messages``, which ``client/app.py`` installs in a simulation).

Prints one JSON line: seconds per round (the median of rounds 2 on), the workers' time per
message, ``workers x round / messages`` (the quantity ``bench.message_parts`` gives as a
simulated message's time outside its handler), and the start-up as ``bench.run`` (a) counts
it: from this process' start to the end of the first round less one round, i.e. Python,
Flower, Ray and its actors, in one process (``pflower run`` adds ``flwr run``, a SuperLink and
the simulation's own process).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from common.flower_compat import (
    engine_waits_for_messages,
    index_undelivered_messages,
    send_and_receive,
)
from common.timing import process_age

ARGS = argparse.Namespace(nodes=36, kb=436, rounds=12, flower_loop=False)
ROUND_S: list[float] = []
FIRST_ROUND_END: list[float] = []   # the process' age when the first round ended

client_app = ClientApp()


@client_app.train()
def echo(msg: Message, context: Context) -> Message:
    """The reply a client would send, with no work: the arrays it got."""
    return Message(RecordDict({"arrays": msg.content.array_records["arrays"]}), reply_to=msg)


server_app = ServerApp()


@server_app.main()
def rounds(grid: Grid, context: Context) -> None:
    index_undelivered_messages()
    nodes: list[int] = []
    for _ in range(600):   # the engine registers its nodes as it starts
        nodes = list(grid.get_node_ids())
        if len(nodes) == ARGS.nodes:
            break
        time.sleep(0.1)
    payload = np.random.default_rng(0).random(ARGS.kb * 256, dtype=np.float32)   # kb x 1024 bytes
    for _ in range(ARGS.rounds):
        start = time.perf_counter()
        messages = [Message(RecordDict({"arrays": ArrayRecord({"w": Array(payload)})}), dst_node_id=node,
                            message_type="train") for node in nodes]
        replies = send_and_receive(grid, messages, timeout=600)
        if len(replies) != ARGS.nodes or any(r.has_error() for r in replies):
            raise RuntimeError(f"{len(replies)} of {len(nodes)} replies, or an error among them")
        ROUND_S.append(time.perf_counter() - start)
        if not FIRST_ROUND_END:
            FIRST_ROUND_END.append(process_age())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=ARGS.nodes)
    ap.add_argument("--kb", type=int, default=ARGS.kb)
    ap.add_argument("--rounds", type=int, default=ARGS.rounds)
    ap.add_argument("--flower-loop", action="store_true", help="keep the engine's own pass loop")
    ap.parse_args(namespace=ARGS)
    if ARGS.nodes < 1 or ARGS.kb < 1 or ARGS.rounds < 2:
        ap.error(f"--nodes and --kb must be >= 1 and --rounds >= 2 (the median is of rounds 2 on), got "
                 f"{ARGS.nodes}, {ARGS.kb}, {ARGS.rounds}")
    if not ARGS.flower_loop:
        if not engine_waits_for_messages(load=True):
            raise SystemExit("this Flower's simulation engine is not the one pflower's loop replaces")
    workers = os.cpu_count() or 1
    run_simulation(server_app, client_app, num_supernodes=ARGS.nodes,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    if len(ROUND_S) != ARGS.rounds:
        raise SystemExit(f"the simulation ran {len(ROUND_S)} of {ARGS.rounds} rounds")
    round_s = statistics.median(ROUND_S[1:])
    print(json.dumps({"nodes": ARGS.nodes, "kb": ARGS.kb, "rounds": ARGS.rounds, "workers": workers,
                      "loop": "flower" if ARGS.flower_loop else "pflower",
                      "round_s": round(round_s, 4), "start_up_s": round(FIRST_ROUND_END[0] - round_s, 1),
                      "worker_ms_per_message": round(1000 * workers * round_s / ARGS.nodes, 2)}), flush=True)


if __name__ == "__main__":
    main()
