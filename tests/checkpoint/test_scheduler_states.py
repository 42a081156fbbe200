"""Schedulers' states across the checkpoint's merge (stages -> one device's groups) and back (-> a stage's groups).

The per-group entries of a scheduler's state (``base_lrs``, ``_last_lr``, ...) follow the optimizer's groups; a
stage may lack a group (an embedding stage without biases). They used to be recognized by a list's length equal
to the group count, which also caught SequentialLR's ``_milestones`` and ``_schedulers``: with warmup + cosine
and a two-group stage, the file got ``_milestones=[3, None]`` and a one-group stage lost the cosine scheduler (its
learning rate 8x off after one step; a one-device resume of the file raised a TypeError)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

from lit_efficient.checkpoint.merge import _merge_optimizers, _merge_schedulers, regroup_schedulers


def _warmup_cosine(groups: list[dict]) -> tuple[torch.optim.Optimizer, SequentialLR]:
    opt = torch.optim.AdamW(groups)
    warmup = LinearLR(opt, 0.1, 1.0, total_iters=3)
    return opt, SequentialLR(opt, [warmup, CosineAnnealingLR(opt, T_max=10)], milestones=[3])


def _groups(stage: int) -> list[dict]:
    decayed = {"params": [nn.Parameter(torch.ones(2))], "weight_decay": 0.1, "lr": 1e-3}
    if stage == 0:  # the embedding stage: no biases, so no undecayed group
        return [decayed]
    return [decayed, {"params": [nn.Parameter(torch.ones(2))], "weight_decay": 0.0, "lr": 1e-3}]


def _trained(stage: int, steps: int = 5) -> tuple[torch.optim.Optimizer, SequentialLR]:
    opt, scheduler = _warmup_cosine(_groups(stage))
    for _ in range(steps):
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.ones_like(p)
        opt.step()
        scheduler.step()
    return opt, scheduler


def _resumed(groups: list[dict], state: dict, lrs: list[float]) -> SequentialLR:
    """A fresh scheduler given ``state``, its optimizer's learning rates as the optimizer's state restores them."""
    opt, scheduler = _warmup_cosine(groups)
    scheduler.load_state_dict(state)
    for group, lr in zip(opt.param_groups, lrs, strict=True):
        group["lr"] = lr
    return scheduler


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's notes on SequentialLR's and the schedulers' order
def test_sequential_lr_survives_the_merge_and_the_regroup():
    live = {stage: _trained(stage) for stage in (0, 1)}
    shares = []
    for stage, (opt, scheduler) in live.items():
        names = [[f"s{stage}g{g}p{i}" for i in range(len(grp["params"]))] for g, grp in enumerate(opt.param_groups)]
        shares.append({"stage": stage, "replica": 0, "groups": names, "optimizer": opt.state_dict(),
                       "lr_schedulers": [scheduler.state_dict()]})  # fmt: skip
    _, names, slots = _merge_optimizers(shares)
    (merged,) = _merge_schedulers(shares, slots, len(names))
    assert len(names) == 2 and merged["_milestones"] == [3] and len(merged["_schedulers"]) == 2
    assert all(len(sub["base_lrs"]) == 2 for sub in merged["_schedulers"])

    # the embedding stage resumes its one group (merged group slots[(0, 0)]) and steps on as it would have
    (state,) = regroup_schedulers([merged], [slots[(0, 0)]], len(names))
    opt0, live0 = live[0]
    resumed = _resumed(_groups(0), state, [g["lr"] for g in opt0.param_groups])
    live0.step()
    resumed.step()
    assert resumed.get_last_lr() == live0.get_last_lr()

    # one device resumes the file with its two groups (the merged order) and steps as the stages do
    opt1, live1 = live[1]
    one_device = _resumed(_groups(1), merged, [g["lr"] for g in opt1.param_groups])
    live1.step()
    one_device.step()
    assert one_device.get_last_lr() == live1.get_last_lr()
