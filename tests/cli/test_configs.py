"""Every shipped YAML config parses through the CLI; the CPU ones build their Trainer and the overlays train.

The quickstart itself runs end to end through the console script in ``test_cli.py``; here the flush and
activation-checkpointing overlays run a few steps in this process's children (``start_method: forkserver``).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import yaml

from lit_efficient.cli.app import LitEfficientCLI

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QUICKSTART = CONFIGS / "quickstart.yaml"
GPU_CONFIGS = ["gpt2_medium_8stage_paci.yaml", "gpt2_medium_8stage_flush.yaml"]
OVERLAYS = ["flush.yaml", "localsgd.yaml", "diloco.yaml", "checkpointing.yaml", "fault_tolerant.yaml"]
# A few steps of the quickstart on a small slice of the corpus; tests swap W&B (test_cli covers it) for CSV.
SHORT = [
    "--trainer.max_steps=2", "--trainer.val_check_interval=8", "--trainer.limit_val_batches=2",
    "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
    "--data.init_args.max_bytes=200000", "--trainer.strategy.init_args.start_method=forkserver",
]  # fmt: skip


class _ParseOnly(LitEfficientCLI):
    """Parses and validates, instantiates nothing (the GPU configs need 8 GPUs and a token file)."""

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-efficient"])


def _args(*names: str) -> list[str]:
    return [f"--config={CONFIGS / name}" for name in names]


# Standalone (not overlays): a Hugging Face model through HFCausalLM.
HF_CONFIGS = ["hf_llama.yaml", "hf_own_model.yaml"]


def test_every_shipped_config_is_covered():
    shipped = sorted(p.name for p in CONFIGS.glob("*.y*ml"))
    assert shipped == sorted(["quickstart.yaml", *OVERLAYS, *GPU_CONFIGS, *HF_CONFIGS])


@pytest.mark.parametrize("stack", [["quickstart.yaml"], *(["quickstart.yaml", o] for o in OVERLAYS),
                                   ["quickstart.yaml", "localsgd.yaml", "diloco.yaml"]])  # fmt: skip
def test_cpu_configs_parse_and_build_their_trainer(stack, tmp_path):
    cli = LitEfficientCLI(args=[*_args(*stack), "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"],
                          run=False)  # fmt: skip
    strategy = cli.trainer.strategy
    assert type(strategy).__name__ == "PACIStrategy" and strategy.pipeline_stages == 2
    assert cli.trainer.accumulate_grad_batches == 4  # N; GradientAccumulation (steps=None) normalizes
    names = [type(cb).__name__ for cb in cli.trainer.callbacks]
    assert {"GradientAccumulation", "PipelineMonitor", "ModelCheckpoint"} <= set(names)
    assert cli.model.hparams.block_size == cli.datamodule.block_size == 64
    overlay = stack[-1]
    if overlay == "flush.yaml":
        assert strategy.schedule == "1f1b_flush"
    elif overlay in ("localsgd.yaml", "diloco.yaml"):
        assert strategy.local_sgd_steps == (20 if overlay == "diloco.yaml" else 4) and strategy.num_processes == 4
        assert strategy.outer_optimizer == ("nesterov" if overlay == "diloco.yaml" else "average")
    elif overlay == "checkpointing.yaml":
        assert "ActivationCheckpointing" in names
    elif overlay == "fault_tolerant.yaml":  # one replica group of two stages (its run: tests/replicas)
        assert strategy.fault_tolerance == "torchft" and strategy.replica_groups == 2 and strategy.num_processes == 2
        assert strategy.local_sgd_steps == 20 and strategy.outer_optimizer == "nesterov"
    else:
        assert strategy.schedule == "paci"


def test_command_line_sets_n_for_the_shipped_configs(tmp_path):
    """The documented override: --trainer.accumulate_grad_batches N, with the config's GradientAccumulation."""
    cli = LitEfficientCLI(
        args=[*_args("quickstart.yaml"), "--trainer.accumulate_grad_batches=8", "--trainer.logger=false",
              f"--trainer.default_root_dir={tmp_path}"],
        run=False,
    )  # fmt: skip
    accumulation = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "GradientAccumulation")
    accumulation.setup(cli.trainer, cli.model, "fit")  # the conflict check and the value it applies
    assert cli.trainer.accumulate_grad_batches == 8
    assert accumulation.get_accumulate_grad_batches(0) == 8


