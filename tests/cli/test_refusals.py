"""What the command line refuses: a usage error (exit 2) that names the value and the fix, never a traceback, for
`fit` (a value a constructor refuses) and `plan` (what fit would refuse, and its own arguments)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import LightningModule

import lit_efficient.cli.plan as plan_module
from lit_efficient import PACIStrategy
from lit_efficient.cli import main as cli_main
from lit_efficient.cli.app import LitEfficientCLI
from lit_efficient.cli.plan import main as plan_main
from lit_efficient.cli.plan import plan
from lit_efficient.models import GPT

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-efficient"])  # LightningCLI warns when args and sys.argv both exist


def _overlay(tmp_path: Path, trainer: dict) -> str:
    path = tmp_path / "overlay.yaml"
    path.write_text(yaml.safe_dump({"trainer": trainer}))
    return str(path)


def _usage_error(capsys, run, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        run(list(args))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Does not validate against any of the Union subtypes" not in err
    return err


# -- fit: a value a constructor refuses ------------------------------------------------------------


@pytest.mark.parametrize(
    "option, value, line",
    [
        ("--trainer.strategy.init_args.p2p_timeout", "-1",
         "trainer.strategy (lit_efficient.PACIStrategy): p2p_timeout=-1.0 must be a positive number of seconds"),
        ("--trainer.strategy.init_args.local_sgd_steps", "0",
         "trainer.strategy (lit_efficient.PACIStrategy): local_sgd_steps=0 must be None"),
        ("--model.init_args.n_layer", "0", "model (lit_efficient.models.GPT): GPT(n_layer=0)"),
        ("--data.init_args.block_size", "0", "data (lit_efficient.data.TextDataModule): TextDataModule(block_size=0)"),
    ],
)  # fmt: skip
def test_a_value_a_constructor_refuses_is_a_usage_error(capsys, option, value, line):
    err = _usage_error(capsys, cli_main, "fit", "--config", QUICKSTART, "--trainer.logger=false", option, value)
    assert f"lit-efficient: error: {line}" in err
    assert "--help" not in err.splitlines()[0] and len(err.strip().splitlines()) <= 3  # a line, not the usage


@pytest.mark.parametrize(
    "args, line",
    [
        (["--trainer.accumulate_grad_batches", "-2"], "Trainer(accumulate_grad_batches=-2): micro-batches per"),
        (["--trainer.strategy.init_args.balance", "[1,2]"], "PACIStrategy(balance=[1, 2]) sums to 3 layers"),
    ],
)  # fmt: skip
def test_a_setting_refused_before_launch_is_a_usage_error(capsys, args, line):
    """Checked when fit starts (the Trainer's and the model's settings together), before any process: these were a
    32-line traceback where a constructor's refusal is one line."""
    err = _usage_error(capsys, cli_main, "fit", "--config", QUICKSTART, "--trainer.logger=false", *args)
    assert f"lit-efficient: error: {line}" in err


