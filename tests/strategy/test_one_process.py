"""A whole pipeline in one process (`StageHost`, ``Trainer(devices=1)``) against S processes: bit-identical.

Max abs difference 0, not a tolerance: the stages run the same actions on the same inputs and only
the transport differs. Every comparison runs with one intra-op thread on both sides (as the spawned
ranks do), since the thread count can change float reduction order.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lit_efficient import GradientAccumulation, PACIStrategy
from lit_efficient.runtime.host import PipelineDeadlockError, StageHost
from lit_efficient.runtime.interpreter import PipelineRuntime
from lit_efficient.runtime.stage import PipelineStage
from lit_efficient.runtime.topology import Topology
from lit_efficient.transport.local import LocalExchange, local_pipeline
from lit_efficient.transport.process import PointToPoint
from tests.support.compare import assert_same as _assert_same
from tests.support.gpt_runs import ValHistory
from tests.support.gpt_runs import gpt_model as _model
from tests.support.gpt_runs import gpt_trainer as _trainer
from tests.support.gpt_runs import max_diff as _max_diff
from tests.support.gpt_runs import ordered_data as _ordered
from tests.support.gpt_runs import text_data as _text
from tests.support.multiproc import spawn, values
from tests.support.runtime_runs import demo_stage as _stage
from tests.support.runtime_runs import runtime_batches as _data

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one thread here and in every rank


# -- the runtime: StageHost against processes -------------------------------------------------------

# (schedule, recompute, normalize): each configuration runs on the same spawned ranks, one after the other.
CONFIGS = [("paci", False, "tokens"), ("1f1b_flush", True, "mean"), ("paci", True, "mean")]


def _run(feed, drain, evaluate, data):
    """6 micro-batches, a drain in the middle of a window and an evaluation, then the rest; the losses."""
    losses = [feed(b, j) for j, b in enumerate(data[:6])]
    drain()
    logits = evaluate(data[0], 0)
    losses += [feed(b, j) for j, b in enumerate(data[6:], start=6)]
    drain()
    return losses, logits


def _state(stage: PipelineStage, stats: dict) -> dict:
    return {
        "params": [p.detach().clone() for p in stage.parameters()],
        "optimizer": stage.optimizer.state_dict(),  # type: ignore[union-attr]
        "rng": stage.rng[0],
        "stats": {k: stats[k] for k in ("forwards", "backwards", "steps", "max_in_flight", "drift_max", "drift_mean")},
    }


def _processes(rank, world):
    topo = Topology.for_world(world, world)
    s = topo.stage_of(rank)
    out = []
    for schedule, recompute, normalize in CONFIGS:
        stage = _stage(world, s, recompute, normalize)
        comm = PointToPoint(s, topo.stage_of, torch.device("cpu"), 60.0)
        runtime = PipelineRuntime(stage, schedule, 4, lambda b: b[0], comm, *topo.neighbours(rank))
        losses, logits = _run(runtime.feed, runtime.drain, runtime.evaluate, _data(14))
        losses = [None if x is None else x.item() for x in losses]
        out.append({**_state(stage, runtime.stats()), "losses": losses, "logits": logits})
    return s, out


@pytest.mark.multiproc
@pytest.mark.parametrize("stages", [2, 4])
def test_local_pipeline_equals_processes(stages):
    """Parameters, optimizer states, dropout streams, losses, evaluation outputs and drift: identical."""
    by_stage = dict(values(spawn(_processes, stages, timeout=240)))
    for c, (schedule, recompute, normalize) in enumerate(CONFIGS):
        stages_ = [_stage(stages, s, recompute, normalize) for s in range(stages)]
        pipe = local_pipeline(stages_, schedule, 4, lambda b: b[0])
        losses, logits = _run(pipe.feed, pipe.drain, pipe.evaluate, _data(14))
        assert pipe.drained and pipe.runtimes[0].comm.exchange.pending == 0  # type: ignore[union-attr]
        for s, rt in enumerate(pipe.runtimes):
            got = _state(rt.stage, rt.stats())
            want = by_stage[s][c]
            _assert_same(got, {k: want[k] for k in got}, f"{schedule} recompute={recompute} {normalize} stage {s}")
        want_losses = by_stage[stages - 1][c]["losses"]
        assert [None if x is None else x.item() for x in losses] == want_losses
        assert want_losses[-1] is not None
        _assert_same(logits, by_stage[stages - 1][c]["logits"], "evaluation")
        if schedule == "paci":
            assert by_stage[0][c]["stats"]["drift_max"] == 1  # staleness happened: the comparison is not vacuous


def test_deadlock_names_the_waiting_stages():
    """A pipeline whose stages run different schedules cannot progress; the error says who waits for what."""
    stages = [_stage(2, s, False, "mean") for s in range(2)]
    topo, exchange = Topology(2), LocalExchange()
    pipe = StageHost([
        PipelineRuntime(stages[0], "paci", 1, lambda b: b[0], exchange.endpoint(1, 0, topo.stage_of), None, 0),
        PipelineRuntime(stages[1], "paci", 1, None, exchange.endpoint(0, 1, topo.stage_of), 5, None),  # rank 5: nobody
    ])  # fmt: skip
    with pytest.raises(PipelineDeadlockError, match=r"stage 1 waits for 1F0 \(its input\) from rank 5"):
        pipe.feed(_data(1)[0], 0)


# -- the Trainer: devices=1 against devices=S -------------------------------------------------------------


class Record(Callback):
    """Per stage: the pipeline's stats at the end of training; on the last stage: every training loss.
    Written to files, since spawned ranks cannot hand objects back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs is not None and "loss" in outputs:
            self.losses.append(outputs["loss"].item())

    def on_train_end(self, trainer, pl_module) -> None:
        runtime = trainer.strategy.runtime
        stats = runtime.stage_stats() if hasattr(runtime, "stage_stats") else [runtime.stats()]
        corrections = [rt.stage.correction for rt in getattr(runtime, "runtimes", [runtime])]
        for st, correction in zip(stats, corrections, strict=True):
            keep = ("forwards", "backwards", "steps", "max_in_flight", "drift_max", "drift_mean")
            # Whether the stage predicted in compiled passes (a compiled form that fell back to eager: False).
            compiled = getattr(correction, "compiled", False)
            record = {**{k: st[k] for k in keep}, "compiled": compiled}
            Path(self.path, f"stage{st['stage']}.json").write_text(json.dumps(record))
        if trainer.global_rank == 0:
            val = getattr(pl_module, "_val_history", [])
            Path(self.path, "losses.json").write_text(json.dumps({"train": self.losses, "val": val}))


