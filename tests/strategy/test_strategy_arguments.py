"""PACIStrategy refuses every keyword that would do nothing, on each path a user reaches it by (issue 23).

Direct construction, a registered name (``Trainer(strategy="paci")``; the registry passes its init
params), and the command line (``--trainer.strategy.init_args.<typo>`` or the same key in a YAML file):
a misspelt option names the closest one and what passes through to Lightning, a DistributedDataParallel
option says what PACIStrategy does instead, and nothing is built, launched or trained first.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from lit_efficient import PACIStrategy
from lit_efficient.cli.app import LitEfficientCLI
from lit_efficient.runtime.schedules import SCHEDULES
from lit_efficient.strategy.config import PASSED_TO_LIGHTNING, options_of, wrapper_options

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
OPTIONS = options_of(PACIStrategy.__init__)
OWN = [n for n in OPTIONS if n not in PASSED_TO_LIGHTNING]


def typos(name: str) -> list[str]:
    """Three misspellings of ``name``: a letter dropped, the last one dropped, two different letters swapped."""
    mid = len(name) // 2
    i = next(i for i in range(mid, len(name) - 1) if name[i] != name[i + 1])
    return [name[:mid] + name[mid + 1 :], name[:-1], name[:i] + name[i + 1] + name[i] + name[i + 2 :]]


def _refusal(**kwargs) -> str:
    with pytest.raises(ValueError) as info:
        PACIStrategy(**kwargs)
    return str(info.value)


def _assert_lists_what_is_accepted(message: str) -> None:
    assert f"PACIStrategy's options: {', '.join(OWN)};" in message
    assert f"passed through to Lightning's DDPStrategy: {', '.join(PASSED_TO_LIGHTNING)}." in message


# -- direct construction ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPTIONS)
def test_a_typo_of_every_option_is_refused_naming_the_option_meant(name):
    for typo in typos(name):
        assert typo not in OPTIONS
        message = _refusal(**{typo: 1})
        assert f"{typo}=1: not an option of PACIStrategy; did you mean {name}?" in message
        _assert_lists_what_is_accepted(message)


def test_the_issue_example_is_refused_with_every_bad_keyword_in_one_message():
    # The issue's example named checkpoint_format (an option since issue 19) and fault_tolerance (one since issue
    # 32); elastic is none.
    message = _refusal(pipeline_stages=2, pipline_stage=4, elastic="restart")
    assert "pipline_stage=4: not an option of PACIStrategy; did you mean pipeline_stages?" in message
    assert "elastic='restart': not an option of PACIStrategy\n" in message  # nothing close: no guess
    _assert_lists_what_is_accepted(message)
    assert "DistributedDataParallel" not in message  # no wrapper option among them: no wrapper story


@pytest.mark.parametrize("name", wrapper_options())
def test_ddp_wrapper_options_say_what_paci_does_instead(name):
    message = _refusal(**{name: None})
    assert f"{name}=None: configures Lightning's DistributedDataParallel wrapper, never built here;" in message
    assert "reduces gradients per stage instead" in message and "data-parallel replica group" in message
    assert "lit_efficient/strategy/step_hooks.py" in message  # where the reduction lives
    _assert_lists_what_is_accepted(message)


@pytest.mark.parametrize(
    ("name", "equivalent"),
    [
        ("find_unused_parameters", "none needed: a stage gives parameters that got no gradient zeros"),
        ("static_graph", "none needed: a stage's gradients go in one flat all-reduce per dtype"),
        ("bucket_cap_mb", "no buckets"),
        ("model_averaging_period", "local_sgd_steps=H"),
        ("ddp_comm_state", "PostLocalSGDState: local_sgd_steps=H"),
        ("ddp_comm_hook", "none for compression hooks"),
        ("mixed_precision", "Trainer(precision='bf16-mixed')"),
        ("broadcast_buffers", "average_buffers=True"),
        ("gradient_as_bucket_view", "no buckets"),
    ],
)
def test_ddp_wrapper_options_name_their_equivalent(name, equivalent):
    line = next(line for line in _refusal(**{name: True}).splitlines() if line.startswith(f"  - {name}="))
    assert equivalent in line.split("; equivalent: ", 1)[1]


def test_checkpoint_io_is_refused_as_never_called():
    message = _refusal(checkpoint_io=object())
    assert "checkpoint_io=<object" in message and "never calls a CheckpointIO" in message


@pytest.mark.parametrize("devices", [1, 2])
def test_a_checkpoint_io_plugin_is_refused_before_training_not_ignored(devices, tmp_path):
    """``Trainer(plugins=[CheckpointIO])`` reaches the strategy past its constructor: refused at fit, before any
    process starts or any step runs, in one process and on processes alike."""
    from lightning.pytorch.plugins import AsyncCheckpointIO

    from lit_efficient.models import GPT

    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=PACIStrategy(pipeline_stages=2), plugins=[AsyncCheckpointIO()],
        max_steps=1, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
    )  # fmt: skip
    model = GPT(n_layer=2, n_head=2, n_embd=16, block_size=8)
    refused = r"plugins=\[AsyncCheckpointIO\(\.\.\.\)\]\) would be ignored.*async_checkpoint=True"
    with pytest.raises(ValueError, match=refused):
        trainer.fit(model, train_dataloaders=[(torch.zeros(2, 8, dtype=torch.long),) * 2])
    assert trainer.global_step == 0


@pytest.mark.parametrize(
    "strategy_kw, devices, n_layer, refused",
    [
        ({"pipeline_stages": 2, "balance": [1, 1]}, 2, 2,
         r"PACIStrategy\(balance=\[1, 1\]\) sums to 2 layers, but pipeline_layers\(\) has 4 \(GPTEmbedding, 2 x Block, "
         r"GPTHead\): make the counts add up to 4"),
        ({"pipeline_stages": 4}, 4, 1,
         r"pipeline_stages=4\) exceeds the 3 layers of pipeline_layers\(\) \(GPTEmbedding, Block, GPTHead\): use at "
         "most 3 stages"),
    ],
)  # fmt: skip
def test_a_split_that_does_not_fit_the_layers_is_refused_before_any_rank_starts(
    monkeypatch, tmp_path, strategy_kw, devices, n_layer, refused
):
    """Refused in setup, it was one traceback per rank and the failure summary (the same message five times at
    S=2); the launching process now counts the layers (the module's, built before setup unless configure_model
    builds them)."""
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    from lit_efficient.models import GPT

    def launched(*args, **kwargs):
        raise AssertionError("a rank was started before the refusal")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", launched)  # the default: popen
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=PACIStrategy(**strategy_kw), max_steps=1,
        default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
    )  # fmt: skip
    model = GPT(n_layer=n_layer, n_head=2, n_embd=16, block_size=8)
    with pytest.raises(ValueError, match=refused):
        trainer.fit(model, train_dataloaders=[(torch.zeros(2, 8, dtype=torch.long),) * 2])


class _Launched(Exception):
    """Raised in place of starting the ranks: the checks before the launch passed."""


def test_a_module_building_its_layers_in_setup_is_counted_after_the_launch(monkeypatch, tmp_path):
    """Lightning's docs build layers in setup(), which runs on the ranks: the launching process's count of the
    layers (above) raised that module's AttributeError before any rank started; it leaves the count to setup."""
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    from lit_efficient.models import GPT

    class LateGPT(GPT):
        def __init__(self):
            super().__init__(n_layer=2, n_head=2, n_embd=16, block_size=8)
            self._blocks = self.blocks
            del self.blocks

        def setup(self, stage):
            self.blocks = self._blocks

    def launched(*args, **kwargs):
        raise _Launched

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", launched)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=PACIStrategy(pipeline_stages=2), max_steps=1,
        default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
    )  # fmt: skip
    with pytest.raises(_Launched):
        trainer.fit(LateGPT(), train_dataloaders=[(torch.zeros(2, 8, dtype=torch.long),) * 2])


