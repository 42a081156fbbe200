"""A run across its launches: where its files go, and which attempt of it this process belongs to.

Where the files go is one answer for the CLI's config copy and the monitor's timeline (`run_dir`); the
job every attempt belongs to is one id (`restartable_job_id`: the CLI's W&B run, hence its checkpoints).

A run restarted after a fault (``torchrun --max-restarts``, or SLURM requeueing the job) is one run in
several attempts. Under torchrun, the restarted workers rendezvous in the store the elastic agent kept
from the attempt before (`attempt_store`), so their process groups must not read that attempt's keys.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import Trainer


def run_dir(trainer: Trainer) -> Path:
    """The run's own directory, the parent of Lightning's default checkpoint directory:
    ``<save_dir>/<name>/version_<n>`` for CSV and TensorBoard, ``<save_dir>/<project>/<run id>`` for W&B
    (whose ``trainer.log_dir`` is the ``save_dir`` every run shares)."""
    if not trainer.loggers:
        return Path(trainer.default_root_dir)
    logger = trainer.loggers[0]
    save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
    version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
    return Path(save_dir, str(logger.name), version)


def restart_count() -> int:
    """Which attempt of the run this process belongs to: 0 for the first launch, k after k restarts
    (torchrun's ``TORCHELASTIC_RESTART_COUNT``, else SLURM's ``SLURM_RESTART_COUNT`` of a requeued job)."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def attempt_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun's shared store: a client of it whose keys are this attempt's own, else None.

    torchrun (c10d and static rendezvous) hosts one TCPStore in the elastic agent and has every worker
    use it (``TORCHELASTIC_USE_AGENT_STORE=True``); it outlives the workers, and a restart hands the new
    workers the same address with the old attempt's keys still in it (pytorch/pytorch#135712: the fix,
    a new store per restart, is not what torch 2.13 does; see docs/DESIGN.md section 6). Every group's
    rendezvous keys are the same names in every attempt (``0/...`` for the default group, ``1/...``,
    ... for each ``new_group``), so a restarted rank reads a dead peer's address and gloo fails with
    "connectFullMesh failed ... Connection refused", or waits for good on a count the old attempt
    completed. A strategy with more groups (PACIStrategy makes a group per pipeline direction, per
    stage's replicas, per pipeline and for signals) loses that race more often. The prefix makes the
    keys of every attempt distinct; the attempt number is each agent's own count, the same on every
    node when every node's workers failed, as a pipeline's do when one rank dies (its peers' transfers
    fail). Cost: one store client per rank, made once per process.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"lit_efficient/attempt_{restart_count()}", store)


def restartable_job_id() -> str | None:
    """An id every attempt of one job shares and no other job has, or None outside a restartable launcher:
    torchrun's rendezvous id (``--rdzv-id``; with ``--standalone`` the one the launcher draws once) or SLURM's
    job id (kept by ``--requeue``) with its step id where there is one: two ``srun`` steps of one allocation are
    two runs, while a requeued job's steps count from 0 again, each continuing its own. torchrun's default
    ``--rdzv-id`` ("none") names no job, so it is not used."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        job = f"torchrun-{run_id}"
    elif os.environ.get("SLURM_JOB_ID"):
        step = os.environ.get("SLURM_STEP_ID")
        job = f"slurm-{os.environ['SLURM_JOB_ID']}" + (f"-{step}" if step else "")
    else:
        return None
    return re.sub(r"[^A-Za-z0-9_-]", "-", job)[:64]  # the characters and length a W&B run id may have
