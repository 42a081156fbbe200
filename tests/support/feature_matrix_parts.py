"""What the rows of tests/strategy/test_feature_matrix.py are made of: tiny modules and data, the record of a run
(every logger row, the hooks a callback sees), the actions a row takes (fit, validate, test, predict, resume,
the CLI), what it observes afterwards and its own assertions.

The modules are the shipped `GPT` at test sizes (the one other tests use) and test_recompute_buffers' BatchNorm
MLP; the data the byte-level `TextDataModule`, in the forms a Lightning user hands it over (a datamodule, plain
DataLoaders, an IterableDataset, workers, a loader that resumes mid-epoch).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning.pytorch.callbacks import (
    Callback,
    EarlyStopping,
    LearningRateFinder,
    LearningRateMonitor,
    ModelCheckpoint,
)
from lightning.pytorch.loggers import Logger
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader, IterableDataset

from lit_efficient import PACIStrategy
from lit_efficient.data import TextDataModule
from lit_efficient.models import GPT
from tests.support.compare import assert_same as _assert_same
from tests.support.gpt_runs import BLOCK
from tests.support.gpt_runs import OrderedData as _OrderedData
from tests.support.modules import BatchNormNet as _BatchNormNet

if TYPE_CHECKING:
    from tests.strategy.test_feature_matrix import Row

N = 2  # micro-batches per optimizer step in every row


# -- modules and data -------------------------------------------------------------------------------------


def _gpt(**kw) -> GPT:
    L.seed_everything(0)
    args = dict(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, warmup_steps=2, max_steps=20, learning_rate=3e-3)
    return GPT(**{**args, **kw})


def _text(**kw) -> TextDataModule:
    return TextDataModule(**{**dict(block_size=BLOCK, batch_size=4, max_bytes=60_000, seed=1), **kw})


class _EpochLR(GPT):
    """SGD with a StepLR stepped once per epoch."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}}


class _Plateau(GPT):
    """SGD with ReduceLROnPlateau on the validation loss, checked at every validation."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=10.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss", "interval": "step"}}


class _LBFGS(GPT):
    """LBFGS, whose step needs a closure (its line search evaluates the loss again): one device trains."""

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1)


class _SGD(GPT):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _sparse_embedding() -> GPT:
    """The token embedding with sparse gradients, stepped by SGD (which takes them): one device trains."""
    model = _as(_SGD)()
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    embeddings[0].sparse = True
    return model


class _PlateauOfTheirOwn(GPT):
    """A plateau scheduler of the user's own (not torch's class), said by the dict's reduce_on_plateau."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.5)
        halve = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
        own = {"scheduler": halve, "monitor": "val_loss", "reduce_on_plateau": True, "interval": "step"}
        return {"optimizer": opt, "lr_scheduler": own}


class _Frozen(GPT):
    """The embedding frozen (``requires_grad_(False)``): stage 0 trains only its block."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.embed.requires_grad_(False)


class _LogsEpoch(GPT):
    """Logs a per-micro-batch metric on step and on epoch, from ``pipeline_loss`` where the pipeline runs it."""

    def pipeline_loss(self, output, batch):
        loss, items = super().pipeline_loss(output, batch)
        if self.trainer.training:
            self.log("mean_target", batch[1].float().mean(), on_step=True, on_epoch=True, batch_size=4)
        return loss, items


def _manual() -> GPT:
    model = _gpt()
    model.automatic_optimization = False
    return model


class _FrozenLeftOut(_Frozen):
    """Its optimizer given only what trains (the fine-tuning recipe: ``filter(requires_grad)``)."""

    def configure_optimizers(self):
        return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=3e-3, weight_decay=0.1)


def _frozen(cls: type[GPT] = _Frozen) -> GPT:
    L.seed_everything(0)
    return cls(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, warmup_steps=2, max_steps=20, learning_rate=3e-3)


def _frozen_left_out() -> GPT:
    return _frozen(_FrozenLeftOut)


def _as(cls: type[GPT]) -> Callable[[], GPT]:
    def build() -> GPT:
        model = _gpt()
        model.__class__ = cls
        return model

    build.__name__ = f"_{cls.__name__.lower()}"
    return build


class _LoggedBatchNorm(_BatchNormNet):
    """test_recompute_buffers' BatchNorm MLP, logging its training loss as the strategy does for it."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch[0].shape[0])
        return loss