def test_every_shipped_checkpoint_callback_saves_last():
    """A restart resumes with ``--ckpt_path last`` (docs/multi-node.md); without ``save_last`` Lightning finds no
    last checkpoint, warns, and the restarted attempt trains from step 0 beside the checkpoint it wrote."""
    savers = {}
    for path in sorted(CONFIGS.glob("*.yaml")):
        for callback in (yaml.safe_load(path.read_text()).get("trainer") or {}).get("callbacks") or []:
            if callback["class_path"].endswith("ModelCheckpoint"):
                savers[path.name] = callback["init_args"].get("save_last")
    assert set(savers) == {"quickstart.yaml", "hf_llama.yaml", "hf_own_model.yaml", *GPU_CONFIGS}
    assert all(save_last in (True, "link") for save_last in savers.values()), savers  # a copy, or a link to it


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_configs_parse_with_the_paper_recipe(name):
    cli = _ParseOnly(args=_args(name), run=False)
    config = cli.config
    trainer, model, data = config.trainer, config.model.init_args, config.data.init_args
    assert (trainer.accelerator, trainer.devices, trainer.precision) == ("gpu", 8, "bf16-mixed")
    assert trainer.strategy.init_args.pipeline_stages == 8
    assert trainer.strategy.init_args.schedule == ("paci" if "paci" in name else "1f1b_flush")
    assert (model.n_layer, model.n_embd, model.n_head) == (24, 1024, 16)
    assert (data.block_size, data.vocab_size) == (1024, 50304) and data.path.endswith(".bin")
    # The model's block_size is linked from the built data module (data.block_size), applied when instantiating:
    # not given in the config, so the saved config cannot disagree with the data.
    assert (
        "block_size"
        not in yaml.safe_load(_ParseOnly(args=_args(name), run=False).parser.dump(config))["model"]["init_args"]
    )
    assert (model.learning_rate, tuple(model.betas), model.weight_decay) == (3e-4, (0.9, 0.95), 0.1)
    assert model.warmup_steps == round(0.01 * trainer.max_steps) and model.min_lr_ratio == 0.1
    accumulation = next(cb for cb in trainer.callbacks if cb.class_path.endswith("GradientAccumulation"))
    assert accumulation.init_args.steps is None  # N is the Trainer's, so the command line can set it
    assert data.batch_size * trainer.accumulate_grad_batches == 128  # the paper's global batch


def test_gpu_paci_and_flush_differ_only_in_schedule():
    paci, flush = (yaml.safe_load((CONFIGS / name).read_text()) for name in GPU_CONFIGS)
    assert paci["trainer"]["strategy"]["init_args"].pop("schedule") == "paci"
    assert flush["trainer"]["strategy"]["init_args"].pop("schedule") == "1f1b_flush"
    paci["trainer"]["logger"]["init_args"].pop("name")
    flush["trainer"]["logger"]["init_args"].pop("name")
    assert paci == flush


@pytest.mark.multiproc
@pytest.mark.parametrize("overlay", ["flush.yaml", "checkpointing.yaml"])
def test_overlay_trains_a_few_steps(overlay, tmp_path):
    logger = ["--trainer.logger=CSVLogger", f"--trainer.logger.save_dir={tmp_path}", "--trainer.logger.name=run",
              "--trainer.logger.version=v0"]  # fmt: skip
    cli = LitEfficientCLI(args=["fit", *_args("quickstart.yaml", overlay), *SHORT, *logger])
    metrics = cli.trainer.callback_metrics  # rank 0's (the last stage), brought back from the spawned ranks
    assert math.isfinite(float(metrics["train_loss"])) and math.isfinite(float(metrics["val_loss"]))
    run = tmp_path / "run" / "v0"
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"pipeline/utilization_stage0", "pipeline/bubble_fraction", "throughput/tokens_per_sec"} <= set(header)
    if overlay == "checkpointing.yaml":
        assert "activation_checkpointing/saved_bytes" in header
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["trainer"]["callbacks"][-1]["class_path"].endswith(
        "ActivationCheckpointing" if overlay == "checkpointing.yaml" else "ModelCheckpoint"
    )
    assert (run / "checkpoints" / "last.ckpt").exists()  # what a restarted attempt's --ckpt_path last resumes


@pytest.mark.multiproc
def test_hf_llama_config_builds_and_trains_a_few_steps(tmp_path):
    pytest.importorskip("transformers")
    logger = [f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false", "--trainer.callbacks=[]"]
    short = [a for a in SHORT if "logger" not in a] + ["--model.init_args.model.num_hidden_layers=2"]
    cli = LitEfficientCLI(args=["fit", *_args("hf_llama.yaml"), *short, *logger])
    model = cli.model.model
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert model.config.vocab_size == cli.datamodule.vocab_size == 256  # linked from the data
    assert cli.trainer.strategy.pipeline_stages == 2
    assert math.isfinite(float(cli.trainer.callback_metrics["train_loss"]))  # rank 0's, from the spawned ranks


@pytest.mark.multiproc
def test_hf_own_model_config_trains_a_saved_model_on_its_tokenizers_ids(tmp_path, demo_model):
    """The config of docs/hf-on-n-gpus.md as written there: a save_pretrained folder, its tokenizer, the data."""
    logger = [f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false", "--trainer.callbacks=[]"]
    short = [a for a in SHORT if "logger" not in a and "max_bytes" not in a] + ["--data.init_args.max_bytes=300000"]
    paths = [f"--model.init_args.model={demo_model}", f"--data.init_args.tokenizer={demo_model}",
             f"--data.init_args.cache_dir={tmp_path / 'tokens'}"]  # fmt: skip
    cli = LitEfficientCLI(args=["fit", *_args("hf_own_model.yaml"), *short, *paths, *logger])
    assert type(cli.model.model).__name__ == "Qwen2ForCausalLM"
    assert type(cli.datamodule).__name__ == "TokenizedDataModule"
    assert cli.model.model.config.vocab_size == cli.datamodule.vocab_size == len(cli.datamodule.tokenizer)
    assert cli.model.hparams.block_size == cli.datamodule.block_size == 128  # linked from the data
    assert list((tmp_path / "tokens").glob("tokens-*.uint16.bin"))
    assert math.isfinite(float(cli.trainer.callback_metrics["train_loss"]))
