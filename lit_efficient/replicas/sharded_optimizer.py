"""ZeRO-1 for ``PACIStrategy(shard_optimizer_state=True)``: a stage's optimizer state split over its replicas.

Without it every data-parallel replica of a stage holds the stage's whole optimizer state (AdamW: two
fp32 tensors per weight). With it, a stage's parameters are laid end to end, one flat buffer per dtype,
padded to a multiple of the R replicas, and replica r owns elements ``[r * C, (r + 1) * C)`` of each
(``C = ceil(numel / R)``). Each optimizer step then has three phases over the stage's replica group:

1. reduce-scatter: every replica's gradients summed, each replica receiving only its own chunk (the
   other elements of its ``.grad`` are zeroed, so what the stage normalizes, checks and clips is its
   chunk); the window's weight and non-finite flags go in one small all-reduce after it;
2. step: the user's optimizer class, built over 1-D views of the owned chunk (a parameter that
   straddles a chunk boundary contributes a piece to each side), steps only those elements, so only
   they have state: 1/R of it per replica;
3. all-gather: every replica's updated chunk, written back into the full parameters.

Reduce-scatter plus all-gather move the same bytes as the all-reduce they replace (a ring all-reduce
is exactly those two phases), plus three numbers. Both collectives are gloo's too (torch 2.13: measured
on CPU in tests/replicas/test_shard_optimizer.py), so no fallback is needed there.

Stepping slices is exact only for optimizers whose update of an element reads that element alone
(SGD, Adam, AdamW, ...): `check_elementwise` refuses the others (Adafactor's factored moments, LBFGS).

Why not ``torch.distributed.optim.ZeroRedundancyOptimizer``: it assigns whole parameters to ranks
(a stage holding one large embedding cannot be split evenly), relies on DDP's all-reduce of the whole
gradient and then broadcasts each parameter from its owner (1.5x the bytes of an all-reduce), and builds
its own optimizer from a class and defaults, so the optimizer ``configure_optimizers`` returned (which
Lightning's LR schedulers and checkpoints hold) would no longer be the one whose learning rate counts.
Here the user's optimizer stays: its parameter groups (names, learning rates a scheduler sets) are read
at every step, it holds no state, and the checkpoint boundary (`ShardedOptimizer.state_dict` /
``load_state_dict``) speaks its format, the whole stage's state by parameter index, so checkpoints stay
what they are without sharding and load on any layout.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lit_efficient.transport.collectives import all_reduce_flat

# Optimizers whose update of an element reads only that element's parameter, gradient and state: stepping
# a slice of a parameter is then stepping the parameter. Checked by their `step` method, so a subclass
# that only changes construction passes and one that changes the update does not.
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta")
)

# torch >= 2.13 names them *_single; the older names are deprecated aliases.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose step is not element-wise: its state cannot be split by element."""
    steps = {cls.step for cls in ELEMENTWISE}
    if type(optimizer).step not in steps:
        raise ValueError(
            f"PACIStrategy(shard_optimizer_state=True) splits each parameter's optimizer state by element over the "
            f"stage's replicas, which is exact only for optimizers that update each element on its own "
            f"({', '.join(c.__name__ for c in ELEMENTWISE)}); configure_optimizers returned "
            f"{type(optimizer).__name__}. Use one of those, or shard_optimizer_state=False."
        )


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors in an optimizer's state (a `ShardedOptimizer`: this replica's chunk's)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


@dataclass(frozen=True)
class _Piece:
    """The part of parameter ``index`` (in the user optimizer's order) this replica owns: elements
    ``[start, stop)`` of its flattened tensor, stepped through ``view``."""

    index: int
    start: int
    stop: int
    view: Tensor


