"""Every stage's share of a checkpoint, merged into the dict one device would have saved.

A stage's share (`rank_share`) is its part of Lightning's checkpoint dict under parameter names, plus the
pipeline state of its rank. `assemble` merges the shares into what one device would have written, which the
single file holds as it is (`single_file`) and the sharded folder holds spread over its ranks
(`sharded_write`):

- ``state_dict``: the whole unsplit model, under the module's own key names;
- ``optimizer_states``: one optimizer in the unsplit index space, each parameter group the
  concatenation, stage by stage, of that group's parameters on every stage (the order
  ``configure_optimizers`` gives them on the whole module, since the stages hold consecutive layers);
- ``lr_schedulers``, loops, callbacks, ``hyper_parameters``: Lightning's own, from rank 0 (the
  pipeline is drained, so every stage's scheduler has taken the same steps);
- ``pipeline``: what only a pipeline has, keyed by parameter name wherever it can be: the layout it
  was written by, every group's parameter names, accumulated gradients of an unfinished window,
  per-rank RNG, and the LocalSGD/DiLoCo state and the diverged replicas' weights.

So ``Module.load_from_checkpoint(path)`` and ``ckpt_path=path`` under one device or DDP read it as
theirs, and `PACIStrategy` resumes it with any number of stages or replicas: each stage takes its
parameters, optimizer state and accumulated gradients by name (`restore`). What cannot carry over to
another layout (per-rank RNG, the averager's per-stage state) is dropped with a warning.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

from torch import nn

from lit_efficient.nested import map_tensors

FORMAT = 2  # `pipeline["format"]` of the single file (3: the sharded folder)
# A rank's own state, kept under its `rank_key` in both formats (``tied``: the tied-weight delay line, `runtime.tied`).
RANK_RECORD = ("accumulation", "rng", "averager", "tied")


def rank_key(stage: int, replica: int) -> str:
    """The key of a stage's rank in a checkpoint's ``pipeline["ranks"]`` (and ``pipeline["replicas"]``)."""
    return f"stage{stage}-replica{replica}"


def replica_of_key(key: str) -> int:
    """The replica of a `rank_key`."""
    return int(key.rpartition("-replica")[2])


def rank_share(
    checkpoint: dict[str, Any],
    group_names: list[list[str]] | None,
    extras: dict[str, Any],
    keep_weights: bool,
    tied_copies: Sequence[str] = (),
) -> dict[str, Any]:
    """What this rank contributes to the file: its stage's weights and optimizer under parameter names.

    Args:
        checkpoint: Lightning's checkpoint dict as this rank built it (its stage's keys only).
        group_names: This stage's optimizer's parameter names per group, in its order (`names_of_groups`); None
            without an optimizer.
        extras: ``stage``, ``replica`` and the pipeline state of this rank (accumulation, RNG, averager), on
            any device: the share holds host copies, and loading puts them back on the loading rank's device.
        keep_weights: Send weights and optimizer state (replica 0 always; other replicas when they diverge).
        tied_copies: Names of this stage's second copies of weights tied to the first stage (the LM head's
            copy of the token table): one device's optimizer holds such a weight once, so the merged
            optimizer leaves them out (``optimizer_by_name`` keeps them, for a pipeline to resume by name).
    """
    # Host copies of everything: the share is pickled to rank 0 (`gather_object`), where a CUDA storage
    # would be reopened on the sending rank's device index. Costs one device-to-host copy of what it holds.
    share = dict(_on_host(extras), tied_copies=list(tied_copies))
    if keep_weights:
        share["state_dict"] = _on_host(checkpoint["state_dict"])
        if group_names is not None and checkpoint.get("optimizer_states"):  # none under save_weights_only
            share["groups"] = [list(names) for names in group_names]
            share["optimizer"] = _on_host(checkpoint["optimizer_states"][0])
            share["lr_schedulers"] = _on_host(checkpoint.get("lr_schedulers", []))
    return share


def names_of_groups(module: nn.Module, optimizer: Any) -> list[list[str]]:
    """``optimizer``'s parameters per group as ``module`` names them."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def assemble(checkpoint: dict[str, Any], shares: list[dict[str, Any]], layout: dict[str, Any]) -> dict[str, Any]:
    """Rank 0: Lightning's dict of rank 0 with the whole model and optimizer merged from every share."""
    primary = sorted((s for s in shares if s["replica"] == 0), key=lambda s: s["stage"])
    out = dict(checkpoint)
    out["state_dict"] = {k: v for s in primary for k, v in s["state_dict"].items()}
    pipeline: dict[str, Any] = {"format": FORMAT, "layout": layout, "ranks": {}, "replicas": {}}
    slots: dict = {}  # none without optimizer state (save_weights_only): diverged replicas then keep weights only
    if all("optimizer" in s for s in primary):
        merged, names, slots = _merge_optimizers(primary)
        out["optimizer_states"] = [merged]
        out["lr_schedulers"] = _merge_schedulers(primary, slots, len(names))
        pipeline["param_names"] = names
        pipeline["optimizer_by_name"] = {n: st for s in primary for n, st in _by_name(s, slots).items()}
    for s in shares:
        key = rank_key(s["stage"], s["replica"])
        pipeline["ranks"][key] = {k: s[k] for k in RANK_RECORD if k in s}
        if s["replica"] > 0 and "state_dict" in s:
            pipeline["replicas"][key] = {"state_dict": s["state_dict"], "optimizer_by_name": _by_name(s, slots)}
    out["pipeline"] = pipeline
    return out


