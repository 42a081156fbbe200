"""A checkpoint that holds more than tensors: the user's own objects in an optimizer's groups, the load's
``weights_only`` as the user asked it, and an ``on_save_checkpoint`` that renames the weights' keys (a user audit).

One process: the merge, the restore and both readers are the processes' own (the audit saw the same on 2 ranks)."""

from __future__ import annotations

import pickle
import warnings

import lightning
import pytest
import torch
from packaging.version import Version

from lit_efficient import PACIStrategy
from lit_efficient.checkpoint.merge import group_key
from lit_efficient.models import GPT
from tests.support.checkpoints import fit_small_gpt

pytestmark = pytest.mark.usefixtures("one_thread")
# fit(..., weights_only=...) is Lightning 2.6's; before it the Trainer's loads were not weights-only.
needs_weights_only = pytest.mark.skipif(Version(lightning.__version__) < Version("2.6"), reason="Lightning < 2.6")


class Tag:
    """A user's marker in a parameter group: a class without a repr of its own (``<Tag object at 0x...>``)."""

    def __init__(self, decay: bool) -> None:
        self.decay = decay


class _Tagged(GPT):
    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.ndim >= 2]
        rest = [p for p in self.parameters() if p.ndim < 2]
        groups = [{"params": decay, "tag": Tag(True)}, {"params": rest, "weight_decay": 0.0, "tag": Tag(False)}]
        return torch.optim.AdamW(groups, lr=1e-2)


class _LayerwiseLR(GPT):
    """A layer-wise learning-rate decay: groups that differ only in their learning rate."""

    def configure_optimizers(self):
        head = [p for n, p in self.named_parameters() if n.startswith(("blocks.1", "head"))]
        rest = [p for n, p in self.named_parameters() if not n.startswith(("blocks.1", "head"))]
        return torch.optim.AdamW([{"params": head, "lr": 1e-2}, {"params": rest, "lr": 5e-3}])


class _SelfReferring:
    def __init__(self) -> None:
        self.me = self


class _Slotted:
    __slots__ = ("decay",)

    def __init__(self, decay: bool) -> None:
        self.decay = decay


class _LegacyKeys(GPT):
    """Keeps its checkpoints in an older key layout: renamed on save, renamed back on load."""

    def on_save_checkpoint(self, checkpoint):
        checkpoint["state_dict"] = {"legacy." + k: v for k, v in checkpoint["state_dict"].items()}

    def on_load_checkpoint(self, checkpoint):
        checkpoint["state_dict"] = {k.removeprefix("legacy."): v for k, v in checkpoint["state_dict"].items()}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)  # no warmup: a step moves the weights by ~1e-2


_fit = fit_small_gpt


def _flush(**kw) -> PACIStrategy:
    return PACIStrategy(pipeline_stages=2, schedule="1f1b_flush", **kw)


def _differ(a: GPT, b: GPT) -> float:
    want = b.state_dict()
    return max((t - want[k]).abs().max().item() for k, t in a.state_dict().items())


def test_groups_holding_a_users_object_merge_by_its_class_and_attributes():
    """Each stage's configure_optimizers made its own Tag, whose default repr holds its address: the stages' groups
    never matched, and the checkpoint had one group per stage (one device then refused it: "a different number of
    parameter groups"; a one-device checkpoint resumed under the pipeline was refused the other way)."""
    assert group_key({"params": [0], "tag": Tag(True)}) == group_key({"params": [1], "tag": Tag(True)})
    assert group_key({"params": [0], "tag": Tag(True)}) != group_key({"params": [1], "tag": Tag(False)})
    assert group_key({"params": [0], "tags": [Tag(True)]}) == group_key({"params": [1], "tags": [Tag(True)]})
    assert group_key({"params": [0], "tag": _Slotted(True)}) != group_key({"params": [1], "tag": _Slotted(False)})
    assert group_key({"params": [0], "tag": _SelfReferring()}) == group_key({"params": [1], "tag": _SelfReferring()})
    # The base learning rate is the scheduler's initial_lr where it set one (a stage's own scheduler moves lr).
    assert group_key({"params": [0], "lr": 1e-3}) != group_key({"params": [1], "lr": 1e-4})
    assert group_key({"params": [0], "lr": 1e-3, "initial_lr": 1e-2}) == group_key(
        {"params": [1], "lr": 2e-3, "initial_lr": 1e-2}
    )