@pytest.mark.parametrize("devices", ["2", "1"])
@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_a_checkpoint_path_with_nothing_there_is_a_usage_error_before_anything_is_written(
    capsys, tmp_path, monkeypatch, subcommand, devices
):
    """It started both ranks, wrote a W&B run and the run's config, then printed a traceback per rank (in one
    process: wrote them, then failed)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    err = _usage_error(capsys, cli_main, subcommand, "--config", QUICKSTART, "--trainer.devices", devices,
                       "--ckpt_path", "nope/missing.ckpt")  # fmt: skip
    assert "lit-efficient: error: Checkpoint file not found: nope/missing.ckpt" in err
    assert "or ckpt_path='last'" in err
    assert not (tmp_path / "runs" / "lit-efficient").exists() and not list(tmp_path.rglob("offline-run-*"))


def test_a_checkpoint_path_lightning_reads_is_not_refused(tmp_path, monkeypatch):
    """A path under ``~`` (a YAML value, not expanded by a shell), Lightning's keywords and a registry's name."""
    from lit_efficient.strategy.config import CheckpointNotFound, check_checkpoint_path

    monkeypatch.setenv("HOME", str(tmp_path))
    torch.save({}, tmp_path / "model.ckpt")
    for path in ("~/model.ckpt", tmp_path / "model.ckpt", "last", "best", "hpc", "registry:org/model", None):
        check_checkpoint_path(path)
    for path in ("~/other.ckpt", "registry_old/model.ckpt", tmp_path / "missing.ckpt"):
        with pytest.raises(CheckpointNotFound, match="Checkpoint file not found"):
            check_checkpoint_path(path)


def test_a_checkpoint_path_to_something_else_is_refused_naming_what_it_is(tmp_path):
    """A folder failed in every rank with IsADirectoryError, a YAML file with torch's unpickling error (advising an
    unsafe weights_only=False), a truncated .ckpt with "Invalid argument", and a sharded folder's meta.pt with a
    diagnosis of weights-only checkpoints; a run folder names the checkpoints in it."""
    from lit_efficient.checkpoint.sharded_write import INDEX
    from lit_efficient.strategy.config import CheckpointNotFound, check_checkpoint_path

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    torch.save({}, run / "checkpoints" / "last.ckpt")
    check_checkpoint_path(run / "checkpoints" / "last.ckpt")
    with pytest.raises(
        CheckpointNotFound, match=r"is a folder without \.metadata: not a sharded checkpoint.*in it: .*last\.ckpt"
    ):
        check_checkpoint_path(run)
    # The first directory format (2026-12-01), which no later version reads: named, with the way forward, here and
    # by consolidate_checkpoint (which called it "not a checkpoint this package writes").
    first = tmp_path / "step=3.ckpt"
    first.mkdir()
    (first / "pipeline.json").write_text("{}")
    torch.save({}, first / "stage0-replica0.pt")
    said = r"first directory format .*no longer reads.*commit 9e7fed1 reads it"
    with pytest.raises(CheckpointNotFound, match=said):
        check_checkpoint_path(first)
    from lit_efficient import consolidate_checkpoint

    with pytest.raises(ValueError, match=said):
        consolidate_checkpoint(first)
    (tmp_path / "config.yaml").write_text("trainer: {}\n")
    whole = (run / "checkpoints" / "last.ckpt").read_bytes()
    (tmp_path / "head_cut.ckpt").write_bytes(whole[10:])
    (tmp_path / "tail_cut.ckpt").write_bytes(whole[:-10])  # a copy that stopped short
    for name in ("config.yaml", "head_cut.ckpt", "tail_cut.ckpt"):
        with pytest.raises(CheckpointNotFound, match=r"is not a checkpoint \(not a file torch.save wrote\)"):
            check_checkpoint_path(tmp_path / name)
    sharded = tmp_path / "last.ckpt"
    sharded.mkdir()
    (sharded / INDEX).write_bytes(b"")
    (sharded / "meta.pt").write_bytes(b"")
    check_checkpoint_path(sharded)
    with pytest.raises(
        CheckpointNotFound, match=r"is one file of the sharded checkpoint .*last\.ckpt'. pass the folder"
    ):
        check_checkpoint_path(sharded / "meta.pt")


def test_a_checkpoint_path_under_home_resumes(tmp_path, monkeypatch):
    """``ckpt_path: ~/...`` (a YAML value: no shell expands it) passed the check and then failed to load."""
    from lightning.pytorch import Trainer

    from lit_efficient.data import TextDataModule

    monkeypatch.setenv("HOME", str(tmp_path))

    def fit(steps: int, ckpt_path=None) -> Trainer:
        trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                          enable_checkpointing=False, strategy=PACIStrategy(pipeline_stages=2), limit_val_batches=0,
                          default_root_dir=tmp_path)  # fmt: skip
        data = TextDataModule(block_size=16, batch_size=2, max_bytes=4000)
        model = GPT(n_layer=2, n_embd=32, n_head=2, block_size=16, warmup_steps=1)
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
        return trainer

    fit(1).save_checkpoint(tmp_path / "m.ckpt")
    assert fit(2, "~/m.ckpt").global_step == 2  # resumed at 1, one step more


@pytest.mark.parametrize("devices", [1, 2])
def test_a_checkpoint_path_with_nothing_there_is_refused_before_any_rank_starts(tmp_path, devices):
    """From Python: one FileNotFoundError in the launching process (this test has no ``multiproc`` mark, so a rank
    started would fail it), with Lightning's words; in one process, before anything is loaded."""
    from lightning.pytorch import Trainer

    from lit_efficient.data import TextDataModule

    trainer = Trainer(accelerator="cpu", devices=devices, max_steps=1, logger=False, enable_progress_bar=False,
                      strategy=PACIStrategy(pipeline_stages=2), default_root_dir=tmp_path)  # fmt: skip
    with pytest.raises(FileNotFoundError, match=r"Checkpoint file not found: .*missing\.ckpt"):
        trainer.fit(GPT(n_layer=2, n_embd=32, n_head=2, block_size=16),
                    datamodule=TextDataModule(block_size=16, batch_size=2, max_bytes=4000),
                    ckpt_path=tmp_path / "missing.ckpt")  # fmt: skip


class _BrokenLayers(GPT):
    """A module whose pipeline_layers() has a bug: a ValueError of the user's code, no setting."""

    def pipeline_layers(self):
        first, second = list(super().pipeline_layers())  # six layers
        return [first, second]


