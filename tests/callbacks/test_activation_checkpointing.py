"""ActivationCheckpointing: exact gradients, saved-activation bytes, module choice, toggle, checkpoints, a real fit."""

from __future__ import annotations

import copy
import csv
import logging
import pickle
import sys
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lit_efficient.callbacks import ActivationCheckpointing, GradientAccumulation
from lit_efficient.callbacks.activation_checkpointing import METRIC_KEY, SavedActivationMeter, is_wrapped
from lit_efficient.data import TextDataModule
from lit_efficient.models import GPT

TINY = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32)


def tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(**{**TINY, **overrides})


def random_batch(batch_size: int = 4, seq_len: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (batch_size, seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def fake_trainer(**strategy_attrs) -> SimpleNamespace:
    # The hooks used here read only trainer.strategy and trainer.callbacks: a stub, free of Trainer setup.
    return SimpleNamespace(strategy=SimpleNamespace(**strategy_attrs), callbacks=[])


class Placeholder(nn.Module):
    """Stands in for another pipeline stage's layer: no parameters, a different class."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(every_n=0), "every_n=0"),
        (dict(every_n=1.5), "every_n=1.5"),
        (dict(mode="partial"), "mode='partial'.*'full' or 'selective'"),
        (dict(modules=[]), r"modules=\[\].*modules=None"),
        (dict(modules="Block"), r"modules=\['Block'\]"),
        (dict(modules=3), r"modules=3\) must be a list of class names"),  # a TypeError from list()
        (dict(enabled="false"), r"enabled='false'\) must be True or False"),  # a truthy string: checkpointing on
    ],
)
def test_bad_arguments_raise_with_the_value_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ActivationCheckpointing(**kwargs)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gradients_match_without_checkpointing_with_dropout_on(mode):
    batch = random_batch()
    grads = []
    for wrap in (False, True):
        model = tiny_gpt(dropout=0.1).train()
        if wrap:
            assert ActivationCheckpointing(mode=mode).wrap(model) == ["blocks.0", "blocks.1"]
        torch.manual_seed(123)  # the same dropout masks in forward; recompute must reproduce them
        loss, _ = model.pipeline_loss(model(batch[0]), batch)
        loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        # Recompute replays the same ops on the same inputs with the same RNG: bitwise equal on CPU.
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=0, msg=name)


class _NormedBlock(nn.Module):
    """A user's block: BatchNorm (running statistics) and dropout, called with a keyword, returning a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.drop = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.3)

    def forward(self, x, scale=None):
        h = self.drop(torch.relu(self.bn(self.lin(x)))) * scale
        return x + h, h.sum()


class _Normed(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_NormedBlock() for _ in range(3))
        self.head, self.scale = nn.Linear(8, 1), nn.Parameter(torch.ones(8))

    def training_step(self, batch, batch_idx):
        x, y = batch
        aux = 0.0
        for block in self.blocks:
            x, a = block(x, scale=self.scale)
            aux = aux + a
        return ((self.head(x).squeeze(-1) - y) ** 2).mean() + 1e-3 * aux

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _NormedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        return x + torch.relu(self.bn(self.lin(x)))


class _NormedPipeline(LightningModule):
    """The pipeline protocol's form of a BatchNorm model: every layer but the head keeps running statistics."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_NormedLayer() for _ in range(4))
        self.head = nn.Linear(8, 1)

    def pipeline_layers(self):
        return [*self.blocks, self.head]

    def pipeline_input(self, batch):
        return batch[0]

    def pipeline_loss(self, output, batch):
        return ((output.squeeze(-1) - batch[1]) ** 2).mean()

    def training_step(self, batch, batch_idx):
        x = self.pipeline_input(batch)
        for layer in self.pipeline_layers():
            x = layer(x)
        return self.pipeline_loss(x, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fitted_state(make, **setup) -> dict[str, torch.Tensor]:
    """The state after one epoch of 8 batches, 2 per optimizer step, of ``make()``'s model."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, generator=g))
    torch.manual_seed(1)
    model = make()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **setup,
    )  # fmt: skip
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    return model.state_dict()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_batchnorm_statistics_are_updated_once_per_forward(mode):
    """The recompute at backward ran BatchNorm in training mode again: its running statistics moved twice per step
    (0.25 in a running mean after 8 batches) and its batch count counted 16 for 8. A fit of a user's model on plain
    Lightning ends with the state (weights, statistics, counts) of the same fit without checkpointing."""
    want = _fitted_state(_Normed, accumulate_grad_batches=2)
    got = _fitted_state(_Normed, accumulate_grad_batches=2, callbacks=[ActivationCheckpointing(mode=mode)])
    assert int(got["blocks.0.bn.num_batches_tracked"]) == 8
    for name, value in want.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_batchnorm_statistics_are_updated_once_per_forward_in_the_pipeline(mode):
    """The same through the pipeline's stages (3 in one process, flush): the wrapped blocks' recompute at each stage's
    backward leaves the statistics alone, and the fit ends with plain Lightning's state, bit for bit."""
    from lit_efficient import PACIStrategy

    want = _fitted_state(_NormedPipeline, accumulate_grad_batches=2)
    got = _fitted_state(
        _NormedPipeline, strategy=PACIStrategy(pipeline_stages=3, schedule="1f1b_flush"),
        callbacks=[GradientAccumulation(2), ActivationCheckpointing(mode=mode)],
    )  # fmt: skip
    assert int(got["blocks.0.bn.num_batches_tracked"]) == 8
    for name, value in want.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_saved_activation_bytes_of_the_blocks_none_over_selective_over_full(dropout):
    saved = {}
    for mode in ("none", "selective", "full"):
        model = tiny_gpt(n_layer=4, dropout=dropout).train()
        if mode != "none":
            ActivationCheckpointing(mode=mode).wrap(model)
        hidden = model.embed(random_batch()[0]).detach().requires_grad_()
        with SavedActivationMeter(exclude=[model]) as meter:
            for block in model.blocks:
                hidden = block(hidden)
        saved[mode] = meter.bytes
        hidden.sum().backward()  # the recorded graph is usable
    assert saved["full"] <= 0.5 * saved["none"], saved
    assert saved["none"] > saved["selective"] > saved["full"], saved
    # Full mode keeps exactly each block's fp32 input: 4 blocks x (4 x 32 x 32) floats.
    assert saved["full"] == 4 * 4 * 32 * 32 * 4


def test_state_dict_keys_unchanged_and_a_wrapped_models_state_loads_into_a_plain_one():
    plain, wrapped = tiny_gpt(), tiny_gpt(n_layer=2)
    ActivationCheckpointing().wrap(wrapped)
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    with torch.no_grad():
        for p in wrapped.parameters():
            p.add_(1.0)
    plain.load_state_dict(wrapped.state_dict(), strict=True)
    torch.testing.assert_close(plain.state_dict(), wrapped.state_dict())


def test_copies_of_a_wrapped_model_run_their_own_weights():
    model = tiny_gpt()
    ActivationCheckpointing().wrap(model)
    clone = copy.deepcopy(model)
    assert is_wrapped(clone.blocks[0]) and clone.blocks[0].forward.__self__ is clone.blocks[0]
    with torch.no_grad():
        clone.blocks[0].mlp.c_proj.bias.add_(1.0)
    x = torch.randn(1, 8, 32)
    assert not torch.allclose(clone.blocks[0](x), model.blocks[0](x))
    # A pickled wrapped model loads unwrapped (and computes the same).
    restored = pickle.loads(pickle.dumps(model))
    assert not is_wrapped(restored.blocks[0])
    torch.testing.assert_close(restored.blocks[0](x), model.blocks[0](x))


def test_auto_detection_every_n_named_classes_and_nesting():
    model = tiny_gpt(n_layer=4)
    names = lambda cb: [n for n, _ in cb.select(model)]  # noqa: E731
    assert names(ActivationCheckpointing()) == [f"blocks.{i}" for i in range(4)]
    assert names(ActivationCheckpointing(every_n=2)) == ["blocks.1", "blocks.3"]
    assert names(ActivationCheckpointing(modules=["lit_efficient.models.gpt.MLP"])) == [
        f"blocks.{i}.mlp" for i in range(4)
    ]
    # The MLPs live inside the Blocks: checkpointing them again inside a checkpoint is skipped.
    assert names(ActivationCheckpointing(modules=["MLP", "Block"])) == [f"blocks.{i}" for i in range(4)]
    # A dotted path as a user writes it, through a re-export (torch.nn.LayerNorm is defined in
    # torch.nn.modules.normalization): matched nothing, refused (a callback audit).
    assert names(ActivationCheckpointing(modules=["torch.nn.LayerNorm"])) == [
        n for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)
    ]
    assert names(ActivationCheckpointing(modules=["lit_efficient.models.Block"])) == [f"blocks.{i}" for i in range(4)]
    sys.modules.pop("this", None)  # never imported: an import runs a module (`this` prints the Zen of Python)
    assert names(ActivationCheckpointing(modules=["Block", "this.Block"])) == [f"blocks.{i}" for i in range(4)]
    assert "this" not in sys.modules
    # A pipeline stage: other stages' blocks are parameter-free placeholders and never picked.
    model.blocks[0], model.blocks[1] = Placeholder(), Placeholder()
    assert names(ActivationCheckpointing()) == ["blocks.2", "blocks.3"]


