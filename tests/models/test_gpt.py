"""GPT: the pipeline protocol, causality, optimizer groups and LR schedule, sampling, a short real fit."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from torch import nn

from lit_efficient.data import TextDataModule
from lit_efficient.models import GPT
from lit_efficient.models.gpt import cosine_with_warmup

TINY = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32)


def tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(**{**TINY, **overrides})


def random_batch(batch_size: int = 2, seq_len: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (batch_size, seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_forward_is_the_pipeline_layers_in_sequence():
    model = tiny_gpt().eval()
    batch = random_batch()
    layers = model.pipeline_layers()
    assert [type(m).__name__ for m in layers] == ["GPTEmbedding", "Block", "Block", "GPTHead"]
    x = model.pipeline_input(batch)
    assert x is batch[0]
    # Two "stages" run one after the other compute what the unsplit model computes.
    hidden = x
    for layer in layers[:2]:
        hidden = layer(hidden)
    for layer in layers[2:]:
        hidden = layer(hidden)
    logits = model(x)
    assert logits.shape == (2, 32, 256)
    torch.testing.assert_close(hidden, logits, rtol=0, atol=0)


def test_pipeline_loss_is_cross_entropy_with_token_count():
    model = tiny_gpt()
    x, y = random_batch()
    logits = model(x)
    loss, count = model.pipeline_loss(logits, (x, y))
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)))
    assert isinstance(count, torch.Tensor) and count.item() == y.numel()
    # Targets of -1 (padding) are left out of both the mean and the count.
    y_pad = y.clone()
    y_pad[:, -5:] = -1
    loss_pad, count_pad = model.pipeline_loss(logits, (x, y_pad))
    expected = F.cross_entropy(logits[:, :-5].reshape(-1, 256), y[:, :-5].reshape(-1))
    torch.testing.assert_close(loss_pad, expected)
    assert count_pad.item() == y.numel() - 10
    # A micro-batch of padding only: loss 0 and no gradient, not torch's 0/0 NaN (which the pipeline refuses).
    logits = logits.detach().requires_grad_()
    loss_none, count_none = model.pipeline_loss(logits, (x, torch.full_like(y, -1)))
    loss_none.backward()
    assert loss_none.item() == 0.0 and count_none.item() == 0 and torch.equal(logits.grad, torch.zeros_like(logits))


def test_every_parameter_lives_in_exactly_one_pipeline_layer():
    model = tiny_gpt()
    owners: dict[int, int] = {}
    for k, layer in enumerate(model.pipeline_layers()):
        for p in layer.parameters():
            assert id(p) not in owners, "parameter shared between pipeline layers"
            owners[id(p)] = k
    assert set(owners) == {id(p) for p in model.parameters()}
    keys = model.state_dict().keys()
    assert keys and all(k.split(".")[0] in {"embed", "blocks", "head"} for k in keys)
    assert "blocks.1.attn.c_attn.weight" in keys and "head.lm_head.weight" in keys


def test_tied_weights_share_the_token_table():
    model = tiny_gpt(tie_weights=True)
    assert model.head.lm_head.weight is model.embed.wte.weight
    assert model(random_batch()[0]).shape == (2, 32, 256)


def test_attention_is_causal():
    model = tiny_gpt().eval()
    x, _ = random_batch()
    changed = x.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_sequence_longer_than_block_size_is_refused():
    with pytest.raises(ValueError, match="block_size=32"):
        tiny_gpt()(torch.zeros(1, 33, dtype=torch.long))


def test_optimizer_groups_decay_only_matrix_weights():
    model = tiny_gpt(max_steps=100)
    optimizer = model.configure_optimizers()["optimizer"]
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decay_names = {names[id(p)] for p in decay["params"]}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert decay_names.isdisjoint(no_decay_names)
    assert decay_names | no_decay_names == set(names.values())
    assert all(n.endswith("weight") and "ln_" not in n and "wte" not in n for n in decay_names)
    assert {"embed.wte.weight", "embed.wpe.weight", "head.ln_f.weight", "blocks.0.attn.c_attn.bias"} <= (no_decay_names)
    assert "head.lm_head.weight" in decay_names and "blocks.1.mlp.c_fc.weight" in decay_names


def test_optimizer_sees_only_the_layers_left_on_this_rank():
    # What a pipeline strategy does to a stage that holds only the blocks.
    model = tiny_gpt(max_steps=100)
    model.embed, model.head = nn.Identity(), nn.Identity()
    optimizer = model.configure_optimizers()["optimizer"]
    grouped = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.blocks.parameters())


def test_tied_weight_is_not_decayed():
    model = tiny_gpt(tie_weights=True, max_steps=100)
    decay, no_decay = model.configure_optimizers()["optimizer"].param_groups
    assert any(p is model.embed.wte.weight for p in no_decay["params"])
    assert all(p is not model.embed.wte.weight for p in decay["params"])


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    model = tiny_gpt(learning_rate=1e-3, warmup_steps=10, max_steps=100, min_lr_ratio=0.1)
    config = model.configure_optimizers()
    assert config["lr_scheduler"]["interval"] == "step"
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    lrs = []
    for _ in range(120):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11], strict=True))  # warmup rises
    assert lrs[10] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))  # then never rises
    assert lrs[55] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # half-way through the cosine
    assert lrs[100] == pytest.approx(1e-4) and lrs[-1] == pytest.approx(1e-4)
    assert cosine_with_warmup(0, 0, 10, 0.0) == pytest.approx(1.0)


def test_generate_shape_range_and_modes():
    model = tiny_gpt()
    model.train()
    prompt = torch.randint(0, 256, (2, 40))  # longer than block_size: cropped, not refused
    out = model.generate(prompt, max_new_tokens=6, top_k=5)
    assert out.shape == (2, 46) and out.dtype == torch.long
    assert torch.equal(out[:, :40], prompt) and out.min() >= 0 and out.max() < 256
    assert model.training, "generate restores the previous mode"
    greedy = model.generate(prompt[:, :8], max_new_tokens=4, temperature=0)
    assert torch.equal(greedy, model.generate(prompt[:, :8], max_new_tokens=4, top_k=1))
    for bad in (-1.0, float("nan")):  # NaN went greedy silently
        with pytest.raises(ValueError, match="temperature"):
            model.generate(prompt, 1, temperature=bad)
    # A temperature so small that the logits overflow is greedy (multinomial refused the infinities).
    assert torch.equal(model.generate(prompt[:, :8], 4, temperature=1e-45), greedy)
    with pytest.raises(ValueError, match=r"a prompt of shape \(B, T\) with T >= 1, not \(1, 0\)"):
        model.generate(GPT.encode(""), 2)  # an IndexError from inside the loop


def test_encode_decode_bytes():
    assert GPT.decode(GPT.encode("héllo")[0]) == "héllo"
    assert GPT.decode([104, 255, 105]) == "h\ufffdi"
    with pytest.raises(ValueError, match="0..255"):
        GPT.decode([300])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(n_embd=30, n_head=4), r"divisible by n_head=4: .* \(e\.g\. n_head=5\) or .* \(e\.g\. n_embd=32\)"),
        (dict(vocab_size=0), "vocab_size=0"),
        (dict(n_layer=0), "n_layer=0"),
        (dict(dropout=1.0), "dropout=1.0"),
        (dict(learning_rate=0.0), "learning_rate"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(betas=0.9), r"betas=0\.9\) must be two values in \[0, 1\)"),  # was a TypeError from len()
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(max_steps=0), "max_steps=0"),
        (dict(warmup_steps=2.5), r"warmup_steps=2\.5\) must be an integer >= 0"),
        (dict(min_lr_ratio=1.5), "min_lr_ratio"),
        (dict(n_head=2.0), r"n_head=2\.0\) must be a positive integer"),  # failed at the first forward
        (dict(n_embd=8.0), r"n_embd=8\.0\) must be a positive integer"),
        (dict(learning_rate=float("nan")), r"learning_rate=nan\) must be a finite number"),  # passed every check
        (dict(weight_decay=float("inf")), r"weight_decay=inf\) must be a finite number"),
        (dict(tie_weights="false"), r"tie_weights='false'\) must be True or False"),  # a truthy string tied them
        (dict(bias="false"), r"bias='false'\) must be True or False"),
    ],
)
def test_bad_arguments_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        GPT(**{**TINY, **overrides})


def _trainer(**kwargs) -> Trainer:
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return Trainer(accelerator="cpu", devices=1, **quiet, **kwargs)


def test_short_fit_on_the_embedded_corpus_lowers_the_loss():
    torch.manual_seed(0)
    data = TextDataModule(block_size=32, batch_size=8, max_bytes=200_000)
    data.setup("fit")
    fixed = next(iter(data.val_dataloader()))
    model = tiny_gpt(learning_rate=3e-3, warmup_steps=5)  # max_steps None: the Trainer's 30
    with torch.no_grad():
        before = model.pipeline_loss(model(fixed[0]), fixed)[0].item()
    trainer = _trainer(max_steps=30, limit_val_batches=2, val_check_interval=30)
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 30
    assert trainer.lr_scheduler_configs[0].scheduler.lr_lambdas[0](30) == pytest.approx(0.1)
    model.eval()
    with torch.no_grad():
        after = model.pipeline_loss(model(fixed[0]), fixed)[0].item()
    assert before == pytest.approx(math.log(256), abs=0.1)
    assert after < before - 1.0, (before, after)
    metrics = trainer.callback_metrics
    assert {"train_loss", "val_loss", "val_ppl"} <= set(metrics)
    # Perplexity is exp(token-mean loss); full blocks make the batch-weighted mean that mean.
    assert metrics["val_ppl"].item() == pytest.approx(math.exp(metrics["val_loss"].item()), rel=1e-4)

    tested = trainer.test(model, datamodule=data, verbose=False)[0]
    assert tested["test_ppl"] == pytest.approx(math.exp(tested["test_loss"]), rel=1e-4)
    trainer_predict = _trainer(limit_predict_batches=1)
    predictions = trainer_predict.predict(model, datamodule=data)
    assert predictions[0].shape == (8, 32) and predictions[0].dtype == torch.long


def test_a_warmup_as_long_as_the_run_warns_with_the_numbers_and_the_fix():
    """GPT's default warmup_steps=100 with --trainer.max_steps 50 trained 50 steps at a rising learning rate that never
    reached its peak nor decayed, silently."""
    with pytest.warns(UserWarning, match=r"GPT\(warmup_steps=100\) is not below the run's 50 optimizer steps "
                      r"\(max_steps=50\).*never reaches its peak.*Set warmup_steps below 50 \(e\.g\. 5"):  # fmt: skip
        tiny_gpt(max_steps=50)
    data = TextDataModule(block_size=32, batch_size=2, max_bytes=20_000)
    with pytest.warns(UserWarning, match=r"run's 1 optimizer steps \(trainer\.estimated_stepping_batches=1\)"):
        _trainer(max_steps=1, limit_val_batches=0).fit(tiny_gpt(), datamodule=data)
    model = tiny_gpt(warmup_steps=10, max_steps=100)  # the schedule is long enough; the run stops in its warmup
    with pytest.warns(UserWarning, match=r"warmup_steps=10\) is not below the run's 1 optimizer steps \(Trainer\("):
        _trainer(max_steps=1, limit_val_batches=0).fit(model, datamodule=data)


def test_fit_refuses_data_the_model_cannot_embed():
    data = TextDataModule(block_size=32, batch_size=2, max_bytes=20_000)
    with pytest.raises(ValueError, match="vocab_size=256"):
        _trainer(max_steps=1).fit(tiny_gpt(vocab_size=100, max_steps=1), datamodule=data)


@pytest.mark.parametrize("pipeline", [False, True], ids=["one-device", "in-process-pipeline"])
def test_validate_then_fit_with_validation(pipeline):
    """Trainer.validate leaves the perplexity's states inference tensors; a later fit validates under no_grad
    and used to fail updating them in place, on one device as under the pipeline."""
    from lit_efficient import PACIStrategy

    model = tiny_gpt()
    data = TextDataModule(block_size=32, batch_size=4, max_bytes=60_000)
    strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush") if pipeline else "auto"
    kw = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=2)  # fmt: skip
    before = Trainer(strategy=strategy, **kw).validate(model, datamodule=data)[0]["val_ppl"]
    strategy = PACIStrategy(pipeline_stages=2, schedule="1f1b_flush") if pipeline else "auto"
    trainer = Trainer(strategy=strategy, max_steps=4, val_check_interval=2, **kw)
    trainer.fit(model, datamodule=data)
    after = trainer.callback_metrics["val_ppl"].item()
    assert math.isfinite(before) and math.isfinite(after) and after < before
