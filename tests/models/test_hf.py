"""HFCausalLM: stock transformers models (random init from configs, no download) pipelined with no glue.

Unit tests check the adapter in one process (parts, side inputs, losses, refusals); the multiproc tests
run the real Trainer with a user's default arguments (spawned ranks, gloo) against one device.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lit_efficient import GradientAccumulation, PACIStrategy
from lit_efficient.data import TextDataModule
from lit_efficient.models import GPT, HFCausalLM
from lit_efficient.runtime.split import check_stage_parameters, layer_parameter_counts
from lit_efficient.runtime.stage import run_layers
from tests.support.multiproc import SpawnedDDP, spawn, values

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tests.support.hf_runs import SGDLM  # noqa: E402

BLOCK = 32
VOCAB = 256  # TextDataModule's bytes


def gpt2(**kw) -> GPT2LMHeadModel:
    L.seed_everything(0)
    args = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=BLOCK, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    args.update(kw)
    return GPT2LMHeadModel(GPT2Config(**args))


def llama(layers: int = 2, **kw) -> LlamaForCausalLM:
    L.seed_everything(0)
    args = dict(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=BLOCK, bos_token_id=0,
                eos_token_id=0, pad_token_id=0)  # fmt: skip
    args.update(kw)
    return LlamaForCausalLM(LlamaConfig(**args))


def qwen2(**kw) -> Qwen2ForCausalLM:
    L.seed_everything(0)
    args = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=BLOCK, tie_word_embeddings=True,
                bos_token_id=0, eos_token_id=0)  # fmt: skip
    args.update(kw)
    return Qwen2ForCausalLM(Qwen2Config(**args))


def _batch(b: int = 2, t: int = 8, pad: int = 2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (b, t), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, t - pad :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


# ----------------------------------------------------------------------------- one process


@pytest.mark.parametrize("make", [gpt2, llama, qwen2], ids=["gpt2", "llama", "qwen2"])
def test_parts_in_a_chain_give_the_models_logits_and_loss(make):
    module = HFCausalLM(make())
    batch = _batch()
    layers = module.pipeline_layers()
    assert len(layers) == 2 + module.model.config.num_hidden_layers
    out = run_layers(layers, module.pipeline_input(batch))
    want = module.model(**batch)
    assert torch.equal(out[0], want.logits)
    loss, count = module.pipeline_loss(out[0], batch)
    assert loss.item() == pytest.approx(want.loss.item(), rel=1e-6)
    assert count.item() == int((batch["labels"][:, 1:] != -100).sum())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_only_the_hidden_states_cross_a_boundary_with_a_gradient(attn):
    module = HFCausalLM(llama(attn_implementation=attn))
    layers = module.pipeline_layers()
    boundary = run_layers(layers[:2], module.pipeline_input(_batch()))
    assert boundary[0].requires_grad
    side = [t for t in boundary[1:] if t is not None]
    assert side and not any(t.requires_grad for t in side)  # rotary cos/sin, position ids, masks


def test_a_micro_batch_of_padding_only_has_loss_zero_not_nan():
    """Every label -100 (a user's padded data cut into micro-batches): torch's mean was 0/0, NaN, which the
    pipeline's non-finite check refuses; 0 with no gradient, as GPT's."""
    module = HFCausalLM(llama())
    batch = _batch()
    batch["labels"] = torch.full_like(batch["labels"], -100)
    logits = module(module.pipeline_input(batch)).detach().requires_grad_()
    loss, count = module.pipeline_loss(logits, batch)
    loss.backward()
    assert loss.item() == 0.0 and count.item() == 0 and not logits.grad.any()


def test_tuple_batches_use_their_targets_and_ignore_negative_ones():
    module = HFCausalLM(gpt2())
    x = torch.randint(0, VOCAB, (2, 8))
    y = torch.randint(0, VOCAB, (2, 8))
    y[1, -3:] = -1
    logits = module(module.pipeline_input((x, y)))
    loss, count = module.pipeline_loss(logits, (x, y))
    keep = y.reshape(-1) >= 0
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB)[keep], y.reshape(-1)[keep])
    assert count.item() == 13 and loss.item() == pytest.approx(want.item(), rel=1e-6)


def test_constructible_from_plain_values_and_saved_models(tmp_path):
    module = HFCausalLM({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32,
                         "num_attention_heads": 2}, vocab_size=VOCAB)  # fmt: skip
    assert type(module.model).__name__ == "LlamaForCausalLM" and module.model.config.vocab_size == VOCAB
    assert module.hparams.model["model_type"] == "llama"
    module.model.save_pretrained(tmp_path)
    again = HFCausalLM(str(tmp_path))
    ids = torch.randint(0, VOCAB, (1, 6))
    assert torch.equal(again(ids), module(ids))
    with pytest.raises(ValueError, match="never downloads"):
        HFCausalLM("gpt2")
    with pytest.raises(ValueError, match="model_type"):
        HFCausalLM({"hidden_size": 16})


def test_a_saved_model_loads_to_train_with_its_dropout_on(tmp_path):
    """``from_pretrained`` returns a model in eval mode; Lightning keeps each submodule's mode as it finds it, so a
    pretrained folder trained with dropout off, silently, while Lightning warned of modules in eval mode."""
    gpt2(resid_pdrop=0.5, embd_pdrop=0.5).save_pretrained(tmp_path)
    module = HFCausalLM(str(tmp_path))
    assert all(m.training for m in module.modules())
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    modes = []

    class Modes(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            modes.append(all(m.training for m in pl_module.modules()))

    trainer.callbacks.append(Modes())
    trainer.fit(module, datamodule=_data())
    assert modes == [True]
    ids = torch.randint(0, VOCAB, (1, 6))
    assert not torch.equal(module(ids), module(ids))  # dropout draws a new mask each call


def test_fits_with_a_logger_beside_a_datamodule_without_the_data_sizes(tmp_path):
    """The Python API's pair: HFCausalLM(model) and TextDataModule(block_size=...), with a logger (the default's
    hparams merge). The model's unset vocab_size/block_size (None) clashed with the data's values ("block_size
    present in both ... different values") before any batch ran."""
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, enable_progress_bar=False,
                        enable_checkpointing=False, logger=L.pytorch.loggers.CSVLogger(str(tmp_path)))  # fmt: skip
    trainer.fit(HFCausalLM(llama()), datamodule=TextDataModule(block_size=16, batch_size=2, max_bytes=20_000))
    assert trainer.global_step == 1
    assert HFCausalLM(llama(), block_size=16).hparams.block_size == 16  # given sizes are still saved


