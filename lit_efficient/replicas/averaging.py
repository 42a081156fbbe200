"""LocalSGD and DiLoCo: keep the data-parallel replicas of one pipeline stage in step.

This module owns the periodic synchronization of a stage's weights across its data-parallel
("dp") group (docs/DESIGN.md section 3): which local steps synchronize, the averaging and outer
Nesterov math, the DiLoCo anchor and outer momentum, and their checkpoint state. It is pure
PyTorch (no Lightning); every collective goes through `lit_efficient.transport.process`.

Cost of one sync for a stage with P parameter elements and B floating-point buffer elements:

- one `all_reduce_flat` call, i.e. one all-reduce per dtype (a single one for an fp32 stage):
  "average" reduces the parameters in their own dtype (P x itemsize bytes), "nesterov" reduces
  the fp32 pseudo-gradient (4P bytes, also for bf16 parameters, so the outer step sees no bf16
  rounding; a warm-up sync averages the parameters in their own dtype under "nesterov" too, and the anchor
  starts from that average); floating buffers ride along in their own dtype (B x itemsize bytes).
- no collective for the divergence metric: each rank knows its own weights and, after the
  reduce, the average, so the distance is local arithmetic plus one host sync (`.item()`).
- memory: "average" reduces a transient copy of the parameters (the local values are needed
  for the divergence); "nesterov" keeps two persistent fp32 copies (anchor, outer momentum).

Construction is collective over the group: the weights are broadcast once from the group's
first rank so that every replica (and every DiLoCo anchor) starts from the same point.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal, Protocol, get_args

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lit_efficient.checks import is_count, is_real
from lit_efficient.transport.collectives import all_reduce_flat, broadcast_flat

OuterOptimizer = Literal["average", "nesterov"]
OUTER_OPTIMIZERS: tuple[str, ...] = get_args(OuterOptimizer)


def check_outer_optimizer(outer_optimizer: str, outer_lr: float, outer_momentum: float) -> None:
    """The one check of the outer optimizer's arguments (`ReplicaAverager`'s and PACIStrategy's, same names)."""
    if outer_optimizer not in OUTER_OPTIMIZERS:
        raise ValueError(f"outer_optimizer={outer_optimizer!r} is unknown; choose one of {OUTER_OPTIMIZERS}.")
    if not (is_real(outer_lr) and outer_lr > 0):
        raise ValueError(
            f"outer_lr={outer_lr!r} must be a number > 0; DiLoCo uses 0.7, 1.0 with momentum 0 is plain averaging."
        )
    if not (is_real(outer_momentum) and 0 <= outer_momentum < 1):
        raise ValueError(
            f"outer_momentum={outer_momentum!r} must be a number in [0, 1); DiLoCo uses 0.9, 0 disables it."
        )


