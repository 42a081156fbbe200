"""Reading a pipeline checkpoint back, by parameter name: each stage takes its weights, optimizer state,
scheduler states and an unfinished window's gradients from the dict one device would have saved (the single
file as it is, or what `sharded_read` gives a rank), whatever layout wrote it and whatever layout reads it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from torch import Tensor, nn

from lit_efficient.checkpoint.merge import replica_of_key


def local_state_dict(checkpoint: dict[str, Any], module: nn.Module, replica_key: str | None) -> dict[str, Tensor]:
    """The checkpoint's weights for this stage's keys (a diverged replica's own, when it was saved)."""
    source = checkpoint["state_dict"]
    replicas = checkpoint.get("pipeline", {}).get("replicas", {})
    if replica_key is not None and replica_key in replicas:
        source = {**source, **replicas[replica_key]["state_dict"]}
    keys = module.state_dict().keys()
    return {k: source[k] for k in keys if k in source}


def unexpected_keys(checkpoint: dict[str, Any], expected: Collection[str]) -> list[str]:
    """The checkpoint's weight keys the whole module does not have (a rank reads only its stage's share of a
    folder, which records all of its keys)."""
    saved = checkpoint.get("pipeline", {}).get("saved_keys", checkpoint["state_dict"].keys())
    expected = set(expected)
    return [k for k in saved if k not in expected]


def local_optimizer_state(
    checkpoint: dict[str, Any], module: nn.Module, optimizer: Any, replica_key: str | None, names_by_group: Any
) -> tuple[dict[str, Any], list[int]]:
    """This stage's optimizer state dict, taken from the checkpoint by parameter name, and for each of
    its groups the checkpoint's group it came from (to regroup the schedulers' per-group lists).

    Args:
        checkpoint: The loaded file.
        module: The split module.
        optimizer: This stage's optimizer.
        replica_key: ``stage{s}-replica{r}`` of this rank (a diverged replica's own state wins).
        names_by_group: For a checkpoint without ``pipeline.optimizer_by_name`` (one device, DDP): a callable
            returning the unsplit optimizer's names per group, by the concatenation rule, and the names of
            tied weights' second copies with the name of the copy one device's optimizer holds (collective).
    """
    pipeline = checkpoint.get("pipeline", {})
    by_name = dict(pipeline.get("optimizer_by_name") or {})
    if replica_key is not None and replica_key in pipeline.get("replicas", {}):
        by_name.update(pipeline["replicas"][replica_key]["optimizer_by_name"])
    if not by_name:
        group_names, copy_of = names_by_group()
        by_name = _from_index_space(checkpoint["optimizer_states"][0], pipeline.get("param_names") or group_names)
        by_name.update({copy: by_name[first] for copy, first in copy_of.items() if first in by_name})
    params = dict(module.named_parameters())
    names = {id(p): n for n, p in params.items()}
    groups, state, index, group_map = [], {}, 0, []
    for group in optimizer.param_groups:
        mine = [names[id(p)] for p in group["params"]]
        missing = [n for n in mine if n not in by_name]
        if missing:
            raise KeyError(
                f"the checkpoint has no optimizer state for {missing[:3]}{' ...' if len(missing) > 3 else ''}: it "
                "was written for another model, or its optimizer covered other parameters"
            )
        if mine:
            saved_group, hyper, _ = by_name[mine[0]]
        else:  # a group with none of this stage's parameters (the same groups built on every stage): by position
            saved_group = len(group_map)
            hyper = next((h for g, h, _ in by_name.values() if g == saved_group), group)
        group_map.append(saved_group)
        # The stage's own parameter names (``named_parameters()`` groups), not the saved group's, which name
        # every stage's (torch's load_state_dict takes a loaded group's ``param_names`` over its own).
        entry = {k: v for k, v in hyper.items() if k != "param_names"}
        entry["params"] = []
        if "param_names" in group:
            entry["param_names"] = list(group["param_names"])
        for name in mine:
            saved = by_name[name][2]
            _check_shapes(name, saved, params[name])
            if saved:
                state[index] = saved
            entry["params"].append(index)
            index += 1
        groups.append(entry)
    return {"state": state, "param_groups": groups}, group_map


def local_accumulation(checkpoint: dict[str, Any], names: list[str], own: str | None = None) -> dict[str, Any] | None:
    """An unfinished window's gradients for this stage's parameters ``names``, or None when there is none.

    Each rank saved its own replica's partial sums (replicas reduce them only at the step; LocalSGD replicas never
    do). ``own`` (this rank's ``stage{s}-replica{r}``, on the layout that saved them): its own record. Otherwise
    (another layout) the records of replica 0, by name over its stages, as the weights are replica 0's: the other
    replicas' partial sums are not carried over. Never one replica's sums for every replica's."""
    ranks = checkpoint.get("pipeline", {}).get("ranks", {})
    wanted = {own} if own is not None else {key for key in ranks if replica_of_key(key) == 0}
    records = [r for key, r in ranks.items() if key in wanted]
    windows = [r["accumulation"] for r in records if r.get("accumulation", {}).get("window") is not None]
    if not windows:
        return None
    grads = {n: g for w in windows for n, g in w["grads"].items()}
    out = {"window": windows[0]["window"], "grads": [grads.get(n) for n in names]}
    if "microbatches" in windows[0]:
        out["microbatches"] = windows[0]["microbatches"]
    return out


def _from_index_space(saved: dict[str, Any], names_by_group: list[list[str]]) -> dict[str, Any]:
    groups = saved["param_groups"]
    if [len(g["params"]) for g in groups] != [len(n) for n in names_by_group]:
        raise ValueError(
            f"the checkpoint's optimizer has groups of {[len(g['params']) for g in groups]} parameters, the stages "
            f"of this pipeline together {[len(n) for n in names_by_group]}: configure_optimizers builds other groups "
            "than when it was saved. Load only the weights (Module.load_from_checkpoint) and start a new optimizer."
        )
    out = {}
    for g, (group, names) in enumerate(zip(groups, names_by_group, strict=True)):
        hyper = {k: v for k, v in group.items() if k != "params"}
        for index, name in zip(group["params"], names, strict=True):
            out[name] = (g, hyper, saved["state"].get(index, {}))
    return out


def _check_shapes(name: str, state: dict[str, Any], param: nn.Parameter) -> None:
    for key, value in state.items():
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape != param.shape:
            raise ValueError(
                f"the checkpoint's optimizer state {key!r} for {name} has shape {tuple(value.shape)}, the parameter "
                f"{tuple(param.shape)}: configure_optimizers orders parameters unlike the pipeline's layers. Order "
                "each parameter group by module order, or load only the weights."
            )