def test_architecture_it_cannot_split_is_named():
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, vocab_size=64))
    with pytest.raises(ValueError, match="decoder-only"):
        HFCausalLM(t5)
    model = llama()
    model.model.extra = nn.Linear(4, 4)  # weights the forward never calls: the first stage holds them
    layers = HFCausalLM(model).pipeline_layers()
    assert layers[0].extra is model.model.extra and type(layers[-1]).__name__ == "HFHead"
    assert [n for n, _ in layers[-1].named_children()] == ["final_norm", "lm_head"]


def test_layers_registered_twice_are_refused_naming_the_fix():
    class Wrapped(L.LightningModule):  # the natural first attempt: keep the model, wrap its layers
        def __init__(self):
            super().__init__()
            self.model = llama()
            self.blocks = nn.ModuleList(nn.Sequential(layer) for layer in self.model.model.layers)

        def pipeline_layers(self):
            return [self.model.model.embed_tokens, *self.blocks, self.model.lm_head]

    module = Wrapped()
    with pytest.raises(ValueError, match="registered twice.*HFCausalLM"):
        layer_parameter_counts(module, module.pipeline_layers())


def test_a_stateless_module_shared_by_layers_is_accepted():
    """openai-gpt's blocks share one activation object: nothing to copy or train, so no refusal."""
    act = nn.GELU()

    class Shared(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), act) for _ in range(3))

        def pipeline_layers(self):
            return list(self.layers)

    module = Shared()
    assert layer_parameter_counts(module, module.pipeline_layers()) == [20, 20, 20]