def test_an_error_of_the_users_code_before_launch_keeps_its_traceback():
    with pytest.raises(ValueError, match="too many values to unpack") as error:
        LitEfficientCLI(args=["fit", "--config", str(QUICKSTART), "--model", f"{__name__}._BrokenLayers",
                              "--trainer.logger=false"])  # fmt: skip
    assert type(error.value) is ValueError  # not RefusedSetting: the CLI prints its traceback


def test_a_refused_callback_is_named_by_its_place_in_the_list(capsys, tmp_path):
    overlay = _overlay(tmp_path, {"callbacks": [
        {"class_path": "lit_efficient.PipelineMonitor"},
        {"class_path": "lit_efficient.GradientAccumulation", "init_args": {"steps": 0}},
    ]})  # fmt: skip
    err = _usage_error(capsys, cli_main, "fit", "--config", QUICKSTART, "--config", overlay, "--trainer.logger=false")
    assert "error: trainer.callbacks[1] (lit_efficient.GradientAccumulation): steps=0 must be an integer >= 1" in err
    assert "lit-efficient fit --trainer.callbacks.help lit_efficient.GradientAccumulation" in err


class Broken(LightningModule):
    """A module whose constructor has a bug (not a refusal of a value): its error must keep its traceback."""

    def __init__(self, vocab_size: int = 256, block_size: int = 64) -> None:
        super().__init__()
        raise RuntimeError("a bug in the constructor")


def test_other_errors_keep_their_traceback():
    with pytest.raises(ValueError, match="a bug in the constructor"):  # jsonargparse's, as before: not an exit
        LitEfficientCLI(args=["--model", f"{__name__}.Broken", "--trainer.logger=false"], run=False)


def test_the_model_keeps_its_hyperparameters_for_load_from_checkpoint():
    """The refusals are noted around LightningCLI's own instantiators, which still run."""
    cli = LitEfficientCLI(args=["--model.init_args.n_layer=1", "--trainer.logger=false"], run=False)
    assert cli.model.hparams["_instantiator"] == "lightning.pytorch.cli.instantiate_module"


# -- plan: what fit refuses, before measuring ------------------------------------------------------


@pytest.fixture
def _no_measuring(monkeypatch):
    def measured(*args, **kwargs):
        raise AssertionError("measured before refusing")

    monkeypatch.setattr(plan_module, "measure_stages", measured)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--trainer.strategy.init_args.pipeline_stages", "10", "--trainer.devices", "10"],
         "PACIStrategy(pipeline_stages=10) exceeds the 6 layers of pipeline_layers() (GPTEmbedding, 4 x Block, "
         "GPTHead)"),
        (["--replicas", "0"], "argument --replicas: '0' is not a number of replicas: an integer >= 1"),
        (["--device-memory", "80gigs"], "argument --device-memory: cannot read '80gigs' as a size"),
        (["--device-memory", "0"], "'0' is no device memory"),
        (["--device-memory", "80"], "'80' reads as 80 bytes, no device's memory: give the unit, e.g. 80GiB"),
        (["--device_memory", "24"], "'24' reads as 24 bytes"),  # fit's spelling of flags, not its usage error
        (["--trainer.strategy", "ddp"], "trainer.strategy='ddp': the plan covers PACIStrategy"),
        (["--trainer.strategy.init_args.p2p_timeout", "-1"],
         "trainer.strategy (lit_efficient.PACIStrategy): p2p_timeout=-1.0 must be a positive number of seconds"),
        (["--model.init_args.n_layer", "0"], "model (lit_efficient.models.GPT): GPT(n_layer=0)"),
        (["--trainer.accumulate_grad_batches", "0"], "trainer.accumulate_grad_batches=0: micro-batches per optimizer"),
        (["--trainer.devices", "3"], "pipeline_stages=2 does not divide the world size 3"),
        (["--trainer.precision", "16-mixed"], "precision='16-mixed' is not supported by PACIStrategy: use one of "
         "32-true, bf16-mixed (float16 with a gradient scaler, on a GPU or as a MixedPrecision plugin"),
        (["--trainer.precision", "bf16-true"], "bf16-mixed (for weights, gradients and optimizer state in bfloat16, "
         "build the model in that dtype, model.to(torch.bfloat16) or HFCausalLM(dtype='bfloat16'), and keep"),
        # The data's sizes, as its constructor checks them (a traceback after measuring, or torch's negative size).
        (["--data.init_args.batch_size", "0"], "--data.init_args.batch_size=0: batch_size must be an integer >= 1"),
        (["--data.init_args.batch_size", "-4"], "--data.init_args.batch_size=-4: batch_size must be an integer"),
        # A misspelt option of plan's own, answered by plan (fit's parser gave its usage and no suggestion).
        (["--device-memroy", "80GiB"], "unrecognized argument --device-memroy; did you mean --device-memory?"),
    ],
)  # fmt: skip
def test_plan_refusals_are_usage_errors(capsys, _no_measuring, args, message):
    err = _usage_error(capsys, plan_main, "--config", QUICKSTART, *args)
    assert "lit-efficient plan: error: " in err and message in err


