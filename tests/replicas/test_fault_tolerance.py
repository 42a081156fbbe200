"""Fault-tolerant pipeline replicas on torchft: two replica groups x two stages on gloo, DiLoCo every 2 steps.

Each group is its own torch elastic agent (what ``torchrun`` runs: `elastic_launch`, as in
tests/checkpoint/test_restart.py) with ``REPLICA_GROUP_ID`` set; a torchft lighthouse (its Rust server, in this
process) keeps the quorum. Rank 1 of group 1 SIGKILLs itself on its first attempt, a step after the groups'
first sync together; its agent restarts the group (whose workers wait for group 0's next two steps first, as a
replacement takes a while), which heals from group 0 at group 0's next sync. Group 0
never stops: it keeps stepping while group 1 is down (paced a little so it is still running when group 1 comes
back), and both groups end at the same step with identical weights.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lit_efficient import PACIStrategy
from tests.support.gpt_runs import gpt_model, gpt_trainer, max_diff, text_data
from tests.support.multiproc import START_METHOD, _free_port

pytestmark = pytest.mark.multiproc

STEPS, SYNC_EVERY, PACE, ALONE_PACE, STEPS_WHILE_DOWN = 20, 2, 0.35, 6.0, 2


class _Timeline(Callback):
    """Records each group's steps (rank 0: step, time) and where each attempt started; kills group 1's rank 1
    once."""

    def __init__(self, out: Path, group: int) -> None:
        self.out, self.group = out, group
        self.attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        self.steps: list[tuple[int, float]] = []
        self.synced_at: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            seen = {"step": trainer.global_step, "at": time.time()}
            Path(self.out, f"start-{self.group}-{self.attempt}.json").write_text(json.dumps(seen))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 0 and (not self.steps or self.steps[-1][0] != trainer.global_step):
            self.steps.append((trainer.global_step, time.time()))
            if self.group == 0:
                with Path(self.out, "progress-0.txt").open("a") as progress:
                    progress.write(f"{trainer.global_step} {self.steps[-1][1]}\n")
                time.sleep(PACE)  # still running when group 1 is back
            elif self.attempt == 0:
                # Group 1 alone, group 0 not training yet (it started seconds late on a busy machine): slowed, so
                # that it does not run all its steps before the two can sync (it did). A bounded wait per step, never
                # an open one: torchft forms a quorum only from more than half of the groups that heartbeat, so
                # group 0's first quorum needs group 1's next request; a group 1 blocked until group 0 trained never
                # made it (both timed out at 60 s, seen once in a fresh environment). It ends once group 0 starts.
                started = Path(self.out, "start-0-0.json")
                deadline = time.monotonic() + ALONE_PACE
                while not started.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
        # Killed once both groups have synced together (they start at different times on a busy machine).
        together = trainer.strategy.replicas.participants == 2
        if self.group == 1 and self.attempt == 0 and trainer.global_rank == 1 and together and self.synced_at is None:
            self.synced_at = trainer.global_step
        if self.synced_at is not None and trainer.global_step == self.synced_at + 1 and self.attempt == 0:
            Path(self.out, "killed.json").write_text(json.dumps({"at": time.time(), "step": trainer.global_step}))
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            Path(self.out, f"steps-{self.group}.json").write_text(json.dumps(self.steps))


def _worker(out: str, group: int) -> None:
    torch.set_num_threads(1)
    if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) > 0:
        _stay_down(Path(out))
    strategy = PACIStrategy(
        pipeline_stages=2, local_sgd_steps=SYNC_EVERY, outer_optimizer="nesterov", fault_tolerance="torchft",
        replica_groups=2, p2p_timeout=60,
    )  # fmt: skip
    # Group 0 also checkpoints as a user would: the file records torchft's sync count for a whole-job restart.
    saves = [ModelCheckpoint(dirpath=Path(out, "checkpoints"), save_last=True, every_n_train_steps=4)]
    saves = saves if group == 0 else []
    trainer = gpt_trainer(
        strategy, 2, STEPS, callbacks=[_Timeline(Path(out), group), *saves], enable_checkpointing=group == 0
    )
    model = gpt_model()
    trainer.fit(model, datamodule=text_data())
    if trainer.global_rank == 0:  # the whole model after fit
        torch.save(model.state_dict(), Path(out, f"weights-{group}.pt"))


def _stay_down(out: Path) -> None:
    """A replacement takes a while to come back (a node, a container): the restarted group waits until group 0 has
    stepped ``STEPS_WHILE_DOWN`` times since the kill (a fixed 2 s sleep left one step on a loaded machine, and a
    1.7 s restart was taken into the quorum group 0 was still forming). A group 0 that stopped while group 1 was
    down never gets there: after two minutes group 1 comes back anyway and the test's count fails."""
    killed = json.loads(Path(out, "killed.json").read_text())["at"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        progress = Path(out, "progress-0.txt")
        lines = progress.read_text().splitlines() if progress.exists() else []
        if sum(float(line.split()[1]) > killed for line in lines if len(line.split()) == 2) >= STEPS_WHILE_DOWN:
            return
        time.sleep(0.05)


def _agent(out: str, group: int, max_restarts: int, environ: dict, worker=_worker) -> None:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.setsid()  # its workers in its process group: a test that fails kills them with it
    os.environ.update(environ, REPLICA_GROUP_ID=str(group), OMP_NUM_THREADS="1")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=2, run_id=uuid.uuid4().hex, rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=max_restarts, monitor_interval=0.1,
        start_method="fork",
    )  # fmt: skip
    elastic_launch(config, worker)(out, group)