def _compiled() -> Any:
    # dynamo and AOTAutograd with eager kernels: no C++ build. The MLP: compiling the GPT's stages takes 20 s here.
    return torch.compile(_LoggedBatchNorm(), backend="aot_eager")


class _Stream(IterableDataset):
    """The first ``n`` training blocks, streamed in order."""

    def __init__(self, blocks, n: int) -> None:
        self.blocks, self.n = blocks, n

    def __iter__(self):
        return (self.blocks[i] for i in range(self.n))


class _IterableText(TextDataModule):
    def train_dataloader(self):
        return DataLoader(_Stream(self.train_set, 32), batch_size=self.batch_size)


class _Noisy(torch.utils.data.Dataset):
    """Training blocks with random tokens blanked, drawn in the loader's worker (seeded by Lightning's
    ``pl_worker_init_function`` under ``seed_everything(workers=True)``)."""

    def __init__(self, blocks) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i):
        x, y = self.blocks[i]
        return x.masked_fill(torch.rand(x.shape) < 0.2, 0), y


class _NoisyText(TextDataModule):
    def train_dataloader(self):
        return DataLoader(_Noisy(self.train_set), batch_size=self.batch_size, num_workers=1, shuffle=False)


class _CountingText(TextDataModule):
    """Counts ``train_dataloader`` calls (``reload_dataloaders_every_n_epochs``)."""

    loads = 0

    def train_dataloader(self):
        self.loads += 1
        return super().train_dataloader()


class _ResumableLoader(DataLoader):
    """A DataLoader Lightning resumes in the middle of an epoch (it saves and restores a loader's
    ``state_dict``): the state is the batches yielded this epoch, skipped on the next iteration."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen, self.skip = 0, 0

    def __iter__(self):
        batches = super().__iter__()
        for _ in range(self.skip):
            next(batches)
        self.seen, self.skip = self.skip, 0
        for batch in batches:
            self.seen += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["seen"]


class _ResumableText(_OrderedData):
    """Epochs of 12 micro-batches in a fixed order, resumable mid-epoch."""

    def train_dataloader(self):
        subset = torch.utils.data.Subset(self.train_set, range(12 * self.batch_size))
        return _ResumableLoader(subset, batch_size=self.batch_size, shuffle=False)


def _resumable() -> _ResumableText:
    return _ResumableText(block_size=BLOCK, batch_size=4, max_bytes=60_000)


def _loaders() -> dict[str, DataLoader]:
    """Plain DataLoaders handed to ``fit`` (no datamodule)."""
    data = _text()
    data.setup("fit")
    return {"train_dataloaders": data.train_dataloader(), "val_dataloaders": data.val_dataloader()}


def _seeded_workers() -> _NoisyText:
    L.seed_everything(0, workers=True)
    return _NoisyText(block_size=BLOCK, batch_size=4, max_bytes=60_000)


def _regression() -> dict[str, DataLoader]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    return {"train_dataloaders": DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()), 8)}


# -- what a run records -----------------------------------------------------------------------------------


class _Rows(Logger):
    """Every row the Trainer writes to a logger, as (step, {name: value})."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "rows"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, {k: float(v) for k, v in metrics.items()}))


class _Seen(Callback):
    """The hooks a user's callback sees, with the step, epoch and batch index at each."""

    def __init__(self) -> None:
        self.hooks: list[tuple] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.hooks.append(("train_batch_end", trainer.global_step, batch_idx))

    def on_validation_end(self, trainer, pl_module) -> None:
        # With what a checkpoint or early-stopping callback reads there (a validation in the middle of a window read
        # the window before's train_loss where one device reads the micro-batch just trained).
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        self.hooks.append(("validation_end", trainer.global_step, trainer.sanity_checking, metrics))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.hooks.append(("train_epoch_end", trainer.global_step, trainer.current_epoch))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.hooks.append(("save_checkpoint", trainer.global_step))


