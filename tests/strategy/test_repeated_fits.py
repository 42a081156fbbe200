"""A notebook's long-lived process on 2 ranks (torchrun's environment: every rank keeps its stage between fits).

A fit that failed left rank 0's model split for good: the strategy remembered the failure in every later run, and
their teardowns skipped gathering the whole model there (``model(x)`` then refused, 14 of 29 keys missing).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torchmetrics import Metric

from lit_efficient import PACIStrategy
from lit_efficient.transport.failures import PipelineCommError
from tests.support.feature_matrix_parts import _LogsEpoch
from tests.support.gpt_runs import gpt_model, gpt_trainer, ordered_data
from tests.support.multiproc import spawn, values

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("one_thread")]


class _FailOnce(Callback):
    def __init__(self) -> None:
        self.armed = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.armed and batch_idx == 3:
            self.armed = False
            raise RuntimeError("the user's callback failed")


def _fail_then_fit_again(rank: int, world: int) -> dict:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    model = gpt_model()
    trainer = gpt_trainer(PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"), world, 3, callbacks=[_FailOnce()])
    with pytest.raises(RuntimeError, match="the user's callback failed"):
        trainer.fit(model, datamodule=ordered_data())
    trainer.fit(model, datamodule=ordered_data())
    missing = sorted(set(gpt_model().state_dict()) - set(model.state_dict()))
    works = rank != 0 or model(torch.zeros(1, 4, dtype=torch.long)).shape[-1] == model.hparams.vocab_size
    return {"missing": missing, "works": works}


def test_a_fit_after_a_failed_one_gives_rank_zero_the_whole_model():
    ranks = values(spawn(_fail_then_fit_again, 2, timeout=240, torchrun_env=True))
    assert ranks[0] == {"missing": [], "works": True}, ranks[0]  # rank 0 holds the whole model after fit


def _threads_and_descriptors() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _runs_without_garbage_collection(rank: int, world: int) -> dict:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    gc.disable()  # what a run leaves in reference cycles stays, as it does between a notebook's rare full collections
    try:
        seen = []
        model = gpt_model(tie_weights=True)  # PACI's tied-weight exchange has its own transport
        for _ in range(3):
            trainer = gpt_trainer(PACIStrategy(pipeline_stages=2), world, 2)
            trainer.fit(model, datamodule=ordered_data())
            trainer.validate(model, datamodule=ordered_data(), verbose=False)
            seen.append(_threads_and_descriptors())
        metrics = [m for m in model.modules() if isinstance(m, Metric)]
        groups = [f"{m.process_group!r} {m.dist_sync_fn!r}" for m in metrics]
        return {"seen": seen, "metric groups": groups}
    finally:
        gc.enable()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads and descriptors in /proc")
def test_runs_release_their_transports_without_a_garbage_collection():
    # A transport's send bookkeeping kept its owner's bound method (a reference cycle), and the Trainer, itself a
    # cycle, kept the run's transports, the user's metrics' group and the SIGTERM broadcast's: every run's groups,
    # with their gloo threads and sockets, lived until a full collection (6 threads and 10 descriptors more per
    # validation, 9 and 15 per fit, on 2 ranks).
    for rank, ran in enumerate(values(spawn(_runs_without_garbage_collection, 2, timeout=240, torchrun_env=True))):
        seen = ran["seen"]
        assert len(seen) == 3 and seen[-1] == seen[0], f"rank {rank}: (threads, descriptors) after each run {seen}"
        # The user's metrics sync on their own group again, not on the run's destroyed one.
        assert ran["metric groups"] == ["None None", "None None"], ran["metric groups"]


class _FailOnRank(Callback):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and batch_idx == 3:
            raise RuntimeError(f"the user's callback failed on rank {self.rank}")


def _fail_on_each_rank_then_lose_one(rank: int, world: int, out: str) -> dict:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    model, seen = gpt_model(), {}
    for run, failing in (("first", 1), ("second", 0)):
        trainer = gpt_trainer(
            PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"), world, 3, callbacks=[_FailOnRank(failing)]
        )
        try:
            trainer.fit(model, datamodule=ordered_data())
        except Exception as err:  # noqa: BLE001 - the script catches it and goes on, as a notebook's cell does
            seen[run] = str(err)
    if rank == 1:
        Path(out).write_text(json.dumps(seen))
        os._exit(0)  # rank 1's script ends; rank 0 fits again, with its default group from the runs before
    start = time.monotonic()
    trainer = gpt_trainer(PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"), world, 3)
    with pytest.raises(PipelineCommError) as gone:
        trainer.fit(model, datamodule=ordered_data())
    return {**seen, "third": str(gone.value), "third took": time.monotonic() - start}


def test_later_fits_name_their_own_failure_and_a_gone_rank_at_once(tmp_path):
    out = tmp_path / "rank1.json"
    rank0 = spawn(_fail_on_each_rank_then_lose_one, 2, str(out), timeout=240, torchrun_env=True)[0]
    assert "ok" in rank0, rank0.get("traceback", rank0)
    rank0, rank1 = rank0["ok"], json.loads(out.read_text())
    # Each fit's failure is its own on every rank: the store kept the first fit's cause, and rank 1 explained rank
    # 0's failure in the second fit by it ("the pipeline stopped because stage 0 (rank 1) raised ... on rank 1").
    assert rank1["first"] == "the user's callback failed on rank 1", rank1
    raised = "raised RuntimeError: the user's callback failed on rank"
    assert rank0["first"].endswith(f"because stage 0 (rank 1) {raised} 1"), rank0
    assert rank0["second"] == "the user's callback failed on rank 0", rank0
    assert rank1["second"].endswith(f"because stage 1 (rank 0) {raised} 0"), rank1
    # Rank 1 gone: the next fit said so at once. It waited out p2p_timeout (600 s) in its first group's rendezvous,
    # then raised the store's "wait timeout ... keys: /default_pg/0//7//cpu//0/1", which names no rank.
    assert "a rank of this process's earlier run is gone" in rank0["third"], rank0["third"]
    assert rank0["third took"] < 60, rank0["third took"]


def _warnings_of_two_fits(rank: int, world: int) -> list[list[str]]:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    seen = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            model = gpt_model()
            model.__class__ = _LogsEpoch  # the feature matrix's: an epoch-level value from pipeline_loss
            trainer = gpt_trainer(PACIStrategy(pipeline_stages=2, schedule="1f1b_flush"), world, 3)
            trainer.fit(model, datamodule=ordered_data())
        seen.append([str(w.message) for w in caught])
    return seen


def test_one_replica_is_not_told_to_sync_an_epoch_level_value_it_alone_computes():
    # With one replica the last stage's rank alone computes an epoch-level value: Lightning's sync_dist advice is a
    # reduce over one rank (every processes row of the feature matrix checks it is not given). Here: two fits in one
    # process, as a notebook's. Silencing it with catch_warnings reset the registries (other warnings came back every
    # fit); Lightning's own cache stays in charge of the others.
    first, second = values(spawn(_warnings_of_two_fits, 2, timeout=240, torchrun_env=True))[0]
    assert not [m for m in first + second if "sync_dist=True" in m], first + second
    assert len(second) <= len(first), (first, second)