def test_every_ddp_strategy_parameter_is_passed_through_or_refused():
    # A Lightning release that adds a DDPStrategy parameter fails here until it is sorted into one or the other.
    ddp = [n for n in inspect.signature(DDPStrategy.__init__).parameters if n not in ("self", "kwargs")]
    for name in ddp:
        if name in PASSED_TO_LIGHTNING:
            assert name in OPTIONS, name
        else:
            assert name in wrapper_options() or name == "checkpoint_io", name
            _refusal(**{name: None})
    assert set(PASSED_TO_LIGHTNING) <= set(OPTIONS) and set(PASSED_TO_LIGHTNING) <= set(ddp)


def test_the_passed_through_options_reach_lightning():
    env, plugin = LightningEnvironment(), MixedPrecision("bf16-mixed", "cpu")
    strategy = PACIStrategy(
        parallel_devices=[torch.device("cpu")] * 2, cluster_environment=env, precision_plugin=plugin,
        process_group_backend="gloo", timeout=timedelta(seconds=7),
    )  # fmt: skip
    trainer = L.Trainer(strategy=strategy, logger=False, enable_progress_bar=False)
    s = trainer.strategy
    assert s is strategy and s.cluster_environment is env and s.precision_plugin is plugin
    assert isinstance(trainer.accelerator, CPUAccelerator) and s.num_processes == 2 and trainer.world_size == 2
    assert s.process_group_backend == "gloo" and s._timeout == timedelta(seconds=7)  # init_process_group's
    # Lightning refuses an accelerator object together with parallel_devices: one at a time.
    accelerator = CPUAccelerator()
    trainer = L.Trainer(strategy=PACIStrategy(accelerator=accelerator), devices=2, logger=False)
    assert trainer.accelerator is accelerator and trainer.strategy.accelerator is accelerator


