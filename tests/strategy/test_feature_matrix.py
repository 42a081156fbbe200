"""The Lightning feature-parity matrix: every Lightning feature a user has, through `PACIStrategy`, in one table.

Each `Row` is a feature with the Trainer, module and callback arguments that exercise it, run the same way
under the pipeline and on plain one-device Lightning, and how the two are compared:

- ``exact vs one device (flush)``: ``Trainer(devices=1, strategy=PACIStrategy(pipeline_stages=2,
  schedule="1f1b_flush"))`` against ``Trainer(devices=1, accumulate_grad_batches=N)``, same module, seed and
  data: the weights after the run, ``global_step`` and epoch, ``callback_metrics``, every row the logger was
  given, the callback hooks seen (with their steps and batch indices), what ``validate``/``test``/``predict``
  returned and what the row itself observes, all equal, max abs difference 0 (not a tolerance) unless the row
  gives one (a sum across stages in another order than one device's). One process
  is bit-identical to S processes (tests/strategy/test_one_process.py), so most rows run there.
- ``documented difference: ...``: where the pipeline differs from one device by design; the row tests the
  documented behaviour instead (against another reference, or with its own assertion).
- ``clear error: ...``: the package's message, before training.

Rows with ``processes=True`` (precision, clipping, checkpoints, validate/test/predict, the distributed sampler's
data order) also run on two gloo processes, all of them in one spawned pair of ranks (process start paid
once): there 1F1B-flush equals one device as above, and PACI on processes equals PACI in one process, bit for
bit. A row that finds a bug carries ``xfail`` with the reason (strict: it fails once fixed).

``python -m tests.support.feature_matrix_table`` prints docs/compatibility.md's "What works with what" table from
`ROWS`; `test_readme_table_is_generated` keeps the two equal. A new Lightning feature gets a row here; the modules,
data, actions, observations and checks rows are built from live in tests/support/feature_matrix_parts.py.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    Callback,
    EarlyStopping,
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    ModelCheckpoint,
    ModelPruning,
    StochasticWeightAveraging,
    ThroughputMonitor,
)

from lit_efficient import ActivationCheckpointing, GradientAccumulation, PipelineMonitor
from tests.support.compare import assert_same as _assert_same
from tests.support.feature_matrix_parts import (
    _LBFGS,
    N,
    _AddsTheEmbeddingsGroup,
    _as,
    _cli,
    _clips_per_stage,
    _compiled,
    _compiled_stages,
    _counted_once,
    _CountingText,
    _EpochLR,
    _evaluate,
    _evaluated_twice_alike,
    _every_other_step,
    _fit,
    _fit_then_evaluate,
    _found,
    _found_nan,
    _frozen,
    _frozen_left_out,
    _frozen_stays,
    _gpt,
    _grad_norms_logged,
    _graphs,
    _IterableText,
    _kept,
    _loaders,
    _loads,
    _LoggedBatchNorm,
    _LogsEpoch,
    _lr_finder,
    _lr_finder_to_nan,
    _lr_monitor,
    _lrs_logged,
    _manual,
    _no_manual_advice,
    _one_row_per_step,
    _own_dropout_streams,
    _pipeline_actions,
    _Plateau,
    _PlateauOfTheirOwn,
    _predictions,
    _profiled,
    _pruned_files,
    _regression,
    _resumable,
    _resume,
    _resumed_as_uninterrupted,
    _Run,
    _saved,
    _saved_every_step,
    _saved_weights,
    _seeded_workers,
    _SetsTheRate,
    _sparse_embedding,
    _stopped,
    _stopped_early,
    _text,
    _timed,
    _top_k,
    _top_k_at_epoch_ends,
    _top_k_train,
    _tuned,
    _two_kept,
    _UnfreezesTheEmbedding,
    _unfrozen_trains,
    _validate_then_fit,
    _weights,
    _WithBackbone,
)
from tests.support.gpt_runs import BLOCK
from tests.support.modules import TwoOptimizers as _TwoOptimizers
from tests.support.multiproc import spawn, values

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

EXACT = "exact vs one device (flush)"
DOCUMENTED = "documented difference: "
ERROR = "clear error: "
SCHEDULES = ("1f1b_flush", "paci")


# -- the table ------------------------------------------------------------------------------------------------


def _none(root: Path) -> list[Callback]:
    return []


@dataclass(frozen=True)
class Row:
    """One feature: its arguments, how it runs and how the pipeline's result is compared.

    Args:
        feature: What a Lightning user would call it.
        how: `EXACT`, or ``DOCUMENTED + why``, or ``ERROR + the message`` (matched literally).
        trainer: Trainer arguments over the common ones (`_Run.trainer`).
        strategy: PACIStrategy arguments besides ``pipeline_stages=2`` and the schedule.
        module: Builds the LightningModule (seeded).
        data: Builds the datamodule, or the dataloaders passed to ``fit`` as a dict.
        callbacks: The row's callbacks, given the run's folder.
        action: What runs: fit, validate, test, predict, resume, the CLI.
        observe: What the row reads from the Trainer after the run; compared like the rest.
        inspect: What the row reads for its own check only (not compared: one device has none of it).
        ignore: Metric names (a regex) left out of the comparison: the documented difference.
        tolerance: The largest difference allowed (weights, metrics; 0: none), where the pipeline sums across
            stages (a collective on processes, `LocalStageSum` in one process) in another order than one device.
        check: The row's own assertion on (pipeline outcome, one-device outcome).
        reference: Compare with another row's one-device run (its feature name) instead of this row's.
        exact: Compare the pipeline with the reference at all (a documented difference may not).
        schedule: The one-process pipeline's schedule.
        processes: Also on two processes: flush there equals one device, paci there equals paci in one process.
        note: For the table.
        xfail: A known bug: the reason (the row is expected to fail, strictly).
    """

    feature: str
    how: str = EXACT
    trainer: dict = field(default_factory=dict)
    strategy: dict = field(default_factory=dict)
    module: Callable[[], Any] = _gpt
    data: Callable[[], Any] = _text
    callbacks: Callable[[Path], list] = _none
    action: Callable[[_Run], tuple] = _fit
    observe: Callable[[Any, Any], dict] | None = None
    inspect: Callable[[Any, Any], dict] | None = None
    ignore: str = ""
    tolerance: float = 0.0
    check: Callable[[dict, dict], None] | None = None
    reference: str = ""
    exact: bool = True
    schedule: str = "1f1b_flush"
    processes: bool = False
    note: str = ""
    xfail: str = ""


VAL = dict(limit_val_batches=2)
EPOCHS = dict(max_steps=-1, max_epochs=3, limit_train_batches=4)  # epochs of 2 windows

ROWS: list[Row] = [
    # -- data and the loop
    Row("accumulate_grad_batches=N, LightningDataModule, the default shuffled loader (DDP-style data order)",
        processes=True, note="the distributed sampler of one replica reads what one device reads"),
    Row("DataLoaders passed to fit", trainer=dict(VAL, val_check_interval=2), data=_loaders),
    Row("IterableDataset", data=lambda: _IterableText(block_size=BLOCK, batch_size=4, max_bytes=60_000)),
    Row("max_epochs, limit_train_batches, limit_val_batches", trainer=dict(EPOCHS, **VAL)),
    Row("limit_train_batches as a fraction", trainer=dict(max_steps=2, limit_train_batches=0.25)),
    Row("an epoch ending in a partial window, with GradientAccumulation",
        trainer=dict(max_steps=-1, max_epochs=2, limit_train_batches=3),
        callbacks=lambda root: [GradientAccumulation(steps=N)],
        note="one device normalizes the short window by its real size too"),
    Row("an epoch ending in a partial window, plain accumulate_grad_batches",
        how=DOCUMENTED + "the pipeline divides a partial window by its real size, Lightning by N (#19987)",
        trainer=dict(max_steps=-1, max_epochs=2, limit_train_batches=3),
        reference="an epoch ending in a partial window, with GradientAccumulation",
        note="equals one device with GradientAccumulation"),
    Row("overfit_batches", trainer=dict(overfit_batches=2)),
    Row("fast_dev_run=True", trainer=dict(fast_dev_run=True), callbacks=lambda root: [GradientAccumulation(steps=N)],
        note="one batch: a partial window, so with GradientAccumulation on both sides (as the rows above)"),
    Row("max_time (the Timer callback)", trainer=dict(max_time={"minutes": 10}),
        note="max_steps ends the run first: a time limit reached mid-run is not reproducible"),
    Row("reload_dataloaders_every_n_epochs", trainer=dict(EPOCHS, reload_dataloaders_every_n_epochs=1),
        data=lambda: _CountingText(block_size=BLOCK, batch_size=4, max_bytes=60_000), observe=_loads),
    Row("seed_everything(workers=True), DataLoader workers", data=_seeded_workers, processes=True,
        note="every stage of a replica seeds its loader's workers by the replica's index, as DDP by its rank"),
    Row("deterministic=True", trainer=dict(deterministic=True)),
    Row("detect_anomaly=True", trainer=dict(detect_anomaly=True, max_steps=2)),
    # -- accumulation and the optimizer
    Row("GradientAccumulation(steps=N)", callbacks=lambda root: [GradientAccumulation(steps=N)]),
    Row("GradientAccumulation schedule {epoch: N}", trainer=dict(EPOCHS, accumulate_grad_batches=1),
        callbacks=lambda root: [GradientAccumulation(steps={0: 1, 1: 2})]),
    Row("Lightning's GradientAccumulationScheduler",
        how=ERROR + "Use lit_efficient.GradientAccumulation(steps={0: 1, 1: 2})",
        trainer=dict(EPOCHS, accumulate_grad_batches=1),
        callbacks=lambda root: [GradientAccumulationScheduler({0: 1, 1: 2})]),
    Row("LR scheduler by step, LearningRateMonitor", callbacks=_lr_monitor, check=_lrs_logged, processes=True,
        note="the last stage's schedule, as global rank 0 logs it; every stage steps its own"),
    Row("LR scheduler by epoch", trainer=EPOCHS, module=_as(_EpochLR), callbacks=_lr_monitor, check=_lrs_logged,
        processes=True, note="every stage's epoch schedulers step at the epoch's end"),
    Row("ReduceLROnPlateau on val_loss", how=ERROR + "ReduceLROnPlateau (a scheduler stepped with a monitored metric",
        trainer=dict(VAL, val_check_interval=2, max_steps=4), module=_as(_Plateau), check=_no_manual_advice,
        note="without Lightning's manual-optimization advice before it"),
    Row("a scheduler dict with reduce_on_plateau", how=ERROR + "LambdaLR (a scheduler stepped with a monitored metric",
        trainer=dict(VAL, val_check_interval=2, max_steps=4), module=_as(_PlateauOfTheirOwn),
        note="the dict's word, not only torch's class"),
    Row("an optimizer whose step needs a closure (LBFGS)", how=ERROR + "LBFGS.step needs a closure that computes",
        module=_as(_LBFGS), note="a stage steps once on its accumulated gradients; one device trains"),
    Row("nn.Embedding(sparse=True) (sparse gradients)", how=ERROR + "Embedding(sparse=True) gives sparse gradients",
        module=_sparse_embedding, note="accumulation, the finite check and replica reduction are dense"),
    Row("frozen layers (requires_grad=False)", module=_frozen, check=_frozen_stays),
    Row("a parameter group added by a callback (unfreezing by hand: add_param_group at an epoch start)",
        module=_frozen_left_out, trainer=EPOCHS, callbacks=lambda root: [_AddsTheEmbeddingsGroup()],
        check=_unfrozen_trains, processes=True,
        note="in one process each stage's optimizer gets the group with its own parameters of it, as each rank's"),
    Row("frozen layers unfrozen by a callback (requires_grad_(True) at an epoch start)", module=_frozen,
        trainer=EPOCHS, callbacks=lambda root: [_UnfreezesTheEmbedding()], check=_unfrozen_trains, processes=True,
        note="configure_optimizers given every parameter; BaseFinetuning is refused"),
    Row("bf16-mixed precision", trainer=dict(precision="bf16-mixed"), processes=True),
    Row("gradient_clip_algorithm='value'", trainer=dict(gradient_clip_val=0.01, gradient_clip_algorithm="value"),
        processes=True),
    Row("gradient-norm clipping under 1f1b_flush", trainer=dict(gradient_clip_val=0.1), processes=True,
        tolerance=1e-7,
        note="the global norm: the stages' squared norms summed (an all-reduce on processes, vs one device to "
        "1e-7; among the stages in one process, a weight tied across stages too: tests/strategy/test_clipping.py). "
        "One device takes the norm of per-parameter norms: the clip factor differs by rounding, which AdamW "
        "magnifies on near-zero gradients (a small GPT, 10 steps: 1e-6 in a bias; 4e-3 under bf16-mixed)"),
    Row("PipelineMonitor(grad_norm=True): the gradient norm before clipping", trainer=dict(gradient_clip_val=0.1),
        callbacks=lambda root: [PipelineMonitor(logging_interval=1, grad_norm=True)], check=_grad_norms_logged,
        ignore=r"(throughput|memory|pipeline)/.*|grad/norm_stage\d+", tolerance=1e-6, processes=True,
        note="what Lightning's grad_norm in on_before_optimizer_step gives on one device (a hook the pipeline never "
        "runs); per stage too"),
    Row("gradient-norm clipping under paci",
        how=DOCUMENTED + "each stage clips its own norm, said once at setup", trainer=dict(gradient_clip_val=0.1),
        schedule="paci", exact=False, check=_clips_per_stage, note="issue 22 item 6; flush clips the global norm"),
    Row("two optimizers split by module", how=ERROR + "one optimizer per stage", module=_as(_TwoOptimizers),
        note="issue 22 item 4; param groups are fine"),
    Row("manual optimization (automatic_optimization=False)",
        how=ERROR + "uses manual optimization; PACIStrategy schedules forwards, backwards and steps itself",
        module=_manual, trainer=dict(accumulate_grad_batches=1),
        note="Lightning's own error first when accumulate_grad_batches > 1"),
    # -- validation, checkpoints, evaluation
    Row("val_check_interval in the middle of a window", trainer=dict(VAL, val_check_interval=3), processes=True),
    Row("val_check_interval in the middle of a window, recompute=True", trainer=dict(VAL, val_check_interval=3),
        strategy=dict(recompute=True), note="the drain at the validation's start recomputes with autograd on"),
    Row("check_val_every_n_epoch", trainer=dict(EPOCHS, check_val_every_n_epoch=2, **VAL)),
    Row("num_sanity_val_steps", trainer=dict(VAL, num_sanity_val_steps=2, val_check_interval=4)),
    Row("EarlyStopping", trainer=dict(VAL, max_steps=8, val_check_interval=2),
        callbacks=lambda root: [EarlyStopping("val_loss", min_delta=10.0, patience=1)], observe=_stopped,
        check=_stopped_early),
    Row("EMAWeightAveraging", trainer=dict(VAL, val_check_interval=2), callbacks=lambda root: [EMAWeightAveraging()],
        note="one process only: refused on processes, where a rank holds only its stage"),
    Row("StochasticWeightAveraging", how=ERROR + "StochasticWeightAveraging is not supported under PACIStrategy",
        trainer=EPOCHS, callbacks=lambda root: [StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)]),
    Row("a learning rate set by hand in a callback (trainer.optimizers' param groups)",
        trainer=dict(max_steps=4, enable_checkpointing=True), processes=True,
        callbacks=lambda root: [_SetsTheRate(), ModelCheckpoint(root / "every", every_n_train_steps=1, save_top_k=-1)],
        note="in one process trainer.optimizers shows the last stage's; what is written there reaches every stage"),
    Row("ThroughputMonitor",
        callbacks=lambda root: [ThroughputMonitor(batch_size_fn=lambda batch: len(batch[0]), window_size=2)],
        ignore=r"train/(device/.*|time)", processes=True,
        note="the counters exact, the rates timed; job-wide rates count the replicas, not the stages"),
    Row("ModelPruning, ModelCheckpoint every step", trainer=dict(EPOCHS, enable_checkpointing=True),
        callbacks=lambda root: [ModelPruning("l1_unstructured", amount=0.3, use_global_unstructured=False),
                                ModelCheckpoint(root / "every", every_n_train_steps=1, save_top_k=-1,
                                                filename="{step}")],
        observe=_saved_weights, check=_pruned_files,
        note="one process only: refused on processes, where a rank holds only its stage"),
    Row("BackboneFinetuning (BaseFinetuning)", how=ERROR + "BackboneFinetuning is not supported under PACIStrategy",
        trainer=EPOCHS, module=_as(_WithBackbone),
        callbacks=lambda root: [BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
        note="it adds parameters to one stage's optimizer; unfreeze with requires_grad_ in a callback instead"),
    Row("LearningRateFinder: lr_find at fit start, then training at its suggestion", callbacks=_lr_finder,
        observe=_found, strategy=dict(sync_start_steps=2), processes=True,
        note="every stage steps the finder's rates; its recorded losses are N x one device's (which divides a "
        "step's loss by N); paci runs its synchronous start again after the finder's run"),
    Row("LearningRateFinder with validation inside fit", trainer=dict(VAL, val_check_interval=4),
        callbacks=_lr_finder, observe=_found, note="the finder's run validates as the fit does, drained first"),
    Row("LearningRateFinder with an epoch-interval LR scheduler", module=_as(_EpochLR),
        trainer=dict(max_steps=-1, max_epochs=8, limit_train_batches=4), callbacks=_lr_finder, observe=_found,
        note="the user's schedulers rest during the finder's run, as on one device"),
    Row("LearningRateFinder up to a rate where the loss turns NaN", callbacks=_lr_finder_to_nan, observe=_found,
        check=_found_nan, note="the finder's run steps on NaN as one device does, whatever on_nonfinite says"),
    Row("Tuner.lr_find, then fit on the same Trainer", action=_tuned,
        strategy=dict(sync_start_steps=2), processes=True, note="the same, through Lightning's Tuner"),
    Row("ModelCheckpoint top-k on val_loss", trainer=dict(VAL, max_steps=4, val_check_interval=2,
        enable_checkpointing=True), callbacks=_top_k, observe=_kept, check=_two_kept, processes=True),
    Row("ModelCheckpoint top-k on train_loss, every step", trainer=dict(max_steps=4, enable_checkpointing=True),
        callbacks=_top_k_train, observe=_kept, check=_two_kept, processes=True),
    Row("ModelCheckpoint top-k on val_loss every N steps, at an epoch's last batch",
        trainer=dict(EPOCHS, **VAL, val_check_interval=2, enable_checkpointing=True), callbacks=_top_k_at_epoch_ends,
        observe=_kept, check=_two_kept, note="the save waits for the epoch's last validation (a stale score before)"),
    Row("ModelCheckpoint(train_time_interval)", trainer=dict(max_steps=4, enable_checkpointing=True),
        callbacks=_timed, observe=_saved, check=_saved_every_step, processes=True),
    Row("resume from ckpt_path='last' in the middle of an epoch", data=_resumable, action=_resume,
        check=_resumed_as_uninterrupted, processes=True, note="resumed == uninterrupted"),
    Row("trainer.validate", trainer=VAL, action=_evaluate("validate"), processes=True),
    Row("trainer.test", trainer=dict(limit_test_batches=2), action=_evaluate("test"), processes=True),
    Row("trainer.predict and what it returns", trainer=dict(limit_predict_batches=2), action=_evaluate("predict"),
        check=_predictions, processes=True),
    Row("fit, then validate, test, predict and validate again on the same Trainer",
        trainer=dict(VAL, limit_test_batches=2, limit_predict_batches=2), action=_fit_then_evaluate,
        check=_evaluated_twice_alike, processes=True, note="issue 33 item 1"),
    Row("validate, then fit with validation (GPT)", trainer=dict(VAL, val_check_interval=2),
        action=_validate_then_fit, note="issue 22 item 5"),
    # -- logging and tooling
    Row("self.log on step: one logger row per optimizer step", check=_one_row_per_step,
        note="issue 22 item 1; every row compares the logged rows"),
    Row("self.log on_epoch from pipeline_loss", module=_as(_LogsEpoch), trainer=dict(EPOCHS),
        processes=True),
    Row("log_every_n_steps", trainer=dict(max_steps=4, log_every_n_steps=2), check=_every_other_step),
    Row("progress bar and model summary", trainer=dict(enable_progress_bar=True, enable_model_summary=True)),
    Row("simple profiler", trainer=dict(profiler="simple"), inspect=_profiled, check=_pipeline_actions,
        note="issue 22 item 6: a row per stage and pipeline action (on processes, each rank's for its own stages)"),
    Row("ActivationCheckpointing", callbacks=lambda root: [ActivationCheckpointing()],
        note="its saved_bytes metric: every stage's in one process, the last stage's on processes"),
    Row("BatchNorm with recompute=True", module=_LoggedBatchNorm, data=_regression, strategy=dict(recompute=True),
        check=_counted_once, note="issue 22 item 2: running statistics updated once per micro-batch"),
    Row("trainer.fit(torch.compile(model))", module=_compiled, data=_regression, inspect=_graphs,
        check=_compiled_stages, reference="BatchNorm with recompute=True",
        note="issue 22 item 3: every stage's layers compiled; against the eager module on one device"),
    Row("dropout", module=lambda: _gpt(dropout=0.1), how=DOCUMENTED + "each stage draws masks from its own stream",
        exact=False, check=_own_dropout_streams,
        note="so masks do not depend on placement: one process == processes (tests/strategy/test_one_process.py)"),
    Row("LightningCLI (lit-efficient fit)", action=_cli),
]  # fmt: skip

BY_NAME = {row.feature: row for row in ROWS}
assert len(BY_NAME) == len(ROWS), "feature names are the rows' ids"


# -- running rows ---------------------------------------------------------------------------------------------

COMPARED = ("weights", "step", "epoch", "metrics", "rows", "hooks", "returned", "observed")


def _outcome(row: Row, where: str, devices: int, root: Path) -> dict:
    """Run ``row`` once; what it did (see COMPARED), the warnings it gave, or the error it raised."""
    root.mkdir(parents=True, exist_ok=True)
    run = _Run(row, where, devices, root)
    deterministic = torch.are_deterministic_algorithms_enabled()
    seeds = {k: os.environ.get(k) for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}  # seed_everything sets them
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer, module, returned = row.action(run)
        except Exception as err:  # noqa: BLE001 - a clear-error row asserts on it
            return {"error": f"{type(err).__name__}: {err}", "warnings": [str(w.message) for w in caught]}
        finally:
            torch.use_deterministic_algorithms(deterministic)  # deterministic=True sets it for the process
            for k, v in seeds.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return {
        "weights": _weights(module), "step": trainer.global_step, "epoch": trainer.current_epoch,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}, "rows": run.logger.rows,
        "hooks": run.seen.hooks, "returned": returned,
        "observed": row.observe(trainer, module) if row.observe else None,
        "inspected": row.inspect(trainer, module) if row.inspect else None,
        "warnings": [str(w.message) for w in caught],
    }  # fmt: skip


class _Runs:
    """Each (row, where) run once per session: one-device references are shared by the rows naming them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[tuple[str, str], dict] = {}

    def get(self, row: Row, where: str) -> dict:
        key = (row.feature, where)
        if key not in self.done:
            folder = self.root / re.sub(r"\W+", "-", f"{where}-{row.feature}")[:80]
            if row.module is _compiled:
                torch._dynamo.reset()
                from torch._dynamo.utils import counters

                counters.clear()
            self.done[key] = _outcome(row, where, 1, folder)
        return self.done[key]

    def reference(self, row: Row) -> dict:
        return self.get(BY_NAME[row.reference] if row.reference else row, "one device")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> _Runs:
    return _Runs(tmp_path_factory.mktemp("matrix"))