@dataclass
class _Run:
    """One run of a row: on one device (``where="one device"``) or under a pipeline schedule, on some devices,
    with a folder of its own."""

    row: Row
    where: str
    devices: int
    root: Path
    seen: _Seen = field(default_factory=_Seen)
    logger: _Rows = field(default_factory=_Rows)

    def strategy(self) -> Any:
        """A fresh strategy for each Trainer (a strategy object belongs to the Trainer it was given to)."""
        if self.where == "one device":
            return "auto"
        return PACIStrategy(pipeline_stages=2, schedule=self.where, **self.row.strategy)

    def trainer(self, extra: tuple[Callback, ...] = (), **kw) -> L.Trainer:
        """The row's Trainer, with ``kw`` over its arguments and ``extra`` callbacks after its own."""
        args = dict(
            accelerator="cpu", devices=self.devices, strategy=self.strategy(), max_steps=3, accumulate_grad_batches=N,
            logger=self.logger, log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, default_root_dir=self.root,
        )  # fmt: skip
        args.update(self.row.trainer)
        args.update(kw)
        return L.Trainer(callbacks=[self.seen, *self.row.callbacks(self.root), *extra], **args)

    def fit(self, trainer: L.Trainer, module, data=None, **kw) -> None:
        data = self.row.data() if data is None else data
        if isinstance(data, dict):
            trainer.fit(module, **data, **kw)
        else:
            trainer.fit(module, datamodule=data, **kw)


def _weights(module) -> dict[str, torch.Tensor]:
    module = getattr(module, "_orig_mod", module)  # torch.compile's wrapper
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# -- actions: what a row does with its Trainer --------------------------------------------------------------


def _fit(run: _Run):
    trainer, module = run.trainer(), run.row.module()
    run.fit(trainer, module)
    return trainer, module, None


def _evaluate(method: str):
    def action(run: _Run):
        trainer, module = run.trainer(), run.row.module()
        returned = getattr(trainer, method)(module, datamodule=run.row.data())
        return trainer, module, returned

    action.__name__ = f"_{method}"
    return action


def _validate_then_fit(run: _Run):
    trainer, module = run.trainer(), run.row.module()
    returned = trainer.validate(module, datamodule=run.row.data())
    run.fit(trainer, module)
    return trainer, module, returned


def _fit_then_evaluate(run: _Run):
    """Lightning's most common pattern: fit, then validate, test, predict and validate again on the same Trainer
    (the module split by fit's setup is set up again, each time)."""
    trainer, module = run.trainer(), run.row.module()
    run.fit(trainer, module)
    returned = [getattr(trainer, method)(module, datamodule=run.row.data()) for method in ("validate", "test")]
    returned.append(trainer.predict(module, datamodule=run.row.data()))
    returned.append(trainer.validate(module, datamodule=run.row.data()))
    return trainer, module, returned


FINDER = dict(min_lr=1e-5, max_lr=1.0)  # 14 rates: enough for a suggestion (it skips the first 10 and the last)


def _finder_record(finder: Any, trainer: L.Trainer, module: Any) -> dict:
    """What Lightning's learning-rate finder recorded and suggested, and the rate it set on the module. Its losses as
    one device records them: there a step's loss divided by N, the pipeline's outputs hold the loss itself
    (lit_efficient/strategy/lr_finder.py; N = 2 divides exactly)."""
    per_step = N if isinstance(trainer.strategy, PACIStrategy) else 1
    losses = [v / per_step if math.isfinite(v) else repr(v) for v in finder.results["loss"]]  # nan != nan
    return {
        "lr": finder.results["lr"], "loss": losses,
        "suggestion": finder.suggestion(), "module lr": module.hparams.learning_rate,
    }  # fmt: skip


def _lr_finder(root: Path) -> list[Callback]:
    return [LearningRateFinder(num_training_steps=14, **FINDER)]


def _lr_finder_to_nan(root: Path) -> list[Callback]:
    """Up to a rate where the loss turns NaN, without the early stop: one device records NaN and goes on."""
    return [LearningRateFinder(num_training_steps=14, min_lr=1e-3, max_lr=1e8, early_stop_threshold=None)]


def _found_nan(piped: dict, ref: dict) -> None:
    assert "nan" in piped["observed"]["loss"], piped["observed"]["loss"]


def _found(trainer, module) -> dict:
    (finder,) = [c for c in trainer.callbacks if isinstance(c, LearningRateFinder)]
    return _finder_record(finder.optimal_lr, trainer, module)


def _tuned(run: _Run):
    """Lightning's tuner on the row's Trainer, then fit on the same Trainer at the rate it set on the module."""
    trainer, module = run.trainer(), run.row.module()
    finder = Tuner(trainer).lr_find(module, datamodule=run.row.data(), num_training=14, **FINDER)
    record = _finder_record(finder, trainer, module)
    run.fit(trainer, module)
    return trainer, module, record