class _Bucket:
    """The parameters of one dtype and device laid end to end, padded to ``replicas x chunk`` elements."""

    def __init__(self, params: list[tuple[int, nn.Parameter]], replicas: int, rank: int) -> None:
        self.params = params
        total = sum(p.numel() for _, p in params)
        self.chunk = math.ceil(total / replicas)
        self.padded = self.chunk * replicas
        self.own = (rank * self.chunk, (rank + 1) * self.chunk)
        self.pieces: list[_Piece] = []
        offset = 0
        for index, p in params:
            if not p.is_contiguous():
                raise ValueError(
                    f"shard_optimizer_state=True steps views of each parameter's flat storage; parameter {index} of "
                    f"the stage's optimizer (shape {tuple(p.shape)}) is not contiguous. Make it contiguous in the "
                    "module's __init__ (param.data = param.data.contiguous())."
                )
            start, stop = max(offset, self.own[0]), min(offset + p.numel(), self.own[1])
            if start < stop:
                flat = p.detach().view(-1)  # shares the parameter's storage and version counter
                self.pieces.append(_Piece(index, start - offset, stop - offset, flat[start - offset : stop - offset]))
            offset += p.numel()

    def flatten(self, tensors: list[Tensor]) -> Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        pad = self.padded - flat.numel()
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    def scatter_back(self, flat: Tensor, tensors: list[Tensor]) -> None:
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