def group_key(group: dict[str, Any]) -> str:
    """What makes parameter groups of different stages one group of the unsplit optimizer: equal
    hyper-parameters and base learning rate, and not the parameters' names (torch keeps them in ``param_names`` for
    an optimizer given ``named_parameters()``). The base rate is ``initial_lr`` where a scheduler set it, whose
    ``lr`` a stage's own scheduler or correction may have moved, and ``lr`` otherwise: groups that differ only in
    it (a layer-wise learning-rate decay) are other groups, which merged into one."""
    base = group.get("initial_lr", group.get("lr"))
    kept = [(k, _comparable(v)) for k, v in group.items() if k not in ("params", "param_names", "lr", "initial_lr")]
    return repr(sorted([*kept, ("base lr", base)]))


def _comparable(value: Any, depth: int = 0) -> Any:
    """``value`` as its repr compares it across stages: an object of a class without a repr of its own (``<Tag
    object at 0x...>``, another address on each stage's ``configure_optimizers`` call) by its class and attributes
    (``__dict__`` and ``__slots__``), which split one group into one per stage (a checkpoint one device refused:
    another number of groups). Three levels deep, then by class alone: an object may refer to itself, or to a
    Trainer and everything it holds."""
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_comparable(v, depth + 1) for v in value) if depth < 3 else type(value).__name__
    if isinstance(value, dict):
        return {k: _comparable(v, depth + 1) for k, v in value.items()} if depth < 3 else "dict"
    if type(value).__repr__ is not object.__repr__:
        return value
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    if depth >= 3:
        return name
    fields = dict(getattr(value, "__dict__", {}))
    for cls in type(value).__mro__:
        slots = getattr(cls, "__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                fields[slot] = getattr(value, slot)
    return (name, sorted((k, _comparable(v, depth + 1)) for k, v in fields.items()))


def merged_groups(stages: Sequence[Sequence[str]]) -> list[list[int]]:
    """Which group of the unsplit optimizer each stage's group is (per stage, per local group), from each stage's
    group keys (`group_key`) in its own order, stage by stage.

    Stages that list the same keys (the same groups built on every stage, an empty one where a stage holds none of
    its parameters, as `GPT`'s optimizer does) are matched by position: one device's groups exactly, two groups of
    equal settings included (``weight_decay=0.0`` makes GPT's two groups alike: matched by settings they merged
    into one, and neither one device nor the pipeline read the other's checkpoint). Stages whose groups differ
    (a stage left a group out, a learning rate per layer) are matched by key, in `group_order`."""
    if all(list(keys) == list(stages[0]) for keys in stages):
        return [list(range(len(keys))) for keys in stages]
    order = group_order(stages)
    return [[order.index(key) for key in keys] for keys in stages]


def group_order(stages: Sequence[Sequence[str]]) -> list[str]:
    """The unsplit optimizer's group keys in one device's order as far as the stages tell it: each stage lists its
    groups in the order of the user's configure_optimizers (less those it left out), so every stage's order is
    kept; groups no stage holds together come by first appearance, stage by stage, which may not be one device's
    (warned: keep the empty groups). First appearance alone put a group stage 0 lacks after stage 0's, where one
    device lists it first: one device refused the checkpoint (another group size) or, with sizes alike, read one
    group's hyper-parameters into another. Stages that disagree on an order (a cycle) keep first appearance."""
    first: dict[str, int] = {}
    before: dict[str, set[str]] = {}  # key -> the keys some stage lists after it
    for keys in stages:
        own = list(dict.fromkeys(keys))  # two equal groups of one stage are one merged group
        for key in own:
            first.setdefault(key, len(first))
            before.setdefault(key, set())
        for a, b in zip(own, own[1:], strict=False):
            before[a].add(b)
    waiting = {key: 0 for key in first}
    for later in before.values():
        for key in later:
            waiting[key] += 1
    order: list[str] = []
    ready = [key for key in first if waiting[key] == 0]
    guessed = False
    while ready:
        guessed = guessed or len(ready) > 1
        key = min(ready, key=first.__getitem__)
        ready.remove(key)
        order.append(key)
        for later in before[key]:
            waiting[later] -= 1
            if waiting[later] == 0:
                ready.append(later)
    if guessed or len(order) < len(first):
        warnings.warn(
            f"The pipeline's stages build different optimizer groups ({[len(keys) for keys in stages]} per stage), "
            "and no stage holds some of them together: the checkpoint lists those in stage order, which may not be "
            "one device's (a one-device resume may then refuse it, or read one group's settings into another). "
            "Build the same groups on every stage in configure_optimizers, keeping a group empty where a stage has "
            "none of its parameters (torch accepts empty groups).",
            stacklevel=2,
        )
    return order + [key for key in first if key not in order]


def merge_group_names(
    stages: Sequence[tuple[int, list[tuple[str, list[str]]], list[str], list[str]]],
) -> tuple[list[list[str]], dict[str, str]]:
    """The unsplit optimizer's parameter names per group from every stage's ``(stage, [(group key, names)],
    first copies, second copies)``: groups matched as `merged_groups` matches them (as `_merge_optimizers`
    does), and ``{second copy: first copy}`` of the tied weights by name."""
    ordered = sorted(stages, key=lambda x: x[0])
    slots = merged_groups([[key for key, _ in groups] for _, groups, _, _ in ordered])
    merged: list[list[str]] = [[] for _ in range(1 + max((m for own in slots for m in own), default=-1))]
    for (_, stage_groups, _, _), own in zip(ordered, slots, strict=True):
        for (_, group_names), m in zip(stage_groups, own, strict=True):
            merged[m].extend(group_names)
    firsts = [n for _, _, f, _ in stages for n in f]
    seconds = [n for _, _, _, c in stages for n in c]
    return merged, dict(zip(seconds, firsts, strict=True))


def _merge_optimizers(primary: list[dict[str, Any]]) -> tuple[dict[str, Any], list[list[str]], dict]:
    """One optimizer state in the unsplit index space. A stage may lack a group (no biases on an
    embedding stage), so groups are matched as `merged_groups` matches them.
    Returns the state, the names per merged group and ``slots[(stage, local group)] = merged group``."""
    matched = merged_groups([[group_key(group) for group in s["optimizer"]["param_groups"]] for s in primary])
    slots = {(s["stage"], g): m for s, own in zip(primary, matched, strict=True) for g, m in enumerate(own)}
    count = 1 + max(slots.values(), default=-1)
    groups: list[dict[str, Any]] = [{} for _ in range(count)]
    names: list[list[str]] = [[] for _ in range(count)]
    members: list[list[tuple[int, Any]]] = [[] for _ in range(count)]  # (share, local index) per merged group
    for i, s in enumerate(primary):
        for g, group in enumerate(s["optimizer"]["param_groups"]):
            m = slots[(s["stage"], g)]
            groups[m] = groups[m] or {k: v for k, v in group.items() if k not in ("params", "param_names")}
            skip = set(s.get("tied_copies", ()))
            pairs = zip(s["groups"][g], group["params"], group.get("param_names", group["params"]), strict=True)
            kept = [(n, local, given) for n, local, given in pairs if n not in skip]
            names[m] += [name for name, _, _ in kept]
            members[m] += [(i, local) for _, local, _ in kept]
            if "param_names" in group:  # the names the user gave torch, one device's group's: every stage's
                groups[m]["param_names"] = groups[m].get("param_names", []) + [given for _, _, given in kept]
    state, index = {}, 0
    for m, group in enumerate(groups):
        group["params"] = []
        for i, local in members[m]:
            if local in primary[i]["optimizer"]["state"]:
                state[index] = primary[i]["optimizer"]["state"][local]
            group["params"].append(index)
            index += 1
    return {"state": state, "param_groups": groups}, names, slots


# A torch scheduler's state entries with one value per parameter group; SequentialLR's and ChainedScheduler's own
# schedulers' states sit under _NESTED. Named, not guessed from a list's length: SequentialLR's ``_milestones`` (and
# ``_schedulers`` itself) may have as many entries as there are groups.
_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs", "max_lrs", "base_momentums", "max_momentums")
_NESTED = "_schedulers"


def _merge_schedulers(primary: list[dict[str, Any]], slots: dict, num_groups: int) -> list[dict[str, Any]]:
    """Each scheduler's state with its per-group lists (``base_lrs``, ``_last_lr``, ...) over the merged groups."""
    return [
        _merge_scheduler([(s["stage"], s["lr_schedulers"][c]) for s in primary], slots, num_groups)
        for c in range(len(primary[0].get("lr_schedulers", [])))
    ]


def _merge_scheduler(states: list[tuple[int, dict[str, Any]]], slots: dict, num_groups: int) -> dict[str, Any]:
    """One scheduler's ``(stage, state)`` of every stage -> its state over the merged groups (nested ones too)."""
    out = dict(states[0][1])
    for key in _PER_GROUP:
        if isinstance(out.get(key), list):
            merged: list[Any] = [None] * num_groups
            for stage, state in states:
                for g, value in enumerate(state[key]):
                    merged[slots[(stage, g)]] = value
            out[key] = merged
    if isinstance(out.get(_NESTED), list):
        out[_NESTED] = [
            _merge_scheduler([(stage, state[_NESTED][i]) for stage, state in states], slots, num_groups)
            for i in range(len(out[_NESTED]))
        ]
    return out


def regroup_schedulers(states: list[dict[str, Any]], group_map: list[int], num_groups: int) -> list[dict[str, Any]]:
    """Scheduler states over the checkpoint's groups -> over this stage's (``group_map[local] = saved``)."""
    return [_regroup_scheduler(state, group_map, num_groups) for state in states]


def _regroup_scheduler(state: dict[str, Any], group_map: list[int], num_groups: int) -> dict[str, Any]:
    state = dict(state)
    for key in _PER_GROUP:
        value = state.get(key)
        if isinstance(value, list) and len(value) == num_groups:
            state[key] = [value[g] for g in group_map]
    if isinstance(state.get(_NESTED), list):
        state[_NESTED] = [_regroup_scheduler(s, group_map, num_groups) for s in state[_NESTED]]
    return state


def _by_name(share: dict[str, Any], slots: dict) -> dict[str, Any]:
    """``{name: (merged group, group hyper-parameters, optimizer state)}`` of one share."""
    if "optimizer" not in share:
        return {}
    local = share["optimizer"]
    out = {}
    for g, (group, names) in enumerate(zip(local["param_groups"], share["groups"], strict=True)):
        hyper = {k: v for k, v in group.items() if k != "params"}
        for local_index, name in zip(group["params"], names, strict=True):
            out[name] = (slots.get((share["stage"], g), g), hyper, local["state"].get(local_index, {}))
    return out


def to_automatic_loops(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Copy the optimizer-step count of the manual loop (the pipeline runs the module under manual
    optimization) into the automatic loop's, where one device and DDP read ``global_step`` from."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    manual = loop.get(_MANUAL)
    automatic = loop.get(_AUTOMATIC)
    if manual is not None and automatic is not None:
        steps = copy.deepcopy(manual)
        automatic["optimizer"]["step"] = steps
        zero = automatic["optimizer"]["zero_grad"]
        for scope in ("total", "current"):
            zero[scope].update(
                ready=steps[scope]["ready"], started=steps[scope]["ready"], completed=steps[scope]["completed"]
            )
    return checkpoint


def from_automatic_loops(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The other way, for a checkpoint written under automatic optimization (one device, DDP)."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    manual, automatic = loop.get(_MANUAL), loop.get(_AUTOMATIC)
    if manual is not None and automatic is not None and manual["total"]["completed"] == 0:
        loop[_MANUAL] = copy.deepcopy(automatic["optimizer"]["step"])
    return checkpoint


_MANUAL = "epoch_loop.manual_optimization.optim_step_progress"
_AUTOMATIC = "epoch_loop.automatic_optimization.optim_progress"


def _on_host(obj: Any) -> Any:
    """``obj`` with every tensor detached and on the host."""
    return map_tensors(obj, lambda t: t.detach().cpu())
