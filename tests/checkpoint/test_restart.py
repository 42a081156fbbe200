"""A rank SIGKILLed mid-run under torch elastic (``torchrun --max-restarts 1 --rdzv-backend c10d``), the run
restarted from ``ckpt_path="last"``, ends at the weights of a deliberate resume from the same checkpoint.

The agent is torchrun's own (`torch.distributed.launcher.api.elastic_launch`, what ``torchrun`` runs): the
c10d rendezvous, the store it shares with the workers, the restart count, the kill of the surviving rank and
the second rendezvous are all torchrun's. What differs from the command line is how a worker starts:
forked from the agent, which was forked from the test session's preloaded server, instead of a fresh
``python train.py`` importing torch and Lightning (about 15 s of CPU per worker and attempt here: a minute
per test, four workers). ``python -m benchmarks.restart`` runs the ``torchrun`` command itself, ten times.

Each test runs, in one agent process: the killed-and-restarted run (rank 1 kills itself once, on the first
attempt, at optimizer step 2; a `ModelCheckpoint` saves every step and ``last``), then a second launch that
resumes deliberately from the checkpoint the restarted attempt loaded (a copy: the first batch after a resume
saves under that step's name again, mid-window), with nothing killed. Both continue
to step 4 with the same checkpoints written on the way (under PACI a save drains the pipeline, so it is
part of the trajectory), and must agree to 1e-6.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lit_efficient import PACIStrategy
from tests.support.gpt_runs import ValHistory
from tests.support.gpt_runs import gpt_model as _model
from tests.support.gpt_runs import gpt_trainer as _trainer
from tests.support.gpt_runs import max_diff as _max_diff
from tests.support.gpt_runs import text_data as _data
from tests.support.multiproc import START_METHOD, _free_port

pytestmark = pytest.mark.multiproc

STEPS, KILL_AT = 4, 2


class _KillOnce(Callback):
    """SIGKILLs rank 1 at the end of optimizer step ``KILL_AT`` on the first attempt only, and records, on the
    attempt that resumed, which step it resumed at."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank != 0:
            return
        seen = {"attempt": int(os.environ["TORCHELASTIC_RESTART_COUNT"]), "step": trainer.global_step}
        Path(self.out, f"start-{seen['attempt']}.json").write_text(json.dumps(seen))
        if trainer.ckpt_path is not None:  # kept: the first batch after a resume saves under the same name again
            copy = shutil.copytree if Path(trainer.ckpt_path).is_dir() else shutil.copyfile
            copy(trainer.ckpt_path, self.out / "resumed-from.ckpt")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
        if first and trainer.global_rank == 1 and trainer.global_step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


def _worker(out: str, schedule: str, fmt: str, ckpt_path: str, kill: bool) -> None:
    """One torch elastic worker: a 2-stage fit to step ``STEPS`` saving every step; rank 0 writes the weights."""
    torch.set_num_threads(1)
    out_dir = Path(out)
    ckpt = ModelCheckpoint(
        dirpath=out_dir / "checkpoints", filename="{step}", every_n_train_steps=1, save_top_k=-1, save_last=True
    )
    strategy = PACIStrategy(pipeline_stages=2, schedule=schedule, checkpoint_format=fmt, p2p_timeout=30)
    callbacks = [ckpt, _KillOnce(out_dir)] if kill else [ckpt]
    # Validation inside fit, as a user's Trainer has it: every optimizer step (4 batches), on two batches.
    trainer = _trainer(
        strategy, 2, STEPS, callbacks=[*callbacks, ValHistory()], enable_checkpointing=True, limit_val_batches=2,
        val_check_interval=4,
    )  # fmt: skip
    model = _model()
    trainer.fit(model, datamodule=_data(), ckpt_path=ckpt_path)
    if trainer.global_rank == 0:  # rank 0 holds the whole model after fit, and the metrics
        torch.save(model.state_dict(), out_dir / "weights.pt")
        Path(out_dir, "val_losses.json").write_text(json.dumps(model.__dict__.get("_val_history", [])))


