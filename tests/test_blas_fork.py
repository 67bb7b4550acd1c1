"""The ServerApp's numpy math cannot hang when its process forks (issue 65).

`pflower run strategy=fedbasis` hung for more than 15 minutes on a busy 2-core machine, the
ServerApp's thread waiting in OpenBLAS (``exec_blas``) inside ``np.linalg.norm`` of FedBasis'
bases (``mean_pairwise_cosine``, from ``FedBasis.__init__``). OpenBLAS's fork handler stops its
thread pool, so a fork in another thread of the process (Ray and subprocesses fork) during a
threaded BLAS call leaves that call waiting for ever. The test repeats that race: one thread
forks in a loop while another computes the cosines of model-sized vectors, in a fresh process
whose BLAS has several threads (the test suite's own ``OMP_NUM_THREADS=1`` would hide it).
Without the ServerApp's one BLAS thread the race hung within a second on this machine
(OpenBLAS 0.3.31, numpy 2.4); with it the race runs to its end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

RACE = r"""
import json, os, threading, time
import numpy as np
from threadpoolctl import threadpool_info

import server.app as server_app
from strategies.fedbasis_math import mean_pairwise_cosine


def blas_threads():
    return [d["num_threads"] for d in threadpool_info() if d["user_api"] == "blas"]


def race(seconds):
    bases = [np.random.default_rng(k).standard_normal(400_000) for k in range(3)]
    stop = threading.Event()
    forks = [0]

    def fork_in_a_loop():
        while not stop.is_set():
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
            forks[0] += 1

    forker = threading.Thread(target=fork_in_a_loop, daemon=True)
    forker.start()
    cosines, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        mean_pairwise_cosine(bases)
        cosines += 1
    stop.set()
    forker.join()
    return forks[0], cosines


seen = {"before": blas_threads()}


def serve(grid, context):  # the ServerApp's run, replaced by the race
    seen["during"] = blas_threads()
    seen["forks"], seen["cosines"] = race(3.0)


server_app.serve = serve
server_app.main(None, None)
seen["after"] = blas_threads()
print(json.dumps(seen))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                    reason="OpenBLAS sizes its pool by the CPUs this process may use: one CPU, no race")
def test_the_serverapps_math_survives_forks_in_its_process() -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS"}}
    env["PYTHONPATH"] = str(REPO)
    try:
        done = subprocess.run([sys.executable, "-c", RACE], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the ServerApp's BLAS call hung while its process forked (one_blas_thread in "
                    "server/app.py must keep numpy's BLAS on one thread for the whole run)")
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    if max(seen["before"], default=1) < 2:
        pytest.skip(f"numpy's BLAS has no thread pool here ({seen['before']}): no race to repeat")
    # the race was real (BLAS had a thread pool) and the limit held for the run, then ended
    assert seen["during"] == [1] * len(seen["during"]) and seen["during"], seen
    assert seen["after"] == seen["before"], seen   # the limit ends with the run
    assert seen["forks"] > 10 and seen["cosines"] > 10, seen
