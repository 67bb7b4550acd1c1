"""What a simulation may use: each simulated client's CPU and GPU share, the Ray instance
its clients run on (a private one, or a cluster), and Flower's federation config of it."""

from __future__ import annotations

import os

from common.config import ConfigError

ACTORS_PER_GPU = 8  # each client actor holds its own CUDA context (about 0.5 GB) and model


def number_text(x: float) -> str:
    """``2`` for 2.0 (a whole number as Flower's and Ray's options take it), else ``0.25``."""
    return str(int(x)) if float(x).is_integer() else str(x)


def gpu_share(num_clients: int, gpus: int, cpus: int, cpus_per_client: float) -> float:
    """GPUs per simulated client when ``--num-gpus`` is not given: 0 without a GPU, else
    the GPUs split evenly among the clients that can run at once (bounded by the clients,
    the CPUs they reserve and ``ACTORS_PER_GPU`` per GPU), as ``1/k`` of a GPU."""
    if gpus <= 0:
        return 0.0
    concurrent = min(num_clients, max(1, int(cpus // max(cpus_per_client, 1e-9))), ACTORS_PER_GPU * gpus)
    per_gpu = max(1, -(-concurrent // gpus))   # ceil
    return 1.0 / per_gpu


def visible_gpus() -> int:
    """The CUDA GPUs torch sees on this machine (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def usable_cores() -> list[int]:
    """The CPU numbers this process may run on (its affinity, as a container limits it), else
    all of the machine's."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return list(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """How many CPUs this process may run on (:func:`usable_cores`)."""
    return len(usable_cores())


def cpus_per_run(jobs: int) -> int:
    """The CPUs each of ``jobs`` runs at once may use: an equal share of this machine's.

    Every run starts its own private Ray instance, and each would otherwise take the whole
    machine: ``jobs`` instances start ``jobs`` times as many clients as there are cores, each
    with as many threads as its ``--num-cpus`` (Ray sets ``OMP_NUM_THREADS``), and the cores
    spend the round switching threads (measured in docs/benchmarks.md)."""
    return max(1, usable_cpus() // max(jobs, 1))


def core_groups(cores: list[int], jobs: int) -> list[tuple[int, ...]] | None:
    """``jobs`` disjoint sets of ``len(cores) // jobs`` cores each, in order (None when there
    are fewer cores than jobs: the runs then share them all).

    Why: a run's Ray share (``--cpus``) bounds its clients, not its ServerApp, SuperLink and
    Ray's own processes, nor the threads torch and BLAS start in them (one per core of the
    machine). Seven 36-client runs on a 16-core H100 machine, each given 2 CPUs, took 3.4 s a
    round; the same runs each pinned to 2 cores took 1.6 s (docs/benchmarks.md, "Each
    parallel run pinned to cores of its own")."""
    per = len(cores) // max(jobs, 1)
    if per < 1:
        return None
    return [tuple(cores[i * per:(i + 1) * per]) for i in range(jobs)]


def pin_to(cores: tuple[int, ...]) -> None:
    """Run this process (and what it starts) on ``cores`` only; a set the machine cannot
    give (cores it lacks) leaves the process where it was, unpinned but running."""
    try:
        os.sched_setaffinity(0, cores)
    except (AttributeError, OSError):
        pass


def check_client_resources(num_cpus: float, num_gpus: float, ray_address: str,
                           ray_cpus: int | None = None) -> None:
    """A client that asks for more than this machine (or this run's ``--cpus`` share of it)
    has never starts: Flower's Ray engine builds an empty actor pool and the run dies after its
    start-up ("ActorPool is empty"). Refused before anything starts, for the private Ray
    instance (a cluster may have more). Flower 1.39 takes a whole number of CPUs per client
    (its ``client-resources-num-cpus`` is an integer), so a fraction is refused here too."""
    if num_cpus > 0 and not float(num_cpus).is_integer():
        raise ConfigError(f"--num-cpus {number_text(num_cpus)}: Flower takes a whole number of CPUs per simulated "
                          f"client; use --num-cpus {max(1, round(num_cpus))} (to run more clients at once, "
                          "give the run more CPUs rather than each client less)")
    if ray_address != "local":
        return
    cpus = os.cpu_count() or 1
    gpus = visible_gpus()
    if num_cpus <= 0:
        raise ConfigError(f"--num-cpus {number_text(num_cpus)}: each simulated client needs a positive CPU share "
                          "(e.g. --num-cpus 1)")
    if ray_cpus is not None and ray_cpus < 1:
        raise ConfigError(f"--cpus {ray_cpus}: a run needs at least one CPU (leave it out for all of them)")
    if ray_cpus is not None and num_cpus > ray_cpus:
        raise ConfigError(f"--num-cpus {number_text(num_cpus)} per client, but this run may use {ray_cpus} CPUs "
                          f"(--cpus {ray_cpus}): no simulated client could start; use --num-cpus {ray_cpus} "
                          "or less, or a larger --cpus")
    if num_cpus > cpus:
        raise ConfigError(f"--num-cpus {number_text(num_cpus)} per client, but this machine has {cpus} CPUs: no "
                          f"simulated client could start; use --num-cpus {cpus} or less (clients run "
                          "num_cpus_of_machine / --num-cpus at a time)")
    if num_gpus > max(gpus, 0):
        raise ConfigError(f"--num-gpus {number_text(num_gpus)} per client, but this machine has {gpus} GPU(s): no "
                          "simulated client could start; use a share such as --num-gpus 0.25, or leave it "
                          "out (an automatic share)")


def resolve_gpu_share(device: str, num_clients: int, requested: float | None,
                      cpus_per_client: float, ray_cpus: int | None = None) -> float:
    """The ``client-resources-num-gpus`` of a simulation. Ray hides the GPU from actors that
    reserve none, so on a CUDA machine clients get a share unless told ``--num-gpus 0``;
    ``device=cuda`` without CUDA, or with ``--num-gpus 0``, is refused before anything starts."""
    import torch

    gpus = visible_gpus()
    if device.startswith("cuda") and gpus == 0:
        raise ConfigError(f"device={device} but this machine has no CUDA GPU (torch "
                          f"{torch.__version__}); use device=auto (CUDA when present) or device=cpu")
    cpus = ray_cpus or os.cpu_count() or 1
    share = gpu_share(num_clients, gpus, cpus, cpus_per_client) if requested is None \
        else float(requested)
    if device.startswith("cuda") and share <= 0:
        raise ConfigError(f"device={device} with --num-gpus 0: Ray hides the GPU from clients that "
                          "reserve none; leave --num-gpus out (an automatic share) or pass e.g. --num-gpus 0.25")
    return share


RAY_ADDRESS_HELP = ("run the simulation's clients on an existing Ray cluster (host:port of its head, "
                    "started with `ray start --head`; other machines join with `ray start --address`), "
                    "for a simulation larger than one machine; default: the RAY_ADDRESS environment "
                    "variable, else a private Ray instance on this machine (never a cluster found by chance)")


def ray_cluster(address: str | None) -> str | None:
    """The Ray cluster a run joins: ``address``, else ``RAY_ADDRESS``; None for a private
    instance on this machine (neither set, or ``local``, which :func:`use_ray_cluster` itself
    writes into this process's environment)."""
    chosen = address or os.environ.get("RAY_ADDRESS")
    return chosen if chosen and chosen != "local" else None


def use_ray_cluster(address: str | None) -> str:
    """Where the simulation's Ray runs: ``address`` (or ``RAY_ADDRESS``), else ``local``, a
    private instance. Ray's own default would join any cluster ``ray start`` left running on
    this machine; the simulation process (started by the SuperLink) inherits the variable."""
    chosen = ray_cluster(address) or "local"
    os.environ["RAY_ADDRESS"] = chosen
    return chosen


def simulated_nodes(num_clients: int, num_cpus: float, num_gpus: float, cpus: int, gpus: int) -> int:
    """How many SuperNodes a simulation on one machine gets: as many as clients can run at
    once (its ``cpus`` over each client's ``num_cpus``, its ``gpus`` over each client's
    ``num_gpus``), at most one per client. Each node serves the clients ``c mod N = p``
    (``client/identity.py``) and gets their messages of an exchange in a few bundles
    (``common/bundles.py``): Flower's engine pays about 10 ms of a worker's time per message
    whatever it carries, so 36 clients on 2 nodes cost 4 hand-offs a round, not 36
    (docs/benchmarks.md (a))."""
    at_once = max(1, int(cpus // max(num_cpus, 1e-9)))
    if num_gpus > 0:
        at_once = min(at_once, max(1, int(round(gpus / num_gpus, 6))))
    return max(1, min(num_clients, at_once))


def simulation_config(num_clients: int, num_cpus: float, num_gpus: float, ray_cpus: int | None,
                      num_nodes: int | None = None) -> str:
    """Flower's ``--federation-config`` of a simulation: ``num_nodes`` SuperNodes (one per
    client when None: a Ray cluster's size is not known here), each client's Ray resources,
    and (``ray_cpus``) the CPUs the run's private Ray instance may use, all of the machine's
    when None."""
    config = (f"num-supernodes={num_nodes or num_clients} client-resources-num-cpus={number_text(num_cpus)} "
              f"client-resources-num-gpus={number_text(num_gpus)}")
    return config + (f" init-args-num-cpus={ray_cpus}" if ray_cpus is not None else "")


