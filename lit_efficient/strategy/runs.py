"""A run across its launches: where its files go, and which attempt of it this process belongs to.

Where the files go is one answer for the CLI's config copy and the monitor's timeline (`run_dir`); the
job every attempt belongs to is one id (`restartable_job_id`: the CLI's W&B run, hence its checkpoints).

A run restarted after a fault (``torchrun --max-restarts``, or SLURM requeueing the job) is one run in
several attempts. Under torchrun, the restarted workers rendezvous in the store the elastic agent kept
from the attempt before (`attempt_store`), so their process groups must not read that attempt's keys.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
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


def free_path(path: Path, also: tuple[str, ...] = ()) -> Path:
    """`path` if nothing is there, else the first of ``<stem>-1<suffix>``, ``<stem>-2<suffix>``, ... that is free,
    with its namesakes of the suffixes ``also`` (a pair of files written together: one number for both)."""
    candidate, n = path, 0
    while any(p.exists() for p in (candidate, *(candidate.with_suffix(s) for s in also))):
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate


def attempt_store(rank: int, timeout: timedelta) -> dist.Store | None:
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
    keys of every attempt distinct.

    The attempt's number is drawn by its rank 0 from a counter in the store, not read from torchrun's
    ``TORCHELASTIC_RESTART_COUNT``: that is each agent's own count, and on several nodes they differ (the
    agent whose worker failed counts a restart; another, seeing the rendezvous change before its own worker
    fails, restarts its workers uncounted), so two prefixes waited for each other until the timeout. The other
    ranks read the number where rank 0 publishes it, which may still hold the previous attempt's; they take
    it only once rank 0's beacon (`_Beacon`, on ``MASTER_ADDR``, rank 0's node under torchrun, else on the host
    name rank 0 publishes) confirms it: the previous attempt's rank 0 is gone with its beacon. A process that
    forms its group again (the user destroyed it between two fits) takes only a number above the one it took
    before: its rank 0's beacon may still answer the old one. Cost: one store client per rank and a listening
    socket on rank 0, made once per process.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    host = os.environ["MASTER_ADDR"]
    store = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    global _joined
    if rank == 0:  # a new number, always
        attempt = store.add(_ATTEMPTS_KEY, 1)
        _Beacon.start(str(attempt))
        assert _Beacon.running is not None
        store.set(_ATTEMPT_KEY, f"{attempt} {_Beacon.running.port} {socket.gethostname()}")
    else:
        attempt = _joined = _confirmed_attempt(store, host, rank, timeout)
    return dist.PrefixStore(f"lit_efficient/attempt_{attempt}", store)


_ATTEMPTS_KEY, _ATTEMPT_KEY = "lit_efficient/attempts", "lit_efficient/attempt"
_joined = 0  # the attempt number a rank other than 0 last formed its default group under, in this process


def _confirmed_attempt(store: dist.Store, host: str, rank: int, timeout: timedelta) -> int:
    """The attempt number this attempt's rank 0 published, once its beacon confirms it is not a dead one's."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        if store.check([_ATTEMPT_KEY]):
            attempt, port, name = store.get(_ATTEMPT_KEY).decode().split()
            hosts = dict.fromkeys((host, name))  # MASTER_ADDR first (a service's address may forward no other port)
            if int(attempt) > _joined and any(_Beacon.ask(h, int(port)) == attempt for h in hosts):
                return int(attempt)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank} waited {timeout.total_seconds():g} s for this attempt's rank 0 to publish its number in "
                f"torchrun's store and answer it on a port of its own (at {host}): start every node's torchrun "
                "together, let the nodes reach each other's ports (as gloo and NCCL need), or raise "
                "PACIStrategy(timeout=...)"
            )
        time.sleep(0.05)


class _Beacon:
    """A socket on rank 0 that answers every connection with the attempt's number, then closes it: a number read
    from the store is this attempt's only if the process listening where it says answers it. Lives as long as
    the process (the ranks of an NCCL group may connect after rank 0's group is formed); a daemon thread."""

    running: _Beacon | None = None

    def __init__(self, attempt: str) -> None:
        self.answer = attempt.encode()
        family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
        self.server = socket.create_server(("", 0), family=family, dualstack_ipv6=family == socket.AF_INET6)
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, name="lit-efficient-attempt-beacon", daemon=True).start()

    @classmethod
    def start(cls, attempt: str) -> None:
        cls.stop()
        cls.running = cls(attempt)

    @classmethod
    def stop(cls) -> None:
        if cls.running is not None:
            with contextlib.suppress(OSError):  # wakes the thread's accept, which a close alone leaves listening
                cls.running.server.shutdown(socket.SHUT_RDWR)
            cls.running.server.close()
            cls.running = None

    def _serve(self) -> None:
        with contextlib.suppress(OSError):  # closed by `stop`
            while True:
                connection, _ = self.server.accept()
                with connection:
                    connection.sendall(self.answer)

    @staticmethod
    def ask(host: str, port: int) -> str | None:
        try:
            with socket.create_connection((host, port), timeout=2.0) as connection:
                return connection.makefile("rb").read(64).decode()
        except OSError:  # nothing listens there (the previous attempt's rank 0 is gone): not confirmed
            return None


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