def _fit(
    tmp: Path, devices: int, stages: int, schedule: str, recompute: bool, normalize: str, correction: str, **kw
):  # fmt: skip
    tmp.mkdir(parents=True, exist_ok=True)
    model = _model(n_layer=2, dropout=0.1)
    # PACI's defaults (AdamW: the first-step weight prediction and a synchronous start), the start shortened to 2
    # of the 6 steps so both orders and the switch between them run in both hostings.
    sync = {"sync_start_steps": 2} if schedule == "paci" else {}
    strategy = PACIStrategy(
        pipeline_stages=stages, schedule=schedule, recompute=recompute, start_method="forkserver",
        staleness_correction=correction, **sync,
    )  # fmt: skip
    ckpt = ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=6, filename="end", save_last=False)
    callbacks = [GradientAccumulation(steps=4, normalize=normalize), ValHistory(), Record(tmp), ckpt]  # type: ignore[arg-type]
    trainer = _trainer(
        strategy, devices, 6, callbacks=callbacks, enable_checkpointing=True, limit_val_batches=2,
        val_check_interval=10, num_sanity_val_steps=1, **kw,
    )  # fmt: skip
    trainer.fit(model, datamodule=_text())
    return model


def _saved(path: Path) -> dict:
    saved = torch.load(path, weights_only=False)
    keep = ("state_dict", "optimizer_states", "lr_schedulers", "global_step", "epoch", "pipeline")
    return {k: saved[k] for k in keep}


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("stages", "schedule", "recompute", "normalize", "correction"),
    # Two Trainer runs per case on S spawned processes are slow on 2 cores; the runtime test above covers the
    # remaining combinations (paci + recompute, every configuration at S=2 and S=4). The third case: the compiled
    # prediction ("auto" on CUDA), compiled in each rank and in the one process.
    [
        (2, "paci", False, "tokens", "auto"),
        (4, "1f1b_flush", True, "mean", "auto"),
        (2, "paci", False, "mean", "weight_prediction_first_step_compiled"),
    ],
)
def test_trainer_on_one_device_equals_processes(tmp_path, stages, schedule, recompute, normalize, correction):
    """Through the real Trainer, with dropout, validation in the middle of a window (after micro-batch 10 of
    windows of 4) and a checkpoint: weights, the checkpoint file (every stage's optimizer, schedulers,
    accumulation and random stream), training and validation losses and per-stage drift are identical to S processes."""
    args = (stages, schedule, recompute, normalize, correction)
    procs = _fit(tmp_path / "procs", stages, *args)
    local = _fit(tmp_path / "local", 1, *args)
    assert _max_diff(local, _model(n_layer=2)) > 1e-3  # training moved the weights
    assert _max_diff(local, procs) == 0.0
    # The checkpoint file: weights, optimizer and schedulers of every stage, accumulation and random streams.
    _assert_same(_saved(tmp_path / "local/ckpt/end.ckpt"), _saved(tmp_path / "procs/ckpt/end.ckpt"), "checkpoint")
    for s in range(stages):
        local_stats, proc_stats = (
            json.loads(Path(tmp_path, d, f"stage{s}.json").read_text()) for d in ("local", "procs")
        )
        assert local_stats == proc_stats, s
    local_losses, proc_losses = (json.loads(Path(tmp_path, d, "losses.json").read_text()) for d in ("local", "procs"))
    assert local_losses == proc_losses and len(local_losses["train"]) == 24 and len(local_losses["val"]) >= 3
    if schedule == "paci":
        assert json.loads(Path(tmp_path, "local/stage0.json").read_text())["drift_max"] == 1
    compiled = correction == "weight_prediction_first_step_compiled"
    assert json.loads(Path(tmp_path, "procs/stage0.json").read_text())["compiled"] is compiled