def test_pipeline_rank_wraps_its_share_of_the_plan_made_on_the_whole_model():
    model, trainer = tiny_gpt(n_layer=4), fake_trainer()
    cb = ActivationCheckpointing(every_n=2)
    cb.setup(trainer, model, "fit")  # Lightning: callback setup runs before strategy.setup (the split)
    model.blocks[0], model.blocks[1] = Placeholder(), Placeholder()  # this rank is stage 1
    cb.on_fit_start(trainer, model)
    assert cb.wrapped_modules == [model.blocks[3]]  # global every_n: blocks 1 and 3, only 3 is local
    cb.teardown(trainer, model, "fit")
    assert not any(is_wrapped(m) for m in model.modules())


class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)


class _Attention(_Mixer):
    pass


class _Hybrid(LightningModule):
    """A hybrid model's layer list (Jamba's: Mamba layers with attention layers between them)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Mixer(), _Attention(), _Mixer(), _Attention()])


def test_setup_names_what_it_wraps_and_the_blocks_of_another_class_it_leaves_beside_them(caplog):
    """On a hybrid model the repeated-block rule wrapped the two Mamba-like layers and silently left the attention
    layers between them as they were."""
    trainer = fake_trainer()
    with caplog.at_level(logging.INFO):
        ActivationCheckpointing().setup(trainer, _Hybrid(), "fit")
        ActivationCheckpointing(modules=["_Mixer", "_Attention"], mode="selective").setup(trainer, _Hybrid(), "fit")
        ActivationCheckpointing().setup(trainer, tiny_gpt(n_layer=4), "fit")
        flat = nn.Sequential(nn.Embedding(8, 8), nn.LayerNorm(8), _Mixer(), _Attention(), _Mixer(), nn.LayerNorm(8),
                             nn.Linear(8, 8))  # fmt: skip
        ActivationCheckpointing().setup(trainer, flat, "fit")  # before the first and after the last: not beside
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ActivationCheckpointing:")]
    assert said == [
        "ActivationCheckpointing: full recomputation of 2 blocks (_Mixer x2; layers.0, ...); beside them, not "
        "wrapped: _Attention x2 (name every class to wrap in modules=[...])",
        "ActivationCheckpointing: selective recomputation of 4 blocks (_Mixer x2, _Attention x2; layers.0, ...)",
        "ActivationCheckpointing: full recomputation of 4 blocks (Block x4; blocks.0, ...)",
        "ActivationCheckpointing: full recomputation of 2 blocks (_Mixer x2; 2, ...); beside them, not wrapped: "
        "_Attention x1 (name every class to wrap in modules=[...])",
    ]


def test_unknown_module_names_raise_listing_the_candidates():
    model, trainer = tiny_gpt(), fake_trainer()
    cb = ActivationCheckpointing(modules=["Blok"])
    cb.setup(trainer, model, "fit")
    with pytest.raises(ValueError, match=r"modules=\['Blok'\]\) matches no module of GPT.*Block \(x2\)"):
        cb.on_fit_start(trainer, model)


def test_a_misspelt_name_beside_a_match_and_an_every_n_past_the_matches_are_refused_at_setup():
    """Both used to pass: ["Block", "Blok"] wrapped the Blocks and dropped "Blok" silently; every_n=5 over 4 blocks
    checkpointed nothing and the error then said the name matched no module, which was false."""
    model, trainer = tiny_gpt(n_layer=4), fake_trainer()
    with pytest.raises(ValueError, match=r"'Blok' matches no module of GPT; did you mean 'Block'\?"):
        ActivationCheckpointing(modules=["Block", "Blok"]).setup(trainer, model, "fit")
    # A misspelt dotted path as imported, by its class name: the whole string is close to no class's own path, so
    # it was let be as another architecture's (the re-read).
    with pytest.raises(ValueError, match=r"'torch.nn.LayerNrom' matches no module of GPT; did you mean 'LayerNorm'\?"):
        ActivationCheckpointing(modules=["Block", "torch.nn.LayerNrom"]).setup(trainer, model, "fit")
    for modules in (["Block"], None):  # named, and found as the repeated blocks
        with pytest.raises(ValueError, match=r"every_n=5\) is past the 4 matching modules.*every_n <= 4"):
            ActivationCheckpointing(modules=modules, every_n=5).setup(trainer, model, "fit")
    ActivationCheckpointing(modules=["Block"], every_n=4).setup(trainer, model, "fit")  # the 4th: one block
    # another architecture's class in a list shared by configs of several models is no misspelling
    ActivationCheckpointing(modules=["Block", "LlamaDecoderLayer"]).setup(trainer, model, "fit")


@pytest.mark.parametrize(
    ("callback", "strategy", "said"),
    [
        (dict(modules=["Blok"]), {}, r"modules=\['Blok'\]\) matches no module of GPT; .*Block \(x2\)"),
        (dict(modules=["Block", "Blok"]), {}, r"'Blok' matches no module of GPT; did you mean 'Block'\?"),
        (dict(every_n=10), {}, r"every_n=10\) is past the 2 matching modules"),
        ({}, dict(recompute=True), r"cannot be combined with PACIStrategy\(recompute=True\)"),
    ],
)
def test_a_plan_that_cannot_work_is_refused_before_any_rank_starts(tmp_path, monkeypatch, callback, strategy, said):
    """On processes these were refused after the launch, in every rank's traceback, each rank listing only its own
    stage's classes (a user audit); now in the launching process, on the whole model, before it starts rank 1."""
    from lightning.pytorch.strategies.launchers import subprocess_script

    from lit_efficient import PACIStrategy

    def no_rank(*args, **kwargs):
        raise AssertionError("rank 1 was started before the refusal")

    monkeypatch.setattr(subprocess_script.subprocess, "Popen", no_rank)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=PACIStrategy(pipeline_stages=2, **strategy), max_steps=1,
        logger=False, enable_progress_bar=False, callbacks=[ActivationCheckpointing(**callback)],
        default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(ValueError, match=said):
        trainer.fit(tiny_gpt(), datamodule=TextDataModule(block_size=16, batch_size=2, max_bytes=4000))