def _run_groups(
    out: Path, min_replicas: int, max_restarts: list[int], worker=_worker, timeout: float = 240,
    ids: list[int] | None = None, fail: bool = False,
) -> None:  # fmt: skip
    """Each group under its own agent (``ids``: their REPLICA_GROUP_IDs, 0, 1, ... by default), a lighthouse in this
    process; every agent and its workers gone after; all agents succeeded (``fail``: all failed)."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=1000, quorum_tick_ms=50,
                                  heartbeat_timeout_ms=2000)  # fmt: skip
    environ = {"TORCHFT_LIGHTHOUSE": lighthouse.address(), "RUST_LOG": "warn"}
    ctx = multiprocessing.get_context(START_METHOD)
    ids = list(range(len(max_restarts))) if ids is None else ids
    pairs = zip(ids, max_restarts, strict=True)
    agents = [ctx.Process(target=_agent, args=(str(out), g, r, environ, worker)) for g, r in pairs]
    try:
        for agent in agents:
            agent.start()
        deadline = time.monotonic() + timeout  # for all of them (pytest-timeout ends the test at 300 s)
        for agent in agents:
            agent.join(max(0.0, deadline - time.monotonic()))
    finally:
        for agent in agents:
            if agent.is_alive():
                with contextlib.suppress(ProcessLookupError):  # before its setsid: no group yet
                    os.killpg(agent.pid, signal.SIGKILL)
                agent.kill()
                agent.join()
        lighthouse.shutdown()
    if fail:
        assert all(a.exitcode != 0 for a in agents), [a.exitcode for a in agents]
    else:
        assert [a.exitcode for a in agents] == [0] * len(agents), "an agent failed; its workers' output is above"


def test_a_killed_group_heals_from_the_live_one_which_never_stops(tmp_path):
    _run_groups(tmp_path, min_replicas=1, max_restarts=[0, 1])

    kill = json.loads((tmp_path / "killed.json").read_text())
    killed = kill["at"]
    healed = json.loads((tmp_path / "start-1-1.json").read_text())
    steps0 = json.loads((tmp_path / "steps-0.json").read_text())
    # Group 1's second attempt resumed at a sync step of group 0's, past the kill: nothing from scratch.
    assert healed["step"] >= kill["step"] and healed["step"] % SYNC_EVERY == 0
    # Group 0 never stopped: it took steps between the kill and group 1's return.
    while_down = [step for step, at in steps0 if killed < at < healed["at"]]
    assert len(while_down) >= STEPS_WHILE_DOWN, (while_down, killed, healed, steps0)
    assert steps0[-1][0] == STEPS
    # Both groups end at the same step with the same weights (the last step is a sync).
    weights = [gpt_model(), gpt_model()]
    for group, model in enumerate(weights):
        model.load_state_dict(torch.load(tmp_path / f"weights-{group}.pt", weights_only=True))
    assert max_diff(weights[0], gpt_model()) > 1e-3  # it trained
    assert max_diff(weights[0], weights[1]) == 0.0
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    saved_at = STEPS // 4 * 4  # every_n_train_steps=4
    assert last["global_step"] == saved_at and last["torchft"]["step"] >= saved_at // SYNC_EVERY


def _together_worker(out: str, group: int) -> None:
    torch.set_num_threads(1)
    strategy = PACIStrategy(
        pipeline_stages=2, local_sgd_steps=SYNC_EVERY, outer_optimizer="nesterov", fault_tolerance="torchft",
        replica_groups=2, p2p_timeout=60,  # the quorum's bound too: 30 s expired once on a loaded 2-core machine
    )  # fmt: skip
    # The user's defaults: a sanity check before fit, validation inside it.
    trainer = gpt_trainer(strategy, 2, 4, limit_val_batches=2, val_check_interval=8)
    model = gpt_model()
    with torch.no_grad():  # groups that did not seed alike start from other weights
        for p in model.parameters():
            p.add_(0.01 * group)
    trainer.fit(model, datamodule=text_data())
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), Path(out, f"weights-{group}.pt"))


def test_groups_that_start_together_take_one_start_and_validate_in_step(tmp_path):
    """Both groups in the first quorum (the lighthouse waits for two): torchft's start-up sync picks the source
    group per rank (rank r from group r % 2), so one rank of each group takes the other group's stage. That rank
    takes its stage only: a whole resume would restore Lightning's loops on it alone, and it then skipped the
    sanity check its neighbour ran: the pipeline hung."""
    _run_groups(tmp_path, min_replicas=2, max_restarts=[0, 0], worker=_together_worker, timeout=180)
    weights = [gpt_model(), gpt_model()]
    for group, model in enumerate(weights):
        model.load_state_dict(torch.load(tmp_path / f"weights-{group}.pt", weights_only=True))
    assert max_diff(weights[0], gpt_model()) > 1e-3  # it trained
    # One start for both (each stage from one group), then DiLoCo from it: the last step is a sync.
    assert max_diff(weights[0], weights[1]) == 0.0


def _refused_worker(out: str, group: int) -> None:
    try:
        _together_worker(out, group)
    except ValueError as err:
        Path(out, f"error-{os.getppid()}-{os.getpid()}.txt").write_text(str(err))  # the parent: the group's agent
        raise


def test_two_launches_given_one_group_index_are_both_refused(tmp_path):
    """A copy-paste slip in the launch loop (REPLICA_GROUP_ID=0 twice): torchft makes every launch's replica id
    unique, so both groups trained to the end on shard 0, shard 1 never read, nothing said. Both are refused at
    their first quorum, naming the index (a rank of each at least: its agent may stop the group's other rank
    before that rank's own check, on a loaded machine)."""
    _run_groups(tmp_path, min_replicas=2, max_restarts=[0, 0], worker=_refused_worker, timeout=120, ids=[0, 0],
                fail=True)  # fmt: skip
    errors = {path.name: path.read_text() for path in tmp_path.glob("error-*.txt")}
    assert len({name.split("-")[1] for name in errors}) == 2, errors  # both groups (their agents)
    assert all("replica group 0 is live 2 times in the torchft quorum" in e for e in errors.values()), errors