def test_a_stage_without_parameters_is_refused_before_training():
    check_stage_parameters([10, 0, 5], [1, 2])
    with pytest.raises(ValueError, match="stage 1 would hold pipeline layers 2..3, which have no parameters"):
        check_stage_parameters([10, 5, 0, 0], [2, 2])


def test_embedding_rows_and_a_tied_head_are_not_decayed():
    module = HFCausalLM(gpt2(), max_steps=10)
    groups = module.configure_optimizers()["optimizer"].param_groups
    no_decay = {id(p) for g in groups if g["weight_decay"] == 0 for p in g["params"]}
    assert id(module.model.lm_head.weight) in no_decay and id(module.model.transformer.wte.weight) in no_decay
    assert "model.lm_head.weight" in module._no_decay  # by name: what the last stage alone sees


# ----------------------------------------------------------------------------- Trainer, several processes


def _data() -> TextDataModule:
    return TextDataModule(block_size=BLOCK, batch_size=4, max_bytes=60_000, seed=1)


def _trainer(strategy, devices: int, max_steps: int, **kw) -> L.Trainer:
    args = dict(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, accumulate_grad_batches=4,
                logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                limit_val_batches=0)  # fmt: skip
    args.update(kw)
    return L.Trainer(**args)


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


TIED_NAMES = ("model.transformer.wte.weight", "model.lm_head.weight")


class DumpTiedCopies(PACIStrategy):
    """Each rank writes its copy of the tied weight once the pipeline is drained at the end of training
    (a callback's on_train_end runs before the strategy drains; its teardown after rank 0 re-gathered)."""

    def __init__(self, path: Path, **kw) -> None:
        super().__init__(start_method="forkserver", **kw)
        self.path = path

    def on_train_end(self) -> None:
        super().on_train_end()
        mine = {n: p.detach().clone() for n, p in self.lightning_module.named_parameters() if n in TIED_NAMES}
        torch.save(mine, self.path / f"copy{self.global_rank}.pt")

    def copies(self) -> list[dict[str, torch.Tensor]]:
        return [torch.load(self.path / f"copy{r}.pt") for r in range(self.pipeline_stages)]


