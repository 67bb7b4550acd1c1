"""The options several ``pflower`` commands share, as argparse parents, and the overrides'
help (from ``conf/``, never stale). Each command registers itself in its own module
(``add_parser(sub)``), listed once in ``ops/cli.py``'s :data:`COMMANDS`."""

from __future__ import annotations

import argparse

from ops.resources import RAY_ADDRESS_HELP

DEFAULT_MAX_RECOVERIES = 3   # automatic resumes of a run whose processes died
JOBS_HELP = ("runs at once, each its own `pflower run` process (default 1: one after another) on an equal "
             "share of this machine's CPUs (cores / N, the run pinned to them; --num-cpus of them per client); "
             "a run of a small model "
             "uses about two cores, so e.g. --jobs 8 on 16 cores; each run's output goes to "
             "<results_root>/.sweep-logs/")


def run_options() -> argparse.ArgumentParser:
    """The options of every command that starts runs (run, sweep, tune): each simulated
    client's resources, where its Ray runs, and how often a dead run resumes by itself."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--num-cpus", type=float, default=1.0,
                   help="CPUs per simulated client (a whole number; --cpus is the whole run's share)")
    p.add_argument("--num-gpus", type=float, default=None,
                   help="GPUs per simulated client (e.g. 0.25; default: an even share of the "
                        "machine's GPUs when CUDA is present, 0 without)")
    p.add_argument("--max-recoveries", type=int, default=DEFAULT_MAX_RECOVERIES,
                   help="times a run whose processes died is resumed from its checkpoint by itself "
                        f"(default {DEFAULT_MAX_RECOVERIES}; 0 = never)")
    p.add_argument("--ray-address", default=None, help=RAY_ADDRESS_HELP)
    return p


def batch_options() -> argparse.ArgumentParser:
    """The options of the commands that run a batch (sweep, tune): its table, its plot, and
    how many of its runs go at once."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--out", default="", help="write the batch's Markdown table here (as compare --out)")
    p.add_argument("--plot", default="", help="write the batch's comparison plot here (PNG)")
    p.add_argument("--jobs", type=int, default=1, help=JOBS_HELP)
    return p


def overrides_help() -> str:
    """The keys, strategies, datasets and models a run takes (from conf/, never stale)."""
    from common.config import group_options

    groups = "\n".join(f"  {g:<11} {', '.join(group_options(g))}" for g in ("strategy", "dataset", "model",
                                                                           "experiment"))
    return f"""overrides (KEY=VALUE, anywhere on the line, options too):
{groups}
  resume=<run folder> alone resumes a run with its own configuration (only rounds, round_timeout,
    wait_for_clients, device, deterministic, data_cache, checkpoint_every, stream_replies_mb may change)
  rounds, seed, run_name, results_root, overwrite=true, device,
  eval_every, eval_bn_statistics, eval_bn_compare, fraction_train, min_train_clients, round_timeout, checkpoint_every,
  stream_replies_mb,
  train.{{lr,local_epochs,batch_size,momentum,weight_decay,optimizer,amp}},
  dataset.{{root,clients_per_domain,new_clients_per_domain,partition,dirichlet_alpha,image_size}},
  strategy.<option> (see conf/strategy/<name>.yaml), finetune.*, personalize.*,
  privacy.{{dp,clip_norm,noise_multiplier,delta,max_epsilon,noise_seed}} (docs/privacy.md)
  e.g.  pflower run strategy=fdse --num-gpus 0.25 rounds=5
        pflower run dataset=imagefolder dataset.root=/data/my-digits strategy=fedbn
A run writes <results_root>/<run_name>/ (default name [<experiment>-]<strategy>-<dataset>-
<model>-s<seed>[-<hash of other overrides>]); an existing run folder is refused unless
resume=<folder> or overwrite=true. Exit codes: 0 done, 1 failed, 2 bad input (nothing
started), 3 Flower could not start, 4 done but some clients are missing, 130 interrupted.
A run whose simulation dies is resumed from its checkpoint by itself (--max-recoveries)."""