def _resume(run: _Run):
    """Two steps with a "last" checkpoint in the middle of the first epoch (6 windows), then resumed from it to
    step 4; the uninterrupted 4 steps, saving at the same step (a checkpoint drains a paci pipeline, which moves
    its trajectory), are returned alongside."""

    def last(folder: str) -> tuple[Callback]:
        return (ModelCheckpoint(dirpath=run.root / folder, save_last=True, every_n_train_steps=2, save_top_k=0),)

    run.fit(run.trainer(last("ckpt"), max_steps=2, enable_checkpointing=True), run.row.module())
    trainer, module = run.trainer(last("ckpt"), max_steps=4, enable_checkpointing=True), run.row.module()
    run.fit(trainer, module, ckpt_path="last")
    uninterrupted = run.row.module()
    run.fit(run.trainer(last("whole"), max_steps=4, enable_checkpointing=True, logger=False), uninterrupted)
    return trainer, module, _weights(uninterrupted)


def _cli(run: _Run):
    from lit_efficient.cli.app import LitEfficientCLI

    args = [
        "fit", "--model.init_args.n_layer=2", "--model.init_args.n_embd=32", "--model.init_args.n_head=2",
        "--model.init_args.warmup_steps=2", "--model.init_args.max_steps=20", "--data.init_args.block_size=32",
        "--data.init_args.batch_size=4", "--data.init_args.max_bytes=60000", "--data.init_args.seed=1",
        "--trainer.accelerator=cpu", f"--trainer.devices={run.devices}", "--trainer.max_steps=3",
        f"--trainer.accumulate_grad_batches={N}", "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--trainer.log_every_n_steps=1", "--seed_everything=0",
        f"--trainer.default_root_dir={run.root}",
    ]  # fmt: skip
    strategy = ["--trainer.strategy=auto"]
    if run.where != "one device":
        strategy = ["--trainer.strategy=lit_efficient.PACIStrategy", "--trainer.strategy.pipeline_stages=2",
                    f"--trainer.strategy.schedule={run.where}"]  # fmt: skip
    record = [f"--trainer.logger={__name__}._Rows", f"--trainer.callbacks+={__name__}._Seen"]
    argv, sys.argv = sys.argv, ["lit-efficient"]  # LightningCLI warns when given args and sys.argv both
    try:
        cli = LitEfficientCLI(args=[*args, *strategy, *record])
    finally:
        sys.argv = argv
    run.logger = cli.trainer.logger
    (run.seen,) = (c for c in cli.trainer.callbacks if isinstance(c, _Seen))
    return cli.trainer, cli.model, None


# -- what a row observes besides the common record ----------------------------------------------------------


def _lr_monitor(root: Path) -> list[Callback]:
    return [LearningRateMonitor(logging_interval="step")]


def _top_k(root: Path) -> list[Callback]:
    return [ModelCheckpoint(dirpath=root / "top", monitor="val_loss", save_top_k=2, filename="{step}")]


def _top_k_train(root: Path) -> list[Callback]:
    """Top-k on the training loss, which only the last stage (rank 0) logs, named by it too: rank 0 alone found it
    and saved (a collective) while the other ranks skipped the save, a hang (the strategy now syncs it first)."""
    return [ModelCheckpoint(dirpath=root / "top", monitor="train_loss", save_top_k=2, every_n_train_steps=1,
                            filename="{step}-{train_loss:.4f}")]  # fmt: skip


def _top_k_at_epoch_ends(root: Path) -> list[Callback]:
    """Saves at every epoch's last batch (2 steps an epoch), which a validation follows (every window validates):
    one device waits for it, so the score is that validation's, not the one a window earlier."""
    return [ModelCheckpoint(dirpath=root / "top", monitor="val_loss", save_top_k=2, every_n_train_steps=2,
                            filename="{step}")]  # fmt: skip


def _timed(root: Path) -> list[Callback]:
    """A save at every batch end past a step, with a training metric, which only the last stage (rank 0) logs: each
    rank must see it when rank 0's clock says save (the decision is rank 0's, broadcast inside the hook)."""
    return [ModelCheckpoint(dirpath=root / "timed", monitor="train_loss", train_time_interval=timedelta(0),
                            save_top_k=-1, filename="{step}")]  # fmt: skip


def _saved(trainer, module) -> dict:
    """The files a ModelCheckpoint wrote, and the step each holds."""
    (cb,) = trainer.checkpoint_callbacks
    return {p.name: torch.load(p, weights_only=False)["global_step"] for p in sorted(Path(cb.dirpath).glob("*.ckpt"))}