# -- registered names -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_registered_names_build_the_strategy_from_valid_init_params(name):
    assert set(StrategyRegistry[name]["init_params"]) <= set(OPTIONS)
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, PACIStrategy) and trainer.strategy.schedule == name


def test_the_class_name_as_a_string_builds_the_strategy_with_its_defaults():
    """``Trainer(strategy="PACIStrategy")`` and ``--trainer.strategy PACIStrategy`` (the class's name, as --model GPT
    names a model) were Lightning's "invalid strategy name: 'pacistrategy'" in a traceback (the session's own try)."""
    for name in ("PACIStrategy", "lit_efficient.PACIStrategy"):  # the CLI passes the latter on as a string, alone
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
        assert type(trainer.strategy) is PACIStrategy and trainer.strategy.schedule == "paci"


@pytest.fixture
def registered():
    """Register names for one test, as a package registering PACIStrategy with init params would."""
    names: list[str] = []

    def register(**init_params) -> str:
        name = f"paci_test_{len(names)}"
        StrategyRegistry.register(name, PACIStrategy, description="test", **init_params)
        names.append(name)
        return name

    yield register
    for name in names:
        StrategyRegistry.remove(name)


@pytest.mark.parametrize("name", OPTIONS)
def test_a_registered_name_with_a_misspelt_init_param_is_refused_at_trainer_construction(registered, name):
    typo = typos(name)[0]
    strategy = registered(schedule="1f1b_flush", **{typo: 1})
    with pytest.raises(ValueError, match=rf"{typo}=1: not an option of PACIStrategy; did you mean {name}\?"):
        L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)


def test_a_registered_name_with_a_ddp_option_is_refused(registered):
    strategy = registered(find_unused_parameters=True)
    with pytest.raises(ValueError, match="DistributedDataParallel wrapper, never built here"):
        L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)


# -- command line -----------------------------------------------------------------------------------


@pytest.fixture
def cli_refusal(monkeypatch, capsys, tmp_path):
    """Run ``lit-efficient fit --config quickstart.yaml <args>``, expect the parser's refusal, return stderr."""
    monkeypatch.setattr(sys, "argv", ["lit-efficient"])  # LightningCLI warns when args and sys.argv both exist
    root = tmp_path / "root"

    def run(*args: str) -> str:
        with pytest.raises(SystemExit) as exit_info:
            LitEfficientCLI(args=["fit", f"--config={QUICKSTART}", f"--trainer.default_root_dir={root}", *args])
        assert exit_info.value.code == 2  # argparse's usage error
        assert not root.exists() and not (tmp_path / "runs").exists()  # nothing was built, nothing trained
        return capsys.readouterr().err

    monkeypatch.chdir(tmp_path)  # the quickstart's logger would write under ./runs
    return run


