"""The ``lit-efficient`` command line: LightningCLI over any model and data module (`GPT` and `TextDataModule` by
default), with W&B kept local.

This file owns the CLI's wiring and nothing else: which classes it exposes (any LightningModule, such as `GPT`,
`HFCausalLM` or a user's own, language model or not, and any LightningDataModule, such as `TextDataModule` or
`TokenizedDataModule`; GPT and TextDataModule by default), the links that keep the data and the model consistent
(``data.block_size`` and ``data.vocab_size`` feed the model's, where the data module has them), the default
logger (W&B, offline, under ``runs/``; one run id for every attempt of a torchrun or SLURM job, so a
restart continues its chart and finds its checkpoints), where W&B may write, and where the resolved run
config is saved. Every option's help text comes from the docstrings of the classes it configures.

    lit-efficient fit --config configs/quickstart.yaml
    lit-efficient fit --config configs/quickstart.yaml --config configs/flush.yaml   # overlays compose
    lit-efficient fit --model GPT --model.n_layer 2 --trainer.max_steps 50
    lit-efficient fit --config configs/quickstart.yaml --print_config                # resolved config
    python -m lit_efficient.cli fit ...                                             # the same, e.g. under srun
    lit-efficient plan --config configs/gpt2_medium_8stage_paci.yaml --device-memory 80GiB  # memory per stage

Multi-process strategies re-run this command once per rank (``PACIStrategy(start_method="popen")``,
torchrun, SLURM): every rank parses the same arguments and builds the same model from the same seed.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml
from jsonargparse import ArgumentParser, Namespace
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy, XLAStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_efficient.callbacks import (  # noqa: F401 - known to --trainer.callbacks+ by name, as ModelCheckpoint is
    ActivationCheckpointing,
    GradientAccumulation,
    PipelineMonitor,
)
from lit_efficient.checkpoint.sharded_write import META
from lit_efficient.checks import closest_choice
from lit_efficient.models import GPT, HFCausalLM  # noqa: F401 - HFCausalLM: known to --model by name
from lit_efficient.strategy import PACIStrategy  # importing it registers the names "paci" and "1f1b_flush"
from lit_efficient.strategy.config import (
    CheckpointNotFound,
    RefusedSetting,
    check_checkpoint_path,
    explain_refused,
    is_checkpoint_keyword,
    options_of,
    refusal_footer,
)
from lit_efficient.strategy.runs import free_path, restartable_job_id, run_dir

DEFAULT_SAVE_DIR = "runs"
_LAST_RESOLVED = "LIT_EFFICIENT_LAST_CHECKPOINT"  # what "last" resolved to, for the ranks the launch starts
WANDB_PROJECT = "lit-efficient"
# W&B's own directories besides the run directory (`dir=save_dir`), relative to `<save_dir>/wandb`.
# Without them wandb writes debug logs and caches into the user's home even for an offline run.
_WANDB_DIRS = {"WANDB_CACHE_DIR": ".cache", "WANDB_DATA_DIR": ".data"}
_WANDB_OFFLINE_DIRS = {"WANDB_CONFIG_DIR": ".config"}  # online runs keep reading the user's settings
# The classes `lit-efficient fit` builds when none is named; parse_arguments keeps their init_args out of another's.
DEFAULT_CLASSES = {"model": "lit_efficient.models.GPT", "data": "lit_efficient.data.TextDataModule"}
# `lit-efficient plan` runs before LightningCLI (lit_efficient.cli.main); its line in `lit-efficient --help`.
PLAN_HELP = "Memory per pipeline stage of a config and whether it fits a device; trains nothing (plan --help)"


class RunConfigCallback(SaveConfigCallback):
    """Saves the resolved run config next to the run's checkpoints and logs it to the run's logger.

    The file goes to ``<save_dir>/<name>/<version>/config.yaml`` (the directory Lightning gives the
    run's ``checkpoints/``; ``<default_root_dir>`` without a logger). Unless ``overwrite=True`` it
    never overwrites anything: when that name is taken (a resumed run, or a run started from that very
    file) it writes ``config-1.yaml``, ``config-2.yaml``, ... instead. The logger receives the same
    config as a nested ``config`` hyperparameter, so a W&B run carries everything needed to repeat it.
    """

    def __init__(self, parser: LightningArgumentParser, config: Any, **kwargs: Any) -> None:
        kwargs["save_to_log_dir"] = False  # Lightning's copy goes to trainer.log_dir, shared by all W&B runs
        super().__init__(parser, config, **kwargs)
        self.path: Path | None = None

    @override
    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        text = dump_all(self.parser, self.config)
        path = run_dir(trainer) / self.config_filename
        self.path = path if self.overwrite else free_path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(text)
        rank_zero_info(f"lit-efficient: run config saved to {self.path}")
        if trainer.logger is not None:
            trainer.logger.log_hyperparams({"config": yaml.safe_load(text)})


def dump_all(parser: LightningArgumentParser, config: Any) -> str:
    """YAML of `config` with None values kept: a None may differ from the default (``max_bytes: null``)."""
    try:
        return parser.dump(config, skip_unset=False)
    except TypeError:  # jsonargparse < 4.49 spells it skip_none
        return parser.dump(config, skip_none=False)


def keep_wandb_local(save_dir: str | os.PathLike, offline: bool) -> dict[str, str]:
    """Point W&B's cache/data (and, offline, config) directories under ``<save_dir>/wandb``.

    Variables the user already set are left alone. Returns the variables it set. Child processes
    (spawned or re-launched ranks) inherit them.
    """
    base = Path(save_dir).expanduser().resolve() / "wandb"
    wanted = dict(_WANDB_DIRS, **(_WANDB_OFFLINE_DIRS if offline else {}))
    chosen = {var: str(base / sub) for var, sub in wanted.items() if not os.environ.get(var)}
    os.environ.update(chosen)
    return chosen


_ABSENT = object()  # a data module without the argument: nothing to follow


def _data_follow_the_checkpoint(config: Namespace) -> None:
    """Give the data module the checkpoint model's ``block_size`` and ``vocab_size``. Lightning builds the model
    from a checkpoint file's hyper-parameters, and the links (the data decide, the model follows) then replaced
    them with the data module's defaults: ``validate --model GPT --ckpt_path ...`` without the run's config loaded
    a 64-token model as a 256-token one and failed on the position embeddings, in a traceback per rank."""
    path, data = config.get("ckpt_path"), config.get("data")
    hyper_parameters = _hyper_parameters_file(path)
    if hyper_parameters is None or not isinstance(data, Namespace) or data.get("init_args") is None:
        return
    saved = _checkpoint_hyper_parameters(str(hyper_parameters))
    for key in ("block_size", "vocab_size"):
        value, given = saved.get(key), data.init_args.get(key, _ABSENT)
        if value is None or given is _ABSENT or given == value:
            continue
        if given is not None and given != _default_of(data.class_path, key):  # the user's own value: not replaced
            raise ValueError(
                f"--data.init_args.{key} {given} differs from the checkpoint's model's {key}={value} ({path}): the "
                f"data decide the model's {key}, and that model's weights are for {value}. Leave it out (the "
                f"checkpoint's is taken), or give {value}."
            )
        data.init_args[key] = value
        if given is not None:  # None: the data would derive it; said only where a default is replaced
            rank_zero_info(f"lit-efficient: --data.init_args.{key} {value}, the checkpoint's model's (was {given})")


def _hyper_parameters_file(path: Any) -> Path | None:
    """The file that holds a checkpoint's hyper-parameters: the checkpoint itself, or a sharded folder's ``meta.pt``
    (Lightning's part of it); None for anything else ("last", a missing path)."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    path = Path(path)
    if path.is_file():
        return path
    return path / META if (path / META).is_file() else None


def _reads_files_only(trainer: Any) -> bool:
    """Whether the configured trainer's strategy is one of Lightning's that open a checkpoint path as a file (the
    default "auto", DDP and its spawning forms, one device): a sharded folder is then IsADirectoryError in a
    traceback. False for PACIStrategy, for Lightning's strategies with checkpoints of their own (FSDP's and model
    parallel's folders hold a meta.pt too; DeepSpeed's, XLA's) and for anything not known."""
    if not isinstance(trainer, Namespace):
        return False
    strategy = trainer.get("strategy", "auto")
    if strategy is None or isinstance(strategy, str):
        name = (strategy or "auto").lower()
        return name == "auto" or name == "single_device" or name.startswith("ddp")
    cls = _class_at(strategy.get("class_path")) if isinstance(strategy, Namespace) else type(strategy)
    if not isinstance(cls, type) or issubclass(cls, (PACIStrategy, DeepSpeedStrategy, XLAStrategy)):
        return False  # DeepSpeed and XLA subclass DDP and keep checkpoints of their own, as their names do
    return issubclass(cls, (DDPStrategy, SingleDeviceStrategy))


def _checkpoint_hyper_parameters(path: str) -> dict[str, Any]:
    """A checkpoint file's hyper-parameters, memory-mapped: its tensors (GBs of weights and optimizer state) are
    not read, only the pickle that names them (Lightning's own parse just read the whole file). A file of torch's
    legacy format cannot be mapped and is read whole."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # "mmap can only be used with files saved with torch._use_new_zipfile_serialization"
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    return checkpoint.get("hyper_parameters") or {}


def _class_at(class_path: Any) -> Any:
    """The object a config's ``class_path`` names (a class, for what jsonargparse accepted), None where it names
    nothing importable."""
    if not isinstance(class_path, str):
        return None
    module_name, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name, None)
    except (ImportError, ValueError):  # ValueError: a bare name, no module
        return None


def _default_of(class_path: str, key: str) -> Any:
    """The default of ``key`` in the data module class ``class_path``'s constructor (_ABSENT if none or unknown)."""
    cls = _class_at(class_path)
    try:
        parameter = inspect.signature(cls).parameters.get(key) if cls is not None else None
    except (TypeError, ValueError):
        return _ABSENT
    return _ABSENT if parameter is None else parameter.default


def run_id_of_checkpoint(ckpt_path: Any) -> str | None:
    """The W&B run id of a checkpoint saved where the CLI's logger puts them, ``<save_dir>/<project>/<run
    id>/checkpoints/<name>`` (a ``.ckpt`` file or a sharded folder); None for any other path or ``"last"``."""
    if not isinstance(ckpt_path, (str, os.PathLike)) or is_checkpoint_keyword(ckpt_path):
        return None
    folder = Path(ckpt_path).expanduser().parent
    return folder.parent.name or None if folder.name == "checkpoints" else None


# What names a run's data where the model's sizes come from it (the vocabulary, the block) or it is the experiment's
# own text: a run on other data is another experiment, not this one's to resume.
_DATA_IDENTITY = ("path", "tokenizer", "block_size")


def latest_last_checkpoint(project_dir: Path, model_class: str | None, data: Any = None) -> Path | None:
    """The newest ``last`` checkpoint (file, sharded folder or link) under ``<save_dir>/<project>``, in the CLI's
    layout ``<run id>/checkpoints/last*.ckpt``, of a run whose saved ``config.yaml`` trains ``model_class`` on
    ``data`` (the data's class and its path, tokenizer and block size where both configs give them; the shipped
    configs share one project: another model's run, or one on other data, is not this one's to resume: its weights
    failed to load with a size mismatch, or it continued another experiment); None if there is none."""
    found = []
    for path in project_dir.glob("*/checkpoints/last*.ckpt"):
        saved = _saved_config(path.parents[1])
        model = saved.get("model") if isinstance(saved.get("model"), dict) else {}
        if path.exists() and _same_class(model.get("class_path"), model_class) and _same_data(saved.get("data"), data):
            found.append(path)  # a dangling link: out
    return max(found, key=lambda path: (path.stat().st_mtime, str(path)), default=None)


def _same_data(saved: Any, configured: Any) -> bool:
    """Whether a run's saved data section and this launch's name the same data (an unknown side: yes)."""
    if not isinstance(saved, dict) or configured is None:
        return True
    configured = configured.as_dict() if hasattr(configured, "as_dict") else dict(configured)
    ours, theirs = configured.get("class_path"), saved.get("class_path")
    if ours and theirs and not _same_class(str(theirs), str(ours)):
        return False
    mine, given = configured.get("init_args") or {}, saved.get("init_args") or {}
    return all(str(mine[k]) == str(given[k]) for k in _DATA_IDENTITY if k in mine and k in given)


def _same_class(saved: str | None, configured: str | None) -> bool:
    """Whether two class paths name one class (``lit_efficient.models.GPT`` is ``lit_efficient.models.gpt.GPT``)."""
    if saved is None or configured is None:
        return False
    if saved == configured:
        return True
    try:
        first, second = (getattr(importlib.import_module(p.rpartition(".")[0]), p.rpartition(".")[2]) for p in
                         (saved, configured))  # fmt: skip
    except (ImportError, AttributeError, ValueError):
        return False
    return first is second


def _saved_config(run: Path) -> dict:
    """The config the CLI saved for a run (`RunConfigCallback`), or an empty one."""
    try:
        saved = yaml.safe_load((run / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _loggers(config: Any) -> list:
    """The logger entries of a subcommand's parsed config, in order (one, a list, or ``False``: none)."""
    logger = config.trainer.logger
    return [entry for entry in (logger if isinstance(logger, list) else [logger]) if entry]


def _is_wandb(logger: Any) -> bool:
    return str(getattr(logger, "class_path", "")).endswith("WandbLogger")


def _checkpoints_have_a_dirpath(trainer_config: Any) -> bool:
    callbacks = trainer_config.get("callbacks") or []
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
    return any((getattr(cb, "init_args", None) or {}).get("dirpath") for cb in callbacks)


class StrategyOptionParser(LightningArgumentParser):
    """LightningCLI's parser, whose refusals of unknown options name the closest known one.

    jsonargparse refuses a class's ``init_args`` key its signature lacks ("Option 'x' is not accepted") before
    anything is built; this adds the closest option the class has, and for PACIStrategy, for a
    DistributedDataParallel option, what it does instead: the `PACIStrategy(**kwargs)` message. An unrecognized
    flag (``--trainer.max_step``: abbreviations are off, argparse took it for ``max_steps`` silently) gets the
    closest flag of the parser.

    A value a class's constructor refuses (``--trainer.strategy.init_args.p2p_timeout -1``) is a usage error too:
    a line that names the section, the class and the constructor's own message, and one saying where the class's
    options are listed. jsonargparse folds that error into its own (for a Union type, among every subtype's) and
    raises it from its frames, which hides both. Any other error keeps its traceback; ``JSONARGPARSE_DEBUG=true``
    keeps it for these too.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refused: list[tuple[type, dict[str, Any], Exception]] = []  # what constructors refused, this parse
        self.subcommands_action: Any = None

    @override
    def add_subcommands(self, *args: Any, **kwargs: Any) -> Any:
        self.subcommands_action = super().add_subcommands(*args, **kwargs)  # where `plan` is listed
        return self.subcommands_action

    @override
    def add_instantiator(
        self, instantiator: Any, class_type: Any, subclasses: bool = True, prepend: bool = False
    ) -> None:
        # LightningCLI's own (the model's and the data's, which record their hyperparameters) build as before.
        super().add_instantiator(_NoteRefusals(self.refused, instantiator), class_type, subclasses, prepend)

    @override
    def instantiate_classes(self, cfg: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "parent_parser", None) is not None:  # a subcommand's parser: its parent notes and reports
            return super().instantiate_classes(cfg, *args, **kwargs)
        self.refused.clear()
        # Every other class (the strategy, callbacks, loggers...), built as jsonargparse would. Registered last, so
        # that the instantiators registered before (the model's, the data's) are still the ones that match them.
        ArgumentParser.add_instantiator(self, _NoteRefusals(self.refused), object, subclasses=True)
        try:
            return super().instantiate_classes(cfg, *args, **kwargs)
        except (ValueError, TypeError) as error:
            message = self.refusal_message(cfg, error)
            if message is None:
                raise
            usage_error(self, message, error)

    def refusal_message(self, cfg: Any, error: Exception) -> str | None:
        """``<section> (<class_path>): <the constructor's message>`` when ``error``, raised while building ``cfg``,
        carries what a constructor refused; None for any other error."""
        text = str(error)
        for class_type, init_args, refused in reversed(self.refused):
            first_line = str(refused).strip().partition("\n")[0]
            if not first_line or first_line not in text:
                continue
            subcommand = cfg.get("subcommand") if hasattr(cfg, "get") else None
            config = cfg[subcommand] if subcommand else cfg
            found = _section_of(config.as_dict() if hasattr(config, "as_dict") else {}, class_type, init_args)
            if found is None:
                return f"{class_type.__module__}.{class_type.__qualname__}: {refused}"
            section, class_path = found
            if ".init_args." in section:  # a class inside another's init_args: no --<section>.help of its own
                return f"{section} ({class_path}): {refused}"
            command = " ".join(filter(None, [self.prog, subcommand]))
            flag = re.sub(r"\[\d+\]$", "", section)
            return f"{section} ({class_path}): {refused}\n(its options: {command} --{flag}.help {class_path})"
        return None

    @override
    def error(self, message: str, ex: Exception | None = None) -> Any:
        message = explain_class_paths(explain_choices(explain_strategy_options(message)))
        # A config key is checked by the root parser, which names the subcommand's parser (its options) on the error.
        known = list(getattr(ex, "subcommand_parser", self)._option_string_actions)
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        flags = [f.split("=")[0] for f in unknown.group(1).split() if f.startswith("--")] if unknown else []
        hints = [f"{f}: did you mean {c[0]}?" for f in flags if (c := difflib.get_close_matches(f, known, n=1))]
        # A key of a config file that is no option (trainer.max_step), said as a key.
        for key in re.findall(r"does not accept option '([\w.]+)'", message):
            if close := difflib.get_close_matches(f"--{key}", known, n=1):
                hints.append(f"{key}: did you mean {close[0].removeprefix('--')}?")
        return super().error("\n".join([message, *hints]), ex)


def explain_strategy_options(message: str) -> str:
    """``message`` with, for each option it says a class did not accept, the closest option that class has; for
    PACIStrategy also why (a DistributedDataParallel option) and everything it accepts."""
    refused = re.findall(r"class_path '([\w.]+)':\s*Option '(\w+)' is not accepted", message)
    if not refused:
        return message
    lines = []
    for class_path in dict.fromkeys(c for c, name in refused if name == "class_path"):  # options beside class_path
        lines.append(
            f"{class_path.rpartition('.')[2]}'s options go under init_args, not beside class_path:\n"
            f"  class_path: {class_path}\n  init_args:\n    <option>: <value>"
        )
    refused = [(c, name) for c, name in refused if name != "class_path"]
    for class_path, name in refused:
        if class_path.rpartition(".")[2] == "PACIStrategy":
            continue
        options = _init_options(class_path)
        if not options:  # jsonargparse tried every subclass of the type: a class with no options says nothing here
            continue
        close = difflib.get_close_matches(name, options, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        lines.append(f"{class_path.rpartition('.')[2]} has no option '{name}': {hint}it takes {', '.join(options)}.")
    names = [name for class_path, name in refused if class_path.rpartition(".")[2] == "PACIStrategy"]
    if names:
        options = options_of(PACIStrategy.__init__)
        names = list(dict.fromkeys([*names, *_every_refused_strategy_option(message, options)]))
        listed = "".join(f"\n  - {explain_refused(name, options, show_value=False)}" for name in names)
        lines.append(f"PACIStrategy does not accept:{listed}\n{refusal_footer(names, options)}")
        if len(names) > 1:
            lines.append(
                f"Remove these {len(names)} keys from the strategy's init_args at once: {', '.join(names)}. (A run's "
                "config.yaml saved by lit-efficient before commit 6906908 of 2026-12-01 lists every option of "
                "Lightning's DDPStrategy, which PACIStrategy no longer takes.)"
            )
    return "\n".join([message, *lines])


def _every_refused_strategy_option(message: str, options: list[str]) -> list[str]:
    """Every init_args key of PACIStrategy it does not take, read from the value jsonargparse quotes: jsonargparse
    names the first one only, and a config with many (one an earlier version saved) was refused once per key."""
    given = re.search(r"Given value: (\{.*\})", message)
    if given is None:
        return []
    try:
        value = ast.literal_eval(given.group(1))
    except (ValueError, SyntaxError, MemoryError, RecursionError):  # a value that is no literal: the first name only
        return []
    if not isinstance(value, dict) or str(value.get("class_path", "")).rpartition(".")[2] != "PACIStrategy":
        return []
    init_args = value.get("init_args")
    return [key for key in init_args if key not in options] if isinstance(init_args, dict) else []


def explain_class_paths(message: str) -> str:
    """``message`` with one line for each class path whose last name its module lacks (a misspelt
    ``lit_efficient.GradientAccumulaton``): the closest name the module has."""
    lines = []
    for module_name, name in dict.fromkeys(re.findall(r"module '([\w.]+)' has no attribute '(\w+)'", message)):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        close = difflib.get_close_matches(name, [n for n in dir(module) if not n.startswith("_")], n=1)
        if close:
            lines.append(f"{module_name}.{name}: did you mean {module_name}.{close[0]}?")
    return "\n".join([message, *lines])


def explain_choices(message: str) -> str:
    """``message`` with one line for each value an option of fixed choices refused (``--...schedule flush``): the
    choices and the closest one. jsonargparse says it inside a dump of every Union subtype it tried."""
    lines = []
    refused = re.findall(r'Parser key "([\w.]+)":\s*Expected a typing\.Literal\[(.*?)\]\. Got value: (\S+)', message)
    for key, allowed, given in refused:
        choices = [c.strip().strip("'\"") for c in allowed.split(",")]
        close = closest_choice(given, choices)
        hint = f"; did you mean {close!r}?" if close else ""
        line = f"{key}={given!r} is not one of {', '.join(map(repr, choices))}{hint}"
        if line not in message and line not in lines:  # a nested parser's error already says it
            lines.append(line)
    return "\n".join([message, *lines])


class _NoteRefusals:
    """A jsonargparse instantiator that builds a class as ``instantiator`` does (None: ``class_type(**init_args)``,
    jsonargparse's default) and notes the ValueError or TypeError its constructor raised, then lets it go on."""

    def __init__(self, refused: list, instantiator: Any = None) -> None:
        self.refused = refused
        self.instantiator = instantiator
        self.takes_links = instantiator is not None and "applied_instantiation_links" in _parameters(instantiator)

    def __call__(self, class_type: type, *args: Any, applied_instantiation_links: Any = None, **kwargs: Any) -> Any:
        links = {"applied_instantiation_links": applied_instantiation_links or {}} if self.takes_links else {}
        try:
            if self.instantiator is None:
                return class_type(*args, **kwargs)
            return self.instantiator(class_type, *args, **kwargs, **links)
        except (ValueError, TypeError) as error:
            self.refused.append((class_type, kwargs, error))
            raise


def _without_print_config(args: list[str]) -> list[str]:
    """``args`` without LightningCLI's ``--print_config[=flags]`` (which prints and exits while parsing)."""
    return [arg for arg in args if arg != "--print_config" and not arg.startswith("--print_config=")]


def _class_path(entry: Any) -> str | None:
    """The class path of a parsed subclass entry (a Namespace with ``class_path``), or None."""
    return entry.get("class_path") if isinstance(entry, (dict, Namespace)) else None


def _parameters(function: Any) -> list[str]:
    try:
        return list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return []


def _section_of(config: Any, class_type: type, init_args: dict[str, Any]) -> tuple[str, str] | None:
    """The key (``trainer.strategy``, ``trainer.callbacks[1]``) and class path of the entry of ``config`` (a dict)
    naming ``class_type``: among several, the one whose ``init_args`` are those it was built with."""
    found = [(key, entry) for key, entry in _class_entries(config, "")
             if str(entry["class_path"]).rpartition(".")[2] == class_type.__name__]  # fmt: skip

    def built_with(entry: dict) -> bool:
        try:
            return all(init_args.get(k, v) == v for k, v in (entry.get("init_args") or {}).items())
        except Exception:  # a value whose == does not answer a bool (a tensor): not a way to tell them apart
            return False

    key, entry = next((f for f in found if built_with(f[1])), found[0] if found else (None, None))
    return None if entry is None else (key, str(entry["class_path"]))


def _class_entries(value: Any, key: str) -> Iterator[tuple[str, dict]]:
    """``(key, {class_path, init_args})`` of every class in a config dict, nested ones (in ``init_args``) too."""
    if isinstance(value, dict):
        if "class_path" in value:
            yield key, value
            value = value.get("init_args") or {}
            key = f"{key}.init_args"
        for name, item in value.items():
            yield from _class_entries(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _class_entries(item, f"{key}[{i}]")


def _init_options(class_path: str) -> list[str]:
    """The keyword options of the class at ``class_path``, its bases' included (as jsonargparse reads them)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return []
    options: list[str] = []
    for klass in cls.__mro__:
        if "__init__" in vars(klass) and klass is not object:
            options += [o for o in options_of(klass.__init__) if o not in options and o not in ("args", "kwargs")]
    return options


def usage_error(parser: ArgumentParser, message: str, error: Exception) -> None:
    """Report a refused value as a usage error of ``parser`` (one line, exit 2), or as jsonargparse reports errors
    where the parser does not exit on them; ``JSONARGPARSE_DEBUG`` keeps ``error``'s traceback."""
    if os.environ.get("JSONARGPARSE_DEBUG"):
        raise error
    if not parser.exit_on_error:
        parser.error(message, error)
    parser.exit(2, f"{parser.prog}: error: {message}\n")


# The package's callbacks hold state in checkpoints under their class name: Lightning refuses two of one class with a
# traceback about state keys ("Found more than one stateful callback"), while the mistake is a config's.
_ONE_EACH = ("ActivationCheckpointing", "GradientAccumulation")


def _refuse_a_callback_given_twice(parser: ArgumentParser, config: Any) -> None:
    """A usage error for two of one of the package's callbacks: a config file's list and ``--trainer.callbacks+=``
    (which appends) each added one."""
    trainer = config.get("trainer") if hasattr(config, "get") else None
    callbacks = (trainer.get("callbacks") if trainer is not None else None) or []
    names = [str(c.get("class_path", "")).rpartition(".")[2] for c in callbacks if hasattr(c, "get")]
    twice = [name for name in _ONE_EACH if names.count(name) > 1]
    if twice:
        message = (
            f"trainer.callbacks holds {twice[0]} {names.count(twice[0])} times (a config file's list and "
            "--trainer.callbacks+=... each add one): keep one, and set its options in the config, or with "
            "--trainer.callbacks.init_args.<option>, which applies to the last callback of the list"
        )
        usage_error(parser, message, ValueError(message))


class LitEfficientCLI(LightningCLI):
    """LightningCLI with `GPT` and `TextDataModule` as defaults and the data feeding the model's sizes.

    Args:
        args: Command-line arguments (None reads ``sys.argv``), a list, or a dict/Namespace.
        run: Run the subcommand (True) or only parse and instantiate (False; tests, notebooks).
        **kwargs: Passed to LightningCLI (e.g. ``trainer_defaults``, ``save_config_kwargs``).
    """

    def __init__(self, args: ArgsType = None, run: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_callback", RunConfigCallback)
        kwargs.setdefault("parser_class", StrategyOptionParser)
        kwargs.setdefault("save_config_kwargs", {"config_filename": "config.yaml", "overwrite": False})
        kwargs.setdefault("parser_kwargs", {
            "prog": "lit-efficient",  # also under `python -m lit_efficient.cli` (argparse would say __main__.py)
            "description": "Pipeline-parallel training for PyTorch Lightning. The memory plan of a config, before "
            "any GPU: lit-efficient plan --config ... (lit-efficient plan --help).",
            # argparse would take the prefix --trainer.max_step for --trainer.max_steps, silently.
            "allow_abbrev": False,
        })  # fmt: skip
        super().__init__(
            LightningModule,  # GPT by default (below), HFCausalLM or any LightningModule of the user's
            LightningDataModule,  # TextDataModule by default (below), TokenizedDataModule or any data module
            subclass_mode_model=True,
            subclass_mode_data=True,
            # GPT.configure_optimizers owns AdamW and its warmup + cosine schedule; set them on the model.
            auto_configure_optimizers=False,
            args=args,
            run=run,
            **kwargs,
        )

    @override
    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        listing = getattr(self.parser, "subcommands_action", None)
        if add_subcommands and listing is not None:  # listed in `lit-efficient --help` beside fit, validate, ...
            listing.add_subcommand("plan", ArgumentParser(description=PLAN_HELP), help=PLAN_HELP)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        # `lit-efficient plan` never reaches LightningCLI: the console script (lit_efficient.cli.main) runs it first.
        # Here only a script whose entry point is this class gets it; the plan is the console script's (this module
        # does not import the plan, which imports it).
        # jsonargparse carries a default class's init_args into the class chosen instead wherever that one takes the
        # same name (jsonargparse issue 460): HFCausalLM got GPT's vocab_size and block_size, a data module of the
        # user's own TextDataModule's batch_size, seed and block_size, over its own defaults and silently. So: parse
        # once to see which classes were chosen (printing no config), then again with the chosen class as the
        # default (its own defaults; init_args given before the class is named still reach it).
        if isinstance(args, (dict, Namespace)):
            chosen = parser.parse_object(args)
        else:
            chosen = parser.parse_args(_without_print_config(sys.argv[1:] if args is None else list(args)))
        subcommand = chosen.get("subcommand")
        section = chosen[subcommand] if subcommand else chosen
        chosen_paths = {key: _class_path(section.get(key)) for key in DEFAULT_CLASSES}
        replaced = {
            key: {"class_path": path} for key, path in chosen_paths.items() if path not in (None, DEFAULT_CLASSES[key])
        }
        if replaced:
            (self._subcommand_parsers[subcommand] if subcommand else parser).set_defaults(replaced)
        super().parse_arguments(parser, args)
        if self.config.get("subcommand") == "plan":
            parser.error("plan is the console script's: lit-efficient plan --config ... (lit-efficient plan --help)")

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults(
            {
                **{key: {"class_path": path} for key, path in DEFAULT_CLASSES.items()},
                "trainer.logger": {
                    "class_path": "lightning.pytorch.loggers.WandbLogger",
                    "init_args": {"project": WANDB_PROJECT, "save_dir": DEFAULT_SAVE_DIR, "offline": True},
                },
            }
        )
        # One source of truth: the data decide the context length and the vocabulary, the model follows. Read from
        # the built data module, so any LightningDataModule fits: a link whose attribute the data lack is not
        # applied (the model's own value stands); a data module's default block_size counts as well (a link made
        # when parsing saw only the values given, and fed a module with another default the model's 256).
        # vocab_size is known only once the data exist (a .bin without vocab_size is scanned for it).
        parser.link_arguments("data.block_size", "model.init_args.block_size", apply_on="instantiate")
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")

    @override
    def before_instantiate_classes(self) -> None:
        # Before the logger exists: wandb reads these variables when it starts, in this process and in
        # every rank launched from it (popen re-runs this command, spawn inherits the environment).
        config = self.config[self.subcommand] if self.subcommand else self.config
        _refuse_a_callback_given_twice(self.parser, config)
        for logger in filter(_is_wandb, _loggers(config)):
            init = logger.init_args
            for key in ("save_dir", "dir"):  # one folder for W&B, the run's config and checkpoints, and "last"
                if isinstance(init.get(key), str) and init[key].startswith("~"):
                    init[key] = os.path.expanduser(init[key])
            offline = bool(init.get("offline")) or "offline" in (init.get("mode"), os.environ.get("WANDB_MODE"))
            keep_wandb_local(init.get("save_dir") or init.get("dir") or ".", offline)
            if init.get("id") or init.get("version") or self.subcommand not in (None, "fit"):
                continue  # the user's own run id wins; an evaluation is a run of its own, not the training's
            # One W&B run, and one checkpoint folder (<save_dir>/<project>/<run id>/checkpoints), for every
            # attempt of a job: a restarted attempt continues the chart and finds its ckpt_path="last", where a
            # fresh id per launch would start the run over. A run resumed by hand from a checkpoint of that
            # layout continues the run that wrote it, likewise.
            run = restartable_job_id() or run_id_of_checkpoint(config.get("ckpt_path"))
            if run is not None:
                init["id"] = run
                if init.get("resume") is None:
                    init["resume"] = "allow"

    @override
    def _parse_ckpt_path(self) -> None:  # Lightning's private step that reads a checkpoint path's hyperparameters
        subcommand = self.config.get("subcommand")
        if subcommand is not None:
            config = self.config[subcommand]
            if isinstance(config.get("ckpt_path"), str) and config.ckpt_path.startswith("~"):
                config.ckpt_path = os.path.expanduser(config.ckpt_path)  # a YAML value: no shell expanded it
            if self._resume_the_latest_run(config) is False and subcommand != "fit":
                usage_error(
                    self.parser,
                    f"--ckpt_path last: the project has no last checkpoint of a {config.model.class_path} run on this "
                    f"data, so {subcommand} would evaluate an untrained model. Give the checkpoint's path "
                    "(--ckpt_path <save_dir>/<project>/<run id>/checkpoints/last.ckpt), or fit first.",
                    FileNotFoundError("last"),
                )
            try:  # before anything is built or written (in one process the strategy's own check comes later)
                check_checkpoint_path(config.get("ckpt_path"))
            except CheckpointNotFound as error:
                usage_error(self.parser, str(error), error)
        folder = self.config[subcommand].get("ckpt_path") if subcommand is not None else None
        hyper_parameters = _hyper_parameters_file(folder)
        if hyper_parameters is not None and hyper_parameters.name == META and not Path(folder).is_file():
            if _reads_files_only(self.config[subcommand].get("trainer")):
                usage_error(
                    self.parser,
                    f"--ckpt_path {folder} is a sharded checkpoint folder, which PACIStrategy reads and Lightning's "
                    "DDP and single-device strategies do not (they open it as a file: IsADirectoryError): add "
                    "--trainer.strategy paci (or the run's config), or make one file of it first: python -m "
                    f"lightning.pytorch.utilities.consolidate_checkpoint {folder}",
                    IsADirectoryError(folder),
                )
            # Lightning reads a checkpoint's hyper-parameters from a file only: a sharded folder's are in its meta.pt,
            # which is shown to it for the parse (without, `validate --model GPT --ckpt_path FOLDER` built the
            # CLI's default model and failed loading the folder's weights into it). The folder is what is loaded.
            self.config[subcommand].ckpt_path = str(hyper_parameters)
            try:
                super()._parse_ckpt_path()
            finally:
                self.config[subcommand].ckpt_path = folder
        else:
            super()._parse_ckpt_path()
        if subcommand is not None:
            try:
                _data_follow_the_checkpoint(self.config[subcommand])
            except ValueError as error:
                usage_error(self.parser, str(error), error)

    @staticmethod
    def _resume_the_latest_run(config: Namespace) -> bool | None:
        """``--ckpt_path last`` launched by hand (no job id that every attempt shares): each launch is a W&B run of
        its own, with a checkpoint folder of its own, where Lightning's "last" finds nothing and starts over. So
        "last" is the newest ``last`` checkpoint of the project's runs of the same model class on the same data,
        then taken as if given (its run id and its hyperparameters, as any path). Left to Lightning: a
        ModelCheckpoint ``dirpath``, a run id of the user's, checkpoints that follow another logger (the first one's
        folder). Returns whether it found one (None: left to Lightning)."""
        if str(config.get("ckpt_path")) != "last" or restartable_job_id():
            return None
        loggers = _loggers(config)  # checkpoints go to the first logger's folder
        if not loggers or not _is_wandb(loggers[0]) or _checkpoints_have_a_dirpath(config.trainer):
            return None
        init = loggers[0].init_args
        if init.get("id") or init.get("version") or not init.get("project"):
            return None
        # A rank this process's launch started (popen re-runs the command) takes its launching process's pick: a
        # checkpoint written meanwhile cannot split them. Another process's pick (an earlier launch's, inherited by
        # a later torchrun's workers) is not this launch's.
        launcher, _, picked = os.environ.get(_LAST_RESOLVED, "").partition(":")
        if picked and launcher == str(os.getppid()):
            config.ckpt_path = picked
            return True
        os.environ.pop(_LAST_RESOLVED, None)  # an earlier launch's pick in this process is not this one's
        project_dir = Path(init.get("save_dir") or init.get("dir") or ".").expanduser() / init["project"]
        model_class = getattr(config.get("model"), "class_path", None)
        latest = latest_last_checkpoint(project_dir, model_class, config.get("data"))
        if latest is None:
            return False  # a first launch: Lightning says that no last checkpoint is there, and a fit starts fresh
        config.ckpt_path = str(latest)
        os.environ[_LAST_RESOLVED] = f"{os.getpid()}:{latest}"  # for the ranks this process starts
        rank_zero_info(
            f"lit-efficient: --ckpt_path last resumes {latest}, the newest last checkpoint of a "
            f"{config.model.class_path} run on this data under {project_dir} (for a fresh run, leave --ckpt_path out)"
        )
        return True

    @override
    def _run_subcommand(self, subcommand: str) -> None:  # Lightning's private hook around the subcommand's run
        try:
            super()._run_subcommand(subcommand)
        except (RefusedSetting, CheckpointNotFound) as error:  # before any process started: a usage error
            usage_error(self.parser, str(error), error)

    def after_fit(self) -> None:
        """Say where the run's checkpoint is, and how to resume from it, or that none was saved."""
        callbacks = self.trainer.checkpoint_callbacks
        best = [cb.best_model_path for cb in callbacks if cb.best_model_path]  # type: ignore[attr-defined]
        last = [cb.last_model_path for cb in callbacks if cb.last_model_path]  # type: ignore[attr-defined]
        if best or last:  # the best by its monitor; a run continues from its latest
            rank_zero_info(f"lit-efficient: checkpoint {(best or last)[0]} (resume: --ckpt_path {(last or best)[0]})")
            return
        if not callbacks:
            rank_zero_warn(
                "lit-efficient: the run ended without saving a checkpoint (no ModelCheckpoint callback). Add a "
                "ModelCheckpoint (the quickstart config has one), with every_n_train_steps or a validation for it to "
                "act on."
            )
            return
        trainer = self.trainer
        if trainer.fit_loop.epoch_loop.val_loop.batch_progress.total.completed > 0:
            rank_zero_warn(
                "lit-efficient: the run ended without saving a checkpoint: its ModelCheckpoint saved nothing after the "
                "run's validations (check its monitor, save_top_k and every_n_* against the run's length)."
            )
            return
        rank_zero_warn(
            "lit-efficient: the run ended without saving a checkpoint: its ModelCheckpoint saves after a validation "
            "or every_n_train_steps / every_n_epochs, and none came in this run (no validation ran: "
            f"val_check_interval={trainer.val_check_interval}, limit_val_batches={trainer.limit_val_batches}). "
            "Validate within the run (a smaller val_check_interval) or set every_n_train_steps."
        )