def _saved_weights(trainer, module) -> dict:
    """The weights each file a ModelCheckpoint wrote holds (compared with one device's files, tensor by tensor)."""
    (cb,) = trainer.checkpoint_callbacks
    return {p.name: torch.load(p, weights_only=True)["state_dict"] for p in sorted(Path(cb.dirpath).glob("*.ckpt"))}


def _pruned_files(piped: dict, ref: dict) -> None:
    """Files were written after a pruning, each with the whole model (a pruned save once held no weights)."""
    files = piped["observed"]
    assert len(files) == 6 and all(len(weights) == len(files["step=1.ckpt"]) > 0 for weights in files.values())


def _kept(trainer, module) -> dict:
    """The top-k files ModelCheckpoint kept, their scores and the weights and step each holds."""
    (cb,) = trainer.checkpoint_callbacks
    kept = {}
    for path, score in cb.best_k_models.items():
        saved = torch.load(path, weights_only=False)
        kept[Path(path).name] = {"score": float(score), "weights": saved["state_dict"], "step": saved["global_step"]}
    return {"kept": kept, "best": Path(cb.best_model_path).name}


def _stopped(trainer, module) -> dict:
    (cb,) = [c for c in trainer.callbacks if isinstance(c, EarlyStopping)]
    return {"stopped_epoch": cb.stopped_epoch, "wait": cb.wait_count, "should_stop": trainer.should_stop}


def _loads(trainer, module) -> dict:
    return {"loads": trainer.datamodule.loads}


def _profiled(trainer, module) -> dict:
    durations = trainer.profiler.recorded_durations
    return {"pipeline": {k: len(v) for k, v in durations.items() if k.startswith("[pipeline]")}}


def _graphs(trainer, module) -> dict:
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"]}


# -- the row's own assertions (pipeline outcome, one-device outcome) ---------------------------------------


def _one_row_per_step(piped: dict, ref: dict) -> None:
    train = [step for step, metrics in piped["rows"] if "train_loss" in metrics]
    assert train == [0, 1, 2], train  # one row per optimizer step, not N


def _every_other_step(piped: dict, ref: dict) -> None:
    train = [step for step, metrics in piped["rows"] if "train_loss" in metrics]
    assert train == [1, 3], train


def _resumed_as_uninterrupted(piped: dict, ref: dict) -> None:
    _assert_same(piped["weights"], piped["returned"], "resumed against uninterrupted")


def _counted_once(piped: dict, ref: dict) -> None:
    assert int(piped["weights"]["layers.0.1.num_batches_tracked"]) == 3 * N  # one update per micro-batch, not two


def _compiled_stages(piped: dict, ref: dict) -> None:
    assert piped["inspected"]["graphs"] >= 2  # each stage's layers; before the fix, 0


def _pipeline_actions(piped: dict, ref: dict) -> None:
    rows = piped["inspected"]["pipeline"]
    for stage in (0, 1):
        assert rows[f"[pipeline] stage {stage} forward"] == rows[f"[pipeline] stage {stage} backward"] == 3 * N
        assert rows[f"[pipeline] stage {stage} optimizer step"] == 3


def _clips_per_stage(piped: dict, ref: dict) -> None:
    said = [w for w in piped["warnings"] if "gradient_clip_val" in w]
    assert len(said) == 1 and "clips each of the 2 stages' gradient norms to 0.1 separately" in said[0], said
    assert "schedule='1f1b_flush'" in said[0]


def _own_dropout_streams(piped: dict, ref: dict) -> None:
    worst = max((piped["weights"][k] - v).abs().max().item() for k, v in ref["weights"].items())
    assert worst > 1e-6, "the stages' masks are their own, so the run differs from one device's"
    assert piped["step"] == ref["step"] and piped["hooks"] == ref["hooks"]


class _SetsTheRate(Callback):
    """A learning rate set by hand in a callback, over the module's scheduler (Lightning's manual warmup, as a
    callback): every group of ``trainer.optimizers``, at every batch's start and (for the next) end. The end's runs
    before a ModelCheckpoint's save (Lightning calls checkpoint callbacks last), whose drain steps stages under
    PACI: on processes each rank has its rate by then, in one process the drain must give it to every stage."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._set(trainer, trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._set(trainer, trainer.global_step + 1)

    @staticmethod
    def _set(trainer, step: int) -> None:
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = min(1.0, (step + 1) / 4) * 1e-2


class _WithBackbone(GPT):
    """What BackboneFinetuning reads: the module's ``backbone``."""

    @property
    def backbone(self) -> torch.nn.Module:
        return self.blocks