@pytest.mark.parametrize("name", OPTIONS)
def test_the_cli_refuses_a_typo_of_every_strategy_option_without_running(cli_refusal, name):
    typo = typos(name)[0]
    err = cli_refusal(f"--trainer.strategy.init_args.{typo}=1")
    assert f"Option '{typo}' is not accepted" in err  # jsonargparse's own refusal
    assert f"  - {typo}: not an option of PACIStrategy; did you mean {name}?" in err
    _assert_lists_what_is_accepted(err)


@pytest.mark.parametrize("given, meant", [("flush", "1f1b_flush"), ("PACI", "paci")])
def test_the_cli_names_the_schedules_when_one_is_misspelt(cli_refusal, given, meant):
    # jsonargparse checks the Literal before the strategy's own "did you mean", inside a dump of the Union it tried.
    err = cli_refusal(f"--trainer.strategy.init_args.schedule={given}")
    assert err.count(f"schedule='{given}' is not one of 'paci', '1f1b_flush'; did you mean '{meant}'?") == 1


def test_the_cli_names_the_closest_key_and_class_of_a_misspelt_config(cli_refusal, tmp_path):
    # A config file's key that is no option, and a callback's class path whose module lacks the name: jsonargparse
    # said neither's closest spelling (the key is checked by the root parser, which holds no --trainer.* option).
    overlay = tmp_path / "typos.yaml"
    overlay.write_text("trainer:\n  max_step: 3\n")
    assert "trainer.max_step: did you mean trainer.max_steps?" in cli_refusal(f"--config={overlay}")
    overlay.write_text("trainer:\n  callbacks:\n    - class_path: lit_efficient.GradientAccumulaton\n")
    err = cli_refusal(f"--config={overlay}")
    assert "lit_efficient.GradientAccumulaton: did you mean lit_efficient.GradientAccumulation?" in err


@pytest.mark.parametrize(
    ("section", "name"),
    [("trainer:\n  strategy:\n    class_path: lit_efficient.PACIStrategy\n    pipeline_stages: 2\n", "PACIStrategy"),
     ("model:\n  class_path: lit_efficient.models.GPT\n  n_layer: 2\n", "GPT")],
)  # fmt: skip
def test_options_beside_class_path_are_told_to_go_under_init_args(cli_refusal, tmp_path, section, name):
    """A section's options written beside ``class_path`` said "PACIStrategy does not accept: class_path" (a
    model's, "GPT has no option 'class_path'"): where the options go is said instead."""
    overlay = tmp_path / "flat.yaml"
    overlay.write_text(section)
    err = cli_refusal(f"--config={overlay}")
    assert f"{name}'s options go under init_args, not beside class_path:" in err, err[-2000:]
    assert "not an option of PACIStrategy" not in err and "has no option 'class_path'" not in err


def test_a_callback_added_twice_is_a_usage_error_naming_where_each_came_from(cli_refusal):
    """checkpointing.yaml's ActivationCheckpointing and ``--trainer.callbacks+=ActivationCheckpointing`` (which
    appends a second) gave Lightning's traceback about state keys of stateful callbacks."""
    err = cli_refusal(
        f"--config={REPO / 'configs' / 'checkpointing.yaml'}", "--trainer.callbacks+=ActivationCheckpointing"
    )
    assert "trainer.callbacks holds ActivationCheckpointing 2 times (a config file's list and" in err, err[-2000:]
    assert "Traceback" not in err


def test_a_misspelt_callback_option_is_named_with_the_closest_one_and_nothing_else(cli_refusal):
    """jsonargparse tries every Callback subclass: Lightning's ``Callback`` itself, which has no options, added
    "Callback has no option 'every_n_train_step': it takes ." after the useful line."""
    err = cli_refusal("--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.init_args.every_n_train_step=5")
    assert "ModelCheckpoint has no option 'every_n_train_step': did you mean 'every_n_train_steps'?" in err
    assert "it takes ." not in err


def test_the_cli_refuses_a_ddp_option_from_a_yaml_file_saying_what_paci_does_instead(cli_refusal, tmp_path):
    overlay = tmp_path / "ddp.yaml"
    overlay.write_text("trainer:\n  strategy:\n    init_args:\n      find_unused_parameters: true\n")
    err = cli_refusal(f"--config={overlay}")
    assert "  - find_unused_parameters: configures Lightning's DistributedDataParallel wrapper" in err
    assert "reduces gradients per stage instead" in err and "lit_efficient/strategy/step_hooks.py" in err