class RecordRanks(Callback):
    """Rank 0 writes the losses it saw (it holds the last stage) and whether, after the strategy gathered the
    model, the head and the embedding are one parameter again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs is not None and "loss" in outputs:
            self.losses.append(float(outputs["loss"]))

    def teardown(self, trainer, pl_module, stage) -> None:
        if trainer.global_rank == 0:
            model = pl_module.model
            tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
            (self.path / "rank0.json").write_text(json.dumps({"tied": tied, "losses": self.losses}))


@pytest.mark.multiproc
def test_stock_gpt2_tied_flush_equals_single_device_and_reloads(tmp_path):
    single, piped = SGDLM(gpt2()), SGDLM(gpt2())
    start = {k: v.clone() for k, v in single.state_dict().items()}
    _trainer("auto", 1, 3).fit(single, datamodule=_data())
    strategy = DumpTiedCopies(tmp_path, pipeline_stages=2, schedule="1f1b_flush")
    _trainer(strategy, 2, 3, callbacks=[RecordRanks(tmp_path)]).fit(piped, datamodule=_data())
    assert max((single.state_dict()[k] - v).abs().max().item() for k, v in start.items()) > 1e-3
    assert _max_diff(piped, single) <= 1e-5
    # The two stages' copies of the tied weight are identical, and one parameter again on rank 0.
    last, first = strategy.copies()  # rank 0 holds the last stage
    assert torch.equal(first["model.transformer.wte.weight"], last["model.lm_head.weight"])
    assert json.loads((tmp_path / "rank0.json").read_text())["tied"]
    # save_pretrained after the pipelined fit reloads to identical logits.
    piped.model.save_pretrained(tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, VOCAB, (2, 16))
    assert torch.equal(reloaded(ids).logits, piped.model(ids).logits)


@pytest.mark.multiproc
@pytest.mark.parametrize(("make", "stages"), [(lambda: llama(layers=2), 4), (qwen2, 2)], ids=["llama-gqa", "qwen2"])
def test_stock_models_flush_equal_single_device(make, stages):
    single, piped = SGDLM(make()), SGDLM(make())
    _trainer("auto", 1, 3).fit(single, datamodule=_data())
    strategy = PACIStrategy(pipeline_stages=stages, schedule="1f1b_flush", start_method="forkserver")
    _trainer(strategy, stages, 3).fit(piped, datamodule=_data())
    assert _max_diff(piped, single) <= 1e-5


class TrailingReshapes(GPT):
    """GPT followed by two parameter-free layers (reshapes, say), which a split can leave alone on a stage."""

    def __init__(self) -> None:
        super().__init__(n_layer=1, n_head=2, n_embd=32, block_size=BLOCK, max_steps=4)
        self.reshape = nn.ModuleList([nn.Identity(), nn.Identity()])

    def pipeline_layers(self):
        return [*super().pipeline_layers(), *self.reshape]


@pytest.mark.multiproc
def test_parameterless_stage_fails_on_every_rank_before_training():
    strategy = PACIStrategy(pipeline_stages=2, balance=[3, 2], start_method="forkserver")
    with pytest.raises(Exception, match="stage 1 would hold pipeline layers 3..4, which have no parameters"):
        _trainer(strategy, 2, 2).fit(TrailingReshapes(), datamodule=_data())


@pytest.mark.multiproc
def test_stock_gpt2_tied_paci_trains_and_keeps_the_copies_equal(tmp_path):
    module = HFCausalLM(gpt2(), learning_rate=3e-3, warmup_steps=2, max_steps=30)
    strategy = DumpTiedCopies(tmp_path, pipeline_stages=2, schedule="paci")
    _trainer(strategy, 2, 30, callbacks=[RecordRanks(tmp_path)]).fit(module, datamodule=_data())
    last, first = strategy.copies()
    assert torch.equal(first["model.transformer.wte.weight"], last["model.lm_head.weight"])
    losses = json.loads((tmp_path / "rank0.json").read_text())["losses"]
    assert len(losses) == 120
    first, last = sum(losses[:16]) / 16, sum(losses[-16:]) / 16
    assert last < first - 0.5, (first, last)


class PaddedDicts(L.LightningDataModule):
    """HF-style dict batches whose rows are right-padded to different lengths (so micro-batches hold
    different token counts): what token-weighted accumulation must get exactly right."""

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(3)
        rows = []
        for _ in range(48):
            ids = torch.randint(1, VOCAB, (16,), generator=gen)
            keep = int(torch.randint(4, 17, (1,), generator=gen))
            mask = (torch.arange(16) < keep).long()
            rows.append({"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
                         "labels": ids.masked_fill(mask == 0, -100)})  # fmt: skip
        return torch.utils.data.DataLoader(rows, batch_size=4)


@pytest.mark.multiproc
def test_padded_dict_batches_token_weighted_flush_equals_single_device():
    def run(strategy, devices):
        module = SGDLM(llama())
        trainer = _trainer(strategy, devices, 3, accumulate_grad_batches=1,
                           callbacks=[GradientAccumulation(steps=4, normalize="tokens")])  # fmt: skip
        trainer.fit(module, datamodule=PaddedDicts())
        return module

    single = run("auto", 1)
    piped = run(PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", start_method="forkserver"), 2)
    assert _max_diff(piped, single) <= 1e-5


@pytest.mark.multiproc
def test_trains_under_ddp_through_training_step():
    module = HFCausalLM(gpt2(), warmup_steps=1, max_steps=2)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = _trainer(SpawnedDDP(), 2, 2)
    trainer.fit(module, datamodule=_data())
    assert max((module.state_dict()[k] - v).abs().max().item() for k, v in before.items()) > 1e-4
    assert torch.isfinite(trainer.callback_metrics["train_loss"])


def _fit_then_evaluate(rank: int, world: int, root: str) -> dict:
    """A user's script on every rank: fit, then validate, test, predict and validate again on the same Trainer."""
    import warnings

    warnings.filterwarnings("ignore")
    model = SGDLM(qwen2())
    trainer = _trainer(
        PACIStrategy(pipeline_stages=2), world, 2, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2,
        default_root_dir=root,
    )  # fmt: skip
    trainer.fit(model, datamodule=_data())
    losses = [
        trainer.validate(model, datamodule=_data(), verbose=False)[0]["val_loss"],
        trainer.test(model, datamodule=_data(), verbose=False)[0]["test_loss"],
    ]
    predictions = trainer.predict(model, datamodule=_data())
    losses.append(trainer.validate(model, datamodule=_data(), verbose=False)[0]["val_loss"])
    if rank == 0:  # the last stage, and the whole model after fit
        Path(root).mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), Path(root, "trained.pt"))
    return {"losses": losses, "predictions": predictions}


