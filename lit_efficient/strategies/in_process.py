"""PACIStrategy's in-process mode: ``Trainer(devices=1)`` with ``pipeline_stages=S`` runs all S stages here.

The stages, schedules and runtimes are the multi-process ones; only the transport differs (comm.py's
`LocalExchange`) and `LocalPipeline` gives the stages their turns. What this module adds is what
each process would have done for its own stage, done S times in one:

- the module is never split (the user's object stays whole), but ``configure_optimizers`` is called
  once per stage with every other stage's layers swapped out for placeholders, so each stage gets
  the optimizer and LR schedulers its rank would build (its own parameter groups, its own schedule
  stepping with its own steps);
- no process group is created (there is no peer): Lightning's collectives see a world of one;
- a checkpoint is the one file S processes would write (each stage's share assembled as rank 0
  does), and each stage reads its part back by parameter name as its rank would, so either layout
  resumes from the other's.

Not supported in one process: gradient-norm clipping under ``1f1b_flush`` (its exact global norm is a
collective across stages at the step, which one process cannot run between two stages' turns) and
LocalSGD/DiLoCo (one replica).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lit_efficient.pipeline.local import LocalPipeline, local_pipeline
from lit_efficient.pipeline.stage import PipelineStage
from lit_efficient.strategies.checkpoint import (
    assemble,
    group_key,
    local_accumulation,
    local_optimizer_state,
    rank_share,
    regroup_schedulers,
    to_automatic_loops,
    write_atomically,
)
from lit_efficient.strategies.hooks import drain_before, warn_uncalled_hooks
from lit_efficient.strategies.split import LayerOnOtherStage, Split, check_sharing

if TYPE_CHECKING:
    from lit_efficient.strategies.paci import PACIStrategy


class InProcessPipeline:
    """The in-process half of a `PACIStrategy`: builds the S stages and writes and reads their shards.

    Args:
        strategy: The strategy it serves (its ``pipeline_stages``, schedule, precision, device...).
    """

    def __init__(self, strategy: PACIStrategy) -> None:
        self.strategy = strategy
        self.selected = strategy.pipeline_stages - 1  # the stage `strategy.stage` reports: the last, like rank 0
        self.sizes: list[int] = []
        self._scheduler_counts: list[int] = []  # LR scheduler configs per stage, in stage order

    @property
    def pipeline(self) -> LocalPipeline:
        """The driver of the stages (the strategy's ``runtime``)."""
        runtime = self.strategy.runtime
        assert isinstance(runtime, LocalPipeline), "the strategy is not set up yet"
        return runtime

    @contextmanager
    def select(self, stage: int) -> Iterator[None]:
        """Let the strategy act for ``stage`` (its ``stage`` and ``runtime.stage``), as that rank would."""
        before = self.selected
        self.selected = self.pipeline.selected = stage
        try:
            yield
        finally:
            self.selected = self.pipeline.selected = before

    # -- setup ------------------------------------------------------------------------------------------

    def setup(self, trainer: Trainer) -> None:
        """What `PACIStrategy.setup` does on each rank, for every stage."""
        from lit_efficient.strategies.paci import _check_module, _normalize_mode

        s = self.strategy
        assert s.accelerator is not None and s.lightning_module is not None
        s._check_before_launch(trainer)  # nothing is launched here, so the check runs now
        s.accelerator.setup(trainer)
        module = s.lightning_module
        _check_module(module, s.precision_plugin)
        layers = list(module.pipeline_layers())
        self.sizes = s._stage_sizes(module, layers, trainer)
        num_stages = s.pipeline_stages
        ties = check_sharing(module, layers, self.sizes)
        if ties:
            # Both stages would hold the one Parameter in their optimizers and step it twice per window.
            raise ValueError(
                f"{type(module).__name__} ties {ties[0].name} to {ties[0].alias} across the first and the last "
                f"stage; weights tied across stages need one process per stage (devices={num_stages}) in this "
                "version, or devices=1 with pipeline_stages=1."
            )
        # The layout record checkpoints are checked against; the module itself stays whole.
        s._split = Split(self.sizes, num_stages - 1, [])
        s.model = s.precision_plugin.convert_module(module)
        s.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            clips_norm = trainer.gradient_clip_val and (trainer.gradient_clip_algorithm or "norm") == "norm"
            if clips_norm and s.schedule == "1f1b_flush":
                raise ValueError(
                    "gradient_clip_algorithm='norm' under schedule='1f1b_flush' needs the norm over every stage at "
                    "the step, which a pipeline in one process cannot gather between two stages' turns. Use "
                    "gradient_clip_algorithm='value', schedule='paci' (each stage clips its own norm), or devices="
                    f"{num_stages}."
                )
            s._was_automatic = module.automatic_optimization
            module.automatic_optimization = False
        bounds = [(sum(self.sizes[:k]), sum(self.sizes[: k + 1])) for k in range(num_stages)]
        stages, optimizers, configs, epoch_schedulers = [], [], [], []
        for stage_index, (first, last) in enumerate(bounds):
            optimizer, scheduler = None, None
            if fitting:
                with only_stage(module, layers, self.sizes, stage_index):
                    s.setup_optimizers(trainer)
                if len(s.optimizers) != 1:
                    raise ValueError(
                        f"configure_optimizers returned {len(s.optimizers)} optimizers; PACIStrategy steps one "
                        "optimizer per stage. Put all parameters into one optimizer (param groups are fine)."
                    )
                optimizer = s.optimizers[0]
                scheduler = s._step_schedulers()
                optimizers.append(optimizer)
                configs += s.lr_scheduler_configs
                self._scheduler_counts.append(len(s.lr_scheduler_configs))
                epoch_schedulers += s._epoch_schedulers
            stage = PipelineStage(
                layers[first:last], stage_index, num_stages, optimizer,
                loss_fn=module.pipeline_loss, scheduler=scheduler, recompute=s.recompute,
                normalize=_normalize_mode(trainer), forward_context=s.precision_plugin.forward_context,
                device=s.root_device, on_nonfinite=s.on_nonfinite, first_layer=first,
            )  # fmt: skip
            if fitting:
                s._install_step_hooks(stage, trainer)
                stage.correction = s.correction_for(stage_index, trainer)
            stages.append(stage)
        if fitting:
            s.optimizers = optimizers  # Lightning sees all S (checkpoints, LR monitors), in stage order
            s.lr_scheduler_configs = configs
            s._epoch_schedulers = epoch_schedulers
        s.setup_precision_plugin()
        accumulate = max(1, trainer.accumulate_grad_batches)
        s.runtime = local_pipeline(stages, s.schedule, accumulate, module.pipeline_input)  # type: ignore[assignment]
        self.pipeline.selected = self.selected
        if fitting:
            drain_before(module, "on_validation_model_zero_grad", s.drain)
            warn_uncalled_hooks(module, trainer.callbacks)
        # One replica: the user's own loader, as on S processes (PACIStrategy.setup says why).
        trainer._accelerator_connector.use_distributed_sampler = False

    # -- checkpoints ------------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        """The one file S processes would write: each stage's share as its rank builds it, assembled."""
        s = self.strategy
        module = s.lightning_module
        assert module is not None
        shares, views = [], []
        for stage in range(s.pipeline_stages):
            with self._as_rank(stage, checkpoint) as view:
                optimizer = s.optimizers[stage] if s.optimizers else None
                shares.append(rank_share(view, module, optimizer, s.pipeline_state(), True))
                views.append(view)
        # Lightning's dict as rank 0 (the last stage) built it: its schedulers, its keys.
        write_atomically(to_automatic_loops(assemble(views[-1], shares, s.layout())), filepath)

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Every stage takes its optimizer state, schedulers, accumulation and streams by parameter name, as
        its rank would (`PACIStrategy.load_optimizer_state_dict`)."""
        s = self.strategy
        module = s.lightning_module
        assert module is not None
        names = {id(p): n for n, p in module.named_parameters()}
        group_names = self._group_names(names)
        saved_schedulers = checkpoint.get("lr_schedulers", [])
        pipeline = checkpoint.get("pipeline", {})
        same_layout = pipeline.get("layout") == s.layout()
        schedulers = []
        for stage, rt in enumerate(self.pipeline.runtimes):
            with self.select(stage), only_stage(module, list(module.pipeline_layers()), self.sizes, stage):
                if s.optimizers:
                    state, group_map = local_optimizer_state(
                        checkpoint, module, s.optimizers[stage], s._rank_key(), lambda: (group_names, {})
                    )
                    s.optimizers[stage].load_state_dict(state)
                    saved_groups = len(checkpoint["optimizer_states"][0]["param_groups"])
                    schedulers += regroup_schedulers(saved_schedulers, group_map, saved_groups)
                accumulation = local_accumulation(checkpoint, [names[id(p)] for p in rt.stage.parameters()])
                mine = pipeline.get("ranks", {}).get(s._rank_key(), {}) if same_layout else {}
                s._load_rank_state(mine, accumulation)
        if s.optimizers:
            checkpoint["lr_schedulers"] = schedulers  # Lightning restores them next, in stage order

    @contextmanager
    def _as_rank(self, stage: int, checkpoint: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """``stage``'s view: the strategy acts for it, the module holds only its layers, and Lightning's dict is
        the one its rank would have built (its keys, its optimizer, its schedulers)."""
        s = self.strategy
        module = s.lightning_module
        assert module is not None
        offsets = [sum(self._scheduler_counts[:k]) for k in range(len(self._scheduler_counts) + 1)]
        with self.select(stage), only_stage(module, list(module.pipeline_layers()), self.sizes, stage):
            keys = module.state_dict().keys()
            view = dict(checkpoint, state_dict={k: checkpoint["state_dict"][k] for k in keys})
            if "optimizer_states" in checkpoint:
                view["optimizer_states"] = [checkpoint["optimizer_states"][stage]]
            if "lr_schedulers" in checkpoint and self._scheduler_counts:
                view["lr_schedulers"] = checkpoint["lr_schedulers"][offsets[stage] : offsets[stage + 1]]
            yield view

    def _group_names(self, names: dict[int, str]) -> list[list[str]]:
        """`PACIStrategy._group_names` without the collective: every stage is here (and no tied weights:
        the in-process pipeline refuses them)."""
        merged: dict[str, list[str]] = {}
        for optimizer in self.strategy.optimizers:
            for group in optimizer.param_groups:
                merged.setdefault(group_key(group), []).extend(names[id(p)] for p in group["params"])
        return list(merged.values())


@contextmanager
def only_stage(module: nn.Module, layers: Sequence[nn.Module], sizes: Sequence[int], stage: int) -> Iterator[None]:
    """Within the block, ``module`` holds only ``stage``'s layers (the others are placeholders without
    parameters), as on that stage's rank: ``parameters()``, ``state_dict()`` and ``configure_optimizers``
    see that stage alone. Every layer is back in its place afterwards, untouched."""
    slots = _slots(module, layers)
    first = sum(sizes[:stage])
    last = first + sizes[stage]
    owner = [k for k, size in enumerate(sizes) for _ in range(size)]
    try:
        for i, ((parent, name), layer) in enumerate(zip(slots, layers, strict=True)):
            if not first <= i < last:
                parent._modules[name] = LayerOnOtherStage(i, owner[i], layer)
        yield
    finally:
        for (parent, name), layer in zip(slots, layers, strict=True):
            parent._modules[name] = layer


def _slots(module: nn.Module, layers: Sequence[nn.Module]) -> list[tuple[nn.Module, str]]:
    where: dict[int, tuple[nn.Module, str]] = {}
    for parent in module.modules():
        for name, child in parent._modules.items():
            if child is not None:
                where.setdefault(id(child), (parent, name))
    missing = [i for i, layer in enumerate(layers) if id(layer) not in where]
    if missing:
        raise ValueError(
            f"pipeline_layers()[{missing[0]}] is not a submodule of the module: register every pipeline layer as an "
            "attribute or in an nn.ModuleList so the stage can find and keep it"
        )
    return [where[id(layer)] for layer in layers]