class ReplicaAverager:
    """Synchronizes one module's weights across a data-parallel group every few local steps.

    Call `after_step()` after every local optimizer step, on every rank of the group, the same
    number of times: the schedule is a pure function of the local step count (`is_sync_step`),
    so replicas agree on when to synchronize without talking about it.

    - ``"average"`` (LocalSGD): parameters, and floating-point buffers if ``average_buffers``,
      become their mean across the group.
    - ``"nesterov"`` (DiLoCo): the anchor (fp32 copy of the last synced parameters) takes one
      outer SGD step with Nesterov momentum on the group-mean pseudo-gradient
      ``anchor - local``; the local parameters are then set to the anchor. Floating buffers are
      averaged as in ``"average"``. With ``outer_lr=1`` and ``outer_momentum=0`` this equals
      ``"average"`` (up to float rounding).

    The local optimizer's state is never touched. Integer buffers are never averaged.

    Args:
        module: The replica's local module (one pipeline stage). Its parameters are updated in
            place at every sync.
        group: The dp group of this stage (replicas of the same stage); None means the default
            group, or no group at all when torch.distributed is not initialized.
        sync_every: Local optimizer steps between syncs after warm-up (H; ~500 for DiLoCo at
            scale). 1 gives synchronous data parallelism for plain SGD.
        warmup_steps: Number of first local steps that each end with a sync (synchronous phase). A warm-up
            sync averages the weights under either outer optimizer, and DiLoCo's anchor starts from the weights
            of the last one (its outer momentum empty).
        outer_optimizer: "average" for LocalSGD, "nesterov" for DiLoCo.
        outer_lr: Outer learning rate (DiLoCo only; reference 0.7).
        outer_momentum: Outer Nesterov momentum in [0, 1) (DiLoCo only; reference 0.9).
        average_buffers: Also average floating-point buffers (e.g. BatchNorm running stats).
        offset: Steps by which this module's syncs are shifted after warm-up (`stream_offset`: Streaming DiLoCo,
            each pipeline stage a fragment synced in its turn). 0: every module syncs at the same steps.
        mean: How the replicas' mean is taken; None: over ``group`` (`GroupMean`), after one broadcast of its
            first rank's weights. A changing replica set (`replicas.fault_tolerance`) passes its own and
            makes the replicas' weights agree by healing, so nothing is broadcast here.

    Attributes:
        last_divergence: Relative L2 distance between this replica's parameters and the group
            average, measured just before the latest sync; None before the first sync.
        bytes_communicated: Payload bytes this rank handed to collectives so far (as reported
            by comm), including the broadcast at construction.
        setup_bytes: The part of `bytes_communicated` spent by the one-time broadcast at
            construction (0 for a single replica).
    """

    def __init__(
        self,
        module: nn.Module,
        group: ProcessGroup | None,
        sync_every: int,
        warmup_steps: int = 0,
        outer_optimizer: OuterOptimizer = "average",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        average_buffers: bool = True,
        mean: ReplicaMean | None = None,
        offset: int = 0,
    ) -> None:
        if not is_count(sync_every):
            raise ValueError(f"sync_every={sync_every!r} must be an integer >= 1; 1 synchronizes after every step.")
        if not is_count(warmup_steps, 0):
            raise ValueError(f"warmup_steps={warmup_steps!r} must be an integer >= 0; use 0 for no warm-up.")
        check_outer_optimizer(outer_optimizer, outer_lr, outer_momentum)
        self.module = module
        self.group = group
        self.sync_every = sync_every
        self.warmup_steps = warmup_steps
        self.offset = offset
        self.outer_optimizer = outer_optimizer
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.average_buffers = average_buffers

        self.last_divergence: float | None = None
        self.bytes_communicated = 0
        self.setup_bytes = 0
        self._step = 0
        self._mean = mean if mean is not None else GroupMean(group)
        # All parameters, frozen ones too: cheap insurance that replicas never drift apart if a
        # parameter is unfrozen later. The list is fixed here, in module order, on every rank.
        self._params = list(module.parameters())

        if mean is not None:
            pass  # a changing replica set (fault_tolerance.py): it makes the replicas' weights agree itself
        elif self._mean.alone:
            warnings.warn(
                "ReplicaAverager: the data-parallel group has a single replica, so there is nothing "
                "to average; syncs only apply the outer optimizer (if any) to this replica.",
                UserWarning,
                stacklevel=2,
            )
        else:
            self._share_weights()  # one model copy, once: DiLoCo anchors that start apart never meet again

        self._anchor: list[Tensor] = []
        self._outer: torch.optim.SGD | None = None
        if outer_optimizer == "nesterov":
            # fp32 so that many small outer updates are not lost to bf16 rounding.
            self._anchor = [p.detach().float().clone() for p in self._params]
            self._outer = torch.optim.SGD(
                self._anchor, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0
            )

    @torch.no_grad()
    def restart(self, step: int) -> None:
        """Start afresh from the module's weights as they are now, at local step ``step``: for a resume whose
        checkpoint carries no state of this averager (another layout, a run saved without replicas). The replicas
        take one copy of the weights (as at construction), the anchor is those weights and the outer momentum is
        empty, so the first sync's pseudo-gradient is what the replicas trained since the resume, not since the
        initial weights the anchor was built from; steps count on from the checkpoint's, so syncs stay on their
        schedule. Collective over the group, as the constructor."""
        if isinstance(self._mean, GroupMean) and not self._mean.alone:  # a changing set heals its replicas itself
            self._share_weights()
        self._step = int(step)
        if self._outer is None:
            return
        for a, p in zip(self._anchor, self._params, strict=True):
            a.copy_(p.detach())
        self._outer.state.clear()

    @property
    def step(self) -> int:
        """Number of local optimizer steps seen so far (calls of `after_step`)."""
        return self._step

    @property
    def bytes_per_step(self) -> float:
        """Payload bytes of this rank's syncs per local optimizer step so far (0.0 before the first step).

        The one-time broadcast at construction is left out, as DDP's initial broadcast is left out of
        its per-step traffic: after k steps with H between syncs (no warm-up) this is
        ``(k // H) * sync_bytes / k``, which tends to ``sync_bytes / H``. Payload, not wire bytes: a
        ring all-reduce over n ranks puts about ``2 (n - 1) / n`` times the payload on each link.
        """
        if self._step == 0:
            return 0.0
        return (self.bytes_communicated - self.setup_bytes) / self._step

    def is_sync_step(self, step: int) -> bool:
        """Whether local step ``step`` (1-based) ends with a sync: every step during warm-up,
        then every ``sync_every``-th step counted from the end of warm-up (shifted by ``offset``)."""
        if step < 1:
            raise ValueError(f"step={step} must be >= 1; local steps are numbered from 1.")
        return sync_due(step, self.sync_every, self.warmup_steps, self.offset)

    def after_step(self) -> bool:
        """Count one local optimizer step and synchronize if the schedule says so.

        Collective over the group on sync steps. Returns True when it synchronized.
        """
        self._step += 1
        if not self.is_sync_step(self._step):
            return False
        self.sync()
        return True

    def count_step(self) -> None:
        """Count one local optimizer step without synchronizing: for replicas whose syncs are driven from
        outside (`replicas.fault_tolerance`, at drained points)."""
        self._step += 1

    def sync(self) -> None:
        """Synchronize now, out of schedule if needed (e.g. before validation or a checkpoint).

        Collective: every rank of the group must call it at the same point. Updates
        `last_divergence` and `bytes_communicated`.
        """
        self.apply(self.reduce())

    @torch.no_grad()
    def reduce(self) -> tuple[list[Tensor], list[Tensor]]:
        """The collective half of `sync`: the replicas' means of what a sync averages (the parameters for
        "average", the fp32 pseudo-gradients for "nesterov"; and the floating buffers), nothing changed yet.
        With a changing replica set (fault_tolerance.py) a sync is committed or dropped after every hosted
        stage has reduced: `apply` only then."""
        buffers = [b.clone() for b in self._float_buffers()]
        if self.outer_optimizer == "nesterov" and not self._warming_up():
            values = [a - p.detach().float() for a, p in zip(self._anchor, self._params, strict=True)]
        else:
            # Reduce copies: the local values are needed afterwards for the divergence.
            values = [p.detach().clone() for p in self._params]
        if not self._mean.alone:
            self.bytes_communicated += self._mean(values + buffers)
        return values, buffers

    @torch.no_grad()
    def apply(self, means: tuple[list[Tensor], list[Tensor]]) -> None:
        """The local half of `sync`: this replica's weights and buffers (and, for "nesterov", the anchor and
        outer momentum) from the means `reduce` returned."""
        values, buffers = means
        if self.outer_optimizer == "average" and self._mean.alone:
            self.last_divergence = 0.0
            return
        for b, mean in zip(self._float_buffers(), buffers, strict=True):
            b.copy_(mean)
        if self.outer_optimizer == "nesterov" and not self._warming_up():
            self._apply_nesterov(values)
            return
        self._apply_average(values)
        if self._outer is not None:  # a warm-up sync: DiLoCo's outer steps start from these weights
            for a, p in zip(self._anchor, self._params, strict=True):
                a.copy_(p.detach())
            self._outer.state.clear()

    def _warming_up(self) -> bool:
        """Whether the step counted last is a warm-up step, whose sync averages the weights under DiLoCo too: an outer
        Nesterov step at every step moved the weights by up to outer_lr / (1 - outer_momentum) (7x) the inner
        step's, a warm-up several times the learning rate asked for, and its momentum carried on after it."""
        return 0 < self._step <= self.warmup_steps

    def _apply_average(self, means: list[Tensor]) -> None:
        diff_sq, avg_sq = _zeros(self._params)
        for p, avg in zip(self._params, means, strict=True):
            diff_sq += (p.detach().float() - avg.float()).pow(2).sum(dtype=torch.float64)
            avg_sq += avg.float().pow(2).sum(dtype=torch.float64)
            p.copy_(avg)
        self.last_divergence = _relative(diff_sq, avg_sq)

    def _apply_nesterov(self, pseudo_grads: list[Tensor]) -> None:
        assert self._outer is not None
        # This replica minus the average = local - (anchor - mean pseudo-gradient).
        diff_sq, avg_sq = _zeros(self._params)
        for a, p, g in zip(self._anchor, self._params, pseudo_grads, strict=True):
            avg = a - g
            diff_sq += (p.detach().float() - avg).pow(2).sum(dtype=torch.float64)
            avg_sq += avg.pow(2).sum(dtype=torch.float64)
            a.grad = g
        self.last_divergence = 0.0 if self._mean.alone else _relative(diff_sq, avg_sq)
        # Identical anchors, identical mean pseudo-gradients and identical outer state on every
        # replica make identical updates: no broadcast needed to stay bit-identical.
        self._outer.step()
        self._outer.zero_grad(set_to_none=True)
        for p, a in zip(self._params, self._anchor, strict=True):
            p.copy_(a)

    def _float_buffers(self) -> list[Tensor]:
        # Looked up at each sync (modules may re-register buffers); integer buffers such as
        # BatchNorm's num_batches_tracked are counters, not statistics, and stay local.
        if not self.average_buffers:
            return []
        return [b for b in self.module.buffers() if b.is_floating_point()]

    def _share_weights(self) -> None:
        """Every replica takes the first replica's weights and buffers (collective over the group); set-up traffic,
        not part of `bytes_per_step`."""
        sent = broadcast_flat(self._synced_tensors(), self.group)
        self.setup_bytes += sent
        self.bytes_communicated += sent

    def _synced_tensors(self) -> list[Tensor]:
        return [p.detach() for p in self._params] + self._float_buffers()

    def state_dict(self) -> dict[str, Any]:
        """Step counter, traffic counter and, for "nesterov", the anchor and outer momentum.

        Tensors are references (as in torch optimizers' state dicts): save or copy them before
        the next sync. The configuration is not stored; the constructor arguments win on resume.
        """
        momentum: list[Tensor | None] | None = None
        if self._outer is not None:
            momentum = [self._outer.state.get(a, {}).get("momentum_buffer") for a in self._anchor]
        return {
            "outer_optimizer": self.outer_optimizer,
            "step": self._step,
            "bytes_communicated": self.bytes_communicated,
            "anchor": list(self._anchor) if self._outer is not None else None,
            "outer_momentum_buffers": momentum,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` so that a resume mid-window continues exactly.

        Load the module's and local optimizer's own state separately (they are not stored here).

        Args:
            state: A dict produced by `state_dict` of an averager with the same outer optimizer
                over a module with the same parameter shapes.
        """
        if state["outer_optimizer"] != self.outer_optimizer:
            raise ValueError(
                f"state was saved with outer_optimizer={state['outer_optimizer']!r} but this averager "
                f"uses {self.outer_optimizer!r}; construct it with the checkpoint's outer optimizer."
            )
        self._step = int(state["step"])
        self.bytes_communicated = int(state["bytes_communicated"])
        if self._outer is None:
            return
        anchor, momentum = state["anchor"], state["outer_momentum_buffers"]
        if len(anchor) != len(self._anchor) or any(
            a.shape != b.shape for a, b in zip(anchor, self._anchor, strict=True)
        ):
            raise ValueError(
                "state's anchor does not match this module's parameters (count or shapes differ); "
                "load a checkpoint of the same stage."
            )
        with torch.no_grad():
            for a, saved in zip(self._anchor, anchor, strict=True):
                a.copy_(saved)
        # Write the momentum buffers directly rather than through SGD.load_state_dict, which
        # would also restore the checkpoint's lr/momentum over the constructor's.
        self._outer.state.clear()
        if self._warming_up():
            return  # a warm-up keeps no outer momentum (one saved before 12-07 carried the warm-up's outer steps')
        for a, buf in zip(self._anchor, momentum, strict=True):
            if buf is not None:
                self._outer.state[a]["momentum_buffer"] = buf.detach().to(a).clone()


def sync_due(step: int, sync_every: int, warmup_steps: int, offset: int) -> bool:
    """Whether a module with this schedule syncs at its local step ``step`` (1-based; 0 never)."""
    if step < 1:
        return False
    if step <= warmup_steps:
        return True
    after = step - warmup_steps
    return after >= offset and (after - offset) % sync_every == 0


def stream_offset(stage: int, num_stages: int, sync_every: int) -> int:
    """Streaming DiLoCo's shift for ``stage``'s syncs (arXiv 2501.18512: the model's fragments synced in turn):
    the stages spread evenly over the H steps between syncs, so at most ceil(S/H) stages' shares are on the
    network at any step instead of the whole model every H steps."""
    return stage * sync_every // num_stages


class ReplicaMean(Protocol):
    """The mean across a stage's replicas, in place, returning the bytes sent: `GroupMean` over a fixed group, or
    `replicas.fault_tolerance.TorchftReplicas` over whichever replica groups are alive."""

    alone: bool  # no other replica: nothing to reduce

    def __call__(self, tensors: list[Tensor]) -> int: ...


class GroupMean:
    """The mean over a fixed torch.distributed group: one summing all-reduce per dtype, then a division."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self.size = _group_size(group)
        self.alone = self.size == 1

    def __call__(self, tensors: list[Tensor]) -> int:
        sent = all_reduce_flat(tensors, self.group)
        for t in tensors:
            t.div_(self.size)
        return sent


def _group_size(group: ProcessGroup | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError(
                "a process group was given but torch.distributed is not initialized; "
                "call init_process_group first or pass group=None."
            )
        return 1
    size = dist.get_world_size(group)
    if size < 1:
        raise ValueError("this rank is not a member of the given group; pass the dp group of this rank's stage.")
    return size


def _zeros(params: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    # The divergence's two float64 sums, on the parameters' device: the per-parameter terms are 0-dim
    # device tensors, and CUDA refuses to add them into a CPU accumulator in place. Summing there also
    # keeps the loop free of host syncs; `_relative` reads both once.
    device = params[0].device if params else torch.device("cpu")
    return torch.zeros((), dtype=torch.float64, device=device), torch.zeros((), dtype=torch.float64, device=device)


def _relative(diff_sq: Tensor, avg_sq: Tensor) -> float:
    # Host sync, once per sync (one transfer of both sums): the metric is for logging and syncs are rare.
    diff, avg = torch.stack([diff_sq, avg_sq]).tolist()
    if avg == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return math.sqrt(diff / avg)