@pytest.mark.multiproc
@pytest.mark.usefixtures("one_thread")  # as the ranks: compared bit for bit below
def test_evaluating_after_fit_on_processes_answers_as_one_device(tmp_path):
    """Lightning's most common pattern, fit then validate/test/predict on the same Trainer, under PACI on two
    processes: a Hugging Face model's layers are discovered once, not again on a rank whose module is split (that
    crashed rank 1 naming a layer on the other stage). Every rank gets the results (only the last stage logs
    them: rank 1's validate()[0]["val_loss"] was a KeyError), and they are one device's on the trained weights."""
    last, first = values(spawn(_fit_then_evaluate, 2, str(tmp_path), timeout=240, torchrun_env=True))
    assert last["losses"] == first["losses"]
    val, test, val_again = last["losses"]
    assert val == val_again
    assert first["predictions"] == [None, None]  # the first stage's rank has no logits to answer with
    reference = SGDLM(qwen2())
    reference.load_state_dict(torch.load(tmp_path / "trained.pt"))
    trainer = _trainer("auto", 1, 1, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2)
    want_val = trainer.validate(reference, datamodule=_data(), verbose=False)[0]["val_loss"]
    want_test = trainer.test(reference, datamodule=_data(), verbose=False)[0]["test_loss"]
    want_predictions = trainer.predict(reference, datamodule=_data())
    assert abs(val - want_val) < 1e-5 and abs(test - want_test) < 1e-5, (val, want_val, test, want_test)
    assert len(last["predictions"]) == 2
    assert all(torch.equal(a, b) for a, b in zip(last["predictions"], want_predictions, strict=True))
    # The same script with the pipeline in one process (devices=1): PACI there is PACI on processes, exactly.
    one = _fit_then_evaluate(0, 1, str(tmp_path / "one"))
    assert one["losses"] == last["losses"]
    assert all(torch.equal(a, b) for a, b in zip(one["predictions"], last["predictions"], strict=True))


def test_a_base_model_without_a_head_is_refused_naming_the_causal_lm_class():
    """``HFCausalLM(Qwen2Model(cfg))`` was refused with a message about decoder stacks that never named the fix."""
    from transformers import Qwen2Model

    base = Qwen2Model(qwen2().config)
    with pytest.raises(ValueError, match=r"HFCausalLM\(Qwen2Model\) is a base model .* Use Qwen2ForCausalLM"):
        HFCausalLM(base)


