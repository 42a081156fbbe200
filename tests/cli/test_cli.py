"""The `lit-efficient` CLI: help from docstrings, links, saved configs, and an offline W&B run end to end."""

from __future__ import annotations

import inspect
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from lit_efficient import ActivationCheckpointing, GradientAccumulation, PACIStrategy, PipelineMonitor
from lit_efficient.cli.app import _LAST_RESOLVED, LitEfficientCLI, free_path, keep_wandb_local

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
# A single-process GPT small enough that a CLI fit takes a couple of seconds.
TINY = [
    "--model.init_args.n_layer=1", "--model.init_args.n_embd=32", "--model.init_args.n_head=2",
    "--data.init_args.block_size=16", "--data.init_args.batch_size=4", "--data.init_args.max_bytes=20000",
    "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false", "--trainer.limit_val_batches=1", "--trainer.num_sanity_val_steps=0",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-efficient"])  # LightningCLI warns when args and sys.argv both exist


def _cli(*args: str, run: bool = False) -> LitEfficientCLI:
    return LitEfficientCLI(args=list(args), run=run)


def _help(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        _cli(*args, run=True)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


# -- parser -----------------------------------------------------------------------------------------


def test_the_packages_callbacks_are_known_by_their_short_names_without_a_config():
    """``--trainer.callbacks+ ActivationCheckpointing`` failed ("Expected a dot import path string") unless a config
    naming one of them had been read first; Lightning's ModelCheckpoint always worked."""
    names = ("ActivationCheckpointing", "GradientAccumulation", "PipelineMonitor")
    flags = [arg for name in names for arg in ("--trainer.callbacks+", name)]
    # A fresh process, as the console script's: this one has imported the callbacks already.
    command = [sys.executable, "-m", "lit_efficient.cli", "fit", "--model", "GPT", *flags, "--print_config"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert all(f"class_path: lit_efficient.{name}" in done.stdout for name in names), done.stdout


def test_help_comes_from_docstrings(capsys):
    fit = _help(capsys, "fit", "--help")
    assert "--trainer.strategy" in fit and "lit_efficient.PACIStrategy" in fit
    assert "data.block_size --> model.init_args.block_size" in fit  # from the built data module
    assert "data.vocab_size --> model.init_args.vocab_size" in fit
    assert "--optimizer" not in fit and "--lr_scheduler" not in fit  # GPT.configure_optimizers owns them
    model = _help(capsys, "fit", "--model.help", "GPT")
    assert "Attention heads per block" in model
    strategy = _help(capsys, "fit", "--trainer.strategy.help", "lit_efficient.PACIStrategy")
    assert "Number of stages S each pipeline is split into" in strategy
    callback = _help(capsys, "fit", "--trainer.callbacks.help", "lit_efficient.GradientAccumulation")
    assert "Micro-batches per optimizer step" in callback


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test", "predict"])
def test_subcommands(capsys, subcommand):
    assert "--ckpt_path" in _help(capsys, subcommand, "--help")


def test_defaults_are_gpt_text_and_offline_wandb():
    cli = _cli("--trainer.logger=false")
    assert type(cli.model).__name__ == "GPT" and type(cli.datamodule).__name__ == "TextDataModule"
    logger = cli.parser.get_defaults().trainer.logger
    assert logger.class_path.endswith("WandbLogger")
    assert logger.init_args.offline is True and logger.init_args.save_dir == "runs"


def test_short_class_name_and_repeated_configs_compose(tmp_path):
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("model:\n  init_args:\n    n_layer: 3\n")
    cli = _cli("--model=GPT", "--model.n_embd=64", f"--config={QUICKSTART}", f"--config={overlay}")
    assert cli.model.hparams.n_layer == 3  # the overlay, after quickstart's 4
    assert cli.model.hparams.n_embd == 128  # quickstart's, after the flag given before it


def test_data_sizes_feed_the_model(tmp_path):
    cli = _cli("--trainer.logger=false", "--data.init_args.block_size=48")
    assert cli.model.hparams.block_size == 48 == cli.datamodule.block_size
    assert cli.model.hparams.vocab_size == 256
    tokens = tmp_path / "tokens.bin"
    np.array([1, 2, 3, 300, 7] * 40, dtype="<u2").tofile(tokens)
    cli = _cli("--trainer.logger=false", f"--data.init_args.path={tokens}", "--data.init_args.block_size=8")
    assert cli.model.hparams.vocab_size == 301  # scanned from the .bin
    # The data decide: a value given for a link target is replaced by the data's.
    cli = _cli("--trainer.logger=false", "--model.init_args.block_size=64", "--data.init_args.block_size=32")
    assert cli.model.hparams.block_size == 32


# -- saved config ----------------------------------------------------------------------------------


def test_free_path_never_reuses_a_name(tmp_path):
    path = tmp_path / "config.yaml"
    assert free_path(path) == path
    path.write_text("x")
    assert free_path(path) == tmp_path / "config-1.yaml"
    (tmp_path / "config-1.yaml").write_text("y")
    assert free_path(path) == tmp_path / "config-2.yaml"


def test_saved_config_reproduces_the_run_and_never_overwrites_its_input(tmp_path):
    logger = [
        "--trainer.logger=CSVLogger", f"--trainer.logger.save_dir={tmp_path}", "--trainer.logger.name=exp",
        "--trainer.logger.version=v0",
    ]  # fmt: skip
    _cli("fit", *TINY, *logger, "--trainer.max_steps=1", "--seed_everything=7", run=True)
    saved = tmp_path / "exp" / "v0" / "config.yaml"
    text = saved.read_text()
    config = yaml.safe_load(text)
    assert config["seed_everything"] == 7 and config["model"]["init_args"]["n_layer"] == 1
    # GPT and TextDataModule hparams merge without a conflict (vocab_size, block_size) in the logger.
    hparams = yaml.safe_load((tmp_path / "exp" / "v0" / "hparams.yaml").read_text())
    assert hparams["vocab_size"] == 256 and hparams["block_size"] == 16
    assert hparams["config"]["trainer"]["max_steps"] == 1  # the resolved config reaches the logger

    # Resuming from the saved file writes the new run's config beside it, never over it.
    _cli("fit", f"--config={saved}", "--trainer.max_steps=2", run=True)
    assert saved.read_text() == text
    again = yaml.safe_load((tmp_path / "exp" / "v0" / "config-1.yaml").read_text())
    assert again["trainer"]["max_steps"] == 2


def test_wandb_directories_stay_under_save_dir(tmp_path, monkeypatch):
    for var in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_DATA_DIR", "/somewhere/the/user/chose")
    chosen = keep_wandb_local(tmp_path / "runs", offline=True)
    assert set(chosen) == {"WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"}
    for var in chosen:
        assert Path(os.environ[var]).is_relative_to(tmp_path / "runs" / "wandb")
    assert os.environ["WANDB_DATA_DIR"] == "/somewhere/the/user/chose"
    monkeypatch.delenv("WANDB_CONFIG_DIR")
    assert "WANDB_CONFIG_DIR" not in keep_wandb_local(tmp_path, offline=False)  # online keeps user settings


# -- end to end: console script, 2 pipeline ranks, offline W&B -----------------------------------


def wandb_records(path: Path):
    """The protobuf records of an offline run's ``run-<id>.wandb`` log (W&B's LevelDB-style log format).

    wandb >= 0.19 writes offline runs only into this log (no ``wandb-summary.json``/``config.yaml``
    until ``wandb sync``); each 32 KiB block holds chunks ``crc32 | length u16 | type u8 | data``.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run log"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += block - pos % block
            continue
        if pos + 7 + length > len(data):  # a chunk still being written
            return
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_offline_run(run_dir: Path, patience: float = 60.0) -> tuple[dict, list[dict]]:
    """(config, history rows) of an offline W&B run directory, values JSON-decoded, once its log is complete.

    ``wandb.finish()`` and a finished process can return before W&B's service has written the run's last records
    (seen on a loaded machine: the resumed run's rows absent at the read, present a minute later), so the log is
    read again until it ends with the run's ``exit`` record."""
    (log,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + patience
    while not any(record.WhichOneof("record_type") == "exit" for record in wandb_records(log)):
        assert time.monotonic() < deadline, f"{log} has no exit record after {patience:.0f} s: the run never ended"
        time.sleep(0.5)
    config: dict = {}
    history: list[dict] = []
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            # Media (the timeline picture) arrive as nested keys: ("pipeline/timeline", "width"), ...
            history.append(
                {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return config, history


@pytest.mark.multiproc
def test_fit_says_where_its_checkpoint_is_or_that_there_is_none(tmp_path, caplog):
    root = f"--trainer.default_root_dir={tmp_path}"
    with caplog.at_level(logging.INFO):
        _cli("fit", *TINY, root, "--trainer.logger=false", "--trainer.max_steps=1", run=True)
    (saved,) = tmp_path.rglob("*.ckpt")
    assert f"lit-efficient: checkpoint {saved} (resume: --ckpt_path {saved})" in caplog.text
    with pytest.warns(UserWarning, match=r"ended without saving a checkpoint \(no ModelCheckpoint callback\)"):
        _cli("fit", *TINY, root, "--trainer.logger=false", "--trainer.max_steps=1",
             "--trainer.enable_checkpointing=false", run=True)  # fmt: skip
    # One that saves after a validation, in a run shorter than its interval (a shortened quickstart): said so.
    with pytest.warns(
        UserWarning, match=r"none came in this run \(no validation ran: val_check_interval=1\.0, limit_val_batches=1\)"
    ):
        _cli("fit", *TINY, root, "--trainer.logger=false", "--trainer.max_steps=1",
             "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.monitor=val_loss", run=True)  # fmt: skip


@pytest.mark.multiproc
@pytest.mark.command
def test_console_script_quickstart_offline_wandb_run(tmp_path):
    home, runs = tmp_path / "home", tmp_path / "runs"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(home), MPLCONFIGDIR=str(tmp_path / "mpl"), PYTHONUNBUFFERED="1")
    script = shutil.which("lit-efficient")
    command = [script] if script else [sys.executable, "-m", "lit_efficient.cli"]
    command += [
        "fit", f"--config={QUICKSTART}", "--trainer.max_steps=2", "--trainer.val_check_interval=8",
        "--trainer.limit_val_batches=2", "--trainer.log_every_n_steps=1", "--data.init_args.max_bytes=200000",
        "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={runs}",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]

    (run_dir,) = (runs / "wandb").glob("offline-run-*")
    config, history = read_offline_run(run_dir)
    keys = set().union(*history)
    assert {"train_loss", "val_loss", "pipeline/utilization_stage0", "pipeline/bubble_fraction"} <= keys
    assert {"pipeline/drift_max_stage0", "throughput/tokens_per_sec"} <= keys
    assert any(key.startswith("pipeline/timeline") for key in keys)  # PipelineMonitor's picture
    assert config["n_layer"] == 4 and config["vocab_size"] == 256  # the model's hparams
    resolved = config["config"]  # the CLI's resolved config
    assert resolved["trainer"]["strategy"]["init_args"]["schedule"] == "paci"
    assert resolved["trainer"]["max_steps"] == 2

    run_id = run_dir.name.rsplit("-", 1)[1]
    own = runs / "lit-efficient" / run_id
    assert yaml.safe_load((own / "config.yaml").read_text())["trainer"]["max_steps"] == 2
    last = (own / "checkpoints" / "last.ckpt").resolve()  # what a restart's --ckpt_path last finds
    (best,) = [p.resolve() for p in (own / "checkpoints").glob("*.ckpt") if p.name != "last.ckpt"]
    assert f"lit-efficient: checkpoint {best} (resume: --ckpt_path {last})" in done.stdout + done.stderr
    assert (own / "pipeline_timeline.png").is_file() and (own / "pipeline_timeline.json").is_file()
    # Nothing from W&B outside save_dir: its cache and logs were pointed under runs/wandb.
    assert not [p for p in home.rglob("*") if "wandb" in str(p.relative_to(home)).lower()]


# -- README ----------------------------------------------------------------------------------------


def test_readme_keeps_the_setup_commands_and_documents_every_option():
    text = (REPO / "README.md").read_text()
    assert "pip install torch==2.13.0 && pip install -e . && lit-efficient fit --config configs/quickstart.yaml" in text
    assert 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest\n' in text  # CI runs it
    options = (REPO / "docs" / "cli.md").read_text()  # the option tables live on the command-line page
    for cls in (PACIStrategy, GradientAccumulation, ActivationCheckpointing, PipelineMonitor):
        section = options.split(f"### `{cls.__name__}`\n", 1)[1].split("\n#", 1)[0]
        for name, param in inspect.signature(cls.__init__).parameters.items():
            if name != "self":
                row = f"| `**{name}` |" if param.kind is param.VAR_KEYWORD else f"| `{name}` |"
                assert row in section, f"docs/cli.md's {cls.__name__} table lacks {name}"


@pytest.mark.parametrize(
    ("env", "want"),
    [({"TORCHELASTIC_RUN_ID": "job/7"}, "torchrun-job-7"), ({"SLURM_JOB_ID": "4242"}, "slurm-4242"),
     ({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1"}, "slurm-4242-1"),  # two srun steps: two runs
     ({"TORCHELASTIC_RUN_ID": "none"}, None), ({}, None)],
)  # fmt: skip
def test_every_attempt_of_a_restartable_job_logs_to_one_wandb_run_and_checkpoint_folder(env, want, monkeypatch):
    """A restarted torchrun/SLURM attempt must find the checkpoints of the one before: they live under the
    W&B run's id (<save_dir>/<project>/<id>/checkpoints), which is one id per job, not a fresh one per launch."""
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    logger = _cli("--trainer.logger.init_args.save_dir=runs-test").trainer.logger
    assert logger.version == want and logger._wandb_init["id"] == want
    assert logger._wandb_init["resume"] == ("allow" if want else None)
    given = _cli("--trainer.logger.init_args.save_dir=runs-test", "--trainer.logger.init_args.id=mine").trainer.logger
    assert given.version == "mine"  # the user's own id wins


@pytest.fixture
def wandb_in_this_process(monkeypatch):
    """W&B started in the test process, ended after the test whatever happens: no run left open for a later
    WandbLogger to attach to, no service left running, and the variables it and the CLI set undone."""
    import wandb

    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR",
                "WANDB_MODE", "WANDB_SERVICE"):  # fmt: skip
        monkeypatch.setenv(var, "")  # registered, so monkeypatch restores it (or its absence) after the test
        monkeypatch.delenv(var)
    yield wandb
    wandb.finish()
    wandb.teardown()


def test_a_resumed_offline_run_continues_its_chart_in_a_second_folder_of_the_same_run(
    tmp_path, monkeypatch, wandb_in_this_process
):
    """A user's day with the default offline W&B: fit, then resume with ``--ckpt_path last``. The resumed launch
    writes a second offline folder of the same run id, whose rows continue the chart's step axis
    (trainer/global_step, what W&B plots every metric against) where the first folder's end, in the one
    checkpoint folder of that run."""
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", _LAST_RESOLVED):
        monkeypatch.setenv(var, "")  # registered: put back as found after the test
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    run = [*TINY, "--trainer.strategy=lit_efficient.PACIStrategy", "--trainer.strategy.pipeline_stages=2",
           "--trainer.log_every_n_steps=1", "--trainer.val_check_interval=2", "--model.init_args.warmup_steps=1",
           "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.save_last=true"]  # fmt: skip
    _cli("fit", *run, "--trainer.max_steps=2", run=True)
    wandb_in_this_process.finish()  # as the first launch's process ends
    (last,) = (tmp_path / "runs" / "lit-efficient").glob("*/checkpoints/last.ckpt")
    _cli("fit", *run, "--trainer.max_steps=4", "--ckpt_path=last", run=True)  # the run's last.ckpt, found
    wandb_in_this_process.finish()  # its log is complete once the run ends
    first, resumed = sorted((tmp_path / "runs" / "wandb").glob("offline-run-*"))
    run_id = last.parents[1].name
    assert f"-{run_id}" in first.name and f"-{run_id}" in resumed.name  # W&B may add "-1" to a name taken
    steps = [
        [row["trainer/global_step"] for row in read_offline_run(d)[1] if "train_loss" in row] for d in (first, resumed)
    ]
    assert steps == [[0, 1], [2, 3]]
    assert [p.name for p in (tmp_path / "runs" / "lit-efficient").iterdir()] == [run_id]


def test_a_run_resumed_from_its_checkpoint_continues_its_wandb_run(monkeypatch, tmp_path):
    """``--ckpt_path <save_dir>/<project>/<run id>/checkpoints/last.ckpt`` started a new W&B run beside the one
    that wrote the checkpoint: the chart of a resumed run began again at its first logged step."""
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(LitEfficientCLI, "_run_subcommand", lambda self, subcommand: None)  # built, not fitted
    monkeypatch.chdir(tmp_path)
    for path in ("runs-test/lit-efficient/1x2y3z/checkpoints/last.ckpt", "elsewhere/model.ckpt",
                 "r/p/1x2y3z/checkpoints/a.ckpt"):  # fmt: skip
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        torch.save({}, tmp_path / path)

    def logger(*args: str):
        return _cli("fit", "--trainer.logger.init_args.save_dir=runs-test", *args, run=True).trainer.logger

    resumed = logger("--ckpt_path=runs-test/lit-efficient/1x2y3z/checkpoints/last.ckpt")
    assert resumed._wandb_init["id"] == "1x2y3z" and resumed._wandb_init["resume"] == "allow"
    for other in ("last", "elsewhere/model.ckpt"):  # no run to continue: a new one, as before
        assert logger(f"--ckpt_path={other}")._wandb_init.get("id") is None
    assert logger("--trainer.logger.init_args.id=mine", "--ckpt_path=r/p/1x2y3z/checkpoints/a.ckpt").version == "mine"
    # an evaluation of that checkpoint is a run of its own: it reopened the training run and rewrote its config
    checkpoint = "--ckpt_path=runs-test/lit-efficient/1x2y3z/checkpoints/last.ckpt"
    evaluated = _cli("validate", "--trainer.logger.init_args.save_dir=runs-test", checkpoint, run=True).trainer.logger
    assert evaluated._wandb_init.get("id") is None


def test_ckpt_path_last_launched_by_hand_resumes_the_newest_run_of_its_model(tmp_path, monkeypatch):
    """Each launch by hand is a W&B run with a checkpoint folder of its own, so Lightning's "last" found nothing
    there and trained from scratch, only warning. It is the newest last checkpoint of the project's runs of the
    same model class (another model's run, newer, is not resumed: the shipped configs share one project), and the
    W&B run is that run; the ranks a launch starts take its pick. A ModelCheckpoint dirpath of the user's, or a run
    id of theirs: Lightning's own "last"."""
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", _LAST_RESOLVED):
        monkeypatch.setenv(var, "")  # registered: put back as found after the test
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(LitEfficientCLI, "_run_subcommand", lambda self, subcommand: None)  # built, not fitted
    project = tmp_path / "runs" / "lit-efficient"
    assert _cli("fit", "--ckpt_path=last", run=True).config.fit.ckpt_path == "last"  # nothing yet: a fresh run
    # An evaluation of nothing: refused (it evaluated an untrained model and exited 0), naming the fix.
    with pytest.raises(SystemExit) as refused:
        _cli("validate", "--ckpt_path=last", run=True)
    assert refused.value.code == 2
    # Newer runs of the same model on other data (another data class; the same class on another text or block) are
    # other experiments: their weights failed to load with a size mismatch, or continued another experiment.
    tokens = {"class_path": "lit_efficient.data.TokenizedDataModule", "init_args": {"tokenizer": "tok"}}
    text = {"class_path": "lit_efficient.data.TextDataModule", "init_args": {"path": "mine.txt", "block_size": 256}}
    block = {"class_path": "lit_efficient.data.TextDataModule", "init_args": {"path": None, "block_size": 8}}
    runs = (("old111", 100, "lit_efficient.models.gpt.GPT", None), ("new222", 10, "lit_efficient.models.GPT", None),
            ("llama3", 5, "lit_efficient.models.HFCausalLM", None), ("nolast4", 1, "lit_efficient.models.GPT", None),
            ("tokens5", 2, "lit_efficient.models.GPT", tokens), ("text6", 3, "lit_efficient.models.GPT", text),
            ("block7", 4, "lit_efficient.models.GPT", block))  # fmt: skip
    for run, age, model, data in runs:
        folder = project / run / "checkpoints"
        folder.mkdir(parents=True)
        saved = {"model": {"class_path": model}, **({"data": data} if data else {})}
        (project / run / "config.yaml").write_text(yaml.safe_dump(saved))
        torch.save({}, folder / ("epoch=0-step=2.ckpt" if run == "nolast4" else "last.ckpt"))
        for path in folder.iterdir():
            os.utime(path, (path.stat().st_mtime - age,) * 2)
    newest = str(Path("runs/lit-efficient/new222/checkpoints/last.ckpt"))
    cli = _cli("fit", "--ckpt_path=last", run=True)
    assert cli.config.fit.ckpt_path == newest and os.environ[_LAST_RESOLVED] == f"{os.getpid()}:{newest}"
    assert cli.trainer.logger._wandb_init["id"] == "new222" and cli.trainer.logger._wandb_init["resume"] == "allow"
    assert _cli("validate", "--ckpt_path=last", run=True).config.validate.ckpt_path == newest  # it found none either
    older = str(project / "old111" / "checkpoints" / "last.ckpt")  # of the same class, spelt by its module's path
    monkeypatch.setenv(_LAST_RESOLVED, f"{os.getppid()}:{older}")  # a rank the launch started: its launcher's pick
    assert _cli("fit", "--ckpt_path=last", run=True).config.fit.ckpt_path == older
    monkeypatch.setenv(_LAST_RESOLVED, f"{os.getpid()}:{older}")  # this process's earlier launch: not this one's
    assert _cli("fit", "--ckpt_path=last", run=True).config.fit.ckpt_path == newest
    own = _cli("fit", "--ckpt_path=last", "--trainer.callbacks+=ModelCheckpoint",
               f"--trainer.callbacks.dirpath={tmp_path / 'mine'}", run=True)  # fmt: skip
    assert own.config.fit.ckpt_path == "last" and own.trainer.logger._wandb_init.get("id") is None
    named = _cli("fit", "--ckpt_path=last", "--trainer.logger.init_args.id=mine", run=True)
    assert named.config.fit.ckpt_path == "last"
    (project / "new222" / "checkpoints" / "last.ckpt").unlink()  # the old run's pick is the newest of its class now
    os.utime(project / "old111" / "checkpoints" / "last.ckpt")
    assert _cli("fit", "--ckpt_path=last", run=True).config.fit.ckpt_path == older.replace(str(tmp_path) + "/", "")
    monkeypatch.setenv("HOME", str(tmp_path))  # a save_dir under ~ (a YAML value): one folder for every writer
    home = _cli("fit", "--trainer.logger.init_args.save_dir=~/runs", "--ckpt_path=last", run=True)
    assert home.trainer.logger.save_dir == str(tmp_path / "runs") and home.config.fit.ckpt_path == older


def test_any_lightning_data_module_goes_through_the_cli(tmp_path, monkeypatch):
    """``--data mymodule.TokenDM`` (a LightningDataModule yielding token batches) was refused: "Import path does not
    correspond to a subclass of TextDataModule". The data's sizes reach the model where the data have them."""
    (tmp_path / "users_data.py").write_text(
        "import torch, lightning as L\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "class TokenDM(L.LightningDataModule):\n"
        "    def __init__(self, n: int = 64):\n"
        "        super().__init__()\n"
        "        self.n = n\n"
        "    def train_dataloader(self):\n"
        "        x = torch.randint(0, 256, (self.n, 17))\n"
        "        return DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4, drop_last=True)\n"
        "class SizedDM(TokenDM):\n"
        "    vocab_size = 1000\n"
        "    block_size = 16\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    plain = _cli("--data=users_data.TokenDM", "--data.init_args.n=32", "--trainer.logger=false")
    assert type(plain.datamodule).__name__ == "TokenDM" and plain.datamodule.n == 32
    assert (plain.model.hparams.vocab_size, plain.model.hparams.block_size) == (256, 256)  # the model's own
    sized = _cli("--data=users_data.SizedDM", "--trainer.logger=false", "--model.init_args.n_layer=1")
    assert (sized.model.hparams.vocab_size, sized.model.hparams.block_size) == (1000, 16)  # linked from the data


def test_a_class_chosen_over_the_default_keeps_its_own_defaults(tmp_path, monkeypatch, capsys):
    """jsonargparse carried the default classes' init_args into the class chosen instead wherever it takes the same
    name (jsonargparse issue 460): a data module of the user's own got TextDataModule's batch_size 16, seed 42 and
    block_size 256 over its own defaults, and HFCausalLM GPT's vocab_size and block_size 256 (refused as "the data
    have vocab_size=256" with data that have none), silently; --print_config showed the same."""
    (tmp_path / "own_data.py").write_text(
        "import lightning as L\n"
        "class OwnDM(L.LightningDataModule):\n"
        "    def __init__(self, batch_size: int = 3, seed: int = 7, block_size: int = 16):\n"
        "        super().__init__()\n"
        "        self.save_hyperparameters()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    own = _cli("--data=own_data.OwnDM", "--trainer.logger=false", "--model.init_args.n_layer=1")
    own_sizes = {k: own.datamodule.hparams[k] for k in ("batch_size", "seed", "block_size")}
    assert own_sizes == {"batch_size": 3, "seed": 7, "block_size": 16}
    given = _cli("--data=own_data.OwnDM", "--data.batch_size=16", "--trainer.logger=false", "--model.n_layer=1")
    assert given.datamodule.hparams["batch_size"] == 16  # given: kept
    before = _cli("--data.batch_size=5", "--data=own_data.OwnDM", "--trainer.logger=false", "--model.n_layer=1")
    assert before.datamodule.hparams["batch_size"] == 5  # given before the class is named: kept too
    printed = _help(capsys, "fit", "--data=own_data.OwnDM", "--print_config")
    assert "batch_size: 3\n    seed: 7\n    block_size: 16" in printed
    llama = '{"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32, ' \
            '"num_attention_heads": 2, "vocab_size": 97}'  # fmt: skip
    hf = _cli("--model=HFCausalLM", f"--model.model={llama}", "--data=own_data.OwnDM", "--trainer.logger=false")
    assert hf.model.model.config.vocab_size == 97
    assert "vocab_size" not in hf.model.hparams and "block_size" not in hf.model.hparams  # none given: the model's


@pytest.mark.parametrize("module", ["lit_efficient.cli", "lit_efficient"])
def test_python_dash_m_names_the_command_as_the_console_script_does(module):
    """The docs launch ``python -m lit_efficient.cli`` under torchrun and srun: its usage and its refusals' hints
    said ``__main__.py fit ...``, a command nobody can run. ``python -m lit_efficient`` is the same command (it was
    "No module named lit_efficient.__main__", a W&B audit's first try)."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
         "--trainer.strategy.init_args.p2p_timeout", "-1"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "lit-efficient: error: trainer.strategy (lit_efficient.PACIStrategy): p2p_timeout=-1.0" in proc.stderr
    assert "(its options: lit-efficient fit --trainer.strategy.help" in proc.stderr and "__main__" not in proc.stderr


def test_an_evaluation_of_a_checkpoint_without_its_config_builds_the_checkpoints_model(
    monkeypatch, tmp_path, caplog, capsys
):
    """Lightning builds the model from the checkpoint's hyper-parameters, and the links (the data decide the model's
    block_size and vocab_size) then replaced them with the data module's defaults: ``validate --model GPT --ckpt_path
    ...`` of a 16-token model built a 256-token one, whose load failed in a traceback per rank (a CLI audit)."""
    from lit_efficient.models import GPT

    monkeypatch.setattr(LitEfficientCLI, "_run_subcommand", lambda self, subcommand: None)  # built, not evaluated
    monkeypatch.chdir(tmp_path)
    trained = GPT(n_layer=1, n_embd=32, n_head=2, block_size=16)
    torch.save({"hyper_parameters": dict(trained.hparams), "state_dict": trained.state_dict()}, tmp_path / "run.ckpt")
    with caplog.at_level("INFO"):
        cli = _cli("validate", "--model=GPT", "--trainer.logger=false", "--data.init_args.max_bytes=20000",
                   "--ckpt_path=run.ckpt", run=True)  # fmt: skip
    assert cli.model.hparams.block_size == 16 == cli.datamodule.block_size and cli.model.hparams.n_embd == 32
    cli.model.load_state_dict(torch.load(tmp_path / "run.ckpt")["state_dict"])  # the shapes of the checkpoint's
    assert "--data.init_args.block_size 16, the checkpoint's model's (was 256)" in caplog.text
    # A value the user gave is no default to replace: refused, with both values and the fix (the review).
    with pytest.raises(SystemExit) as exit_info:
        _cli("validate", "--model=GPT", "--trainer.logger=false", "--data.init_args.block_size=8",
             "--ckpt_path=run.ckpt", run=True)  # fmt: skip
    assert exit_info.value.code == 2
    assert (
        "--data.init_args.block_size 8 differs from the checkpoint's model's block_size=16" in capsys.readouterr().err
    )


def test_an_evaluation_of_a_sharded_checkpoint_without_its_config_builds_the_checkpoints_model(
    monkeypatch, tmp_path, caplog, capsys
):
    """Lightning reads a checkpoint's hyper-parameters from a file only: ``validate --model GPT --ckpt_path
    FOLDER`` of a sharded checkpoint built the CLI's default GPT (4 layers, 256 tokens), whose load of a 2-layer
    16-token folder failed, where the same checkpoint as a file evaluated (one checkpoint path, both formats)."""
    from lightning.pytorch import Trainer

    from lit_efficient import PACIStrategy
    from lit_efficient.data import TextDataModule
    from lit_efficient.models import GPT

    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      strategy=PACIStrategy(pipeline_stages=2, checkpoint_format="sharded"))  # fmt: skip
    trained = GPT(n_layer=2, n_embd=32, n_head=2, block_size=16)  # in process: no process group left behind
    trainer.fit(trained, datamodule=TextDataModule(block_size=16, batch_size=2, max_bytes=20_000))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    assert (tmp_path / "run.ckpt").is_dir()
    monkeypatch.setattr(LitEfficientCLI, "_run_subcommand", lambda self, subcommand: None)  # built, not evaluated
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("INFO"):
        cli = _cli("validate", "--model=GPT", "--trainer.logger=false", "--data.init_args.max_bytes=20000",
                   "--trainer.strategy=paci", "--ckpt_path=run.ckpt", run=True)  # fmt: skip
    assert cli.model.hparams.n_layer == 2 and cli.model.hparams.n_embd == 32
    assert cli.model.hparams.block_size == 16 == cli.datamodule.block_size
    assert cli.config.validate.ckpt_path == "run.ckpt"  # the folder is what the strategy loads
    assert "--data.init_args.block_size 16, the checkpoint's model's (was 256)" in caplog.text
    # Lightning's own strategies open a folder as a file (IsADirectoryError in a traceback): said, with the fixes.
    with pytest.raises(SystemExit) as exit_info:
        _cli("validate", "--model=GPT", "--trainer.logger=false", "--ckpt_path=run.ckpt", run=True)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--ckpt_path run.ckpt is a sharded checkpoint folder, which PACIStrategy reads and Lightning's DDP" in err
    assert "add --trainer.strategy paci" in err and "consolidate_checkpoint run.ckpt" in err
    # Only where the strategy opens it as a file: FSDP's and model-parallel folders hold a meta.pt too, and those
    # strategies read them (refusing them broke their resumes, the diff review); DeepSpeed keeps its own.
    from jsonargparse import Namespace

    from lit_efficient.cli.app import _reads_files_only

    named = {"auto": True, "ddp_spawn": True, "single_device": True, "fsdp": False, "deepspeed_stage_2": False,
             "paci": False, "1f1b_flush": False}  # fmt: skip
    for strategy, files_only in named.items():
        assert _reads_files_only(Namespace(strategy=strategy)) is files_only, strategy
    for class_path, files_only in (("lightning.pytorch.strategies.FSDPStrategy", False),
                                   ("lightning.pytorch.strategies.DeepSpeedStrategy", False),  # a DDP subclass
                                   ("lightning.pytorch.strategies.DDPStrategy", True),
                                   ("lit_efficient.PACIStrategy", False)):  # fmt: skip
        assert _reads_files_only(Namespace(strategy=Namespace(class_path=class_path))) is files_only, class_path