def test_the_cli_refuses_init_args_on_a_registered_name(cli_refusal):
    err = cli_refusal("--trainer.strategy=paci", "--trainer.strategy.init_args.pipeline_stages=2")
    assert 'Parser key "trainer.strategy"' in err  # a name takes no options: spell out the class to set them


def test_the_cli_shows_and_applies_the_passed_through_options_and_no_ddp_option(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["lit-efficient"])
    with pytest.raises(SystemExit):
        LitEfficientCLI(args=["fit", "--trainer.strategy.help", "lit_efficient.PACIStrategy"])
    help_text = capsys.readouterr().out
    for name in OPTIONS:
        assert f"--trainer.strategy.{name} " in help_text, name
    assert not [n for n in wrapper_options() if f"--trainer.strategy.{n} " in help_text]
    assert "--trainer.strategy.checkpoint_io " not in help_text
    args = [
        "--trainer.strategy=lit_efficient.PACIStrategy", "--trainer.strategy.init_args.timeout=0:10:00",
        "--trainer.strategy.init_args.process_group_backend=gloo", "--trainer.logger=false",
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--model.init_args.n_layer=2",
        "--model.init_args.n_embd=32", "--model.init_args.n_head=2", "--data.init_args.max_bytes=20000",
    ]  # fmt: skip
    strategy = LitEfficientCLI(args=args, run=False).trainer.strategy
    assert isinstance(strategy, PACIStrategy)
    assert strategy._timeout == timedelta(minutes=10) and strategy.process_group_backend == "gloo"