def test_a_folder_of_another_class_is_refused_before_it_trains_from_random_weights(tmp_path):
    """from_pretrained loads what a folder and the causal LM class share and initializes the rest at random, saying so
    only in transformers' log: a bare Qwen2Model's folder trained with a random LM head, BART's seq2seq folder without
    its embeddings. And a T5 config failed with AutoModelForCausalLM's list of two hundred config classes."""
    from safetensors.torch import load_file, save_file
    from transformers import BartConfig, BartForConditionalGeneration, Qwen2Model

    Qwen2Model(qwen2(tie_word_embeddings=False).config).save_pretrained(tmp_path / "bare")
    with pytest.raises(ValueError, match=r"saved from Qwen2Model .* not a causal LM; .* as Qwen2ForCausalLM"):
        HFCausalLM(str(tmp_path / "bare"))
    bart = BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                      decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)  # fmt: skip
    BartForConditionalGeneration(bart).save_pretrained(tmp_path / "bart")
    with pytest.raises(ValueError, match=r"saved from BartForConditionalGeneration .* as BartForCausalLM"):
        HFCausalLM(str(tmp_path / "bart"))
    qwen2(tie_word_embeddings=False).save_pretrained(tmp_path / "no_head")  # a causal LM's folder, its head lost
    weights = tmp_path / "no_head" / "model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if k != "lm_head.weight"}, weights, {"format": "pt"})
    with pytest.raises(ValueError, match=r"do not hold 1 of Qwen2ForCausalLM's parameters \(lm_head.weight\)"):
        HFCausalLM(str(tmp_path / "no_head"))
    with pytest.raises(ValueError, match=r"model_type 't5' \(T5Config\) has no causal LM class"):
        HFCausalLM({"model_type": "t5", "d_model": 16, "num_layers": 1, "num_heads": 2})


def test_a_causal_lm_registered_with_the_auto_classes_is_taken(tmp_path):
    """AutoModelForCausalLM.register(...) adds a model_type the fixed name table lacks: the class checks read the
    mapping the register call fills, as from_config and from_pretrained do."""
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    class OwnConfig(Qwen2Config):
        model_type = "own_qwen2_for_the_test"

    class OwnForCausalLM(Qwen2ForCausalLM):
        config_class = OwnConfig

    AutoConfig.register(OwnConfig.model_type, OwnConfig, exist_ok=True)
    AutoModelForCausalLM.register(OwnConfig, OwnForCausalLM, exist_ok=True)
    config = {k: v for k, v in qwen2().config.to_diff_dict().items() if k != "model_type"}
    assert type(HFCausalLM({"model_type": OwnConfig.model_type, **config}).model) is OwnForCausalLM
    OwnForCausalLM(OwnConfig(**config)).save_pretrained(tmp_path / "own")
    assert type(HFCausalLM(str(tmp_path / "own")).model) is OwnForCausalLM


@pytest.mark.parametrize(
    ("make", "key"), [(gpt2, "token_type_ids"), (llama, "position_ids"), (llama, "cu_seq_lens_q")]
)  # the last through the forward's **kwargs: a flattening collator's
def test_a_batch_key_the_model_takes_but_the_pipeline_does_not_pass_is_refused(make, key):
    """A user's padded dict batches with token_type_ids (GPT-2 adds their embedding) or position_ids (packed rows'
    restarts): HFCausalLM read input_ids and attention_mask only and trained without them, silently unlike
    model(**batch).loss (4.9e-2 in the weights after 2 steps). A column the forward does not take is the data's."""
    module = HFCausalLM(make())
    batch = {**_batch(), key: torch.zeros(2, 8, dtype=torch.long), "length": torch.tensor([6, 8])}
    said = rf"the batch holds '{key}', an input of {type(module.model).__name__}.forward that HFCausalLM does not "
    with pytest.raises(ValueError, match=said + r"pass on: it reads attention_mask, input_ids, labels only"):
        module.pipeline_input(batch)
    del batch[key]
    assert len(module.pipeline_input(batch)) == 2  # input_ids and attention_mask; the length column stays unread


def test_blocks_longer_than_the_position_table_are_refused_with_the_fix():
    """The Python API pair HFCausalLM(gpt2 with n_positions=16) and TextDataModule(block_size=32) failed with a bare
    IndexError in stage 0's position embedding; a data module of the user's own has no block_size to check."""
    model = HFCausalLM(gpt2(n_positions=16))
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    with pytest.raises(ValueError, match=r"block_size=32 but GPT2LMHeadModel has max_position_embeddings=16; use"):
        trainer.fit(model, datamodule=TextDataModule(block_size=32, batch_size=2, max_bytes=20_000))
    with pytest.raises(ValueError, match="sequences have 32 tokens but GPT2LMHeadModel has max_position_embeddings"):
        model.pipeline_input((torch.zeros(2, 32, dtype=torch.long), None))