def test_plan_refuses_gradient_accumulation_as_the_callback_does(capsys, tmp_path, _no_measuring):
    steps_0 = _overlay(tmp_path, {"callbacks": [{"class_path": "lit_efficient.GradientAccumulation",
                                                 "init_args": {"steps": 0}}]})  # fmt: skip
    err = _usage_error(capsys, plan_main, "--config", QUICKSTART, "--config", steps_0)
    assert "trainer.callbacks[0] (lit_efficient.GradientAccumulation): steps=0 must be an integer >= 1" in err
    schedule = _overlay(tmp_path, {"callbacks": [{"class_path": "lit_efficient.GradientAccumulation",
                                                  "init_args": {"steps": {0: 2, 4: 8}}}]})  # fmt: skip
    err = _usage_error(capsys, plan_main, "--config", QUICKSTART, "--config", schedule)  # quickstart's N=4 too
    assert "Trainer(accumulate_grad_batches=4) and GradientAccumulation(steps={0: 2, 4: 8})" in err


def test_plan_refuses_before_measuring_from_python(_no_measuring):
    with torch.device("meta"):
        module = GPT(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
    batch = tuple(torch.zeros(2, 16, dtype=torch.long, device="meta") for _ in range(2))
    for kwargs, match in [({"replicas": 0}, "replicas=0"), ({"device_memory": "lots"}, "cannot read 'lots'"),
                          ({"precision": "16-mixed"}, "16-mixed"), ({"accumulate": 0}, "accumulate=0")]:  # fmt: skip
        with pytest.raises(plan_module.PlanError, match=match):
            plan(module, batch, PACIStrategy(pipeline_stages=2), **kwargs)


def test_plan_takes_a_gradient_accumulation_schedule_at_its_largest_n(capsys, tmp_path):
    schedule = _overlay(tmp_path, {"accumulate_grad_batches": 1, "callbacks": [
        {"class_path": "lit_efficient.GradientAccumulation", "init_args": {"steps": {0: 2, 4: 8}}}]})  # fmt: skip
    assert plan_main(["--config", QUICKSTART, "--config", schedule]) == 0
    assert "N=8 (the largest of GradientAccumulation's schedule {0: 2, 4: 8})" in capsys.readouterr().out
    assert plan_main(["--config", QUICKSTART, "--config", schedule, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["accumulate"] == 8 and out["context"]["accumulate_schedule"] == {"0": 2, "4": 8}


def test_plan_takes_no_abbreviation_of_its_own_options():
    """--replica was taken for --replicas silently; it is refused, with the option it resembles."""
    with pytest.raises(SystemExit) as exit_info:
        plan_main(["--config", QUICKSTART, "--json", "--replica", "4"])
    assert exit_info.value.code == 2


def test_plan_counts_devices_given_on_the_command_line(capsys):
    assert plan_main(["--config", QUICKSTART, "--json", "--trainer.devices", "4"]) == 0  # a string: "4"
    assert json.loads(capsys.readouterr().out)["replicas"] == 2
    # --replicas plans another world: the config's devices, which the stages need not divide, do not refuse it
    assert plan_main(["--config", QUICKSTART, "--json", "--trainer.devices", "3", "--replicas", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["replicas"] == 4


@pytest.mark.parametrize("given, unified", [("bf16", "bf16-mixed"), ("32", "32-true"), (32, "32-true")])
def test_plan_reads_lightnings_precision_aliases(given, unified):
    assert plan_module.unified_precision(given) == unified


def test_plan_plans_bf16_as_fit_runs_it(capsys):
    assert plan_main(["--config", QUICKSTART, "--json", "--trainer.precision", "bf16"]) == 0
    assert json.loads(capsys.readouterr().out)["context"]["precision"] == "bf16-mixed"


# -- the top-level help ----------------------------------------------------------------------------


def test_top_level_help_lists_plan(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "{fit,validate,test,predict,plan}" in out
    assert any(line.split()[:1] == ["plan"] and "Memory per pipeline stage" in line for line in out.splitlines())
    with pytest.raises(SystemExit) as exit_info:  # a script whose entry point is the class: told where plan is
        LitEfficientCLI(args=["plan"])
    assert exit_info.value.code == 2 and "lit-efficient plan --config" in capsys.readouterr().err