def _param(row: Row):
    marks = [pytest.mark.xfail(strict=True, reason=row.xfail)] if row.xfail else []
    return pytest.param(row, id=row.feature, marks=marks)


def _without(outcome: dict, ignore: str) -> dict:
    """``outcome`` without the metrics whose names match ``ignore`` (in callback_metrics, logged rows and the
    callback metrics seen at each validation's end)."""
    if not ignore:
        return outcome
    keep = lambda metrics: {k: v for k, v in metrics.items() if not re.fullmatch(ignore, k)}  # noqa: E731
    hooks = [(*h[:3], keep(h[3])) if h[0] == "validation_end" else h for h in outcome["hooks"]]
    rows = [(s, keep(m)) for s, m in outcome["rows"]]
    return {**outcome, "metrics": keep(outcome["metrics"]), "rows": rows, "hooks": hooks}


def _assert_close(a, b, tolerance: float, where: str) -> None:
    """`_assert_same`, allowing ``tolerance`` on every floating tensor and float."""
    if isinstance(a, torch.Tensor) and a.is_floating_point():
        assert a.shape == b.shape and (a.double() - b.double()).abs().max().item() <= tolerance, where
    elif isinstance(a, float):
        assert abs(a - b) <= tolerance, (where, a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_close(a[k], b[k], tolerance, f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_close(x, y, tolerance, f"{where}[{i}]")
    else:
        _assert_same(a, b, where)


def _assert_outcomes(got: dict, want: dict, where: str, ignore: str = "", tolerance: float = 0.0) -> None:
    assert "error" not in got, f"{where}: {got['error']}"
    assert "error" not in want, f"{where}, the reference: {want['error']}"
    got, want = _without(got, ignore), _without(want, ignore)
    for key in COMPARED:
        if tolerance:
            _assert_close(got[key], want[key], tolerance, f"{where}: {key}")
        else:
            _assert_same(got[key], want[key], f"{where}: {key}")


@pytest.mark.parametrize("row", [_param(r) for r in ROWS])
def test_one_process(runs, row):
    """The row in one process against plain one-device Lightning, as its `how` says."""
    piped = runs.get(row, row.schedule)
    if row.how.startswith(ERROR):
        message = row.how.removeprefix(ERROR)
        assert "error" in piped and message in piped["error"], piped.get("error", "no error raised")
        if row.check is not None:
            row.check(piped, None)
        return
    reference = runs.reference(row)
    if row.exact:
        _assert_outcomes(piped, reference, row.feature, row.ignore, row.tolerance)
    assert "error" not in piped, piped["error"]
    if row.check is not None:
        row.check(piped, reference)


# -- two processes: every processes row in one spawned pair of ranks ---------------------------------------

PROCESS_ROWS = [i for i, row in enumerate(ROWS) if row.processes]


def _on_ranks(rank: int, world: int, root: str) -> dict | None:
    """Every processes row under both schedules, one after the other on the same two ranks; rank 0 (the
    last stage: the loss, the logger, the metrics, the whole model after fit) returns what it saw."""
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    out = {}
    for i in PROCESS_ROWS:
        row = ROWS[i]
        for schedule in SCHEDULES:
            folder = Path(root, f"{schedule}-{i}")
            out[(i, schedule)] = _outcome(row, schedule, world, folder)
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def on_processes(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("processes")
    return values(spawn(_on_ranks, 2, str(root), timeout=300, torchrun_env=True))[0]


@pytest.mark.multiproc
@pytest.mark.parametrize("row", [_param(ROWS[i]) for i in PROCESS_ROWS])
def test_processes(runs, on_processes, row):
    """On two processes, 1F1B-flush against one device (or against flush in one process, where the row is a
    documented difference) and PACI against PACI in one process: bit for bit."""
    i = ROWS.index(row)
    paci = on_processes[(i, "paci")]
    _assert_outcomes(paci, runs.get(row, "paci"), f"{row.feature}: paci, processes against one process", row.ignore)
    flush = on_processes[(i, "1f1b_flush")]
    want = runs.reference(row) if row.exact else runs.get(row, "1f1b_flush")
    _assert_outcomes(flush, want, f"{row.feature}: 1f1b_flush on processes", row.ignore, row.tolerance)
    for outcome in (paci, flush):  # Lightning warns once per process: either schedule's run may carry it
        # Its advice to log epoch-level metrics with sync_dist=True changes nothing with one replica per stage (the
        # metric is the last stage's alone); it was said in every 2-process run logging one.
        advice = [w for w in outcome["warnings"] if "It is recommended to use `self.log(" in w]
        assert not advice, f"{row.feature}: {advice}"
    if row.check is not None:
        row.check(paci, runs.reference(row))


# -- docs/compatibility.md's table -----------------------------------------------------------------------------------


def test_readme_table_is_generated():
    from tests.support.feature_matrix_table import README, current_section, section

    assert current_section(README.read_text()) == section(), (
        "docs/compatibility.md's 'What works with what' table is not the generated one: run "
        "`python -m tests.support.feature_matrix_table --write`"
    )