def test_an_evaluation_is_not_refused_for_a_plan_only_fit_uses(tmp_path):
    """The callback acts in fit alone: the pre-launch check refused validate with recompute=True beside it (a
    review), which ran before it."""
    from lit_efficient import PACIStrategy

    for callback, strategy in ((dict(every_n=10), {}), ({}, dict(recompute=True))):
        trainer = Trainer(
            accelerator="cpu", devices=1, strategy=PACIStrategy(pipeline_stages=2, **strategy), logger=False,
            enable_progress_bar=False, callbacks=[ActivationCheckpointing(**callback)], limit_val_batches=1,
            default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.validate(tiny_gpt(), datamodule=TextDataModule(block_size=16, batch_size=2, max_bytes=4000))


def test_refuses_a_strategy_that_already_recomputes():
    with pytest.raises(ValueError, match=r"recompute=True.*recompute=False.*remove ActivationCheckpointing"):
        ActivationCheckpointing().setup(fake_trainer(recompute=True), tiny_gpt(), "fit")
    ActivationCheckpointing().setup(fake_trainer(recompute=False), tiny_gpt(), "fit")  # fine


class Toggler(Callback):
    """Records the measured bytes and the flag per batch; toggles the callback between steps."""

    def __init__(self, ac: ActivationCheckpointing, plan: dict[int, str]) -> None:
        self.ac, self.plan = ac, plan
        self.saved: list[int | None] = []
        self.wrapped_during_fit = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.saved.append(self.ac.saved_bytes)
        self.wrapped_during_fit = all(is_wrapped(b) for b in pl_module.blocks)
        action = self.plan.get(len(self.saved) - 1)
        if action is not None:
            getattr(self.ac, action)()


def _trainer(tmp_path, callbacks, max_steps: int, **kw) -> Trainer:
    return Trainer(
        **kw,
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        limit_val_batches=0,
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path, name="logs"),
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_real_fit_toggle_mid_run_logged_bytes_and_flag_survives_resume(tmp_path):
    data = TextDataModule(block_size=32, batch_size=4, max_bytes=200_000, vocab_size=256)
    ac = ActivationCheckpointing()
    # After batch 1 off, after batch 2 on, after batch 3 off: the checkpoint holds enabled=False.
    toggler = Toggler(ac, {1: "disable", 2: "enable", 3: "disable"})
    model = tiny_gpt(dropout=0.1, warmup_steps=1)
    trainer = _trainer(tmp_path, [ac, toggler], max_steps=4)
    trainer.fit(model, datamodule=data)
    on, off = toggler.saved[0], toggler.saved[2]
    assert toggler.saved == [on, on, off, on] and off > on, toggler.saved
    assert toggler.wrapped_during_fit and not any(is_wrapped(b) for b in model.blocks)  # teardown unwraps

    with open(trainer.logger.log_dir + "/metrics.csv") as f:
        logged = [float(row[METRIC_KEY]) for row in csv.DictReader(f) if row.get(METRIC_KEY)]
    assert logged == [float(b) for b in toggler.saved]

    ckpt = str(tmp_path / "last.ckpt")
    trainer.save_checkpoint(ckpt)
    assert not ac.enabled
    # Written with the callback, it loads into a model that never saw it.
    assert list(GPT.load_from_checkpoint(ckpt).state_dict()) == list(tiny_gpt().state_dict())

    resumed_ac = ActivationCheckpointing(enabled=True)
    resumed = Toggler(resumed_ac, {})
    _trainer(tmp_path, [resumed_ac, resumed], max_steps=5).fit(tiny_gpt(dropout=0.1), datamodule=data, ckpt_path=ckpt)
    assert not resumed_ac.enabled
    assert resumed.saved == [off]


@pytest.mark.parametrize(
    "every, logged, pipeline",
    [(1, [0, 1, 2, 3, 4, 5], False), (2, [1, 3, 5], False), (3, [2, 5], False), (2, [1, 3, 5], True)],
)
def test_saved_bytes_are_logged_once_per_window_on_the_train_losss_step(tmp_path, every, logged, pipeline):
    """With N micro-batches per step they were logged at every micro-batch (N rows per step with
    log_every_n_steps=1), a window's last at the next window's step, and on steps Lightning logs nothing. One device,
    and the pipeline in one process (by hand: on 2 processes, PACI and flush, the same steps)."""
    from lit_efficient import PACIStrategy

    data = TextDataModule(block_size=32, batch_size=4, max_bytes=200_000, vocab_size=256)
    callbacks = [ActivationCheckpointing(), GradientAccumulation(steps=2)]
    strategy = {"strategy": PACIStrategy(pipeline_stages=2)} if pipeline else {}
    trainer = _trainer(tmp_path, callbacks, max_steps=6, **strategy)
    trainer.log_every_n_steps = every
    trainer.fit(tiny_gpt(warmup_steps=1), datamodule=data)
    with open(trainer.logger.log_dir + "/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    losses = [int(row["step"]) for row in rows if row.get("train_loss")]
    assert [int(row["step"]) for row in rows if row.get(METRIC_KEY)] == losses == logged


# -- selective mode and random numbers drawn inside a kept op (fused attention's dropout on CUDA) -------

_DROPOUT_OPS = [
    name
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    if hasattr(torch.ops.aten, name)
]


@pytest.mark.parametrize("name", _DROPOUT_OPS)
def test_selective_recomputes_fused_attention_that_draws_a_dropout_mask(name):
    """The CUDA attention kernels draw their dropout mask inside (Philox offsets of the device's stream).
    Kept, such a call is skipped at recompute, so every random op after it in the block draws at other
    offsets than in forward: other dropout masks, wrong gradients. Kept only without dropout."""
    from torch.utils.checkpoint import CheckpointPolicy

    from lit_efficient.callbacks.activation_checkpointing import SELECTIVE_SAVE_OPS, _selective_policy

    op = getattr(torch.ops.aten, name).default
    assert op in SELECTIVE_SAVE_OPS
    schema = op._schema.arguments
    position = next(i for i, a in enumerate(schema) if a.name == "dropout_p")
    q = torch.empty(1, 2, 8, 4, device="meta")
    stand_ins = {"query": q, "key": q, "value": q, "compute_log_sumexp": True}  # attn_bias: None
    args = [stand_ins.get(a.name) for a in schema[:position]]
    ctx = SimpleNamespace(is_recompute=False, op_output=None)
    for is_recompute in (False, True):
        ctx.is_recompute = is_recompute
        assert _selective_policy(ctx, op, *args, 0.1) == CheckpointPolicy.PREFER_RECOMPUTE
        assert _selective_policy(ctx, op, *args, 0.0) == CheckpointPolicy.MUST_SAVE
        assert _selective_policy(ctx, op, *args) == CheckpointPolicy.MUST_SAVE  # the default: no dropout
        assert _selective_policy(ctx, op, *args, dropout_p=0.1) == CheckpointPolicy.PREFER_RECOMPUTE


# A CPU stand-in for fused attention with dropout (which CPU kernels refuse: they decompose it instead):
# one op that draws its dropout mask inside, from the process's stream, as the CUDA kernels do.
@torch.library.custom_op(
    "lit_efficient_test::fused_mm_dropout", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def _fused_mm_dropout(x: torch.Tensor, w: torch.Tensor, dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    mask = (torch.rand(x.shape[0], w.shape[1]) >= dropout_p).to(x.dtype) / (1 - dropout_p)
    return (x @ w) * mask, mask


@_fused_mm_dropout.register_fake
def _(x, w, dropout_p):
    return x.new_empty(x.shape[0], w.shape[1]), x.new_empty(x.shape[0], w.shape[1])


def _fused_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], output[1])


def _fused_backward(ctx, grad, _grad_mask):
    x, w, mask = ctx.saved_tensors
    g = grad * mask
    return g @ w.t(), x.t() @ g, None


_fused_mm_dropout.register_autograd(_fused_backward, setup_context=_fused_setup)


class FusedBlock(nn.Module):
    """attention-like fused op with dropout, then the block's other random op (residual dropout)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 8) / 3)
        self.w2 = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = _fused_mm_dropout(x, self.w1, 0.3)
        y = torch.nn.functional.dropout(torch.nn.functional.gelu(y), 0.3)
        return x + y @ self.w2


def test_selective_gradients_exact_when_a_kept_op_draws_random_numbers(monkeypatch):
    """With a kept op that draws random numbers (fused attention with dropout, as on CUDA), the masks
    drawn after it at recompute must be the forward's: gradients equal those without checkpointing."""
    from lit_efficient.callbacks import activation_checkpointing as ac_module

    op = torch.ops.lit_efficient_test.fused_mm_dropout.default
    monkeypatch.setattr(ac_module, "SELECTIVE_SAVE_OPS", ac_module.SELECTIVE_SAVE_OPS | {op})
    x = torch.randn(4, 8)
    grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(FusedBlock(), FusedBlock())
        if wrap:
            assert ActivationCheckpointing(mode="selective").wrap(model) == ["0", "1"]
        torch.manual_seed(123)
        model(x).pow(2).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=0, msg=name)