def test_a_bfloat16_folder_loads_in_float32_unless_asked(tmp_path):
    """Most downloaded checkpoints (Qwen2.5, Llama 3.2) are bfloat16, and transformers 5 loads a folder in its own
    dtype: the master weights, gradients and AdamW state were bfloat16 (pure-bf16 training), silently."""
    llama().to(torch.bfloat16).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    module = HFCausalLM(str(tmp_path))
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    assert {p.dtype for p in HFCausalLM(str(tmp_path), dtype="auto").parameters()} == {torch.bfloat16}
    assert {p.dtype for p in HFCausalLM(str(tmp_path), dtype=torch.bfloat16).parameters()} == {torch.bfloat16}
    with torch.device("meta"):  # the memory plan's build: the same dtype as training's
        assert {p.dtype for p in HFCausalLM(str(tmp_path)).parameters()} == {torch.float32}
    config = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32,
              "num_attention_heads": 2, "dtype": "bfloat16"}  # fmt: skip
    assert {p.dtype for p in HFCausalLM(config, vocab_size=VOCAB).parameters()} == {torch.float32}
    with pytest.raises(ValueError, match=r"dtype='fp32'\) is not a dtype to train in: use 'float32'"):
        HFCausalLM(str(tmp_path), dtype="fp32")
    # an instance keeps its own dtype: a dtype given with it was ignored, silently; now refused
    with pytest.raises(ValueError, match=r"dtype='bfloat16'\) applies to a model built or loaded here"):
        HFCausalLM(module.model, dtype="bfloat16")
    assert {p.dtype for p in HFCausalLM(module.model).parameters()} == {torch.float32}
    with pytest.raises(ValueError, match=r"HFCausalLM\(learning_rate=nan\) must be a finite number"):
        HFCausalLM(module.model, learning_rate=float("nan"))  # passed every comparison, as GPT's did


def test_attn_implementation_is_checked_and_never_ignored(tmp_path):
    """A number reached transformers' string methods (an AttributeError naming no argument), and a name given with an
    instance was ignored: the instance ran its own attention, silently."""
    config = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32,
              "num_attention_heads": 2}  # fmt: skip
    with pytest.raises(ValueError, match=r"attn_implementation=5\) must be a transformers attention name"):
        HFCausalLM(config, vocab_size=VOCAB, attn_implementation=5)
    built = HFCausalLM(config, vocab_size=VOCAB, attn_implementation="eager")
    assert built.model.config._attn_implementation == "eager"
    instance = llama(attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"keeps its own \('sdpa'\)\. Set it on the instance first"):
        HFCausalLM(instance, attn_implementation="eager")
    instance.set_attn_implementation("eager")  # the fix the message gives
    module = HFCausalLM(instance)
    assert module.model.config._attn_implementation == "eager"
    # and a checkpoint rebuilds it so (the config it keeps drops the attention: the rebuild ran sdpa; the review)
    from lightning.pytorch import Trainer

    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, max_steps=0)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    assert HFCausalLM.load_from_checkpoint(tmp_path / "m.ckpt").model.config._attn_implementation == "eager"


def test_an_instance_in_bfloat16_reloads_from_its_checkpoint_in_bfloat16(tmp_path):
    """A model given as an instance (from_pretrained(dtype=torch.bfloat16), say) was rebuilt from the checkpoint's
    config in float32, and its weights cast into it, silently."""
    from lightning.pytorch import Trainer

    module = HFCausalLM(llama().to(torch.bfloat16))
    assert module.hparams["dtype"] == "bfloat16"
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, max_steps=0)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    loaded = HFCausalLM.load_from_checkpoint(tmp_path / "m.ckpt")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    saved, reloaded = module.state_dict(), loaded.state_dict()
    assert saved.keys() == reloaded.keys() and all(torch.equal(saved[k], reloaded[k]) for k in saved)
    mixed = llama().to(torch.bfloat16)
    mixed.model.norm.float()  # float32 parts of the user's own: rebuilt in float32, cast up, nothing lost
    assert HFCausalLM(mixed).hparams["dtype"] is None