@pytest.mark.parametrize(
    ("args", "want"),
    [(["--model.init_args.n_layr=2"], "GPT has no option 'n_layr': did you mean 'n_layer'? it takes vocab_size,"),
     (["--data.init_args.batchsize=2"], "TextDataModule has no option 'batchsize': did you mean 'batch_size'?"),
     (["--trainer.max_step", "5"], "--trainer.max_step: did you mean --trainer.max_steps?")],
    ids=["model-option", "data-option", "abbreviated-flag"],
)  # fmt: skip
def test_the_cli_names_the_option_meant_for_a_typo_anywhere(cli_refusal, args, want):
    """A typo in a model or data option got jsonargparse's bare refusal; ``--trainer.max_step 5`` was silently taken
    as max_steps (argparse's prefix matching): refused now, naming the flag meant."""
    assert want in cli_refusal(*args)


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"recompute": "no"}, "recompute='no'\\) must be True or False"),  # a truthy string switched it on
        ({"streaming_sync": 1, "local_sgd_steps": 4}, "streaming_sync=1\\) must be True or False"),
        ({"pipeline_stages": True}, "pipeline_stages=True must be an integer >= 1"),
        # One test of a count (lit_efficient.checks.is_count): these four took True as 1.
        ({"pipeline_stages": 2, "balance": [True, 1]}, r"balance=\[True, 1\] must list 2 positive layer counts"),
        ({"local_sgd_steps": 4, "local_sgd_warmup_steps": True}, "local_sgd_warmup_steps=True must be an integer"),
        ({"staleness_anneal_steps": True}, "staleness_anneal_steps=True must be an integer >= 1"),
        # A numpy integer is refused too: accepted, it failed in fit (int.bit_length) and in weights-only loading.
        ({"pipeline_stages": __import__("numpy").int64(2)}, r"pipeline_stages=np\.int64\(2\) must be an integer >= 1"),
        (
            {"fault_tolerance": "torchft", "local_sgd_steps": 4, "min_replica_groups": True},
            "min_replica_groups=True must be an integer >= 1",
        ),
        # torchft's group options without it were ignored (a single replica trained), and "replicas" was sent to them.
        ({"replica_groups": 2, "replica_group_id": 1}, r"replica_group_id=1, replica_groups=2: options of fault_tol"),
        ({"min_replica_groups": 2}, r"min_replica_groups=2: options of fault_tolerance='torchft'.*which is off"),
        ({"replicas": 2}, r"replicas=2: data-parallel replicas come from the world size.*raise Trainer\(devices"),
        # Other pipeline libraries' micro-batch options said only "not an option of PACIStrategy".
        ({"chunks": 4}, r"chunks=4: a loader batch is one micro-batch.*Trainer\(accumulate_grad_batches=N\)"),
        ({"n_microbatches": 4}, r"n_microbatches=4: a loader batch is one micro-batch \(its size: the DataLoader"),
        ({"micro_batch_size": 2}, r"micro_batch_size=2: a loader batch is one micro-batch.*GradientAccumulation"),
        ({"start_method": "Spawn"}, "start_method='Spawn' must be one of 'popen', 'spawn', 'fork', 'forkserver'"),
        ({"precision_plugin": "bf16-mixed"}, r"precision_plugin='bf16-mixed' must be a Precision.*Trainer\(precision="),
        ({"timeout": 30}, r"timeout=30 must be a timedelta or None; pass datetime.timedelta"),
        ({"p2p_timeout": "30"}, r"p2p_timeout='30' must be a positive number of seconds"),  # was a TypeError of '>'
        ({"p2p_timeout": True}, r"p2p_timeout=True must be a positive number of seconds"),
        ({"cluster_environment": "slurm"}, "cluster_environment='slurm' must be a ClusterEnvironment or None"),
        # Read before the flags' kinds, a quoted 'false' was taken as True and told to need the sharded format.
        ({"async_checkpoint": "false"}, r"async_checkpoint='false'\) must be True or False \(a string such as"),
        # Refused by torch in every rank after the launch ("Unknown backend type ncll"), or by its socket (0 ms).
        ({"process_group_backend": "ncll"}, r"process_group_backend='ncll' is not a torch.distributed backend: one "),
        ({"timeout": __import__("datetime").timedelta(0)}, r"timeout=datetime.timedelta\(0\) must be positive"),
        ({"parallel_devices": "PACI"}, r"parallel_devices='PACI' must be a list of torch.device or None"),
        # torchft's group options: a string failed at the launch in a comparison, 0.0 and True passed it.
        (
            {"fault_tolerance": "torchft", "local_sgd_steps": 4, "replica_group_id": "1"},
            r"replica_group_id='1'\) must be an integer >= 0",
        ),
        (
            {"fault_tolerance": "torchft", "local_sgd_steps": 4, "replica_groups": True},
            r"replica_groups=True\) must be an integer >= 1",
        ),
        # DiLoCo's rate as a string was a TypeError of '>'; inf and True were taken.
        ({"local_sgd_steps": 4, "outer_optimizer": "nesterov", "outer_lr": "0.1"}, "outer_lr='0.1' must be a number"),
        ({"local_sgd_steps": 4, "outer_optimizer": "nesterov", "outer_lr": float("inf")}, "outer_lr=inf must be a "),
        ({"local_sgd_steps": 4, "outer_optimizer": "nesterov", "outer_momentum": True}, "outer_momentum=True must "),
    ],
)
def test_an_option_of_the_wrong_kind_is_refused_naming_it(kwargs, said):
    """Refused at construction, kinds before any check that reads them: a string flag was truthy; the pass-through
    arguments failed deep in Lightning's DDP machinery, or were dropped (a precision given as a string trained in
    float32) without naming the option."""
    with pytest.raises(ValueError, match=said):
        PACIStrategy(**kwargs)