def _launch(out: Path, schedule: str, fmt: str, ckpt_path: str, kill: bool, max_restarts: int) -> None:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=2, run_id=uuid.uuid4().hex, rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=max_restarts, monitor_interval=0.1,
        start_method="fork",
    )  # fmt: skip
    elastic_launch(config, _worker)(str(out), schedule, fmt, ckpt_path, kill)


def _agent(root: str, schedule: str, fmt: str) -> None:
    """The killed-and-restarted run, then the deliberate resume from the checkpoint the restart loaded."""
    os.environ["OMP_NUM_THREADS"] = "1"
    restarted, resumed = Path(root, "restarted"), Path(root, "resumed")
    restarted.mkdir()
    resumed.mkdir()
    _launch(restarted, schedule, fmt, "last", kill=True, max_restarts=1)
    _launch(resumed, schedule, fmt, str(restarted / "resumed-from.ckpt"), kill=False, max_restarts=0)


@pytest.mark.parametrize(("schedule", "fmt"), [("paci", "file"), ("1f1b_flush", "sharded")])
def test_run_restarted_after_a_sigkilled_rank_ends_at_the_deliberate_resume(tmp_path, schedule, fmt):
    proc = multiprocessing.get_context(START_METHOD).Process(target=_agent, args=(str(tmp_path), schedule, fmt))
    proc.start()
    proc.join(150)
    if proc.is_alive():
        proc.kill()
        proc.join()
    assert proc.exitcode == 0, f"the agent failed (exit code {proc.exitcode}); its workers' output is above"
    restarted = tmp_path / "restarted"
    first = json.loads((restarted / "start-0.json").read_text())
    second = json.loads((restarted / "start-1.json").read_text())
    assert first["step"] == 0  # nothing to resume from on the first attempt
    assert 1 <= second["step"] <= KILL_AT  # the restart resumed from the last checkpoint saved before the kill
    trained, deliberate = _model(), _model()
    trained.load_state_dict(torch.load(restarted / "weights.pt", weights_only=True))
    deliberate.load_state_dict(torch.load(tmp_path / "resumed" / "weights.pt", weights_only=True))
    assert _max_diff(trained, _model()) > 1e-3  # it trained
    assert _max_diff(trained, deliberate) <= 1e-6
    # The restarted attempt validated where the deliberate resume did, on the same weights.
    val_restarted, val_resumed = (json.loads((tmp_path / run / "val_losses.json").read_text()) for run in
                                  ("restarted", "resumed"))  # fmt: skip
    assert len(val_restarted) >= STEPS - KILL_AT and val_restarted == pytest.approx(val_resumed, abs=1e-6)


def test_each_attempt_rendezvouses_under_its_own_keys_in_torchruns_store(monkeypatch):
    """What the restart rests on (lit_efficient.strategy.runs.attempt_store): under torchrun's shared store, a group's
    keys are written under the attempt's prefix, so attempt 2 never reads what attempt 1 left, even where a rank
    of attempt 2 reads the store before its rank 0 has published the new number, and a group formed again in the
    same processes (attempt 3: the user destroyed it between two fits) never takes the number of the group before,
    which rank 0's live beacon still answers; elsewhere (SLURM, a plain launch, spawned ranks) nothing changes."""
    import threading

    import torch.distributed as dist

    from lit_efficient.strategy import runs
    from lit_efficient.strategy.runs import _Beacon, attempt_store

    wait = timedelta(seconds=20)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert attempt_store(0, wait) is None
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=wait)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    try:
        monkeypatch.setattr(runs, "_joined", 0)  # a fresh process's
        for attempt in (1, 2, 3):
            stores: dict[int, dist.Store] = {}
            early = threading.Thread(target=lambda got=stores: got.__setitem__(1, attempt_store(1, wait)))
            if attempt > 1:  # rank 1 first: the store still names the attempt before, whose number it must not take
                early.start()
                time.sleep(0.5)
                assert early.is_alive(), f"rank 1 took attempt {attempt - 1}'s number"
            stores[0] = attempt_store(0, wait)
            if attempt == 1:
                early.start()
            early.join(20)
            for rank, store in stores.items():
                store.set(f"0/rank_{rank}", f"address of attempt {attempt}")
            if attempt == 1:
                _Beacon.stop()  # rank 0's process ends with its attempt; after attempt 2, its beacon answers on
        for attempt in (1, 2, 3):
            for rank in (0, 1):
                assert (
                    server.get(f"lit_efficient/attempt_{attempt}/0/rank_{rank}")
                    == f"address of attempt {attempt}".encode()
                )
        assert not server.check(["0/rank_0"])
    finally:
        _Beacon.stop()