def test_a_config_key_its_class_does_not_define_is_refused_with_a_suggestion():
    """``num_hidden_layer: 4`` was kept as an unused attribute, and the model built with Llama's default 32 layers."""
    sizes = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2}
    with pytest.raises(ValueError, match=r"'num_hidden_layer' \(did you mean 'num_hidden_layers'\?\) is not a field "
                       r"of LlamaConfig: transformers would keep it as an unused attribute"):  # fmt: skip
        HFCausalLM({"model_type": "llama", "num_hidden_layer": 1, **sizes}, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"'hiden_size' \(did you mean 'hidden_size'\?\) is not a field"):
        HFCausalLM({"model_type": "llama", "num_hidden_layers": 1, "hiden_size": 16, "foo": 1}, vocab_size=VOCAB)
    # A downloaded config.json's extras (GPT-2's own: n_ctx, task_specific_params) are no misspelling: named, kept
    with pytest.warns(UserWarning, match=r"'n_ctx', 'task_specific_params' are not fields of GPT2Config"):
        HFCausalLM({"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2, "n_ctx": 32,
                    "task_specific_params": {"text-generation": {"max_length": 50}}}, vocab_size=VOCAB)  # fmt: skip
    with pytest.raises(ValueError, match=r"no model type 'lama' \(did you mean 'llama'"):
        HFCausalLM({"model_type": "lama", **sizes})
    # Aliases (GPT-2's attribute_map), the generic keys, legacy rotary keys and a saved config's own keys pass.
    HFCausalLM({"model_type": "gpt2", "num_hidden_layers": 1, "hidden_size": 16, "n_head": 2, "torch_dtype": "float32",
                "tie_word_embeddings": True, "architectures": ["GPT2LMHeadModel"]}, vocab_size=VOCAB)  # fmt: skip
    module = HFCausalLM({"model_type": "llama", "num_hidden_layers": 1, "rope_theta": 500_000.0, **sizes})
    assert module.model.config.num_hidden_layers == 1 and module.model.config.rope_parameters["rope_theta"] == 5e5
    HFCausalLM(module._config_dict())  # what a checkpoint of a module built from an instance rebuilds from


def test_the_shipped_config_dicts_pass_the_key_check():
    import yaml

    from lit_efficient.models.hf import _check_config_keys

    root = Path(__file__).resolve().parents[2]
    for name in ["configs/hf_llama.yaml", "benchmarks/memory_plan_llama3_8b.yaml"]:
        _check_config_keys(yaml.safe_load((root / name).read_text())["model"]["init_args"]["model"])


@pytest.mark.parametrize("betas", [(0.9, 1.0), (0.9,), 0.9, (0.9, -0.1)])
def test_betas_outside_two_values_in_0_1_are_refused_at_construction(betas):
    """Checked by GPT, not by HFCausalLM: they failed later, in AdamW, on every rank."""
    with pytest.raises(
        ValueError, match=r"HFCausalLM\(betas=.*\) must be two values in \[0, 1\), e\.g\. \(0\.9, 0\.95\)"
    ):
        HFCausalLM(gpt2(), betas=betas)


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (dict(learning_rate=0.0), r"HFCausalLM\(learning_rate=0\.0\) must be > 0"),
        (dict(warmup_steps=2.5), r"HFCausalLM\(warmup_steps=2\.5\) must be an integer >= 0"),
        (dict(max_steps=True), r"HFCausalLM\(max_steps=True\) must be an integer >= 1"),
    ],
)
def test_the_recipe_is_checked_as_gpt_checks_it(overrides, said):
    """One check of the AdamW + warmup + cosine recipe for both models (`models.gpt.check_recipe`): HFCausalLM
    named four arguments at once for one bad value, and took a fractional warmup or max_steps=True."""
    with pytest.raises(ValueError, match=said):
        HFCausalLM(gpt2(), **overrides)


def test_a_warmup_as_long_as_max_steps_warns():
    with pytest.warns(UserWarning, match=r"HFCausalLM\(warmup_steps=100\) is not below the run's 10 optimizer steps"):
        HFCausalLM(gpt2(), max_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HFCausalLM(gpt2(), warmup_steps=5, max_steps=10)