@pytest.mark.multiproc
def test_resume_across_layouts(tmp_path):
    """A one-process checkpoint resumes in one process and on S processes, along the uninterrupted trajectory.
    (The other direction follows: the Trainer test above finds the two layouts' checkpoint files identical.)"""

    def trainer(devices, max_steps, **kw):
        strategy = PACIStrategy(pipeline_stages=2, schedule="paci", start_method="forkserver")
        return _trainer(strategy, devices, max_steps, **kw)

    full = _model()
    trainer(1, 6).fit(full, datamodule=_ordered())
    first = _model()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, filename="{step}")
    trainer(1, 3, callbacks=[ckpt], enable_checkpointing=True).fit(first, datamodule=_ordered())
    path = tmp_path / "step=3.ckpt"
    assert path.is_file()
    resumed = _model()
    trainer(1, 6).fit(resumed, datamodule=_ordered(), ckpt_path=str(path))
    assert _max_diff(resumed, first) > 1e-3
    assert _max_diff(resumed, full) == 0.0
    on_processes = _model()
    trainer(2, 6).fit(on_processes, datamodule=_ordered(), ckpt_path=str(path))
    assert _max_diff(on_processes, full) == 0.0


def test_one_process_leaves_no_process_group_and_user_module_whole():
    model = _model()
    before = copy.deepcopy(model)
    strategy = PACIStrategy(pipeline_stages=4)
    _trainer(strategy, 1, 2).fit(model, datamodule=_text())
    assert not torch.distributed.is_initialized()
    assert strategy.launcher is None
    assert model.state_dict().keys() == before.state_dict().keys() and _max_diff(model, before) > 0