# -- two nodes: each agent counts its own restarts ------------------------------------------------------------


class _KillRankOneOnce(Callback):
    """SIGKILLs rank 1 at optimizer step ``KILL_AT`` of the first attempt (a marker file says which attempt that
    is: the two agents' restart counts differ), and records the step each attempt of rank 0 started at."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            with open(self.out / "starts", "a") as f:
                f.write(f"{trainer.global_step} {os.environ['TORCHELASTIC_RESTART_COUNT']}\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        marker = self.out / "killed"
        if trainer.global_rank == 1 and trainer.global_step == KILL_AT and not marker.exists():
            marker.write_text(os.environ["TORCHELASTIC_RESTART_COUNT"])
            os.kill(os.getpid(), signal.SIGKILL)


def _node_worker(out: str) -> None:
    torch.set_num_threads(1)
    out_dir = Path(out)
    ckpt = ModelCheckpoint(dirpath=out_dir / "checkpoints", every_n_train_steps=1, save_last=True)
    strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", p2p_timeout=30, timeout=timedelta(seconds=60))
    trainer = _trainer(strategy, 1, STEPS, num_nodes=2, callbacks=[ckpt, _KillRankOneOnce(out_dir)],
                       enable_checkpointing=True)  # fmt: skip
    model = _model()
    trainer.fit(model, datamodule=_data(), ckpt_path="last")
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), out_dir / "weights.pt")


def _node_agent(out: str, endpoint: str, run_id: str) -> None:
    """One node's torchrun agent: one worker, two nodes, one restart."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ["OMP_NUM_THREADS"] = "1"
    config = LaunchConfig(
        min_nodes=2, max_nodes=2, nproc_per_node=1, run_id=run_id, rdzv_backend="c10d", rdzv_endpoint=endpoint,
        max_restarts=1, monitor_interval=0.1, start_method="fork",
    )  # fmt: skip
    elastic_launch(config, _node_worker)(out)


def test_a_restart_on_two_nodes_whose_agents_count_their_restarts_apart(tmp_path):
    """One worker per node, rank 1 SIGKILLed: its agent restarts it as attempt 1, while the other agent, which sees
    the rendezvous change before its own worker fails, restarts its worker uncounted (attempt 0 again). Keys
    prefixed by each agent's count kept the two apart: both waited in the default group's rendezvous until its
    timeout. The restarted run resumes from "last" and ends where one device does (1F1B-flush)."""
    endpoint, run_id = f"127.0.0.1:{_free_port()}", uuid.uuid4().hex
    context = multiprocessing.get_context(START_METHOD)
    agents = [context.Process(target=_node_agent, args=(str(tmp_path), endpoint, run_id)) for _ in range(2)]
    for agent in agents:
        agent.start()
    for agent in agents:
        agent.join(150)
    for agent in agents:
        if agent.is_alive():
            agent.kill()
            agent.join()
    assert [a.exitcode for a in agents] == [0, 0], "an agent failed; its workers' output is above"
    starts = [line.split() for line in (tmp_path / "starts").read_text().splitlines()]
    assert len(starts) == 2 and starts[0][0] == "0" and 1 <= int(starts[1][0]) <= KILL_AT, starts
    one_device = _model()
    _trainer("auto", 1, STEPS).fit(one_device, datamodule=_data())
    trained = _model()
    trained.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True))
    assert _max_diff(trained, _model()) > 1e-3
    assert _max_diff(trained, one_device) <= 1e-5