class ShardedOptimizer:
    """The user's optimizer, its state split by element over a stage's replicas (see the module docstring).

    `PipelineStage` calls ``step`` and ``zero_grad`` as on any optimizer and `reduce_gradients` instead of the
    replicas' all-reduce; Lightning and the checkpoints see ``param_groups`` (the user's own) and the state
    of the whole stage through ``state_dict`` / ``load_state_dict``.

    Args:
        optimizer: What ``configure_optimizers`` built over this stage's parameters (element-wise; see
            `check_elementwise`). It keeps its parameter groups and never steps or holds state.
        group: The stage's data-parallel replica group.
        ranks: The global ranks of ``group``, replica 0 first (where ``state_dict`` consolidates).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup, ranks: Sequence[int]) -> None:
        check_elementwise(optimizer)
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups  # the same dicts: a scheduler's lr is read at every step
        self.defaults = optimizer.defaults
        self.group, self.ranks = group, list(ranks)
        self.rank = dist.get_rank(group)
        self._final: dict[str, Any] | None = None
        params = [p for g in self.param_groups for p in g["params"]]
        by_kind: dict[tuple[torch.dtype, torch.device], list[tuple[int, nn.Parameter]]] = {}
        for index, p in enumerate(params):
            by_kind.setdefault((p.dtype, p.device), []).append((index, p))
        self._params = params
        self._buckets = [_Bucket(members, len(self.ranks), self.rank) for members in by_kind.values()]
        self._pieces = [piece for b in self._buckets for piece in b.pieces]
        group_of = {i: g for g, group_ in enumerate(self.param_groups) for i in _indices(group_, params)}
        inner_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in self.param_groups
        ]  # fmt: skip
        by_group: list[list[_Piece]] = [[] for _ in self.param_groups]
        for piece in self._pieces:
            by_group[group_of[piece.index]].append(piece)
        for group_, members in zip(inner_groups, by_group, strict=True):
            group_["params"] = [piece.view for piece in members]
        self._ordered = [piece for members in by_group for piece in members]  # the inner optimizer's index order
        # None: this replica owns only padding (a stage with fewer elements than replicas).
        self._inner = _same_kind(optimizer, inner_groups) if self._pieces else None

    @property
    def state(self) -> dict[Tensor, dict[str, Any]]:
        """This replica's optimizer state: its chunk's pieces' (a property: loading replaces the inner dict)."""
        return self._inner.state if self._inner is not None else {}

    # -- the step's three phases --------------------------------------------------------------------

    def reduce_gradients(self, grads: list[Tensor], totals: Tensor) -> Tensor:
        """`PipelineStage.reduce_gradients`: reduce-scatter the stage's gradients (phase 1).

        Each ``.grad`` is left holding this replica's chunk of the sum over replicas and zeros elsewhere.
        The window's weight and downstream non-finite flag are summed as the all-reduce would, and so is a
        non-finite count of the chunks: any replica's chunk being non-finite puts a NaN into every replica's
        gradients, so all of them refuse the update (each would otherwise see only its own chunk, and one
        raising while the others wait in the all-gather would hang them until the group's timeout).
        """
        mine = {id(p.grad) for p in self._params}
        others = [g for g in grads if id(g) not in mine]  # a stage parameter the optimizer does not hold
        bad = torch.zeros((), dtype=totals.dtype, device=totals.device)
        for bucket in self._buckets:
            # A frozen parameter (no gradient on any replica) reduces zeros and keeps no gradient: stepped with one,
            # AdamW's weight decay would move it.
            live = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in bucket.params]
            flat = bucket.flatten(live)
            chunk = flat.new_empty(bucket.chunk)
            _reduce_scatter(chunk, flat, group=self.group)
            flat.zero_()
            flat[bucket.own[0] : bucket.own[1]] = chunk
            bucket.scatter_back(flat, live)
            bad += (~torch.isfinite(chunk)).sum().to(bad.dtype)
        totals = totals.clone()
        head = torch.stack([totals[0], totals[1], bad])
        all_reduce_flat([*others, head], self.group)
        totals[:2] = head[:2]
        holding = [p for p in self._params if p.grad is not None]
        if holding:  # without a host sync: NaN into the first element where any chunk was non-finite
            first = holding[0].grad.view(-1)[:1]
            first.copy_(torch.where(head[2:3] > 0, torch.full_like(first, float("nan")), first))
        return totals

    def step(self, closure: Any = None) -> None:
        """Step this replica's chunk (phase 2) and all-gather every replica's into the parameters (phase 3)."""
        if closure is not None:
            raise ValueError("shard_optimizer_state=True steps without a closure (the pipeline computes the loss)")
        if self._inner is not None:
            for inner, own in zip(self._inner.param_groups, self.param_groups, strict=True):
                inner.update({k: v for k, v in own.items() if k != "params"})  # lr from schedulers, lr_scale
            for piece in self._pieces:
                grad = self._params[piece.index].grad
                piece.view.grad = None if grad is None else grad.reshape(-1)[piece.start : piece.stop]
            self._inner.step()
        # The user's optimizer, which its schedulers hold, never steps itself: mark it stepped as its own step would
        # (torch's schedulers warned "lr_scheduler.step() before optimizer.step()" at every first step otherwise).
        self.optimizer._opt_called = True
        for bucket in self._buckets:
            own = [piece.view for piece in bucket.pieces]
            pad = bucket.chunk - sum(v.numel() for v in own)
            ref = bucket.params[0][1]
            chunk = torch.cat([*own, ref.new_zeros(pad)]) if pad or not own else torch.cat(own)
            full = ref.new_empty(bucket.padded)
            _all_gather(full, chunk.detach(), group=self.group)
            with torch.no_grad():
                bucket.scatter_back(full, [p.detach() for _, p in bucket.params])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The parameters' gradients, and the chunk views of them the step used (they would keep them alive)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for piece in self._pieces:
            piece.view.grad = None

    # -- the checkpoint boundary: the whole stage's state, as the user's optimizer would hold it -------

    def state_dict(self) -> dict[str, Any]:
        """The user's optimizer's state dict for the whole stage, on replica 0 (the others: its groups and no
        state; only replica 0's share goes into a checkpoint). Collective over the replica group while the
        stage trains; after `keep_consolidated` (the end of fit, before the group goes) the kept one."""
        if self._final is not None:
            return self._final
        return self._consolidate()

    def keep_consolidated(self) -> None:
        """At the end of training, while the replica group still exists: consolidate once and keep it, for a
        ``trainer.save_checkpoint`` after ``fit``. Costs replica 0 the whole stage's state in host memory."""
        self._final = self._consolidate()

    def _consolidate(self) -> dict[str, Any]:
        # Host copies, gathered as objects (pickled): a CUDA storage would be reopened on the sender's device.
        # Replica 0 then holds the stage's whole state in host memory while the checkpoint is written, as an
        # unsharded stage's share does (checkpoint.rank_share copies it to the host too).
        mine = []
        if self._inner is not None:
            for view, piece in zip(self._inner_params(), self._ordered, strict=True):
                state = self._inner.state.get(view, {})
                mine.append((piece.index, piece.start, {k: _cpu(v) for k, v in state.items()}))
        gathered: list[Any] | None = [None] * len(self.ranks) if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=self.ranks[0], group=self.group)
        out = self.optimizer.state_dict()  # the groups, current hyper-parameters; no state: it never steps
        out["state"] = {}
        if self.rank != 0:
            return out
        pieces: dict[int, list[tuple[int, dict[str, Any]]]] = {}
        for part in gathered:  # type: ignore[union-attr]
            for index, start, state in part:
                pieces.setdefault(index, []).append((start, state))
        for index, parts in pieces.items():
            parts.sort(key=lambda item: item[0])
            shape = self._params[index].shape
            merged: dict[str, Any] = {}
            for key, first in parts[0][1].items():
                if torch.is_tensor(first) and first.dim() == 1:  # element-wise: the pieces end to end
                    merged[key] = torch.cat([state[key] for _, state in parts]).view(shape)
                else:  # a per-parameter scalar (Adam's step): equal on every piece
                    merged[key] = first
            if merged:
                out["state"][index] = merged
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take this replica's chunk of a whole stage's state (what `local_optimizer_state` gives every rank)."""
        self._final = None
        for own, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            own.update({k: v for k, v in saved.items() if k != "params"})
        if self._inner is None:
            return
        inner: dict[int, dict[str, Any]] = {}
        views = self._inner_params()
        for j, piece in enumerate(self._ordered):
            saved = state_dict["state"].get(piece.index)
            if saved is None:
                continue
            # A 0-dim parameter's element-wise state is 0-dim too, as its step count is: which is which, the
            # optimizer's class says (a 0-dim moment loaded onto the 1-D piece failed its next step).
            scalar = self._params[piece.index].dim() == 0
            by_element = _elementwise_keys(self._inner, views[j]) if scalar else set()
            # A clone, not a view: a view would keep the whole parameter's state alive on every replica.
            inner[j] = {
                k: v.reshape(-1)[piece.start : piece.stop].clone()
                if torch.is_tensor(v) and (v.dim() > 0 or k in by_element)
                else v
                for k, v in saved.items()
            }
        groups = self._inner.state_dict()["param_groups"]
        for own, group in zip(self.param_groups, groups, strict=True):
            group.update({k: v for k, v in own.items() if k != "params"})
        self._inner.load_state_dict({"state": inner, "param_groups": groups})

    def _inner_params(self) -> list[Tensor]:
        assert self._inner is not None
        return [p for g in self._inner.param_groups for p in g["params"]]

    def __repr__(self) -> str:
        return f"ShardedOptimizer({self.optimizer!r}, replica {self.rank} of {len(self.ranks)})"


def _same_kind(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and defaults over ``groups``. Only the defaults its constructor
    takes (AdamW's carry ``decoupled_weight_decay``, which it sets itself); the groups carry every one."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


def _elementwise_keys(optimizer: torch.optim.Optimizer, view: Tensor) -> set[str]:
    """The state keys ``optimizer``'s class keeps element by element for ``view``'s group, told apart from its
    per-parameter scalars (Adam's ``step``, NAdam's ``mu_product``) by one step of a copy on a one-element tensor."""
    group = next(g for g in optimizer.param_groups if any(p is view for p in g["params"]))
    probe = torch.zeros(1, dtype=view.dtype, device=view.device, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    copy = _same_kind(optimizer, [{**{k: v for k, v in group.items() if k != "params"}, "params": [probe]}])
    copy.step()
    return {k for k, v in copy.state[probe].items() if torch.is_tensor(v) and v.dim() > 0}


def _indices(group: dict[str, Any], params: list[nn.Parameter]) -> list[int]:
    ids = {id(p) for p in group["params"]}
    return [i for i, p in enumerate(params) if id(p) in ids]


def _cpu(value: Any) -> Any:
    return value.detach().cpu() if torch.is_tensor(value) else value
