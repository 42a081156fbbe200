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
import uuid
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lit_efficient import PACIStrategy
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
    trainer = _trainer(strategy, 2, STEPS, callbacks=callbacks, enable_checkpointing=True)
    model = _model()
    trainer.fit(model, datamodule=_data(), ckpt_path=ckpt_path)
    if trainer.global_rank == 0:  # rank 0 holds the whole model after fit
        torch.save(model.state_dict(), out_dir / "weights.pt")


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


def test_each_attempt_rendezvouses_under_its_own_keys_in_torchruns_store(monkeypatch):
    """What the restart rests on (lit_efficient.strategy.runs.attempt_store): under torchrun's shared store, a group's
    keys are written under the attempt's prefix, so attempt 1 never reads what attempt 0 left; elsewhere
    (SLURM, a plain launch, spawned ranks) nothing changes."""
    from datetime import timedelta

    import torch.distributed as dist

    from lit_efficient.strategy.runs import attempt_store

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert attempt_store(timedelta(seconds=5)) is None
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        attempt_store(timedelta(seconds=5)).set("0/rank_0", f"address of attempt {attempt}")  # type: ignore[union-attr]
    assert server.get("lit_efficient/attempt_0/0/rank_0") == b"address of attempt 0"
    assert server.get("lit_efficient/attempt_1/0/rank_0") == b"address of attempt 1"
    assert not server.check(["0/rank_0"])
