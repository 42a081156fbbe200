"""Real models in one process (``Trainer(devices=1)`` with ``pipeline_stages=S``) against S processes.

`HFCausalLM` layers are adapters outside the module tree and GPT-2-style models tie their embeddings:
the in-process pipeline takes both through the process path's own split and tied-weight rule, so it
must match S processes bit for bit (max abs difference 0.0, not a tolerance), and every callback hook
must see, stage by stage, what it sees on S processes (docs/DESIGN.md section 7). Both sides run one
intra-op thread, as the spawned ranks do, since the thread count can change float reduction order.
"""

from __future__ import annotations

import pickle
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lit_efficient import PACIStrategy
from lit_efficient.data import TextDataModule
from lit_efficient.models import HFCausalLM
from lit_efficient.runtime.host import PipelineDeadlockError
from lit_efficient.runtime.partition import partition_uniform, stage_bounds
from lit_efficient.runtime.stage import PipelineStage
from lit_efficient.runtime.tied import TiedWeight, finish_tied, tie_delay
from lit_efficient.tools.demo import lm_loss
from lit_efficient.transport.local import LocalTiedLink, local_pipeline
from tests.support.compare import assert_same as _assert_same
from tests.support.runtime_runs import runtime_batches as _batches
from tests.support.tied_runs import emulate_tied as _emulate
from tests.support.tied_runs import tied_layers as _tied_layers
from tests.support.tied_runs import tied_sgd as _optimizer
from tests.support.tied_runs import unique_layers as _unique

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

BLOCK = 32
VOCAB = 256  # TextDataModule's bytes


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one thread here and in every rank


# Tiny configs of several architectures, built from their Config classes (random init, nothing downloaded).
ARCHS = {
    "gpt2": dict(model_type="gpt2", n_layer=2, n_embd=32, n_head=2, n_positions=BLOCK, resid_pdrop=0.1,
                 embd_pdrop=0.1, attn_pdrop=0.0),  # tied embeddings, dropout
    "llama": dict(model_type="llama", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=BLOCK),  # untied, GQA, rotary
    "qwen2": dict(model_type="qwen2", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=BLOCK,
                  tie_word_embeddings=True),  # tied, attention biases
    "gpt_neox": dict(model_type="gpt_neox", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                     num_attention_heads=4, max_position_embeddings=BLOCK, rotary_pct=0.5),  # untied, parallel residual
}  # fmt: skip


# -- the runtime: the tied-weight rule in one process ---------------------------------------------------


def _tied_pipeline(stages: int, schedule: str, accumulate: int, tie_first: bool = True):
    """test_tied's tied demo model, each stage holding its own copy of every layer (as on its own process), its
    tied weight exchanged over a `LocalTiedLink`; ``tie_first=False`` leaves stage 0 without the rule."""
    link = LocalTiedLink()
    built = []
    for s, (lo, hi) in enumerate(stage_bounds(partition_uniform(len(_tied_layers()), stages))):
        mine = _tied_layers()[lo:hi]
        stage = PipelineStage(mine, s, stages, _optimizer(_unique(mine)), lm_loss, recompute=True)
        built.append(stage)
    first, last = built[0].layers[0].tok.weight, built[-1].layers[-1].out.weight
    delay = tie_delay(stages, accumulate)
    tied = [TiedWeight(last, False, schedule, delay, link.end(False))]
    built[-1].exchange_tied = tied[0]
    if tie_first:
        tied.insert(0, TiedWeight(first, True, schedule, delay, link.end(True)))
        built[0].exchange_tied = tied[0]
    pipe = local_pipeline(built, schedule, accumulate, lambda b: b[0])
    link.wait = pipe.run_others_until
    return pipe, link, tied


@pytest.mark.parametrize(
    ("schedule", "stages", "accumulate"), [("1f1b_flush", 2, 4), ("1f1b_flush", 4, 2), ("paci", 4, 2)]
)  # flush: the last stage waits inside its step for stage 0's gradient; paci at S=4, N=2: delay 2
def test_tied_rule_in_one_process_equals_its_definition(schedule, stages, accumulate):
    windows = 4
    data = _batches(accumulate * windows)
    pipe, link, tied = _tied_pipeline(stages, schedule, accumulate)
    for j, batch in enumerate(data):
        pipe.feed(batch, j)
    pipe.drain()
    finish_tied(tied)
    assert link.pending == 0 and pipe.drained
    for s, mine in enumerate(_emulate(data, stages, accumulate, schedule)):
        got = list(pipe.runtimes[s].stage.parameters())
        assert max((a - b).abs().max().item() for a, b in zip(got, _unique(mine), strict=True)) <= 1e-5, s
    first, last = tied[0].param, tied[-1].param
    assert first is not last and torch.equal(first, last)  # two copies, equal after the run