def test_paci_options_given_with_flush_are_said_to_do_nothing():
    """staleness_correction='lr_scale' or sync_start_steps=10 with schedule='1f1b_flush' were taken in silence (nothing
    is stale under flush): warned, not refused, so a config that switches the schedule alone keeps working."""
    with pytest.warns(UserWarning, match=r"staleness_correction='lr_scale', sync_start_steps=10 with schedule='1f1b_"):
        PACIStrategy(schedule="1f1b_flush", staleness_correction="lr_scale", sync_start_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults, and the values that ask for nothing, say nothing
        PACIStrategy(schedule="1f1b_flush")
        PACIStrategy(schedule="1f1b_flush", staleness_correction=None, sync_start_steps=0)
        PACIStrategy(schedule="paci", staleness_correction="lr_scale", sync_start_steps=10)


def test_torchft_group_settings_known_at_construction_are_checked_there():
    """An index outside the groups given, or a quorum larger than them, passed construction and was refused only at
    setup, after the processes had started; a bad quorum size was told to set local_sgd_steps first."""
    torchft = {"fault_tolerance": "torchft", "local_sgd_steps": 4}
    with pytest.raises(ValueError, match=r"replica_group_id=5 is not one of the 2 replica groups launched \(0\.\.1\)"):
        PACIStrategy(**torchft, replica_group_id=5, replica_groups=2)
    with pytest.raises(ValueError, match="min_replica_groups=3 must be between 1 and the 2 replica groups launched"):
        PACIStrategy(**torchft, min_replica_groups=3, replica_groups=2)
    with pytest.raises(ValueError, match="min_replica_groups=0 must be an integer >= 1"):
        PACIStrategy(fault_tolerance="torchft", min_replica_groups=0)  # before local_sgd_steps is asked for
    assert PACIStrategy(**torchft, replica_group_id=1, replica_groups=2).replica_group_id == 1


def test_a_schedule_named_otherwise_is_refused_naming_the_one_meant():
    """schedule="flush" (the name the docs and BENCHMARKS.md use in prose) said only "not one of paci, 1f1b_flush"."""
    for given, meant in (("flush", "1f1b_flush"), ("1F1B-flush", "1f1b_flush"), ("PACI", "paci")):
        want = f"schedule={given!r} is not one of paci, 1f1b_flush (did you mean {meant!r}?)"
        assert want in _refusal(schedule=given)
    assert _refusal(schedule="gpipe") == "schedule='gpipe' is not one of paci, 1f1b_flush"  # nothing close: no guess


def test_a_config_with_several_options_the_strategy_does_not_take_names_them_all_at_once(cli_refusal, tmp_path):
    """jsonargparse names the first option it refuses: a run's config.yaml saved before PACIStrategy refused
    DDPStrategy's options (every one of them listed, None) took one run per key to clean, 23 runs."""
    old = tmp_path / "saved.yaml"
    old.write_text(
        "trainer:\n  strategy:\n    class_path: lit_efficient.PACIStrategy\n    init_args:\n      pipeline_stages: 2\n"
        "      checkpoint_io: null\n      ddp_comm_hook: null\n      static_graph: false\n"
    )
    err = cli_refusal(f"--config={old}")
    assert err.count("Option 'checkpoint_io' is not accepted") == 1  # jsonargparse's own, the first only
    for name in ("checkpoint_io", "ddp_comm_hook", "static_graph"):
        assert f"\n  - {name}: " in err, name
    said = "Remove these 3 keys from the strategy's init_args at once: checkpoint_io, ddp_comm_hook, static_graph"
    assert said in err


@pytest.mark.parametrize(
    ("precision", "said"),
    [
        ("64-true", "(for weights, gradients and optimizer state in float64, build the model in that dtype, "
         "model.to(torch.float64), and keep precision='32-true'"),
        ("bf16-true", "model.to(torch.bfloat16) or HFCausalLM(dtype='bfloat16'), and keep precision='32-true'"),
        ("scaler", "(float16 with a gradient scaler, on a GPU or as a MixedPrecision plugin with a GradScaler, "
         "which PACIStrategy does not train with; precision='16-mixed' on CPU runs"),
    ],
)  # fmt: skip
def test_an_unsupported_precision_is_refused_with_what_trains_instead(precision, said):
    """64-true was refused without the way that trains exactly (a float64 model under 32-true), and a 16-mixed plugin
    with a GradScaler on CPU was told "a fit on CPU runs it" while this fit on CPU was refused (a precision audit)."""
    from tests.support.gpt_runs import gpt_model, ordered_data

    kwargs = {"precision": precision}
    if precision == "scaler":
        kwargs = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        strategy=PACIStrategy(pipeline_stages=2), **kwargs)  # fmt: skip
    with pytest.raises(ValueError, match="is not supported by PACIStrategy") as refused:
        trainer.fit(gpt_model(), datamodule=ordered_data())
    assert said in str(refused.value), str(refused.value)