class _UnfreezesTheEmbedding(Callback):
    """The fine-tuner's unfreezing without BaseFinetuning (refused): ``requires_grad_(True)`` at epoch 1, the
    optimizer given every parameter from the start."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 1:
            pl_module.embed.requires_grad_(True)


class _AddsTheEmbeddingsGroup(Callback):
    """Unfreezing by hand, as BaseFinetuning (refused) does: at epoch 1 the embedding trains again, its two tables
    in parameter groups of their own (two learning rates) added to ``trainer.optimizers[0]`` in one hook (where a
    rank holds none of a table, nothing is added)."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 1:
            pl_module.embed.requires_grad_(True)
            optimizer = trainer.optimizers[0]
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            for name, lr in (("wte", 1e-3), ("wpe", 2e-3)):  # a rank without stage 0 has a stand-in embedding
                table = getattr(pl_module.embed, name, torch.nn.Identity())
                new = [p for p in table.parameters() if id(p) not in held]
                if new:
                    optimizer.add_param_group({"params": new, "lr": lr, "weight_decay": 0.0})


def _unfrozen_trains(piped: dict, ref: dict) -> None:
    start = _frozen().state_dict()
    assert not torch.equal(piped["weights"]["embed.wte.weight"], start["embed.wte.weight"])


def _frozen_stays(piped: dict, ref: dict) -> None:
    start = _frozen().state_dict()
    assert all(torch.equal(piped["weights"][k], start[k]) for k in start if k.startswith("embed."))
    assert not torch.equal(piped["weights"]["blocks.0.attn.c_attn.weight"], start["blocks.0.attn.c_attn.weight"])


def _lrs_logged(piped: dict, ref: dict) -> None:
    """LearningRateMonitor logged a learning rate at every step and the schedule moved it, so the rows' comparison
    tells which stage's schedule is logged (under paci the stages have taken different steps at a window end)."""
    lrs = [v for _, metrics in piped["rows"] for k, v in metrics.items() if k.startswith("lr-")]
    assert len(lrs) >= 3 and len(set(lrs)) > 1, piped["rows"]


def _grad_norms_logged(piped: dict, ref: dict) -> None:
    """PipelineMonitor(grad_norm=True) logged the norm before clipping at every step on both sides (compared by the
    row); under the pipeline each stage's share too, whose squares sum to the whole's."""
    steps = [metrics for _, metrics in piped["rows"] if "grad/norm" in metrics]
    assert len(steps) >= 3 and len({m["grad/norm"] for m in steps}) > 1, piped["rows"]
    assert len([m for _, m in ref["rows"] if "grad/norm" in m]) == len(steps), ref["rows"]
    for m in steps:
        whole = (m["grad/norm_stage0"] ** 2 + m["grad/norm_stage1"] ** 2) ** 0.5
        assert abs(whole - m["grad/norm"]) <= 1e-6 * m["grad/norm"] and m["grad/norm"] > 0.1, m  # clipped at 0.1


def _stopped_early(piped: dict, ref: dict) -> None:
    assert piped["observed"]["should_stop"] and piped["step"] < 8, piped["step"]  # before max_steps


def _two_kept(piped: dict, ref: dict) -> None:
    assert len(piped["observed"]["kept"]) == 2 and piped["observed"]["best"] in piped["observed"]["kept"]


def _no_manual_advice(piped: dict, ref: dict | None) -> None:
    """The module optimizes automatically: nothing tells it to step its schedulers by hand (manual optimization is
    the strategy's inside), before the refusal."""
    assert not [w for w in piped["warnings"] if "manually in manual optimization" in w], piped["warnings"]


def _saved_every_step(piped: dict, ref: dict) -> None:
    assert piped["observed"] == {f"step={s}.ckpt": s for s in (1, 2, 3, 4)}


def _predictions(piped: dict, ref: dict) -> None:
    assert len(piped["returned"]) == 2 and piped["returned"][0].shape == (4, BLOCK)


def _evaluated_twice_alike(piped: dict, ref: dict) -> None:
    first, _, predictions, again = piped["returned"]
    assert first == again and len(predictions) == 2 and predictions[0].shape == (4, BLOCK)