@needs_weights_only
def test_a_checkpoint_with_a_users_object_in_its_groups_resumes_both_ways(tmp_path):
    _fit(_Tagged, "auto", 2, save=tmp_path / "plain.ckpt")
    _fit(_Tagged, _flush(), 2, save=tmp_path / "piped.ckpt")
    groups = torch.load(tmp_path / "piped.ckpt", weights_only=False)["optimizer_states"][0]["param_groups"]
    assert [g["tag"].decay for g in groups] == [True, False]
    want = _fit(_Tagged, "auto", 3, ckpt=tmp_path / "plain.ckpt", weights_only=False)
    for strategy, path in (("auto", tmp_path / "piped.ckpt"), (_flush(), tmp_path / "plain.ckpt")):
        assert _differ(_fit(_Tagged, strategy, 3, ckpt=path, weights_only=False), want) < 1e-6


def test_groups_that_differ_only_in_their_learning_rate_save_as_one_devices(tmp_path):
    """A layer-wise learning-rate decay's groups merged into one (the learning rate was left out of the match, as a
    stage's scheduler moves it): the file held one group at the first group's rate, which one device refused."""
    _fit(_LayerwiseLR, "auto", 2, save=tmp_path / "plain.ckpt")
    _fit(_LayerwiseLR, _flush(), 2, save=tmp_path / "piped.ckpt")
    plain, piped = (
        torch.load(tmp_path / f"{n}.ckpt", weights_only=True)["optimizer_states"][0] for n in ("plain", "piped")
    )
    assert [(g["lr"], len(g["params"])) for g in piped["param_groups"]] == [
        (g["lr"], len(g["params"])) for g in plain["param_groups"]
    ]
    want = _fit(_LayerwiseLR, "auto", 3, ckpt=tmp_path / "plain.ckpt")
    assert _differ(_fit(_LayerwiseLR, "auto", 3, ckpt=tmp_path / "piped.ckpt"), want) < 1e-6


@needs_weights_only
@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_resume_loads_as_weights_only_says(tmp_path, fmt):
    """Lightning restores a strategy that restores after its setup without the fit's weights_only: the load saw None
    and unpickled the user's objects in full even when weights_only=True was asked (plain Lightning refuses)."""
    path = tmp_path / "tagged.ckpt"
    _fit(_Tagged, _flush(checkpoint_format=fmt), 2, save=path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        _fit(_Tagged, _flush(), 3, ckpt=path, weights_only=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*weights_only=True refuses")
        _fit(_Tagged, _flush(), 3, ckpt=path, weights_only=False)
    said = r"holds Python objects that weights_only=True refuses \(tests.checkpoint.test_user_objects.Tag\); loading"
    with pytest.warns(UserWarning, match=said):
        _fit(_Tagged, _flush(), 3, ckpt=path)


@pytest.mark.parametrize("schedule", ["1f1b_flush", "paci"])
def test_renamed_keys_resume_from_a_folder_as_from_a_file(tmp_path, schedule):
    """A rank reads only its own keys from a folder: keys its on_save_checkpoint had renamed were none of them, the
    strict load blamed "another model", and strict_loading=False went on with fresh weights. A process missing keys
    reads every weight, for on_load_checkpoint to rename. The default schedule (PACI) resumes a folder as a file
    too; flush also as one device's own resume."""

    def piped(**kw) -> PACIStrategy:
        return PACIStrategy(pipeline_stages=2, schedule=schedule, **kw)

    for fmt in ("file", "sharded"):
        _fit(_LegacyKeys, piped(checkpoint_format=fmt), 2, save=tmp_path / f"{fmt}.ckpt")
    from_file = _fit(_LegacyKeys, piped(), 3, ckpt=tmp_path / "file.ckpt")
    assert _differ(_fit(_LegacyKeys, piped(), 3, ckpt=tmp_path / "sharded.ckpt"), from_file) == 0
    if schedule == "1f1b_flush":  # a step moves the weights by ~1e-2: fresh weights would be that far off
        _fit(_LegacyKeys, "auto", 2, save=tmp_path / "plain.ckpt")
        assert _differ(from_file, _fit(_LegacyKeys, "auto", 3, ckpt=tmp_path / "plain.ckpt")) < 1e-6
