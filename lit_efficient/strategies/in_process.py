"""PACIStrategy's in-process mode: ``Trainer(devices=1)`` with ``pipeline_stages=S`` runs all S stages here.

The stages, schedules and runtimes are the multi-process ones; only the transport differs (comm.py's
`LocalExchange`, and `pipeline.tied.LocalTiedLink` for a tied weight) and `LocalPipeline` gives the
stages their turns. What this module adds is what each process would have done for its own stage,
done S times in one, through the process path's own pieces:

- the module is never split (the user's object stays whole), but ``configure_optimizers`` is called
  once per stage with every other stage's layers swapped out for placeholders (`split.only_stage`, the
  slots `split_module` uses, adapter layers included), so each stage gets the optimizer and LR
  schedulers its rank would build (its own parameter groups, its own schedule stepping with its own
  steps). Lightning is shown what global rank 0 shows it, the last stage's optimizer and schedulers
  (``trainer.optimizers``, ``trainer.lr_scheduler_configs``: `LearningRateMonitor` logs the keys and values
  it logs on processes); every stage's are kept here (`InProcessPipeline.optimizers`,
  ``scheduler_configs``), every stage's epoch-interval schedulers step, and checkpoints hold every stage's;
- a weight tied between the first and the last stage gets two copies for the run, the second on the
  last stage as on its rank (`split.separate_tied_copies`), kept equal by the one tied-weight rule
  (`strategies.tied.tie_stage`), and is one parameter again after it (`split.tie_again`);
- no process group is created (there is no peer): Lightning's collectives see a world of one;
- a checkpoint is the one file S processes would write (each stage's share assembled as rank 0
  does), and each stage reads its part back by parameter name as its rank would, so either layout
  resumes from the other's;
- the Lightning hooks are the process path's (`PACIStrategy._join_lightning`): the same drains before
  the same hooks, so every callback sees what it sees on S processes (docs/DESIGN.md section 7).

- gradient-norm clipping under ``1f1b_flush`` clips the global norm as on processes: each stage's step
  sums the stages' squared norms through `pipeline.local.LocalStageSum` (the collective's stand-in), the
  other stages taking their turns while one waits inside its step, as for a tied weight. With a weight
  tied between the first and the last stage, the last stage posts its squared norm before it waits for
  the tied gradient (`LocalStepHooks._post_norm_before_tied_exchange`), and a drain calls the last stage
  first, so it is the one to enter a step first: stage 0 then completes its step inside that wait.

Not supported in one process: LocalSGD/DiLoCo (one replica).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from lit_efficient.pipeline.local import LocalPipeline, LocalStageSum, local_pipeline
from lit_efficient.pipeline.stage import PipelineStage
from lit_efficient.pipeline.tied import LocalTiedLink, TiedWeight, tie_delay
from lit_efficient.pipeline.topology import Topology
from lit_efficient.strategies.checkpoint import (
    assemble,
    local_accumulation,
    local_optimizer_state,
    merge_group_names,
    rank_share,
    regroup_schedulers,
    to_automatic_loops,
    write_atomically,
)
from lit_efficient.strategies.split import (
    Split,
    check_sharing,
    layer_slots,
    only_stage,
    separate_tied_copies,
    tie_again,
)
from lit_efficient.strategies.tied import tie_stage, untag

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
        # Every stage's optimizer and LR scheduler configs, in stage order. Lightning holds only the last
        # stage's (its `optimizers`), as on global rank 0. Kept after fit, as Lightning keeps its own, for a
        # save after fit.
        self.optimizers: list[Any] = []
        self.scheduler_configs: list[list[Any]] = []
        self.tied: list[list[TiedWeight]] = []  # per stage: its copies of the tied weights (first and last only)
        self.tie_link: LocalTiedLink | None = None

    @property
    def pipeline(self) -> LocalPipeline:
        """The driver of the stages (the strategy's ``runtime``)."""
        runtime = self.strategy.runtime
        assert isinstance(runtime, LocalPipeline), "the strategy is not set up yet"
        return runtime

    @contextmanager
    def select(self, stage: int) -> Iterator[None]:
        """Let the strategy act for ``stage`` (its ``stage``, ``runtime.stage`` and tied copies), as that rank
        would."""
        s = self.strategy
        before, tied = self.selected, s._tied
        self.selected = self.pipeline.selected = stage
        s._tied = self.tied[stage] if self.tied else []
        try:
            yield
        finally:
            self.selected = self.pipeline.selected = before
            s._tied = tied

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
        ties = check_sharing(module, layers, self.sizes)  # a tied embedding: see lit_efficient.pipeline.tied
        # The layout record checkpoints are checked against, and where every layer's parts sit; the module
        # itself stays whole.
        s._split = Split(self.sizes, num_stages - 1, layer_slots(module, layers), ties)
        s.model = s.precision_plugin.convert_module(module)
        s.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            clips_norm = trainer.gradient_clip_val and (trainer.gradient_clip_algorithm or "norm") == "norm"
            # flush clips the global norm: each stage's step sums the stages' squared norms, here among
            # the stages themselves (the others take their turns while one waits inside its step).
            topo = Topology(num_stages)
            exact_norm = clips_norm and s.schedule == "1f1b_flush" and num_stages > 1
            s._local_stage_sum = LocalStageSum([topo.stage_of(r) for r in range(num_stages)]) if exact_norm else None
            s._was_automatic = module.automatic_optimization
            module.automatic_optimization = False
            # Before the optimizers are built: the last stage's optimizer holds its own copy, as on its rank.
            separate_tied_copies(s._split)
        accumulate = max(1, trainer.accumulate_grad_batches)
        self.tie_link = LocalTiedLink() if ties and fitting else None
        self.tied = [[] for _ in range(num_stages)]
        bounds = [(sum(self.sizes[:k]), sum(self.sizes[: k + 1])) for k in range(num_stages)]
        stages, optimizers, configs, epoch_schedulers = [], [], [], []  # per stage (configs: lists)
        for stage_index, (first, last) in enumerate(bounds):
            optimizer, scheduler = None, None
            if fitting:
                with only_stage(module, layers, self.sizes, stage_index):
                    s._setup_stage_optimizer(trainer)
                optimizer = s.optimizers[0]
                scheduler = s._step_schedulers()
                optimizers.append(optimizer)
                configs.append(s.lr_scheduler_configs)
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
            if self.tie_link is not None and stage_index in (0, num_stages - 1):
                end = self.tie_link.end(stage_index == 0)
                delay = tie_delay(num_stages, accumulate)
                self.tied[stage_index] = tie_stage(stage, s._split, s.schedule, delay, end)
                if s._local_stage_sum is not None and stage.is_last:
                    s._post_norm_before_tied_exchange(stage)  # else its step and stage 0's wait for each other
            stages.append(stage)
        if fitting:
            self.optimizers, self.scheduler_configs = optimizers, configs
            # Lightning and every callback see what they see on global rank 0 (the last stage): one optimizer,
            # so LearningRateMonitor's keys (lr-AdamW, lr-AdamW/pg1) name the last stage's, as on processes.
            s.optimizers, s.lr_scheduler_configs = [optimizers[-1]], configs[-1]
            s._epoch_schedulers = epoch_schedulers  # every stage's: each rank steps its own at an epoch's end
            s._tied = [t for tied in self.tied for t in tied]  # on_train_end finishes both stages' exchanges
        s.setup_precision_plugin()
        s.runtime = local_pipeline(stages, s.schedule, accumulate, module.pipeline_input, s.wire_format)  # type: ignore[assignment]
        self.pipeline.selected = self.selected
        for link in (self.tie_link, s._local_stage_sum):
            if link is not None:
                link.wait = self.pipeline.run_others_until  # a stage waiting inside its step lets the others run
        s._join_lightning(trainer, fitting)

    def teardown(self) -> None:
        """The module as the user gave it: tied weights one parameter again (the first stage's copy, which equals
        the last stage's after the run, as on processes after the model is gathered)."""
        s = self.strategy
        if s._split is not None:
            tie_again(s._split)
        untag([t for tied in self.tied for t in tied])
        self.tied, self.tie_link = [], None
        s._local_stage_sum = None
        # What Lightning's teardown does with its optimizer (the last stage's), for the others: on an
        # accelerator their state would otherwise stay in its memory after fit.
        _optimizers_to_device(self.optimizers[:-1], torch.device("cpu"))

    # -- checkpoints ------------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        """The one file S processes would write: each stage's share as its rank builds it, assembled."""
        s = self.strategy
        module = s.lightning_module
        assert module is not None
        checkpoint = self.every_stage(checkpoint)
        shares, views = [], []
        for stage in range(s.pipeline_stages):
            with self._as_rank(stage, checkpoint) as view:
                optimizer = self.optimizers[stage] if self.optimizers else None
                copies = s._tied_copy_names()[1]
                shares.append(rank_share(view, module, optimizer, s.pipeline_state(), True, tied_copies=copies))
                views.append(view)
        # Lightning's dict as rank 0 (the last stage) built it: its schedulers, its keys.
        write_atomically(to_automatic_loops(assemble(views[-1], shares, s.layout())), filepath)

    def every_stage(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Lightning's dict with every stage's optimizer state and scheduler states, in stage order, where
        Lightning put the last stage's only (what `_as_rank` and `shares.live_records` slice per stage).

        Lightning's own entries stay the last stage's: they are what rank 0's dict holds, hooks' changes
        (``on_save_checkpoint``) included.
        """
        if "optimizer_states" not in checkpoint:  # save_weights_only: no optimizer, no schedulers
            return checkpoint
        earlier = range(len(self.optimizers) - 1)
        return dict(
            checkpoint,
            optimizer_states=[
                *(self.strategy.optimizer_state(self.optimizers[k]) for k in earlier),
                *checkpoint["optimizer_states"],
            ],
            lr_schedulers=[
                *(c.scheduler.state_dict() for k in earlier for c in self.scheduler_configs[k]),
                *checkpoint.get("lr_schedulers", []),
            ],
        )

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Every stage takes its optimizer state, schedulers, accumulation and streams by parameter name, as
        its rank would (`PACIStrategy.load_optimizer_state_dict`)."""
        s = self.strategy
        module = s.lightning_module
        assert module is not None
        names = {id(p): n for n, p in module.named_parameters()}
        group_names = self._group_names() if self.optimizers else ([], {})
        saved_schedulers = checkpoint.get("lr_schedulers", [])
        pipeline = checkpoint.get("pipeline", {})
        same_layout = pipeline.get("layout") == s.layout()
        given: set[int] = set()  # the checkpoint's tensors an earlier stage's optimizer holds now
        for stage, rt in enumerate(self.pipeline.runtimes):
            with self.select(stage), only_stage(module, list(module.pipeline_layers()), self.sizes, stage):
                if self.optimizers:
                    state, group_map = local_optimizer_state(
                        checkpoint, module, self.optimizers[stage], s._rank_key(), lambda: group_names
                    )
                    self.optimizers[stage].load_state_dict(_own_copy(state, given))
                    saved_groups = len(checkpoint["optimizer_states"][0]["param_groups"])
                    schedulers = regroup_schedulers(saved_schedulers, group_map, saved_groups)
                    if stage < s.pipeline_stages - 1:
                        # zip, not strict: what Lightning's restore does with the last stage's (next).
                        for config, saved in zip(self.scheduler_configs[stage], schedulers, strict=False):
                            config.scheduler.load_state_dict(saved)
                    else:
                        checkpoint["lr_schedulers"] = schedulers  # Lightning restores them next, as on rank 0
                accumulation = local_accumulation(checkpoint, [names[id(p)] for p in rt.stage.parameters()])
                mine = pipeline.get("ranks", {}).get(s._rank_key(), {}) if same_layout else {}
                s._load_rank_state(mine, accumulation)

    @contextmanager
    def _as_rank(self, stage: int, checkpoint: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """``stage``'s view: the strategy acts for it, the module holds only its layers, and Lightning's dict is
        the one its rank would have built (its keys, its optimizer, its schedulers)."""
        s = self.strategy
        module = s.lightning_module
        assert module is not None
        counts = [len(configs) for configs in self.scheduler_configs]
        offsets = [sum(counts[:k]) for k in range(len(counts) + 1)]
        with self.select(stage), only_stage(module, list(module.pipeline_layers()), self.sizes, stage):
            keys = module.state_dict().keys()
            view = dict(checkpoint, state_dict={k: checkpoint["state_dict"][k] for k in keys})
            if "optimizer_states" in checkpoint:
                view["optimizer_states"] = [checkpoint["optimizer_states"][stage]]
            if "lr_schedulers" in checkpoint and counts:
                view["lr_schedulers"] = checkpoint["lr_schedulers"][offsets[stage] : offsets[stage + 1]]
            yield view

    def _group_names(self) -> tuple[list[list[str]], dict[str, str]]:
        """`PACIStrategy._group_names` without the collective: every stage's part is here."""
        s = self.strategy
        module = s.lightning_module
        assert module is not None
        layers = list(module.pipeline_layers())
        parts = []
        for stage in range(s.pipeline_stages):
            with self.select(stage), only_stage(module, layers, self.sizes, stage):
                parts.append(s._stage_group_names(self.optimizers[stage]))
        return merge_group_names(parts)


def _own_copy(state: dict[str, Any], given: set[int]) -> dict[str, Any]:
    """``state`` with a copy of every tensor another stage's optimizer was given already, and those tensors noted.

    ``Optimizer.load_state_dict`` keeps the checkpoint's tensors when they already have the parameter's dtype and
    device. A one-device checkpoint holds a tied weight's state once, and both stages' copies take it (the last
    stage's by the first's name): on S processes each rank has its own; here the two optimizers would update one
    pair of moment buffers, twice per step.
    """
    out = {}
    for index, entry in state["state"].items():
        mine = {}
        for key, value in entry.items():
            if isinstance(value, Tensor):
                value = value.clone() if id(value) in given else value
                given.add(id(value))
            mine[key] = value
        out[index] = mine
    return dict(state, state=out)