def test_a_tied_exchange_nobody_answers_is_a_deadlock_naming_it():
    pipe, _, _ = _tied_pipeline(2, "1f1b_flush", 2, tie_first=False)
    with pytest.raises(PipelineDeadlockError, match="stage 1 waits for the tied-weight all-reduce with stage 0"):
        for j, batch in enumerate(_batches(2)):
            pipe.feed(batch, j)


# -- the Trainer: HFCausalLM in one process against S processes --------------------------------------------


def _model(arch: str, sgd: bool) -> HFCausalLM:
    L.seed_everything(0)
    config = dict(ARCHS[arch], vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    model = AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    cls = SGDLM if sgd else HFCausalLM
    return cls(model, learning_rate=3e-3, warmup_steps=2, max_steps=20)


class SGDLM(HFCausalLM):
    """Plain SGD with momentum: what the one-device comparison of flush uses (AdamW magnifies rounding)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def _data() -> TextDataModule:
    return TextDataModule(block_size=BLOCK, batch_size=4, max_bytes=60_000, seed=1)


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


class Views(Callback):
    """At every hook: the step, each parameter's weights and gradient under its name, and each stage's learning
    rates. Written per rank, since spawned ranks cannot hand objects back; in one process (and on one device)
    the one record holds every stage."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.views: list[dict] = []
        self.losses: list[float] = []

    def _see(self, hook: str, trainer, pl_module, **extra) -> None:
        runtime = getattr(trainer.strategy, "runtime", None)
        runtimes = getattr(runtime, "runtimes", [runtime] if runtime is not None else [])
        # Each stage's own optimizer: a rank's one, or every stage's in one process, where trainer.optimizers
        # holds the last stage's only (as on global rank 0); one device's otherwise.
        optimizers = {rt.stage.stage: rt.stage.optimizer for rt in runtimes} or {0: trainer.optimizers[0]}
        lrs = {s: [g["lr"] for g in opt.param_groups] for s, opt in optimizers.items()}
        versions = {rt.stage.stage: rt.stage.version for rt in runtimes}  # optimizer steps each stage has taken
        self.views.append({
            "hook": hook, "step": trainer.global_step, **extra, "lr": lrs, "versions": versions,
            "weights": {n: _copy(p) for n, p in pl_module.named_parameters()},
            "grads": {n: _copy(p.grad) for n, p in pl_module.named_parameters()},
        })  # fmt: skip

    def on_train_start(self, trainer, pl_module):
        self._see("train_start", trainer, pl_module)

    def on_train_epoch_start(self, trainer, pl_module):
        self._see("train_epoch_start", trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._see("train_batch_start", trainer, pl_module, batch=batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if outputs is not None and "loss" in outputs:
            self.losses.append(outputs["loss"].item())
        self._see("train_batch_end", trainer, pl_module, batch=batch_idx)

    def on_validation_start(self, trainer, pl_module):
        self._see("validation_start", trainer, pl_module)

    def on_validation_end(self, trainer, pl_module):
        self._see("validation_end", trainer, pl_module, val=_value(trainer.callback_metrics.get("val_loss")))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self._see("save_checkpoint", trainer, pl_module)

    def on_train_epoch_end(self, trainer, pl_module):
        self._see("train_epoch_end", trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self._see("train_end", trainer, pl_module)
        runtime = getattr(trainer.strategy, "runtime", None)  # None: plain one-device Lightning
        # Per hosted stage: whether it predicted in compiled passes (a compiled form that fell back: False).
        runtimes = getattr(runtime, "runtimes", [runtime]) if runtime is not None else []
        compiled = {rt.stage.stage: getattr(rt.stage.correction, "compiled", False) for rt in runtimes}
        drift = {rt.stage.stage: rt.stats()["drift_max"] for rt in runtimes}  # > 0: stale forwards ran
        out = {"views": self.views, "losses": self.losses, "compiled": compiled, "drift": drift}
        Path(self.path, f"rank{trainer.global_rank}.pkl").write_bytes(pickle.dumps(out))


def _value(x) -> float | None:
    return None if x is None else float(x)


def _fit(
    tmp: Path, module: HFCausalLM, strategy, devices: int, epoch: int = 7, steps: int = 3, val_every: int = 3
) -> HFCausalLM:
    """``steps`` optimizer steps over epochs of ``epoch`` micro-batches (windows of 4: with 7, the first epoch ends
    with a partial window, the run with max_steps in the middle of the second), a validation every ``val_every``
    micro-batches (3 or 5: in the middle of windows), a checkpoint every 2 steps, the default (shuffling) loader."""
    tmp.mkdir(parents=True, exist_ok=True)
    views = Views(tmp)
    ckpt = ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=2, filename="{step}", save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, accumulate_grad_batches=4,
        limit_train_batches=epoch, val_check_interval=val_every, limit_val_batches=2, callbacks=[views, ckpt],
        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp,
    )  # fmt: skip
    trainer.fit(module, datamodule=_data())
    return module


def _pipeline(stages: int, schedule: str, correction: str = "auto") -> PACIStrategy:
    # PACI's defaults with AdamW (weight prediction, a synchronous start) with the start shortened to 1 step: the
    # switch from flush's order, a tied weight's PACI rule across it, and stale forwards (predicted) in the 3-step
    # fit's last window, in both hostings.
    sync = {"sync_start_steps": 1} if schedule == "paci" else {}
    return PACIStrategy(
        pipeline_stages=stages, schedule=schedule, start_method="forkserver", staleness_correction=correction, **sync
    )


def _views(path: Path) -> dict:
    return pickle.loads(path.read_bytes())


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    assert a.shape == b.shape and a.dtype == b.dtype
    return (a.double() - b.double()).abs().max().item()


def _compare_views(mine: list[dict], theirs: list[dict], grads: bool, lr_pairs: list[tuple[int, int]]) -> float:
    """The largest difference between what one run's callback saw and another's, hook by hook, over the names
    ``theirs`` saw (a rank sees its stage's parameters), validation losses included. Hooks, steps, batches and
    the learning rates of each ``(my stage, their stage)`` pair must agree exactly."""
    assert [v["hook"] for v in mine] == [v["hook"] for v in theirs]
    worst = 0.0
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        where = f"view {i} ({b['hook']}, step {b['step']}, batch {b.get('batch')})"
        assert {k: a.get(k) for k in ("step", "batch")} == {k: b.get(k) for k in ("step", "batch")}, where
        assert (a.get("val") is None) == (b.get("val") is None), where
        if a.get("val") is not None:
            worst = max(worst, abs(a["val"] - b["val"]))
        for my_stage, their_stage in lr_pairs:
            assert a["lr"][my_stage] == b["lr"][their_stage], where
        assert all(a["versions"][stage] == v for stage, v in b["versions"].items()), where
        for part in ("weights", "grads") if grads else ("weights",):
            assert set(b[part]) <= set(a[part]), where
            for name, t in b[part].items():
                worst = max(worst, _diff(a[part][name], t))
    return worst


# (architecture, stages, schedule, staleness correction, micro-batches per epoch): tied and untied embeddings, S=2
# and S=4, both schedules. Epochs of 7 end in a partial window (3 steps, a validation every 3 micro-batches). A
# drain (a validation, a checkpoint, an epoch's end) at a window's end leaves nothing stale, and with those the
# PACI runs would never forward on predicted weights: epochs of 16 run 4 steps with a validation every 5
# micro-batches, so step 3's window end is not a drain and window 4's first forward on stage 0 is stale (predicted)
# after the 1-step synchronous start: the eager prediction on llama, the compiled one ("auto" on CUDA) on a tied
# qwen2.
COMPILED = "weight_prediction_first_step_compiled"
CASES = [
    ("gpt2", 4, "paci", "auto", 7), ("llama", 2, "paci", "auto", 16), ("qwen2", 4, "1f1b_flush", "auto", 7),
    ("gpt_neox", 2, "1f1b_flush", "auto", 7), ("qwen2", 2, "paci", COMPILED, 16),
]  # fmt: skip


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("arch", "stages", "schedule", "correction", "epoch"), CASES,
    ids=[f"{a}-S{s}-{k}-{e}" + ("-compiled" if c == COMPILED else "") for a, s, k, c, e in CASES],
)  # fmt: skip
def test_hf_models_in_one_process_equal_processes(tmp_path, arch, stages, schedule, correction, epoch):
    """HFCausalLM in one process against S processes, through the real Trainer (default loader, validation inside fit in
    the middle of windows, an epoch ending in a partial window and max_steps in the middle of the next, or 4 windows in
    one epoch where PACI's stale forwards run on predicted weights; checkpoints): what every callback hook sees
    (weights, gradients, learning rates of every stage, steps, validation losses), the training losses, the checkpoint
    files and the weights after fit are identical; a tied weight is one parameter again afterwards. Under flush both
    also equal plain one-device Lightning with accumulate_grad_batches=4 (to float reassociation)."""
    flush = schedule == "1f1b_flush"
    steps, val_every = (3, 3) if epoch == 7 else (4, 5)
    pipeline = partial(_pipeline, stages, schedule, correction)
    local = _fit(tmp_path / "local", _model(arch, sgd=flush), pipeline(), 1, epoch, steps, val_every)
    procs = _fit(tmp_path / "procs", _model(arch, sgd=flush), pipeline(), stages, epoch, steps, val_every)
    start = _model(arch, sgd=flush).state_dict()
    after = local.state_dict()
    assert max(_diff(after[k], start[k]) for k in start) > 1e-3  # training moved the weights
    assert max(_diff(after[k], v) for k, v in procs.state_dict().items()) == 0.0
    model = local.model
    tied = model.config.tie_word_embeddings
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    one = _views(tmp_path / "local/rank0.pkl")
    # Section 7's points: every stage has taken global_step steps when a validation, a checkpoint, an epoch's end
    # or the end of training is seen; between batches under paci stage 0 has not (the comparison is not vacuous).
    for view in one["views"]:
        drained = view["hook"] in ("validation_start", "save_checkpoint", "train_epoch_end", "train_end")
        assert not drained or set(view["versions"].values()) == {view["step"]}, view["hook"]
    lagging = [v for v in one["views"] if v["hook"] == "train_batch_end" and v["versions"][0] < v["step"]]
    assert bool(lagging) == (schedule == "paci")
    for rank in range(stages):
        theirs = _views(tmp_path / f"procs/rank{rank}.pkl")
        (stage,) = theirs["views"][0]["lr"]
        assert _compare_views(one["views"], theirs["views"], grads=True, lr_pairs=[(stage, stage)]) == 0.0, rank
    # Windows of 4, less the partial window's missing micro-batch with epochs of 7.
    assert one["losses"] == _views(tmp_path / "procs/rank0.pkl")["losses"]
    assert len(one["losses"]) == 4 * steps - (epoch == 7)
    compiled, drift = {}, {}
    for rank in range(stages):
        theirs = _views(tmp_path / f"procs/rank{rank}.pkl")
        compiled.update(theirs["compiled"])
        drift.update(theirs["drift"])
    # Stage 0's stale forwards ran (on predicted weights) in both hostings where the epoch holds the windows, and
    # in compiled passes in both, or in neither.
    assert one["drift"][0] == drift[0] == (1 if schedule == "paci" and epoch == 16 else 0)
    assert one["compiled"][0] == compiled[0] == (correction == COMPILED)
    saved = [torch.load(tmp_path / d / "ckpt/step=2.ckpt", weights_only=False) for d in ("local", "procs")]
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "pipeline", "global_step", "loops"):
        _assert_same(saved[0][key], saved[1][key], key)
    if flush:
        # Epochs of whole windows: Lightning divides a partial window's gradient by N, not by its size (#19987).
        local = _fit(tmp_path / "local8", _model(arch, sgd=True), _pipeline(stages, schedule), 1, epoch=8)
        plain = _fit(tmp_path / "one", _model(arch, sgd=True), "auto", 1, epoch=8)
        assert max(_diff(local.state_dict()[k], v) for k, v in plain.state_dict().items()) <= 1e-5
        one, reference = _views(tmp_path / "local8/rank0.pkl"), _views(tmp_path / "one/rank0.pkl")
        lr_pairs = [(s, 0) for s in range(stages)]  # every stage's schedule is one device's
        assert _compare_views(one["views"], reference["views"], grads=False, lr_pairs=lr_pairs) <= 1e-5


@pytest.mark.multiproc
def test_tied_checkpoints_resume_in_one_process_as_on_processes(tmp_path):
    """GPT-2 (tied) resumed from a one-process checkpoint and from plain one-device Lightning's (no parameter names:
    each stage takes its share by the unsplit optimizer's order, the head's copy the table's state), in one process
    and on 2 processes: bit-identical."""

    def fit(strategy, devices, steps, ckpt_path=None, save=None):
        callbacks = [ModelCheckpoint(dirpath=tmp_path / save, save_last=True)] if save else []
        module = _model("gpt2", sgd=False)
        L.Trainer(
            accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, accumulate_grad_batches=4,
            limit_val_batches=0, callbacks=callbacks, enable_checkpointing=bool(save), logger=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        ).fit(module, datamodule=_data(), ckpt_path=ckpt_path)  # fmt: skip
        return module.state_dict()

    fit(_pipeline(2, "paci"), 1, 2, save="piped")
    fit("auto", 1, 2, save="one")
    for source in ("piped", "one"):
        path = tmp_path / source / "last.ckpt"
        local = fit(_pipeline(2, "paci"), 1, 3, ckpt_path=path)
        procs = fit(_pipeline(2, "paci"), 2, 3, ckpt_path=path)
        assert max(_diff(local[k], v) for k, v in procs.items()) == 0.0, source
